"""Several jobs at once: one GPU against two, through the batch command.

    python bench/bench_jobs.py [--jobs 4] [--seconds 20] [--size 1920x1080] [--markdown OUT.md]
                               [--runs "one GPU" "two GPUs" "two GPUs, Ray"]

Makes ``--jobs`` face/audio pairs (the synthetic input of bench_pipeline.py, each with its own
copy of the video so that no avatar cache is shared between them), then runs
``python -m heygem batch`` on them once per run, each in a fresh process with a fresh job store:

- "one GPU": one local worker on cuda:0 (--devices cuda:0);
- "two GPUs": one local worker per GPU (--devices cuda:0,cuda:1);
- "two GPUs, Ray": a local Ray cluster started by the command (--ray), one task per GPU.

Prints the wall time of each whole command (imports, engine loads and every job included), the
frames made per second over all jobs, and checks that every job is done with an MP4 of the
expected frame count.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

RUNS = {
    "one GPU": ["--devices", "cuda:0"],
    "two GPUs": ["--devices", "cuda:0,cuda:1"],
    "two GPUs, Ray": ["--ray"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4, help="face/audio pairs in the batch")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each input")
    parser.add_argument("--size", default="1920x1080", help="WIDTHxHEIGHT of the inputs")
    parser.add_argument("--engine", default="wav2lip", choices=["wav2lip", "landmark"])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="NAME",
                        help="which runs, in this order: " + ", ".join(RUNS))
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--logs", type=Path, help="a folder for each run's stderr")
    args = parser.parse_args()

    from bench_pipeline import machine_description, make_inputs

    width, height = (int(value) for value in args.size.lower().split("x"))
    with tempfile.TemporaryDirectory(prefix="heygem-jobs-") as folder_name:
        folder = Path(folder_name)
        environment = dict(os.environ, PYTHONUNBUFFERED="1", HEYGEM_CACHE_DIR=str(folder / "avatar-cache"))
        if args.engine == "wav2lip":
            import torch

            from heygem.models.wav2lip import Wav2Lip

            weights = folder / "weights"
            weights.mkdir()
            torch.save({"state_dict": Wav2Lip().state_dict()}, weights / "wav2lip.pth")
            environment["HEYGEM_WEIGHTS"] = str(weights)
        video, audio = make_inputs(folder, args.seconds, width, height)
        inputs = folder / "inputs"
        inputs.mkdir()
        for index in range(args.jobs):
            shutil.copy(video, inputs / f"job{index}.mp4")
            shutil.copy(audio, inputs / f"job{index}.wav")
            with open(inputs / f"job{index}.mp4", "ab") as copy:  # a different file: no shared avatar cache
                copy.write(b"\0" * (index + 1))
        expected_frames = round(args.seconds * 25)

        rows = ["| run | jobs | wall s | frames/s over all jobs | done |", "| --- | ---: | ---: | ---: | --- |"]
        print(f"machine: {machine_description()}")
        print(f"{args.jobs} jobs of {width}x{height}, 25 fps, {args.seconds:g} s each, {args.engine} engine\n")
        print(rows[0])
        for name in args.runs:
            output = folder / f"out-{name.replace(' ', '-').replace(',', '')}"
            shutil.rmtree(folder / "avatar-cache", ignore_errors=True)
            command = [sys.executable, "-m", "heygem", "batch", str(inputs), "--output", str(output),
                       "--jobs-dir", str(output / "jobs"), "--engine", args.engine, "--quiet", *RUNS[name]]
            started = time.perf_counter()
            finished = subprocess.run(command, env=environment, cwd=REPO, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - started
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                (args.logs / f"{output.name}.log").write_text(finished.stderr, encoding="utf-8")
            done = _check(output, args.jobs, expected_frames) if finished.returncode == 0 else \
                f"exit {finished.returncode}: {(finished.stderr.strip().splitlines() or ['?'])[-1]}"
            row = f"| {name} | {args.jobs} | {wall:.1f} | {args.jobs * expected_frames / wall:.1f} | {done} |"
            rows.append(row)
            print(row, flush=True)
        if args.markdown:
            args.markdown.write_text(f"Machine: {machine_description()}\n\n{args.jobs} jobs of {width}x{height}, "
                                     f"25 fps, {args.seconds:g} s each, {args.engine} engine\n\n"
                                     + "\n".join(rows) + "\n", encoding="utf-8")


def _check(output: Path, jobs: int, expected_frames: int) -> str:
    """'all N' when summary.csv lists every job done with an MP4 of the expected frame count."""
    import av

    summary = output / "summary.csv"
    if not summary.is_file():
        return "no summary.csv"
    with open(summary, newline="", encoding="utf-8") as handle:
        items = list(csv.DictReader(handle))
    done = [item for item in items if item.get("status") == "done"]
    wrong = []
    for item in done:
        with av.open(str(output / item["output"])) as container:
            if container.streams.video[0].frames != expected_frames:
                wrong.append(item)
    if len(done) != jobs or wrong:
        return f"{len(done)} of {jobs} done, {len(wrong)} with a wrong frame count"
    return f"all {jobs}"


if __name__ == "__main__":
    main()
