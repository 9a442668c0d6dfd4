"""Stick-breaking attention: the materialised form against the paper's product
written as loops in numpy (float64), the tiled form against the materialised
one forward and backward, empty rows, extreme logits, and memory linear in L."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.attention import stick_breaking
from jattn.attention.memory import xla_attention_temp_bytes

SB = stick_breaking.stick_breaking_attention
SB_XLA = stick_breaking.stick_breaking_attention_xla


def product_oracle(q, k, v, q_seg, kv_seg):
    """`w_ij = beta_ij * prod_{j<k<=i visible} (1 - beta_ik)`, by loops (default positions)."""
    b, t, n, h = q.shape
    g = n // k.shape[2]
    out = np.zeros((b, t, n, v.shape[-1]))
    for bi in range(b):
        for hi in range(n):
            kh = hi // g
            for i in range(t):
                seen = [
                    j for j in range(min(i + 1, k.shape[1])) if q_seg[bi, i] == kv_seg[bi, j] != 0
                ]
                for j in seen:
                    beta = {
                        c: 1 / (1 + np.exp(-(q[bi, i, hi] @ k[bi, c, kh]) / np.sqrt(h)))
                        for c in seen
                    }
                    w = beta[j] * np.prod([1 - beta[c] for c in seen if c > j])
                    out[bi, i, hi] += w * v[bi, j, kh]
    return out


def inputs(seed, b=2, t=13, s=13, n=4, kv=2, h=8, ev=6, scale=1.0):
    r = np.random.default_rng(seed)
    q = r.normal(size=(b, t, n, h)) * scale
    k = r.normal(size=(b, s, kv, h)) * scale
    v = r.normal(size=(b, s, kv, ev))
    return q, k, v


def packed(b, length):
    """Two packed segments, then padding (id 0) at the end of row 0."""
    seg = np.ones((b, length), np.int32)
    seg[:, length // 2 :] = 2
    seg[0, -3:] = 0
    return seg


@pytest.mark.parametrize("segments", [False, True])
def test_materialised_equals_the_papers_product(segments):
    q, k, v = inputs(0)
    seg = packed(2, 13) if segments else np.ones((2, 13), np.int32)
    with jax.enable_x64(True):
        got = SB_XLA(q, k, v, q_segment_ids=seg, kv_segment_ids=seg)
    np.testing.assert_allclose(got, product_oracle(q, k, v, seg, seg), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("blocks", [(4, 4), (5, 3), (16, 16)])
def test_tiled_equals_materialised_forward_and_backward(segments, blocks):
    q, k, v = inputs(1)
    seg = packed(2, 13) if segments else None
    ct = np.random.default_rng(2).normal(size=(2, 13, 4, 6))
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg)
    with jax.enable_x64(True):
        want, want_vjp = jax.vjp(lambda *a: SB_XLA(*a, **kw), q, k, v)
        got, got_vjp = jax.vjp(
            lambda *a: SB(*a, **kw, block_q=blocks[0], block_k=blocks[1]), q, k, v
        )
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
        for name, g, w in zip("qkv", got_vjp(ct), want_vjp(ct), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-11, err_msg=f"d{name}")


def test_positions_decide_what_is_visible():
    """Cross-length causal by the positions given (queries at the last positions)."""
    q, k, v = inputs(3, t=5, s=11)
    qp = np.broadcast_to(np.arange(6, 11, dtype=np.int32), (2, 5))
    with jax.enable_x64(True):
        want = SB_XLA(q, k, v, q_positions=qp)
        got = SB(q, k, v, q_positions=qp, block_q=2, block_k=4)
        full = SB_XLA(q, k, v, q_positions=np.full((2, 5), 10, np.int32))
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
    assert np.abs(want - full).max() > 1e-3  # the positions mattered


@pytest.mark.parametrize("fn", [SB, SB_XLA])
def test_empty_rows_are_zero_with_finite_gradients(fn):
    q, k, v = inputs(4)
    q_seg = np.ones((2, 13), np.int32)
    q_seg[:, :4] = 3  # no key has segment 3
    q_seg[1, 5] = 0  # a padding query
    kv_seg = np.ones((2, 13), np.int32)
    with jax.enable_x64(True):
        run = lambda q, k, v: fn(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg)  # noqa: E731
        out = run(q, k, v)
        grads = jax.grad(lambda *a: jnp.sum(run(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    assert np.all(np.asarray(out)[:, :4] == 0) and np.all(np.asarray(out)[1, 5] == 0)
    assert np.abs(np.asarray(out)[:, 6:]).max() > 0
    assert all(np.isfinite(g).all() for g in grads)
    assert np.all(np.asarray(grads[0])[:, :4] == 0)


@pytest.mark.parametrize("x64", [False, True])
def test_extreme_logits_stay_finite(x64):
    """Logits of +-1e4: a key with beta = 1 takes the whole stick; float32 too."""
    q, k, v = inputs(5, h=1)
    q = np.sign(q) * 100.0  # logits = +-1e4 * |k| with k of unit scale, H = 1
    k = np.sign(k) * 100.0
    dtype = np.float64 if x64 else np.float32
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    with jax.enable_x64(x64):
        want = SB_XLA(q, k, v)
        got = SB(q, k, v, block_q=4, block_k=4)
        grads = jax.grad(lambda *a: jnp.sum(SB(*a, block_q=4, block_k=4)), argnums=(0, 1, 2))(
            q, k, v
        )
    assert np.isfinite(got).all() and all(np.isfinite(g).all() for g in grads)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Each query's weights are one-hot on its nearest key with a positive logit (or 0).
    s = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, 2, axis=2)).astype(np.float64)
    for bi, hi, i in [(0, 0, 12), (1, 3, 7)]:
        pos = [j for j in range(i + 1) if s[bi, hi, i, j] > 0]
        expect = v[bi, pos[-1], hi // 2] if pos else 0.0
        np.testing.assert_allclose(np.asarray(got)[bi, i, hi], expect, rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_one_line_errors():
    q, k, v = inputs(6, n=3)
    with pytest.raises(ValueError, match="must divide query heads"):
        SB(q, k, v)
    with pytest.raises(ValueError, match="q_segment_ids must be int"):
        SB_XLA(*inputs(6), q_segment_ids=np.ones((2, 4), np.int32))


def compiled_temp_bytes(fn, length, grad):
    q = jax.ShapeDtypeStruct((1, length, 4, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, length, 4, 64), jnp.float32)
    f = (lambda *a: jax.grad(lambda *b: jnp.sum(fn(*b)), argnums=(0, 1, 2))(*a)) if grad else fn
    return jax.jit(f).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("grad", [False, True])
def test_memory_is_linear_in_length(grad):
    """As tests/test_memory.py measures it (XLA's compiled temporary memory): the
    tiled form at L = 4096 is about twice its L = 2048 figure, and far below one
    `[B, N, L, L]` float32 array, where the materialised form is above it."""
    tiled = {n: compiled_temp_bytes(SB, n, grad) for n in (2048, 4096)}
    one_matrix = 4 * 4096 * 4096 * 4
    assert tiled[4096] < 2.5 * tiled[2048], tiled
    # The custom VJP's backward keeps the inputs, the output and one tile's arrays.
    assert tiled[4096] < one_matrix / (6 if grad else 8), (tiled, one_matrix)
    if not grad:
        assert compiled_temp_bytes(SB_XLA, 4096, False) > one_matrix
    if not grad:  # the same order as softmax's chunked path (tests/test_memory.py's measure)
        softmax = xla_attention_temp_bytes(1, 4, 4096, 4096, 64, implementation="chunked")
        assert tiled[4096] < 4 * softmax, (tiled, softmax)


def test_bench_reverse_scan_script_runs(capsys):
    """`benchmarks/attention.py --reverse-scan` times both forms beside softmax (tiny length)."""
    import pathlib
    import runpy

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "attention.py"
    main = runpy.run_path(str(path))["main"]
    assert main(["--reverse-scan", "--lengths", "64", "--block", "32", "--repeats", "1"]) == 0
    table = capsys.readouterr().out
    cells = ("softmax chunked", "stick-breaking", "cope", "cope, gathers", "stick-breaking xla")
    for cell in (*cells, "cope xla", "cope xla, gathers"):
        assert f"| {cell} |" in table
