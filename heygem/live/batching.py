"""Live sessions that share one engine: one engine instance and one thread per engine and its files, which
draws the mouths due in every session on it with one engine call.

Each session holds a seat at its engine (:func:`take_seat`). Its render thread hands the seat its request (the
frame, the face, the sound: what the engine's batch function reads) and waits; the engine's thread takes every
request waiting once each seated session has handed one in, or GATHER_SECONDS after the first came (or after
the last call ended, for requests that waited through it), so that one slow session does not hold the others
up, runs the batch function on all of them at once and hands each
session its result. The sessions' frames fall due together (heygem.live.tracks puts every video track on
one grid of frame times), so at 25 frames a second the engine runs about 25 calls a second whatever the
number of sessions, each on as many faces as there are sessions, instead of a call per face: a network on a
GPU drawing one face a call waits on its kernel launches, not its arithmetic.

Errors: the batch function returns an exception in place of the result of a request it could not serve
(that session's render raises it, the others get their frames); an exception it raises reaches every session of
that call; the thread goes on with the next calls either way.

A session's end leaves its seat; the others go on. When the last seat is left the thread ends and the engine is
kept loaded (KEEP_IDLE) for the next session on the same engine, files and options, which takes it back
instead of loading it again (a second or two for Wav2Lip, more for MuseTalk).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

logger = logging.getLogger("heygem")

GATHER_SECONDS = 0.006  # how long the first request of a call waits for the other sessions' requests
KEEP_IDLE = 1  # engines kept loaded per key with no session on them (one engine serves every session of a key)

BatchFunction = Callable[[list], list]  # requests -> one result (or exception) per request, in order


@dataclass
class _Request:
    seat: int
    item: object
    arrived: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class SharedEngine:
    """One engine, the sessions seated at it and the thread that runs their requests in batches."""

    def __init__(self, key: tuple, engine, batch_function: BatchFunction, gather_seconds: float | None = None):
        self.key = key
        self.engine = engine
        self.batch_function = batch_function
        self.gather_seconds = GATHER_SECONDS if gather_seconds is None else gather_seconds
        self.calls = 0  # batch function calls run
        self.frames = 0  # requests they served
        self.busy_seconds = 0.0  # wall seconds spent in the batch function
        self._seats: set[int] = set()
        self._next_seat = 0
        self._waiting: list[_Request] = []
        self._changed = threading.Condition()
        self._ended = False
        self._last_call_end = 0.0  # monotonic time the last call ended
        self._thread = threading.Thread(target=self._run, name=f"heygem-live-{key[0]}", daemon=True)
        self._thread.start()

    def seat(self) -> int:
        with self._changed:
            self._next_seat += 1
            self._seats.add(self._next_seat)
            self._changed.notify_all()
            return self._next_seat

    def leave(self, seat: int) -> None:
        with self._changed:
            self._seats.discard(seat)
            self._changed.notify_all()  # the others' call no longer waits for this seat's request

    def draw(self, seat: int, item):
        """The batch function's result for ``item``, run with the other sessions' requests; its error raised
        here, in the session's thread."""
        request = _Request(seat, item)
        with self._changed:
            if self._ended:
                raise RuntimeError("the live engine's thread has ended")
            self._waiting.append(request)
            self._changed.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.result

    def _gather(self) -> list[_Request] | None:
        """The requests of the next call, or None when no seat is left (the thread then ends)."""
        while True:
            with self._changed:
                while not self._waiting and self._seats:
                    self._changed.wait()
                if self._waiting:
                    # from the first request's arrival, or from the last call's end for requests that waited
                    # through it (their sessions' next frames come back out of step with the others otherwise)
                    deadline = max(self._waiting[0].arrived, self._last_call_end) + self.gather_seconds
                    while not self._seats <= {request.seat for request in self._waiting}:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._changed.wait(left)
                    batch, self._waiting = self._waiting, []
                    return batch
            # no seat and nothing waiting: end, unless a session takes a seat meanwhile (the registry's lock
            # first, as take_seat takes it, so a session never sits at an engine whose thread has ended)
            with _REGISTRY_LOCK, self._changed:
                if self._seats or self._waiting:
                    continue
                self._ended = True
                logger.info("live %s: no session left after %d calls on %d frames (%.2f a call); kept loaded",
                            self.key[0], self.calls, self.frames, self.frames / max(1, self.calls))
                if _SHARED.get(self.key) is self:
                    del _SHARED[self.key]
                idle = _IDLE.setdefault(self.key, [])
                if len(idle) < KEEP_IDLE:
                    idle.append(self.engine)
                return None

    def _run(self) -> None:
        while (batch := self._gather()) is not None:
            self.calls += 1
            self.frames += len(batch)
            started = time.monotonic()
            try:
                results = self.batch_function([request.item for request in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"the live batch gave {len(results)} results for {len(batch)} requests")
            except Exception as error:  # noqa: BLE001 - the call's error goes to each session of the call
                logger.warning("live %s: a call on %d frame(s) failed: %s", self.key[0], len(batch), error)
                results = [error] * len(batch)
            self._last_call_end = time.monotonic()
            self.busy_seconds += self._last_call_end - started
            for request, result in zip(batch, results):
                if isinstance(result, BaseException):
                    request.error = result
                else:
                    request.result = result
                request.done.set()


class Seat:
    """A session's place at a shared engine."""

    def __init__(self, shared: SharedEngine):
        self.shared = shared
        self.number = shared.seat()

    @property
    def engine(self):
        return self.shared.engine

    def draw(self, item):
        return self.shared.draw(self.number, item)

    def leave(self) -> None:
        self.shared.leave(self.number)


_SHARED: dict[tuple, SharedEngine] = {}  # (engine, its files and their stamps, options) -> the engine in use
_IDLE: dict[tuple, list] = {}  # the same keys -> engines no session uses, kept loaded
_REGISTRY_LOCK = threading.Lock()


def take_seat(key: tuple, load: Callable[[], object], batch_function_of: Callable[[object], BatchFunction]) -> Seat:
    """A seat at the engine of ``key``: the one in use, else one kept idle, else ``load()`` (a second session on
    the same key meanwhile waits for that load rather than running its own); ``batch_function_of(engine)`` is
    what its thread runs on each call."""
    with _REGISTRY_LOCK:
        shared = _SHARED.get(key)
        if shared is None:
            idle = _IDLE.get(key)
            engine = idle.pop() if idle else load()
            shared = SharedEngine(key, engine, batch_function_of(engine))
            _SHARED[key] = shared
        return Seat(shared)


class EngineUse(NamedTuple):
    """What a shared engine in use has done so far (for a server's operators and the live benchmark)."""

    name: str  # the engine's name
    sessions: int  # sessions seated at it now
    calls: int  # batch function calls run
    frames: int  # requests (frames) they served
    busy_seconds: float  # wall seconds its thread spent in them: near the wall time, the engine's thread is the wall


def engines_in_use() -> list[EngineUse]:
    """Each shared engine in use and what it has done."""
    with _REGISTRY_LOCK:
        return [EngineUse(key[0], len(shared._seats), shared.calls, shared.frames, shared.busy_seconds)
                for key, shared in _SHARED.items()]
