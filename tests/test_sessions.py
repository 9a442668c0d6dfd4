"""What a grid cost survives the session that paid it: the lab's `lab/sessions.py`.

A session that ends normally writes its line; one killed outright (SIGKILL, a
restart) leaves its heartbeat file (the child beats every 0.5 s: slack for a
loaded CI machine), which reads as "killed" with the wall
time up to its last beat and is folded into ``sessions.jsonl`` by the next
session. The kill is real: a child process in a session, SIGKILLed.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: lab/
from lab import sessions  # noqa: E402

CHILD = textwrap.dedent(
    """
    import sys, time
    from lab import sessions
    beat = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
    with sessions.recording(sys.argv[1], jobs=2, to_train=3, heartbeat_s=beat) as s:
        print("in", flush=True)
        time.sleep(600)
        s["outcome"] = "finished"
    """
)


def _child_in_a_session(workdir, *heartbeat_s: str) -> subprocess.Popen:
    """A process inside a session (`CHILD`), returned once the session has begun."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(workdir), *heartbeat_s],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    if child.stdout.readline().strip() != "in":
        child.kill()
        child.wait(timeout=60)
        raise AssertionError("the child never entered its session")
    return child


def _open_files(workdir) -> list[str]:
    """The heartbeat files. Not the ``.tmp`` a beat is written to before its atomic
    rename: a live session's is there for a moment each beat (CI once caught one)."""
    return sorted(
        p.name
        for p in workdir.iterdir()
        if p.name.startswith(".session-") and p.name.endswith(".json")
    )


def _session_leftovers(workdir) -> list[str]:
    """Everything a session wrote beside ``sessions.jsonl``, ``.tmp`` writes included."""
    return sorted(p.name for p in workdir.iterdir() if p.name.startswith(".session-"))


def test_a_session_that_ends_writes_its_line_and_leaves_no_heartbeat(tmp_path):
    with sessions.recording(str(tmp_path), jobs=1, to_train=2, heartbeat_s=0.05) as s:
        (live,) = sessions.read_sessions(str(tmp_path))
        assert live["outcome"] == "running" and live["started"] == s["started"]
        time.sleep(0.2)
        s["outcome"] = "finished"
    assert _session_leftovers(tmp_path) == []
    (done,) = sessions.read_sessions(str(tmp_path))
    assert done["outcome"] == "finished" and done["runs_to_train"] == 2
    assert done["wall_s"] >= 0.2 and len(done["load_end"]) == 3


def test_a_killed_session_keeps_its_wall_time_and_the_next_one_records_it(tmp_path):
    child = _child_in_a_session(tmp_path)
    try:
        time.sleep(3.0)  # about six heartbeats
        os.kill(child.pid, signal.SIGKILL)  # no finally, no line written
    finally:
        child.wait(timeout=60)
    assert not (tmp_path / sessions.SESSIONS_FILE).exists()
    assert _open_files(tmp_path) == [f".session-{child.pid}.json"]

    time.sleep(2.0)  # more than three missed heartbeats: dead
    (killed,) = sessions.read_sessions(str(tmp_path))
    assert killed["outcome"] == sessions.KILLED
    assert killed["jobs"] == 2 and killed["runs_to_train"] == 3
    assert 2.0 <= killed["wall_s"] <= 4.0, killed["wall_s"]  # short by about one beat
    assert killed["ended"] >= killed["started"] and len(killed["load_end"]) == 3
    assert not any(k.startswith("_") for k in killed)  # the file's bookkeeping stays out

    # The report's cost section counts it.
    cost = "\n".join(sessions.cost_section(str(tmp_path), [100, 100, 100]))
    assert sessions.KILLED in cost and "over 1 session(s)" in cost

    # The next session writes the dead one into the file for good, before its own line.
    with sessions.recording(str(tmp_path), jobs=1, to_train=1, heartbeat_s=0.05) as s:
        s["outcome"] = "finished"
    lines = [json.loads(x) for x in (tmp_path / sessions.SESSIONS_FILE).read_text().splitlines()]
    assert [x["outcome"] for x in lines] == [sessions.KILLED, "finished"]
    assert lines[0] == killed
    assert _session_leftovers(tmp_path) == []
    assert sessions.read_sessions(str(tmp_path)) == lines


def test_a_session_killed_before_its_heartbeat_is_stale_reads_as_killed(tmp_path):
    """Before (issue 54): a `jattn ablate` SIGKILLed in its first minute was listed as
    "running", 0 s, until three heartbeats (3 minutes) were missed. Its process is
    gone from this host: it is killed at once."""
    child = _child_in_a_session(tmp_path, "60")  # the default heartbeat: one beat, at start
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=60)
    (killed,) = sessions.read_sessions(str(tmp_path))
    assert killed["outcome"] == sessions.KILLED
    assert killed["wall_s"] < 60
    with sessions.recording(str(tmp_path), jobs=1, to_train=1, heartbeat_s=0.05) as s:
        s["outcome"] = "finished"
    outcomes = [x["outcome"] for x in sessions.read_sessions(str(tmp_path))]
    assert outcomes == [sessions.KILLED, "finished"]
    assert _session_leftovers(tmp_path) == []


def test_a_live_session_of_another_process_is_not_taken_for_dead(tmp_path):
    child = _child_in_a_session(tmp_path)
    try:
        time.sleep(1.0)
        (live,) = sessions.read_sessions(str(tmp_path))
        assert live["outcome"] == "running" and live["wall_s"] > 0
        assert _open_files(tmp_path) == [f".session-{child.pid}.json"]
    finally:
        child.kill()
        child.wait(timeout=60)


def test_a_session_killed_mid_beat_leaves_nothing_once_the_next_one_records_it(tmp_path):
    """A kill between writing a beat to its ``.tmp`` and renaming it: the beat before
    it is the dead session's line, and the half-done write goes with it."""
    with sessions.recording(str(tmp_path), jobs=1, to_train=4, heartbeat_s=0.05) as s:
        heartbeat = tmp_path / f".session-{os.getpid()}.json"
        beat = json.loads(heartbeat.read_text())
        s["outcome"] = "finished"
    # What a process killed mid-beat leaves: its last beat, long stale, and the next.
    dead = tmp_path / ".session-999999999.json"
    beat["_last_beat_epoch"] -= 3600
    dead.write_text(json.dumps(beat))
    (tmp_path / f"{dead.name}.tmp").write_text(json.dumps(beat)[:20])
    with sessions.recording(str(tmp_path), jobs=1, to_train=1, heartbeat_s=0.05) as s:
        s["outcome"] = "finished"
    outcomes = [x["outcome"] for x in sessions.read_sessions(str(tmp_path))]
    assert outcomes == ["finished", sessions.KILLED, "finished"]
    assert _session_leftovers(tmp_path) == []


def test_a_session_that_trained_nothing_writes_no_line(tmp_path):
    with sessions.recording(str(tmp_path), jobs=1, to_train=None, heartbeat_s=0.05) as s:
        s["runs_to_train"] = 0
        s["outcome"] = "finished"
    assert sessions.read_sessions(str(tmp_path)) == []
    assert _session_leftovers(tmp_path) == []


def test_a_grid_on_a_gpu_names_it_in_its_cost(tmp_path, monkeypatch):
    """A grid's wall time means something beside its machine: a session on a GPU
    machine records the GPUs nvidia-smi names (not jax: the recording process
    must not take the memory its jobs share), and the cost table shows them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # what nvidia-smi --query-gpu=name prints on two GPUs
    smi.write_text("#!/bin/sh\nprintf 'NVIDIA H100 80GB HBM3\\nNVIDIA H100 80GB HBM3\\n'\n")
    smi.chmod(0o755)
    workdir = tmp_path / "grid"
    workdir.mkdir()
    with sessions.recording(str(workdir), jobs=1, to_train=1, heartbeat_s=60) as s:
        s["outcome"] = "finished"  # on this machine: no nvidia-smi on PATH
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with sessions.recording(str(workdir), jobs=6, to_train=36, heartbeat_s=60) as s:
        s["outcome"] = "preempted"
    cpu, gpu = sessions.read_sessions(str(workdir))
    assert cpu["accelerators"] is None and gpu["accelerators"] == "2x NVIDIA H100 80GB HBM3"
    table = [x for x in sessions.cost_section(str(workdir), [100]) if x.startswith("|")]
    assert table[0].split(" | ")[6] == "GPUs"
    assert [row.split(" | ")[6] for row in table[2:]] == ["-", "2x NVIDIA H100 80GB HBM3"]
    assert all(row.count("|") == table[0].count("|") for row in table)


def test_a_grid_without_a_gpu_keeps_its_cost_table(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, as on this lab's CPUs
    with sessions.recording(str(tmp_path), jobs=2, to_train=4, heartbeat_s=60) as s:
        s["outcome"] = "finished"
    (header,) = [x for x in sessions.cost_section(str(tmp_path), [10]) if "| started" in x]
    assert "GPUs" not in header and header.count("|") == 10
