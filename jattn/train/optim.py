"""Learning-rate schedules and optimisers, picked by name from the optimiser's piece.

What is read here is the config's `OptimizerPart` (`jattn.train.parts`):
`schedule`, `learning_rate`, `warmup_steps`, `num_train_steps`, `d_model`
(``model.d_model``), `optimizer`, `adam_b1`, `adam_b2`, `adam_eps`,
`weight_decay`, `grad_clip_norm`.

The paper's schedule ("rsqrt", Vaswani et al. 2017, eq. 3) is

    lr(step) = learning_rate * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)

with `step` counted from 1 and `learning_rate` a multiplier (1.0 in the
paper). For the other schedules `learning_rate` is the peak rate, reached
after a linear warmup `learning_rate * (count + 1) / warmup_steps`; "cosine"
and "linear" then decay to 0 at `num_train_steps` (optax's
`cosine_decay_schedule` / `linear_schedule` joined to the warmup with
`join_schedules`). "rsqrt" stays hand-written: optax has no schedule with
this warmup-then-inverse-square-root shape.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import optax

from jattn.train.parts import ConfigError, OptimizerPart

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "make_optimizer",
    "make_schedule",
]

Schedule = Callable[[int], float]


def rsqrt_schedule(learning_rate: float, d_model: int, warmup_steps: int) -> Schedule:
    """The paper's warmup then inverse-square-root decay (step counted from 1)."""

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        warm = step * float(max(warmup_steps, 1)) ** -1.5
        return learning_rate * float(d_model) ** -0.5 * jnp.minimum(step**-0.5, warm)

    return schedule


def _rsqrt(c: OptimizerPart) -> Schedule:
    return rsqrt_schedule(c.learning_rate, c.d_model, c.warmup_steps)


def _warmup(c: OptimizerPart) -> optax.Schedule:
    """Linear warmup: `learning_rate * (count + 1) / warmup_steps`, reaching the peak at
    count `warmup_steps - 1` (constant at the peak without warmup)."""
    w = max(c.warmup_steps, 1)
    return optax.linear_schedule(c.learning_rate / w, c.learning_rate, w - 1)


def _then(c: OptimizerPart, decay: optax.Schedule) -> optax.Schedule:
    """Warmup for `warmup_steps` counts, then `decay` (counted from the end of warmup)."""
    return optax.join_schedules([_warmup(c), decay], boundaries=[c.warmup_steps])


def _decay_steps(c: OptimizerPart) -> int:
    return max(c.num_train_steps - c.warmup_steps, 1)


def _constant(c: OptimizerPart) -> Schedule:
    return _warmup(c)


def _cosine(c: OptimizerPart) -> Schedule:
    return _then(c, optax.cosine_decay_schedule(c.learning_rate, _decay_steps(c)))


def _linear(c: OptimizerPart) -> Schedule:
    return _then(c, optax.linear_schedule(c.learning_rate, 0.0, _decay_steps(c)))


SCHEDULES: dict[str, Callable[[OptimizerPart], Schedule]] = {
    "rsqrt": _rsqrt,
    "constant": _constant,
    "cosine": _cosine,
    "linear": _linear,
}


def make_schedule(part: OptimizerPart) -> Schedule:
    """The learning-rate schedule named by `part.schedule`."""
    if part.schedule not in SCHEDULES:
        raise ConfigError(f"schedule={part.schedule!r}: choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[part.schedule](part)


def _adam(c, lr):
    return optax.adam(lr, b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps)


def _adamw(c, lr):
    return optax.adamw(lr, b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps, weight_decay=c.weight_decay)


def _sgd(c, lr):
    return optax.sgd(lr, momentum=c.adam_b1 or None)


OPTIMIZERS = {"adam": _adam, "adamw": _adamw, "sgd": _sgd}


def make_optimizer(part: OptimizerPart) -> tuple[optax.GradientTransformation, Schedule]:
    """The optimiser named by `part.optimizer`, with global-norm clipping when
    `part.grad_clip_norm > 0`.

    Gradient accumulation is not an optax wrapper here: the train step scans
    over `grad_accum_steps` micro-batches and applies one update, so the step
    counter, schedule and checkpoints mean the same with or without it.

    Args:
      part: the run's optimiser piece (`Parts.optimizer`).

    Returns:
      (the optax transformation, the schedule, for logging).
    """
    if part.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer={part.optimizer!r}: choose one of {sorted(OPTIMIZERS)}")
    schedule = make_schedule(part)
    tx = OPTIMIZERS[part.optimizer](part, schedule)
    if part.grad_clip_norm and part.grad_clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(part.grad_clip_norm), tx)
    return tx, schedule
