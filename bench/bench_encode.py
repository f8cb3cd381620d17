"""Output encoding throughput on this machine: frames per second of write + close.

Feeds synthetic moving frames (already I420, or BGR converted by the encoder)
to heygem.media.encode.open_encoder with one or several x264 processes and times
everything from the first write to the finished MP4, audio muxed. "cpu" adds
up the CPU seconds of this process and its ffmpeg children: on a shared or
busy machine it shows the work done when the wall time does not.

    python bench/bench_encode.py
    python bench/bench_encode.py --sizes 1920x1080 --encoders 1 2 4 6 --seconds 20 --preset veryfast
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["320x240", "1280x720"], help="WIDTHxHEIGHT frame sizes")
    parser.add_argument("--encoders", type=int, nargs="+", default=[1, 2], help="x264 processes to compare")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the encoded video")
    parser.add_argument("--fps", default="25/1", help="frame rate as a fraction")
    parser.add_argument("--preset", default="veryfast", help="x264 preset")
    parser.add_argument("--crf", type=int, default=18, help="x264 quality")
    parser.add_argument("--input", choices=["i420", "bgr"], default="i420", help="what the encoder is handed")
    parser.add_argument("--batch", type=int, default=16, help="frames per write")
    return parser.parse_args()


def synthetic_frames(width: int, height: int, count: int) -> np.ndarray:
    """(count, H, W, 3) uint8 BGR: a drifting gradient with a moving square, some detail, some noise."""
    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    frames = np.empty((count, height, width, 3), dtype=np.uint8)
    for index in range(count):
        frames[index, :, :, 0] = (xs * 255 / width + 3 * index) % 256
        frames[index, :, :, 1] = 40 + ys * 150 / height
        frames[index, :, :, 2] = 128 + 60 * np.sin((xs + ys + 4 * index) / 23.0)
        size = height // 5
        left = (index * width // 50) % (width - size)
        frames[index, height // 3: height // 3 + size, left: left + size] = 235
    noise = rng.integers(-4, 5, size=frames.shape, dtype=np.int16)
    return np.clip(frames.astype(np.int16) + noise, 0, 255).astype(np.uint8)


def main() -> None:
    from fractions import Fraction

    from heygem.media import encode
    from heygem.media.ffmpeg import ffmpeg_binary
    from heygem.media.frames import bgr_to_yuv420
    from heygem.media.probing import probe
    from heygem.types import FrameGeometry

    arguments = parse_arguments()
    fps = float(Fraction(arguments.fps))
    frame_count = int(round(arguments.seconds * fps))
    print(f"{os.cpu_count()} cores, ffmpeg {ffmpeg_binary()}, preset {arguments.preset}, "
          f"crf {arguments.crf}, {frame_count} frames at {arguments.fps}, fed {arguments.input}")
    with tempfile.TemporaryDirectory(prefix="heygem-bench-") as folder:
        audio_path = Path(folder) / "tone.wav"
        subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-f", "lavfi", "-i",
                        f"sine=frequency=220:duration={frame_count / fps:.6f}", str(audio_path)], check=True)
        audio_info = probe(audio_path)
        for size in arguments.sizes:
            width, height = (int(value) for value in size.lower().split("x"))
            pool_bgr = synthetic_frames(width, height, 50)
            pool = np.stack([bgr_to_yuv420(frame) for frame in pool_bgr]) if arguments.input == "i420" \
                else pool_bgr
            for encoders in arguments.encoders:
                output_path = Path(folder) / f"out-{size}-{encoders}.mp4"
                started, cpu_started = time.perf_counter(), os.times()
                encoder = encode.open_encoder(FrameGeometry(width, height), arguments.fps, audio_path, audio_info,
                                              output_path, crf=arguments.crf, preset=arguments.preset,
                                              audio_bitrate="128k", frame_count=frame_count, encoders=encoders)
                for start in range(0, frame_count, arguments.batch):
                    indices = np.arange(start, min(start + arguments.batch, frame_count)) % len(pool)
                    batch = pool[indices]  # a new array each time: the encoder keeps it until written
                    if arguments.input == "i420":
                        encoder.write_i420(batch)
                    else:
                        encoder.write(batch)
                encoder.close()
                seconds = time.perf_counter() - started
                cpu = os.times()
                cpu_seconds = sum(getattr(cpu, field) - getattr(cpu_started, field)
                                  for field in ("user", "system", "children_user", "children_system"))
                segments = len(encoder.processes) - 1 if encoders > 1 else 1
                print(f"{size:>10}  encoders {encoders}  segments {segments:>2}  "
                      f"{frame_count / seconds:7.1f} frames/s  "
                      f"{seconds:6.2f} s  cpu {cpu_seconds:6.2f} s  {output_path.stat().st_size / 1e6:6.2f} MB")
                output_path.unlink()


if __name__ == "__main__":
    main()
