"""The train state, the loss, the pure train and eval step functions, and the run's
jitted steps.

`make_train_step` and `make_eval_step` are pure functions of a state and a
batch, which know of no mesh but the optional micro-batch sharding
constraint; `jit_steps` jits them (and the decoder) with the run's explicit
shardings, the state donated: what `jattn.train.run` calls each step. Batches
are dicts of int32 `[B, L]` arrays: ``inputs``, ``targets``,
``inputs_segment_ids``, ``targets_segment_ids``, ``inputs_positions``,
``targets_positions`` (token 0 is padding; segment id 0 marks padding in
packed rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jattn.train import evaluation as evaluation_lib
from jattn.train import mesh as mesh_lib
from jattn.train.parts import DataPart, EvalPart, StepPart

__all__ = [
    "TrainState",
    "cross_entropy",
    "jit_steps",
    "make_eval_step",
    "make_init",
    "make_train_step",
    "model_kwargs",
]

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    """Everything a resumed run needs besides the data iterator.

    Attributes:
      step: int32 `[]`, number of optimiser updates applied so far.
      params: the model parameters (fp32).
      opt_state: the optax state.
      rng: uint32 `[2]`, the run's root key; step `s` uses `fold_in(rng, s)`,
        so randomness depends only on the step, never on how the run was cut.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, label_smoothing: float = 0.0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Label-smoothed cross entropy summed over the tokens with weight 1.

    The smoothed target puts `1 - ls` on the reference token and `ls / (V-1)`
    on each other token; its own entropy is subtracted so a perfect model
    scores 0 for any `ls` (as in the paper's tensor2tensor setup).

    Args:
      logits: `[B, T, V]`, any float dtype (computed in fp32).
      targets: int `[B, T]`.
      weights: `[B, T]`, 1.0 on real tokens and 0.0 on padding.
      label_smoothing: `ls` in [0, 1).

    Returns:
      (summed loss `[]`, summed weights `[]`, number of correct argmax tokens `[]`).
    """
    vocab = logits.shape[-1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, T, V]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    normaliser = (
        -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
        if label_smoothing > 0
        else 0.0
    )
    target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]
    if label_smoothing > 0:
        # sum_v soft_v * logp_v with soft = low + (confidence - low) * onehot
        per_token = -(low * jnp.sum(logp, axis=-1) + (confidence - low) * target_logp)
        per_token = per_token - normaliser
    else:
        per_token = -target_logp
    correct = (jnp.argmax(logits, axis=-1) == targets) * weights
    return jnp.sum(per_token * weights), jnp.sum(weights), jnp.sum(correct)


def model_kwargs(batch: Batch) -> dict[str, jax.Array]:
    """The keyword arguments of `Transformer.__call__` present in `batch`."""
    names = ("inputs_segment_ids", "targets_segment_ids", "inputs_positions", "targets_positions")
    return {k: batch[k] for k in names if k in batch}


def _split_micro(batch: Batch, num_micro: int, micro_spec: Any) -> Batch:
    """`[B, L]` -> `[A, B/A, L]` taking rows a, a+A, a+2A, ... into micro-batch a.

    Strided (not contiguous) so that each device keeps an equal share of every
    micro-batch when rows are sharded over the data axes.
    """

    def split(x):
        b = x.shape[0]
        y = x.reshape(b // num_micro, num_micro, *x.shape[1:]).swapaxes(0, 1)  # [A, B/A, L]
        if micro_spec is not None:
            y = jax.lax.with_sharding_constraint(y, micro_spec)
        return y

    return jax.tree.map(split, batch)


def _accumulate(grad_fn, params, micro: Batch, rng):
    """Sums of `grad_fn`'s gradients and sums over the micro-batches `[A, B/A, L]`
    (a scan; micro-batch `a` draws its dropout from ``fold_in(rng, a)``)."""

    def body(carry, xs):
        index, mb = xs
        (l, (w, c)), g = grad_fn(params, mb, jax.random.fold_in(rng, index))
        acc_g, acc_l, acc_w, acc_c = carry
        return (jax.tree.map(jnp.add, acc_g, g), acc_l + l, acc_w + w, acc_c + c), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    num = jax.tree.leaves(micro)[0].shape[0]
    (grads, loss_sum, weight_sum, correct), _ = jax.lax.scan(
        body, (zeros, 0.0, 0.0, 0.0), (jnp.arange(num), micro)
    )
    return grads, loss_sum, weight_sum, correct


def make_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    schedule: Callable[[Any], Any],
    *,
    label_smoothing: float,
    grad_accum_steps: int = 1,
    micro_spec: Any = None,
    debug_nan_at_step: int = 0,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds `train_step(state, batch) -> (new_state, metrics)`.

    Args:
      model: the flax module; called as ``model.apply({"params": p}, inputs,
        targets, **segment/position kwargs, train=True, rngs={"dropout": r})``.
      tx: the optax optimiser.
      schedule: learning rate as a function of the update count (logged).
      label_smoothing: see `cross_entropy`.
      grad_accum_steps: split the batch into this many micro-batches, scan
        over them summing gradients, then apply one update normalised by the
        total token count (the same update as one big batch, up to fp32
        rounding).
      micro_spec: sharding for the `[A, B/A, L]` micro-batch stack (or None).
      debug_nan_at_step: testing aid; when > 0, the loss of update number
        `debug_nan_at_step` (1-based, as logged) is multiplied by NaN, so the
        gradients and the updated state are NaN too.

    Returns:
      The pure step function. Metrics: ``loss`` (per-token, label-smoothed),
      ``accuracy``, ``tokens`` (non-padding source + target tokens),
      ``grad_norm``, ``learning_rate``.
    """

    def loss_fn(params, micro: Batch, rng):
        logits = model.apply(
            {"params": params},
            micro["inputs"],
            micro["targets"],
            **model_kwargs(micro),
            train=True,
            rngs={"dropout": rng},
        )  # [b, T, V]
        weights = (micro["targets"] > 0).astype(jnp.float32)  # [b, T]
        loss_sum, weight_sum, correct = cross_entropy(
            logits, micro["targets"], weights, label_smoothing
        )
        return loss_sum, (weight_sum, correct)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, batch: Batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if grad_accum_steps == 1:
            (loss_sum, (weight_sum, correct)), grads = grad_fn(state.params, batch, rng)
        else:
            micro = _split_micro(batch, grad_accum_steps, micro_spec)
            grads, loss_sum, weight_sum, correct = _accumulate(grad_fn, state.params, micro, rng)
        denom = jnp.maximum(weight_sum, 1.0)
        loss = loss_sum / denom
        if debug_nan_at_step > 0:
            poison = jnp.where(state.step + 1 == debug_nan_at_step, jnp.nan, 1.0)
            loss = loss * poison
            denom = denom / poison
        grads = jax.tree.map(lambda g: g / denom, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        tokens = jnp.sum(batch["targets"] > 0) + jnp.sum(batch["inputs"] > 0)
        metrics = {
            "loss": loss,
            "accuracy": correct / denom,
            "tokens": tokens.astype(jnp.float32),
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
        }
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return train_step


def make_eval_step(model: nn.Module) -> Callable[[Any, Batch], dict[str, jax.Array]]:
    """Builds `eval_step(params, batch) -> sums` of the plain (unsmoothed) loss.

    Returns sums, not means, so that batches (including padded rows, which
    have weight 0) can be added up exactly: ``loss_sum``, ``weight_sum``,
    ``correct``, and per row ``row_correct`` and ``row_weight`` `[B]` (the
    teacher-forced accuracy of each example, which evaluation groups by length).
    """

    def eval_step(params, batch: Batch):
        logits = model.apply(
            {"params": params}, batch["inputs"], batch["targets"], **model_kwargs(batch)
        )
        weights = (batch["targets"] > 0).astype(jnp.float32)  # [B, T]
        loss_sum, weight_sum, correct = cross_entropy(logits, batch["targets"], weights, 0.0)
        hits = (jnp.argmax(logits, axis=-1) == batch["targets"]) * weights  # [B, T]
        return {
            "loss_sum": loss_sum,
            "weight_sum": weight_sum,
            "correct": correct,
            "row_correct": jnp.sum(hits, axis=-1),  # [B]
            "row_weight": jnp.sum(weights, axis=-1),  # [B]
        }

    return eval_step


def make_init(model, tx, data: DataPart, rows: int):
    """`rng key data -> TrainState` with boxed (logically annotated) parameters, of
    `rows` rows of the training data's lengths (inputs `data.input_len`, targets
    `data.max_len`)."""

    def init_boxed(rng: jax.Array) -> TrainState:
        init_rng, state_rng = jax.random.split(jax.random.wrap_key_data(rng))
        inputs = jnp.zeros((rows, data.input_len), jnp.int32)  # [rows, S]
        targets = jnp.zeros((rows, data.max_len), jnp.int32)  # [rows, T]
        params = model.init({"params": init_rng}, inputs, targets, train=False)["params"]
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.key_data(state_rng),
        )

    return init_boxed


def jit_steps(
    module: nn.Module, tx, schedule, step: StepPart, evaluation: EvalPart, mesh, shardings
):
    """The run's `(train_step, eval_step, decode or None)`, jitted with explicit shardings.

    ``train_step(state, batch) -> (state, metrics)`` donates the state (a
    non-finite loss is the caller's error: `jattn.train.metrics.TrainMetrics`);
    ``eval_step(params, batch)`` is `make_eval_step`'s; ``decode(params, inputs,
    targets)`` decodes per `evaluation.decode` (None without decoded examples).
    Metrics and outputs come back replicated.

    Args:
      module, tx, schedule: the model, its optimiser and learning-rate schedule.
      step: the train step's piece (label smoothing, micro-batches, the NaN aid).
      evaluation: what `jattn.train.evaluation.decode_fn` reads.
      mesh: the run's mesh; batches are sharded over its data axes.
      shardings: the `TrainState`'s shardings (`jattn.train.mesh.abstract_state`).
    """
    batch_sharding = mesh_lib.batch_sharding(mesh)
    replicated = NamedSharding(mesh, P())
    train = jax.jit(
        make_train_step(
            module,
            tx,
            schedule,
            label_smoothing=step.label_smoothing,
            grad_accum_steps=step.grad_accum_steps,
            micro_spec=NamedSharding(mesh, P(None, *mesh_lib.BATCH_SPEC)),
            debug_nan_at_step=step.debug_nan_at_step,
        ),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )
    eval_step = jax.jit(
        make_eval_step(module),
        in_shardings=(shardings.params, batch_sharding),
        out_shardings=replicated,
    )
    decode_one = evaluation_lib.decode_fn(module, evaluation)
    decode = decode_one and jax.jit(
        decode_one,
        in_shardings=(shardings.params, batch_sharding, batch_sharding),
        out_shardings=replicated,
    )
    return train, eval_step, decode
