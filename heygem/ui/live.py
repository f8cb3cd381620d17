"""The live player: a job's HLS stream (heygem.jobs.stream) played in the page while the job renders.

The player is the browser's own ``<video>`` on the job's playlist, muted so that it may start by
itself. It is put in the page once the first segment is out (a playlist that answers 404 would
leave the element in error) and taken away when the job ends, where the Generate tab shows the
final MP4 and the Jobs tab the result.
"""

from __future__ import annotations

import asyncio
import html

import gradio as gr

from heygem.jobs.store import RUNNING, JobStore
from heygem.jobs.stream import stream_url
from heygem.media.stream import listed_segments, stream_folder
from heygem.ui.common import WATCH_INTERVAL

LIVE_POLL_SECONDS = 0.1  # how often the page looks for the first segment: the first frame shows fast


def live_player(elem_id: str) -> gr.HTML:
    """The (hidden until a stream plays) place of the live player."""
    return gr.HTML("", visible=False, elem_id=elem_id, elem_classes=["live-stream"])


def player_html(job_id: str) -> str:
    source = html.escape(stream_url(job_id), quote=True)
    return (f"<div class='live-label'>Live: the video as it renders</div>"
            f"<video src='{source}' autoplay muted playsinline controls data-job='{html.escape(job_id)}' "
            f"style='width:100%;max-height:420px;background:#000'></video>")


def has_stream(store: JobStore, job_id: str) -> bool:
    job = store.find(job_id) if job_id else None
    return job is not None and bool(listed_segments(stream_folder(job.result_path)))


def job_stream(store: JobStore, job_id: str):
    """The live player for a job picked in the Jobs tab: its stream while it runs, else nothing."""
    job = store.find((job_id or "").strip()) if job_id else None
    if job is None or job.status != RUNNING or not has_stream(store, job.id):
        return gr.update(visible=False, value="")
    return gr.update(visible=True, value=player_html(job.id))


def follow_stream(store: JobStore):
    """For the Generate tab: an async generator that shows the job's stream from its first segment
    until the job ends."""

    async def follow(job_id):
        if not job_id:
            yield gr.update(visible=False, value="")
            return
        shown = False
        while True:
            job = await asyncio.to_thread(store.find, job_id)
            if job is None or job.is_finished:
                yield gr.update(visible=False, value="")
                return
            if not shown and await asyncio.to_thread(has_stream, store, job_id):
                shown = True
                yield gr.update(visible=True, value=player_html(job_id))
            await asyncio.sleep(LIVE_POLL_SECONDS if not shown else WATCH_INTERVAL)

    return follow
