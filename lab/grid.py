"""`jattn ablate` with the lab's cost record: how this repository runs its grids.

    python lab/grid.py --config experiments/positional.py --workdir runs/positional --jobs 2

Takes exactly `jattn ablate`'s arguments and runs it in a child process, inside a
session record (`lab/sessions.py`: UTC start and end, wall time, ``--jobs``, runs
to train, CPUs, the load average at start and end, a heartbeat so that a session
killed outright keeps its hours). When the child ends, the grid's "Cost" section
is written to ``DIR/report_appendix.md``, which every rendering of the report
carries (`jattn.analysis.report.appendix`), and the report is rendered once more
(``--report-only``) so that it counts this session.

Why outside the package: a grid's wall time means something only beside the
machine and the load it ran under, which is this lab's bookkeeping, not a
library's; an installed `jattn ablate` writes the same report without it.

A SIGTERM or SIGINT to this process is passed on to `jattn ablate` (which saves
and stops, "preempted"); the child runs in its own process group so that a
signal sent to this one's group reaches it once. `--emit`, `--report-only` and
`--reevaluate` train nothing: they run with the appendix refreshed and no
session recorded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

LAB = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(LAB))

from jattn.analysis.report import APPENDIX_FILE  # noqa: E402
from jattn.cli.ablate import make_parser  # noqa: E402
from jattn.cli.common import parse_with_overrides  # noqa: E402
from lab import sessions  # noqa: E402

# The runner's own lines (`jattn.analysis.runner.run_grid`).
TO_TRAIN = re.compile(r"^ablation: \d+ runs, \d+ already finished, (\d+) to train")
PREEMPTED = "ablation: preempted; rerun the same command to resume"


def planned_steps(config: str, overrides, workdir: str) -> list[int]:
    """Each run's ``num_train_steps``, as `jattn ablate` expands the grid."""
    from jattn.analysis import grid as grid_lib  # noqa: PLC0415
    from jattn.train.config import load_config  # noqa: PLC0415

    root = os.path.dirname(LAB)  # the checkout this script is in
    exp = grid_lib.apply_experiment_overrides(load_config(config), overrides, root)
    runs = grid_lib.expand(exp, os.path.abspath(workdir))
    return [c.num_train_steps for c in grid_lib.checked_configs(exp, runs, root)]


def write_appendix(workdir: str, steps: list[int]) -> None:
    """``DIR/report_appendix.md`` from the sessions recorded so far (nothing without any)."""
    lines = sessions.cost_section(workdir, steps)
    if not lines:
        return
    path = os.path.join(workdir, APPENDIX_FILE)
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


def _ablate(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "jattn.cli", "ablate", *argv]


def _without_jobs(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--jobs":
            skip = True
        elif not a.startswith("--jobs="):
            out.append(a)
    return out


def train(argv: list[str], workdir: str, jobs: int) -> tuple[int, bool, int]:
    """Runs `jattn ablate argv` inside a session; (its exit status, whether a
    signal came to this process, the runs it set out to train)."""
    signalled = []
    with sessions.recording(workdir, jobs=jobs, to_train=None) as session:
        child = subprocess.Popen(
            _ablate(argv), stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True
        )

        def forward(signum, _frame):
            signalled.append(signum)
            child.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        preempted = False
        try:
            for line in child.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                found = TO_TRAIN.match(line)
                if found:
                    session["runs_to_train"] = int(found.group(1))
                preempted = preempted or line.startswith(PREEMPTED)
            status = child.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if session["runs_to_train"] is None:
            session["runs_to_train"] = 0  # stopped before training (e.g. a bad flag): no cost
        if status != 0:
            session["outcome"] = f"failed: exit {status}"
        else:
            session["outcome"] = "preempted" if preempted else "finished"
    return status, bool(signalled), session["runs_to_train"]


def main(argv: list[str]) -> int:
    args, overrides = parse_with_overrides(make_parser(), argv)
    workdir = args.workdir
    if args.emit:
        return subprocess.call(_ablate(argv))
    if args.report_only or args.reevaluate:
        write_appendix(workdir, planned_steps(args.config, overrides, workdir))
        return subprocess.call(_ablate(argv))
    os.makedirs(workdir, exist_ok=True)
    status, signalled, trained = train(argv, workdir, args.jobs)
    if not os.path.exists(os.path.join(workdir, sessions.SESSIONS_FILE)):
        return status  # no session has trained here (e.g. the config was refused)
    write_appendix(workdir, planned_steps(args.config, overrides, workdir))
    if status == 0 and not signalled and trained:
        # The child's report was written while this session was still open.
        again = subprocess.run(
            _ablate([*_without_jobs(argv), "--report-only"]), capture_output=True, text=True
        )
        if again.returncode != 0:
            sys.stderr.write(again.stderr)
            return again.returncode
        print(f"lab/grid.py: the report counts this session ({APPENDIX_FILE})")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
