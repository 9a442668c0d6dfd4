"""The anchors' records (docs/results/anchors.json) as values the tests read.

What each paper jattn compares against says lives in a data file beside the
reports, not in the library: its setup and its numbers, each with where it
was read, ``null`` with a reason where it was not. This module reads it into
small frozen values and answers the questions the tests ask of it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import statistics

PATH = pathlib.Path(__file__).resolve().parent.parent / "docs" / "results" / "anchors.json"


@dataclasses.dataclass(frozen=True)
class Fact:
    """One fact and where it was read; ``value=None`` means not read here (`reason` says why)."""

    value: float | str | None
    source: str
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One of the paper's numbers: a statistic of one scheme on one task."""

    task: str
    scheme: str
    statistic: str  # e.g. "exact match, seed 146317" or "mean reciprocal rank"
    value: float | None
    source: str
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class AnchorRecord:
    """A paper, its setup (`SETUP_KEYS` and more) and its numbers jattn compares against."""

    key: str
    title: str
    authors: str
    year: int
    arxiv: str
    setup: dict[str, Fact]
    findings: tuple[Finding, ...]
    claims: tuple[Fact, ...] = ()


def _load() -> tuple[tuple[str, ...], dict[str, AnchorRecord]]:
    data = json.loads(PATH.read_text(encoding="utf-8"))
    records = {
        key: AnchorRecord(
            key=key,
            title=r["title"],
            authors=r["authors"],
            year=r["year"],
            arxiv=r["arxiv"],
            setup={k: Fact(**f) for k, f in r["setup"].items()},
            findings=tuple(Finding(**f) for f in r["findings"]),
            claims=tuple(Fact(**f) for f in r["claims"]),
        )
        for key, r in data["records"].items()
    }
    return tuple(data["setup_keys"]), records


SETUP_KEYS, RECORDS = _load()


def record(key: str) -> AnchorRecord:
    """The record of one anchor, by key (``"ruoss2023"``)."""
    if key not in RECORDS:
        raise KeyError(f"no anchor record {key!r}; known: {', '.join(RECORDS)}")
    return RECORDS[key]


def findings(key: str, task: str | None = None, scheme: str | None = None) -> list[Finding]:
    """The findings of one anchor, optionally of one task and scheme."""
    return [
        f
        for f in record(key).findings
        if (task is None or f.task == task) and (scheme is None or f.scheme == scheme)
    ]


def per_seed(key: str, task: str, scheme: str) -> list[float] | None:
    """An anchor's per-seed numbers (statistic ``..., seed N``) of one task and scheme;
    None where it holds none or one was not read."""
    found = [f for f in findings(key, task, scheme) if ", seed " in f.statistic]
    if not found or any(f.value is None for f in found):
        return None
    return [float(f.value) for f in found]


def mean_over_seeds(key: str, task: str, scheme: str) -> float:
    """The mean of an anchor's per-seed findings of one task and scheme.

    Raises:
      ValueError: the anchor holds no per-seed number for them, or one was not read.
    """
    found = [f for f in findings(key, task, scheme) if ", seed " in f.statistic]
    if not found:
        raise ValueError(f"{key} has no per-seed numbers for {task!r}, {scheme!r}")
    if any(f.value is None for f in found):
        raise ValueError(f"{key} has a per-seed number for {task!r}, {scheme!r} not read here")
    return statistics.mean(float(f.value) for f in found)


_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e-?\d+)?")


def numbers(key: str) -> set[float]:
    """Every number an anchor's record states: findings, per-seed means, and the numbers in
    its setup facts (``"reversing 6,250"`` gives 6250). A number quoted about this anchor
    must be one of these."""
    rec = record(key)
    out: set[float] = set()
    for f in rec.findings:
        if f.value is not None:
            out.add(float(f.value))
        out.update(float(m.replace(",", "")) for m in _NUMBER.findall(f"{f.task} {f.statistic}"))
    for f in rec.findings:
        if ", seed " in f.statistic:
            out.add(mean_over_seeds(key, f.task, f.scheme))
    for fact in list(rec.setup.values()) + list(rec.claims):
        if isinstance(fact.value, int | float):
            out.add(float(fact.value))
        elif isinstance(fact.value, str):
            out.update(float(m.replace(",", "")) for m in _NUMBER.findall(fact.value))
    return out
