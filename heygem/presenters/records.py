"""Presenter records: a row of the job store's database (``outputs/jobs.db``, table ``presenters``)
and a folder beside the jobs::

    outputs/presenters/<id>/<clip name>     the clip or photo as uploaded, name sanitised
    outputs/presenters/<id>/thumbnail.jpg   a frame with the face box and the mouth region drawn
    outputs/presenters/<id>/speech.wav      the cleanest 5-30 s of the clip's own speech (none if silent)
    outputs/presenters/<id>/track/          the clip's whole face track (heygem.presenters.prepare)

States: ``preparing -> ready | failed``. A presenter is made in a folder whose name starts with a dot
and renamed into place once its clip passed the checks, so a refused one leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shutil
import sqlite3
import time
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from heygem.errors import HeygemError
from heygem.jobs.files import DATABASE_NAME, Upload, store_input
from heygem.jobs.store import iso_time

PREPARING, READY, FAILED = "preparing", "ready", "failed"
FOLDER_NAME = "presenters"
THUMBNAIL_NAME, SAMPLE_NAME, TRACK_FOLDER = "thumbnail.jpg", "speech.wav", "track"
MAX_NAME_CHARACTERS = 80
DEFAULT_MAX_SECONDS = 600.0  # the longest clip a presenter may be made from (--max-presenter-seconds)
ID_PATTERN = re.compile(r"^p-[0-9]{8}-[0-9]{6}-[0-9a-f]{6}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS presenters (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    submitter TEXT,                        -- the user who made it (app.py --users); NULL: no user
    status TEXT NOT NULL,                  -- preparing, ready, failed
    progress REAL NOT NULL DEFAULT 0,      -- 0..1 of the preparation
    error TEXT,                            -- why the preparation failed
    created REAL NOT NULL,
    clip_name TEXT NOT NULL,               -- file name inside the presenter's folder
    kind TEXT NOT NULL,                    -- video or image
    face_index INTEGER,                    -- which face speaks, counted from the left; NULL: the only one
    seconds REAL NOT NULL,                 -- the clip's length (0 for a photo)
    width INTEGER NOT NULL,
    height INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    warnings TEXT NOT NULL DEFAULT '[]',   -- JSON list of the checks' warnings
    speech_seconds REAL,                   -- length of speech.wav; NULL: none
    prepared TEXT NOT NULL DEFAULT '[]'    -- JSON list of what was prepared once: "track", "musetalk latents"
);
CREATE INDEX IF NOT EXISTS presenters_by_submitter ON presenters (submitter, created);
CREATE UNIQUE INDEX IF NOT EXISTS presenters_by_name ON presenters (COALESCE(submitter, ''), name);
"""
_ADDED_COLUMNS = {"prepared": "TEXT NOT NULL DEFAULT '[]'"}  # columns a presenters table made earlier lacks


@dataclass
class Presenter:
    """One row of the presenters table, plus where its files are."""

    id: str
    name: str
    submitter: str | None
    status: str
    progress: float
    error: str | None
    created: float
    clip_name: str
    kind: str
    face_index: int | None
    seconds: float
    width: int
    height: int
    bytes: int
    warnings: list[str] = field(default_factory=list)
    speech_seconds: float | None = None
    prepared: list[str] = field(default_factory=list)  # what was prepared once: "track", "musetalk latents"
    directory: Path = Path()

    @property
    def clip_path(self) -> Path:
        return self.directory / self.clip_name

    @property
    def thumbnail_path(self) -> Path:
        return self.directory / THUMBNAIL_NAME

    @property
    def sample_path(self) -> Path | None:
        """The speech sample, when the clip had enough speech for one."""
        return self.directory / SAMPLE_NAME if self.speech_seconds else None

    @property
    def track_dir(self) -> Path:
        return self.directory / TRACK_FOLDER

    def to_dict(self) -> dict:
        """The JSON shape the REST API returns."""
        ready = self.status == READY
        return {
            "id": self.id, "name": self.name, "status": self.status, "progress": round(self.progress, 4),
            "error": self.error, "created": iso_time(self.created), "kind": self.kind,
            "face_index": self.face_index, "seconds": round(self.seconds, 3),
            "size": {"width": self.width, "height": self.height}, "bytes": self.bytes,
            "warnings": list(self.warnings), "submitter": self.submitter,
            "speech_sample_seconds": None if self.speech_seconds is None else round(self.speech_seconds, 2),
            "prepared": list(self.prepared),
            "thumbnail": f"/api/presenters/{self.id}/thumbnail" if ready and self.thumbnail_path.is_file() else None,
        }


def new_presenter_id() -> str:
    """Time-ordered and unique, told from a job id by its prefix: p-20240501-120000-3fa2c1."""
    return f"p-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def check_name(name: str | None) -> str:
    """The presenter's name as kept: trimmed; HeygemError when empty, too long or with control characters."""
    name = unicodedata.normalize("NFC", (name or "")).strip()
    if not name:
        raise HeygemError("give the presenter a name")
    if len(name) > MAX_NAME_CHARACTERS:
        raise HeygemError(f"a presenter's name has at most {MAX_NAME_CHARACTERS} characters")
    if any(ord(character) < 32 or ord(character) == 127 for character in name):
        raise HeygemError("a presenter's name has no control characters (such as a line break)")
    return name


class PresenterStore:
    """Presenters of one outputs folder: the same database file as its jobs, a folder each.

    Each call opens its own SQLite connection, so the store is safe to share between threads.
    """

    def __init__(self, outputs_dir: str | Path, *, max_seconds: float | None = DEFAULT_MAX_SECONDS,
                 max_upload_bytes: int | None = None):
        self.outputs_dir = Path(outputs_dir).resolve()
        self.folder = self.outputs_dir / FOLDER_NAME  # made with the first presenter
        self.outputs_dir.mkdir(parents=True, exist_ok=True)
        self.database_path = self.outputs_dir / DATABASE_NAME
        self.max_seconds = max_seconds
        self.max_upload_bytes = max_upload_bytes
        with self._connection() as db:
            db.executescript(_SCHEMA)
            present = {row["name"] for row in db.execute("PRAGMA table_info(presenters)")}
            for name, kind in _ADDED_COLUMNS.items():
                if name not in present:
                    with contextlib.suppress(sqlite3.OperationalError):  # added meanwhile by another process
                        db.execute(f"ALTER TABLE presenters ADD COLUMN {name} {kind}")

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.database_path, timeout=60, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            yield db
        finally:
            db.close()

    def _from_row(self, row: sqlite3.Row) -> Presenter:
        return Presenter(
            id=row["id"], name=row["name"], submitter=row["submitter"], status=row["status"],
            progress=row["progress"], error=row["error"], created=row["created"], clip_name=row["clip_name"],
            kind=row["kind"], face_index=row["face_index"], seconds=row["seconds"], width=row["width"],
            height=row["height"], bytes=row["bytes"], warnings=json.loads(row["warnings"]),
            speech_seconds=row["speech_seconds"], prepared=json.loads(row["prepared"]),
            directory=self.folder / row["id"])

    # ------------------------------------------------------------------ reading

    def get(self, presenter_id: str) -> Presenter | None:
        if not ID_PATTERN.match(presenter_id or ""):
            return None
        with self._connection() as db:
            row = db.execute("SELECT * FROM presenters WHERE id = ?", (presenter_id,)).fetchone()
        return None if row is None else self._from_row(row)

    def list(self, submitter: str | None = None, every_user: bool = True) -> list[Presenter]:
        """Presenters, newest first: every user's, or with ``every_user`` false only ``submitter``'s."""
        with self._connection() as db:
            if every_user:
                rows = db.execute("SELECT * FROM presenters ORDER BY created DESC, id DESC").fetchall()
            else:
                rows = db.execute("SELECT * FROM presenters WHERE submitter IS ? ORDER BY created DESC, id DESC",
                                  (submitter,)).fetchall()
        return [self._from_row(row) for row in rows]

    def find(self, id_or_name: str, submitter: str | None = None, every_user: bool = True) -> Presenter:
        """The presenter with this id, or else this name, among those the caller may see; HeygemError
        when there is none (the same answer for another user's, so their ids do not leak) or the name is
        taken by several (an admin seeing every user's)."""
        visible = self.list(submitter, every_user)
        for presenter in visible:
            if presenter.id == id_or_name:
                return presenter
        named = [presenter for presenter in visible if presenter.name == (id_or_name or "").strip()]
        if len(named) == 1:
            return named[0]
        if named:
            raise HeygemError(f"{len(named)} presenters are named {id_or_name!r}: name one by its id "
                              f"({', '.join(presenter.id for presenter in named)})")
        raise HeygemError(f"there is no presenter {id_or_name!r} (python -m heygem presenters list shows them)")

    # ------------------------------------------------------------------ changing

    def create(self, source: Path | str | Upload, name: str, face_index: int | None = None,
               submitter: str | None = None, look=None) -> Presenter:
        """Store the clip and record a presenter that is ``preparing``, once the clip passed the quick
        checks (``look(clip_path, face_index, max_seconds) -> checks.Look``, heygem.presenters.checks.look
        by default). A refused clip raises HeygemError and leaves nothing behind."""
        from heygem.presenters import checks

        look = look or checks.look
        name = check_name(name)
        if face_index is not None and (not isinstance(face_index, int) or face_index < 0 or face_index > 1000):
            raise HeygemError("face_index counts faces from the left from 0: give 0 to 1000")
        if any(presenter.name == name for presenter in self.list(submitter, every_user=False)):
            raise HeygemError(f"you already have a presenter named {name!r}: remove it first or choose another name")
        presenter_id = new_presenter_id()
        staging = self.folder / f".{presenter_id}.partial"
        self.folder.mkdir(exist_ok=True)
        staging.mkdir()
        try:
            clip_name = store_input(source, staging, "face", {THUMBNAIL_NAME, SAMPLE_NAME, TRACK_FOLDER},
                                    self.max_upload_bytes)
            seen = look(staging / clip_name, face_index, self.max_seconds)
            info = seen.info
            row = (presenter_id, name, submitter, PREPARING, time.time(), clip_name, info.kind, face_index,
                   info.duration if info.kind == "video" else 0.0, info.width, info.height,
                   (staging / clip_name).stat().st_size, json.dumps(seen.warnings, ensure_ascii=False))
            staging.rename(self.folder / presenter_id)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        try:
            with self._connection() as db:
                db.execute("INSERT INTO presenters (id, name, submitter, status, created, clip_name, kind, "
                           "face_index, seconds, width, height, bytes, warnings) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
        except sqlite3.IntegrityError:  # the same name, made meanwhile by a parallel request
            shutil.rmtree(self.folder / presenter_id, ignore_errors=True)
            raise HeygemError(f"you already have a presenter named {name!r}: remove it first or choose another "
                              "name") from None
        except BaseException:
            shutil.rmtree(self.folder / presenter_id, ignore_errors=True)
            raise
        return self.get(presenter_id)

    def report_progress(self, presenter_id: str, fraction: float) -> None:
        with self._connection() as db:
            db.execute("UPDATE presenters SET progress = ? WHERE id = ? AND status = ?",
                       (min(max(float(fraction), 0.0), 1.0), presenter_id, PREPARING))

    def mark_ready(self, presenter_id: str, warnings: list[str], speech_seconds: float | None,
                   prepared: list[str] | None = None) -> None:
        with self._connection() as db:
            db.execute("UPDATE presenters SET status = ?, progress = 1, error = NULL, warnings = ?, "
                       "speech_seconds = ?, prepared = ? WHERE id = ?",
                       (READY, json.dumps(warnings, ensure_ascii=False), speech_seconds,
                        json.dumps(prepared or []), presenter_id))

    def mark_failed(self, presenter_id: str, error: str) -> None:
        """Record why the preparation failed; the clip and whatever was made from it are deleted first, so
        a presenter seen as failed has no files left."""
        shutil.rmtree(self.folder / presenter_id, ignore_errors=True)
        with self._connection() as db:
            db.execute("UPDATE presenters SET status = ?, error = ? WHERE id = ?", (FAILED, error, presenter_id))

    def remove(self, presenter_id: str) -> None:
        """Delete the presenter's record and folder (its entry in the avatar cache ages out with the cache)."""
        with self._connection() as db:
            db.execute("DELETE FROM presenters WHERE id = ?", (presenter_id,))
        doomed = self.folder / f".{presenter_id}.{secrets.token_hex(4)}.removed"
        with contextlib.suppress(OSError):
            (self.folder / presenter_id).rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def preparing(self) -> list[Presenter]:
        """Presenters whose preparation has not ended (one interrupted by a stop starts again)."""
        with self._connection() as db:
            rows = db.execute("SELECT * FROM presenters WHERE status = ? ORDER BY created", (PREPARING,)).fetchall()
        return [self._from_row(row) for row in rows]
