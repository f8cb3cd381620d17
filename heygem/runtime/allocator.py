"""How the C allocator of this process hands out and returns the memory of frames.

A job moves thousands of frame-sized buffers (a 1080p frame is 3 MiB as I420, 6 MiB as BGR)
between a dozen threads. glibc's malloc, left to itself, gives threads that contend for it
arenas of their own (up to eight per core) and, once a large buffer has been freed, raises the
size above which it maps buffers straight from the kernel. From then on frames come from the
arenas, and what the threads free stays in the process scattered over them: on the 16-core GPU
machine a job's main process held 1-2 GiB more than the frames in flight (docs/benchmarks.md).

:func:`tune` caps the arenas and fixes that size, so that a buffer of 4 MiB or more goes back to
the kernel when it is freed. It acts once per process and only on glibc, and by default only on
machines of 8 cores or more: there the pipeline runs many decoding, tracking and encoding threads
and the tuning took 1.5 GiB off a ten-minute 1080p job; on the 2-core CPU it saved 60 MiB and cost
3-15 % of speed in five paired runs (the kernel maps and zeroes every large buffer anew).
``HEYGEM_ALLOCATOR`` says otherwise: ``tuned`` (on any machine), ``system`` (never); a user who
tuned malloc through the environment keeps it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

logger = logging.getLogger("heygem")

MIN_CORES = 8  # tuned by default on machines with at least this many cores
ARENAS = 4  # at most this many malloc arenas for the whole process
MAP_ABOVE_BYTES = 4 * 2**20  # buffers of this size or more are mapped from the kernel and given back when freed
TRIM_ABOVE_BYTES = 4 * 2**20  # free memory above this at the top of a heap is given back

# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

# environment variables through which glibc's malloc is tuned at start-up; a user who set one keeps it
_USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_lock = threading.Lock()
_outcome: str | None = None


def _reason_to_leave() -> str | None:
    """Why the allocator is left as it is, or None."""
    choice = os.environ.get("HEYGEM_ALLOCATOR", "auto").strip().lower() or "auto"
    if choice not in ("auto", "tuned", "system"):
        logger.warning("HEYGEM_ALLOCATOR=%s is not auto, tuned or system: the allocator is left as it is", choice)
        return f"HEYGEM_ALLOCATOR={choice} is not auto, tuned or system"
    if choice == "system":
        return "HEYGEM_ALLOCATOR=system"
    if any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "malloc is tuned in the environment"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    cores = os.cpu_count() or 1
    if choice == "auto" and cores < MIN_CORES:
        return f"{cores} cores (HEYGEM_ALLOCATOR=tuned tunes it)"
    return None


def tune() -> str:
    """Cap the arenas and fix the mapping size of this process's malloc (see the module's text), the
    first time it is called; later calls do nothing. Returns what was done, for the log: "tuned" or
    "left: <why>"."""
    global _outcome
    with _lock:
        if _outcome is not None:
            return _outcome
        reason = _reason_to_leave()
        if reason is None:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            applied = [mallopt(_M_ARENA_MAX, ARENAS), mallopt(_M_MMAP_THRESHOLD, MAP_ABOVE_BYTES),
                       mallopt(_M_TRIM_THRESHOLD, TRIM_ABOVE_BYTES)]
            reason = None if all(applied) else "mallopt refused a setting"
        _outcome = "tuned" if reason is None else f"left: {reason}"
        logger.debug("malloc %s", _outcome)
        return _outcome


__all__ = ["ARENAS", "MAP_ABOVE_BYTES", "MIN_CORES", "tune"]
