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
@pytest.mark.parametrize(("b", "t", "s"), [(2, 4, 0), (2, 0, 4), (2, 0, 0), (0, 4, 4)])
def test_empty_sequences_return_what_jax_nn_returns(impl, b, t, s):
    """T = 0, S = 0, and (issue 54) B = 0, which the Pallas kernel's interpreter
    refused with a TypeError."""
    q = jnp.ones((b, t, 4, 8))
    k = jnp.ones((b, s, 2, 8))
    v = jnp.ones((b, s, 2, 8))
    kr, vr = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)  # jax.nn: GQA as MHA
    with jax.debug_nans(False), jax.debug_infs(False):  # jax.nn's max over no key: -inf
        want = jax.nn.dot_product_attention(q, kr, vr)
    got = jattn.dot_product_attention(q, k, v, implementation=impl)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    out, lse = jattn.dot_product_attention(q, k, v, implementation=impl, return_residual=True)
    assert lse.shape == (b, t, 4) and np.all(np.exp(np.asarray(lse)) == 0)
    grads = jax.grad(
        lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation=impl).sum(),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g, x in zip(grads, (q, k, v), strict=True):
        assert g.shape == x.shape and not np.any(np.asarray(g))


_RANK3_MASK = """
import warnings
import jax, jax.numpy as jnp, numpy as np
import jattn
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.normal(size=(2, 3, 2, 4)), jnp.float32) for _ in range(3))
mask = jnp.asarray(rng.random((2, 3, 3)) < 0.7).at[:, :, 0].set(True)  # [2, T, S]: B = N = 2
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = [jattn.dot_product_attention(q, k, v, mask=mask, implementation=i)
           for i in ("xla", "chunked")]
    per_row = jattn.dot_product_attention(q, k, v, mask=mask[:, None])
    other = jnp.ones((3, 3, 3), bool)  # [3, T, S] with N = 2: an error, no warning
    try:
        jattn.dot_product_attention(q, k, v, mask=other)
    except ValueError:
        pass
want = jax.nn.dot_product_attention(q, k, v, mask=mask)
assert all(np.allclose(g, want, atol=1e-6) for g in got)
assert not np.allclose(per_row, want, atol=1e-3)  # the two readings differ here
print(len(caught))
print(caught[0].message)
"""


def test_an_ambiguous_rank3_mask_is_read_as_jax_nn_reads_it_and_warned_about_once(cli_env):
    """A rank-3 mask `[X, T, S]` is `[N, T, S]` in jax.nn (broadcast from the right);
    with B = N the caller may have meant one per batch row: one warning a process
    (issue 54), the answer jax.nn's."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _RANK3_MASK], env=cli_env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, message = proc.stdout.strip().splitlines()
    assert count == "1"
    assert message == (
        "dot_product_attention: a rank-3 mask of shape [2, 3, 3] with batch B = heads N = 2 "
        "is read as [N, T, S], one per head (jax.nn's broadcasting rule); for one per batch "
        "row pass mask[:, None] ([B, 1, T, S]). Shown once."
    )


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
    it = iter(
        data.make_loader(
            task, "train", batch_size=4, max_len=1, seed=0, io=data.LoaderIO(prefetch=0)
        )
    )
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
