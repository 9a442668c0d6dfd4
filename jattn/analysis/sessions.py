"""What a grid cost: each `jattn ablate` session's wall time, jobs and machine load.

A grid's runs are often trained over several sessions (preempted, resumed,
extended), and its wall time is only meaningful beside the load the machine
carried. `recording` appends one line per session to ``DIR/sessions.jsonl``
when the session ends (finished, preempted or failed): UTC start and end,
wall seconds, ``--jobs``, runs it set out to train, the CPUs and the load
average (1, 5, 15 min) at start and end. `cost_section` turns the file into
the report's "Cost" section: runs x steps, each session, and the total, so
every wall time quoted about a grid comes from a file beside its results.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["SESSIONS_FILE", "cost_section", "read_sessions", "recording"]

SESSIONS_FILE = "sessions.jsonl"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@contextlib.contextmanager
def recording(workdir: str, *, jobs: int, to_train: int) -> Iterator[dict[str, Any]]:
    """Records the session around the block (see the module docstring).

    Yields the session's dict; the caller sets ``outcome`` ("finished" or
    "preempted"); an exception leaves "failed: <type>" and is re-raised.
    """
    session: dict[str, Any] = {
        "started": _now(),
        "jobs": jobs,
        "runs_to_train": to_train,
        "cpus": os.cpu_count(),
        "load_start": _load(),
        "outcome": "failed",
    }
    start = time.monotonic()
    try:
        yield session
    except BaseException as e:
        session["outcome"] = f"failed: {type(e).__name__}"
        raise
    finally:
        session.update(ended=_now(), wall_s=round(time.monotonic() - start, 1), load_end=_load())
        with open(os.path.join(workdir, SESSIONS_FILE), "a") as f:
            f.write(json.dumps(session) + "\n")


def read_sessions(workdir: str) -> list[dict[str, Any]]:
    """The sessions recorded in ``workdir`` (oldest first; [] when none)."""
    path = os.path.join(workdir, SESSIONS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
    rows = [
        f"| {s['started']} | {s.get('ended', '-')} | {_duration(s.get('wall_s', 0))} | "
        f"{s['jobs']} | {s['runs_to_train']} | {s['cpus']} | "
        f"{', '.join(map(str, s['load_start']))} | {', '.join(map(str, s.get('load_end', [])))} | "
        f"{s['outcome']} |"
        for s in sessions
    ]
    total = sum(s.get("wall_s", 0) for s in sessions)
    return [
        "## Cost",
        "",
        f"{shape}; wall time {_duration(total)} over {len(sessions)} session(s) of "
        f"`jattn ablate` ({SESSIONS_FILE}; the load average is the machine's, 1/5/15 min, at "
        "each session's start and end: other work on the machine slows a grid down).",
        "",
        "| started | ended | wall time | --jobs | runs to train | CPUs | load at start | "
        "load at end | outcome |",
        "|---|---|---:|---:|---:|---:|---|---|---|",
        *rows,
        "",
    ]
