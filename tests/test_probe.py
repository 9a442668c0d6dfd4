"""Interventions instead of heatmaps: on a hand-built attention layer, hiding
the only relevant key changes the output and hiding an irrelevant one does
not; the probe utilities on a small Transformer return what they promise."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.analysis import probe
from jattn.models import Transformer, TransformerConfig
from jattn.models.layers import Attention
from jattn.visibility import Visibility

HAND = TransformerConfig(
    vocab_size=8,
    d_model=2,
    num_heads=1,
    num_kv_heads=1,
    num_layers=1,
    d_ff=4,
    dropout_rate=0.0,
    max_len=8,
    position="none",
)


def _hand_params(sharp: float = 10.0):
    """q = k = sharp * x, v = x, o = identity: the query [1, 0] puts weight
    e^(sharp^2/sqrt(2)) : 1 : 1 on keys [1,0], [0,1], [0,-1]."""
    eye = np.eye(2, dtype=np.float32)
    return {
        "q": sharp * eye[:, None, :],
        "k": sharp * eye[:, None, :],
        "v": eye[:, None, :],
        "o": eye[None, :, :],
    }


def _apply(interventions=None, params=None):
    layer = Attention(HAND, cross=True)
    x = jnp.array([[[1.0, 0.0]]])  # one query
    kv = jnp.array([[[1.0, 0.0], [0.0, 1.0], [0.0, -1.0]]])  # three keys
    variables = {"params": params or _hand_params()}
    if interventions:
        variables["interventions"] = interventions
    return np.asarray(
        layer.apply(
            variables,
            x,
            kv,
            visibility=Visibility(
                q_positions=jnp.zeros((1, 1), jnp.int32), kv_positions=jnp.arange(3)[None]
            ),
        )
    )


def test_hiding_the_only_relevant_key_changes_the_output():
    base = _apply()
    np.testing.assert_allclose(base, [[[1.0, 0.0]]], atol=1e-6)  # reads key 0's payload
    hide0 = _apply({"key_visible": jnp.array([[False, True, True]])})
    hide1 = _apply({"key_visible": jnp.array([[True, False, True]])})
    np.testing.assert_allclose(hide0, [[[0.0, 0.0]]], atol=1e-6)  # mean of [0,1] and [0,-1]
    np.testing.assert_allclose(hide1, base, atol=1e-6)  # an irrelevant key: no effect


def test_replacing_payloads_matters_only_where_the_weight_is():
    base = _apply()
    repl = jnp.full((1, 3, 1, 2), 5.0)
    at_relevant = _apply(
        {"value_where": jnp.array([[True, False, False]]), "value_replacement": repl}
    )
    at_irrelevant = _apply(
        {"value_where": jnp.array([[False, True, False]]), "value_replacement": repl}
    )
    np.testing.assert_allclose(at_relevant, [[[5.0, 5.0]]], atol=1e-5)
    np.testing.assert_allclose(at_irrelevant, base, atol=1e-6)


def test_a_large_weight_on_a_zero_payload_has_no_effect():
    """Key 0 takes almost all the weight but carries a zero payload, and the
    other keys' payloads cancel: hiding key 0 changes nothing. A heatmap
    would call key 0 decisive; the intervention says it is not."""
    params = _hand_params()
    params["v"] = np.array([[[0.0, 0.0]], [[0.0, 1.0]]], np.float32)  # v(x) = [0, x_1]
    base = _apply(params=params)
    hidden = _apply({"key_visible": jnp.array([[False, True, True]])}, params=params)
    np.testing.assert_allclose(base, 0.0, atol=1e-6)
    np.testing.assert_allclose(hidden, base, atol=1e-6)  # weight ~1, effect 0


@pytest.fixture(scope="module")
def small():
    cfg = TransformerConfig(
        vocab_size=16,
        d_model=16,
        num_heads=2,
        num_kv_heads=2,
        num_layers=2,
        d_ff=32,
        dropout_rate=0.0,
        max_len=16,
        position="shaw",
        position_options={"shaw": {"max_distance": 4}},
    )
    model = Transformer(cfg)
    inputs = jnp.array([[5, 6, 7, 1, 0], [8, 9, 1, 0, 0]], jnp.int32)
    targets = jnp.array([[3, 4, 1, 0], [6, 1, 0, 0]], jnp.int32)
    params = nn.unbox(model.init(jax.random.key(0), inputs, targets)["params"])
    return model, params, inputs, targets


def test_capture_finds_every_attention_layer(small):
    model, params, inputs, targets = small
    logits, weights = probe.capture(model, params, inputs, targets)
    assert logits.shape == (2, 4, 16)
    kinds = sorted(p[-1] for p in weights)
    assert kinds == ["cross_attention"] * 2 + ["self_attention"] * 4
    for path, w in weights.items():
        s = 5 if path[0] == "encoder" or path[-1] == "cross_attention" else 4
        assert w.shape == (2, 2, 5 if path[0] == "encoder" else 4, s)
        assert np.all(np.asarray(w)[:, :, :, :] >= 0)
    # Padding keys of the source get no weight from real queries.
    cross = np.asarray(weights[("decoder", "layer_0", "cross_attention")])
    assert np.all(cross[1, :, :2, 3:] == 0.0)


def test_head_gate_equals_zeroing_that_heads_output_weights(small):
    model, params, inputs, targets = small
    path = ("decoder", "layer_1", "cross_attention")
    gated = probe.reference_scores(model, params, inputs, targets, probe.ablate_heads(path, 2, [1]))
    edited = jax.tree_util.tree_map(lambda x: x, params)
    o = np.array(edited["decoder"]["layer_1"]["cross_attention"]["o"])
    o[1] = 0.0  # [N, H, D]: head 1 writes nothing
    edited["decoder"]["layer_1"]["cross_attention"]["o"] = jnp.asarray(o)
    direct = probe.reference_scores(model, edited, inputs, targets)
    np.testing.assert_allclose(gated["logprob"], direct["logprob"], rtol=1e-5, atol=1e-5)


def test_source_effects_and_head_table(small):
    model, params, inputs, targets = small
    eff = probe.source_position_effects(model, params, inputs, targets)
    assert eff["weight"].shape == eff["effect"].shape == (2, 5)
    assert np.all(np.isnan(eff["weight"][1, 3:])) and np.all(np.isfinite(eff["weight"][1, :3]))
    np.testing.assert_allclose(np.nansum(eff["weight"], -1), 1.0, rtol=1e-5)
    assert np.all(np.isfinite(eff["effect"][0, :4])) and np.isnan(eff["effect"][0, 4])
    rows = probe.head_ablation_table(model, params, inputs, targets)
    assert len(rows) == 6 * 2
    drops = [r["logprob_drop"] for r in rows]
    assert drops == sorted(drops, reverse=True)
    assert dataclasses.replace(model.config).capture_attention is False  # model untouched


@pytest.mark.parametrize("position", ["shaw", "none"])
def test_source_effects_of_a_decoder_only_model(small, position):
    """Decoder-only: the target side reads the source through the one stack's
    self-attention, so weights and effects are numbers at every real source
    position (NaN only at padding) and the weights are the target rows' share
    on the input columns (at most 1: the rest is on the separator and targets)."""
    _, _, inputs, targets = small
    cfg = TransformerConfig(
        vocab_size=16, d_model=16, num_heads=2, num_kv_heads=2, num_layers=1, d_ff=32,
        dropout_rate=0.0, max_len=16, position=position,
        position_options={"shaw": {"max_distance": 4}},
        architecture="decoder_only",
    )  # fmt: skip
    model = Transformer(cfg)
    params = nn.unbox(model.init(jax.random.key(1), inputs, targets)["params"])
    eff = probe.source_position_effects(model, params, inputs, targets)
    real = np.asarray(inputs) > 0
    assert eff["weight"].shape == eff["effect"].shape == (2, 5)
    assert np.all(np.isfinite(eff["weight"][real])) and np.all(np.isnan(eff["weight"][~real]))
    assert np.all(np.isfinite(eff["effect"][real])) and np.all(np.isnan(eff["effect"][~real]))
    assert np.all(eff["weight"][real] > 0) and np.all(np.nansum(eff["weight"], -1) <= 1 + 1e-6)
    assert np.any(np.abs(eff["effect"][real]) > 1e-6)  # hiding a source token moves the targets


def test_effects_mark_the_eos_position(small):
    model, params, inputs, targets = small
    eff = probe.source_position_effects(model, params, inputs, targets)
    np.testing.assert_array_equal(eff["eos"], np.asarray(inputs) == 1)


def test_labels_are_not_cut_and_the_title_carries_the_correlation():
    long = {"inputs": "996056", "targets": "neunhundertsechsundneunzigtausendsechsundfünfzig"}
    label = probe.example_label(long)
    assert label.replace("\n", "") == "996056 -> " + long["targets"]  # all of it
    wrapped = probe.example_label({"inputs": "x " * 60, "targets": "y " * 60}, width=40)
    assert all(len(line) <= 40 for line in wrapped.split("\n")) and "\n" in wrapped
    title = probe.weight_vs_effect_title(0.2034, 26)
    assert "r = 0.203" in title and "26 real source positions" in title
    assert "r = n/a" in probe.weight_vs_effect_title(float("nan"), 2)
    assert "mean over heads" in probe.WEIGHT_AGGREGATION
    assert "cross-attention" in probe.WEIGHT_AGGREGATION


def test_weight_vs_effect_plot_is_a_png(small, tmp_path):
    model, params, inputs, targets = small
    eff = probe.source_position_effects(model, params, inputs, targets)
    texts = [{"inputs": "567", "targets": "a" * 60}, {"inputs": "89", "targets": "b"}]
    path = tmp_path / "wve.png"
    probe.plot_weight_vs_effect(eff, str(path), texts)  # text dicts become full labels
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_quiet_checkpoint_metadata_drops_only_that_warning(caplog):
    import logging

    absl = logging.getLogger("absl")
    msg = "Metadata file does not exist: /r/checkpoints/3/state/_CHECKPOINT_METADATA"
    with caplog.at_level(logging.INFO, logger="absl"):
        with probe.quiet_checkpoint_metadata():
            absl.warning(msg)
            absl.warning("some other warning")
            absl.error("Metadata file does not exist but this is an error: _CHECKPOINT_METADATA")
        absl.warning(msg)  # outside: back to normal
    got = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert got == [
        ("WARNING", "some other warning"),
        ("ERROR", "Metadata file does not exist but this is an error: _CHECKPOINT_METADATA"),
        ("WARNING", msg),
    ]
    assert not absl.filters
