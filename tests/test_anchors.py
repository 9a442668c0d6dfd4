"""The report as the anchors report: best of seeds beside the mean, teacher-forced
accuracy beyond the training lengths, exact match by length bucket.

Contracts, each against values worked out by hand: the eval step's per-row
teacher-forced sums add up to its totals and equal a numpy reference of the
logits; `evaluate` counts beyond-training accuracy over exactly the rows
longer than every training target; the anchors' tables show the maximum over
seeds, the mean with its t interval, and per length bucket k/N with its
Wilson interval and the teacher-forced mean over seeds.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.analysis import anchors, grid
from jattn.train import evaluation, steps

# -- the eval step's per-row sums -------------------------------------------------------


class _Logits:
    """A stand-in model whose logits are fixed: `apply` returns them."""

    def __init__(self, logits):
        self.logits = logits

    def apply(self, variables, inputs, targets, **kwargs):
        return self.logits


def test_eval_step_row_sums_match_a_numpy_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 7)).astype(np.float32)  # [B, T, V]
    targets = np.array([[3, 4, 1, 0, 0], [5, 5, 5, 6, 1], [2, 1, 0, 0, 0]], np.int32)
    # Make some tokens right on purpose: row 0 gets its first two right.
    logits[0, 0, 3] = logits[0, 1, 4] = 10.0
    step = steps.make_eval_step(_Logits(jnp.asarray(logits)))
    out = jax.device_get(step(None, {"inputs": targets, "targets": targets}))
    hits = (logits.argmax(-1) == targets) & (targets > 0)  # [B, T]
    np.testing.assert_array_equal(out["row_correct"], hits.sum(-1))
    np.testing.assert_array_equal(out["row_weight"], [3, 5, 2])
    assert float(out["correct"]) == float(np.sum(out["row_correct"]))
    assert float(out["weight_sum"]) == float(np.sum(out["row_weight"]))
    assert out["row_correct"][0] >= 2


# -- evaluate: beyond-training accuracy and each example's teacher-forced counts --------


class _Tok:
    vocab_size = 10

    def decode(self, ids):
        return "".join(str(i) for i in ids)


def _evaluate(targets, row_correct, row_weight, *, train_max_target_tokens=3, decode=False):
    """`evaluation.evaluate` on one batch of `targets` whose eval step returns these
    per-row teacher-forced hits and tokens (their sums as the batch's)."""
    batch = {"inputs": targets, "targets": targets}
    n = len(targets)
    es = evaluation.EvalSet("test_longer", [batch], n, ("exact_match",), train_max_target_tokens)

    def eval_step(params, b):
        return {
            "loss_sum": 1.0,
            "weight_sum": float(sum(row_weight)),
            "correct": float(sum(row_correct)),
            "row_correct": np.array(row_correct, np.float64),
            "row_weight": np.array(row_weight, np.float64),
        }

    return evaluation.evaluate(
        None,
        {"test_longer": es},
        eval_step=eval_step,
        decode=(lambda params, inputs, tape_targets: targets) if decode else None,
        to_global=lambda b: b,
        tokenizer=_Tok(),
        num_decode=n if decode else 0,
    )


def test_beyond_train_accuracy_counts_only_the_longer_rows():
    """Rows with 2, 4 and 5 target tokens; training targets had at most 3. Hits
    2/2, 1/4 and 4/5: beyond training (rows 1 and 2) (1 + 4) / (4 + 5) = 5/9,
    while all rows give 7/11."""
    targets = np.array([[3, 1, 0, 0, 0], [3, 4, 5, 1, 0], [3, 4, 5, 6, 1]], np.int32)
    metrics, decodes = _evaluate(targets, [2, 1, 4], [2, 4, 5], decode=True)
    assert metrics["eval/test_longer/accuracy"] == pytest.approx(7 / 11)
    assert metrics["eval/test_longer/beyond_train/accuracy"] == pytest.approx(5 / 9)
    # Per target length, then the mean over lengths (Ruoss et al.'s score): 1/4 and 4/5.
    assert metrics["eval/test_longer/beyond_train/length_avg_accuracy"] == pytest.approx(
        (1 / 4 + 4 / 5) / 2
    )
    assert [(e["tf_correct"], e["tf_tokens"]) for e in decodes["test_longer"]] == [
        (2, 2),
        (1, 4),
        (4, 5),
    ]
    # Unknown training length (a task built by hand): no beyond-training metric.
    metrics, _ = _evaluate(targets, [2, 1, 4], [2, 4, 5], train_max_target_tokens=None)
    assert "eval/test_longer/accuracy" in metrics
    assert "eval/test_longer/beyond_train/accuracy" not in metrics
    assert "eval/test_longer/beyond_train/length_avg_accuracy" not in metrics


def test_length_avg_accuracy_pools_within_a_length_and_weighs_lengths_equally():
    """Beyond training (3 tokens): two rows of 5 tokens with 1 and 3 hits, one of 6
    with 6. Per length 4/10 and 6/6, averaged 0.7; pooled over tokens 10/16."""
    metrics, _ = _evaluate(np.zeros((3, 6), np.int32), [1, 3, 6], [5, 5, 6])
    assert metrics["eval/test_longer/beyond_train/accuracy"] == pytest.approx(10 / 16)
    assert metrics["eval/test_longer/beyond_train/length_avg_accuracy"] == pytest.approx(0.7)


# -- the anchors' tables ----------------------------------------------------------------


def _rows(tmp_path, finals, decodes, check):
    """Rows as `jattn.analysis.runs.collect` returns them, from hand-written workdirs."""
    rows = []
    for name, final in finals.items():
        axes = dict(kv.split("=") for kv in name.split(","))
        workdir = os.path.join(tmp_path, name)
        os.makedirs(os.path.join(workdir, "decodes"))
        with open(os.path.join(workdir, "decodes", "test_longer.jsonl"), "w") as f:
            for e in decodes.get(name, []):
                f.write(json.dumps({"step": 100, **e}) + "\n")
        run = grid.Run(name, axes, (), workdir)
        rows.append({"run": run, "final": {"step": 100, **final}, "check": check})
    return rows


CHECK = {
    "train": {"max_target_tokens": 27, "max_input_tokens": 10},  # 26 tokens + EOS
    "test_longer": {"examples": 9, "producible": 1.0, "longer_than_train": 1.0},
}
EM = "eval/test_longer/exact_match"
TF = "eval/test_longer/beyond_train/accuracy"
TF_BY_LENGTH = "eval/test_longer/beyond_train/length_avg_accuracy"


def test_best_of_seeds_beside_mean_and_interval(tmp_path):
    finals = {
        f"position=t5,seed={s}": {EM: em, TF: tf}
        for s, (em, tf) in enumerate([(0.2, 0.9), (0.4, 0.8), (0.6, 0.7)])
    }
    finals["position=learned,seed=0"] = {EM: 0.0}
    rows = _rows(tmp_path, finals, {}, CHECK)
    assert anchors.anchor_metrics(rows) == [EM, TF]
    lines = anchors.seeds_table(rows)
    # mean 0.4, s = 0.2, t_{0.975, 2} = 4.3027: 0.4 ± 0.4968 -> [0, 0.897] clipped.
    # tf: mean 0.8, s = 0.1: 0.8 ± 0.2484 -> [0.552, 1.0] clipped.
    assert "| position=t5 | 3 | 0.600 | 0.400 [0.000, 0.897] | 0.900 | 0.800 [0.552, 1.000] |" in (
        lines
    )
    assert "| position=learned | 1 | 0.000 | 0.000 (1 seed) | - | - |" in lines
    # The by-length score, found in any order among a run's metrics, comes last.
    finals["position=learned,seed=0"] = {TF_BY_LENGTH: 0.5, EM: 0.0}
    rows = _rows(tmp_path / "by_length", finals, {}, CHECK)
    assert anchors.anchor_metrics(rows) == [EM, TF, TF_BY_LENGTH]


def test_unproducible_split_shows_no_best_seed(tmp_path):
    check = dict(CHECK, test_longer={"examples": 9, "producible": 0.5, "longer_than_train": 1})
    rows = _rows(tmp_path, {"position=t5,seed=0": {EM: 0.0}}, {}, check)
    assert "| position=t5 | 1 | unproducible (50.0% of targets) | - |" in anchors.seeds_table(rows)


def test_buckets_align_on_the_training_length():
    # Training targets up to 26 tokens, buckets of 5: 22-26 holds only seen lengths.
    assert anchors.bucket_of(26, 5, 26) == (22, 26)
    assert anchors.bucket_of(27, 5, 26) == (27, 31)
    assert anchors.bucket_of(31, 5, 26) == (27, 31)
    assert anchors.bucket_of(32, 5, 26) == (32, 36)
    assert anchors.bucket_of(2, 5, 26) == (2, 6)
    assert anchors.bucket_of(1, 5, 26) == (1, 1)  # what is left below
    assert anchors.bucket_of(7, 5, None) == (6, 10)
    with pytest.raises(ValueError, match="width"):
        anchors.bucket_of(3, 0, None)


def test_exact_match_and_teacher_forced_accuracy_by_bucket(tmp_path):
    """Bucket 27-31: seed 0 has 3 examples (2 right), seed 1 one (right): 3/4,
    Wilson [30.1%, 95.4%]; teacher-forced seed 0 (14 + 15 + 0) / (28 + 31 + 29)
    = 29/88, seed 1 32/32. Bucket 22-26: one example of seed 0, wrong: 0/1,
    Wilson upper end z²/(1 + z²) = 79.3%, teacher-forced 20/26 = 0.769."""

    def ex(length, correct, hits, tokens):
        return {"target_tokens": length, "correct": correct, "tf_correct": hits,
                "tf_tokens": tokens, "input_tokens": 9}  # fmt: skip

    decodes = {
        "position=t5,seed=0": [
            ex(27, True, 14, 28),
            ex(30, True, 15, 31),
            ex(28, False, 0, 29),
            ex(25, False, 20, 26),
        ],  # fmt: skip
        "position=t5,seed=1": [ex(31, True, 32, 32)],
    }
    finals = {name: {EM: 0.5} for name in decodes}
    rows = _rows(tmp_path, finals, decodes, CHECK)
    table, edge = anchors.length_buckets(rows, 5)
    assert edge == 26
    cells = table["position=t5"]
    assert (cells[(27, 31)]["k"], cells[(27, 31)]["n"]) == (3, 4)
    assert cells[(27, 31)]["tf"] == {"position=t5,seed=0": [29, 88], "position=t5,seed=1": [32, 32]}
    assert (cells[(22, 26)]["k"], cells[(22, 26)]["n"]) == (0, 1)
    lines = anchors.bucket_tables(rows, 5)
    assert "| group | 22-26 | 27-31 † |" in lines
    assert "| position=t5 | 0.0% [0.0, 79.3] of 1 | 75.0% [30.1, 95.4] of 4 |" in lines
    # Teacher-forced: seed 0 29/88 = 0.3295, seed 1 32/32 = 1.0: mean 0.6648,
    # s = 0.4743, t_{0.975, 1} = 12.706: interval clipped to [0, 1].
    assert "| position=t5 | 0.769 (1 seed) | 0.665 [0.000, 1.000] |" in lines
    section = anchors.section(rows, 5)
    assert section[0] == "## As the anchors report"
    # The anchors' seed counts were not read: the header says so, and claims none.
    assert any("of up to 2; how many seeds the anchors ran" in line for line in section)
    assert not any("best of 10" in line for line in section)


def test_where_outputs_stop_per_run(tmp_path):
    """Seed 0: outputs of 16, 16, 16, 20 tokens: 16 is the most common (3/4), none at
    the limit of 32; seed 1: 32, 32, 17 (no end token in two): 32 is the most common
    and 2/3 reach the limit. A tie (seed 2: 17 and 18 once each) names the shorter."""
    decodes = {
        "position=shaw,seed=0": [{"output_tokens": n} for n in (16, 16, 20, 16)],
        "position=shaw,seed=1": [{"output_tokens": n} for n in (32, 17, 32)],
        "position=shaw,seed=2": [{"output_tokens": n} for n in (18, 17)],
    }
    rows = _rows(tmp_path, {name: {EM: 0.0} for name in decodes}, decodes, CHECK)
    for r in rows:
        with open(os.path.join(r["run"].workdir, "config.json"), "w") as f:
            json.dump({"eval_max_len": 32, "decode_max_len": 0}, f)
    lines = anchors.stop_table(rows)
    assert "| position=shaw,seed=0 | 4 | 16 | 3/4 (75.0%) | 32 | 0/4 |" in lines
    assert "| position=shaw,seed=1 | 3 | 32 | 2/3 (66.7%) | 32 | 2/3 |" in lines
    assert "| position=shaw,seed=2 | 2 | 17 | 1/2 (50.0%) | 32 | 0/2 |" in lines
    assert lines[-3:] == anchors.section(rows)[-4:-1]  # the report's section carries it
