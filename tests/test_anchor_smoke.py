"""`jattn train` end to end on the anchors of issue 35, run as a user runs them.

Each run is the real command in a subprocess (`python -m jattn.cli train`),
a tiny model for a few steps, evaluated at its last step:

- the encoder-only model with its output tape (Delétang et al. 2023) on three
  of their tasks, one a level: ``parity_check`` (regular, one output token),
  ``reverse_string`` (context-free, a tape as long as the input) and
  ``binary_addition`` (context-sensitive, a terminated and padded answer);
  `jattn decode` then prints each run's tape, and it is the tape the
  evaluation decoded for the same input (two paths: evaluation's batches
  with each row's own tape length, the command's padded batch);
- the main job's task config (configs/reverse_digits.py) with
  ``transformer_xl`` positions and ``model.shared_layers=True``, and with
  ``sandwich`` positions;
- an unknown task name, in the config's ``:arg`` or in ``--config.dataset``:
  exit status 2 and one line naming the registered tasks.

A run is checked on what it leaves: exit status 0, a finite training loss
at every step in metrics.jsonl, finite metrics for both evaluation splits,
the start-up line naming the architecture (and "shared" layers) with the
parameter count of the checkpoint it saved at the last step.

Runs of a fixture are started together (the processes spend much of their
time in single-threaded Python and compilation) on one data directory
prepared beforehand.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jattn import cli
from jattn.data import chomsky, registry
from jattn.data.chomsky_tasks import target_tokens
from jattn.train import load_run, read_metrics

REPO = Path(__file__).resolve().parents[1]
CHOMSKY = str(REPO / "configs" / "chomsky.py")
REVERSE = str(REPO / "configs" / "reverse_digits.py")
STEPS = 5
SPLITS = ("validation", "test_longer")
TINY_MODEL = (
    "--config.model.num_layers=2", "--config.model.d_model=16", "--config.model.num_heads=2",
    "--config.model.d_ff=32", f"--config.num_train_steps={STEPS}", "--config.log_every_steps=1",
    "--config.progress_bar=false", "--compilation-cache-dir=",
)  # fmt: skip
# The tape runs: a rate high enough that five steps leave non-empty tapes to compare.
TAPE = ("--config.model.architecture=encoder_only", "--config.batch_size=8",
        "--config.learning_rate=0.01")  # fmt: skip
TAPE_TASKS = ("parity_check", "reverse_string", "binary_addition")
# reverse_digits/tiny in rows of 32 tokens, 16 examples of each split decoded.
SMALL = ("--config.dataset=reverse_digits/tiny", "--config.batch_size=4", "--config.max_len=32",
         "--config.max_input_len=32", "--config.warmup_steps=1", "--config.eval_batch_size=16",
         "--config.eval_max_batches=1", "--config.eval_decode_examples=16")  # fmt: skip
TIMEOUT = 300


def _env() -> dict[str, str]:
    # XLA_FLAGS (conftest's fast-compiling flags) are inherited from this process.
    return dict(os.environ, JAX_PLATFORMS="cpu")


def _train_cmd(spec: str, workdir, data_dir, *overrides) -> list[str]:
    return [
        sys.executable, "-m", "jattn.cli", "train", "--config", spec, "--workdir", str(workdir),
        f"--config.data_dir={data_dir}", *overrides,
    ]  # fmt: skip


def _run_together(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """Runs the commands at once; name -> finished process (stdout, stderr as text)."""
    procs = {
        name: subprocess.Popen(
            cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, cmd in commands.items()
    }
    done = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def _prepare(data_dir, *names) -> None:
    """Prepares data sets once, before runs that read them start together."""
    from jattn import data  # noqa: PLC0415

    for name in names:
        data.load(name, data_dir=data_dir)


def _check_run(workdir, proc: subprocess.CompletedProcess, *, architecture: str, layers: str,
               decoded: int):  # fmt: skip
    """What every smoke run must leave; returns its `TrainedRun` (the last checkpoint)."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    rows = read_metrics(str(workdir))
    losses = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert all(math.isfinite(v) for v in losses.values()), losses
    (evaluation,) = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert evaluation["step"] == STEPS
    for split in SPLITS:
        for metric in ("loss", "accuracy", "exact_match"):
            value = evaluation[f"eval/{split}/{metric}"]
            assert math.isfinite(value), (split, metric, value)
        assert evaluation[f"eval/{split}/num_decoded"] == decoded
        assert len((Path(workdir) / "decodes" / f"{split}.jsonl").read_text().splitlines()) == (
            decoded
        )
    assert f"done at step {STEPS}: " in proc.stdout

    run = load_run(str(workdir))  # the checkpoint of the last step, on disk
    assert run.step == STEPS and (Path(workdir) / "checkpoints" / str(STEPS)).is_dir()
    assert run.model.config.architecture == architecture
    line = re.search(rf"^parameters: ([\d,]+) \({architecture}, {layers}; at the same width: ",
                     output, re.MULTILINE)  # fmt: skip
    assert line, output[:3000]
    from jattn.models.summary import count_params  # noqa: PLC0415

    assert int(line.group(1).replace(",", "")) == count_params(run.params)
    return run


def _leaf_paths(params) -> list[str]:
    import jax  # noqa: PLC0415

    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]


def _decode(workdir, texts, capsys, *flags) -> list[str]:
    """`jattn decode` (in this process, as tests/test_decode_command.py runs it): its lines."""
    capsys.readouterr()
    assert cli.main(["decode", "--workdir", str(workdir), *flags, *texts]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == len(texts), out
    return out.split("\n")[:-1]


# -- an unknown task: one line ------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, overrides, named",
    [
        (f"{CHOMSKY}:not_a_task,tiny", (), chomsky.TASKS),
        (f"{CHOMSKY}:parity_check,tiny", ("--config.dataset=not_a_dataset/xx",),
         sorted(registry.BUILDERS)),
    ],
    ids=["chomsky_arg", "dataset_override"],
)  # fmt: skip
def test_an_unknown_task_is_one_line_naming_the_registered_ones(spec, overrides, named, tmp_path):
    proc = subprocess.run(
        _train_cmd(spec, tmp_path / "w", tmp_path / "tfds", *overrides, "--compilation-cache-dir="),
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jattn train: error: "), proc.stderr[-3000:]
    wrong = "not_a_task" if "not_a_task" in spec else "not_a_dataset/xx"
    assert repr(wrong) in lines[0]
    missing = [name for name in named if name not in lines[0]]
    assert not missing, (missing, lines[0])
    assert not (tmp_path / "w" / "checkpoints").exists()


# -- the encoder-only tape on three of Delétang et al.'s tasks -----------------------------


@pytest.fixture(scope="module")
def tape_runs(tmp_path_factory, data_dir):
    """task -> (workdir, finished `jattn train`) for the encoder-only runs."""
    root = tmp_path_factory.mktemp("tape")
    _prepare(data_dir, *(f"{task}/tiny" for task in TAPE_TASKS))
    done = _run_together(
        {
            task: _train_cmd(f"{CHOMSKY}:{task},tiny", root / task, data_dir, *TINY_MODEL, *TAPE)
            for task in TAPE_TASKS
        }
    )
    return {task: (root / task, proc) for task, proc in done.items()}


@pytest.mark.slow
@pytest.mark.parametrize("task", TAPE_TASKS)
def test_encoder_only_trains_evaluates_and_decodes_its_tape(task, tape_runs, capsys):
    workdir, proc = tape_runs[task]
    run = _check_run(workdir, proc, architecture="encoder_only", layers="2 layers", decoded=50)
    assert "['encoder']['tape_blank']" in _leaf_paths(run.params)
    assert not [p for p in _leaf_paths(run.params) if "decoder" in p]

    examples = [
        json.loads(line)
        for line in (workdir / "decodes" / "validation.jsonl").read_text().splitlines()
    ]
    assert any(e["prediction"] for e in examples), "every tape empty: the comparison is vacuous"
    # Evaluation reads a tape of each row's target tokens (EOS included);
    # `jattn decode` gives each text the task's target length at its length
    # (`chomsky_tasks.target_tokens`): the same tapes, so the same outputs.
    cells = {e["input"]: len(run.tokenizer.encode(e["target"])) for e in examples}
    assert all(n == target_tokens(task, len(x)) for x, n in cells.items())
    printed = _decode(workdir, [e["input"] for e in examples], capsys)
    assert printed == [e["prediction"] for e in examples]
    # --max-len overrides the rule: every row reads that many cells (one
    # cell: at most one token printed; the rule's count: the rule's output).
    texts = [e["input"] for e in examples[:4]]
    assert all(len(x) <= 1 for x in _decode(workdir, texts, capsys, "--max-len", "1"))
    one = examples[0]
    told = _decode(workdir, [one["input"]], capsys, "--max-len", str(cells[one["input"]]))
    assert told == [one["prediction"]]


# -- the main job's task config: Transformer-XL with shared layers, sandwich ---------------


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory, data_dir):
    """variant -> (workdir, finished `jattn train`) on configs/reverse_digits.py."""
    root = tmp_path_factory.mktemp("small")
    _prepare(data_dir, "reverse_digits/tiny")
    variants = {
        "transformer_xl": ("--config.model.shared_layers=True",),
        "sandwich": (),
    }
    done = _run_together(
        {
            name: _train_cmd(f"{REVERSE}:{name}", root / name, data_dir, *TINY_MODEL, *SMALL, *x)
            for name, x in variants.items()
        }
    )
    return {name: (root / name, proc) for name, proc in done.items()}


@pytest.mark.slow
def test_transformer_xl_with_shared_layers_trains_on_the_main_task(small_runs):
    from jattn.models.summary import architecture_counts  # noqa: PLC0415

    workdir, proc = small_runs["transformer_xl"]
    run = _check_run(
        workdir, proc, architecture="encoder_decoder", layers="2\\+2 shared layers", decoded=16
    )
    config = run.model.config
    assert (config.position, config.shared_layers) == ("transformer_xl", True)
    paths = _leaf_paths(run.params)
    # One block a stack, with Transformer-XL's relative projection and biases u, v.
    for stack in ("encoder", "decoder"):
        assert not [p for p in paths if f"['{stack}']['layer_" in p], paths
        for name in ("xl_r", "xl_u", "xl_v"):
            assert f"['{stack}']['shared_layer']['self_attention']['{name}']" in paths
    unshared = architecture_counts(config.replace(shared_layers=False))["encoder_decoder"]
    assert architecture_counts(config)["encoder_decoder"] < unshared


@pytest.mark.slow
def test_sandwich_trains_on_the_main_task(small_runs):
    workdir, proc = small_runs["sandwich"]
    run = _check_run(
        workdir, proc, architecture="encoder_decoder", layers="2\\+2 layers", decoded=16
    )
    from jattn.models.summary import architecture_counts, count_params  # noqa: PLC0415

    config = run.model.config
    assert (config.position, config.shared_layers) == ("sandwich", False)
    # Sandwich is parameter-free: the model has the sinusoidal one's parameters, no more.
    sinusoidal = architecture_counts(config.replace(position="sinusoidal"))["encoder_decoder"]
    assert count_params(run.params) == sinusoidal
