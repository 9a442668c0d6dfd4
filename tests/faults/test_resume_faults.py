"""Resuming and starting under faults that used to pass in silence (issue 38): every case
ends in a bit-identical resume or in one line that refuses with nothing lost.

- a config key changed on resume: refused naming the key and the flag that allows it;
  keys that change no training step resume as before, so do checkpoints of an earlier
  jattn (whose meta lacks what this one records);
- a checkpoint's data iterator file deleted: the step is set aside, the previous one
  resumes; a checkpoint of another process count is still refused;
- a flipped bit in a checkpoint's array data that decodes to finite values: caught by the
  checksum the save recorded, the step set aside, the previous one resumes;
- a truncated chunk: recovered without asyncio's "Task exception was never retrieved"
  tracebacks on stderr;
- SIGTERM in the first moment of `jattn train`: one line, exit 0;
- a deleted ``dataset_info.json``: refused naming it; a config of another run: refused
  before its data set is prepared.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from fault_harness import (
    DAMAGE,
    REPO,
    arrays,
    catches_sigterm,
    error_line,
    flip_to_finite_garbage,
    losses,
    run_cli,
    smoke_config,
    steps_on_disk,
    train_cmd,
)

from jattn.train import ConfigError, load_config, train_and_evaluate
from jattn.train.config import apply_overrides

ABANDONED = "Task exception was never retrieved"


def _files(workdir: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}


def _without_step_40(run: Path) -> None:
    """The run as a stop after step 30 left it (step 40 never saved, not finished)."""
    (run / "final_metrics.json").unlink()
    shutil.rmtree(run / "checkpoints" / "40")


def _warnings(err: str, step: int) -> list[str]:
    return [line for line in err.splitlines() if f"checkpoint step {step}" in line]


def _edit_meta(step_dir: Path, edit) -> None:
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


# -- 1. config keys changed on resume ----------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "saved"), [("adam_b2", 0.5, 0.98), ("label_smoothing", 0.0, 0.1)]
)
def test_a_changed_training_key_is_refused_naming_it_and_its_flag(
    key, value, saved, run_copy, pristine_data
):
    """Before: accepted in silence, config.json rewritten. Now one line naming the key,
    both values and the flag; every file of the workdir as it was."""
    before = _files(run_copy)
    with pytest.raises(ConfigError) as e:
        train_and_evaluate(smoke_config(pristine_data, **{key: value}), str(run_copy))
    message = str(e.value)
    assert "\n" not in message
    assert f"holds a checkpoint (step 40) trained under other values of {key}: " in message
    assert f"{key}: checkpoint {saved!r} != config {value!r}" in message
    assert f"--config.allow_config_change={key} " in message
    assert _files(run_copy) == before


def test_the_cli_refuses_a_changed_key_with_status_2(run_copy, pristine_data, cli_env):
    before = _files(run_copy)
    proc = run_cli(run_copy, pristine_data, cli_env, "--config.adam_b2=0.5",
                   "--config.label_smoothing=0.0")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = error_line(proc.stderr)
    assert "other values of adam_b2, label_smoothing" in line
    assert "--config.allow_config_change=adam_b2,label_smoothing" in line
    assert _files(run_copy) == before


def test_an_allowed_change_continues_under_the_new_value(reference, run_copy, pristine_data):
    _, ref = reference
    _without_step_40(run_copy)
    config = smoke_config(pristine_data, adam_b2=0.5, allow_config_change="adam_b2")
    assert train_and_evaluate(config, str(run_copy))["step"] == 40
    got = losses(run_copy)
    assert [got[s] for s in range(1, 31)] == [ref[s] for s in range(1, 31)]  # history kept
    assert [got[s] for s in range(31, 41)] != [ref[s] for s in range(31, 41)]  # new b2
    assert json.loads((run_copy / "config.json").read_text())["adam_b2"] == 0.5


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ("adam_b3", "'adam_b3' is not a config key (did you mean 'adam_b2'?)"),
        ("batch_size", "'batch_size' fixes the state's shapes or the data stream"),
        ("log_every_steps", "'log_every_steps' may change on resume without it"),
    ],
)
def test_allow_config_change_names_only_keys_it_can_allow(names, message, run_copy, pristine_data):
    before = _files(run_copy)
    with pytest.raises(ConfigError, match=None) as e:
        train_and_evaluate(smoke_config(pristine_data, allow_config_change=names), str(run_copy))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert _files(run_copy) == before


def test_keys_that_change_no_step_resume_bit_identically(
    reference, run_copy, pristine_data, tmp_path
):
    """Where the data lies, how often the run saves, how many checkpoints it keeps,
    the progress bar and the flags themselves: no refusal, the reference's losses."""
    _, ref = reference
    _without_step_40(run_copy)
    moved = tmp_path / "moved_data"
    shutil.copytree(pristine_data, moved)
    config = smoke_config(
        moved, checkpoint_every_steps=5, keep_checkpoints=3, progress_bar=True,
        allow_schedule_change=True,
    )  # fmt: skip
    assert train_and_evaluate(config, str(run_copy))["step"] == 40
    assert losses(run_copy) == ref


@pytest.mark.parametrize("earlier", ["meta without checksums", "meta without config"])
def test_checkpoints_of_an_earlier_jattn_still_resume(
    earlier, reference, run_copy, pristine_data, capsys
):
    """A meta saved before this jattn lacks the checksums, the process count, keys
    added since (allow_config_change, vocab_multiple in the signature), or, older
    still, the config: only what it has is compared, and it resumes bit-identically."""
    _, ref = reference
    _without_step_40(run_copy)

    def older(meta):
        meta.pop("checksums")
        meta.pop("process_count")
        meta["signature"].pop("vocab_multiple")
        if earlier == "meta without config":
            meta.pop("config")
        else:
            for key in ("allow_config_change", "adam_b2", "vocab_multiple"):
                meta["config"].pop(key)

    _edit_meta(run_copy / "checkpoints" / "30", older)
    assert train_and_evaluate(smoke_config(pristine_data), str(run_copy))["step"] == 40
    assert losses(run_copy) == ref
    assert "warning" not in capsys.readouterr().err


# -- 2. the data iterator's file -----------------------------------------------------------


def test_a_deleted_data_iterator_file_falls_back_to_the_previous_step(
    reference, run_copy, pristine_data, capsys
):
    """Before: exit 2 claiming another process count. Now step 40 is damage: set aside
    with one warning saying why, resumed from 30, the reference's losses."""
    _, ref = reference
    (run_copy / "final_metrics.json").unlink()
    (run_copy / "checkpoints" / "40" / "data" / "process_0-of-1.json").unlink()
    assert train_and_evaluate(smoke_config(pristine_data), str(run_copy))["step"] == 40
    (warning,) = _warnings(capsys.readouterr().err, 40)
    assert warning.startswith("warning: checkpoint step 40 has no data/process_0-of-1.json")
    assert losses(run_copy) == ref
    assert len(list((run_copy / "checkpoints.skipped").iterdir())) == 1
    assert steps_on_disk(run_copy) == [30, 40]


def test_an_edited_data_position_falls_back_to_the_previous_step(
    reference, run_copy, pristine_data, capsys
):
    """A data file that still parses but is not what was saved (its position moved):
    its checksum says so, and the run does not silently train on other batches."""
    _, ref = reference
    (run_copy / "final_metrics.json").unlink()
    path = run_copy / "checkpoints" / "40" / "data" / "process_0-of-1.json"
    position = json.loads(path.read_text())
    position["parent"]["offset"] += 8
    path.write_text(json.dumps(position, indent=4))
    assert train_and_evaluate(smoke_config(pristine_data), str(run_copy))["step"] == 40
    (warning,) = _warnings(capsys.readouterr().err, 40)
    assert "data/process_0-of-1.json that does not match its checksum" in warning
    assert losses(run_copy) == ref


@pytest.mark.parametrize("told_by", ["meta", "files"])
def test_a_checkpoint_of_another_process_count_is_refused(told_by, run_copy, pristine_data):
    """Two processes' iterator files (and, for a checkpoint of this jattn, a meta that
    says 2): refused in one line, nothing set aside."""
    (run_copy / "final_metrics.json").unlink()
    data = run_copy / "checkpoints" / "40" / "data"
    own = data / "process_0-of-1.json"
    for i in range(2):
        shutil.copy(own, data / f"process_{i}-of-2.json")
    own.unlink()

    def written_by_two(meta):
        if told_by == "meta":
            meta["process_count"] = 2
        else:
            meta.pop("process_count")

    _edit_meta(run_copy / "checkpoints" / "40", written_by_two)
    before = _files(run_copy / "checkpoints")
    with pytest.raises(ConfigError) as e:
        train_and_evaluate(smoke_config(pristine_data), str(run_copy))
    assert "was written by 2 process(es), this run has 1" in str(e.value)
    assert "\n" not in str(e.value)
    assert _files(run_copy / "checkpoints") == before
    assert not (run_copy / "checkpoints.skipped").exists()


# -- 3. a flipped bit in the array data ----------------------------------------------------


def test_a_flipped_bit_that_decodes_to_finite_values_falls_back(
    reference, run_copy, pristine_data, capsys
):
    """Before: restored and trained on (say 1.5e37 in Adam's first moment). Now the
    checksum recorded by the save differs: step 40 set aside, resumed from 30, the
    reference's losses and its final parameters to the last bit."""
    ref_dir, ref = reference
    (run_copy / "final_metrics.json").unlink()
    changed = flip_to_finite_garbage(run_copy / "checkpoints" / "40")
    assert train_and_evaluate(smoke_config(pristine_data), str(run_copy))["step"] == 40
    (warning,) = _warnings(capsys.readouterr().err, 40)
    got, want = arrays(run_copy / "checkpoints" / "40"), arrays(ref_dir / "checkpoints" / "40")
    assert f"does not match its checksum (1 of {len(want)} arrays differ, first {changed})" in (
        warning
    )
    assert losses(run_copy) == ref
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_a_non_finite_optimiser_state_is_not_resumed(reference):
    """A checkpoint saved before checksums, with NaN in Adam's second moment only:
    parameters alone looked fine."""
    from jattn.train.recovery import verify_state
    from jattn.train.steps import TrainState

    state = ocp.StandardCheckpointer().restore(reference[0] / "checkpoints" / "40" / "state")
    state = TrainState(**state)
    assert verify_state(state, 40) is None
    nu = np.array(state.opt_state[0]["nu"]["embed"]["embedding"])
    nu[0, 0] = np.nan
    state.opt_state[0]["nu"]["embed"]["embedding"] = nu
    assert verify_state(state, 40) == "restored an optimiser state that is NaN or Inf"


# -- 4. asyncio's echo of a failed restore -------------------------------------------------


def test_a_truncated_chunk_recovers_without_asyncio_tracebacks(
    reference, run_copy, pristine_data, cli_env
):
    _, ref = reference
    (run_copy / "final_metrics.json").unlink()
    DAMAGE["truncated chunk"](run_copy / "checkpoints" / "40")
    proc = run_cli(run_copy, pristine_data, cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ABANDONED not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (warning,) = _warnings(proc.stderr, 40)
    assert warning.startswith("warning: checkpoint step 40 cannot be restored")
    got = losses(run_copy)
    assert [got[s] for s in range(1, 31)] == [ref[s] for s in range(1, 31)]  # history kept
    # Retrained in a `jattn` process, without the suite's XLA flags: equal to rounding.
    np.testing.assert_allclose([got[s] for s in ref], list(ref.values()), rtol=1e-6)


# Orbax's read coroutine as a failed restore leaves it: suspended inside its read, where
# ``except BaseException`` turns the collector's close into the read error; compiled with
# a file name inside orbax's checkpoint package, which is what the filter looks at.
_ECHOES = '''
import gc, os, sys
from jattn.train.recovery import quiet_abandoned_reads

READ = """
async def _read_array_index_and_device_put():
    try:
        await Pending()
    except BaseException as e:
        raise Exception("read of {where} failed") from e
"""

class Pending:  # a read tensorstore has not finished
    def __await__(self):
        yield

def reader(where, path):
    namespace = {"Pending": Pending}
    exec(compile(READ.format(where=where), path, "exec"), namespace)
    return namespace["_read_array_index_and_device_put"]

orbax = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "_src", "s.py")
mine = os.path.join(os.sep, "home", "me", "reads.py")

def abandon(where):
    suspended = [reader(where, orbax)(), reader(where + " (mine)", mine)()]
    for coro in suspended:
        coro.send(None)  # now waiting inside the read
    never_started = reader(where, orbax)()
    del suspended, never_started, coro
    gc.collect()
    print("---", file=sys.stderr, flush=True)

with quiet_abandoned_reads():
    abandon("inside")
abandon("after")
'''


def test_the_filters_drop_orbax_reads_abandoned_inside_the_block_and_nothing_else():
    """Inside `quiet_abandoned_reads` (no restore failed): an orbax read closed while
    suspended and one never started are not echoed, the same read of another file is;
    after the block every one is."""
    # -W always: each warning shown, not only its first time at that line of `abandon`.
    cmd = [sys.executable, "-W", "always", "-c", _ECHOES]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    inside, after, rest = proc.stderr.split("---\n")
    assert "read of" not in rest and "never awaited" not in rest, proc.stderr
    assert "read of inside (mine) failed" in inside, proc.stderr
    assert "read of inside failed" not in inside and "never awaited" not in inside, inside
    assert "read of after (mine) failed" in after and "read of after failed" in after, after
    assert "coroutine '_read_array_index_and_device_put' was never awaited" in after, after


def _abandon_failed_reads(n: int = 50) -> None:
    """What orbax does when one read of a restore fails: that error is raised, the
    other reads, failed too, are left with their exceptions unretrieved."""

    async def read(i: int):
        raise OSError(f"chunk {i} truncated")

    async def restore():
        reads = [asyncio.ensure_future(read(i)) for i in range(n)]
        await asyncio.sleep(0)
        raise reads[0].exception()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(restore())
    finally:
        loop.close()


def test_reads_abandoned_by_a_failed_restore_are_not_echoed(
    reference, run_copy, pristine_data, caplog, monkeypatch, capsys
):
    """A restore of step 40 that fails the way orbax's does, abandoning fifty failed
    reads: one warning, the previous step resumed, none of asyncio's fifty records."""
    from jattn.train import checkpoints as ckpt
    from jattn.train import recovery

    # A failed restore earlier in this process (another test) leaves the filter on
    # for good; this test starts from a process that has had none.
    recovery.release_abandoned_reads()
    caplog.set_level(logging.ERROR, logger="asyncio")
    with pytest.raises(OSError):  # the fault is real: unguarded, asyncio logs each read
        _abandon_failed_reads()
    gc.collect()
    assert sum(ABANDONED in r.getMessage() for r in caplog.records) == 49
    caplog.clear()

    _, ref = reference
    (run_copy / "final_metrics.json").unlink()
    restore = ckpt.restore

    def failing_at_40(mngr, step, abstract, it):
        if step == 40:
            _abandon_failed_reads()
        return restore(mngr, step, abstract, it)

    monkeypatch.setattr(ckpt, "restore", failing_at_40)
    assert train_and_evaluate(smoke_config(pristine_data), str(run_copy))["step"] == 40
    gc.collect()
    assert not [r for r in caplog.records if ABANDONED in r.getMessage()]
    (warning,) = _warnings(capsys.readouterr().err, 40)
    assert "cannot be restored (OSError: chunk 0 truncated)" in warning
    assert losses(run_copy) == ref

    # Reads of the failed restore that end later, while the run trains: still quiet.
    with pytest.raises(OSError):
        _abandon_failed_reads()
    gc.collect()
    assert not [r for r in caplog.records if ABANDONED in r.getMessage()]
    recovery.release_abandoned_reads()  # and on request, asyncio's records are back
    with pytest.raises(OSError):
        _abandon_failed_reads()
    gc.collect()
    assert sum(ABANDONED in r.getMessage() for r in caplog.records) == 49


# -- 5. SIGTERM in the first moment ----------------------------------------------------------

_EARLY_SIGTERM = """
import os, signal, sys
import jattn.cli
install = signal.signal
def spy(signum, handler):
    previous = install(signum, handler)
    if signum == signal.SIGTERM:  # the first handler: SIGTERM right now
        heavy = ("jattn.train", "orbax.checkpoint", "flax", "tensorflow_datasets", "grain")
        print([m for m in heavy if m in sys.modules], flush=True)
        signal.signal = install
        os.kill(os.getpid(), signal.SIGTERM)
    return previous
signal.signal = spy
sys.argv = ["jattn", *sys.argv[1:]]
sys.exit(jattn.cli.main())
"""


def test_sigterm_at_the_first_moment_exits_0_before_the_training_imports(
    pristine_data, tmp_path, cli_env
):
    """Before: the handler came after seconds of imports; a SIGTERM then exited 143
    with no word. Now it is installed before any of the training code is imported,
    and a SIGTERM at that moment is one line and status 0."""
    workdir = tmp_path / "run"
    args = train_cmd(workdir, pristine_data)[3:]  # after `python -m jattn.cli`
    proc = subprocess.run([sys.executable, "-c", _EARLY_SIGTERM, *args], env=cli_env,
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"  # none of the training code imported yet
    assert "stopped by SIGTERM" in error_line(proc.stderr)
    assert not workdir.exists()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_sigterm_as_soon_as_jattn_train_can_catch_it(pristine_data, tmp_path, cli_env):
    workdir = tmp_path / "run"
    start = time.monotonic()
    proc = subprocess.Popen(
        train_cmd(workdir, pristine_data),
        env=cli_env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not catches_sigterm(proc.pid):
        assert proc.poll() is None and time.monotonic() - start < 60
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "stopped by SIGTERM" in error_line(err)
    if workdir.exists():  # a slow poll: the run had started, but trained nothing
        assert not losses(workdir)


# -- 6. start-up refusals ---------------------------------------------------------------------


def test_a_deleted_dataset_info_is_refused_naming_it(data_dir, tmp_path, cli_env):
    (info,) = (data_dir / "jattn_copy" / "tiny").glob("*/dataset_info.json")
    info.unlink()
    proc = run_cli(tmp_path / "run", data_dir, cli_env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{info} is missing; delete {info.parent} to prepare it again" in error_line(proc.stderr)
    assert not info.exists()  # nothing prepared in its place
    assert not (tmp_path / "run").exists()


def test_a_config_of_another_run_is_refused_before_its_data_is_prepared(run_copy, tmp_path):
    """configs/numbers.py on a workdir of configs/smoke.py: before, the numbers data
    set was prepared (tens of seconds) and then refused."""
    empty = tmp_path / "tfds"
    empty.mkdir()
    config = apply_overrides(
        load_config(str(REPO / "configs" / "numbers.py")), [("data_dir", str(empty))]
    )
    before = _files(run_copy)
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        train_and_evaluate(config, str(run_copy))
    assert "holds a checkpoint (step 40) of an incompatible config" in str(e.value)
    assert "dataset: checkpoint 'copy/tiny' != config 'numbers'" in str(e.value)
    assert "\n" not in str(e.value)
    assert not list(empty.iterdir())  # no data set prepared, no vocabulary learned
    assert time.monotonic() - start < 20
    assert _files(run_copy) == before
