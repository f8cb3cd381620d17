"""The torch render stage alone: frames per second of heygem.render.Wav2LipDeviceRender on synthetic batches.

    python bench/bench_render.py [--size 1920x1080] [--batch 21] [--batches 30] [--device cuda]
                                 [--landmarks] [--sections]

Builds the wav2lip engine from a random-init checkpoint in the official layout, a batch of
synthetic I420 frames with one face box each (a ~40 % of the height box, the ellipse mask
that faces without landmarks get), and times the render stage on them batch after batch
(face regions out of the frames, upload, crop, generator, sharpen, paste, download, back
into the frames), after three warm-up batches, with its two stages in threads of their own as
the pipeline runs them.

--landmarks: the frames are the bundled portrait (as bench_landmark.py makes them) with its
face-mesh landmarks found by mediapipe and the tracker's boxes, so the mask is the lower-face
hull a tracked video gets. --sections: a second timed pass that waits for the GPU after each
step (crop, generator, sharpen, paste; the rest is the host side: cutting the regions out, the
copies, pasting back) and prints the milliseconds of each per batch; waiting changes the
total, so the first pass's figure is the one to quote.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1920x1080")
    parser.add_argument("--batch", type=int, default=21, help="frames per batch (the pipeline's for 1080p I420)")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--landmarks", action="store_true", help="the portrait with real landmarks and tracked boxes")
    parser.add_argument("--sections", action="store_true", help="also time each step, waiting for the GPU after it")
    args = parser.parse_args()

    started = time.perf_counter()
    import numpy as np
    import torch

    torch_seconds = time.perf_counter() - started

    from heygem.config import Config, EngineConfig
    from heygem.engines.wav2lip.device import Wav2LipDeviceRender
    from heygem.engines.wav2lip.engine import Wav2LipEngine
    from heygem.models.wav2lip import Wav2Lip
    from heygem.render.restore import Restoration
    from heygem.speech import audio
    from heygem.types import Face, FrameBatch

    width, height = (int(v) for v in args.size.lower().split("x"))
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = Path(folder) / "wav2lip.pth"
        torch.save({"state_dict": Wav2Lip().state_dict()}, checkpoint)
        started = time.perf_counter()
        engine = Wav2LipEngine(checkpoint, EngineConfig(device=args.device))
        engine_seconds = time.perf_counter() - started
    device = engine.device

    def synchronise():
        if device.type == "cuda":
            torch.cuda.synchronize()

    rng = np.random.default_rng(0)
    if args.landmarks:
        frames, faces = _portrait_batch(width, height, args.batch)
    else:
        side = int(0.4 * height)
        x1, y1 = (width - side) // 2, (height - side) // 2
        faces = [Face(box=(x1 + i % 5, y1 + i % 3, x1 + side + i % 5, y1 + side + i % 3)) for i in range(args.batch)]
        frames = rng.integers(16, 235, (args.batch, height * 3 // 2, width), dtype=np.uint8)
    mel = rng.uniform(-4, 4, (80, 80 * 60)).astype(np.float32)

    class Ready:  # what heygem.render.Prepared gives once the engine and the mel are there
        def __init__(self):
            self.engine = engine

        @staticmethod
        def mel_windows(output_indices):
            return audio.mel_windows(mel, output_indices % 4000)

    Ready.restoration = Restoration("sharpen", Config().restore.strength)
    render = Wav2LipDeviceRender(Ready(), Config())
    timings = {"whole batch": 0.0}

    def batches():
        for index in range(args.batches + 3):  # three to warm up (cuDNN autotuning, CUDA graph capture)
            if index == 3:
                timings["whole batch"] = 0.0
            yield FrameBatch(np.arange(args.batch) + index * args.batch, np.arange(args.batch), frames.copy(),
                             faces=faces)

    # the render stages as the pipeline runs them: each in a thread of its own, queues between them
    from heygem.runtime.flow import Stage, StageClock, run_stages

    clock = StageClock()
    warm = threading.Event()

    def count_out(done_batches):
        for count, batch in enumerate(done_batches, start=1):
            if count == 3:
                warm.set()
            yield batch

    run_stages(_started_after_warm_up(batches(), timings, warm), [*render.stages(), Stage("out", count_out)],
               concurrent=True, clock=clock)
    synchronise()
    timings["whole batch"] = time.perf_counter() - timings["started"]
    frame_total = args.batch * args.batches
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; {width}x{height}, batches of {args.batch}, {args.batches} batches"
          + (", portrait with landmarks" if args.landmarks else ""))
    print(f"import torch {torch_seconds:.1f} s; "
          f"build the engine (CUDA start, weights, cuDNN check) {engine_seconds:.1f} s")
    busy = ", ".join(f"{name} {1000 * seconds / (args.batches + 3):.2f}" for name, seconds in clock.seconds.items()
                     if name in ("render", "paste"))
    print(f"render stages: {1000 * timings['whole batch'] / args.batches:.2f} ms per batch, "
          f"{frame_total / timings['whole batch']:.0f} frames/s (busy ms per batch, warm-up included: {busy})")
    if args.sections:
        sections = _time_sections(engine, synchronise)
        timings["whole batch"] = 0.0
        for _batch in render.paste(render.render(_timed(batches(), timings, synchronise))):
            if timings["whole batch"] == 0.0:  # still warming up: count from the fourth batch
                sections.clear()
        steps = sum(sections.values())
        print("waiting for the GPU after each step, ms per batch: " + ", ".join(
            f"{step} {1000 * seconds / args.batches:.2f}" for step, seconds in sections.items())
            + f", host side {1000 * (timings['whole batch'] - steps) / args.batches:.2f}"
            + f"; whole batch {1000 * timings['whole batch'] / args.batches:.2f}")


def _portrait_batch(width: int, height: int, count: int):
    """(count, H * 3/2, W) uint8 I420 frames of the drifting portrait and one tracked Face each."""
    import numpy as np

    from bench.bench_landmark import make_frames
    from heygem.config import FaceConfig
    from heygem.face.track import crop_boxes, tight_box
    from heygem.media.frames import bgr_to_yuv420
    from heygem.types import Face

    frames_bgr, landmarks = make_frames(width, height)
    raw_boxes = np.stack([tight_box(points) for points in landmarks])
    boxes = crop_boxes(raw_boxes, np.ones(len(raw_boxes), bool), FaceConfig(), width, height)
    frames = np.stack([bgr_to_yuv420(frames_bgr[i % len(frames_bgr)]) for i in range(count)])
    faces = [Face(box=tuple(int(v) for v in boxes[i % len(boxes)]), landmarks=landmarks[i % len(landmarks)])
             for i in range(count)]
    return frames, faces


def _time_sections(engine, synchronise) -> dict:
    """Wrap the render stage's GPU steps so that each waits for the GPU and adds its seconds to the dict returned."""
    import time as clock

    from heygem.render import gpu_blend

    sections: dict = {}

    def timed(name, function):
        def wrapper(*args, **kwargs):
            synchronise()
            started = clock.perf_counter()
            result = function(*args, **kwargs)
            synchronise()
            sections[name] = sections.get(name, 0.0) + clock.perf_counter() - started
            return result
        return wrapper

    gpu_blend.crop_faces = timed("crop", gpu_blend.crop_faces)
    gpu_blend.sharpen_changed = timed("sharpen", gpu_blend.sharpen_changed)
    gpu_blend.paste_faces = timed("paste", gpu_blend.paste_faces)
    engine.generate_faces = timed("generator", engine.generate_faces)
    return sections


def _started_after_warm_up(batches, timings, warm):
    """Yield the batches; once the three warm-up batches are through (``warm`` is set), note the time in
    ``timings["started"]`` and yield the rest."""
    for index, batch in enumerate(batches):
        if index == 3:
            warm.wait()
            timings["started"] = time.perf_counter()
        yield batch


def _timed(batches, timings, synchronise):
    """Yield the batches, adding the time the render stage takes over each one to ``timings``."""
    for batch in batches:
        started = time.perf_counter()
        yield batch  # the render stage works on it, then asks for the next one
        synchronise()
        timings["whole batch"] += time.perf_counter() - started


if __name__ == "__main__":
    main()
