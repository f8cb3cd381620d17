"""The named endpoints for scripts that use gradio_client (/generate, /submit_job and /job_status); nothing of
this shows on the page.

    client.predict(face=handle_file("me.jpg"), text="Hello.", api_name="/generate")  # -> (MP4 path, job id)
    job_id = client.predict(face=..., audio=handle_file("speech.wav"), api_name="/submit_job")
    client.predict(job_id=job_id, api_name="/job_status")  # -> {"status": ..., "progress": ...}
    client.predict(api_name="/voices")  # -> [{"name": ..., "kind": ..., "language": ..., "sample_rate": ...}, ...]
    client.predict(api_name="/presenters")  # -> [{"id": ..., "name": ..., "status": ...}, ...]
    client.predict(video=handle_file("me.mp4"), name="Me", api_name="/add_presenter")  # -> {"id", "status", ...}
    client.predict(presenter="p-...", api_name="/remove_presenter")  # -> {"id", "status": "deleted"}
    client.predict(presenter="p-...", text="Hello.", api_name="/generate")  # a saved presenter instead of a face

Every request goes through the same check as REST (heygem.jobs.request, as a remote client); a user's
mistake comes back as one message and one line in the server's log, never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import gradio as gr

from heygem.errors import HeygemError
from heygem.jobs.files import server_folders, without_server_paths
from heygem.jobs.request import parse_options
from heygem.jobs.store import DONE, JobStore
from heygem.jobs.users import may_see, sees_every_job
from heygem.presenters.api import Preparer, job_face, voice_sample_for
from heygem.presenters.records import PresenterStore
from heygem.ui.access import PageAccess
from heygem.ui.common import WATCH_INTERVAL, uploaded_file

logger = logging.getLogger("heygem")


def user_error(message: str, store: JobStore | None = None) -> gr.Error:
    """The error a client sees for its own mistake (the server's folders named short, with ``store``):
    one line in the log, no traceback."""
    logger.warning("gradio_client request refused: %s", message)
    if store is not None:
        message = without_server_paths(message, server_folders(store.outputs_dir), every_path=False)
    return gr.Error(message, print_exception=False)


def client_api(store: JobStore, access: PageAccess, presenters: PresenterStore | None = None,
               preparer: Preparer | None = None) -> None:
    """Named endpoints for scripts that use gradio_client: /generate waits for its job and returns the
    MP4 and the job's id (with progress), /submit_job queues a job and returns its id at once, /job_status
    reports any job, /presenters lists the saved presenters a face may be replaced by, /add_presenter makes
    one (checked as REST checks one, then prepared by ``preparer``) and /remove_presenter deletes one.
    Nothing of this shows on the page."""
    presenters = presenters if presenters is not None else PresenterStore(store.outputs_dir)
    preparer = preparer if preparer is not None else Preparer(presenters, store.base_config)

    def queue(face: str | None, audio: str | None, engine: str, options: str, text: str, voice: str,
              voice_sample: str | None, voice_consent: bool, presenter: str, request) -> str:
        if not face and not presenter:
            raise HeygemError("add a face: a video or a photo (the face parameter), or a saved presenter's id "
                              "(the presenter parameter)")
        chosen = parse_options(options)
        if engine:
            chosen["engine.name"] = engine
        face, chosen = job_face(presenters, presenter, access.user(request), face or None, chosen,
                                lambda given: store.resolve_options(given, remote=True))
        voice_sample = voice_sample_for(presenters, presenter, voice, voice_sample or None)  # a presenter's own
        return store.create_job(face, audio or None, chosen, text=text if text else None, voice=voice or None,
                                remote=True, submitter=access.submitter(request), voice_sample=voice_sample,
                                voice_consent=bool(voice_consent))

    async def generate(face: str | None = None, audio: str | None = None, engine: str = "auto", options: str = "{}",
                       text: str = "", voice: str = "", voice_sample: str | None = None, voice_consent: bool = False,
                       presenter: str = "", progress=gr.Progress(),  # noqa: B008 - how Gradio passes progress
                       request: gr.Request = None) -> tuple[str, str]:
        """Make a lip-synced MP4 of ``face`` (a video or photo) speaking ``audio``, or ``text`` spoken offline
        by ``voice`` (see `python -m heygem voices`; the result then carries subtitles); with neither, the face
        video's own sound. ``voice`` "clone" speaks in the voice of ``voice_sample`` (else of the face video's
        own sound) and needs ``voice_consent`` True: you may use that person's voice. ``presenter``: a saved
        presenter's id (see /presenters) instead of ``face``. ``engine``: auto, wav2lip or landmark.
        ``options``: JSON of more options with the dotted names of configs/default.yaml, e.g.
        {"media.output_height": 360}. Returns the MP4 and the job's id (for /job_status)."""
        try:
            job_id = await asyncio.to_thread(queue, face, audio, engine, options, text, voice, voice_sample,
                                             voice_consent, presenter, request)
        except HeygemError as error:
            raise user_error(str(error), store) from None
        try:
            while True:
                job = await asyncio.to_thread(store.get, job_id)
                if job.is_finished:
                    break
                progress(job.progress, desc=f"job {job_id}: {job.stage or job.status}")
                await asyncio.sleep(WATCH_INTERVAL)
        except asyncio.CancelledError:  # the client went away: the job stops too
            await asyncio.to_thread(store.cancel, job_id)
            raise
        video = access.deliver(job) if job.status == DONE else None
        if video is None:
            raise user_error(f"job {job_id} {job.status}: {job.error or 'no result'}")
        return video, job_id

    def submit(face: str | None = None, audio: str | None = None, engine: str = "auto", options: str = "{}",
               text: str = "", voice: str = "", voice_sample: str | None = None, voice_consent: bool = False,
               presenter: str = "", request: gr.Request = None) -> str:
        """Queue a job as /generate does, without waiting: returns its id, for /job_status and for
        GET /api/jobs/ID/result once it is done."""
        try:
            return queue(face, audio, engine, options, text, voice, voice_sample, voice_consent, presenter, request)
        except HeygemError as error:
            raise user_error(str(error), store) from None

    def list_presenters(request: gr.Request) -> list[dict]:
        """The saved presenters this user may use (an admin: everyone's): id, name, status, seconds, warnings."""
        user = access.user(request)
        shown = presenters.list(user and user.name, every_user=sees_every_job(user))
        return [presenter.to_dict() for presenter in shown]

    def list_voices() -> list[dict]:
        """The voices ``voice`` takes: name, kind (piper, espeak, clone), language, sample rate."""
        from heygem.speech.tts import voice_records
        from heygem.weights import weights_dir

        return voice_records(weights_dir())

    def add_presenter(video: str | None, name: str, face_index: str = "", request: gr.Request = None) -> dict:
        """Make a saved presenter of ``video`` (a clip, or a photo) called ``name``; ``face_index``: which face
        speaks when it shows several (counted from the left from 0). The clip is checked first (one clear
        message when it cannot serve); the presenter is then prepared in the background: /presenters shows
        its status until it is ready."""
        if not video:
            raise user_error("add the presenter's clip (the video parameter)")
        try:
            index = int(face_index) if str(face_index).strip() else None
        except ValueError:
            raise user_error(f"face_index counts faces from the left from 0, not {face_index!r}") from None
        user = access.user(request)
        try:
            made = presenters.create(Path(video), name, face_index=index, submitter=user and user.name)
        except HeygemError as error:
            raise user_error(str(error), store) from None
        preparer.submit(made)
        return made.to_dict()

    def remove_presenter(presenter: str, request: gr.Request = None) -> dict:
        """Delete the saved presenter ``presenter`` (its id); one being prepared has its preparation stopped."""
        user = access.user(request)
        found = presenters.get((presenter or "").strip())
        if found is None or not may_see(user, found.submitter):
            raise user_error(f"there is no presenter {presenter!r}")
        return {"id": found.id, "status": "deleted" if preparer.delete(found) else "cancelling"}

    def job_status(job_id: str, request: gr.Request) -> dict:
        """Where a job stands: status, progress, stage, error, times, engine (as GET /api/jobs/ID gives)."""
        job = access.find(job_id, request)
        if job is None:
            raise user_error(f"no job {job_id!r}")
        return job.to_dict()

    with gr.Column(visible=False):
        face = uploaded_file(label="face")
        audio = uploaded_file(label="audio")
        engine = gr.Textbox("auto", label="engine")
        options = gr.Textbox("{}", label="options")
        text = gr.Textbox("", label="text")
        voice = gr.Textbox("", label="voice")
        voice_sample = uploaded_file(label="voice_sample")
        voice_consent = gr.Checkbox(False, label="voice_consent")
        presenter = gr.Textbox("", label="presenter")
        presenter_list = gr.JSON(label="presenters")
        presenter_video = uploaded_file(label="video")
        presenter_name = gr.Textbox("", label="name")
        presenter_face = gr.Textbox("", label="face_index")
        presenter_made = gr.JSON(label="presenter")
        voice_list = gr.JSON(label="voices")
        video = gr.File(label="video")
        job_id = gr.Textbox(label="job_id")
        made_id = gr.Textbox(label="job_id")
        status = gr.JSON(label="status")
        run = gr.Button()
        queue_button = gr.Button()
        look = gr.Button()
        listing = gr.Button()
        making = gr.Button()
        removing = gr.Button()
        voices_button = gr.Button()
    inputs = [face, audio, engine, options, text, voice, voice_sample, voice_consent, presenter]
    run.click(generate, inputs, [video, made_id], api_name="generate", concurrency_limit=8)
    queue_button.click(submit, inputs, made_id, api_name="submit_job", concurrency_limit=8)
    look.click(job_status, job_id, status, api_name="job_status", queue=False)
    listing.click(list_presenters, None, presenter_list, api_name="presenters", queue=False)
    making.click(add_presenter, [presenter_video, presenter_name, presenter_face], presenter_made,
                 api_name="add_presenter", concurrency_limit=2)
    removing.click(remove_presenter, presenter, presenter_made, api_name="remove_presenter", concurrency_limit=2)
    voices_button.click(list_voices, None, voice_list, api_name="voices", queue=False)
