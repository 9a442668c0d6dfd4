"""Run benchmark cells in child processes, each with its own timeout.

The stage runner behind `benchmarks/gpu.py`, with no jax import, so
that the parent process never initialises (and never holds memory on) the
GPU. Why child processes: a compiler failure in LLVM or ptxas aborts the
whole process (a signal, not an exception), and a hung compilation never
returns, so no try/except can protect one cell from another. Here a cell is
`python <script> --cell '<json>' --rows <file>`; the child appends one JSON
object a row to `<file>` as each measurement finishes, so a cell that dies
half-way keeps its finished rows, and the parent records the death as a
failed row and goes on with the next cell.

Each child runs with `XLA_FLAGS=--xla_dump_to=<dumps>/<cell>` (HLO as text,
which holds the Pallas kernels' Triton IR in their custom calls); the dump
and the child's output are kept for a failed cell and deleted for a passing
one unless `keep_dumps`.

A row may carry `share` (a dict): the runner keeps it and passes everything
shared so far to later cells as `spec["shared"]` (the measured matmul peak
reaches the timing cells this way).

Rows are dicts; the parent fills `stage`, `cell`, `status` and `seconds`
where the child did not, and writes every row to the CSV as it arrives.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

__all__ = ["Cell", "StageRunner"]


@dataclass(frozen=True)
class Cell:
    """One unit of work in its own process.

    `name` identifies it in rows, logs and dump folders; `spec` is the JSON
    the child receives; `timeout_s` its wall-clock limit; `expect_s` what it
    should take (a stage starts a cell only while that still fits its budget).
    """

    name: str
    spec: dict = field(hash=False)
    timeout_s: float
    expect_s: float = 10.0


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


class StageRunner:
    """Runs cells of `script` one after the other, writing rows to `csv_path`.

    Args:
      script: the Python file whose `--cell` mode runs one cell.
      csv_path: CSV the rows go to (appended; header written once).
      columns: CSV columns (keys a row lacks are left empty, extra ones dropped).
      dump_dir: parent folder of the per-cell XLA dumps and logs.
      env: extra environment for the children.
      keep_dumps: keep dumps of passing cells too.
      log: `log(message)` for progress lines.
    """

    def __init__(
        self, script, csv_path, columns, dump_dir, *, env=None, keep_dumps=False, log=print
    ):
        self.script = script
        self.csv_path = csv_path
        self.columns = list(columns)
        self.dump_dir = dump_dir
        self.env = dict(env or {})
        self.keep_dumps = keep_dumps
        self.log = log
        self.rows: list[dict] = []
        self.shared: dict = {}
        os.makedirs(os.path.dirname(os.path.abspath(csv_path)), exist_ok=True)
        os.makedirs(dump_dir, exist_ok=True)

    def _write(self, row: dict) -> None:
        new = not os.path.exists(self.csv_path) or os.path.getsize(self.csv_path) == 0
        with open(self.csv_path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow({c: row.get(c, "") for c in self.columns})
        self.rows.append(row)

    def run(self, stage: str, cell: Cell, timeout_s: float | None = None) -> list[dict]:
        """Run one cell (for at most `timeout_s`, default the cell's own);
        returns its rows (at least one: a failure row if the child produced
        none or died)."""
        timeout_s = cell.timeout_s if timeout_s is None else timeout_s
        safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in cell.name)
        cell_dir = os.path.join(self.dump_dir, f"{stage}-{safe}")
        shutil.rmtree(cell_dir, ignore_errors=True)
        os.makedirs(cell_dir)
        rows_path = os.path.join(cell_dir, "rows.jsonl")
        log_path = os.path.join(cell_dir, "output.txt")
        env = dict(os.environ, **self.env)
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_dump_to={cell_dir} --xla_dump_hlo_as_text".strip()
        spec = json.dumps(dict(cell.spec, shared=self.shared))
        cmd = [sys.executable, self.script, "--cell", spec, "--rows", rows_path]
        t0 = time.perf_counter()
        failure = None
        with open(log_path, "w") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
                proc.wait()
                rc = None
                failure = f"timeout after {timeout_s:.0f} s"
        seconds = time.perf_counter() - t0
        if failure is None and rc != 0:
            failure = f"crash: {_signal_name(rc)}" if rc < 0 else f"exit status {rc}"
        rows = []
        if os.path.exists(rows_path):
            with open(rows_path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        failed = failure is not None or any(
            not str(r.get("status", "ok")).startswith(("ok", "PASS", "skip")) for r in rows
        )
        if failure is not None:
            with open(log_path) as f:
                tail = f.read()[-300:].strip().replace("\n", " | ")
            rows.append(dict(status=f"FAIL {failure}", note=tail))
        for r in rows:
            self.shared.update(r.get("share") or {})
            r.setdefault("stage", stage)
            r.setdefault("cell", cell.name)
            r.setdefault("status", "ok")
            r.setdefault("seconds", f"{seconds:.1f}")
            if failed or self.keep_dumps:
                r["dump"] = cell_dir
            self._write(r)
        if failed or self.keep_dumps:
            self.log(f"{stage}/{cell.name}: kept {cell_dir} (XLA dump, output.txt)")
        else:
            shutil.rmtree(cell_dir, ignore_errors=True)
        return rows

    def run_stage(self, stage: str, cells: list[Cell], budget_s: float) -> bool:
        """Run `cells` in order while each still fits `budget_s` (by its
        `expect_s`); the rest get a "skip: stage budget" row. A cell's timeout
        is also cut to what is left of the budget, so a stage never overruns
        it. Returns whether every row that ran passed."""
        t0 = time.perf_counter()
        ok = True
        for cell in cells:
            used = time.perf_counter() - t0
            if used + cell.expect_s > budget_s:
                self._write(dict(stage=stage, cell=cell.name, status="skip: stage budget"))
                self.log(f"{stage}/{cell.name}: skipped (stage budget {budget_s:.0f} s)")
                continue
            rows = self.run(stage, cell, min(cell.timeout_s, budget_s - used))
            for r in rows:
                shown = {k: v for k, v in r.items() if v not in ("", None)}
                shown = {k: v for k, v in shown.items() if k not in ("stage", "cell", "share")}
                self.log(f"{stage}/{cell.name}: " + " ".join(f"{k}={v}" for k, v in shown.items()))
                ok &= str(r["status"]).startswith(("ok", "PASS", "skip"))
        self.log(f"stage {stage}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s")
        return ok
