"""Probing a trained Transformer: capture attention, then intervene.

Attention weights are not explanations: a large weight on a small or
cancelling value may matter less than it looks, and the residual stream can
route around a head. So next to capturing per-layer, per-head weights this
module changes the computation and measures what the output does:

- hide key positions from an attention layer (`hide_keys`),
- ablate heads (`ablate_heads`),

each reported as the change in the log-probability of the reference and in
token accuracy. Interventions travel to the attention layers as the
"interventions" variable collection (see `jattn.models.attention_layer.Attention`),
keyed by module path, e.g. ``("decoder", "layer_1", "cross_attention")``; a
model applied without that collection is untouched.

Shapes: B batch, S source length, T target length, N heads, K kv heads,
H head dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jattn.models import Transformer

Array = jax.Array
Path = tuple[str, ...]

COLLECTION = "interventions"
EOS_ID = 1

__all__ = [
    "ablate_heads",
    "attention_paths",
    "capture",
    "encode_examples",
    "example_label",
    "head_ablation_table",
    "hide_keys",
    "merge",
    "plot_weight_vs_effect",
    "quiet_checkpoint_metadata",
    "reference_scores",
    "source_position_effects",
    "weight_effect_correlation",
    "weight_vs_effect_title",
]


def _nest(path: Path, leaves: dict[str, Array]) -> dict:
    tree: dict = dict(leaves)
    for part in reversed(path):
        tree = {part: tree}
    return tree


def merge(*interventions: dict) -> dict:
    """Deep-merge intervention trees (later ones win on the same leaf)."""
    out: dict = {}
    for tree in interventions:
        for k, v in tree.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def hide_keys(path: Path, visible: Array) -> dict:
    """Make key positions invisible to one attention layer.

    Args:
      path: module path of an attention layer.
      visible: bool `[B, S]`; False hides that key from every query and head.
    """
    return _nest(path, {"key_visible": jnp.asarray(visible, bool)})


def ablate_heads(path: Path, num_heads: int, heads: Sequence[int]) -> dict:
    """Zero the outputs of `heads` of one attention layer (before the output
    projection), so the layer's residual update omits them."""
    gate = np.ones(num_heads, np.float32)
    gate[list(heads)] = 0.0
    return _nest(path, {"head_gate": jnp.asarray(gate)})


def _variables(params, interventions):
    params = params["params"] if isinstance(params, dict) and set(params) == {"params"} else params
    v = {"params": params}
    if interventions:
        v[COLLECTION] = interventions
    return v


def capture(
    model: Transformer,
    params: Any,
    inputs: Array,
    targets: Array,
    interventions: dict | None = None,
) -> tuple[Array, dict[Path, Array]]:
    """Logits and every attention layer's weights.

    Returns:
      `(logits [B, T, V], {path: weights [B, N, T, S]})`, weights float32.
    """
    probe = model.clone(config=dataclasses.replace(model.config, capture_attention=True))
    logits, state = probe.apply(
        _variables(params, interventions), inputs, targets, mutable=["intermediates"]
    )
    flat = jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]
    weights = {}
    for keypath, leaf in flat:
        names = tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in keypath)
        if "attention_weights" in names:
            weights[names[: names.index("attention_weights")]] = leaf
    return logits, weights


def attention_paths(model: Transformer, params: Any, inputs: Array, targets: Array) -> list[Path]:
    """Module paths of every attention layer, in call order (traced abstractly,
    nothing is computed)."""
    shapes = jax.eval_shape(lambda p, i, t: capture(model, p, i, t)[1], params, inputs, targets)
    return list(shapes)


def reference_scores(
    model: Transformer,
    params: Any,
    inputs: Array,
    targets: Array,
    interventions: dict | None = None,
) -> dict[str, Array]:
    """Per example: summed log-probability of the reference targets and token
    accuracy (teacher forcing), over non-padding target tokens.

    Returns:
      ``{"logprob": [B], "accuracy": [B]}``.
    """
    logits = model.apply(_variables(params, interventions), inputs, targets)  # [B, T, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    real = (targets > 0).astype(jnp.float32)  # [B, T]
    tok = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return {
        "logprob": jnp.sum(tok * real, -1),
        "accuracy": jnp.sum(correct * real, -1) / jnp.maximum(jnp.sum(real, -1), 1.0),
    }


def _scores_fn(model):
    return jax.jit(lambda p, i, t, iv: reference_scores(model, p, i, t, iv))


def _source_layers(model: Transformer, weights: dict, inputs: Array, targets: Array):
    """The layers through which target positions read the source, and how to
    read their weights as target-on-source `[B, T, S]`.

    Encoder-decoder: the cross-attention layers, whose weights are already
    `[B, N, T, S]`. One-stream models (decoder-only, encoder-only): every
    self-attention layer of the one stack, whose weights are over the stream
    `[inputs | target side]` (`[B, N, S+T, S+T]`, `jattn.models.decoder_only`,
    `jattn.models.encoder_only`): the target-side queries' rows on the input
    keys' columns.
    """
    s = inputs.shape[1]
    if model.architecture.joined:
        paths = [p for p in weights if p[-1] == "self_attention"]
        return paths, (lambda w: w[:, :, s:, :s]), s + targets.shape[1]
    return [p for p in weights if p[-1] == "cross_attention"], (lambda w: w), s


def source_position_effects(
    model: Transformer, params: Any, inputs: Array, targets: Array
) -> dict[str, np.ndarray]:
    """Attention weight of the target positions on each source position
    against the effect of hiding that position from every layer they read it
    through.

    Encoder-decoder: the cross-attention layers (the encoder still sees the
    hidden position). Decoder-only: every self-attention layer, from every
    query (so the later input tokens do not see it either: the stack has no
    separate encoder to leave it to). The S hidings share one compiled
    function (the same intervention tree, only the visibility changes).

    Returns:
      ``weight [B, S]``: mean over layers, heads and real target tokens of the
      weight target positions give the source position; ``effect [B, S]``:
      drop in the reference log-probability when the position is hidden;
      ``base [B]``: the unperturbed log-probability. Padding source positions
      get NaN. ``eos [B, S]``: True at the end-of-sequence token of each source.
    """
    _, weights = capture(model, params, inputs, targets)
    layers, on_source, key_len = _source_layers(model, weights, inputs, targets)
    if not layers:
        raise ValueError("source_position_effects: the model has no layer that reads the source")
    real_t = np.asarray(targets > 0, np.float32)  # [B, T]
    w = np.mean([np.asarray(on_source(weights[p])).mean(1) for p in layers], axis=0)  # [B, T, S]
    weight = (w * real_t[..., None]).sum(1) / np.maximum(real_t.sum(1, keepdims=True), 1)
    score = _scores_fn(model)
    base = np.asarray(score(params, inputs, targets, None)["logprob"])
    b, s = inputs.shape
    effect = np.full((b, s), np.nan)
    for pos in range(s):
        visible = np.ones((b, key_len), bool)
        visible[:, pos] = False
        iv = merge(*[hide_keys(p, visible) for p in layers])
        hidden = np.asarray(score(params, inputs, targets, iv)["logprob"])
        effect[:, pos] = base - hidden
    real_s = np.asarray(inputs > 0)
    weight = np.where(real_s, weight, np.nan)
    effect = np.where(real_s, effect, np.nan)
    eos = np.asarray(inputs) == EOS_ID
    return {"weight": weight, "effect": effect, "base": base, "eos": eos}


def head_ablation_table(
    model: Transformer, params: Any, inputs: Array, targets: Array
) -> list[dict[str, Any]]:
    """Ablate each head of each attention layer alone; rows sorted by cost
    (largest drop in mean reference log-probability first).

    Every layer carries a head gate in every call (all ones but the ablated
    head's zero), so all ablations share one compiled function."""
    paths = attention_paths(model, params, inputs, targets)
    score = _scores_fn(model)
    base = jax.device_get(score(params, inputs, targets, None))
    n = model.config.num_heads
    ones = jnp.ones(n, jnp.float32)
    rows = []
    for path in paths:
        for head in range(n):
            gates = [_nest(p, {"head_gate": ones}) for p in paths if p != path]
            iv = merge(*gates, ablate_heads(path, n, [head]))
            s = jax.device_get(score(params, inputs, targets, iv))
            rows.append(
                {
                    "layer": "/".join(path),
                    "head": head,
                    "logprob_drop": float(np.mean(base["logprob"] - s["logprob"])),
                    "accuracy_drop": float(np.mean(base["accuracy"] - s["accuracy"])),
                }
            )
    rows.sort(key=lambda r: -r["logprob_drop"])
    return rows


WEIGHT_AGGREGATION = (
    "x: cross-attention weight on the source position, mean over heads, over the "
    "cross-attention layers of every decoder layer, and over the real target tokens"
)
EFFECT_DESCRIPTION = (
    "y: drop in log p(reference) when the position is hidden from every "
    "cross-attention layer (teacher-forced)"
)


def example_label(text: dict, width: int = 70) -> str:
    """A legend label for one example, ``inputs -> targets`` in full (wrapped
    at `width` characters, never cut)."""
    import textwrap  # noqa: PLC0415

    line = f"{text['inputs']} -> {text['targets']}"
    return "\n".join(textwrap.wrap(line, width, break_long_words=True)) or line


def weight_vs_effect_title(correlation: float, count: int) -> str:
    """The plot's title: what it shows and the Pearson correlation over the
    real source positions."""
    r = "n/a" if not np.isfinite(correlation) else f"{correlation:.3f}"
    return (
        f"Attention weight vs. intervention effect per source position\n"
        f"Pearson r = {r} over {count} real source positions"
    )


def plot_weight_vs_effect(effects: dict[str, np.ndarray], path: str, labels=None, eos=None) -> None:
    """Scatter of attention weight (x) against intervention effect (y) per
    source position, one colour per example; the end-of-sequence positions
    (`eos`, bool `[B, S]`, or ``effects["eos"]``) drawn as stars. The title
    carries the correlation, the axes say how the weights are aggregated.
    Labels are shown in full (long ones wrapped); an example's text dict
    ``{"inputs", "targets"}`` as a label becomes `example_label` of it."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    eos = effects.get("eos") if eos is None else eos
    weight, effect = effects["weight"], effects["effect"]
    count = int(np.sum(np.isfinite(weight) & np.isfinite(effect)))
    fig, ax = plt.subplots(figsize=(9, 6.5))
    cmap = plt.get_cmap("tab10")
    for i in range(weight.shape[0]):
        ok = np.isfinite(weight[i])
        is_eos = np.zeros_like(ok) if eos is None else np.asarray(eos[i], bool)
        label = labels[i] if labels else f"example {i}"
        label = example_label(label) if isinstance(label, dict) else label
        plain = ok & ~is_eos
        ax.scatter(weight[i][plain], effect[i][plain], color=cmap(i % 10), label=label, s=30)
        if np.any(ok & is_eos):
            ax.scatter(
                weight[i][ok & is_eos],
                effect[i][ok & is_eos],
                color=cmap(i % 10),
                marker="*",
                s=160,
                edgecolors="black",
                linewidths=0.8,
            )
    if eos is not None and np.any(np.asarray(eos, bool)):
        ax.scatter([], [], marker="*", s=160, color="white", edgecolors="black", label="EOS token")
    ax.axhline(0.0, color="0.6", linewidth=0.8)
    import textwrap  # noqa: PLC0415

    ax.set_xlabel(textwrap.fill(WEIGHT_AGGREGATION, 80), fontsize=9)
    ax.set_ylabel("drop in log p(reference) when the position is hidden", fontsize=9)
    ax.set_title(weight_vs_effect_title(weight_effect_correlation(effects), count), fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.grid(alpha=0.3)
    fig.text(0.01, 0.01, EFFECT_DESCRIPTION, fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def weight_effect_correlation(effects: dict[str, np.ndarray]) -> float:
    """Pearson correlation of attention weight and hiding effect over the real
    source positions of `source_position_effects` (NaN with fewer than 3, or
    when either is constant)."""
    w, e = effects["weight"].ravel(), effects["effect"].ravel()
    ok = np.isfinite(w) & np.isfinite(e)
    if ok.sum() < 3 or np.std(w[ok]) == 0 or np.std(e[ok]) == 0:
        return float("nan")
    return float(np.corrcoef(w[ok], e[ok])[0, 1])


def encode_examples(task, split: str, count: int) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """`(inputs [n, S], targets [n, T], texts)`: the first `count` examples of
    `split` of a `jattn.data` task, tokenized and padded with 0."""
    src = task.source(split)
    texts = [src[i] for i in range(min(count, len(src)))]
    ins = [task.tokenizer.encode(t["inputs"]) for t in texts]
    outs = [task.tokenizer.encode(t["targets"]) for t in texts]

    def pad(rows):
        width = max(len(r) for r in rows)
        return np.array([r + [0] * (width - len(r)) for r in rows], np.int32)

    return pad(ins), pad(outs), texts


class _DropCheckpointMetadataWarning(logging.Filter):
    """Drops orbax's "Metadata file does not exist: .../_CHECKPOINT_METADATA"
    warning (checkpoints written without that file restore fine); nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        msg = record.getMessage()
        return not ("Metadata file does not exist" in msg and "_CHECKPOINT_METADATA" in msg)


@contextlib.contextmanager
def quiet_checkpoint_metadata():
    """Around a checkpoint restore (``with quiet_checkpoint_metadata(): load_run(...)``):
    silences only orbax's missing-_CHECKPOINT_METADATA warning on the absl
    logger; every other record, errors included, still gets through."""
    flt = _DropCheckpointMetadataWarning()
    logger = logging.getLogger("absl")  # absl.logging's records go to this one
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def unbox(params: Any) -> Any:
    """Strip flax partitioning metadata (restored checkpoints may carry it)."""
    return nn.unbox(params)
