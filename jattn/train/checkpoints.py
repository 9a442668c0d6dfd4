"""Checkpoints: one orbax CheckpointManager step holds everything a run needs.

Layout of `workdir/checkpoints/<step>/`:

- ``state``: the `TrainState` (params, optimiser state, step, RNG), saved
  asynchronously, restored straight into the target shardings (so a run may
  resume on a different mesh);
- ``data``: the grain iterator state, one JSON file per process;
- ``meta``: the run's resolved config, its compatibility signature, the
  number of processes that wrote it and a checksum of every saved array and
  of the data iterator's position (`checksums`).

Saves are atomic: orbax writes into ``<step>.orbax-checkpoint-tmp-*`` and
renames the folder only once every item is complete, so a crash mid-save
leaves the previous steps untouched and a temporary folder that the next
start deletes (`cleanup_tmp_directories`). Retention keeps the last
`keep_checkpoints` steps, the best one by `best_metric` (an eval metric
name such as ``"eval/validation/exact_match"``, `best_mode` "max" or "min")
and the last one whose training loss was sane (`jattn.train.sanity`), so a
divergence never rotates every sane checkpoint out. A finished step is not
checked again by orbax; `jattn.train.recovery` skips one that fails to
restore or whose restored arrays do not match the checksums its ``meta``
recorded when it was saved.

A resume compares every key of the config with the checkpoint's saved config
(`check_compatible`, and `check_saved_config` before the data set is even
loaded) by the rules of `jattn.train.resume_keys`: which keys may never
change, which only when allowed, which freely. What is read here is the
run's `CheckpointPart` (`jattn.train.parts`): retention, and the whole
config as plain JSON (`record`) that a step saves and a resume compares.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

from jattn.data import checkpoint as data_ckpt
from jattn.train import workdir as workdir_lib
from jattn.train.parts import CheckpointPart, ConfigError
from jattn.train.resume_keys import (
    allowed_changes,
    check_allowed_changes,
    config_changes,
    incompatibilities,
    schedule_changes,
    signature,
)
from jattn.train.sanity import SANE_STEP_METRIC

__all__ = [
    "DamagedStepError",
    "check_compatible",
    "check_saved_config",
    "checksums",
    "latest_complete_step",
    "make_manager",
    "restore",
    "save",
    "save_bytes",
    "saved_meta",
    "signature",
    "state_bytes",
    "step_problem",
]

CHECKPOINT_DIR = workdir_lib.CHECKPOINTS


class DamagedStepError(Exception):
    """A checkpoint step is damaged (the message says how, as "checkpoint step N
    <message>" reads): `jattn.train.recovery` sets it aside and tries the previous one."""


def _sane_step(metrics: dict[str, Any]) -> float:
    return float(metrics.get(SANE_STEP_METRIC, -1))


def make_manager(workdir: str, part: CheckpointPart) -> ocp.CheckpointManager:
    """The run's CheckpointManager (creates `workdir/checkpoints`)."""
    mode = part.best_mode
    if mode not in ("max", "min"):
        raise ConfigError(f"best_mode={mode!r}: choose 'max' or 'min'")
    policies = [
        cm.LatestN(n=max(int(part.keep), 1)),
        # The last sane checkpoint survives a divergence (see `jattn.train.sanity`).
        cm.BestN(
            get_metric_fn=_sane_step,
            reverse=False,
            n=1,
            keep_checkpoints_without_metrics=False,
        ),
    ]
    if part.best_metric:
        name = part.best_metric
        sign = 1.0 if mode == "max" else -1.0
        policies.append(
            cm.BestN(
                get_metric_fn=lambda m: sign * float(m.get(name, float("-inf") * sign)),
                reverse=False,
                n=1,
                keep_checkpoints_without_metrics=False,
            )
        )
    options = ocp.CheckpointManagerOptions(
        preservation_policy=cm.AnyPreservationPolicy(policies),
        # With a best_fn orbax writes each step's metrics into the step (a `metrics`
        # item), so retention still knows them after a restart; `best_step()` is
        # then the last sane step.
        best_fn=_sane_step,
        enable_async_checkpointing=part.async_saves,
        cleanup_tmp_directories=True,
        create=True,
    )
    directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
    return ocp.CheckpointManager(directory, options=options)


def _vocabulary_changed(meta: dict[str, Any], vocab: str | None) -> str | None:
    saved = meta.get("vocab_sha256")
    if saved is None or vocab is None or saved == vocab:
        return None
    return f"tokenizer vocabulary: checkpoint {saved} != data set's {vocab}"


def _read_meta(step_dir: str) -> dict[str, Any] | None:
    path = os.path.join(step_dir, "meta", "metadata")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def saved_meta(mngr: ocp.CheckpointManager, step: int) -> dict[str, Any] | None:
    """The ``meta`` item of checkpoint `step` (None if it has none)."""
    return _read_meta(os.path.join(str(mngr.directory), str(step)))


def recorded_checksums(step_dir: str) -> dict[str, str] | None:
    """The state's checksums (``{array path: checksum}``) that the save of the step in
    `step_dir` recorded in its meta; None for a step saved before jattn recorded them.

    Raises:
      OSError, ValueError: the meta exists but cannot be read.
    """
    return ((_read_meta(step_dir) or {}).get("checksums") or {}).get("state")


def step_problem(step_dir: str) -> str | None:
    """Why the step folder `step_dir` cannot be a complete checkpoint, or None.

    Checks only what is cheap to check without restoring: the folder has
    content, ``state/`` and its ``_METADATA`` exist, and ``meta/metadata``
    (when the step has a ``meta`` item) is JSON naming this step.
    """
    try:
        entries = os.listdir(step_dir)
    except OSError as e:
        return f"cannot be listed ({e.strerror})"
    if not entries:
        return "is empty"
    if "state" not in entries:
        return "has no state/"
    if not os.path.exists(os.path.join(step_dir, "state", "_METADATA")):
        return "has no state/_METADATA"
    if "meta" in entries:
        try:
            meta = _read_meta(step_dir) or {}
        except (OSError, ValueError) as e:
            return f"has an unreadable meta/metadata ({type(e).__name__})"
        step = os.path.basename(os.path.normpath(step_dir))
        if str(meta.get("step")) != step:
            return f"has meta/metadata of step {meta.get('step')!r}"
    return None


def latest_complete_step(checkpoint_dir: str) -> int | None:
    """The newest step folder of `checkpoint_dir` without a `step_problem` (None: none)."""
    if not os.path.isdir(checkpoint_dir):
        return None
    steps = sorted(
        (int(n) for n in os.listdir(checkpoint_dir) if n.isdigit()),
        reverse=True,
    )
    for step in steps:
        if step_problem(os.path.join(checkpoint_dir, str(step))) is None:
            return step
    return None


def _check_meta(
    meta: dict[str, Any], workdir: str, step: int, config: dict[str, Any], vocab: str | None
) -> None:
    """Refuses (ConfigError, one line) a `config` (a run's `record`) that cannot
    continue the checkpoint of `step` whose ``meta`` is `meta`; see `check_compatible`."""
    diffs = incompatibilities(meta["signature"], config, meta.get("config"))
    diffs += [d for d in [_vocabulary_changed(meta, vocab)] if d]
    if diffs:
        raise ConfigError(
            f"workdir {workdir!r} holds a checkpoint (step {step}) of an incompatible config: "
            + "; ".join(diffs)
            + ". Use a new --workdir (nothing was overwritten)."
        )
    allowed = allowed_changes(config)
    parts, flags = [], []
    schedule = [line for k, line in schedule_changes(meta, config).items() if k not in allowed]
    if schedule and not config.get("allow_schedule_change", False):
        parts.append("another schedule: " + "; ".join(schedule))
        flags.append("--config.allow_schedule_change=True")
    others = {k: line for k, line in config_changes(meta, config).items() if k not in allowed}
    if others:
        parts.append(f"other values of {', '.join(others)}: " + "; ".join(others.values()))
        flags.append(f"--config.allow_config_change={','.join(others)}")
    if parts:
        raise ConfigError(
            f"workdir {workdir!r} holds a checkpoint (step {step}) trained under "
            + "; and under ".join(parts)
            + f". Pass {' and '.join(flags)} to continue it under the new values, or use a "
            "new --workdir (nothing was overwritten)."
        )


def _meta_or_run_config(step_dir: str, workdir: str) -> dict[str, Any] | None:
    """A step's meta, or for a checkpoint without one the workdir's ``config.json``
    in its place (None when neither exists)."""
    meta = _read_meta(step_dir)
    if meta is not None:
        return meta
    saved_config = workdir_lib.read_json(os.path.join(workdir, workdir_lib.CONFIG))
    if saved_config is None:
        return None
    return {"signature": signature(saved_config), "config": saved_config}


def check_compatible(
    mngr: ocp.CheckpointManager,
    workdir: str,
    part: CheckpointPart,
    vocab: str | None = None,
) -> int | None:
    """Checks that the latest checkpoint in `workdir` can continue under the run's
    config (`part.record`).

    `vocab` is the hash of the tokenizer's vocabulary
    (`jattn.data.tokenizers.vocab_hash`): the tokenizer's name is in the
    signature, its contents here (the same characters in another order are
    another experiment).

    Returns:
      The latest step, or None for a fresh workdir.

    Raises:
      ConfigError: one line listing what differs and the flag that allows it,
        if one does (the workdir is left alone): a changed `COMPAT_KEYS` value
        or vocabulary always; a changed `SCHEDULE_KEYS` value unless
        `config.allow_schedule_change` is True or `allow_config_change` names
        it; a change of any other key outside `RESUME_SAFE_KEYS` unless
        `config.allow_config_change` names it.
    """
    step = mngr.latest_step()
    if step is None:
        return None
    check_allowed_changes(part.record)
    meta = _meta_or_run_config(os.path.join(str(mngr.directory), str(step)), workdir)
    if meta is not None:
        _check_meta(meta, workdir, step, part.record, vocab)
    return step


def check_saved_config(workdir: str, part: CheckpointPart) -> None:
    """`check_compatible` before any manager is opened or data loaded (the
    vocabulary is checked later, once the data set is loaded): a config that
    cannot continue the newest complete checkpoint in `workdir` is refused
    before anything is prepared or written.

    Raises:
      ConfigError: as `check_compatible`.
    """
    check_allowed_changes(part.record)
    folder = os.path.join(workdir, CHECKPOINT_DIR)
    step = latest_complete_step(folder)
    if step is None:
        return
    meta = _meta_or_run_config(os.path.join(folder, str(step)), workdir)
    if meta is not None:
        _check_meta(meta, workdir, step, part.record, None)


# -- checksums ---------------------------------------------------------------------------


def _as_uint32(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 (one word an element; 64-bit elements: two)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # a trailing axis of 2
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection of uint32 that spreads every bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """uint32 ``[2]``: two weighted sums mod 2^32 of an array's bits.

    Each element's weight is odd and depends on its position, so any change
    of one element (a flipped bit included) changes both sums, and a swap of
    two elements changes them too; other damage goes unseen with odds of
    2^-64. Sums of products are computed shard by shard and added, so the
    result is the same on any mesh (the array is never gathered).
    """
    bits = _as_uint32(x)
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(bits.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(
            stride % (1 << 32)
        )
        stride *= bits.shape[axis]
    w1 = (index * jnp.uint32(0x9E3779B1)) | jnp.uint32(1)
    w2 = (_mix(index + jnp.uint32(0x7F4A7C15))) | jnp.uint32(1)
    sums = (jnp.sum(bits * w1, dtype=jnp.uint32), jnp.sum(_mix(bits) * w2, dtype=jnp.uint32))
    return jnp.stack(sums)


# A program a leaf, compiled once a shape, dtype and sharding (one over the tree
# compiled a reduction a leaf: 4x the compile time, docs/reliability.md); each
# leaf's sums fetched before the next starts, as several sharded programs in
# flight deadlocked XLA:CPU's collectives (tests/faults/test_sharded_resume.py).
_leaf_checksum_jit = jax.jit(_leaf_checksum)


def checksums(state: Any) -> dict[str, str]:
    """``{array path: 16 hex digits}``: a checksum of every array of `state`
    (`_leaf_checksum`), as a step's ``meta`` records it and a restore checks it.
    Paths are written as orbax names the arrays (``opt_state/0/mu/embed/embedding``)."""
    sums = jax.tree.map(lambda x: jax.device_get(_leaf_checksum_jit(x)), state)
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): "".join(
            f"{int(v):08x}" for v in np.asarray(s)
        )
        for path, s in jax.tree_util.tree_flatten_with_path(sums)[0]
    }


def _iterator_sha256(state: Any) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def _position_sha256(data_iter: Any) -> str | None:
    """The checksum of a `make_loader` iterator's position (a JSON-able dict, which
    grain writes as the step's data file); None for another kind of state."""
    state = data_iter.get_state()
    return _iterator_sha256(json.loads(json.dumps(state))) if isinstance(state, dict) else None


_DATA_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json$")


def _check_data_item(step_dir: str, meta: dict[str, Any] | None) -> None:
    """This process's data iterator file of a step: there, readable, and (one
    process) the position its meta recorded.

    Raises:
      ConfigError: the step was written by another number of processes (its
        meta says so, or, for a meta that does not record it, its files).
      DamagedStepError: the file is missing, not JSON, or not what was saved.
    """
    folder = os.path.join(step_dir, "data")
    index, count = jax.process_index(), jax.process_count()
    name = f"process_{index}-of-{count}.json"
    saved_count = (meta or {}).get("process_count")
    if saved_count is None and os.path.isdir(folder):
        counts = {int(m[2]) for n in os.listdir(folder) if (m := _DATA_FILE.match(n))}
        saved_count = next(iter(counts)) if len(counts) == 1 and count not in counts else None
    if saved_count is not None and saved_count != count:
        raise ConfigError(
            f"checkpoint step {os.path.basename(step_dir)} in {os.path.dirname(step_dir)} was "
            f"written by {saved_count} process(es), this run has {count}: resume it with "
            f"{saved_count}, or use a new --workdir"
        )
    path = os.path.join(folder, name)
    try:
        with open(path) as f:
            position = json.load(f)
    except FileNotFoundError:
        raise DamagedStepError(f"has no data/{name} (this process's data position)") from None
    except (OSError, ValueError) as e:
        raise DamagedStepError(f"has an unreadable data/{name} ({type(e).__name__})") from None
    expected = ((meta or {}).get("checksums") or {}).get("data")
    if count == 1 and expected is not None and _iterator_sha256(position) != expected:
        raise DamagedStepError(f"has a data/{name} that does not match its checksum")


def save(
    mngr: ocp.CheckpointManager,
    step: int,
    state: Any,
    data_iter: Any,
    part: CheckpointPart,
    metrics: dict[str, float] | None = None,
    vocab: str | None = None,
) -> None:
    """Starts an (async) save of `state` and the data iterator at `step`.

    `metrics` are what retention ranks by (`best_metric`, `SANE_STEP_METRIC`);
    the run's config (`part.record`) and its signature go into ``meta``;
    `vocab` (the tokenizer's vocabulary hash) is recorded in ``meta``, and so
    are the number of processes, and the checksums a restore checks: of every
    array of `state` (`checksums`) and, with one process, of the iterator's
    position. They are part of the same atomic save as what they describe.
    """
    config = json.loads(json.dumps(part.record))  # the meta's own copy
    meta = {"config": config, "signature": signature(config), "step": int(step)}
    meta["process_count"] = jax.process_count()
    meta["checksums"] = {"state": checksums(state)}
    position = _position_sha256(data_iter) if jax.process_count() == 1 else None
    if position is not None:
        meta["checksums"]["data"] = position
    if vocab is not None:
        meta["vocab_sha256"] = vocab
    mngr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=data_ckpt.save_args(data_iter),
            meta=ocp.args.JsonSave(meta),
        ),
        metrics=metrics,
        force=True,
    )


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state: Any, data_iter: Any) -> Any:
    """Restores checkpoint `step` into `abstract_state`'s shardings and `data_iter`.

    The state's checksums are checked by the caller
    (`jattn.train.recovery.verify_state`); the data iterator's file here,
    before grain reads it.

    Args:
      abstract_state: the state as `jax.ShapeDtypeStruct` leaves with shardings.
      data_iter: a fresh iterator of the same loader; its position is set in place.

    Returns:
      The restored state.

    Raises:
      ConfigError: the step was written by another number of processes.
      DamagedStepError: this process's data iterator file is missing, unreadable
        or not what was saved.
    """
    step_dir = os.path.join(str(mngr.directory), str(step))
    try:
        meta = _read_meta(step_dir)
    except (OSError, ValueError):
        meta = None  # `step_problem` reports an unreadable meta before this
    _check_data_item(step_dir, meta)
    restored = mngr.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=data_ckpt.restore_args(data_iter),
        ),
    )
    return restored.state


def state_bytes(abstract) -> int:
    """Bytes of a checkpoint's state (parameters, optimiser state), a save's size."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract))


def save_bytes(abstract) -> int:
    """The free space a save of `abstract` asks for: its bytes, a fifth more, and 1 MiB."""
    return int(1.2 * state_bytes(abstract)) + (1 << 20)
