"""Where a job's files live and how they are named.

Layout on disk (``outputs/`` by default)::

    outputs/jobs.db                 the job store (SQLite)
    outputs/<job_id>/<face name>    the inputs as uploaded, names sanitised
    outputs/<job_id>/options.json   the options the job was submitted with
    outputs/<job_id>/job.log        what happened, attempt by attempt
    outputs/<job_id>/result.mp4     the video, once done
    outputs/<job_id>/result.json    the pipeline's summary (seconds per stage, ...)
    outputs/<job_id>/result.hls/    the stream, published while the job is encoded (heygem.media.stream)

Input names keep what the user will recognise but can never leave the job's
folder or take the name of a file the job itself writes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sqlite3
import unicodedata
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

from heygem.config import REPO_ROOT
from heygem.errors import HeygemError
from heygem.media.probing import check_regular_file
from heygem.runtime.workdir import WORK_DIR_VARIABLE, sweep_work_dirs

DEFAULT_OUTPUTS = Path(os.environ.get("HEYGEM_OUTPUTS", REPO_ROOT / "outputs"))
DATABASE_NAME = "jobs.db"

RESULT_NAME, SUMMARY_NAME, OPTIONS_NAME, LOG_NAME = "result.mp4", "result.json", "options.json", "job.log"
SPEECH_NAME, SUBTITLES_NAME = "speech.wav", "speech.srt"  # a job made from text: its speech and the cues
TEXT_NAME = "speech.json"  # a job made from text: its words, voice and speed, until its worker speaks them
UPLOADS_NAME = "uploads.json"  # the server's copies of the client's uploads (the page's), removed with the job
RESULT_SUBTITLES_NAME = "result.srt"
RESULT_STREAM_NAME = "result.hls"  # the folder of the stream published while the job is encoded
RESERVED_NAMES = {RESULT_NAME, SUMMARY_NAME, OPTIONS_NAME, LOG_NAME, DATABASE_NAME, SPEECH_NAME, SUBTITLES_NAME,
                  TEXT_NAME, UPLOADS_NAME, RESULT_SUBTITLES_NAME, RESULT_STREAM_NAME}
MAX_NAME_BYTES = 120  # longest sanitised input file name, in UTF-8 bytes


class UploadTooLarge(HeygemError):
    """An input file is larger than the configured upload limit."""


@dataclass(frozen=True)
class Upload:
    """An input that arrives as a stream (an HTTP upload) rather than a file on disk."""

    name: str  # the file name the client sent; sanitised before use
    stream: BinaryIO


def sanitize_filename(name: str, fallback: str) -> str:
    """A safe file name that keeps what the user will recognise.

    Keeps letters and digits of any script, spaces, dots, dashes and
    underscores; drops any folder part; never starts or ends with a dot or a
    space; at most ``MAX_NAME_BYTES`` bytes with the suffix kept.
    """
    name = unicodedata.normalize("NFC", name or "").replace("\\", "/").rsplit("/", 1)[-1]
    name = re.sub(r"[^\w.\- ]+", "_", name)
    name = re.sub(r"\s+", " ", name).strip(" .")
    if not name or not re.search(r"[^._\- ]", name):
        name = fallback
    stem, dot, suffix = name.rpartition(".")
    if not dot or not stem:
        stem, suffix = name, ""
    suffix = suffix[:16]
    while len((stem + "." + suffix).encode("utf-8")) > MAX_NAME_BYTES and len(stem) > 1:
        stem = stem[:-1]
    return f"{stem}.{suffix}" if suffix else stem


def keep_server_files_under(outputs_dir: Path) -> dict[str, str]:
    """Point the files a server keeps besides its jobs into ``outputs_dir``: the avatar cache
    (``avatar-cache/``, $HEYGEM_CACHE_DIR), the voices optimised for this machine (``voice-cache/``,
    $HEYGEM_VOICE_CACHE), the jobs' work folders (``tmp/``, $HEYGEM_WORK_DIR; those of processes that are
    gone are removed now) and Gradio's copies of uploads and results (``gradio-temp/``, $GRADIO_TEMP_DIR),
    unless the environment already names a place for them. Call it before gradio is imported (Gradio
    reads its folder then). Returns the variables it set."""
    outputs_dir = Path(outputs_dir).resolve()
    wanted = {"HEYGEM_CACHE_DIR": outputs_dir / "avatar-cache", "HEYGEM_VOICE_CACHE": outputs_dir / "voice-cache",
              WORK_DIR_VARIABLE: outputs_dir / "tmp", "GRADIO_TEMP_DIR": outputs_dir / "gradio-temp"}
    chosen = {}
    for name, folder in wanted.items():
        if not os.environ.get(name):
            folder.mkdir(parents=True, exist_ok=True)
            os.environ[name] = chosen[name] = str(folder)
    sweep_work_dirs(Path(os.environ[WORK_DIR_VARIABLE]))  # left by a server killed mid-job
    return chosen


# An absolute path in a message: folders, then a last part that may be empty (a folder's trailing slash).
_ABSOLUTE_PATH = re.compile(r"(?<![\w.\-/])/(?:[^\s'\"/:;,()<>]+/)+(?P<name>[^\s'\"/:;,()<>]*)")


def without_server_paths(text: str | None, folders: dict[Path, str] | None = None,
                         every_path: bool = True) -> str | None:
    """``text`` (a message for a client of the server) without the server's absolute paths: each of
    ``folders`` written as its short name (longest first); with ``every_path``, any other path as its
    last part too. A path is one whose first folder exists here (/srv/..., /tmp/...), so /api/jobs/ID
    stays as it is. An answer to a request (which may quote the client's own words) passes
    ``every_path=False``; a job's error (the server's words) does not."""
    if not text:
        return text
    for folder in sorted(folders or {}, key=lambda path: len(str(path)), reverse=True):
        text = text.replace(str(folder), folders[folder])
    if not every_path:
        return text

    def shorten(match: re.Match) -> str:
        path = match.group(0)
        if not Path("/", path.split("/")[1]).exists():
            return path
        return match.group("name") or Path(path).name

    return _ABSOLUTE_PATH.sub(shorten, text)


def server_folders(outputs_dir: Path) -> dict[Path, str]:
    """The server's own folders as a client reads them: its outputs, its weights, the checkout it runs
    from, and the page's copies of uploads ($GRADIO_TEMP_DIR)."""
    from heygem.weights import weights_dir

    folders = {Path(outputs_dir).resolve(): "outputs", weights_dir().resolve(): "weights", REPO_ROOT: "heygem"}
    if os.environ.get("GRADIO_TEMP_DIR"):
        folders[Path(os.environ["GRADIO_TEMP_DIR"]).resolve()] = "uploads"
    return folders


def is_disk_full(problem: BaseException) -> bool:
    """Whether a write failed for want of space (a full disk, a quota, a file size limit)."""
    if isinstance(problem, sqlite3.OperationalError):
        return "full" in str(problem)  # "database or disk is full"
    return getattr(problem, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def human_size(size: float) -> str:
    """1536 -> '1.5 kB', 734003200 -> '700 MB' (binary units, as upload limits are given)."""
    for unit in ("bytes", "kB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "bytes" or size >= 10 else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.0f} GB"


def _copy_limited(stream: BinaryIO, destination: Path, max_bytes: int | None, shown_name: str) -> None:
    total = 0
    with open(destination, "xb") as output:
        while chunk := stream.read(1 << 20):
            total += len(chunk)
            if max_bytes is not None and total > max_bytes:
                raise UploadTooLarge(f"{shown_name} is larger than the upload limit of {human_size(max_bytes)}")
            output.write(chunk)
    if total == 0:
        raise HeygemError(f"{shown_name} is empty")


def append_log(directory: Path, message: str) -> None:
    """Add one timestamped line to the job folder's job.log."""
    with contextlib.suppress(OSError):
        with open(directory / LOG_NAME, "a", encoding="utf-8") as log:
            log.write(f"{datetime.now():%Y-%m-%d %H:%M:%S} {message}\n")


def store_input(source: Path | str | Upload, directory: Path, role: str, taken: set[str],
                max_bytes: int | None = None) -> str:
    """Copy one input into the job folder under its sanitised name; return that name.

    ``role`` ("face" or "audio") names the file when nothing usable is left of
    its own name; a name the job writes itself, or one in ``taken``, gets the
    role as a prefix.
    """
    if isinstance(source, Upload):
        original_name, stream, close = source.name, source.stream, False
    else:
        path = Path(source)
        check_regular_file(path, f"{role} file")
        original_name, stream, close = path.name, open(path, "rb"), True
    name = sanitize_filename(original_name, fallback=role)
    if name in RESERVED_NAMES or name in taken:
        name = sanitize_filename(f"{role}-{name}", fallback=role)
    try:
        _copy_limited(stream, directory / name, max_bytes, original_name or role)
    finally:
        if close:
            stream.close()
    return name


def note_uploads(directory: Path, sources: list, upload_folder: Path | None) -> None:
    """Write the job folder's list of its inputs that are the server's copies of a client's uploads
    (files in ``upload_folder``, Gradio's), so that :func:`remove_uploads` takes them with the job."""
    if upload_folder is None:
        return
    folder = Path(upload_folder).resolve()
    copies = [str(Path(source).resolve()) for source in sources if isinstance(source, (str, Path))
              and Path(source).resolve().is_relative_to(folder)]
    if copies:
        (directory / UPLOADS_NAME).write_text(json.dumps(copies) + "\n", encoding="utf-8")


def remove_uploads(directory: Path, upload_folder: Path | None) -> None:
    """Remove the uploads :func:`note_uploads` listed for a job (only files inside ``upload_folder``), and
    the folders Gradio made for them when they are left empty."""
    listed = directory / UPLOADS_NAME
    if upload_folder is None or not listed.is_file():
        return
    folder = Path(upload_folder).resolve()
    with contextlib.suppress(OSError, ValueError):
        for name in json.loads(listed.read_text(encoding="utf-8")):
            path = Path(name).resolve()
            if path.is_relative_to(folder) and path != folder:
                path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # not empty: another upload is there too
                    if path.parent != folder:
                        path.parent.rmdir()


def download_name(job) -> str:
    """What a job's video (heygem.jobs.store.Job) is called when it is downloaded, from the page or
    REST: the batch item's name, or the face and the speech it was made from (astronaut-hello.mp4),
    astronaut-text.mp4 when typed text was spoken, anna-own-audio.mp4 when the video spoke with its own
    sound (never the face file's own name, which a download beside it would overwrite)."""
    if job.label:
        return f"{job.label}.mp4"
    face = Path(job.face_name).stem
    if not job.audio_name:
        return f"{face}-own-audio.mp4"
    if job.audio_name == SPEECH_NAME:  # an uploaded speech.wav is stored as audio-speech.wav (RESERVED_NAMES)
        return f"{face}-text.mp4"
    return f"{face}-{Path(job.audio_name).stem}.mp4"
