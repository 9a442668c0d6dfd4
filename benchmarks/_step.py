"""One config's train step, its initial states and batches: what the step timings share.

`jattn bench train --peak` and `jattn bench variants` time the
compiled step alone (no data loading, no logging); this builds it exactly as
`jattn train` does (`jattn.train.steps`, `jattn.train.load`), so a timing
here is of the step a real run takes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jattn.models import Transformer
from jattn.train import steps as steps_lib
from jattn.train.config import read_parts
from jattn.train.load import open_task, train_loader
from jattn.train.optim import make_optimizer


def build_step(config, num_seeds: int, num_batches: int) -> dict[str, Any]:
    """The un-jitted train step of `config` (`jattn.train.steps.make_train_step`),
    `num_seeds` initial states (seeds 0 .. num_seeds-1) and `num_batches`
    training batches of each seed (`batches[i][s]`, numpy, as the loader gives
    them)."""
    parts = read_parts(config)
    task = open_task(parts.data)
    model = Transformer(parts.model.build(task.tokenizer.vocab_size))
    tx, schedule = make_optimizer(parts.optimizer)
    init_boxed = steps_lib.make_init(model, tx, parts.data, rows=1)
    init = jax.jit(lambda r: nn.meta.unbox(init_boxed(r)))
    states = [init(jax.random.key_data(jax.random.key(s))) for s in range(num_seeds)]
    # Seed s's stream: the run `jattn train --config.seed=S` would read.
    seeded = [dataclasses.replace(parts.data, seed=s) for s in range(num_seeds)]
    iters = [iter(train_loader(task, data)) for data in seeded]
    batches = [[next(it) for it in iters] for _ in range(num_batches)]
    label_smoothing = parts.step.label_smoothing
    step = steps_lib.make_train_step(model, tx, schedule, label_smoothing=label_smoothing)
    return {"step": step, "states": states, "batches": batches}


def device_batch(batch) -> dict[str, jax.Array]:
    """A loader batch as device arrays (so timing leaves the host copy out)."""
    return jax.tree.map(jnp.asarray, batch)
