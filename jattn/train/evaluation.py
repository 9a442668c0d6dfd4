"""Periodic evaluation: loss, token accuracy and decoded metrics on each eval split.

Each split (``config.eval_splits``, e.g. validation and test_longer) is read
once, unpacked (one example a row), without shuffling, up to
`eval_max_batches` batches of `eval_batch_size` rows of `eval_max_input_len`
input and `eval_max_len` target tokens (examples longer on either side are
dropped), and cached in host memory. Every process reads the same rows, so the
batches are global and each process can build its shards locally.

Metrics, per split ``S``:

- ``eval/S/loss``: mean per-token cross entropy (no label smoothing), nats;
- ``eval/S/accuracy``: teacher-forced next-token accuracy;
- ``eval/S/beyond_train/accuracy``: the same over the examples whose
  targets are longer (in tokens, EOS included) than every training target
  (the data check's ``max_target_tokens``): the anchors' teacher-forced
  score beyond the training lengths (Delétang et al. 2023, Ruoss et al.
  2023); only where the split has such examples and the task was loaded
  with `jattn.data.load` (its data check is cached);
- ``eval/S/beyond_train/length_avg_accuracy``: the same examples' token
  accuracy per target length, averaged over the lengths with equal weight
  (their code scores each test length, then averages over lengths; the
  pooled ``beyond_train/accuracy`` weighs a length by its tokens, so the
  longest, hardest lengths count more there);
- ``eval/S/tf_sequence_accuracy``: teacher-forced sequence accuracy, the
  fraction of the evaluated examples whose every target token (EOS
  included, padding not) is the argmax under the gold prefix: Ontañón et
  al. 2022's score (their code feeds the gold prefix, takes the argmax,
  cuts it after its first end token and compares it with the reference,
  which is the same thing). For greedy decoding it is the same event as
  exact match, not a looser one: a greedy output is right exactly when
  each step's argmax, fed the right prefix, is the right token. The two
  part only where the decoder's cached steps round an argmax differently
  from this full pass, where the decoding limit cuts an output, or with
  beam search. With ``eval/S/num_evaluated``, the examples it is over (N
  of its k/N: every real row of the split, decoded or not);
- ``eval/S/exact_match``: fraction of the first `eval_decode_examples`
  examples whose decoded output equals the reference string (in [0, 1]);
- ``eval/S/num_decoded``: how many examples were decoded (N), so that the
  report knows exact match as k of N and can give it a binomial interval;
- ``eval/S/length_match``: fraction of those decoded outputs that stop
  after exactly as many tokens as the reference (a model that stops too
  early or too late fails here whatever its tokens: on longer inputs it
  tells a length limit from wrong content);
- ``eval/S/chrf``: sacrebleu corpus chrF (0-100);
- ``eval/S/bleu``: sacrebleu corpus BLEU (0-100), word-level tasks only.

The decoded metrics are those the task declares (``task.metrics``, see
`jattn.data.tasks.task_metrics`): character-level tasks (numbers, copy,
reverse) have no BLEU, which needs 4-grams and reads 0 on one-word outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jattn.data import producibility
from jattn.train import workdir as workdir_lib
from jattn.train.parts import ConfigError, EvalPart

__all__ = [
    "TF_SEQUENCE",
    "EvalSet",
    "decode_fn",
    "evaluate",
    "format_eval",
    "ids_to_text",
    "load_eval_sets",
    "metric_names",
    "write_decodes",
]

EOS_ID, PAD_ID = 1, 0
DECODED_METRICS = ("exact_match", "bleu", "chrf")  # every one `evaluate` knows
TF_SEQUENCE = "tf_sequence_accuracy"  # eval/<split>/tf_sequence_accuracy


@dataclasses.dataclass
class EvalSet:
    """The cached rows of one eval split.

    Attributes:
      split: the split name.
      batches: numpy batches, each ``{name: int32 [rows, L]}`` with L =
        `eval_max_input_len` for the "inputs*" names, `eval_max_len` for "targets*".
      num_examples: real (non-padding) rows across `batches`.
      metrics: the decoded metrics to report (the task's `metrics`).
      train_max_target_tokens: the longest training target in tokens (EOS
        included), from the task's data check; None where unknown.
    """

    split: str
    batches: list[dict[str, np.ndarray]]
    num_examples: int
    metrics: tuple[str, ...] = DECODED_METRICS
    train_max_target_tokens: int | None = None


def _train_max_target_tokens(task: Any, splits: Sequence[str]) -> int | None:
    """The data check's longest training target, for a task `jattn.data.load` made
    (whose check the run has just cached: reading it costs nothing); else None."""
    if not getattr(task, "vocab_dir", ""):
        return None
    return int(producibility.check(task, splits)["train"]["max_target_tokens"])


def _pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Pads every array to `rows` rows with zeros (padding rows carry no weight)."""
    have = next(iter(batch.values())).shape[0]
    if have == rows:
        return batch
    return {k: np.pad(v, [(0, rows - have)] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}


def load_eval_sets(
    task: Any, make_loader: Callable[..., Any], evaluation: EvalPart, splits: Sequence[str]
) -> dict[str, EvalSet]:
    """Reads and caches the eval rows of `splits` (see the module docstring).

    Raises:
      ConfigError: a split none of whose examples fits the eval row lengths
        (its metrics would silently read 0).
    """
    input_len = evaluation.input_len
    metrics = tuple(getattr(task, "metrics", DECODED_METRICS))
    unknown = sorted(set(metrics) - set(DECODED_METRICS))
    if unknown:
        raise ConfigError(f"task metrics {unknown} unknown; evaluation knows {DECODED_METRICS}")
    longest = _train_max_target_tokens(task, splits)
    sets = {}
    for split in splits:
        loader = make_loader(
            task,
            split,
            batch_size=evaluation.batch_size,
            max_len=evaluation.max_len,
            max_input_len=input_len,
            seed=evaluation.seed,
            shuffle=False,
            num_epochs=1,
            pack=False,
            overlong="drop",
        )
        batches, count = [], 0
        for batch in loader:
            batch = {k: np.asarray(v) for k, v in batch.items()}
            count += int(np.sum(np.any(batch["targets"] > 0, axis=-1)))
            batches.append(_pad_rows(batch, evaluation.batch_size))
            if evaluation.max_batches and len(batches) >= evaluation.max_batches:
                break
        if count == 0:
            raise ConfigError(
                f"eval split {split!r} has no example that fits eval_max_input_len="
                f"{input_len} and eval_max_len={evaluation.max_len}: raise them, or drop "
                f"{split!r} from eval_splits"
            )
        sets[split] = EvalSet(split, batches, count, metrics, longest)
    return sets


def _until_stop(ids: np.ndarray) -> list[int]:
    """The ids of a row before its first EOS or PAD."""
    ids = [int(i) for i in ids]
    for stop in (EOS_ID, PAD_ID):
        if stop in ids:
            ids = ids[: ids.index(stop)]
    return ids


def _length(ids: np.ndarray) -> int:
    """Tokens of a row before its EOS: a decoded output's length (where it stopped)."""
    return len(_until_stop(ids))


def ids_to_text(tokenizer: Any, ids: np.ndarray) -> str:
    """Decodes one row of ids, stopping at EOS or PAD and skipping ids past the vocab.

    (The model's vocabulary may be padded beyond the tokenizer's for sharding.)
    """
    return tokenizer.decode([i for i in _until_stop(ids) if i < tokenizer.vocab_size])


def evaluate(
    params: Any,
    eval_sets: dict[str, EvalSet],
    *,
    eval_step: Callable[[Any, dict[str, jax.Array]], dict[str, jax.Array]],
    decode: Callable[[Any, jax.Array], jax.Array] | None,
    to_global: Callable[[dict[str, np.ndarray]], dict[str, jax.Array]],
    tokenizer: Any,
    num_decode: int,
) -> tuple[dict[str, float], dict[str, list[dict[str, Any]]]]:
    """Evaluates `params` on every cached split.

    Args:
      params: the (sharded) model parameters.
      eval_sets: from `load_eval_sets`.
      eval_step: jitted `(params, batch) -> {"loss_sum", "weight_sum", "correct"}`
        with replicated outputs, and optionally per row ``row_correct`` and
        ``row_weight`` `[rows]` (teacher-forced hits and tokens; they give
        ``tf_sequence_accuracy``, ``beyond_train/accuracy`` and each decoded
        example's ``tf_correct``).
      decode: jitted `(params, inputs [rows, S]) -> ids [rows, max_length]`,
        replicated output; None skips the decoded metrics.
      to_global: numpy batch (the same on every process) -> global arrays.
      tokenizer: has ``decode(ids) -> str`` and ``vocab_size``.
      num_decode: decode at most this many examples a split.

    Returns:
      (metrics named ``eval/<split>/<metric>``, the decoded ones those of the
      split's `EvalSet.metrics`, per split the decoded examples
      as dicts with input, target, prediction, correct, input_tokens,
      target_tokens, output_tokens, and where the step gives them ``tf_correct``
      and ``tf_tokens``: the example's teacher-forced hits and tokens, EOS included).
    """
    metrics, decodes = {}, {}
    for split, es in eval_sets.items():
        loss = weight = correct = beyond_correct = beyond_weight = 0.0
        sequences = [0, 0]  # teacher-forced: [rows with every token right, rows]
        by_length: dict[int, list[float]] = {}  # target tokens -> [hits, tokens], beyond training
        examples: list[dict[str, Any]] = []
        for batch in es.batches:
            gbatch = to_global(batch)
            sums = jax.device_get(eval_step(params, gbatch))
            loss += float(sums["loss_sum"])
            weight += float(sums["weight_sum"])
            correct += float(sums["correct"])
            rows = _row_sums(sums)
            if rows is not None:
                sequences = [a + b for a, b in zip(sequences, _sequence_counts(*rows), strict=True)]
            if rows is not None and es.train_max_target_tokens is not None:
                beyond = rows[1] > es.train_max_target_tokens  # [rows]
                beyond_correct += float(np.sum(rows[0][beyond]))
                beyond_weight += float(np.sum(rows[1][beyond]))
                for hits, tokens in zip(rows[0][beyond], rows[1][beyond], strict=True):
                    acc = by_length.setdefault(int(tokens), [0.0, 0.0])
                    acc[0] += float(hits)
                    acc[1] += float(tokens)
            if decode is None or len(examples) >= num_decode:
                continue
            out = np.asarray(jax.device_get(decode(params, gbatch["inputs"], gbatch["targets"])))
            examples += _examples(tokenizer, batch, out, rows, num_decode - len(examples))
        prefix = f"eval/{split}/"
        metrics[prefix + "loss"] = loss / max(weight, 1.0)
        metrics[prefix + "accuracy"] = correct / max(weight, 1.0)
        if sequences[1]:
            metrics[prefix + TF_SEQUENCE] = sequences[0] / sequences[1]
            metrics[prefix + "num_evaluated"] = sequences[1]  # N of its k/N
        if beyond_weight:
            metrics[prefix + "beyond_train/accuracy"] = beyond_correct / beyond_weight
            metrics[prefix + "beyond_train/length_avg_accuracy"] = float(
                np.mean([hits / tokens for hits, tokens in by_length.values()])
            )
        metrics.update(_decoded_metrics(prefix, examples, es.metrics))
        decodes[split] = examples
    return metrics, decodes


def _examples(tokenizer, batch, out: np.ndarray, rows, room: int) -> list[dict[str, Any]]:
    """At most `room` decoded examples of one batch (padding rows skipped)."""
    examples = []
    for row in range(out.shape[0]):
        if len(examples) >= room or not np.any(batch["targets"][row] > 0):
            continue
        pred = ids_to_text(tokenizer, out[row])
        ref = ids_to_text(tokenizer, batch["targets"][row])
        examples.append(
            {
                "input": ids_to_text(tokenizer, batch["inputs"][row]),
                "target": ref,
                "prediction": pred,
                "correct": pred == ref,
                "input_tokens": int(np.sum(batch["inputs"][row] > 0)),
                "target_tokens": _length(batch["targets"][row]),
                "output_tokens": _length(out[row]),
            }
        )
        if rows is not None:
            examples[-1]["tf_correct"] = int(rows[0][row])
            examples[-1]["tf_tokens"] = int(rows[1][row])
    return examples


def _decoded_metrics(prefix: str, examples, names) -> dict[str, float]:
    """Exact match (with ``num_decoded`` and ``length_match``), BLEU and chrF of the
    decoded `examples`, those of `names` (a split's `EvalSet.metrics`)."""
    import sacrebleu  # noqa: PLC0415 -- heavy, only needed here

    if not examples:
        return {}
    metrics = {}
    hyps = [e["prediction"] for e in examples]
    refs = [e["target"] for e in examples]
    if "exact_match" in names:
        metrics[prefix + "exact_match"] = float(np.mean([e["correct"] for e in examples]))
        metrics[prefix + "num_decoded"] = len(examples)  # N of exact match's k/N
        metrics[prefix + "length_match"] = float(
            np.mean([e["output_tokens"] == e["target_tokens"] for e in examples])
        )
    if "bleu" in names:
        metrics[prefix + "bleu"] = float(sacrebleu.corpus_bleu(hyps, [refs]).score)
    if "chrf" in names:
        metrics[prefix + "chrf"] = float(sacrebleu.corpus_chrf(hyps, [refs]).score)
    return metrics


def _row_sums(sums: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """(teacher-forced hits, tokens) per row `[rows]`, if the eval step gives them."""
    if "row_correct" not in sums or "row_weight" not in sums:
        return None
    return np.asarray(sums["row_correct"]), np.asarray(sums["row_weight"])


def _sequence_counts(hits: np.ndarray, tokens: np.ndarray) -> tuple[int, int]:
    """(rows whose every target token is right teacher-forced, rows) of one batch's
    per-row hits and tokens `[rows]`; padding rows (no token) are not rows."""
    real = tokens > 0
    return int(np.sum(real & (hits == tokens))), int(np.sum(real))


def write_decodes(workdir: str, step: int, decodes: dict[str, list[dict[str, Any]]]) -> None:
    """Writes `workdir/decodes/<split>.jsonl` (the latest eval's decoded examples)."""
    os.makedirs(os.path.join(workdir, workdir_lib.DECODES), exist_ok=True)
    for split, examples in decodes.items():
        path = workdir_lib.decodes_path(workdir, split)
        with open(path + ".tmp", "w") as f:
            for e in examples:
                f.write(json.dumps({"step": int(step), **e}) + "\n")
        os.replace(path + ".tmp", path)


def decode_fn(model, evaluation: EvalPart):
    """`(params, inputs [B, S], targets [B, T]) -> ids [B, max_length]` per
    `evaluation.decode`, or None. The targets are read only by a model that is
    told its output length (an encoder-only tape: `tape_lengths`, each row's
    target tokens); an autoregressive model decodes from the inputs alone."""
    if evaluation.decode_examples <= 0:
        return None
    from jattn.models import decoding  # noqa: PLC0415

    max_length = evaluation.decode_max_len
    search = decoding.greedy
    if evaluation.decode == "beam":
        search = functools.partial(
            decoding.beam_search, beam_size=evaluation.beam_size, alpha=evaluation.beam_alpha
        )

    def decode(params, inputs, targets):
        lengths = jax.numpy.minimum(jax.numpy.sum(targets > 0, axis=-1), max_length)
        return search(model, params, inputs, max_length=max_length, tape_lengths=lengths)

    return decode


def metric_names(eval_sets) -> list[str]:
    """The scalars TensorBoard's HPARAMS table shows: training's and every split's."""
    return ["train/loss", "train/accuracy"] + [
        f"eval/{es.split}/{m}"
        for es in eval_sets.values()
        for m in ("loss", "accuracy", TF_SEQUENCE, *es.metrics)
    ]


def format_eval(step: int, metrics: dict[str, float]) -> str:
    """``step 100: validation/loss=1.23, ...``: an evaluation's log line."""
    parts = [f"{k.removeprefix('eval/')}={v:.4g}" for k, v in sorted(metrics.items())]
    return f"step {step}: " + ", ".join(parts)
