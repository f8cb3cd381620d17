"""Batch mode: many faces and audio files (or texts to speak) in, one job each, through the job store.

Items are planned from a list of files by one of three pairings:

- ``stem``: files with the same name before the suffix belong together
  (``anna.mp4`` + ``anna.wav``, or ``anna.mp4`` + ``anna.txt``, whose words are
  spoken; with both, the audio file is used); a video alone uses its own sound;
  the only face of a folder speaks every audio or text file in it;
- ``cross``: every face with every audio or text file;
- a CSV manifest with the columns ``face``, ``audio`` (empty: the video's own
  sound) and optionally ``text`` (words to speak instead of audio, or a .txt
  file's name), ``name`` and ``options`` (a JSON object); a ``presenter``
  column names a saved presenter (its name or id, heygem.presenters) instead of
  a face file, resolved as ``generate --presenter`` resolves it.

An item made from text gets its subtitles (``text.subtitles``) and ``NAME.srt``, and is spoken by the
voice of the manifest's ``voice`` column, else the batch's (``--voice``), else the one chosen for its
language; the cloned voice (``clone``, the face video's own voice) needs ``voice_consent`` (a column
saying true, or ``--voice-consent``).

``python -m heygem batch`` runs the items with a worker in this process
(one per device with ``--devices cuda:0,cuda:1``), skips items whose inputs and options are
unchanged since a finished earlier run,
keeps going when an item fails and writes ``summary.csv``. The web app plans
items the same way and queues them on its own workers.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from heygem.errors import HeygemError
from heygem.jobs.files import DEFAULT_OUTPUTS, RESULT_SUBTITLES_NAME, SPEECH_NAME, TEXT_NAME, sanitize_filename
from heygem.jobs.request import flatten_options, parse_options
from heygem.jobs.store import DONE, FAILED, JobStore, new_job_id
from heygem.jobs.worker import start_workers
from heygem.media.probing import AUDIO_SUFFIXES, IMAGE_SUFFIXES, VIDEO_SUFFIXES

logger = logging.getLogger("heygem")

TEXT_SUFFIXES = {".txt"}  # UTF-8 text to speak
PAIRINGS = ("stem", "cross")  # or the path of a CSV manifest

SUMMARY_NAME = "summary.csv"
STATE_NAME = ".heygem-batch.json"  # item name -> key of the inputs and options its result was made from
SKIPPED = "skipped"
SUMMARY_COLUMNS = ("name", "status", "face", "audio", "output", "seconds", "engine", "error", "job_id", "device",
                   "note")


@dataclass
class BatchItem:
    """One output to make."""

    name: str  # the output's file stem, unique within the batch
    face_path: Path | None
    audio_path: Path | None  # None: the face video's own audio (or the text below)
    options: dict = field(default_factory=dict)  # this item's options over the batch's (manifest column)
    problem: str | None = None  # why the item cannot run, found while planning
    text: str | None = None  # words to speak instead of audio (from a .txt file or the manifest's text column)
    text_path: Path | None = None  # the .txt file the text came from
    note: str | None = None  # something planning decided that the user should know (which file was used)
    presenter: str | None = None  # a saved presenter's name or id instead of a face file (manifest column)
    voice: str | None = None  # who speaks the text: a voice name (manifest column or the batch's); None: chosen
    voice_consent: bool = False  # the speaker agreed to the cloned voice (manifest column or the batch's)
    voice_sample: Path | None = None  # whose voice "clone" speaks in: the item's presenter's kept sample, if any

    @property
    def speech_label(self) -> str:
        """What the item speaks, as the summary shows it."""
        if self.audio_path is not None:
            return self.audio_path.name
        if self.text is not None or self.text_path is not None:
            return f"{self.text_path.name} (text)" if self.text_path else "(text)"
        return "(video's own audio)"


@dataclass
class BatchResult:
    """What became of one item."""

    item: BatchItem
    status: str  # done, skipped, failed or cancelled
    job_id: str | None = None
    output_path: Path | None = None
    seconds: float | None = None
    engine: str | None = None
    error: str | None = None
    device: str | None = None  # the device the job ran with

    def row(self) -> dict:
        return {
            "name": self.item.name,
            "status": self.status,
            "face": (f"presenter {self.item.presenter}" if self.item.presenter
                     else self.item.face_path.name if self.item.face_path else ""),
            "audio": self.item.speech_label,
            "output": self.output_path.name if self.output_path else "",
            "seconds": "" if self.seconds is None else f"{self.seconds:.1f}",
            "engine": self.engine or "",
            "error": self.error or "",
            "job_id": self.job_id or "",
            "device": self.device or "",
            "note": self.item.note or "",
        }


def file_role(path: Path) -> str | None:
    """'image', 'video', 'audio' or 'text' by the file's suffix; None for anything else."""
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return "image"
    if suffix in VIDEO_SUFFIXES:
        return "video"
    if suffix in AUDIO_SUFFIXES:
        return "audio"
    if suffix in TEXT_SUFFIXES:
        return "text"
    return None


def collect_files(folder: Path) -> list[Path]:
    """The media and .txt files directly inside ``folder`` (not hidden ones), sorted by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HeygemError(f"batch folder not found: {folder}")
    return sorted(path for path in folder.iterdir()
                  if path.is_file() and not path.name.startswith(".") and file_role(path) is not None)


def resolve_under_roots(folder: str | Path, roots: list[Path]) -> Path:
    """``folder`` resolved (symlinks followed) if it lies under one of ``roots``; HeygemError otherwise."""
    if not roots:
        raise HeygemError("server folders are switched off: start the app with --batch-root DIR to allow some")
    text = str(folder).strip()
    if not text:
        raise HeygemError("enter a folder on the server")
    candidate = Path(text).expanduser()
    resolved_roots = [Path(root).resolve() for root in roots]
    options = [candidate] if candidate.is_absolute() else [root / candidate for root in resolved_roots]
    for option in options:
        resolved = option.resolve()
        if any(resolved == root or resolved.is_relative_to(root) for root in resolved_roots):
            if not resolved.is_dir():
                raise HeygemError(f"{text} is not a folder")
            return resolved
    raise HeygemError(f"{text} is outside the folders this server allows: {', '.join(map(str, resolved_roots))}")


def _unique_names(items: list[BatchItem]) -> list[BatchItem]:
    """Make item names safe and unique (anna, anna-2, ...)."""
    seen: set[str] = set()
    for item in items:
        base = sanitize_filename(item.name, fallback="item")
        name, number = base, 2
        while name.casefold() in seen:
            name, number = f"{base}-{number}", number + 1
        seen.add(name.casefold())
        item.name = name
    return items


def plan_items(files: list[Path], pairing: str = "stem", base_dir: Path | None = None) -> list[BatchItem]:
    """Turn files into batch items by ``pairing``: "stem", "cross" or a manifest CSV's path.

    Files with problems become items with ``problem`` set, so that they show
    in the summary instead of silently disappearing. With ``base_dir`` (a folder of files, not uploads),
    a file whose real path (links followed) is outside it is never paired, in every pairing.
    """
    files = [Path(path) for path in files]
    escaped = []  # a manifest's rows are checked one by one (_pair_by_manifest)
    if base_dir is not None and pairing in PAIRINGS:
        escaped = _outside(files, Path(base_dir))
    files = [path for path in files if path not in escaped]
    faces = [path for path in files if file_role(path) in ("image", "video")]
    audios = [path for path in files if file_role(path) == "audio"]
    texts = [path for path in files if file_role(path) == "text"]
    if pairing == "stem" and len(faces) == 1 and any(path.stem != faces[0].stem for path in audios + texts):
        items = _pair_lone_face(faces[0], audios, texts)
    elif pairing == "stem":
        items = _pair_by_stem(faces, audios, texts)
    elif pairing == "cross":
        items = _pair_crosswise(faces, audios, texts)
    else:
        manifest = Path(pairing)
        if manifest.suffix.lower() != ".csv":
            raise HeygemError(f"pairing must be stem, cross or a .csv manifest, not {pairing!r}")
        items = _pair_by_manifest(manifest, files, base_dir)
    items += [BatchItem(name=path.stem, face_path=path if file_role(path) in ("image", "video") else None,
                        audio_path=path if file_role(path) == "audio" else None,
                        text_path=path if file_role(path) == "text" else None,
                        problem=f"{path.name} links to a file outside the batch folder: skipped") for path in escaped]
    if not items:
        raise HeygemError("no faces (videos or images) and audio or text files to pair were found")
    return _unique_names(items)


def plan_for_presenter(files: list[Path], presenter: str, base_dir: Path | None = None) -> list[BatchItem]:
    """Every audio or .txt file spoken by one saved presenter (its name or id, resolved when the items are
    queued: :func:`with_presenter`), an item each named after the file; faces among the files are listed as
    not used. With ``base_dir``, a file whose real path is outside it is skipped as in :func:`plan_items`."""
    files = [Path(path) for path in files]
    escaped = _outside(files, Path(base_dir)) if base_dir is not None else []
    items = []
    for path in files:
        role = file_role(path)
        if path in escaped:
            items.append(BatchItem(name=path.stem, face_path=None, audio_path=None, presenter=presenter,
                                   problem=f"{path.name} links to a file outside the batch folder: skipped"))
        elif role in ("audio", "text"):
            item = _speech_item(path.stem, None, path)
            item.presenter = presenter
            items.append(item)
        elif role in ("image", "video"):
            items.append(BatchItem(name=path.stem, face_path=path, audio_path=None, presenter=presenter,
                                   problem=f"{path.name} not used: the saved presenter speaks every audio and "
                                           "text file"))
    if not any(item.problem is None for item in items):
        raise HeygemError("no audio or text files for the presenter to speak were found")
    return _unique_names(items)


def _outside(files: list[Path], folder: Path) -> list[Path]:
    """The files whose real path (links followed) is not inside ``folder``'s."""
    root = folder.resolve()
    return [path for path in files if not path.resolve().is_relative_to(root)]


def read_text_file(path: Path) -> tuple[str | None, str | None]:
    """(the words of a UTF-8 .txt file, None), or (None, why it cannot be spoken)."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        return None, f"{Path(path).name} is not UTF-8 text: save it as UTF-8"
    except OSError as error:
        return None, f"cannot read {Path(path).name}: {error.strerror or error}"
    if not text.strip():
        return None, f"{Path(path).name} is empty: write the words to speak in it"
    return text, None


def _speech_item(name: str, face: Path | None, speech: Path | None) -> BatchItem:
    """An item that speaks ``speech``: an audio file, or a .txt file whose words are read now."""
    if speech is not None and file_role(speech) == "text":
        text, problem = read_text_file(speech)
        return BatchItem(name=name, face_path=face, audio_path=None, text=text, text_path=speech, problem=problem)
    return BatchItem(name=name, face_path=face, audio_path=speech)


def _pair_by_stem(faces: list[Path], audios: list[Path], texts: list[Path] = ()) -> list[BatchItem]:
    stems: dict[str, tuple[list[Path], list[Path], list[Path]]] = {}
    for path in faces:
        stems.setdefault(path.stem, ([], [], []))[0].append(path)
    for path in audios:
        stems.setdefault(path.stem, ([], [], []))[1].append(path)
    for path in texts:
        stems.setdefault(path.stem, ([], [], []))[2].append(path)
    items = []
    for stem, (stem_faces, stem_audios, stem_texts) in sorted(stems.items()):
        face = stem_faces[0] if len(stem_faces) == 1 else None
        speeches = stem_audios or stem_texts  # an audio file wins over a text of the same name
        speech = speeches[0] if len(speeches) == 1 else None
        item = _speech_item(stem, face, speech)
        if stem_audios and stem_texts:
            item.note = (f"{', '.join(path.name for path in stem_texts)} not spoken: "
                         f"{', '.join(path.name for path in stem_audios)} gives the speech")
        if len(stem_faces) > 1 or len(speeches) > 1:
            names = ", ".join(path.name for path in stem_faces + speeches)
            item.problem = (f"several files are named {stem}: {names}; rename them so each stem has one face "
                            "and one audio or text")
        elif face is None:
            item.problem = (f"{speech.name} has no face (image or video) named {stem}.*; --pairing cross pairs "
                            "every face with every audio or text")
        elif speech is None and file_role(face) == "image":
            item.problem = f"{face.name} is a photo with no audio or text file named {stem}.*"
        items.append(item)
    return items


def _pair_lone_face(face: Path, audios: list[Path], texts: list[Path] = ()) -> list[BatchItem]:
    """The one face of a folder speaks every audio or text file in it (a text beside an audio of the same
    name is not spoken, as by stem); an item is named face__speech, or the face's own name for its
    namesake."""
    stems: dict[str, tuple[list[Path], list[Path]]] = {}
    for path in audios:
        stems.setdefault(path.stem, ([], []))[0].append(path)
    for path in texts:
        stems.setdefault(path.stem, ([], []))[1].append(path)
    items = []
    for stem, (stem_audios, stem_texts) in sorted(stems.items()):
        speeches = stem_audios or stem_texts
        item = _speech_item(stem if stem == face.stem else f"{face.stem}__{stem}", face,
                            speeches[0] if len(speeches) == 1 else None)
        if stem_audios and stem_texts:
            item.note = (f"{', '.join(path.name for path in stem_texts)} not spoken: "
                         f"{', '.join(path.name for path in stem_audios)} gives the speech")
        if len(speeches) > 1:
            item.problem = (f"several files are named {stem}: {', '.join(path.name for path in speeches)}; "
                            "rename them so each stem has one audio or text")
        items.append(item)
    return items


def _pair_crosswise(faces: list[Path], audios: list[Path], texts: list[Path] = ()) -> list[BatchItem]:
    if not faces:
        raise HeygemError("cross pairing needs at least one face (image or video)")
    speeches = [*audios, *texts]
    if not speeches:
        raise HeygemError("cross pairing needs at least one audio or text file")
    return [_speech_item(f"{face.stem}__{speech.stem}", face, speech) for face in faces for speech in speeches]


def _pair_by_manifest(manifest: Path, files: list[Path], base_dir: Path | None) -> list[BatchItem]:
    """Rows of face, audio[, text][, name][, options]; paths are relative to ``base_dir`` (or uploaded file
    names); ``text`` holds the words to speak instead of an audio file, or the name of a .txt file holding them."""
    if not manifest.is_file():
        raise HeygemError(f"manifest not found: {manifest}")
    by_name = {path.name: path for path in files}
    root = base_dir.resolve() if base_dir is not None else None

    def locate(entry: str) -> tuple[Path | None, str | None]:
        entry = entry.strip()
        if root is None:
            path = by_name.get(entry)
            return (path, None) if path else (None, f"{entry} is not among the uploaded files")
        path = (root / entry).resolve()
        if not path.is_relative_to(root):
            return None, f"{entry} is outside the batch folder"
        if not path.is_file():
            return None, f"{entry} not found in the batch folder"
        return path, None

    try:
        with open(manifest, newline="", encoding="utf-8-sig") as handle:
            rows = list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise HeygemError(f"cannot read the manifest {manifest.name}: {error}") from None
    if rows and "face" not in rows[0] and "presenter" not in rows[0]:
        raise HeygemError(f"the manifest {manifest.name} needs a header row with at least: face,audio "
                          "(or presenter,audio)")
    items = []
    for number, row in enumerate(rows, start=2):
        face_entry, audio_entry = (row.get("face") or "").strip(), (row.get("audio") or "").strip()
        presenter = (row.get("presenter") or "").strip() or None
        text = row.get("text") or ""
        if not face_entry and presenter is None:
            continue
        face, problem = locate(face_entry) if face_entry else (None, None)
        if face_entry and presenter is not None:
            problem = f"line {number}: give a face or a presenter, not both"
        audio, audio_problem = (locate(audio_entry) if audio_entry else (None, None))
        stem = Path(face_entry).stem if face_entry else Path(sanitize_filename(presenter, "presenter")).stem
        name = (row.get("name") or "").strip() or (f"{stem}__{Path(audio_entry).stem}" if audio_entry else stem)
        item = BatchItem(name=name, face_path=face, audio_path=audio, problem=problem or audio_problem,
                         text=text if text.strip() else None, presenter=presenter)
        if text.strip().lower().endswith(".txt") and "\n" not in text.strip():  # the name of a .txt file
            text_path, text_problem = locate(text.strip())
            if text_path is not None:
                item.text, text_problem = read_text_file(text_path)
                item.text_path = text_path
            item.problem = item.problem or text_problem
        if text.strip() and audio_entry:
            item.problem = f"line {number}: give audio or text, not both"
        elif "text" in row and text and not text.strip():
            item.problem = f"line {number}: the text is empty: write the words to speak, or leave the cell empty"
        item.voice = (row.get("voice") or "").strip() or None
        item.voice_consent = (row.get("voice_consent") or "").strip().lower() in ("true", "1", "yes", "on")
        options_text = (row.get("options") or "").strip()
        if options_text and item.problem is None:
            try:  # the one check of a request's options JSON (finite numbers, size, depth)
                item.options = parse_options(options_text)
            except HeygemError as error:
                item.problem = f"line {number}: {error}"
        items.append(item)
    return items


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def item_key(item: BatchItem, options: dict) -> str:
    """A hash of the item's inputs (their bytes) and its effective options."""
    digest = hashlib.sha256()
    digest.update(_file_digest(item.face_path).encode())
    if item.audio_path:
        digest.update(_file_digest(item.audio_path).encode())
    elif item.text is not None:
        digest.update(b"text:" + item.text.encode("utf-8"))
        if item.voice:
            digest.update(b"voice:" + item.voice.encode("utf-8"))
    else:
        digest.update(b"own-audio")
    digest.update(json.dumps(options, sort_keys=True, ensure_ascii=False).encode())
    return digest.hexdigest()


def with_presenter(store: JobStore, item: BatchItem, options: dict, submitter: str | None = None) -> dict:
    """The item's options with its presenter's face chosen, its ``face_path`` set to the presenter's clip
    (whose track goes into the avatar cache for the job), as ``generate --presenter`` does; ``options``
    unchanged for an item with a face file. HeygemError: no such presenter (among ``submitter``'s, or
    anyone's without users), or one not ready."""
    if item.presenter is None:
        return options
    from heygem.presenters.prepare import presenter_job
    from heygem.presenters.records import PresenterStore

    presenter = PresenterStore(store.outputs_dir).find(item.presenter, submitter, every_user=submitter is None)
    item.face_path, options = presenter_job(presenter, options, store.resolve_options)
    item.voice_sample = presenter.sample_path  # the cloned voice speaks in the presenter's own (heygem.presenters)
    return options


def new_batch_id() -> str:
    """A new batch's id: batch- and a job id (when it was made, and random)."""
    return f"batch-{new_job_id()}"


def submit_items(store: JobStore, items: list[BatchItem], options: dict | None, batch: str,
                 reuse: bool = False, remote: bool = False, submitter: str | None = None) -> dict[str, str | Exception]:
    """Queue one job per item that can run; return item name -> job id, or the error that stopped it.

    With ``reuse``, an item whose inputs and options match a queued, running or
    done job is attached to that job instead of making a new one. ``remote``: the items come from a
    client of a server (the Batch tab), so the batch's and each row's options are checked as REST
    checks a request's (heygem.jobs.request): checkpoint names inside the weights folder, process caps.
    The jobs belong to ``submitter`` (heygem.jobs.users), if given.
    """
    outcome: dict[str, str | Exception] = {}
    for item in items:
        if item.problem:
            outcome[item.name] = HeygemError(item.problem)
            continue
        try:
            if remote:  # the request as the client gave it, checked as a whole; the job resolves it again
                merged = {**flatten_options(options), **flatten_options(item.options)}
                store.resolve_options(merged, remote=True)
            else:
                merged = {**store.resolve_options(options)[0], **store.resolve_options(item.options)[0]}
            merged = with_presenter(store, item, merged, submitter)
            key = item_key(item, merged)
            existing = store.find_by_item_key(key) if reuse else None
            if existing is not None:
                store.set_batch(existing.id, batch, item.name)
                outcome[item.name] = existing.id
            else:
                outcome[item.name] = store.create_job(item.face_path, item.audio_path, merged, batch=batch,
                                                      label=item.name, item_key=key, text=item.text, remote=remote,
                                                      submitter=submitter, **_voice_of(item))
        except (HeygemError, OSError) as error:
            outcome[item.name] = error if isinstance(error, HeygemError) else HeygemError(str(error))
    return outcome


def _voice_of(item: BatchItem) -> dict:
    """The voice arguments of an item's job: only an item made from text has a voice; the cloned one speaks in
    the item's presenter's voice where it has a kept sample."""
    if item.text is None:
        return {}
    sample = item.voice_sample if item.voice == "clone" else None
    return {"voice": item.voice, "voice_consent": item.voice_consent, **({"voice_sample": sample} if sample else {})}


def zip_results(store: JobStore, batch: str, not_queued: list[BatchResult] = ()) -> Path | None:
    """A zip of the batch as ``python -m heygem batch`` writes its folder: NAME.mp4 and NAME.json of each
    finished item, NAME.srt of one made from text, and summary.csv with a row for every item (``not_queued``:
    the items that never became a job, with why); None when no item is done yet."""
    jobs = sorted(store.list(batch=batch), key=lambda job: job.label or job.id)
    if not any(job.status == DONE and job.result_path.is_file() for job in jobs):
        return None
    folder = store.outputs_dir / "batches"
    folder.mkdir(exist_ok=True)
    destination = folder / f"{batch}.zip"
    partial = folder / f".{batch}.{uuid.uuid4().hex}.partial"
    summary = partial.with_suffix(".csv")
    results = sorted([*(_job_result(job) for job in jobs), *not_queued], key=lambda result: result.item.name)
    try:
        write_summary(results, summary)
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED) as archive:
            for job in jobs:
                name = job.label or job.id
                if job.status != DONE or not job.result_path.is_file():
                    continue
                archive.write(job.result_path, f"{name}.mp4")
                for source, suffix in ((job.summary_path, ".json"), (job.directory / RESULT_SUBTITLES_NAME, ".srt")):
                    if source.is_file():
                        archive.write(source, f"{name}{suffix}")
            archive.write(summary, SUMMARY_NAME)
        os.replace(partial, destination)
    finally:
        summary.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return destination


def _job_result(job) -> BatchResult:
    """A batch job as a row of summary.csv."""
    name = job.label or job.id
    spoken = job.audio_name == SPEECH_NAME and (job.directory / TEXT_NAME).is_file()  # made from text
    item = BatchItem(name=name, face_path=job.face_path, audio_path=None if spoken or not job.audio_name
                     else job.audio_path, text="" if spoken else None)
    return BatchResult(item, job.status, job_id=job.id, seconds=job.seconds, engine=job.engine, error=job.error,
                       device=job.device, output_path=Path(f"{name}.mp4") if job.status == DONE else None)


# ---------------------------------------------------------------------- command line


def _load_state(output_dir: Path) -> dict:
    try:
        return json.loads((output_dir / STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def _copy_atomically(source: Path, destination: Path) -> None:
    partial = destination.with_name(f".{destination.name}.{uuid.uuid4().hex}.partial")
    shutil.copyfile(source, partial)
    os.replace(partial, destination)


def write_summary(results: list[BatchResult], path: Path) -> None:
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    with open(partial, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=SUMMARY_COLUMNS)
        writer.writeheader()
        for result in results:
            writer.writerow(result.row())
    os.replace(partial, path)


def run_batch(input_dir: Path, output_dir: Path, pairing: str = "stem", options: dict | None = None, *,
              jobs_dir: Path = DEFAULT_OUTPUTS, show_progress: bool = True,
              devices: list[str] | None = None, ray_address: str | None = None, voice: str | None = None,
              voice_consent: bool = False) -> list[BatchResult]:
    """Make every item of ``input_dir`` into ``output_dir/<name>.mp4`` and write ``summary.csv``.
    ``voice`` (``voice_consent``) speaks the text items whose manifest row names none.

    Jobs go through the store in ``jobs_dir`` and run on a worker in this
    process, or on one worker per entry of ``devices`` (e.g. ["cuda:0",
    "cuda:1"]), or on a Ray cluster when ``ray_address`` is given ("local",
    "auto" or HOST:PORT; see heygem.jobs.ray_executor). Items whose result
    exists and whose inputs and options are unchanged are skipped; a failed
    item is recorded and the rest go on.
    """
    from tqdm import tqdm

    input_dir, output_dir = Path(input_dir), Path(output_dir)
    if pairing not in PAIRINGS:
        manifest = Path(pairing)
        pairing = str(manifest if manifest.is_absolute() or manifest.exists() else input_dir / manifest)
    items = plan_items(collect_files(input_dir), pairing, base_dir=input_dir)
    for item in items:
        item.voice, item.voice_consent = item.voice or voice, item.voice_consent or voice_consent
        if item.note:
            logger.warning("%s: %s", item.name, item.note)
    output_dir.mkdir(parents=True, exist_ok=True)
    store = JobStore(jobs_dir)
    state = _load_state(output_dir)
    batch = new_batch_id()
    results: dict[str, BatchResult] = {}
    to_submit = []
    for item in items:
        output_path = output_dir / f"{item.name}.mp4"
        if item.problem is None and output_path.is_file() and item.name in state:
            merged = {**store.resolve_options(options)[0], **store.resolve_options(item.options)[0]}
            try:
                merged = with_presenter(store, item, merged)
            except HeygemError:  # said when the item is submitted
                to_submit.append(item)
                continue
            if state[item.name] == item_key(item, merged):
                results[item.name] = BatchResult(item, SKIPPED, output_path=output_path)
                continue
        to_submit.append(item)
    submitted = submit_items(store, to_submit, options, batch, reuse=True)
    pending: dict[str, str] = {}
    for item in to_submit:
        outcome = submitted[item.name]
        if isinstance(outcome, Exception):
            results[item.name] = BatchResult(item, FAILED, error=str(outcome))
            logger.warning("%s: %s", item.name, outcome)
        else:
            pending[item.name] = outcome
    by_name = {item.name: item for item in items}

    if not pending:
        workers = []
    elif ray_address is not None:
        from heygem.jobs.ray_executor import start_ray_workers

        workers = start_ray_workers(store, ray_address, batch=batch)
    else:
        workers = start_workers(store, None if devices else 1, devices=devices, batch=batch)
    bar = tqdm(total=len(items), unit="item", desc="batch", disable=not show_progress)
    bar.update(len(results))
    try:
        while pending:
            for name, job_id in list(pending.items()):
                job = store.get(job_id)
                if job.status == "running":
                    bar.set_postfix_str(f"{name}: {job.stage} {job.progress:.0%}", refresh=False)
                if not job.is_finished:
                    continue
                del pending[name]
                item = by_name[name]
                result = BatchResult(item, job.status, job_id=job.id, seconds=job.seconds, engine=job.engine,
                                     error=job.error, device=job.device)
                if job.status == DONE:
                    result.output_path = output_dir / f"{name}.mp4"
                    _copy_atomically(job.result_path, result.output_path)
                    if job.summary_path.is_file():
                        _copy_atomically(job.summary_path, output_dir / f"{name}.json")
                    subtitles = job.directory / RESULT_SUBTITLES_NAME
                    if subtitles.is_file():  # made from text
                        _copy_atomically(subtitles, output_dir / f"{name}.srt")
                    state[name] = job.item_key
                    _write_atomically(output_dir / STATE_NAME, json.dumps(state, indent=1, sort_keys=True))
                else:
                    bar.write(f"{name}: {job.status}: {job.error or ''}")
                results[name] = result
                bar.update(1)
            if pending:
                time.sleep(0.3)
    finally:
        bar.close()
        for worker in workers:
            worker.stop()
        ordered = [results[item.name] for item in items if item.name in results]
        write_summary(ordered, output_dir / SUMMARY_NAME)
    return ordered


