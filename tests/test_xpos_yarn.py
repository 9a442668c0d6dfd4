"""xPos at any position, and YaRN in both conventions.

xPos: queries and keys measured from a per-row reference give the logits of
the formula (a float64 reference written in `n - m` alone) at positions near
10^6 in float32, where the absolute form is not even finite; the reference
is the row's centre; the widest rows `xpos_max_span` promises stay exact; a
causal attention layer decoding from its KV cache at 10^6 equals its full
pass, and both equal the same layer at small positions; configs whose rows
can be wider are refused.

YaRN: the "hf" convention against Hugging Face's recipe written out here in
float64 numpy (correction dimensions rounded outwards, a ramp linear in the
pair index, the attention factor with mscale / mscale_all_dim), the "paper"
one against Peng et al.'s ramp in r = L / λ; where the two differ; and the
config fields reach the rotation.

Shapes: B batch, T queries, S keys, N heads, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import positions as pos_lib
from jattn.models import SCHEMES, TransformerConfig
from jattn.models.layer_call import LayerCall
from jattn.models.layers import Attention
from jattn.models.schemes import Site
from jattn.visibility import Visibility

TINY = dict(
    vocab_size=13,
    d_model=16,
    num_heads=4,
    num_kv_heads=2,
    num_layers=1,
    d_ff=32,
    dropout_rate=0.0,
    max_len=32,
    attention_impl="xla",
)

# -- xPos ---------------------------------------------------------------------------------


def _xpos_logits64(q, k, q_pos, kv_pos, scale_base=512.0, base=10_000.0):
    """xPos logits `[B, N, T, S]` in float64 from the formula, in `d = n - m` only:
    per pair i, `zeta_i^(d/scale_base) [(q1 k1 + q2 k2) cos(d θ_i) + (q1 k2 - q2 k1)
    sin(d θ_i)]` (rotate-half pairs `(i, i + H/2)`), which is `R(nθ)q · R(mθ)k`
    with the decays `zeta^(n/γ)`, `zeta^(-m/γ)` multiplied in; and the sum of
    the terms' sizes, the scale float32's rounding is relative to."""
    h = q.shape[-1]
    half = h // 2
    i = np.arange(half) * 2.0 / h
    theta, zeta = base**-i, (i + 0.4) / 1.4  # [H/2]
    d = (q_pos[:, :, None] - kv_pos[:, None, :]).astype(np.float64)  # [B, T, S]
    ang = d[..., None] * theta  # [B, T, S, H/2]
    decay = zeta ** (d[..., None] / scale_base)
    q1, q2, k1, k2 = q[..., :half], q[..., half:], k[..., :half], k[..., half:]
    same = np.einsum("BTNi,BSNi->BNTSi", q1, k1) + np.einsum("BTNi,BSNi->BNTSi", q2, k2)
    cross = np.einsum("BTNi,BSNi->BNTSi", q1, k2) - np.einsum("BTNi,BSNi->BNTSi", q2, k1)
    terms = same * np.cos(ang)[:, None] + cross * np.sin(ang)[:, None]
    size = (np.abs(same) + np.abs(cross)) * decay[:, None]
    return np.sum(terms * decay[:, None], axis=-1), np.sum(size, axis=-1)  # [B, N, T, S] each


def _xpos_logits32(q, k, q_pos, kv_pos, reference):
    """The logits of jattn's xpos in float32 (None: the paper's absolute form)."""
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    qx = pos_lib.xpos(f(q), jnp.asarray(q_pos), key=False, reference=reference)
    kx = pos_lib.xpos(f(k), jnp.asarray(kv_pos), key=True, reference=reference)
    return np.asarray(jnp.einsum("BTNH,BSNH->BNTS", qx, kx), np.float64)


def test_xpos_at_a_million_positions_equals_the_float64_formula():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 6, 2, 16)), rng.normal(size=(2, 7, 2, 16))
    offsets = np.array([[1_000_000], [3_000_017]])  # far past the absolute form's ~36k
    q_pos = offsets + np.sort(rng.choice(400, (2, 6)), axis=1)  # [B, T]
    kv_pos = offsets + np.sort(rng.choice(400, (2, 7)), axis=1)  # [B, S], both directions
    want, _ = _xpos_logits64(q, k, q_pos, kv_pos)
    ref = pos_lib.xpos_reference(jnp.asarray(q_pos), jnp.asarray(kv_pos))
    got = _xpos_logits32(q, k, q_pos, kv_pos, ref)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # The same logits at small positions (the formula is shift invariant), and
    # the absolute form, which this replaces, is not finite here.
    small = _xpos_logits32(q, k, q_pos - offsets, kv_pos - offsets, None)
    np.testing.assert_allclose(got, small, rtol=1e-4, atol=1e-4)
    with jax.debug_nans(False), jax.debug_infs(False):
        assert not np.isfinite(_xpos_logits32(q, k, q_pos, kv_pos, None)).all()


def test_xpos_rows_as_wide_as_max_span_stay_exact():
    """A row of `xpos_max_span` positions at 10^6: every logit, the far key
    ahead (e^80 times its terms) as the far key behind (e^-80), equals the
    float64 formula to float32 rounding (of angles up to span / 2 radians,
    relative to the size of the logit's terms)."""
    span = pos_lib.xpos_max_span()
    assert span == 32_695  # 80 * 512 / ln(1.4 / 0.4)
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(1, 6, 2, 8)), rng.normal(size=(1, 6, 2, 8))
    pos = 1_000_000 + np.array([[0, 1, span // 2, span - 300, span - 1, span]])
    want, size = _xpos_logits64(q, k, pos, pos)  # [1, N, T, S]
    got = _xpos_logits32(q, k, pos, pos, pos_lib.xpos_reference(jnp.asarray(pos)))
    assert np.isfinite(got).all() and size.max() > 1e33  # the far key ahead: ~e^80
    assert np.all(np.abs(got - want) <= 1e-3 * size)


def test_xpos_reference_is_the_rows_centre():
    q = jnp.array([[3, 9], [1_000_000, 1_000_004]])
    kv = jnp.array([[0, 5, 7], [1_000_001, 1_000_002, 1_000_003]])
    ref = np.asarray(pos_lib.xpos_reference(q, kv))
    assert ref.shape == (2, 1) and ref.dtype == np.int32
    np.testing.assert_array_equal(ref[:, 0], [4, 1_000_002])  # (0 + 9) // 2, (10^6 + 10^6 + 4) / 2
    np.testing.assert_array_equal(pos_lib.xpos_reference(q)[:, 0], [6, 1_000_002])


def _xpos_layer():
    cfg = TransformerConfig(**TINY, position="xpos")
    return Attention(cfg, causal=True, decode=True)


@jax.jit
def _full_and_cached(params, x, pos, cache):
    """The causal xPos layer's full pass over `x` `[B, T, D]` at positions `pos`
    `[B, T]`, and its decode from a zero cache one token a step, the slots at
    `pos` (`cache_positions`, as decoder-only decoding and random positions
    give them)."""
    layer = _xpos_layer()
    full = layer.apply({"params": params}, x, x, visibility=Visibility.of_sequence(positions=pos))

    def step(cache, t):
        xt = jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1)  # [B, 1, D]
        pt = jax.lax.dynamic_slice_in_dim(pos, t, 1, axis=1)  # [B, 1]
        out, mutated = layer.apply(
            {"params": params, "cache": cache},
            xt,
            xt,
            call=LayerCall(mode="step", cache_index=t),
            visibility=Visibility(q_positions=pt, kv_positions=pos),  # the keys: the slots
            mutable=["cache"],
        )
        return mutated["cache"], out[:, 0]

    _, steps = jax.lax.scan(step, cache, jnp.arange(x.shape[1]))  # [T, B, D]
    return full, steps.transpose(1, 0, 2)


def test_xpos_layer_decodes_from_its_cache_at_a_million_as_its_full_pass():
    """The cached keys were scaled with the reference of the cache's slots
    (fixed for the decode) and each step's query with the same one; the full
    pass takes its own. Both give the layer's output at small positions."""
    rng = np.random.default_rng(2)
    b, t = 2, 6
    x = jnp.asarray(rng.normal(size=(b, t, TINY["d_model"])), jnp.float32)
    small = np.sort(rng.choice(30, (b, t), replace=False), axis=1).astype(np.int32)
    large = small + np.array([[1_000_000], [2_500_000]], np.int32)
    variables = _xpos_layer().init(
        jax.random.key(0), x, x, visibility=Visibility.of_sequence(positions=jnp.asarray(small))
    )
    params, cache = variables["params"], variables["cache"]
    full_small, cached_small = map(np.asarray, _full_and_cached(params, x, small, cache))
    full_large, cached_large = map(np.asarray, _full_and_cached(params, x, large, cache))
    assert np.isfinite(full_large).all() and np.isfinite(cached_large).all()
    np.testing.assert_allclose(cached_small, full_small, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cached_large, full_large, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(full_large, full_small, rtol=1e-4, atol=1e-4)


def test_xpos_config_refuses_rows_wider_than_float32_holds():
    span = pos_lib.xpos_max_span()
    TransformerConfig(**TINY, position="xpos", random_positions=span)
    bad = r"at most 32695 .*random_positions\)=32696; raise position_options.xpos.scale_base"
    with pytest.raises(ValueError, match=bad):
        TransformerConfig(**TINY, position="xpos", random_positions=span + 1)
    with pytest.raises(ValueError, match="max_len, random_positions\\)=40000"):
        TransformerConfig(**{**TINY, "max_len": 40_000}, position="xpos")
    wider = {"xpos": {"scale_base": 1024.0}}
    TransformerConfig(**TINY, position="xpos", random_positions=60_000, position_options=wider)


# -- YaRN ---------------------------------------------------------------------------------


def _hf_yarn64(rot, base, length, s, beta_fast=32.0, beta_slow=1.0, mscale=0.0, all_dim=0.0):
    """Hugging Face transformers' YaRN (`_compute_yarn_parameters`), written out
    in float64: the correction dimension of `n` rotations is the pair index
    where a pair turns n times over `length`; the ramp runs linearly in the
    pair index from floor(dim(beta_fast)) to ceil(dim(beta_slow)) (clamped to
    [0, rot - 1], widened by 0.001 when empty); interpolation where the ramp
    is 1, extrapolation where it is 0."""

    def dim(turns):
        return rot * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim(beta_fast)), 0)
    high = min(math.ceil(dim(beta_slow)), rot - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rot // 2) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 / base ** (np.arange(0, rot, 2) / rot)
    interpolation = extrapolation / s
    extrapolation_factor = 1.0 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor

    def m(c):
        return 1.0 if s <= 1 else 0.1 * c * math.log(s) + 1.0

    factor = m(mscale) / m(all_dim) if mscale and all_dim else m(1.0)
    return inv_freq, factor


HF_CASES = {
    "rot64 L2048 s4": dict(rot=64, base=10_000.0, length=2048, s=4.0),
    "rot128 base5e5 L8192 s8 mscale ratio": dict(
        rot=128, base=500_000.0, length=8192, s=8.0, mscale=1.0, all_dim=0.707
    ),
    "rot16 L64 s2 beta 16/2, mscale alone ignored": dict(
        rot=16, base=10_000.0, length=64, s=2.0, beta_fast=16.0, beta_slow=2.0, mscale=0.5
    ),
    "rot8 L4: an empty band, widened": dict(rot=8, base=10_000.0, length=4, s=2.0),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_yarn_hf_convention_equals_hugging_faces_formula(case):
    kw = HF_CASES[case]
    want, want_factor = _hf_yarn64(**kw)
    yarn = pos_lib.YarnOptions(
        convention="hf",
        beta_fast=kw.get("beta_fast", 32.0),
        beta_slow=kw.get("beta_slow", 1.0),
        mscale=kw.get("mscale", 0.0),
        mscale_all_dim=kw.get("all_dim", 0.0),
    )
    got, factor = pos_lib.rope_frequencies(
        kw["rot"],
        kw["base"],
        scaling="yarn",
        factor=kw["s"],
        original_length=kw["length"],
        yarn=yarn,
    )
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    # Through the rotation: queries and keys rotated by the frequencies, scaled by the factor.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 5, 2, kw["rot"]))
    pos = np.array([[0, 1, 17, 300, 5000]])
    half = kw["rot"] // 2
    ang = pos[..., None, None] * want  # [B, T, 1, H/2]
    x1, x2 = x[..., :half], x[..., half:]
    rotated = np.concatenate(
        [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1
    )
    out = pos_lib.rope(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(pos),
        kw["base"],
        scaling="yarn",
        scaling_factor=kw["s"],
        original_length=kw["length"],
        yarn=yarn,
    )
    np.testing.assert_allclose(out, rotated * want_factor, rtol=2e-3, atol=2e-3)


def test_yarn_paper_convention_is_the_ramp_in_turns_and_where_hf_differs():
    rot, length, s = 64, 2048, 4.0
    theta = 10_000.0 ** -(np.arange(0, rot, 2) / rot)
    turns = length * theta / (2 * math.pi)  # r = L / λ
    keep = np.clip((turns - 1.0) / (32.0 - 1.0), 0.0, 1.0)
    want = keep * theta + (1 - keep) * theta / s
    paper, factor = pos_lib.rope_frequencies(rot, scaling="yarn", factor=s, original_length=length)
    np.testing.assert_allclose(paper, want, rtol=1e-12)
    assert factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    hf, hf_factor = _hf_yarn64(rot, 10_000.0, length, s)
    assert hf_factor == factor  # the same attention factor by default
    # Outside the band both keep (r > 32) or interpolate (r < 1) the pair alike;
    # inside, HF's ramp (linear in the index) keeps more of each frequency.
    outside = (turns > 32.0) | (turns < 1.0)
    np.testing.assert_allclose(hf[outside], paper[outside], rtol=1e-12)
    ratio = hf / paper
    assert ratio.max() == pytest.approx(1.80, abs=0.01) and int(ratio.argmax()) == 15
    assert np.all(ratio >= 1.0 - 1e-12)


def test_yarn_config_fields_reach_the_rotation_at_evaluation():
    cfg = TransformerConfig(
        **TINY,
        position="rope",
        position_options={
            "rope": {
                "scaling": "yarn",
                "scaling_factor": 4.0,
                "original_length": 16,
                "yarn": {
                    "convention": "hf",
                    "beta_fast": 8.0,
                    "beta_slow": 0.5,
                    "mscale": 1.0,
                    "mscale_all_dim": 0.5,
                },
            }
        },
    )
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.normal(size=(1, 5, 4, cfg.head_dim)), jnp.float32)
    pos = jnp.arange(5)[None] * 9
    got, _ = SCHEMES["rope"].rotate(cfg, q, q, pos, pos, Site(causal=True, train=False))
    yarn = pos_lib.YarnOptions("hf", beta_fast=8.0, beta_slow=0.5, mscale=1.0, mscale_all_dim=0.5)
    want = pos_lib.rope(q, pos, scaling="yarn", scaling_factor=4.0, original_length=16, yarn=yarn)
    np.testing.assert_array_equal(got, want)
    paper = pos_lib.rope(q, pos, scaling="yarn", scaling_factor=4.0, original_length=16)
    assert np.abs(np.asarray(got) - np.asarray(paper)).max() > 1e-2
    trained, _ = SCHEMES["rope"].rotate(cfg, q, q, pos, pos, Site(causal=True, train=True))
    np.testing.assert_array_equal(trained, pos_lib.rope(q, pos))  # training ignores scalings


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(convention="meta"), r"rope.yarn: convention='meta'; choose one of"),
        (dict(beta_fast=1.0, beta_slow=2.0), "rope.yarn: need 0 < beta_slow < beta_fast"),
        (dict(beta_slow=0.0), "rope.yarn: need 0 < beta_slow"),
        (dict(mscale=-1.0), r"rope.yarn: mscale and mscale_all_dim must be >= 0, got -1.0"),
        (dict(mscale_all_dim=-0.5), "rope.yarn: mscale and mscale_all_dim must be >= 0"),
    ],
)
def test_yarn_config_errors_are_one_line_and_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message) as err:
        TransformerConfig(**TINY, position="rope", position_options={"rope": {"yarn": bad}})
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("TransformerConfig.position_options.rope.yarn: ")
    with pytest.raises(ValueError, match="yarn: "):
        pos_lib.YarnOptions(**bad)
