"""Training programs of N >= 1 members: learning, outputs, exact resumption, faults, meshes,
several processes.

`train_and_evaluate` runs one program of N members (`jattn.train.run`). The
suite parametrises every contract that holds for any N over N in {1, 3}:

- N = 1: the plain run of `configs/smoke.py` (copy/tiny, a 1+1-layer jattn
  Transformer, 40 steps) in its workdir, the single run's unmapped step;
- N = 3: `config.seeds=0,1,2`, each member in ``WORKDIR/seed-<s>`` laid out as
  that seed's single run, the single run's step under `lax.map`.

Two module fixtures train them once (`reference`, `group`); `singles` adds
the plain runs of seeds 1 and 2, so each member of the group has its single
run to be compared with (seed 0's is `reference`). Tests of a contract that
exists for one N only (input lengths, meshes and processes of a plain run;
the seed keys, a diverged member among live ones, seed axes over a mesh, a
member already finished) say so in their names. Everything runs the real
pieces: real tfds data, real orbax checkpoints, real subprocesses and
signals. Subprocesses run with the suite's XLA flags and NaN checks
(conftest.py) and share a persistent compilation cache, so a restart does not
compile again and its numbers are the in-process fixtures' bit for bit.
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
from run_helpers import REPO, SMOKE, decodes, losses, sharded_mesh_axes, smoke_config

from jattn.train import (
    ConfigError,
    TrainingDivergedError,
    check_config,
    config_to_dict,
    load_run,
    read_metrics,
    train_and_evaluate,
)

SEEDS = "0,1,2"  # the N = 3 program


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


def layout(workdir) -> set[str]:
    """The top-level names of a run's workdir (checkpoint steps and event files aside)."""
    return {p.name for p in Path(workdir).iterdir()} | {
        f"decodes/{p.name}" for p in (Path(workdir) / "decodes").iterdir()
    }


@dataclasses.dataclass(frozen=True)
class Program:
    """A finished program of `n` members (seeds 0..n-1) and what it printed."""

    n: int
    workdir: Path
    result: dict[str, Any]
    stderr: str

    @property
    def overrides(self) -> dict[str, str]:
        """Config overrides that make the smoke config this program."""
        return {} if self.n == 1 else {"seeds": SEEDS}

    @property
    def flags(self) -> list[str]:
        return [f"--config.{k}={v}" for k, v in self.overrides.items()]

    def dirs(self, workdir=None) -> list[Path]:
        """Every member's run directory under `workdir` (default: this program's)."""
        workdir = Path(workdir or self.workdir)
        return [workdir] if self.n == 1 else [workdir / f"seed-{s}" for s in range(self.n)]

    @property
    def finals(self) -> dict[int, dict[str, Any]]:
        """seed -> that member's final metrics."""
        return {0: self.result} if self.n == 1 else self.result["members"]


def train_quietly(workdir, **overrides) -> Program:
    """Trains the smoke config with `overrides`, keeping what it printed."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = train_and_evaluate(smoke_config(**overrides), str(workdir))
    n = len(overrides.get("seeds", "0").split(","))
    return Program(n, Path(workdir), result, err.getvalue())


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    """Environment for subprocesses: CPU, the suite's XLA flags and NaN/Inf checks (so
    their numbers are the in-process runs': `jax_debug_nans` changes the last bits of a
    jitted step), a shared compilation cache, the repo on the path."""
    import jax

    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_DEBUG_NANS=str(jax.config.jax_debug_nans),
        JAX_DEBUG_INFS=str(jax.config.jax_debug_infs),
        JATTN_COMPILATION_CACHE=str(tmp_path_factory.mktemp("xla_cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def with_devices(env: dict[str, str], count: int) -> dict[str, str]:
    """`env` with `count` simulated CPU devices (the suite's other XLA flags kept)."""
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    return dict(env, XLA_FLAGS=flags.strip())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Program:
    """N = 1: the uninterrupted smoke run on one device."""
    return train_quietly(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> Program:
    """N = 3: seeds 0, 1, 2 of the smoke config in one program."""
    return train_quietly(tmp_path_factory.mktemp("group"), seeds=SEEDS)


@pytest.fixture(params=[1, 3], ids=["N=1", "N=3"])
def program(request) -> Program:
    """The finished program of N members (the module's `reference` or `group`)."""
    return request.getfixturevalue("reference" if request.param == 1 else "group")


@pytest.fixture(scope="module")
def singles(reference, tmp_path_factory) -> dict[int, Path]:
    """seed -> the workdir of that seed's plain run (seed 0: the reference's)."""
    out = {0: reference.workdir}
    for seed in (1, 2):
        out[seed] = train_quietly(tmp_path_factory.mktemp(f"single{seed}"), seed=seed).workdir
    return out


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


# -- every N: a finished program ---------------------------------------------------------


def test_a_program_learns_and_writes_each_members_outputs(program):
    """Each member: 40 finite losses that fall, metrics.jsonl with eval at 20 and 40,
    final metrics (strict JSON, the last eval's numbers, the last logged loss),
    TensorBoard with the hparams, the single run's config.json, decodes, and its
    own checkpoints: the last two plus the best by `best_metric`."""
    assert sorted(program.finals) == list(range(program.n))
    if program.n > 1:
        assert not program.result["diverged"] and program.result["step"] == 40
        # No stacked state: the program workdir holds the members' workdirs only.
        assert sorted(p.name for p in program.workdir.iterdir()) == ["seed-0", "seed-1", "seed-2"]
    for seed, workdir in enumerate(program.dirs()):
        final = program.finals[seed]
        loss = losses(workdir)
        steps = sorted(loss)
        assert steps == list(range(1, 41))
        first, last = np.mean([loss[s] for s in steps[:5]]), np.mean([loss[s] for s in steps[-5:]])
        assert last < first - 0.5, (seed, first, last)
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

        # TensorBoard (with the run's hparams), the resolved config (the single run's),
        # the model config, decodes, final metrics.
        events = list((workdir / "tb").glob("events.out.tfevents.*"))
        assert events and events[0].stat().st_size > 0
        blob = b"".join(p.read_bytes() for p in events)
        assert b"hparams" in blob and b"model.d_model" in blob and b"train/loss" in blob
        saved = json.loads((workdir / "config.json").read_text())
        assert saved == config_to_dict(smoke_config(seed=seed))
        model_config = json.loads((workdir / "model_config.json").read_text())
        assert model_config["vocab_size"] % 8 == 0 and model_config["d_model"] == 32
        decoded = [json.loads(x) for x in (workdir / "decodes" / "validation.jsonl").open()]
        assert len(decoded) == 8 and {"input", "target", "prediction", "correct"} <= set(decoded[0])
        written = strict_json(workdir / "final_metrics.json")
        assert written["step"] == 40 and written == json.loads(json.dumps(final))
        train_rows = [r for r in rows if "train/loss" in r]
        assert written["train/loss"] == train_rows[-1]["train/loss"]  # the last window's mean
        assert ("train/seeds_in_program" in written) == (program.n > 1)

        # Checkpoints: the last two (30, 40) plus the best by exact match (20 or 40).
        kept = saved_steps(workdir)
        assert kept[-2:] == [30, 40] and set(kept) <= {20, 30, 40}
        best = {s: eval_rows[s]["eval/validation/exact_match"] for s in (20, 40)}
        if best[20] != best[40]:
            assert (20 in kept) == (best[20] > best[40]), (kept, best)
        assert (workdir / "checkpoints" / "40" / "data" / "process_0-of-1.json").exists()


def test_the_startup_summary_comes_before_the_first_step(program):
    """Before the first step: workdir, parameters, devices and mesh, data sizes, the
    tensorboard command; a program of several members names them and its memory."""
    import jax

    from jattn import data

    summary, _, rest = program.stderr.partition(f"tensorboard --logdir {program.workdir}\n")
    if program.n == 1:
        assert rest.startswith("step 20:")  # printed before the loop's first output
    else:
        line, memory, rest = rest.split("\n", 2)
        assert line == "seeds [0, 1, 2] in one program (map) -> seed-0, seed-1, seed-2"
        assert memory.startswith("memory: 3 seed(s) in one program (map)")
        assert "seeds fit 90% of the" in memory
        assert rest.startswith("seed 0: step 20:")
    task = data.load("copy/tiny")
    final = program.finals[0]
    assert f"workdir: {program.workdir}\n" in summary
    # One count a member, beside the other architectures' at the same width.
    said = f"parameters: {final['num_params']:,} (encoder_decoder, 1+1 layers; at the same width: "
    assert summary.count("parameters: ") == 1 and said in summary
    assert f"devices: {jax.device_count()} x cpu" in summary
    assert "mesh {'data': 1, 'fsdp': 1, 'tensor': 1}" in summary
    assert f"train {len(task.source('train')):,} examples" in summary
    assert f"validation {len(task.source('validation')):,} examples" in summary
    assert "training rows: 8 a step (16 input + 16 target tokens), 40 steps" in summary


def test_a_finished_program_returns_its_results_without_training(program):
    before = {d: (d / "metrics.jsonl").read_text() for d in program.dirs()}
    t0 = time.perf_counter()
    again = train_and_evaluate(smoke_config(**program.overrides), str(program.workdir))
    assert time.perf_counter() - t0 < 30
    if program.n == 1:
        assert again == json.loads(json.dumps(program.result))
    else:
        assert again["step"] == 40 and not again["diverged"]
        assert again["members"] == {
            s: json.loads(json.dumps(f)) for s, f in program.result["members"].items()
        }
    assert {d: (d / "metrics.jsonl").read_text() for d in program.dirs()} == before


def test_an_incompatible_workdir_is_refused_and_left_untouched(program, tmp_path, capsys):
    """A changed model or input length is refused in one line naming the first member's
    workdir and every difference; nothing in the workdir changes. (A plain run's seed
    is part of its config; a program's members' seeds are their own.)"""
    from jattn import cli

    workdir = tmp_path / "run"
    shutil.copytree(program.workdir, workdir)
    before = files_of(workdir)
    seed = ["--config.seed=3"] if program.n == 1 else []
    status = cli.main(
        ["train", "--config", SMOKE, "--workdir", str(workdir), "--compilation_cache_dir=",
         "--config.model.d_model=64", "--config.max_input_len=8", *seed, *program.flags]
    )  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err
    member = program.dirs(workdir)[0]
    assert f"workdir '{member}' holds a checkpoint (step 40) of an incompatible config" in err
    max_len = smoke_config().max_len
    assert "model.d_model: checkpoint 32 != config 64" in err
    assert f"input_len: checkpoint {max_len} != config 8" in err
    assert ("seed: checkpoint 0 != config 3" in err) == (program.n == 1)
    assert files_of(workdir) == before


def test_a_changed_schedule_is_refused_unless_allowed(program, tmp_path, capsys):
    """num_train_steps, schedule, warmup_steps, learning_rate of a finished (or
    interrupted) program: changing them is refused in one line, the workdir untouched."""
    from jattn import cli

    workdir = tmp_path / "run"
    shutil.copytree(program.workdir, workdir)
    before = files_of(workdir)
    status = cli.main(
        ["train", "--config", SMOKE, "--workdir", str(workdir), "--compilation_cache_dir=",
         "--config.num_train_steps=50", "--config.warmup_steps=7",
         "--config.learning_rate=0.01", "--config.schedule=cosine", *program.flags]
    )  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err
    member = program.dirs(workdir)[0]
    assert f"workdir '{member}' holds a checkpoint (step 40) trained under another schedule" in err
    for change in ("num_train_steps: checkpoint 40 != config 50", "warmup_steps: checkpoint 5 != "
                   "config 7", "learning_rate: checkpoint 0.003 != config 0.01",
                   "schedule: checkpoint 'constant' != config 'cosine'"):  # fmt: skip
        assert change in err
    assert "--config.allow_schedule_change=True" in err
    assert files_of(workdir) == before


def test_load_run_reproduces_the_decodes_written_by_each_member(program):
    """Every member's workdir reads back as a single run: its restored parameters decode
    the validation inputs exactly as the program did."""
    from jattn import data
    from jattn.models import decoding
    from jattn.train.evaluation import ids_to_text

    tokenizer = data.load("copy/tiny").tokenizer
    for seed, workdir in enumerate(program.dirs()):
        run = load_run(str(workdir))
        assert run.step == 40 and run.config.dataset == "copy/tiny" and run.config.seed == seed
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


@pytest.mark.parametrize("n", [1, 3], ids=["N=1", "N=3"])
def test_a_workdir_of_the_old_stacked_layout_is_refused_in_one_line(n, tmp_path):
    """A seed program of an earlier jattn kept one stacked checkpoint of every member in
    WORKDIR/checkpoints: a program of seeds (N = 1: `seeds=0`) is refused before
    anything is written, saying how to finish it. (A plain run's WORKDIR/checkpoints
    are its own: it resumes them.)"""
    (tmp_path / "checkpoints" / "20").mkdir(parents=True)
    seeds = ",".join(str(s) for s in range(n))
    with pytest.raises(ConfigError) as e:
        train_and_evaluate(smoke_config(seeds=seeds), str(tmp_path))
    message = str(e.value)
    assert "\n" not in message
    assert f"{tmp_path / 'checkpoints'} holds the stacked checkpoints" in message
    assert "git checkout" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # nothing written


# -- every N: divergence and interruption ------------------------------------------------


@pytest.mark.parametrize("n", [1, 3], ids=["N=1", "N=3"])
def test_a_nan_loss_stops_its_member_and_keeps_its_last_good_checkpoint(n, group, tmp_path):
    """The member whose loss turns NaN at step 13 (N = 3: seed 1 only) logs and saves
    nothing of that step or later, keeps its step-10 checkpoint (finite), and is named
    in the error; with N = 3 the others finish as if nothing happened (evaluation does
    not touch training) and their checkpoints name it, so a resume leaves it out."""
    import jax
    import orbax.checkpoint as ocp

    if n == 1:
        config = smoke_config(debug_nan_at_step=13, eval_splits="()")
        bad, message = tmp_path, r"non-finite loss \(nan\) at step 13.*step 10"
    else:
        config = smoke_config(
            seeds=SEEDS, debug_nan_at_step=13, debug_nan_seed=1, eval_splits="()",
            num_train_steps=20,
        )  # fmt: skip
        bad, message = tmp_path / "seed-1", r"seed 1: non-finite loss \(nan\) at step 13"
    with pytest.raises(TrainingDivergedError, match=message):
        train_and_evaluate(config, str(tmp_path))
    assert saved_steps(bad) == [10]
    assert max(losses(bad)) == 12  # nothing logged or saved for the NaN step
    assert not (bad / "final_metrics.json").exists()
    restored = ocp.StandardCheckpointer().restore(bad / "checkpoints" / "10" / "state")
    leaves = [np.asarray(x) for x in jax.tree.leaves(restored["params"])]
    assert leaves and all(np.all(np.isfinite(x)) for x in leaves)
    assert int(restored["step"]) == 10
    if n == 1:
        return
    for seed in (0, 2):
        live = tmp_path / f"seed-{seed}"
        got, want = losses(live), losses(group.dirs()[seed])
        assert sorted(got) == list(range(1, 21))
        # The constant schedule: a 20-step run's losses are a 40-step run's first 20.
        # (The poisoned step is another program: rounding may differ in the last bit.)
        compare(got, want, range(1, 21), rtol=1e-5)
        assert json.loads((live / "final_metrics.json").read_text())["step"] == 20
        meta = json.loads((live / "checkpoints" / "20" / "meta" / "metadata").read_text())
        assert set(meta["diverged"]) == {"1"}
        assert "seed 1: non-finite loss" in meta["diverged"]["1"]
    assert not (tmp_path / "checkpoints").exists()  # no stacked checkpoint


@pytest.mark.slow
def test_sigterm_then_sigkill_then_finish_equals_the_uninterrupted_program(
    program, cache_env, tmp_path
):
    """SIGTERM saves every member at the step it stopped and exits cleanly; SIGKILL
    loses only the steps since the last save; the restarted program trains those
    steps again exactly as the killed process did and ends with the uninterrupted
    program's losses, bit for bit."""
    dirs = program.dirs(tmp_path)
    # Eval settings do not touch training; skipping eval keeps the subprocesses quick.
    cmd = train_cmd(tmp_path, "--config.eval_splits=()", "--config.progress_bar=false",
                    *program.flags)  # fmt: skip

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
        compare(got, losses(program.dirs()[seed]), range(1, 41), rtol=0)


# -- N = 3 against its single runs; N = 1 programs ---------------------------------------


def test_each_member_of_a_3_member_program_equals_its_single_run(group, singles):
    """Each seed's member is its plain run up to last-bit rounding (`lax.map` against
    the unmapped step; the code claims 3e-7 relative on the smoke config): losses,
    final loss, exactly its decodes, its workdir layout, config.json and vocabulary,
    so it resumes as a single run. The seeds really differ."""
    finals = {}
    for seed, member in enumerate(group.dirs()):
        single = singles[seed]
        got, want = losses(member), losses(single)
        assert sorted(got) == sorted(want) == list(range(1, 41))
        compare(got, want, range(1, 41), rtol=1e-6)
        mine = json.loads((member / "final_metrics.json").read_text())
        theirs = json.loads((single / "final_metrics.json").read_text())
        np.testing.assert_allclose(mine["train/loss"], theirs["train/loss"], rtol=1e-6)
        assert mine["step"] == 40 and mine["train/seeds_in_program"] == 3
        assert decodes(member) == decodes(single) and decodes(single)
        assert layout(member) == layout(single)
        assert (member / "config.json").read_text() == (single / "config.json").read_text()
        assert list((member / "tb").iterdir()), "no TensorBoard events"
        metas = [
            json.loads((d / "checkpoints" / "40" / "meta" / "metadata").read_text())
            for d in (member, single)
        ]
        assert metas[0]["vocab_sha256"] == metas[1]["vocab_sha256"]  # resumable as a single run
        finals[seed] = theirs["train/loss"]
    # The seeds really differ (a program that trained seed 0 thrice would fail above,
    # but say it plainly).
    assert len({round(v, 6) for v in finals.values()}) == 3


def test_a_member_finished_as_a_single_run_is_left_out_and_the_rest_runs_unmapped(
    reference, singles, tmp_path
):
    """Seed 0 already trained as a plain run in its member workdir: the program of
    seeds 0, 1 trains seed 1 alone and returns both seeds' final metrics under their
    own seeds. A program of one member runs the single run's unmapped step, so seed 1
    is its plain run bit for bit: losses, evaluation, decodes."""
    shutil.copytree(reference.workdir, tmp_path / "seed-0")
    result = train_and_evaluate(smoke_config(seeds="0,1"), str(tmp_path))
    assert sorted(result["members"]) == [0, 1] and not result["diverged"]
    assert result["members"][0]["train/loss"] == reference.result["train/loss"]
    assert "train/seeds_in_program" not in result["members"][0]  # not retrained
    assert losses(tmp_path / "seed-0") == losses(reference.workdir)
    mine = result["members"][1]
    assert mine["train/seeds_in_program"] == 1
    single = json.loads((singles[1] / "final_metrics.json").read_text())
    measured = {"train/steps_per_sec", "train/seeds_in_program"}
    assert {k: v for k, v in mine.items() if k not in measured} == {
        k: v for k, v in single.items() if k not in measured
    }
    assert losses(tmp_path / "seed-1") == losses(singles[1])
    assert decodes(tmp_path / "seed-1") == decodes(singles[1])


def test_vmap_program_equals_separate_runs_within_rounding(group, tmp_path, capsys):
    """The batched form: the same per-seed losses up to rounding, the same decodes, and
    a memory line in the run log."""
    config = smoke_config(seeds="0,1", seed_program="vmap", checkpoint_every_steps=40,
                          eval_every_steps=40)  # fmt: skip
    train_and_evaluate(config, str(tmp_path))
    err = capsys.readouterr().err
    assert "in one program (vmap)" in err and "seeds fit 90% of the" in err
    for seed in (0, 1):
        got, want = losses(tmp_path / f"seed-{seed}"), losses(group.dirs()[seed])
        compare(got, want, range(1, 41), rtol=1e-5)
        assert decodes(tmp_path / f"seed-{seed}") == decodes(group.dirs()[seed])


def test_seed_keys_are_checked():
    with pytest.raises(ConfigError, match="repeats a seed"):
        check_config(smoke_config(seeds="0,1,1"))
    with pytest.raises(ConfigError, match="seed_mesh_axis"):
        check_config(smoke_config(seed_mesh_axis="seeds"))
    with pytest.raises(ConfigError, match="custom kernel"):
        train_and_evaluate(smoke_config(seeds="0,1", **{"model.attention_impl": "pallas"}), "/x")


SHARDED_SCRIPT = """
import json, sys
import jax
from jattn.train import load_config, apply_overrides, train_and_evaluate, read_metrics, ConfigError
assert jax.device_count() == 2, jax.devices()
out = {}
common = [("num_train_steps", "6"), ("eval_splits", "()"), ("mesh_shape", "(2,1,1)")]
for axis in ("", "data"):
    c = apply_overrides(load_config(sys.argv[1]), common + [("seeds", "0,1"),
                        ("seed_mesh_axis", axis)])
    train_and_evaluate(c, f"{sys.argv[2]}/{axis or 'replicated'}")
    out[axis or "replicated"] = {
        s: [r["train/loss"] for r in read_metrics(f"{sys.argv[2]}/{axis or 'replicated'}/seed-{s}")
            if "train/loss" in r] for s in (0, 1)}
try:
    c = apply_overrides(load_config(sys.argv[1]), common + [("seeds", "0,1,2"),
                        ("seed_mesh_axis", "data")])
    train_and_evaluate(c, sys.argv[2] + "/bad")
except ConfigError as e:
    out["error"] = str(e)
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_seed_axis_replicated_or_sharded_over_a_mesh_axis(group, cache_env, tmp_path):
    """Two CPU devices: the seed axis replicated over data parallelism, or sharded over
    the data axis (one seed a device), gives each seed its losses."""
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT, SMOKE, str(tmp_path)],
        env=with_devices(cache_env, 2), cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    for mode in ("replicated", "data"):
        for seed in (0, 1):
            want = losses(group.dirs()[seed])
            np.testing.assert_allclose(
                out[mode][str(seed)], [want[s] for s in range(1, 7)], rtol=2e-5, err_msg=mode
            )
    assert "do not divide 3 seeds" in out["error"]


# -- N = 1: final metrics, wandb, checkpoint signatures ----------------------------------


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


# -- N = 1: separate row lengths for inputs and targets ----------------------------------


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


# -- N = 1: a torn save, meshes, several processes ---------------------------------------


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
