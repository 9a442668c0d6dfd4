"""What a grid cost: each session's wall time, jobs and machine load (the lab's record).

Not part of the jattn package: a record of this lab's machines, kept by
`lab/grid.py` (the checkout's wrapper of `jattn ablate`), which writes
`cost_section` into the grid's ``report_appendix.md`` for the report to carry.

A grid's runs are often trained over several sessions (preempted, resumed,
extended), and its wall time is only meaningful beside the load the machine
carried. `recording` appends one line per session to ``DIR/sessions.jsonl``
when the session ends (finished, preempted or failed): UTC start and end,
wall seconds, ``--jobs``, runs it set out to train, the CPUs, the GPUs (as
nvidia-smi names them; None without one) and the load
average (1, 5, 15 min) at start and end. `cost_section` turns the file into
the report's "Cost" section: runs x steps, each session, and the total, so
every wall time quoted about a grid comes from a file beside its results.

A session can also end with no chance to write that line (SIGKILL, a machine
that restarts, a job scheduler's hard limit), and its hours would vanish
from the total. So while it runs, a session keeps ``DIR/.session-<pid>.json``
(its line so far, rewritten every `HEARTBEAT_S` seconds with the time and
load). One whose heartbeat is older than three of its intervals died, and so
did one whose process is gone from this host (a SIGKILL seconds after the
start: its heartbeat is not stale yet): `read_sessions` reports it as
"killed", ended at its last heartbeat (its wall time short by less than one
interval), and the next session writes it into ``sessions.jsonl`` for good.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import glob
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = [
    "HEARTBEAT_S",
    "KILLED",
    "SESSIONS_FILE",
    "accelerators",
    "cost_section",
    "read_sessions",
    "recording",
]

SESSIONS_FILE = "sessions.jsonl"
HEARTBEAT_S = 60.0
_OPEN = ".session-{pid}.json"  # a running session's line so far
_STALE_BEATS = 3  # heartbeats missed before a session counts as dead
KILLED = "killed (no end recorded; ended at its last heartbeat)"


def _now(epoch: float | None = None) -> str:
    when = datetime.datetime.fromtimestamp(time.time() if epoch is None else epoch, datetime.UTC)
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def accelerators() -> str | None:
    """The machine's GPUs as nvidia-smi names them ("1x NVIDIA H100 80GB HBM3"), or
    None without one. Asked of nvidia-smi, not jax: this process must not take the
    GPU memory the grid's jobs share."""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.split("\n")  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    counts = collections.Counter(n.strip() for n in names if n.strip())
    return ", ".join(f"{k}x {name}" for name, k in counts.items()) or None


def _append(workdir: str, session: dict[str, Any]) -> None:
    with open(os.path.join(workdir, SESSIONS_FILE), "a") as f:
        f.write(json.dumps(session) + "\n")


def _pending(path: str) -> str:
    """Where a beat is written before its atomic rename onto ``path``."""
    return f"{path}.tmp"


def _write_open(path: str, session: dict[str, Any], started: float, heartbeat_s: float) -> None:
    """The running session's line so far, replaced atomically (never half written)."""
    now = time.time()
    beat = {
        **session,
        "ended": _now(now),
        "wall_s": round(now - started, 1),
        "load_end": _load(),
        "_last_beat_epoch": now,
        "_heartbeat_s": heartbeat_s,
        "_started_epoch": started,
        "_host": socket.gethostname(),
        "_pid": os.getpid(),
    }
    tmp = _pending(path)
    with open(tmp, "w") as f:
        f.write(json.dumps(beat))
    os.replace(tmp, path)


def _gone(beat: dict[str, Any]) -> bool:
    """Whether the process of a heartbeat on this host has ended (or its pid now names
    a process that started after the session did), so that a session killed seconds
    after its start is not "running" until three heartbeats have been missed.
    Another host's sessions (a shared filesystem) are judged by their heartbeat alone."""
    pid = beat.get("_pid")
    if beat.get("_host") != socket.gethostname() or not isinstance(pid, int):
        return False
    if pid == os.getpid():
        return False  # this process's own session
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    started = _process_start(pid)
    return started is not None and started > beat.get("_started_epoch", started) + 1.0


def _process_start(pid: int) -> float | None:
    """When process `pid` started (epoch seconds), from /proc; inf for a zombie (it
    has ended; only its parent has not collected it); None without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    if fields[0] == "Z":
        return float("inf")
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _open_sessions(workdir: str, now: float) -> list[tuple[str, dict[str, Any], bool]]:
    """Each running or dead session's file: (path, its line, whether it died)."""
    found = []
    for path in sorted(glob.glob(os.path.join(workdir, _OPEN.format(pid="*")))):
        try:
            with open(path) as f:
                beat = json.load(f)
            stale = now - beat["_last_beat_epoch"] > _STALE_BEATS * beat["_heartbeat_s"]
            dead = stale or _gone(beat)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # gone meanwhile (its session ended), or not a heartbeat of ours
        line = {k: v for k, v in beat.items() if not k.startswith("_")}
        line["outcome"] = KILLED if dead else "running"
        found.append((path, line, dead))
    return found


@contextlib.contextmanager
def recording(
    workdir: str, *, jobs: int, to_train: int | None, heartbeat_s: float = HEARTBEAT_S
) -> Iterator[dict[str, Any]]:
    """Records the session around the block (see the module docstring).

    Yields the session's dict; the caller sets ``outcome`` ("finished" or
    "preempted") and may set ``runs_to_train`` once it is known (None until
    then); a session that set it to 0 trained nothing and writes no line. An
    exception leaves "failed: <type>" and is re-raised. Sessions that died
    before this one are written to the file first.
    """
    for path, line, dead in _open_sessions(workdir, time.time()):
        if dead:
            _append(workdir, line)
            os.remove(path)
            # A kill between writing the next beat and renaming it leaves that
            # write behind; the dead session's line is in the file now.
            with contextlib.suppress(FileNotFoundError):
                os.remove(_pending(path))
    started = time.time()
    session: dict[str, Any] = {
        "started": _now(started),
        "jobs": jobs,
        "runs_to_train": to_train,
        "cpus": os.cpu_count(),
        "accelerators": accelerators(),
        "load_start": _load(),
        "outcome": "failed",
    }
    open_path = os.path.join(workdir, _OPEN.format(pid=os.getpid()))
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(heartbeat_s):
            with contextlib.suppress(OSError):  # a full disk must not stop the grid
                _write_open(open_path, session, started, heartbeat_s)

    _write_open(open_path, session, started, heartbeat_s)  # on disk before any work
    beating = threading.Thread(target=heartbeat, name="jattn-session-heartbeat", daemon=True)
    beating.start()
    start = time.monotonic()
    try:
        yield session
    except BaseException as e:
        session["outcome"] = f"failed: {type(e).__name__}"
        raise
    finally:
        stop.set()
        beating.join()
        session.update(ended=_now(), wall_s=round(time.monotonic() - start, 1), load_end=_load())
        if session["runs_to_train"] != 0:  # a session that trained nothing cost nothing
            _append(workdir, session)
        with contextlib.suppress(FileNotFoundError):
            os.remove(open_path)


def read_sessions(workdir: str) -> list[dict[str, Any]]:
    """The sessions of ``workdir``, oldest first ([] when none): those recorded,
    then any still running ("running", its time so far) or dead without an end
    (`KILLED`, ended at its last heartbeat)."""
    path = os.path.join(workdir, SESSIONS_FILE)
    recorded = []
    if os.path.exists(path):
        with open(path) as f:
            recorded = [json.loads(line) for line in f if line.strip()]
    return recorded + [line for _, line, _ in _open_sessions(workdir, time.time())]


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s} s" if minutes else f"{s} s"


def cost_section(workdir: str, steps: Sequence[int]) -> list[str]:
    """Markdown lines of the report's "Cost" section, or [] with no sessions recorded.

    Args:
      workdir: the grid's directory.
      steps: each run's ``num_train_steps``.
    """
    sessions = read_sessions(workdir)
    if not sessions:
        return []
    by_steps: dict[int, int] = {}
    for n in steps:
        by_steps[n] = by_steps.get(n, 0) + 1
    shape = " + ".join(f"{k} runs x {n:,} steps" for n, k in sorted(by_steps.items()))
    # The GPUs' column only in a grid that had one (sessions before it was recorded: -).
    gpus = any(s.get("accelerators") for s in sessions)
    rows = []
    for s in sessions:
        cells = [
            s["started"],
            s.get("ended", "-"),
            _duration(s.get("wall_s", 0)),
            s["jobs"],
            "-" if s["runs_to_train"] is None else s["runs_to_train"],
            s["cpus"],
            *([s.get("accelerators") or "-"] if gpus else []),
            ", ".join(map(str, s["load_start"])),
            ", ".join(map(str, s.get("load_end", []))),
            s["outcome"],
        ]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    total = sum(s.get("wall_s", 0) for s in sessions)
    return [
        "## Cost",
        "",
        f"{shape}; wall time {_duration(total)} over {len(sessions)} session(s) of "
        f"`jattn ablate` ({SESSIONS_FILE}; the load average is the machine's, 1/5/15 min, at "
        "each session's start and end: other work on the machine slows a grid down).",
        "",
        "| started | ended | wall time | --jobs | runs to train | CPUs | "
        + ("GPUs | " if gpus else "")
        + "load at start | load at end | outcome |",
        "|---|---|---:|---:|---:|---:|" + ("---|" if gpus else "") + "---|---|---|",
        *rows,
        "",
    ]
