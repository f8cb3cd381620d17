"""Decoding the face video into Python: frames per second for each number of ffmpeg decoders.

    python bench/bench_decode.py [--size 1920x1080] [--seconds 20] [--decoders 1 2 3 4] [--batch 32]

Makes the bench_pipeline.py input, then reads it whole through heygem.media.decode.iter_video_i420
with each decoder count (DecoderShare: every process decodes the video, only its share of the
frames crosses its pipe), timed from the first ffmpeg start to the last batch; the first count
is repeated at the end so that a warming disk cache does not flatter the later ones. Every run
must yield the same number of frames, and the frames of each decoder count are checked equal to
those of one decoder by a digest.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def decode_once(info, geometry, batch_frames: int, decoders: int) -> tuple[int, float, str]:
    """(frames, seconds, digest of the bytes) of one whole decode."""
    from heygem.media.decode import iter_video_i420

    digest = hashlib.sha256()
    frames = 0
    started = time.perf_counter()
    for batch in iter_video_i420(info, geometry, batch_frames, decoders):
        frames += len(batch)
        digest.update(batch[:, ::64, ::64].tobytes())  # a sparse sample: hashing every byte would be the bottleneck
    return frames, time.perf_counter() - started, digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1920x1080", help="WIDTHxHEIGHT of the test video")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the test video at 25 fps")
    parser.add_argument("--decoders", type=int, nargs="+", default=[1, 2, 3, 4], help="decoder counts to time")
    parser.add_argument("--batch", type=int, default=32, help="frames per batch (the chunk each decoder passes on)")
    args = parser.parse_args()

    from bench_pipeline import machine_description, make_inputs

    from heygem.media.probing import probe, working_geometry

    width, height = (int(value) for value in args.size.lower().split("x"))
    print(f"machine: {machine_description()}")
    with tempfile.TemporaryDirectory(prefix="heygem-decode-") as folder:
        video, _ = make_inputs(Path(folder), args.seconds, width, height)
        info = probe(video)
        geometry = working_geometry(info, None)
        print(f"input: {width}x{height}, 25 fps, {args.seconds:g} s; batches of {args.batch} frames\n")
        print("| decoders | frames | seconds | frames/s |")
        print("| ---: | ---: | ---: | ---: |")
        reference = None
        for decoders in [*args.decoders, args.decoders[0]]:
            frames, seconds, digest = decode_once(info, geometry, args.batch, decoders)
            reference = reference or (frames, digest)
            if (frames, digest) != reference:
                raise SystemExit(f"{decoders} decoders gave other frames than {args.decoders[0]}")
            print(f"| {decoders} | {frames} | {seconds:.2f} | {frames / seconds:.0f} |")


if __name__ == "__main__":
    main()
