"""heygem's wav2lip engine against the public Wav2Lip ``inference.py``, whole processes, same inputs.

    python bench/bench_peer.py --wav2lip PATH_TO_A_WAV2LIP_CHECKOUT [--seconds 6] [--size 320x376] [--runs 3]

Both get the same face video (bench_pipeline.py's synthetic input), the same speech and the same
random-init checkpoint in the official layout. heygem tracks the face on every frame
(``python -m heygem generate --engine wav2lip``); ``inference.py`` is given a fixed box (``--box``,
found once on the first frame) so that it skips its S3FD detection, which would download weights.
Each command runs ``--runs`` times as a fresh process, the two taking turns; the table gives min /
median / max wall seconds and the speed-up of heygem's median over inference.py's.

inference.py was written against older libraries; the run works around that from outside its
code: its ``ffmpeg`` comes from the imageio-ffmpeg wheel through a PATH entry, and a
``sitecustomize`` lets ``librosa.filters.mel`` take its first two arguments by position again
(librosa 0.10 made them keyword-only). It runs in a temporary copy of the checkout, since it
writes into ``temp/`` and ``results/`` next to itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

LIBROSA_POSITIONAL_MEL = '''
import functools
import librosa.filters

_mel = librosa.filters.mel


@functools.wraps(_mel)
def _mel_positional(*args, **kwargs):
    names = ("sr", "n_fft")
    kwargs.update(zip(names, args))
    return _mel(**kwargs)


librosa.filters.mel = _mel_positional
'''


def first_frame_box(video: Path) -> tuple[int, int, int, int]:
    """The face box (x1, y1, x2, y2) that heygem's tracking gives the video's first frame, padded as
    Wav2Lip pads it by default (10 pixels below)."""
    import cv2

    from heygem.config import FaceConfig
    from heygem.face.finder import FaceFinder
    from heygem.face.track import tight_box

    capture = cv2.VideoCapture(str(video))
    ok, frame = capture.read()
    capture.release()
    if not ok:
        raise SystemExit(f"cannot read {video}")
    with FaceFinder(FaceConfig()) as finder:
        landmarks = finder.find(frame)
    if landmarks is None:
        raise SystemExit("no face on the first frame")
    x1, y1, x2, y2 = tight_box(landmarks)
    height, width = frame.shape[:2]
    return max(int(x1), 0), max(int(y1), 0), min(int(x2), width), min(int(y2) + 10, height)


def timed(command: list[str], cwd: Path, environment: dict) -> float:
    started = time.perf_counter()
    finished = subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if finished.returncode != 0:
        raise SystemExit(f"{command[1]} failed ({finished.returncode}):\n{finished.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wav2lip", type=Path, required=True, help="a checkout of github.com/Rudrabha/Wav2Lip")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of the clip")
    parser.add_argument("--size", default="320x376", help="WIDTHxHEIGHT of the clip")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per command")
    args = parser.parse_args()
    if not (args.wav2lip / "inference.py").is_file():
        raise SystemExit(f"{args.wav2lip} has no inference.py")

    import torch
    from bench_pipeline import machine_description, make_inputs

    from heygem.media.ffmpeg import ffmpeg_binary
    from heygem.models.wav2lip import Wav2Lip

    width, height = (int(value) for value in args.size.lower().split("x"))
    with tempfile.TemporaryDirectory(prefix="heygem_peer_") as folder_name:  # no dot: inference.py splits on '.'
        folder = Path(folder_name)
        video, audio = make_inputs(folder, args.seconds, width, height)
        weights = folder / "weights"
        weights.mkdir()
        torch.manual_seed(0)
        torch.save({"state_dict": Wav2Lip().state_dict()}, weights / "wav2lip.pth")
        peer = folder / "peer"
        shutil.copytree(args.wav2lip, peer, ignore=shutil.ignore_patterns(".git"))
        (peer / "temp").mkdir(exist_ok=True)
        tools = folder / "tools"
        tools.mkdir()
        (tools / "ffmpeg").symlink_to(ffmpeg_binary())
        (tools / "sitecustomize.py").write_text(LIBROSA_POSITIONAL_MEL, encoding="utf-8")
        x1, y1, x2, y2 = first_frame_box(video)

        environment = dict(os.environ, HEYGEM_WEIGHTS=str(weights), HEYGEM_CACHE_DIR=str(folder / "cache"))
        ours = [sys.executable, "-m", "heygem", "generate", "--face", str(video), "--audio", str(audio),
                "-o", str(folder / "ours.mp4"), "--engine", "wav2lip", "--no-avatar-cache"]
        peer_environment = dict(os.environ, PATH=f"{tools}{os.pathsep}{os.environ.get('PATH', '')}",
                                PYTHONPATH=str(tools))
        theirs = [sys.executable, "inference.py", "--checkpoint_path", str(weights / "wav2lip.pth"),
                  "--face", str(video), "--audio", str(audio), "--outfile", str(folder / "theirs.mp4"),
                  "--box", str(y1), str(y2), str(x1), str(x2)]

        commands = (("heygem generate (tracks every frame)", ours, REPO, environment),
                    ("Wav2Lip inference.py --box", theirs, peer, peer_environment))
        results: dict[str, list[float]] = {name: [] for name, *_ in commands}
        for _ in range(args.runs):  # the two commands take turns, so that a shared machine's drift falls on both
            for name, command, cwd, env in commands:
                results[name].append(timed(command, cwd, env))

        print(f"machine: {machine_description()}")
        print(f"input: {width}x{height}, 25 fps, {args.seconds:g} s; random-init Wav2Lip weights; "
              f"{args.runs} fresh processes each\n")
        print("| command | min s | median s | max s |")
        print("| --- | ---: | ---: | ---: |")
        for name, times in results.items():
            print(f"| {name} | {min(times):.1f} | {statistics.median(times):.1f} | {max(times):.1f} |")
        ours_median, theirs_median = (statistics.median(times) for times in results.values())
        print(f"\nheygem is {theirs_median / ours_median:.2f}x the speed of inference.py (medians)")


if __name__ == "__main__":
    main()
