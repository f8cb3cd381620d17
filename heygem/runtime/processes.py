"""Helper processes that take work off the main process's interpreter lock: spawned, one pipe each.

A pool starts ``size`` processes running ``target(connection, *args)``. The target answers each
request with ``(kind, payload)``, or ``("error", text)`` when it failed, and returns when it reads
None or its pipe closes. Processes are spawned, never forked: the parent may have mediapipe or
CUDA loaded, and a fork of either crashes.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from types import SimpleNamespace

logger = logging.getLogger("heygem")

STOP_SECONDS = 5.0  # how long close() waits for a process before terminating it


class WorkerProcessError(RuntimeError):
    """A helper process failed or died; the message carries its exception and traceback."""


def _stop_processes(processes: list, connections: list) -> None:
    """Ask each process to stop, wait a little, then terminate what is left."""
    for connection in connections:
        try:
            connection.send(None)
        except (OSError, ValueError):
            pass
    for process in processes:
        process.join(STOP_SECONDS)
        if process.is_alive():
            process.terminate()
            process.join(STOP_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()
    for connection in connections:
        connection.close()


@contextmanager
def _main_script_left_out():
    """While processes start, keep them from running the parent's main script again.

    A spawned process imports the parent's ``__main__`` anew (as ``__mp_main__``) so that
    functions defined there can be found, unless it is a package's ``__main__`` (``python -m
    heygem``). Started from ``python app.py`` every helper process would import Gradio and the
    whole app (3.5 s and 160 MiB for a landmark rendering process on the 2-core CPU). Helpers run
    heygem's own functions only, so the main module is named ``__main__`` for the moment of the
    start: multiprocessing then leaves it out.
    """
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__spec__", None) is not None:
        yield
        return
    main.__spec__ = SimpleNamespace(name="__main__")
    try:
        yield
    finally:
        main.__spec__ = None


class ProcessPool:
    """``size`` spawned processes running ``target``, one pipe each, named ``heygem-{name}-{index}``.

    ``what`` names them in errors ("landmark rendering process"); ``error`` is the exception type
    raised when one fails or dies. Closed by close(), by garbage collection or at interpreter exit,
    whichever comes first.
    """

    def __init__(self, target, size: int, name: str, what: str, error: type[WorkerProcessError] = WorkerProcessError,
                 args: tuple = ()):
        import multiprocessing
        import weakref

        context = multiprocessing.get_context("spawn")
        self.what = what
        self.error = error
        self.processes, self.connections = [], []
        self._finalizer = weakref.finalize(self, _stop_processes, self.processes, self.connections)
        for index in range(size):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=target, args=(child_end, *args), daemon=True,
                                      name=f"heygem-{name}-{index}")
            with _main_script_left_out():
                process.start()
            child_end.close()
            self.processes.append(process)
            self.connections.append(parent_end)
        logger.debug("%d %ses started", size, what)

    @property
    def size(self) -> int:
        return len(self.processes)

    def alive(self) -> bool:
        """Whether every process still runs (a pool kept idle between jobs is checked before reuse)."""
        return all(process.is_alive() for process in self.processes)

    def send(self, index: int, message: tuple, data=None) -> None:
        """Send ``message`` to process ``index``, then ``data`` (a buffer, e.g. a contiguous array) as raw
        bytes when given: large arrays go without pickling them into a copy first."""
        try:
            self.connections[index].send(message)
            if data is not None:
                self.connections[index].send_bytes(memoryview(data).cast("B"))  # bytes: a 2-D view counts rows
        except OSError as error:
            raise self.error(f"{self.what} {index} is gone (exit code {self.processes[index].exitcode}): "
                             f"{error}") from error

    def receive(self, index: int, expected: str):
        """The payload of process ``index``'s next reply; raises ``error`` if it failed or died."""
        from multiprocessing.connection import wait

        connection, process = self.connections[index], self.processes[index]
        wait([connection, process.sentinel])
        try:
            if not connection.poll():
                raise EOFError
            kind, payload = connection.recv()
        except (EOFError, OSError) as error:
            process.join(1.0)
            raise self.error(f"{self.what} {index} exited unexpectedly (exit code {process.exitcode})") from error
        if kind == "error":
            raise self.error(f"{self.what} {index} failed: {payload}")
        if kind != expected:
            raise self.error(f"{self.what} {index} answered {kind!r}, not {expected!r}")
        return payload

    def close(self) -> None:
        self._finalizer()


def serve(connection, handle, on_error=None) -> None:
    """A helper process's loop: ``handle(kind, payload)`` for each ``(kind, payload)`` request until it
    reads None or its pipe closes. ``handle`` sends its own replies; an exception it raises goes back as
    ``("error", text)`` with its traceback, after ``on_error()`` when given, and the loop goes on.
    Native libraries' log lines are dropped from its standard error first (heygem.runtime.library_logs)."""
    import traceback

    from heygem.runtime import library_logs

    library_logs.quiet()

    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        kind, payload = message
        try:
            handle(kind, payload)
        except Exception as error:  # noqa: BLE001 - every failure goes back to the parent, which raises it
            if on_error is not None:
                on_error()
            connection.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
