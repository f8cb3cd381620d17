"""Whole-pipeline throughput and peak memory, per engine (720p by default).

    python bench/bench_pipeline.py [--seconds 10] [--size 1280x720] [--engines landmark wav2lip]

Makes a synthetic talking-head input (the bundled portrait, moving slowly, at
25 fps) and the bundled speech cut to the same length, runs
:func:`heygem.pipeline.generate` once per engine (wav2lip with a random-init
checkpoint in the official layout: the speed is the same as with real weights)
and prints frames per second, seconds per stage and peak resident memory of
this process and of its ffmpeg children.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def machine_description() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__}, Python {platform.python_version()}"


class MemorySampler:
    """Peak resident memory of this process and of this process plus its ffmpeg children, sampled every 50 ms.

    (getrusage's figure for children is useless here: a forked child reports
    the parent's size at the moment of the fork.)
    """

    def __init__(self):
        import threading

        self.peak_self = 0
        self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss_kib(pid) -> int:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def _children(self) -> list[int]:
        me = os.getpid()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == me:
                    pids.append(int(entry.name))
        return pids

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            own = self._rss_kib("self")
            total = own + sum(self._rss_kib(pid) for pid in self._children())
            self.peak_self, self.peak_total = max(self.peak_self, own), max(self.peak_total, total)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def make_inputs(folder: Path, seconds: float, width: int, height: int) -> tuple[Path, Path]:
    """A width x height, 25 fps video of the portrait drifting slowly, and speech of the same length."""
    from heygem.media import ffmpeg_binary

    video = folder / f"face_{width}x{height}.mp4"
    audio = folder / "speech.wav"
    portrait = REPO / "assets" / "astronaut.jpg"
    side = max(width, height) + 40
    subprocess.run([ffmpeg_binary(), "-v", "error", "-y", "-loop", "1", "-i", str(portrait),
                    "-vf", f"scale={side}:{side},crop={width}:{height}:x='(iw-ow)/2+10*sin(t)':y='20+8*cos(t*0.7)',"
                           "format=yuv420p",
                    "-r", "25", "-t", str(seconds), "-c:v", "libx264", "-preset", "veryfast", str(video)], check=True)
    subprocess.run([ffmpeg_binary(), "-v", "error", "-y", "-stream_loop", "-1", "-i",
                    str(REPO / "assets" / "speech_en.wav"), "-t", str(seconds), str(audio)], check=True)
    return video, audio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the test video and audio")
    parser.add_argument("--size", default="1280x720", help="WIDTHxHEIGHT of the test video")
    parser.add_argument("--engines", nargs="+", default=["landmark", "wav2lip"], choices=["landmark", "wav2lip"])
    args = parser.parse_args()

    import torch

    from heygem.models.wav2lip import Wav2Lip
    from heygem.pipeline import generate

    with tempfile.TemporaryDirectory(prefix="heygem-bench-") as folder_name:
        folder = Path(folder_name)
        width, height = (int(v) for v in args.size.lower().split("x"))
        video, audio = make_inputs(folder, args.seconds, width, height)
        weights = folder / "weights"
        weights.mkdir()
        torch.save({"state_dict": Wav2Lip().state_dict()}, weights / "wav2lip.pth")
        os.environ["HEYGEM_WEIGHTS"] = str(weights)
        print(f"machine: {machine_description()}")
        print(f"input: {width}x{height}, 25 fps, {args.seconds:g} s; output at the input's size\n")
        print(f"{'engine':<10}{'frames':>8}{'seconds':>9}{'frames/s':>10}{'x realtime':>12}{'peak MiB':>10}"
              f"{'+ffmpeg':>9}  seconds per stage")
        for engine in args.engines:
            started = time.perf_counter()
            with MemorySampler() as memory:
                summary = generate(video, audio, folder / f"out_{engine}.mp4", overrides={"engine.name": engine})
            elapsed = time.perf_counter() - started
            stages = ", ".join(f"{k} {v:.1f}" for k, v in summary.seconds_per_stage.items() if v >= 0.05)
            print(f"{engine:<10}{summary.frames:>8}{elapsed:>9.1f}{summary.frames / elapsed:>10.1f}"
                  f"{summary.video_seconds / elapsed:>12.2f}{memory.peak_self / 1024:>10.0f}"
                  f"{memory.peak_total / 1024:>9.0f}  {stages}")
        print("\npeak MiB: resident memory of this process during the run; +ffmpeg: with its ffmpeg children")


if __name__ == "__main__":
    main()
