"""`jattn`'s stderr filter drops exactly the closed-event-loop tracebacks that
tensorstore's write futures print after a failed checkpoint write
(`jattn.cli.stderr`), and passes everything else through unchanged."""

import io
import subprocess
import sys

from jattn.cli.stderr import ClosedLoopFilter

CLOSED = (
    "Traceback (most recent call last):\n"
    '  File "/usr/lib/python3.11/asyncio/base_events.py", line 806, in call_soon_threadsafe\n'
    "    self._check_closed()\n"
    '  File "/usr/lib/python3.11/asyncio/base_events.py", line 519, in _check_closed\n'
    "    raise RuntimeError('Event loop is closed')\n"
    "RuntimeError: Event loop is closed\n"
)
OTHER = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 3, in step\n'
    "    1 / 0\n"
    "ZeroDivisionError: division by zero\n"
)
LINE = "jattn train: error: writing in /w failed at step 20: disk full\n"


def _through(*chunks: str) -> str:
    out = io.StringIO()
    f = ClosedLoopFilter(out)
    for c in chunks:
        f.write(c)
    f.flush()
    return out.getvalue()


def test_the_closed_loop_tracebacks_are_dropped_and_nothing_else():
    assert _through(CLOSED * 3, LINE, CLOSED) == LINE
    assert _through("workdir: /w\n", OTHER, LINE) == "workdir: /w\n" + OTHER + LINE
    # The same error from another place is not the futures' echo: kept.
    elsewhere = CLOSED.replace("call_soon_threadsafe", "run_until_complete")
    assert _through(elsewhere) == elsewhere


def test_written_in_pieces_and_partial_lines():
    pieces = [CLOSED[i : i + 7] for i in range(0, len(CLOSED), 7)] + list(LINE)
    assert _through(*pieces) == LINE
    # A progress bar writes without a newline: passed on at once, not held.
    out = io.StringIO()
    f = ClosedLoopFilter(out)
    f.write("\rtrain:  50%")
    assert out.getvalue() == "\rtrain:  50%"
    # An unfinished traceback at exit is written out, not lost.
    assert _through(OTHER[:60]) == OTHER[:60]


def test_the_jattn_command_installs_it_and_in_process_calls_do_not():
    code = (
        "import sys; from jattn.cli import main; from jattn.cli.stderr import ClosedLoopFilter\n"
        "sys.argv = ['jattn', 'configs']\n"
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()): main()\n"
        "print(isinstance(sys.stderr, ClosedLoopFilter))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True"
    from jattn.cli import main

    before = sys.stderr
    main(["configs"])
    assert sys.stderr is before
