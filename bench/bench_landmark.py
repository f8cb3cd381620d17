"""Milliseconds per frame of the built-in landmark engine alone, per worker count.

    python bench/bench_landmark.py [--sizes 1280x720 1920x1080] [--frames 200] [--workers 0 1 2]
                                   [--save-reference FILE | --check-reference FILE] [--profile] [--i420]
                                   [--torch [--device cpu|cuda] [--torch-threads N] [--plan-processes N]]

The input is the one bench_pipeline.py makes (the bundled portrait scaled to cover
the frame, drifting slowly) with the bundled English speech: a few distinct frames
whose landmarks come from mediapipe's face mesh once each, then cycled. Every worker
count must give the same bytes as ``--workers 0``; the script checks that, and
``--save-reference`` / ``--check-reference`` compare against a digest saved by an
earlier version of the engine. ``--i420`` times generate_i420 instead, the path the
pipeline takes: I420 frames in, blended I420 windows out (digests under "WxH i420").
``--torch`` also times the ``--render torch`` path (heygem.render.LandmarkDeviceRender, drawing
with heygem.engines.landmark.device) on ``--device``: regions cut out, uploaded, drawn, copied
back and pasted, per --batch-frames batch, and says how far its frames are from the CPU engine's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import threading
import time
from pathlib import Path

import cv2
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FPS = 25.0
DISTINCT_FRAMES = 8


def make_frames(width: int, height: int, landmarks: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """(DISTINCT_FRAMES, H, W, 3) uint8 frames of the drifting portrait and their face-mesh landmarks
    (found with mediapipe unless given, as (DISTINCT_FRAMES, 468, 2))."""
    portrait = cv2.imread(str(REPO / "assets" / "astronaut.jpg"))
    side = max(width, height) + 40
    scaled = cv2.resize(portrait, (side, side), interpolation=cv2.INTER_CUBIC)
    frames = []
    for index in range(DISTINCT_FRAMES):
        seconds = index / FPS * 6
        x = int((side - width) / 2 + 10 * np.sin(seconds))
        y = int(20 + 8 * np.cos(seconds * 0.7))
        frames.append(np.ascontiguousarray(scaled[y:y + height, x:x + width]))
    if landmarks is not None:
        return np.stack(frames), list(landmarks)
    import mediapipe as mp

    found = []
    with mp.solutions.face_mesh.FaceMesh(static_image_mode=True, max_num_faces=1) as mesh:
        for frame in frames:
            points = mesh.process(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)).multi_face_landmarks[0].landmark
            found.append(np.array([[p.x * width, p.y * height] for p in points], np.float32))
    return np.stack(frames), found


def speech_windows(count: int) -> np.ndarray:
    """(count, 80, 16) mel windows of the bundled speech, looped."""
    from heygem.speech import audio

    mel = audio.melspectrogram(audio.load_audio_16k(REPO / "assets" / "speech_en.wav"))
    starts = audio.mel_window_starts(int(mel.shape[1] * FPS / 80), FPS, mel.shape[1])
    windows = audio.mel_windows(mel, starts)
    return windows[np.arange(count) % len(windows)]


def make_batches(frames: np.ndarray, landmarks: list[np.ndarray], windows: np.ndarray, batch_frames: int):
    from heygem.types import EngineBatch, Face

    height, width = frames.shape[1:3]
    batches = []
    for start in range(0, len(windows), batch_frames):
        indices = np.arange(start, min(start + batch_frames, len(windows)))
        faces = [Face(box=(0, 0, width, height), landmarks=landmarks[i % len(landmarks)]) for i in indices]
        batches.append(EngineBatch(frame_indices=indices.astype(np.int64), frames_bgr=frames[indices % len(frames)],
                                   faces=faces, mel_windows=windows[indices], fps=FPS))
    return batches


def i420_batches(batches) -> list[tuple[np.ndarray, list, np.ndarray]]:
    """(frames_i420 (N, H * 3/2, W) uint8, faces, mel_windows) of each batch, for generate_i420."""
    from heygem.media.frames import bgr_to_yuv420

    return [(np.stack([bgr_to_yuv420(frame) for frame in batch.frames_bgr]), batch.faces, batch.mel_windows)
            for batch in batches]


def children_cpu_seconds() -> float:
    """User plus system CPU seconds of the child processes that have ended and been waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def run_engine(batches, workers: int, stream: bool = False):
    """(patches, seconds per frame after the first batch, seconds of the first batch, CPU seconds
    per frame of this process after the first batch, CPU seconds per frame of the rendering
    processes, their start included): the first batch starts the engine's rendering processes,
    a cost paid once per job."""

    from heygem.config import EngineConfig
    from heygem.engines.landmark.engine import LandmarkEngine

    engine = LandmarkEngine(EngineConfig(), FPS, workers=workers)
    if isinstance(batches[0], tuple):  # from i420_batches
        from heygem.config import BlendConfig

        blend = BlendConfig()

        def generate(batch):
            return engine.generate_i420(*batch, blend)
    else:
        generate = engine.generate
    try:
        started = time.perf_counter()
        patches = list(generate(batches[0]))
        first_seconds = time.perf_counter() - started
        started, started_cpu = time.perf_counter(), time.process_time()
        if stream:  # generate_i420_stream: the next batch is warped while one is handed on
            for windows in engine.generate_i420_stream(iter(batches[1:]), blend):
                patches.extend(windows)
        else:
            for batch in batches[1:]:
                patches.extend(generate(batch))
        steady_frames = sum(len(batch[1] if isinstance(batch, tuple) else batch.faces) for batch in batches[1:])
        per_frame = (time.perf_counter() - started) / steady_frames
        cpu_per_frame = (time.process_time() - started_cpu) / steady_frames
    finally:
        children_before = children_cpu_seconds()
        engine.close()
    children_cpu = children_cpu_seconds() - children_before
    return patches, per_frame, first_seconds, cpu_per_frame, children_cpu / len(patches)


def time_threads(batches, threads: int) -> float:
    """Seconds to warp and finish every frame in a pool of ``threads`` threads (teeth colour
    from the skin: this measures what the GIL lets threads overlap, not the engine)."""
    from concurrent.futures import ThreadPoolExecutor

    from heygem.engines.landmark.drawing import finish_mouth, warp_mouth

    def draw(item):
        frame_bgr, landmarks, openness, width = item
        warped = warp_mouth(frame_bgr, landmarks, openness, width)
        return None if warped is None else finish_mouth(warped, None)

    items = [(batch.frames_bgr[i], batch.faces[i].landmarks, 0.8 * (i % 3) / 2, 0.0)
             for batch in batches for i in range(len(batch.faces))]
    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        list(pool.map(draw, items))
        return time.perf_counter() - started


def pasted_frames(batches, windows) -> np.ndarray:
    """The I420 frames of ``batches`` (from i420_batches) with the CPU engine's ``windows`` pasted in."""
    from heygem.media.frames import paste_i420_window

    frames = np.concatenate([batch[0] for batch in batches])
    for frame, window in zip(frames, windows):
        if window is not None:
            paste_i420_window(frame, window.box, window.planes)
    return frames


def run_torch(batches, device_name: str, processes: int = 0):
    """(frames (N, H * 3/2, W) I420 drawn by the --render torch path, seconds per frame after the first
    batch, seconds of the first batch, a line of each stage's busy seconds with its thread's CPU
    seconds and the CPU seconds of this process and of the rendering processes). The batches go
    through heygem.render.LandmarkDeviceRender's stages, each in its own thread as in the pipeline:
    regions cut into a host buffer and the faces
    planned (in ``processes`` rendering processes, 0: in the stage's thread), uploaded, drawn
    (landmark_torch), copied back and pasted."""
    from heygem.config import Config
    from heygem.engines.landmark.device import LandmarkDeviceRender
    from heygem.engines.landmark.engine import LandmarkEngine
    from heygem.runtime.flow import Stage, StageClock, run_stages
    from heygem.types import FrameBatch

    config = Config()
    config.engine.device = device_name
    windows = np.concatenate([batch[2] for batch in batches])  # (N, 80, 16) every frame's mel window

    class Ready:  # what heygem.render.Prepared gives once the engine and the mel are there
        engine = LandmarkEngine(config.engine, FPS, workers=processes)

        @staticmethod
        def mel_windows(output_indices):
            return windows[output_indices]

    render = LandmarkDeviceRender(Ready(), config)
    timing = {"first": 0.0}
    first_out = threading.Event()

    def frame_batches():
        start, started = 0, time.perf_counter()
        for number, (frames_i420, faces, _) in enumerate(batches):
            if number == 1:  # once the first batch is back and pasted: CUDA started, kernels loaded
                first_out.wait()
                timing["first"] = time.perf_counter() - started
                timing["started"] = time.perf_counter()
            indices = np.arange(start, start + len(faces))
            yield FrameBatch(indices, indices, frames_i420.copy(), faces=faces)
            start += len(faces)

    drawn = []

    def keep(items):
        for batch in items:
            drawn.append(batch.frames_i420)
            first_out.set()
            yield batch

    if processes:
        Ready.engine.rendering_processes()  # started before the clock, as a job's engine starts them while it loads
    clock = StageClock()
    own_before, children_before = time.process_time(), children_cpu_seconds()
    try:
        run_stages(frame_batches(), [*render.stages(), Stage("out", keep)], concurrent=True, clock=clock)
    finally:
        Ready.engine.close()  # waits for the processes, so that their CPU time is counted
    steady_frames = sum(len(batch[1]) for batch in batches[1:])
    per_frame = (time.perf_counter() - timing.get("started", time.perf_counter())) / max(steady_frames, 1)
    children_cpu = children_cpu_seconds() - children_before
    stages = ", ".join(f"{name} {busy:.2f} ({clock.cpu_seconds.get(name, 0.0):.2f})"
                       for name, busy in clock.seconds.items())
    times = (f"busy seconds (the stage thread's CPU seconds): {stages}; CPU seconds: this process "
             f"{time.process_time() - own_before:.2f}, rendering processes {children_cpu:.2f}")
    return np.concatenate(drawn), per_frame, timing["first"], times


def digest(patches) -> str:
    hasher = hashlib.sha256()
    for patch in patches:
        if patch is None:
            hasher.update(b"none")
            continue
        hasher.update(np.array(patch.box, np.int64).tobytes())
        if hasattr(patch, "planes"):  # an I420Window
            hasher.update(patch.planes.tobytes())
            continue
        hasher.update(patch.image_bgr.tobytes())
        hasher.update(patch.mask.tobytes())
    return hasher.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["1280x720", "1920x1080"], help="WIDTHxHEIGHT of the frames")
    parser.add_argument("--frames", type=int, default=200, help="frames per run (the first batch is timed apart)")
    parser.add_argument("--batch-frames", type=int, default=32, help="frames per generate() call")
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2], help="worker counts to time")
    parser.add_argument("--stream", action="store_true", help="with --i420: the batches after the first through "
                        "generate_i420_stream (overlapping in the rendering processes), as the pipeline runs them")
    parser.add_argument("--threads", nargs="*", type=int, default=[],
                        help="also time a pool of this many threads drawing frames without the engine's state")
    parser.add_argument("--repeats", type=int, default=2, help="runs per worker count; the fastest is reported")
    parser.add_argument("--save-reference", type=Path, help="write the digests of workers=0 to this JSON file")
    parser.add_argument("--check-reference", type=Path, help="compare the digests with this JSON file")
    parser.add_argument("--save-inputs", type=Path, help="write the landmarks, mel windows and mel-band centres "
                        "to this .npz, for a machine without mediapipe and librosa")
    parser.add_argument("--inputs", type=Path, help="read them from such a file")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the workers=0 run")
    parser.add_argument("--torch", action="store_true", help="also time the batched torch drawing (--render torch) "
                        "with I420 batches of --batch-frames frames, and compare its frames with the CPU engine's")
    parser.add_argument("--device", default="cpu", help="where --torch draws: cpu, cuda or cuda:N")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch's CPU threads for --torch on the CPU "
                        "(0: torch's default; 1 is steadier on a busy machine)")
    parser.add_argument("--plan-processes", type=int, default=0, help="with --torch: rendering processes that "
                        "plan the faces (geometry and source colours; 0: the plan stage's own thread)")
    parser.add_argument("--i420", action="store_true", help="time generate_i420 (I420 frames in, blended I420 "
                        "windows out, as the pipeline runs the engine) instead of generate (BGR patches)")
    args = parser.parse_args()

    inputs = dict(np.load(args.inputs)) if args.inputs else {}
    if inputs:
        from heygem.engines.landmark import mouth_shapes

        mouth_shapes.mel_band_centres_hz = lambda: inputs["band_centres_hz"]
    saved_inputs = {}
    reference = json.loads(args.check_reference.read_text()) if args.check_reference else {}
    saved = {}
    for size in args.sizes:
        width, height = (int(v) for v in size.lower().split("x"))
        frames, landmarks = make_frames(width, height, inputs.get(f"landmarks_{size}"))
        windows = inputs["windows"][:args.frames] if inputs else speech_windows(args.frames)
        saved_inputs[f"landmarks_{size}"] = np.stack(landmarks)
        saved_inputs["windows"] = windows
        batches = make_batches(frames, landmarks, windows, args.batch_frames)
        if args.i420:
            batches = i420_batches(batches)
        label = f"{size} i420" if args.i420 else size
        baseline = run_engine(batches, 0)[0]
        expected = digest(baseline)
        saved[label] = expected
        if label in reference:
            print(f"{label}: {'same bytes as' if reference[label] == expected else 'DIFFERENT from'} the reference")
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.runcall(run_engine, batches, 0)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        for workers in args.workers:
            best, first, own_cpu, workers_cpu = (float("inf"),) * 4
            for _ in range(args.repeats):
                patches, per_frame, first_seconds, cpu, children_cpu = run_engine(batches, workers,
                                                                                  args.stream and args.i420)
                assert digest(patches) == expected, f"workers={workers} changed the output"
                best, first = min(best, per_frame), min(first, first_seconds)
                own_cpu, workers_cpu = min(own_cpu, cpu), min(workers_cpu, children_cpu)
            print(f"{label} workers={workers}: {1000 * best:.2f} ms/frame ({1 / best:.1f} frames/s); "
                  f"first batch {first:.2f} s; CPU ms/frame: this process {1000 * own_cpu:.2f}, "
                  f"rendering processes {1000 * workers_cpu:.2f}")
        if args.torch:
            if args.torch_threads:
                import torch

                torch.set_num_threads(args.torch_threads)
            torch_batches = batches if args.i420 else i420_batches(batches)
            reference_windows = baseline if args.i420 else run_engine(torch_batches, 0)[0]
            expected_frames = pasted_frames(torch_batches, reference_windows)
            best, first = float("inf"), float("inf")
            for _ in range(args.repeats):
                drawn, per_frame, first_seconds, times = run_torch(torch_batches, args.device,
                                                                   args.plan_processes)
                best, first = min(best, per_frame), min(first, first_seconds)
                print(f"{size} torch run: {times}")
            luma = slice(0, height)
            difference = np.abs(drawn[:, luma].astype(np.int16) - expected_frames[:, luma])
            changed = (drawn[:, luma] != np.concatenate([batch[0] for batch in torch_batches])[:, luma])
            print(f"{size} torch on {args.device}, batches of {args.batch_frames}, {args.plan_processes} planning "
                  f"processes: {1000 * best:.2f} ms/frame "
                  f"({1 / best:.1f} frames/s); first batch {first:.2f} s; Y against the CPU engine: "
                  f"mean {difference[changed].mean():.3f} over the {int(changed.sum() / len(drawn))} changed "
                  f"bytes per frame, max {int(difference.max())}")
        for threads in args.threads:
            best = min(time_threads(batches, threads) for _ in range(args.repeats))
            print(f"{size} threads={threads}: {1000 * best / args.frames:.2f} ms/frame "
                  f"({args.frames / best:.1f} frames/s)")
    if args.save_inputs:
        from heygem.engines.landmark.mouth_shapes import mel_bands

        np.savez_compressed(args.save_inputs, band_centres_hz=mel_bands().centres_hz, **saved_inputs)
    if args.save_reference:  # added to what the file holds already
        if args.save_reference.exists():
            saved = {**json.loads(args.save_reference.read_text()), **saved}
        args.save_reference.write_text(json.dumps(saved, indent=1))


if __name__ == "__main__":
    main()
