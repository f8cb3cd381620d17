"""The REST API: jobs over HTTP, served by ``python app.py`` next to the web UI.

    POST   /api/jobs               multipart: face, audio (optional: the face video's own sound) or text (with
                                   optional voice, speed and subtitles: none, soft or burn; voice=clone with
                                   voice_consent=true and an optional voice_sample file), options (JSON)
                                   -> 201 {"id": ...}; bad files, file names that are not a plain name of a
                                   video, image or audio type, or unknown options -> 400 {"error": ...};
                                   queue full -> 429 (Retry-After); disk short or full -> 507
    GET    /api/jobs               -> {"jobs": [...]}, newest first (?status=, ?limit=)
    GET    /api/jobs/{id}          -> {"id", "status", "progress", "stage", "error", "created", ...}
    GET    /api/jobs/{id}/result   -> the MP4 (404 until the job is done)
    GET    /api/jobs/{id}/log      -> the job's log as text
    GET    /api/jobs/{id}/stream.m3u8  -> HLS of the frames encoded so far (heygem.jobs.stream)
    DELETE /api/jobs/{id}          -> cancels a queued or running job; deletes a finished (done, failed,
                                   cancelled) one with its files -> {"id", "status": "deleted"}
    POST   /api/jobs/{id}/retry    -> queues a failed or cancelled job again (admitted as a new job:
                                   queue full -> 429 with Retry-After, disk short -> 507)
    GET    /api/voices             -> {"voices": [{"name", "kind", "language", "sample_rate"}, ...]}: what the
                                   text's voice field takes (Piper voices in weights/voices/ included)
    /api/presenters...             saved presenters, and presenter=ID instead of face in POST /api/jobs
                                   (heygem.presenters.api)
    /api/live...                   live sessions over WebRTC (heygem.live.routes); the page's Live tab
                                   signs in with a one-use ticket and its session's key instead
                                   (heygem.live.tickets)

Every error is JSON ``{"error": message}`` (a query parameter of the wrong type too: 400). With
``auth`` set, every route needs HTTP basic auth with the same user and password as the web UI. With
``users`` (heygem.jobs.users), every route needs one of those users (basic auth
NAME:SECRET, or ``Authorization: Bearer NAME:SECRET``, or ``Bearer SECRET`` for a
secret written plain), checked in a worker thread; repeated failures from one
address or for one name answer 429 (Retry-After) for a while; a request from
another site's page (a foreign Origin, or a foreign Referer on POST, PUT, PATCH
and DELETE) answers 403. Each job belongs to the user
who submitted it, a user sees and touches only their own (another's answers
404, as a job that does not exist) and an admin every job. Only files inside
the job folders are ever served.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import secrets
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from starlette.datastructures import UploadFile

from heygem.config import REPO_ROOT
from heygem.errors import HeygemError
from heygem.jobs import files
from heygem.jobs.files import Upload, UploadTooLarge, download_name, human_size, without_server_paths
from heygem.jobs.limits import NotEnoughDisk, QueueFull
from heygem.jobs.request import check_upload_name, flatten_options, parse_options
from heygem.jobs.store import DONE, JobStore
from heygem.jobs.stream import add_stream_routes
from heygem.jobs.users import FailedSignIns, Users, claimed_name, foreign_origin, log_for, may_see, submitter_filter
from heygem.live.routes import add_live_routes
from heygem.live.sessions import LiveSettings
from heygem.live.tickets import TicketRefused
from heygem.presenters.api import Preparer, add_presenter_routes, voice_sample_for
from heygem.presenters.api import job_face as presenter_job_face
from heygem.presenters.records import PresenterStore
from heygem.weights import weights_dir

logger = logging.getLogger("heygem")

JOB_ID_PATTERN = re.compile(r"^[0-9A-Za-z-]{1,64}$")
BASIC_CHALLENGE = 'Basic realm="heygem", charset="UTF-8"'
MULTIPART_OVERHEAD = 1 << 20  # bytes of form fields and boundaries allowed on top of the two files


class ApiError(Exception):
    """Ends a request with ``{"error": message}`` and an HTTP status."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def check_basic_auth(request: Request, credentials: tuple[str, str]) -> None:
    """Raise ApiError(401) unless the request carries these basic-auth credentials."""
    challenge = {"WWW-Authenticate": BASIC_CHALLENGE}
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        raise ApiError(401, "this server needs a user name and password (HTTP basic auth)", challenge)
    try:
        user, _, password = base64.b64decode(encoded, validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        raise ApiError(401, "the Authorization header is not valid basic auth", challenge) from None
    expected_user, expected_password = credentials
    user_ok = secrets.compare_digest(user.encode(), expected_user.encode())
    password_ok = secrets.compare_digest(password.encode(), expected_password.encode())
    if not (user_ok and password_ok):
        raise ApiError(401, "wrong user name or password", challenge)


def refuse_foreign_origin(request: Request) -> None:
    """Raise ApiError(403) for a request from another site's page (heygem.jobs.users.foreign_origin)."""
    headers = request.headers
    origin = foreign_origin(request.method, headers.get("origin"), headers.get("referer"), headers.get("host"))
    if origin is not None:
        logger.warning("refused %s %s from another site's page (%s)", request.method, request.url.path, origin)
        raise ApiError(403, "this API takes no requests from other sites' pages")


def validation_message(error: RequestValidationError) -> str:
    """FastAPI's list of what failed validation, as one line: limit='abc': Input should be a valid integer."""
    problems = []
    for problem in error.errors():
        name = ".".join(str(part) for part in problem.get("loc", ())[1:]) or "the request"
        given = f"={problem['input']!r}" if isinstance(problem.get("input"), (str, int, float)) else ""
        problems.append(f"{name}{given}: {problem.get('msg', 'not valid')}"[:200])
    return "; ".join(problems).replace("\n", " ") or "the request is not valid"


def counted_request(request: Request, max_bytes: int) -> Request:
    """``request`` with its body counted as it arrives: past ``max_bytes`` reading it raises UploadTooLarge,
    so a chunked upload (no Content-Length to refuse it by) is stopped early, not spooled whole."""
    received = 0

    async def receive() -> dict:
        nonlocal received
        message = await request.receive()
        if message.get("type") == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise UploadTooLarge(f"the upload is larger than the limit of {human_size(max_bytes)}")
        return message

    return Request(request.scope, receive)


def server_folders(store: JobStore, job) -> dict[Path, str]:
    """The server's folders a job's log may name, with what a user who is not an admin reads instead."""
    return {job.directory: "<job folder>", store.outputs_dir: "<outputs>", weights_dir(): "weights",
            REPO_ROOT: "<heygem>"}


def create_router(store: JobStore, *, auth: tuple[str, str] | None = None, users: Users | None = None,
                  max_upload_bytes: int | None = None, sign_ins: FailedSignIns | None = None,
                  presenters: PresenterStore | None = None, preparer: Preparer | None = None,
                  live: LiveSettings | None = None) -> APIRouter:
    """The /api routes over ``store``; include them in the app that also serves the UI. ``users``: who
    may call them, each seeing their own jobs (``auth``, one shared name and password, is then unused).
    ``sign_ins``: the failed sign-ins counted (shared with the page's login). ``presenters``: the saved
    presenters (heygem.presenters), by default those of the store's folder; ``preparer``: what prepares new
    ones (the page's too), by default one started here. ``live``: what live sessions (heygem.live) may do,
    by default LiveSettings()."""
    sign_ins = sign_ins if sign_ins is not None else FailedSignIns()
    live = live if live is not None else LiveSettings()

    def signed_in(request: Request):
        """The request's user (request.state.user), or 401 (429 after repeated failures); None when the
        server has no users. Run in a worker thread: a hashed secret takes a while to check."""
        if users is None and auth is None:
            return None
        try:  # the page's Live tab: a one-use ticket, or its session's key (heygem.live.tickets)
            live_pass = live.tickets.pass_for(request.scope.get("method", "GET"), request.url.path,
                                              request.path_params, request.headers)
        except TicketRefused as refused:
            raise ApiError(401, str(refused)) from None
        if live_pass is not None:
            user = users.get(live_pass.user_name) if users is not None else None
            if users is not None and user is None:
                raise ApiError(401, "the user this live ticket was given to is no longer on this server")
            return user
        header = request.headers.get("authorization", "")
        address, name = request.client.host if request.client else None, claimed_name(header)
        wait = sign_ins.retry_after(address, name)
        if wait:
            raise ApiError(429, f"too many failed sign-ins: try again in {wait} s", {"Retry-After": str(wait)})
        try:
            if users is None:
                check_basic_auth(request, auth)
                return None
            user = users.from_authorization(header)
            if user is None:
                raise ApiError(401, "this server needs a user: HTTP basic auth NAME:SECRET, or the header "
                                    "Authorization: Bearer NAME:SECRET", {"WWW-Authenticate": BASIC_CHALLENGE})
            return user
        except ApiError:
            if header.strip():
                sign_ins.failed(address, name)
            raise

    class GuardedRoute(APIRoute):
        """Checks the user first and turns ApiError and HeygemError into JSON errors."""

        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                try:
                    refuse_foreign_origin(request)
                    request.state.user = await run_in_threadpool(signed_in, request)
                    return await handler(request)
                except ApiError as error:  # no server folder in it: a client may quote its own paths
                    message = without_server_paths(error.message, door_folders, every_path=False)
                    return error_response(error.status, message, error.headers)
                except RequestValidationError as error:  # a query or path parameter of the wrong type
                    return error_response(400, validation_message(error))

            return guarded

    router = APIRouter(prefix="/api", route_class=GuardedRoute)
    presenters = presenters or PresenterStore(store.outputs_dir, max_upload_bytes=max_upload_bytes)
    door_folders = files.server_folders(store.outputs_dir)

    def find_job(job_id: str, request: Request):
        """The job, when it exists and the request's user may see it; else 404 (the same answer for both,
        so that ids of other users' jobs do not leak)."""
        job = store.find(job_id) if JOB_ID_PATTERN.match(job_id) else None
        if job is None or not may_see(request.state.user, job.submitter):
            raise ApiError(404, f"there is no job {job_id!r}")
        return job

    @router.post("/jobs", status_code=201)
    async def submit_job(request: Request):
        user = request.state.user
        limit = max_upload_bytes
        declared = request.headers.get("content-length")
        if limit is not None and declared and declared.isdigit() and int(declared) > 2 * limit + MULTIPART_OVERHEAD:
            raise ApiError(413, f"the upload is larger than the limit of {human_size(limit)} per file")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "send multipart/form-data with a face file, an audio file and optional options JSON")
        if limit is not None:
            request = counted_request(request, 2 * limit + MULTIPART_OVERHEAD)
        try:
            form = await request.form(max_files=3, max_fields=10)
        except UploadTooLarge:
            raise ApiError(413, f"the upload is larger than the limit of {human_size(limit)} per file") from None
        except Exception as error:  # malformed multipart
            raise ApiError(400, f"the upload could not be read: {error}") from None
        try:
            face, audio = form.get("face"), form.get("audio")
            presenter = form.get("presenter")  # a saved presenter's id instead of a face file (heygem.presenters)
            if presenter is not None and not isinstance(presenter, str):
                raise ApiError(400, "presenter is a plain form field: the presenter's id")
            if not isinstance(face, UploadFile) and not presenter:
                raise ApiError(400, "the face file is missing: send it as the multipart field 'face'")
            if audio is not None and not isinstance(audio, UploadFile):
                if str(audio).strip():
                    raise ApiError(400, "audio must be a file (multipart field 'audio'); leave it out to use "
                                        "the face video's own sound")
                audio = None
            options_text = form.get("options") or "{}"
            if not isinstance(options_text, str):
                options_text = (await options_text.read()).decode("utf-8", "replace")
            try:
                options = parse_options(options_text)
            except HeygemError as error:
                raise ApiError(400, str(error)) from None
            text, voice, speed = form.get("text"), form.get("voice"), form.get("speed")
            subtitles = form.get("subtitles")
            if any(value is not None and not isinstance(value, str) for value in (text, voice, speed, subtitles)):
                raise ApiError(400, "text, voice, speed and subtitles are plain form fields, not files")
            if subtitles:  # a shorthand for the option text.subtitles
                try:
                    options = {**options, **flatten_options({"text.subtitles": subtitles.strip()})}
                    store.resolve_options(options, remote=True)
                except HeygemError as error:
                    raise ApiError(400, str(error)) from None
            try:
                speed = float(speed) if speed else 1.0
            except ValueError:
                raise ApiError(400, f"speed must be a number such as 1.0, not {speed!r}") from None
            try:
                if not presenter:
                    check_upload_name(face.filename or "", "face")
                if audio is not None:
                    check_upload_name(audio.filename or "", "audio")
            except HeygemError as error:
                raise ApiError(400, str(error)) from None
            face_upload = Upload(face.filename, face.file) if isinstance(face, UploadFile) else None
            audio_upload = Upload(audio.filename, audio.file) if audio is not None else None
            sample, consent = form.get("voice_sample"), str(form.get("voice_consent") or "").strip().lower()
            if sample is not None and not isinstance(sample, UploadFile) and str(sample).strip():
                raise ApiError(400, "voice_sample must be a file (multipart field 'voice_sample'): a recording of "
                                    "the person speaking")
            sample_upload = Upload(sample.filename, sample.file) if isinstance(sample, UploadFile) else None

            def create_job() -> str:
                job_face, job_options = presenter_job_face(presenters, presenter, user, face_upload, options,
                                                           lambda given: store.resolve_options(given, remote=True))
                job_sample = voice_sample_for(presenters, presenter, voice, sample_upload)  # a presenter's own voice
                return store.create_job(job_face, audio_upload, job_options, text=text, voice=voice, speed=speed,
                                        remote=True, submitter=user and user.name, voice_sample=job_sample,
                                        voice_consent=consent in ("true", "1", "yes", "on"))

            try:
                job_id = await run_in_threadpool(create_job)
            except UploadTooLarge as error:
                raise ApiError(413, str(error)) from None
            except QueueFull as error:
                raise ApiError(429, str(error), headers={"Retry-After": str(error.retry_after)}) from None
            except NotEnoughDisk as error:
                raise ApiError(507, str(error)) from None
            except HeygemError as error:
                raise ApiError(400, str(error)) from None
        finally:
            await form.close()
        return JSONResponse({"id": job_id, "status": "queued", "url": f"/api/jobs/{job_id}"}, status_code=201,
                            headers={"Location": f"/api/jobs/{job_id}"})

    @router.get("/jobs")
    def list_jobs(request: Request, status: str | None = None, limit: int = 100):
        submitter = submitter_filter(request.state.user)
        try:
            jobs = store.list(status=status, limit=max(1, min(limit, 1000)), submitter=submitter)
        except HeygemError as error:
            raise ApiError(400, str(error)) from None
        return {"jobs": [job.to_dict() for job in jobs], "counts": store.counts(submitter=submitter)}

    @router.get("/jobs/{job_id}")
    def get_job(job_id: str, request: Request):
        return find_job(job_id, request).to_dict()

    @router.get("/jobs/{job_id}/result")
    def get_result(job_id: str, request: Request):
        job = find_job(job_id, request)
        if job.status != DONE or not job.result_path.is_file():
            detail = f": {job.error}" if job.error else (f" ({job.stage} {job.progress:.0%})" if job.stage else "")
            raise ApiError(404, f"job {job_id} has no result yet: it is {job.status}{detail}")
        return FileResponse(job.result_path, media_type="video/mp4", filename=download_name(job))

    @router.get("/jobs/{job_id}/log")
    def get_log(job_id: str, request: Request):
        job = find_job(job_id, request)
        text = job.log_path.read_text(encoding="utf-8", errors="replace") if job.log_path.is_file() else ""
        return PlainTextResponse(log_for(request.state.user, text, server_folders(store, job)))

    @router.delete("/jobs/{job_id}")
    def cancel_or_delete_job(job_id: str, request: Request):
        job = find_job(job_id, request)
        if not job.is_finished:
            return store.cancel(job_id).to_dict()
        try:
            store.delete(job_id)
        except HeygemError as error:  # queued again (a retry) or claimed since it was read
            raise ApiError(409, str(error)) from None
        return {"id": job_id, "status": "deleted"}

    @router.post("/jobs/{job_id}/retry")
    def retry_job(job_id: str, request: Request):
        find_job(job_id, request)
        try:
            return store.retry(job_id).to_dict()
        except QueueFull as error:
            raise ApiError(429, str(error), headers={"Retry-After": str(error.retry_after)}) from None
        except NotEnoughDisk as error:
            raise ApiError(507, str(error)) from None
        except HeygemError as error:
            raise ApiError(409, str(error)) from None

    @router.get("/voices")
    async def list_voices() -> JSONResponse:
        from heygem.speech.tts import voice_records

        return JSONResponse({"voices": await run_in_threadpool(voice_records, weights_dir())})

    add_stream_routes(router, find_job)  # GET /jobs/{id}/stream.m3u8 and its segments, as the job is encoded
    add_presenter_routes(router, presenters, preparer or Preparer(presenters, store.base_config))  # /presenters
    add_live_routes(router, presenters, signed_in, live, store.base_config)  # /live (heygem.live.routes)
    return router
