"""A run sharded over the ``fsdp`` or the ``tensor`` axis resumes (issue 54, item 1).

Before: with two devices, resuming configs/smoke.py on mesh ``(1,1,2)`` or
``(1,2,1)`` waited 40 s on an all-reduce and aborted (exit 134, a C++ stack):
the restore's finiteness check ran one eager op per array on the sharded state.
Now the checks are one jitted function, and each case is the fault itself: a
2-device run on the mesh, SIGKILLed a few steps after a checkpoint, resumed

- on the same mesh: the steps it trains again are the killed process's, bit
  for bit, and it finishes;
- on the other sharded mesh: the same steps to float rounding (the reductions
  are split across the devices another way), and it finishes.

A run written on one device resumes on ``(1,1,2)`` the same way (it aborted too).
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
from fault_harness import REPO, losses, steps_on_disk, train_cmd

MESHES = {"fsdp": "(1,2,1)", "tensor": "(1,1,2)", "one device": "(1,1,1)"}
OTHER = {"fsdp": "tensor", "tensor": "fsdp"}


def _devices(env: dict[str, str], axis: str) -> dict[str, str]:
    """`env` with the CPU devices the mesh of `axis` takes (2, or 1 for "one device")."""
    count = 1 if axis == "one device" else 2
    return dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={count}")


def _cmd(workdir, data_dir, mesh: str) -> list[str]:
    return train_cmd(workdir, data_dir, f"--config.mesh_shape={mesh}")


def _kill_after_a_save(workdir, proc: subprocess.Popen, timeout: float = 300) -> int:
    """SIGKILLs `proc` once a checkpoint is on disk and three steps after it are logged
    (never right at one); the last step it logged."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        saved = steps_on_disk(workdir) if (workdir / "checkpoints").is_dir() else []
        done = losses(workdir) if saved else {}
        if done and max(done) >= saved[-1] + 3:
            proc.kill()
            proc.communicate(timeout=60)
            return max(losses(workdir))
        assert proc.poll() is None, f"the run exited early: {proc.communicate()}"
        time.sleep(0.005)
    raise TimeoutError(f"no checkpoint within {timeout} s")


def _kill(axis: str, data_dir, env, tmp_path_factory):
    """A run on the mesh of `axis`, SIGKILLed a few steps after a checkpoint:
    (axis, workdir, {step: loss} it logged, its last checkpoint)."""
    workdir = tmp_path_factory.mktemp(f"killed_{axis.replace(' ', '_')}") / "run"
    proc = subprocess.Popen(
        _cmd(workdir, data_dir, MESHES[axis]),
        env=_devices(env, axis),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = _kill_after_a_save(workdir, proc)
    assert seen < 40, "the run finished before it could be killed"
    last_save = max(steps_on_disk(workdir))
    assert seen > last_save, "killed exactly at a checkpoint: nothing to train again"
    return axis, workdir, losses(workdir), last_save


@pytest.fixture(scope="module", params=["fsdp", "tensor"])
def killed(request, pristine_data, cli_env, tmp_path_factory):
    """A 2-device run on the mesh sharded over `request.param`, SIGKILLed (`_kill`)."""
    return _kill(request.param, pristine_data, cli_env, tmp_path_factory)


def _resume(killed_run, to: str, data_dir, env, tmp_path) -> tuple[list[float], list[float]]:
    """Resumes a copy of a killed run on the mesh of `to` to its end: the losses of the
    steps it trained again, and those the killed process had logged for them."""
    _, written, before, last_save = killed_run
    workdir = tmp_path / "run"
    shutil.copytree(written, workdir)
    proc = subprocess.run(
        _cmd(workdir, data_dir, MESHES[to]),
        env=_devices(env, to),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "skipped" not in proc.stderr, proc.stderr[-3000:]
    after = losses(workdir)
    assert sorted(after) == list(range(1, 41))
    again = [s for s in before if s > last_save]
    assert again
    return [after[s] for s in again], [before[s] for s in again]


@pytest.mark.parametrize("where", ["same mesh", "other mesh"])
def test_a_sharded_run_killed_resumes_on_its_mesh_and_on_another(
    where, killed, pristine_data, cli_env, tmp_path
):
    axis = killed[0]
    got, lost = _resume(killed, axis if where == "same mesh" else OTHER[axis], pristine_data,
                        cli_env, tmp_path)  # fmt: skip
    if where == "same mesh":
        assert got == lost  # bit for bit
    else:
        assert got == pytest.approx(lost, rel=1e-5, abs=0)


@pytest.mark.slow
def test_a_run_killed_on_one_device_resumes_sharded(
    pristine_data, cli_env, tmp_path_factory, tmp_path
):
    killed_run = _kill("one device", pristine_data, cli_env, tmp_path_factory)
    got, lost = _resume(killed_run, "tensor", pristine_data, cli_env, tmp_path)
    assert got == pytest.approx(lost, rel=1e-5, abs=0)  # float rounding: another mesh
