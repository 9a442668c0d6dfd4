"""Training loop: learning, outputs, exact resumption, faults, meshes, several processes.

Everything runs the real pieces: `configs/smoke.py` (copy/tiny, a 1+1-layer
jattn Transformer), real tfds data, real orbax checkpoints, real subprocesses
and signals. One in-process reference run (module fixture) gives the
step-by-step losses every other run is compared against. Subprocesses share a
persistent compilation cache so that restarts do not compile again.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from run_helpers import REPO, SMOKE, losses, smoke_config

from jattn.train import (
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


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    """Environment for subprocesses: CPU, a shared compilation cache, the repo on the path."""
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        JATTN_COMPILATION_CACHE=str(tmp_path_factory.mktemp("xla_cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.pop("XLA_FLAGS", None)
    return env


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted smoke run on one device: (workdir, final metrics, losses)."""
    workdir = tmp_path_factory.mktemp("reference")
    final = train_and_evaluate(smoke_config(), str(workdir))
    return workdir, final, losses(workdir)


def train_cmd(workdir, *extra) -> list[str]:
    return [
        sys.executable, "-m", "jattn.cli", "train", "--config", SMOKE, "--workdir", str(workdir),
        *extra,
    ]  # fmt: skip


def wait_for_step(workdir, proc: subprocess.Popen, step: int, timeout: float = 240) -> int:
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


# -- the reference run ------------------------------------------------------------------


def test_smoke_run_learns_and_writes_its_outputs(reference):
    workdir, final, loss = reference
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

    # TensorBoard, the resolved config, the model config, decodes, final metrics.
    events = list((workdir / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    saved = json.loads((workdir / "config.json").read_text())
    assert saved == config_to_dict(smoke_config())
    model_config = json.loads((workdir / "model_config.json").read_text())
    assert model_config["vocab_size"] % 8 == 0 and model_config["d_model"] == 32
    decoded = [json.loads(x) for x in (workdir / "decodes" / "validation.jsonl").open()]
    assert len(decoded) == 8 and {"input", "target", "prediction", "correct"} <= set(decoded[0])
    assert json.loads((workdir / "final_metrics.json").read_text())["step"] == 40

    # Checkpoints: the last two (30, 40) plus the best by exact match (20 or 40).
    kept = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert kept[-2:] == [30, 40] and set(kept) <= {20, 30, 40}
    assert (workdir / "checkpoints" / "40" / "data" / "process_0-of-1.json").exists()


def test_finished_workdir_returns_its_results_without_training(reference):
    workdir, final, _ = reference
    before = (workdir / "metrics.jsonl").read_text()
    t0 = time.perf_counter()
    again = train_and_evaluate(smoke_config(), str(workdir))
    assert again == json.loads(json.dumps(final))
    assert (workdir / "metrics.jsonl").read_text() == before
    assert time.perf_counter() - t0 < 30


def test_incompatible_workdir_is_refused_and_left_untouched(reference, tmp_path, capsys):
    from jattn import cli

    workdir = tmp_path / "run"
    shutil.copytree(reference[0], workdir)
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    status = cli.main(
        ["train", "--config", SMOKE, "--workdir", str(workdir), "--compilation_cache_dir=",
         "--config.model.d_model=64", "--config.seed=3", "--config.max_input_len=8"]
    )  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err
    assert f"workdir '{workdir}' holds a checkpoint (step 40) of an incompatible config" in err
    max_len = smoke_config().max_len
    assert (
        "model.d_model: checkpoint 32 != config 64" in err
        and "seed: checkpoint 0 != config 3" in err
        and f"input_len: checkpoint {max_len} != config 8" in err
    )
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before


def test_a_changed_schedule_is_refused_unless_allowed(reference, tmp_path, capsys):
    """num_train_steps, schedule, warmup_steps, learning_rate of a finished (or
    interrupted) run: changing them is refused in one line, the workdir untouched."""
    from jattn import cli

    workdir = tmp_path / "run"
    shutil.copytree(reference[0], workdir)
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
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
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before


def test_final_metrics_are_strict_json_with_the_logged_window_mean(tmp_path):
    """final_metrics.json's train/loss is the last metrics.jsonl row's (the mean over the
    logging interval, train/loss_window_steps steps); no NaN in the file; a rerun that
    cannot time its steps keeps the step rate measured before."""

    def strict(path):
        def no_nan(name):
            raise AssertionError(f"{path} holds {name}")

        return json.loads(path.read_text(), parse_constant=no_nan)

    overrides = dict(num_train_steps=7, log_every_steps=3, checkpoint_every_steps=7,
                     eval_every_steps=7, eval_splits="()")  # fmt: skip
    final = train_and_evaluate(smoke_config(**overrides), str(tmp_path))
    rows = [r for r in read_metrics(str(tmp_path)) if "train/loss" in r]
    assert [(r["step"], r["train/loss_window_steps"]) for r in rows] == [(3, 3), (6, 3), (7, 1)]
    saved = strict(tmp_path / "final_metrics.json")
    assert saved == final and saved["train/loss"] == rows[-1]["train/loss"]
    measured = saved["train/steps_per_sec"]
    assert measured > 0
    # A stale final_metrics.json makes the run resume at its last step: no step is
    # timed (NaN), yet the file keeps the earlier measurement, as strict JSON.
    stale = dict(saved, step=6)
    (tmp_path / "final_metrics.json").write_text(json.dumps(stale))
    again = train_and_evaluate(smoke_config(**overrides), str(tmp_path))
    saved = strict(tmp_path / "final_metrics.json")
    assert saved == again and saved["step"] == 7
    assert saved["train/steps_per_sec"] == measured
    assert saved["train/loss"] == rows[-1]["train/loss"]


def test_startup_summary_hparams_and_wandb_off(tmp_path, capsys, monkeypatch):
    """Before the first step: workdir, parameters, devices and mesh, data sizes, the
    tensorboard command. TensorBoard gets the run's hparams. wandb stays off unless
    asked; asked for without the package, it is a clear error before anything runs."""
    import jax

    from jattn.train import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match="config.wandb=True needs the `wandb` package"):
        train_and_evaluate(smoke_config(wandb=True), str(tmp_path / "wandb"))
    assert not (tmp_path / "wandb").exists()

    workdir = tmp_path / "run"
    config = smoke_config(num_train_steps=2, eval_splits="('validation',)")
    final = train_and_evaluate(config, str(workdir))
    err = capsys.readouterr().err
    summary, _, rest = err.partition(f"tensorboard --logdir {workdir}\n")
    assert rest.startswith("step 2:")  # printed before the loop's first output
    from jattn import data

    task = data.load("copy/tiny")
    assert f"workdir: {workdir}\n" in summary
    assert f"parameters: {final['num_params']:,}\n" in summary
    assert f"devices: {jax.device_count()} x cpu" in summary
    assert "mesh {'data': 1, 'fsdp': 1, 'tensor': 1}" in summary
    assert f"train {len(task.source('train')):,} examples" in summary
    assert f"validation {len(task.source('validation')):,} examples" in summary
    assert "training rows: 8 a step (16 input + 16 target tokens), 2 steps" in summary
    events = b"".join(p.read_bytes() for p in (workdir / "tb").glob("events.out.tfevents.*"))
    assert b"hparams" in events and b"model.d_model" in events and b"train/loss" in events


def test_write_final_metrics_keeps_measured_values(tmp_path):
    from jattn.train.metrics import write_final_metrics

    path = str(tmp_path / "final_metrics.json")
    write_final_metrics(path, {"step": 5, "a": 1.5, "b": float("inf")})
    out = write_final_metrics(path, {"step": 5, "a": float("nan"), "b": float("nan"), "c": 2})
    assert out == {"step": 5, "a": 1.5, "b": None, "c": 2}
    assert json.loads((tmp_path / "final_metrics.json").read_text()) == out


def test_signature_input_length_and_legacy_checkpoints():
    # max_input_len = 0 means max_len: the same data stream, so the same
    # signature; another input length is a different stream. A signature
    # saved before the key existed (no input_len) meant max_len.
    from jattn.train.checkpoints import incompatibilities, signature

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
    from jattn.train.checkpoints import incompatibilities, signature

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


def test_load_run_reproduces_the_decodes_written_by_the_run(reference):
    """The restored parameters decode the validation inputs exactly as the run did."""
    from jattn import data
    from jattn.models import decoding
    from jattn.train.evaluation import ids_to_text

    workdir = reference[0]
    run = load_run(str(workdir))
    assert run.step == 40 and run.config.dataset == "copy/tiny"
    with pytest.raises(ValueError, match="no checkpoint at step 7"):
        load_run(str(workdir), step=7)
    tokenizer = data.load(run.config.dataset).tokenizer
    decoded = [json.loads(x) for x in (workdir / "decodes" / "validation.jsonl").open()]
    inputs = np.zeros((len(decoded), run.config.eval_max_len), np.int32)
    for i, example in enumerate(decoded):
        ids = tokenizer.encode(example["input"])
        inputs[i, : len(ids)] = ids
    out = decoding.greedy(run.model, run.params, inputs, max_length=run.config.eval_max_len)
    assert [ids_to_text(tokenizer, row) for row in np.asarray(out)] == [
        e["prediction"] for e in decoded
    ]


# -- separate row lengths for inputs and targets ---------------------------------------


def test_input_lengths_equal_to_the_target_lengths_reproduce_the_reference_run(reference, tmp_path):
    """max_input_len = max_len (and the same for eval) is the default layout: the same
    batches, so the same losses step by step and the same eval metrics."""
    _, ref_final, ref_loss = reference
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
    from jattn.train import ConfigError

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


# -- faults -----------------------------------------------------------------------------


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    import orbax.checkpoint as ocp

    config = smoke_config(debug_nan_at_step=13, eval_splits="()")
    with pytest.raises(TrainingDivergedError, match=r"non-finite loss \(nan\) at step 13.*step 10"):
        train_and_evaluate(config, str(tmp_path))
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [10]
    assert max(losses(tmp_path)) == 12  # nothing logged or saved for the NaN step
    restored = ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / "10" / "state")
    leaves = [np.asarray(x) for x in __import__("jax").tree.leaves(restored["params"])]
    assert leaves and all(np.all(np.isfinite(x)) for x in leaves)
    assert int(restored["step"]) == 10


@pytest.mark.slow
def test_resume_skips_a_torn_save_and_extends_a_finished_run(reference, tmp_path):
    """A crash mid-save leaves `<step>.orbax-checkpoint-tmp-*`; the restart ignores it."""
    src, _, ref_loss = reference
    workdir = tmp_path / "run"
    shutil.copytree(src, workdir)
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


@pytest.mark.slow
def test_sigterm_then_sigkill_then_finish_equals_the_uninterrupted_run(
    reference, cache_env, tmp_path
):
    """SIGTERM saves and exits cleanly; SIGKILL loses only the steps since the last save;
    the restarted run reproduces the uninterrupted run's losses step by step."""
    _, _, ref_loss = reference
    # Eval settings do not touch training; skipping eval keeps the subprocesses quick.
    cmd = train_cmd(tmp_path, "--config.eval_splits=()", "--config.progress_bar=false")

    proc = subprocess.Popen(cmd, env=cache_env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    wait_for_step(tmp_path, proc, 13)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "preempted at step" in out
    stopped = max(losses(tmp_path))
    assert 13 <= stopped < 30
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == stopped  # a checkpoint at the very step it stopped

    proc = subprocess.Popen(cmd, env=cache_env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    # Kill a few steps after a checkpoint (every 10), never right at one.
    target = next(t for t in range(stopped + 3, 40) if t % 10 == 3)
    seen = wait_for_step(tmp_path, proc, target)
    proc.kill()
    proc.communicate(timeout=60)
    assert seen < 40, "the run finished before it could be killed"
    assert max(losses_quiet(tmp_path)) > max(
        int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()
    ), "killed exactly at a checkpoint: nothing to lose"

    subprocess.run(cmd, env=cache_env, cwd=REPO, check=True, capture_output=True, timeout=300)
    compare(losses(tmp_path), ref_loss, range(1, 41), rtol=1e-6)


# -- several devices and processes ------------------------------------------------------

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
    _, _, ref_loss = reference
    env = dict(cache_env, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, SMOKE, str(tmp_path)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    for mesh in ("(2,2,2)", "(8,1,1)"):
        got = {int(k): v for k, v in result[mesh].items()}
        compare(got, ref_loss, range(1, 7), rtol=2e-5)
    # The (2,2,2) run really sharded its parameters (orbax records each array's spec).
    specs = json.loads(
        (tmp_path / "(2,2,2)" / "checkpoints" / "6" / "state" / "_sharding").read_text()
    )
    used = set()
    for spec in specs.values():
        spec = json.loads(spec) if isinstance(spec, str) else spec
        for entry in spec["partition_spec"]:
            used.update([entry] if isinstance(entry, str) else entry or [])
    assert {"fsdp", "tensor"} <= used
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
    saved = sorted(int(p.name) for p in (resumed / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == max(got) >= 15  # one checkpoint, at the step both processes stopped
    assert (resumed / "checkpoints" / str(saved[-1]) / "data" / "process_1-of-2.json").exists()
