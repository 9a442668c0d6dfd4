"""Device mesh, logical axis rules, and the shardings of the state and the batches.

Sharding is data: the config gives `mesh_shape`, the sizes of the mesh axes
``("data", "fsdp", "tensor")`` (one of them may be -1, filled from the device
count), and optionally `logical_axis_rules`. The model annotates parameters
and activations with logical names ("batch", "length", "embed", "heads",
"kv", "mlp", "vocab"); the rules map those names to mesh axes:

- batch  -> ("data", "fsdp"): rows are split over every data-parallel device;
- embed  -> "fsdp": parameters are sharded ZeRO-3 style along their model dim
  (an activation that already uses "fsdp" for its batch keeps embed whole,
  flax assigns each mesh axis once per array);
- heads, mlp, vocab -> "tensor": Megatron-style tensor parallelism;
- length, kv -> not sharded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jattn.train.parts import ConfigError

__all__ = [
    "BATCH_SPEC",
    "DEFAULT_RULES",
    "MESH_AXES",
    "abstract_state",
    "batch_sharding",
    "check_sizes",
    "fit_spec",
    "make_global_batch",
    "make_mesh",
    "resolve_mesh_shape",
    "state_shardings",
    "unbox_values",
]

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("length", None),
    ("kv", None),
)

# Batches are [B, L]; rows over every data-parallel device.
BATCH_SPEC = P(("data", "fsdp"), None)


def resolve_mesh_shape(mesh_shape: Sequence[int], num_devices: int) -> tuple[int, int, int]:
    """Fills a -1 in `mesh_shape` and checks the product equals `num_devices`.

    Raises:
      ConfigError: wrong length, more than one -1, a size < 1, or a product
        that does not equal the number of devices.
    """
    shape = tuple(int(s) for s in mesh_shape)
    if len(shape) != len(MESH_AXES):
        raise ConfigError(
            f"mesh_shape must give the sizes of {MESH_AXES}, got {shape} ({len(shape)} entries)"
        )
    fills = [i for i, s in enumerate(shape) if s == -1]
    if len(fills) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ConfigError(f"mesh_shape={shape}: sizes must be >= 1, with at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if fills:
        if num_devices % known:
            raise ConfigError(
                f"mesh_shape={shape}: {num_devices} devices are not divisible by {known}"
            )
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ConfigError(
            f"mesh_shape={shape} needs {math.prod(shape)} devices, but there are {num_devices} "
            f"({jax.process_count()} process(es))"
        )
    return shape


def make_mesh(mesh_shape: Sequence[int], devices: Sequence[Any] | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh with Auto axes over `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(mesh_shape, len(devices))
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        # Device layouts make_mesh cannot optimise (e.g. odd CPU counts): plain order.
        grid = np.asarray(devices, dtype=object).reshape(shape)
        return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """Drops the mesh axes of `spec` that do not divide the matching dim of `shape`.

    A parameter whose dim is not a multiple of the mesh axes it maps to (say 6
    heads on a tensor axis of 4) is replicated along that dim instead of
    failing to compile.
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    fitted = []
    for dim, entry in zip(shape, entries, strict=True):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        size = math.prod(mesh.shape[a] for a in axes)
        fitted.append(entry if axes and dim % size == 0 else None)
    return P(*fitted)


def state_shardings(abstract_boxed_state: Any, mesh: Mesh, rules: Sequence[Any]) -> Any:
    """NamedShardings for every leaf of a state whose params are flax-boxed.

    Args:
      abstract_boxed_state: `jax.eval_shape` of the state constructor, with
        `nn.LogicallyPartitioned` boxes around annotated parameters (and the
        optimiser moments derived from them).
      mesh: the device mesh.
      rules: logical axis rules, e.g. `DEFAULT_RULES`.

    Returns:
      A pytree with the structure of the *unboxed* state, NamedSharding leaves.
    """
    logical = nn.get_partition_spec(abstract_boxed_state)
    mesh_specs = nn.logical_to_mesh(logical, rules)
    shapes = unbox_values(abstract_boxed_state)
    return jax.tree.map(
        lambda spec, x: NamedSharding(mesh, fit_spec(spec, x.shape, mesh)),
        mesh_specs,
        shapes,
        is_leaf=lambda s: isinstance(s, P),
    )


def unbox_values(tree: Any) -> Any:
    """Removes flax's logical-axis boxes without applying sharding constraints."""
    return jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.meta.AxisMetadata) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of a `[B, L]` batch array."""
    return NamedSharding(mesh, BATCH_SPEC)


def make_global_batch(
    local: dict[str, np.ndarray], sharding: NamedSharding, *, replicated_input: bool = False
) -> dict[str, jax.Array]:
    """Turns this process's numpy batch into global jax arrays.

    Args:
      local: ``{name: [b, L]}`` numpy arrays.
      sharding: the target sharding (`batch_sharding`).
      replicated_input: True when every process holds the same *global* batch
        (evaluation); False when each process holds its own rows (training,
        global rows = b * process_count).
    """
    if replicated_input:
        return {
            k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in local.items()
        }
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def check_sizes(
    mesh: jax.sharding.Mesh, batch_size: int, eval_batch_size: int, grad_accum_steps: int
) -> None:
    """The global batch sizes (training, evaluation) and the training micro-batch
    against the data-parallel axes and the processes (before compiling)."""
    rows = mesh.shape["data"] * mesh.shape["fsdp"]
    nproc = jax.process_count()
    for key, size in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
        if size % rows:
            raise ConfigError(
                f"{key}={size} is not divisible by the data-parallel devices "
                f"data*fsdp={rows} of mesh {dict(mesh.shape)}"
            )
    if batch_size % nproc:
        raise ConfigError(f"batch_size={batch_size} is not divisible by {nproc} processes")
    micro = batch_size // grad_accum_steps
    if micro % rows:
        raise ConfigError(
            f"micro-batch batch_size/grad_accum_steps={micro} is not divisible by data*fsdp={rows}"
        )


def abstract_state(init_boxed, root: jax.Array, mesh, rules):
    """`(abstract state, state shardings)`: shapes, dtypes and shardings of the
    state, from the logical axis names of the boxed parameters (nothing is
    allocated)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_boxed = jax.eval_shape(init_boxed, root)
        shardings = state_shardings(abstract_boxed, mesh, rules)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        unbox_values(abstract_boxed),
        shardings,
    )
    return abstract, shardings
