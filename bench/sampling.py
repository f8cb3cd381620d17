"""Sampling threads of a benchmark's process: :class:`Sampling` calls ``sample()`` every so often while a ``with``
block runs; :class:`ThreadSampler` counts where some of the process's threads spend their wall time."""

from __future__ import annotations

import sys
import threading
from pathlib import Path


class Sampling:
    """A thread that calls ``self.sample()`` every ``interval`` seconds while the ``with`` block runs."""

    def __init__(self, interval: float):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()



class ThreadSampler(Sampling):
    """Where the threads whose names start with ``name`` (a pipeline stage's ``heygem-render``, a live engine's
    ``heygem-live-musetalk``) spend their wall time: their stacks sampled every ``interval`` seconds from a
    thread of its own (cProfile cannot watch one thread alone on Python 3.12), counted per line where a thread
    was (innermost frame) and per function on its stack, waits included."""

    def __init__(self, name: str, interval: float = 0.002):
        super().__init__(interval)
        self.name = name
        self.innermost: dict[str, int] = {}
        self.inclusive: dict[str, int] = {}
        self.samples = 0

    def sample(self) -> None:
        frames = sys._current_frames()
        for thread in threading.enumerate():
            if not thread.name.startswith(self.name) or thread.ident not in frames:
                continue
            frame, seen = frames[thread.ident], set()
            place = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}:{frame.f_lineno}"
            self.innermost[place] = self.innermost.get(place, 0) + 1
            while frame is not None:
                name = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
                if name not in seen:
                    seen.add(name)
                    self.inclusive[name] = self.inclusive.get(name, 0) + 1
                frame = frame.f_back
            self.samples += 1

    def report(self, lines: int = 40) -> str:
        if not self.samples:
            return f"{self.name}: no samples (no thread of that name ran)"
        out = [f"{self.name}: {self.samples} samples every {self.interval * 1000:g} ms", "where (innermost line):"]
        for place, count in sorted(self.innermost.items(), key=lambda item: -item[1])[:lines]:
            out.append(f"  {100 * count / self.samples:5.1f} %  {place}")
        out.append("on the stack (function):")
        for name, count in sorted(self.inclusive.items(), key=lambda item: -item[1])[:lines]:
            out.append(f"  {100 * count / self.samples:5.1f} %  {name}")
        return "\n".join(out)
