"""Helpers of the fault suite: the smoke config on a private data directory, metrics
and checkpoints read back, `jattn train` as a subprocess and its one error line.

Every case damages its own copy (of the data directory or of the reference
workdir), never the shared ~/tensorflow_datasets, and runs configs/smoke.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from run_helpers import REPO, SMOKE, losses, smoke_config  # noqa: F401 -- the suite's API

DATA_DIR_NAME = "data"


def steps_on_disk(workdir) -> list[int]:
    folder = Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def split_file(data_dir, split: str) -> Path:
    (path,) = (Path(data_dir) / "jattn_copy" / "tiny").glob(f"*/jattn_copy-{split}.array_record-*")
    return path


def train_cmd(workdir, data_dir, *extra) -> list[str]:
    return [
        sys.executable, "-m", "jattn.cli", "train", "--config", SMOKE, "--workdir", str(workdir),
        f"--config.data_dir={data_dir}", "--config.eval_splits=()", "--config.best_metric=",
        "--config.progress_bar=false", *extra,
    ]  # fmt: skip


def run_cli(workdir, data_dir, env, *extra, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_cmd(workdir, data_dir, *extra),
        env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def error_line(stderr: str) -> str:
    """The one `jattn train: ...` line of stderr (asserting there is exactly one and no
    traceback)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("jattn train:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def _truncate_a_chunk(step: Path) -> None:
    chunks = sorted(p for p in (step / "state").rglob("d/*") if p.is_file())
    biggest = max(chunks, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])


def empty_step(step: Path) -> None:
    shutil.rmtree(step)
    step.mkdir()


DAMAGE = {  # ways a finished checkpoint step gets damaged: name -> (step folder -> None)
    "truncated chunk": _truncate_a_chunk,
    "deleted state/_METADATA": lambda step: (step / "state" / "_METADATA").unlink(),
    "truncated meta/metadata": lambda step: (step / "meta" / "metadata").write_text('{"conf'),
    "deleted state/": lambda step: shutil.rmtree(step / "state"),
    "emptied step": empty_step,
}


def arrays(step_dir: Path) -> dict[str, np.ndarray]:
    """Every array of a checkpoint step's state by path, ``opt_state/0/mu/...``
    (restored with orbax alone)."""
    state = ocp.StandardCheckpointer().restore(step_dir / "state")
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x) for p, x in flat}


def flip_to_finite_garbage(step_dir: Path) -> str:
    """Flips one bit of the largest data chunk of `step_dir` where the step still
    restores, every value finite, but one array differs; returns that array's path."""
    chunks = [p for p in (step_dir / "state").rglob("d/*") if p.is_file()]
    chunk = max(chunks, key=lambda p: p.stat().st_size)
    original, data = arrays(step_dir), chunk.read_bytes()
    for offset in np.linspace(len(data) // 4, len(data) - 64, 24).astype(int):
        flipped = bytearray(data)
        flipped[offset] ^= 1 << 6
        chunk.write_bytes(bytes(flipped))
        try:
            damaged = arrays(step_dir)
        except Exception:  # noqa: BLE001, S112 -- a flip that fails to decode: already caught
            continue
        changed = [k for k in original if not np.array_equal(original[k], damaged[k])]
        if len(changed) == 1 and all(np.all(np.isfinite(x)) for x in damaged.values()):
            return changed[0]
    chunk.write_bytes(data)
    raise AssertionError("no flip in the largest chunk decoded to finite other values")


def catches_sigterm(pid: int) -> bool:
    """Whether process `pid` has a SIGTERM handler now (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def mount_tmpfs(path, size: str) -> bool:
    """Mounts a tmpfs of `size` at `path` (needs root); False when it cannot."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                        capture_output=True).returncode == 0  # fmt: skip
    return ok


def umount(path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)
