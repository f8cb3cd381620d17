"""What a saved presenter saves: preparing it once against tracking its face in every job.

    python bench/bench_presenters.py [--seconds 20] [--height 720] [--runs 3]
                                     [--speech assets/speech_en.wav] [--markdown OUT.md]

Makes a ``--seconds`` long clip of the bundled portrait drifting at ``--height`` rows (25 fps),
prepares it as a presenter (heygem.presenters: the quick checks, then the whole clip's track, the
thumbnail, the speech sample) and times that once. Then the same job, the presenter speaking
``--speech``, ``--runs`` times each way, alternated: with the presenter (its track from the avatar
cache) and with the clip as a plain face and ``--no-avatar-cache`` (every frame tracked). Prints a
Markdown table of the medians: the job's total seconds and its faces stage (step 5).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def make_clip(path: Path, seconds: float, height: int) -> None:
    import subprocess

    from heygem.media.ffmpeg import ffmpeg_binary

    width = height * 16 // 9 // 2 * 2
    side = int(width * 1.02)
    drift = (f"scale={side}:{side},crop={width}:{height}:x='{side - width}/2+4*sin(t*3)':"
             f"y='{side // 8}+4*cos(t*2)',format=yuv420p")
    subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-y", "-loop", "1", "-i",
                    str(REPO / "assets" / "astronaut.jpg"), "-vf", drift, "-r", "25", "-t", str(seconds),
                    "-c:v", "libx264", "-preset", "ultrafast", str(path)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--speech", type=Path, default=REPO / "assets" / "speech_en.wav")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="heygem-bench-presenters-"))
    os.environ["HEYGEM_CACHE_DIR"] = str(folder / "avatar-cache")
    from heygem.config import load_config
    from heygem.pipeline import generate
    from heygem.presenters.prepare import job_options, prepare, presenter_config, use_for_job
    from heygem.presenters.records import PresenterStore

    clip = folder / "presenter.mp4"
    make_clip(clip, args.seconds, args.height)
    store = PresenterStore(folder / "outputs")
    started = time.perf_counter()
    presenter = prepare(store, store.create(clip, "bench"))
    prepared_seconds = time.perf_counter() - started
    config = presenter_config(presenter.face_index, load_config())

    rows: dict[str, list[tuple[float, float]]] = {"presenter": [], "plain face, --no-avatar-cache": []}
    for run in range(args.runs):
        face = use_for_job(presenter, config)
        summary = generate(face, args.speech, folder / f"presenter-{run}.mp4", overrides=job_options(presenter, {}))
        assert summary.avatar_cache == "hit", summary.avatar_cache
        rows["presenter"].append((summary.total_seconds, summary.seconds_per_stage.get("faces", 0.0)))
        summary = generate(clip, args.speech, folder / f"plain-{run}.mp4", overrides={"run.avatar_cache": False})
        rows["plain face, --no-avatar-cache"].append((summary.total_seconds,
                                                      summary.seconds_per_stage.get("faces", 0.0)))

    lines = [f"Presenter of {args.seconds:g} s at {args.height} rows prepared once in {prepared_seconds:.1f} s; "
             f"a job speaking {args.speech.name}, median of {args.runs}:", "",
             "| face | job seconds | faces stage seconds |", "| --- | --- | --- |"]
    for name, measured in rows.items():
        lines.append(f"| {name} | {statistics.median(total for total, _ in measured):.2f} | "
                     f"{statistics.median(faces for _, faces in measured):.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
