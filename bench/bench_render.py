"""The torch render stage alone: frames per second of heygem.render.GpuRender on synthetic batches.

    python bench/bench_render.py [--size 1920x1080] [--batch 21] [--batches 30] [--device cuda]

Builds the wav2lip engine from a random-init checkpoint in the official layout, a batch of
synthetic I420 frames with one face box each (a ~40 % of the height box, the ellipse mask
that faces without landmarks get), and times the render stage on them batch after batch
(face regions out of the frames, upload, crop, generator, sharpen, paste, download, back
into the frames), after three warm-up batches.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
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
    args = parser.parse_args()

    started = time.perf_counter()
    import numpy as np
    import torch

    torch_seconds = time.perf_counter() - started

    from heygem import audio
    from heygem.config import Config, EngineConfig
    from heygem.engines.wav2lip import Wav2LipEngine
    from heygem.models.wav2lip import Wav2Lip
    from heygem.render import GpuRender
    from heygem.restore import Restoration
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
    render = GpuRender(Ready(), Config())
    timings = {"whole batch": 0.0}

    def batches():
        for index in range(args.batches + 3):
            if index == 3:  # after warm-up (cuDNN autotuning, CUDA graph capture)
                timings["whole batch"] = 0.0
            yield FrameBatch(np.arange(args.batch) + index * args.batch, np.arange(args.batch), frames.copy(),
                             faces=faces)

    for _batch in render.render(_timed(batches(), timings, synchronise)):
        pass
    frame_total = args.batch * args.batches
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; {width}x{height}, batches of {args.batch}, {args.batches} batches")
    print(f"import torch {torch_seconds:.1f} s; build the engine (CUDA start, weights, cuDNN check) {engine_seconds:.1f} s")
    print(f"render stage: {1000 * timings['whole batch'] / args.batches:.2f} ms per batch, "
          f"{frame_total / timings['whole batch']:.0f} frames/s")


def _timed(batches, timings, synchronise):
    """Yield the batches, adding the time the render stage takes over each one to ``timings``."""
    for batch in batches:
        started = time.perf_counter()
        yield batch  # the render stage works on it, then asks for the next one
        synchronise()
        timings["whole batch"] += time.perf_counter() - started


if __name__ == "__main__":
    main()
