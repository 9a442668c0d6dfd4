"""Score mods inside the Pallas kernels (interpret mode), against float64.

The contract (docs/design.md, `jattn.ScoreMod`): the kernels apply
`fn(params, score, batch, head, q_position, kv_position)` per tile to the
scaled logits, forward and backward, and the result equals attention on the
materialised modified logits; gradients reach query, key, value and every
params leaf. Checked for every score mod the registered schemes build
(tests/registry_mods.py: each scheme's own hooks and initialisers, so a new
scheme is covered with no edit here), the forms of `jattn.positions` no
scheme builds (ALiBi's asymmetric form, softcap), two more styles (a one-hot
over a bucket axis, an MLP over a hidden axis) and one that reads `batch`,
in both kernel families (Triton-style
`interpret`, Mosaic `tpu_interpret`), across several tiles, causal and
packed with padding; fully masked rows stay 0 with no gradient; the fused
backward; composition with Shaw terms, GQA, windows and dropout (against the
xla path, which applies the mod to the whole matrix); lowering for CUDA
(Triton) and TPU (Mosaic) on this CPU host; and the refusal of a fn the
kernels cannot lower.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import registry_mods
from attention_cases import normal_form
from flash_harness import F32_TOL, _close, _packed, _qkv, cuda_target, kernel_outputs

import jattn
from jattn import positions
from jattn.attention.pallas import flash_attention as fa
from jattn.attention.pallas.score_mod_tiles import ScoreModLoweringError

# --------------------------------------------------------------------------------------
# Score mods written in the styles of jattn.positions: params indexed by `head`
# (or `batch`) or a static index, tables looked up by one-hot compare-and-sum.

N_HEADS = registry_mods.SMALL["num_heads"]


def _dist(q, k, dtype):
    return (q - k).astype(dtype)  # i - j


def _lift(x, ndim: int):
    """Leading unit axes up to `ndim` (explicit broadcasting: the suite raises
    on rank promotion)."""
    return jnp.reshape(x, (1,) * (ndim - x.ndim) + x.shape)


def _one_hot_lookup(row, ids, size):
    """`row[ids]` for a table row `[..., size]` and int ids `[..., t, s]`."""
    hit = ids[..., None] == _lift(jnp.arange(size), ids.ndim + 1)  # [..., t, s, size]
    return jnp.sum(jnp.where(hit, _lift(row, hit.ndim), 0.0), axis=-1)


def t5_one_hot(p, s, b, h, q, k):
    """T5-style buckets looked up by a one-hot over a third (bucket) axis."""
    nb, exact, max_d = 16, 4, 64
    rel = k - q
    sign = jnp.where(rel > 0, nb // 2, 0)  # bidirectional: half the buckets per side
    d = jnp.abs(rel)
    half = nb // 2
    # Buckets in float32 whatever the score's dtype: the float64 reference must
    # round the log at the bucket edges as the kernels do.
    log_b = exact + (
        jnp.log(jnp.maximum(d, 1).astype(jnp.float32) / exact)
        / float(np.log(max_d / exact))
        * (half - exact)
    ).astype(jnp.int32)
    bucket = sign + jnp.where(d < exact, d, jnp.minimum(log_b, half - 1))
    return s + _one_hot_lookup(p["table"][h], bucket, nb)


def fire_hidden_axis(p, s, b, h, q, k):
    """FIRE with its MLP over a hidden axis added to the tile."""
    c = jax.nn.softplus(p["c"])
    psi = lambda x: jnp.log(c * x + 1.0)  # noqa: E731
    rel = jnp.abs(_dist(q, k, s.dtype))
    x = psi(rel) / psi(jnp.maximum(jnp.abs(p["threshold"]), q.astype(s.dtype)) + 1.0)
    nd = x.ndim + 1
    hidden = jax.nn.relu(x[..., None] * _lift(p["w1"], nd) + _lift(p["b1"], nd))  # [t, s, hid]
    return s + jnp.sum(hidden * _lift(p["w2"][h], nd), axis=-1) + p["b2"][h]


def per_batch(p, s, b, h, q, k):
    """Written in the test: a term per batch row and head (exercises `batch`)."""
    return s + p["row"][b] * jnp.cos(0.3 * _dist(q, k, s.dtype)) * p["head"][h]


def _mods() -> dict[str, jattn.ScoreMod]:
    """The registry's mods (tables of 2k + 1 = 9 and 12 entries: not powers
    of two, so Triton gets them flattened and padded), the forms of
    `jattn.positions` no scheme builds, two more styles and the per-batch mod
    written here."""
    rng = np.random.default_rng(0)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    slopes = positions.alibi_slopes(N_HEADS)
    mods = {label: built.mod for label, built in registry_mods.small_mods().items()}
    return mods | {
        "alibi_asymmetric": positions.alibi_score_mod(
            slopes, mode="asymmetric", right_slopes=slopes[::-1]
        ),
        "softcap": positions.softcap_score_mod(2.5),
        "t5_one_hot": jattn.ScoreMod(t5_one_hot, {"table": f(N_HEADS, 16)}),
        "fire_hidden_axis": jattn.ScoreMod(
            fire_hidden_axis,
            {
                "c": f(),
                "threshold": jnp.asarray(8.0),
                "w1": f(8),
                "b1": f(8),
                "w2": f(N_HEADS, 8),
                "b2": f(N_HEADS),
            },
        ),
        "per_batch": jattn.ScoreMod(per_batch, {"row": f(2), "head": f(N_HEADS)}),
    }


def _fire_short() -> jattn.ScoreMod:
    """FIRE with its threshold L inside the tested lengths (its initial L is
    512) and a per-head offset, for the tests of its kernel form."""
    params = positions.init_fire_params(jax.random.PRNGKey(1), N_HEADS, hidden=8)
    params["L"] = jnp.asarray(3.0, jnp.float32)
    params["b2"] = jnp.asarray(np.random.default_rng(2).standard_normal(N_HEADS), jnp.float32)
    return positions.fire_score_mod(params)


MODS = _mods()
FIRE_SHORT = _fire_short()
SHAW_BIAS = registry_mods.label_of("shaw_bias")
FIRE = registry_mods.label_of("fire")


def _mod(name: str) -> jattn.ScoreMod:
    return MODS[name]


# --------------------------------------------------------------------------------------
# Float64 reference: the modified logits materialised, GQA by repetition.


def _reference(inputs: dict, mod: jattn.ScoreMod, cot, *, is_causal: bool):
    """Float64 `(out, grads)`; grads of query, key, value and the params."""
    q, k = inputs["query"], inputs["key"]
    b, t, n, h = q.shape
    s = k.shape[1]
    qpos = np.broadcast_to(inputs.get("q_positions", np.arange(t)), (b, t))
    kvpos = np.broadcast_to(inputs.get("kv_positions", np.arange(s)), (b, s))
    vis = np.ones((b, 1, t, s), bool)
    if is_causal:
        vis &= kvpos[:, None, None, :] <= qpos[:, None, :, None]
    if inputs.get("q_segment_ids") is not None:
        qs, ks = inputs["q_segment_ids"], inputs["kv_segment_ids"]
        vis &= qs[:, None, :, None] == ks[:, None, None, :]
        vis &= qs[:, None, :, None] != 0  # segment id 0 is padding: it sees no key
    if inputs.get("mask") is not None:
        vis &= np.asarray(inputs["mask"])
    f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
    with jax.enable_x64(True), jax.debug_nans(False), jax.debug_infs(False):

        def f(q, k, v, params):
            rep = n // k.shape[2]
            k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
            logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
            logits = mod.fn(
                params,
                logits,
                jnp.arange(b, dtype=jnp.int32)[:, None, None, None],
                jnp.arange(n, dtype=jnp.int32)[None, :, None, None],
                jnp.asarray(qpos, jnp.int32)[:, None, :, None],
                jnp.asarray(kvpos, jnp.int32)[:, None, None, :],
            )
            logits = jnp.where(vis, logits, -jnp.inf)
            m = jnp.max(logits, axis=-1, keepdims=True)
            w = jnp.where(vis, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
            den = w.sum(-1, keepdims=True)
            w = w / jnp.where(den == 0, 1.0, den)
            return jnp.einsum("bnts,bsnv->btnv", w, v)

        params = jax.tree.map(f64, mod.params)
        out, vjp = jax.vjp(f, f64(q), f64(k), f64(inputs["value"]), params)
        grads = vjp(f64(cot))
        return np.asarray(out), jax.tree.map(np.asarray, grads)


@functools.partial(
    jax.jit, static_argnames=("is_causal", "backend", "backward", "bq", "bk", "tiles")
)
def _pallas(inputs, mod, cot, *, is_causal, backend, backward="split", bq=16, bk=32, tiles=None):
    """Output and gradients (query, key, value, params) through the kernels;
    `tiles` each backward kernel's (`fa.BackwardTiles`) or None."""

    def f(q, k, v, params):
        nf = normal_form(
            q,
            k,
            v,
            mask=inputs.get("mask"),
            is_causal=is_causal,
            q_segment_ids=inputs.get("q_segment_ids"),
            kv_segment_ids=inputs.get("kv_segment_ids"),
            q_positions=inputs.get("q_positions"),
            kv_positions=inputs.get("kv_positions"),
            score_mod=jattn.ScoreMod(mod.fn, params, mod.name),
        )
        return fa.flash_attention(
            nf, block_q=bq, block_k=bk, backend=backend, backward=backward, backward_tiles=tiles
        )[0]

    out, vjp = jax.vjp(f, inputs["query"], inputs["key"], inputs["value"], mod.params)
    return out, vjp(cot)


def _compare(got, want, tol=F32_TOL):
    out, grads = got
    want_out, want_grads = want
    _close("out", out, want_out, tol)
    for name, g, w in zip(("dquery", "dkey", "dvalue"), grads[:3], want_grads[:3], strict=True):
        _close(name, g, w, tol)
    got_p = jax.tree_util.tree_leaves_with_path(grads[3])
    want_p = jax.tree.leaves(want_grads[3])
    assert len(got_p) == len(want_p) > 0
    # A params gradient is a sum over every logit; a leaf whose gradient is
    # small or 0 (FIRE's threshold; a per-head constant, which softmax
    # ignores) keeps the rounding of the large terms it sums, so each leaf is
    # measured against its own scale or 1% of the largest leaf's, whichever
    # is larger.
    floor = 0.01 * max(float(np.max(np.abs(w))) for w in want_p)
    for (path, g), w in zip(got_p, want_p, strict=True):
        g = np.asarray(g, np.float64)
        assert g.shape == w.shape and np.all(np.isfinite(g))
        size = float(np.max(np.abs(w)))
        # Exactly 0 in exact arithmetic (a per-head constant): a cancellation of
        # sums over every row, whose float32 error grows with the row count.
        leaf_tol = 25 * tol if size < 1e-9 else tol
        err = float(np.max(np.abs(g - w))) / max(size, floor, 1e-6)
        name = f"dparams{jax.tree_util.keystr(path)}"
        assert err <= leaf_tol, f"{name}: error {err:.2e} > {leaf_tol:.0e}"


def _cot(inputs, seed=7):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(inputs["query"].shape), jnp.float32)


def _causal_inputs():
    return _qkv(1, 2, 64, 64, N_HEADS, 2, 16)  # B=2, GQA 4 over 2, 4x2 tiles of 16x32


def _packed_padded_inputs():
    """Two rows of three packed segments and a padding tail (segment 0)."""
    inputs = _qkv(2, 2, 64, 64, N_HEADS, 2, 16)
    seg, pos = _packed(2, [20, 26, 12])  # 58 real tokens, 6 padding
    seg = np.concatenate([seg, np.zeros((2, 6), np.int32)], axis=1)
    pos = np.concatenate([pos, np.zeros((2, 6), np.int32)], axis=1)
    for side in ("q", "kv"):
        inputs[f"{side}_segment_ids"] = seg
        inputs[f"{side}_positions"] = pos
    return inputs


# --------------------------------------------------------------------------------------
# Every mod, both kernel families, against float64.


@pytest.mark.parametrize("name", sorted(MODS))
def test_triton_kernels_causal_match_float64(name):
    inputs, mod = _causal_inputs(), _mod(name)
    cot = _cot(inputs)
    got = _pallas(inputs, mod, cot, is_causal=True, backend="interpret")
    _compare(got, _reference(inputs, mod, cot, is_causal=True))


def test_fire_tile_parts_equal_fn_and_its_autodiff_in_float64():
    """FIRE's kernel form (`TileParts`: the views, the unit loop and its
    hand-written backward) is `fn` with the gradient autodiff gives, on a
    tile with positive and negative pre-activations, in float64."""
    from jattn.score_mod import tile_parts

    parts = tile_parts(FIRE_SHORT.fn)
    assert parts is not None
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), FIRE_SHORT.params)
        rng = np.random.default_rng(3)
        s = jnp.asarray(rng.standard_normal((8, 16)))
        ct = jnp.asarray(rng.standard_normal((8, 16)))
        i = jnp.arange(8, dtype=jnp.int32)[:, None] + 5  # [bq, 1]
        j = jnp.arange(16, dtype=jnp.int32)[None, :]  # [1, bk]
        head = jnp.asarray(2, jnp.int32)

        def by_parts(p, s):
            return s + parts.core(parts.views(p, 0, head, i, j))

        fn = lambda p, s: FIRE_SHORT.fn(p, s, 0, head, i, j)  # noqa: E731
        np.testing.assert_allclose(by_parts(params, s), fn(params, s), rtol=1e-12, atol=1e-12)
        views, pull = jax.vjp(lambda p: parts.views(p, 0, head, i, j), params)
        a = views[4][..., None] * views[0][None, None] + views[1][None, None]  # [bq, bk, hidden]
        assert np.any(np.asarray(a) > 0) and np.any(np.asarray(a) < 0)
        (got,) = pull(tuple(parts.core_vjp(views, ct)))
        want, _ = jax.vjp(fn, params, s)[1](ct)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_fire_with_an_odd_hidden_size_falls_back_to_autodiff():
    """Triton gets a leaf whose size is not a power of two flattened, and
    FIRE's loop uses `w1` whole: its kernel form is not used (autodiff of
    `fn` is), and the kernels still match float64."""
    from jattn.attention.pallas import score_mod_tiles as smt

    params = positions.init_fire_params(jax.random.PRNGKey(4), N_HEADS, hidden=6)
    params["L"] = jnp.asarray(3.0, jnp.float32)
    mod = positions.fire_score_mod(params)
    assert smt.usable_parts(smt.mod_spec(mod, "interpret")[0]) is None
    assert smt.usable_parts(smt.mod_spec(MODS[FIRE], "interpret")[0]) is not None
    inputs = _causal_inputs()
    cot = _cot(inputs)
    got = _pallas(inputs, mod, cot, is_causal=True, backend="interpret")
    _compare(got, _reference(inputs, mod, cot, is_causal=True))


@pytest.mark.parametrize("name", sorted(MODS))
def test_mosaic_kernels_packed_padded_match_float64(name):
    inputs, mod = _packed_padded_inputs(), _mod(name)
    cot = _cot(inputs)
    # Mosaic tiles: block_k a multiple of 128 or all keys (64 here); 4 query tiles.
    got = _pallas(inputs, mod, cot, is_causal=False, backend="tpu_interpret", bq=16, bk=64)
    _compare(got, _reference(inputs, mod, cot, is_causal=False))


@pytest.mark.parametrize("name", [SHAW_BIAS, FIRE, "per_batch"])
def test_triton_packed_padded_and_fused_backward(name):
    inputs, mod = _packed_padded_inputs(), _mod(name)
    cot = _cot(inputs)
    want = _reference(inputs, mod, cot, is_causal=True)
    for backward in ("split", "fused"):
        got = _pallas(inputs, mod, cot, is_causal=True, backend="interpret", backward=backward)
        _compare(got, want)


@pytest.mark.parametrize("name", sorted(MODS))
def test_dq_and_dkv_kernels_on_their_own_tiles(name):
    # The dq kernel (which also sums the params' gradient) on 32x16 tiles and
    # the dk/dv kernel on 16x64 (another warp count: 2), the forward on
    # 16x32: three tilings of packed, padded rows, every mod against float64
    # (a distance-table mod builds one tile set per tiling).
    inputs, mod = _packed_padded_inputs(), _mod(name)
    cot = _cot(inputs)
    tiles = fa.BackwardTiles(dq_blocks=(32, 16), dkv_blocks=(16, 64), dkv_warps=2)
    got = _pallas(inputs, mod, cot, is_causal=True, backend="interpret", tiles=tiles)
    _compare(got, _reference(inputs, mod, cot, is_causal=True))


@pytest.mark.parametrize("backend", ["interpret", "tpu_interpret"])
def test_fully_masked_rows_are_zero_with_no_gradient(backend):
    inputs, mod = _causal_inputs(), _mod(registry_mods.label_of("alibi_offset"))
    rng = np.random.default_rng(11)
    mask = rng.random((2, 1, 64, 64)) > 0.3
    dead = [0, 17, 40]
    mask[:, :, dead] = False
    inputs["mask"] = mask
    cot = _cot(inputs)
    bk = 32 if backend == "interpret" else 64
    got = _pallas(inputs, mod, cot, is_causal=False, backend=backend, bk=bk)
    _compare(got, _reference(inputs, mod, cot, is_causal=False))
    out, grads = got
    assert np.all(np.asarray(out)[:, dead] == 0.0)
    assert np.all(np.asarray(grads[0])[:, dead] == 0.0)


# --------------------------------------------------------------------------------------
# Composition with Shaw terms, windows, dropout and return_residual: the public
# entry against the xla path (same keep mask; the mod on the whole matrix).


def _public(inputs, mod, impl, **kw):
    rng = np.random.default_rng(21)
    rel = jattn.ShawRelative(
        key=jnp.asarray(rng.standard_normal((N_HEADS, 9, 16)), jnp.float32),
        value=jnp.asarray(rng.standard_normal((9, 16)), jnp.float32),
        max_distance=4,
    )

    def f(q, k, v, params, rel):
        out, lse = jattn.dot_product_attention(
            q,
            k,
            v,
            implementation=impl,
            relative=rel,
            score_mod=jattn.ScoreMod(mod.fn, params, mod.name),
            return_residual=True,
            q_segment_ids=inputs.get("q_segment_ids"),
            kv_segment_ids=inputs.get("kv_segment_ids"),
            q_positions=inputs.get("q_positions"),
            kv_positions=inputs.get("kv_positions"),
            **kw,
        )
        return out, lse

    (out, lse), vjp = jax.vjp(f, inputs["query"], inputs["key"], inputs["value"], mod.params, rel)
    grads = vjp((_cot(inputs), jnp.zeros_like(lse)))
    return out, lse, grads


@pytest.mark.parametrize(
    "kw",
    [
        dict(is_causal=True, local_window_size=(20, 0)),
        dict(dropout_rate=0.2, dropout_rng=jax.random.PRNGKey(3)),
    ],
    ids=["causal_window", "dropout"],
)
def test_composes_with_shaw_gqa_window_dropout_residual(kw):
    inputs, mod = _packed_padded_inputs(), _mod(registry_mods.label_of("t5", "bidirectional"))
    got = jax.jit(lambda x, m: _public(x, m, "pallas", **kw))(inputs, mod)
    want = jax.jit(lambda x, m: _public(x, m, "xla", **kw))(inputs, mod)
    as64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    _close("out", got[0], as64(want[0]), F32_TOL)
    live = np.asarray(want[1]) > -1e30
    np.testing.assert_allclose(np.asarray(got[1])[live], np.asarray(want[1])[live], atol=1e-4)
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True)):
        _close(f"grad leaf {i}", g, as64(w), 5 * F32_TOL)


# --------------------------------------------------------------------------------------
# Refusal by name, and no gradient pass for params nobody differentiates.


def gathered_t5(p, s, b, h, q, k):
    """A table looked up with an array index: a gather, which Triton and the
    kernels' rewrite cannot lower."""
    return s + p["table"][h][jnp.clip(k - q, -3, 3) + 3]  # a table of 8 (power of two)


@pytest.mark.parametrize("backend", ["interpret", "gpu", "tpu_interpret"])
def test_unlowerable_fn_is_refused_by_name(backend):
    inputs = _causal_inputs()
    mod = jattn.ScoreMod(gathered_t5, {"table": jnp.zeros((N_HEADS, 8))})
    nf = normal_form(inputs["query"], inputs["key"], inputs["value"], score_mod=mod)
    bk = 64 if backend == "tpu_interpret" else 32
    with pytest.raises(ScoreModLoweringError, match=r"ScoreMod 'gathered_t5'.*gather"):
        fa.flash_attention(nf, block_q=16, block_k=bk, backend=backend)


def sorted_mod(p, s, b, h, q, k):
    return jnp.sort(s, axis=-1) * p["w"][h]  # not elementwise: a sort


def whole_odd_leaf(p, s, b, h, q, k):
    return s + jnp.sum(p["w"])  # uses a leaf of 3 (not a power of two) whole


def test_refuses_unlowerable_primitives_and_whole_odd_leaves_on_triton():
    inputs = _causal_inputs()
    nf = lambda mod: normal_form(  # noqa: E731
        inputs["query"], inputs["key"], inputs["value"], score_mod=mod
    )
    sort = jattn.ScoreMod(sorted_mod, {"w": jnp.ones((N_HEADS,))})
    for backend, bk in (("interpret", 32), ("gpu", 32), ("tpu_interpret", 64)):
        with pytest.raises(ScoreModLoweringError, match=r"'sorted_mod'.*primitive 'sort'"):
            fa.flash_attention(nf(sort), block_q=16, block_k=bk, backend=backend)
    odd = jattn.ScoreMod(whole_odd_leaf, {"w": jnp.ones((3,))})
    for backend in ("interpret", "gpu"):
        with pytest.raises(ScoreModLoweringError, match=r"'whole_odd_leaf'.*power of two"):
            fa.flash_attention(nf(odd), block_q=16, block_k=32, backend=backend)
    # Mosaic tensors need no power-of-two sizes: the same fn runs there.
    out, _ = fa.flash_attention(nf(odd), block_q=16, block_k=64, backend="tpu_interpret")
    assert np.all(np.isfinite(np.asarray(out)))


def _dq_kernel_outputs(f, *args) -> int:
    """Number of outputs of the dq pallas_call in the jaxpr of `f(*args)`."""
    found = kernel_outputs(jax.make_jaxpr(f)(*args), "jattn_flash_dq")
    assert len(found) == 1, found
    return found[0]


def test_fixed_params_skip_the_params_gradient():
    """A score mod whose params are not differentiated (a fixed softcap) runs
    the backward without the params' partial sums, and still gives the
    float64 output and q/k/v gradients."""
    inputs, mod = _causal_inputs(), _mod("softcap")
    cot = _cot(inputs)
    qkv = (inputs["query"], inputs["key"], inputs["value"])

    def f(q, k, v, params):
        nf = normal_form(q, k, v, is_causal=True, score_mod=jattn.ScoreMod(mod.fn, params))
        return fa.flash_attention(nf, block_q=16, block_k=32, backend="interpret")[0]

    fixed = lambda *a: jax.vjp(lambda q, k, v: f(q, k, v, mod.params), *a)[1](cot)  # noqa: E731
    learned = lambda *a: jax.vjp(f, *a, mod.params)[1](cot)  # noqa: E731
    assert _dq_kernel_outputs(fixed, *qkv) == 1  # dq alone
    assert _dq_kernel_outputs(learned, *qkv) == 2  # dq and the params' partial sums
    out = f(*qkv, mod.params)
    want_out, want_grads = _reference(inputs, mod, cot, is_causal=True)
    _close("out", out, want_out, F32_TOL)
    for name, g, w in zip(("dq", "dk", "dv"), jax.jit(fixed)(*qkv), want_grads[:3], strict=True):
        _close(name, g, w, F32_TOL)


# --------------------------------------------------------------------------------------
# Lowering on this CPU host: Triton for CUDA, Mosaic for TPU.


def _lower(platform: str, backend: str, name: str, *, t: int, h: int, backward="split") -> str:
    """StableHLO of the kernels' output and vjp (q, k, v and params) with score
    mod `name`, causal, packed (segments and positions), GQA 4 over 2."""
    sds = jax.ShapeDtypeStruct
    mod = _mod(name)
    q = sds((1, t, N_HEADS, h), jnp.bfloat16)
    kv = sds((1, t, 2, h), jnp.bfloat16)
    ids = sds((1, t), jnp.int32)
    params = jax.tree.map(lambda x: sds(x.shape, x.dtype), mod.params)

    def f(q, k, v, params, seg, pos, cot):
        def g(q, k, v, params):
            nf = normal_form(
                q,
                k,
                v,
                is_causal=True,
                q_segment_ids=seg,
                kv_segment_ids=seg,
                q_positions=pos,
                kv_positions=pos,
                score_mod=jattn.ScoreMod(mod.fn, params, mod.name),
            )
            return fa.flash_attention(
                nf, block_q=None, block_k=None, backend=backend, backward=backward
            )[0]

        out, vjp = jax.vjp(g, q, k, v, params)
        return out, vjp(cot)

    args = (q, kv, kv, params, ids, ids, q)
    if platform != "cuda":
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    # As flash_harness._lower_vjp: host-side constants first, then trace and
    # lower under an abstract H100 (jax >= 0.11 asks the device for its
    # compute capability).
    jax.eval_shape(f, *args)
    with cuda_target():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name", sorted(MODS))
def test_triton_kernels_lower_for_cuda(name):
    text = _lower("cuda", "gpu", name, t=200, h=64)
    for kernel in ("jattn_flash_fwd", "jattn_flash_dq", "jattn_flash_dkv"):
        assert kernel in text


def test_fused_backward_lowers_for_cuda():
    text = _lower("cuda", "gpu", SHAW_BIAS, t=200, h=64, backward="fused")
    assert "jattn_flash_bwd_fused" in text


@pytest.mark.parametrize("name", sorted(MODS))
def test_mosaic_kernels_lower_for_tpu(name):
    text = _lower("tpu", "tpu", name, t=300, h=128)
    for kernel in ("jattn_flash_fwd_tpu", "jattn_flash_dq_tpu", "jattn_flash_dkv_tpu"):
        assert kernel in text
