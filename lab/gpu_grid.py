"""The GPU grid's state between windows: what comes back from the GPU machine, and goes in again.

    python lab/gpu_grid.py pack STATE OUTDIR       # on the GPU machine, after the grid stage
    python lab/gpu_grid.py unpack FILES_AT STATE   # here, on what came back (then carry STATE)

`scripts/gpu_window.sh OUTDIR --grid` trains the Delétang/Ruoss reverse_string
slice (`experiments/deletang.py:reverse`, 36 runs of 10,000 steps) on one GPU with
`--jobs`, in ``STATE`` (``.gpugrid/``, ignored by git, named in the command's
carry). A window is one command of at most 10 minutes on a machine that starts bare
and sends back at most 8 files of 16 MiB; the grid takes more than one window, and
a machine given back keeps nothing. So the window ends by packing ``STATE`` into
``OUTDIR``, and the next one starts from it, unpacked here and carried there:
`jattn ablate` resumes a workdir as it finds it (finished runs skipped, the others
restored from their latest checkpoint).

What travels is what a resume reads, not more: every file of every run (its config,
metrics, evaluations, decodes), the checkpoints of unfinished runs, each its latest
complete step alone, and no checkpoint of a finished run (36 of them, 3 MB each, would not
fit; their results are in their files, and only `jattn ablate --reevaluate` would
read them again). A session here that ends with the grid unfinished keeps what git
can: ``pack --finished-only`` (the finished runs alone, without checkpoints: 0.2 MiB
for the dry run's four), committed, and the runs it left out start again. The tar is
gzipped and cut into parts of at most `PART_BYTES`, ``grid_state.tgz.00``, ``.01``,
... (a file over 16 MiB does not come back).

Why in the lab: a bare machine, 8 files and 16 MiB are this lab's GPU windows, not
a property of jattn; a cluster user resumes the same workdir in place.
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import shutil
import sys
import tarfile
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jattn.train.checkpoints import latest_complete_step  # noqa: E402
from jattn.train.workdir import CONFIG, finished_metrics, read_json  # noqa: E402

__all__ = ["PART_BYTES", "PREFIX", "left_behind", "pack", "unpack"]

PART_BYTES = 15 * 1024 * 1024
PREFIX = "grid_state.tgz."


def _finished(run_dir: str) -> bool:
    """The run reached the steps its own config asks for (`jattn ablate`'s test)."""
    try:
        steps = (read_json(os.path.join(run_dir, CONFIG)) or {}).get("num_train_steps")
    except ValueError:
        return False  # a config cut off mid-write: the run starts again
    return steps is not None and finished_metrics(run_dir, steps) is not None


def left_behind(state: str, finished_only: bool = False) -> list[str]:
    """The paths under `state` (relative to it) that do not travel: every finished run's
    ``checkpoints/``, and each unfinished run's checkpoint steps but the one its resume
    reads (`latest_complete_step`: a newer step whose save the kill cut short stays
    behind, as a resume would pass it over; with `finished_only`, every unfinished run
    whole)."""
    out = []
    for run_dir in sorted(glob.glob(os.path.join(state, "*", "runs", "*"))):
        checkpoints = os.path.join(run_dir, "checkpoints")
        if finished_only and not _finished(run_dir):
            out.append(run_dir)
        elif not os.path.isdir(checkpoints):
            continue
        elif _finished(run_dir):
            out.append(checkpoints)
        else:
            keep = str(latest_complete_step(checkpoints))
            out += [os.path.join(checkpoints, s) for s in os.listdir(checkpoints) if s != keep]
    return [os.path.relpath(p, state) for p in out]


class _Parts(io.RawIOBase):
    """A write-only stream cut into files ``OUTDIR/PREFIXnn`` of at most `size` bytes."""

    def __init__(self, outdir: str, size: int):
        self.outdir, self.size, self.names, self._file, self._used = outdir, size, [], None, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        data, n = memoryview(data), len(data)
        while data:
            if self._file is None or self._used == self.size:
                self._next()
            k = min(len(data), self.size - self._used)
            self._file.write(data[:k])
            self._used += k
            data = data[k:]
        return n

    def _next(self) -> None:
        if self._file is not None:
            self._file.close()
        self.names.append(f"{PREFIX}{len(self.names):02d}")
        self._file = open(os.path.join(self.outdir, self.names[-1]), "wb")  # noqa: SIM115
        self._used = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


def pack(
    state: str, outdir: str, part_bytes: int = PART_BYTES, finished_only: bool = False
) -> list[str]:
    """Writes `state` less `left_behind` into ``outdir/grid_state.tgz.NN``; their names."""
    skip = {os.path.normpath(p) for p in left_behind(state, finished_only)}

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if os.path.normpath(info.name) in skip else info

    os.makedirs(outdir, exist_ok=True)
    parts = _Parts(outdir, part_bytes)
    with parts, tarfile.open(fileobj=parts, mode="w|gz") as tar:
        for name in sorted(os.listdir(state)):
            tar.add(os.path.join(state, name), arcname=name, filter=keep)
    return parts.names


def unpack(files_at: str, state: str) -> list[str]:
    """Replaces `state` with the grid state packed in `files_at`; the runs it holds.

    Raises:
      FileNotFoundError: `files_at` holds no ``grid_state.tgz.NN``.
      ValueError: the parts are not numbered 00, 01, ... without a gap.
    """
    names = sorted(n for n in os.listdir(files_at) if n.startswith(PREFIX))
    if not names:
        raise FileNotFoundError(f"{files_at}: no {PREFIX}NN (lab/gpu_grid.py pack writes them)")
    if names != [f"{PREFIX}{k:02d}" for k in range(len(names))]:
        raise ValueError(f"{files_at}: parts missing or misnumbered: {names}")
    fresh = state.rstrip("/") + ".unpacking"
    shutil.rmtree(fresh, ignore_errors=True)
    os.makedirs(fresh)
    stream = io.BytesIO()  # at most a few 15 MiB parts
    for n in names:
        with open(os.path.join(files_at, n), "rb") as f:
            shutil.copyfileobj(f, stream)
    stream.seek(0)
    with tarfile.open(fileobj=stream, mode="r:gz") as tar:
        tar.extractall(fresh, filter="data")
    shutil.rmtree(state, ignore_errors=True)
    os.replace(fresh, state)
    runs = glob.glob(os.path.join(state, "*", "runs", "*"))
    return sorted(os.path.relpath(p, state) for p in runs)


def _summary(state: str) -> str:
    runs = glob.glob(os.path.join(state, "*", "runs", "*"))
    return f"{len(runs)} runs, {sum(map(_finished, runs))} finished"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lab/gpu_grid.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="STATE -> OUTDIR/grid_state.tgz.NN")
    p.add_argument("state")
    p.add_argument("outdir")
    p.add_argument(
        "--finished-only",
        action="store_true",
        help="the finished runs alone, no checkpoint (small enough to commit: what a "
        "session that ends with the grid unfinished keeps; the others start again)",
    )
    u = sub.add_parser("unpack", help="FILES_AT/grid_state.tgz.NN -> STATE (replaced)")
    u.add_argument("files_at")
    u.add_argument("state")
    args = parser.parse_args(argv)
    if args.verb == "pack":
        if not os.path.isdir(args.state):
            print(f"gpu_grid: no grid state in {args.state}", file=sys.stderr)
            return 1
        names = pack(args.state, args.outdir, finished_only=args.finished_only)
        size = sum(os.path.getsize(os.path.join(args.outdir, n)) for n in names)
        print(f"gpu_grid: packed {_summary(args.state)} into {len(names)} part(s), "
              f"{size / 2**20:.1f} MiB: {' '.join(names)}")  # fmt: skip
    else:
        unpack(args.files_at, args.state)
        print(f"gpu_grid: unpacked {_summary(args.state)} into {args.state}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
