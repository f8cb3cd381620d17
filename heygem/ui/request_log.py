"""What the server's log says about a page request that Gradio or the web server refuses before it
reaches heygem's code (a forged event: too few inputs, an unknown event number): one line, not a traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path

import gradio.queueing
import gradio.routes
import gradio.utils

import heygem
from heygem.errors import first_line
from heygem.runtime.library_logs import library_logs_shown

logger = logging.getLogger("heygem")


def one_line_request_errors() -> None:
    """A page request that Gradio or the web server refuses before it reaches heygem's code (a forged
    event: too few inputs, an unknown event number) is logged as one line, not a traceback; a failure
    raised inside heygem keeps its traceback, and so does everything with HEYGEM_LOG=debug or --verbose."""
    if library_logs_shown():
        return
    for module in (gradio.queueing, gradio.routes, gradio.utils):
        module.traceback = _TracebacksOfOurs()  # each calls traceback.print_exc() for an event that failed
    logging.getLogger("uvicorn.error").addFilter(_one_line_unless_ours)


WEB_PACKAGES = ("gradio", "starlette", "fastapi", "uvicorn")  # what serves the page around heygem's code


def _raised_in_heygem(trace) -> bool:
    """Whether the error came from heygem's own code (a bug of ours, worth its traceback): heygem's code is
    in the traceback below every frame of the web server's packages. A page middleware of heygem's that
    only passed the request on (heygem.ui.access) is above them, and does not make the error ours."""
    package = str(Path(heygem.__file__).parent) + os.sep
    ours, web = -1, -1
    for depth, frame in enumerate(traceback.extract_tb(trace)):
        if frame.filename.startswith(package):
            ours = depth
        elif any(f"{os.sep}{name}{os.sep}" in frame.filename for name in WEB_PACKAGES):
            web = depth
    return ours > web


class _TracebacksOfOurs:
    """The traceback module, except that print_exc() writes one line for an error raised outside heygem."""

    def __getattr__(self, name: str):
        return getattr(traceback, name)

    @staticmethod
    def print_exc(*args, **kwargs) -> None:
        kind, problem, trace = sys.exc_info()
        if problem is None or _raised_in_heygem(trace):
            traceback.print_exc(*args, **kwargs)
            return
        logger.warning("a page request was refused: %s: %s", kind.__name__, first_line(problem))


def _one_line_unless_ours(record) -> bool:
    """A logging filter: the web server's record of a failed request, its traceback folded into one line
    when heygem's code is not in it."""
    if record.exc_info and record.exc_info[1] is not None and not _raised_in_heygem(record.exc_info[2]):
        kind, problem = record.exc_info[0], record.exc_info[1]
        record.msg, record.args = f"{record.getMessage().strip()} ({kind.__name__}: {first_line(problem)})", ()
        record.exc_info, record.exc_text = None, None
    return True

