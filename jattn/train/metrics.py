"""Metric output: `metrics.jsonl`, TensorBoard event files, and the progress bar.

Only process 0 writes; on the others every method is a no-op. Each line of
`metrics.jsonl` is one JSON object with ``"step"`` and metric names such as
``"train/loss"`` or ``"eval/validation/exact_match"``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["MetricsWriter", "Progress", "read_metrics"]

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
    """A JSON-safe python scalar (NaN/Inf become strings, as JSON has none)."""
    value = float(value) if not isinstance(value, int | str | bool) else value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Appends metrics to `workdir/metrics.jsonl` and TensorBoard files in `workdir/tb`.

    Args:
      workdir: the run directory.
      enabled: False on every process but 0.
      resume_step: when resuming from a checkpoint at this step, lines with a
        larger step (written by the interrupted run after its last checkpoint)
        are dropped, so the file reads as one uninterrupted run.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, resume_step: int | None = None):
        self.enabled = enabled
        self.path = os.path.join(workdir, METRICS_FILE)
        self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        if os.path.exists(self.path):
            keep = [r for r in read_metrics(workdir) if r["step"] <= (resume_step or 0)]
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in keep)
            os.replace(tmp, self.path)
        from tensorboardX import SummaryWriter  # noqa: PLC0415 -- optional, heavy

        # TensorBoard drops events at or after purge_step: those of the interrupted run.
        purge = None if resume_step is None else resume_step + 1
        self._tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=purge)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes one line `{"step": step, **metrics}` and the TensorBoard scalars."""
        if not self.enabled or not metrics:
            return
        row = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for name, value in metrics.items():
            if isinstance(value, int | float) or hasattr(value, "dtype"):
                self._tb.add_scalar(name, float(value), int(step))

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All rows of `workdir/metrics.jsonl` (an empty list when there is none).

    A torn last line (a crash mid-write) is skipped.
    """
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


class Progress:
    """A tqdm bar over training steps (step, loss, tokens/s; tqdm adds the ETA).

    The bar is shown when `enabled`; messages (`write`) are printed on the
    main process only.
    """

    def __init__(self, total: int, initial: int, *, enabled: bool = True, is_main: bool = True):
        self._bar = None
        self._is_main = is_main
        self._last_time = time.perf_counter()
        self._tokens = 0.0
        if enabled:
            from tqdm.auto import tqdm  # noqa: PLC0415

            self._bar = tqdm(
                total=total,
                initial=initial,
                desc="train",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=0.5,
            )

    def update(self, steps: int, loss: float, tokens_per_sec: float) -> None:
        if self._bar is None:
            return
        self._bar.update(steps)
        self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_sec:,.0f}", refresh=False)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        elif self._is_main:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
