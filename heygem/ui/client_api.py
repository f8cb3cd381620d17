"""The named endpoints for scripts that use gradio_client (/generate and /job_status); nothing of this
shows on the page.
"""

from __future__ import annotations

import asyncio

import gradio as gr

from heygem.errors import HeygemError
from heygem.jobs.request import parse_options
from heygem.jobs.store import DONE, JobStore
from heygem.ui.access import PageAccess
from heygem.ui.common import WATCH_INTERVAL


def client_api(store: JobStore, access: PageAccess) -> None:
    """Named endpoints for scripts that use gradio_client: /generate waits for its job and returns the
    MP4 (with progress), /job_status reports any job. Nothing of this shows on the page."""

    async def generate(face: str, audio: str | None, engine: str = "auto", options: str = "{}", text: str = "",
                       voice: str = "", progress=gr.Progress(),  # noqa: B008 - how Gradio passes progress
                       request: gr.Request = None) -> str:
        """Make a lip-synced MP4 of ``face`` (a video or photo) speaking ``audio``, or ``text`` spoken offline
        by ``voice`` (see `python -m heygem voices`; the result then carries subtitles); with neither, the face
        video's own sound. ``engine``: auto, wav2lip or landmark. ``options``: JSON of more options with the
        dotted names of configs/default.yaml, e.g. {"media.output_height": 360}. Returns the MP4."""
        try:
            chosen = parse_options(options)
            if engine:
                chosen["engine.name"] = engine
            job_id = await asyncio.to_thread(lambda: store.create_job(
                face, audio or None, chosen, text=text if text else None, voice=voice or None, remote=True,
                submitter=access.submitter(request)))
        except HeygemError as error:
            raise gr.Error(str(error)) from None
        try:
            while True:
                job = await asyncio.to_thread(store.get, job_id)
                if job.is_finished:
                    break
                progress(job.progress, desc=job.stage or job.status)
                await asyncio.sleep(WATCH_INTERVAL)
        except asyncio.CancelledError:  # the client went away: the job stops too
            await asyncio.to_thread(store.cancel, job_id)
            raise
        video = access.deliver(job) if job.status == DONE else None
        if video is None:
            raise gr.Error(f"job {job_id} {job.status}: {job.error or 'no result'}")
        return video

    def job_status(job_id: str, request: gr.Request) -> dict:
        """Where a job stands: status, progress, stage, error, times, engine (as GET /api/jobs/ID gives)."""
        job = access.find(job_id, request)
        if job is None:
            raise gr.Error(f"no job {job_id!r}")
        return job.to_dict()

    with gr.Column(visible=False):
        face = gr.File(label="face")
        audio = gr.File(label="audio")
        engine = gr.Textbox("auto", label="engine")
        options = gr.Textbox("{}", label="options")
        text = gr.Textbox("", label="text")
        voice = gr.Textbox("", label="voice")
        video = gr.File(label="video")
        job_id = gr.Textbox(label="job_id")
        status = gr.JSON(label="status")
        run = gr.Button()
        look = gr.Button()
    run.click(generate, [face, audio, engine, options, text, voice], video, api_name="generate", concurrency_limit=8)
    look.click(job_status, job_id, status, api_name="job_status", queue=False)
