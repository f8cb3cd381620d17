"""The avatar cache: face tracking kept on disk and reused for the same face video.

One presenter video usually comes with many scripts. Tracking its face is the
costliest CPU stage, and its result depends only on the video's bytes, the face
options, the working frame size and the decode rate, so it is stored once under
a key made of exactly those and read back for every later audio.

An entry is one folder named by its key::

    <cache_dir>/<key>/
        found.npy       (F,) bool
        raw_boxes.npy   (F, 4) float32 x1 y1 x2 y2 pixels, NaN where not found
        landmarks.npy   (F, 468, 2) float32 pixels, NaN where not found
        entry.json      format version, the key's inputs in clear text, F,
                        whole_video, a sha256 of the three arrays, created time

Entries are written into a uniquely named folder beside the final one, synced
and renamed into place, so a crash or two jobs storing the same key never leave
a half-written entry under the key's name. Nothing read back is trusted: the
checksum, shapes, dtypes and finiteness are checked before a track is returned,
and a broken entry is deleted and reported as a miss. Failing to read or write
the cache never fails a generation: it only costs the tracking time.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heygem.config import REPO_ROOT, FaceConfig
from heygem.face.detect import LANDMARK_COUNT
from heygem.face.track import FaceTrack
from heygem.types import FrameGeometry

logger = logging.getLogger("heygem")

FORMAT_VERSION = 1  # bump when the entry layout or the meaning of a tracked array changes
ENTRY_FILE = "entry.json"
ARRAY_FILES = ("found.npy", "raw_boxes.npy", "landmarks.npy")
HASH_CHUNK_BYTES = 8 * 2**20  # the face video is hashed in pieces of this size
CHECKSUM_CHUNK_FRAMES = 2048  # landmarks are hashed and checked this many frames at a time (~7.7 MB)
LEFTOVER_SECONDS = 3600.0  # unfinished or stale folders older than this are swept by clear_cache


@dataclass
class CachedTrack:
    """A raw face track read back from the cache.

    ``track`` holds ``found``, ``raw_boxes`` and ``landmarks`` (``boxes`` is None:
    run :func:`heygem.face.finder.finalize_track` on it as on a fresh track). ``found``
    and ``raw_boxes`` are private in-memory copies; ``landmarks`` is a read-only
    memory map, safe to read from several threads. When ``whole_video`` is true
    the track covers every frame of the video, so its ``frame_count`` is the
    video's length; otherwise it covers the first ``frame_count`` frames only.
    """

    track: FaceTrack
    whole_video: bool

    def covers(self, frames_needed: int) -> bool:
        """Whether it holds every frame a job needs: the whole video, or at least ``frames_needed``."""
        return self.whole_video or self.track.frame_count >= frames_needed


class _BrokenEntry(Exception):
    """An entry that exists but cannot be trusted."""


def cache_dir() -> Path:
    """Where entries live: ``$HEYGEM_CACHE_DIR`` or the repository's ``outputs/avatar-cache``."""
    override = os.environ.get("HEYGEM_CACHE_DIR")
    return Path(override) if override else REPO_ROOT / "outputs" / "avatar-cache"


def _entry_path(key: str) -> Path:
    """The folder of ``key``, which must be a key made by :func:`avatar_key` (64 hex digits)."""
    if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
        raise ValueError(f"not an avatar cache key: {key!r}")
    return cache_dir() / key


# ---------------------------------------------------------------------------------------------
# keys

_content_digests: dict[tuple, str] = {}
_content_digests_lock = threading.Lock()
_descriptions: dict[str, dict] = {}  # key -> its inputs in clear text, for the entry's JSON
MAX_REMEMBERED = 1024  # digests and descriptions kept per process, oldest dropped first


def _file_identity(path: Path) -> tuple:
    """What must stay equal for a remembered content digest of ``path`` to still hold."""
    stat = path.stat()
    return (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def file_digest(path: Path) -> str:
    """sha256 hex of ``path``'s bytes, read in chunks; remembered while the file's size and times stay."""
    identity = _file_identity(path)
    with _content_digests_lock:
        remembered = _content_digests.get(identity)
    if remembered is not None:
        return remembered
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    with _content_digests_lock:
        _content_digests[identity] = digest.hexdigest()
        while len(_content_digests) > MAX_REMEMBERED:
            del _content_digests[next(iter(_content_digests))]
    return digest.hexdigest()


def _key_inputs(face_config: FaceConfig, geometry: FrameGeometry, fps_fraction: str) -> dict:
    return {"face": dataclasses.asdict(face_config), "geometry": dataclasses.asdict(geometry),
            "fps": str(fps_fraction)}


def avatar_key(face_path: Path, face_config: FaceConfig, geometry: FrameGeometry, fps_fraction: str) -> str:
    """The cache key of tracking ``face_path`` with these options, at this size and decode rate.

    It depends on the file's content (not its name or folder: a copy of the
    same video shares its entry), on every face option, on the working geometry,
    on the decode rate and on the entry format's version.
    """
    face_path = Path(face_path)
    content = file_digest(face_path)
    inputs = _key_inputs(face_config, geometry, fps_fraction)
    described = {"format": FORMAT_VERSION, "content": content, **inputs}
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    with _content_digests_lock:
        _descriptions[key] = {"file": {"name": face_path.name, "bytes": face_path.stat().st_size, "sha256": content},
                              **inputs}
        while len(_descriptions) > MAX_REMEMBERED:
            del _descriptions[next(iter(_descriptions))]
    return key


# ---------------------------------------------------------------------------------------------
# checks shared by storing and loading

def _check_arrays(found: np.ndarray, raw_boxes: np.ndarray, landmarks: np.ndarray) -> str:
    """sha256 hex over the three arrays' bytes; raises _BrokenEntry if they are not a raw track."""
    frame_count = found.shape[0] if found.ndim == 1 else -1
    expected = {"found": (found, (frame_count,), np.bool_),
                "raw_boxes": (raw_boxes, (frame_count, 4), np.float32),
                "landmarks": (landmarks, (frame_count, LANDMARK_COUNT, 2), np.float32)}
    for name, (array, shape, dtype) in expected.items():
        if array.shape != shape or array.dtype != dtype:
            raise _BrokenEntry(f"{name} is {array.dtype}{array.shape}, expected {np.dtype(dtype)}{shape}")
    if not np.isfinite(raw_boxes[found]).all():
        raise _BrokenEntry("a frame with a face has no finite box")
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(found).tobytes())
    digest.update(np.ascontiguousarray(raw_boxes).tobytes())
    for start in range(0, frame_count, CHECKSUM_CHUNK_FRAMES):
        chunk = np.ascontiguousarray(landmarks[start: start + CHECKSUM_CHUNK_FRAMES])  # (n, 468, 2)
        if not np.isfinite(chunk[found[start: start + CHECKSUM_CHUNK_FRAMES]]).all():
            raise _BrokenEntry("a frame with a face has landmarks that are not finite")
        digest.update(chunk.tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# loading

def _read_array(directory_fd: int, name: str, memory_map: bool) -> np.ndarray:
    """Read ``name`` (a .npy file) from the open entry folder; the header and length are checked."""
    handle = os.fdopen(os.open(name, os.O_RDONLY, dir_fd=directory_fd), "rb")
    with handle:
        version = np.lib.format.read_magic(handle)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(handle)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(handle)
        else:
            raise _BrokenEntry(f"{name} has .npy version {version}")
        if fortran_order or dtype.hasobject:
            raise _BrokenEntry(f"{name} is not a plain C-ordered array")
        offset = handle.tell()
        data_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        file_bytes = os.fstat(handle.fileno()).st_size
        if file_bytes != offset + data_bytes:
            raise _BrokenEntry(f"{name} holds {file_bytes - offset} bytes of data, its header says {data_bytes}")
        if memory_map and data_bytes > 0:
            return np.memmap(handle, dtype=dtype, mode="r", offset=offset, shape=shape)
        array = np.fromfile(handle, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)))
        return array.reshape(shape)


def _read_entry(directory_fd: int, key: str) -> tuple[dict, CachedTrack]:
    """The metadata and verified track of the entry folder open as ``directory_fd``; raises on any flaw."""
    with os.fdopen(os.open(ENTRY_FILE, os.O_RDONLY, dir_fd=directory_fd), "rb") as handle:
        meta = json.loads(handle.read().decode("utf-8"))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or meta.get("key") != key:
        raise _BrokenEntry("its description does not match the key or the format")
    frame_count, whole_video, checksum = meta.get("frames"), meta.get("whole_video"), meta.get("checksum")
    if not isinstance(frame_count, int) or not isinstance(whole_video, bool) or not isinstance(checksum, str):
        raise _BrokenEntry("its description lacks frames, whole_video or checksum")
    found = _read_array(directory_fd, "found.npy", memory_map=False)
    raw_boxes = _read_array(directory_fd, "raw_boxes.npy", memory_map=False)
    landmarks = _read_array(directory_fd, "landmarks.npy", memory_map=True)
    if found.shape != (frame_count,):
        raise _BrokenEntry(f"it holds {found.shape} frames, its description says {frame_count}")
    if _check_arrays(found, raw_boxes, landmarks) != checksum:
        raise _BrokenEntry("its arrays do not match their checksum")
    return meta, CachedTrack(track=FaceTrack(found=found, raw_boxes=raw_boxes, landmarks=landmarks),
                             whole_video=whole_video)


def load_track(key: str, frames_needed: int | None = None) -> CachedTrack | None:
    """The cached raw track for ``key`` if it covers ``frames_needed`` frames or the whole video;
    with ``frames_needed`` None, whatever the entry holds (a job tracks on from its end).

    A missing entry, or one that covers too few frames, is a miss (None). An entry
    that cannot be read or fails a check is logged, deleted and also a miss. The
    returned track is the whole stored track, which may be longer than asked for.
    """
    entry_path = _entry_path(key)
    try:
        directory_fd = os.open(entry_path, os.O_RDONLY | os.O_DIRECTORY)  # every file from this one folder
    except FileNotFoundError:
        return None
    except OSError as error:
        logger.warning("avatar cache: cannot read %s (%s); the face will be tracked again", entry_path, error)
        return None
    identity = None
    try:
        identity = os.fstat(directory_fd)
        meta, cached = _read_entry(directory_fd, key)
    except (_BrokenEntry, OSError, ValueError, EOFError) as error:
        if identity is None or not _is_same_folder(entry_path, identity):
            return None  # replaced or removed by another job while it was being read: not broken
        logger.warning("avatar cache: dropping the broken entry %s (%s); the face will be tracked again",
                       key[:16], error)
        _remove_entry(entry_path, identity)
        return None
    finally:
        os.close(directory_fd)
    if frames_needed is not None and not cached.covers(frames_needed):
        logger.info("avatar cache: entry %s covers %d frames, %d are needed", key[:16],
                    cached.track.frame_count, frames_needed)
        return None
    logger.info("avatar cache: reusing the face tracking of %s (%d frames)", meta.get("file", {}).get("name", "?"),
                cached.track.frame_count)
    return cached


def _is_same_folder(path: Path, identity: os.stat_result) -> bool:
    try:
        current = os.stat(path)
    except OSError:
        return False
    return (current.st_dev, current.st_ino) == (identity.st_dev, identity.st_ino)


def _remove_entry(entry_path: Path, identity: os.stat_result | None = None) -> bool:
    """Move the entry away from the key's name, then delete it; with ``identity``, only if it is
    still the folder that was read (not a fresh entry stored since). Returns whether it was removed."""
    if identity is not None and not _is_same_folder(entry_path, identity):
        return False
    doomed = entry_path.with_name(f".{entry_path.name}.{uuid.uuid4().hex}.stale")
    try:
        os.rename(entry_path, doomed)
    except OSError:
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    return True


# ---------------------------------------------------------------------------------------------
# storing

def _write_array(directory: Path, name: str, array: np.ndarray) -> None:
    """Write ``array`` as a .npy file, frame chunk by frame chunk (the source may be a memory map)."""
    with open(directory / name, "wb") as handle:
        np.lib.format.write_array_header_1_0(handle, np.lib.format.header_data_from_array_1_0(array))
        for start in range(0, max(len(array), 1), CHECKSUM_CHUNK_FRAMES):
            handle.write(np.ascontiguousarray(array[start: start + CHECKSUM_CHUNK_FRAMES]).tobytes())
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_directory(directory: Path) -> None:
    directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)


def _covers(meta: dict | None, frame_count: int, whole_video: bool) -> bool:
    """Whether an entry described by ``meta`` already holds at least what a new one would."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        return False
    if meta.get("whole_video") is True:
        return True
    return not whole_video and isinstance(meta.get("frames"), int) and meta["frames"] >= frame_count


def _read_meta(entry_path: Path) -> dict | None:
    try:
        return json.loads((entry_path / ENTRY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def store_track(key: str, track: FaceTrack, whole_video: bool) -> None:
    """Keep the raw ``track`` (found, raw_boxes, landmarks) under ``key``; never raises for I/O.

    Store the track before :func:`heygem.face.finder.finalize_track` (a fixed box marks
    every frame as found). ``whole_video`` says the track covers every frame of
    the video. The entry's JSON describes the key's inputs in clear text when
    ``key`` came from :func:`avatar_key` in this process. An existing entry that
    already covers as much is kept.
    """
    entry_path = _entry_path(key)
    root = entry_path.parent
    found = np.asarray(track.found, dtype=bool)
    raw_boxes = np.asarray(track.raw_boxes, dtype=np.float32)
    landmarks = np.asarray(track.landmarks, dtype=np.float32)
    try:
        checksum = _check_arrays(found, raw_boxes, landmarks)
    except _BrokenEntry as error:
        logger.warning("avatar cache: not storing a face track that is not a raw track (%s)", error)
        return
    if _covers(_read_meta(entry_path), track.frame_count, whole_video):
        return
    with _content_digests_lock:
        description = _descriptions.get(key, {})
    meta = {"format": FORMAT_VERSION, "key": key, **description, "frames": track.frame_count,
            "whole_video": bool(whole_video), "checksum": checksum, "created": time.time(),
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    partial_path = root / f".{key}.{uuid.uuid4().hex}.partial"
    try:
        root.mkdir(parents=True, exist_ok=True)
        partial_path.mkdir()
        _write_array(partial_path, "found.npy", found)
        _write_array(partial_path, "raw_boxes.npy", raw_boxes)
        _write_array(partial_path, "landmarks.npy", landmarks)
        with open(partial_path / ENTRY_FILE, "w", encoding="utf-8") as handle:
            json.dump(meta, handle, indent=2, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        _fsync_directory(partial_path)
        _move_into_place(partial_path, entry_path, track.frame_count, whole_video)
        _fsync_directory(root)
    except OSError as error:
        logger.warning("avatar cache: could not store the face tracking in %s (%s); generation goes on",
                       root, error)
    finally:
        shutil.rmtree(partial_path, ignore_errors=True)


def _move_into_place(partial_path: Path, entry_path: Path, frame_count: int, whole_video: bool) -> None:
    """Rename the finished folder to the key's name, replacing an entry that covers less."""
    for _ in range(3):
        try:
            os.rename(partial_path, entry_path)  # atomic; fails if the key's folder exists
            return
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if _covers(_read_meta(entry_path), frame_count, whole_video):
            return  # another job stored as much meanwhile: ours is discarded
        _remove_entry(entry_path)


# ---------------------------------------------------------------------------------------------
# clearing

def clear_cache(older_than_seconds: float | None = None) -> int:
    """Delete entries (all, or those created more than ``older_than_seconds`` ago); returns how many.

    Unfinished folders left by a crash are swept too when they are over an hour old.
    """
    root = cache_dir()
    if not root.is_dir():
        return 0
    now = time.time()
    removed = 0
    for path in root.iterdir():
        if path.name.startswith("."):  # an unfinished or stale folder
            try:
                if now - path.stat().st_mtime > LEFTOVER_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass
            continue
        if not path.is_dir():
            continue
        if older_than_seconds is not None:
            meta = _read_meta(path)
            created = meta.get("created") if isinstance(meta, dict) else None
            if not isinstance(created, (int, float)):
                try:
                    created = path.stat().st_mtime
                except OSError:
                    continue
            if now - created <= older_than_seconds:
                continue
        removed += _remove_entry(path)
    return removed


# ---------------------------------------------------------------------------------------------
# latents of reference crops (MuseTalk's avatar preparation)
#
#     <cache_dir>/latents/<namespace>/<crop digest>.npy     one crop's latents
#
# An engine that encodes each face crop into latents before its network runs stores them here,
# under a namespace naming its encoder's files and the digest of the crop's pixels, so a new
# script for the same presenter (or the same frame seen again) never encodes again. Each file
# is written beside its final name and renamed into place; one that does not read back as the
# shape and dtype asked for is a miss.


def _latents_path(namespace: str, digest: str) -> Path:
    for part in (namespace, digest):
        if len(part) != 64 or not all(c in "0123456789abcdef" for c in part):
            raise ValueError(f"not a sha256 hex digest: {part!r}")
    return cache_dir() / "latents" / namespace / f"{digest}.npy"


def load_latents(namespace: str, digest: str, shape: tuple, dtype) -> np.ndarray | None:
    """The latents stored under ``namespace`` for the crop of ``digest``, or None (never raises for a
    missing or unusable file)."""
    path = _latents_path(namespace, digest)
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if array.shape != tuple(shape) or array.dtype != np.dtype(dtype) or not np.isfinite(array).all():
        return None
    return array


def store_latents(namespace: str, digest: str, array: np.ndarray) -> None:
    """Keep ``array`` for the crop of ``digest``; a failure is logged, never raised."""
    path = _latents_path(namespace, digest)
    partial = path.with_name(f".{path.stem}.{uuid.uuid4().hex}.npy")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(partial, np.ascontiguousarray(array), allow_pickle=False)
        os.replace(partial, path)
    except OSError as error:
        logger.warning("could not keep latents in the avatar cache (%s)", error)
        partial.unlink(missing_ok=True)
