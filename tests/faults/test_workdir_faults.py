"""Two writers, unwritable or full disks, SIGTERM at start-up, nonsense config values:
a documented exit code and one line, within seconds, with nothing lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from fault_harness import (
    REPO,
    error_line,
    losses,
    mount_tmpfs,
    run_cli,
    smoke_config,
    train_cmd,
    umount,
)

from jattn.train import ConfigError, train_and_evaluate
from jattn.train.filesystem import WorkdirIOError
from jattn.train.workdir import WorkdirLock, WorkdirLockedError


def test_a_held_workdir_is_refused_and_a_dead_holder_is_taken_over(pristine_data, tmp_path):
    workdir = tmp_path / "run"
    with WorkdirLock(str(workdir)):
        with pytest.raises(WorkdirLockedError, match=f"pid {os.getpid()}"):
            train_and_evaluate(smoke_config(pristine_data, num_train_steps=2), str(workdir))
    assert not (workdir / ".lock").exists()  # released and removed
    # A holder that died leaves its record, but no lock: taken over with a warning.
    (workdir / ".lock").write_text(json.dumps({"pid": 999999, "host": "gone"}))
    final = train_and_evaluate(smoke_config(pristine_data, num_train_steps=2), str(workdir))
    assert final["step"] == 2


@pytest.mark.slow
def test_two_trainers_started_together_one_refused_one_finishes(pristine_data, tmp_path, cli_env):
    cmd = train_cmd(tmp_path / "run", pristine_data, "--config.num_train_steps=20")
    procs = [
        subprocess.Popen(cmd, env=cli_env, cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    results = [(p.wait(timeout=180), p.communicate()[1]) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 3], results
    refused = next(err for code, err in results if code == 3)
    assert "is in use by pid" in error_line(refused)
    assert sorted(losses(tmp_path / "run")) == list(range(1, 21))  # each step once


def test_a_read_only_workdir_is_refused_at_start(pristine_data, small_disk, cli_env):
    (small_disk / "run").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(WorkdirIOError, match="read-only filesystem"):
        train_and_evaluate(smoke_config(pristine_data), str(small_disk / "run"))
    start = time.monotonic()
    proc = run_cli(small_disk / "run", pristine_data, cli_env)
    assert proc.returncode == 4
    assert "read-only filesystem" in error_line(proc.stderr)
    assert time.monotonic() - start < 60


def test_a_full_disk_stops_at_the_first_save_in_one_line(pristine_data, small_disk, cli_env):
    """2 MiB hold the run's files and a few 0.4 MiB checkpoints, not all of them."""
    proc = run_cli(small_disk / "run", pristine_data, cli_env, "--config.keep_checkpoints=40",
                   timeout=120)  # fmt: skip
    assert proc.returncode == 4, proc.stderr[-2000:]
    line = error_line(proc.stderr)
    assert "disk full" in line, line
    assert len(proc.stderr.splitlines()) < 30  # no wall of orbax errors


@pytest.mark.slow
def test_a_disk_filling_up_mid_run_stops_at_the_next_save(pristine_data, tmp_path, cli_env):
    """Another program fills the disk after step 10 was saved: the run stops at its next
    save within seconds, in one line, with steps up to 10 intact."""
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "16m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        cmd = train_cmd(disk / "run", pristine_data, "--config.num_train_steps=400",
                        "--config.checkpoint_every_steps=10")  # fmt: skip
        proc = subprocess.Popen(cmd, env=cli_env, cwd=REPO, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not (disk / "run" / "checkpoints" / "10" / "commit_success.txt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        with open(disk / "filler", "wb", buffering=0) as f:  # the other program (unbuffered:
            # a close that flushes into the full disk would raise)
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
            except OSError:
                pass
        start = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - start < 30
        assert proc.returncode == 4, err[-2000:]
        assert "disk full" in error_line(err)
        assert 10 in [int(p.name) for p in (disk / "run" / "checkpoints").iterdir()
                      if p.name.isdigit()]  # fmt: skip
    finally:
        umount(disk)


def _sigterm_when(ready, workdir, data_dir, env) -> str:
    """Starts `jattn train`, sends SIGTERM once `ready(proc)` holds, and returns the
    stderr of a process that exited 0 having written no training step."""
    proc = subprocess.Popen(train_cmd(workdir, data_dir), env=env, cwd=REPO,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not ready(proc):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert not losses(workdir)  # nothing trained, nothing half-written
    return err


def test_sigterm_during_start_up_exits_0_with_a_message(pristine_data, tmp_path, cli_env):
    workdir = tmp_path / "run"
    # Start-up: the workdir is being opened.
    err = _sigterm_when(lambda _: (workdir / ".lock").exists(), workdir, pristine_data, cli_env)
    assert "stopped by SIGTERM" in error_line(err)


HEAVY = ("jax", "numpy", "flax", "optax", "orbax", "tensorflow_datasets", "grain")


def test_the_command_imports_nothing_heavy_before_its_sigterm_handler(cli_env):
    # `jattn.cli.main` installs the handler first; what runs before it is the
    # import of `jattn` and `jattn.cli`, which must stay within the standard
    # library (it imported jax, ~1.6 s, before: a SIGTERM then exited 143).
    code = "import sys, jattn.cli; print(sorted(m for m in sys.modules if m.split('.')[0] in %r))"
    out = subprocess.run([sys.executable, "-c", code % (HEAVY,)], env=cli_env, cwd=REPO,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.strip() == "[]", out


def _catches_sigterm(proc) -> bool:
    """Whether `proc` has a handler for SIGTERM (/proc's SigCgt mask)."""
    with open(f"/proc/{proc.pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


def test_sigterm_at_the_first_instant_the_command_can_catch_it_exits_0(
    pristine_data, tmp_path, cli_env
):
    # As early as the process can answer at all: the moment its handler is in
    # place (while jax and the training code are still being imported).
    err = _sigterm_when(_catches_sigterm, tmp_path / "run", pristine_data, cli_env)
    assert "stopped by SIGTERM outside training; nothing was lost" in error_line(err)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"learning_rate": -0.1}, "config.learning_rate must be a number >= 0"),
        ({"warmup_steps": -5}, "config.warmup_steps must be a number >= 0"),
        ({"eval_splits": "validaton"}, "['validaton'] not a split of 'copy/tiny'"),
        ({"eval_splits": "validation", "best_metric": "eval/validation/exact_mach"},
         "best_metric='eval/validation/exact_mach' is not a metric this run logs"),
        ({"max_len": 2}, "drops"),
    ],
)  # fmt: skip
def test_nonsense_config_values_are_refused_before_anything_is_written(
    pristine_data, tmp_path, overrides, message
):
    with pytest.raises(ConfigError, match=None) as e:
        train_and_evaluate(smoke_config(pristine_data, **overrides), str(tmp_path / "run"))
    assert message in str(e.value) and "\n" not in str(e.value)
    written = [p.name for p in (tmp_path / "run").glob("*") if p.is_file()]
    assert not written, written  # refused before config, metrics or checkpoints were written


def test_max_len_1_is_refused_at_once_not_spun_on(pristine_data, tmp_path, cli_env):
    start = time.monotonic()
    proc = run_cli(tmp_path / "run", pristine_data, cli_env, "--config.max_len=1", timeout=60)
    assert proc.returncode == 2
    assert "max_len=1" in error_line(proc.stderr)
    assert time.monotonic() - start < 60


def test_a_dropped_share_is_reported(pristine_data, tmp_path, capsys):
    train_and_evaluate(smoke_config(pristine_data, max_len=12, num_train_steps=2),
                       str(tmp_path / "run"))  # fmt: skip
    assert "note: max_len=12" in capsys.readouterr().err
