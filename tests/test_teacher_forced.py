"""Teacher-forced sequence accuracy (Ontañón et al. 2022's score) beside decoded exact match.

Contracts:

- an example counts when every target token (EOS included) is the argmax under
  the gold prefix; padding, inside a row or a whole padding row, is not
  scored; a high token accuracy with one wrong token a row is 0 sequences;
- through a tiny model of every architecture the metric equals a plain-numpy
  recomputation from the model's logits, and for greedy decoding it equals
  exact match example by example (a decoded output is right exactly when
  every step's argmax under the right prefix is right);
- the report puts it beside exact match: a group-table column with its t
  interval, per run k/N with a Wilson interval, a results.csv column, the
  anchors' best of seeds and a by-length table that counts where the two
  scores disagree.
"""

from __future__ import annotations

import csv
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jattn.analysis import grid, report, stats
from jattn.models import ARCHITECTURES, Transformer, TransformerConfig
from jattn.train import evaluation, steps
from jattn.train.parts import EvalPart

TF = "eval/test_longer/tf_sequence_accuracy"
EM = "eval/test_longer/exact_match"


class _Logits:
    """A stand-in model whose logits are fixed: `apply` returns them."""

    def __init__(self, logits):
        self.logits = logits

    def apply(self, variables, inputs, targets, **kwargs):
        return self.logits


class _Chars:
    """One character an id, so that decoded texts compare as the ids do."""

    vocab_size = 13

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def _eval_set(batches):
    rows = sum(int(np.sum(np.any(b["targets"] > 0, axis=-1))) for b in batches)
    return evaluation.EvalSet("test_longer", batches, rows, ("exact_match",), None)


def _one_hot_logits(predicted: np.ndarray, vocab: int = 7) -> np.ndarray:
    """Logits `[B, T, vocab]` whose argmax is `predicted` `[B, T]`."""
    logits = np.zeros((*predicted.shape, vocab), np.float32)
    np.put_along_axis(logits, predicted[..., None], 5.0, axis=-1)
    return logits


def _evaluate_fixed(targets: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    """`evaluation.evaluate` of one batch whose teacher-forced argmax is `predicted`."""
    step = jax.jit(steps.make_eval_step(_Logits(jnp.asarray(_one_hot_logits(predicted)))))
    batch = {"inputs": targets, "targets": targets}
    metrics, _ = evaluation.evaluate(
        None, {"test_longer": _eval_set([batch])}, eval_step=step, decode=None,
        to_global=lambda b: b, tokenizer=_Chars(), num_decode=0,
    )  # fmt: skip
    return metrics


def test_one_wrong_token_a_row_is_high_token_accuracy_and_no_sequence():
    """Two rows of 10 tokens (9 digits and EOS), each with one token wrong:
    token accuracy 18/20, sequence accuracy 0/2."""
    targets = np.array([[2, 3, 4, 5, 6, 2, 3, 4, 5, 1]] * 2, np.int32)
    predicted = targets.copy()
    predicted[0, 4] = 3  # a digit wrong
    predicted[1, 9] = 2  # the EOS missed: the output would not stop there
    metrics = _evaluate_fixed(targets, predicted)
    assert metrics["eval/test_longer/accuracy"] == pytest.approx(0.9)
    assert metrics[TF] == 0.0
    assert metrics["eval/test_longer/num_evaluated"] == 2


def test_padding_is_not_scored_and_padding_rows_are_not_examples():
    """Row 0 right, row 1 right on its 2 tokens whatever the argmax over its
    padding, row 2 wrong at its EOS, row 3 all padding: 2 of 3 examples."""
    targets = np.array(
        [[3, 4, 5, 6, 1], [2, 1, 0, 0, 0], [3, 4, 5, 6, 1], [0, 0, 0, 0, 0]], np.int32
    )
    predicted = targets.copy()
    predicted[1, 2:] = [4, 4, 6]  # over padding
    predicted[2, 4] = 0  # PAD predicted where EOS belongs
    predicted[3] = [3, 3, 3, 3, 3]  # a padding row's argmax
    metrics = _evaluate_fixed(targets, predicted)
    assert metrics[TF] == pytest.approx(2 / 3)
    assert metrics["eval/test_longer/num_evaluated"] == 3
    assert metrics["eval/test_longer/accuracy"] == pytest.approx(11 / 12)


def test_sequences_add_up_over_batches():
    """Batch 1: 1 of 2 right; batch 2: 2 of 2 (and a padding row): 3 of 4, not
    the mean of the batches' shares."""
    good = np.array([2, 3, 1], np.int32)
    t1, t2 = np.stack([good, good]), np.stack([good, good, np.zeros(3, np.int32)])
    p1 = t1.copy()
    p1[1, 0] = 4
    logits = [_one_hot_logits(p) for p in (p1, t2)]
    sums = [
        jax.device_get(steps.make_eval_step(_Logits(jnp.asarray(lg)))(None, {"inputs": t,
                                                                          "targets": t}))
        for lg, t in zip(logits, (t1, t2), strict=True)
    ]  # fmt: skip
    calls = iter(sums)
    metrics, _ = evaluation.evaluate(
        None, {"test_longer": _eval_set([{"inputs": t1, "targets": t1},
                                         {"inputs": t2, "targets": t2}])},
        eval_step=lambda params, b: next(calls), decode=None, to_global=lambda b: b,
        tokenizer=_Chars(), num_decode=0,
    )  # fmt: skip
    assert metrics[TF] == pytest.approx(3 / 4)
    assert metrics["eval/test_longer/num_evaluated"] == 4


def test_a_step_without_row_sums_gives_no_sequence_accuracy():
    es = _eval_set([{"inputs": np.ones((2, 3), np.int32), "targets": np.ones((2, 3), np.int32)}])
    metrics, _ = evaluation.evaluate(
        None, {"test_longer": es},
        eval_step=lambda p, b: {"loss_sum": 1.0, "weight_sum": 6.0, "correct": 3.0},
        decode=None, to_global=lambda b: b, tokenizer=_Chars(), num_decode=0,
    )  # fmt: skip
    assert TF not in metrics and "eval/test_longer/num_evaluated" not in metrics


# -- through a tiny model of every architecture -----------------------------------------

TINY = dict(
    vocab_size=13, d_model=16, num_heads=4, num_kv_heads=2, num_layers=1, d_ff=32,
    max_len=32, attention_impl="xla", position="sinusoidal",
)  # fmt: skip
B, S, T = 8, 6, 6


def _targets_of(model, params, inputs) -> np.ndarray | None:
    """Targets that the model gets right teacher-forced, then one token changed in
    every odd row (which makes that row wrong, and no other token's prefix); None
    where the model's argmax is PAD before a row's end (that PAD would be padding)."""
    if model.architecture.autoregressive:
        from jattn.models import decoding

        targets = np.asarray(decoding.greedy(model, params, inputs, max_length=T))
    else:  # the tape: its cells' values never enter, only its length
        lengths = np.array([2, 3, 4, 5, 6, 6, 3, 4])
        cells = np.where(np.arange(T)[None] < lengths[:, None], 2, 0).astype(np.int32)
        argmax = np.asarray(model.apply({"params": params}, inputs, cells)).argmax(-1)
        targets = np.where(cells > 0, argmax, 0).astype(np.int32)
    ends = [np.nonzero(row)[0] for row in targets]
    if any(
        len(e) == 0 or np.any(row[: e[-1] + 1] == 0) for row, e in zip(targets, ends, strict=True)
    ):
        return None
    changed = targets.copy()
    changed[1::2, 0] = 2 + (targets[1::2, 0] - 1) % (TINY["vocab_size"] - 2)  # another non-PAD id
    assert np.all(changed[1::2, 0] != targets[1::2, 0])
    return changed


def _numpy_sequences(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per row: every real target token the argmax (float64 logits)."""
    hit = np.asarray(logits, np.float64).argmax(-1) == targets
    real = targets > 0
    return np.all(hit | ~real, axis=-1) & np.any(real, axis=-1)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_a_tiny_model_of_every_architecture_against_numpy(name):
    model = Transformer(TransformerConfig(**{**TINY, "architecture": name}))
    inputs = np.array(jax.random.randint(jax.random.key(1), (B, S), 2, 13), np.int32)
    inputs[::3, -2:] = [1, 0]  # some shorter inputs: EOS, padding
    for key in range(20):  # the first initialisation whose argmax makes usable targets
        params = model.init(jax.random.key(key), inputs, np.ones((B, T), np.int32))["params"]
        targets = _targets_of(model, params, inputs)
        if targets is not None:
            break
    assert targets is not None, "no initialisation of 20 gave targets without PAD"
    config = EvalPart(
        splits=("test_longer",), batch_size=B, max_len=T, input_len=S, max_batches=0,
        decode_examples=B, decode="greedy", beam_size=1, beam_alpha=0.6, decode_max_len=T,
        seed=0,
    )  # fmt: skip
    metrics, decodes = evaluation.evaluate(
        params, {"test_longer": _eval_set([{"inputs": inputs, "targets": targets}])},
        eval_step=jax.jit(steps.make_eval_step(model)),
        decode=jax.jit(evaluation.decode_fn(model, config)), to_global=lambda b: b,
        tokenizer=_Chars(), num_decode=B,
    )  # fmt: skip
    reference = _numpy_sequences(model.apply({"params": params}, inputs, targets), targets)
    assert list(reference) == [True, False] * (B // 2)  # right where built so, wrong where changed
    assert metrics[TF] == reference.mean() == 0.5
    assert metrics["eval/test_longer/num_evaluated"] == B
    # Greedy decoding: exact match is the same event, example by example.
    examples = decodes["test_longer"]
    assert [e["correct"] for e in examples] == list(reference)
    assert [e["tf_correct"] == e["tf_tokens"] for e in examples] == list(reference)
    assert metrics[EM] == metrics[TF]


# -- the report -------------------------------------------------------------------------

METRICS = (EM, TF, "eval/validation/exact_match")


def _grid(tmp_path, per_run: dict[str, tuple[int, int]], n: int = 20):
    """A finished grid written by hand: per run (exact match k, teacher-forced k) of
    n test_longer examples, validation all right, one decoded example per row
    with its teacher-forced counts (a right sequence: tf_correct == tf_tokens)."""
    positions = list(dict.fromkeys(name.split(",")[0].split("=")[1] for name in per_run))
    seeds = list(dict.fromkeys(name.split(",")[1].split("=")[1] for name in per_run))
    exp = ml_collections.ConfigDict({
        "base": "configs/reverse_digits.py", "train": {},
        "grid": {"position": {"key": "model.position", "values": ",".join(positions)},
                 "seed": {"key": "seed", "values": ",".join(seeds)}},
        "metrics": METRICS, "reference": f"position={positions[0]}",
    })  # fmt: skip
    runs = grid.expand(exp, str(tmp_path))
    configs = []
    for run in runs:
        em, tf = per_run[run.name]
        configs.append(ml_collections.ConfigDict({"num_train_steps": 10, "seed": 0,
                                                  "model": {"position": "t5"}}))  # fmt: skip
        final = {
            "step": 10, EM: em / n, TF: tf / n, "eval/test_longer/num_decoded": n,
            "eval/test_longer/num_evaluated": n, "eval/validation/exact_match": 1.0,
            "eval/validation/num_decoded": n,
        }  # fmt: skip
        os.makedirs(os.path.join(run.workdir, "decodes"))
        with open(os.path.join(run.workdir, "final_metrics.json"), "w") as f:
            json.dump(final, f)
        with open(os.path.join(run.workdir, "decodes", "test_longer.jsonl"), "w") as f:
            for i in range(n):  # examples 0..em-1 decoded right, 0..tf-1 teacher-forced right
                row = {"step": 10, "correct": i < em, "input_tokens": 20, "target_tokens": 20,
                       "tf_correct": 21 if i < tf else 20, "tf_tokens": 21}  # fmt: skip
                f.write(json.dumps(row) + "\n")
        with open(os.path.join(run.workdir, "data_check.json"), "w") as f:
            json.dump({"train": {"max_target_tokens": 17, "max_input_tokens": 17},
                       "test_longer": {"examples": n, "producible": 1.0,
                                       "longer_than_train": 1.0}}, f)  # fmt: skip
    return exp, runs, configs


def test_the_report_puts_it_beside_exact_match_with_intervals(tmp_path):
    counts = {"t5": [(8, 8), (10, 11), (12, 12)], "rope": [(2, 2), (4, 4), (3, 3)]}
    per_run = {f"position={p},seed={s}": c for p, cs in counts.items() for s, c in enumerate(cs)}
    exp, runs, configs = _grid(tmp_path, per_run)
    md = report.write_report(exp, runs, configs, str(tmp_path), status=None)["markdown"]
    head = next(line for line in md.splitlines() if line.startswith("| group | seeds |"))
    assert head.startswith(f"| group | seeds | {EM} | {TF} | eval/validation/exact_match |")
    t5 = next(line for line in md.splitlines() if line.startswith("| position=t5 | 3 |"))
    assert report.fmt_mean_ci([0.4, 0.55, 0.6], TF) in t5.split(" | ")[3]
    mean, low, high = stats.t_interval([0.4, 0.55, 0.6])
    assert f"{mean:.3f} [{low:.3f}, {high:.3f}]" in t5
    # Per run: k/N and the Wilson interval of each score.
    low, high = stats.wilson_interval(11, 20)
    assert (
        f"| position=t5,seed=1 | test_longer | 10/20 (50.00%) | "
        f"{report.fmt_wilson(10, 20)} | 11/20 (55.00%) | [{100 * low:.2f}%, {100 * high:.2f}%] |"
    ) in md
    with open(tmp_path / "results.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert float(rows["position=t5,seed=1"][TF]) == 11 / 20
    assert rows["position=rope,seed=0"]["eval/test_longer/num_evaluated"] == "20"
    # The anchors' section: best of seeds beside the mean, and by length with the
    # examples where the scores disagree (t5 seed 1: one, right only teacher-forced).
    assert f"| {EM} best | {EM} mean | {TF} best | {TF} mean |" in md
    assert "| position=t5 | 3 | 0.600 | 0.500 [0.252, 0.748] | 0.600 | 0.517 [" in md
    assert "It disagrees with decoded exact match on 1 of these 120 examples." in md
    low, high = stats.wilson_interval(31, 60)  # t5 over its seeds: 8 + 11 + 12 of 60
    assert f"| position=t5 | 51.7% [{100 * low:.1f}, {100 * high:.1f}] of 60 |" in md
    assert "| position=t5 | 50.0% [" in md  # exact match by the same bucket: 30 of 60
