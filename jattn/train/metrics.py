"""Metrics: training-step bookkeeping, `metrics.jsonl`, TensorBoard files, the progress bar.

`TrainMetrics` keeps the training loop free of bookkeeping: it holds the
device metrics of the step in flight (fetched while the next one runs),
averages them over a log interval, times the steps, and writes a row through
`MetricsWriter` and `Progress`.

Only process 0 writes; on the others every method is a no-op. Each line of
`metrics.jsonl` is one JSON object with ``"step"`` and metric names such as
``"train/loss"`` or ``"eval/validation/exact_match"``.

One training loss everywhere: ``train/loss`` is the mean of the per-step
losses over the logging interval that ends at the row's step (the
``train/loss_window_steps`` steps since the previous row; `log_every_steps`,
shorter before an evaluation or a checkpoint). The progress bar, metrics.jsonl,
TensorBoard and ``final_metrics.json`` (the run's last interval) all show
this same number under this name, so the ablation report reads it too.

`write_final_metrics` writes ``final_metrics.json`` as strict JSON (null for
an unknown value, never NaN) and keeps a value measured by an earlier
invocation of the run where this one could not measure it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jattn.train import workdir as workdir_lib

__all__ = [
    "MetricsWriter",
    "NonFiniteLossError",
    "Progress",
    "TrainMetrics",
    "flat_hparams",
    "last_logged_loss",
    "logged_losses",
    "read_metrics",
    "strict_json_value",
    "write_final_metrics",
]


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
        self.path = os.path.join(workdir, workdir_lib.METRICS)
        self._tb = None
        self._wandb = None
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
        """Writes one line `{"step": step, **metrics}`, the TensorBoard scalars and,
        when `log_to_wandb` was called, the same numbers to Weights & Biases."""
        if not self.enabled or not metrics:
            return
        row = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {
            name: float(value)
            for name, value in metrics.items()
            if isinstance(value, int | float) or hasattr(value, "dtype")
        }
        for name, value in scalars.items():
            self._tb.add_scalar(name, value, int(step))
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))

    def hparams(self, hparams: Mapping[str, Any], metric_names: Sequence[str]) -> None:
        """Records the run's hyperparameters for TensorBoard's HPARAMS tab (its own
        `tb/` folder, so the runs of an ablation compare side by side under
        ``tensorboard --logdir <ablation workdir>``).

        Args:
          hparams: flat ``{name: int | float | str | bool}`` (others are shown as text).
          metric_names: scalar tags (e.g. ``"train/loss"``) the table shows per run.
        """
        if not self.enabled:
            return
        from tensorboardX.summary import hparams as hparams_summary  # noqa: PLC0415

        clean = {
            k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in hparams.items()
        }
        for summary in hparams_summary(clean, dict.fromkeys(metric_names, 0.0)):
            self._tb.file_writer.add_summary(summary)

    def log_to_wandb(self, run: Any) -> None:
        """Sends every later `write` to a Weights & Biases run (``wandb.init``'s result)."""
        self._wandb = run if self.enabled else None

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All rows of `workdir/metrics.jsonl` (an empty list when there is none).

    A torn last line (a crash mid-write) is skipped.
    """
    return workdir_lib.read_jsonl(os.path.join(workdir, workdir_lib.METRICS))


def logged_losses(workdir: str) -> list[Any]:
    """Every ``train/loss`` of `workdir/metrics.jsonl`, oldest first (NaN as "nan")."""
    return [r["train/loss"] for r in read_metrics(workdir) if "train/loss" in r]


def strict_json_value(value: Any) -> Any:
    """`value` for strict JSON: a non-finite float (NaN: not measured) becomes None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_final_metrics(path: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """Writes `result` to `path` (``final_metrics.json``) as strict JSON and returns
    what was written.

    NaN/Inf become null. A key that is null now but holds a value in the file
    already there (an earlier invocation of the same run measured it, e.g.
    ``train/steps_per_sec`` before a restart that trained too few steps to
    time them) keeps that value: a rerun never replaces a measurement with
    "unknown".
    """
    out = {k: strict_json_value(v) for k, v in result.items()}
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
        except (OSError, json.JSONDecodeError):
            old = {}
        for k, v in old.items():
            if out.get(k) is None and isinstance(v, int | float) and math.isfinite(v):
                out[k] = v
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=2, sort_keys=True, allow_nan=False)
    os.replace(tmp, path)
    return out


class Progress:
    """A tqdm bar over training steps (step, `train/loss` as logged, tokens/s; tqdm
    adds the ETA).

    The bar is shown when `enabled`; messages (`write`) are printed on the
    main process only.
    """

    def __init__(
        self,
        total: int,
        initial: int,
        *,
        enabled: bool = True,
        is_main: bool = True,
    ):
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
        # The interval's mean: the number metrics.jsonl logs as train/loss.
        self._bar.set_postfix(
            {"train/loss": f"{loss:.4f}", "tok_s": f"{tokens_per_sec:,.0f}"},
            refresh=False,
        )

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        elif self._is_main:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class NonFiniteLossError(ArithmeticError):
    """A training step's loss is NaN or Inf (`TrainMetrics` found it)."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"non-finite loss ({loss}) at step {step}")
        self.step = step
        self.loss = loss


_SUMMED = ("loss", "accuracy", "tokens", "grad_norm")


class TrainMetrics:
    """Training metrics between two log lines, and the run's step rate.

    The train step returns device scalars (``loss``, ``accuracy``,
    ``tokens``, ``grad_norm``, ``learning_rate``). `push` keeps one step's
    in flight and fetches the previous one, so the host never waits for the
    device; `log` fetches what is left and writes the interval's means:
    ``train/loss``, ``train/accuracy``, ``train/grad_norm``, with
    ``train/loss_window_steps`` (how many steps they average),
    ``train/learning_rate`` (the last step's), ``train/tokens_per_sec``,
    ``train/steps_per_sec`` and ``train/input_wait_ms``: the mean time a step's
    host loop spent getting its batch (`waited`), which on a fast device tells
    whether the input pipeline keeps it fed (near ``1000 / steps_per_sec``: it
    does not). `logged_loss` is the last row's ``train/loss``,
    `logged_tokens_per_sec` its ``train/tokens_per_sec``.

    The first interval of a process includes compilation, so it is left out
    of `steady_steps_per_sec`; `restart_clock` leaves evaluation and
    checkpoint time out of the rates.

    Raises (from `push`, `fetch`, `log`):
      NonFiniteLossError: a fetched step's loss is NaN or Inf.
    """

    def __init__(self, writer: MetricsWriter, progress: Progress):
        self._writer = writer
        self._progress = progress
        self._pending: tuple[int, Any] | None = None  # (step, device metrics) in flight
        self._sums = dict.fromkeys(_SUMMED, 0.0)
        self._count = 0
        self._waited = 0.0  # seconds the loop waited for batches this interval
        self._learning_rate = 0.0
        self.last_loss = float("nan")  # of the last fetched step
        self.logged_loss = float("nan")  # train/loss of the last row written (a window's mean)
        self.logged_tokens_per_sec = 0.0  # train/tokens_per_sec of the last row written
        self._clock = time.perf_counter()
        self._first = True
        self._steady_time = 0.0
        self._steady_steps = 0

    def push(self, step: int, device_metrics: Any) -> None:
        """Records step `step`'s metrics (still on device); fetches the previous step's."""
        self.fetch()
        self._pending = (step, device_metrics)

    def waited(self, seconds: float) -> None:
        """Adds `seconds` the loop spent getting a step's batch to the interval."""
        self._waited += seconds

    def fetch(self) -> None:
        """Fetches the metrics in flight, if any, into the interval's sums."""
        if self._pending is None:
            return
        import jax  # noqa: PLC0415

        step, device_metrics = self._pending
        self._pending = None
        m = jax.device_get(device_metrics)
        loss = float(m["loss"])
        if not math.isfinite(loss):
            raise NonFiniteLossError(step, loss)
        for k in _SUMMED:
            self._sums[k] += float(m[k])
        self._count += 1
        self.last_loss = loss
        self._learning_rate = float(m["learning_rate"])

    def log(self, step: int) -> None:
        """Fetches, writes the interval's row at `step`, starts a new interval."""
        self.fetch()
        elapsed = max(time.perf_counter() - self._clock, 1e-9)
        n = max(self._count, 1)
        if self._first:
            self._first = False
        else:
            self._steady_time += elapsed
            self._steady_steps += self._count
        row = {
            "train/loss": self._sums["loss"] / n,
            "train/loss_window_steps": self._count,
            "train/accuracy": self._sums["accuracy"] / n,
            "train/grad_norm": self._sums["grad_norm"] / n,
            "train/learning_rate": self._learning_rate,
            "train/tokens_per_sec": self._sums["tokens"] / elapsed,
            "train/steps_per_sec": self._count / elapsed,
            "train/input_wait_ms": 1000.0 * self._waited / n,
        }
        self._writer.write(step, row)
        if self._count:
            self.logged_loss = row["train/loss"]
        self.logged_tokens_per_sec = row["train/tokens_per_sec"]
        self._progress.update(self._count, row["train/loss"], row["train/tokens_per_sec"])
        self._sums = dict.fromkeys(_SUMMED, 0.0)
        self._count, self._waited = 0, 0.0
        self.restart_clock()

    def restart_clock(self) -> None:
        """Starts timing the interval now (after an evaluation or a checkpoint)."""
        self._clock = time.perf_counter()

    @property
    def steady_steps_per_sec(self) -> float:
        """Steps a second over every interval but the first (NaN if none)."""
        if self._steady_time <= 0:
            return float("nan")
        return self._steady_steps / self._steady_time


def flat_hparams(record: dict[str, Any]) -> dict[str, Any]:
    """A run's config as plain JSON (`Parts.record`) made flat, ``{"key": value,
    "model.key": value}``, for TensorBoard."""
    flat = {}

    def add(name: str, value: Any) -> None:  # nested groups (model.position_options.rope.*) too
        if isinstance(value, dict):
            for sub, v in value.items():
                add(f"{name}.{sub}", v)
        else:
            flat[name] = "" if value is None else (
                str(tuple(value)) if isinstance(value, list) else value)  # fmt: skip

    for key, value in record.items():
        add(key, value)
    return flat


def last_logged_loss(workdir: str) -> float:
    """The last `train/loss` (an interval's mean) of metrics.jsonl (a run resumed at
    its end trains no step)."""
    logged = logged_losses(workdir)
    return float(logged[-1]) if logged else float("nan")
