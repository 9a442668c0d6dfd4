"""The workdir's filesystem: writable at start, room for a save, a failed save stops at once.

Orbax writes a checkpoint in a background thread. When that write fails
(disk full, a read-only or remounted filesystem) the error stays in the
thread: training goes on, the next save waits for the failed one on an
internal 300 s timeout, and the run ends in a TimeoutError or in hundreds
of lines where the real error sits among "Event loop is closed". A run
whose checkpoints cannot be written is losing work, so:

- `check_writable` writes and removes a probe file in the workdir and its
  checkpoint folder at start, before anything trains;
- `check_room` compares the free space with the size of the last
  checkpoint (or an estimate from the state's bytes) before each save;
- `check_saves` surfaces a failed background save at the next step;
- `checked_save` wraps one save: the previous save first, then the room,
  then the save call; `close_manager` ends a run's manager without waiting
  on a save that failed;

and each raises `WorkdirIOError` with one line that says why (`describe`):
"disk full", "read-only filesystem", "permission denied", naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

__all__ = [
    "WorkdirIOError",
    "check_room",
    "check_saves",
    "check_writable",
    "close_manager",
    "checked_save",
    "wait_for_saves",
    "describe",
    "write_error",
]

_REASONS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


class WorkdirIOError(RuntimeError):
    """The workdir or its checkpoints cannot be written; the message is one line.

    Attributes:
      save_failed: a save was started and failed (its background thread may
        still hold orbax resources: do not wait for it); False when the
        problem was found before saving (`check_room`, `check_writable`).
    """

    def __init__(self, message: str, *, save_failed: bool = True):
        super().__init__(message)
        self.save_failed = save_failed


def write_error(error: BaseException, workdir: str, step: int) -> WorkdirIOError:
    """The one-line error for `error`, raised while a training loop wrote at `step`: a
    `WorkdirIOError` as it is; an `OSError` (metrics, TensorBoard events or decodes
    could not be written) as a failed write in `workdir`, counted as a failed save
    (a save may be in flight on the same full disk: do not wait for it)."""
    if isinstance(error, WorkdirIOError):
        return error
    return WorkdirIOError(f"writing in {workdir} failed at step {step}: {describe(error)}")


def _os_error(e: BaseException | None) -> OSError | None:
    """The first OSError with an errno in `e`'s chain (cause, context, group members)."""
    seen = set()
    todo = [e]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None


def describe(e: BaseException) -> str:
    """One line for a failed write: ``"disk full ([Errno 28] ...: path)"`` or the error's
    first line. Finds the OSError inside wrapped errors (orbax re-raises them)."""
    os_error = _os_error(e)
    if os_error is not None:
        reason = _REASONS.get(os_error.errno, os_error.strerror or "I/O error")
        where = f": {os_error.filename}" if os_error.filename else ""
        return f"{reason} ([Errno {os_error.errno}] {os_error.strerror}{where})"
    text = str(e).strip()
    for pattern, reason in _TEXTS.items():  # tensorstore reports errno in text only
        if pattern in text:
            return f"{reason} ({pattern})"
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:400]


_TEXTS = {
    "No space left on device": "disk full",
    "Disk quota exceeded": "disk quota exceeded",
    "Read-only file system": "read-only filesystem",
    "Permission denied": "permission denied",
}


def wait_for_saves(mngr: Any) -> None:
    """Waits for the saves in flight and raises the error of one that failed.

    Raises:
      WorkdirIOError: one line saying why a save failed.
    """
    try:
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 -- orbax re-raises the background error here
        raise WorkdirIOError(
            f"saving a checkpoint in {mngr.directory} failed: {describe(e)} (the earlier "
            "checkpoints are intact: rerun the same command to resume)"
        ) from None
    check_saves(mngr)


def check_writable(*folders: str) -> None:
    """Creates each folder and writes, syncs and removes a probe file in it.

    Raises:
      WorkdirIOError: a folder that cannot be created or written, and why.
    """
    for folder in folders:
        probe = os.path.join(folder, f".write-probe-{os.getpid()}")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"jattn")
                f.flush()
                os.fsync(f.fileno())
            os.remove(probe)
        except OSError as e:
            raise WorkdirIOError(
                f"{folder} is not writable: {describe(e)}", save_failed=False
            ) from None


def check_room(folder: str, needed: int) -> None:
    """Refuses a save that cannot fit: less free space in `folder` than `needed` bytes.

    Raises:
      WorkdirIOError: "disk full", with the free and the needed space.
    """
    try:
        free = shutil.disk_usage(folder).free
    except OSError as e:
        raise WorkdirIOError(
            f"{folder} cannot be checked for space: {describe(e)}", save_failed=False
        ) from None
    if free < needed:
        raise WorkdirIOError(
            f"disk full: {folder} has {free / 2**20:.1f} MiB free, a checkpoint needs about "
            f"{needed / 2**20:.1f} MiB; free space and rerun the same command to resume from "
            "the last checkpoint",
            save_failed=False,
        )


def check_saves(mngr: Any) -> None:
    """Raises the error of a failed background save, if one has finished failing.

    Raises:
      WorkdirIOError: one line saying why the save failed.
    """
    try:
        mngr.check_for_errors()
    except Exception as e:  # noqa: BLE001 -- orbax wraps the OSError in its own errors
        raise WorkdirIOError(
            f"saving a checkpoint in {mngr.directory} failed: {describe(e)}; training stopped "
            "(the earlier checkpoints are intact: rerun the same command to resume)"
        ) from None


@contextlib.contextmanager
def checked_save(mngr: Any, step: int, needed: int) -> Iterator[None]:
    """``with checked_save(mngr, step, needed): <start the save of step>``.

    Before the save: the previous one must have finished well (orbax's save would
    wait for it anyway: its failure is a failed save, and only then is the free
    space meaningful), and `mngr`'s folder must have `needed` bytes free. A save
    call that fails in the block is one line too.

    Raises:
      WorkdirIOError: the previous save failed, the room is missing, or the save
        call failed (orbax wraps the OSError).
    """
    folder = os.fspath(mngr.directory)
    wait_for_saves(mngr)
    check_room(folder, needed)
    try:
        yield
    except Exception as e:  # noqa: BLE001 -- orbax wraps the OSError
        raise WorkdirIOError(f"saving step {step} in {folder} failed: {describe(e)}") from None


def close_manager(mngr: Any, *, save_failed: bool) -> None:
    """Waits for `mngr`'s saves and closes it at the end of a run (in a ``finally``).

    After a failed save it does neither: orbax would wait 300 s on the failed
    save's threads. While another error is on its way out, a save failing too
    is suppressed so that it does not mask that error.
    """
    if save_failed:
        return
    with contextlib.suppress(Exception) if sys.exc_info()[0] else contextlib.nullcontext():
        mngr.wait_until_finished()
        mngr.close()
