"""The `jattn` process's stderr, without the echo of a failed checkpoint write.

Why. When a checkpoint write fails in orbax's background thread (a disk
filling up, a filesystem remounted read-only), the run stops at its next
step with one line that says why and exit status 4 (`jattn.train.filesystem`).
But tensorstore's write futures are still completing on other threads, and
each one that completes after orbax closed its asyncio event loop prints
Python's traceback of ``loop.call_soon_threadsafe`` raising
``RuntimeError: Event loop is closed``: dozens of identical tracebacks, in
about one failed run of three, before or after the one line that matters,
with nothing a user can act on (the earlier checkpoints are intact; the line
says so). They are printed as "unraisable" errors from C++ callbacks, past
every Python hook a program can set for its own threads, but through
``sys.stderr``; so `jattn` (the command, not code that imports jattn)
writes its stderr through `ClosedLoopFilter`, which drops exactly those
tracebacks and passes everything else through unchanged, line by line.

Several threads print at once, a piece of a line at a time, so the filter
reads each writing thread's text apart (in CI two interleaved tracebacks,
read as one stream, got past it). The same error raised where Python can
report it (an unraisable exception, or one uncaught in a Python thread) is
dropped at its hook, before any text is written.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

__all__ = ["ClosedLoopFilter", "install"]

_START = "Traceback (most recent call last):"
_CLOSED = "RuntimeError: Event loop is closed"
_SOURCE = "call_soon_threadsafe"


class _Reading:
    """One writing thread's unfinished line and held traceback."""

    def __init__(self):
        self.partial = ""
        self.held: list[str] | None = None  # the lines of a traceback being read


class ClosedLoopFilter:
    """A text stream over `stream` that drops the closed-event-loop tracebacks.

    Lines are passed on as they complete, except a traceback, which is held
    until its last (unindented) line: dropped when that line is
    ``RuntimeError: Event loop is closed`` and a frame is
    ``call_soon_threadsafe`` (the futures' callback), written out otherwise.
    Each writing thread's text is read apart from the others'.
    """

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()
        self._readings: dict[int, _Reading] = {}  # by thread id

    def write(self, text: str) -> int:
        with self._lock:
            r = self._readings.setdefault(threading.get_ident(), _Reading())
            lines = (r.partial + text).split("\n")
            r.partial = lines.pop()
            for line in lines:
                self._line(r, line + "\n")
            if r.held is None and r.partial and not _START.startswith(r.partial):
                self._stream.write(r.partial)  # a prompt or progress bar without "\n"
                r.partial = ""
        return len(text)

    def _line(self, r: _Reading, line: str) -> None:
        if r.held is None:
            if line.rstrip("\n") == _START:
                r.held = [line]
            else:
                self._stream.write(line)
            return
        r.held.append(line)
        if line.startswith((" ", "\t")):
            return  # a frame of the traceback
        held, r.held = r.held, None
        if line.rstrip("\n") == _CLOSED and any(_SOURCE in h for h in held):
            return
        self._stream.write("".join(held))

    def flush(self) -> None:
        with self._lock:
            for r in self._readings.values():
                if r.held is not None:  # an unfinished traceback is not withheld at exit
                    self._stream.write("".join(r.held))
                    r.held = None
                if r.partial:
                    self._stream.write(r.partial)
                    r.partial = ""
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)  # encoding, fileno, isatty, ...


def _is_closed_loop(exc: BaseException | None) -> bool:
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _drop_at_the_hooks() -> None:
    """The closed-loop error as an unraisable exception or uncaught in a Python
    thread: dropped there; every other exception goes to the hook it went to."""
    unraisable, in_thread = sys.unraisablehook, threading.excepthook

    def on_unraisable(u):
        if not _is_closed_loop(u.exc_value):
            unraisable(u)

    def on_thread(args):
        if not _is_closed_loop(args.exc_value):
            in_thread(args)

    sys.unraisablehook, threading.excepthook = on_unraisable, on_thread


def install() -> None:
    """Routes this process's `sys.stderr` through `ClosedLoopFilter` and drops
    the closed-loop error at Python's hooks (once)."""
    if not isinstance(sys.stderr, ClosedLoopFilter):
        sys.stderr = ClosedLoopFilter(sys.stderr)
        _drop_at_the_hooks()
