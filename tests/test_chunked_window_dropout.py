"""Contracts of the chunked path's sliding windows and attention dropout.

- Dropout: the chunked path drops exactly the weights the xla path drops
  (`jattn.dropout.keep` of `(rng, b, n, t, s)`), forward and backward, for
  every tiling; the keep rate is 1 - rate within a binomial bound; different
  rngs drop different weights.
- Windows: output and gradients equal a float64 oracle given the window as a
  dense boolean mask built here with numpy; a windowed call visits O(L·w)
  tiles (trip counts of the forward and backward loops).
- Eager calls under `jax_numpy_rank_promotion="raise"`, `jax.debug_nans` and
  `jax.debug_infs` run clean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    implementation,
    make_problem,
    normal_form,
    packed_ids,
    packed_positions,
    shaw,
)
from oracle import attention_and_grads

import jattn
from jattn.attention.chunked import attention_chunked, forward
from jattn.attention.chunked_backward import backward
from jattn.attention.chunked_problem import Residuals, TiledProblem

FP32_TOL = dict(rtol=2e-5, atol=2e-5)
GRAD_NAMES = ("query", "key", "value", "bias", "rel_key", "rel_value")


def run(impl, q, k, v, ct, *, options=None, bias=None, relative=None, **kw):
    """`(out, lse, grads)` of one implementation under jit; `kw` are the
    remaining `jattn.normalise` arguments (static ones are closed over)."""
    arrays = {n: x for n, x in kw.items() if isinstance(x, np.ndarray | jax.Array)}
    static = {n: x for n, x in kw.items() if n not in arrays}
    dist = None if relative is None else relative.max_distance

    def f(q, k, v, bias, rk, rv, arrays, ct):
        def g(q, k, v, bias, rk, rv):
            rel = None if dist is None else jattn.ShawRelative(rk, rv, dist)
            nf = normal_form(q, k, v, bias, relative=rel, **arrays, **static)
            return implementation(impl)(nf, **(options or {}))

        (out, lse), vjp = jax.vjp(g, q, k, v, bias, rk, rv)
        return out, lse, vjp((ct.astype(out.dtype), jnp.zeros_like(lse)))

    rk = rv = None
    if relative is not None:
        rk, rv = relative.key, relative.value
    out, lse, grads = jax.jit(f)(q, k, v, bias, rk, rv, arrays, ct)
    return (
        np.asarray(out),
        np.asarray(lse),
        {n: None if x is None else np.asarray(x) for n, x in zip(GRAD_NAMES, grads, strict=True)},
    )


def assert_same(got, ref, tol=FP32_TOL):
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = got, ref
    np.testing.assert_allclose(out, ref_out, **tol, err_msg="out")
    np.testing.assert_allclose(lse, ref_lse, **tol, err_msg="lse")
    for name in GRAD_NAMES:
        if ref_grads[name] is None:
            assert grads[name] is None, name
        else:
            np.testing.assert_allclose(grads[name], ref_grads[name], **tol, err_msg=f"d{name}")


# --- dropout: the chunked path drops exactly what the xla path drops ------------------

B, T, H = 2, 13, 8
DROPOUT_CASES = {
    # name: (heads (N, K), blocks, kwargs)
    "mha_causal": ((4, 4), (4, 5), dict(is_causal=True)),
    "gqa_plain_bias": ((4, 2), (8, 8), dict(bias="full")),
    "gqa_packed_shaw": ((4, 2), (3, 7), dict(is_causal=True, packed=True, shaw=True)),
    "mqa_broadcast_batch_window": (
        (4, 1),
        (5, 4),
        dict(dropout_broadcast_batch=True, local_window_size=(3, 2), shaw=True),
    ),
}


def dropout_case(name, rate=0.3, seed=0):
    (n, kh), blocks, spec = DROPOUT_CASES[name]
    spec = dict(spec)
    q, k, v = make_problem(20, B, T, T, n, kh, H, hv=6)
    rng = np.random.default_rng(20)
    kw = dict(dropout_rate=rate, dropout_rng=jax.random.key(seed))
    if spec.pop("bias", None):
        kw["bias"] = rng.normal(size=(B, n, T, T)).astype(np.float32)
    if spec.pop("packed", False):
        seg = np.stack([packed_ids([5, 6], T), packed_ids([13], T)])
        pos = np.stack([packed_positions(s) for s in seg])
        kw.update(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
    if spec.pop("shaw", False):
        kw["relative"] = shaw(20, n, H, 6, 2, per_head_key=True)
    kw.update(spec)
    ct = rng.normal(size=(B, T, n, 6)).astype(np.float32)
    return (q, k, v, ct), blocks, kw


@pytest.mark.parametrize("case", list(DROPOUT_CASES))
def test_dropout_matches_xla_forward_and_backward(case):
    """Same keep mask, same normaliser, same gradients (q, k, v, bias, Shaw
    tables) as the xla path, with ragged last tiles."""
    (q, k, v, ct), (bq, bk), kw = dropout_case(case)
    got = run("chunked", q, k, v, ct, options=dict(block_q=bq, block_k=bk), **kw)
    ref = run("xla", q, k, v, ct, **kw)
    assert_same(got, ref)
    # Dropout really is on: without it the output differs.
    kw_off = {n: x for n, x in kw.items() if n not in ("dropout_rate", "dropout_rng")}
    off = run("chunked", q, k, v, ct, options=dict(block_q=bq, block_k=bk), **kw_off)
    assert not np.allclose(off[0], got[0], atol=1e-3)


def kept_weights(rng_key, *, rate, b=2, n=2, t=64, s=48, broadcast=False, blocks=(16, 16)):
    """The chunked path's dropout factors `z[b, n, t, s]` read off its output:
    with all logits equal the weights are 1/s, and value s is the one-hot e_s,
    so `out[b, t, n, s] = z[b, n, t, s] / s`."""
    q = jnp.zeros((b, t, n, 4))
    k = jnp.zeros((b, s, 1, 4))
    v = jnp.broadcast_to(jnp.eye(s)[None, :, None, :], (b, s, 1, s))
    nf = normal_form(
        q,
        k,
        v,
        dropout_rate=rate,
        dropout_rng=rng_key,
        dropout_broadcast_batch=broadcast,
    )
    out, _ = attention_chunked(nf, block_q=blocks[0], block_k=blocks[1])
    return np.asarray(out).transpose(0, 2, 1, 3) * s  # [B, N, T, S]


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_keep_rate_and_rng_dependence(rate):
    z = kept_weights(jax.random.key(1), rate=rate)
    mult = 1.0 / (1.0 - rate)
    kept = np.isclose(z, mult, rtol=1e-5)
    assert np.all(kept | (z == 0.0)), "every weight is either dropped or scaled by 1/(1-rate)"
    n = z.size
    sigma = np.sqrt(n * rate * (1 - rate))
    assert abs(kept.sum() - n * (1 - rate)) <= 5 * sigma, (kept.mean(), 1 - rate)
    # The mask is a function of the rng (and not of the tiling).
    again = kept_weights(jax.random.key(1), rate=rate, blocks=(7, 48))
    np.testing.assert_array_equal(again, z)
    other = kept_weights(jax.random.key(2), rate=rate) > 0
    assert 0.3 * n * rate < (other != kept).sum()  # about 2·rate·(1-rate)·n differ
    # Batch rows and heads get their own masks unless broadcast over the batch.
    assert (kept[0] != kept[1]).any() and (kept[:, 0] != kept[:, 1]).any()
    shared = kept_weights(jax.random.key(1), rate=rate, broadcast=True) > 0
    np.testing.assert_array_equal(shared[0], shared[1])


# --- sliding windows against the float64 oracle ---------------------------------------


def window_mask(q_pos, kv_pos, left, right):
    """jax.nn's local window on positions, `[B, 1, T, S]`, in plain numpy."""
    d = np.asarray(kv_pos)[:, None, :] - np.asarray(q_pos)[:, :, None]  # [B, T, S]
    return ((d >= -left) & (d <= right))[:, None]


WINDOW_CASES = {
    # name: (T, S, heads, window, blocks, kwargs)
    "int_causal": (21, 21, (4, 2), 4, (4, 5), dict(is_causal=True)),
    "left_right": (19, 19, (2, 2), (2, 5), (8, 8), {}),
    "cross_left_only": (11, 23, (4, 1), (6, 0), (4, 5), {}),
    "packed_causal_shaw": (24, 24, (4, 2), 3, (5, 4), dict(is_causal=True, packed=True, shaw=True)),
    "right_only_shaw_bias": (17, 17, (2, 1), (0, 4), (4, 4), dict(shaw=True, bias=True)),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_window_matches_float64_oracle(case):
    t, s, (n, kh), window, (bq, bk), spec = WINDOW_CASES[case]
    spec = dict(spec)
    q, k, v = make_problem(30, B, t, s, n, kh, H, hv=6)
    rng = np.random.default_rng(30)
    ct = rng.normal(size=(B, t, n, 6))
    q_pos = np.broadcast_to(np.arange(t), (B, t))
    kv_pos = np.broadcast_to(np.arange(s), (B, s))
    kw = {}
    if spec.pop("packed", False):
        seg = np.stack([packed_ids([9, 11], t), packed_ids([24], t)])
        q_pos = kv_pos = np.stack([packed_positions(x) for x in seg])
        kw.update(q_segment_ids=seg, kv_segment_ids=seg, q_positions=q_pos, kv_positions=kv_pos)
    if spec.pop("shaw", False):
        kw["relative"] = shaw(30, n, H, 6, 2)
    if spec.pop("bias", False):
        kw["bias"] = rng.normal(size=(1, n, t, s)).astype(np.float32)
    kw.update(spec)
    left, right = (window, window) if isinstance(window, int) else window
    out, _, grads = run(
        "chunked",
        q,
        k,
        v,
        ct,
        options=dict(block_q=bq, block_k=bk),
        local_window_size=window,
        **kw,
    )
    ref, ref_grads = attention_and_grads(
        q, k, v, cotangent=ct, mask=window_mask(q_pos, kv_pos, left, right), **kw
    )
    np.testing.assert_allclose(out, ref, **FP32_TOL, err_msg="out")
    for name in GRAD_NAMES:
        if ref_grads[name] is None:
            assert grads[name] is None, name
        else:
            np.testing.assert_allclose(grads[name], ref_grads[name], **FP32_TOL, err_msg=name)
    # The window matters: without it the answer is different.
    ref_full, _ = attention_and_grads(q, k, v, **kw)
    assert not np.allclose(out, ref_full, atol=1e-3)


def test_window_with_shaw_uses_every_tile_body():
    """A long causal window with Shaw terms exercises every tile body (per
    element; FULL with one constant relative id; PARTIAL at the window's edge
    with one constant relative id) and still equals the float64 oracle, and,
    with dropout, the xla path."""
    t, (bq, bk), window, k = 64, (8, 8), (40, 0), 3
    q, kk, v = make_problem(31, 1, t, t, 2, 1, 4)
    kw = dict(is_causal=True, relative=shaw(31, 2, 4, 4, k))
    nf = normal_form(q, kk, v, local_window_size=window, **kw)
    branches = np.asarray(TiledProblem(nf, bq, bk).plan.branch)
    assert set(np.unique(branches)) == {0, 1, 2, 3}, np.bincount(branches.ravel())
    ct = np.random.default_rng(31).normal(size=(1, t, 2, 4))
    opts = dict(block_q=bq, block_k=bk)
    out, _, grads = run("chunked", q, kk, v, ct, options=opts, local_window_size=window, **kw)
    pos = np.arange(t)[None]
    ref, ref_grads = attention_and_grads(
        q, kk, v, cotangent=ct, mask=window_mask(pos, pos, *window), **kw
    )
    np.testing.assert_allclose(out, ref, **FP32_TOL, err_msg="out")
    for name in ("query", "key", "value", "rel_key", "rel_value"):
        np.testing.assert_allclose(grads[name], ref_grads[name], **FP32_TOL, err_msg=name)
    kw.update(local_window_size=window, dropout_rate=0.2, dropout_rng=jax.random.key(3))
    assert_same(run("chunked", q, kk, v, ct, options=opts, **kw), run("xla", q, kk, v, ct, **kw))


# --- a windowed call costs O(L·w): trip counts of the tile loops ------------------------


def trips(length, *, window, is_causal, block=8):
    """Query-tile trips of the forward and key-tile trips of the backward."""
    q, k, v = make_problem(40, 1, length, length, 2, 2, 4)
    nf = normal_form(q, k, v, is_causal=is_causal, local_window_size=window)
    pb = TiledProblem(nf, block, block)
    ft = forward(pb)
    grads = backward(
        Residuals(nf, ft.out, ft.lse, ft.pr), jnp.ones(q.shape), block_q=block, block_k=block
    )
    return np.asarray(ft.trips), np.asarray(grads.trips)


def test_windowed_call_visits_only_tiles_inside_the_window():
    """Causal window (w, 0) with 8x8 tiles: each query tile visits at most
    ceil(w/8) + 1 key tiles and each key tile as many query tiles, so the
    work doubles when L doubles (O(L·w)), while full causal attention grows
    four-fold (O(L²))."""
    w, block = 16, 8
    per_tile = w // block + 1
    fwd_256, bwd_256 = trips(256, window=(w, 0), is_causal=True)
    fwd_512, bwd_512 = trips(512, window=(w, 0), is_causal=True)
    assert fwd_256.max() <= per_tile and bwd_256.max() <= per_tile
    assert fwd_512.max() <= per_tile and bwd_512.max() <= per_tile
    n256, n512 = 256 // block, 512 // block
    assert fwd_256.sum() == bwd_256.sum() == n256 * per_tile - (per_tile - 1) * per_tile // 2
    assert fwd_512.sum() == bwd_512.sum() == n512 * per_tile - (per_tile - 1) * per_tile // 2
    full_256, _ = trips(256, window=None, is_causal=True)
    full_512, _ = trips(512, window=None, is_causal=True)
    assert full_256.sum() == n256 * (n256 + 1) // 2  # causal alone: the lower triangle
    assert full_512.sum() > 3.9 * full_256.sum()
    assert fwd_512.sum() < 2.1 * fwd_256.sum()


# --- eager, under rank-promotion "raise", debug_nans and debug_infs ----------------------


@pytest.mark.parametrize("blocks", [None, (4, 3)], ids=["public_entry", "tiles_4x3"])
def test_eager_calls_are_clean_under_strict_numerics(blocks):
    """No implicit rank promotion, no NaN and no Inf anywhere (every primitive
    is checked eagerly), with a user mask that hides a whole query row,
    causal, a window, segments, Shaw terms and dropout, forward and backward,
    through the public entry point and with small tiles (skipped, FULL and
    PARTIAL tiles); the results equal the jitted xla path's."""
    t, n, kh = 12, 4, 2
    q, k, v = make_problem(50, B, t, t, n, kh, 4)
    q = 30.0 * q  # large logits: exp(s - lse) must never see a hidden entry
    mask = np.ones((B, 1, t, t), bool)
    mask[0, :, 3] = False  # query row 3 of batch row 0 sees nothing
    seg = np.stack([packed_ids([7, 5], t), packed_ids([12], t)])
    pos = np.stack([packed_positions(x) for x in seg])
    kw = dict(
        mask=mask,
        is_causal=True,
        local_window_size=(4, 0),
        q_segment_ids=seg,
        kv_segment_ids=seg,
        q_positions=pos,
        kv_positions=pos,
        relative=shaw(50, n, 4, 4, 2),
        dropout_rate=0.25,
        dropout_rng=jax.random.key(5),
    )
    ct = np.random.default_rng(50).normal(size=(B, t, n, 4)).astype(np.float32)

    def loss(impl, q, k, v):
        if impl == "chunked" and blocks is not None:
            nf = normal_form(q, k, v, **kw)
            out, _ = attention_chunked(nf, block_q=blocks[0], block_k=blocks[1])
        else:
            out = jattn.dot_product_attention(q, k, v, implementation=impl, **kw)
        return jnp.sum(out * ct), out

    grad = jax.grad(loss, argnums=(1, 2, 3), has_aux=True)
    with jax.numpy_rank_promotion("raise"), jax.debug_nans(True), jax.debug_infs(True):
        (dq, dk, dv), out = grad("chunked", jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
        dq, dk, dv, out = (np.asarray(x) for x in (dq, dk, dv, out))
    assert np.all(out[0, 3] == 0.0) and np.all(dq[0, 3] == 0.0)
    (rq, rk, rv), ref = jax.jit(grad, static_argnums=0)("xla", q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


# --- the sliding-window benchmark mode runs and reports the growth ratio ---------------


def test_bench_window_mode_reports_growth(tmp_path, capsys):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "attention.py")
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "window.csv"
    argv = ["--window", "8", "--lengths", "32", "64", "--heads", "1", "--head-dim", "8"]
    assert bench.main(argv + ["--repeats", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "local_window_size=(8, 0)" in printed
    rows = out.read_text().strip().splitlines()
    assert len(rows) == 1 + 2 * 3  # header, 2 lengths x 3 implementations, fwd+bwd
    growth = printed[printed.index("| implementation | pass | ms at L=32") :].splitlines()
    assert len(growth) == 2 + 3
    for line in growth[2:]:
        ratio = float(line.strip("| ").split("|")[-1])
        assert ratio > 0
