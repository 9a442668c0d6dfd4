"""A run's data and a trained run: `load_task(config)`, `load_run(workdir)`.

    run = jattn.train.load_run("runs/numbers")            # the latest checkpoint
    logits = run.model.apply({"params": run.params}, inputs, targets)
    ids = jattn.models.decoding.greedy(run.model, run.params, inputs, max_length=64)
    run.tokenizer.decode(ids[0])                          # the run's own vocabulary

The training loop and `load_run` open a config's data set the same way
(`load_task`), so an analysis sees the tokenizer and splits the run trained on.

Parameters are restored onto one device (the first local one) whatever mesh
the run was trained on, so a checkpoint of an 8-device run opens on a laptop.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from jattn.train import workdir as files
from jattn.train.checkpoints import CHECKPOINT_DIR
from jattn.train.config import ConfigError, default_config

__all__ = ["TASK_KEYS", "TrainedRun", "checkpoint_steps", "load_run", "load_task"]

# The config keys that name a run's data (`load_task`).
TASK_KEYS = ("dataset", "data_dir", "tokenizer", "vocab_size", "source_key", "target_key")


def load_task(config: ml_collections.ConfigDict):
    """The `jattn.data` task (data set and tokenizer) of a config.

    Keys a config lacks (a run saved before they existed) take their
    `default_config` values.

    Raises:
      ConfigError: an unknown data set or an unusable data key.
    """
    from jattn import data  # noqa: PLC0415

    defaults = default_config()
    keys = {k: config.get(k, defaults[k]) for k in TASK_KEYS}
    try:
        return data.load(keys.pop("dataset"), **keys)
    except ValueError as e:
        raise ConfigError(f"dataset={config.get('dataset')!r}: {e}") from None


@dataclasses.dataclass
class TrainedRun:
    """A trained model read from a workdir.

    Attributes:
      config: the run's resolved config (`config.json`), unlocked.
      model: `jattn.models.Transformer` with the run's `TransformerConfig`.
      params: the parameters at `step` (jax arrays on one device).
      step: the checkpoint's step.
      tokenizer: the tokenizer the run trained with, read from the workdir
        (``tokenizer.json``, saved when the run started), so decoding needs
        neither the data set nor its vocabulary cache. Runs saved before the
        workdir kept it fall back to `task.tokenizer`.
      task: the run's data set and tokenizer (`load_task`), loaded on first use.
    """

    config: ml_collections.ConfigDict
    model: Any
    params: Any
    step: int
    tokenizer: Any = None

    @functools.cached_property
    def task(self):
        return load_task(self.config)


def checkpoint_steps(workdir: str) -> list[int]:
    """The steps of the complete checkpoints in `workdir`, ascending (torn saves and
    step folders with a missing part, see `recovery.step_problem`, excluded)."""
    from jattn.train.recovery import step_problem  # noqa: PLC0415

    folder = os.path.join(workdir, CHECKPOINT_DIR)
    if not os.path.isdir(folder):
        return []
    return sorted(
        int(name)
        for name in os.listdir(folder)
        if name.isdigit() and step_problem(os.path.join(folder, name)) is None
    )


def load_run(workdir: str, step: int | None = None) -> TrainedRun:
    """Reads the config, the model config, the parameters of checkpoint `step` and
    the tokenizer.

    Args:
      workdir: a `jattn train` workdir.
      step: a checkpoint step; None takes the latest.

    Raises:
      FileNotFoundError: no run or no checkpoint there.
      ValueError: `step` is not one of the saved steps (they are listed).
    """
    from jattn.models import Transformer, TransformerConfig  # noqa: PLC0415

    for name in (files.CONFIG, files.MODEL_CONFIG):
        if not os.path.exists(os.path.join(workdir, name)):
            raise FileNotFoundError(f"load_run: {workdir!r} has no {name}; not a jattn workdir")
    steps = checkpoint_steps(workdir)
    if not steps:
        raise FileNotFoundError(f"load_run: no checkpoint in {workdir!r}")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(f"load_run: no checkpoint at step {step} in {workdir!r}; saved: {steps}")
    config = ml_collections.ConfigDict(files.read_json(os.path.join(workdir, files.CONFIG)))
    model_config = TransformerConfig.from_dict(
        files.read_json(os.path.join(workdir, files.MODEL_CONFIG))
    )

    path = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR, str(step), "state"))
    checkpointer = ocp.StandardCheckpointer()
    # The item's own metadata (`state/_METADATA`): the checkpointer's `metadata` also
    # looks for a step file inside the item folder and logs absl's "Metadata file does
    # not exist: .../_CHECKPOINT_METADATA" warning before every `jattn decode`.
    saved = ocp.StandardCheckpointHandler().metadata(epath.Path(path))
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), saved)
    state = checkpointer.restore(path, target)
    checkpointer.close()
    model = Transformer(model_config)
    run = TrainedRun(config=config, model=model, params=state["params"], step=step)
    from jattn.data.tokenizers import load_from_dir  # noqa: PLC0415

    run.tokenizer = load_from_dir(workdir) or run.task.tokenizer
    return run
