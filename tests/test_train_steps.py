"""Pieces of the training loop, each against a hand or float64 reference.

The loss against numpy in float64, gradient accumulation against one big
batch, mixed precision against fp32, the NaN probe, schedules, mesh shapes
and sharding specs, cluster detection.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jattn.models import Transformer, TransformerConfig
from jattn.train import ConfigError, check_config, default_config
from jattn.train import mesh as mesh_lib
from jattn.train.config import read_parts
from jattn.train.distributed import cluster_detected
from jattn.train.optim import make_optimizer
from jattn.train.steps import TrainState, cross_entropy, make_train_step


def ce_reference(logits, targets, weights, ls):
    """float64 numpy: sum over weighted tokens of KL(smoothed one-hot || softmax)."""
    logits = np.asarray(logits, np.float64)
    v = logits.shape[-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    q = np.full(logits.shape, ls / (v - 1))
    np.put_along_axis(q, targets[..., None], 1.0 - ls, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(q > 0, q * np.log(q), 0.0).sum(-1)
    per_token = -(q * logp).sum(-1) - entropy
    return float((per_token * weights).sum())


@pytest.mark.parametrize("ls", [0.0, 0.1, 0.3])
def test_cross_entropy_matches_float64(ls):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
    targets = rng.integers(0, 7, size=(2, 5))
    weights = (rng.random((2, 5)) > 0.3).astype(np.float32)
    loss, weight, correct = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), weights, ls)
    assert float(loss) == pytest.approx(ce_reference(logits, targets, weights, ls), rel=1e-5)
    assert float(weight) == weights.sum()
    assert float(correct) == ((logits.argmax(-1) == targets) * weights).sum()


def test_smoothed_loss_is_zero_at_the_smoothed_target():
    """A model predicting exactly the smoothed distribution scores 0 (entropy subtracted)."""
    v, ls = 6, 0.1
    targets = np.array([[0, 3, 5]])
    q = np.full((1, 3, v), ls / (v - 1))
    np.put_along_axis(q, targets[..., None], 1 - ls, axis=-1)
    loss, _, _ = cross_entropy(jnp.log(jnp.asarray(q, jnp.float32)), targets, np.ones((1, 3)), ls)
    assert abs(float(loss)) < 1e-5
    worse, _, _ = cross_entropy(jnp.zeros((1, 3, v)), targets, np.ones((1, 3)), ls)
    assert float(worse) > 0.1


# -- the train step on a tiny real Transformer ------------------------------------------


def tiny(dropout=0.0, dtype="float32"):
    return TransformerConfig(
        vocab_size=16, d_model=16, num_heads=2, num_layers=1, d_ff=32, max_len=8,
        dropout_rate=dropout, dtype=dtype,
    )  # fmt: skip


def batch(rows=4, length=8, seed=0):
    rng = np.random.default_rng(seed)
    b = {
        "inputs": rng.integers(2, 16, size=(rows, length)).astype(np.int32),
        "targets": rng.integers(1, 16, size=(rows, length)).astype(np.int32),
    }
    b["targets"][:, -2:] = 0  # some padding
    return b


def init_state(model, tx, b):
    params = model.init(jax.random.key(0), b["inputs"], b["targets"])["params"]
    params = mesh_lib.unbox_values(params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key_data(jax.random.key(1)),
    )


@functools.cache
def compiled_step(config, accum=1, nan_at=0):
    """(model, tx, jitted step), shared by the tests so each program compiles once."""
    model = Transformer(config)
    tx = optax.adam(1e-2)
    step = jax.jit(
        make_train_step(
            model, tx, lambda c: 1e-2, label_smoothing=0.1, grad_accum_steps=accum,
            debug_nan_at_step=nan_at,
        )
    )  # fmt: skip
    return model, tx, step


def run_step(config, accum=1, nan_at=0, steps=1):
    model, tx, step = compiled_step(config, accum, nan_at)
    b = batch()
    state = init_state(model, tx, b)
    out = []
    for _ in range(steps):
        state, m = step(state, b)
        out.append(m)
    return state, out


def test_gradient_accumulation_equals_one_big_batch():
    one, (m1,) = run_step(tiny(), accum=1)
    two, (m2,) = run_step(tiny(), accum=2)
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    assert float(m2["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=1e-4)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert int(two.step) == 1


def test_bf16_compute_keeps_fp32_params_and_tracks_fp32():
    state32, (m32,) = run_step(tiny())
    state16, (m16,) = run_step(tiny(dtype="bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(state16.params)} == {jnp.dtype("float32")}
    assert np.isfinite(float(m16["loss"]))
    assert float(m16["loss"]) == pytest.approx(float(m32["loss"]), rel=3e-2)


def test_dropout_depends_on_the_step_only():
    """Two runs of the same config give identical steps; dropout masks differ per step."""
    _, a = run_step(tiny(dropout=0.3), steps=2)
    _, b = run_step(tiny(dropout=0.3), steps=2)
    assert [float(m["loss"]) for m in a] == [float(m["loss"]) for m in b]
    _, c = run_step(tiny(dropout=0.0), steps=1)
    assert float(a[0]["loss"]) != float(c[0]["loss"])  # dropout is on in training


def test_nan_probe_poisons_only_its_step():
    state, (m1, m2) = run_step(tiny(), nan_at=2, steps=2)
    assert np.isfinite(float(m1["loss"])) and np.isnan(float(m2["loss"]))
    assert not np.all(np.isfinite(np.asarray(jax.tree.leaves(state.params)[0])))


@pytest.mark.parametrize("position", ["t5", "shaw"])
def test_a_model_that_assumes_finite_keys_trains_as_the_guarded_one(position):
    """`attention_assume_finite=True` (off by default) skips attention's guard
    against non-finite hidden keys, which the model's own projections never
    have: three train steps with dropout give the guarded run's losses and
    state to float32 rounding. Not bit for bit here: without the guard XLA
    fuses the value projection's gradient otherwise (this model's `v`
    gradients differ in the last bit); for the main job's config they are
    equal bit for bit (`python benchmarks/train.py`, docs/benchmarks.md)."""
    guarded = dataclasses.replace(tiny(dropout=0.1), position=position)
    assert not guarded.attention_assume_finite
    state, metrics = run_step(guarded, steps=3)
    fast, fast_metrics = run_step(
        dataclasses.replace(guarded, attention_assume_finite=True), steps=3
    )
    for m, f in zip(metrics, fast_metrics, strict=True):
        assert float(f["loss"]) == pytest.approx(float(m["loss"]), rel=1e-6)
    # Adam divides by a gradient's running root mean square, so a last-bit change
    # of a near-zero gradient moves its parameter far more than the rounding of
    # the gradient (here up to 6e-7); 1e-5 is a thousandth of a step (lr 1e-2).
    for a, b in zip(jax.tree.leaves(fast.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)


# -- schedules and optimisers -----------------------------------------------------------


def test_schedules():
    c = default_config()
    c.learning_rate, c.warmup_steps, c.num_train_steps = 1.0, 10, 110
    c.schedule = "constant"
    _, s = make_optimizer(read_parts(c).optimizer)
    assert [float(s(i)) for i in (0, 4, 9, 50)] == pytest.approx([0.1, 0.5, 1.0, 1.0])
    c.schedule = "cosine"
    _, s = make_optimizer(read_parts(c).optimizer)
    assert float(s(9)) == pytest.approx(1.0) and float(s(60)) == pytest.approx(0.5)
    assert float(s(110)) == pytest.approx(0.0, abs=1e-7)
    c.schedule = "linear"
    _, s = make_optimizer(read_parts(c).optimizer)
    assert float(s(60)) == pytest.approx(0.5)
    c.schedule = "nope"
    with pytest.raises(ConfigError, match="schedule='nope'"):
        make_optimizer(read_parts(c).optimizer)


def test_gradient_clipping_is_applied():
    c = default_config()
    c.schedule, c.learning_rate, c.warmup_steps, c.optimizer = "constant", 1.0, 0, "sgd"
    c.adam_b1, c.grad_clip_norm = 0.0, 1.0
    tx, _ = make_optimizer(read_parts(c).optimizer)
    grads = {"w": jnp.array([3.0, 4.0])}
    updates, _ = tx.update(grads, tx.init(grads))
    np.testing.assert_allclose(np.asarray(updates["w"]), [-0.6, -0.8], rtol=1e-6)


# -- mesh -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, n, want",
    [((-1, 1, 1), 8, (8, 1, 1)), ((2, -1, 2), 8, (2, 2, 2)), ((1, 1, 1), 1, (1, 1, 1))],
)
def test_resolve_mesh_shape(shape, n, want):
    assert mesh_lib.resolve_mesh_shape(shape, n) == want


@pytest.mark.parametrize(
    "shape, n, message",
    [
        ((2, 1, 1), 1, "needs 2 devices, but there are 1"),
        ((3, -1, 1), 8, "8 devices are not divisible by 3"),
        ((-1, -1, 1), 8, "at most one -1"),
        ((0, 1, 1), 8, "sizes must be >= 1"),
        ((8, 1), 8, "mesh_shape must give the sizes of"),
    ],
)
def test_bad_mesh_shapes(shape, n, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        mesh_lib.resolve_mesh_shape(shape, n)


def test_fit_spec_replicates_dims_the_mesh_does_not_divide():
    mesh = jax.sharding.AbstractMesh((2, 2, 4), mesh_lib.MESH_AXES)
    assert mesh_lib.fit_spec(P("fsdp", "tensor"), (8, 6), mesh) == P("fsdp", None)
    assert mesh_lib.fit_spec(P(("data", "fsdp"), None), (8, 3), mesh) == P(("data", "fsdp"), None)
    assert mesh_lib.fit_spec(P(("data", "fsdp")), (6, 3), mesh) == P(None, None)


def test_rules_keep_activations_from_reusing_a_mesh_axis():
    from flax import linen as nn

    rules = mesh_lib.DEFAULT_RULES
    assert nn.logical_to_mesh_axes(("batch", "length", "embed"), rules) == P(
        ("data", "fsdp"), None, None
    )
    assert nn.logical_to_mesh_axes(("vocab", "embed"), rules) == P("tensor", "fsdp")
    assert nn.logical_to_mesh_axes(("embed", "heads", "kv"), rules) == P("fsdp", "tensor", None)


# -- config checks and cluster detection ------------------------------------------------


def test_check_config():
    c = default_config()
    check_config(c)
    del c["eval_splits"]
    with pytest.raises(ConfigError, match=r"config lacks keys \['eval_splits'\]"):
        check_config(c)
    c = default_config()
    c.label_smoothing = 1.0
    with pytest.raises(ConfigError, match="label_smoothing"):
        check_config(c)


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, False),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, False),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, True),
        ({"TPU_WORKER_HOSTNAMES": "a"}, False),
        ({"TPU_WORKER_HOSTNAMES": "a,b"}, True),
        ({"JATTN_DISTRIBUTED": "1"}, True),
    ],
)
def test_cluster_detection(env, want):
    assert cluster_detected(env) is want


# -- checkpoint retention ---------------------------------------------------------------


@pytest.mark.parametrize("mode, best", [("max", 2), ("min", 3)])
def test_retention_keeps_the_last_n_and_the_best(tmp_path, mode, best):
    import orbax.checkpoint as ocp

    from jattn.train import checkpoints as ckpt

    c = default_config()
    c.keep_checkpoints, c.best_metric, c.best_mode = 2, "eval/validation/exact_match", mode
    mngr = ckpt.make_manager(str(tmp_path), read_parts(c).checkpoints)
    scores = {1: 0.2, 2: 0.9, 3: 0.1, 4: None, 5: 0.5, 6: None}
    for step, score in scores.items():
        metrics = None if score is None else {"eval/validation/exact_match": score}
        args = ocp.args.Composite(state=ocp.args.StandardSave({"w": np.full(3, step, np.float32)}))
        mngr.save(step, args=args, metrics=metrics, force=True)
    mngr.wait_until_finished()
    assert sorted(mngr.all_steps()) == sorted({5, 6, best})
    mngr.close()


# -- training-metric bookkeeping --------------------------------------------------------


def test_train_metrics_average_an_interval_and_stop_on_a_non_finite_loss(tmp_path):
    from jattn.train.metrics import (
        MetricsWriter,
        NonFiniteLossError,
        Progress,
        TrainMetrics,
        read_metrics,
    )

    def step_metrics(loss, lr):
        return {"loss": loss, "accuracy": 0.5, "tokens": 10.0, "grad_norm": 2 * loss,
                "learning_rate": lr}  # fmt: skip

    writer = MetricsWriter(str(tmp_path))
    metrics = TrainMetrics(writer, Progress(10, 0, enabled=False, is_main=False))
    metrics.waited(0.004)  # step 1's batch took 4 ms to get, step 2's 2 ms
    metrics.push(1, step_metrics(1.0, 0.1))
    assert metrics.last_loss != metrics.last_loss  # NaN: step 1 is still in flight
    metrics.waited(0.002)
    metrics.push(2, step_metrics(3.0, 0.2))
    assert metrics.last_loss == 1.0  # step 1 fetched while step 2 runs
    metrics.log(2)
    metrics.push(3, step_metrics(5.0, 0.3))
    metrics.log(3)
    writer.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [2, 3]
    assert rows[0]["train/loss"] == 2.0 and rows[0]["train/grad_norm"] == 4.0
    assert rows[0]["train/learning_rate"] == 0.2 and rows[1]["train/loss"] == 5.0
    # The mean wait of the interval's steps; the next interval starts from none.
    assert rows[0]["train/input_wait_ms"] == pytest.approx(3.0)
    assert rows[1]["train/input_wait_ms"] == 0.0
    assert set(rows[0]) == {
        "step", "train/loss", "train/loss_window_steps", "train/accuracy", "train/grad_norm",
        "train/learning_rate", "train/tokens_per_sec", "train/steps_per_sec",
        "train/input_wait_ms",
    }  # fmt: skip
    assert metrics.steady_steps_per_sec > 0  # the second interval (the first compiles)
    metrics.push(4, step_metrics(float("nan"), 0.4))
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss \(nan\) at step 4"):
        metrics.fetch()


# The hand-written schedules optim.py had before it used optax's: the reference
# the optax ones are checked against.
def _old_warmup(c, count):
    return jnp.minimum(1.0, (jnp.asarray(count, jnp.float32) + 1.0) / max(c.warmup_steps, 1))


def _old_decay_fraction(c, count):
    span = max(c.num_train_steps - c.warmup_steps, 1)
    return jnp.clip((jnp.asarray(count, jnp.float32) - c.warmup_steps) / span, 0.0, 1.0)


def _old_schedule(c, count):
    if c.schedule == "constant":
        return c.learning_rate * _old_warmup(c, count)
    frac = _old_decay_fraction(c, count)
    decay = 0.5 * (1.0 + jnp.cos(jnp.pi * frac)) if c.schedule == "cosine" else 1.0 - frac
    return c.learning_rate * _old_warmup(c, count) * decay


@pytest.mark.parametrize("name", ["constant", "cosine", "linear"])
@pytest.mark.parametrize(
    "lr, warmup, total",
    [
        (1.0, 10, 110),
        (3e-3, 5, 40),
        (5e-4, 0, 100),
        (2e-3, 1, 7),
        (1.0, 50, 30),
        (1.0, 4000, 10**5),
    ],
)
def test_optax_schedules_equal_the_hand_written_ones(name, lr, warmup, total):
    """optax's schedules give the old hand-written values at every count the train step
    sees (an int32 step) up to float32 rounding: measured max |difference| = 1.2e-7 *
    learning_rate (one float32 ulp of the peak; not bit-identical)."""
    c = default_config()
    c.schedule, c.learning_rate, c.warmup_steps, c.num_train_steps = name, lr, warmup, total
    _, new = make_optimizer(read_parts(c).optimizer)
    counts = jnp.arange(total + 5, dtype=jnp.int32)
    got = np.asarray(jax.vmap(new)(counts))
    want = np.asarray(jax.vmap(lambda i: _old_schedule(c, i))(counts))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1.5e-7 * lr)
