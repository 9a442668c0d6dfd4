"""A run's files: their names, and the one reader and writer of each.

A `jattn train` workdir (and each run directory of a grid) holds::

    config.json          the full config (`config_to_json`); `load_run` reads it back
    model_config.json    the TransformerConfig
    tokenizer.json       the tokenizer (and its vocabulary file)
    data_check.json      `jattn.data.producibility.check` of the evaluation splits
    metrics.jsonl        one JSON object a line: ``step`` and metric names
    tb/                  TensorBoard event files
    decodes/<split>.jsonl  the latest evaluation's decoded examples
    checkpoints/         orbax checkpoints (``checkpoints.skipped/``: set aside)
    final_metrics.json   once the run reached ``num_train_steps``

Training (`jattn.train.run`), recovery, `jattn.train.load`, checkpoints and
the ablation report (`jattn.analysis`) name these files only through the
constants here, and read them with these readers, so a name changes in one
place. Nothing here needs jax.

One writer per workdir (`WorkdirLock`): an exclusive lock held for the
whole run, in ``.lock``.

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
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CHECKPOINTS",
    "CONFIG",
    "DATA_CHECK",
    "DECODES",
    "FINAL_METRICS",
    "LOCK_FILE",
    "METRICS",
    "MODEL_CONFIG",
    "TENSORBOARD",
    "WorkdirLock",
    "WorkdirLockedError",
    "decodes_path",
    "finished_metrics",
    "read_json",
    "read_jsonl",
    "write_json",
    "write_run_files",
]

CONFIG = "config.json"
MODEL_CONFIG = "model_config.json"
DATA_CHECK = "data_check.json"
METRICS = "metrics.jsonl"
FINAL_METRICS = "final_metrics.json"
DECODES = "decodes"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tb"


def read_json(path: str) -> Any:
    """The JSON value in `path`, or None when there is no such file."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_json(path: str, value: Any) -> None:
    """Writes `value` to `path` as indented JSON."""
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Every row of a JSON-lines file (empty when there is none); a torn line (a crash
    mid-write) is skipped."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return rows


def decodes_path(workdir: str, split: str) -> str:
    """``workdir/decodes/<split>.jsonl``."""
    return os.path.join(workdir, DECODES, f"{split}.jsonl")


def finished_metrics(workdir: str, num_train_steps: int) -> dict[str, Any] | None:
    """The saved ``final_metrics.json`` if the run in `workdir` reached
    `num_train_steps` (a run stopped earlier, or trained with fewer steps, is not
    finished), else None."""
    final = read_json(os.path.join(workdir, FINAL_METRICS))
    if final is not None and final.get("step") == num_train_steps:
        return final
    return None


def write_run_files(
    workdir: str, record: Mapping[str, Any], model_config, tokenizer, data_check: Mapping[str, Any]
) -> None:
    """What makes a workdir self-contained (`load_run`): ``config.json`` (the run's
    config as plain JSON, `Parts.record`, written as `config_to_json` writes it),
    ``model_config.json``, the tokenizer and ``data_check.json``."""
    from jattn.data.tokenizers import save_to_dir  # noqa: PLC0415 -- keeps this module light

    with open(os.path.join(workdir, CONFIG), "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
    with open(os.path.join(workdir, MODEL_CONFIG), "w") as f:
        json.dump(model_config.to_dict(), f, indent=2, sort_keys=True)
    save_to_dir(tokenizer, workdir)
    write_json(os.path.join(workdir, DATA_CHECK), dict(data_check))


# -- one writer per workdir --------------------------------------------------------------

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
