"""Each task declares its decoded metrics and evaluation computes only those:
character-level tasks (numbers, copy, reverse) report exact match and chrF, no
BLEU; word-level translation (here the local stand-in for wmt14 from
test_data) reports BLEU too. The metric names stay ``eval/<split>/<metric>``."""

from __future__ import annotations

import numpy as np
import pytest
from test_data import JattnTestTranslate  # noqa: F401 -- registers the wmt stand-in

from jattn import data
from jattn.data import tasks
from jattn.train import evaluation


def test_declarations():
    for name in ("numbers", "numbers/en", "numbers/de_tiny", "copy", "reverse/tiny"):
        assert tasks.task_metrics(name) == ("exact_match", "chrf"), name
    for name in ("wmt14_translate/de-en", "jattn_test_translate"):
        assert tasks.task_metrics(name) == ("exact_match", "bleu", "chrf"), name


def _eval_set(task, split: str, rows: int = 4) -> evaluation.EvalSet:
    """The first `rows` examples of `split`, padded to a common width."""
    src = task.source(split)
    exs = [src[i] for i in range(rows)]
    enc = [(task.tokenizer.encode(e["inputs"]), task.tokenizer.encode(e["targets"])) for e in exs]

    def pad(seqs):
        width = max(len(s) for s in seqs)
        return np.array([s + [0] * (width - len(s)) for s in seqs], np.int32)

    batch = {"inputs": pad([i for i, _ in enc]), "targets": pad([t for _, t in enc])}
    return evaluation.EvalSet(split, [batch], rows, tuple(task.metrics))


def _evaluate(task, es, outputs=None):
    """`evaluate` with a stub step and a decoder that returns `outputs` (default:
    the targets, a perfect decoder)."""
    targets = es.batches[0]["targets"] if outputs is None else outputs

    def eval_step(params, batch):
        return {"loss_sum": 1.0, "weight_sum": 2.0, "correct": 2.0}

    def decode(params, inputs, targets_):
        return targets

    return evaluation.evaluate(
        None,
        {es.split: es},
        eval_step=eval_step,
        decode=decode,
        to_global=lambda b: b,
        tokenizer=task.tokenizer,
        num_decode=4,
    )[0]


def test_char_task_has_no_bleu(data_dir):
    task = data.load("copy/tiny", data_dir=data_dir)
    assert task.metrics == ("exact_match", "chrf")
    metrics = _evaluate(task, _eval_set(task, "validation"))
    assert set(metrics) == {
        f"eval/validation/{m}"
        for m in ("loss", "accuracy", "exact_match", "num_decoded", "length_match", "chrf")
    }
    assert metrics["eval/validation/exact_match"] == 1.0
    assert metrics["eval/validation/chrf"] == pytest.approx(100.0)


def test_length_match_counts_where_outputs_stop(data_dir):
    """Four outputs by hand: right; one token changed (right length); stopped one
    token early; one token too long. Exact match 1/4, length match 2/4."""
    task = data.load("copy/tiny", data_dir=data_dir)
    es = _eval_set(task, "validation")
    targets = es.batches[0]["targets"]
    out = np.zeros((4, targets.shape[1] + 1), np.int32)
    for row in range(4):
        ids = [int(i) for i in targets[row] if i > 1]  # the reference's tokens, no EOS
        if row == 1:
            ids[0] = ids[1] if ids[1] != ids[0] else 3 + (ids[0] - 2) % 5
        elif row == 2:
            ids = ids[:-1]
        elif row == 3:
            ids = ids + [ids[-1]]
        out[row, : len(ids) + 1] = ids + [1]  # EOS
    metrics = _evaluate(task, es, outputs=out)
    assert metrics["eval/validation/exact_match"] == 0.25
    assert metrics["eval/validation/length_match"] == 0.5


def test_word_level_translation_has_bleu(data_dir):
    task = data.load("jattn_test_translate", data_dir=data_dir, tokenizer="spm", vocab_size=64)
    assert task.metrics == ("exact_match", "bleu", "chrf")
    metrics = _evaluate(task, _eval_set(task, "validation"))
    assert {"eval/validation/bleu", "eval/validation/chrf", "eval/validation/exact_match"} <= set(
        metrics
    )
    assert metrics["eval/validation/exact_match"] == 1.0


def test_load_eval_sets_carries_the_task_metrics():
    """`load_eval_sets` takes the task's declaration (and refuses an unknown one)."""

    from jattn.train import config as config_lib

    class Task:
        metrics = ("exact_match", "chrf")

    def make_loader(task, split, **kwargs):
        return [{"inputs": np.ones((2, 8), np.int32), "targets": np.ones((2, 8), np.int32)}]

    cfg = config_lib.default_config()
    cfg.eval_batch_size, cfg.eval_max_len, cfg.eval_max_batches = 2, 8, 1
    part = config_lib.read_parts(cfg).evaluation
    sets = evaluation.load_eval_sets(Task(), make_loader, part, ["validation"])
    assert sets["validation"].metrics == ("exact_match", "chrf")
    Task.metrics = ("exact_match", "rouge")
    with pytest.raises(config_lib.ConfigError, match="rouge"):
        evaluation.load_eval_sets(Task(), make_loader, part, ["validation"])
