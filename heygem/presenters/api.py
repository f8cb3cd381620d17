"""Presenters over HTTP, added to the REST API's router (heygem.jobs.api), with its users and errors:

    POST   /api/presenters                 multipart: video (a clip or photo), name, optional face_index
                                           -> 201 {"id", "name", "status": "preparing", "url"}; a clip the
                                           checks refuse -> 400 {"error": ...} and nothing is kept
    GET    /api/presenters                 -> {"presenters": [{"id", "name", "status", "seconds", "size",
                                           "thumbnail", "warnings", ...}]}, newest first
    GET    /api/presenters/{id}            -> one of those
    GET    /api/presenters/{id}/thumbnail  -> JPEG, once ready
    GET    /api/presenters/{id}/speech     -> the speech sample (WAV), when the clip had one
    DELETE /api/presenters/{id}            -> {"id", "status": "deleted"}; one being prepared has its
                                           preparation stopped first (202 {"status": "cancelling"} if that
                                           takes over a few seconds: it goes then)
    POST   /api/jobs with presenter=ID     instead of a face file (see :func:`job_face`)

A presenter belongs to the user who made it: another user gets 404, as for one that does not exist;
an admin sees all. The preparation (the whole clip's face track, the thumbnail, the speech sample)
runs in a background thread of the server, one presenter at a time, with status
``preparing -> ready | failed`` and its progress; one a stop interrupted starts again when the
server starts next.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse
from starlette.datastructures import UploadFile

from heygem.config import Config
from heygem.errors import GenerationCancelled, HeygemError
from heygem.jobs.files import Upload, UploadTooLarge, human_size
from heygem.jobs.request import check_upload_name
from heygem.jobs.users import may_see, sees_every_job
from heygem.presenters.records import PREPARING, READY, Presenter, PresenterStore

logger = logging.getLogger("heygem")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class Preparer:
    """Prepares presenters one at a time on a background thread; those left ``preparing`` by an earlier
    server are queued again when it starts. :meth:`delete` removes one, stopping its preparation first."""

    def __init__(self, presenters: PresenterStore, config: Config | None = None):
        self.presenters = presenters
        self.config = config
        self.waiting: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.cancelled: set[str] = set()  # presenters to stop and remove (read by the preparing thread)
        self.lock = threading.Lock()
        for presenter in presenters.preparing():
            logger.info("presenter %s: its preparation was interrupted; it starts again", presenter.id)
            self.waiting.put(presenter.id)
        self.thread = threading.Thread(target=self._run, name="heygem-presenters", daemon=True)
        self.thread.start()

    def submit(self, presenter: Presenter) -> None:
        self.waiting.put(presenter.id)

    def delete(self, presenter: Presenter, wait_seconds: float = 5.0) -> bool:
        """Remove ``presenter``, the one way every door deletes one: a presenter being prepared (waiting or
        under way) has its preparation stopped first. True once it is gone, False when it is still stopping
        after ``wait_seconds`` (it goes when it has)."""
        if presenter.status != PREPARING:
            self.presenters.remove(presenter.id)
            return True
        with self.lock:
            self.cancelled.add(presenter.id)
        deadline = time.monotonic() + wait_seconds
        while True:
            current = self.presenters.get(presenter.id)
            if current is not None and current.status != PREPARING:  # its preparation ended meanwhile
                self.presenters.remove(presenter.id)
                current = None
            if current is None:
                with self.lock:
                    self.cancelled.discard(presenter.id)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _stop_if_cancelled(self, presenter_id: str) -> None:
        with self.lock:
            if presenter_id in self.cancelled:
                raise GenerationCancelled(f"presenter {presenter_id} was deleted while it was prepared")

    def _run(self) -> None:
        while True:
            self.prepare_one(self.waiting.get())

    def prepare_one(self, presenter_id: str) -> None:
        from heygem.presenters.prepare import prepare

        presenter = self.presenters.get(presenter_id)
        if presenter is None or presenter.status != PREPARING:
            with self.lock:
                self.cancelled.discard(presenter_id)
            return

        def progress(fraction: float) -> None:
            self._stop_if_cancelled(presenter_id)
            self.presenters.report_progress(presenter_id, fraction)

        try:
            progress(0.0)
            prepare(self.presenters, presenter, self.config, progress=progress)
        except GenerationCancelled:
            logger.info("presenter %s (%s): its preparation was stopped and it was deleted", presenter_id,
                        presenter.name)
        except HeygemError as problem:
            logger.warning("presenter %s failed: %s", presenter_id, problem)
            self.presenters.mark_failed(presenter_id, str(problem))
        except Exception as problem:  # a bug, not the clip: logged with its traceback
            logger.exception("presenter %s failed with an unexpected error", presenter_id)
            self.presenters.mark_failed(presenter_id, f"unexpected error ({type(problem).__name__}: {problem})")
        finally:
            with self.lock:
                stopped = presenter_id in self.cancelled
                self.cancelled.discard(presenter_id)
            if stopped:  # deleted while it was prepared: whatever it reached goes too
                self.presenters.remove(presenter_id)


def job_face(presenters: PresenterStore, presenter_id: str | None, user, face, options: dict, resolve_options):
    """(face, options) of a job: unchanged without a presenter; with one, the presenter's clip and its
    face index, its track put in the avatar cache under the key the job's config gives
    (``resolve_options(options) -> (flat options, config)``). HeygemError: no such presenter (for this
    user), or not ready."""
    if not presenter_id:
        return face, options
    from heygem.presenters.prepare import presenter_job

    if face is not None:
        raise HeygemError("send a face file or a presenter, not both")
    presenter = presenters.get(presenter_id.strip())
    if presenter is None or not may_see(user, presenter.submitter):
        raise HeygemError(f"there is no presenter {presenter_id!r}")
    return presenter_job(presenter, options, resolve_options)


def voice_sample_for(presenters: PresenterStore, presenter_id: str | None, voice: str | None, sample):
    """The voice sample a job takes: ``sample`` when one was sent; else, for the cloned voice and a saved
    presenter, the presenter's own speech sample (cut once when it was prepared); else None (the job
    then takes the face video's own sound)."""
    if sample or voice != "clone" or not presenter_id:
        return sample
    presenter = presenters.get(presenter_id.strip())
    return presenter.sample_path if presenter is not None and presenter.sample_path is not None else sample


def add_presenter_routes(router: APIRouter, presenters: PresenterStore, preparer: Preparer) -> None:
    """The /presenters routes on ``router`` (whose route class signs the user in as request.state.user);
    new presenters go to ``preparer`` (one per server: the page hands it its presenters too)."""

    def visible(presenter_id: str, request: Request) -> Presenter | None:
        presenter = presenters.get(presenter_id)
        if presenter is None or not may_see(request.state.user, presenter.submitter):
            return None
        return presenter

    def missing(presenter_id: str) -> JSONResponse:
        return _error(404, f"there is no presenter {presenter_id!r}")

    @router.post("/presenters", status_code=201)
    async def add_presenter(request: Request):
        user = request.state.user
        limit, declared = presenters.max_upload_bytes, request.headers.get("content-length", "")
        if limit is not None and declared.isdigit() and int(declared) > limit + (1 << 20):
            return _error(413, f"the upload is larger than the limit of {human_size(limit)}")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            return _error(400, "send multipart/form-data with the presenter's video (or photo), its name and "
                               "optionally face_index")
        try:
            form = await request.form(max_files=1, max_fields=4)
        except Exception as error:  # malformed multipart
            return _error(400, f"the upload could not be read: {error}")
        try:
            video, name, face_index = form.get("video"), form.get("name"), form.get("face_index")
            if not isinstance(video, UploadFile):
                return _error(400, "the clip is missing: send it as the multipart field 'video'")
            if not isinstance(name, str) or (face_index is not None and not isinstance(face_index, str)):
                return _error(400, "name (and face_index) are plain form fields")
            try:
                index = int(face_index) if face_index not in (None, "") else None
            except ValueError:
                return _error(400, f"face_index counts faces from the left from 0, not {face_index!r}")
            upload = Upload(video.filename or "", video.file)
            try:
                check_upload_name(upload.name, "face")
                presenter = await run_in_threadpool(
                    lambda: presenters.create(upload, name, face_index=index, submitter=user and user.name))
            except UploadTooLarge as error:
                return _error(413, str(error))
            except HeygemError as error:
                return _error(400, str(error))
        finally:
            await form.close()
        preparer.submit(presenter)
        url = f"/api/presenters/{presenter.id}"
        return JSONResponse({"id": presenter.id, "name": presenter.name, "status": presenter.status, "url": url,
                             "warnings": presenter.warnings}, status_code=201, headers={"Location": url})

    @router.get("/presenters")
    def list_presenters(request: Request):
        user = request.state.user
        shown = presenters.list(user and user.name, every_user=sees_every_job(user))
        return {"presenters": [presenter.to_dict() for presenter in shown]}

    @router.get("/presenters/{presenter_id}")
    def get_presenter(presenter_id: str, request: Request):
        presenter = visible(presenter_id, request)
        return presenter.to_dict() if presenter else missing(presenter_id)

    @router.get("/presenters/{presenter_id}/thumbnail")
    def get_thumbnail(presenter_id: str, request: Request):
        presenter = visible(presenter_id, request)
        if presenter is None:
            return missing(presenter_id)
        if presenter.status != READY or not presenter.thumbnail_path.is_file():
            return _error(404, f"presenter {presenter_id} has no thumbnail: it is {presenter.status}")
        return FileResponse(presenter.thumbnail_path, media_type="image/jpeg")

    @router.get("/presenters/{presenter_id}/speech")
    def get_speech(presenter_id: str, request: Request):
        presenter = visible(presenter_id, request)
        if presenter is None:
            return missing(presenter_id)
        sample: Path | None = presenter.sample_path
        if sample is None or not sample.is_file():
            return _error(404, f"presenter {presenter_id} has no speech sample (its clip is {presenter.status}, "
                               "silent, a photo, or holds under 5 s of speech)")
        return FileResponse(sample, media_type="audio/wav", filename=f"{presenter.name}.wav")

    @router.delete("/presenters/{presenter_id}")
    def delete_presenter(presenter_id: str, request: Request):
        presenter = visible(presenter_id, request)
        if presenter is None:
            return missing(presenter_id)
        if not preparer.delete(presenter):
            return JSONResponse({"id": presenter.id, "status": "cancelling"}, status_code=202)
        return {"id": presenter.id, "status": "deleted"}
