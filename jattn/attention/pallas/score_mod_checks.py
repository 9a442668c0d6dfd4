"""Whether a score mod lowers in the flash kernels, and what its tile backward costs.

Both are read from the rewritten `fn` (`score_mod_tiles.bind`) and its vjp
(`score_mod_tiles.tile_backward`) traced once on one `[block_q, block_k]`
tile (`_tile_jaxprs`), before any kernel is built:

- `check_lowerable` refuses, naming the ScoreMod and the primitive, any
  primitive the chosen backend has no lowering rule for (`gather` for a
  table looked up with an array index, `sort`, ...); a captured array
  constant and a whole use of a flat leaf (`score_mod_tiles.FlatLeaf`) are
  refused by the rewrite itself while it is traced here. Interpret mode
  runs the same rewritten `fn` and is refused on the same grounds as the
  backend it emulates, so the CPU tests see what a GPU or TPU would;
- `backward_cost` counts the tile-valued operations of the vjp, which
  decides the backward's warps (`LIGHT_MOD_COST`, `backend.default_warps`),
  and `has_loop` whether the forward runs a loop, which narrows the float32
  forward's tiles (`backend.default_blocks`).

The backends' lowering rules are read from jax's private tables; where they
cannot be read nothing is refused (the lowering itself then fails).
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from jattn.attention.pallas.score_mod_tiles import (
    ModSpec,
    ScoreModLoweringError,
    bind,
    tile_backward,
)

__all__ = ["LIGHT_MOD_COST", "backward_cost", "check_lowerable", "has_loop"]

_TRITON_RULES = ("jax._src.pallas.triton.lowering", "triton_lowering_rules")
_MOSAIC_RULES = ("jax._src.pallas.mosaic.lowering", "lowering_rules")


def _rule_names(backend: str) -> set[str] | None:
    """Names of the primitives the backend's Pallas lowering has rules for,
    or None when jax's (private) tables cannot be read."""
    try:
        if backend in ("tpu", "tpu_interpret"):
            module, attr = _MOSAIC_RULES
            core_type = importlib.import_module("jax._src.pallas.mosaic.core").CoreType
            rules = getattr(importlib.import_module(module), attr)[core_type.TC]
        else:
            module, attr = _TRITON_RULES
            rules = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, KeyError):
        return None
    return {p.name for p in rules}


def _primitives(jaxpr, found: set[str]) -> set[str]:
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for sub in jex_core.jaxprs_in_params(eqn.params):
            _primitives(sub, found)
    return found


_ALWAYS_OK = {"pjit", "jit", "custom_jvp_call", "stop_gradient"}


# A mod whose traced tile backward has at most this many tile-valued
# operations is "light" (`backward.default_warps`): ALiBi 8, softcap 14,
# FIRE's loop 14, KERPLE 15, against T5's select chain 237 and Shaw's bias 232.
LIGHT_MOD_COST = 64


@functools.lru_cache(maxsize=64)
def _tile_jaxprs(spec: ModSpec, block_q: int, block_k: int):
    """The mod's forward and backward (the params' gradient included when
    `spec.grad`) traced on one `[block_q, block_k]` tile, after the rewrite:
    what `check_lowerable` and `backward_cost` read (traced once for both)."""
    sds = jax.ShapeDtypeStruct
    leaves = tuple(sds(s, d) for s, d in zip(spec.kernel_shapes, spec.dtypes, strict=True))
    tile = sds((block_q, block_k), jnp.float32)
    i32 = lambda shape: sds(shape, jnp.int32)  # noqa: E731
    idx = (i32(()), i32(()), i32((block_q, 1)), i32((1, block_k)))

    def forward(leaves, s, *idx):
        return bind(spec, leaves, *idx)(s)

    def backward(leaves, s, ds, *idx):
        return tile_backward(spec, bind(spec, leaves, *idx), s, ds, with_params=spec.grad)

    return (
        jax.make_jaxpr(forward)(leaves, tile, *idx),
        jax.make_jaxpr(backward)(leaves, tile, tile, *idx),
    )


def backward_cost(spec: ModSpec, block_q: int, block_k: int) -> int:
    """Tile-valued operations of the mod's backward on a `[block_q, block_k]`
    tile, the params' gradient included (top level: a loop body counts
    once): a proxy for how many tiles its vjp keeps live in the dq kernels,
    which decides their warps (`LIGHT_MOD_COST`)."""
    jaxpr = _tile_jaxprs(spec, block_q, block_k)[1].jaxpr
    shape = (block_q, block_k)
    return sum(1 for e in jaxpr.eqns for v in e.outvars if tuple(v.aval.shape) == shape)


def has_loop(spec: ModSpec) -> bool:
    """Whether the mod's forward on a tile runs a loop (FIRE's MLP over its
    hidden units, `jax.lax.fori_loop`): each iteration keeps tile-sized
    temporaries live beside the forward's accumulators, so the float32
    forward at head dim <= 64 takes narrower tiles (`backend.default_blocks`)."""
    return bool(_primitives(_tile_jaxprs(spec, 16, 16)[0].jaxpr, set()) & {"while", "scan"})


def check_lowerable(spec: ModSpec, backend: str, block_q: int, block_k: int) -> None:
    """Raise `ScoreModLoweringError` if the kernels of `backend` cannot run the
    score mod: its forward and its vjp are traced at the tile shapes (after
    the rewrite) and every primitive must have a lowering rule; a Triton
    leaf whose size is not a power of two may only be indexed (`FlatLeaf`)."""
    triton = backend in ("gpu", "interpret")
    family = "Triton" if triton else "Mosaic (TPU)"
    jaxprs = _tile_jaxprs(spec, block_q, block_k)
    rules = _rule_names(backend)
    if rules is None:
        return
    for closed in jaxprs:
        for prim in sorted(_primitives(closed.jaxpr, set())):
            if prim not in rules and prim not in _ALWAYS_OK:
                raise ScoreModLoweringError(
                    f"ScoreMod {spec.name!r} cannot run in the Pallas {family} kernels: "
                    f"primitive {prim!r} (in fn or its gradient) has no {family} lowering"
                )
