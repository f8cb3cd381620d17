"""Who uses the page and what they may reach: the signed-in user (Gradio's login, checked against
``--users``), the jobs they see (their own; an admin every job), and the files that leave the server.

The job folders are never served as they are: Gradio's ``/gradio_api/file=`` refuses every path under
``--outputs``, and a job's video goes to the browser as a copy in Gradio's cache folder (a hard link
where the disk allows), in a folder of its own with an unguessable name and the name the download
should have (``<face>-<speech>.mp4``). So one user cannot fetch another's files by their paths, and no
server path of a job shows on the page. Without ``--users`` (one person's server, with or without
``--auth``) everyone who signs in is that one person and sees every job.

Gradio's login calls :meth:`PageAccess.page_auth`'s check, which runs in a worker thread (a hashed
secret takes a while) and counts failures with the REST API's (heygem.jobs.users.FailedSignIns: 429
after too many). :class:`PageGuard`, a middleware of the page's server, refuses /login to an address
refused for now, ends the sessions of users removed from the users file (or given a new secret), and
serves a streamed output (the live player's playlist and segments, under
``/gradio_api/stream/SESSION/``) only to the signed-in user whose page session it is: anyone else
gets 404, and without sign-in 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from fastapi import HTTPException
from gradio.utils import get_upload_folder, is_in_or_equal
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse

from heygem.errors import HeygemError
from heygem.jobs.files import download_name
from heygem.jobs.store import Job, JobStore
from heygem.jobs.users import (
    FailedSignIns,
    User,
    Users,
    may_see,
    sees_every_job,
    shared_password_matches,
    submitter_filter,
)

logger = logging.getLogger("heygem")

NOBODY = User(name="", admin=False)  # a request without a known user sees no job
SWEEP_SECONDS = 30.0  # how often the page looks for copies of jobs deleted elsewhere
MAX_STREAM_SESSIONS = 10_000  # page sessions whose user is remembered for their streamed outputs
STREAM_PATH = re.compile(r"/gradio_api/stream/(?P<session>[^/]+)/[^/]+/[^/]+/[^/]+$")  # SESSION/RUN/COMPONENT/FILE
_client_address: contextvars.ContextVar[str | None] = contextvars.ContextVar("heygem_client", default=None)


class PageAccess:
    """The page's access rules over ``store``: ``users`` None is a server for one person."""

    def __init__(self, store: JobStore, users: Users | None = None, sign_ins: FailedSignIns | None = None):
        self.store, self.users = store, users
        self.sign_ins = sign_ins if sign_ins is not None else FailedSignIns()  # shared with the REST API
        self._stream_users: OrderedDict[str, str | None] = OrderedDict()  # page session -> its user
        self._generation = users.generation if users is not None else 0  # the users' reading sessions follow
        self._listed = {user.name: user for user in users} if users is not None else {}  # as of that reading
        # (job id or "", source path, file name) -> its copy in Gradio's cache ("": no job's, a batch's zip)
        self._delivered: dict[tuple[str, str, str], Path] = {}
        self._swept = 0.0  # when copies of jobs deleted elsewhere (REST, `jobs delete`, clean) were last removed
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ who

    def user(self, request) -> User | None:
        """The user behind a Gradio request (gr.Request); None when the server has no users."""
        if self.users is None:
            return None
        return self.users.get(getattr(request, "username", None)) or NOBODY

    def submitter(self, request) -> str | None:
        """The name a job submitted by this request is recorded under; HeygemError without a known user."""
        user = self.user(request)
        if user is NOBODY:
            raise HeygemError("sign in first: this server takes jobs from its users only")
        return None if user is None else user.name

    def sees_all(self, request) -> bool:
        return sees_every_job(self.user(request))

    def page_auth(self, shared: tuple[str, str] | None) -> Callable | None:
        """What launch(auth=...) takes: an async check of the users (else of the one shared name and
        password), run in a worker thread; HTTP 429 after too many failures (None: no sign-in)."""
        if self.users is None and shared is None:
            return None
        users, sign_ins = self.users, self.sign_ins

        def right(name: str, password: str) -> bool:
            if users is not None:
                return users.check_password(name, password) is not None
            return shared_password_matches(shared, name, password)

        async def sign_in(name: str, password: str) -> bool:
            address = _client_address.get()
            wait = sign_ins.retry_after(address, name)
            if wait:
                raise HTTPException(429, f"too many failed sign-ins: try again in {wait} s",
                                    headers={"Retry-After": str(wait)})
            if await asyncio.to_thread(right, name, password):
                return True
            sign_ins.failed(address, name)
            return False

        return sign_in

    def middleware(self) -> Middleware:
        """What launch(app_kwargs={"middleware": [...]}) takes: :class:`PageGuard` over this page."""
        return Middleware(PageGuard, access=self)

    def note_stream_user(self, request) -> None:
        """Remember whose page session (gr.Request) streams a live output, for :class:`PageGuard`."""
        session = getattr(request, "session_hash", None)
        if not session:
            return
        with self._lock:
            self._stream_users[session] = getattr(request, "username", None)
            self._stream_users.move_to_end(session)
            while len(self._stream_users) > MAX_STREAM_SESSIONS:
                self._stream_users.popitem(last=False)

    def streams_to(self, session: str, name: str | None) -> bool:
        """Whether a page session's streamed outputs may go to the signed-in ``name``."""
        if self.users is None:
            return True  # one person's server: everyone who signed in is that person
        with self._lock:
            known, owner = session in self._stream_users, self._stream_users.get(session)
        return known and name is not None and owner == name and self.users.get(name) is not None

    def end_removed_sessions(self, tokens: dict) -> None:
        """End the page sessions (Gradio's tokens, to user names) of users no longer in the users file, or
        whose line in it changed (a new secret), once per new reading of it."""
        if self.users is None:
            return
        len(self.users)  # looks at the users file when that is due
        with self._lock:
            if self.users.generation == self._generation:
                return
            self._generation = self.users.generation
            listed, self._listed = self._listed, {user.name: user for user in self.users}
            changed = {name for name, user in listed.items() if self._listed.get(name) != user}
        ended = [token for token, name in list(tokens.items()) if name in changed or name not in self._listed]
        for token in ended:
            tokens.pop(token, None)
        if ended:
            logger.info("ended %d page sessions of users removed from the users file or given a new secret",
                        len(ended))

    # ------------------------------------------------------------------ which jobs

    def find(self, job_id: str | None, request) -> Job | None:
        """The job, when it exists and this request's user may see it."""
        job = self.store.find(job_id.strip()) if job_id and job_id.strip() else None
        if job is None or not may_see(self.user(request), job.submitter):
            return None
        return job

    def jobs(self, request, status: str | None = None, limit: int | None = None,
             batch: str | None = None) -> list[Job]:
        self.forget_deleted()
        return self.store.list(status=status, limit=limit, batch=batch,
                               submitter=submitter_filter(self.user(request)))

    def counts(self, request) -> dict[str, int]:
        return self.store.counts(submitter=submitter_filter(self.user(request)))

    # ------------------------------------------------------------------ files

    def served_paths(self) -> dict:
        """launch()'s allowed_paths and blocked_paths: nothing of the job store is served as it is (the
        page hands out copies, see :meth:`deliver`); the database is blocked even where Gradio's cache
        folder lies inside the outputs folder."""
        outputs = self.store.outputs_dir
        blocked = [str(self.store.database_path) + suffix for suffix in ("", "-wal", "-shm")]
        if not is_in_or_equal(get_upload_folder(), str(outputs)):
            blocked.append(str(outputs))
        return {"allowed_paths": [], "blocked_paths": blocked}

    def deliver(self, job: Job) -> str | None:
        """A path Gradio may serve for the job's video, named after its inputs (None until there is one)."""
        self.forget_deleted()
        return self.deliver_file(job.result_path, download_name(job), job.id)

    def deliver_file(self, source: Path, name: str, key_prefix: str = "") -> str | None:
        """A copy of ``source`` in Gradio's cache folder, called ``name``, in a folder of its own with an
        unguessable name; made once per file (again when the file changed). None when it is not there.
        ``key_prefix``: the job the file belongs to (its copies go when the job is deleted); "" for none."""
        if not source.is_file():
            return None
        key = (key_prefix, str(source), name)
        with self._lock:
            copy = self._delivered.get(key)
            if copy is not None and copy.is_file() and os.path.getmtime(copy) >= os.path.getmtime(source):
                return str(copy)
        folder = Path(get_upload_folder()) / f"heygem-{secrets.token_hex(16)}"
        folder.mkdir(parents=True, exist_ok=False)
        copy = folder / name
        try:
            os.link(source, copy)  # no second copy on disk where the cache is on the same file system
        except OSError:
            shutil.copyfile(source, copy)
        with self._lock:
            self._delivered[key] = copy
        return str(copy)

    def forget_deleted(self, every_seconds: float = SWEEP_SECONDS) -> None:
        """Remove the copies of jobs that no longer exist (deleted through REST, `python -m heygem jobs
        delete` or the store's cleaning, not on this page); at most once every ``every_seconds``."""
        now = time.monotonic()
        with self._lock:
            if now - self._swept < every_seconds:
                return
            self._swept = now
            job_ids = {key[0] for key in self._delivered if key[0]}
        for job_id in job_ids:
            if self.store.find(job_id) is None:
                self.forget(job_id)

    def forget(self, job_id: str) -> None:
        """Remove the copies handed out for a job (it was deleted)."""
        with self._lock:
            copies = [copy for key, copy in self._delivered.items() if key[0] == job_id]
            for key in [key for key in self._delivered if key[0] == job_id]:
                del self._delivered[key]
        for copy in copies:
            with contextlib.suppress(OSError):
                copy.unlink()
                copy.parent.rmdir()


class PageGuard:
    """ASGI middleware of the page's server (see the module's docstring), over ``access``."""

    def __init__(self, app, access: PageAccess):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        address = (scope.get("client") or (None,))[0]
        _client_address.set(address)  # for page_auth's check, run within this request
        server = scope.get("app")
        tokens = getattr(server, "tokens", None)
        if isinstance(tokens, dict):
            self.access.end_removed_sessions(tokens)
        path, method = scope["path"], scope["method"]
        refusal = None
        if method == "POST" and path.rstrip("/").endswith("/login"):
            wait = self.access.sign_ins.retry_after(address)
            if wait:
                refusal = JSONResponse({"detail": f"too many failed sign-ins: try again in {wait} s"},
                                       status_code=429, headers={"Retry-After": str(wait)})
        stream = STREAM_PATH.search(path)
        if stream is not None and getattr(server, "auth", None) is not None:
            cookies = HTTPConnection(scope).cookies
            cookie_id = getattr(server, "cookie_id", "")
            token = cookies.get(f"access-token-{cookie_id}") or cookies.get(f"access-token-unsecure-{cookie_id}")
            name = tokens.get(token) if isinstance(tokens, dict) and token else None
            if name is None:
                refusal = JSONResponse({"detail": "Not authenticated"}, status_code=401)
            elif not self.access.streams_to(stream["session"], name):
                refusal = JSONResponse({"detail": "Stream not found"}, status_code=404)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)
