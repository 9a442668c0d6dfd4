"""The verdict rule of the published comparisons, and the statistics it and the reports use.

Contracts: Holm's adjustment equals its definition computed by brute force;
the seed-and-example bootstrap is deterministic, symmetric and sees the counts
Welch ignores; the detectable difference is where a simulated Welch test
reaches 80% power; every branch of `jattn.analysis.verdicts.verdict` is
reached by the grid that should reach it.
"""

from __future__ import annotations

import itertools
import pathlib

import numpy as np
import pytest

from jattn.analysis import refresh, stats, verdicts

# -- Holm ------------------------------------------------------------------------------------


def _holm_by_definition(p: list[float]) -> list[float]:
    """Adjusted p_i = max over the j ranked at or below i of min(1, (m - rank_j) * p_j)."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    rank = {i: r for r, i in enumerate(order)}
    return [
        max(min(1.0, (m - rank[j]) * p[j]) for j in range(m) if rank[j] <= rank[i])
        for i in range(m)
    ]


@pytest.mark.parametrize("seed", range(5))
def test_holm_equals_its_definition(seed):
    p = list(np.random.default_rng(seed).uniform(0, 0.2, size=7))
    assert stats.holm(p) == pytest.approx(_holm_by_definition(p))


def test_holm_of_the_main_job_keeps_t5_alone():
    # The main job's Welch p against sinusoidal (docs/results/results.md, before Holm).
    raw = [0.1, 0.1, 0.51, 0.013, 0.051, 0.12, 0.0064]
    adjusted = stats.holm(raw)
    assert [a < stats.ALPHA for a in adjusted] == [False] * 6 + [True]
    assert adjusted[6] == pytest.approx(7 * 0.0064) and adjusted[3] == pytest.approx(6 * 0.013)
    assert stats.holm([]) == []
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        stats.holm([0.5, 1.5])


def test_a_verdict_says_differs_only_after_adjustment():
    c = stats.compare([0.1, 0.12, 0.14], [0.3, 0.33, 0.36])
    assert c.verdict().startswith("differs")
    assert c.verdict(adjusted=0.2) == f"within noise ({stats.fmt_p(c.p)}, Holm p=0.2)"


# -- the seed-and-example bootstrap -----------------------------------------------------------


def test_the_bootstrap_sees_counts_welch_cannot():
    """Learned against sinusoidal in the main job: 0 of 3,072 against 169 of 3,072.
    Welch over the three seeds: p = 0.1; the counts leave no doubt."""
    learned = [(0, 1024)] * 3
    sinusoidal = [(21, 1024), (60, 1024), (88, 1024)]
    welch = stats.compare([k / n for k, n in sinusoidal], [k / n for k, n in learned])
    assert welch.p == pytest.approx(0.1, abs=0.005)
    assert stats.seed_example_bootstrap(sinusoidal, learned) < 0.001


def test_the_bootstrap_is_deterministic_symmetric_and_one_where_nothing_differs():
    a, b = [(300, 1024), (350, 1024), (310, 1024)], [(320, 1024), (330, 1024), (340, 1024)]
    assert stats.seed_example_bootstrap(a, b) == stats.seed_example_bootstrap(a, b)
    assert stats.seed_example_bootstrap(a, b) == pytest.approx(
        stats.seed_example_bootstrap(b, a), abs=0.05
    )
    assert stats.seed_example_bootstrap(a, b) > 0.3
    assert stats.seed_example_bootstrap([(0, 10)] * 2, [(0, 10)] * 3) == 1.0
    with pytest.raises(ValueError, match="0 <= k <= N"):
        stats.seed_example_bootstrap([(11, 10)], [(0, 10)])


# -- power -----------------------------------------------------------------------------------


def test_the_detectable_difference_is_where_welch_reaches_80_percent_power():
    """Simulate: two groups of 3 seeds with the measured spreads, the second shifted by the
    detectable difference; Welch rejects at alpha in about 80% of the draws."""
    a, b = [0.02, 0.06, 0.09], [0.10, 0.16, 0.12]
    d = stats.detectable_difference(a, b)
    sa, sb = np.std(a, ddof=1), np.std(b, ddof=1)
    rng = np.random.default_rng(0)
    # The noncentral t holds the variances at their measured values; so does the simulation,
    # by drawing seeds whose spread is exactly the measured one, in a random direction.
    hits = 0
    draws = 4000
    for _ in range(draws):
        x = rng.standard_normal(3)
        y = rng.standard_normal(3)
        x = (x - x.mean()) / x.std(ddof=1) * sa + rng.normal(0, sa / np.sqrt(3))
        y = (y - y.mean()) / y.std(ddof=1) * sb + d + rng.normal(0, sb / np.sqrt(3))
        hits += stats.welch_test(x, y) < stats.ALPHA
    assert hits / draws == pytest.approx(0.8, abs=0.04)
    assert stats.detectable_difference(a, b, alpha=0.005) > d  # a stricter level needs more
    assert stats.detectable_difference([0.0, 0.0], [0.0, 0.0]) is None
    assert stats.detectable_difference([0.1], [0.2, 0.3]) is None


# -- the rule --------------------------------------------------------------------------------

THEIRS = {  # three seeds a scheme: t5 > alibi > rope, all beyond noise
    "t5": [0.42, 0.41, 0.43],
    "alibi": [0.32, 0.34, 0.33],
    "rope": [0.01, 0.02, 0.015],
}
FITTED = dict.fromkeys(THEIRS, True)


def test_every_pair_of_theirs_seen_here_is_reproduced():
    ours = {"t5": [0.61, 0.6, 0.62], "alibi": [0.4, 0.41, 0.39], "rope": [0.1, 0.12, 0.11]}
    v = verdicts.verdict(ours, THEIRS, FITTED)
    assert v.word == "reproduced" and len(v.agree) == 3 and not v.opposite
    assert v.pairs({"t5": "T5"}) == ("agree: T5 > alibi, T5 > rope, alibi > rope; opposite: none")


def test_a_scheme_not_fitted_in_every_seed_makes_it_partly_reproduced():
    ours = {"t5": [0.61, 0.6, 0.62], "alibi": [0.4, 0.41, 0.39], "rope": [0.1, 0.12, 0.11]}
    v = verdicts.verdict(ours, THEIRS, {**FITTED, "alibi": False})
    assert v.word == "partly reproduced" and v.unfitted == ("alibi",)
    assert v.explain({"alibi": "ALiBi"}).endswith("; not fitted in every seed: ALiBi")


def test_a_pair_of_theirs_within_noise_here_makes_it_partly_reproduced():
    ours = {"t5": [0.4, 0.1, 0.7], "alibi": [0.4, 0.41, 0.39], "rope": [0.1, 0.12, 0.11]}
    v = verdicts.verdict(ours, THEIRS, FITTED)
    assert v.word == "partly reproduced" and v.agree == (("alibi", "rope"),)
    assert set(v.unseen) == {("t5", "alibi"), ("t5", "rope")}
    assert v.explain() == (
        "partly reproduced: agree: alibi > rope; opposite: none; theirs beyond noise, "
        "within noise here: t5 > alibi, t5 > rope"
    )


def test_a_pair_opposite_on_both_sides_is_not_reproduced():
    ours = {"t5": [0.1, 0.11, 0.12], "alibi": [0.4, 0.41, 0.39], "rope": [0.01, 0.0, 0.02]}
    v = verdicts.verdict(ours, THEIRS, FITTED)
    assert v.word == "not reproduced" and v.opposite == (("alibi", "t5"),)
    assert ("alibi", "rope") in v.agree  # agreeing pairs do not save it
    assert "a pair opposite beyond noise on both sides" in v.explain()


def test_nothing_seen_beyond_noise_is_not_reproduced():
    ours = {s: [0.1, 0.5, 0.9] for s in THEIRS}
    v = verdicts.verdict(ours, THEIRS, FITTED)
    assert v.word == "not reproduced" and not v.agree and not v.opposite


def test_their_numbers_not_read_is_unchecked_before_anything_else():
    ours = {"t5": [0.61, 0.6, 0.62], "alibi": [0.4, 0.41, 0.39]}
    unread = verdicts.verdict(ours, {"t5": None, "alibi": None}, FITTED, verdicts.Setup(False))
    assert unread.word == "unchecked"
    one = verdicts.verdict(ours, {"t5": [1.0], "alibi": None}, FITTED)  # one end of a pair
    assert one.word == "unchecked"


def test_a_setup_that_differs_in_kind_is_not_comparable():
    ours = {"t5": [0.61, 0.6, 0.62], "alibi": [0.4, 0.41, 0.39], "rope": [0.1, 0.12, 0.11]}
    setup = verdicts.Setup(metric=False, differs="decoded exact match, theirs teacher-forced")
    v = verdicts.verdict(ours, THEIRS, FITTED, setup)
    assert v.explain() == "not comparable: decoded exact match, theirs teacher-forced"


def test_pair_signs_use_the_counts_where_no_seed_varies_and_adjust_by_holm():
    values = {"a": [0.5, 0.5], "b": [0.0, 0.0]}
    assert verdicts.pair_signs(values) == {("a", "b"): 0}  # no spread, no counts: untestable
    counts = {"a": (1024, 2048), "b": (0, 2048)}
    assert verdicts.pair_signs(values, counts) == {("a", "b"): 1}
    # Three schemes, three pairs: a raw p of 0.037 (twice) does not survive Holm.
    close = {"a": [0.50, 0.52, 0.54], "b": [0.45, 0.47, 0.49], "c": [0.40, 0.42, 0.44]}
    raw = stats.compare(close["b"], close["a"]).p
    assert raw < stats.ALPHA
    assert verdicts.pair_signs(close) == {("a", "b"): 0, ("a", "c"): 1, ("b", "c"): 0}
    assert set(verdicts.pair_signs(close)) == set(itertools.combinations(close, 2))


def test_the_compared_metric_is_the_anchors_own():
    """Teacher-forced sequence accuracy for the anchor whose code scores it (Ontañón
    et al.), decoded exact match for those that decode, and exact match marked as
    differing in kind against a per-token accuracy; from the records' own words."""
    import anchor_data

    chosen = {
        key: verdicts.compared_metric(r.setup["metric"].value)
        for key, r in anchor_data.RECORDS.items()
    }
    assert chosen == {
        "ontanon2022": ("eval/test_longer/tf_sequence_accuracy", True),
        "kazemnejad2023": ("eval/test_longer/exact_match", True),
        "csordas2021": ("eval/test_longer/exact_match", True),
        "ruoss2023": ("eval/test_longer/exact_match", False),
        "deletang2023": ("eval/test_longer/exact_match", False),
        # Language models scored by perplexity, or accuracy on their own tasks.
        "lin2025": ("eval/test_longer/exact_match", False),
        "golovneva2024": ("eval/test_longer/exact_match", False),
        "tan2025": ("eval/test_longer/exact_match", False),
    }
    assert verdicts.compared_metric("Teacher-forced sequence accuracy", "validation") == (
        "eval/validation/tf_sequence_accuracy",
        True,
    )


def test_the_vocabulary_is_fixed():
    with pytest.raises(ValueError, match="not one of"):
        verdicts.Verdict("reproduced in direction")


# -- the committed reports -------------------------------------------------------------------

REPO = pathlib.Path(__file__).resolve().parent.parent
REPORTS = sorted(
    str(p.parent.relative_to(REPO))
    for p in REPO.glob("docs/results*/**/results.csv")
    if "## Groups" in (p.parent / "results.md").read_text(encoding="utf-8")
)


@pytest.mark.parametrize("folder", REPORTS)
def test_every_committed_report_is_the_refresh_of_its_results_csv(folder):
    """Each report's group table (Holm-adjusted) and comparisons section are what the
    report code makes of its results.csv today: rebuilding it changes nothing."""
    path = REPO / folder / "results.md"
    assert refresh.refresh(str(REPO / folder)) == path.read_text(encoding="utf-8"), (
        f"{folder}: run python -m jattn.analysis.refresh {folder}"
    )


def test_refresh_reads_the_table_it_rebuilds():
    header = "| group | seeds | a/b | c/d | vs position=rope,task=x, same task, size (a/b) |"
    assert refresh.table_spec(header) == (["a/b", "c/d"], "position=rope,task=x", ("task", "size"))
    assert refresh.table_spec("| group | seeds | a/b |") == (["a/b"], None, ())
    with pytest.raises(ValueError, match="no group table"):
        refresh.table_spec("# nothing")
