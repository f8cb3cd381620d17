"""Spawned helper processes (heygem.runtime.processes): what they run and what they leave out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
from pathlib import Path

with Path({marker!r}).open("a") as marker:  # runs again in every process that imports this script
    marker.write("imported\\n")

if __name__ == "__main__":
    import sys

    from heygem.engines.landmark.processes import LandmarkWorkerError, RenderPool

    pool = RenderPool(2)
    try:
        for index in range(2):
            pool.send(index, ("no such request", None))
            try:
                pool.receive(index, "anything")
            except LandmarkWorkerError as error:
                print("answered:", str(error).splitlines()[0])
    finally:
        pool.close()
    print("main spec after the start:", sys.modules["__main__"].__spec__)
"""


def test_helper_processes_started_from_a_script_do_not_run_the_script_again(tmp_path):
    # python app.py is such a script: its helpers would import Gradio and the whole app again
    marker = tmp_path / "imports.txt"
    script = tmp_path / "launcher.py"
    script.write_text(SCRIPT.format(marker=str(marker)))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    answers = [line for line in result.stdout.splitlines() if line.startswith("answered:")]
    assert len(answers) == 2 and all("failed: ValueError: unknown message 'no such request'" in line
                                     for line in answers)
    assert marker.read_text() == "imported\n"  # the parent's import only
    assert "main spec after the start: None" in result.stdout  # the script's module is as it was
