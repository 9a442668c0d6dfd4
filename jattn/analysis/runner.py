"""An ablation grid run on this machine, or printed for a cluster.

`run_grid` trains the runs, each seed its own run, one after another in this
process (or several at once, each in its own pinned process:
`jattn.analysis.parallel`), skipping finished ones (their
``final_metrics.json`` says they reached ``num_train_steps``) and resuming
interrupted ones (each run's workdir holds its own orbax checkpoints), then
writes the report. A run that diverges is
recorded as such and the grid goes on. `emit` prints the same grid as one
``jattn train`` line per run (`jattn.cli.slurm` makes it a SLURM array
script), so a cluster runs exactly what this machine would.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import ml_collections

from jattn.analysis import grid as grid_lib
from jattn.analysis import parallel, report
from jattn.analysis.parallel import fmt_cpus, fmt_duration
from jattn.train import workdir as workdir_lib
from jattn.train.workdir import WorkdirLock

STATUS_FILE = "ablation_status.json"


def _final(run: grid_lib.Run, num_steps: int) -> dict[str, Any] | None:
    return workdir_lib.finished_metrics(run.workdir, num_steps)


def _train_in_turn(todo, runs, configs, log, done, started, stop) -> bool:
    """The runs `todo` one after another in this process; True when one was
    preempted, or a SIGTERM came at any other moment (between runs, as one
    starts, during a run's last step or final evaluation): then no further run
    starts (`stop`, set by `_sigterm_stops`)."""
    from jattn.train.distributed import Terminated  # noqa: PLC0415 -- imports jax

    start = time.time()
    for number, i in enumerate(todo, start=1):
        if stop.is_set():
            return True
        trained = number - 1
        eta = (time.time() - start) / trained * (len(todo) - trained) if trained else None
        log(started(number, runs[i].name, eta))
        t0 = time.time()
        try:
            job_status = parallel.train_run(runs[i], configs[i])
        except Terminated:  # as the run started, or once its last step was saved
            stop.set()
            job_status = parallel.stopped_status(runs[i], configs[i])
        parallel.log_diverged(job_status, log)
        log(f"  done in {fmt_duration(time.time() - t0)}")
        done(job_status)
        if parallel.preempted(job_status) or stop.is_set():
            return True
    return False


@contextlib.contextmanager
def _sigterm_stops() -> Iterator[threading.Event]:
    """``with _sigterm_stops() as stop:`` SIGTERM sets `stop` and nothing else.

    Between the jobs of `_train_in_turn` this handler is the one in place (a
    run's `PreemptionWatch` replaces it while the run trains, and puts it back),
    so a SIGTERM there is not Python's default (exit 143, no line) and never
    raises where an exception could be dropped: the grid reads the flag before
    each job. Only the main thread can install it; elsewhere `stop` is never set.
    """
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_grid(
    exp: ml_collections.ConfigDict,
    workdir: str,
    *,
    repo_root: str,
    log=print,
    parallel_jobs: int = 1,
) -> dict[str, Any]:
    """Trains every run of the grid that is not finished, then reports.

    Args:
      exp: the experiment config (see `jattn.analysis.grid`).
      workdir: the ablation directory; runs go to ``workdir/runs/<name>``,
        the report to ``results.csv``, ``results.md`` and ``*.png``.
      repo_root: where relative config paths are resolved.
      log: where progress lines go.
      parallel_jobs: train this many runs at once, each in its own process
        pinned to its share of the CPUs (`jattn.analysis.parallel`); 1: one
        after another in this process.

    Returns:
      The report summary (see `jattn.analysis.report.write_report`).

    Raises:
      ValueError: `parallel_jobs` < 1 or above the CPUs this process may use.
      JobFailed: a run failed while others trained in parallel (after they end).
      ConfigError: runs are left to train in a grid an earlier jattn trained as
        stacked seed programs (``DIR/groups/``).
      WorkdirLockedError: another `jattn ablate` is training this grid
        (``workdir/.lock``, `jattn.train.workdir`).
    """
    parallel.cpu_slots(parallel_jobs)  # a bad --jobs fails before anything runs
    runs = grid_lib.expand(exp, workdir)
    configs = grid_lib.checked_configs(exp, runs, repo_root)  # all checked first
    report.check_reference(exp, runs)
    # One grid per directory: a second `jattn ablate` on it (the same command in
    # another terminal) would train the same jobs and race on every file.
    with _sigterm_stops() as stop, WorkdirLock(workdir):
        return _train_and_report(exp, runs, configs, workdir, log, parallel_jobs, stop)


def check_layout(workdir: str, todo) -> None:
    """Refuses (one line) a grid with runs left to train whose seed programs an
    earlier jattn kept in ``DIR/groups/<program>/`` as stacked checkpoints, which
    no run resumes.

    Raises:
      ConfigError: ``DIR/groups/`` holds something and `todo` is not empty.
    """
    from jattn.train.config import ConfigError  # noqa: PLC0415

    groups = os.path.join(workdir, "groups")
    if todo and os.path.isdir(groups) and os.listdir(groups):
        raise ConfigError(
            f"{groups} holds the stacked checkpoints of seed programs of an earlier jattn, "
            "which this one does not resume: finish it with the jattn release that started it "
            "(the last commit with jattn/train/seed_program.py: git checkout $(git log -1 "
            "--format=%h --diff-filter=D -- jattn/train/seed_program.py)~1), or train into "
            "a new --workdir"
        )


def _train_and_report(exp, runs, configs, workdir, log, parallel_jobs, stop):
    """`run_grid` once the grid is checked and its directory locked; a SIGTERM from
    here on sets `stop`: no run starts after it, and the report is written whole."""
    with open(os.path.join(workdir, "experiment.json"), "w") as f:
        f.write(exp.to_json_best_effort(indent=2, sort_keys=True))
    status: dict[str, str] = {}
    todo = [i for i, r in enumerate(runs) if _final(r, configs[i].num_train_steps) is None]
    for i, r in enumerate(runs):
        if i not in todo:
            status[r.name] = "finished"
    log(
        f"ablation: {len(runs)} runs, {len(runs) - len(todo)} already finished, "
        f"{len(todo)} to train -> {workdir}"
    )
    check_layout(workdir, todo)
    start = time.time()
    status_path = os.path.join(workdir, STATUS_FILE)

    def done(job_status: dict[str, str]) -> None:
        status.update(job_status)
        with open(status_path, "w") as f:
            json.dump(status, f, indent=2)

    def started(number: int, what: str, eta_s: float | None) -> str:
        eta = "" if eta_s is None else f", ETA {fmt_duration(eta_s)}"
        return f"[{number}/{len(todo)}] {what} (elapsed {fmt_duration(time.time() - start)}{eta})"

    if parallel_jobs > 1 and len(todo) > 1:
        slots = parallel.cpu_slots(min(parallel_jobs, len(todo)))
        log(f"ablation: {len(slots)} runs at once, on CPUs {' | '.join(map(fmt_cpus, slots))}")
        parallel.prepare_data([configs[i] for i in todo])
        preempted = stop.is_set() or parallel.train_jobs(  # its own handler from here
            todo, runs, configs, workdir, slots=slots, log=log, on_done=done, progress=started
        )
    else:
        preempted = _train_in_turn(todo, runs, configs, log, done, started, stop)
    if preempted:
        log("ablation: preempted; rerun the same command to resume")
    else:
        log(f"ablation: trained {len(todo)} runs in {fmt_duration(time.time() - start)}")
    summary = report.write_report(exp, runs, configs, workdir, status=status)
    if stop.is_set() and not preempted:
        log("ablation: SIGTERM while the report was written; it is complete, nothing was lost")
    return summary


def emit(
    exp: ml_collections.ConfigDict, workdir: str, *, fmt: str, repo_root: str, config_spec: str
) -> str:
    """The grid as shell commands, one ``jattn train`` line per run (``fmt="commands"``).

    A SLURM array script is `jattn.cli.slurm.slurm_script` (`jattn ablate
    --emit slurm`), which also takes the cluster resources."""
    if fmt != "commands":
        raise ValueError(
            f"emit: fmt must be 'commands', got {fmt!r} (SLURM scripts: jattn.cli.slurm)"
        )
    runs = grid_lib.expand(exp, workdir)
    grid_lib.checked_configs(exp, runs, repo_root)  # fail here, not on the cluster
    report.check_reference(exp, runs)
    lines = []
    for r in runs:
        base = grid_lib.resolve_base(grid_lib.run_base(exp, r), repo_root)
        args = ["jattn", "train", "--config", base, "--workdir", r.workdir]
        args += [f"--config.{k}={v}" for k, v in r.overrides]
        lines.append(shlex.join(args))
    return "\n".join(lines) + "\n"


def main_ablate(
    config_spec: str,
    workdir: str,
    overrides,
    *,
    emit_fmt: str | None,
    report_only: bool,
    repo_root: str,
    parallel_jobs: int = 1,
    reevaluate: bool = False,
) -> int:
    """`jattn ablate` (see `jattn.cli.ablate`): runs, emits or reports the grid.

    Args:
      config_spec: the experiment config, ``experiments/X.py[:arg]``.
      workdir: the ablation directory.
      overrides: ``(dotted key, raw value)`` pairs for the experiment config
        (see `jattn.analysis.grid.apply_experiment_overrides`).
      emit_fmt: None (run the grid) or "commands" (print it; `--emit slurm`
        is `jattn.cli.slurm`).
      report_only: only rebuild the report from the runs in `workdir`.
      repo_root: where relative base-config paths resolve.
      parallel_jobs: see `run_grid`.
      reevaluate: evaluate every finished run again from its final checkpoint
        (`jattn.analysis.reevaluation`), then rebuild the report; nothing trains.

    Returns:
      The exit status, 0 (errors are raised as ConfigError).
    """
    from jattn.train.config import load_config  # noqa: PLC0415

    exp = grid_lib.apply_experiment_overrides(load_config(config_spec), overrides, repo_root)
    workdir = os.path.abspath(workdir)
    if emit_fmt:
        sys.stdout.write(
            emit(exp, workdir, fmt=emit_fmt, repo_root=repo_root, config_spec=config_spec)
        )
        return 0
    if report_only or reevaluate:
        runs = grid_lib.expand(exp, workdir)
        configs = grid_lib.checked_configs(exp, runs, repo_root)
        if reevaluate:
            from jattn.analysis import reevaluation  # noqa: PLC0415 -- imports jax

            with WorkdirLock(workdir):  # no `jattn ablate` trains it meanwhile
                reevaluation.reevaluate_grid(runs, configs, workdir)
        summary = report.write_report(exp, runs, configs, workdir, status=None)
    else:
        summary = run_grid(exp, workdir, repo_root=repo_root, parallel_jobs=parallel_jobs)
    print(summary["markdown"])
    return 0
