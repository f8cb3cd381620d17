"""What a job store lets in (JobLimits, and the refusals QueueFull and NotEnoughDisk), and what a server
lets a remote request start: caps on the processes and threads one job may ask for.

A job's options can set how many face trackers (``run.face_workers``, processes of their own), ffmpeg
decoders (``run.decoders``) and x264 encoders (``run.encoders``) it starts. The command line run on its own
machine may ask for as many as it likes; a request that comes over the network (the page,
gradio_client, REST, the Batch tab) is refused with one line above the server's caps, so a few
requests cannot exhaust the machine. 0 (pick from the cores) is always allowed: the automatic
choice is bounded by the machine itself.

The operator sets the caps with ``python app.py --max-job-processes N``; the default is the
machine's core count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from heygem.errors import HeygemError

# The options that set a count of processes or threads, and what each starts (for the message).
PROCESS_OPTIONS = {
    "run.face_workers": "face tracker processes",
    "run.decoders": "ffmpeg decoder processes",
    "run.encoders": "x264 encoder processes",
}


def machine_cores() -> int:
    """The CPU cores this process may use (its affinity where the platform tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ProcessCaps:
    """The most of each kind of process one remote job may ask for."""

    face_workers: int
    decoders: int
    encoders: int

    @classmethod
    def every(cls, count: int) -> ProcessCaps:
        """The same cap on every kind."""
        count = max(1, int(count))
        return cls(face_workers=count, decoders=count, encoders=count)

    @classmethod
    def for_machine(cls) -> ProcessCaps:
        """The default: as many as the machine has cores."""
        return cls.every(os.cpu_count() or machine_cores())

    def cap(self, option: str) -> int:
        return getattr(self, option.split(".", 1)[1])


def check_process_caps(options: dict, caps: ProcessCaps | None = None) -> None:
    """HeygemError when an option of ``options`` (flat dotted keys, values already checked as numbers) asks
    for more processes than ``caps`` (default: :meth:`ProcessCaps.for_machine`) allow."""
    caps = caps if caps is not None else ProcessCaps.for_machine()
    for option, what in PROCESS_OPTIONS.items():
        value = options.get(option)
        if value is None:
            continue
        limit = caps.cap(option)
        if value > limit:
            raise HeygemError(f"{option} asks for {value} {what}; this server allows at most {limit} per job "
                              "(0 picks from the cores)")


@dataclass(frozen=True)
class JobLimits:
    """What a job store accepts before it queues a job; None switches a limit off."""

    max_queued: int | None = None  # jobs waiting to run; one more is refused (QueueFull, HTTP 429)
    max_audio_seconds: float | None = None  # longest speech, so the longest output
    max_output_height: int | None = None  # tallest output frame (the face's own, or media.output_height)
    min_free_bytes: int | None = None  # free disk space under outputs/ needed to take a job (HTTP 507)
    max_text_characters: int | None = None  # longest text spoken for a job; None: the config's text.max_characters
    process_caps: ProcessCaps | None = None  # processes a remote job may start; None: the machine's cores


class QueueFull(HeygemError):
    """Too many jobs are waiting; ``retry_after`` seconds is a fair time to try again."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class NotEnoughDisk(HeygemError):
    """The outputs folder's disk has less free space than a job needs."""
