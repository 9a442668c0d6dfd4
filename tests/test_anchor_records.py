"""The anchor records, and the tables of published comparisons against their sources.

Contracts:

- every record (docs/results/anchors.json, read by tests/anchor_data.py) names
  its paper and states the whole setup, and every fact and number has a
  source; a number not read here is ``None`` with a reason, never a guess;
- every number in docs/results.md's comparison table comes from a source: the
  "their finding" numbers are numbers of that anchor's record, and the
  "jattn's finding" numbers (means with their 95% t intervals, best-of-seed
  differences, p-values, steps) are recomputed here from the grid's
  ``results.csv`` (or read from its ``results.md``) in docs/results*/, and
  nothing else in the cell is a number;
- every verdict, in the README and in docs/results.md, is the output of
  `jattn.analysis.verdicts.verdict` on the grid's results.csv and the record.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import pathlib
import re
import statistics

import anchor_data as anchor_records
import pytest

from jattn.analysis import fit, report, verdicts

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
# Names whose digits are not numbers of any finding.
NAMES = ("T5", "rel2", "results/", "anchors.json")

# -- the records -------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(anchor_records.RECORDS))
def test_every_record_names_its_paper_and_states_its_whole_setup(key):
    rec = anchor_records.record(key)
    assert rec.title and rec.authors
    assert 2017 <= rec.year <= 2030
    assert re.fullmatch(r"\d{4}\.\d{5}", rec.arxiv), rec.arxiv
    missing = [k for k in anchor_records.SETUP_KEYS if k not in rec.setup]
    assert not missing, f"{key} does not state {missing}"


@pytest.mark.parametrize("key", sorted(anchor_records.RECORDS))
def test_every_fact_and_number_has_a_source_and_an_unread_one_a_reason(key):
    rec = anchor_records.record(key)
    facts = [(f"setup {k}", f.value, f.source, f.reason) for k, f in rec.setup.items()]
    facts += [("claim", f.value, f.source, f.reason) for f in rec.claims]
    facts += [(f"{f.task}/{f.scheme}", f.value, f.source, f.reason) for f in rec.findings]
    assert rec.findings, f"{key} holds no finding"
    for name, value, source, reason in facts:
        assert source.strip(), f"{key} {name}: no source"
        if value is None:
            assert reason.strip(), f"{key} {name}: not read, and no reason given"
        else:
            assert not reason, f"{key} {name}: a value and a reason it was not read"


def test_unread_numbers_are_none_and_the_accessors_refuse_them():
    # The papers' tables could not be read here: no record may hold a number from them.
    for key in ("ontanon2022", "ruoss2023", "deletang2023", "csordas2021"):
        tables = [f for f in anchor_records.findings(key) if "table" in f.reason]
        assert tables and all(f.value is None for f in tables), key
    with pytest.raises(KeyError, match="no anchor record"):
        anchor_records.record("vaswani2017")
    with pytest.raises(ValueError, match="no per-seed numbers"):
        anchor_records.mean_over_seeds("ruoss2023", "15 tasks", "all")


def test_per_seed_means_are_means_of_the_recorded_seeds():
    seeds = [
        f.value
        for f in anchor_records.findings("kazemnejad2023", "copy", "t5")
        if ", seed " in f.statistic
    ]
    assert len(seeds) == anchor_records.record("kazemnejad2023").setup["seeds"].value == 3
    assert anchor_records.mean_over_seeds("kazemnejad2023", "copy", "t5") == pytest.approx(
        statistics.mean(seeds)
    )


def test_their_repeated_token_copy_is_where_alibi_falls_below_nope():
    """Kazemnejad et al.'s own per-seed results (sanity_check.jsonl, splits rsc, rsc2x,
    rdc): NoPE 0.9856 and ALiBi 0.2893 on rsc (means of 0.9835, 0.9808, 0.9925 and of
    0.279, 0.2655, 0.3234); on every repeated variant every ALiBi seed is below every
    NoPE seed, unlike random-token copy (ALiBi 0.331 against NoPE 0.305)."""
    mean = anchor_records.mean_over_seeds
    assert mean("kazemnejad2023", "copy_rsc", "none") == pytest.approx(0.98560, abs=5e-6)
    assert mean("kazemnejad2023", "copy_rsc", "alibi") == pytest.approx(0.28930, abs=5e-6)
    for task in ("copy_rsc", "copy_rsc2x", "copy_rdc"):
        nope, alibi = (
            [f.value for f in anchor_records.findings("kazemnejad2023", task, scheme)]
            for scheme in ("none", "alibi")
        )
        assert len(nope) == len(alibi) == 3 and max(alibi) < min(nope), task
    assert mean("kazemnejad2023", "copy", "alibi") > mean("kazemnejad2023", "copy", "none")


# -- the README's table --------------------------------------------------------------------


def readme_table() -> list[dict[str, str]]:
    """docs/results.md's table of published comparisons (the details of the README's)
    as one dict a row (anchor, their, jattn, verdict, section)."""
    lines = (DOCS / "results.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| anchor | their finding"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 5, f"a comparison row without 5 cells: {line[:80]}"
        rows.append(
            dict(zip(("anchor", "their", "jattn", "verdict", "section"), cells, strict=True))
        )
    return rows


def numbers_in(text: str) -> list[tuple[float, int, bool]]:
    """The numbers of a cell as (value, decimals, is a percentage), names like T5 left out."""
    for name in NAMES:
        text = text.replace(name, " ")
    out = []
    for m in NUMBER.finditer(text):
        s = m.group().rstrip(",")
        decimals = len(s.split(".")[1]) if "." in s else 0
        out.append((float(s.replace(",", "")), decimals, text[m.end() : m.end() + 1] == "%"))
    return out


@functools.cache
def runs(folder: str) -> tuple[dict[str, str], ...]:
    with open(DOCS / folder / "results.csv", encoding="utf-8") as f:
        return tuple(r for r in csv.DictReader(f) if r["status"] == "finished")


def values(folder: str, group: str, metric: str) -> list[float]:
    out = [float(r[metric]) for r in runs(folder) if r["group"] == group]
    assert out, f"no finished run of {group} in {folder}"
    return out


def ci(folder: str, group: str, metric: str = "eval/test_longer/exact_match") -> str:
    """The cell the report writes: mean [95% t interval], recomputed from results.csv."""
    return report.fmt_mean_ci(values(folder, group, metric), metric)


def mean(folder: str, group: str, metric: str = "eval/test_longer/exact_match") -> str:
    return f"{statistics.mean(values(folder, group, metric)):.3f}"


def steps(*folders: str) -> str:
    found = {int(r["step"]) for folder in folders for r in runs(folder)}
    assert len(found) == 1, f"{folders} trained for different numbers of steps: {found}"
    return f"{found.pop():,} steps"


def p_value(folder: str, group: str) -> str:
    """The p of a group's comparison as its report's results.md writes it."""
    text = (DOCS / folder / "results.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith(f"| {group} |"))
    return f"p = {re.search(r'p=([0-9.]+)', row).group(1)}"


def holm_p(folder: str, group: str) -> str:
    """The Holm-adjusted p of a group's comparison as its report's results.md writes it."""
    text = (DOCS / folder / "results.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith(f"| {group} |"))
    return f"Holm p = {re.search(r'Holm p=([0-9.]+)', row).group(1)}"


def csordas_validation(folder: str) -> str:
    """The cell's 'validation <Transformer-XL> and <sinusoidal>': the mean validation
    exact match of a Csordás grid's unshared pair."""
    return "validation " + " and ".join(
        mean(folder, f"position={p},shared=False", "eval/validation/exact_match")
        for p in ("transformer_xl", "sinusoidal")
    )


def signed(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")


def same_as_decoded(folder: str) -> str:
    """``0 of 49,152 examples differ``: where a grid's teacher-forced sequence accuracy
    and decoded exact match disagree, as its report counts them over the decoded
    examples (the anchors' by-length table); every run's two numbers are equal too."""
    for r in runs(folder):
        for split in ("test_longer", "validation"):
            em, tf = (r[f"eval/{split}/{m}"] for m in ("exact_match", "tf_sequence_accuracy"))
            assert float(em) == float(tf), (folder, r["run"], split, em, tf)
    text = (DOCS / folder / "results.md").read_text(encoding="utf-8")
    found = re.search(r"disagrees with decoded exact match on ([\d,]+) of these ([\d,]+)", text)
    return f"{found.group(1)} of {found.group(2)} examples differ"


def randomized() -> list[str]:
    """The Ruoss row: best-of-seeds differences of teacher-forced accuracy past training
    (their kind of metric) and mean exact-match differences, random minus plain."""
    folder, metric = "results/randomized", "eval/test_longer/beyond_train/accuracy"
    schemes = sorted({r["position"] for r in runs(folder)})
    seeds = {
        len(values(folder, f"position={s},random={a}", metric)) for s in schemes for a in (0, 128)
    }
    best = {
        s: max(values(folder, f"position={s},random=128", metric))
        - max(values(folder, f"position={s},random=0", metric))
        for s in schemes
    }
    exact = [
        statistics.mean(values(folder, f"position={s},random=128", "eval/test_longer/exact_match"))
        - statistics.mean(values(folder, f"position={s},random=0", "eval/test_longer/exact_match"))
        for s in schemes
    ]
    rope = [mean(folder, f"position=rope,random={a}") for a in (0, 128)]
    return [
        f"mean over {len(schemes)} schemes",
        signed(statistics.mean(best.values())),
        f"best of {seeds.pop()} seeds",
        f"{signed(min(best.values()))} to {signed(max(best.values()))}",
        signed(statistics.mean(exact)),
        f"{rope[0]} -> {rope[1]}",
        p_value(folder, "position=rope,random=128"),
        holm_p(folder, "position=rope,random=128"),
    ]


# The slice's final checkpoints evaluated again with the by-length score (every
# other metric equal to results/deletang_reverse_slice's, to the last digit).
DEL_SLICE = "results/deletang_reverse_slice_reeval"
TAPE_SCHEMES = {
    "sinusoidal": "sinusoidal",
    "rope": "RoPE",
    "alibi": "ALiBi",
    "t5": "T5",
    "learned": "learned",
}
TAPE_PAST = "eval/test_longer/beyond_train/length_avg_accuracy"  # their score
TAPE_POOLED = "eval/test_longer/beyond_train/accuracy"


def _tape(folder: str, scheme: str, m: int, metric: str) -> float:
    """The one seed's value of `scheme` with `random_positions` = m (0: plain)."""
    (value,) = values(folder, f"position={scheme},random={m},task=reverse_string/test100", metric)
    return value


def _tape_pairs(folder: str, metric: str = TAPE_PAST) -> dict[str, list[float]]:
    """Each scheme's [plain, randomised] token accuracy past the training lengths."""
    return {s: [_tape(folder, s, m, metric) for m in (0, 512)] for s in TAPE_SCHEMES}


def tape_slice(folder: str) -> list[str]:
    """Ruoss et al. on Delétang's tape, one task and one seed a scheme: each
    scheme's plain -> randomised token accuracy past the training lengths
    (per length, averaged over lengths), the mean difference, the same pooled
    over tokens (and ALiBi's), NoPE's pair, and each arm's validation exact
    match (lowest-highest over the schemes)."""
    pairs = _tape_pairs(folder)
    diffs = [b - a for a, b in pairs.values()]
    pooled = {s: b - a for s, (a, b) in _tape_pairs(folder, TAPE_POOLED).items()}

    def span(m: int) -> str:
        found = [_tape(folder, s, m, "eval/validation/exact_match") for s in TAPE_SCHEMES]
        return f"{min(found):.3f}–{max(found):.3f}"

    return [
        steps(folder),
        *(f"{TAPE_SCHEMES[s]} {a:.3f} -> {b:.3f}" for s, (a, b) in pairs.items()),
        f"mean over the {len(diffs)} schemes {signed(statistics.mean(diffs))}",
        f"pooled over tokens {signed(statistics.mean(pooled.values()))}",
        f"ALiBi {signed(pooled['alibi'])}",
        f"NoPE {_tape(folder, 'none', 0, TAPE_PAST):.3f} -> "
        f"{_tape(folder, 'none', 512, TAPE_PAST):.3f}",
        f"validation exact match plain {span(0)}, randomised {span(512)}",
    ]


# Each row: the record of its anchor, and what its jattn cell must say, computed from files.
XEON = "results_rerun_xeon"  # the main job on an Intel Xeon, re-evaluated with their metric
TF = "eval/test_longer/tf_sequence_accuracy"
ONT_REV = "results/ontanon_reverse"
ONT_DUP = "results/ontanon_duplicate"
DUP_XEON = "results/duplicate_rerun_xeon"  # the duplication grid rerun with their metric
SHAW_XEON = "results/shaw_variants_rerun_xeon"  # Shaw's terms rerun with their metric
REV_XEON = "results/ontanon_reverse_rerun_xeon"  # reversing at their budget, their metric
DUPB_XEON = "results/ontanon_duplicate_rerun_xeon"  # duplication at their budget, their metric
# Duplication at their budget's schemes, in the order its cell gives them.
DUPB = (("ALiBi", "alibi"), ("T5", "t5"), ("RoPE", "rope"), ("sinusoidal", "sinusoidal"),
        ("Shaw", "shaw"), ("sinusoidal+Shaw", "sinusoidal+shaw"))  # fmt: skip
KZ_LONG = ("results/decoder_only_long", "results/decoder_only_long_alibi_rope")
KZ_SIN = "results/decoder_only_long_sinusoidal"
KZ_REP = "results/decoder_only_repeated"
KZ_REV = "results/decoder_only_reverse_long"
KZ_NAMES = {
    "none": "NoPE",
    "sinusoidal": "sinusoidal",
    "alibi": "ALiBi",
    "t5": "T5",
    "rope": "RoPE",
}
DD = "results/decoder_only_data_dependent"  # the schemes of the tokens, decoder-only
DD_NAMES = {"forgetting": "forget gate", "cope": "CoPE", "stick_breaking": "stick-breaking"}
# Each paper's scheme against the Transformer it compares with (RoPE), on reversal.
DD_PAPERS = (
    ("Lin et al. 2025, forget gate (FoX)", "lin2025", "length extrapolation", "forgetting"),
    ("Golovneva et al. 2024, CoPE", "golovneva2024", "selective copy, counting, Flip-Flop", "cope"),
    ("Tan et al. 2025, stick-breaking", "tan2025", "length generalisation", "stick_breaking"),
)


# The schemes of the tokens at 3,600 steps, RoPE beside them (no NoPE), by task: the
# forget gate and stick-breaking on both tasks, CoPE on copy (a grid of its own).
DD_LONG = {
    "reverse": ("results/decoder_only_data_dependent_long",),
    "copy": (
        "results/decoder_only_data_dependent_copy_long",
        "results/decoder_only_cope_copy_long",
    ),
}


def long_grid(scheme: str, task: str) -> str | None:
    """The 3,600-step grid that trained `scheme` on `task`, if one did."""
    trained = (f for f in DD_LONG[task] if f"position={scheme},task=kz_{task}" in groups_of(f))
    return next(trained, None)


def dd_reverse(scheme: str) -> str:
    """The reverse grid a data-dependent scheme's verdict reads: the longest that trained it."""
    return long_grid(scheme, "reverse") or DD


def data_dependent(scheme: str) -> list[str]:
    """A data-dependent scheme's jattn cell: at 3,600 steps (on each task where it was
    trained so long) beside RoPE; then at 1,200 steps beside RoPE and NoPE."""
    out = []
    long = {task: f for task in DD_LONG if (f := long_grid(scheme, task))}
    if long:
        out.append(steps(*long.values()))
        for task, folder in long.items():
            out.append(f"`kz_{task}`")
            for s in (scheme, "rope"):
                out.append(f"{NICE[s]} {ci(folder, f'position={s},task=kz_{task}')}")
    out.append(steps(DD))
    for task in ("reverse", "copy"):
        out.append(f"`kz_{task}`")
        for s in (scheme, "rope", "none"):
            out.append(f"{NICE[s]} {ci(DD, f'position={s},task=kz_{task}')}")
    return list(dict.fromkeys(out))  # a task's name once: the check takes out every copy


SPECS = {
    "Ontañón et al. 2022, reversing digits": (
        "ontanon2022",
        lambda: [
            f"T5 {ci('results', 'position=t5')}",
            f"sinusoidal+Shaw {ci('results', 'position=sinusoidal+shaw')}",
            f"sinusoidal {ci('results', 'position=sinusoidal')}",
            steps("results"),
            f"T5 {ci(XEON, 'position=t5', TF)}",
            f"sinusoidal+Shaw {ci(XEON, 'position=sinusoidal+shaw', TF)}",
            f"sinusoidal {ci(XEON, 'position=sinusoidal', TF)}",
            same_as_decoded(XEON),
        ],
    ),
    "Ontañón et al. 2022, reversing at their budget": (
        "ontanon2022",
        lambda: [
            # First: some of the rerun's cells are the same text as the table's.
            ", ".join(
                f"{name} {ci(REV_XEON, f'position={scheme}', TF)}"
                for name, scheme in (
                    ("T5", "t5"),
                    ("ALiBi", "alibi"),
                    ("sinusoidal", "sinusoidal"),
                    ("sinusoidal+Shaw", "sinusoidal+shaw"),
                    ("Shaw", "shaw"),
                )
            ),
            same_as_decoded(REV_XEON),
            steps(ONT_REV, REV_XEON),
            f"T5 {ci(ONT_REV, 'position=t5')}",
            f"ALiBi {ci(ONT_REV, 'position=alibi')}",
            f"sinusoidal {ci(ONT_REV, 'position=sinusoidal')}",
            f"sinusoidal+Shaw {ci(ONT_REV, 'position=sinusoidal+shaw')}",
            f"Shaw {ci(ONT_REV, 'position=shaw')}",
        ],
    ),
    "Ontañón et al. 2022, Shaw's terms (rel-e, rel-b, rel-eb, rel2)": (
        "ontanon2022",
        lambda: [
            f"rel-e {ci('results_shaw_variants', 'rel2=false,terms=key')}",
            f"rel-b {ci('results_shaw_variants', 'rel2=false,terms=bias')}",
            f"rel-eb {ci('results_shaw_variants', 'rel2=false,terms=key+bias')}",
            f"key embeddings {ci('results_shaw_variants', 'rel2=true,terms=key')}",
            steps("results_shaw_variants", SHAW_XEON),
            f"rel-e {ci(SHAW_XEON, 'rel2=false,terms=key', TF)}",
            f"rel-b {ci(SHAW_XEON, 'rel2=false,terms=bias', TF)}",
            f"rel-eb {ci(SHAW_XEON, 'rel2=false,terms=key+bias', TF)}",
            f"key embeddings {ci(SHAW_XEON, 'rel2=true,terms=key', TF)}",
            same_as_decoded(SHAW_XEON),
        ],
    ),
    "Ontañón et al. 2022, duplication": (
        "ontanon2022",
        lambda: [
            # First: the rerun's sinusoidal cell is the same text as the table's.
            f"T5 {ci(DUP_XEON, 'position=t5', TF)} and sinusoidal "
            f"{ci(DUP_XEON, 'position=sinusoidal', TF)}",
            same_as_decoded(DUP_XEON),
            f"{ci('results/duplicate', 'position=t5')} vs",
            f"sinusoidal {ci('results/duplicate', 'position=sinusoidal')}",
            steps("results/duplicate", DUP_XEON),  # one number of steps for both
        ],
    ),
    "Ontañón et al. 2022, duplication at their budget": (
        "ontanon2022",
        lambda: [
            # First: some of the rerun's cells are the same text as the table's.
            ", ".join(f"{name} {ci(DUPB_XEON, f'position={scheme}', TF)}" for name, scheme in DUPB),
            same_as_decoded(DUPB_XEON),
            steps(ONT_DUP, DUPB_XEON),
            *(f"{name} {ci(ONT_DUP, f'position={scheme}')}" for name, scheme in DUPB),
        ],
    ),
    "Kazemnejad et al. 2023, decoder-only copy": (
        "kazemnejad2023",
        lambda: [
            steps(*KZ_LONG, KZ_SIN),
            f"ALiBi {ci(KZ_LONG[1], 'position=alibi,task=kz_copy')}",
            f"NoPE {ci(KZ_LONG[0], 'position=none,task=kz_copy')}",
            f"T5 {ci(KZ_LONG[0], 'position=t5,task=kz_copy')}",
            f"sinusoidal {ci(KZ_SIN, 'position=sinusoidal,task=kz_copy')}",
            f"RoPE {ci(KZ_LONG[1], 'position=rope,task=kz_copy')}",
        ],
    ),
    "Kazemnejad et al. 2023, decoder-only reverse": (
        "kazemnejad2023",
        lambda: [
            steps(KZ_REV),
            "validation "
            + mean(KZ_REV, "position=none,task=kz_reverse", "eval/validation/exact_match"),
            f"ALiBi {ci(KZ_REV, 'position=alibi,task=kz_reverse')}",
            f"NoPE {ci(KZ_REV, 'position=none,task=kz_reverse')}",
            f"T5 {ci(KZ_REV, 'position=t5,task=kz_reverse')}",
            f"sinusoidal {ci(KZ_REV, 'position=sinusoidal,task=kz_reverse')}",
            f"RoPE {ci(KZ_REV, 'position=rope,task=kz_reverse')}",
        ],
    ),
    **{
        f"Kazemnejad et al. 2023, {title} ({task})": (
            "kazemnejad2023",
            lambda task=task, order=order: [
                steps(KZ_REP),
                f"`{task}`",
                *(
                    f"{KZ_NAMES[scheme]} {ci(KZ_REP, f'position={scheme},task=kz_copy_{task}')}"
                    for scheme in order.split()
                ),
            ],
        )
        for title, task, order in (
            ("repeated-token copy", "rsc", "none sinusoidal alibi t5 rope"),
            ("one token replaced", "rdc", "sinusoidal none t5 alibi rope"),
        )
    },
    "Ruoss et al. 2023, randomised positions": ("ruoss2023", randomized),
    "Ruoss et al. 2023, on their encoder-only tape (reverse_string, six schemes)": (
        "ruoss2023",
        lambda: tape_slice(DEL_SLICE),
    ),
    "Csordás et al. 2021, SCAN cutoff 26": (
        "csordas2021",
        lambda: [
            steps("results/csordas_long"),
            "Transformer-XL relative "
            + ci("results/csordas_long", "position=transformer_xl,shared=False"),
            f"sinusoidal {ci('results/csordas_long', 'position=sinusoidal,shared=False')}",
            csordas_validation("results/csordas_long"),
            steps("results/csordas"),
            "Transformer-XL relative "
            + ci("results/csordas", "position=transformer_xl,shared=False"),
            f"shared layers {ci('results/csordas', 'position=transformer_xl,shared=True')}",
            f"sinusoidal {ci('results/csordas', 'position=sinusoidal,shared=False')}",
            csordas_validation("results/csordas"),
            f"RoPE {ci('results/scan', 'position=rope')}",
            f"Shaw {ci('results/scan', 'position=shaw')}",
            f"sinusoidal {ci('results/scan', 'position=sinusoidal')}",
            steps("results/scan"),
            f"RoPE at {steps('results/scan_long')} {ci('results/scan_long', 'position=rope')}",
        ],
    ),
    **{
        anchor: (key, lambda scheme=scheme: data_dependent(scheme))
        for anchor, key, _, scheme in DD_PAPERS
    },
}


def test_the_detailed_table_has_one_spec_a_row():
    assert [r["anchor"] for r in readme_table()] == list(SPECS) == list(ROWS)


@pytest.mark.parametrize("anchor", list(SPECS))
def test_jattn_numbers_equal_the_grid_reports(anchor):
    row = next(r for r in readme_table() if r["anchor"] == anchor)
    cell = row["jattn"]
    for expected in SPECS[anchor][1]():
        assert expected in cell, f"{anchor}: jattn cell lacks {expected!r} (from docs/)"
        cell = cell.replace(expected, " ")
    assert not numbers_in(cell), f"{anchor}: jattn numbers with no source: {cell!r}"


@pytest.mark.parametrize("anchor", list(SPECS))
def test_their_numbers_are_numbers_of_the_anchor_record(anchor):
    row = next(r for r in readme_table() if r["anchor"] == anchor)
    key = SPECS[anchor][0]
    assert "anchors.json" in row["their"], f"{anchor}: their finding cites no record"
    known = anchor_records.numbers(key)

    def theirs(value, decimals, percent):
        tol = 0.5 * 10.0**-decimals + 1e-9  # the README rounds to the digits it shows
        return any(abs(value - k) <= tol for k in known) or (
            percent and any(abs(value / 100 - k) <= tol / 100 for k in known)
        )

    for value, decimals, percent in numbers_in(row["their"]):
        assert theirs(value, decimals, percent), (
            f"{anchor}: {value} is not a number of {key}'s record"
        )


# -- the verdicts: computed by jattn.analysis.verdicts from the files ----------------------

NICE = {**KZ_NAMES, "learned": "learned", "shaw": "Shaw", "sinusoidal+shaw": "sinusoidal+Shaw",
        "transformer_xl": "Transformer-XL", **DD_NAMES}  # fmt: skip


def groups_of(folder: str) -> list[str]:
    return list(dict.fromkeys(r["group"] for r in runs(folder)))


def label(group: str) -> str:
    """``position=alibi,task=kz_copy`` -> ``ALiBi``; other axes kept (``random=128``)."""
    parts = dict(p.split("=", 1) for p in group.split(","))
    name = NICE.get(parts.pop("position", ""), "")
    parts.pop("task", None)
    rest = ",".join(f"{k}={v}" for k, v in parts.items())
    return " ".join(x for x in (name, rest) if x) or group


# Each row: the anchor's record, the task in it, and the compared groups as
# (record scheme, folder, group). A scheme whose numbers the record lacks is None there.
def _kz(task: str, folders: dict[str, str]) -> tuple:
    return (
        "kazemnejad2023",
        task,
        [(s, f, f"position={s},task=kz_{task}") for s, f in folders.items()],
    )


KZ_COPY = {"none": KZ_LONG[0], "t5": KZ_LONG[0], "alibi": KZ_LONG[1], "rope": KZ_LONG[1],
           "sinusoidal": KZ_SIN}  # fmt: skip
ROWS = {
    **{
        anchor: ("ontanon2022", task, [(g, folder, g) for g in groups_of(folder)])
        for anchor, task, folder in (
            ("Ontañón et al. 2022, reversing digits", "reversing", XEON),
            ("Ontañón et al. 2022, reversing at their budget", "reversing", REV_XEON),
            (
                "Ontañón et al. 2022, Shaw's terms (rel-e, rel-b, rel-eb, rel2)",
                "reversing",
                SHAW_XEON,
            ),
            ("Ontañón et al. 2022, duplication", "duplication", DUP_XEON),
            ("Ontañón et al. 2022, duplication at their budget", "duplication", DUPB_XEON),
        )
    },  # fmt: skip
    "Kazemnejad et al. 2023, decoder-only copy": _kz("copy", KZ_COPY),
    "Kazemnejad et al. 2023, decoder-only reverse": _kz("reverse", dict.fromkeys(KZ_NAMES, KZ_REV)),
    "Kazemnejad et al. 2023, repeated-token copy (rsc)": _kz(
        "copy_rsc", dict.fromkeys(KZ_NAMES, KZ_REP)
    ),
    "Kazemnejad et al. 2023, one token replaced (rdc)": _kz(
        "copy_rdc", dict.fromkeys(KZ_NAMES, KZ_REP)
    ),
    "Ruoss et al. 2023, randomised positions": (
        "ruoss2023",
        "reverse",
        [(g, "results/randomized", g) for g in groups_of("results/randomized")],
    ),  # fmt: skip
    "Ruoss et al. 2023, on their encoder-only tape (reverse_string, six schemes)": (
        "ruoss2023",
        "reverse_string",
        [(g, DEL_SLICE, g) for g in groups_of(DEL_SLICE)],
    ),  # fmt: skip
    "Csordás et al. 2021, SCAN cutoff 26": (
        "csordas2021",
        "SCAN length split, cutoff 26",
        [
            ("relative", "results/csordas_long", "position=transformer_xl,shared=False"),
            ("sinusoidal", "results/csordas_long", "position=sinusoidal,shared=False"),
        ],
    ),  # fmt: skip
    # On reversal, from the 3,600-step grid where it trained the scheme.
    **{
        anchor: (
            key,
            task,
            [(s, dd_reverse(scheme), f"position={s},task=kz_reverse") for s in (scheme, "rope")],
        )
        for anchor, key, task, scheme in DD_PAPERS
    },
}
EXACT, VALIDATION = "eval/test_longer/exact_match", "eval/validation/exact_match"
# How a row's setup differs from its anchor's in kind (the rest: same kind). With their
# numbers unread these rows are "unchecked" first; once read, they are "not comparable"
# until the difference is removed. The metric is the anchor's own where the grid has it
# (`verdicts.compared_metric`: Ontañón et al.'s teacher-forced sequence accuracy).
SETUPS = {
    "Ruoss et al. 2023, randomised positions": verdicts.Setup(
        architecture=False,
        metric=False,
        differs="an encoder–decoder scored by exact match; theirs encoder-only with an output "
        "tape, scored by per-token accuracy",
    ),
    "Ruoss et al. 2023, on their encoder-only tape (reverse_string, six schemes)": (
        verdicts.Setup(metric=False, differs="exact match here; their score is token accuracy")
    ),
    **{
        anchor: verdicts.Setup(
            architecture=False,
            task=False,
            metric=False,
            differs="a 4-layer decoder of 200k parameters on copy and reverse, scored by exact "
            "match; theirs language models and their tasks, scored by perplexity or accuracy",
        )
        for anchor, *_ in DD_PAPERS
    },
}
NO_TEACHER_FORCED = (
    "decoded exact match here (this grid was evaluated before the teacher-forced score "
    "existed); their sequence accuracy is teacher-forced"
)


def compared(anchor: str) -> tuple[str, verdicts.Setup]:
    """The metric a row's verdict compares and its setup: the anchor's own metric
    (`verdicts.compared_metric` of its record) where every folder of the row has
    it, else decoded exact match with the metric marked as differing in kind."""
    key, _, rows = ROWS[anchor]
    metric, same = verdicts.compared_metric(anchor_records.record(key).setup["metric"].value)
    setup = SETUPS.get(anchor, verdicts.Setup())
    if all(metric in runs(folder)[0] for _, folder, _ in rows):
        return metric, dataclasses.replace(setup, metric=setup.metric and same)
    return EXACT, dataclasses.replace(setup, metric=False, differs=NO_TEACHER_FORCED)


def _counts(metric: str, rs) -> tuple[int, int]:
    """(k, N) of a metric summed over runs: exact match is over the decoded
    examples, teacher-forced sequence accuracy over the evaluated ones."""
    n_key = "num_evaluated" if metric.endswith("tf_sequence_accuracy") else "num_decoded"
    ns = [int(float(r[f"eval/test_longer/{n_key}"])) for r in rs]
    return round(sum(float(r[metric]) * n for r, n in zip(rs, ns, strict=True))), sum(ns)


def computed(anchor: str) -> tuple[verdicts.Verdict, str]:
    """The row's verdict by the rule, and its 'every scheme fitted' cell."""
    key, task, compared_groups = ROWS[anchor]
    metric, setup = compared(anchor)
    ours, theirs, fitted, counts, short = {}, {}, {}, {}, []
    for scheme, folder, group in compared_groups:
        rs = [r for r in runs(folder) if r["group"] == group]
        ours[scheme] = [float(r[metric]) for r in rs]
        seeds = [float(r[VALIDATION]) >= fit.DEFAULT_THRESHOLD for r in rs]
        fitted[scheme] = all(seeds)
        if not all(seeds):
            short.append(f"{label(group)} {sum(seeds)} of {len(seeds)}")
        counts[scheme] = _counts(metric, rs)
        theirs[scheme] = anchor_records.per_seed(key, task, scheme)
    v = verdicts.verdict(ours, theirs, fitted, setup, counts)
    names = ", ".join(short)
    cell = "yes" if not short else f"no: {names}" if len(names) <= 70 else (
        f"no: {len(short)} of {len(compared_groups)} groups")  # fmt: skip
    return v, cell


def test_ontanons_rows_compare_their_teacher_forced_score_where_the_grid_has_it():
    """The verdict reads the anchor's own metric: teacher-forced sequence accuracy
    for Ontañón et al. where the grid was evaluated with it, decoded exact match
    (and a metric that differs in kind) where it was not; exact match for the
    anchors that decode."""
    chosen = {anchor: compared(anchor) for anchor in ROWS}
    forced = [a for a, (m, _) in chosen.items() if m.endswith("tf_sequence_accuracy")]
    assert forced and all(a.startswith("Ontañón") for a in forced)
    for anchor, (metric, setup) in chosen.items():
        if anchor.startswith("Ontañón") and anchor not in forced:
            assert metric == EXACT and not setup.metric and setup.differs == NO_TEACHER_FORCED
        elif anchor in forced:
            assert setup.metric, anchor
        else:
            assert metric == EXACT, anchor


def verdict_cell(anchor: str) -> str:
    """The detailed table's verdict cell: the rule's word, its pairs and why."""
    return computed(anchor)[0].explain(NICE)


def readme_rows() -> list[list[str]]:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| anchor and task |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def metric_cell(anchor: str) -> str:
    """The README's "compared on" cell: the metric the verdict compares, and for a
    grid with their teacher-forced score how far it is from decoded exact match."""
    metric, setup = compared(anchor)
    if metric == TF:
        folder = ROWS[anchor][2][0][1]
        return f"their teacher-forced sequence accuracy; {same_as_decoded(folder)} (Intel Xeon)"
    if setup.differs == NO_TEACHER_FORCED:
        return (
            "decoded exact match; their teacher-forced score not evaluated (checkpoints not kept)"
        )
    return "decoded exact match" + ("" if setup.metric else "; their metric differs")


def test_the_readme_verdicts_are_the_rules_output():
    """The README's published comparisons: one row a comparison, its verdict the
    rule's word, its fit cell computed from the files, the metric its verdict
    compares, its link a section of docs/results.md; the detailed table there has
    the same rows."""
    expected = []
    for anchor in ROWS:
        v, fitted = computed(anchor)
        expected.append([anchor, v.word, fitted, metric_cell(anchor)])
    assert [r[:4] for r in readme_rows()] == expected
    for row in readme_rows():
        assert row[4].startswith("[details](docs/results.md#"), row


def test_the_detailed_verdicts_are_the_rules_output():
    for row in readme_table():
        assert row["verdict"] == verdict_cell(row["anchor"]), row["anchor"]
