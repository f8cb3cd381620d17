"""Where a run's start-up goes: named marks in seconds since the process started.

The clock starts when the operating system started the process (Linux: /proc/self/stat), so the
first mark already holds the interpreter's start and the imports before heygem's first line.
``mark(name)`` records a moment once (a second mark of the same name is ignored, so "first ..."
marks can be called for every batch); ``marks()`` gives them in order; ``describe()`` one line,
which the pipeline logs at the end of a run (job.log, and the terminal with --verbose).
``span(name)`` marks the start and end of a block (``name`` and ``name done``).

Stages mark their first item (heygem.runtime.flow): "first decode batch", "first faces batch",
... "first encode batch" (the first frames handed to x264).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager


def _process_age() -> float:
    """Seconds since the operating system started this process (0 where that cannot be read)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of stat(5), counted after the command name
        with open("/proc/uptime", encoding="ascii") as uptime:
            now = float(uptime.read().split()[0])
        return max(0.0, now - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


_START = time.perf_counter() - _process_age()  # perf_counter() at the process's start
_MARKS: dict[str, float] = {}
_LOCK = threading.Lock()


def now() -> float:
    """Seconds since the process started."""
    return time.perf_counter() - _START


def mark(name: str) -> float:
    """Record ``name`` at this moment unless it is recorded already; returns its time."""
    with _LOCK:
        return _MARKS.setdefault(name, now())


def marks() -> list[tuple[str, float]]:
    """Every mark, earliest first."""
    with _LOCK:
        return sorted(_MARKS.items(), key=lambda item: item[1])


def clear() -> None:
    """Forget the marks (a worker's next job starts a timeline of its own; times stay process-relative)."""
    with _LOCK:
        _MARKS.clear()


@contextmanager
def span(name: str):
    mark(name)
    try:
        yield
    finally:
        mark(f"{name} done")


def describe() -> str:
    """One line: "name 0.12 s, other 0.50 s, ..." in seconds since the process started."""
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in marks())
