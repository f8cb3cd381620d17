"""How the pipeline's stages run: one after another, or all at once with bounded queues between them.

A stage is a function from an iterator of items to an iterator of items. It does not know
whether it runs inline or in a thread of its own, so one set of stage functions gives both
the sequential baseline and the concurrent pipeline, and the two can be checked against
each other frame for frame.

- ``run_stages(source, stages, concurrent=False)`` chains the stages as plain generators:
  each item goes all the way through before the next one is read.
- ``concurrent=True`` runs the source and every stage in a thread of its own, joined by
  queues of ``depth`` items, so memory stays bounded however long the video is. The first
  error in any stage stops all of them and is re-raised in the caller, with the stage's name
  added as a note; ``should_stop`` is asked between items and cancels the run.
- ``ordered_map(function, items, workers)`` runs a function over items on several threads at
  once and yields the results in the items' order (face tracking uses it).

Each stage's busy time (inside the stage, not waiting for its neighbours) is added up
per name, so a run can say which stage is the wall, and so is the CPU time its own thread used
meanwhile: a stage busy far longer than its CPU time waits for something else (the GPU, child
processes, a pipe, or other threads holding the interpreter lock).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from heygem.errors import GenerationCancelled
from heygem.runtime import timeline

POLL_SECONDS = 0.1  # how often a blocked queue operation looks whether the run was stopped


@dataclass(frozen=True)
class Stage:
    """A named step: takes an iterator of items and yields items for the next step."""

    name: str
    run: Callable[[Iterator], Iterator]


@dataclass
class StageClock:
    """Busy seconds per stage (the time spent inside a stage, not waiting for its input or output),
    the CPU seconds the stage's own thread used in that time, and when each stage was first and last
    busy (seconds since ``origin``), so that stages that ran at the same time can be drawn on one time line."""

    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)  # stage -> (first start, last end)
    origin: float = field(default_factory=time.perf_counter)  # perf_counter() of the run's start
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, seconds: float, cpu_seconds: float | None = None, started: float | None = None) -> None:
        """``seconds`` more of ``name``, which ended now, or ran from ``started`` (a perf_counter() value)
        for work timed elsewhere (a background load)."""
        ended = time.perf_counter() if started is None else started + seconds
        begun = ended - seconds
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            if cpu_seconds is not None:
                self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + cpu_seconds
            first, last = self.spans.get(name, (begun - self.origin, ended - self.origin))
            self.spans[name] = (min(first, begun - self.origin), max(last, ended - self.origin))


class _Stopped(Exception):
    """Raised inside a stage's input when the run is stopping, so the stage unwinds and cleans up."""


def run_stages(source: Iterable, stages: Sequence[Stage], *, concurrent: bool, depth: int = 1,
               should_stop: Callable[[], bool] | None = None, clock: StageClock | None = None,
               source_name: str = "decode") -> int:
    """Pull every item from ``source`` through ``stages``; returns how many items left the last stage.

    ``source`` is an iterable of items (its time counts as ``source_name``). Raises the first
    error any stage raised (with a note naming the stage), or GenerationCancelled when
    ``should_stop()`` says so.
    """
    clock = clock if clock is not None else StageClock()
    if concurrent:
        return _run_threads(source, stages, depth, should_stop, clock, source_name)
    items = _Timed(_checked(iter(source), should_stop), source_name, clock, upstream=None)
    for stage in stages:
        items = _Timed(stage.run(items), stage.name, clock, upstream=items)
    count = 0
    try:
        for _ in items:
            count += 1
    finally:
        items.close()
    return count


def _checked(items: Iterator, should_stop: Callable[[], bool] | None) -> Iterator:
    """The source's items, cancelled when ``should_stop()`` says so; closing it closes the source."""
    try:
        for item in items:
            if should_stop is not None and should_stop():
                raise GenerationCancelled("the job was cancelled")
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


class _Timed:
    """An inline stage's output: adds the time spent inside the stage itself (its input's time
    taken out) to the clock, and closes the stage and everything before it when closed."""

    def __init__(self, items: Iterator, name: str, clock: StageClock, upstream: _Timed | None):
        self.items = iter(items)
        self.name = name
        self.clock = clock
        self.upstream = upstream
        self.total = 0.0  # seconds spent in this stage and the ones before it
        self.total_cpu = 0.0  # the thread's CPU seconds in the same spans

    def __iter__(self):
        return self

    def __next__(self):
        started, cpu_started = time.perf_counter(), time.thread_time()
        upstream = self.upstream
        upstream_before = (upstream.total, upstream.total_cpu) if upstream is not None else (0.0, 0.0)
        try:
            item = next(self.items)
            timeline.mark(f"first {self.name} batch")
            return item
        finally:
            elapsed, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
            self.total += elapsed
            self.total_cpu += cpu
            if upstream is not None:
                elapsed -= upstream.total - upstream_before[0]
                cpu -= upstream.total_cpu - upstream_before[1]
            self.clock.add(self.name, elapsed, cpu)

    def close(self) -> None:
        close = getattr(self.items, "close", None)
        try:
            if close is not None:
                close()
        finally:
            if self.upstream is not None:
                self.upstream.close()


_END = object()


class _QueueInput:
    """A stage's input in the concurrent run: items from a queue until the end marker or a stop."""

    def __init__(self, source: queue.Queue, stop: threading.Event):
        self.source = source
        self.stop = stop
        self.waited = 0.0  # seconds spent waiting for the previous stage

    def __iter__(self):
        return self

    def __next__(self):
        started = time.perf_counter()
        try:
            while True:
                if self.stop.is_set():
                    raise _Stopped()
                try:
                    item = self.source.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    continue
                if item is _END:
                    raise StopIteration
                return item
        finally:
            self.waited += time.perf_counter() - started


def _put(target: queue.Queue, item, stop: threading.Event) -> bool:
    """Put ``item`` unless the run stops first; False when it stopped."""
    while not stop.is_set():
        try:
            target.put(item, timeout=POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def _run_threads(source: Iterable, stages: Sequence[Stage], depth: int, should_stop, clock: StageClock,
                 source_name: str) -> int:
    stop = threading.Event()
    errors: list[tuple[str, BaseException]] = []
    errors_lock = threading.Lock()
    queues = [queue.Queue(maxsize=depth) for _ in range(len(stages) + 1)]

    def fail(name: str, error: BaseException) -> None:
        with errors_lock:
            errors.append((name, error))
        stop.set()

    def pump(name: str, make_items: Callable[[], Iterator], output: queue.Queue, input_: _QueueInput | None):
        items = None
        try:
            items = make_items()
            while True:
                started, cpu_started = time.perf_counter(), time.thread_time()
                waited_before = input_.waited if input_ is not None else 0.0
                try:
                    item = next(items)
                except StopIteration:
                    break
                busy = time.perf_counter() - started - ((input_.waited - waited_before) if input_ else 0.0)
                clock.add(name, busy, time.thread_time() - cpu_started)
                timeline.mark(f"first {name} batch")
                if not _put(output, item, stop):
                    return
            _put(output, _END, stop)
        except _Stopped:
            pass
        except BaseException as error:  # handed to the caller, which re-raises the first one
            fail(name, error)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                try:
                    close()
                except BaseException as error:  # a stage whose clean-up fails still reports it
                    fail(name, error)

    threads = [threading.Thread(target=pump, name=f"heygem-{source_name}", daemon=True,
                                args=(source_name, lambda: _checked(iter(source), should_stop), queues[0], None))]
    for index, stage in enumerate(stages):
        stage_input = _QueueInput(queues[index], stop)
        threads.append(threading.Thread(
            target=pump, name=f"heygem-{stage.name}", daemon=True,
            args=(stage.name, (lambda run=stage.run, inputs=stage_input: run(inputs)), queues[index + 1],
                  stage_input)))
    for thread in threads:
        thread.start()

    count = 0
    cancelled = False
    try:
        while True:
            if should_stop is not None and should_stop():
                cancelled = True
                stop.set()
                break
            try:
                item = queues[-1].get(timeout=POLL_SECONDS)
            except queue.Empty:
                if stop.is_set():
                    break
                continue
            if item is _END:
                break
            count += 1
    except BaseException:  # KeyboardInterrupt in the caller: stop the stages, then re-raise
        stop.set()
        raise
    finally:
        for thread in threads:
            while thread.is_alive():
                thread.join(POLL_SECONDS)
                if stop.is_set():
                    _drain(queues)
    if errors:
        name, error = errors[0]
        if not isinstance(error, GenerationCancelled):
            error.add_note(f"(in the {name} stage)")
        raise error
    if cancelled:
        raise GenerationCancelled("the job was cancelled")
    return count


def _drain(queues: list[queue.Queue]) -> None:
    """Empty the queues so that no stage stays blocked on a full one while the run stops."""
    for pending in queues:
        try:
            while True:
                pending.get_nowait()
        except queue.Empty:
            pass


def ordered_map(function: Callable, items: Iterable, workers: int, ahead: int | None = None) -> Iterator:
    """``map(function, items)`` on ``workers`` threads, results in the items' order.

    At most ``workers + ahead`` items are in flight, so memory stays bounded. With one worker
    or fewer it is a plain inline map. An error in ``function`` is raised when its result is
    due; closing the iterator cancels what has not started.
    """
    if workers <= 1:
        for item in items:
            yield function(item)
        return
    ahead = workers if ahead is None else ahead
    pending: deque[Future] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="heygem-map") as pool:
        try:
            for item in items:
                pending.append(pool.submit(function, item))
                if len(pending) >= workers + ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
