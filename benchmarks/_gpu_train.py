"""The GPU window's training stage: the Delétang tape model, default path against xla.

    python3 benchmarks/_gpu_train.py --out OUT/train.csv [--total-s 150] [--cpu-smoke]

Runs `jattn train` of Delétang et al.'s encoder-only output-tape Transformer
(``configs/chomsky.py:reverse_string,test100`` with
``model.architecture=encoder_only``, as experiments/deletang.py trains it) for
300 steps twice: with `model.attention_impl` left to the default rule, and
with ``xla``. Each run is a child process with its own timeout (a compiler
abort or a hang costs that arm, not the window), its workdir under a temp
folder (so that the window's output stays a few files). From each run's
metrics.jsonl the stage writes one CSV row: the losses at the logged steps,
the final loss, steps/s of the last logging interval (past compilation) and
the wall time. A third child times the host data path alone for the same
rows (`jattn.data.measure_loader`, one thread, no prefetch): host ms a step,
what a GPU step waits for if the pipeline cannot hide it.

`--cpu-smoke` runs the same stage with a handful of steps and small batches:
the window's CPU dry run (tests/test_gpu_window.py). The data must be prepared
in `--data-dir` (scripts/gpu_kit.sh does it; nothing on a GPU machine reaches
a registry). The parent imports no jax, so it never holds the GPU.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = "configs/chomsky.py:reverse_string,test100"
# What scripts/gpu_kit.sh prepares for this stage.
DATASETS = ("reverse_string/test100",)
ARMS = (("default", None), ("xla", "xla"))
COLUMNS = (
    "arm",
    "status",
    "steps",
    "batch_size",
    "final_loss",
    "losses",
    "steps_per_s",
    "host_ms_per_step",
    "wall_s",
    "device",
    "note",
)


def train_args(workdir: str, data_dir: str, steps: int, batch: int, impl: str | None) -> list[str]:
    """`jattn train`'s command line for one arm (logging six times, one eval batch)."""
    log_every = max(1, steps // 6)
    args = [
        sys.executable,
        "-m",
        "jattn.cli",
        "train",
        "--config",
        CONFIG,
        "--workdir",
        workdir,
        "--compilation-cache-dir",
        "",
        f"--config.data_dir={data_dir}",
        "--config.model.architecture=encoder_only",
        f"--config.num_train_steps={steps}",
        f"--config.batch_size={batch}",
        f"--config.log_every_steps={log_every}",
        f"--config.eval_every_steps={steps}",
        f"--config.checkpoint_every_steps={steps}",
        "--config.eval_max_batches=1",
        "--config.eval_decode_examples=0",
    ]
    if impl is not None:
        args.append(f"--config.model.attention_impl={impl}")
    return args


def child_env() -> dict[str, str]:
    """The environment of a child: the tree first on PYTHONPATH, so `jattn` is this one."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def summarize(workdir: str) -> dict:
    """Losses, final loss and the last interval's steps/s from a run's metrics.jsonl."""
    path = os.path.join(workdir, "metrics.jsonl")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    train = [r for r in rows if "train/loss" in r]
    if not train:
        return {}
    return {
        "steps": train[-1]["step"],
        "final_loss": f"{train[-1]['train/loss']:.5f}",
        "losses": " ".join(f"{r['step']}:{r['train/loss']:.4f}" for r in train),
        "steps_per_s": f"{train[-1].get('train/steps_per_sec', float('nan')):.3f}",
    }


def device_line(output: str) -> str:
    """The run's own `devices:` line (what it trained on), or ''."""
    for line in output.splitlines():
        if line.strip().startswith("devices:"):
            return line.strip()[len("devices:") :].split(";")[0].strip()
    return ""


def run_arm(name, impl, args, tmp, timeout_s) -> dict:
    """One `jattn train` child; its row (status ok, failed rc=N or timeout)."""
    workdir = os.path.join(tmp, name)
    cmd = train_args(workdir, args.data_dir, args.steps, args.batch_size, impl)
    print(f"[train] {name}: {' '.join(cmd[1:])} (timeout {timeout_s:.0f} s)", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout_s
        )
        status = "ok" if proc.returncode == 0 else f"failed rc={proc.returncode}"
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        status = "timeout"
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
    wall = time.monotonic() - start
    # The tail of the child's output goes to the window's log (progress bars dropped).
    lines = [ln for ln in output.replace("\r", "\n").splitlines() if ln.strip() and "%|" not in ln]
    print("\n".join(f"[train {name}] {ln}" for ln in lines[-25:]), flush=True)
    row = {"arm": name, "status": status, "batch_size": args.batch_size, "wall_s": f"{wall:.1f}"}
    row.update(summarize(workdir))
    row["device"] = device_line(output)
    if status != "ok":
        row["note"] = (lines[-1] if lines else "")[:200]
    return row


HOST_CHILD = """
import json, sys
import jattn.data as data
from jattn.train.config import load_config
c = load_config(sys.argv[1])
task = data.load(c.dataset, data_dir=sys.argv[2])
s = data.measure_loader(task, "train", batch_size=int(sys.argv[3]), max_len=c.max_len,
                        max_input_len=c.max_input_len, num_batches=int(sys.argv[4]), pack=c.pack)
print(json.dumps(s))
"""


def host_time(args, timeout_s) -> str:
    """Host ms a step of the training rows, from a child (the pipeline alone)."""
    cmd = [sys.executable, "-c", HOST_CHILD, CONFIG, args.data_dir, str(args.batch_size)]
    cmd.append(str(args.host_batches))
    env = child_env() | {"JAX_PLATFORMS": "cpu"}
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        print("[train] host data time: timeout", flush=True)
        return ""
    if proc.returncode != 0:
        print(f"[train] host data time failed: {proc.stderr.strip()[-500:]}", flush=True)
        return ""
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"[train] host data path: {stats}", flush=True)
    return f"{1000.0 / stats['batches_per_s']:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="CSV of rows (one per arm)")
    p.add_argument("--data-dir", default=str(ROOT / ".gpukit" / "data"), help="prepared tfds data")
    p.add_argument("--total-s", type=float, default=150.0, help="budget of the whole stage")
    p.add_argument("--steps", type=int, default=None, help="default 300 (4 under --cpu-smoke)")
    p.add_argument("--batch-size", type=int, default=None, help="default 128 (16 --cpu-smoke)")
    p.add_argument("--cpu-smoke", action="store_true", help="a handful of steps: the dry run")
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    args.steps = args.steps or (4 if smoke else 300)
    args.batch_size = args.batch_size or (16 if smoke else 128)
    args.host_batches = 5 if smoke else 50
    args.data_dir = os.path.abspath(args.data_dir)
    if not os.path.isdir(args.data_dir):
        print(f"_gpu_train: no prepared data in {args.data_dir} (scripts/gpu_kit.sh)", flush=True)
        return 2
    # The host data child last, with a fixed reserve: the arms get the rest.
    host_reserve = min(30.0, 0.15 * args.total_s)
    deadline = time.monotonic() + args.total_s - host_reserve
    rows = []
    with tempfile.TemporaryDirectory(prefix="jattn_gpu_train_") as tmp:
        for i, (name, impl) in enumerate(ARMS):
            share = (deadline - time.monotonic()) / (len(ARMS) - i)
            if share < 10:
                rows.append({"arm": name, "status": "skipped", "note": "no time left"})
                continue
            rows.append(run_arm(name, impl, args, tmp, share))
        host_ms = host_time(args, max(5.0, deadline + host_reserve - time.monotonic()))
        for row in rows:
            row["host_ms_per_step"] = host_ms
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for row in rows:
            w.writerow({k: row.get(k, "") for k in COLUMNS})
    for row in rows:
        print(f"[train] {row}", flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
