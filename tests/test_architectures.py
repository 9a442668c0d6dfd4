"""Tests of the architecture registry (`jattn.models.ARCHITECTURES`), the
encoder-only model with its output tape (Delétang et al. 2023) and
`shared_layers` (Dehghani et al. 2019), all built from the registry:

- `Transformer(config)` builds the registered model of every architecture,
  an unknown name is a one-line error listing the registered ones, and a
  method an architecture lacks is a one-line error naming it;
- the encoder-only model's tape logits equal those of a stream assembled
  by hand (tokens, blank cells, segments and positions written out); the
  tape's values never enter; attention is bidirectional (an input after a
  cell changes it) and packed rows equal unpacked ones, forward and in the
  parameter gradient; decoding is the tape's argmax;
- with `shared_layers` every architecture has one block's parameters, its
  depth still applies the block `num_layers` (or `2 * num_layers`) times,
  and cached decoding equals full recomputation (one cache per depth).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.models import (
    ARCHITECTURES,
    SCHEMES,
    Encoder,
    EncoderOnly,
    Transformer,
    TransformerConfig,
    count_params,
    decoding,
)
from jattn.models.blocks import vocab_logits
from jattn.models.layers import Embed

TINY = dict(
    vocab_size=13,
    d_model=16,
    num_heads=4,
    num_kv_heads=2,
    num_layers=1,
    d_ff=32,
    max_len=32,
    attention_impl="xla",
    position="sinusoidal",
)


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(**{**TINY, **kw})


def _init(model, inputs, targets):
    return model.init(jax.random.key(0), inputs, targets)["params"]


INPUTS = jnp.array([[3, 4, 1, 0], [5, 6, 7, 1]], jnp.int32)  # [B, S]: n = 3 and 4
TARGETS = jnp.array([[8, 9, 1], [10, 1, 0]], jnp.int32)  # [B, T]: m = 3 and 2


# -- the registry -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_transformer_builds_the_registered_model(name):
    arch = ARCHITECTURES[name]
    model = Transformer(_config(architecture=name))
    assert type(model) is arch.model and isinstance(model, Transformer)
    assert model.architecture is arch and arch.name == name
    assert type(model.clone(use_cache=True)) is arch.model
    logits = model.apply({"params": _init(model, INPUTS, TARGETS)}, INPUTS, TARGETS)
    assert logits.shape == (2, 3, TINY["vocab_size"]) and logits.dtype == jnp.float32


def test_unknown_architecture_lists_the_registered_ones():
    with pytest.raises(ValueError, match="choose one of") as e:
        _config(architecture="mixture")
    assert all(name in str(e.value) for name in ARCHITECTURES)
    assert "\n" not in str(e.value)


def test_a_subclass_refuses_another_architectures_config():
    with pytest.raises(ValueError, match="build it with Transformer"):
        _init(EncoderOnly(_config()), INPUTS, TARGETS)


@pytest.mark.parametrize(
    "name,method,args",
    [
        ("encoder_only", "encode", (INPUTS,)),
        ("encoder_only", "step", (INPUTS, INPUTS[:, :1])),
        ("decoder_only", "prefill", (jnp.zeros((2, 4, 16)),)),
        ("encoder_decoder", "prefill_prompt", (INPUTS,)),
    ],
)
def test_a_method_an_architecture_lacks_is_a_one_line_error(name, method, args):
    model = Transformer(_config(architecture=name))
    params = _init(model, INPUTS, TARGETS)
    with pytest.raises(ValueError, match=f"not a method of the {name} model"):
        model.apply({"params": params}, *args, method=method)


def test_architecture_properties_drive_the_config_checks():
    with pytest.raises(ValueError, match="prefix_lm=True needs architecture in"):
        _config(architecture="encoder_only", prefix_lm=True)
    with pytest.raises(ValueError, match="needs cross-attention; the .encoder_only. model"):
        _config(architecture="encoder_only", position="t5", relative_cross=True)
    with pytest.raises(ValueError, match="shared_layers must be a bool"):
        _config(shared_layers=1)


# -- the encoder-only model -----------------------------------------------------------


class HandStream(nn.Module):
    """The encoder-only model's stack and output layer on a stream given by hand."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens, tape, segment_ids, positions):
        cfg = self.config
        embed = Embed(cfg, name="embed")
        encoder = Encoder(cfg, embed=embed, name="encoder")
        x = encoder(tokens, segment_ids=segment_ids, positions=positions, tape=tape)
        return vocab_logits(cfg, embed, x)  # [B, S+T, V]


@pytest.mark.parametrize("position", ["sinusoidal", "t5", "rope"])
def test_tape_logits_equal_a_hand_assembled_stream(position):
    cfg = _config(architecture="encoder_only", position=position, share_embeddings=False)
    model = Transformer(cfg)
    params = _init(model, INPUTS, TARGETS)
    got = model.apply({"params": params}, INPUTS, TARGETS)  # [B, T, V]
    # Row 0: inputs 3 4 1 at 0..2, a padded slot, then the tape: the separator
    # (token 0) at position 3 and two blank cells at 4, 5.
    # Row 1: inputs 5 6 7 1 at 0..3, the separator at 4, one blank at 5, a padded cell.
    tokens = jnp.array([[3, 4, 1, 0, 0, 0, 0], [5, 6, 7, 1, 0, 0, 0]])
    tape = jnp.array([[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1, 0]], bool)
    segments = jnp.array([[1, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
    positions = jnp.array([[0, 1, 2, 0, 3, 4, 5], [0, 1, 2, 3, 4, 5, 0]])
    hand = HandStream(cfg).apply({"params": params}, tokens, tape, segments, positions)
    real = np.array([[1, 1, 1], [1, 1, 0]], bool)
    np.testing.assert_allclose(
        np.asarray(got)[real], np.asarray(hand[:, 4:])[real], rtol=1e-6, atol=1e-6
    )


def test_the_tape_never_reads_target_values_and_sees_every_input():
    cfg = _config(architecture="encoder_only")
    model = Transformer(cfg)
    params = _init(model, INPUTS, TARGETS)
    base = model.apply({"params": params}, INPUTS, TARGETS)
    other_values = jnp.where(TARGETS > 0, 7, 0)  # same cells, other tokens
    np.testing.assert_array_equal(base, model.apply({"params": params}, INPUTS, other_values))
    later = INPUTS.at[1, 3].set(9)  # the last input token of row 1
    moved = model.apply({"params": params}, later, TARGETS)
    # Bidirectional: every cell of row 1 sees it (the first cell precedes it in no
    # order that matters); row 0 is untouched.
    assert np.all(np.abs(np.asarray(moved - base)[1, :2]).max(-1) > 1e-6)
    np.testing.assert_array_equal(moved[0], base[0])


def test_encoder_only_packed_rows_equal_unpacked_forward_and_gradient():
    cfg = _config(architecture="encoder_only", position="t5")
    model = Transformer(cfg)
    params = _init(model, INPUTS, TARGETS)
    # Example 0: inputs 3 4 1, targets 8 9 1. Example 1: inputs 5 6 7 1, targets 10 1.
    p_in = jnp.array([[3, 4, 1, 5, 6, 7, 1, 0]])
    p_in_seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    p_in_pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]])
    p_tg = jnp.array([[8, 9, 1, 10, 1, 0]])
    p_tg_seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    p_tg_pos = jnp.array([[0, 1, 2, 0, 1, 0]])

    def packed_loss(p):
        logits = model.apply(
            {"params": p},
            p_in,
            p_tg,
            inputs_segment_ids=p_in_seg,
            targets_segment_ids=p_tg_seg,
            inputs_positions=p_in_pos,
            targets_positions=p_tg_pos,
        )
        return jnp.sum(logits[0, :5] ** 2), logits

    def unpacked_loss(p):
        logits = model.apply({"params": p}, INPUTS, TARGETS)
        return jnp.sum(logits[0, :3] ** 2) + jnp.sum(logits[1, :2] ** 2), logits

    (lp, packed), gp = jax.value_and_grad(packed_loss, has_aux=True)(params)
    (lu, unpacked), gu = jax.value_and_grad(unpacked_loss, has_aux=True)(params)
    np.testing.assert_allclose(packed[0, :3], unpacked[0, :3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[0, 3:5], unpacked[1, :2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lp, lu, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gu), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_encoder_only_decoding_is_the_tape_argmax():
    cfg = _config(architecture="encoder_only")
    model = Transformer(cfg)
    params = _init(model, INPUTS, TARGETS)
    lengths = jnp.array([3, 2])
    got = decoding.greedy(model, params, INPUTS, max_length=4, tape_lengths=lengths)
    cells = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    want = np.asarray(jnp.argmax(model.apply({"params": params}, INPUTS, cells), -1) * cells)
    for row in want:  # 0 after the first EOS
        hits = np.flatnonzero(row == decoding.EOS)
        if hits.size:
            row[hits[0] + 1 :] = 0
    np.testing.assert_array_equal(got, want)
    beams = decoding.beam_search(model, params, INPUTS, max_length=4, tape_lengths=lengths)
    np.testing.assert_array_equal(beams, got)
    with pytest.raises(ValueError, match="tape_lengths must be int"):
        decoding.greedy(model, params, INPUTS, max_length=4, tape_lengths=jnp.ones(3, jnp.int32))


# -- shared layers ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_shared_layers_have_one_blocks_parameters(name):
    deep = dict(architecture=name, num_layers=3)
    plain = Transformer(_config(**deep))
    shared = Transformer(_config(**deep, shared_layers=True))
    p_plain, p_shared = _init(plain, INPUTS, TARGETS), _init(shared, INPUTS, TARGETS)
    for stack in p_shared:
        if stack == "embed":
            continue
        blocks = [k for k in p_shared[stack] if "layer" in k]
        assert blocks == ["shared_layer"], (stack, sorted(p_shared[stack]))
        depth = len([k for k in p_plain[stack] if k.startswith("layer_")])
        assert depth == {"n+n": 3, "n": 3, "2n": 6}[ARCHITECTURES[name].stacks]
        one_block = count_params(p_shared[stack]["shared_layer"])
        assert count_params(p_plain[stack]) - count_params(p_shared[stack]) == (
            (depth - 1) * one_block
        )
        # The shared block is applied at every depth: copying it into every layer
        # of the unshared model gives the same function.
        for i in range(depth):
            p_plain[stack][f"layer_{i}"] = p_shared[stack]["shared_layer"]
        for k in p_shared[stack]:
            if "layer" not in k:
                p_plain[stack][k] = p_shared[stack][k]
    p_plain["embed"] = p_shared["embed"]
    np.testing.assert_allclose(
        plain.apply({"params": p_plain}, INPUTS, TARGETS),
        shared.apply({"params": p_shared}, INPUTS, TARGETS),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize(
    "name", [n for n in sorted(ARCHITECTURES) if ARCHITECTURES[n].autoregressive]
)
def test_shared_layers_cached_decoding_equals_full_recomputation(name):
    model = Transformer(_config(architecture=name, num_layers=2, shared_layers=True))
    params = _init(model, INPUTS, TARGETS)
    tokens = decoding.greedy(model, params, INPUTS, max_length=5)  # [B, 5]
    # Full recomputation: the teacher-forced argmax over the decoded tokens, every slot real.
    logits = model.apply(
        {"params": params},
        INPUTS,
        tokens,
        inputs_segment_ids=(INPUTS != 0).astype(jnp.int32),
        targets_segment_ids=jnp.ones_like(tokens),
    )
    full = np.asarray(jnp.argmax(logits, -1))
    got = np.asarray(tokens)
    for b in range(got.shape[0]):
        stop = np.flatnonzero(got[b] == decoding.EOS)
        end = stop[0] + 1 if stop.size else got.shape[1]
        np.testing.assert_array_equal(got[b, :end], full[b, :end])


def test_dropout_draws_differ_between_the_depths_of_a_shared_block():
    """One block applied at two depths draws a dropout mask at each: the
    zeros its residual dropout leaves (the mask) differ between depths."""
    cfg = _config(architecture="encoder_only", shared_layers=True, dropout_rate=0.5, num_layers=2)
    model = Transformer(cfg)
    params = _init(model, INPUTS, TARGETS)
    _, state = model.apply(
        {"params": params},
        INPUTS,
        TARGETS,
        train=True,
        rngs={"dropout": jax.random.key(1)},
        capture_intermediates=True,
        mutable=["intermediates"],
    )
    outs = state["intermediates"]["encoder"]["shared_layer"]["Dropout_0"]["__call__"]
    assert len(outs) == cfg.num_layers == 2  # one application a depth
    zeros = [np.asarray(o) == 0 for o in outs]  # [B, L, D] each: the dropped units
    assert 0.3 < zeros[0].mean() < 0.7
    assert (zeros[0] != zeros[1]).mean() > 0.2


# -- every registered scheme in the encoder-only model ---------------------------------

ENCODER_SCHEMES = sorted(n for n, s in SCHEMES.items() if not s.causal_only)


@pytest.mark.parametrize("position", ENCODER_SCHEMES)
def test_every_scheme_encoder_only_packed_equals_unpacked_and_shift(position):
    """Built from the registry: a scheme added later is covered with no edit."""
    shaw = {"shaw": {"max_distance": 2}}
    cfg = _config(architecture="encoder_only", position=position, position_options=shaw)
    model = Transformer(cfg)
    params = _init(model, INPUTS, TARGETS)
    p_in = jnp.array([[3, 4, 1, 5, 6, 7, 1, 0]])
    p_tg = jnp.array([[8, 9, 1, 10, 1, 0]])
    packed = model.apply(
        {"params": params},
        p_in,
        p_tg,
        inputs_segment_ids=jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]]),
        targets_segment_ids=jnp.array([[1, 1, 1, 2, 2, 0]]),
        inputs_positions=jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]]),
        targets_positions=jnp.array([[0, 1, 2, 0, 1, 0]]),
    )
    unpacked = model.apply({"params": params}, INPUTS, TARGETS)
    np.testing.assert_allclose(packed[0, :3], unpacked[0, :3], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(packed[0, 3:5], unpacked[1, :2], rtol=2e-5, atol=2e-5)
    if SCHEMES[position].shift_invariant:
        shifted = model.apply(
            {"params": params},
            INPUTS,
            TARGETS,
            inputs_segment_ids=(INPUTS != 0).astype(jnp.int32),
            targets_segment_ids=(TARGETS != 0).astype(jnp.int32),
            inputs_positions=jnp.broadcast_to(jnp.arange(4) + 5, (2, 4)),
            # tape positions count on from the last input's: they shift with them
            targets_positions=jnp.broadcast_to(jnp.arange(3), (2, 3)),
        )
        real = np.asarray(TARGETS > 0)
        np.testing.assert_allclose(
            np.asarray(shifted)[real], np.asarray(unpacked)[real], rtol=2e-5, atol=2e-5
        )
