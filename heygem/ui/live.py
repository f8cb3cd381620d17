"""The live player: a job's HLS stream (heygem.jobs.stream) played in the page while the job renders.

The player is a ``<video>`` fed by hls.js (heygem/ui/static/hls.light.min.js, Apache-2.0, from
the hls.js 1.7 release), from the stream's first frame on: a browser's own HLS player treats a
playlist without an end as a live broadcast and jumps to its newest segments, and a job renders
faster than real time, so it would skip most of the video. hls.js starts at 0 and plays every
segment in turn, reloading the playlist as soon as it nears its end. Where hls.js cannot run
(no Media Source Extensions: Safari on an iPhone) the browser's own player gets the playlist.

The player is put in the page once the first segment is out (a playlist that answers 404 would
leave the player in error) and taken away when the job ends, where the Generate tab shows the
final MP4 and the Jobs tab the result. It starts with sound where the browser allows it (the page
was clicked: Generate), muted where it does not.
"""

from __future__ import annotations

import asyncio
import html
from pathlib import Path

import gradio as gr

from heygem.jobs.store import RUNNING, JobStore
from heygem.jobs.stream import stream_url
from heygem.media.stream import listed_segments, stream_folder
from heygem.ui.common import WATCH_INTERVAL

HLS_SCRIPT = Path(__file__).resolve().parent / "static" / "hls.light.min.js"
LIVE_POLL_SECONDS = 0.1  # how often the page looks for the first segment: the first frame shows fast

# Runs in the page (gr.HTML's js_on_load): attaches a player to the <video data-src> the value holds,
# each time the value changes.
PLAYER_JS = """
const attach = () => {
  if (element._heygemHls) { element._heygemHls.destroy(); element._heygemHls = null; }
  const video = element.querySelector('video[data-src]');
  if (!video) return;
  const start = () => video.play().catch(() => { video.muted = true; video.play(); });
  const source = video.dataset.src;
  if (window.Hls && window.Hls.isSupported()) {
    const player = new window.Hls({startPosition: 0});
    element._heygemHls = player;
    player.on(window.Hls.Events.MANIFEST_PARSED, start);
    player.loadSource(source);
    player.attachMedia(video);
  } else {
    video.src = source;
    video.addEventListener('loadeddata', start, {once: true});
  }
};
attach();
watch('value', attach);
"""


def live_player(elem_id: str) -> gr.HTML:
    """The (hidden until a stream plays) place of the live player."""
    head = f"<script src='/gradio_api/file={HLS_SCRIPT}'></script>" if HLS_SCRIPT.is_file() else None
    if head is not None:
        gr.set_static_paths([HLS_SCRIPT.parent])
    return gr.HTML("", visible=False, elem_id=elem_id, elem_classes=["live-stream"], head=head,
                   js_on_load=PLAYER_JS)


def player_html(job_id: str) -> str:
    source = html.escape(stream_url(job_id), quote=True)
    return (f"<div class='live-label'>Live: the video as it renders</div>"
            f"<video data-src='{source}' playsinline controls data-job='{html.escape(job_id, quote=True)}' "
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


def follow_stream(store: JobStore, followed=None):
    """For the Generate tab: an async generator that shows the job's stream from its first segment
    until the job ends, or until ``followed(request, job_id)`` says the page follows a newer job."""

    async def follow(job_id, request: gr.Request):
        if not job_id:
            yield gr.update(visible=False, value="")
            return
        shown = False
        while True:
            job = await asyncio.to_thread(store.find, job_id)
            if job is None or job.is_finished:
                yield gr.update(visible=False, value="")
                return
            if followed is not None and not followed(request, job_id):  # the newer job's follow shows it
                return
            if not shown and await asyncio.to_thread(has_stream, store, job_id):
                shown = True
                yield gr.update(visible=True, value=player_html(job_id))
            await asyncio.sleep(LIVE_POLL_SECONDS if not shown else WATCH_INTERVAL)

    return follow
