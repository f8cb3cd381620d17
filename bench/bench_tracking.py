"""Face tracking alone: frames/s and CPU milliseconds per frame, per number of tracking threads.

    python bench/bench_tracking.py [--size 1920x1080] [--seconds 12] [--threads 1 8 16]
                                   [--opencv-threads N] [--passes 2] [--inputs DIR]

The frames are those bench_pipeline.py makes (the bundled portrait drifting slowly), decoded to
I420 as the pipeline decodes them. They are tracked as the pipeline tracks them: runs of
``--run-frames`` new frames, each from a fresh start, on a pool of face finders shared by the
threads (heygem.face.finder.FinderPool). ``--opencv-threads`` sets OpenCV's own thread pool first (0
leaves it as it comes; the pipeline sets 1 when several threads track). The CPU time is the whole
process's, mediapipe's graph threads included.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def decoded_frames(video: Path) -> np.ndarray:
    """(N, H * 3/2, W) uint8 I420 frames of ``video``."""
    from heygem.media.decode import iter_video_i420
    from heygem.media.probing import probe, working_geometry

    info = probe(video)
    return np.concatenate(list(iter_video_i420(info, working_geometry(info, None), 32)))


def track_all(pool, frames: np.ndarray, threads: int, run_frames: int, passes: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, frames) for tracking every run of ``frames`` ``passes`` times."""
    from heygem.media.frames import I420Frames

    starts = [start for _ in range(passes) for start in range(0, len(frames), run_frames)]
    runs = [I420Frames(frames[start:start + run_frames]) for start in starts]
    wall, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(max_workers=threads) as executor:
        results = list(executor.map(pool.track_run, runs))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if any(landmarks is None for run in results for landmarks in run):
        raise SystemExit("a frame without a face: the input is not the one this benchmark expects")
    return wall, cpu, sum(len(run) for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1920x1080", help="frame size WxH")
    parser.add_argument("--seconds", type=float, default=12.0, help="length of the input at 25 fps")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 8, 16], help="tracking threads to time")
    parser.add_argument("--run-frames", type=int, default=21, help="frames per run (the pipeline's 1080p batch)")
    parser.add_argument("--passes", type=int, default=2, help="times every run is tracked per measurement")
    parser.add_argument("--opencv-threads", type=int, default=0, help="OpenCV's own pool (0: as it comes)")
    parser.add_argument("--inputs", type=Path, help="folder for the generated input, kept and reused")
    args = parser.parse_args()

    import cv2
    from bench_pipeline import make_inputs

    from heygem.config import FaceConfig
    from heygem.face.finder import FinderPool

    if args.opencv_threads:
        cv2.setNumThreads(args.opencv_threads)
    width, height = (int(side) for side in args.size.split("x"))
    with tempfile.TemporaryDirectory() as temporary:
        video, _ = make_inputs(args.inputs or Path(temporary), args.seconds, width, height)
        frames = decoded_frames(video)
    print(f"{len(frames)} frames {width}x{height}, runs of {args.run_frames}, OpenCV threads {cv2.getNumThreads()}")
    print("| threads | frames/s | CPU ms per frame |")
    print("| ---: | ---: | ---: |")
    for threads in args.threads:
        with FinderPool(FaceConfig(), threads) as pool:
            track_all(pool, frames[: args.run_frames * threads], threads, args.run_frames, 1)  # graphs warmed up
            wall, cpu, count = track_all(pool, frames, threads, args.run_frames, args.passes)
        print(f"| {threads} | {count / wall:.1f} | {cpu / count * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
