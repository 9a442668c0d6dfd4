"""A learning-rate (and warmup) sweep along the seed axis: one program, and each of
its members equal to the single run with that seed and those values.

Real pieces: `configs/smoke.py`, real data and checkpoints. The members' losses
must be the single runs' within 1e-5 relative (in the program the learning rate
and warmup are numbers, in a single run constants: float32 rounding of the
schedule may differ), their decodes and `config.json` exactly the single runs'.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from run_helpers import decodes, losses
from run_helpers import short_smoke_config as smoke_config

from jattn.train import ConfigError, check_config, train_and_evaluate

SWEEP = {"seeds": "0,1", "sweep_learning_rate": "3e-3,1e-3", "sweep_warmup_steps": "5,0"}
NAMES = [
    "learning_rate-0.003_warmup_steps-5_seed-0",
    "learning_rate-0.003_warmup_steps-5_seed-1",
    "learning_rate-0.003_warmup_steps-0_seed-0",
    "learning_rate-0.003_warmup_steps-0_seed-1",
    "learning_rate-0.001_warmup_steps-5_seed-0",
    "learning_rate-0.001_warmup_steps-5_seed-1",
    "learning_rate-0.001_warmup_steps-0_seed-0",
    "learning_rate-0.001_warmup_steps-0_seed-1",
]


def _values(name: str) -> tuple[float, int, int]:
    m = re.fullmatch(r"learning_rate-([0-9.e-]+)_warmup_steps-(\d+)_seed-(\d+)", name)
    assert m, name
    return float(m[1]), int(m[2]), int(m[3])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sweep")
    return workdir, train_and_evaluate(smoke_config(**SWEEP), str(workdir))


def test_every_member_is_written_as_its_single_run(sweep):
    workdir, result = sweep
    assert sorted(result["members"]) == sorted(NAMES) and not result["diverged"]
    for name in NAMES:
        config = json.loads((workdir / name / "config.json").read_text())
        lr, warmup, seed = _values(name)
        assert (config["learning_rate"], config["warmup_steps"], config["seed"]) == (
            lr,
            warmup,
            seed,
        )
        assert config["seeds"] == [] and config["sweep_learning_rate"] == []
    finals = [result["members"][n]["train/loss"] for n in NAMES]
    assert len({round(v, 5) for v in finals}) == len(NAMES), finals  # they all differ


@pytest.mark.parametrize("name", [NAMES[1], NAMES[6]])
def test_a_member_equals_the_single_run_with_its_values(sweep, name, tmp_path):
    workdir, _ = sweep
    lr, warmup, seed = _values(name)
    single = tmp_path / "single"
    train_and_evaluate(smoke_config(seed=seed, learning_rate=lr, warmup_steps=warmup), str(single))
    got, want = losses(workdir / name), losses(single)
    assert sorted(got) == sorted(want) == list(range(1, 21))
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-5)
    assert decodes(workdir / name) == decodes(single) and decodes(single)
    assert (workdir / name / "config.json").read_text() == (single / "config.json").read_text()


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("sweep_learning_rate", "0.001,-1.0", "floats > 0"),
        ("sweep_learning_rate", "0.001,0.001", "repeats a value"),
        ("sweep_warmup_steps", "1.5,2", "ints >= 0"),
    ],
)
def test_bad_sweeps_are_refused_in_one_line(key, value, match):
    with pytest.raises(ConfigError, match=match):
        check_config(smoke_config(**{key: value}))
