"""The members of one training program, and their step over a member axis.

Every `jattn train` is one program of N >= 1 members (`jattn.train.run`). A
member is the single run with its seed and, when a sweep is set, its
optimiser values (`jattn.train.optim.SWEEPABLE`):

    --config.seeds=0,1 --config.sweep_learning_rate=1e-3,3e-4

trains four members, every (learning rate, seed) pair, seeds varying fastest.
A member is exactly the single run with its values (`member_config`): same
initialisation, dropout keys and batches; its learning rate and warmup enter
the program as numbers instead of constants (`jattn.train.optim.swept_schedule`).
Its workdir is the single run's layout (``WORKDIR/seed-0`` or
``WORKDIR/learning_rate-0.001_seed-0``; the workdir itself for a plain run),
its own checkpoints included, so `load_run` and the ablation report read it
as one run.

N = 1 runs the unmapped step, the one a single run has always had. N > 1
gives every leaf of the `TrainState` a leading member axis `[N, ...]`, stacks
each member's `[B, L]` batches to `[N, B, L]`, and maps the single run's
step over that axis (`over_members`: `jax.vmap`, which fills an accelerator,
or `lax.map`, each member's own computation; both equal a single run's numbers
up to last-bit rounding, which XLA may place differently inside a program); a
member whose loss
turns NaN or Inf keeps its last good state (a select on device).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jattn.train import evaluation, steps
from jattn.train import mesh as mesh_lib
from jattn.train.config import ConfigError, input_lengths

__all__ = [
    "SWEEPS",
    "Member",
    "Streams",
    "batch_lengths",
    "compile_steps",
    "describe",
    "grouped",
    "hparam_arrays",
    "member_config",
    "members",
    "memory_line",
    "over_members",
    "program_kind",
    "seed_config",
    "stack",
    "stacked_abstract",
    "take",
    "vmap_blockers",
]

# config key of the swept values -> the key each member sets.
SWEEPS = {"sweep_learning_rate": "learning_rate", "sweep_warmup_steps": "warmup_steps"}


@dataclasses.dataclass(frozen=True)
class Member:
    """One model of a program: its seed, the optimiser values it sweeps, its workdir.

    Attributes:
      seed: the single run's `config.seed`.
      hparams: ``((key, value), ...)`` in `SWEEPS` order; () without a sweep.
      workdir: its run directory ("": ``<program workdir>/<name>``).
    """

    seed: int
    hparams: tuple[tuple[str, float | int], ...] = ()
    workdir: str = ""

    @property
    def name(self) -> str:
        """``seed-0``, or ``learning_rate-0.001_seed-0`` with a sweep: its workdir's name."""
        return "_".join([f"{k}-{v:g}" for k, v in self.hparams] + [f"seed-{self.seed}"])

    @property
    def label(self) -> str:
        """How log lines name it: ``seed 0``, or its `name` with a sweep."""
        return self.name if self.hparams else f"seed {self.seed}"

    @property
    def key(self) -> int | str:
        """How results are keyed: the seed without a sweep, else `name`."""
        return self.name if self.hparams else self.seed


def grouped(config: ml_collections.ConfigDict) -> bool:
    """Whether `config` names its members (seeds or a sweep): they train in
    ``WORKDIR/<member name>`` and the result is keyed by member."""
    return bool(config.get("seeds")) or any(config.get(sweep) for sweep in SWEEPS)


def members(config: ml_collections.ConfigDict, workdir: str) -> list[Member]:
    """Every (swept values, seed) combination of `config`, seeds fastest, each in
    ``workdir/<name>``; a plain config is one member in `workdir` itself."""
    if not grouped(config):
        return [Member(int(config.seed), (), workdir)]
    seeds = [int(s) for s in config.seeds] or [int(config.seed)]
    axes = [
        [(key, v) for v in config.get(sweep, ())]
        for sweep, key in SWEEPS.items()
        if config.get(sweep, ())
    ]
    program = [Member(s, tuple(combo)) for combo in itertools.product(*axes) for s in seeds]
    return [dataclasses.replace(m, workdir=os.path.join(workdir, m.name)) for m in program]


def seed_config(config: ml_collections.ConfigDict, seed: int) -> ml_collections.ConfigDict:
    """The config a single run of `seed` would have (``seed=s``, ``seeds=()``, locked).

    Its `config.json` is the one `jattn train --config.seed=s` writes, so a
    member's workdir reads back (`load_run`) like a single run's.
    """
    out = config.copy_and_resolve_references()
    with out.unlocked():
        out.seed = int(seed)
        out.seeds = ()
        out.sweep_learning_rate = ()  # a member's values are set by `member_config`
        out.sweep_warmup_steps = ()
        out.seed_mesh_axis = ""
        out.seed_program = "auto"
        out.debug_nan_at_step = (
            config.debug_nan_at_step if config.debug_nan_seed in (-1, seed) else 0
        )
        out.debug_nan_seed = -1
    out.lock()
    return out


def member_config(config: ml_collections.ConfigDict, member: Member) -> ml_collections.ConfigDict:
    """The config of the single run `member` is (locked; no seeds, no sweeps)."""
    out = seed_config(config, member.seed)
    with out.unlocked():
        for key, value in member.hparams:
            out[key] = value
    return out


def hparam_arrays(program: Sequence[Member]) -> dict[str, np.ndarray]:
    """The swept values as float32 arrays ``[N]`` by key (`swept_schedule`'s input);
    empty without a sweep."""
    if not program or not program[0].hparams:
        return {}
    keys = [k for k, _ in program[0].hparams]
    return {k: np.asarray([dict(m.hparams)[k] for m in program], np.float32) for k in keys}


def describe(program: Sequence[Member]) -> str:
    """``seeds [0, 1, 2]``, or ``4 members (seeds [0, 1] x learning_rate (0.001, 0.0003))``."""
    seeds = sorted({m.seed for m in program})
    if not program[0].hparams:
        return f"seeds {seeds}"
    swept = [
        f"{k} ({', '.join(f'{v:g}' for v in dict.fromkeys(dict(m.hparams)[k] for m in program))})"
        for k, _ in program[0].hparams
    ]
    return f"{len(program)} members (seeds {seeds} x {' x '.join(swept)})"


def vmap_blockers(config: ml_collections.ConfigDict) -> list[str]:
    """Why `config` cannot train several members in one program (empty: it can).

    The Pallas and cuDNN attention kernels are custom calls with no batching
    rule over a member axis of parameters; Weights & Biases logs one run a
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


# -- trees with a member axis -----------------------------------------------------------


def stack(trees: Sequence[Any]) -> Any:
    """`N` trees of one structure -> one tree of `[N, ...]` numpy leaves."""
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def take(tree: Any, index: int) -> Any:
    """Member `index`'s slice of a stacked tree (`[N, ...]` -> `[...]`)."""
    return jax.tree.map(lambda x: x[index], tree)


def stacked_abstract(abstract_state: Any, shardings: Any, num: int, axis: str | None):
    """`(abstract state, shardings)` of the stacked state: `[N, ...]` leaves, the member
    dim on mesh axis `axis` (None: replicated), the other dims as in one run.

    Raises:
      ConfigError: `axis` is used by a parameter's own sharding too (a mesh axis
        can shard one dim of an array only), or does not divide `num`.
    """
    stacked = jax.tree.map(lambda s: NamedSharding(s.mesh, P(axis, *s.spec)), shardings)
    if axis is not None:
        size = next(iter(jax.tree.leaves(shardings))).mesh.shape[axis]
        if num % size:
            raise ConfigError(
                f"seed_mesh_axis={axis!r} has {size} devices, which do not divide {num} seeds"
            )
        for s in jax.tree.leaves(shardings):
            used = {a for e in s.spec for a in ((e,) if isinstance(e, str) else (e or ()))}
            if axis in used:
                raise ConfigError(
                    f"seed_mesh_axis={axis!r} also shards the parameters ({s.spec}): pick "
                    "an axis the parameters do not use, e.g. 'data'"
                )
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct((num, *x.shape), x.dtype, sharding=s),
        abstract_state,
        stacked,
    )
    return abstract, stacked


class Streams:
    """Every member's training iterator; `next` is one member's batch (N = 1) or the
    members' batches stacked to `[N, B, L]`, as global arrays on `sharding`."""

    def __init__(self, iterators: Sequence[Iterator[dict[str, np.ndarray]]], sharding):
        self.iterators, self.sharding = list(iterators), sharding

    def __next__(self) -> dict[str, jax.Array]:
        if len(self.iterators) == 1:
            return mesh_lib.make_global_batch(next(self.iterators[0]), self.sharding)
        host = stack([next(it) for it in self.iterators])
        return {
            k: jax.make_array_from_process_local_data(self.sharding, v) for k, v in host.items()
        }


def program_kind(config: ml_collections.ConfigDict) -> str:
    """ "map" or "vmap": `config.seed_program`, with "auto" resolved.

    On the CPU, a batched matmul rounds differently from N unbatched ones and
    is no faster (the cores are already busy), and training amplifies last-bit
    differences to percent-level ones within a few hundred steps; `lax.map`
    runs each member's own computation (equal to a single run's up to the
    last bit: 3e-7 relative on the smoke config). An accelerator is filled
    by the batched form, and a member axis sharded over devices needs it.
    """
    if config.seed_program != "auto":
        return config.seed_program
    if config.seed_mesh_axis or jax.default_backend() != "cpu":
        return "vmap"
    return "map"


def over_members(fn, kind: str, num_shared: int = 0):
    """`fn` mapped over the leading member axis of its arguments, the last
    `num_shared` arguments shared by every member (``jax.vmap`` or ``lax.map``)."""
    if kind == "vmap":

        def batched(*args):
            axes = (0,) * (len(args) - num_shared) + (None,) * num_shared
            return jax.vmap(fn, in_axes=axes)(*args)

        return batched

    def mapped(*args):
        split = len(args) - num_shared
        per_member, shared = args[:split], args[split:]
        return jax.lax.map(lambda xs: fn(*xs, *shared), per_member)

    return mapped


def batch_lengths(config: ml_collections.ConfigDict) -> dict[str, int]:
    """Row length of every batch array the training loader yields."""
    input_len, _ = input_lengths(config)
    out = {}
    for name in ("", "_segment_ids", "_positions"):
        out["inputs" + name] = input_len
        out["targets" + name] = config.max_len
    return out


# -- the compiled steps -----------------------------------------------------------------


def _guarded_step(model, config, mesh, program: Sequence[Member], batch_spec, kind):
    # `model`: the program's `jattn.train.run.Model` (module, optimiser, schedule).
    """`(state [N], batch [N, B, L], alive bool [N]) -> (state, metrics [N], alive)`.

    The single run's step over the member axis. Each member's optimiser is
    built from its own swept values (`jattn.train.optim.make_optimizer`).
    With `debug_nan_at_step`, only the members `debug_nan_seed` names (-1:
    all) get the poisoned step (a testing aid; under vmap both steps run and
    one is selected).
    """
    from jattn.train.optim import make_optimizer  # noqa: PLC0415

    common = dict(
        label_smoothing=config.label_smoothing,
        grad_accum_steps=config.grad_accum_steps,
        micro_spec=None if config.grad_accum_steps == 1 else NamedSharding(mesh, batch_spec),
    )
    poisoned = [config.debug_nan_seed in (-1, m.seed) for m in program]
    nan_at = config.debug_nan_at_step if any(poisoned) else 0

    def one(state, batch, poison, hp):
        t, s = make_optimizer(config, hp) if hp else (model.tx, model.schedule)
        clean = steps.make_train_step(model.module, t, s, **common)
        if nan_at <= 0:
            return clean(state, batch)
        nan_step = steps.make_train_step(model.module, t, s, **common, debug_nan_at_step=nan_at)
        return jax.lax.cond(poison, nan_step, clean, state, batch)

    poison = jnp.asarray(poisoned)  # [N]
    hp = {k: jnp.asarray(v, jnp.float32) for k, v in hparam_arrays(program).items()}  # [N]

    def guarded(state, batch, alive, poison, hp):
        new, metrics = one(state, batch, poison, hp)
        ok = alive & jnp.isfinite(metrics["loss"])
        # A diverged member keeps its last good state; the others are untouched bit for bit.
        new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)
        return new, metrics, ok

    over = over_members(guarded, kind)
    return lambda state, batch, alive: over(state, batch, alive, poison, hp)


def _single_steps(model, config, mesh, shardings):
    """N = 1: the single run's `(train_step, eval_step, decode or None)`, jitted with
    explicit shardings, the state donated (`alive` passes through: a non-finite
    loss is the caller's error)."""
    batch_sharding = mesh_lib.batch_sharding(mesh)
    replicated = NamedSharding(mesh, P())
    train = jax.jit(
        steps.make_train_step(
            model.module,
            model.tx,
            model.schedule,
            label_smoothing=config.label_smoothing,
            grad_accum_steps=config.grad_accum_steps,
            micro_spec=NamedSharding(mesh, P(None, *mesh_lib.BATCH_SPEC)),
            debug_nan_at_step=config.debug_nan_at_step,
        ),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )
    eval_step = jax.jit(
        steps.make_eval_step(model.module),
        in_shardings=(shardings.params, batch_sharding),
        out_shardings=replicated,
    )
    decode_one = evaluation.decode_fn(model.module, config)
    decode = decode_one and jax.jit(
        decode_one,
        in_shardings=(shardings.params, batch_sharding, batch_sharding),
        out_shardings=replicated,
    )
    return (lambda state, batch, alive: (*train(state, batch), alive)), eval_step, decode


def compile_steps(model, config, mesh, rules, program: Sequence[Member], abstract, shardings):
    """`(train_step, eval_step, decode or None, batch sharding)` of a program.

    ``train_step(state, batch, alive) -> (state, metrics, alive)``: for N = 1
    the single run's jitted step (`alive` is None); for N > 1 the guarded step
    over the member axis, compiled ahead. ``eval_step(params, batch)`` and
    ``decode(params, inputs, targets)`` return one member's output, or `[N, ...]`.
    """
    if len(program) == 1:
        return (*_single_steps(model, config, mesh, shardings), mesh_lib.batch_sharding(mesh))
    num, axis = len(program), config.seed_mesh_axis or None
    replicated, kind = NamedSharding(mesh, P()), program_kind(config)
    rows = tuple(a for a in ("data", "fsdp") if a != axis)  # data parallelism the members leave
    batch_sharding = NamedSharding(mesh, P(axis, rows, None))  # [N, B, L]
    member_sharding = NamedSharding(mesh, P(axis))
    rows_spec = P(None, rows, None)
    train = _guarded_step(model, config, mesh, program, rows_spec, kind)
    abstract_batch = {
        k: jax.ShapeDtypeStruct((num, config.batch_size, n), jnp.int32, sharding=batch_sharding)
        for k, n in batch_lengths(config).items()
    }
    from flax import linen as nn  # noqa: PLC0415

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        train = (
            jax.jit(
                train,
                in_shardings=(shardings, batch_sharding, member_sharding),
                out_shardings=(shardings, replicated, member_sharding),
                donate_argnums=(0,),
            )
            .lower(abstract, abstract_batch, jax.ShapeDtypeStruct((num,), jnp.bool_))
            .compile()
        )
    eval_batch_sharding = mesh_lib.batch_sharding(mesh)
    over = functools.partial(over_members, kind=kind, num_shared=1)
    eval_step = jax.jit(
        over(steps.make_eval_step(model.module)),
        in_shardings=(shardings.params, eval_batch_sharding),
        out_shardings=replicated,
    )
    decode_one = evaluation.decode_fn(model.module, config)
    decode = decode_one and jax.jit(
        functools.partial(over_members, kind=kind, num_shared=2)(decode_one),
        in_shardings=(shardings.params, eval_batch_sharding, eval_batch_sharding),
        out_shardings=replicated,
    )
    return train, eval_step, decode, batch_sharding


# -- what fits ------------------------------------------------------------------------


def _device_memory_bytes() -> tuple[int | None, str]:
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


def memory_line(compiled: Any, abstract_one: Any, num: int, kind: str = "vmap") -> str:
    """How much one member needs and how many fit a device (the run log's memory line).

    A member's state is its parameters and optimiser state (held twice while a
    step runs: in and out, less what is donated). Under vmap the step's
    temporaries (activations, gradients) grow with the member count too, so a
    member costs the compiled program's total over `num`; under map the
    members run one after another and share one member's temporaries.
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
        held, temp = 2 * state_bytes * num, state_bytes * num
    total = held + temp
    per_member, fixed = (held / num, temp) if kind == "map" else (total / num, 0)
    per_member = max(per_member, 1)
    limit, source = _device_memory_bytes()
    fits = "unknown" if limit is None else f"{max(int((limit * 0.9 - fixed) // per_member), 0):,}"
    mib = 2**20
    return (
        f"memory: {num} seed(s) in one program ({kind}); state {state_bytes / mib:.1f} MiB "
        f"a seed, train step {total / mib:.1f} MiB ({per_member / mib:.1f} MiB a seed"
        + (f" + {fixed / mib:.1f} MiB shared" if fixed else "")
        + f"); {fits} seeds fit 90% of the {source}"
        + ("" if limit is None else f" ({limit / 2**30:.1f} GiB)")
    )
