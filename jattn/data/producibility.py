"""Whether a model can produce an evaluation split's targets from what training shows.

A length-generalisation split measures something only if its answers are
reachable: every target token must occur in some training target (a model
never learns to emit a token it was never asked to emit), and the report
should say how many targets are longer than any training target (that is
the point of the split, but also where a learned position table or a
clipping distance runs out). `check` computes both, per split, in tokens of
the task's own tokenizer, and `warnings` turns a split that cannot be
produced into a loud line. The training loop runs it whenever it prepares a
data set and writes it to the run's ``data_check.json`` and final metrics
(``data/<split>/producible``, ``data/<split>/longer_than_train``), and
`jattn ablate`'s report prints "unproducible" instead of an exact match that
would be a silent 0 fixed before training started.

For the small local tasks this reads every example (a second or two); data
sets above `TRAIN_SAMPLE` training examples use a fixed random sample of that
many, and the result says how many were scanned. The result is cached next to
the task's vocabulary, keyed by the tokenizer and the split sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["TRAIN_SAMPLE", "check", "metrics", "sample_indices", "summary_lines", "warnings"]

TRAIN_SAMPLE = 1_000_000  # training examples scanned at most (a fixed random sample)
_UNSEEN_SHOWN = 8  # unseen tokens named in the result


def sample_indices(n: int, limit: int) -> np.ndarray:
    """The training examples the check scans: all `n` when `n <= limit`, else
    `limit` of them drawn without replacement with a fixed seed and sorted
    (the same sample on every run and host), int `[min(n, limit)]`."""
    if n <= limit:
        return np.arange(n)
    return np.sort(np.random.default_rng(0).choice(n, size=limit, replace=False))


def _examples(source, indices: np.ndarray):
    for start in range(0, len(indices), 4096):
        yield from source.__getitems__(indices[start : start + 4096].tolist())


def _cache_path(task, splits: Sequence[str], limit: int) -> str | None:
    vocab_dir = getattr(task, "vocab_dir", "")
    if not vocab_dir:
        return None
    tok = task.tokenizer
    key = json.dumps(
        {
            "tokenizer": type(tok).__name__,
            "vocab_size": tok.vocab_size,
            "vocab": hashlib.sha256(
                "\x00".join(tok.decode([i]) for i in range(tok.vocab_size)).encode()
            ).hexdigest(),
            "splits": {s: len(task.source(s)) for s in ("train", *splits)},
            "limit": limit,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(vocab_dir, f"data_check-{digest}.json")


def check(task, splits: Sequence[str], *, limit: int = TRAIN_SAMPLE) -> dict[str, Any]:
    """Producibility and length of each split's targets against training's.

    Args:
      task: a `jattn.data.Task` (its tokenizer and sources).
      splits: the evaluation splits to check (those the task lacks are skipped).
      limit: training examples scanned at most.

    Returns:
      ``{"train": {"examples", "scanned", "max_input_tokens", "max_target_tokens"},
      <split>: {"examples", "producible", "longer_than_train", "max_target_tokens",
      "unseen_tokens", "unseen_characters"}}``: token counts include EOS;
      ``producible`` is the share of targets made only of tokens that occur
      in training targets,
      ``longer_than_train`` the share with more tokens than any training target,
      ``unseen_tokens`` up to 8 target tokens training never shows (an
      out-of-vocabulary piece shows as the tokenizer's unknown token), and
      ``unseen_characters`` up to 8 characters of those targets that no
      training target has.
    """
    splits = [s for s in splits if s in task.splits and s != "train"]
    path = _cache_path(task, splits, limit)
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    tok = task.tokenizer
    train = task.source("train")
    indices = sample_indices(len(train), limit)
    seen: set[int] = set()
    seen_chars: set[str] = set()
    max_in = max_out = 0
    for ex in _examples(train, indices):
        ids = tok.encode(ex["targets"])
        seen.update(ids)
        seen_chars.update(ex["targets"])
        max_out = max(max_out, len(ids))
        max_in = max(max_in, len(tok.encode(ex["inputs"])))
    result: dict[str, Any] = {
        "train": {
            "examples": len(train),
            "scanned": len(indices),
            "max_input_tokens": max_in,
            "max_target_tokens": max_out,
        }
    }
    for split in splits:
        source = task.source(split)
        n = producible = longer = longest = 0
        unseen: dict[int, None] = {}
        unseen_chars: dict[str, None] = {}
        for ex in _examples(source, np.arange(len(source))):
            ids = tok.encode(ex["targets"])
            missing = [i for i in ids if i not in seen]
            producible += not missing
            unseen.update(dict.fromkeys(missing))
            if missing:
                unseen_chars.update(dict.fromkeys(c for c in ex["targets"] if c not in seen_chars))
            longer += len(ids) > max_out
            longest = max(longest, len(ids))
            n += 1
        result[split] = {
            "examples": n,
            "producible": producible / n if n else 1.0,
            "longer_than_train": longer / n if n else 0.0,
            "max_target_tokens": longest,
            "unseen_tokens": [tok.decode([i]) for i in list(unseen)[:_UNSEEN_SHOWN]],
            "unseen_characters": sorted(unseen_chars)[:_UNSEEN_SHOWN],
        }
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"  # processes of one run may check at once
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, path)
    return result


def metrics(result: dict[str, Any]) -> dict[str, float]:
    """``data/<split>/producible`` and ``data/<split>/longer_than_train`` of `check`'s result."""
    out = {}
    for split, r in result.items():
        if split != "train":
            out[f"data/{split}/producible"] = float(r["producible"])
            out[f"data/{split}/longer_than_train"] = float(r["longer_than_train"])
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One line per split for a run's start-up summary."""
    train = result["train"]
    scanned = "" if train["scanned"] == train["examples"] else f" (of {train['scanned']:,})"
    lines = [
        f"data check: training targets up to {train['max_target_tokens']} tokens, inputs up "
        f"to {train['max_input_tokens']}{scanned}"
    ]
    for split, r in result.items():
        if split != "train":
            lines.append(
                f"data check: {split}: {r['producible']:.1%} of targets producible from "
                f"training's tokens, {r['longer_than_train']:.1%} longer than any training "
                f"target (up to {r['max_target_tokens']} tokens)"
            )
    return lines


def warnings(result: dict[str, Any]) -> list[str]:
    """A line for every split some of whose targets no model can produce."""
    out = []
    for split, r in result.items():
        if split != "train" and r["producible"] < 1.0:
            out.append(
                f"WARNING: {split}: only {r['producible']:.1%} of targets can be produced "
                f"(never in a training target: tokens {r['unseen_tokens']}, characters "
                f"{r['unseen_characters']}); its exact "
                "match is bounded by that share and cannot measure generalisation"
            )
    return out
