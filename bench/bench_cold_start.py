"""Where a cold ``python -m heygem generate`` spends its start: a timeline from the process's start.

    python bench/bench_cold_start.py --face FACE --audio AUDIO --output OUT.mp4 [-- generate options]
    python bench/bench_cold_start.py --count-lines --face ... (the plain command: how many lines it prints)
    python bench/bench_cold_start.py --warm-worker FACE AUDIO '{"engine.name": "wav2lip"}' RUNS
    python bench/bench_cold_start.py --generator heuristics|autotune (a GPU: the generator's start alone)
    python bench/bench_cold_start.py --compare RUNS SECONDS CHECK_SECONDS TREE... [-- generate options]

Runs the generate command in this process exactly as ``python -m heygem generate`` does (same
parser, same entry point), with marks
(heygem.runtime.timeline) added from outside around the steps of a cold start that live below
the pipeline: loading the generator, the CUDA graph capture, the generator's first batch,
importing mediapipe and building its graphs, spawning the tracking and rendering processes. The
product's own marks (torch imported, CUDA started, the generator's warm-up, probe,
speech, engine chosen, x264 started, each stage's first batch) come with it.
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


def install_marks() -> None:
    """Marks around the cold-start steps below the pipeline (only what is installed is wrapped). Nothing
    here imports torch: the run imports it where a plain run does (the engine's loading marks that, and
    CUDA's start and the generator's warm-up)."""
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
    from heygem.runtime import device

    _wrap(device.FixedBatchRunner, "_capture", "CUDA graph capture")
    _wrap(device.FixedBatchRunner, "__call__", "generator's first batch")
    try:
        from heygem.engines.wav2lip import Wav2LipKind

        _wrap(Wav2LipKind, "load", "load the wav2lip generator")
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


def generator_start(mode: str, batches: int = 24) -> None:
    """The wav2lip generator alone on the GPU (random init, batches of 64, fp16, channels-last, CUDA graph), in
    a fresh process: the warm-up's seconds (cuDNN's kernel choice, three eager passes, the graph capture) and
    the median milliseconds of a batch after it, with cuDNN's heuristics (``heuristics``, what heygem does)
    or its autotuner (``autotune``: cudnn.benchmark on, as heygem had it)."""
    import statistics

    started = time.perf_counter()
    import torch

    from heygem.models.wav2lip import Wav2Lip, fold_batchnorm
    from heygem.runtime.device import FixedBatchRunner, configure_backends

    device = torch.device("cuda")
    configure_backends(device=device)
    torch.backends.cudnn.benchmark = mode == "autotune"
    model = Wav2Lip().to(device)
    fold_batchnorm(model)
    torch.cuda.synchronize()
    ready = time.perf_counter()
    runner = FixedBatchRunner(model, device, 64, channels_last=True, use_cuda_graph=True, name="wav2lip generator")
    runner.warm_up(((1, 80, 16), torch.float32), ((6, 96, 96), torch.float32))
    warm = time.perf_counter() - ready
    generator = torch.Generator(device=device).manual_seed(0)
    times = []
    for _ in range(batches):
        mel = torch.randn((64, 1, 80, 16), device=device, generator=generator)
        faces = torch.rand((64, 6, 96, 96), device=device, generator=generator)
        torch.cuda.synchronize()
        begin = time.perf_counter()
        runner(mel, faces)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    print(f"generator, cuDNN {mode}: torch imported and model on the GPU {ready - started:.2f} s, warm-up "
          f"{warm:.2f} s, a batch of 64 after it {1000 * statistics.median(times):.2f} ms (median of {batches}), "
          f"so {batches} batches (a minute of 25 fps) {sum(times):.2f} s")


def _timeline_of(log: str) -> dict[str, float]:
    """The marks of the timeline line a -v run logs at its end: {name: seconds since the process started}."""
    import re

    for line in log.splitlines():
        if "timeline (seconds since the process started):" in line:
            text = line.split("started):", 1)[1]
            return {name.strip(): float(seconds) for name, seconds in re.findall(r"([^,]+?) ([0-9.]+) s(?:,|$)", text)}
    return {}


def _decoded_md5(video: Path) -> str:
    import hashlib

    from heygem.media.ffmpeg import ffmpeg_binary

    frames = subprocess.run([ffmpeg_binary(), "-v", "error", "-i", str(video), "-f", "rawvideo", "-pix_fmt", "yuv420p",
                             "-"], check=True, stdout=subprocess.PIPE).stdout
    return hashlib.md5(frames).hexdigest()


def compare(trees: list[Path], runs: int, seconds: float, check_seconds: float, options: list[str]) -> None:
    """Cold ``python -m heygem -v generate`` runs of each tree (a checkout of heygem), alternated, each in a fresh
    process with an empty avatar cache: the wall time, the first encoded frame and the end (the timeline the run
    logs); then the MD5 of the decoded frames of a short run of each, default and --deterministic."""
    import os
    import shutil
    import statistics
    import tempfile

    sys.path.insert(0, str(REPO / "bench"))
    from bench_pipeline import make_inputs

    folder = Path(tempfile.mkdtemp(prefix="heygem-cold-"))
    video, speech = make_inputs(folder / "inputs", seconds, 1920, 1080)
    short_video, short_speech = make_inputs(folder / "inputs", check_seconds, 1920, 1080)
    environment = dict(os.environ, PYTHONUNBUFFERED="1")
    if "landmark" not in options and "HEYGEM_WEIGHTS" not in os.environ:  # random init in the official layout
        import torch

        from heygem.models.wav2lip import Wav2Lip

        torch.manual_seed(0)
        (folder / "weights").mkdir()
        torch.save({"state_dict": Wav2Lip().state_dict()}, folder / "weights" / "wav2lip.pth")
        environment["HEYGEM_WEIGHTS"] = str(folder / "weights")

    def one(tree: Path, face: Path, audio: Path, extra: list[str], name: str) -> tuple[float, dict, Path]:
        shutil.rmtree(folder / "avatar-cache", ignore_errors=True)
        output = folder / f"{name}.mp4"
        python_path = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
        started = time.perf_counter()
        child = subprocess.run([sys.executable, "-m", "heygem", "-v", "generate", "--face", str(face), "--audio",
                                str(audio), "--output", str(output), *options, *extra], cwd=tree,
                               env=dict(environment, PYTHONPATH=python_path,
                                        HEYGEM_CACHE_DIR=str(folder / "avatar-cache")),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        wall = time.perf_counter() - started
        if child.returncode != 0:
            print(child.stdout[-3000:])
            raise SystemExit(f"{tree}: exit {child.returncode}")
        return wall, _timeline_of(child.stdout), output

    results: dict[Path, list[tuple[float, dict]]] = {tree: [] for tree in trees}
    for run in range(runs):
        for number, tree in enumerate(trees):
            wall, marks, _ = one(tree, video, speech, [], f"run{run}-{number}")
            results[tree].append((wall, marks))
            print(f"{tree.name} run {run + 1}: wall {wall:.2f} s; timeline: "
                  + ", ".join(f"{name} {value:.2f}" for name, value in marks.items()), flush=True)
    print(f"cold runs, {seconds:g} s of 1920x1080 at 25 fps, options {' '.join(options)} (median of {runs}):")
    for tree in trees if runs else []:
        walls = [wall for wall, _ in results[tree]]
        firsts = [marks.get("first encode batch", float("nan")) for _, marks in results[tree]]
        print(f"  {tree.name}: wall {statistics.median(walls):.2f} s ({', '.join(f'{w:.2f}' for w in walls)}), "
              f"first encode batch {statistics.median(firsts):.2f} s ({', '.join(f'{f:.2f}' for f in firsts)})")
    for extra in ([], ["--deterministic"]):
        hashes = []
        for number, tree in enumerate(trees):
            _, _, output = one(tree, short_video, short_speech, extra, f"check{number}{len(extra)}")
            hashes.append(_decoded_md5(output))
        same = "the same" if len(set(hashes)) == 1 else "DIFFERENT"
        print(f"decoded frames of {check_seconds:g} s {' '.join(extra) or '(default)'}: {same}: "
              + ", ".join(f"{tree.name} {digest}" for tree, digest in zip(trees, hashes)), flush=True)
    shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    arguments = sys.argv[1:]
    if arguments[:1] == ["--compare"]:  # --compare RUNS SECONDS CHECK_SECONDS TREE... [-- generate options]
        options = arguments[arguments.index("--") + 1:] if "--" in arguments else []
        head = arguments[1:arguments.index("--")] if "--" in arguments else arguments[1:]
        compare([Path(tree).resolve() for tree in head[3:]], int(head[0]), float(head[1]), float(head[2]), options)
        return
    if arguments[:1] == ["--generator"]:  # --generator heuristics|autotune
        generator_start(arguments[1])
        return
    if arguments[:1] == ["--count-lines"]:
        count_lines(arguments[1:])
        return
    if arguments[:1] == ["--warm-worker"]:  # --warm-worker FACE AUDIO OPTIONS_JSON RUNS
        import json

        warm_worker(Path(arguments[1]), Path(arguments[2]), json.loads(arguments[3]), int(arguments[4]))
        return
    install_marks()
    timeline.mark("marks installed")
    from heygem.cli import main as heygem_main

    code = heygem_main(["generate", *arguments])
    timeline.mark("command returned")
    print(f"exit {code}; timeline (seconds since the process started):")
    for name, seconds in timeline.marks():
        print(f"  {seconds:7.2f}  {name}")


if __name__ == "__main__":
    main()
