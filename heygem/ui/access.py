"""Who uses the page and what they may reach: the signed-in user (Gradio's login, checked against
``--users``), the jobs they see (their own; an admin every job), and the files that leave the server.

The job folders are never served as they are: Gradio's ``/gradio_api/file=`` refuses every path under
``--outputs``, and a job's video goes to the browser as a copy in Gradio's cache folder (a hard link
where the disk allows), in a folder of its own with an unguessable name and the name the download
should have (``<face>-<speech>.mp4``). So one user cannot fetch another's files by their paths, and no
server path of a job shows on the page. Without ``--users`` (one person's server, with or without
``--auth``) everyone who signs in is that one person and sees every job.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gradio.utils import get_upload_folder, is_in_or_equal

from heygem.errors import HeygemError
from heygem.jobs.files import download_name
from heygem.jobs.store import Job, JobStore
from heygem.jobs.users import User, Users, may_see, sees_every_job, submitter_filter

NOBODY = User(name="", admin=False)  # a request without a known user sees no job
SWEEP_SECONDS = 30.0  # how often the page looks for copies of jobs deleted elsewhere


class PageAccess:
    """The page's access rules over ``store``: ``users`` None is a server for one person."""

    def __init__(self, store: JobStore, users: Users | None = None):
        self.store, self.users = store, users
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

    def page_auth(self, shared: tuple[str, str] | None) -> Callable[[str, str], bool] | tuple[str, str] | None:
        """What launch(auth=...) takes: the users' check, else the one shared name and password (or none)."""
        if self.users is None:
            return shared
        users = self.users
        return lambda name, password: users.check_password(name, password) is not None

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
