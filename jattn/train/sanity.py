"""Which checkpoints are "good": a sane loss, not merely a finite one.

A run that diverges slowly (too high a learning rate) keeps finite losses
for many steps: 4.1, 37, 2e5, 1.3e12, then NaN. With frequent saves and
"keep the last N", every sane checkpoint rotates out before the NaN, and
the one called the last good checkpoint is at loss 1.3e12.

`LossSanity` calls a logged training loss sane when it is finite and not
far above the recent running loss: at most ``factor * median + margin`` of
the last `window` sane logged losses (cross-entropy falls, so a loss of
twice the recent median plus one nat is a divergence, not noise). Only sane
losses enter the history, so a diverging run cannot drag its own reference
up. A resumed run seeds the history from ``metrics.jsonl``.

The training loop records ``SANE_STEP_METRIC`` with every checkpoint (the
step when sane, -1 when not) and `checkpoints.make_manager` keeps the
checkpoint with the largest value whatever else rotates out, so the last
sane checkpoint survives any divergence (`jattn.train.run.Run` keeps the
run's `LossSanity` and observes each logged loss).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

__all__ = ["SANE_STEP_METRIC", "LossSanity", "insane_warning"]

SANE_STEP_METRIC = "jattn/sane_step"


class LossSanity:
    """Running reference of recent sane training losses.

    Args:
      history: earlier logged losses, oldest first (from ``metrics.jsonl``;
        values that are not numbers are skipped).
      window: how many recent sane losses the reference (their median) uses.
      factor, margin: a loss above ``factor * median + margin`` is not sane.
    """

    def __init__(
        self,
        history: Iterable[float] = (),
        *,
        window: int = 20,
        factor: float = 2.0,
        margin: float = 1.0,
    ):
        self._recent: deque[float] = deque(maxlen=window)
        self._factor = factor
        self._margin = margin
        for loss in history:
            if isinstance(loss, int | float):  # metrics.jsonl writes NaN as "nan"
                self.observe(loss)

    @property
    def limit(self) -> float:
        """The largest sane loss now (inf before any loss was seen)."""
        if not self._recent:
            return math.inf
        return self._factor * statistics.median(self._recent) + self._margin

    def is_sane(self, loss: float) -> bool:
        """True if `loss` is finite and at most `limit`."""
        return math.isfinite(loss) and loss <= self.limit

    def observe(self, loss: float) -> bool:
        """Checks `loss` and, if sane, adds it to the reference; returns whether it was."""
        sane = self.is_sane(loss)
        if sane:
            self._recent.append(float(loss))
        return sane


def insane_warning(
    step: int, loss: float, sanity: LossSanity, last_sane: int | None, who: str = ""
) -> str:
    """The warning line of a checkpoint saved at a loss that is not sane.

    `who` names whose loss it is (e.g. ``" (seed 1)"``; empty for a single run).
    """
    return (
        f"warning: step {step}'s loss {loss:.4g}{who} is above the sane limit "
        f"{sanity.limit:.4g} (twice the recent median + 1); kept, but step {last_sane} stays "
        "the last sane one"
    )
