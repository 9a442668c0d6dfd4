"""Training runs: learning, outputs, exact resumption, faults, meshes, several processes.

`train_and_evaluate` trains one run, one seed (`jattn.train.run`). A module
fixture trains the plain run of `configs/smoke.py` (copy/tiny, a 1+1-layer
jattn Transformer, 40 steps) once (`reference`); the tests read it, resume
copies of it, or train beside it. Keys and workdirs of the seed programs an
earlier jattn had (`config.seeds`, ``WORKDIR/seed-0/``) are refused in one
line. Everything runs the real pieces: real tfds data, real orbax
checkpoints, real subprocesses and signals. Subprocesses run with the suite's
XLA flags and NaN checks (conftest.py) and share a persistent compilation
cache, so a restart does not compile again and its numbers are the in-process
fixture's bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from run_helpers import REPO, SMOKE, losses, sharded_mesh_axes, smoke_config

from jattn.train import (
    ConfigError,
    TrainingDivergedError,
    config_to_dict,
    load_run,
    read_metrics,
    train_and_evaluate,
)


def compare(got: dict[int, float], want: dict[int, float], steps, rtol: float) -> None:
    steps = list(steps)
    assert set(steps) <= set(got), f"missing steps {sorted(set(steps) - set(got))}"
    np.testing.assert_allclose(
        [got[s] for s in steps], [want[s] for s in steps], rtol=rtol, err_msg=f"steps {steps}"
    )


def strict_json(path: Path) -> Any:
    """`path` read as strict JSON (a NaN or Infinity fails)."""

    def no_nan(name):
        raise AssertionError(f"{path} holds {name}")

    return json.loads(path.read_text(), parse_constant=no_nan)


def saved_steps(run_dir) -> list[int]:
    """The checkpoint steps of a run directory, ascending."""
    steps = (Path(run_dir) / "checkpoints").iterdir()
    return sorted(int(p.name) for p in steps if p.name.isdigit())


def files_of(workdir) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in Path(workdir).rglob("*") if p.is_file()}


@dataclasses.dataclass(frozen=True)
class Trained:
    """A finished run and what it printed."""

    workdir: Path
    result: dict[str, Any]
    stderr: str


def train_quietly(workdir, **overrides) -> Trained:
    """Trains the smoke config with `overrides`, keeping what it printed."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = train_and_evaluate(smoke_config(**overrides), str(workdir))
    return Trained(Path(workdir), result, err.getvalue())


@pytest.fixture(scope="module")
def cache_env(session_compilation_cache):
    """Environment for subprocesses: CPU, the suite's XLA flags and NaN/Inf checks (so
    their numbers are the in-process runs': `jax_debug_nans` changes the last bits of a
    jitted step), the session's compilation cache (JATTN_COMPILATION_CACHE,
    tests/conftest.py), the repo on the path."""
    import jax

    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_DEBUG_NANS=str(jax.config.jax_debug_nans),
        JAX_DEBUG_INFS=str(jax.config.jax_debug_infs),
        JATTN_COMPILATION_CACHE=session_compilation_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def with_devices(env: dict[str, str], count: int) -> dict[str, str]:
    """`env` with `count` simulated CPU devices (the suite's other XLA flags kept)."""
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    return dict(env, XLA_FLAGS=flags.strip())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Trained:
    """The uninterrupted smoke run on one device."""
    return train_quietly(tmp_path_factory.mktemp("reference"))


def train_cmd(workdir, *extra) -> list[str]:
    return [
        sys.executable, "-m", "jattn.cli", "train", "--config", SMOKE, "--workdir", str(workdir),
        *extra,
    ]  # fmt: skip


def wait_for_step(workdir, proc: subprocess.Popen, step: int, timeout: float = 300) -> int:
    """Polls metrics.jsonl until a train/loss at `step` or later is written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [s for s in losses_quiet(workdir) if s >= step]
        if done:
            return max(losses_quiet(workdir))
        assert proc.poll() is None, f"run exited early: {proc.communicate()}"
        time.sleep(0.01)
    raise TimeoutError(f"no step {step} within {timeout}s")


def losses_quiet(workdir) -> list[int]:
    return [r["step"] for r in read_metrics(str(workdir)) if "train/loss" in r]


# -- a finished run ------------------------------------------------------------------------


def test_a_run_learns_and_writes_its_outputs(reference):
    """40 finite losses that fall, metrics.jsonl with eval at 20 and 40, final metrics
    (strict JSON, the last eval's numbers, the last logged loss), TensorBoard with the
    hparams, the run's config.json, decodes, and its checkpoints: the last two plus
    the best by `best_metric`."""
    workdir, final = reference.workdir, reference.result
    loss = losses(workdir)
    steps = sorted(loss)
    assert steps == list(range(1, 41))
    first, last = np.mean([loss[s] for s in steps[:5]]), np.mean([loss[s] for s in steps[-5:]])
    assert last < first - 0.5, (first, last)
    assert all(math.isfinite(v) for v in loss.values())

    # metrics.jsonl: one object a line, "step" plus named metrics, eval at 20 and 40.
    rows = read_metrics(str(workdir))
    assert all(isinstance(r["step"], int) for r in rows)
    eval_rows = {r["step"]: r for r in rows if "eval/validation/loss" in r}
    assert sorted(eval_rows) == [20, 40]
    for name in ("loss", "accuracy", "exact_match", "chrf"):  # char-level: no BLEU
        for split in ("validation", "test_longer"):
            assert f"eval/{split}/{name}" in eval_rows[40]
            assert final[f"eval/{split}/{name}"] == pytest.approx(
                eval_rows[40][f"eval/{split}/{name}"]
            )
    assert 0.0 <= final["eval/validation/exact_match"] <= 1.0
    assert {"train/tokens_per_sec", "train/learning_rate", "train/accuracy"} <= set(rows[0])
    # The loop's wait for its batches, timed: some, and less than a whole step takes.
    train_rows = [r for r in rows if "train/loss" in r]
    assert train_rows and all(
        0 < r["train/input_wait_ms"] < 1000 / r["train/steps_per_sec"] for r in train_rows
    )

    # TensorBoard (with the run's hparams), the resolved config,
    # the model config, decodes, final metrics.
    events = list((workdir / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    blob = b"".join(p.read_bytes() for p in events)
    assert b"hparams" in blob and b"model.d_model" in blob and b"train/loss" in blob
    saved = json.loads((workdir / "config.json").read_text())
    assert saved == config_to_dict(smoke_config())
    model_config = json.loads((workdir / "model_config.json").read_text())
    assert model_config["vocab_size"] % 8 == 0 and model_config["d_model"] == 32
    decoded = [json.loads(x) for x in (workdir / "decodes" / "validation.jsonl").open()]
    assert len(decoded) == 8 and {"input", "target", "prediction", "correct"} <= set(decoded[0])
    written = strict_json(workdir / "final_metrics.json")
    assert written["step"] == 40 and written == json.loads(json.dumps(final))
    train_rows = [r for r in rows if "train/loss" in r]
    assert written["train/loss"] == train_rows[-1]["train/loss"]  # the last window's mean

    # Checkpoints: the last two (30, 40) plus the best by exact match (20 or 40).
    kept = saved_steps(workdir)
    assert kept[-2:] == [30, 40] and set(kept) <= {20, 30, 40}
    best = {s: eval_rows[s]["eval/validation/exact_match"] for s in (20, 40)}
    if best[20] != best[40]:
        assert (20 in kept) == (best[20] > best[40]), (kept, best)
    assert (workdir / "checkpoints" / "40" / "data" / "process_0-of-1.json").exists()


def test_the_startup_summary_comes_before_the_first_step(reference):
    """Before the first step: workdir, parameters, devices and mesh, data sizes, the
    tensorboard command."""
    import jax

    from jattn import data

    summary, _, rest = reference.stderr.partition(f"tensorboard --logdir {reference.workdir}\n")
    assert rest.startswith("step 20:")  # printed before the loop's first output
    task = data.load("copy/tiny")
    final = reference.result
    assert f"workdir: {reference.workdir}\n" in summary
    # One count, beside the other architectures' at the same width.
    said = f"parameters: {final['num_params']:,} (encoder_decoder, 1+1 layers; at the same width: "
    assert summary.count("parameters: ") == 1 and said in summary
    assert f"devices: {jax.device_count()} x cpu" in summary
    assert "mesh {'data': 1, 'fsdp': 1, 'tensor': 1}" in summary
    assert f"train {len(task.source('train')):,} examples" in summary
    assert f"validation {len(task.source('validation')):,} examples" in summary
    assert "training rows: 8 a step (16 input + 16 target tokens), 40 steps" in summary


def test_a_finished_run_returns_its_results_without_training(reference):
    before = (reference.workdir / "metrics.jsonl").read_text()
    t0 = time.perf_counter()
    again = train_and_evaluate(smoke_config(), str(reference.workdir))
    assert time.perf_counter() - t0 < 30
    assert again == json.loads(json.dumps(reference.result))
    assert (reference.workdir / "metrics.jsonl").read_text() == before


def test_an_incompatible_workdir_is_refused_and_left_untouched(reference, tmp_path, capsys):
    """A changed model, input length or seed is refused in one line naming the workdir
    and every difference; nothing in the workdir changes."""
    from jattn import cli

    workdir = tmp_path / "run"
    shutil.copytree(reference.workdir, workdir)
    before = files_of(workdir)
    status = cli.main(
        ["train", "--config", SMOKE, "--workdir", str(workdir), "--compilation_cache_dir=",
         "--config.model.d_model=64", "--config.max_input_len=8", "--config.seed=3"]
    )  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err
    assert f"workdir '{workdir}' holds a checkpoint (step 40) of an incompatible config" in err
    max_len = smoke_config().max_len
    assert "model.d_model: checkpoint 32 != config 64" in err
    assert f"input_len: checkpoint {max_len} != config 8" in err
    assert "seed: checkpoint 0 != config 3" in err
    assert files_of(workdir) == before


def test_a_changed_schedule_is_refused_unless_allowed(reference, tmp_path, capsys):
    """num_train_steps, schedule, warmup_steps, learning_rate of a finished (or
    interrupted) run: changing them is refused in one line, the workdir untouched."""
    from jattn import cli

    workdir = tmp_path / "run"
    shutil.copytree(reference.workdir, workdir)
    before = files_of(workdir)
    status = cli.main(
        ["train", "--config", SMOKE, "--workdir", str(workdir), "--compilation_cache_dir=",
         "--config.num_train_steps=50", "--config.warmup_steps=7",
         "--config.learning_rate=0.01", "--config.schedule=cosine"]
    )  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err
    assert f"workdir '{workdir}' holds a checkpoint (step 40) trained under another schedule" in err
    for change in ("num_train_steps: checkpoint 40 != config 50", "warmup_steps: checkpoint 5 != "
                   "config 7", "learning_rate: checkpoint 0.003 != config 0.01",
                   "schedule: checkpoint 'constant' != config 'cosine'"):  # fmt: skip
        assert change in err
    assert "--config.allow_schedule_change=True" in err
    assert files_of(workdir) == before


def test_load_run_reproduces_the_decodes_written_by_the_run(reference):
    """The workdir reads back: its restored parameters decode the validation inputs
    exactly as the run did."""
    from jattn import data
    from jattn.models import decoding
    from jattn.train.evaluation import ids_to_text

    tokenizer = data.load("copy/tiny").tokenizer
    workdir = reference.workdir
    run = load_run(str(workdir))
    assert run.step == 40 and run.config.dataset == "copy/tiny" and run.config.seed == 0
    with pytest.raises(ValueError, match="no checkpoint at step 7"):
        load_run(str(workdir), step=7)
    decoded = [json.loads(x) for x in (workdir / "decodes" / "validation.jsonl").open()]
    inputs = np.zeros((len(decoded), run.config.eval_max_len), np.int32)
    for i, example in enumerate(decoded):
        ids = tokenizer.encode(example["input"])
        inputs[i, : len(ids)] = ids
    out = decoding.greedy(run.model, run.params, inputs, max_length=run.config.eval_max_len)
    assert [ids_to_text(tokenizer, row) for row in np.asarray(out)] == [
        e["prediction"] for e in decoded
    ]


@pytest.mark.parametrize(
    "member, saved",
    [
        ("seed-0", "seed-0/checkpoints/20"),
        ("learning_rate-0.001_seed-1", "learning_rate-0.001_seed-1/checkpoints/20"),
        ("seed-0", "checkpoints/20"),  # the older layout: every seed's state stacked here
    ],
)
def test_a_workdir_of_a_seed_program_is_refused_in_one_line(member, saved, tmp_path, capsys):
    """An earlier jattn trained several seeds (and swept values) in one program, each in
    ``WORKDIR/<member>/``: `jattn train` on such a workdir is refused before anything is
    written, in one line naming the release that finishes it."""
    from jattn import cli

    (tmp_path / saved).mkdir(parents=True)
    (tmp_path / member).mkdir(exist_ok=True)
    (tmp_path / member / "config.json").write_text("{}")
    before = files_of(tmp_path)
    with pytest.raises(ConfigError) as e:
        train_and_evaluate(smoke_config(), str(tmp_path))
    message = str(e.value)
    assert "\n" not in message
    assert f"{tmp_path} holds several seeds trained in one program" in message
    assert f"({member})" in message
    assert "git checkout $(git log -1 --format=%h --diff-filter=D -- jattn/train/members.py)~1" in (
        message
    )
    assert "train each seed as its own run" in message
    status = cli.main(["train", "--config", SMOKE, "--workdir", str(tmp_path),
                       "--compilation_cache_dir="])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 2 and err == f"jattn train: error: {message}"
    assert files_of(tmp_path) == before  # nothing written


@pytest.mark.parametrize(
    "key, value",
    [("seeds", "0,1,2"), ("seed_program", "map"), ("sweep_learning_rate", "1e-3,3e-4")],
)
def test_a_seed_program_key_is_refused_naming_its_replacement(key, value, tmp_path, capsys):
    """``--config.seeds=...`` (and the other keys of seed programs), on the command
    line or set by a config file, is one line naming what replaces it: a grid axis
    trained side by side with `jattn ablate --jobs N`."""
    from jattn import cli

    status = cli.main(["train", "--config", SMOKE, "--workdir", str(tmp_path / "run"),
                       f"--config.{key}={value}"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err
    assert err.startswith(f"jattn train: error: config.{key} was removed: ")
    assert "`jattn ablate --jobs N`" in err and "grid" in err
    assert not (tmp_path / "run").exists()

    old = tmp_path / "old_config.py"  # a config file of an earlier release
    old.write_text(
        "import runpy\n"
        f"_smoke = runpy.run_path({SMOKE!r})\n"
        "def get_config(arg=None):\n"
        "    c = _smoke['get_config'](arg)\n"
        f"    c.{key} = {value.split(',')[0]!r}\n"
        "    return c\n"
    )
    status = cli.main(["train", "--config", str(old), "--workdir", str(tmp_path / "run"),
                       "--compilation_cache_dir="])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err
    assert err.startswith(f"jattn train: error: config.{key} was removed: ")
    assert "`jattn ablate --jobs N`" in err
    assert not (tmp_path / "run").exists()


# -- divergence and interruption ---------------------------------------------------------


def test_a_nan_loss_stops_the_run_and_keeps_its_last_good_checkpoint(tmp_path):
    """A loss that turns NaN at step 13: nothing of that step or later is logged or
    saved, the step-10 checkpoint (finite) is kept and named in the error."""
    import jax
    import orbax.checkpoint as ocp

    config = smoke_config(debug_nan_at_step=13, eval_splits="()")
    with pytest.raises(TrainingDivergedError, match=r"non-finite loss \(nan\) at step 13.*step 10"):
        train_and_evaluate(config, str(tmp_path))
    assert saved_steps(tmp_path) == [10]
    assert max(losses(tmp_path)) == 12  # nothing logged or saved for the NaN step
    assert not (tmp_path / "final_metrics.json").exists()
    restored = ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / "10" / "state")
    leaves = [np.asarray(x) for x in jax.tree.leaves(restored["params"])]
    assert leaves and all(np.all(np.isfinite(x)) for x in leaves)
    assert int(restored["step"]) == 10


@pytest.mark.slow
def test_sigterm_then_sigkill_then_finish_equals_the_uninterrupted_run(
    reference, cache_env, tmp_path
):
    """SIGTERM saves at the step it stopped and exits cleanly; SIGKILL loses only the
    steps since the last save; the restarted run trains those steps again exactly as
    the killed process did and ends with the uninterrupted run's losses, bit for bit."""
    dirs = [tmp_path]
    # Eval settings do not touch training; skipping eval keeps the subprocesses quick.
    cmd = train_cmd(tmp_path, "--config.eval_splits=()", "--config.progress_bar=false")

    proc = subprocess.Popen(cmd, env=cache_env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    wait_for_step(dirs[-1], proc, 13)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "preempted at step" in out
    stopped = max(losses(dirs[0]))
    assert 13 <= stopped < 30
    for run in dirs:
        assert max(losses(run)) == stopped
        assert saved_steps(run)[-1] == stopped  # a checkpoint at the very step it stopped

    proc = subprocess.Popen(cmd, env=cache_env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    # Kill a few steps after a checkpoint (every 10), never right at one.
    target = next(t for t in range(stopped + 3, 40) if t % 10 == 3)
    seen = wait_for_step(dirs[-1], proc, target)
    proc.kill()
    proc.communicate(timeout=60)
    assert seen < 40, "the run finished before it could be killed"
    last_save = max(saved_steps(dirs[0]))
    killed = [losses(run) for run in dirs]
    for k in killed:
        assert max(k) > last_save, "killed exactly at a checkpoint: nothing to lose"

    subprocess.run(cmd, env=cache_env, cwd=REPO, check=True, capture_output=True, timeout=300)
    for seed, run in enumerate(dirs):
        got = losses(run)
        assert sorted(got) == list(range(1, 41))
        again = [s for s in killed[seed] if s > last_save]
        assert again and [got[s] for s in again] == [killed[seed][s] for s in again], seed
        compare(got, losses(reference.workdir), range(1, 41), rtol=0)


# -- final metrics, wandb, checkpoint signatures ----------------------------------


def test_final_metrics_are_strict_json_with_the_logged_window_mean(tmp_path):
    """final_metrics.json's train/loss is the last metrics.jsonl row's (the mean over the
    logging interval, train/loss_window_steps steps); no NaN in the file; a rerun that
    cannot time its steps keeps the step rate measured before."""
    overrides = dict(num_train_steps=7, log_every_steps=3, checkpoint_every_steps=7,
                     eval_every_steps=7, eval_splits="()")  # fmt: skip
    final = train_and_evaluate(smoke_config(**overrides), str(tmp_path))
    rows = [r for r in read_metrics(str(tmp_path)) if "train/loss" in r]
    assert [(r["step"], r["train/loss_window_steps"]) for r in rows] == [(3, 3), (6, 3), (7, 1)]
    saved = strict_json(tmp_path / "final_metrics.json")
    assert saved == final and saved["train/loss"] == rows[-1]["train/loss"]
    measured = saved["train/steps_per_sec"]
    assert measured > 0
    # A stale final_metrics.json makes the run resume at its last step: no step is
    # timed (NaN), yet the file keeps the earlier measurement, as strict JSON.
    stale = dict(saved, step=6)
    (tmp_path / "final_metrics.json").write_text(json.dumps(stale))
    again = train_and_evaluate(smoke_config(**overrides), str(tmp_path))
    saved = strict_json(tmp_path / "final_metrics.json")
    assert saved == again and saved["step"] == 7
    assert saved["train/steps_per_sec"] == measured
    assert saved["train/loss"] == rows[-1]["train/loss"]


def test_wandb_is_a_clear_error_without_the_package(tmp_path, monkeypatch):
    """wandb stays off unless asked; asked for without the package, it is a clear error
    before anything runs."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match="config.wandb=True needs the `wandb` package"):
        train_and_evaluate(smoke_config(wandb=True), str(tmp_path / "wandb"))
    assert not (tmp_path / "wandb").exists()


def test_write_final_metrics_keeps_measured_values(tmp_path):
    from jattn.train.metrics import write_final_metrics

    path = str(tmp_path / "final_metrics.json")
    write_final_metrics(path, {"step": 5, "a": 1.5, "b": float("inf")})
    out = write_final_metrics(path, {"step": 5, "a": float("nan"), "b": float("nan"), "c": 2})
    assert out == {"step": 5, "a": 1.5, "b": None, "c": 2}
    assert json.loads((tmp_path / "final_metrics.json").read_text()) == out


def _checksum_by_numpy(x) -> str:
    """The checksum a step's meta records (`checkpoints._leaf_checksum`), computed
    again in numpy from its description: each element's bits as uint32, two sums
    mod 2^32 weighted by odd functions of the element's row-major index."""
    import jax

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    bits = (a.astype(np.uint32) if a.dtype == bool else a.view(unsigned)).astype(np.uint64)
    index = np.arange(bits.size, dtype=np.uint64)
    m32 = np.uint64(0xFFFFFFFF)

    def mix(h):
        h = h ^ (h >> np.uint64(16))
        h = (h * np.uint64(0x85EBCA6B)) & m32
        h = h ^ (h >> np.uint64(13))
        h = (h * np.uint64(0xC2B2AE35)) & m32
        return h ^ (h >> np.uint64(16))

    w1 = ((index * np.uint64(0x9E3779B1)) & m32) | np.uint64(1)
    w2 = mix((index + np.uint64(0x7F4A7C15)) & m32) | np.uint64(1)
    flat = bits.reshape(-1)
    sums = (np.sum((flat * w1) & m32) & m32, np.sum((mix(flat) * w2) & m32) & m32)
    return "".join(f"{int(v):08x}" for v in sums)


def test_state_checksums_are_the_recorded_formula_for_every_dtype():
    """A restore checks every array against the checksum its step's meta recorded,
    so the function must give the same digits as the jattn that saved the step:
    held against a numpy computation of the formula, leaf by leaf and in a tree."""
    import jax
    import jax.numpy as jnp

    from jattn.train.checkpoints import checksums

    rng = np.random.default_rng(0)
    state = {
        "params": {
            "w": jnp.asarray(rng.normal(size=(5, 7)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(7,)), jnp.bfloat16),
        },
        "opt_state": [
            jnp.asarray(rng.integers(-9, 9, size=(3, 2, 4)), jnp.int32),
            jnp.asarray(rng.integers(0, 2, size=(6,)), bool),
        ],
        "step": jnp.int32(1234),
        "key": jax.random.key(7),
        "bytes": jnp.asarray(rng.integers(0, 255, size=(9,)), jnp.uint8),
    }
    got = checksums(state)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    name = lambda p: jax.tree_util.keystr(p, simple=True, separator="/")  # noqa: E731
    want = {name(p): _checksum_by_numpy(x) for p, x in flat}
    assert got == want
    assert set(got) >= {"params/w", "opt_state/0", "step", "key"}
    # One element changed, or two swapped, changes the digits.
    w = np.asarray(state["params"]["w"]).copy()
    w[2, 3] = np.nextafter(w[2, 3], np.float32(np.inf))
    assert checksums({"w": jnp.asarray(w)})["w"] != got["params/w"]
    w = np.asarray(state["params"]["w"]).copy()
    w[[0, 4]] = w[[4, 0]]
    assert checksums({"w": jnp.asarray(w)})["w"] != got["params/w"]


def test_signature_input_length_and_legacy_checkpoints():
    # max_input_len = 0 means max_len: the same data stream, so the same
    # signature; another input length is a different stream. A signature
    # saved before the key existed (no input_len) meant max_len.
    from jattn.train.resume_keys import incompatibilities, signature

    config = smoke_config()
    same = smoke_config()
    same.max_input_len = config.max_len
    assert signature(same) == signature(config)
    legacy = signature(config)
    del legacy["input_len"]
    assert incompatibilities(legacy, config) == []
    assert incompatibilities(legacy, same) == []
    shorter = smoke_config()
    shorter.max_input_len = 8
    assert incompatibilities(legacy, shorter) == [
        f"input_len: checkpoint {config.max_len} != config 8"
    ]


def test_signature_of_a_model_field_added_after_the_checkpoint():
    # A checkpoint saved before a TransformerConfig field existed ran with the
    # field's default: it resumes under that default and under no other value.
    from jattn.train.resume_keys import incompatibilities, signature

    config = smoke_config()
    legacy = signature(config)
    field = "relative_cross"
    default = config.model[field]
    del legacy["model"][field]
    assert incompatibilities(legacy, config) == []
    changed = smoke_config()
    changed.model[field] = 0.5 if isinstance(default, float) else not default
    assert incompatibilities(legacy, changed) == [
        f"model.{field}: checkpoint {default!r} != config {changed.model[field]!r}"
    ]


def test_a_model_field_that_changes_at_most_rounding_may_change_on_resume():
    # attention_assume_finite fixes no shape and no data: a checkpoint saved with
    # either value (or before the field existed) resumes under the other.
    from jattn.train.resume_keys import MODEL_RESUME_SAFE_KEYS, incompatibilities, signature

    assert MODEL_RESUME_SAFE_KEYS == ("attention_assume_finite",)
    config = smoke_config()
    saved = signature(config)
    assert "attention_assume_finite" not in saved["model"]
    flipped = smoke_config()
    flipped.model.attention_assume_finite = not config.model.attention_assume_finite
    assert incompatibilities(saved, flipped) == []
    older = signature(config)
    older["model"]["attention_assume_finite"] = True  # a signature that kept the field
    assert incompatibilities(older, config) == []


# -- separate row lengths for inputs and targets ----------------------------------


def test_input_lengths_equal_to_the_target_lengths_reproduce_the_reference_run(reference, tmp_path):
    """max_input_len = max_len (and the same for eval) is the default layout: the same
    batches, so the same losses step by step and the same eval metrics."""
    ref_final, ref_loss = reference.result, losses(reference.workdir)
    config = smoke_config(max_input_len=16, eval_max_input_len=32)
    final = train_and_evaluate(config, str(tmp_path))
    compare(losses(tmp_path), ref_loss, range(1, 41), rtol=0)
    evals = sorted(k for k in ref_final if k.startswith("eval/"))
    assert evals and {k: final[k] for k in evals} == {k: ref_final[k] for k in evals}


def test_training_with_shorter_input_rows(tmp_path):
    """Encoder rows of 8 tokens and decoder rows of 16 (eval: 12 and 32): it trains,
    reads the data stream of a loader with those lengths, and resumes."""
    from jattn import data

    overrides = dict(
        max_input_len=8,
        eval_max_input_len=12,
        num_train_steps=6,
        eval_every_steps=6,
        checkpoint_every_steps=3,
        eval_splits="('validation',)",
    )
    final = train_and_evaluate(smoke_config(**overrides), str(tmp_path))
    loss = losses(tmp_path)
    assert sorted(loss) == list(range(1, 7)) and all(math.isfinite(v) for v in loss.values())
    assert math.isfinite(final["eval/validation/loss"]) and final["eval/validation/loss"] > 0
    # The data state saved with step 6 is that of the loader with 8 inputs slots after
    # 6 batches. copy/tiny inputs and targets have equal lengths (2-16 tokens), so only
    # the inputs' limit can have dropped examples.
    saved = json.loads(
        (tmp_path / "checkpoints" / "6" / "data" / "process_0-of-1.json").read_text()
    )
    loader = data.make_loader(
        data.load("copy/tiny"), "train", batch_size=8, max_len=16, max_input_len=8, seed=0
    )
    it = iter(loader)
    for _ in range(6):
        batch = next(it)
    assert batch["inputs"].shape == (8, 8) and batch["targets"].shape == (8, 16)
    assert json.loads(json.dumps(it.get_state())) == saved
    assert data.loader_stats(it)["dropped"] > 0
    decoded = [json.loads(x) for x in (tmp_path / "decodes" / "validation.jsonl").open()]
    assert decoded and all(e["input_tokens"] <= 12 for e in decoded)  # eval's inputs limit
    # Resuming with the same lengths continues the run (history kept).
    extended = {**overrides, "num_train_steps": 8, "allow_schedule_change": True}
    final = train_and_evaluate(smoke_config(**extended), str(tmp_path))
    assert final["step"] == 8
    compare(losses(tmp_path), loss, range(1, 7), rtol=0)


def test_input_length_keys_fail_clearly(tmp_path):
    for key, value in (("max_input_len", -1), ("eval_max_input_len", -3)):
        with pytest.raises(
            ConfigError, match=rf"config.{key} must be an int >= 0 \(0: the default\), got {value}"
        ):
            train_and_evaluate(smoke_config(**{key: value}), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # refused before anything was written
    with pytest.raises(ConfigError, match="max_input_len='16.5': not a valid int"):
        smoke_config(max_input_len="16.5")
    # A learned position table must cover every row length, checked up front.
    learned = smoke_config(eval_max_input_len=40)
    learned.model.position = "learned"
    with pytest.raises(
        ConfigError,
        match=r"model.max_len=32 positions, but eval_max_input_len resolves to 40",
    ):
        train_and_evaluate(learned, str(tmp_path / "learned"))
    assert not (tmp_path / "learned").exists()
    # copy/tiny inputs have 2-16 tokens: one input slot drops every eval example,
    # which would read as loss 0 and accuracy 0 instead of an error.
    with pytest.raises(ConfigError, match="eval split 'validation' has no example that fits"):
        train_and_evaluate(smoke_config(eval_max_input_len=1), str(tmp_path / "empty"))


# -- a torn save, meshes, several processes ---------------------------------------


@pytest.mark.slow
def test_resume_skips_a_torn_save_and_extends_a_finished_run(reference, tmp_path):
    """A crash mid-save leaves `<step>.orbax-checkpoint-tmp-*`; the restart ignores it."""
    ref_loss = losses(reference.workdir)
    workdir = tmp_path / "run"
    shutil.copytree(reference.workdir, workdir)
    torn = workdir / "checkpoints" / "50.orbax-checkpoint-tmp-1700000000000000"
    shutil.copytree(workdir / "checkpoints" / "40", torn)
    for f in (torn / "state").rglob("*"):
        if f.is_file() and "manifest" in f.name:
            f.write_bytes(b"torn")
    config = smoke_config(num_train_steps=45, eval_splits="()", allow_schedule_change=True)
    final = train_and_evaluate(config, str(workdir))
    assert final["step"] == 45
    assert not torn.exists()
    loss = losses(workdir)
    assert sorted(loss) == list(range(1, 46))
    compare(loss, ref_loss, range(1, 41), rtol=0)  # history kept as it was
    assert all(math.isfinite(loss[s]) for s in range(41, 46))


MESH_SCRIPT = """
import json, sys
import jax
from jattn.train import load_config, apply_overrides, train_and_evaluate, read_metrics, ConfigError
assert jax.device_count() == 8, jax.devices()
out = {}
for mesh in ("(2,2,2)", "(8,1,1)"):
    c = apply_overrides(load_config(sys.argv[1]), [
        ("num_train_steps", "6"), ("eval_splits", "()"), ("mesh_shape", mesh)])
    train_and_evaluate(c, f"{sys.argv[2]}/{mesh}")
    out[mesh] = {r["step"]: r["train/loss"] for r in read_metrics(f"{sys.argv[2]}/{mesh}")}
errors = []
for bad in [[("batch_size", "12")], [("mesh_shape", "(3,-1,1)")], [("mesh_shape", "(4,1,1)")]]:
    try:
        train_and_evaluate(apply_overrides(load_config(sys.argv[1]), bad), sys.argv[2] + "/bad")
    except ConfigError as e:
        errors.append(str(e))
out["errors"] = errors
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_meshes_of_eight_devices_match_one_device(reference, cache_env, tmp_path):
    ref_loss = losses(reference.workdir)
    proc = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, SMOKE, str(tmp_path)],
        env=with_devices(cache_env, 8), cwd=REPO, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    for mesh in ("(2,2,2)", "(8,1,1)"):
        got = {int(k): v for k, v in result[mesh].items()}
        compare(got, ref_loss, range(1, 7), rtol=2e-5)
    # The (2,2,2) run really sharded its parameters (orbax records each array's spec).
    assert {"fsdp", "tensor"} <= sharded_mesh_axes(tmp_path / "(2,2,2)", 6)
    batch_error, fill_error, mesh_error = result["errors"]
    assert "batch_size=12 is not divisible by the data-parallel devices data*fsdp=8" in batch_error
    assert "8 devices are not divisible by 3" in fill_error
    assert "needs 4 devices, but there are 8" in mesh_error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_processes(workdir, env, *extra) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            train_cmd(
                workdir,
                *extra,
                "--coordinator_address",
                f"127.0.0.1:{port}",
                "--num_processes",
                "2",
                "--process_id",
                str(i),
            ),
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]


def finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=400)
        outs.append(out)
        assert p.returncode == 0, out[-3000:]
    return outs


@pytest.mark.slow
def test_two_processes_train_checkpoint_preempt_and_resume_exactly(cache_env, tmp_path):
    """Two processes on 127.0.0.1 (gloo): an uninterrupted 15-step run; then a run resumed
    from its step-10 checkpoint, preempted by SIGTERM to both processes, agrees with it
    step by step and saves at the step both processes agreed on."""
    args = ("--config.checkpoint_every_steps=5", "--config.eval_splits=()")
    full = tmp_path / "full"
    outs = finish(start_two_processes(full, cache_env, "--config.num_train_steps=15", *args))
    assert "done at step 15" in outs[0] and "done at step" not in outs[1]  # process 0 reports
    step10 = full / "checkpoints" / "10"
    assert {p.name for p in (step10 / "data").glob("*.json")} == {
        "process_0-of-2.json",
        "process_1-of-2.json",
    }

    resumed = tmp_path / "resumed"
    shutil.copytree(step10, resumed / "checkpoints" / "10")
    longer = ("--config.num_train_steps=100000", "--config.allow_schedule_change=True")
    procs = start_two_processes(resumed, cache_env, *longer, *args)
    wait_for_step(resumed, procs[0], 15)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    outs = finish(procs)
    assert "preempted at step" in outs[0]
    got = losses(resumed)
    assert min(got) == 11  # continued from 10, not from scratch
    compare(got, losses(full), range(11, 16), rtol=1e-6)
    saved = saved_steps(resumed)
    assert saved[-1] == max(got) >= 15  # one checkpoint, at the step both processes stopped
    assert (resumed / "checkpoints" / str(saved[-1]) / "data" / "process_1-of-2.json").exists()
