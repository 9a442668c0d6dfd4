"""The report's comparisons with the reference, as a reviewer reads them.

`jattn.analysis.report`'s group table says per group "differs" or "within
noise" after Holm's adjustment. This section gives each comparison's parts,
so a reader can see what the verdict rests on and what it could not see:

- the test (Welch over seeds, or the counts where no seed varies), its raw p
  and its Holm-adjusted p among every comparison of the grid;
- a seed-and-example bootstrap p from the exact-match counts
  (`stats.seed_example_bootstrap`), shown beside, not used by the verdict:
  with three seeds it sees less seed spread than there is;
- the smallest difference the comparison would have detected with 80% power
  at Holm's strictest level, from the seed spread measured
  (`stats.detectable_difference`), so "within noise" is read with its power;
- each side's fit inside the training lengths, per seed (`jattn.analysis.fit`);
- the machine the report was written on (`machine`), since float32 results
  move across CPUs: another instruction set rounds differently, and a rerun
  elsewhere lands inside the intervals, not on the same last digit.

The groups are `report.Group`-like values (``name``, ``seeds``, ``values``,
``counts``); `section` takes them with the comparisons `report.comparisons`
made, so the two cannot disagree.
"""

from __future__ import annotations

import os
import platform
from typing import Any

from jattn.analysis import fit, stats
from jattn.analysis.runs import exact_match_split

__all__ = ["FLOAT32_NOTE", "NOT_RECORDED", "machine", "machine_line", "section"]

FLOAT32_NOTE = (
    "float32 results move across CPUs (another instruction set rounds differently): a rerun "
    "on another machine lands within these intervals, not on the same last digit, which is "
    "reproducible on the same machine only."
)
NOT_RECORDED = "not recorded in this grid's files (reports did not record it when it ran)"


def machine() -> dict[str, Any]:
    """The machine this process runs on: CPU model, logical cores, jax and jaxlib versions."""
    import jax  # noqa: PLC0415 -- only a report being written needs it
    import jaxlib  # noqa: PLC0415

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "?"),
    }


def machine_line(found: dict[str, Any] | None) -> str:
    """``Machine: AMD EPYC 7B13, 2 cores; jax 0.10.2, jaxlib 0.10.2.`` and the float32 note;
    None: the grid's files do not say."""
    if found is None:
        return f"Machine: {NOT_RECORDED}. {FLOAT32_NOTE}"
    return (
        f"Machine: {found['cpu']}, {found['cores']} cores; jax {found['jax']}, "
        f"jaxlib {found['jaxlib']}. {FLOAT32_NOTE}"
    )


def _fit_cell(group, threshold: float) -> str:
    values = group.values.get(fit.METRIC)
    if not values:
        return "-"
    return f"{fit.fitted(values, threshold)} of {len(values)} (lowest {min(values):.3f})"


def _mdd(mdd: float | None, metric: str) -> str:
    """A detectable difference; past a share's whole range (1) no difference is detectable."""
    if mdd is None:
        return "-"
    return "> 1 (none)" if mdd > 1 and exact_match_split(metric) else f"{mdd:.3f}"


def _p(p: float | None) -> str:
    if p is None:
        return "-"
    return "<0.001" if p < 0.001 else f"{p:.2g}"


def section(
    groups: dict[str, Any],
    metric: str,
    found: dict[str, tuple[str | None, stats.Comparison | str, float | None]],
    threshold: float = fit.DEFAULT_THRESHOLD,
    machine_found: dict[str, Any] | None = None,
) -> list[str]:
    """The report's section "Comparisons with the reference" (markdown lines).

    Args:
      groups: name -> group, as `report.groups_of` builds them.
      metric: the compared metric (the report's first).
      found: `report.comparisons` of these groups on `metric`.
      threshold: the fit threshold on validation exact match.
      machine_found: `machine()` of the machine that wrote the report, or None
        where the grid's files do not say.
    """
    tested = [n for n, (_, _, adjusted) in found.items() if adjusted is not None]
    m = len(tested)
    strict = stats.ALPHA / max(m, 1)  # Holm's first step
    split = exact_match_split(metric)
    lines = [
        "## Comparisons with the reference",
        "",
        f"| group | against | test | p | Holm p | verdict | bootstrap p | detectable "
        f"(80%, alpha {stats.ALPHA}) | fitted seeds (group) | fitted seeds (reference) |",
        "|---|---|---|---:|---:|---|---:|---:|---|---|",
    ]
    detectable = []
    for name, (ref, c, adjusted) in found.items():
        if ref is None or ref == name or not isinstance(c, stats.Comparison):
            continue
        g, r = groups[name], groups[ref]
        counts_g = g.counts.get(split) if split else None
        counts_r = r.counts.get(split) if split else None
        boot = (
            stats.seed_example_bootstrap(counts_r, counts_g)
            if counts_g and counts_r and len(counts_g) == g.seeds and len(counts_r) == r.seeds
            else None
        )
        mdd = stats.detectable_difference(r.values[metric], g.values[metric])
        if mdd is not None:
            strictest = stats.detectable_difference(r.values[metric], g.values[metric], strict)
            detectable.append((mdd, strictest))
        lines.append(
            f"| {name} | {ref} | {c.test} | {_p(c.p)} | {_p(adjusted)} | "
            f"{c.verdict(adjusted=adjusted).split(' (')[0]} | {_p(boot)} | "
            f"{_mdd(mdd, metric)} | {_fit_cell(g, threshold)} | "
            f"{_fit_cell(r, threshold)} |"
        )
    if len(lines) == 4:
        return []
    family = f"for the {m} comparisons tested" if m else "(no comparison could be tested: one seed)"
    notes = [
        f"{metric}: the test, its raw p and its p adjusted by Holm's method {family}; the "
        f'verdict ("differs" where the adjusted p is below {stats.ALPHA}) is the one the '
        "group table and every verdict built on this report use.",
        "Bootstrap p: seeds resampled, then each drawn seed's decoded examples (k of N), "
        "10,000 draws; it uses the counts where seeds are few, and with three seeds it sees "
        "less seed spread than there is, so it is shown beside the verdict and not used by it.",
        f"Detectable: the smallest true difference of means a Welch test with these seeds "
        f"would find with 80% power at alpha {stats.ALPHA}, from the seed spread the two "
        "groups measured; '-' where neither varies, '> 1 (none)' where no share could differ "
        "by that much.",
    ]
    if detectable:
        low, high = min(d for d, _ in detectable), max(d for d, _ in detectable)
        tightest = min(d for _, d in detectable)
        notes.append(
            f"This grid's seeds detect differences of {_mdd(low, metric)} to "
            f"{_mdd(high, metric)} in {metric} (80% power, alpha {stats.ALPHA}), and of at "
            f"least {_mdd(tightest, metric)} at Holm's strictest step (alpha {strict:.2g}); "
            'a smaller difference reads "within noise" whether or not it is there.'
        )
    notes.append(
        f"Fitted seeds: validation exact match at least {threshold:g}, per seed; "
        "a comparison with a side not fitted in every seed is no verdict on the scheme."
    )
    notes.append(machine_line(machine_found))
    return [*lines, "", *[f"{n}  " for n in notes[:-1]], notes[-1], ""]
