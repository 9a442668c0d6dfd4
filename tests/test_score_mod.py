"""Contracts of `jattn.ScoreMod` (docs/design.md): a score mod gives the float64
answer of the materialised modified logits, forward and backward (query, key,
value and every parameter leaf), in every implementation; it composes with
causal, packing and padding, windows, GQA/MQA, dropout, Shaw terms, rank 3,
jit and vmap; it changes values, never visibility.

Every score mod the registered schemes build (tests/registry_mods.py: each
scheme's own hooks and initialisers, so a new scheme is covered with no edit
here), the forms of `jattn.positions` no scheme builds (ALiBi's asymmetric
form, soft-capping) and one written here (a per-batch term, so `batch` is
exercised) run through `IMPLEMENTATIONS_UNDER_TEST`; chunked tiles are 16 x 16
so every case crosses several tiles and a ragged last one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
import registry_mods
from attention_cases import implementation, make_problem, normal_form, packed_ids, packed_positions

import jattn
from jattn import positions
from jattn.attention.chunked import forward
from jattn.attention.chunked_problem import TiledProblem
from jattn.score_mod import apply_score_mod, tile_parts

IMPLEMENTATIONS_UNDER_TEST = ("xla", "chunked", "pallas")
OPTIONS = {"chunked": (("block_k", 16), ("block_q", 16))}
B, L, K, H = 2, 40, 2, 8  # GQA: 2 query heads per kv head; 40 = 2.5 tiles
N = registry_mods.SMALL["num_heads"]


def _per_batch(params, score, batch, head, i, j):
    """A user-written mod: a learned per-batch-row slope of a bounded distance
    term and a per-head offset (reads `batch`, `head`, both positions)."""
    d = jnp.tanh((i - j).astype(jnp.float32) / 8.0)
    return score + params["row"][batch] * d + params["head"][head]


def _mods() -> dict:
    """The registry's mods, then the forms and styles no scheme builds."""
    rng = np.random.default_rng(3)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    slopes = positions.alibi_slopes(N)
    mods = {label: built.mod for label, built in registry_mods.small_mods().items()}
    return mods | {
        "alibi_asymmetric": positions.alibi_score_mod(
            slopes, mode="asymmetric", right_slopes=slopes[::-1]
        ),
        "softcap": positions.softcap_score_mod(1.5),
        "per_batch": jattn.ScoreMod(_per_batch, {"row": normal(B), "head": normal(N)}),
    }


MODS = _mods()
REGISTRY = registry_mods.small_mods()
# The mods that depend on positions only through i - j (FIRE also reads i),
# as each scheme declares.
SHIFT_INVARIANT = tuple(n for n in MODS if n not in REGISTRY or REGISTRY[n].shift_invariant)
# The mods some tests need by name.
T5 = registry_mods.label_of("t5", "bidirectional")
ALIBI_CAUSAL = registry_mods.label_of("alibi_causal")
ALIBI_SYMMETRIC = registry_mods.label_of("alibi_symmetric")
ALIBI_OFFSET = registry_mods.label_of("alibi_offset")
SHAW_BIAS = registry_mods.label_of("shaw_bias")
FIRE = registry_mods.label_of("fire")
KERPLE = registry_mods.label_of("kerple_log")


def _fire_short():
    """FIRE with its threshold L inside the tested lengths (its initial L is
    512), so the normaliser psi(max(L, i)) reads the query position."""
    params = positions.init_fire_params(jax.random.PRNGKey(1), N, hidden=8)
    params["L"] = jnp.asarray(3.0, jnp.float32)
    return positions.fire_score_mod(params)


FIRE_SHORT = _fire_short()


@functools.cache
def _grad_fn(impl: str, static: tuple):
    """Jitted `(out, lse, grads)` of one implementation; grads are the
    cotangents of (query, key, value, score mod params, Shaw key, Shaw value)."""
    kw = dict(static)
    dist = kw.pop("max_distance", None)

    def f(q, k, v, mod, rk, rv, arrays, ct):
        def g(q, k, v, mod, rk, rv):
            rel = None if dist is None else jattn.ShawRelative(rk, rv, dist)
            nf = normal_form(q, k, v, relative=rel, score_mod=mod, **arrays, **kw)
            return implementation(impl)(nf, **dict(OPTIONS.get(impl, ())))

        (out, lse), vjp = jax.vjp(g, q, k, v, mod, rk, rv)
        return out, lse, vjp((ct, jnp.zeros_like(lse)))

    return jax.jit(f)


def run(impl, q, k, v, mod, *, relative=None, **kw):
    """Output, lse and gradients dict of one implementation."""
    arrays = {n: jnp.asarray(x) for n, x in kw.items() if isinstance(x, np.ndarray | jax.Array)}
    static = {n: x for n, x in kw.items() if n not in arrays}
    rk = rv = None
    if relative is not None:
        static["max_distance"] = relative.max_distance
        rk, rv = relative.key, relative.value
    ct = jnp.asarray(np.random.default_rng(7).normal(size=q.shape[:3] + (v.shape[-1],)), q.dtype)
    fn = _grad_fn(impl, tuple(sorted(static.items())))
    out, lse, g = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mod, rk, rv, arrays, ct)
    names = ("query", "key", "value", "score_mod", "rel_key", "rel_value")
    grads = dict(zip(names, g, strict=True))
    grads["score_mod"] = None if mod is None else grads["score_mod"].params
    return np.asarray(out), np.asarray(lse), grads, np.asarray(ct)


def reference(q, k, v, mod, ct, **kw):
    return oracle.attention_and_grads(q, k, v, score_mod=mod, cotangent=ct, **kw)


def assert_close(got, ref, what, rtol=2e-4):
    got, ref = np.asarray(got), np.asarray(ref)
    atol = rtol * max(1.0, float(np.max(np.abs(ref), initial=0.0)))
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol, err_msg=what)


def assert_matches_reference(got, ref, names=("query", "key", "value")):
    out, _, grads, _ = got
    ref_out, ref_grads = ref
    assert_close(out, ref_out, "out")
    for name in names:
        assert_close(grads[name], ref_grads[name], f"d{name}")
    if ref_grads.get("score_mod") is not None:
        got_leaves = jax.tree_util.tree_leaves_with_path(grads["score_mod"])
        ref_leaves = jax.tree.leaves(ref_grads["score_mod"])
        assert len(got_leaves) == len(ref_leaves) > 0
        for (path, g), r in zip(got_leaves, ref_leaves, strict=True):
            assert_close(g, r, f"d params{jax.tree_util.keystr(path)}")


def _layout(name: str) -> dict:
    """`causal`: plain causal rows; `packed`: two bidirectional segments per
    row with restarting positions, then padding (segment 0)."""
    if name == "causal":
        return dict(is_causal=True)
    ids = np.stack([packed_ids([13, 17], L), packed_ids([25, 6], L)])
    pos = np.stack([packed_positions(r) for r in ids])
    return dict(q_segment_ids=ids, kv_segment_ids=ids, q_positions=pos, kv_positions=pos)


# --- every mod, every implementation, against the float64 reference ----------------------


# (pallas, causal) is left out here: tests/test_pallas_score_mod.py checks every
# one of these mods in the same kernels, causal with GQA, against float64
# (`test_triton_kernels_causal_match_float64`); the packed layout below is what
# the public entry adds for pallas (segment ids and positions into the mod).
@pytest.mark.parametrize(
    ("impl", "layout"),
    [
        (impl, layout)
        for impl in IMPLEMENTATIONS_UNDER_TEST
        for layout in ("causal", "packed")
        if (impl, layout) != ("pallas", "causal")
    ],
)
@pytest.mark.parametrize("mod_name", list(MODS))
def test_matches_float64_reference_forward_and_backward(impl, mod_name, layout):
    q, k, v = make_problem(0, B, L, L, N, K, H)
    mod, kw = MODS[mod_name], _layout(layout)
    got = run(impl, q, k, v, mod, **kw)
    assert_matches_reference(got, reference(q, k, v, mod, got[3], **kw))


# --- visibility contracts with a score mod -------------------------------------------------


@pytest.mark.parametrize("mod_name", ["per_batch", T5])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS_UNDER_TEST)
def test_packed_sequences_stay_isolated(impl, mod_name):
    q, k, v = make_problem(1, B, L, L, N, K, H)
    kw = _layout("packed")
    second = jnp.asarray(kw["q_segment_ids"] == 2)[:, :, None, None]  # [B, L, 1, 1]
    q2, k2, v2 = make_problem(2, B, L, L, N, K, H)
    changed = [np.where(second, b, a) for a, b in ((q, q2), (k, k2), (v, v2))]
    base = run(impl, q, k, v, MODS[mod_name], **kw)
    moved = run(impl, *changed, MODS[mod_name], **kw)
    others = ~np.asarray(second)[..., 0, 0]  # [B, L]: every token outside segment 2
    np.testing.assert_allclose(moved[0][others], base[0][others], rtol=0, atol=1e-6)
    for name in ("query", "key", "value"):
        got, ref = np.asarray(moved[2][name]), np.asarray(base[2][name])
        np.testing.assert_allclose(got[others], ref[others], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("mod_name", ["per_batch", FIRE, T5])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS_UNDER_TEST)
def test_fully_masked_rows_are_zero_with_zero_finite_gradient(impl, mod_name):
    q, k, v = make_problem(3, B, L, L, N, K, H)
    q_ids = np.stack([packed_ids([20, 20], L)] * B)
    kv_ids = np.stack([packed_ids([20], L)] * B)  # segment 2 has no key at all
    out, _, grads, _ = run(
        impl, q, k, v, MODS[mod_name], q_segment_ids=q_ids, kv_segment_ids=kv_ids
    )
    empty = q_ids == 2
    assert np.all(out[empty] == 0.0)
    assert np.all(np.asarray(grads["query"])[empty] == 0.0)
    for g in jax.tree.leaves(grads):
        assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("mod_name", SHIFT_INVARIANT)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS_UNDER_TEST)
def test_relative_mods_are_shift_invariant(impl, mod_name):
    q, k, v = make_problem(4, B, L, L, N, K, H)
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    base = run(impl, q, k, v, MODS[mod_name], is_causal=True, q_positions=pos, kv_positions=pos)
    shifted = pos + 1000
    moved = run(
        impl, q, k, v, MODS[mod_name], is_causal=True, q_positions=shifted, kv_positions=shifted
    )
    np.testing.assert_allclose(moved[0], base[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(moved[2]), jax.tree.leaves(base[2]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_fire_reads_the_query_position_beyond_its_threshold():
    """FIRE's normaliser psi(max(L, i)) makes it depend on i, not only i - j."""
    q, k, v = make_problem(4, B, L, L, N, K, H)
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    base = run("xla", q, k, v, FIRE_SHORT, is_causal=True, q_positions=pos, kv_positions=pos)
    moved = run(
        "xla", q, k, v, FIRE_SHORT, is_causal=True, q_positions=pos + 50, kv_positions=pos + 50
    )
    assert np.max(np.abs(moved[0] - base[0])) > 1e-3


def test_a_score_mod_changes_values_not_the_tile_plan():
    q, k, v = make_problem(5, B, 64, 64, N, K, H)
    plain = normal_form(q, k, v, is_causal=True)
    with_mod = normal_form(q, k, v, is_causal=True, score_mod=MODS[T5])
    trips = [np.asarray(forward(TiledProblem(nf, 16, 16)).trips) for nf in (plain, with_mod)]
    np.testing.assert_array_equal(trips[0], trips[1])
    # Causal: query tile i visits key tiles 0..i, the ones above the diagonal are skipped.
    np.testing.assert_array_equal(trips[1], [1, 2, 3, 4])


# --- composition --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_UNDER_TEST)
def test_mqa_matches_reference(impl):
    q, k, v = make_problem(6, B, L, L, N, 1, H)
    got = run(impl, q, k, v, MODS[T5], is_causal=True)
    assert_matches_reference(got, reference(q, k, v, MODS[T5], got[3], is_causal=True))


@pytest.mark.parametrize("mod_name", ["per_batch", SHAW_BIAS])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS_UNDER_TEST)
def test_with_shaw_key_and_value_terms(impl, mod_name):
    q, k, v = make_problem(7, B, L, L, N, K, H)
    rng = np.random.default_rng(8)
    rel = jattn.ShawRelative(
        key=rng.normal(size=(N, 9, H)).astype(np.float32),
        value=rng.normal(size=(9, H)).astype(np.float32),
        max_distance=4,
    )
    kw = _layout("packed")
    got = run(impl, q, k, v, MODS[mod_name], relative=rel, **kw)
    ref = reference(q, k, v, MODS[mod_name], got[3], relative=rel, **kw)
    assert_matches_reference(got, ref)
    for name in ("rel_key", "rel_value"):
        assert_close(got[2][name], ref[1][name], f"d{name}")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_UNDER_TEST)
def test_with_a_sliding_window(impl):
    q, k, v = make_problem(9, B, L, L, N, K, H)
    window = (5, 3)
    got = run(impl, q, k, v, MODS[KERPLE], local_window_size=window)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    mask = (j >= i - window[0]) & (j <= i + window[1])
    assert_matches_reference(got, reference(q, k, v, MODS[KERPLE], got[3], mask=mask))


@pytest.mark.parametrize("mod_name", ["per_batch", ALIBI_OFFSET])
def test_dropout_drops_the_same_weights_as_xla(mod_name):
    q, k, v = make_problem(10, B, L, L, N, K, H)
    kw = dict(is_causal=True, dropout_rate=0.3, dropout_rng=jax.random.PRNGKey(4))
    got = run("chunked", q, k, v, MODS[mod_name], **kw)
    ref = run("xla", q, k, v, MODS[mod_name], **kw)
    off = run("xla", q, k, v, MODS[mod_name], is_causal=True)
    assert np.max(np.abs(ref[0] - off[0])) > 1e-2  # dropout is on
    np.testing.assert_allclose(got[0], ref[0], rtol=2e-5, atol=2e-5)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(ref[2]), strict=True):
        assert_close(a, b, "grad", rtol=5e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_UNDER_TEST)
def test_return_residual_lse_matches_xla(impl):
    q, k, v = make_problem(11, B, L, L, N, K, H)
    kw = _layout("packed")
    got, ref = run(impl, q, k, v, MODS[T5], **kw), run("xla", q, k, v, MODS[T5], **kw)
    np.testing.assert_allclose(got[1], ref[1], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_UNDER_TEST)
def test_rank_3_inputs_through_the_public_entry_point(impl):
    q, k, v = make_problem(12, 1, L, L, N, K, H)
    mod = MODS[ALIBI_CAUSAL]
    call = functools.partial(
        jattn.dot_product_attention, is_causal=True, score_mod=mod, implementation=impl
    )
    out3 = call(q[0], k[0], v[0])
    assert out3.shape == (L, N, H)
    ref = oracle.attention(q, k, v, is_causal=True, score_mod=mod)
    assert_close(out3, ref[0], "out")
    g3 = jax.grad(lambda q, m: jnp.sum(jnp.sin(call(q, k[0], v[0], score_mod=m))), (0, 1))
    dq, dmod = g3(jnp.asarray(q[0]), mod)
    ct = np.cos(np.asarray(ref))  # d sum(sin(out)) / d out
    _, ref_grads = reference(q, k, v, mod, ct, is_causal=True)
    assert_close(dq, ref_grads["query"][0], "dquery")
    assert_close(dmod.params, ref_grads["score_mod"], "dslopes")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_UNDER_TEST)
def test_vmap_over_inputs_and_params_equals_a_loop(impl):
    """vmap over a leading axis of q, k, v and of the mod's params (one T5
    table per member), under jit, equals calling each member alone."""
    m = 3
    q, k, v = make_problem(13, m * B, L, L, N, K, H)
    q, k, v = (x.reshape((m, B) + x.shape[1:]) for x in (q, k, v))
    tables = jnp.asarray(np.random.default_rng(14).normal(size=(m, N, 16)), jnp.float32)
    mod_of = lambda t: positions.t5_score_mod(t, max_distance=20)  # noqa: E731

    def loss(q, k, v, table):
        out = jattn.dot_product_attention(
            q, k, v, is_causal=True, score_mod=mod_of(table), implementation=impl
        )
        return jnp.sum(jnp.sin(out)), out

    grad = jax.grad(loss, argnums=(0, 3), has_aux=True)
    (dq, dt), out = jax.jit(jax.vmap(grad))(q, k, v, tables)
    for i in range(m):
        (dq_i, dt_i), out_i = grad(q[i], k[i], v[i], tables[i])
        np.testing.assert_allclose(out[i], out_i, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dq[i], dq_i, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dt[i], dt_i, rtol=1e-4, atol=1e-5)


# --- the built-in mods are today's terms, and their formulas --------------------------------


def _grid(t: int, s: int, shift: int = 0):
    """Index arrays of the whole `[B, N, T, S]` problem, as the xla path passes them."""
    return (
        jnp.arange(B, dtype=jnp.int32)[:, None, None, None],
        jnp.arange(N, dtype=jnp.int32)[None, :, None, None],
        shift + jnp.arange(t, dtype=jnp.int32)[None, None, :, None],
        jnp.arange(s, dtype=jnp.int32)[None, None, None, :],
    )


def _term(mod, t=L, s=L):
    """The additive term a mod puts on zero logits: `[B, N, T, S]`."""
    return np.asarray(apply_score_mod(mod, jnp.zeros((B, N, t, s)), *_grid(t, s)))


def test_symmetric_alibi_is_the_materialised_alibi_bias_exactly():
    slopes = positions.alibi_slopes(N)
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    want = np.asarray(oracle.alibi_bias(slopes, pos, pos))
    np.testing.assert_array_equal(_term(MODS[ALIBI_SYMMETRIC]), want)
    # Causal ALiBi equals it wherever the causal mask lets a key through.
    lower = np.tril(np.ones((L, L), bool))
    np.testing.assert_array_equal(_term(MODS[ALIBI_CAUSAL])[..., lower], want[..., lower])


def test_t5_mod_is_the_materialised_t5_bias_exactly():
    pos = jnp.broadcast_to(jnp.arange(L), (B, L)) * 3  # distances past max_distance too
    for bidirectional in (True, False):
        table = jnp.asarray(np.random.default_rng(15).normal(size=(N, 32)), jnp.float32)
        mod = positions.t5_score_mod(table, max_distance=64, bidirectional=bidirectional)
        buckets = oracle.t5_buckets(pos, pos, 32, 64, bidirectional)
        got = apply_score_mod(
            mod,
            jnp.zeros((B, N, L, L)),
            *_grid(L, L)[:2],
            pos[:, None, :, None],
            pos[:, None, None, :],
        )
        want = oracle.t5_bias(table.T, buckets)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_shaw_bias_mod_is_todays_rel_b_exactly():
    k = 4
    table = jnp.asarray(np.random.default_rng(16).normal(size=(N, 2 * k + 1)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    ids = positions.relative_ids(pos, pos, k)  # [B, T, S]
    want = np.transpose(np.asarray(jnp.take(table, ids, axis=1)), (1, 0, 2, 3))  # [B, N, T, S]
    np.testing.assert_array_equal(_term(positions.shaw_bias_score_mod(table, k)), want)


def test_order_aware_alibi_tells_left_from_right():
    d = 3
    i = L // 2
    for name in (ALIBI_OFFSET, "alibi_asymmetric"):
        term = _term(MODS[name])
        assert np.all(term[:, :, i, i - d] != term[:, :, i, i + d]), name
    sym = _term(MODS[ALIBI_SYMMETRIC])
    np.testing.assert_array_equal(sym[:, :, i, i - d], sym[:, :, i, i + d])
    off = MODS[ALIBI_OFFSET].params
    want = -off["slopes"] * d - off["offset"]  # a key d to the right
    np.testing.assert_allclose(_term(MODS[ALIBI_OFFSET])[0, :, i, i + d], want, rtol=1e-6)


def test_kerple_fire_and_softcap_formulas_by_hand():
    # KERPLE (log): -r1 * log(1 + r2 * |i - j|); r1 = 2, r2 = 0.5, |i - j| = 4.
    kerple = positions.kerple_score_mod(jnp.full((N,), 2.0), jnp.full((N,), 0.5))
    assert _term(kerple)[0, 0, 10, 6] == pytest.approx(-2.0 * np.log(3.0), rel=1e-6)
    # Soft-capping: tanh(s / c) * c on s = 100, c = 50.
    cap = positions.softcap_score_mod(50.0)
    got = apply_score_mod(cap, jnp.full((1,), 100.0), 0, 0, 0, 0)
    assert float(got[0]) == pytest.approx(50.0 * np.tanh(2.0), rel=1e-6)
    # FIRE: f(psi(|i-j|) / psi(max(L, i))), psi(x) = log(c x + 1), f an MLP (NumPy, hidden axis).
    p = {n: np.asarray(x, np.float64) for n, x in FIRE_SHORT.params.items()}
    c, thr = np.log1p(np.exp(p["c"])), np.log1p(np.exp(p["L"]))
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    x = np.log(c * np.abs(i - j) + 1) / np.log(c * np.maximum(thr, i) + 1)  # [T, S]
    hidden = np.maximum(x[..., None] * p["w1"] + p["b1"], 0.0)  # [T, S, hidden]
    want = np.einsum("tsh,nh->nts", hidden, p["w2"]) + p["b2"][:, None, None]
    np.testing.assert_allclose(_term(FIRE_SHORT)[0], want, rtol=1e-5, atol=1e-6)


# --- errors at the boundary -----------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_UNDER_TEST)
def test_a_fn_returning_the_wrong_shape_is_a_clear_error(impl):
    q, k, v = make_problem(17, 1, L, L, N, K, H)
    bad = jattn.ScoreMod(lambda p, s, b, h, i, j: s[..., :1], None, "cropped")
    with pytest.raises(ValueError, match="ScoreMod 'cropped': fn must return an array of score"):
        jattn.dot_product_attention(q, k, v, score_mod=bad, implementation=impl)


def test_a_fn_that_is_not_callable_or_a_bare_function_is_a_clear_error():
    with pytest.raises(TypeError, match="ScoreMod: fn must be callable"):
        jattn.ScoreMod(3.0, None)
    q, k, v = make_problem(18, 1, 8, 8, N, K, H)
    with pytest.raises(TypeError, match=r"score_mod must be a jattn.ScoreMod\(fn, params\)"):
        jattn.dot_product_attention(q, k, v, score_mod=_per_batch)


@pytest.mark.parametrize("mod_name", list(REGISTRY))
def test_mods_give_the_same_values_and_gradients_per_program_and_per_tile(mod_name):
    """With a scalar `head` (a Pallas program) the table mods use the
    compare-and-select chain and FIRE plain autodiff of its unit loop; with
    an index array (xla, chunked) the table mods a gather and FIRE its
    matmul backward. Same values, same parameter gradients (the float64
    reference calls fn with an index array too, so this is what ties the
    hand-written backward to autodiff). Every mod of the registry, so a new
    one's two forms are held to each other too."""
    mod = MODS[mod_name]
    _, heads, qi, kj = _grid(L, L)
    qi, kj = qi[0, 0], kj[0, 0]  # [T, 1], [1, S]
    ct = jnp.asarray(np.random.default_rng(19).normal(size=(N, L, L)), jnp.float32)

    def per_tile(params):
        return mod.fn(params, jnp.zeros((N, L, L)), 0, heads[0], qi[None], kj[None])  # [N,1,1]

    def per_program(params):
        rows = [mod.fn(params, jnp.zeros((L, L)), 0, jnp.int32(n), qi, kj) for n in range(N)]
        return jnp.stack(rows)

    (a, pull_a), (b, pull_b) = jax.vjp(per_tile, mod.params), jax.vjp(per_program, mod.params)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    if tile_parts(mod.fn) is None:  # a table read selects the entry itself: exact
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got, want = pull_a(ct)[0], pull_b(ct)[0]
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        assert_close(g, w, f"d params{jax.tree_util.keystr(path)}", rtol=1e-5)


def test_with_settings_gives_one_fn_per_settings_so_jit_compiles_once():
    """`with_settings` (how a mod fixes settings that are not parameters) hands
    out one function object per settings: two T5 mods with equal settings
    share a compilation, other settings are another function."""
    q, k, v = make_problem(20, 1, 16, 16, N, K, H)
    table = jnp.asarray(np.random.default_rng(21).normal(size=(N, 12)), jnp.float32)
    a, b = (positions.t5_score_mod(table * s, max_distance=20) for s in (1.0, 2.0))
    other = positions.t5_score_mod(table, max_distance=30)
    assert a.fn is b.fn and a.fn is not other.fn
    call = jax.jit(lambda q, mod: jattn.dot_product_attention(q, k, v, score_mod=mod))
    outs = [call(jnp.asarray(q), mod) for mod in (a, b)]
    assert call._cache_size() == 1
    assert np.max(np.abs(np.asarray(outs[0]) - np.asarray(outs[1]))) > 1e-3  # params did change
