"""The report as the length-generalisation anchors write theirs, beside jattn's own.

jattn's report gives each group's mean over seeds with its interval. The
papers this project measures itself against report other numbers, and a
reader comparing with them needs those too:

- the best seed: Delétang et al. 2023 ("Neural Networks and the Chomsky
  Hierarchy") and Ruoss et al. 2023 ("Randomized Positional Encodings")
  are read as reporting a best seed, but how many seeds they ran and which
  they report was not read here (docs/results/anchors.json says so).
  `seeds_table` puts the maximum over the grid's seeds beside the mean and
  its 95% Student t interval (the maximum of 3 seeds is an optimistic,
  noisy statistic, which is why the mean stays beside it);
- teacher-forced sequence accuracy (``eval/<split>/tf_sequence_accuracy``,
  the score of Ontañón et al. 2022's code): beside exact match in the
  seeds table, and per length bucket from each decoded example's
  ``tf_correct`` / ``tf_tokens`` (right where they are equal). For greedy
  decoding it is the same event as exact match: a decoded output is
  right exactly when every step's argmax, fed the right prefix, is the
  right token. The buckets count the examples where the two disagree,
  which only the decoder's cached arithmetic (or a decoding limit) can make;
- teacher-forced token accuracy beyond the training lengths (the score of
  Delétang et al. and Ruoss et al.): ``eval/<split>/beyond_train/accuracy``,
  computed by `jattn.train.evaluation` over the examples whose targets are
  longer than every training target, pooled over their tokens, and
  ``.../beyond_train/length_avg_accuracy``, per target length averaged over
  the lengths (how their code scores), and per length bucket from each
  decoded example's ``tf_correct`` / ``tf_tokens``;
- exact match by length bucket (Kazemnejad et al. 2023 plot it against
  length): `length_buckets` pools each group's decoded examples over seeds
  and eval splits by target length (tokens before EOS: characters of copy
  and reverse, actions of SCAN), each bucket's exact match as k/N with its
  95% Wilson interval;
- where outputs stop (`stop_table`): per run, the output length (tokens
  before EOS) the most `test_longer` outputs have and its share, and the
  share that reach the decoding limit with no end token. A model that
  fails beyond its training lengths either stops where training ended or
  never stops, and the table says which, from the same decode files.

Buckets have `width` lengths and are aligned on the longest training target
(the data check's ``max_target_tokens`` minus EOS), so no bucket mixes
lengths seen in training with longer ones. Splits whose targets cannot all be
produced from training are left out, as in the rest of the report. Every
number is read back from the runs' workdirs, like `jattn.analysis.report`.
"""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Any

from jattn.analysis import stats
from jattn.analysis.runs import TF_SEQUENCE, exact_match_split, unproducible_share

__all__ = [
    "BEYOND_TRAIN",
    "BEYOND_TRAIN_BY_LENGTH",
    "anchor_metrics",
    "bucket_of",
    "bucket_tables",
    "length_buckets",
    "section",
    "seeds_table",
    "stop_table",
    "train_length",
]

BEYOND_TRAIN = "beyond_train/accuracy"  # eval/<split>/beyond_train/accuracy
# The same averaged over target lengths with equal weight (Ruoss et al.'s way).
BEYOND_TRAIN_BY_LENGTH = "beyond_train/length_avg_accuracy"
DEFAULT_WIDTH = 5


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _split_of(metric: str) -> str | None:
    """The eval split of an exact-match, teacher-forced sequence or beyond-training
    accuracy metric."""
    split = exact_match_split(metric)
    if split:
        return split
    prefix, _, rest = metric.partition("/")
    split, _, name = rest.partition("/")
    known = (TF_SEQUENCE, BEYOND_TRAIN, BEYOND_TRAIN_BY_LENGTH)
    return split if prefix == "eval" and name in known else None


def anchor_metrics(rows) -> list[str]:
    """The exact-match, teacher-forced sequence and beyond-training accuracy metrics
    the finished runs have, per eval split in order of appearance (exact match
    first, teacher-forced sequence accuracy beside it)."""
    found: dict[str, list[str]] = collections.OrderedDict()
    for r in rows:
        for key, value in (r["final"] or {}).items():
            split = _split_of(key)
            if split and _number(value) and key not in found.setdefault(split, []):
                found[split].append(key)

    def order(metric: str) -> int:  # exact match, sequences, pooled accuracy, by length
        for rank, name in enumerate((TF_SEQUENCE, BEYOND_TRAIN, BEYOND_TRAIN_BY_LENGTH), 1):
            if metric.endswith("/" + name):
                return rank
        return 0

    return [m for ms in found.values() for m in sorted(ms, key=order)]


def _mean_ci(values: list[float]) -> str:
    """``0.953 [0.910, 0.990]``, the interval clipped to [0, 1]; one seed: no interval."""
    mean, low, high = stats.t_interval(values)
    if math.isnan(low):
        return f"{mean:.3f} (1 seed)"
    return f"{mean:.3f} [{max(low, 0.0):.3f}, {min(high, 1.0):.3f}]"


def seeds_table(rows) -> list[str]:
    """Per group and anchor metric: the best seed, then mean [95% t interval] over seeds.

    Returns:
      markdown lines (a table), or [] when no finished run has such a metric.
    """
    metrics = anchor_metrics(rows)
    if not metrics:
        return []
    values: dict[str, dict[str, list[float]]] = collections.OrderedDict()
    checks: dict[str, Any] = {}
    for r in rows:
        group = r["run"].group
        per_metric = values.setdefault(group, {})
        checks.setdefault(group, r.get("check"))
        for m in metrics if r["final"] else ():
            if _number(r["final"].get(m)):
                per_metric.setdefault(m, []).append(float(r["final"][m]))
    head = "| group | seeds | " + " | ".join(f"{m} best | {m} mean" for m in metrics) + " |"
    lines = [head, "|---|---:|" + "---:|---:|" * len(metrics)]
    for group, per_metric in values.items():
        seeds = max((len(v) for v in per_metric.values()), default=0)
        cells = []
        for m in metrics:
            share = unproducible_share(checks[group], _split_of(m))
            got = per_metric.get(m, [])
            if share is not None:
                cells += [f"unproducible ({100 * share:.1f}% of targets)", "-"]
            elif not got:
                cells += ["-", "-"]
            else:
                cells += [f"{max(got):.3f}", _mean_ci(got)]
        lines.append(f"| {group} | {seeds} | " + " | ".join(cells) + " |")
    return lines


def train_length(rows) -> int | None:
    """The longest training target in tokens before EOS, from the runs' data check."""
    for r in rows:
        longest = ((r.get("check") or {}).get("train") or {}).get("max_target_tokens")
        if _number(longest):
            return int(longest) - 1
    return None


def bucket_of(length: int, width: int, edge: int | None) -> tuple[int, int]:
    """The bucket ``(first, last)`` of a length: `width` lengths, one boundary just
    after `edge` (the longest training length; None: buckets from 1)."""
    if width < 1:
        raise ValueError(f"bucket width must be at least 1, got {width}")
    start = (edge or 0) + 1
    first = start + ((length - start) // width) * width
    return max(first, 1), first + width - 1


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def length_buckets(rows, width: int = DEFAULT_WIDTH):
    """Per group and length bucket: exact match and teacher-forced tokens of the
    final step's decoded examples, pooled over seeds and producible eval splits.

    Returns:
      (group -> bucket -> {"k", "n", "tf": {run name: [hits, tokens]}, "seq":
      [teacher-forced right, examples with teacher-forced counts], "differ":
      examples where that and exact match disagree}, the longest training
      length or None).
    """
    edge = train_length(rows)
    table: dict[str, dict[tuple[int, int], dict[str, Any]]] = collections.OrderedDict()
    for r in rows:
        g = table.setdefault(r["run"].group, {})
        if not r["final"]:
            continue
        folder = os.path.join(r["run"].workdir, "decodes")
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        for split in (n.removesuffix(".jsonl") for n in names if n.endswith(".jsonl")):
            if unproducible_share(r.get("check"), split) is not None:
                continue
            for e in _read_jsonl(os.path.join(folder, f"{split}.jsonl")):
                if e.get("step") != r["final"].get("step") or "target_tokens" not in e:
                    continue  # another step's, or written before lengths were recorded
                cell = g.setdefault(
                    bucket_of(int(e["target_tokens"]), width, edge),
                    {"k": 0, "n": 0, "tf": {}, "seq": [0, 0], "differ": 0},
                )
                cell["k"] += bool(e["correct"])
                cell["n"] += 1
                if "tf_tokens" in e:
                    tf = cell["tf"].setdefault(r["run"].name, [0, 0])
                    tf[0] += int(e["tf_correct"])
                    tf[1] += int(e["tf_tokens"])
                    right = int(e["tf_correct"]) == int(e["tf_tokens"])
                    cell["seq"][0] += right
                    cell["seq"][1] += 1
                    cell["differ"] += right != bool(e["correct"])
    return table, edge


def _bucket_name(bucket: tuple[int, int]) -> str:
    return str(bucket[0]) if bucket[0] == bucket[1] else f"{bucket[0]}-{bucket[1]}"


def _wilson_cell(k: int, n: int) -> str:
    low, high = stats.wilson_interval(k, n)
    return f"{100 * k / n:.1f}% [{100 * low:.1f}, {100 * high:.1f}] of {n}"


def _tf_cell(per_run: dict[str, list[int]]) -> str:
    accuracies = [hits / tokens for hits, tokens in per_run.values() if tokens]
    return _mean_ci(accuracies) if accuracies else "-"


def bucket_tables(rows, width: int = DEFAULT_WIDTH) -> list[str]:
    """Markdown: exact match, then teacher-forced accuracy, by target-length bucket."""
    table, edge = length_buckets(rows, width)
    buckets = sorted({b for g in table.values() for b in g})
    if not buckets:
        return []
    names = [_bucket_name(b) + (" †" if edge is not None and b[0] > edge else "") for b in buckets]
    head = "| group | " + " | ".join(names) + " |"
    sep = "|---|" + "---:|" * len(buckets)
    exact = [head, sep]
    forced = [head, sep]
    sequences = [head, sep]
    for group, cells in table.items():
        exact.append(
            f"| {group} | "
            + " | ".join(
                _wilson_cell(cells[b]["k"], cells[b]["n"]) if b in cells else "-" for b in buckets
            )  # fmt: skip
            + " |"
        )
        forced.append(
            f"| {group} | "
            + " | ".join(_tf_cell(cells[b]["tf"]) if b in cells else "-" for b in buckets)
            + " |"
        )
        sequences.append(
            f"| {group} | "
            + " | ".join(
                _wilson_cell(*cells[b]["seq"]) if b in cells and cells[b]["seq"][1] else "-"
                for b in buckets
            )
            + " |"
        )
    beyond = (
        f"† marks lengths beyond training (training targets up to {edge} tokens before EOS). "
        if edge is not None
        else ""
    )
    out = [
        "Exact match by target length (tokens before EOS), the final step's decoded "
        "examples pooled over seeds and eval splits: k/N with its 95% Wilson interval.",
        "",
        *exact,
        "",
    ]
    if any(cell["tf"] for g in table.values() for cell in g.values()):
        cells = [cell for g in table.values() for cell in g.values()]
        differ, counted = sum(c["differ"] for c in cells), sum(c["seq"][1] for c in cells)
        out += [
            "Teacher-forced sequence accuracy (Ontañón et al.'s score: every target token, "
            "EOS included, the argmax under the gold prefix) by the same buckets, the same "
            "examples: k/N with its 95% Wilson interval. It disagrees with decoded exact "
            f"match on {differ:,} of these {counted:,} examples.",
            "",
            *sequences,
            "",
            "Teacher-forced token accuracy (EOS included) by the same buckets: mean over "
            "seeds [95% t interval] of each seed's accuracy in the bucket.",
            "",
            *forced,
            "",
        ]
    return [*out, beyond + f"Buckets of {width} lengths."]


def _decode_limit(workdir: str) -> int | None:
    """The run's decoding limit in tokens (`decode_max_len`, else `eval_max_len`)."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        config = json.load(f)
    return config.get("decode_max_len") or config.get("eval_max_len")


def stop_table(rows, split: str = "test_longer") -> list[str]:
    """Markdown: where each run's decoded `split` outputs stop (module docstring), or []."""
    lines = []
    for r in rows:
        if not r["final"]:
            continue
        step = r["final"].get("step")
        found = _read_jsonl(os.path.join(r["run"].workdir, "decodes", f"{split}.jsonl"))
        lengths = [
            int(e["output_tokens"])
            for e in found
            if e.get("step") == step and "output_tokens" in e  # older files lack it
        ]
        if not lengths:
            continue
        counts = collections.Counter(lengths)
        mode, k = max(counts.items(), key=lambda item: (item[1], -item[0]))
        limit = _decode_limit(r["run"].workdir)
        at_limit = f"{counts.get(limit, 0)}/{len(lengths)}" if limit else "-"
        lines.append(
            f"| {r['run'].name} | {len(lengths)} | {mode} | {k}/{len(lengths)} "
            f"({100 * k / len(lengths):.1f}%) | {limit or '-'} | {at_limit} |"
        )
    if not lines:
        return []
    return [
        f"Where the `{split}` outputs stop, per run (the final step's decode files): the "
        "output length (tokens before EOS) the most outputs have, and how many reach the "
        "decoding limit without an end token.",
        "",
        "| run | outputs | most common length | its share | decoding limit | at the limit |",
        "|---|---:|---:|---:|---:|---:|",
        *lines,
    ]


def section(rows, width: int = DEFAULT_WIDTH) -> list[str]:
    """The report's section "As the anchors report" (markdown lines), or [] when the
    runs have nothing for it."""
    seeds = seeds_table(rows)
    buckets = bucket_tables(rows, width)
    if not seeds and not buckets:
        return []
    out = ["## As the anchors report", ""]
    if seeds:
        n = max(collections.Counter(r["run"].group for r in rows if r["final"]).values())
        out += [
            f"Best of seeds (of up to {n}; how many seeds the anchors ran and which they report "
            "was not read here, see docs/results/anchors.json) beside the mean [95% t "
            f"interval]; `{TF_SEQUENCE}` (where the runs have it) is teacher-forced sequence "
            f"accuracy (Ontañón et al.'s score); `{BEYOND_TRAIN}` is teacher-forced "
            "token accuracy over the examples longer than every training target, pooled over "
            f"their tokens; `{BEYOND_TRAIN_BY_LENGTH}` (where the runs have it) the same per "
            "target length, averaged over the lengths (how Ruoss et al.'s code scores).",
            "",
            *seeds,
            "",
        ]
    if buckets:
        out += [*buckets, ""]
    stops = stop_table(rows)
    if stops:
        out += [*stops, ""]
    return out
