"""The per-seed bookkeeping of a seed program (`jattn.train.seed_program`).

Each seed of the program writes what a single run writes: its own
`metrics.jsonl` and TensorBoard files (a `MetricsWriter` and a `TrainMetrics`
a seed) and keeps its own `LossSanity`. The program's step metrics come back
stacked (``[S]``): `SeedMetrics.push` keeps one step in flight and hands each
seed its slice once fetched; a seed whose loss is NaN or Inf is marked
diverged (the program keeps its last good state) and logs nothing more.

A stacked checkpoint is sane (`sane`) when every seed's last logged loss is
sane (`jattn.train.sanity`): for a seed still training, the loss logged at
the checkpoint's step; for a seed that went NaN, the last one it logged
before, since its state stays frozen there. So a seed that went NaN from
sane losses does not stop the others' checkpoints from being sane, and one
that blew up first keeps every later checkpoint from being called sane.

One progress bar shows the live seeds' mean logged loss and the program's
tokens a second: every live seed's tokens (`program_tokens_per_sec`), which
the bar's label says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jattn.train import seeds as seeds_lib
from jattn.train import workdir as files
from jattn.train.metrics import (
    MetricsWriter,
    Progress,
    TrainMetrics,
    logged_losses,
    program_tokens_per_sec,
)
from jattn.train.sanity import LossSanity, insane_warning
from jattn.train.setup import flat_hparams

__all__ = ["SeedMetrics", "finished_members"]


def finished_members(dirs: Sequence[str], configs: Sequence[Any]) -> dict[int, dict[str, Any]]:
    """Position -> saved final metrics, for the members whose workdir holds a finished
    run (e.g. trained by single runs before): they are left out of the program."""
    out = {}
    for i, (d, c) in enumerate(zip(dirs, configs, strict=True)):
        final = files.finished_metrics(d, c.num_train_steps)
        if final is not None:
            out[i] = final
    return out


class SeedMetrics:
    """Every seed's writer, step metrics and loss sanity, and the program's bar.

    Args:
      seeds, dirs, configs: how log lines name the program's members ("seed 0"),
        their workdirs and configs.
      start: the step the program starts at (later rows of a resumed seed's
        metrics are dropped, as in a single run).
      metric_names: the scalars TensorBoard's HPARAMS table shows.
      progress: the program's bar.
      diverged: position -> message of seeds that diverged before this start.
      is_main: process 0 (the only one that writes).
    """

    def __init__(
        self,
        seeds: Sequence[str],
        dirs: Sequence[str],
        configs: Sequence[Any],
        *,
        start: int,
        metric_names: Sequence[str],
        progress: Progress,
        diverged: dict[int, str],
        is_main: bool,
    ):
        self.seeds = list(seeds)
        self.progress = progress
        self.diverged = diverged
        self.alive = [i not in diverged for i in range(len(self.seeds))]
        self.writers: list[MetricsWriter] = []
        self.trackers: list[TrainMetrics] = []
        for d, c in zip(dirs, configs, strict=True):
            writer = MetricsWriter(d, enabled=is_main, resume_step=start)
            writer.hparams(flat_hparams(c), metric_names)
            self.writers.append(writer)
            self.trackers.append(TrainMetrics(writer, Progress(1, 0, enabled=False, is_main=False)))
        self.sanities, self.sane_seeds = [], []  # whether each seed's last logged loss was sane
        for d in dirs:
            history = [h for h in logged_losses(d) if isinstance(h, int | float)]
            self.sanities.append(LossSanity(history))
            self.sane_seeds.append(not history or self.sanities[-1].is_sane(history[-1]))
        self._pending: tuple[int, Any, Any] | None = None
        self._shown = start  # the step the bar shows

    def live(self) -> list[int]:
        """Positions of the seeds still training."""
        return [i for i, a in enumerate(self.alive) if a]

    def push(self, step: int, device_metrics: Any, device_ok: Any) -> None:
        """Records step `step`'s stacked metrics (on device); fetches the previous step's."""
        self.drain()
        self._pending = (step, device_metrics, device_ok)

    def drain(self) -> None:
        """Fetches the step in flight and hands each live seed its metrics."""
        if self._pending is None:
            return
        step, device_metrics, device_ok = self._pending
        self._pending = None
        m, ok = jax.device_get((device_metrics, device_ok))
        for i in self.live():
            if not ok[i]:
                self.alive[i] = False
                self.diverged[i] = (
                    f"{self.seeds[i]}: non-finite loss ({float(m['loss'][i])}) at step "
                    f"{step}; its state is kept from step {step - 1}, the other seeds went on"
                )
                self.progress.write(self.diverged[i])
                continue
            self.trackers[i].push(step, seeds_lib.take(m, i))
            self.trackers[i].fetch()

    def log(self, step: int) -> None:
        """Writes every live seed's row at `step`, checks each one's loss against its
        `LossSanity` (`sane_seeds`), and advances the bar."""
        self.drain()
        for i in self.live():
            self.trackers[i].log(step)
            self.sane_seeds[i] = self.sanities[i].observe(self.trackers[i].logged_loss)
        live = [self.trackers[i] for i in self.live()]
        losses = [t.logged_loss for t in live]
        loss = float(np.mean(losses)) if losses else float("nan")
        self.progress.update(step - self._shown, loss, program_tokens_per_sec(live))
        self._shown = step

    @property
    def insane(self) -> list[int]:
        """Positions of the seeds whose last logged loss was not sane."""
        return [i for i, ok in enumerate(self.sane_seeds) if not ok]

    @property
    def sane(self) -> bool:
        """Whether a checkpoint now is sane: every seed's last logged loss was."""
        return all(self.sane_seeds)

    def insane_warnings(self, step: int, last_sane: int | None) -> list[str]:
        """One warning line a seed whose loss makes the checkpoint of `step` not sane."""
        return [
            insane_warning(
                step,
                self.trackers[i].logged_loss,
                self.sanities[i],
                last_sane,
                f" ({self.seeds[i]})",
            )
            for i in self.insane
        ]

    def named_diverged(self) -> dict[str, str]:
        """`diverged` keyed by position, for the checkpoint's meta (JSON keys are strings)."""
        return {str(i): msg for i, msg in self.diverged.items()}

    def end_interval(self) -> None:
        """After an evaluation or a save: flush, and leave its time out of the rates."""
        for w in self.writers:
            w.flush()
        for t in self.trackers:
            t.restart_clock()

    def close(self) -> None:
        for w in self.writers:
            with contextlib.suppress(OSError):
                w.close()
