"""Keep the terminal for heygem's own lines: the native libraries' log lines are dropped.

mediapipe's C++ core logs through absl and TensorFlow Lite's own logger straight to the
process's standard error (file descriptor 2), before any of it can be configured from Python:
"W0000 00:00:... inference_feedback_manager.cc:114] ...", "INFO: Created TensorFlow Lite
XNNPACK delegate for CPU.", "WARNING: All log messages before absl::InitializeLog() ...", and on
machines with a GPU "I0000 ... gl_context_egl.cc:85] Successfully initialized EGL". Neither
absl's nor glog's environment variables reach them in mediapipe 0.10.14, so :func:`quiet`
puts a pipe in front of descriptor 2: a thread copies everything that arrives to the real
standard error at once, except whole lines in those libraries' formats. Python's own
``sys.stderr`` (logging, progress bars, tracebacks) writes to the real standard error
directly, so its lines keep their order with standard output. Processes started from here
inherit the pipe, so their lines pass the same filter. mediapipe's Python side also warns
about a deprecated protobuf call on every graph; that warning is ignored. The command line
and the app call :func:`quiet` first thing; loading mediapipe calls it too.

``HEYGEM_LOG=debug`` (``--verbose`` sets it for the processes it starts) leaves standard
error as it is and shows every line again.
"""

from __future__ import annotations

import atexit
import io
import os
import re
import select
import sys
import threading
import warnings

# the lines the native libraries write: absl / glog ("W0000 00:00:1796159067.957187    1067
# file.cc:114] text") and TensorFlow Lite's minimal logger ("INFO: Created TensorFlow Lite ...").
# One such line can follow a progress bar's unfinished line, so they are looked for anywhere.
LIBRARY_LINE = re.compile(
    rb"(?:[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^\s\]]+:\d+\] "
    rb"|(?:INFO|WARNING|ERROR): (?:Created TensorFlow Lite|Initialized TensorFlow Lite|All log messages before absl))"
    rb"[^\n]*\n"
)
_LIBRARY_START = re.compile(rb"[IWEF]\d{4} \d\d:|(?:INFO|WARNING|ERROR): ")
_LIBRARY_STARTS = (b"INFO: ", b"WARNING: ", b"ERROR: ")
_ABSL_STUB = re.compile(rb"[IWEF]\d{0,4}")
_PROTOBUF_WARNING = r"SymbolDatabase\.GetPrototype\(\) is deprecated"

_lock = threading.Lock()
_filter: _StderrFilter | None = None


def library_logs_shown() -> bool:
    """Whether the libraries' own log lines are wanted (``HEYGEM_LOG=debug``)."""
    return os.environ.get("HEYGEM_LOG", "").strip().lower() == "debug"


def show_library_logs() -> None:
    """Show the libraries' lines in this process and in the processes it starts (``--verbose``)."""
    os.environ["HEYGEM_LOG"] = "debug"


def quiet() -> None:
    """Drop the native libraries' log lines from this process's standard error from now on, unless
    :func:`library_logs_shown`. Call it before loading mediapipe; calling it again does nothing."""
    global _filter
    if library_logs_shown():
        return
    warnings.filterwarnings("ignore", message=_PROTOBUF_WARNING, category=UserWarning)
    with _lock:
        if _filter is None:
            try:
                _filter = _StderrFilter()
            except OSError:  # no descriptor 2 to filter (a daemon with it closed): nothing to do
                return
            atexit.register(_filter.stop)


def is_library_line(line: bytes) -> bool:
    """Whether ``line`` (one whole line, with its end) is a native library's log line."""
    return LIBRARY_LINE.fullmatch(line) is not None


def filter_lines(data: bytes, pending: bytes = b"") -> tuple[bytes, bytes]:
    """(what to write, what to hold): ``pending + data`` without the libraries' lines.

    What follows the last line end is written at once (a progress bar redraws itself with ``\\r``),
    except from where a library line may begin: that part is held until its line is whole.
    """
    text = LIBRARY_LINE.sub(b"", pending + data)
    tail_start = text.rfind(b"\n") + 1
    hold = _held_from(text[tail_start:])
    if hold is None:
        return text, b""
    return text[:tail_start + hold], text[tail_start + hold:]


def _held_from(tail: bytes) -> int | None:
    """Where in ``tail`` (a line's unfinished end) a library line may have begun, or None."""
    found = _LIBRARY_START.search(tail)
    if found is not None:
        return found.start()
    for size in range(min(len(tail), 8), 0, -1):  # a line cut within its first few bytes
        end = tail[-size:]
        if _ABSL_STUB.fullmatch(end) or any(start.startswith(end) for start in _LIBRARY_STARTS):
            return len(tail) - size
    return None


class _StderrFilter:
    """A pipe in place of descriptor 2 and the thread that copies it, filtered, to the real one."""

    HOLD_SECONDS = 0.05  # a held piece with no more data after this long is written as it is

    def __init__(self):
        self._target = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._read_end = read_end
        self._python_stderr = None
        try:
            writes_to_descriptor_2 = sys.stderr is not None and sys.stderr.fileno() == 2
        except (AttributeError, OSError, ValueError):  # a stand-in stream (a test's capture): left as it is
            writes_to_descriptor_2 = False
        if writes_to_descriptor_2:
            self._python_stderr = sys.stderr
            sys.stderr.flush()
            sys.stderr = io.TextIOWrapper(io.FileIO(self._target, "w", closefd=False),
                                          encoding=sys.stderr.encoding, errors=sys.stderr.errors,
                                          line_buffering=True, write_through=True)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._copy, name="heygem-stderr-filter", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        pending = b""
        while True:
            ready, _, _ = select.select([self._read_end], [], [], self.HOLD_SECONDS)
            if not ready:
                if pending:  # nothing completed it: not a library line after all
                    self._write(pending)
                    pending = b""
                if self._stopping.is_set():
                    return
                continue
            data = os.read(self._read_end, 1 << 16)
            if not data:
                self._write(pending)
                return
            kept, pending = filter_lines(data, pending)
            self._write(kept)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self._target, view)
            except OSError:
                return
            view = view[written:]

    def stop(self) -> None:
        """Copy what is still in the pipe, then give descriptor 2 back (at exit)."""
        self._stopping.set()
        self._thread.join(timeout=1.0)
        os.dup2(self._target, 2)
        if self._python_stderr is not None:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            sys.stderr = self._python_stderr
