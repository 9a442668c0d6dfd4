"""What the benchmark scripts share: their flags, a timer, a child process with a timeout, tables.

The benchmarks are scripts of the checkout (`python benchmarks/NAME.py`), not of
the installed package: they measure its code against peers and read its
configs/ and tests/. Importing this reads ``--platform`` into `JAX_PLATFORMS`
(jax reads it once), so a script imports it before jax; it imports no jax
itself, so the GPU runner's parent, which must not hold the GPU, can use it.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = os.path.join("runs", "bench")


def select_platform(argv: Sequence[str] | None = None) -> str | None:
    """Sets `JAX_PLATFORMS` from ``--platform NAME`` (or ``--platform=NAME``) in
    `argv` (default `sys.argv`); returns the name, or None when not given."""
    argv = list(sys.argv[1:] if argv is None else argv) + [""]
    for arg, after in zip(argv, argv[1:], strict=False):
        if arg.startswith("--platform=") or (arg == "--platform" and after):
            os.environ["JAX_PLATFORMS"] = name = arg.split("=", 1)[1] if "=" in arg else after
            return name
    return None


select_platform()  # before the script that imports this imports jax


def parser(doc: str, *, out: str | None = None) -> argparse.ArgumentParser:
    """The script's `argparse` parser: described by `doc`'s first paragraph, with
    ``--platform`` and, when `out` is given, ``--out`` (default ``runs/bench/<out>``)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    where = "default: where it is started (JAX_PLATFORMS, else jax's choice)"
    p.add_argument("--platform", help=f"jax platform to run on (cpu, cuda, rocm, tpu); {where}")
    if out is not None:
        default = os.path.join(OUT_DIR, out)
        p.add_argument("--out", default=default, help="where the table goes (%(default)s)")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`p`'s arguments from `argv` (default the command line), `--head_dim` read as `--head-dim`."""
    from jattn.cli.common import normalize_flags  # noqa: PLC0415

    return p.parse_args(normalize_flags(sys.argv[1:] if argv is None else argv))


# The timer.
def rounds(cells, repeats: int, *, warm=True, alternate=False, each_round=None) -> list[list]:
    """Seconds of each cell's call (a function of nothing, its result waited for), in
    `repeats` rounds visiting every cell once, so that the machine's load hits all
    alike. `warm`: an untimed call before each timed one (no cell timed cold after
    another's working set); `alternate`: the order reversed every other round;
    `each_round(r, times)` after each round."""
    import jax  # noqa: PLC0415

    times: list[list[float]] = [[] for _ in cells]
    for r in range(repeats):
        for i in reversed(range(len(cells))) if alternate and r % 2 else range(len(cells)):
            if warm:
                jax.block_until_ready(cells[i]())
            t0 = time.perf_counter()
            jax.block_until_ready(cells[i]())
            times[i].append(time.perf_counter() - t0)
        if each_round is not None:
            each_round(r, times)
    return times


def time_cells(cells: dict, repeats: int, max_gib: float) -> dict[object, dict]:
    """key -> ``{"temp_mib", "seconds", "note"}`` of each cell `(fn, args)` of `cells`:
    every one compiled first (an error is its note), its compiled temporaries read
    before anything runs (`memory_analysis`), one over `max_gib` reported and
    skipped, the rest timed by `rounds` (median)."""
    import statistics  # noqa: PLC0415

    import jax  # noqa: PLC0415

    out, ready = {}, {}
    for key, (fn, args) in cells.items():
        out[key] = dict(temp_mib=None, seconds=None, note="")
        try:
            compiled = jax.jit(fn).lower(*args).compile()
        except Exception as e:  # report and carry on with the other cells
            out[key]["note"] = f"error: {type(e).__name__}: {str(e)[:80]}"
            continue
        temp = getattr(compiled.memory_analysis(), "temp_size_in_bytes", None)
        out[key]["temp_mib"] = None if temp is None else temp / 2**20
        if temp is not None and temp > max_gib * 2**30:
            out[key]["note"] = f"skipped: needs {temp / 2**30:.1f} GiB"
        else:
            ready[key] = lambda c=compiled, a=args: c(*a)
    for key, t in zip(ready, rounds(list(ready.values()), repeats), strict=True):
        out[key]["seconds"] = statistics.median(t)
    return out


def train_steps(config, num_batches: int, *, donate: bool = False) -> dict:
    """`config`'s train step as `jattn train` builds it, compiled and run once (the
    first run allocates): ``compiled``, ``state``, its first `num_batches` ``batches``
    (device arrays), ``rows`` (their shape) and ``run``, a cell stepping over them."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import linen as nn  # noqa: PLC0415

    from jattn.models import Transformer  # noqa: PLC0415
    from jattn.train import load, optim, steps  # noqa: PLC0415
    from jattn.train.config import read_parts  # noqa: PLC0415

    parts = read_parts(config)  # the pieces each part of a run reads
    task = load.open_task(parts.data)
    model = Transformer(parts.model.build(task.tokenizer.vocab_size))
    tx, schedule = optim.make_optimizer(parts.optimizer)
    init = steps.make_init(model, tx, parts.data, rows=1)
    state = jax.jit(lambda r: nn.meta.unbox(init(r)))(jax.random.key_data(jax.random.key(0)))
    it = iter(load.train_loader(task, parts.data))
    batches = [jax.tree.map(jnp.asarray, next(it)) for _ in range(num_batches)]
    step = steps.make_train_step(model, tx, schedule, label_smoothing=parts.step.label_smoothing)
    step = jax.jit(step, donate_argnums=(0,) if donate else ())
    compiled = step.lower(state, batches[0]).compile()
    (rows, s), t = batches[0]["inputs"].shape, batches[0]["targets"].shape[1]
    out = dict(compiled=compiled, batches=batches, rows=f"{rows}x({s}+{t})")
    out["state"], _ = jax.block_until_ready(compiled(state, batches[0]))

    def run():
        for x in batches:  # dispatched back to back, as a run's loop does
            out["state"], _ = compiled(out["state"], x)
        return out["state"]

    out["run"] = run
    return out


# A child process with a timeout.
# How a child ended (ok, exit N, crash: SIGNAME, timeout after N s), its seconds, its output.
Child = collections.namedtuple("Child", "status seconds output")


def run_child(cmd, log_path, *, timeout_s=None, env=None, cwd=None) -> Child:
    """Runs `cmd`, its output to `log_path`, in a session of its own: past `timeout_s`
    it is killed with all it started. A compiler failure in LLVM or ptxas aborts (a
    signal) and a hung compile never returns: only a process isolates one."""
    t0 = time.perf_counter()
    with open(log_path, "w") as out:
        kw = dict(stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        proc = subprocess.Popen(cmd, **kw)
        try:
            rc = proc.wait(timeout=timeout_s)
            name = {-s.value: s.name for s in signal.Signals}.get(rc, f"signal {-rc}")
            status = "ok" if rc == 0 else f"exit {rc}" if rc > 0 else f"crash: {name}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timeout after {timeout_s:.0f} s"
    with open(log_path, errors="replace") as f:
        return Child(status, time.perf_counter() - t0, f.read())


def child_env(**extra: str) -> dict[str, str]:
    """This environment, `extra` set and the checkout first on PYTHONPATH (this `jattn`)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# Tables.
def table(header: Sequence[str], rows: Iterable[Sequence], align: str = "") -> str:
    """A markdown table; `align` has an ``r`` for each right-aligned column."""
    rule = "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(header), "l"))
    lines = ["| " + " | ".join(header) + " |", "|" + rule]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


ratio = lambda x, base: x / base if x is not None and base else None  # None: one is missing
fmt = lambda x, spec: "-" if x is None else format(x, spec)  # `x` by `spec`, "-" for None


def write_csv(path: str, rows: Sequence[dict], columns: Sequence[str] | None = None) -> None:
    """`rows` as CSV at `path` (its folder made), the columns `columns` or the first row's."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns or rows[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
