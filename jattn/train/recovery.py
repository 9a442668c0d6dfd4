"""Resuming from damaged checkpoints: set aside what cannot be restored, keep the rest.

Orbax makes a save atomic (a step folder appears only once complete), but it
does not check a finished step again: a truncated chunk, a deleted
``state/_METADATA``, a truncated ``meta/metadata``, a missing ``state/`` or an
empty ``checkpoints/155/`` (a stray ``mkdir``, a copy that stopped) all end
in a long traceback when the newest step is restored, although the previous
step is intact.

So a run resumes from the newest step that restores and verifies:

1. `set_aside_incomplete` looks at every step folder before the manager
   opens them and moves those missing a part (empty, no ``state/``, no
   ``state/_METADATA``, an unreadable ``meta/metadata``) to
   ``workdir/checkpoints.skipped/<step>-<time>``;
2. `restore_newest` restores the newest step; if that fails (a truncated
   chunk; this process's data iterator file missing or not what was saved),
   or the restored state is not that step's (its step counter differs, an
   array does not match the checksum the save recorded, a parameter or
   optimiser value is NaN/Inf), the step is set aside the same way and the
   next older one is tried. A step written by another number of processes is
   not damage: it is refused (`ConfigError`).

While it restores, the echo of the reads orbax abandons in a failed restore
(one per array, thousands for a large model) is dropped
(`quiet_abandoned_reads`): the warning line says what failed. It comes three
ways, as the garbage collector meets each read: asyncio logs ``Task (or
_GatheringFuture) exception was never retrieved`` for a read that failed
unretrieved; a read left suspended is closed, and orbax's ``except
BaseException`` turns the close into its read error, printed by
`sys.unraisablehook` as ``Exception ignored in: <coroutine object
_read_array_index_and_device_put ...>``; a read never started warns
``coroutine ... was never awaited``. (On this machine most runs of the
truncated-chunk fault printed dozens of the second.) Some reads are still
running in tensorstore when the restore raises and end later, at any moment
of the training that follows or at the interpreter's exit; so once a restore
has failed the filters stay on for the rest of the process, and what is left
of the abandoned reads is collected at exit while they are on (in CI, a late
traceback got out while the step after the restore trained, and another
after the last step).

Every skipped step is one warning line that names it and why. Nothing is
deleted: a step set aside can be inspected or moved back. Moving it out of
``checkpoints/`` matters: orbax's retention would otherwise count it as one
of the steps to keep and delete a good one in its place.

`archive_metrics` keeps the metrics of a workdir that starts again from
step 0 (every checkpoint gone or skipped): they are renamed, not wiped.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn.train import workdir as workdir_lib
from jattn.train.checkpoints import (
    DamagedStepError,
    checksums,
    recorded_checksums,
    step_problem,
)

__all__ = [
    "SKIPPED_DIR",
    "archive_metrics",
    "quiet_abandoned_reads",
    "release_abandoned_reads",
    "restore_newest",
    "restore_verified",
    "set_aside",
    "set_aside_incomplete",
    "step_problem",
    "verify_state",
]

SKIPPED_DIR = "checkpoints.skipped"

# What asyncio logs for a task or future that ended in an exception nobody asked for
# (``Task``, ``Future``, ``_GatheringFuture exception was never retrieved``).
_ABANDONED = re.compile(r"\w+ exception was never retrieved")
# Where orbax's read coroutines are written: one closed unfinished by the garbage
# collector raises its read error (`quiet_abandoned_reads`).
_ORBAX = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"
# Orbax's read coroutines that a failed restore may leave created but never started.
_NEVER_AWAITED = re.compile(
    r"coroutine '(?:_read_array_index_and_device_put|_read_and_create_array|_read_shard"
    r"|async_deserialize|_deserialize_arrays)' was never awaited"
)

# Whether a restore of this process has failed: then its abandoned reads may end
# (and be reported) at any later moment, and the filters of `quiet_abandoned_reads`
# stay on. Both lists are changed in place, never rebound: the filters hold them.
_failed_restores: list[int] = []
_quiet_blocks: list[None] = []  # one entry per `quiet_abandoned_reads` block now open
_installed: list[bool] = []


def _quiet_now(_blocks=_quiet_blocks, _failed=_failed_restores) -> bool:
    # Bound as defaults, not read from the module: at the interpreter's exit module
    # globals are cleared while late tasks are still being finalised.
    return bool(_blocks or _failed)


def _install_filters() -> None:
    """Puts three filters in this process (once), each dropping one echo of an
    abandoned read while `_quiet_now()` and passing everything else through:

    - on the ``asyncio`` logger: ``... exception was never retrieved``;
    - before `sys.unraisablehook` (whatever it is now): an orbax coroutine
      closed unfinished, raising its read error;
    - before `warnings.showwarning`: an orbax read coroutine never awaited.
    """
    if _installed:
        return
    _installed.append(True)
    quiet_now, abandoned, orbax, never_awaited = _quiet_now, _ABANDONED, _ORBAX, _NEVER_AWAITED

    def log_filter(record: logging.LogRecord) -> bool:
        return not (quiet_now() and abandoned.match(str(record.msg)))

    previous_hook = sys.unraisablehook

    def unraisable_hook(unraisable) -> None:
        code = getattr(unraisable.object, "cr_code", None)  # only coroutines have one
        if not (quiet_now() and code is not None and orbax in code.co_filename):
            previous_hook(unraisable)

    previous_show = warnings.showwarning

    def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
        if not (quiet_now() and category is RuntimeWarning and never_awaited.match(str(message))):
            previous_show(message, category, filename, lineno, file, line)

    logging.getLogger("asyncio").addFilter(log_filter)
    sys.unraisablehook, warnings.showwarning = unraisable_hook, show_warning


def _collect_at_exit() -> None:
    """Collects the failed restores' last abandoned reads while the filters are on
    (atexit runs before module teardown, and before `logging.shutdown`)."""
    if _failed_restores:
        gc.collect()


atexit.register(_collect_at_exit)


@contextlib.contextmanager
def quiet_abandoned_reads() -> Iterator[None]:
    """``with quiet_abandoned_reads():`` restore attempts without the echo of their reads.

    When one array of a step fails to read, orbax's restore raises that error
    and abandons the other reads of its event loop, and each is echoed when
    the garbage collector meets it: a read that failed too is logged by
    asyncio as ``Task exception was never retrieved`` (or ``_GatheringFuture
    ...``) with its traceback; a read still suspended is closed, which orbax's
    ``except BaseException`` turns into the read error, printed by
    `sys.unraisablehook` as ``Exception ignored in: <coroutine object
    _read_array_index_and_device_put ...>``; a read created but not started
    warns ``coroutine ... was never awaited``. Pages of them, sometimes
    thousands, after the one warning line that matters. Inside the block those
    three are dropped (coroutines of orbax's checkpoint package only), and on
    the way out the garbage is collected, so reads abandoned inside it are
    met inside it. Everything else passes. Once a restore has failed
    (`restore_newest`), the filters stay on after the block, since that
    restore's reads may end later (`release_abandoned_reads` takes them off).
    """
    _install_filters()
    _quiet_blocks.append(None)
    try:
        yield
    finally:
        gc.collect()
        _quiet_blocks.pop()


def release_abandoned_reads() -> None:
    """Gives back the echo of abandoned reads (asyncio's log, the unraisable hook,
    the never-awaited warning) after a failed restore.

    After a failed restore the filters of `quiet_abandoned_reads` stay on for
    the process; a long-lived process (a notebook, a test session) that has
    moved past that restore and wants asyncio's records of its own tasks again
    calls this. The failed restore's late reads are then echoed again.
    """
    _failed_restores.clear()


def set_aside(checkpoint_dir: str, step: int, reason: str, warn: Callable[[str], None]) -> str:
    """Moves ``<checkpoint_dir>/<step>`` to ``<workdir>/checkpoints.skipped/`` and warns.

    Returns:
      Where the step now lies.

    Raises:
      OSError: the folder cannot be moved (a read-only workdir).
    """
    src = os.path.join(checkpoint_dir, str(step))
    parent = os.path.join(os.path.dirname(os.path.normpath(checkpoint_dir)), SKIPPED_DIR)
    os.makedirs(parent, exist_ok=True)
    dst = os.path.join(parent, f"{step}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    shutil.move(src, dst)
    warn(f"warning: checkpoint step {step} {reason}; skipped it (moved to {dst})")
    return dst


def _step_dirs(checkpoint_dir: str) -> list[int]:
    if not os.path.isdir(checkpoint_dir):
        return []
    return sorted(
        int(name)
        for name in os.listdir(checkpoint_dir)
        if name.isdigit() and os.path.isdir(os.path.join(checkpoint_dir, name))
    )


def set_aside_incomplete(checkpoint_dir: str, warn: Callable[[str], None]) -> list[int]:
    """Sets aside every step folder with a missing or unreadable part (`step_problem`).

    Call it before the checkpoint manager opens the folder. Returns the steps
    set aside.
    """
    skipped = []
    for step in _step_dirs(checkpoint_dir):
        problem = step_problem(os.path.join(checkpoint_dir, str(step)))
        if problem is not None:
            set_aside(checkpoint_dir, step, problem, warn)
            skipped.append(step)
    return skipped


@jax.jit
def _finite_flags(tree: Any) -> jax.Array:
    """bool ``[leaves]``: whether each inexact array of `tree` is all finite (no leaf: ``[]``).

    One jitted function over the whole tree, not an eager op per array: eager ops
    on arrays sharded over several devices each start their own all-reduce, and
    on a host with several CPU devices (and on a pod) those interleave with
    other threads' collectives and wait forever (issue 54: a run on mesh
    ``(1,1,2)`` or ``(1,2,1)`` aborted on resume after 40 s in an all-reduce).
    """
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _inexact(x)]
    return jnp.stack(flags) if flags else jnp.zeros((0,), bool)


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _all_finite(tree: Any) -> bool:
    return bool(np.all(jax.device_get(_finite_flags(tree))))


def _part(state: Any, name: str) -> Any:
    """A field of a train state, or the same key of the plain dict a raw restore gives."""
    return state[name] if isinstance(state, Mapping) else getattr(state, name)


def verify_state(state: Any, step: int, expected: dict[str, str] | None = None) -> str | None:
    """Why a restored state is not checkpoint `step`'s, or None: its step counter
    differs, an array's checksum differs from `expected` (``{array path:
    checksum}``, recorded by the save; None for a step saved before jattn
    recorded them), or a parameter or an optimiser value is NaN or Inf.

    `state` is a train state, or the plain dict (``step``, ``params``,
    ``opt_state``, ...) a restore without the train state's structure gives
    (`jattn.train.load_run`): the checksums name the arrays the same way."""
    restored = int(jax.device_get(_part(state, "step")))
    if restored != step:
        return f"restored a state of step {restored}"
    if expected:
        got = checksums(state)
        wrong = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
        if wrong:
            return (
                f"does not match its checksum ({len(wrong)} of {len(expected)} arrays differ, "
                f"first {wrong[0]}): its files changed after the save"
            )
    if not _all_finite(_part(state, "params")):
        return "restored parameters that are NaN or Inf"
    if not _all_finite(_part(state, "opt_state")):
        return "restored an optimiser state that is NaN or Inf"
    return None


def restore_newest(
    mngr: Any,
    restore: Callable[[int], tuple[Any, Any]],
    warn: Callable[[str], None],
) -> tuple[int | None, tuple[Any, Any] | None]:
    """Restores the newest step that restores and verifies.

    A step that fails to restore or verify (`verify_state`) is set aside and
    the next older one is tried.

    Args:
      mngr: the run's orbax `CheckpointManager`.
      restore: ``step -> (state, data iterator)`` (a fresh iterator each call: a
        failed restore may leave one half set).
      warn: prints one warning line.

    Returns:
      ``(step, (state, iterator))``, or ``(None, None)`` when no step restores
      (the run starts at 0).
    """
    with quiet_abandoned_reads():
        while True:
            step = mngr.latest_step()
            if step is None:
                return None, None
            restored, problem = _restore_one(mngr, step, restore)
            if problem is None:
                return step, restored
            gc.collect()  # the failed attempt's abandoned reads, while quiet
            set_aside(os.fspath(mngr.directory), step, problem, warn)
            mngr.reload()


def _restore_one(mngr, step: int, restore: Callable[[int], tuple[Any, Any]]):
    """`step`: ``(restored (state, iterator), None)``, or ``(None, why it cannot be
    resumed)``.

    Raises:
      ConfigError: the step was written by another number of processes (not damage).
    """
    step_dir = os.path.join(os.fspath(mngr.directory), str(step))
    return restore_verified(lambda: restore(step), step, step_dir, lambda r: r[0])


def restore_verified(
    restore: Callable[[], Any],
    step: int,
    step_dir: str,
    state_of: Callable[[Any], Any] = lambda restored: restored,
) -> tuple[Any, str | None]:
    """Restores checkpoint `step` and verifies it (`verify_state`, against the checksums
    its save recorded in `step_dir`): ``(what restore returned, None)``, or ``(None,
    why the step cannot be used)``, one clause for a warning line. What training
    resumes from and what `jattn decode` or `jattn probe` read (`load_run`) pass
    this same check. Call it inside `quiet_abandoned_reads`.

    Args:
      restore: restores the step (``() -> restored``).
      state_of: the train state (or plain state dict) in what `restore` returns.

    Raises:
      ConfigError: the step was written by another number of processes (not damage).
    """
    try:
        restored = restore()
        problem = verify_state(state_of(restored), step, recorded_checksums(step_dir))
    except (KeyboardInterrupt, SystemExit):
        raise
    except DamagedStepError as e:
        restored, problem = None, str(e)
    except Exception as e:  # noqa: BLE001 -- any failure of this step: try the previous
        if type(e).__name__ == "ConfigError":  # another process count: not damage
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        restored, problem = None, f"cannot be restored ({type(e).__name__}: {first[:200]})"
    if problem is not None:
        _failed_restores.append(step)  # its abandoned reads may end at any later moment
        return None, problem
    return restored, None


def archive_metrics(workdir: str, warn: Callable[[str], None]) -> str | None:
    """Keeps the metrics of an earlier start when a workdir starts again at step 0.

    ``metrics.jsonl`` and ``final_metrics.json`` are renamed with the time
    (``metrics.20260101T120000.jsonl``); TensorBoard files stay where they are.

    Returns:
      The archived ``metrics.jsonl`` path, or None if there was nothing to keep.
    """
    path = os.path.join(workdir, workdir_lib.METRICS)
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S")
    kept = os.path.join(workdir, f"metrics.{stamp}.jsonl")
    os.replace(path, kept)
    final = os.path.join(workdir, workdir_lib.FINAL_METRICS)
    if os.path.exists(final):
        os.replace(final, os.path.join(workdir, f"final_metrics.{stamp}.json"))
    warn(
        f"warning: {workdir} has metrics but no checkpoint to resume; starting at step 0 "
        f"(the earlier metrics are kept in {kept})"
    )
    return kept
