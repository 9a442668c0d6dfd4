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

A report makes several comparisons at once (every group against the
reference), so `holm` adjusts their p-values for their number, and a
comparison "differs" only where its adjusted p is below alpha. Two more
numbers sit beside each comparison:

- `seed_example_bootstrap`: a test that uses the exact-match counts too,
  resampling seeds and, within each drawn seed, its decoded examples. With
  three seeds it answers "do these trained models differ" more than "does
  the scheme": resampling 3 seeds sees (n - 1)/n of their spread and only 10
  distinct sets, so it is shown, and the verdicts use Welch with Holm;
- `detectable_difference`: the smallest true difference a Welch comparison
  with these seeds would find with 80% power, from the seed spread measured,
  so "within noise" says how large a difference would have been seen.
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
    "detectable_difference",
    "holm",
    "prediction_interval",
    "seed_example_bootstrap",
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
    return _t_around_mean("t_interval", values, confidence, lambda n: 1.0 / math.sqrt(n))


def _t_around_mean(name: str, values, confidence: float, width) -> tuple[float, float, float]:
    """`mean ± t_{(1+c)/2, n-1} * s * width(n)` of `values` (s: ddof 1); NaN
    bounds for one value, a `ValueError` naming `name` for none."""
    a = np.asarray(values, np.float64)
    if a.size == 0:
        raise ValueError(f"{name} of no values")
    mean = float(a.mean())
    if a.size < 2:
        return mean, math.nan, math.nan
    spread = float(a.std(ddof=1)) * width(a.size)
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2, df=a.size - 1)) * spread
    return mean, mean - half, mean + half


def prediction_interval(
    values: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """Mean of `values` (one per seed) and the Student t interval one more
    draw from their distribution falls in with probability `confidence`.

    ``mean ± t_{(1+c)/2, n-1} * s * sqrt(1 + 1/n)``: wider than `t_interval`
    by the new draw's own spread. What a single new run (the same config on
    another device, whose rounding differs) is held to against the seeds.

    Returns:
      (mean, low, high); low and high are NaN for a single value.
    """
    return _t_around_mean("prediction_interval", values, confidence, lambda n: math.sqrt(1 + 1 / n))


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

    def verdict(self, alpha: float = ALPHA, adjusted: float | None = None) -> str:
        """``within noise (p=0.41)``, ``differs (p=0.003)``, ``... counts`` for the
        two-proportion fallback, or ``n/a (reason)``. With `adjusted` (its Holm
        p among the report's comparisons) the word follows the adjusted p and
        both are shown: ``within noise (p=0.013, Holm p=0.077)``."""
        if self.p is None:
            return f"n/a ({self.test})"
        how = ", counts" if self.test == "counts" else ""
        if adjusted is None:
            return f"{'differs' if self.p < alpha else 'within noise'} ({fmt_p(self.p)}{how})"
        word = "differs" if adjusted < alpha else "within noise"
        return f"{word} ({fmt_p(self.p)}, Holm {fmt_p(adjusted)}{how})"


def fmt_p(p: float) -> str:
    """``p=0.013``, ``p<0.001``: two significant digits."""
    return "p<0.001" if p < 0.001 else f"p={p:.2g}"


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


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of `pvalues` for their number, in their order.

    Sorted ascending, the i-th smallest (from 0) becomes ``(m - i) * p``, made
    non-decreasing along the order and capped at 1. It controls the chance of
    any false "differs" among the m comparisons at alpha, with no assumption
    about how they depend on each other (they share the reference group).
    """
    p = np.asarray(pvalues, np.float64)
    if p.size == 0:
        return []
    if np.any((p < 0) | (p > 1) | np.isnan(p)):
        raise ValueError(f"holm: p-values must lie in [0, 1], got {list(pvalues)}")
    order = np.argsort(p, kind="stable")
    m = p.size
    stepped = np.maximum.accumulate((m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.minimum(stepped, 1.0)
    return [float(x) for x in out]


def seed_example_bootstrap(
    reference: Sequence[tuple[int, int]],
    other: Sequence[tuple[int, int]],
    draws: int = 10_000,
    seed: int = 0,
) -> float:
    """Two-sided p of a two-level bootstrap that `other`'s mean exact match equals
    `reference`'s, from each seed's counts ``(k, N)``.

    Each draw resamples a group's seeds with replacement, then each drawn
    seed's N examples (a binomial draw at its k/N), and takes the mean of the
    seeds' proportions; p is twice the smaller share of draws whose difference
    (other - reference) falls on either side of 0, with one draw added to each
    count (so it is never 0), capped at 1. Deterministic for a given `seed`.

    Raises:
      ValueError: a group with no seeds, or counts outside 0 <= k <= N, N >= 1.
    """
    rng = np.random.default_rng(seed)

    def means(counts: Sequence[tuple[int, int]]) -> np.ndarray:
        if not counts:
            raise ValueError("seed_example_bootstrap needs at least one seed a group")
        k, n = (np.asarray(x, np.int64) for x in zip(*counts, strict=True))
        if np.any(n < 1) or np.any(k < 0) or np.any(k > n):
            raise ValueError(f"seed_example_bootstrap: counts must be 0 <= k <= N, got {counts}")
        pick = rng.integers(0, k.size, size=(draws, k.size))
        return (rng.binomial(n[pick], k[pick] / n[pick]) / n[pick]).mean(axis=1)

    diff = means(other) - means(reference)
    below, above = np.sum(diff <= 0) + 1, np.sum(diff >= 0) + 1
    return float(min(1.0, 2 * min(below, above) / (draws + 1)))


def _power(ncp: float, df: float, alpha: float) -> float:
    """Power of a two-sided t-test at noncentrality `ncp` (scipy's far tail can be NaN: 0)."""
    crit = float(scipy_stats.t.ppf(1 - alpha / 2, df))
    low = float(np.nan_to_num(scipy_stats.t.cdf(-crit, df) if ncp == 0 else
                              scipy_stats.nct.cdf(-crit, df, ncp)))  # fmt: skip
    high = float(np.nan_to_num(scipy_stats.nct.sf(crit, df, ncp), nan=1.0))
    return low + high


def detectable_difference(
    a: Sequence[float], b: Sequence[float], alpha: float = ALPHA, power: float = 0.8
) -> float | None:
    """The smallest difference of means a two-sided Welch test of `a` against `b`
    finds with probability `power` at level `alpha`, given the seed spread the
    two measured (their standard errors and Welch–Satterthwaite degrees of
    freedom, the noncentral t). None where it cannot be said: fewer than two
    seeds on a side, or no spread on either (the counts decide there).
    """
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if x.size < 2 or y.size < 2:
        return None
    va, vb = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    if va + vb == 0:
        return None
    df = (va + vb) ** 2 / (va**2 / (x.size - 1) + vb**2 / (y.size - 1))
    low, high = 0.0, 1.0
    while _power(high, df, alpha) < power:
        high *= 2
    for _ in range(60):  # bisection on the noncentrality
        mid = (low + high) / 2
        low, high = (mid, high) if _power(mid, df, alpha) < power else (low, mid)
    return high * math.sqrt(va + vb)
