"""The torch render path step by step: where a batch of frames spends its time on the device.

    python bench/bench_render.py [--size 1920x1080] [--batch 21] [--batches 30] [--device cuda]

Builds the wav2lip engine from a random-init checkpoint in the official layout, a batch of
synthetic I420 frames with one face box each (a ~40 % of the height box, the ellipse mask
that faces without landmarks get), and times each step of heygem.render.GpuRender on it:
upload, crop, generator, sharpen, paste, download. Each step is timed from the host after a
device synchronise, so the figures add up to the batch's wall time; frames per second per
step and for the whole batch are printed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
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

    import numpy as np
    import torch

    from heygem import gpu_blend
    from heygem.config import EngineConfig
    from heygem.engines.wav2lip import FACE_SIZE, Wav2LipEngine
    from heygem.models.wav2lip import Wav2Lip

    width, height = (int(v) for v in args.size.lower().split("x"))
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = Path(folder) / "wav2lip.pth"
        torch.save({"state_dict": Wav2Lip().state_dict()}, checkpoint)
        engine = Wav2LipEngine(checkpoint, EngineConfig(device=args.device))
    device = engine.device

    def synchronise():
        if device.type == "cuda":
            torch.cuda.synchronize()

    rng = np.random.default_rng(0)
    frames = rng.integers(16, 235, (args.batch, height * 3 // 2, width), dtype=np.uint8)
    side = int(0.4 * height)
    x1, y1 = (width - side) // 2, (height - side) // 2
    boxes_host = [(x1 + i % 5, y1 + i % 3, x1 + side + i % 5, y1 + side + i % 3) for i in range(args.batch)]
    mel_host = rng.uniform(-4, 4, (args.batch, 1, 80, 16)).astype(np.float32)
    landmarks = np.full((args.batch, 468, 2), np.nan, dtype=np.float32)
    pinned = torch.empty(frames.shape, dtype=torch.uint8, pin_memory=device.type == "cuda")
    seconds: dict[str, float] = defaultdict(float)

    def step(name, function):
        started = time.perf_counter()
        result = function()
        synchronise()
        seconds[name] += time.perf_counter() - started
        return result

    with torch.inference_mode():
        for index in range(args.batches + 3):
            if index == 3:  # after warm-up (cuDNN autotuning, CUDA graph capture)
                seconds.clear()
            host = torch.from_numpy(frames)
            planes = step("upload", lambda: pinned.copy_(host).to(device, non_blocking=True))
            frame_index = torch.arange(args.batch, device=device)
            boxes = torch.tensor(boxes_host, dtype=torch.int64, device=device)
            crops = step("crop", lambda: gpu_blend.crop_faces(planes, frame_index, boxes, FACE_SIZE))

            def run_generator():
                masked = crops.clone()
                masked[:, :, FACE_SIZE // 2:] = 0.0
                mel = torch.from_numpy(mel_host).to(device, non_blocking=True)
                return engine.generate_faces(torch.cat((masked, crops), dim=1), mel)

            generated = step("generate", run_generator)
            generated = step("sharpen", lambda: gpu_blend.sharpen_changed(generated, crops, 0.6))
            step("paste", lambda: gpu_blend.paste_faces(planes, frame_index, boxes, generated, landmarks))
            step("download", lambda: host.copy_(planes.cpu()))
    total = sum(seconds.values())
    frame_total = args.batch * args.batches
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; {width}x{height}, batches of {args.batch}, {args.batches} batches")
    print("| step | ms per batch | frames/s |\n| --- | ---: | ---: |")
    for label, value in seconds.items():
        print(f"| {label} | {1000 * value / args.batches:.2f} | {frame_total / value:.0f} |")
    print(f"| all | {1000 * total / args.batches:.2f} | {frame_total / total:.0f} |")


if __name__ == "__main__":
    main()
