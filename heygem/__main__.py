"""``python -m heygem`` and the ``heygem`` command: see heygem.cli.

A command that finished leaves without tearing the interpreter down: the teardown after
``import torch`` alone takes 0.4 s on a 2-core CPU, and at that point nothing is left to do.
The exit is the last exit handler: threads are joined and every handler registered after the
command's start (logging's, temporary folders' finalizers, multiprocessing's) has run before it.
"""

import atexit
import os
import sys

_exit_code: list[int] = []


def _leave_now() -> None:
    """Registered first, so run last; exits with the command's code once it returned one."""
    if not _exit_code or "coverage" in sys.modules:  # a tool that writes its data at exit gets a normal one
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_exit_code[0])


def run() -> None:
    """Run the command line and exit with its status (the ``heygem`` console script)."""
    atexit.register(_leave_now)
    from heygem.runtime import timeline

    timeline.mark("python started heygem")
    # imported after the exit handler is registered: the handlers the command registers run before it
    from heygem.cli import main

    timeline.mark("command line imported")

    _exit_code.append(main() or 0)
    sys.exit(_exit_code[0])


if __name__ == "__main__":
    run()
