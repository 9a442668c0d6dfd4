"""The encoder-only model in training as the other architectures are: with
Ruoss et al.'s randomised positions over M = 2,048 and sharded over a mesh
of eight devices, where a sharded run's losses equal one device's.

The task is one of Delétang et al.'s (parity check on the tiny data set, the
paper's own encoder-only setting), on a model small enough for a test.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
from run_helpers import losses, sharded_mesh_axes

from jattn.train import apply_overrides, load_config, train_and_evaluate

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs" / "chomsky.py") + ":parity_check,tiny,rope"
STEPS = 4
OVERRIDES = [
    ("model.architecture", "encoder_only"),
    ("model.num_layers", "2"),
    ("model.d_model", "32"),
    ("model.num_heads", "4"),
    ("model.d_ff", "64"),
    ("model.dropout_rate", "0.0"),
    ("batch_size", "16"),
    ("num_train_steps", str(STEPS)),
    ("eval_splits", "()"),
]
M = [("model.random_positions", "2048")]


def config(*extra):
    return apply_overrides(load_config(CONFIG), [*OVERRIDES, *extra])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """Losses of one-device runs with and without randomised positions."""
    out = {}
    for name, extra in (("random", M), ("plain", [])):
        workdir = tmp_path_factory.mktemp(name)
        train_and_evaluate(config(*extra), str(workdir))
        out[name] = losses(workdir)
    return out


def test_randomised_positions_over_2048_train_and_change_the_draws(one_device):
    random, plain = one_device["random"], one_device["plain"]
    assert sorted(random) == sorted(plain) and max(random) == STEPS
    assert all(math.isfinite(v) for v in random.values())
    # Same data, same initialisation: RoPE at positions drawn from [0, 2048)
    # gives other losses than plain positions.
    assert abs(random[STEPS] - plain[STEPS]) > 1e-6, (random, plain)


MESH_SCRIPT = """
import json, sys
import jax
from jattn.train import apply_overrides, load_config, read_metrics, train_and_evaluate
assert jax.device_count() == 8, jax.devices()
overrides = json.loads(sys.argv[3])
out = {}
for mesh in ("(2,2,2)", "(8,1,1)"):
    c = apply_overrides(load_config(sys.argv[1]), [*map(tuple, overrides), ("mesh_shape", mesh)])
    train_and_evaluate(c, f"{sys.argv[2]}/{mesh}")
    out[mesh] = {r["step"]: r["train/loss"] for r in read_metrics(f"{sys.argv[2]}/{mesh}")
                 if "train/loss" in r}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_sharded_encoder_only_matches_one_device(one_device, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, CONFIG, str(tmp_path), json.dumps([*OVERRIDES, *M])],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    want = one_device["random"]
    for mesh in ("(2,2,2)", "(8,1,1)"):
        got = {int(k): v for k, v in result[mesh].items()}
        assert sorted(got) == sorted(want), (mesh, got)
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=2e-5), (mesh, step, got, want)
    # The (2,2,2) run sharded its parameters over fsdp and tensor (orbax's record).
    assert {"fsdp", "tensor"} <= sharded_mesh_axes(tmp_path / "(2,2,2)", STEPS)
