"""The statistics of an ablation report: intervals and tests a reviewer accepts.

Two kinds of noise sit under every number of `jattn ablate`:

- seed noise: a group's metric varies from seed to seed. Its mean gets a
  Student t interval over seeds (`t_interval`, n - 1 degrees of freedom), and
  two groups are compared with Welch's t-test (`welch_test`: unequal
  variances, Welch–Satterthwaite degrees of freedom);
- sampling noise: one run's exact match is k correct of N decoded examples,
  a binomial proportion. It gets a Wilson score interval (`wilson_interval`),
  which stays inside [0, 1] and is not empty at 0/N or N/N (the normal
  approximation gives [0, 0] there, i.e. claims certainty from a sample).

`compare` picks the test: Welch over seeds, unless both groups have zero
variance over seeds (all seeds 1.000, or all 0.000: Welch divides by zero),
where it falls back to a two-proportion z-test on the counts pooled over
seeds (`two_proportion_test`). Everything here is a pure function of
numbers; scipy supplies only the t and normal quantiles and tails.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as scipy_stats

__all__ = [
    "Comparison",
    "compare",
    "t_interval",
    "two_proportion_test",
    "welch_test",
    "wilson_interval",
]

CONFIDENCE = 0.95
ALPHA = 0.05


def _z(confidence: float) -> float:
    """The two-sided normal quantile (1.96 for 95%)."""
    return float(scipy_stats.norm.ppf(0.5 + confidence / 2))


def t_interval(
    values: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """Mean of `values` (one per seed) and its Student t confidence interval.

    ``mean ± t_{(1+c)/2, n-1} * s / sqrt(n)`` with ``s`` the sample standard
    deviation (ddof 1). Zero spread gives ``[mean, mean]``.

    Returns:
      (mean, low, high); low and high are NaN for a single value (one seed
      says nothing about seed noise).
    """
    a = np.asarray(values, np.float64)
    if a.size == 0:
        raise ValueError("t_interval of no values")
    mean = float(a.mean())
    if a.size < 2:
        return mean, math.nan, math.nan
    sem = float(a.std(ddof=1)) / math.sqrt(a.size)  # standard error of the mean
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2, df=a.size - 1)) * sem
    return mean, mean - half, mean + half


def wilson_interval(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n.

    ``(p + z²/2n ± z * sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)`` with p = k/n:
    the p's for which a z-test of p̂ = k/n would not reject. At k = 0 the low
    end is exactly 0 and the high end z²/(n + z²) (0/1024: 0.37%).

    Raises:
      ValueError: n < 1 or k outside [0, n].
    """
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"wilson_interval: need 0 <= k <= n and n >= 1, got {k}/{n}")
    z = _z(confidence)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low, high = centre - half, centre + half
    # Exact ends at the boundaries (the formula gives them up to rounding).
    return (0.0 if k == 0 else max(low, 0.0)), (1.0 if k == n else min(high, 1.0))


def welch_test(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of Welch's t-test that `a` and `b` have the same mean.

    ``t = (mean_a - mean_b) / sqrt(s_a²/n_a + s_b²/n_b)`` with
    ``df = (s_a²/n_a + s_b²/n_b)² / ((s_a²/n_a)²/(n_a-1) + (s_b²/n_b)²/(n_b-1))``.

    Raises:
      ValueError: fewer than two values on a side, or zero variance on both
        (the statistic is undefined; see `compare`).
    """
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if x.size < 2 or y.size < 2:
        raise ValueError("welch_test needs at least two values (seeds) a group")
    va, vb = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size  # squared standard errors
    if va + vb == 0:
        raise ValueError("welch_test: zero variance in both groups")
    t = (x.mean() - y.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (x.size - 1) + vb**2 / (y.size - 1))
    return float(2 * scipy_stats.t.sf(abs(t), df))


def two_proportion_test(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p-value of the pooled two-proportion z-test of k1/n1 = k2/n2.

    ``z = (p1 - p2) / sqrt(p(1-p)(1/n1 + 1/n2))`` with the pooled
    ``p = (k1 + k2) / (n1 + n2)``. Both proportions 0 (or both 1) are the
    same proportion: p-value 1.
    """
    if n1 < 1 or n2 < 1:
        raise ValueError("two_proportion_test needs n1, n2 >= 1")
    pooled = (k1 + k2) / (n1 + n2)
    if pooled in (0.0, 1.0):
        return 1.0
    z = (k1 / n1 - k2 / n2) / math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    return float(2 * scipy_stats.norm.sf(abs(z)))


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The verdict of `compare` for one group against the reference.

    Attributes:
      p: the two-sided p-value, or None where no test applies.
      test: "welch", "counts" (the two-proportion fallback) or a reason
        no test applies ("1 seed", "no variance").
    """

    p: float | None
    test: str

    def verdict(self, alpha: float = ALPHA) -> str:
        """``within noise (p=0.41)``, ``differs (p=0.003)``, ``... counts`` for the
        two-proportion fallback, or ``n/a (reason)``."""
        if self.p is None:
            return f"n/a ({self.test})"
        p = "p<0.001" if self.p < 0.001 else f"p={self.p:.2g}"
        how = ", counts" if self.test == "counts" else ""
        return f"{'differs' if self.p < alpha else 'within noise'} ({p}{how})"


def compare(
    reference: Sequence[float],
    other: Sequence[float],
    reference_counts: tuple[int, int] | None = None,
    other_counts: tuple[int, int] | None = None,
) -> Comparison:
    """Is `other`'s mean over seeds different from `reference`'s?

    Welch's t-test over seeds; where both groups have zero variance over
    seeds, the two-proportion test on the pooled counts ``(k, N)`` (summed
    over seeds) when both are given. One seed a group allows no test of
    seed noise, and is said so.
    """
    if len(reference) < 2 or len(other) < 2:
        return Comparison(None, "1 seed")
    if np.var(reference) == 0 and np.var(other) == 0:
        if reference_counts is None or other_counts is None:
            same = float(np.mean(reference)) == float(np.mean(other))
            return Comparison(1.0, "identical") if same else Comparison(None, "no variance")
        return Comparison(two_proportion_test(*reference_counts, *other_counts), "counts")
    return Comparison(welch_test(reference, other), "welch")
