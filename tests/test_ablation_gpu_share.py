"""`jattn ablate --jobs N` on one accelerator: each job's process gets a share
of the GPU's memory (`jattn.analysis.parallel.job_environment`), set only on a
GPU and never over the user's own settings, and the spawned job sees it."""

from __future__ import annotations

import os
import pathlib

import pytest

from jattn.analysis import expand, parallel
from jattn.analysis.grid import checked_configs
from jattn.train.config import load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = str(ROOT / "experiments" / "positional.py") + ":tiny"


@pytest.mark.parametrize(("jobs", "fraction"), [(1, "0.900"), (2, "0.450"), (3, "0.300")])
@pytest.mark.parametrize("platform", ["gpu", "cuda", "rocm"])
def test_a_gpu_job_gets_its_share_of_the_memory(jobs, fraction, platform):
    env = parallel.job_environment(jobs, platform, {"PATH": "/bin"})
    assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": fraction}


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_nothing_is_set_off_a_gpu(platform):
    assert parallel.job_environment(2, platform, {}) == {}


@pytest.mark.parametrize("key", parallel.SHARING_KEYS)
def test_the_users_own_sharing_settings_win(key):
    assert parallel.job_environment(2, "gpu", {key: "x"}) == {}


def test_the_platform_is_read_from_jax_platforms_first():
    assert parallel.accelerator({"JAX_PLATFORMS": "cpu"}) == "cpu"
    assert parallel.accelerator({"JAX_PLATFORMS": "cuda,cpu"}) == "gpu"
    assert parallel.accelerator({"JAX_PLATFORMS": "tpu"}) == "tpu"
    nodes = ("/dev/nvidiactl", "/dev/kfd", "/dev/accel0")
    if not any(os.path.exists(node) for node in nodes):  # no accelerator's driver here
        assert parallel.accelerator({}) == "cpu"


@pytest.mark.parametrize(("platform", "expect"), [("gpu", "0.900"), ("cpu", None)])
def test_the_spawned_job_sees_its_share(tmp_path, monkeypatch, platform, expect):
    """A real spawned job (one that fails fast: its data set does not exist)
    prints the sharing settings its process has; the parent's are restored."""
    for key in parallel.SHARING_KEYS:
        monkeypatch.delenv(key, raising=False)
    exp = load_config(TINY)
    runs = expand(exp, str(tmp_path))
    configs = checked_configs(exp, runs, str(ROOT))
    with configs[0].unlocked():
        configs[0].dataset = "no_such_dataset"
    lines = []
    with pytest.raises(parallel.JobFailed):
        parallel.train_jobs(
            [0], runs, configs, str(tmp_path),
            slots=[(sorted(os.sched_getaffinity(0))[0],)], log=lines.append,
            on_done=lambda status: pytest.fail(f"no job finished: {status}"),
            progress=lambda number, done, what: f"[{number}] {what}", platform=platform,
        )  # fmt: skip
    log = (tmp_path / "logs" / "position-sinusoidal_seed-0.log").read_text()
    assert "no_such_dataset" in log  # the job ran
    if expect:
        assert f"job environment: XLA_PYTHON_CLIENT_MEM_FRACTION={expect}" in log
        assert f"each with XLA_PYTHON_CLIENT_MEM_FRACTION={expect}" in "\n".join(lines)
    else:
        assert "job environment" not in log and not any("share" in x for x in lines)
    assert not any(key in os.environ for key in parallel.SHARING_KEYS)
