"""Library edges: empty sequences give jax.nn's answer in every implementation, bad
sizes are clear errors, nothing spins, and SIGTERM ends a blocked main thread."""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import data
from jattn.train.distributed import PreemptionWatch, Terminated


@pytest.mark.parametrize("impl", ["xla", "chunked", "pallas"])
@pytest.mark.parametrize(("t", "s"), [(4, 0), (0, 4), (0, 0)])
def test_empty_sequences_return_what_jax_nn_returns(impl, t, s):
    q = jnp.ones((2, t, 4, 8))
    k = jnp.ones((2, s, 2, 8))
    v = jnp.ones((2, s, 2, 8))
    kr, vr = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)  # jax.nn: GQA as MHA
    with jax.debug_nans(False), jax.debug_infs(False):  # jax.nn's max over no key: -inf
        want = jax.nn.dot_product_attention(q, kr, vr)
    got = jattn.dot_product_attention(q, k, v, implementation=impl)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    out, lse = jattn.dot_product_attention(q, k, v, implementation=impl, return_residual=True)
    assert lse.shape == (2, t, 4) and np.all(np.exp(np.asarray(lse)) == 0)
    grads = jax.grad(
        lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation=impl).sum(),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g, x in zip(grads, (q, k, v), strict=True):
        assert g.shape == x.shape and not np.any(np.asarray(g))


def test_head_dim_0_is_a_clear_error():
    x = jnp.ones((1, 3, 2, 0))
    with pytest.raises(ValueError, match="head_dim must be at least 1"):
        jattn.dot_product_attention(x, x, x)


def test_positions_beyond_int32_are_refused_not_wrapped():
    x = jnp.ones((1, 2, 1, 4))
    big = np.array([[0, 2**31]], np.int64)
    with pytest.raises(ValueError, match="q_positions holds values in"):
        jattn.dot_product_attention(x, x, x, q_positions=big, is_causal=True)
    fine = np.array([[0, 2**31 - 1]], np.int64)
    assert jattn.dot_product_attention(x, x, x, kv_positions=fine).shape == x.shape


def test_a_loader_that_drops_every_example_raises_instead_of_spinning(pristine_data):
    task = data.load("copy/tiny", data_dir=str(pristine_data))
    it = iter(data.make_loader(task, "train", batch_size=4, max_len=1, seed=0, prefetch=0))
    start = time.monotonic()
    with pytest.raises(ValueError, match="no example fits the row lengths"):
        next(it)
    assert time.monotonic() - start < 30


def test_a_sigterm_the_loop_never_sees_interrupts_a_blocked_main_thread():
    """The first SIGTERM sets the flag; when no step comes to read it (a batch that
    never arrives), the watch delivers it again and the blocked wait ends."""
    watch = PreemptionWatch(grace_s=0.3)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        start = time.monotonic()
        with pytest.raises(Terminated) as e:
            threading.Event().wait(30)  # blocked, as on a data loader that hangs
        assert e.value.stage == "blocked"
        assert time.monotonic() - start < 10
    finally:
        watch.close()


def test_a_sigterm_the_loop_sees_is_left_to_the_loop():
    watch = PreemptionWatch(grace_s=0.3)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert watch.reached(1)  # seen: the loop will save and stop
        time.sleep(0.6)  # no second delivery
    finally:
        watch.close()


@pytest.mark.parametrize(("stage", "status"), [("start-up", 0), ("finishing", 0)])
def test_sigterm_outside_the_steps_ends_at_once_with_the_documented_status(stage, status, capsys):
    """Before the first step and after the last save there is nothing to save: the
    signal ends the run at once (exit 0, one line); a second SIGTERM mid-save is 143."""
    from jattn.cli.train import terminated_status

    watch = PreemptionWatch(stage=stage)
    try:
        with pytest.raises(Terminated) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
    finally:
        watch.close()
    assert e.value.stage == stage
    assert terminated_status(e.value, "w") == status
    assert "stopped by SIGTERM" in capsys.readouterr().err
    assert terminated_status(Terminated("training"), "w") == 143
