"""`jattn`'s stderr filter drops exactly the closed-event-loop tracebacks that
tensorstore's write futures print after a failed checkpoint write
(`jattn.cli.stderr`), and passes everything else through unchanged."""

import io
import os
import subprocess
import sys
import threading

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


def test_tracebacks_of_two_threads_interleaved_are_read_apart():
    """Threads print a piece of a line at a time: two tracebacks written at once
    are read per thread, so the closed-loop ones are still dropped and another
    comes out whole (in CI two interleaved ones got past a single-stream read)."""

    def interleaved(a: str, b: str) -> str:
        out = io.StringIO()
        f = ClosedLoopFilter(out)
        pa, pb = ([t[i : i + 7] for i in range(0, len(t), 7)] for t in (a, b))
        n = max(len(pa), len(pb))
        pieces = [p + [""] * (n - len(p)) for p in (pa, pb)]
        turn = [threading.Semaphore(1), threading.Semaphore(0)]

        def writer(me):
            for piece in pieces[me]:
                turn[me].acquire()
                f.write(piece)
                turn[1 - me].release()

        threads = [threading.Thread(target=writer, args=(me,)) for me in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        f.write(LINE)
        f.flush()
        return out.getvalue()

    assert interleaved(CLOSED, CLOSED) == LINE
    assert interleaved(CLOSED, OTHER) == OTHER + LINE


def test_the_closed_loop_error_is_dropped_at_pythons_hooks_too():
    """`install` also drops the error where Python reports it itself (an
    unraisable exception, an uncaught one in a thread), and nothing else:
    another unraisable error and another thread's error still print."""
    script = """
import threading
from jattn.cli.stderr import install
install()

class Raises:
    def __init__(self, exc):
        self.exc = exc
    def __del__(self):
        raise self.exc

Raises(RuntimeError("Event loop is closed"))
Raises(ValueError("kept unraisable"))
for exc in (RuntimeError("Event loop is closed"), ValueError("kept in thread")):
    def boom(exc=exc):
        raise exc
    t = threading.Thread(target=boom)
    t.start()
    t.join()
print("done")
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    assert "kept unraisable" in out.stderr and "kept in thread" in out.stderr
    assert "Event loop is closed" not in out.stderr
