"""A seed axis: several runs that differ only by their seed, stacked into one state.

Seeds of one group share the model, the optimiser and the data set; they
differ in their random numbers (initialisation, dropout) and their data order.
So they can be one program: every leaf of the `TrainState` gets a leading seed
axis `[S, ...]`, each seed's training stream yields its own `[B, L]` batches,
stacked to `[S, B, L]`, and the train and eval steps are `jax.vmap`-ed over
that axis (`jattn.train.seed_program`). Seed `s` keeps exactly what a single run
with ``seed=s`` has: the root key ``key(s)``, the loader seeded with ``s``.

This file holds the pieces that need no loop (a seed's config is
`jattn.train.members.seed_config`): stacking and unstacking trees, shardings
with a seed axis, the train step over the seed axis, the stacked checkpoint
(the state plus every seed's data iterator), which configs cannot be vmapped,
and the memory a seed needs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jattn.data import checkpoint as data_ckpt
from jattn.train import checkpoints as ckpt
from jattn.train import steps
from jattn.train.config import ConfigError, config_to_dict, input_lengths

__all__ = [
    "SeedStreams",
    "batch_lengths",
    "memory_line",
    "over_seeds",
    "program_kind",
    "restore_stacked",
    "save_stacked",
    "seed_batch_sharding",
    "seed_train_step",
    "stack",
    "stacked_abstract",
    "take",
    "vmap_blockers",
]


# -- trees with a seed axis -------------------------------------------------------------


def stack(trees: Sequence[Any]) -> Any:
    """`S` trees of one structure -> one tree of `[S, ...]` numpy leaves."""
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def take(tree: Any, index: int) -> Any:
    """Seed `index`'s slice of a stacked tree (`[S, ...]` -> `[...]`)."""
    return jax.tree.map(lambda x: x[index], tree)


def _prepend(sharding: NamedSharding, axis: str | None) -> NamedSharding:
    return NamedSharding(sharding.mesh, P(axis, *sharding.spec))


def stacked_abstract(abstract_state: Any, shardings: Any, num_seeds: int, axis: str | None):
    """`(abstract state, shardings)` of the stacked state: `[S, ...]` leaves, the seed
    dim on mesh axis `axis` (None: replicated), the other dims as in one run.

    Raises:
      ConfigError: `axis` is used by a parameter's own sharding too (a mesh axis
        can shard one dim of an array only), or does not divide `num_seeds`.
    """
    stacked_shardings = jax.tree.map(lambda s: _prepend(s, axis), shardings)
    if axis is not None:
        size = next(iter(jax.tree.leaves(shardings))).mesh.shape[axis]
        if num_seeds % size:
            raise ConfigError(
                f"seed_mesh_axis={axis!r} has {size} devices, which do not divide {num_seeds} seeds"
            )
        for s in jax.tree.leaves(shardings):
            used = {a for e in s.spec for a in ((e,) if isinstance(e, str) else (e or ()))}
            if axis in used:
                raise ConfigError(
                    f"seed_mesh_axis={axis!r} also shards the parameters ({s.spec}): pick "
                    "an axis the parameters do not use, e.g. 'data'"
                )
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct((num_seeds, *x.shape), x.dtype, sharding=s),
        abstract_state,
        stacked_shardings,
    )
    return abstract, stacked_shardings


def seed_batch_sharding(mesh: jax.sharding.Mesh, axis: str | None) -> NamedSharding:
    """The sharding of a stacked `[S, B, L]` batch: seeds on `axis`, rows over the
    data-parallel axes it leaves free."""
    rows = tuple(a for a in ("data", "fsdp") if a != axis)
    return NamedSharding(mesh, P(axis, rows, None))


class SeedStreams:
    """Every seed's training iterator; `next` stacks their batches to `[S, B, L]`."""

    def __init__(self, iterators: Sequence[Iterator[dict[str, np.ndarray]]]):
        self.iterators = list(iterators)

    def __next__(self) -> dict[str, np.ndarray]:
        return stack([next(it) for it in self.iterators])


def program_kind(config: ml_collections.ConfigDict) -> str:
    """ "map" or "vmap": `config.seed_program`, with "auto" resolved.

    On the CPU, a batched matmul rounds differently from S unbatched ones and
    is no faster (the cores are already busy), and training amplifies last-bit
    differences to percent-level ones within a few hundred steps; `lax.map`
    runs each seed's own computation, bit for bit. An accelerator is filled by
    the batched form, and a seed axis sharded over devices needs it.
    """
    if config.seed_program != "auto":
        return config.seed_program
    if config.seed_mesh_axis or jax.default_backend() != "cpu":
        return "vmap"
    return "map"


def over_seeds(fn, kind: str, num_shared: int = 0):
    """`fn` mapped over the leading seed axis of its arguments, the last
    `num_shared` arguments shared by every seed (``jax.vmap`` or ``lax.map``)."""
    if kind == "vmap":

        def batched(*args):
            axes = (0,) * (len(args) - num_shared) + (None,) * num_shared
            return jax.vmap(fn, in_axes=axes)(*args)

        return batched

    def mapped(*args):
        split = len(args) - num_shared
        per_seed, shared = args[:split], args[split:]
        return jax.lax.map(lambda xs: fn(*xs, *shared), per_seed)

    return mapped


def seed_train_step(model, tx, schedule, config, mesh, seeds, batch_spec, kind, hparams=None):
    """`(state [S], batch [S, B, L], alive bool [S]) -> (state, metrics [S], alive)`.

    The single run's step over the seed axis (`kind`: "vmap" or "map"). With
    `hparams` (`jattn.train.members.hparam_arrays`: swept learning rates and
    warmups, ``[S]`` each), each member's optimiser is built from its own
    values (`jattn.train.optim.make_optimizer`); its state has the structure
    `tx`'s has. With `debug_nan_at_step`, only the seeds `debug_nan_seed`
    names (-1: all) get the poisoned step (a testing aid only; under vmap both
    steps are computed and one is selected).
    """
    from jattn.train.optim import make_optimizer  # noqa: PLC0415

    common = dict(
        label_smoothing=config.label_smoothing,
        grad_accum_steps=config.grad_accum_steps,
        micro_spec=None if config.grad_accum_steps == 1 else NamedSharding(mesh, batch_spec),
    )
    poisoned_seeds = [config.debug_nan_seed in (-1, s) for s in seeds]
    nan_at = config.debug_nan_at_step if any(poisoned_seeds) else 0

    def one(state, batch, poison, hp):
        t, s = make_optimizer(config, hp) if hp else (tx, schedule)
        clean = steps.make_train_step(model, t, s, **common)
        if nan_at <= 0:
            return clean(state, batch)
        nan_step = steps.make_train_step(model, t, s, **common, debug_nan_at_step=nan_at)
        return jax.lax.cond(poison, nan_step, clean, state, batch)

    poison = jnp.asarray(poisoned_seeds)  # [S]
    hp = {k: jnp.asarray(v, jnp.float32) for k, v in (hparams or {}).items()}  # [S] each

    def guarded(state, batch, alive, poison, hp):
        new, metrics = one(state, batch, poison, hp)
        ok = alive & jnp.isfinite(metrics["loss"])
        # A diverged seed keeps its last good state; the others are untouched bit for bit.
        new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)
        return new, metrics, ok

    over = over_seeds(guarded, kind)
    return lambda state, batch, alive: over(state, batch, alive, poison, hp)


def batch_lengths(config: ml_collections.ConfigDict) -> dict[str, int]:
    """Row length of every batch array the training loader yields."""
    input_len, _ = input_lengths(config)
    out = {}
    for name in ("", "_segment_ids", "_positions"):
        out["inputs" + name] = input_len
        out["targets" + name] = config.max_len
    return out


# -- the stacked checkpoint -------------------------------------------------------------


def save_stacked(
    mngr: ocp.CheckpointManager,
    step: int,
    state: Any,
    alive: Any,
    streams: SeedStreams,
    config: ml_collections.ConfigDict,
    seeds: Sequence[int],
    diverged: dict[str, str],
    metrics: dict[str, float] | None = None,
) -> None:
    """Starts an (async) save of the stacked state, the seeds still training, and
    every seed's data iterator (items ``data_0`` ... ``data_<S-1>``) at `step`.

    `metrics` are what retention ranks by (`SANE_STEP_METRIC`), as in
    `jattn.train.checkpoints.save`."""
    meta = {
        "config": config_to_dict(config),
        "signature": {**ckpt.signature(config), "seeds": [_key(s) for s in seeds]},
        "step": int(step),
        "diverged": diverged,
    }
    items = {
        "state": ocp.args.StandardSave({"state": state, "alive": alive}),
        "meta": ocp.args.JsonSave(meta),
    }
    for i, it in enumerate(streams.iterators):
        items[f"data_{i}"] = data_ckpt.save_args(it)
    mngr.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=True)


def restore_stacked(
    mngr: ocp.CheckpointManager, step: int, abstract: Any, streams: SeedStreams
) -> tuple[Any, Any, dict[str, Any]]:
    """Restores checkpoint `step`: `(state, alive, meta)`; the iterators in place.

    Args:
      abstract: ``{"state": stacked abstract state, "alive": abstract bool [S]}``.
    """
    items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
    for i, it in enumerate(streams.iterators):
        items[f"data_{i}"] = data_ckpt.restore_args(it)
    restored = mngr.restore(step, args=ocp.args.Composite(**items))
    return restored.state["state"], restored.state["alive"], dict(restored.meta)


def check_stacked_compatible(meta: dict[str, Any], config, seeds: Sequence[int], where: str):
    """Refuses a stacked checkpoint of other seeds or an incompatible config (one line)."""
    saved = dict(meta.get("signature") or {})
    saved_seeds = saved.pop("seeds", None)
    diffs = ckpt.incompatibilities(saved, config)
    if saved_seeds != [_key(s) for s in seeds]:
        diffs.append(f"seeds: checkpoint {saved_seeds!r} != config {list(seeds)!r}")
    changes = ckpt.schedule_changes(meta, config)
    if changes and not config.allow_schedule_change:
        diffs += changes
    if diffs:
        raise ConfigError(
            f"{where} holds a checkpoint (step {meta.get('step')}) of an incompatible config: "
            + "; ".join(diffs)
            + ". Use a new --workdir (nothing was overwritten)."
        )


# -- what cannot be vmapped, and what fits ---------------------------------------------


def vmap_blockers(config: ml_collections.ConfigDict) -> list[str]:
    """Why `config` cannot train its seeds in one vmapped program (empty: it can).

    The Pallas and cuDNN attention kernels are custom calls with no batching
    rule over a seed axis of parameters; Weights & Biases logs one run a
    process.
    """
    why = []
    if config.model.attention_impl in ("pallas", "cudnn"):
        why.append(
            f"model.attention_impl={config.model.attention_impl!r} is a custom kernel "
            "without a batching rule for a seed axis"
        )
    if config.wandb:
        why.append("config.wandb logs one run a process")
    return why


def device_memory_bytes() -> tuple[int | None, str]:
    """The memory of one device and where the number comes from (None: unknown)."""
    device = jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except (NotImplementedError, RuntimeError):
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def memory_line(compiled: Any, abstract_one: Any, num_seeds: int, kind: str = "vmap") -> str:
    """How much one seed needs and how many fit a device (the run log's memory line).

    A seed's state is its parameters and optimiser state (held twice while a
    step runs: in and out, less what is donated). Under vmap the step's
    temporaries (activations, gradients) grow with the seed count too, so a
    seed costs the compiled program's total over `num_seeds`; under map the
    seeds run one after another and share one seed's temporaries.
    """
    state_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract_one))
    try:
        analysis = compiled.memory_analysis()
        held = (
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes
        )
        temp = analysis.temp_size_in_bytes
    except (AttributeError, NotImplementedError, RuntimeError):
        held, temp = 2 * state_bytes * num_seeds, state_bytes * num_seeds
    total = held + temp
    if kind == "map":
        per_seed, fixed = held / num_seeds, temp
    else:
        per_seed, fixed = total / num_seeds, 0
    per_seed = max(per_seed, 1)
    limit, source = device_memory_bytes()
    fits = "unknown" if limit is None else f"{max(int((limit * 0.9 - fixed) // per_seed), 0):,}"
    mib = 2**20
    return (
        f"memory: {num_seeds} seed(s) in one program ({kind}); state {state_bytes / mib:.1f} MiB "
        f"a seed, train step {total / mib:.1f} MiB ({per_seed / mib:.1f} MiB a seed"
        + (f" + {fixed / mib:.1f} MiB shared" if fixed else "")
        + f"); {fits} seeds fit 90% of the {source}"
        + ("" if limit is None else f" ({limit / 2**30:.1f} GiB)")
    )


def _key(member_key: int | str) -> int | str:
    """A member's key as the stacked checkpoint records it: the seed as an int (numpy
    ints included), or the member's name when it sweeps a learning rate or warmup."""
    return member_key if isinstance(member_key, str) else int(member_key)
