"""The durable job store: jobs as rows of one SQLite database next to their folders.

States: ``queued -> running -> done | failed | cancelled``. A worker claims a
job inside one write transaction, so two workers (threads or processes) never
run the same job; it records its owner (host, pid, a per-process token), and
only that owner may move the job on. A job left ``running`` by a process that
no longer exists (a crash, ``kill -9``) goes back to ``queued`` when a worker
starts next, and runs again from the start.

The database (``outputs/jobs.db``) is in WAL mode with one connection per thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import shutil
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from heygem.config import Config, load_config
from heygem.errors import HeygemError
from heygem.jobs.files import (
    DATABASE_NAME,
    DEFAULT_OUTPUTS,
    LOG_NAME,
    OPTIONS_NAME,
    RESULT_NAME,
    SUMMARY_NAME,
    Upload,
    append_log,
    human_size,
    is_disk_full,
    note_uploads,
    remove_uploads,
    store_input,
    without_server_paths,
)
from heygem.jobs.limits import JobLimits, NotEnoughDisk, QueueFull
from heygem.jobs.request import check_options, check_speech, check_speed, finite_json
from heygem.media.probing import probe_inputs

logger = logging.getLogger("heygem")

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
STATUSES = (QUEUED, RUNNING, DONE, FAILED, CANCELLED)
FINISHED = (DONE, FAILED, CANCELLED)

FOREIGN_OWNER_STALE_SECONDS = 600  # a job owned by another host with no heartbeat for this long is requeued

_PROCESS_TOKEN = secrets.token_hex(4)  # tells this process from an earlier one that had the same pid

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    progress REAL NOT NULL DEFAULT 0,      -- 0..1, overall
    stage TEXT NOT NULL DEFAULT '',        -- the pipeline stage now running
    error TEXT,                            -- the user-facing message of a failure
    created REAL NOT NULL,                 -- unix seconds
    queued REAL NOT NULL,                  -- when it last entered the queue: the queue order
    started REAL,
    finished REAL,
    heartbeat REAL,                        -- last progress write while running
    face_name TEXT NOT NULL,               -- file name inside the job folder
    audio_name TEXT,                       -- NULL: use the face video's own audio
    options TEXT NOT NULL,                 -- JSON, flat dotted keys
    engine TEXT NOT NULL,                  -- as asked until done, then the engine that ran
    attempts INTEGER NOT NULL DEFAULT 0,
    owner TEXT,                            -- host:pid:token:worker while running
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    batch TEXT,                            -- batch id, when created by a batch
    label TEXT,                            -- the batch item's name
    item_key TEXT,                         -- hash of inputs and options, for resuming batches
    worker TEXT,                           -- the worker that claimed the last attempt (e.g. worker-1)
    device TEXT,                           -- the engine.device that attempt ran with (cuda:1, cpu, auto)
    submitter TEXT                         -- the user who submitted it (app.py --users); NULL: no user
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, queued, id);
CREATE INDEX IF NOT EXISTS jobs_by_batch ON jobs (batch);
CREATE INDEX IF NOT EXISTS jobs_by_item_key ON jobs (item_key);
"""
# Columns newer than the first release of the schema: added to an older jobs.db when it is opened.
_ADDED_COLUMNS = {"worker": "TEXT", "device": "TEXT", "submitter": "TEXT"}


@dataclass
class Job:
    """One row of the job store, plus where its files are."""

    id: str
    status: str
    progress: float
    stage: str
    error: str | None
    created: float
    queued: float
    started: float | None
    finished: float | None
    face_name: str
    audio_name: str | None
    options: dict
    engine: str
    attempts: int
    cancel_requested: bool
    batch: str | None
    label: str | None
    item_key: str | None
    owner: str | None
    worker: str | None  # the worker that claimed the last attempt
    device: str | None  # the engine.device the last attempt ran with
    submitter: str | None  # the user who submitted it (heygem.jobs.users); None: made without a user
    directory: Path
    jobs_ahead: int | None = None  # queued jobs that run before this one (None unless queued)
    summary: dict | None = field(default=None, repr=False)  # result.json, once done

    @property
    def face_path(self) -> Path:
        return self.directory / self.face_name

    @property
    def audio_path(self) -> Path:
        """The audio input; the face file itself when the job uses the video's own audio."""
        return self.directory / (self.audio_name or self.face_name)

    @property
    def result_path(self) -> Path:
        return self.directory / RESULT_NAME

    @property
    def summary_path(self) -> Path:
        return self.directory / SUMMARY_NAME

    @property
    def log_path(self) -> Path:
        return self.directory / LOG_NAME

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    @property
    def seconds(self) -> float | None:
        """Wall-clock seconds of the last attempt, once finished."""
        if self.started is None or self.finished is None:
            return None
        return self.finished - self.started

    def read_summary(self) -> dict | None:
        """The pipeline's result.json, or None when there is none (yet)."""
        if self.summary is None and self.status == DONE and self.summary_path.is_file():
            try:
                self.summary = json.loads(self.summary_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                self.summary = None
        return self.summary

    def to_dict(self) -> dict:
        """The JSON shape the REST API returns."""
        summary = self.read_summary() or {}
        return {
            "id": self.id,
            "status": self.status,
            "progress": round(self.progress, 4) if math.isfinite(self.progress) else 0.0,
            "stage": self.stage,
            "error": without_server_paths(self.error),
            "created": iso_time(self.created),
            "started": iso_time(self.started),
            "finished": iso_time(self.finished),
            "engine": self.engine,
            "queue_position": None if self.jobs_ahead is None else self.jobs_ahead + 1,
            "attempts": self.attempts,
            "face": self.face_name,
            "audio": self.audio_name,
            "options": finite_json(self.options),
            "batch": self.batch,
            "label": self.label,
            "worker": self.worker,
            "device": self.device,
            "submitter": self.submitter,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "seconds_per_stage": finite_json(summary.get("seconds_per_stage")),
            "warnings": list(summary.get("warnings") or []),  # what a job that worked should say
            "result": f"/api/jobs/{self.id}/result" if self.status == DONE else None,
            "stream": f"/api/jobs/{self.id}/stream.m3u8" if self.status in (RUNNING, DONE) else None,
        }


def iso_time(seconds: float | None) -> str | None:
    """Unix seconds as an ISO 8601 UTC timestamp, e.g. 2024-05-01T12:00:00Z."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def new_job_id() -> str:
    """Time-ordered and unique: 20240501-120000-3fa2c1."""
    return f"{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def process_owner(worker_name: str) -> str:
    """Who runs a job: host:pid:token:worker_name."""
    return f"{socket.gethostname()}:{os.getpid()}:{_PROCESS_TOKEN}:{worker_name}"


def owner_worker(owner: str) -> str:
    """The worker name at the end of an owner string (host:pid:token:worker-1 -> worker-1)."""
    return owner.split(":", 3)[-1]


def job_device(options: dict, worker_device: str | None) -> str:
    """The engine.device a job runs with: its own option when it names a device, else its worker's, else auto."""
    own = str(options.get("engine.device") or "auto")
    if own != "auto" or not worker_device:
        return own
    return worker_device


def _owner_is_gone(owner: str | None, heartbeat: float | None) -> bool:
    """Whether the worker that claimed a job can no longer finish it."""
    if not owner:
        return True
    host, _, rest = owner.partition(":")
    pid_text, _, rest = rest.partition(":")
    token = rest.partition(":")[0]
    if host != socket.gethostname():
        return heartbeat is None or time.time() - heartbeat > FOREIGN_OWNER_STALE_SECONDS
    if not pid_text.isdigit():
        return True
    pid = int(pid_text)
    if pid == os.getpid():
        return token != _PROCESS_TOKEN
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    with contextlib.suppress(OSError, IndexError):  # a zombie is as gone as a dead process
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "Z"
    return False


def _status_row(db, job_id: str):
    """The job's row (its status) inside a transaction; HeygemError when there is no such job."""
    row = db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if row is None:
        raise HeygemError(f"there is no job {job_id!r}")
    return row


class JobStore:
    """Jobs in ``outputs_dir``: create, read, cancel, retry, delete, clean.

    Safe to share between threads (each thread gets its own SQLite connection)
    and between processes on one machine (SQLite's locking; WAL mode lets
    readers work while a worker writes).
    """

    def __init__(self, outputs_dir: str | Path = DEFAULT_OUTPUTS, *, max_upload_bytes: int | None = None,
                 base_config: Config | None = None, limits: JobLimits | None = None,
                 upload_folder: Path | None = None):  # the page's copies of uploads: deleted with their job
        self.outputs_dir, self.upload_folder = Path(outputs_dir).resolve(), upload_folder
        self.limits = limits if limits is not None else JobLimits()
        self.outputs_dir.mkdir(parents=True, exist_ok=True)
        self.database_path = self.outputs_dir / DATABASE_NAME
        self.max_upload_bytes = max_upload_bytes
        self.base_config = base_config if base_config is not None else load_config()
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self.job_added = threading.Event()  # set when a job is queued in this process; workers wake up
        self._connect().executescript(_SCHEMA)
        self._add_missing_columns()

    # ------------------------------------------------------------------ connections

    def _connect(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = sqlite3.connect(self.database_path, timeout=60, isolation_level=None,
                                         check_same_thread=False)
            connection.row_factory = sqlite3.Row
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.execute("PRAGMA foreign_keys=ON")
            self._local.connection = connection
            with self._connections_lock:
                self._connections.append(connection)
        return connection

    def _add_missing_columns(self) -> None:
        """Bring a jobs.db made by an earlier version up to the current columns (new ones start empty)."""
        present = {row["name"] for row in self._connect().execute("PRAGMA table_info(jobs)")}
        if present.issuperset(_ADDED_COLUMNS):
            return
        with self._transaction() as db:  # checked again under the write lock: another process may have added them
            present = {row["name"] for row in db.execute("PRAGMA table_info(jobs)")}
            for name, kind in _ADDED_COLUMNS.items():
                if name not in present:
                    db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
                    logger.info("job store: added the column %s to %s", name, self.database_path)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction that takes the write lock at once (no upgrade deadlocks)."""
        db = self._connect()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        else:
            db.execute("COMMIT")

    def close(self) -> None:
        """Close every connection this store opened (call when no thread uses it any more)."""
        with self._connections_lock:
            for connection in self._connections:
                with contextlib.suppress(sqlite3.Error):
                    connection.close()
            self._connections.clear()
        self._local = threading.local()

    # ------------------------------------------------------------------ reading

    def _job_from_row(self, row: sqlite3.Row) -> Job:
        return Job(
            id=row["id"], status=row["status"], progress=row["progress"], stage=row["stage"],
            error=row["error"], created=row["created"], queued=row["queued"], started=row["started"],
            finished=row["finished"], face_name=row["face_name"], audio_name=row["audio_name"],
            options=json.loads(row["options"]), engine=row["engine"], attempts=row["attempts"],
            cancel_requested=bool(row["cancel_requested"]), batch=row["batch"], label=row["label"],
            item_key=row["item_key"], owner=row["owner"], worker=row["worker"], device=row["device"],
            submitter=row["submitter"], directory=self.outputs_dir / row["id"],
        )

    def get(self, job_id: str) -> Job:
        """The job, with its place in the queue; HeygemError when there is no such job."""
        db = self._connect()
        row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise HeygemError(f"there is no job {job_id!r}")
        job = self._job_from_row(row)
        if job.status == QUEUED:
            job.jobs_ahead = db.execute(
                "SELECT COUNT(*) FROM jobs WHERE status = ? AND (queued, id) < (?, ?)",
                (QUEUED, job.queued, job.id)).fetchone()[0]
        return job

    def find(self, job_id: str) -> Job | None:
        try:
            return self.get(job_id)
        except HeygemError:
            return None

    def list(self, status: str | None = None, batch: str | None = None, limit: int | None = None,
             submitter: str | None = None) -> list[Job]:
        """Jobs (of ``submitter``, if given), newest first; queued ones carry their place in the queue."""
        clauses, parameters = [], []
        if status is not None:
            if status not in STATUSES:
                raise HeygemError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
            clauses.append("status = ?")
            parameters.append(status)
        for column, value in (("batch", batch), ("submitter", submitter)):
            if value is not None:
                clauses.append(f"{column} = ?")
                parameters.append(value)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        query = f"SELECT * FROM jobs {where} ORDER BY created DESC, id DESC"
        if limit is not None:
            query += f" LIMIT {int(limit)}"
        db = self._connect()
        jobs = [self._job_from_row(row) for row in db.execute(query, parameters)]
        queue_order = [row[0] for row in db.execute(
            "SELECT id FROM jobs WHERE status = ? ORDER BY queued, id", (QUEUED,))]
        ahead = {job_id: index for index, job_id in enumerate(queue_order)}
        for job in jobs:
            job.jobs_ahead = ahead.get(job.id) if job.status == QUEUED else None
        return jobs

    def counts(self, submitter: str | None = None) -> dict[str, int]:
        """How many jobs (of ``submitter``, if given) are in each state."""
        rows = self._connect().execute("SELECT status, COUNT(*) FROM jobs WHERE ? IS NULL OR submitter = ? "
                                       "GROUP BY status", (submitter, submitter)).fetchall()
        counts = dict.fromkeys(STATUSES, 0)
        counts.update({row[0]: row[1] for row in rows})
        return counts

    def find_by_item_key(self, item_key: str) -> Job | None:
        """The most useful job with these inputs and options: done first, then queued or running."""
        rows = self._connect().execute(
            "SELECT id FROM jobs WHERE item_key = ? AND status IN (?, ?, ?) "
            "ORDER BY CASE status WHEN 'done' THEN 0 WHEN 'running' THEN 1 ELSE 2 END, created DESC",
            (item_key, DONE, RUNNING, QUEUED)).fetchall()
        for row in rows:
            job = self.find(row[0])
            if job is not None and (job.status != DONE or job.result_path.is_file()):
                return job
        return None

    # ------------------------------------------------------------------ creating

    def resolve_options(self, options: dict | None, remote: bool = False) -> tuple[dict, Config]:
        """Options as flat dotted keys plus the config they give, checked as heygem.jobs.request checks a
        request (``remote``: from a client of a server); HeygemError for unknown or bad ones."""
        return check_options(options, self.base_config, remote=remote, caps=self.limits.process_caps)

    def create_job(self, face: Path | str | Upload, audio: Path | str | Upload | None,
                   options: dict | None = None, *, batch: str | None = None, label: str | None = None,
                   item_key: str | None = None, text: str | None = None, voice: str | None = None,
                   speed: float = 1.0, remote: bool = False, submitter: str | None = None,
                   voice_sample: Path | str | Upload | None = None, voice_consent: bool = False) -> str:
        """Queue a generation and return its id.

        ``face`` is a video or photo, ``audio`` an audio file (or a video with
        sound), or None to use the face video's own audio. Both are copied into
        the job's folder first, so the caller may delete its copies at once.
        ``text`` instead of ``audio`` is spoken now (heygem.speech.tts, with ``voice`` and
        ``speed``) into the job's speech.wav, with its cues in speech.srt; the
        result then gets them as subtitles. ``remote``: the request comes from a client of a server
        (the page, gradio_client, REST), whose options are limited (heygem.jobs.request); ``submitter``:
        the user it belongs to (heygem.jobs.users). ``voice`` "clone" needs ``voice_consent`` and speaks
        in the voice of ``voice_sample`` (else of the face video's own sound). Unknown options, unreadable
        files, files over the upload limit and unusable text raise HeygemError here, before anything is queued.
        """
        check_speech(audio is not None, text, own_audio=audio is None and text is None)
        if text is not None:
            speed = check_speed(speed)
        flat_options, config = self.resolve_options(options, remote=remote)
        self._check_room()
        job_id = new_job_id()
        directory = self.outputs_dir / job_id
        directory.mkdir(parents=False, exist_ok=False)
        try:
            face_name = store_input(face, directory, "face", set(), self.max_upload_bytes)
            audio_name = None
            if audio is not None:
                audio_name = store_input(audio, directory, "audio", {face_name}, self.max_upload_bytes)
            elif text is not None:
                from heygem.jobs import speech

                max_characters = self.limits.max_text_characters
                if max_characters is None:
                    max_characters = config.text.max_characters
                sample_name = None if voice_sample is None else store_input(
                    voice_sample, directory, "voice_sample", {face_name}, self.max_upload_bytes)
                audio_name = speech.keep_text(directory, text, voice, speed, max_characters,
                                              self.limits.max_audio_seconds, voice_consent=voice_consent,
                                              voice_sample=sample_name, face_name=face_name)
            spoken_later = audio is None and text is not None  # by the worker (heygem.jobs.speech)
            face_info, audio_info = probe_inputs(directory / face_name, None if audio_name is None
                                                 else directory / audio_name, picture_only=spoken_later)
            self._check_size(face_info, audio_info, config)
            note_uploads(directory, [face, audio], self.upload_folder)
            (directory / OPTIONS_NAME).write_text(
                json.dumps(flat_options, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
            now = time.time()
            with self._transaction() as db:
                self._check_queue(db)  # counted again under the write lock: parallel submissions hold the limit
                db.execute(
                    "INSERT INTO jobs (id, status, created, queued, face_name, audio_name, options, engine, "
                    "batch, label, item_key, submitter) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (job_id, QUEUED, now, now, face_name, audio_name, json.dumps(flat_options, ensure_ascii=False),
                     config.engine.name, batch, label, item_key, submitter))
        except (OSError, sqlite3.OperationalError) as problem:
            shutil.rmtree(directory, ignore_errors=True)
            if is_disk_full(problem):
                raise NotEnoughDisk(f"the server's disk is full: the upload could not be stored ({problem}); try "
                                    "again once old jobs are cleaned") from None
            raise
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        append_log(directory, f"queued: face {face_name!r}, audio {audio_name or 'from the face video'!r}, "
                              f"options {json.dumps(flat_options, ensure_ascii=False)}")
        logger.info("job %s queued", job_id)
        self.job_added.set()
        return job_id

    def _check_room(self) -> None:
        """Refuse a job while the queue is full or the disk is short (nothing is written then)."""
        self._check_disk()
        self._check_queue(self._connect())

    def _check_disk(self) -> None:
        """NotEnoughDisk when the outputs folder's disk has less free space than min_free_bytes."""
        needed = self.limits.min_free_bytes
        if needed is not None and (free := shutil.disk_usage(self.outputs_dir).free) < needed:
            raise NotEnoughDisk(f"the server's disk is nearly full ({human_size(free)} free, a job needs "
                                f"{human_size(needed)}); try again once old jobs are cleaned")

    def _check_queue(self, db: sqlite3.Connection) -> None:
        """QueueFull when max_queued jobs wait (in create_job's insert transaction: parallel submissions hold it)."""
        limit = self.limits.max_queued
        if limit is None:
            return
        waiting = db.execute("SELECT COUNT(*) FROM jobs WHERE status = ?", (QUEUED,)).fetchone()[0]
        if waiting >= limit:
            raise QueueFull(f"{waiting} jobs are already waiting (the limit is {limit}); try again in a minute",
                            retry_after=60)

    def _check_size(self, face_info, audio_info, config: Config) -> None:
        """Refuse speech longer, or frames taller, than the limits allow."""
        limits = self.limits
        seconds = 0.0 if audio_info is None else audio_info.audio_duration or audio_info.duration
        if limits.max_audio_seconds is not None and seconds > limits.max_audio_seconds:
            raise HeygemError(f"the speech lasts {seconds:.1f} s; this server takes at most "
                              f"{limits.max_audio_seconds:g} s per job")
        height = config.media.output_height or face_info.height
        if limits.max_output_height is not None and height > limits.max_output_height:
            raise HeygemError(f"the output would be {height} pixels tall; this server makes at most "
                              f"{limits.max_output_height}: set media.output_height to {limits.max_output_height} "
                              "or less")
        width = round(face_info.width * height / max(face_info.height, 1))
        max_width = None if limits.max_output_height is None else limits.max_output_height * 16 // 9
        if max_width is not None and width > max_width:
            raise HeygemError(f"the output would be {width} pixels wide; this server makes at most {max_width} "
                              "(16:9 of its tallest output): crop or scale the face picture down")

    # ------------------------------------------------------------------ changing

    def cancel(self, job_id: str) -> Job:
        """Cancel a queued job at once, or ask a running one to stop; finished jobs are left as they are."""
        with self._transaction() as db:
            row = _status_row(db, job_id)
            if row["status"] == QUEUED:
                db.execute("UPDATE jobs SET status = ?, finished = ?, stage = '' WHERE id = ?",
                           (CANCELLED, time.time(), job_id))
            elif row["status"] == RUNNING:
                db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
        if row["status"] in (QUEUED, RUNNING):
            append_log(self.outputs_dir / job_id, "cancel requested")
            logger.info("job %s: cancel requested", job_id)
        return self.get(job_id)

    def retry(self, job_id: str) -> Job:
        """Queue a failed or cancelled job again, at the back of the queue, admitted as create_job admits one."""
        self._check_disk()
        with self._transaction() as db:
            row = _status_row(db, job_id)
            if row["status"] not in (FAILED, CANCELLED):
                raise HeygemError(f"job {job_id} is {row['status']}; only failed or cancelled jobs can be retried")
            self._check_queue(db)
            db.execute(
                "UPDATE jobs SET status = ?, queued = ?, progress = 0, stage = '', error = NULL, started = NULL, "
                "finished = NULL, owner = NULL, worker = NULL, device = NULL, cancel_requested = 0 WHERE id = ?",
                (QUEUED, time.time(), job_id))
        append_log(self.outputs_dir / job_id, "queued again (retry)")
        self.job_added.set()
        return self.get(job_id)

    def delete(self, job_id: str) -> None:
        """Remove a job that is not running, with its folder and the page's copies of its uploads."""
        with self._transaction() as db:
            row = _status_row(db, job_id)
            if row["status"] == RUNNING:
                raise HeygemError(f"job {job_id} is running: cancel it first")
            db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        remove_uploads(self.outputs_dir / job_id, self.upload_folder)
        shutil.rmtree(self.outputs_dir / job_id, ignore_errors=True)
        logger.info("job %s deleted", job_id)

    def clean(self, older_than_seconds: float) -> list[str]:
        """Delete finished jobs (done, failed, cancelled) that finished more than this long ago."""
        cutoff = time.time() - older_than_seconds
        rows = self._connect().execute(
            "SELECT id FROM jobs WHERE status IN (?, ?, ?) AND COALESCE(finished, created) < ?",
            (*FINISHED, cutoff)).fetchall()
        removed = []
        for row in rows:
            with contextlib.suppress(HeygemError):
                self.delete(row["id"])
                removed.append(row["id"])
        for archive in (self.outputs_dir / "batches").glob("*.zip"):  # the web app's batch downloads
            with contextlib.suppress(OSError):
                if archive.stat().st_mtime < cutoff:
                    archive.unlink()
        return removed

    def set_batch(self, job_id: str, batch: str, label: str) -> None:
        """Make an existing job part of a batch (a rerun of a batch adopting its earlier jobs)."""
        with self._transaction() as db:
            db.execute("UPDATE jobs SET batch = ?, label = ? WHERE id = ?", (batch, label, job_id))

    # ------------------------------------------------------------------ for workers

    def claim_next(self, owner: str, batch: str | None = None, *, device: str | None = None) -> Job | None:
        """Move the oldest queued job (of ``batch``, if given) to running for ``owner``.

        ``device`` is the claiming worker's device (None: auto); the job records
        the device it will run with (see :func:`job_device`) and the worker's name.
        """
        with self._transaction() as db:
            if batch is None:
                row = db.execute("SELECT id, options FROM jobs WHERE status = ? ORDER BY queued, id LIMIT 1",
                                 (QUEUED,)).fetchone()
            else:
                row = db.execute("SELECT id, options FROM jobs WHERE status = ? AND batch = ? "
                                 "ORDER BY queued, id LIMIT 1", (QUEUED, batch)).fetchone()
            if row is None:
                return None
            now = time.time()
            db.execute(
                "UPDATE jobs SET status = ?, started = ?, heartbeat = ?, finished = NULL, owner = ?, "
                "attempts = attempts + 1, progress = 0, stage = 'starting', error = NULL, worker = ?, device = ? "
                "WHERE id = ?",
                (RUNNING, now, now, owner, owner_worker(owner), job_device(json.loads(row["options"]), device),
                 row["id"]))
        return self.get(row["id"])

    def report_progress(self, job_id: str, owner: str, stage: str, fraction: float) -> None:
        fraction = min(max(float(fraction), 0.0), 1.0)
        with self._transaction() as db:
            db.execute("UPDATE jobs SET progress = ?, stage = ?, heartbeat = ? WHERE id = ? AND owner = ? "
                       "AND status = ?", (fraction, stage, time.time(), job_id, owner, RUNNING))

    def should_stop(self, job_id: str, owner: str) -> bool:
        """True when the job was cancelled, deleted or taken over by another worker."""
        row = self._connect().execute("SELECT status, owner, cancel_requested FROM jobs WHERE id = ?",
                                      (job_id,)).fetchone()
        return row is None or row["status"] != RUNNING or row["owner"] != owner or bool(row["cancel_requested"])

    def finish(self, job_id: str, owner: str, status: str, *, error: str | None = None,
               engine: str | None = None) -> bool:
        """Record how a run ended; False when this owner no longer holds the job."""
        assert status in FINISHED
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE jobs SET status = ?, error = ?, finished = ?, engine = COALESCE(?, engine), "
                "progress = CASE WHEN ? = 'done' THEN 1 ELSE progress END, "
                "stage = CASE WHEN ? = 'done' THEN 'done' ELSE stage END, owner = NULL "
                "WHERE id = ? AND owner = ? AND status = ?",
                (status, error, time.time(), engine, status, status, job_id, owner, RUNNING))
            return cursor.rowcount == 1

    def recover_interrupted(self) -> list[str]:
        """Requeue jobs left running by a process that is gone; return their ids.

        A job whose cancellation had been asked for is marked cancelled instead.
        """
        rows = self._connect().execute("SELECT id, owner, heartbeat, cancel_requested FROM jobs WHERE status = ?",
                                       (RUNNING,)).fetchall()
        recovered = []
        for row in rows:
            if not _owner_is_gone(row["owner"], row["heartbeat"]):
                continue
            with self._transaction() as db:
                if row["cancel_requested"]:
                    cursor = db.execute(
                        "UPDATE jobs SET status = ?, finished = ?, owner = NULL WHERE id = ? AND owner IS ? "
                        "AND status = ?", (CANCELLED, time.time(), row["id"], row["owner"], RUNNING))
                else:
                    cursor = db.execute(
                        "UPDATE jobs SET status = ?, progress = 0, stage = '', started = NULL, owner = NULL, "
                        "worker = NULL, device = NULL, error = NULL WHERE id = ? AND owner IS ? AND status = ?",
                        (QUEUED, row["id"], row["owner"], RUNNING))
            if cursor.rowcount == 1:
                recovered.append(row["id"])
                append_log(self.outputs_dir / row["id"], "interrupted (the process running it stopped); "
                           + ("cancelled" if row["cancel_requested"] else "queued again to run from the start"))
                logger.warning("job %s was interrupted; %s", row["id"],
                               "cancelled" if row["cancel_requested"] else "queued again")
        if recovered:
            self.job_added.set()
        return recovered
