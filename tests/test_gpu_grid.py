"""The GPU grid window (`scripts/gpu_window.sh OUTDIR --grid`) and the state it
carries from one window to the next (`lab/gpu_grid.py`).

A GPU window is one command on a machine that starts bare and sends back at most
8 files of 16 MiB; the reverse_string grid takes several. So each window packs the
grid's directory (every run's files, the unfinished runs' latest checkpoint, no
finished run's checkpoint), and the next starts from it unpacked here, at another
path, on another machine. The dry run trains the tiny preset on the CPU in the real
child processes; the resumed run restores its checkpoint from the unpacked copy.
"""

import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the checkout: lab/
from lab import gpu_grid  # noqa: E402


def _run(tmp_path, name, steps, final_step, checkpoints=(), cut_short=()) -> str:
    """A run directory as `jattn train` leaves it: its config, its final metrics
    (None: not written), its checkpoint steps (each with ``state/_METADATA``, as
    `checkpoints.step_problem` asks of a complete one), and steps whose save was cut
    short (an empty folder)."""
    run = tmp_path / "state" / "grid" / "runs" / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"num_train_steps": steps}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    if final_step is not None:
        (run / "final_metrics.json").write_text(json.dumps({"step": final_step}))
    for s in checkpoints:
        (run / "checkpoints" / str(s) / "state").mkdir(parents=True)
        (run / "checkpoints" / str(s) / "state" / "_METADATA").write_bytes(os.urandom(4096))
    for s in cut_short:
        (run / "checkpoints" / str(s)).mkdir(parents=True)
    return os.path.relpath(run, tmp_path / "state")


def test_what_travels_is_what_a_resume_reads(tmp_path):
    done = _run(tmp_path, "done", 1000, 1000, checkpoints=(900, 1000))
    # Killed in a save: step 1500's folder is empty, so its resume reads step 1000.
    cut = _run(tmp_path, "cut", 2000, None, checkpoints=(500, 900, 1000), cut_short=(1500,))
    # A final evaluation of an earlier, shorter grid: not this run's end.
    short = _run(tmp_path, "short", 1000, 400, checkpoints=(400,))
    _run(tmp_path, "fresh", 1000, None)  # started, no checkpoint yet
    left = gpu_grid.left_behind(str(tmp_path / "state"))
    # Steps compare as numbers: 1000 is the latest complete, not "900" > "1000" as strings.
    assert sorted(left) == sorted(
        [f"{done}/checkpoints"] + [f"{cut}/checkpoints/{s}" for s in (500, 900, 1500)]
    )
    assert not any(p.startswith(short) for p in left)
    # What a session keeps in git when it ends with the grid unfinished.
    assert sorted(gpu_grid.left_behind(str(tmp_path / "state"), finished_only=True)) == sorted(
        [f"{done}/checkpoints", cut, short, "grid/runs/fresh"]
    )


def test_the_state_goes_back_in_numbered_parts_and_comes_back_whole(tmp_path):
    cut = _run(tmp_path, "cut", 10, 5, checkpoints=(5, 8))
    done = _run(tmp_path, "done", 10, 10, checkpoints=(10,))
    state = str(tmp_path / "state")
    names = gpu_grid.pack(state, str(tmp_path / "out"), part_bytes=1500)
    assert len(names) > 1 and names == [f"grid_state.tgz.{k:02d}" for k in range(len(names))]
    assert all(os.path.getsize(tmp_path / "out" / n) <= 1500 for n in names)

    again = str(tmp_path / "elsewhere" / ".gpugrid")
    os.makedirs(again)
    with open(os.path.join(again, "stale"), "w") as f:
        f.write("an older window's state is replaced, not merged")
    assert gpu_grid.unpack(str(tmp_path / "out"), again) == ["grid/runs/cut", "grid/runs/done"]
    assert not os.path.exists(os.path.join(again, "stale"))
    assert sorted(os.listdir(os.path.join(again, cut, "checkpoints"))) == ["8"]
    assert not os.path.exists(os.path.join(again, done, "checkpoints"))
    for path in (f"{cut}/checkpoints/8/state/_METADATA", f"{done}/final_metrics.json"):
        with open(os.path.join(state, path), "rb") as a, open(os.path.join(again, path), "rb") as b:
            assert a.read() == b.read(), path


def test_unpack_refuses_a_missing_part(tmp_path):
    _run(tmp_path, "cut", 10, None, checkpoints=(5,))
    names = gpu_grid.pack(str(tmp_path / "state"), str(tmp_path / "out"), part_bytes=1500)
    os.remove(tmp_path / "out" / names[1])
    with pytest.raises(ValueError, match="parts missing or misnumbered"):
        gpu_grid.unpack(str(tmp_path / "out"), str(tmp_path / "again"))
    with pytest.raises(FileNotFoundError, match="no grid_state.tgz.NN"):
        gpu_grid.unpack(str(tmp_path / "state"), str(tmp_path / "again"))
    assert not os.path.exists(tmp_path / "again")  # nothing replaced


# The tiny preset's T5 pair alone (plain and randomised, run at once by --jobs 2): the
# window passes `jattn ablate` overrides on (GPU_GRID_ARGS).
PAIR = (
    "--config.grid.position.values=t5 "
    "--config.reference=task=reverse_string/tiny,position=t5,random=0"
)


def _window(out, state, data_dir):
    env = dict(os.environ, PYTHON=sys.executable, GPU_WINDOW_NO_KIT="1", JAX_PLATFORMS="cpu",
               GPU_WINDOW_DATA=data_dir, GPU_GRID_STATE=str(state), GPU_GRID_ARGS=PAIR)  # fmt: skip
    cmd = ["bash", os.path.join(ROOT, "scripts", "gpu_window.sh"), str(out), "--grid", "--cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    log = (out / "window.log").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + log[-5000:]
    return log


@pytest.mark.slow  # two windows of child processes (~1.5 minutes on a shared 2-core CPU)
def test_gpu_grid_dry_run_packs_its_state_and_the_next_window_resumes_it(tmp_path, data_dir):
    state, out = tmp_path / "machine1" / ".gpugrid", tmp_path / "out1"
    log = _window(out, state, data_dir)
    # What comes back is a few files (a GPU machine returns at most 8).
    back = ["grid_state.tgz.00", "results.csv", "results.md", "window.log"]
    assert sorted(os.listdir(out)) == back
    assert "stage grid-seeds-0: rc=0" in log and "stage pack: rc=0" in log
    assert "ablation: 2 runs, 0 already finished, 2 to train" in log
    assert "ablation: 2 runs at once" in log
    assert "gpu_grid: packed 2 runs, 2 finished into 1 part(s)" in log
    report = (out / "results.md").read_text()
    assert "(2/2 runs finished)" in report and "## Cost" in report
    with tarfile.open(out / "grid_state.tgz.00") as tar:
        names = tar.getnames()
    assert not any("/checkpoints" in n for n in names), names  # finished: none travel
    assert sum(n.endswith("/final_metrics.json") for n in names) == 2

    # A run killed in its final evaluation: a checkpoint at its last step and no final
    # metrics. Its checkpoint travels; on the next machine it is restored from there.
    runs = state / "deletang_reverse" / "runs"
    cut = runs / "position-t5_random-512_seed-0_task-reverse_string_tiny"
    before = json.loads((cut / "final_metrics.json").read_text())
    os.remove(cut / "final_metrics.json")
    gpu_grid.pack(str(state), str(tmp_path / "out_cut"))
    state2 = tmp_path / "machine2" / ".gpugrid"
    gpu_grid.unpack(str(tmp_path / "out_cut"), str(state2))
    cut2 = state2 / "deletang_reverse" / "runs" / cut.name
    assert os.listdir(cut2 / "checkpoints") == ["4"]

    log = _window(tmp_path / "out2", state2, data_dir)
    assert "ablation: 2 runs, 1 already finished, 1 to train" in log, log[-3000:]
    after = json.loads((cut2 / "final_metrics.json").read_text())
    assert after["step"] == 4
    # Evaluated from the restored parameters: the same numbers as before the kill.
    evals = [k for k in before if k.startswith("eval/")]
    assert evals and {k: after[k] for k in evals} == {k: before[k] for k in evals}
    sessions = (state2 / "deletang_reverse" / "sessions.jsonl").read_text().splitlines()
    assert [json.loads(s)["runs_to_train"] for s in sessions] == [2, 1]  # both windows' cost
