"""`jattn decode` (and every reader through `load_run`) on damaged checkpoints (issue 54,
item 4).

Before: `load_run` checked neither checksums nor finiteness. With one bit flipped
in every chunk `jattn decode` decoded as if nothing happened; with 32 bytes
flipped it printed two empty lines and exited 0; with a truncated chunk it
exited 1 with a 140-line orbax traceback while the step before was intact. Now
it restores and verifies as training does: a damaged newest step is passed
over with a warning line, the next line names the step used, and the output is
that step's; a damaged step named with ``--step`` is one error line (exit 2).
Nothing is moved: a reader may run beside the training that writes the run.
"""

from __future__ import annotations

import shutil

import pytest
from fault_harness import DAMAGE, flip_to_finite_garbage

from jattn import cli
from jattn.train import load_run

TEXTS = ("abc", "hello")


def _flip_every_chunk(step_dir) -> None:
    """One bit flipped in the middle of every data chunk of the step."""
    for chunk in (p for p in (step_dir / "state").rglob("d/*") if p.is_file()):
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 1 << 3
        chunk.write_bytes(bytes(data))


CASES = {
    "one bit flipped, decoding to finite values": flip_to_finite_garbage,
    "one bit flipped in every chunk": _flip_every_chunk,
    "truncated chunk": DAMAGE["truncated chunk"],
    "deleted state/": DAMAGE["deleted state/"],
}


def _decode(capsys, *args) -> tuple[int, str, str]:
    status = cli.main(["decode", *args, *TEXTS])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture(scope="module")
def step_30_output(reference) -> str:
    """What `jattn decode --step 30` prints on the undamaged run."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["decode", "--workdir", str(reference[0]), "--step", "30", *TEXTS]) == 0
    return out.getvalue()


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_passes_over_a_damaged_newest_step_and_names_the_one_it_used(
    case, run_copy, step_30_output, capsys
):
    step_40 = run_copy / "checkpoints" / "40"
    CASES[case](step_40)
    before = sorted(p.relative_to(run_copy) for p in run_copy.rglob("*"))
    status, out, err = _decode(capsys, "--workdir", str(run_copy))
    assert status == 0, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("warning: checkpoint step 40 ") and lines[0].endswith("; not used")
    if case == "one bit flipped, decoding to finite values":
        assert "does not match its checksum (1 of " in lines[0]
    assert lines[1] == "warning: using checkpoint step 30, the newest that restores and verifies"
    assert out == step_30_output
    assert sorted(p.relative_to(run_copy) for p in run_copy.rglob("*")) == before  # nothing moved


def test_a_damaged_step_named_is_one_error_line(run_copy, capsys):
    _flip_every_chunk(run_copy / "checkpoints" / "40")
    status, out, err = _decode(capsys, "--workdir", str(run_copy), "--step", "40")
    assert (status, out) == (2, "")
    (line,) = err.strip().splitlines()
    assert line.startswith("jattn decode: error: load_run: checkpoint step 40 in ")


def test_a_missing_step_is_one_error_line_listing_the_saved_ones(run_copy, capsys):
    shutil.rmtree(run_copy / "checkpoints" / "40")
    status, out, err = _decode(capsys, "--workdir", str(run_copy), "--step", "40")
    assert (status, out) == (2, "")
    assert err.strip().splitlines() == [
        f"jattn decode: error: load_run: no checkpoint at step 40 in {str(run_copy)!r}; saved: [30]"
    ]


def test_no_intact_step_is_one_error_line_after_the_warnings(run_copy, capsys):
    for step in (30, 40):
        DAMAGE["truncated chunk"](run_copy / "checkpoints" / str(step))
    status, out, err = _decode(capsys, "--workdir", str(run_copy))
    assert (status, out) == (2, "")
    lines = err.strip().splitlines()
    assert [line.split(" ", 3)[:3] for line in lines[:2]] == [
        ["warning:", "checkpoint", "step"]
    ] * 2
    assert lines[2].startswith("jattn decode: error: load_run: no checkpoint in ")
    assert lines[2].endswith("restores and verifies (steps 40, 30; see the warnings above)")


def test_load_run_of_an_intact_run_says_nothing(reference, capsys):
    run = load_run(str(reference[0]))
    assert run.step == 40
    assert capsys.readouterr().err == ""
