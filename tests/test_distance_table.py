"""Distance-table score mods (`jattn.ScoreMod.from_distance`) and Sandwich.

The contract (docs/design.md, docs/score_mods.md): a mod declared as a
function of `(params, head, kv_position - q_position)` is evaluated once per
call on the distances the call can see (`jattn.attention.distance_table`)
and the tiles read the table, forward and backward; it equals its per-logit
form (`mod.fn`, what the Pallas kernels run) to float32 rounding, parameter
gradients included. Checked for every distance mod the registered schemes
build (tests/registry_mods.py, so a new one is covered with no edit) and two
written here (one clipped), in xla and chunked (several tiles) with
default, packed, per-row shifted and random sorted positions (the last
spread wider than `T + S - 1` distances: the call falls back to the
per-logit form), and in the Pallas kernels (interpret and tpu_interpret).
Sandwich is checked against its formula in float64 written here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
import registry_mods
from attention_cases import implementation, normal_form, packed_ids, packed_positions

import jattn
from jattn import positions
from jattn.attention import distance_table
from jattn.attention.pallas import flash_attention as fa

B, L, KH, H = 2, 40, 2, 8  # 40 = 2.5 tiles of 16
N = registry_mods.SMALL["num_heads"]
OPTIONS = {"chunked": {"block_q": 16, "block_k": 16}, "xla": {}}


def _tanh_term(params, head, d):
    """Written here: a learned per-head amplitude of a bounded distance term."""
    return params["a"][head] * jnp.tanh(d.astype(jnp.float32) / 5.0) + params["c"][head]


def _clipped_term(params, head, d):
    """Written here: a term clipped at 3 (d arrives clipped), odd in d."""
    return params[head] * jnp.sin(0.7 * d.astype(jnp.float32))


def _mods() -> dict[str, jattn.ScoreMod]:
    rng = np.random.default_rng(5)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    mods = {
        label: built.mod
        for label, built in registry_mods.small_mods().items()
        if built.mod.distance is not None
    }
    return mods | {
        "tanh": jattn.ScoreMod.from_distance(_tanh_term, {"a": f(N), "c": f(N)}),
        "clipped": jattn.ScoreMod.from_distance(_clipped_term, f(N), max_distance=3),
    }


MODS = _mods()


def test_the_builtins_measured_faster_from_a_table_are_distance_mods():
    """T5, Shaw's bias, KERPLE and Sandwich read tables; ALiBi stays per logit
    (one multiply per logit measured faster: docs/benchmarks.md)."""
    names = {m.name for m in MODS.values()}
    assert {"t5", "shaw_bias", "kerple_log", "sandwich"} <= names
    assert not any(n.startswith("alibi") for n in names)


def _per_logit(mod: jattn.ScoreMod) -> jattn.ScoreMod:
    """The same mod without its distance form: every implementation runs it per logit."""
    return jattn.ScoreMod(mod.fn, mod.params, mod.name)


def _positions(layout: str):
    """`(arrays for normalise, is_causal)` of a layout of two rows of L tokens."""
    rng = np.random.default_rng(11)
    ar = np.arange(L, dtype=np.int32)
    if layout == "arange":
        return {}, True
    if layout == "packed":
        ids = np.stack([packed_ids([13, 20, 5], L), packed_ids([40], L)])
        pos = np.stack([packed_positions(r) for r in ids])
        return dict(q_segment_ids=ids, kv_segment_ids=ids, q_positions=pos, kv_positions=pos), True
    if layout == "shifted":  # each row its own offset, queries after the keys (a cache)
        q = np.stack([ar + 3, ar + 500])
        kv = np.stack([ar, ar + 480])
        return dict(q_positions=q, kv_positions=kv), False
    if layout == "random":  # sorted samples of [0, 400): wider than 2L - 1 distances
        pos = np.stack([np.sort(rng.choice(400, L, replace=False)) for _ in range(B)])
        return dict(q_positions=pos.astype(np.int32), kv_positions=pos.astype(np.int32)), True
    raise ValueError(layout)


LAYOUTS = ("arange", "packed", "shifted", "random")


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, L, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, L, KH, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, L, KH, H)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(B, L, N, H)), jnp.float32)
    return q, k, v, ct


@functools.cache
def _grad_fn(impl: str, is_causal: bool):
    """Jitted `(out, (dq, dk, dv, d mod))` of one implementation (shared compiles)."""
    run = implementation(impl)

    def f(q, k, v, mod, arrays, ct):
        def g(q, k, v, mod):
            nf = normal_form(q, k, v, score_mod=mod, is_causal=is_causal, **arrays)
            return run(nf, **OPTIONS.get(impl, {}))[0]

        out, vjp = jax.vjp(g, q, k, v, mod)
        return out, vjp(ct)

    return jax.jit(f)


def _run(impl, mod, layout):
    arrays, causal = _positions(layout)
    q, k, v, ct = _inputs()
    arrays = {n: jnp.asarray(x) for n, x in arrays.items()}
    out, (dq, dk, dv, dmod) = _grad_fn(impl, causal)(q, k, v, mod, arrays, ct)
    return out, dq, dk, dv, dmod.params


def _close(what, got, want, rtol=2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.all(np.isfinite(got)), what
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    err = float(np.max(np.abs(got - want), initial=0.0)) / scale
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"


def _compare(got, want):
    for name, g, w in zip(("out", "dquery", "dkey", "dvalue"), got[:4], want[:4], strict=True):
        _close(name, g, w)
    gp, wp = jax.tree.leaves(got[4]), jax.tree.leaves(want[4])
    assert len(gp) == len(wp) > 0
    for i, (g, w) in enumerate(zip(gp, wp, strict=True)):
        _close(f"dparams[{i}]", g, w)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("impl", ["xla", "chunked"])
@pytest.mark.parametrize("name", sorted(MODS))
def test_table_equals_per_logit_form_forward_and_backward(impl, name, layout):
    mod = MODS[name]
    _compare(_run(impl, mod, layout), _run(impl, _per_logit(mod), layout))


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_table_matches_float64_reference_with_parameter_gradients(impl):
    """The table path against the float64 oracle (the per-logit form materialised)."""
    mod = MODS["tanh"]
    arrays, causal = _positions("shifted")
    q, k, v, ct = _inputs()
    out, dq, dk, dv, dparams = _run(impl, mod, "shifted")
    out_ref, ref = oracle.attention_and_grads(
        np.asarray(q), np.asarray(k), np.asarray(v), is_causal=causal, score_mod=_per_logit(mod),
        cotangent=np.asarray(ct), **arrays,
    )  # fmt: skip
    _close("out", out, out_ref, 2e-4)
    for name, g in (("query", dq), ("key", dk), ("value", dv)):
        _close(name, g, ref[name], 2e-4)
    for leaf in ("a", "c"):
        _close(f"dparams[{leaf}]", dparams[leaf], ref["score_mod"][leaf], 2e-4)


def _spy_mod(calls: list):
    def term(params, head, d):
        calls.append(tuple(jnp.shape(d)))
        return params[head] * d.astype(jnp.float32)

    return jattn.ScoreMod.from_distance(term, jnp.linspace(0.1, 0.4, N, dtype=jnp.float32))


@pytest.mark.parametrize(
    "impl, layout, table_len",
    [
        ("xla", "arange", 2 * L - 1),
        ("chunked", "arange", 2 * 48 - 1),  # padded to 3 tiles of 16
        ("chunked", "shifted", 2 * L - 1),
    ],
)
def test_the_term_is_evaluated_once_per_call_on_its_table(impl, layout, table_len):
    """Traced, the distance fn sees one table of distances `[B', 1, D]`, never a tile."""
    calls = []
    mod = _spy_mod(calls)
    arrays, causal = _positions(layout)
    q, k, v, ct = _inputs()
    arrays = {n: jnp.asarray(x) for n, x in arrays.items()}

    def loss(q, mod):
        nf = normal_form(q, k, v, score_mod=mod, is_causal=causal, **arrays)
        return jnp.sum(implementation(impl)(nf, **OPTIONS[impl])[0] * ct)

    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, mod)
    # The per-logit fallback of a call whose positions could be too wide is
    # traced too (lax.cond); it sees whole tiles, once in each pass.
    tables = [c for c in calls if len(c) == 3 and c[1] == 1]
    assert tables and all(c[-1] == table_len for c in tables), calls
    if layout == "arange":
        assert calls == tables


def test_tabulate_bounds_cover_the_distances_or_say_they_do_not():
    mod = MODS["tanh"]
    q, k, v, _ = _inputs()
    for layout, want in (("shifted", True), ("packed", True), ("random", False)):
        arrays, _ = _positions(layout)
        nf = normal_form(q, k, v, score_mod=mod, **{n: jnp.asarray(x) for n, x in arrays.items()})
        table_mod, fits = distance_table.tabulate(nf, L, L)
        assert bool(fits) is want, layout
        qp, kp = arrays["q_positions"], arrays["kv_positions"]
        lo = np.asarray(table_mod.params["lo"])
        np.testing.assert_array_equal(lo, kp.min(1) - qp.max(1))
        if want:  # every distance of every row has its entry, and the entry is the term
            d = kp[:, None, :] - qp[:, :, None]
            assert d.min() >= 0 + lo.min() and np.all(d - lo[:, None, None] < 2 * L - 1)
            tab = np.asarray(table_mod.params["table"])  # [B, N, D]
            b = 1
            want_term = np.asarray(
                _tanh_term(mod.params, jnp.arange(N)[:, None], jnp.asarray(d[b].ravel())[None])
            )
            got_term = tab[b][:, (d[b] - lo[b]).ravel()]
            np.testing.assert_array_equal(got_term, want_term)


def test_a_clipped_mod_gets_a_2k_plus_1_table_whatever_the_positions():
    q, k, v, _ = _inputs()
    arrays, _ = _positions("random")
    nf = normal_form(
        q, k, v, score_mod=MODS["clipped"], **{n: jnp.asarray(x) for n, x in arrays.items()}
    )
    table_mod, fits = distance_table.tabulate(nf, L, L)
    assert fits is None and table_mod.params["table"].shape == (1, N, 7)
    np.testing.assert_array_equal(np.asarray(table_mod.params["lo"]), [-3])


def test_toeplitz_places_each_distance():
    t, s = 5, 7  # a window of t + s - 1 = 11 distances
    v = jnp.arange(t + s - 1, dtype=jnp.float32)
    got = np.asarray(distance_table.toeplitz(v, t, s))
    want = np.asarray(v)[np.arange(s)[None, :] - np.arange(t)[:, None] + t - 1]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        np.asarray(distance_table.toeplitz(v[:s], 1, s)), np.asarray(v[:s])[None]
    )


def test_from_distance_reuses_one_fn_per_form():
    a = positions.sandwich_score_mod(4)
    b = positions.sandwich_score_mod(4)
    assert a.fn is b.fn and a.distance == b.distance
    assert (
        positions.t5_score_mod(jnp.zeros((4, 12))).fn
        is positions.t5_score_mod(jnp.ones((4, 12))).fn
    )
    with pytest.raises(ValueError, match="max_distance"):
        jattn.ScoreMod.from_distance(_clipped_term, None, max_distance=-1)


# --------------------------------------------------------------------------------------
# Pallas with given (shifted) positions: the kernels run the per-logit form (no
# gather in Triton or Mosaic); default positions: tests/test_pallas_distance_table.py.


@functools.partial(jax.jit, static_argnames=("backend",))
def _pallas(q, k, v, mod, arrays, ct, *, backend):
    def f(q, k, v, mod):
        nf = normal_form(q, k, v, score_mod=mod, **arrays)
        block_k = L if backend == "tpu_interpret" else 16  # Mosaic: 128-multiples or all keys
        return fa.flash_attention(nf, block_q=16, block_k=block_k, backend=backend)[0]

    out, vjp = jax.vjp(f, q, k, v, mod)
    return out, vjp(ct)


@pytest.mark.parametrize("backend", ["interpret", "tpu_interpret"])
@pytest.mark.parametrize("name", ["tanh", "clipped", registry_mods.label_of("sandwich")])
def test_pallas_kernels_equal_the_table_path(backend, name):
    mod = MODS[name]
    arrays, _ = _positions("shifted")
    arrays = {n: jnp.asarray(x) for n, x in arrays.items()}
    q, k, v, ct = _inputs()
    out, (dq, dk, dv, dmod) = _pallas(q, k, v, mod, arrays, ct, backend=backend)
    want = _run("xla", mod, "shifted")  # the table path
    _compare((out, dq, dk, dv, dmod.params), want)


# --------------------------------------------------------------------------------------
# Sandwich against its formula in float64.


def _sandwich_f64(d: np.ndarray, num_heads: int, dim: int) -> np.ndarray:
    """`[N, *d.shape]`: (Σ_{k<dim/2} cos(d / 10000^(2k/dim)) - dim/2) * N / (8h), h = 1..N."""
    k = np.arange(dim // 2, dtype=np.float64)
    inner = np.cos(d[..., None].astype(np.float64) / 10_000.0 ** (2 * k / dim)).sum(-1)
    scale = num_heads / (8.0 * np.arange(1, num_heads + 1))
    return scale.reshape((-1,) + (1,) * d.ndim) * (inner - dim / 2)[None]


@pytest.mark.parametrize("num_heads, dim", [(4, 128), (12, 32)])
def test_sandwich_bias_is_its_float64_formula(num_heads, dim):
    d = np.arange(-700, 701)
    want = _sandwich_f64(d, num_heads, dim)
    got = np.asarray(positions.sandwich_bias(jnp.asarray(d), num_heads, dim))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * dim)
    mod = positions.sandwich_score_mod(num_heads, dim)
    table = np.asarray(jattn.score_mod.distance_table(mod, num_heads, jnp.asarray([-700]), 1401))
    np.testing.assert_allclose(table[0], want, rtol=0, atol=2e-5 * dim)


def test_sandwich_is_the_inner_product_of_sinusoidal_embeddings():
    pe = np.asarray(positions.sinusoidal(jnp.arange(64), 32), np.float64)  # [P, 32]
    inner = pe @ pe.T  # [P, P]
    d = np.arange(64)[:, None] - np.arange(64)[None, :]
    np.testing.assert_allclose(_sandwich_f64(d, 8, 32)[0] * 1.0 + 16, inner, atol=1e-4)


def test_sandwich_attention_matches_float64_with_the_bias_materialised():
    """Through chunked (the table) against the float64 oracle given the bias `[1, N, T, S]`."""
    mod = positions.sandwich_score_mod(N)
    q, k, v, ct = _inputs()
    out, dq, dk, dv, _ = _run("chunked", mod, "arange")
    d = np.arange(L)[None, :] - np.arange(L)[:, None]
    bias = _sandwich_f64(d, N, 128)[None]  # [1, N, T, S]
    out_ref, grads = oracle.attention_and_grads(
        np.asarray(q), np.asarray(k), np.asarray(v), bias=bias, is_causal=True,
        cotangent=np.asarray(ct),
    )  # fmt: skip
    _close("out", out, out_ref, 2e-4)
    for name, g in (("query", dq), ("key", dk), ("value", dv)):
        _close(name, g, grads[name], 2e-4)
