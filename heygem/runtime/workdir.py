"""A run's work folder: what the pipeline keeps on disk while it renders (the landmarks of step 5, the
source's frames), in ``$HEYGEM_WORK_DIR`` (a server sets it to ``<outputs>/tmp``) or else the system's temp
folder. Each is named after the process that made it (heygem-PID@HOST-xxxx), so that a later start removes
those a killed process left (:func:`sweep_work_dirs`) and never one in use.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

WORK_DIR_VARIABLE = "HEYGEM_WORK_DIR"
_NAME = re.compile(r"^heygem-(?P<pid>[0-9]+)@(?P<host>.+)-[^-]+$")


def new_work_dir() -> Path:
    """A new, empty work folder of this process; the caller removes it when the run ends."""
    folder = os.environ.get(WORK_DIR_VARIABLE) or None
    if folder is not None:
        Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"heygem-{os.getpid()}@{socket.gethostname()}-", dir=folder))


def sweep_work_dirs(folder: Path) -> list[Path]:
    """Remove the work folders in ``folder`` of processes of this machine that are gone; return them."""
    removed = []
    for path in Path(folder).glob("heygem-*@*"):
        named = _NAME.match(path.name)
        if named is None or named["host"] != socket.gethostname() or _running(int(named["pid"])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
