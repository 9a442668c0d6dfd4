"""What a run says and sets about its numerics: `config.matmul_precision`
(jax's default_matmul_precision for the run's traces) and the one line
`jattn train` prints for the path `implementation=None` took."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jattn.train.config import ConfigError, check_config, default_config, matmul_precision

REPO = pathlib.Path(__file__).resolve().parent.parent
SMOKE = str(REPO / "configs" / "smoke.py")


def _dot_precisions(config) -> list:
    """The precision of each dot_general traced under the run's context."""
    with matmul_precision(config):
        jaxpr = jax.make_jaxpr(lambda a: jnp.einsum("ij,jk->ik", a, a))(jnp.ones((4, 4)))
    return [e.params["precision"] for e in jaxpr.eqns if e.primitive.name == "dot_general"]


def test_default_leaves_jax_default_and_highest_sets_it():
    config = default_config()
    assert config.matmul_precision == "default"
    assert _dot_precisions(config) == [None]  # traced exactly as without the key
    config.matmul_precision = "highest"
    (precision,) = _dot_precisions(config)
    assert precision == (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert _dot_precisions(default_config()) == [None]  # the context ended


def test_unknown_precision_is_refused_in_one_line():
    config = default_config()
    config.matmul_precision = "tf32"
    with pytest.raises(ConfigError, match=r"config.matmul_precision='tf32': choose one of"):
        check_config(config)


def test_jattn_train_prints_its_attention_path_and_records_its_precision(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    args = [sys.executable, "-m", "jattn.cli", "train", "--config", SMOKE]
    args += ["--workdir", str(tmp_path / "w"), "--config.num_train_steps=2"]
    args += ["--config.eval_every_steps=2", "--config.matmul_precision=highest"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("jattn: attention")]
    # Encoder, decoder and cross attention all take xla on the CPU at these sizes: one line.
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "implementation=None -> 'xla'" in lines[0] and "on cpu" in lines[0]
    saved = json.loads((tmp_path / "w" / "config.json").read_text())
    assert saved["matmul_precision"] == "highest"
    assert "float32 matmuls: highest (config.matmul_precision)" in proc.stdout + proc.stderr


def test_the_header_names_a_gpu_runs_tf32():
    from jattn.train.parts import precision_line

    assert "TF32 on the tensor cores on gpu" in precision_line("default", "gpu")
    assert "IEEE float32 on cpu" in precision_line("default", "cpu")
    assert precision_line("highest", "gpu") == "float32 matmuls: highest (config.matmul_precision)"
