"""One writer per workdir: an exclusive lock held for the whole run.

Two trainers on one workdir both write checkpoints and ``metrics.jsonl``:
the rows interleave, one save deletes the other's steps, and when they start
together one crashes on the other's half-written checkpoint. So `jattn
train` takes ``workdir/.lock`` with ``fcntl.flock`` before it writes
anything, and a second trainer is refused in one line naming the holder.

The kernel releases a flock when its process ends, however it ends
(SIGKILL included), so a lock left by a dead process is never stale: the
file's recorded holder (pid, host, start time) is only information, read
for the message. A run that ends removes the file; one found with a holder
recorded but unlocked was left by a process that died (`previous`), which
the loop reports in one line before taking it over. Network filesystems
without flock support are reported as such rather than run unlocked.
Only process 0 of a multi-process run takes the lock (the others write no
metrics, and orbax coordinates their checkpoint writes).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

__all__ = ["LOCK_FILE", "WorkdirLock", "WorkdirLockedError"]

LOCK_FILE = ".lock"


class WorkdirLockedError(RuntimeError):
    """Another live process holds the workdir's lock."""


class WorkdirLock:
    """``with WorkdirLock(workdir):`` holds the lock of `workdir` (created if needed).

    Raises (on enter):
      WorkdirLockedError: another process holds it (its pid, host and start
        time named when it recorded them).
      OSError: the workdir cannot be created or the filesystem refuses locks.
    """

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        self._fd: int | None = None
        self.previous: dict | None = None  # the holder recorded by the last run, if any

    def acquire(self) -> WorkdirLock:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                who = (
                    f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}"
                    if holder
                    else "another process"
                )
                raise WorkdirLockedError(
                    f"workdir {os.path.dirname(self.path)} is in use by {who} ({self.path}); "
                    "wait for it to finish or stop it, or use another --workdir"
                ) from None
            except OSError:
                os.close(fd)
                raise
            # The holder before us may have removed the file between our open and
            # our flock: then we hold a lock on a deleted file; take the new one.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        # A holder that ended normally removed the file: content means it died.
        self.previous = _read_holder(fd) or None
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Removes the lock file, then unlocks (a waiting `acquire` retries on the new file)."""
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}
