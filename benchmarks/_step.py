"""One config's train step, its initial states and batches: what the step timings share.

`jattn bench train --peak` and `jattn bench variants` time the
compiled step alone (no data loading, no logging); this builds it exactly as
`jattn train` does (`jattn.train.steps`, `jattn.train.load`), so a timing
here is of the step a real run takes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jattn.models import Transformer
from jattn.train import steps as steps_lib
from jattn.train.config import build_model_config
from jattn.train.load import load_task, train_loader
from jattn.train.optim import make_optimizer


def _seeded(config, seed: int):
    """`config` with ``seed=seed``: the run `jattn train --config.seed=S` would be."""
    out = config.copy_and_resolve_references()
    out.seed = int(seed)
    return out


def build_step(config, num_seeds: int, num_batches: int) -> dict[str, Any]:
    """The un-jitted train step of `config` (`jattn.train.steps.make_train_step`),
    `num_seeds` initial states (seeds 0 .. num_seeds-1) and `num_batches`
    training batches of each seed (`batches[i][s]`, numpy, as the loader gives
    them)."""
    task = load_task(config)
    model = Transformer(build_model_config(config, task.tokenizer.vocab_size))
    tx, schedule = make_optimizer(config)
    init_boxed = steps_lib.make_init(model, tx, config, rows=1)
    init = jax.jit(lambda r: nn.meta.unbox(init_boxed(r)))
    states = [init(jax.random.key_data(jax.random.key(s))) for s in range(num_seeds)]
    iters = [iter(train_loader(task, _seeded(config, s))) for s in range(num_seeds)]
    batches = [[next(it) for it in iters] for _ in range(num_batches)]
    step = steps_lib.make_train_step(model, tx, schedule, label_smoothing=config.label_smoothing)
    return {"step": step, "states": states, "batches": batches}


def device_batch(batch) -> dict[str, jax.Array]:
    """A loader batch as device arrays (so timing leaves the host copy out)."""
    return jax.tree.map(jnp.asarray, batch)
