"""A published comparison's verdict, computed by a written rule, not written by hand.

A grid run here is held against a paper's finding about the same schemes.
`verdict` takes both sides' numbers per scheme and what is known of the
setups, and returns one word of `VOCABULARY` with the scheme pairs behind it.
The rule (docs/results.md, "How a verdict is reached", says the same):

1. **unchecked**: fewer than two of the compared schemes have their numbers
   read (a pair needs both ends), so nothing of theirs can be checked;
2. **not comparable**: the architecture, task or metric differs in kind;
3. otherwise every pair of schemes is tested on each side (Welch over seeds,
   the counts where no seed varies, `stats.compare`; Holm's adjustment over
   the pairs of that side). A pair *agrees* where both sides differ beyond
   noise in the same direction, is *opposite* where both differ beyond noise
   in opposite directions;
4. **not reproduced**: a pair is opposite, or no pair agrees (nothing of
   theirs is seen here);
5. **reproduced**: no pair opposite, every pair that differs beyond noise on
   their side agrees here, and every compared scheme fitted its training
   lengths in every seed;
6. **partly reproduced**: some pairs agree and none is opposite, but a pair
   of theirs is not seen here or a scheme has a seed that did not fit.

Both sides are compared on the anchor's own metric where this grid has it
(`compared_metric`, from the metric its record describes): teacher-forced
sequence accuracy for Ontañón et al. 2022, whose code scores that, decoded
exact match for an anchor that decodes. A metric the grid lacks (a grid
evaluated before the teacher-forced score existed) leaves decoded exact
match, and the setup then differs in metric ("not comparable" once their
numbers are read).

The verdict uses Welch over seeds with Holm's adjustment; the
seed-and-example bootstrap of the reports is not used (with three seeds it
sees less seed spread than there is). Their side is tested the same way on
their per-seed numbers; a scheme with one number of theirs has no seed
spread, so its pairs cannot differ beyond noise on their side.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

from jattn.analysis import stats
from jattn.analysis.runs import TF_SEQUENCE

__all__ = ["VOCABULARY", "Setup", "Verdict", "compared_metric", "pair_signs", "verdict"]

VOCABULARY = (
    "reproduced",
    "partly reproduced",
    "not reproduced",
    "not comparable",
    "unchecked",
)


@dataclasses.dataclass(frozen=True)
class Setup:
    """How this grid's setup stands against the anchor's, in kind (not in size).

    Attributes:
      architecture, task, metric: False where it differs in kind (an
        encoder-decoder against their encoder-only tape; exact match against
        their per-token accuracy).
      differs: what differs, in words (shown with a "not comparable" verdict).
    """

    architecture: bool = True
    task: bool = True
    metric: bool = True
    differs: str = ""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One comparison's verdict: a word of `VOCABULARY`, the pairs behind it and why.

    Pairs are (higher, lower) as this grid orders them.
    """

    word: str
    agree: tuple[tuple[str, str], ...] = ()
    opposite: tuple[tuple[str, str], ...] = ()
    unseen: tuple[tuple[str, str], ...] = ()  # beyond noise on theirs, not here (their order)
    unfitted: tuple[str, ...] = ()  # schemes with a seed that did not fit
    why: str = ""

    def __post_init__(self):
        if self.word not in VOCABULARY:
            raise ValueError(f"verdict {self.word!r} is not one of {VOCABULARY}")

    def pairs(self, names: Mapping[str, str] | None = None) -> str:
        """``agree: ALiBi > RoPE, T5 > RoPE; opposite: none``."""
        names = names or {}

        def fmt(pairs) -> str:
            return ", ".join(f"{names.get(a, a)} > {names.get(b, b)}" for a, b in pairs) or "none"

        return f"agree: {fmt(self.agree)}; opposite: {fmt(self.opposite)}"

    def explain(self, names: Mapping[str, str] | None = None) -> str:
        """The verdict in words: ``partly reproduced: agree: ...; opposite: none;
        theirs beyond noise, within noise here: T5 > ALiBi (as they order it);
        not fitted in every seed: NoPE``. The unseen pairs are where more
        seeds here could change the verdict."""
        if self.word in ("unchecked", "not comparable"):
            return f"{self.word}: {self.why}"
        names = names or {}
        parts = [self.pairs(names)]
        if self.word == "not reproduced":
            parts.append(self.why)
        if self.unseen:
            unseen = ", ".join(f"{names.get(a, a)} > {names.get(b, b)}" for a, b in self.unseen)
            parts.append(f"theirs beyond noise, within noise here: {unseen}")
        if self.unfitted:
            unfitted = ", ".join(names.get(s, s) for s in self.unfitted)
            parts.append(f"not fitted in every seed: {unfitted}")
        return f"{self.word}: " + "; ".join(parts)


def compared_metric(anchor_metric: str, split: str = "test_longer") -> tuple[str, bool]:
    """The metric of a grid's `split` that a verdict compares with an anchor whose own
    metric its record describes as `anchor_metric`, and whether the two are the same
    in kind.

    Teacher-forced sequence accuracy (Ontañón et al.: their code feeds the gold
    prefix and compares the argmax) -> ``eval/<split>/tf_sequence_accuracy``;
    exact match or sequence accuracy of a decoded output -> ``exact_match``; any
    other (a per-token accuracy) -> ``exact_match``, not the same in kind.
    """
    text = anchor_metric.lower()
    if "teacher-forced" in text and "sequence accuracy" in text:
        return f"eval/{split}/{TF_SEQUENCE}", True
    same = "exact match" in text or "sequence accuracy" in text
    return f"eval/{split}/exact_match", same


def pair_signs(
    values: Mapping[str, Sequence[float]],
    counts: Mapping[str, tuple[int, int]] | None = None,
    alpha: float = stats.ALPHA,
) -> dict[tuple[str, str], int]:
    """For each pair (a, b) of `values`' schemes in their order: +1 where a is above b
    beyond noise, -1 below, 0 within noise or untestable, after Holm's adjustment
    over the pairs tested (`stats.compare`; `counts`, per scheme (k, N) summed over
    seeds, decide where neither varies)."""
    counts = counts or {}
    tested: dict[tuple[str, str], float] = {}
    for a, b in itertools.combinations(values, 2):
        c = stats.compare(values[b], values[a], counts.get(b), counts.get(a))
        if c.p is not None:
            tested[(a, b)] = c.p
    adjusted = dict(zip(tested, stats.holm(list(tested.values())), strict=True))
    signs = {}
    for a, b in itertools.combinations(values, 2):
        diff = sum(values[a]) / len(values[a]) - sum(values[b]) / len(values[b])
        beyond = adjusted.get((a, b), 1.0) < alpha and diff != 0
        signs[(a, b)] = (1 if diff > 0 else -1) if beyond else 0
    return signs


def verdict(
    ours: Mapping[str, Sequence[float]],
    theirs: Mapping[str, Sequence[float] | None],
    fitted: Mapping[str, bool],
    setup: Setup = Setup(),
    counts: Mapping[str, tuple[int, int]] | None = None,
) -> Verdict:
    """The verdict of this grid (`ours`: scheme -> one value per seed) against an
    anchor (`theirs`: scheme -> their values per seed, None where not read).

    Args:
      ours: this grid's compared metric per scheme, one value per seed.
      theirs: the anchor's numbers on the same task and metric per scheme.
      fitted: scheme -> whether every seed here fitted the training lengths.
      setup: how the setups stand in kind.
      counts: scheme -> this grid's (k, N) of the compared metric summed over seeds.
    """
    schemes = [s for s in ours if theirs.get(s) is not None]
    if len(schemes) < 2:
        return Verdict("unchecked", why="their numbers for a pair of these schemes not read")
    if not (setup.architecture and setup.task and setup.metric):
        return Verdict("not comparable", why=setup.differs)
    here = pair_signs({s: ours[s] for s in schemes}, counts)
    there = pair_signs({s: theirs[s] for s in schemes})
    ordered = []  # (higher, lower) as this grid orders them
    for (a, b), sign in here.items():
        ordered.append(((a, b) if sign >= 0 else (b, a), sign, there[(a, b)]))
    agree = tuple(p for p, h, t in ordered if h != 0 and h == t)
    opposite = tuple(p for p, h, t in ordered if h != 0 and t != 0 and h != t)
    unseen = tuple(
        (a, b) if there[(a, b)] > 0 else (b, a)
        for (a, b), h in here.items()
        if there[(a, b)] and not h
    )
    unfitted = tuple(s for s in schemes if not fitted.get(s, False))
    if opposite or not agree:
        why = "a pair opposite beyond noise on both sides" if opposite else "no pair agrees"
        return Verdict("not reproduced", agree, opposite, unseen, unfitted, why)
    word = "partly reproduced" if unseen or unfitted else "reproduced"
    return Verdict(word, agree, opposite, unseen, unfitted)
