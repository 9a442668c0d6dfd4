"""Fixtures of the fault suite: a private copy of the prepared data, a finished
reference run on it, and the environment of `jattn train` subprocesses.

Every case damages its own copy (of the data directory or of the reference
workdir), never the shared ~/tensorflow_datasets, and runs configs/smoke.py.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
from fault_harness import DATA_DIR_NAME, REPO, losses, mount_tmpfs, smoke_config, umount

from jattn.train import train_and_evaluate


@pytest.fixture(scope="session")
def pristine_data(tmp_path_factory) -> Path:
    """copy/tiny prepared once into a private data directory (with its manifest)."""
    from jattn import data

    root = tmp_path_factory.mktemp("faults_data")
    data.load("copy/tiny", data_dir=str(root))
    return root


@pytest.fixture
def data_dir(pristine_data, tmp_path) -> Path:
    """A copy of the prepared data that a test may damage."""
    dst = tmp_path / DATA_DIR_NAME
    shutil.copytree(pristine_data, dst)
    return dst


@pytest.fixture(scope="session")
def reference(pristine_data, tmp_path_factory):
    """The uninterrupted 40-step smoke run: (workdir, losses). Checkpoints 30 and 40."""
    workdir = tmp_path_factory.mktemp("faults_reference")
    train_and_evaluate(smoke_config(pristine_data), str(workdir))
    return workdir, losses(workdir)


@pytest.fixture
def run_copy(reference, tmp_path) -> Path:
    """A copy of the reference workdir that a test may damage."""
    dst = tmp_path / "run"
    shutil.copytree(reference[0], dst)
    return dst


@pytest.fixture(scope="session")
def cli_env(session_compilation_cache):
    """Environment for `jattn train` subprocesses: CPU, the session's compilation
    cache (JATTN_COMPILATION_CACHE, tests/conftest.py)."""
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        JATTN_COMPILATION_CACHE=session_compilation_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.pop("XLA_FLAGS", None)
    return env


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (mounting needs privileges: skipped without them)."""
    disk = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    if not mount_tmpfs(disk, "2m"):
        pytest.skip("mounting a tmpfs needs root")
    yield disk
    umount(disk)
