"""The report's data-check table: what each eval split holds, as the runs checked it.

Per split: the examples checked, those the final evaluation decoded, the share
of targets that can be produced from what training shows and the share longer
than training (`jattn.data.producibility.check`, written into each run's
``data_check.json``); `jattn.analysis.report` puts the table first.
"""

from __future__ import annotations

from jattn.analysis.runs import DATA_CHECK, is_number

__all__ = ["data_check_section", "fmt_share"]


def fmt_share(x: float) -> str:
    """A share as a percentage that reads 100% or 0% only when it is exactly that."""
    if 0.999 < x < 1.0:
        return "> 99.9%"
    return "< 0.1%" if 0.0 < x < 0.001 else f"{100 * x:.1f}%"


def data_check_section(rows, splits: list[str]) -> list[str]:
    """The data check in markdown: per eval split the number of examples checked,
    the number the final evaluation decoded (what exact match is over), the
    share of producible targets and the share longer than training, from the
    first run that has a check, and whether the runs agree."""
    checked = [r for r in rows if r.get("check")]
    if not checked:
        listed = ", ".join(splits) if splits else "the eval splits"
        return [f"Data check: not checked ({listed}; no run has {DATA_CHECK})."]
    first = checked[0]
    check = first["check"]
    lines = [
        "| split | examples | decoded | producible targets | longer than training | "
        "target tokens training never shows |",
        "|---|---:|---:|---:|---:|---|",
    ]
    decoded = first.get("counts") or {}  # split -> (k correct, N decoded)
    for split, c in check.items():
        if split == "train" or not isinstance(c, dict):
            continue
        cells = [
            f"{c['examples']:,}" if is_number(c.get("examples")) else "-",
            f"{decoded[split][1]:,}" if split in decoded else "-",
            fmt_share(c["producible"]) if is_number(c.get("producible")) else "not checked",
            fmt_share(c["longer_than_train"]) if is_number(c.get("longer_than_train")) else "-",
            " ".join(f"`{t}`" for t in c.get("unseen_tokens") or []) or "-",
        ]
        lines.append(f"| {split} | " + " | ".join(cells) + " |")
    train = check.get("train") or {}
    notes = [f"From run {first['run'].name}"]
    if train:
        notes.append(
            f"training: targets up to {train.get('max_target_tokens', '?')} tokens, "
            f"inputs up to {train.get('max_input_tokens', '?')}"
        )
    differ = [r["run"].name for r in checked[1:] if r["check"] != check]
    if differ:
        notes.append(
            f"runs disagree: {', '.join(differ)} differ (each group's cells use its own check)"
        )
    elif len(checked) == len(rows):
        notes.append("every run agrees")
    unchecked = [r["run"].name for r in rows if not r.get("check")]
    if unchecked:
        notes.append(f"not checked: {', '.join(unchecked)}")
    return [*lines, "", "; ".join(notes) + "."]
