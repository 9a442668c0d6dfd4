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
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

__all__ = ["ClosedLoopFilter", "install"]

_START = "Traceback (most recent call last):"
_CLOSED = "RuntimeError: Event loop is closed"
_SOURCE = "call_soon_threadsafe"


class ClosedLoopFilter:
    """A text stream over `stream` that drops the closed-event-loop tracebacks.

    Lines are passed on as they complete, except a traceback, which is held
    until its last (unindented) line: dropped when that line is
    ``RuntimeError: Event loop is closed`` and a frame is
    ``call_soon_threadsafe`` (the futures' callback), written out otherwise.
    """

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()
        self._partial = ""
        self._held: list[str] | None = None  # the lines of a traceback being read

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            for line in lines:
                self._line(line + "\n")
            if self._held is None and self._partial and not _START.startswith(self._partial):
                self._stream.write(self._partial)  # a prompt or progress bar without "\n"
                self._partial = ""
        return len(text)

    def _line(self, line: str) -> None:
        if self._held is None:
            if line.rstrip("\n") == _START:
                self._held = [line]
            else:
                self._stream.write(line)
            return
        self._held.append(line)
        if line.startswith((" ", "\t")):
            return  # a frame of the traceback
        held, self._held = self._held, None
        if line.rstrip("\n") == _CLOSED and any(_SOURCE in h for h in held):
            return
        self._stream.write("".join(held))

    def flush(self) -> None:
        with self._lock:
            if self._held is not None:  # an unfinished traceback is not withheld at exit
                self._stream.write("".join(self._held))
                self._held = None
            if self._partial:
                self._stream.write(self._partial)
                self._partial = ""
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)  # encoding, fileno, isatty, ...


def install() -> None:
    """Routes this process's `sys.stderr` through `ClosedLoopFilter` (once)."""
    if not isinstance(sys.stderr, ClosedLoopFilter):
        sys.stderr = ClosedLoopFilter(sys.stderr)
