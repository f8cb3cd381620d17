"""What a job worker keeps between jobs, in one registry.

A worker runs job after job; loading a Wav2Lip generator takes 10-15 s (torch, CUDA, the weights),
starting eight rendering processes a second or more, building a job's sixteen mediapipe graphs
holds the interpreter lock for 0.8 s. So what one job built is kept for the next, under a key that
holds everything it was built from. A key that starts with a checkpoint's :func:`file_identity`
(its path, size and modification time) is stale once the file changes: what was built from the
old file is dropped, so a replaced file is loaded again. Each kind of thing is kept one of two ways:

- **shared**: :meth:`Kept.shared` returns the one kept for the key, or builds and keeps it; several
  jobs may use it at once (S3FD, GFPGAN) or one owner thread uses it job after job (a Wav2Lip
  engine: ``owner`` set, one per owner).
- **handed back**: :meth:`Kept.take` hands the kept object out (nobody else can take it meanwhile)
  and :meth:`Kept.put` gives it back after a job that ended well (face tracker pools, the landmark
  engine's rendering processes); after a failed job the caller closes it instead.

At most ``most`` of a kind are kept; the oldest goes first. :meth:`Kept.release` closes what is
kept (a job worker calls it for its thread when it stops).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("heygem")


@dataclass(frozen=True)
class KeptKind:
    name: str  # what it is, for the log: "wav2lip engine"
    most: int  # how many are kept at once
    per_owner: bool = False  # one per owner thread (it serves that thread only)
    process_wide: bool = False  # released whenever any worker releases (one pool for the whole process)


WAV2LIP_ENGINE = KeptKind("wav2lip engine", most=4, per_owner=True)
RENDERING_PROCESSES = KeptKind("landmark rendering processes", most=4, per_owner=True)
FACE_TRACKERS = KeptKind("face trackers", most=1, process_wide=True)
S3FD_DETECTOR = KeptKind("S3FD detector", most=2)
GFPGAN_RESTORER = KeptKind("GFPGAN restorer", most=2)


def file_identity(path: Path) -> tuple:
    """(resolved path, size, modification time in ns) of a file: the start of a key built from it."""
    path = Path(path)
    status = path.stat()
    return ("file", str(path.resolve()), status.st_size, status.st_mtime_ns)


def _stale(old_key: tuple, new_key: tuple) -> bool:
    """Whether ``old_key`` was built from an earlier version of the file ``new_key`` starts with."""
    old, new = (old_key[0] if old_key else None), (new_key[0] if new_key else None)
    return (isinstance(old, tuple) and isinstance(new, tuple) and len(old) == 4 == len(new) and old[0] == "file"
            == new[0] and old[1] == new[1] and old != new)


def _close(thing) -> None:
    close = getattr(thing, "close", None)
    if close is not None:
        close()


@dataclass
class _Entry:
    kind: KeptKind
    owner: int | None
    key: tuple
    thing: object


class Kept:
    """The registry (one per process: :data:`KEPT`)."""

    def __init__(self):
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self._building: dict[tuple, threading.Lock] = {}  # one per key being built: it is never built twice at once

    def shared(self, kind: KeptKind, key: tuple, build: Callable[[], object], owner: int | None = None):
        """The ``kind`` kept for ``key`` (and ``owner``, for a per-owner kind), else ``build()``'s result, kept.
        A per-owner kind keeps one per owner: what that owner had under another key is dropped."""
        owner = owner if kind.per_owner else None
        with self._lock:
            building = self._building.setdefault((kind.name, owner, key), threading.Lock())
        with building:
            with self._lock:
                for entry in self._entries:
                    if entry.kind is kind and entry.owner == owner and entry.key == key:
                        logger.info("%s: the one loaded for an earlier job", kind.name)
                        return entry.thing
            thing = build()
            self._add(_Entry(kind, owner, key, thing), drop_owners=kind.per_owner)
        with self._lock:
            self._building.pop((kind.name, owner, key), None)
        return thing

    def take(self, kind: KeptKind, key: tuple, owner: int | None = None, usable: Callable[[object], bool] = None):
        """The ``kind`` kept for ``key`` (and ``owner``), handed out, or None. What is kept under another key,
        or fails ``usable`` (a process has died), is closed."""
        owner = owner if kind.per_owner else None
        found, dropped = None, []
        with self._lock:
            for entry in [entry for entry in self._entries if entry.kind is kind and entry.owner == owner]:
                self._entries.remove(entry)
                if found is None and entry.key == key and (usable is None or usable(entry.thing)):
                    found = entry.thing
                else:
                    dropped.append(entry.thing)
        for thing in dropped:
            _close(thing)
        if found is not None:
            logger.info("%s: those of the previous job", kind.name)
        return found

    def put(self, kind: KeptKind, key: tuple, thing, owner: int | None = None) -> None:
        """Keep ``thing`` (handed out by :meth:`take` or new, after a job that ended well) for the next job."""
        owner = owner if kind.per_owner else None
        self._add(_Entry(kind, owner, key, thing), drop_owners=True)

    def _add(self, entry: _Entry, drop_owners: bool) -> None:
        dropped = []
        with self._lock:
            same = [other for other in self._entries if other.kind is entry.kind]
            for other in [other for other in same if _stale(other.key, entry.key)]:  # its file has changed since
                self._entries.remove(other)
                same.remove(other)
                dropped.append(other.thing)
            if drop_owners:  # one per owner (or one in all, for a process-wide kind)
                for other in [other for other in same if other.owner == entry.owner]:
                    self._entries.remove(other)
                    same.remove(other)
                    if other.thing is not entry.thing:
                        dropped.append(other.thing)
            while len(same) >= entry.kind.most:
                oldest = same.pop(0)
                self._entries.remove(oldest)
                dropped.append(oldest.thing)
            self._entries.append(entry)
        for thing in dropped:
            _close(thing)

    def release(self, owner: int | None = None) -> None:
        """Close what is kept for thread ``owner`` and the process-wide pools (every entry when None)."""
        with self._lock:
            gone = [entry for entry in self._entries
                    if owner is None or entry.owner == owner or entry.kind.process_wide]
            for entry in gone:
                self._entries.remove(entry)
        for entry in gone:
            _close(entry.thing)

    def kept(self, kind: KeptKind) -> list:
        """What is kept of ``kind`` now (tests and the doctor look)."""
        with self._lock:
            return [entry.thing for entry in self._entries if entry.kind is kind]


KEPT = Kept()
