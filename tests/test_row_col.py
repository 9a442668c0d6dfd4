"""Row and column terms (`row_col_bias=(a, c)`, docs/score_mods.md): logit
(b, n, i, j) gains `a[b, n, i] + c[b, n, j]`, read per tile in O(T + S).

Every check is against the independent float64 oracle (tests/oracle.py) fed
the materialised bias `a[:, :, :, None] + c[:, :, None, :]`: the output and
the gradients to q, k, v and to a and c (the oracle's dbias summed over keys
and over queries), through xla and chunked in float64 and through both Pallas
kernel families in float32, in interpret mode (the Triton kernels, split and
fused backward, and the Mosaic ones), with tiles smaller than the problem
and not dividing it (so padding and skipped tiles are exercised), causal,
packed, cross-attention, GQA and MQA. A row term alone cancels in the
softmax (its gradient is 0); under a nonlinear score mod (soft-capping,
applied after the terms) it does not, so the kernels' row sums are checked
against a gradient that is not 0 there. The kernels' backward holds nothing
`[T, S]`, and terms that need no gradient cost no sums (the jaxpr says so),
and the kernels lower for CUDA and for TPU on this host.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from attention_cases import normal_form
from flash_harness import cuda_target, intermediate_shapes, kernel_outputs

import jattn
from jattn import positions
from jattn.attention.chunked import attention_chunked
from jattn.attention.pallas.flash_attention import flash_attention
from jattn.attention.xla import attention_xla

B, T, S, N, K, H = 2, 19, 19, 4, 2, 8


def _packed():
    ids = np.array([[1] * 7 + [2] * 9 + [0] * 3, [1] * 12 + [2] * 7], np.int32)
    pos = np.zeros_like(ids)
    for r in range(ids.shape[0]):
        for i in range(1, ids.shape[1]):
            pos[r, i] = pos[r, i - 1] + 1 if ids[r, i] == ids[r, i - 1] else 0
    return dict(q_segment_ids=ids, kv_segment_ids=ids, q_positions=pos, kv_positions=pos)


LAYOUTS = {
    "causal": lambda: dict(is_causal=True),
    "packed": _packed,
    "packed_causal": lambda: dict(_packed(), is_causal=True),
    "cross": lambda: {},
}


def _problem(seed, t=T, s=S, kv_heads=K):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, N, H))
    k = rng.normal(size=(B, s, kv_heads, H))
    v = rng.normal(size=(B, s, kv_heads, H))
    a = rng.normal(size=(B, N, t))
    c = rng.normal(size=(B, N, s))
    ct = rng.normal(size=(B, t, N, H))
    return q, k, v, a, c, ct


IMPLS = {
    "xla": attention_xla,
    # tiles that do not divide 19 and differ by axis: padding, skipped tiles
    "chunked": lambda nf: attention_chunked(nf, block_q=5, block_k=4),
}


def _vjp(attend, dtype, q, k, v, a, c, ct, mod=None, **kw):
    """Output and gradients (q, k, v, a, c, and the params of the score mod
    `mod`, one array, if given) of `attend(normal form)` with inputs in
    `dtype`, as float64 numpy; `kw` the call's other keywords."""

    def f(q, k, v, a, c, *params):
        mods = {} if mod is None else {"score_mod": dataclasses.replace(mod, params=params[0])}
        return attend(normal_form(q, k, v, row_col_bias=(a, c), **mods, **kw))[0]

    def run(ct, *args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(ct)

    args = (ct, q, k, v, a, c) + (() if mod is None else (mod.params,))
    with jax.enable_x64(dtype == jnp.float64):
        out, grads = jax.jit(run)(*(jnp.asarray(x, dtype) for x in args))
        return np.asarray(out, np.float64), [np.asarray(g, np.float64) for g in grads]


def _run(impl, q, k, v, a, c, ct, **kw):
    """Output and gradients (q, k, v, a, c) of xla or chunked, float64."""
    return _vjp(IMPLS[impl], jnp.float64, q, k, v, a, c, ct, **kw)


def _reference(q, k, v, a, c, ct, mod=None, **kw):
    """The oracle on the materialised bias; d a and d c are its dbias's row and
    column sums (and the params' gradient last, given a score mod `mod`)."""
    bias = a[:, :, :, None] + c[:, :, None, :]
    out, ref = oracle.attention_and_grads(q, k, v, bias=bias, score_mod=mod, cotangent=ct, **kw)
    grads = [ref["query"], ref["key"], ref["value"], ref["bias"].sum(-1), ref["bias"].sum(-2)]
    return out, grads + ([] if mod is None else [np.asarray(ref["score_mod"])])


def _close(got, want, what, rtol=1e-6):
    """Agreement up to `rtol` of the larger of 1 and the reference's largest
    value. Float64 (the default): the ~1e-7 that jattn's float64 path and the
    oracle differ by without any row or column term (a few orders below
    float32's)."""
    atol = rtol * max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def _assert_matches(got, want, rtol=1e-6):
    _close(got[0], want[0], "out", rtol)
    names = ("dq", "dk", "dv", "da", "dc", "dparams")[: len(want[1])]
    for name, g, r in zip(names, got[1], want[1], strict=True):
        _close(g, r, name, rtol)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_matches_the_materialised_bias_in_float64(impl, layout):
    t, s = (T, 11) if layout == "cross" else (T, S)
    q, k, v, a, c, ct = _problem(0, t, s)
    kw = LAYOUTS[layout]()
    _assert_matches(_run(impl, q, k, v, a, c, ct, **kw), _reference(q, k, v, a, c, ct, **kw))


def test_the_column_term_acts_and_the_row_term_cancels():
    """The check above could pass with terms never added: c changes the output
    and has a gradient; a row term shifts a whole softmax row, so it leaves
    the output unchanged and its gradient (a row sum of dS) is zero, as the
    oracle's is."""
    q, k, v, a, c, ct = _problem(1)
    kw = LAYOUTS["causal"]()
    with_terms = _run("chunked", q, k, v, a, c, ct, **kw)
    row_only = _run("chunked", q, k, v, a, 0 * c, ct, **kw)
    without = _run("chunked", q, k, v, 0 * a, 0 * c, ct, **kw)
    assert np.max(np.abs(with_terms[0] - without[0])) > 1e-2
    assert np.max(np.abs(with_terms[1][4])) > 1e-2
    _close(row_only[0], without[0], "out with a row term alone")
    _close(with_terms[1][3], np.zeros_like(a), "da")


def test_public_entry_point_and_its_errors():
    q, k, v, a, c, _ = _problem(2)
    q, k, v, a, c = (jnp.asarray(x, jnp.float32) for x in (q, k, v, a, c))
    bias = a[:, :, :, None] + c[:, :, None, :]
    want = jattn.dot_product_attention(q, k, v, bias, is_causal=True, implementation="xla")
    for impl in (None, "xla", "chunked", "pallas"):
        got = jattn.dot_product_attention(
            q, k, v, is_causal=True, row_col_bias=(a, c), implementation=impl
        )
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(impl))
    with pytest.raises(ValueError, match="row_col_bias's column term must have shape"):
        jattn.dot_product_attention(q, k, v, row_col_bias=(a, c[:, :, :3]))
    with pytest.raises(TypeError, match="row_col_bias must be a pair"):
        jattn.dot_product_attention(q, k, v, row_col_bias=a)
    with pytest.raises(ValueError, match="cannot take row_col_bias"):
        jattn.dot_product_attention(q, k, v, row_col_bias=(a, c), implementation="cudnn")


# --------------------------------------------------------------------------------------
# The Pallas kernels (interpret mode), float32 against the float64 oracle.

# Each kernel family's options: tiles smaller than the problem (T = 19) and not
# dividing it; the Mosaic key tile is a lane tile, 128, which holds a short
# problem's keys whole and splits the long cross-attention case's (S = 140) in two.
FAMILIES = {
    "triton": dict(backend="interpret", block_q=16, block_k=16),
    "triton_fused": dict(backend="interpret", block_q=16, block_k=16, backward="fused"),
    "mosaic": dict(backend="tpu_interpret", block_q=8, block_k=128),
}
F32_RTOL = 2e-5  # float32 kernels against float64: their sums' rounding, far above 1e-6
# The soft-cap of the cases with a score mod (its cap differentiated too):
# logits of a few units are bent.
CAP = 2.0

# name -> (family, layout, key length (None: T), kv heads (4 query heads), soft-capped)
PALLAS_CASES = {
    "triton-causal-gqa": ("triton", "causal", None, 2, False),
    "triton_fused-packed-softcap": ("triton_fused", "packed", None, 2, True),
    "triton-cross-mqa": ("triton", "cross", 11, 1, False),
    "mosaic-packed_causal-softcap": ("mosaic", "packed_causal", None, 2, True),
    "mosaic-cross-mqa-two_key_tiles": ("mosaic", "cross", 140, 1, False),
}


@pytest.mark.parametrize("case", list(PALLAS_CASES))
def test_pallas_kernels_match_the_materialised_bias(case):
    family, layout, s, kv_heads, capped = PALLAS_CASES[case]
    problem = _problem(3, T, s or T, kv_heads)
    # The oracle sees the float32 inputs the kernels see.
    q, k, v, a, c, ct = (np.asarray(x, np.float32).astype(np.float64) for x in problem)
    kw = LAYOUTS[layout]()
    mod = positions.softcap_score_mod(CAP) if capped else None
    attend = functools.partial(flash_attention, **FAMILIES[family])
    got = _vjp(attend, jnp.float32, q, k, v, a, c, ct, mod, **kw)
    want = _reference(q, k, v, a, c, ct, mod, **kw)
    if capped:  # the row term moves the output: its gradient is not 0 to check
        assert np.max(np.abs(want[1][3])) > 1e-2
    _assert_matches(got, want, F32_RTOL)


@pytest.mark.parametrize("family", ["triton", "mosaic"])
def test_distance_tiles_and_their_gradient_read_the_terms(family):
    """A distance-table mod with default positions (Shaw's bias term) reaches
    the kernels as Toeplitz tiles, and its table's gradient comes from a
    kernel of its own that recomputes dS (`triton_distance_grad`,
    `mosaic_distance_grad`): with the row and column terms in every logit,
    the output and every gradient, the table's included, are the oracle's."""
    q, k, v, a, c, ct = (np.asarray(x, np.float32).astype(np.float64) for x in _problem(5))
    table = np.random.default_rng(6).normal(size=(N, 9)).astype(np.float32)
    mod = positions.shaw_bias_score_mod(jnp.asarray(table), 4)
    attend = functools.partial(flash_attention, **FAMILIES[family])
    got = _vjp(attend, jnp.float32, q, k, v, a, c, ct, mod, is_causal=True)
    want = _reference(q, k, v, a, c, ct, mod, is_causal=True)
    _assert_matches(got, want, F32_RTOL)


def test_pallas_holds_nothing_quadratic_and_fixed_terms_cost_no_sums():
    """T = S = 64 (tiles of 16): no value of the forward and backward is
    `[T, S]`; the dq kernel returns dq and the row sums, the dk/dv kernel dk,
    dv and the column sums, and one output fewer each where a and c get no
    gradient."""
    t = 64
    q, k, v, a, c, _ = (jnp.asarray(x, jnp.float32) for x in _problem(4, t, t))

    def loss(q, a, c):
        nf = normal_form(q, k, v, is_causal=True, row_col_bias=(a, c))
        return jnp.sum(flash_attention(nf, **FAMILIES["triton"])[0])

    both = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, a, c)
    only_q = jax.make_jaxpr(jax.grad(loss))(q, a, c)
    quadratic = [x for x in intermediate_shapes(both) if sum(d >= t for d in x[0]) >= 2]
    assert not quadratic, quadratic[:5]
    assert kernel_outputs(both, "jattn_flash_dq") == [2]
    assert kernel_outputs(both, "jattn_flash_dkv") == [3]
    assert kernel_outputs(only_q, "jattn_flash_dq") == [1]
    assert kernel_outputs(only_q, "jattn_flash_dkv") == [2]


def _lowered(platform: str, backend: str, backward: str = "split") -> str:
    """StableHLO of the kernels' output and vjp (q, k, v, a, c), bf16, T = 200
    (not a multiple of the tiles), causal and packed, GQA 4 over 2, lowered
    for `platform` from abstract inputs."""
    sds = jax.ShapeDtypeStruct
    t, h = 200, 64
    args = (
        sds((1, t, N, h), jnp.bfloat16),
        sds((1, t, K, h), jnp.bfloat16),
        sds((1, t, K, h), jnp.bfloat16),
        sds((1, N, t), jnp.float32),
        sds((1, N, t), jnp.float32),
        sds((1, t), jnp.int32),
        sds((1, t, N, h), jnp.bfloat16),
    )

    def f(q, k, v, a, c, ids, ct):
        def g(q, k, v, a, c):
            nf = normal_form(
                q, k, v, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids, row_col_bias=(a, c)
            )
            return flash_attention(nf, backend=backend, backward=backward)[0]

        out, vjp = jax.vjp(g, q, k, v, a, c)
        return out, vjp(ct)

    if platform != "cuda":
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    jax.eval_shape(f, *args)  # host-side constants first (tests/flash_harness.py)
    with cuda_target():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "platform,backend,backward,kernels",
    [
        ("cuda", "gpu", "split", ("jattn_flash_fwd", "jattn_flash_dq", "jattn_flash_dkv")),
        ("cuda", "gpu", "fused", ("jattn_flash_fwd", "jattn_flash_bwd_fused")),
        (
            "tpu",
            "tpu",
            "split",
            ("jattn_flash_fwd_tpu", "jattn_flash_dq_tpu", "jattn_flash_dkv_tpu"),
        ),
    ],
)
def test_pallas_kernels_lower_for_cuda_and_tpu(platform, backend, backward, kernels):
    text = _lowered(platform, backend, backward)
    for kernel in kernels:
        assert kernel in text
