"""Runs of a grid side by side: `jattn ablate --jobs N`.

A grid's runs (every seed its own run) are independent, so `--jobs N` trains
N of them at once, each a job: its own process pinned to its own share of
the CPUs (before jax starts, so XLA sizes its thread pool to that share).
`train_run` is what a job does, and what `jattn ablate` without `--jobs`
does for each run in turn.

Whether it pays depends on how well one job uses its CPUs. Measured on this
project's 2-core machine, 2026-12-02, when a job was a group's 3 seeds
trained in one program (an earlier jattn's; a seed's run computes what it
computed there): a group alone on both cores against two groups side by side
on one core each, the same hour (machine speed drifts by day: compare within
a run of measurements):

- duplication (encoder-decoder, 2+2 layers of width 64): 4.93 steps/s
  alone, 3.59 and 3.55 side by side (1.45x the steps); 400-step groups
  took 109 s alone and 158 s for two, 1.38x;
- decoder-only copy (4 layers, rows of 128 tokens): 3.20 steps/s alone,
  2.49 and 2.47 side by side (1.55x); 150 s alone, 197 s for two, 1.52x.

What a user sees: one line when a job starts (its CPUs and its log file,
``DIR/logs/<job>.log``, which holds everything the job prints) and one when
it ends. What is kept on the way:

- Data sets are prepared here, before any job starts, so two jobs never
  build the same tfds data set at once.
- SIGTERM or Ctrl-C stops new jobs and sends SIGTERM to the running ones,
  which save a checkpoint at their next step and exit; rerunning the same
  command resumes them (jobs ignore SIGINT themselves, so a Ctrl-C in the
  terminal reaches them only through this process, as a SIGTERM). A job
  whose parent dies is sent SIGTERM by the kernel (Linux).
- A job that fails stops new jobs but not the running ones: they finish,
  and then `JobFailed` names the failed jobs and their logs.

On a GPU the jobs share the device: each process would otherwise preallocate
75% of its memory, and the second could not start. `job_environment` gives
each job `XLA_PYTHON_CLIENT_MEM_FRACTION` = 0.9 / N (its cap; the parent's
environment around the jobs' start, which spawned processes inherit) unless
the user set `XLA_PYTHON_CLIENT_MEM_FRACTION`, `XLA_PYTHON_CLIENT_PREALLOCATE`
or `XLA_PYTHON_CLIENT_ALLOCATOR` already; on the CPU and on a TPU (a TPU chip
takes one process) nothing is set. `accelerator` names the platform without
starting jax's backend here (it would take the memory the jobs need).

A run's numbers depend on how many CPUs its process has, not on `--jobs`
itself: XLA:CPU splits some reductions by thread, so a run pinned to one CPU
rounds differently in float32 (about 1e-7 relative in the first steps, which
a long run can amplify) than the same run on two, and equals the same run on
a one-CPU machine (checked: `taskset -c 0 jattn ablate` gives byte-identical
metrics). Compare runs made with the same CPUs per job.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "SHARING_KEYS",
    "JobFailed",
    "accelerator",
    "cpu_slots",
    "fmt_cpus",
    "fmt_duration",
    "job_environment",
    "log_diverged",
    "prepare_data",
    "preempted",
    "stopped_status",
    "train_jobs",
    "train_run",
]

LOG_DIR = "logs"

# The environment variables by which processes share one GPU (jax's GPU memory docs).
SHARING_KEYS = (
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
)
_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")
_GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd")


def accelerator(environ: Mapping[str, str] | None = None) -> str:
    """The platform jobs started from here run on ("gpu", "tpu" or "cpu"), read
    without starting jax's backend: `JAX_PLATFORMS` when set (its first entry),
    else "gpu" when a CUDA or ROCm plugin of jax is installed and the driver's
    device node exists, "tpu" when libtpu is installed and /dev/accel0 exists."""
    environ = os.environ if environ is None else environ
    named = (environ.get("JAX_PLATFORMS") or "").split(",")[0].strip().lower()
    if named:
        return "gpu" if named in ("cuda", "rocm", "gpu") else named
    if any(importlib.util.find_spec(p) for p in _GPU_PLUGINS) and any(
        os.path.exists(d) for d in _GPU_DEVICES
    ):
        return "gpu"
    if importlib.util.find_spec("libtpu") and os.path.exists("/dev/accel0"):
        return "tpu"
    return "cpu"


def job_environment(jobs: int, platform: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What each of `jobs` processes sharing this machine adds to `environ`: on a
    GPU a memory fraction of 0.9 / jobs, unless `environ` already says how to
    share it (`SHARING_KEYS`); elsewhere nothing."""
    if platform not in ("gpu", "cuda", "rocm") or any(k in environ for k in SHARING_KEYS):
        return {}
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.9 / jobs:.3f}"}


class JobFailed(RuntimeError):
    """One or more jobs of a parallel grid raised or died; the message names their logs."""


def cpu_slots(jobs: int, cpus: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """This process's CPUs cut into `jobs` contiguous shares, as even as they go.

    Raises:
      ValueError: `jobs` < 1 or more jobs than CPUs.
    """
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if jobs < 1 or jobs > len(cpus):
        raise ValueError(
            f"--jobs {jobs}: must be between 1 and the {len(cpus)} CPU(s) this process may use"
        )
    base, extra = divmod(len(cpus), jobs)
    slots, start = [], 0
    for k in range(jobs):
        size = base + (k < extra)
        slots.append(tuple(cpus[start : start + size]))
        start += size
    return slots


def train_run(run, config) -> dict[str, str]:
    """Trains (or resumes) one run of a grid in this process; returns its status
    ``{run name: "finished" | "preempted" | "diverged: <message>"}`` as
    `jattn.analysis.runner` records it.

    Args:
      run: a `jattn.analysis.grid.Run` (its name and workdir).
      config: its checked training config.
    """
    from jattn.train.loop import TrainingDivergedError  # noqa: PLC0415
    from jattn.train.run import train_and_evaluate  # noqa: PLC0415 -- only when a run trains

    try:
        result = train_and_evaluate(config, run.workdir)
    except TrainingDivergedError as e:
        return {run.name: f"diverged: {e}"}
    return {run.name: "preempted" if result["preempted"] else "finished"}


def fmt_cpus(slot: Sequence[int]) -> str:
    """``0,1``: a slot's CPUs as the progress lines print them."""
    return ",".join(map(str, slot))


def log_diverged(status: dict[str, str], log: Callable[[str], None]) -> None:
    """One line per run of a finished job's status that diverged."""
    for name, state in status.items():
        if state.startswith("diverged"):
            log(f"  {name} {state}")


def preempted(status: dict[str, str]) -> bool:
    """Whether a job's runs stopped on SIGTERM (a rerun resumes them)."""
    return any(state == "preempted" for state in status.values())


def _log_name(label: str) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in label.replace("=", "-"))
    return safe + ".log"


def _set_parent_death_signal() -> None:
    """Linux: SIGTERM to this process when its parent dies (no orphaned training)."""
    try:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stopped_status(run, config) -> dict[str, str]:
    """A run that a SIGTERM stopped outside its steps (`Terminated`: as it started,
    or once its last step was saved): "finished" when its final metrics are
    written, else "preempted" (a rerun resumes it)."""
    from jattn.train import workdir as workdir_lib  # noqa: PLC0415

    done = workdir_lib.finished_metrics(run.workdir, config.num_train_steps)
    return {run.name: "finished" if done else "preempted"}


def _worker(run, config, cpus, log_path, status_path, cache) -> None:
    """A spawned process: pin, redirect output, train one run, write its status."""
    os.sched_setaffinity(0, cpus)  # before jax starts: XLA sizes its threads to these
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C arrives from the parent as SIGTERM
    _set_parent_death_signal()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    shared = [f"{k}={os.environ[k]}" for k in SHARING_KEYS if k in os.environ]
    if shared:  # how this job shares the accelerator, as its process sees it
        print("job environment: " + " ".join(shared), flush=True)
    from jattn.train.allocator import tune_host_allocator  # noqa: PLC0415

    tune_host_allocator()
    if cache["dir"]:
        import jax  # noqa: PLC0415

        jax.config.update("jax_compilation_cache_dir", cache["dir"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", cache["min_secs"])
    from jattn.train.distributed import Terminated  # noqa: PLC0415

    try:
        status = train_run(run, config)
    except Terminated:  # the parent's SIGTERM, outside the run's steps: not a failure
        status = stopped_status(run, config)
    except BaseException as e:
        import traceback  # noqa: PLC0415

        traceback.print_exc()
        status = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
    tmp = status_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, status_path)
    sys.stdout.flush()
    sys.stderr.flush()


def _cache_settings() -> dict[str, Any]:
    """This process's persistent compilation cache, for the jobs to use too."""
    if "jax" not in sys.modules:
        return {"dir": None, "min_secs": None}
    import jax  # noqa: PLC0415

    return {
        "dir": jax.config.jax_compilation_cache_dir,
        "min_secs": jax.config.jax_persistent_cache_min_compile_time_secs,
    }


def prepare_data(configs: Sequence[Any]) -> None:
    """Prepares (once) every data set and vocabulary the configs use, here, so jobs
    started together only read them."""
    from jattn.train.load import TASK_KEYS, load_task  # noqa: PLC0415

    seen = set()
    for config in configs:
        key = tuple(str(config.get(k)) for k in TASK_KEYS)
        if key not in seen:
            seen.add(key)
            load_task(config)


def train_jobs(
    jobs: Sequence[int],
    runs: Sequence[Any],
    configs: Sequence[Any],
    workdir: str,
    *,
    slots: Sequence[tuple[int, ...]],
    log: Callable[[str], None],
    on_done: Callable[[dict[str, str]], None],
    progress: Callable[[int, str, float | None], str],
    platform: str | None = None,
) -> bool:
    """Trains the runs `jobs`, at most ``len(slots)`` at once, each in its own process
    pinned to one slot's CPUs.

    Args:
      jobs: indices into `runs` and `configs`, in the order to start them.
      runs, configs: the grid's runs (`jattn.analysis.grid.Run`) and their configs.
      workdir: the ablation directory (the jobs' logs go to ``workdir/logs/``).
      slots: the CPUs of each concurrent job (`cpu_slots`).
      log: where progress lines go.
      on_done: called with each finished job's status (as `train_run`'s).
      progress: ``(job number, description, ETA in seconds or None) -> line`` for a
        start; the ETA is the mean finished job's time for every job not finished,
        less what the running ones have done, shared by the slots.
      platform: where the jobs run (default: `accelerator()`); on a GPU each job
        gets its share of the device's memory (`job_environment`).

    Returns:
      True when stopped by SIGTERM or Ctrl-C (the running jobs saved and exited).

    Raises:
      JobFailed: after the other jobs ended, naming each job that raised or died.
    """
    ctx = multiprocessing.get_context("spawn")
    log_dir = os.path.join(workdir, LOG_DIR)
    os.makedirs(log_dir, exist_ok=True)
    cache = _cache_settings()
    pending = list(enumerate(jobs, start=1))
    free = list(range(len(slots)))
    running: dict[Any, tuple] = {}  # sentinel -> (process, job, number, slot, t0, label, status)
    failed: list[str] = []
    stop = {"now": False}
    durations: list[float] = []

    def request_stop(signum=None, frame=None) -> None:  # noqa: ARG001
        if not stop["now"]:
            log("ablation: stopping: the running jobs save a checkpoint and exit")
        stop["now"] = True
        for proc, *_ in running.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, request_stop) if main_thread else None
    shared = job_environment(len(slots), platform or accelerator(), os.environ)
    if shared:
        log(f"ablation: the jobs share one GPU, each with {_fmt_env(shared)}")
    saved = {k: os.environ.get(k) for k in shared}
    os.environ.update(shared)  # spawned jobs inherit it; restored below
    try:
        while running or (pending and not stop["now"] and not failed):
            while pending and free and not stop["now"] and not failed:
                number, job = pending.pop(0)
                slot = free.pop(0)
                label = runs[job].name
                log_path = os.path.join(log_dir, _log_name(label))
                status_path = log_path[: -len(".log")] + ".status.json"
                if os.path.exists(status_path):
                    os.remove(status_path)
                log(progress(number, label, _eta(durations, pending, running, slots)))
                log(f"  on CPU {fmt_cpus(slots[slot])}; log: {os.path.relpath(log_path, workdir)}")
                proc = ctx.Process(
                    target=_worker,
                    args=(runs[job], configs[job], slots[slot], log_path, status_path, cache),
                    name=f"jattn-job-{number}",
                )
                proc.start()
                running[proc.sentinel] = (proc, job, number, slot, time.time(), label, status_path)
            try:
                ready = multiprocessing.connection.wait(list(running), timeout=5.0)
            except KeyboardInterrupt:
                request_stop()
                continue
            for sentinel in ready:
                proc, job, number, slot, t0, label, status_path = running.pop(sentinel)
                proc.join()
                free.append(slot)
                free.sort()
                status = None
                if os.path.exists(status_path):
                    with open(status_path) as f:
                        status = json.load(f)
                    os.remove(status_path)
                if status is None or "error" in status:
                    why = status["error"] if status else f"exit code {proc.exitcode}"
                    where = os.path.join(LOG_DIR, _log_name(label))
                    failed.append(f"{label} ({why}; log: {where})")
                    log(f"[{number}/{len(jobs)}] {label} FAILED: {why}")
                    continue
                log_diverged(status, log)
                took, stopped = time.time() - t0, preempted(status)
                end = "saved and stopped after" if stopped else "done in"
                log(f"[{number}/{len(jobs)}] {label} {end} {fmt_duration(took)}")
                if stopped:
                    stop["now"] = True
                else:
                    durations.append(took)
                on_done(status)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        for proc, *_ in running.values():  # only after an unexpected error here
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
                proc.join()
    if failed:
        raise JobFailed("jobs failed (the others finished): " + "; ".join(failed))
    return stop["now"]


def _fmt_env(env: Mapping[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env.items()))


def _eta(durations, pending, running, slots) -> float | None:
    """Seconds left, from the mean finished job (None before one finished)."""
    if not durations:
        return None
    mean, now = sum(durations) / len(durations), time.time()
    left = mean * (len(pending) + 1)  # the job being started counts too
    left += sum(max(mean - (now - item[4]), 0.0) for item in running.values())
    return left / len(slots)


def fmt_duration(seconds: float) -> str:
    """``12m05s``."""
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s"
