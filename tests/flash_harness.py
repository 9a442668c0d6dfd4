"""Shared harness of the flash-kernel tests: inputs, the jitted kernel vjp,
the float64 oracle and the comparison with tolerances as tight as the dtype
allows. Used by tests/test_pallas.py (Triton kernels) and
tests/test_pallas_tpu.py (Mosaic kernels), both in interpret mode on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
from attention_cases import normal_form

import jattn
from jattn.attention.normal_form import EMPTY_ROW_LSE
from jattn.attention.pallas import flash_attention as fa
from jattn.attention.pallas.backend import cuda_target  # noqa: F401 (tests import it from here)

GRAD_NAMES = ("query", "key", "value", "bias", "rel_key", "rel_value")
F32_TOL = 2e-5
BF16_TOL = 3e-2


# --------------------------------------------------------------------------------------
# Harness.


def _relative(inputs: dict, max_distance: int):
    """The Shaw tables of `inputs` as a `jattn.ShawRelative`, or None."""
    if inputs.get("rel_key") is None and inputs.get("rel_value") is None:
        return None
    return jattn.ShawRelative(
        key=inputs.get("rel_key"), value=inputs.get("rel_value"), max_distance=max_distance
    )


def _normal_form(
    inputs: dict,
    *,
    is_causal: bool,
    max_distance: int,
    window=None,
    dropout_rate: float = 0.0,
    broadcast_batch: bool = False,
):
    rel = _relative(inputs, max_distance)
    return normal_form(
        inputs["query"],
        inputs["key"],
        inputs["value"],
        bias=inputs.get("bias"),
        mask=inputs.get("mask"),
        is_causal=is_causal,
        q_segment_ids=inputs.get("q_segment_ids"),
        kv_segment_ids=inputs.get("kv_segment_ids"),
        q_positions=inputs.get("q_positions"),
        kv_positions=inputs.get("kv_positions"),
        relative=rel,
        scale=None,
        local_window_size=window,
        dropout_rate=dropout_rate,
        dropout_rng=inputs.get("dropout_rng"),
        dropout_broadcast_batch=broadcast_batch,
    )


_STATIC = ("is_causal", "max_distance", "window", "dropout_rate", "broadcast_batch")


@functools.partial(
    jax.jit,
    static_argnames=(
        *_STATIC,
        "block_q",
        "block_k",
        "backend",
        "backward",
        "backward_blocks",
        "backward_tiles",
    ),
)
def _pallas_vjp(
    inputs,
    cotangent,
    *,
    is_causal,
    max_distance,
    block_q,
    block_k,
    backend="interpret",
    window=None,
    dropout_rate=0.0,
    broadcast_batch=False,
    backward="split",
    backward_blocks=None,
    backward_tiles=None,
):
    """Output and gradients of the differentiable inputs (None where absent);
    `backward` the kernel's backward variant ("split" or "fused"),
    `backward_blocks` its own tiles, `backward_tiles` each backward kernel's."""
    diff = {name: inputs.get(name) for name in GRAD_NAMES}
    kw = dict(window=window, dropout_rate=dropout_rate, broadcast_batch=broadcast_batch)

    def f(diff):
        nf = _normal_form({**inputs, **diff}, is_causal=is_causal, max_distance=max_distance, **kw)
        return fa.flash_attention(
            nf,
            block_q=block_q,
            block_k=block_k,
            backend=backend,
            backward=backward,
            backward_blocks=backward_blocks,
            backward_tiles=backward_tiles,
        )[0]

    out, vjp = jax.vjp(f, diff)
    return out, vjp(cotangent)[0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def _xla_vjp(inputs, cotangent, *, is_causal, max_distance, window, dropout_rate, broadcast_batch):
    """`_pallas_vjp` through the public entry with `implementation="xla"`."""
    diff = {name: inputs.get(name) for name in GRAD_NAMES}

    def f(diff):
        x = {**inputs, **diff}
        rel = _relative(x, max_distance)
        return jattn.dot_product_attention(
            x["query"],
            x["key"],
            x["value"],
            x.get("bias"),
            x.get("mask"),
            is_causal=is_causal,
            local_window_size=window,
            implementation="xla",
            q_segment_ids=x.get("q_segment_ids"),
            kv_segment_ids=x.get("kv_segment_ids"),
            q_positions=x.get("q_positions"),
            kv_positions=x.get("kv_positions"),
            relative=rel,
            dropout_rate=dropout_rate,
            dropout_rng=x.get("dropout_rng"),
            dropout_broadcast_batch=broadcast_batch,
        )

    out, vjp = jax.vjp(f, diff)
    return out, vjp(cotangent)[0]


def window_mask(inputs: dict, window) -> np.ndarray:
    """The local-window rule as a dense bool `[B, 1, T, S]` built with numpy
    (independently of jattn), for the oracle: key visible iff
    `q_pos - left <= kv_pos <= q_pos + right`."""
    b, t = np.shape(inputs["query"])[:2]
    s = np.shape(inputs["key"])[1]
    q_pos = inputs.get("q_positions")
    kv_pos = inputs.get("kv_positions")
    q_pos = np.broadcast_to(np.arange(t) if q_pos is None else np.asarray(q_pos), (b, t))
    kv_pos = np.broadcast_to(np.arange(s) if kv_pos is None else np.asarray(kv_pos), (b, s))
    left, right = (window, window) if np.ndim(window) == 0 else window
    d = kv_pos[:, None, :] - q_pos[:, :, None]  # [B, T, S]
    return ((d >= -left) & (d <= right))[:, None]


def _oracle(inputs: dict, cotangent, *, is_causal: bool, max_distance: int, window=None):
    as64 = lambda x: None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    rel = _relative({k: as64(inputs.get(k)) for k in ("rel_key", "rel_value")}, max_distance)
    mask = inputs.get("mask")
    if window is not None:
        near = window_mask(inputs, window)
        mask = near if mask is None else np.asarray(mask) & near
    return oracle.attention_and_grads(
        as64(inputs["query"]),
        as64(inputs["key"]),
        as64(inputs["value"]),
        bias=as64(inputs.get("bias")),
        mask=mask,
        is_causal=is_causal,
        q_segment_ids=inputs.get("q_segment_ids"),
        kv_segment_ids=inputs.get("kv_segment_ids"),
        q_positions=inputs.get("q_positions"),
        kv_positions=inputs.get("kv_positions"),
        relative=rel,
        cotangent=as64(cotangent),
    )


def _close(name: str, got, want, tol: float, absolute: bool = False):
    """Max error relative to the largest reference value (or absolute)."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    scale = 1.0 if absolute else max(float(np.max(np.abs(want))), 1e-6)
    err = float(np.max(np.abs(got - want))) / scale
    assert err <= tol, f"{name}: max error {err:.2e} (scale {scale:.2e}) > {tol:.0e}"


def _check(
    inputs,
    *,
    is_causal=False,
    max_distance=0,
    block_q=16,
    block_k=16,
    tol=F32_TOL,
    seed=0,
    backend="interpret",
    window=None,
    dropout_rate=0.0,
    broadcast_batch=False,
    backward="split",
    backward_blocks=None,
    backward_tiles=None,
):
    """Run pallas and the float64 oracle on `inputs`; compare output and every
    gradient. With dropout on, the reference is the xla path (the same keep
    mask; the oracle has no dropout), in float32.

    A bias without a key axis shifts whole rows of logits, which softmax
    ignores: its gradient is 0 up to rounding and is compared absolutely.
    """
    rng = np.random.default_rng(seed + 1000)
    q, v = inputs["query"], inputs["value"]
    cot = rng.standard_normal((*q.shape[:3], v.shape[-1])).astype(np.float32)
    cot = jnp.asarray(cot, q.dtype)
    kw = dict(
        is_causal=is_causal,
        max_distance=max_distance,
        window=window,
        dropout_rate=dropout_rate,
        broadcast_batch=broadcast_batch,
    )
    out, grads = _pallas_vjp(
        inputs,
        cot,
        block_q=block_q,
        block_k=block_k,
        backend=backend,
        backward=backward,
        backward_blocks=backward_blocks,
        backward_tiles=backward_tiles,
        **kw,
    )
    if dropout_rate:
        want, want_grads = _xla_vjp(inputs, cot, **kw)
        as64 = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
        want, want_grads = as64(want), {k: as64(g) for k, g in want_grads.items()}
    else:
        want, want_grads = _oracle(
            inputs, cot, is_causal=is_causal, max_distance=max_distance, window=window
        )
    assert out.dtype == q.dtype
    _close("out", out, want, tol)
    for name in GRAD_NAMES:
        if inputs.get(name) is None:
            continue
        assert grads[name].shape == np.shape(inputs[name]), name
        row_bias = name == "bias" and np.shape(inputs["bias"])[-1] == 1
        _close(f"d{name}", grads[name], want_grads[name], tol, absolute=row_bias)
    return out, grads


def _qkv(seed, b, t, s, n, kh, h, hv=None, dtype=np.float32, q_scale=1.0):
    rng = np.random.default_rng(seed)
    hv = hv or h
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)  # noqa: E731
    return {
        "query": jnp.asarray(q_scale * rng.standard_normal((b, t, n, h)).astype(np.float32), dtype),
        "key": arr(b, s, kh, h),
        "value": arr(b, s, kh, hv),
    }


def _packed(b: int, lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids (1, 2, ...; 0 = padding tail) and positions restarting per segment."""
    seg, pos = [], []
    for i, n in enumerate(lengths):
        seg += [i + 1] * n
        pos += list(range(n))
    return np.tile(np.int32(seg), (b, 1)), np.tile(np.int32(pos), (b, 1))


def _lower_vjp(platform: str, backend: str, dtype, *, t, h, causal, packed, shaw, bias_shape,
               mask_shape, window=None, dropout_rate=0.0, backward="split") -> str:  # fmt: skip
    """StableHLO text of the kernel's output and vjp, lowered for `platform`
    ("cuda" or "tpu") from abstract inputs: B = 1, N = 4 query heads over
    K = 2 kv heads, Shaw k = 16 (a per-head key table, a shared value table),
    optionally a local window and dropout."""
    b, n, kh = 1, 4, 2
    sds = jax.ShapeDtypeStruct
    args = {
        "query": sds((b, t, n, h), dtype),
        "key": sds((b, t, kh, h), dtype),
        "value": sds((b, t, kh, h), dtype),
    }
    if shaw:
        args["rel_key"] = sds((n, 33, h), jnp.float32)
        args["rel_value"] = sds((33, h), jnp.float32)
    if bias_shape:
        args["bias"] = sds(bias_shape, jnp.float32)
    if mask_shape:
        args["mask"] = sds(mask_shape, jnp.bool_)
    if packed:
        for name in ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions"):
            args[name] = sds((b, t), jnp.int32)
    if dropout_rate:
        args["dropout_rng"] = sds((2,), jnp.uint32)
    cot = sds((b, t, n, h), dtype)
    fn = functools.partial(
        _pallas_vjp.__wrapped__,
        is_causal=causal,
        max_distance=16,
        block_q=None,
        block_k=None,
        backend=backend,
        window=window,
        dropout_rate=dropout_rate,
        backward=backward,
    )
    if platform != "cuda":
        return jax.jit(fn).trace(args, cot).lower(lowering_platforms=(platform,)).as_text()
    # The trace's compile-time constants (the cached static block maps) are
    # evaluated on the host first: eager work cannot run under an abstract mesh.
    jax.eval_shape(fn, args, cot)
    with cuda_target():
        return jax.jit(fn).trace(args, cot).lower(lowering_platforms=("cuda",)).as_text()


def _equations(jaxpr):
    """Every equation of a jaxpr, those of its sub-jaxprs (a pallas_call's
    kernel, a loop's body) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


def intermediate_shapes(closed_jaxpr) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every value an equation produces, sub-jaxprs included:
    what a memory check reads (is anything `[T, S]`?)."""
    found = []
    for eqn in _equations(closed_jaxpr.jaxpr):
        for var in eqn.outvars:
            aval = getattr(var, "aval", None)
            if hasattr(aval, "shape"):
                found.append((tuple(aval.shape), str(aval.dtype)))
    return found


def kernel_outputs(closed_jaxpr, name: str) -> list[int]:
    """The number of outputs of each pallas_call named `name` in the jaxpr
    (what a gradient that is not wanted must not cost)."""
    return [
        len(eqn.outvars)
        for eqn in _equations(closed_jaxpr.jaxpr)
        if eqn.primitive.name == "pallas_call"
        and str(eqn.params.get("name", eqn.params.get("name_and_src_info"))) == name
    ]


def _debug_mode(setting: str):
    """The context manager of one strict jax setting."""
    if setting == "rank_promotion_raise":
        return jax.numpy_rank_promotion("raise")
    if setting == "debug_infs":
        return jax.debug_infs(True)
    if setting == "debug_nans":
        return jax.debug_nans(True)
    raise ValueError(setting)


def _check_debug_mode(
    setting: str, *, backend: str, block_q: int, block_k: int | None, backward: str = "split"
):
    """Eager (un-jitted) forward and backward of a causal, masked, windowed
    call with dropout and fully masked rows under a strict jax setting: it
    runs, and gives the xla path's output and gradients (computed outside the
    setting); dead rows are 0 with `EMPTY_ROW_LSE` and no gradient."""
    b, t, n, kh, h = 2, 40, 4, 2, 16
    inputs = _qkv(40, b, t, t, n, kh, h)
    rng = np.random.default_rng(41)
    mask = rng.random((b, 1, t, t)) > 0.2
    dead = [0, 7, 33]
    mask[:, :, dead] = False
    inputs["mask"] = mask
    inputs["dropout_rng"] = jax.random.PRNGKey(42)
    kw = dict(is_causal=True, max_distance=0, window=(9, 0), dropout_rate=0.25)
    cot = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    diff = {name: inputs[name] for name in ("query", "key", "value")}

    def f(diff):
        nf = _normal_form({**inputs, **diff}, **kw)
        return fa.flash_attention(
            nf, block_q=block_q, block_k=block_k, backend=backend, backward=backward
        )

    with _debug_mode(setting):
        (out, lse), vjp = jax.vjp(f, diff)
        grads = vjp((cot, jnp.zeros_like(lse)))[0]
    want, want_grads = _xla_vjp(inputs, cot, broadcast_batch=False, **kw)
    as64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    _close("out", out, as64(want), F32_TOL)
    for name in diff:
        _close(f"d{name}", grads[name], as64(want_grads[name]), F32_TOL)
    assert np.all(np.asarray(out)[:, dead] == 0.0)
    assert np.all(np.asarray(grads["query"])[:, dead] == 0.0)
    lse = np.asarray(lse)
    assert np.all(lse[:, dead] == EMPTY_ROW_LSE)
    live = np.setdiff1d(np.arange(t), dead)
    assert np.all(np.abs(lse[:, live]) < 1e3)
