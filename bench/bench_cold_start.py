"""Where a cold ``python -m heygem generate`` spends its start: a timeline from the process's start.

    python bench/bench_cold_start.py --face FACE --audio AUDIO --output OUT.mp4 [-- generate options]
    python bench/bench_cold_start.py --count-lines --face ... (the plain command: how many lines it prints)
    python bench/bench_cold_start.py --warm-worker FACE AUDIO '{"engine.name": "wav2lip"}' RUNS

Runs the generate command in this process exactly as ``python -m heygem generate`` does (same
parser, same entry point), with marks (heygem.runtime.timeline) added from outside around the
steps of a cold start that live below the pipeline: importing torch, starting CUDA, loading the
generator, cuDNN's autotuning and the CUDA graph capture (the generator's first batch), importing
mediapipe and building its graphs, spawning the tracking and rendering processes. The pipeline's
own marks (probe, speech, engine chosen, x264 started, each stage's first batch) come with it.
Prints the timeline, one mark a line, in seconds since the process started; "first encode batch"
is the first frames handed to x264.

``--count-lines`` instead runs ``python -m heygem generate`` as a child and counts the lines it
prints to the terminal (stdout and stderr together): what a user sees of a plain run.

``--warm-worker`` runs a job worker in this process (a server's, without its HTTP layer, for machines
without gradio) and prints, for a warm-up job and then RUNS more, when the first segment was listed
and when the job was done, in seconds from the job's submission to the store.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from pathlib import Path

from heygem.runtime import timeline  # first: the clock reads the process's start time

REPO = Path(__file__).resolve().parent.parent


def _wrap(owner, attribute: str, label: str) -> None:
    """Mark ``label`` when owner.attribute is first called and ``label done`` when that call returns."""
    original = getattr(owner, attribute)

    @functools.wraps(original)
    def marked(*args, **kwargs):
        timeline.mark(label)
        try:
            return original(*args, **kwargs)
        finally:
            timeline.mark(f"{label} done")

    setattr(owner, attribute, marked)


def install_marks(with_torch: bool = True) -> None:
    """Marks around the cold-start steps below the pipeline (only what is installed is wrapped)."""
    from heygem.face import detect

    _wrap(detect, "import_mediapipe", "import mediapipe")
    try:
        from heygem.runtime import processes

        _wrap(processes.ProcessPool, "__init__", "spawn helper processes")
    except (ImportError, AttributeError):
        pass
    try:
        from heygem.face.finder import FaceFinder

        _wrap(FaceFinder, "__init__", "mediapipe graphs")
    except (ImportError, AttributeError):
        pass
    if not with_torch:  # the landmark engine never imports torch on the CPU
        return
    try:
        timeline.mark("import torch")
        import torch

        timeline.mark("import torch done")
    except ImportError:
        return
    if torch.cuda.is_available():
        _wrap(torch.cuda, "init", "CUDA start")
        from heygem.runtime import device

        _wrap(device.FixedBatchRunner, "_capture", "CUDA graph capture")
        _wrap(device.FixedBatchRunner, "__call__", "generator batch (first: cuDNN autotuning)")
    try:
        from heygem.engines.wav2lip.engine import Wav2LipEngine

        _wrap(Wav2LipEngine, "__init__", "load the wav2lip generator")
    except ImportError:
        pass


def count_lines(arguments: list[str]) -> None:
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-m", "heygem", "generate", *arguments], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # bytes: a progress bar's \r stays
    output = child.stdout.decode(errors="replace")
    shown = [line for line in output.split("\n") if line.strip()]  # a progress bar redraws in place
    print(f"exit {child.returncode}, {time.perf_counter() - started:.1f} s, {len(shown)} lines printed:")
    for line in shown:
        print("    " + line.rsplit("\r", 1)[-1][-200:])


def warm_worker(face: Path, audio: Path, options: dict, runs: int) -> None:
    """A job worker in this process (the server's, without HTTP): the first segment of its second job and
    later ones, from the job's submission to the store."""
    import json
    import tempfile

    from heygem.jobs.store import JobStore
    from heygem.jobs.worker import start_workers
    from heygem.media.stream import listed_segments, stream_folder

    with tempfile.TemporaryDirectory(prefix="heygem-warm-") as folder:
        store = JobStore(Path(folder) / "outputs")
        workers = start_workers(store, 1)
        try:
            for run in range(runs + 1):
                started = time.perf_counter()
                job_id = store.create_job(face, audio, options)
                first = None
                while True:
                    job = store.get(job_id)
                    if first is None and listed_segments(stream_folder(job.result_path)):
                        first = time.perf_counter() - started
                    if job.is_finished:
                        break
                    time.sleep(0.005)
                label = "warm-up (first job)" if run == 0 else f"job {run + 1}"
                print(f"{label}: {job.status}, first segment listed {first:.2f} s, done "
                      f"{time.perf_counter() - started:.2f} s after the submission; options {json.dumps(options)}")
        finally:
            for worker in workers:
                worker.stop(wait=30)


def main() -> None:
    arguments = sys.argv[1:]
    if arguments[:1] == ["--count-lines"]:
        count_lines(arguments[1:])
        return
    if arguments[:1] == ["--warm-worker"]:  # --warm-worker FACE AUDIO OPTIONS_JSON RUNS
        import json

        warm_worker(Path(arguments[1]), Path(arguments[2]), json.loads(arguments[3]), int(arguments[4]))
        return
    install_marks(with_torch="landmark" not in arguments)
    timeline.mark("marks installed")
    from heygem.cli import main as heygem_main

    code = heygem_main(["generate", *arguments])
    timeline.mark("command returned")
    print(f"exit {code}; timeline (seconds since the process started):")
    for name, seconds in timeline.marks():
        print(f"  {seconds:7.2f}  {name}")


if __name__ == "__main__":
    main()
