"""`jattn ablate --emit slurm`: an ablation grid as one SLURM array script.

The script follows `launch/slurm.sbatch`: each array task runs its
``jattn train`` under ``srun`` (one process per node, JAX reads the SLURM
environment), ``--requeue`` with ``--signal=TERM@<seconds>`` before the time
limit (jattn checkpoints on SIGTERM and exits 0; a task whose run has no
``final_metrics.json`` then requeues itself with ``scontrol requeue``, since
SLURM requeues only after a node failure or a preemption, and resumes), the
progress bar off (logs, not a terminal), and the ``jattn`` of the
interpreter that emitted the script (an absolute path, so the job does not
depend on the PATH of the compute node).

Resources come from, last one winning: `DEFAULTS` (one CPU task: no GPUs),
the experiment's optional ``slurm`` section (a ConfigDict with any of the
keys of `DEFAULTS`), and the ``--slurm-*`` flags of `jattn ablate`.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from jattn.cli.common import UsageError

__all__ = ["DEFAULTS", "jattn_executable", "resources", "slurm_arguments", "slurm_script"]

# key -> default; the experiment's `slurm` section and the --slurm-* flags use these keys.
DEFAULTS: dict[str, Any] = {
    "partition": "",  # "" leaves it to the cluster's default partition
    "nodes": 1,
    "gpus_per_node": 0,  # a CPU task unless asked
    "cpus_per_task": 4,
    "time": "04:00:00",  # SLURM's formats: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]
    "signal_seconds": 120,  # SIGTERM this long before the time limit
}
_HELP = {
    "partition": "SLURM partition (default: the cluster's default)",
    "nodes": "nodes per run; one jattn process per node (default 1)",
    "gpus_per_node": "GPUs per node (default 0: a CPU task)",
    "cpus_per_task": "CPUs per task (default 4)",
    "time": "time limit per run, e.g. 04:00:00 or 1-00:00:00 (default 04:00:00)",
    "signal_seconds": "send SIGTERM this many seconds before the time limit; jattn "
    "checkpoints and the job is requeued (default 120)",
}


def slurm_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--slurm-partition``, ``--slurm-nodes``, ... (one flag a key of `DEFAULTS`)."""
    group = parser.add_argument_group(
        "SLURM resources (with --emit slurm; they override the experiment's `slurm` section)"
    )
    for key, default in DEFAULTS.items():
        group.add_argument(
            "--slurm-" + key.replace("_", "-"),
            dest="slurm_" + key,
            type=type(default),
            default=None,
            metavar=key.upper(),
            help=_HELP[key],
        )


def time_limit_seconds(text: str) -> int:
    """Seconds in a SLURM time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``).

    Raises:
      UsageError: text in none of these forms.
    """
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise UsageError(f"--slurm-time={text!r}: use MM, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(a), int(b or 0), int(c or 0)
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if c is not None:  # HH:MM:SS
        return (int(a) * 60 + int(b)) * 60 + int(c)
    return int(a) * 60 + int(b or 0)  # MM or MM:SS


def resources(exp, args: argparse.Namespace | None = None) -> dict[str, Any]:
    """`DEFAULTS`, then the experiment's ``slurm`` section, then the ``--slurm-*`` flags.

    Raises:
      UsageError: an unknown key in the experiment's section, or a value out of range.
    """
    values = dict(DEFAULTS)
    section = exp.get("slurm") if "slurm" in exp else None
    if section is not None:
        unknown = sorted(set(section.keys()) - set(DEFAULTS))
        if unknown:
            raise UsageError(
                f"experiment slurm section: unknown keys {unknown}; use {sorted(DEFAULTS)}"
            )
        for key in section.keys():
            try:
                values[key] = type(DEFAULTS[key])(section[key])
            except (TypeError, ValueError):
                raise UsageError(f"experiment slurm.{key}={section[key]!r}: not valid") from None
    for key in DEFAULTS:
        given = getattr(args, "slurm_" + key, None) if args is not None else None
        if given is not None:
            values[key] = given
    for key in ("nodes", "cpus_per_task", "signal_seconds"):
        if values[key] < 1:
            raise UsageError(f"slurm {key} must be >= 1, got {values[key]}")
    if values["gpus_per_node"] < 0:
        raise UsageError(f"slurm gpus_per_node must be >= 0, got {values['gpus_per_node']}")
    limit = time_limit_seconds(values["time"])
    if values["signal_seconds"] >= limit:
        raise UsageError(
            f"slurm signal_seconds={values['signal_seconds']} must be shorter than the time "
            f"limit {values['time']} ({limit} s)"
        )
    return values


def jattn_executable() -> list[str]:
    """The running interpreter's ``jattn`` script, absolute; else ``python -m jattn.cli``."""
    python = os.path.abspath(sys.executable)  # not resolved: a venv's python is a symlink
    script = Path(python).parent / "jattn"
    if script.is_file():
        return [str(script)]
    return [python, "-m", "jattn.cli"]


# Around `srun`: a run the time limit's SIGTERM stopped has saved and exited 0 without
# final_metrics.json. SLURM requeues a --requeue job itself only after a node failure or
# a preemption, not at its time limit, so the script requeues it: only when the job left
# a newer checkpoint than it found (a time limit shorter than start-up plus the signal's
# lead would otherwise requeue forever), and never after a failed run (`set -e` stops
# the script first). launch/slurm.sbatch holds both blocks verbatim (a test says so).
BEFORE = """# latest_step DIR: the step of the run's newest checkpoint, 0 when it has none.
latest_step() {
  local s
  s=$(ls "$1/checkpoints" 2>/dev/null | grep -xE '[0-9]+' | sort -n | tail -1) || true
  echo "${s:-0}"
}
before=$(latest_step "$run_dir")
"""
REQUEUE = """if [ ! -e "$run_dir/final_metrics.json" ]; then
  after=$(latest_step "$run_dir")
  if [ "$after" -le "$before" ]; then
    echo "jattn: $run_dir stopped with no checkpoint newer than step $before; not requeued" \\
      "(is the time limit shorter than start-up plus the signal's lead?)" >&2
    exit 1
  fi
  echo "jattn: $run_dir stopped at step $after, before its last; requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID" || echo "jattn: scontrol requeue failed; resubmit to resume" >&2
fi
"""


def slurm_script(exp, workdir: str, *, repo_root: str, config_spec: str, slurm: dict) -> str:
    """The SLURM array script of the grid: task i runs the ``jattn train`` of run i.

    Every run is checked first (`jattn.analysis.grid.checked_configs`), so a bad
    grid fails here, not on the cluster.

    Args:
      exp: the experiment config, overrides applied.
      workdir: the ablation directory (absolute).
      repo_root: where relative base-config paths resolve.
      config_spec: the experiment's ``--config``, for the comment on the report.
      slurm: `resources(...)`.
    """
    from jattn.analysis import grid as grid_lib  # noqa: PLC0415

    runs = grid_lib.expand(exp, workdir)
    grid_lib.checked_configs(exp, runs, repo_root)
    jattn = jattn_executable()
    cases = []
    for i, run in enumerate(runs):
        base = grid_lib.resolve_base(grid_lib.run_base(exp, run), repo_root)
        args = ["srun", "--kill-on-bad-exit=1", *jattn, "train", "--config", base]
        args += ["--workdir", run.workdir]
        args += [f"--config.{k}={v}" for k, v in run.overrides if k != "progress_bar"]
        args += ["--config.progress_bar=false"]
        cases.append(f"  {i}) run_dir={shlex.quote(run.workdir)}; run=({shlex.join(args)}) ;;")
    header = [
        "#SBATCH --job-name=jattn-ablate",
        f"#SBATCH --array=0-{len(runs) - 1}",
    ]
    if slurm["partition"]:
        header.append(f"#SBATCH --partition={slurm['partition']}")
    header += [
        f"#SBATCH --nodes={slurm['nodes']}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={slurm['cpus_per_task']}",
    ]
    if slurm["gpus_per_node"]:
        header.append(f"#SBATCH --gpus-per-node={slurm['gpus_per_node']}")
    header += [
        f"#SBATCH --time={slurm['time']}",
        f"#SBATCH --signal=TERM@{slurm['signal_seconds']}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",  # a requeued task's log follows its earlier ones
        f"#SBATCH --output={workdir}/slurm-%A_%a.out",
    ]
    report = shlex.join(
        [*jattn, "ablate", "--config", config_spec, "--workdir", workdir, "--report-only"]
    )
    newline = "\n"
    return f"""#!/bin/bash
# Ablation grid from {config_spec}: {len(runs)} runs, one array task each, under srun.
# {slurm["signal_seconds"]} s before the time limit SLURM sends SIGTERM; jattn saves a checkpoint
# and exits 0 without final_metrics.json, and the task requeues itself (below), which
# resumes from that checkpoint.
# Submit with (the output folder must exist first):
#   mkdir -p {shlex.quote(workdir)} && sbatch this_script.sbatch
# When every task has finished, build the report with
#   {report}
{newline.join(header)}
set -euo pipefail
case "$SLURM_ARRAY_TASK_ID" in
{newline.join(cases)}
esac
{BEFORE}"${{run[@]}}"
{REQUEUE}"""
