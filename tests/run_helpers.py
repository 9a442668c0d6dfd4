"""What the training, seed, sweep and fault tests share: the smoke config and a run's
files read back.

Every such test trains `configs/smoke.py` (copy/tiny, a 1+1-layer Transformer)
and compares runs by the losses of their `metrics.jsonl` and the predictions of
their `decodes/`; the data fixtures are in `conftest.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from jattn.train import apply_overrides, load_config, read_metrics

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.py")


def smoke_config(data_dir=None, /, **overrides):
    """configs/smoke.py with `overrides` (``key=value``, as on the command line).

    With `data_dir` (the fault suite's private data), the run reads its data there
    and evaluates nothing unless asked (faster).
    """
    if data_dir is not None:
        overrides = {"eval_splits": "()", "best_metric": "", "data_dir": str(data_dir), **overrides}
    return apply_overrides(load_config(SMOKE), [(k, str(v)) for k, v in overrides.items()])


SHORT_STEPS = {"num_train_steps": 20, "eval_every_steps": 20, "checkpoint_every_steps": 10}


def short_smoke_config(data_dir=None, /, **overrides):
    """`smoke_config` of 20 steps (one evaluation; checkpoints at 10 and 20), for tests
    that train many members; a call's keys win."""
    return smoke_config(data_dir, **{**SHORT_STEPS, **overrides})


def losses(workdir) -> dict[int, float]:
    """step -> train/loss from metrics.jsonl (asserting each step appears once)."""
    rows = [r for r in read_metrics(str(workdir)) if "train/loss" in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"repeated steps in metrics.jsonl: {steps}"
    return {r["step"]: r["train/loss"] for r in rows}


def decodes(workdir) -> dict[str, list[str]]:
    """split -> the predictions of the run's latest evaluation (`decodes/<split>.jsonl`)."""
    out = {}
    for path in sorted((Path(workdir) / "decodes").glob("*.jsonl")):
        out[path.stem] = [json.loads(line)["prediction"] for line in path.read_text().splitlines()]
    return out


def sharded_mesh_axes(workdir, step: int) -> set[str]:
    """The mesh axes any array of checkpoint `step` is partitioned over, read from
    orbax's own record of each saved array's sharding (`state/_sharding`)."""
    path = Path(workdir) / "checkpoints" / str(step) / "state" / "_sharding"
    used = set()
    for spec in json.loads(path.read_text()).values():
        spec = json.loads(spec) if isinstance(spec, str) else spec
        for entry in spec["partition_spec"]:
            used.update([entry] if isinstance(entry, str) else entry or [])
    return used
