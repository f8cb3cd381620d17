"""The ffmpeg binary heygem runs, what it says when it fails, and pipes tuned for raw frames.

ffmpeg is the system binary when one is on PATH, otherwise the one bundled in the imageio-ffmpeg
wheel, so ``pip install`` alone is enough. Every command heygem builds runs without a shell, its
arguments made by small pure functions (``*_args``) that the tests check without running ffmpeg.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import time

import numpy as np

from heygem.errors import HeygemError

logger = logging.getLogger("heygem")


@functools.lru_cache(maxsize=1)
def ffmpeg_binary() -> str:
    """The ffmpeg executable: the system one if present, else imageio-ffmpeg's bundled binary."""
    override = os.environ.get("HEYGEM_FFMPEG")
    if override:
        return override
    system = shutil.which("ffmpeg")
    if system:
        return system
    try:
        import imageio_ffmpeg
    except ImportError:
        imageio_ffmpeg = None
    for attempt in range(3 if imageio_ffmpeg is not None else 0):
        try:
            return imageio_ffmpeg.get_ffmpeg_exe()
        except RuntimeError:
            # imageio-ffmpeg remembers a failed look-up for the life of the process, even one that failed for a
            # passing reason (its check runs `ffmpeg -version`): forget it and look again before giving up
            lookup = getattr(getattr(imageio_ffmpeg, "_utils", None), "_get_ffmpeg_exe", None)
            if not hasattr(lookup, "cache_clear"):
                break
            lookup.cache_clear()
            logger.warning("the bundled ffmpeg did not answer; looking again (%d of 3)", attempt + 1)
            time.sleep(0.2 * (attempt + 1))
    raise HeygemError(
        "ffmpeg was not found: install it (apt install ffmpeg, brew install ffmpeg) "
        "or `pip install imageio-ffmpeg`, which bundles one"
    )


def ffmpeg_message(stderr_file, return_code: int | None, error: BaseException | None = None) -> str:
    """ffmpeg's last stderr line, or how it ended when it said nothing (killed, say)."""
    stderr_file.seek(0)
    lines = stderr_file.read().decode(errors="replace").strip().splitlines()
    if any("No space left on device" in line for line in lines):
        return "the disk holding the output is full (no space left on device): free some space and try again"
    if lines:
        return lines[-1]
    if return_code is not None and return_code < 0:
        return f"ffmpeg was stopped by signal {-return_code}"
    return str(error) if error is not None else f"ffmpeg exited with status {return_code}"


PIPE_BYTES = 1 << 20  # a 1080p frame is 3 MiB: 64 KiB pipes cost ~50 wake-ups per frame each way


def enlarge_pipe(pipe) -> None:
    """Ask Linux for a 1 MiB pipe buffer (F_SETPIPE_SZ), so raw frames cross in few large steps.

    Elsewhere, or above the system's limit for an unprivileged user, the pipe stays as it is.
    """
    if not sys.platform.startswith("linux"):
        return
    import fcntl

    try:
        fcntl.fcntl(pipe.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:
        pass


def read_into(stream, buffer: np.ndarray) -> int:
    """Fill ``buffer`` (a flat uint8 array) from ``stream`` until it is full or the stream ends; bytes read."""
    view = memoryview(buffer).cast("B")
    filled = 0
    while filled < len(view):
        count = stream.readinto(view[filled:])
        if not count:
            break
        filled += count
    return filled
