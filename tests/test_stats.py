"""The report's statistics (jattn.analysis.stats) against numbers computed another way:
Wilson intervals as the roots of the score-test quadratic, t intervals and Welch's
test from the textbook formulas with table quantiles, and the two-proportion test
from a worked example."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jattn.analysis import stats

Z95 = 1.959963984540054  # the normal 97.5% quantile
T975_DF2 = 4.302652729911275  # Student t 97.5% quantile, 2 degrees of freedom (tables: 4.303)


def _wilson_by_quadratic(k: int, n: int) -> tuple[float, float]:
    """The p with (k/n - p)² = z² p (1 - p) / n: the ends of the score interval,
    as the roots of (1 + z²/n) p² - (2 k/n + z²/n) p + (k/n)² = 0."""
    phat, c = k / n, Z95**2 / n
    a, b, cc = 1 + c, -(2 * phat + c), phat**2
    disc = math.sqrt(b * b - 4 * a * cc)
    return (-b - disc) / (2 * a), (-b + disc) / (2 * a)


@pytest.mark.parametrize("k, n", [(0, 10), (10, 10), (5, 10), (37, 1024), (0, 1024), (1, 3)])
def test_wilson_interval_is_the_score_test_quadratic(k, n):
    low, high = stats.wilson_interval(k, n)
    want_low, want_high = _wilson_by_quadratic(k, n)
    assert low == pytest.approx(want_low, abs=1e-12) and high == pytest.approx(want_high, abs=1e-12)
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_wilson_interval_hand_values():
    z2 = Z95**2  # 3.8415
    assert stats.wilson_interval(0, 10) == (0.0, pytest.approx(z2 / (10 + z2)))  # 0.2775
    assert stats.wilson_interval(0, 10)[1] == pytest.approx(0.27753, abs=1e-5)
    assert stats.wilson_interval(10, 10) == (pytest.approx(10 / (10 + z2)), 1.0)  # 0.7225
    low, high = stats.wilson_interval(5, 10)
    assert (low, high) == (pytest.approx(0.23659, abs=1e-5), pytest.approx(0.76341, abs=1e-5))
    assert low + high == pytest.approx(1.0)  # symmetric about 1/2
    # 37/1024: p = 0.036133, z²/n = 0.0037514, centre = (p + z²/2n) / (1 + z²/n) = 0.037867,
    # half = z sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n) = 0.011540.
    low, high = stats.wilson_interval(37, 1024)
    assert (low, high) == (pytest.approx(0.026327, abs=1e-5), pytest.approx(0.049406, abs=1e-5))
    assert stats.wilson_interval(0, 1024)[1] == pytest.approx(0.003738, abs=1e-6)  # "≤ 0.37%"
    with pytest.raises(ValueError):
        stats.wilson_interval(3, 2)
    with pytest.raises(ValueError):
        stats.wilson_interval(0, 0)


def test_t_interval_by_hand():
    mean, low, high = stats.t_interval([0.9, 0.95, 1.0])
    half = T975_DF2 * 0.05 / math.sqrt(3)  # s = 0.05, n = 3: 0.124207
    assert mean == pytest.approx(0.95)
    assert (low, high) == (pytest.approx(0.95 - half), pytest.approx(0.95 + half))
    assert low == pytest.approx(0.825793, abs=1e-6)
    # Two seeds: 1 degree of freedom, t = 12.706.
    mean, low, high = stats.t_interval([0.8, 1.0])
    assert (mean, high - mean) == (pytest.approx(0.9), pytest.approx(12.7062047 * 0.1, rel=1e-7))
    assert stats.t_interval([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)  # zero spread
    mean, low, high = stats.t_interval([0.7])
    assert mean == 0.7 and math.isnan(low) and math.isnan(high)  # one seed: no interval
    with pytest.raises(ValueError):
        stats.t_interval([])


def test_prediction_interval_by_hand_and_its_coverage():
    mean, low, high = stats.prediction_interval([0.9, 0.95, 1.0])
    half = T975_DF2 * 0.05 * math.sqrt(1 + 1 / 3)  # s = 0.05, n = 3: 0.248414
    assert mean == pytest.approx(0.95) and high - mean == pytest.approx(half)
    assert low == pytest.approx(0.701586, abs=1e-6)
    mean, low, high = stats.prediction_interval([0.7])
    assert mean == 0.7 and math.isnan(low) and math.isnan(high)
    with pytest.raises(ValueError):
        stats.prediction_interval([])
    # What it promises: one more draw lands inside 95% of the time (five seeds).
    draws = np.random.default_rng(0).normal(3.0, 0.2, size=(4000, 6))
    inside = [lo <= d[5] <= hi for d in draws for _, lo, hi in [stats.prediction_interval(d[:5])]]
    assert 0.935 <= np.mean(inside) <= 0.965, np.mean(inside)


def test_welch_test_worked_example():
    # a: mean 0.95, s² 0.0025; b: mean 0.8, s² 0.01; n = 3 each.
    # se² = 0.0025/3 + 0.01/3 = 0.0041667, t = 0.15 / 0.064550 = 2.32379,
    # df = 0.0041667² / ((0.00083333² + 0.0033333²) / 2) = 2.94118, two-sided p = 0.10448
    # (the t density with that df integrated from t to infinity, twice).
    p = stats.welch_test([0.9, 0.95, 1.0], [0.7, 0.8, 0.9])
    assert p == pytest.approx(0.10448, abs=5e-6)
    from scipy import stats as scipy_stats

    assert p == pytest.approx(
        scipy_stats.ttest_ind([0.9, 0.95, 1.0], [0.7, 0.8, 0.9], equal_var=False).pvalue
    )
    # One side without variance is fine: se² = 0.02/2, t = 0.4/0.1 = 4, df = 1 (Cauchy):
    # p = 1 - 2 atan(4) / pi = 0.15596.
    assert stats.welch_test([1.0, 1.0], [0.5, 0.7]) == pytest.approx(1 - 2 * math.atan(4) / math.pi)
    with pytest.raises(ValueError, match="zero variance"):
        stats.welch_test([1.0, 1.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="two values"):
        stats.welch_test([1.0], [0.0, 0.5])


def test_two_proportion_test_worked_example():
    # 30/100 vs 50/100: pooled 0.4, se = sqrt(0.4 * 0.6 * 0.02) = 0.069282,
    # z = -0.2 / 0.069282 = -2.88675, two-sided p = 0.003892.
    assert stats.two_proportion_test(30, 100, 50, 100) == pytest.approx(0.003892, abs=2e-6)
    assert stats.two_proportion_test(0, 10, 0, 20) == 1.0  # both 0: the same proportion
    assert stats.two_proportion_test(10, 10, 20, 20) == 1.0


def test_compare_welch_then_the_counts_fallback():
    welch = stats.compare([0.9, 0.95, 1.0], [0.7, 0.8, 0.9])
    assert welch.test == "welch" and welch.verdict() == "within noise (p=0.1)"
    assert stats.compare([0.9, 0.95, 1.0], [0.5, 0.55, 0.45]).verdict() == "differs (p<0.001)"
    # Zero variance on both sides: Welch is undefined; the pooled counts decide.
    fallback = stats.compare([1.0, 1.0], [0.0, 0.0], (2048, 2048), (0, 2048))
    assert fallback.test == "counts" and fallback.verdict() == "differs (p<0.001, counts)"
    same = stats.compare([1.0, 1.0], [1.0, 1.0], (40, 40), (40, 40))
    assert same.verdict() == "within noise (p=1, counts)"
    close = stats.compare([0.3, 0.3], [0.5, 0.5], (30, 100), (50, 100))  # the example above
    assert close.verdict() == "differs (p=0.0039, counts)"
    # Zero variance without counts (chrF, say): no test, unless the values are equal.
    assert stats.compare([90.0, 90.0], [80.0, 80.0]).verdict() == "n/a (no variance)"
    assert stats.compare([90.0, 90.0], [90.0, 90.0]).verdict() == "within noise (p=1)"
    assert stats.compare([0.9], [0.8, 0.7]).verdict() == "n/a (1 seed)"
