"""Parameter counts per module and in total, as data and as a table.

Works on real parameters or on the abstract ones of `abstract_params(config)`
(`jax.eval_shape`, nothing allocated), so the base model's 63M parameters can
be counted on any laptop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn.models.architectures import ARCHITECTURES
from jattn.models.config import TransformerConfig
from jattn.models.transformer import Transformer

__all__ = [
    "abstract_params",
    "architecture_counts",
    "architecture_line",
    "count_params",
    "param_counts",
    "summary",
]


def abstract_params(config: TransformerConfig, *, length: int = 8) -> dict[str, Any]:
    """The "params" collection of `Transformer(config)` as `jax.ShapeDtypeStruct`s.

    Uses `jax.eval_shape`, so no parameter is materialised. Logical-axis
    boxes are removed.
    """
    model = Transformer(config)
    tokens = jnp.ones((1, length), jnp.int32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens))
    return nn.unbox(variables["params"])


def architecture_counts(config: TransformerConfig) -> dict[str, int]:
    """Parameter counts of `config` as every registered architecture
    (everything else equal; abstract, nothing allocated).

    A one-stack model has `2 * num_layers` layers (as many as encoder plus
    decoder) and one token embedding, so a decoder-only model differs from
    the encoder–decoder by the cross-attention projections (`4 D^2` a
    decoder layer, plus its norm) and, without `share_embeddings`, by the
    second input embedding; an encoder-only one also by its tape's blank
    vector `[D]`.

    Returns:
      `{architecture: count}` for every name in `ARCHITECTURES` that can run
      the config's scheme (a causal-only scheme: the causal architectures).
    """
    return {
        name: count_params(
            abstract_params(
                config.replace(architecture=name, prefix_lm=False, relative_cross=False)
            )
        )
        for name, arch in ARCHITECTURES.items()
        if arch.causal or not config.scheme.causal_only
    }


def architecture_line(config: TransformerConfig) -> str:
    """One start-up line: this model's count beside the other architectures'
    at the same width, e.g. "parameters: 17,600 (decoder_only, 2 layers;
    at the same width: encoder_decoder 21,984, 1+1 layers; encoder_only
    17,616, 2 layers)"; "shared layers" where one block serves every depth."""
    counts = architecture_counts(config)
    n, shared = config.num_layers, "shared " if config.shared_layers else ""

    def layers(name: str) -> str:
        return ARCHITECTURES[name].layers(n).replace("layer", shared + "layer")

    others = "; ".join(
        f"{name} {counts[name]:,}, {layers(name)}" for name in counts if name != config.architecture
    )
    same_width = f"; at the same width: {others}" if others else ""
    return (
        f"parameters: {counts[config.architecture]:,} ({config.architecture}, "
        f"{layers(config.architecture)}{same_width})"
    )


def _unwrap(params: Mapping[str, Any]) -> Mapping[str, Any]:
    params = nn.unbox(params)
    if isinstance(params, Mapping) and set(params) == {"params"}:
        params = params["params"]
    return params


def count_params(params: Mapping[str, Any]) -> int:
    """Total number of scalars in a parameter tree (arrays or shape structs)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(_unwrap(params)))


def param_counts(params: Mapping[str, Any], max_depth: int | None = None) -> dict[str, int]:
    """Parameter count of every module, keyed by its '/'-joined path.

    Args:
      params: a "params" collection (or a variables dict holding one).
      max_depth: deepest module path to list (1 = top-level modules only);
        None lists every module down to individual parameters.

    Returns:
      `{"total": n, "decoder": ..., "decoder/layer_0": ..., ...}`, in tree order.
    """
    counts: dict[str, int] = {"total": 0}
    for path, leaf in jax.tree_util.tree_flatten_with_path(_unwrap(params))[0]:
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        n = math.prod(leaf.shape)
        counts["total"] += n
        depth = len(names) if max_depth is None else min(max_depth, len(names))
        for d in range(1, depth + 1):
            key = "/".join(names[:d])
            counts[key] = counts.get(key, 0) + n
    return counts


def summary(params_or_config: Mapping[str, Any] | TransformerConfig, max_depth: int = 2) -> str:
    """A text table of parameter counts per module (indented by depth) and the total.

    Args:
      params_or_config: a parameter tree, or a `TransformerConfig` (counted
        abstractly with `abstract_params`).
      max_depth: deepest module level shown.
    """
    params = (
        abstract_params(params_or_config)
        if isinstance(params_or_config, TransformerConfig)
        else params_or_config
    )
    counts = param_counts(params, max_depth=max_depth)
    total = counts["total"]
    rows = [(k, v) for k, v in counts.items() if k != "total"]
    width = max([len("module")] + [2 * k.count("/") + len(k.rsplit("/", 1)[-1]) for k, _ in rows])
    lines = [f"{'module':<{width}}  {'params':>12}  {'share':>6}", "-" * (width + 24)]
    for key, n in rows:
        label = "  " * key.count("/") + key.rsplit("/", 1)[-1]
        lines.append(f"{label:<{width}}  {n:>12,}  {100.0 * n / max(total, 1):>5.1f}%")
    lines.append("-" * (width + 24))
    lines.append(f"{'total':<{width}}  {total:>12,}  {100.0:>5.1f}%")
    return "\n".join(lines)
