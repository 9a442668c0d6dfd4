"""A `jattn.ScoreMod` inside the flash kernels: per tile, forward and backward.

The kernels call a score mod on each tile's scaled natural logits (after
Shaw's key term and the bias, before visibility), as
`fn(params, s [bq, bk], batch, head, q_pos [bq, 1], kv_pos [1, bk])` with
`batch` / `head` the program's scalars. The params' leaves are small
whole-array kernel inputs, read once per program. No `[T, S]` array of
the term exists anywhere.

Backward: the kernels recompute the tile's logits, take `jax.vjp` of `fn`
on the tile and pull the score gradient `dS` back through it: to `score`
(elementwise, so `dS_raw = dS * ∂fn/∂score`, which then reaches q and k) and,
in the dq kernels, to every float params leaf. The params' gradient is a
per-program partial sum (the dq kernel's program owns one query tile of
one head and loops over its key tiles), written as an output
`[nT, B, N, *leaf]` and summed after the kernel: no atomics, deterministic.
It is computed inside the kernels, not by a second pass outside, because
the vjp of a lowerable `fn` is itself made of lowerable primitives (the
transposes of broadcasts, elementwise ops, selects and sums), so the
kernels' own recomputation of the weights is reused.

Lowering. Triton (and Mosaic for what it lowers) has no gather, no
dynamic or static slicing of values. A score mod written as for scalars
indexes its params by `head` (`slopes[head]`, a `dynamic_slice`) or by a
static index (`w[0]`, a `slice`), so `fn` is traced to a jaxpr and
re-evaluated with those two primitives replaced by one-hot
compare-and-sums over the (small) parameter axis (`lowerable`); their
transposes are selects, which lower too. Any other primitive is bound as
is, except custom_jvp calls (`jax.nn.relu`, `softplus`), whose bodies and
jvp rules are both rewritten, so derivatives stay jax.nn's (relu's at 0).
Triton tensors must have power-of-two sizes: a leaf whose size is not one
(a Shaw bias table `[N, 2k+1]`, ALiBi slopes of 12 heads) goes to the
Triton kernels flattened and zero-padded, and fn may only index it
(`FlatLeaf`). Before the kernels are built, `score_mod_checks` traces the
rewritten `fn` and its vjp at the tile shapes and refuses what the chosen
backend cannot lower. A distance-table mod that the kernels read as Toeplitz tiles
(`distance_tiles`: default positions) never comes here, so its `fn` need
not lower.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from jattn.score_mod import ScoreMod, TileParts, tile_parts

Array = jax.Array

__all__ = [
    "ModSpec",
    "ScoreModLoweringError",
    "bind",
    "kernel_leaves",
    "mod_spec",
    "tile_backward",
    "usable_parts",
]


class ScoreModLoweringError(ValueError):
    """A score mod the Pallas kernels of the chosen backend cannot lower."""


@dataclasses.dataclass(frozen=True)
class ModSpec:
    """The static part of a score mod as the kernels see it (hashable).

    Attributes:
      fn: the ScoreMod's function.
      name: its name, for errors.
      treedef: the params' tree structure.
      shapes: each leaf's shape as given (rank 0 allowed).
      dtypes: each leaf's dtype.
      grad: whether the backward computes the params' gradient at all.
      min_rank: the least rank of a leaf inside the kernels: 1 for Triton
        (a block needs an axis), 2 for Mosaic (whose lowering of rank-1
        blocks depends on the chip's lane count; 2-D blocks of the whole
        array always lower).
      pow2: Triton: a leaf whose size is not a power of two (Triton tensors
        must be) goes to the kernels flattened and zero-padded to one, and
        fn may only index it (`FlatLeaf`).
    """

    fn: Callable[..., Array]
    name: str
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    grad: bool = True
    min_rank: int = 1
    pow2: bool = False

    @property
    def flat(self) -> tuple[bool, ...]:
        """Which leaves go flattened and padded to a power-of-two size."""
        return tuple(self.pow2 and not _is_pow2(math.prod(s)) for s in self.shapes)

    @property
    def kernel_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Leaf shapes inside the kernels: leading unit axes up to `min_rank`
        (the rewritten fn reshapes them back), or `(P,)` for a flat leaf."""
        return tuple(
            (_next_pow2(math.prod(s)),) if f else (1,) * max(0, self.min_rank - len(s)) + s
            for s, f in zip(self.shapes, self.flat, strict=True)
        )

    @property
    def differentiable(self) -> tuple[bool, ...]:
        """Which leaves get a gradient (the inexact ones)."""
        return tuple(bool(jnp.issubdtype(d, jnp.inexact)) for d in self.dtypes)


def mod_spec(mod: ScoreMod, backend: str) -> tuple[ModSpec, tuple[Array, ...]]:
    """`(spec, leaves)` of a score mod for the kernels of `backend`; leaves as
    arrays, in tree order."""
    leaves, treedef = jax.tree.flatten(mod.params)
    leaves = tuple(jnp.asarray(x) for x in leaves)
    spec = ModSpec(
        fn=mod.fn,
        name=mod.name,
        treedef=treedef,
        shapes=tuple(tuple(x.shape) for x in leaves),
        dtypes=tuple(x.dtype for x in leaves),
        min_rank=2 if backend in ("tpu", "tpu_interpret") else 1,
        pow2=backend in ("gpu", "interpret"),
    )
    return spec, leaves


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def kernel_leaves(spec: ModSpec, leaves) -> tuple[Array, ...]:
    """Leaves in their kernel shapes (`ModSpec.kernel_shapes`): reshaped, or
    flattened and zero-padded (differentiable: the gradient comes back
    through the same ops)."""
    out = []
    for x, shape, flat in zip(leaves, spec.kernel_shapes, spec.flat, strict=True):
        if flat:
            x = jnp.pad(jnp.reshape(x, (-1,)), (0, shape[0] - x.size))
        out.append(jnp.reshape(x, shape))
    return tuple(out)


class FlatLeaf:
    """A params leaf inside the Triton kernels whose size is not a power of two:
    its values flattened and zero-padded to `[P]`, P a power of two. fn may
    only index it (`x[head]`, `x[head, 3]`, `x[0]`): the rewrite reads the
    indexed elements from the flat array by a one-hot compare-and-sum."""

    def __init__(self, flat: Array, shape: tuple[int, ...], name: str):
        self.flat, self.shape, self.name = flat, tuple(shape), name

    def take(self, starts, sizes) -> Array:
        """`lax.dynamic_slice(x, starts, sizes)` of the unflattened leaf."""
        strides = [math.prod(self.shape[a + 1 :]) for a in range(len(self.shape))]
        base = jnp.zeros((), jnp.int32)
        for start, n, m, stride in zip(starts, self.shape, sizes, strides, strict=True):
            base = base + jnp.clip(jnp.asarray(start, jnp.int32), 0, n - m) * stride
        sizes = tuple(int(m) for m in sizes)
        p = self.flat.shape[0]
        zero = jnp.zeros((), self.flat.dtype)
        if math.prod(sizes) == 1:
            hit = lax.broadcasted_iota(jnp.int32, (p,), 0) == base
            return jnp.reshape(jnp.sum(jnp.where(hit, self.flat, zero)), sizes)
        offsets = jnp.broadcast_to(base, sizes)
        for a, (m, stride) in enumerate(zip(sizes, strides, strict=True)):
            if m > 1:
                offsets = offsets + lax.broadcasted_iota(jnp.int32, sizes, a) * stride
        hit = lax.broadcasted_iota(jnp.int32, (*sizes, p), len(sizes)) == offsets[..., None]
        flat = jnp.reshape(self.flat, (1,) * len(sizes) + (p,))
        return jnp.sum(jnp.where(hit, flat, zero), axis=-1)

    def refuse(self, prim: str):
        raise ScoreModLoweringError(
            f"ScoreMod {self.name!r} cannot run in the Pallas Triton kernels: a params leaf "
            f"of shape {list(self.shape)} has a size that is not a power of two (Triton "
            f"tensors must be), so fn may only index it (by head, batch or static "
            f"indices), not use it whole (primitive {prim!r}); pad it to a power of two"
        )


# --------------------------------------------------------------------------------------
# The rewrite: `fn` re-evaluated with slicing of values as one-hot sums.


def _take_window(x: Array, axis: int, start, size: int) -> Array:
    """`lax.dynamic_slice_in_dim(x, start, size, axis)` without slicing: a
    one-hot compare-and-sum over `axis` (start clamped as dynamic_slice does)."""
    n = x.shape[axis]
    if size == n:
        return x
    start = jnp.clip(jnp.asarray(start, jnp.int32), 0, n - size)
    zero = jnp.zeros((), x.dtype)
    if size == 1:
        hit = lax.broadcasted_iota(jnp.int32, x.shape, axis) == start
        if x.dtype == jnp.bool_:
            return jnp.any(hit & x, axis=axis, keepdims=True)
        return jnp.sum(jnp.where(hit, x, zero), axis=axis, keepdims=True).astype(x.dtype)
    moved = jnp.moveaxis(x, axis, -1)[..., None, :]  # [..., 1, n]
    hit = lax.broadcasted_iota(jnp.int32, (size, n), 1) == (
        start + lax.broadcasted_iota(jnp.int32, (size, n), 0)
    )  # [size, n]
    out = jnp.sum(jnp.where(hit, moved, zero), axis=-1).astype(x.dtype)  # [..., size]
    return jnp.moveaxis(out, -1, axis)


def _dynamic_slice(name: str, x, *starts, slice_sizes):
    for axis, (start, size) in enumerate(zip(starts, slice_sizes, strict=True)):
        x = _take_window(x, axis, start, size)
    return x


def _slice(name: str, x, *, start_indices, limit_indices, strides):
    if strides is not None and any(s != 1 for s in strides):
        raise ScoreModLoweringError(
            f"ScoreMod {name!r}: strided slices of a value cannot run in the Pallas kernels"
        )
    for axis, (lo, hi) in enumerate(zip(start_indices, limit_indices, strict=True)):
        x = _take_window(x, axis, lo, hi - lo)
    return x


def _refuse_gather(name: str, *args, **params):
    raise ScoreModLoweringError(
        f"ScoreMod {name!r} cannot run in the Pallas kernels: it gathers with an array "
        "index (primitive 'gather'); index params by `head`, `batch` or a static index and "
        "look tables up by a one-hot compare-and-sum over a static axis"
    )


_SUB_JAXPR = {"jit": "jaxpr", "pjit": "jaxpr"}


def _custom_jvp(name: str, eqn, invals):
    """A `custom_jvp_call` (jax.nn.relu, softplus, ...) with its body and its
    jvp rule both rewritten: inlining the body alone would change the
    derivative where the rule differs from the body's (relu's at 0)."""
    sub, n_consts = eqn.params["call_jaxpr"], eqn.params["num_consts"]
    jvp_fun = eqn.params["jvp_jaxpr_fun"]
    consts, args = invals[:n_consts], invals[n_consts:]

    @jax.custom_jvp
    def call(*xs):
        return tuple(_eval(name, sub.jaxpr, sub.consts, [*consts, *xs]))

    @call.defjvp
    def call_jvp(primals, tangents):
        jvp_jaxpr, jvp_consts, out_zeros = jvp_fun.call_wrapped(*([False] * len(primals)))
        out = _eval(name, jvp_jaxpr, jvp_consts, [*primals, *tangents])
        n_out = len(out_zeros)
        primals_out, nz = out[:n_out], iter(out[n_out:])
        tangents_out = [
            jnp.zeros(jnp.shape(p), jnp.result_type(p)) if z else next(nz)
            for p, z in zip(primals_out, out_zeros, strict=True)
        ]
        return tuple(primals_out), tuple(tangents_out)

    return list(call(*args))


def _eval(name: str, jaxpr, consts, args):
    """`jax.core.eval_jaxpr` with the rewrites above, inlining jit calls and
    rewriting custom_jvp bodies and rules (which may slice too)."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        prim = eqn.primitive.name
        flat = [x for x in invals if isinstance(x, FlatLeaf)]
        if flat and prim == "dynamic_slice" and len(flat) == 1 and invals[0] is flat[0]:
            outs = [flat[0].take(invals[1:], eqn.params["slice_sizes"])]
        elif flat and prim == "slice" and eqn.params["strides"] in (None, (1,) * len(invals)):
            lo, hi = eqn.params["start_indices"], eqn.params["limit_indices"]
            outs = [flat[0].take(lo, [b - a for a, b in zip(lo, hi, strict=True)])]
        elif flat:
            flat[0].refuse(prim)
        elif prim == "dynamic_slice":
            outs = [_dynamic_slice(name, *invals, **eqn.params)]
        elif prim == "slice":
            outs = [_slice(name, *invals, **eqn.params)]
        elif prim in ("gather", "dynamic_update_slice", "scatter", "scatter-add"):
            _refuse_gather(name)
        elif prim == "custom_jvp_call":
            outs = _custom_jvp(name, eqn, invals)
        elif prim in _SUB_JAXPR:
            sub = eqn.params[_SUB_JAXPR[prim]]
            outs = _eval(name, sub.jaxpr, sub.consts, invals)
        elif prim == "custom_vjp_call":
            sub = eqn.params["call_jaxpr"]
            outs = _eval(name, sub.jaxpr, sub.consts, invals)
        else:
            outs = eqn.primitive.bind(*invals, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _kernel_views(spec: ModSpec, leaves) -> list:
    """Kernel-shaped leaves as `fn` sees them: reshaped to their true shapes,
    or a `FlatLeaf` for a flattened one."""
    return [
        FlatLeaf(x, shape, spec.name) if flat else jnp.reshape(x, shape)
        for x, shape, flat in zip(leaves, spec.shapes, spec.flat, strict=True)
    ]


def _rewritten(spec: ModSpec, func: Callable[..., Any], leaves, *args):
    """`func(params, *args)` traced at the leaves' true shapes and evaluated
    with the rewrites (`_eval`) on the kernel-shaped `leaves`; its output tree."""

    def traced(leaves, *args):
        return func(jax.tree.unflatten(spec.treedef, leaves), *args)

    sds = jax.ShapeDtypeStruct
    avals = [sds(shape, d) for shape, d in zip(spec.shapes, spec.dtypes, strict=True)]
    avals = (avals, *(sds(jnp.shape(x), x.dtype) for x in args))
    closed, out_shapes = jax.make_jaxpr(traced, return_shape=True)(*avals)
    for c in closed.consts:
        if jnp.ndim(c) > 0:
            raise ScoreModLoweringError(
                f"ScoreMod {spec.name!r} cannot run in the Pallas kernels: fn captures an "
                f"array constant of shape {list(jnp.shape(c))}; pass it in params instead"
            )
    flat_args = jax.tree.leaves((_kernel_views(spec, leaves), *args))
    outs = _eval(spec.name, closed.jaxpr, closed.consts, flat_args)
    return jax.tree.unflatten(jax.tree.structure(out_shapes), outs)


def lowerable(spec: ModSpec) -> Callable[..., Array]:
    """`f(leaves, s, batch, head, q_pos, kv_pos) -> s`: `spec.fn` on kernel-shaped
    leaves, with value slicing rewritten as one-hot sums (see the module
    docstring). Float32 in and out; the index arrays are int32."""

    def f(leaves, s, batch, head, q_pos, kv_pos):
        args = (
            s.astype(jnp.float32),
            jnp.asarray(batch, jnp.int32),
            jnp.asarray(head, jnp.int32),
            jnp.asarray(q_pos, jnp.int32),
            jnp.asarray(kv_pos, jnp.int32),
        )
        out = _rewritten(spec, spec.fn, leaves, *args)
        out = jnp.asarray(out)
        if out.shape != s.shape:
            raise ValueError(
                f"ScoreMod {spec.name!r}: fn must return an array of score's shape "
                f"{list(s.shape)}, got {list(out.shape)}"
            )
        return out.astype(jnp.float32)

    return f


def bind(spec: ModSpec, leaves, batch, head, q_pos: Array, kv_pos: Array) -> Callable[..., Array]:
    """The score mod of one tile: `mod(s) -> s` and `mod(s, leaves=...)`.

    Args:
      spec: the static score mod.
      leaves: the params' leaves in kernel shapes (values read from refs).
      batch, head: int32 scalars of the program.
      q_pos, kv_pos: int32 `[bq, 1]`, `[1, bk]` positions of the tile.
    """
    index = (
        jnp.asarray(batch, jnp.int32),
        jnp.asarray(head, jnp.int32),
        jnp.asarray(q_pos, jnp.int32),
        jnp.asarray(kv_pos, jnp.int32),
    )
    parts = usable_parts(spec)
    if parts is None:
        f = lowerable(spec)

        def mod(s, leaves=leaves):
            return f(leaves, s, *index)

    else:

        def mod(s, leaves=leaves):
            views = _rewritten(spec, parts.views, leaves, *index)
            return s.astype(jnp.float32) + parts.core(views).astype(jnp.float32)

    mod.leaves = tuple(leaves)
    mod.index = index
    return mod


@functools.lru_cache(maxsize=64)
def usable_parts(spec: ModSpec) -> TileParts | None:
    """The mod's `TileParts` when the kernels can use them: attached to `fn`,
    and no flattened leaf (`FlatLeaf`, Triton's non-power-of-two leaves) is
    among the views, which `core` would use whole. Else None: `fn` with
    autodiff. Cached: every tile's `bind` and `tile_backward` asks."""
    parts = tile_parts(spec.fn)
    if parts is None or not any(spec.flat):
        return parts
    sds = jax.ShapeDtypeStruct
    probe = jax.make_jaxpr(
        lambda leaves: parts.views(
            jax.tree.unflatten(spec.treedef, leaves),
            0,
            0,
            jnp.zeros((1, 1), jnp.int32),
            jnp.zeros((1, 1), jnp.int32),
        )
    )
    closed = probe([sds(sh, d) for sh, d in zip(spec.shapes, spec.dtypes, strict=True)])
    whole = {v for v in closed.jaxpr.outvars if v in set(closed.jaxpr.invars)}
    flat_vars = {v for v, f in zip(closed.jaxpr.invars, spec.flat, strict=True) if f}
    return None if whole & flat_vars else parts


def tile_backward(
    spec: ModSpec, mod, raw: Array, ds: Array, with_params: bool
) -> tuple[Array, tuple[Array | None, ...] | None]:
    """Pull a tile's score gradient back through the score mod.

    Args:
      spec: the static score mod.
      mod: the tile's bound mod (`bind`).
      raw: float32 `[bq, bk]` logits before the mod (natural units).
      ds: float32 `[bq, bk]` gradient w.r.t. the modified logits (0 where
        invisible).
      with_params: also return the params' gradient of this tile.

    Returns:
      `(ds_raw, d_leaves)`: the gradient w.r.t. the raw logits (0 where `ds`
      is 0, so a non-finite derivative at an invisible entry cannot leak)
      and, with `with_params`, one float32 kernel-shaped array per leaf (None
      for integer leaves), else None.
    """
    diff = spec.differentiable if with_params else (False,) * len(mod.leaves)
    wrt = tuple(x for x, d in zip(mod.leaves, diff, strict=True) if d)
    parts = usable_parts(spec)
    if parts is not None:  # additive: the score's gradient passes through
        if not with_params:
            return ds, None

        def views_of(wrt_leaves):
            it = iter(wrt_leaves)
            leaves = tuple(next(it) if d else x for x, d in zip(mod.leaves, diff, strict=True))
            return tuple(_rewritten(spec, parts.views, leaves, *mod.index))

        views, pull = jax.vjp(views_of, wrt)
        d_views = tuple(
            jnp.asarray(g).astype(v.dtype)
            for g, v in zip(parts.core_vjp(views, ds), views, strict=True)
        )
        (d_wrt,) = pull(d_views)
        it = iter(d_wrt)
        return ds, tuple(next(it).astype(jnp.float32) if d else None for d in diff)

    def f(wrt_leaves, s):
        it = iter(wrt_leaves)
        leaves = tuple(next(it) if d else x for x, d in zip(mod.leaves, diff, strict=True))
        return mod(s, leaves=leaves)

    _, vjp = jax.vjp(f, wrt, raw)
    d_wrt, ds_raw = vjp(ds)
    ds_raw = jnp.where(ds == 0.0, 0.0, ds_raw)
    if not with_params:
        return ds_raw, None
    it = iter(d_wrt)
    d_leaves = tuple(next(it).astype(jnp.float32) if d else None for d in diff)
    return ds_raw, d_leaves
