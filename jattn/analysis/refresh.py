"""A committed report's tables rebuilt from its ``results.csv``, with no workdir.

A grid's workdir (checkpoints, decode files) is not kept; its ``results.csv``
and ``results.md`` are. When the report's rules change (Holm's adjustment,
the comparisons section), `refresh` rewrites what the CSV determines: the
group table (every cell recomputed from the per-run metrics; exact-match
counts are ``exact_match x num_decoded``) and the section "Comparisons with
the reference". What needs the decode files (by length, where outputs stop)
is kept as written. No CSV holds the machine: a report that records it keeps
its line, one written before reports recorded it reads "not recorded".

    python -m jattn.analysis.refresh docs/results docs/results/ontanon_reverse
"""

from __future__ import annotations

import csv
import os
import re
import sys

from jattn.analysis import comparisons, fit
from jattn.analysis import report as report_lib
from jattn.analysis.runs import exact_match_split

__all__ = ["groups_from_csv", "main", "refresh", "table_spec"]

_HEAD = re.compile(
    r"^\| group \| seeds \| (?P<metrics>.*?)(?: \| vs (?P<vs>.+) \((?P<on>[^()]+)\))? \|$"
)
_ANCHORS_OLD = re.compile(
    r"^Best of seeds \(Delétang et al\. and Ruoss et al\. report the best of 10; here of up to "
    r"(?P<n>\d+)\) beside"
)


def table_spec(markdown: str) -> tuple[list[str], str | None, tuple[str, ...]]:
    """(metrics, reference, within) of a report's group table, read from its header."""
    for line in markdown.splitlines():
        m = _HEAD.match(line)
        if m:
            metrics = m.group("metrics").split(" | ")
            vs = m.group("vs")
            if vs is None:
                return metrics, None, ()
            reference, _, within = vs.partition(", same ")
            return metrics, reference, tuple(w.strip() for w in within.split(",") if w.strip())
    raise ValueError("no group table (a '| group | seeds | ...' header) in the report")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def groups_from_csv(path: str, metrics: list[str]) -> dict[str, report_lib.Group]:
    """The finished runs of a ``results.csv`` folded into groups, in its order, as
    `report.groups_of` builds them from workdirs."""
    with open(path, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    groups: dict[str, report_lib.Group] = {}
    for r in rows:
        g = groups.setdefault(r["group"], report_lib.Group(r["group"]))
        if g.check is None:
            check = {}
            for key, value in r.items():
                parts = key.split("/")
                if len(parts) == 3 and parts[0] == "data" and _number(value) is not None:
                    check.setdefault(parts[1], {})[parts[2]] = float(value)
            g.check = check or None
        if r["status"] != "finished":
            continue
        g.seeds += 1
        for m in dict.fromkeys([*metrics, fit.METRIC]):
            if (v := _number(r.get(m) or "")) is not None:
                g.values.setdefault(m, []).append(v)
        for key in r:
            split = exact_match_split(key)
            em, n = _number(r[key] or ""), _number(r.get(f"eval/{split}/num_decoded") or "")
            if split and em is not None and n:
                g.counts.setdefault(split, []).append((round(em * n), int(n)))
    return groups


def refresh(folder: str, threshold: float = fit.DEFAULT_THRESHOLD) -> str:
    """The report ``folder/results.md`` with its group table and comparisons section
    rebuilt from ``folder/results.csv`` (returned, not written)."""
    with open(os.path.join(folder, "results.md"), encoding="utf-8") as f:
        old = f.read()
    metrics, reference, within = table_spec(old)
    groups = groups_from_csv(os.path.join(folder, "results.csv"), metrics)
    table, notes = report_lib.group_table(groups, metrics, reference, within)
    extra = []
    if reference:
        found = report_lib.comparisons(groups, metrics[0], reference, within)
        extra = comparisons.section(groups, metrics[0], found, threshold, None)
    lines = old.splitlines()
    start = next(i for i, line in enumerate(lines) if _HEAD.match(line))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    out = lines[:start] + table.splitlines() + lines[end:]
    # The notes under the table, and the comparisons section after it, are rebuilt too.
    i = start + len(table.splitlines())
    j = i + 1
    while j < len(out) and out[j].strip() and not out[j].startswith(("Reference:", "No comp")):
        j += 1
    out[i + 1 : j] = [f"{n}  " for n in notes]
    heading = next((k for k in range(i, len(out)) if out[k].startswith("## ")), len(out))
    if heading < len(out) and out[heading] == "## Comparisons with the reference":
        after = next(
            (k for k in range(heading + 1, len(out)) if out[k].startswith("## ")), len(out)
        )
        # A report written since reports record their machine keeps its line.
        kept = [line for line in out[heading:after] if line.startswith("Machine: ")]
        if kept:
            extra = [kept[0] if line.startswith("Machine: ") else line for line in extra]
        del out[heading:after]
    out[heading:heading] = extra
    text = "\n".join(_anchors_header(line) for line in out) + "\n"
    return text


def _anchors_header(line: str) -> str:
    """The old "As the anchors report" header claimed the anchors' seed count, unread."""
    m = _ANCHORS_OLD.match(line)
    if not m:
        return line
    return _ANCHORS_OLD.sub(
        f"Best of seeds (of up to {m.group('n')}; how many seeds the anchors ran and which "
        "they report was not read here, see docs/results/anchors.json) beside",
        line,
    )


def main(argv: list[str] | None = None) -> int:
    """Rewrite each named report folder's results.md in place."""
    for folder in argv if argv is not None else sys.argv[1:]:
        text = refresh(folder)
        with open(os.path.join(folder, "results.md"), "w", encoding="utf-8") as f:
            f.write(text)
        print(f"refreshed {folder}/results.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
