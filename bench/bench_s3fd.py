"""S3FD face detector throughput on this machine, in frames per second.

For each precision, model form, frame size, longest input side and batch size, two timings:

- network: the S3FD network alone on a batch already resized, mean-subtracted and on the
  device (CUDA events on a GPU, the wall clock on the CPU);
- detect_faces: heygem.face.s3fd.detect_faces end to end from uint8 frames in host memory
  (upload, resize, network, score thresholding, box decoding, NMS, boxes back to the host;
  wall clock, since half of it is host work).

The frames are the bundled portrait (assets/astronaut.jpg) scaled to cover the frame size.
The weights are random (the official layout, seeded) unless --weights names a real s3fd.pth.
Random weights would score about half of all anchors as faces; so that NMS works on about as
many boxes as a real face gives, the face logits' biases are shifted until --candidates anchors
per frame score above the threshold (at the first frame size and input side; the
candidates/frame and boxes/frame columns say how many there were in each row).

Model forms: "prepared" is what the detector runs (heygem.face.s3fd.prepare_s3fd: on CUDA
the weights cast to the precision and channels-last); "autocast" is the fp32 model as loaded,
run under autocast (the form before prepare_s3fd existed).

    python bench/bench_s3fd.py --device cuda --seconds 1 --markdown   # 1080p and 720p, inputs 640/480/320,
                                                                      # batches 8/16/32, fp32 and fp16, both forms
    python bench/bench_s3fd.py --device cuda --sizes 1920x1080 --max-sides 640 --batch-sizes 1 8 32 --precisions fp16
    python bench/bench_s3fd.py --device cpu --sizes 320x240 --max-sides 160 --repeats 1   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

FORMS = ("prepared", "autocast")


@dataclass(frozen=True)
class Timing:
    network_rate: float  # frames/s through the network alone
    detect_rate: float  # frames/s through detect_faces from host frames
    candidates_per_frame: float  # anchors scoring above the threshold, per frame (before the max_candidates cap)
    boxes_per_frame: float  # boxes detect_faces returns per frame


def frame_size(text: str) -> tuple[int, int]:
    """"1920x1080" -> (1920, 1080), width first."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a frame size is WIDTHxHEIGHT, e.g. 1280x720, not {text!r}") from None
    if width < 32 or height < 32:
        raise argparse.ArgumentTypeError(f"frames must be at least 32x32, not {text}")
    return width, height


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="frames per forward pass (default: 8 16 32 on CUDA, 1 on the CPU)")
    parser.add_argument("--sizes", type=frame_size, nargs="+", default=None,
                        help="frame sizes WIDTHxHEIGHT (default: 1920x1080 1280x720 on CUDA, 640x360 on the CPU)")
    parser.add_argument("--max-sides", type=int, nargs="+", default=None,
                        help="longest side of the network's input; frames are shrunk to it, never enlarged "
                             "(default: 640 480 320 on CUDA, 320 on the CPU)")
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "fp16", "bf16"], default=None,
                        help="compute precisions (default: fp32 fp16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=None,
                        help="model forms, see above (default: both on CUDA, prepared on the CPU)")
    parser.add_argument("--weights", type=Path, default=None, help="a real s3fd.pth instead of random weights")
    parser.add_argument("--score-threshold", type=float, default=0.5, help="face probability a box needs")
    parser.add_argument("--max-candidates", type=int, default=1000, help="best boxes per frame that go through NMS")
    parser.add_argument("--candidates", type=int, default=None,
                        help="random weights: anchors per frame above the threshold, set through the face logits' "
                             "biases (default: 100; 0 leaves the random weights alone; never done to --weights)")
    parser.add_argument("--seconds", type=float, default=2.0, help="time each measurement at least this long")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per measurement (default: as many as --seconds takes)")
    parser.add_argument("--markdown", action="store_true",
                        help="print only a markdown table, one row per configuration")
    return parser.parse_args(argv)


def cover_frame(portrait: np.ndarray, width: int, height: int) -> np.ndarray:
    """(height, width, 3) uint8 BGR: ``portrait`` scaled to cover the frame, centred, cropped."""
    import cv2

    side = max(width, height)
    interpolation = cv2.INTER_AREA if side < len(portrait) else cv2.INTER_CUBIC
    scaled = cv2.resize(portrait, (side, side), interpolation=interpolation)
    top, left = (side - height) // 2, (side - width) // 2
    return np.ascontiguousarray(scaled[top:top + height, left:left + width])


def time_calls(call, on_cuda: bool, device, seconds: float, repeats: int | None, events: bool) -> tuple[int, float]:
    """(calls, seconds) of repeated ``call()``: CUDA events around each when ``events``, else the wall clock."""
    import torch

    calls, elapsed = 0, 0.0
    while (repeats is None and elapsed < seconds) or (repeats is not None and calls < repeats):
        if on_cuda and events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            elapsed += start.elapsed_time(end) / 1000.0
        else:
            started = time.perf_counter()
            call()
            if on_cuda:
                torch.cuda.synchronize(device)
            elapsed += time.perf_counter() - started
        calls += 1
    return calls, elapsed


def time_configuration(model, frames_bgr: np.ndarray, max_side: int, precision: str, args, device) -> Timing:
    """Both timings for one batch of ``frames_bgr`` (B, H, W, 3) uint8 through ``model`` (already prepared)."""
    import torch

    from heygem.face.s3fd import detect_faces, model_layout, prepare_images, resized_size
    from heygem.runtime.device import inference_context

    on_cuda = device.type == "cuda"
    batch_size = len(frames_bgr)
    weights_dtype, channels_last = model_layout(model)
    input_dtype = None if weights_dtype == torch.float32 else weights_dtype
    run_precision = precision if input_dtype is None else "fp32"  # cast weights run without autocast
    size = resized_size(*frames_bgr.shape[1:3], None, max_side)
    images = prepare_images(frames_bgr, size, device, dtype=input_dtype, channels_last=channels_last)  # (B, 3, h, w)

    def run_network():
        with inference_context(device, run_precision):
            return model(images)

    def run_detection():
        return detect_faces(model, frames_bgr, max_side=max_side, score_threshold=args.score_threshold,
                            batch_size=batch_size, max_candidates=args.max_candidates, precision=precision)

    levels = run_network()
    face_scores = torch.cat([logits.float().softmax(dim=1)[:, 1].flatten(1) for logits, _ in levels], dim=1)  # (B, A)
    candidates = float((face_scores > args.score_threshold).sum()) / batch_size
    boxes = run_detection()
    for _ in range(2 if on_cuda else 0):  # warm-up: cuDNN autotuning for this shape, the allocator
        run_network()
        run_detection()
    if on_cuda:
        torch.cuda.synchronize(device)
    calls, elapsed = time_calls(run_network, on_cuda, device, args.seconds, args.repeats, events=True)
    network_rate = calls * batch_size / elapsed
    calls, elapsed = time_calls(run_detection, on_cuda, device, args.seconds, args.repeats, events=False)
    detect_rate = calls * batch_size / elapsed
    return Timing(network_rate, detect_rate, candidates, sum(len(found) for found in boxes) / batch_size)


def set_candidate_count(model, frame_bgr: np.ndarray, max_side: int, candidates: int, score_threshold: float) -> float:
    """Shift the face logit of every detection head of ``model`` (in place) so that about ``candidates``
    anchors of ``frame_bgr`` (H, W, 3) uint8 score above ``score_threshold``; returns the shift.

    A face score is the softmax of (background, face) logits, sigmoid(face - background), so
    adding d to the face logits' biases moves every anchor's logit difference by exactly d.
    """
    import torch

    from heygem.face.s3fd import prepare_images, resized_size
    from heygem.models.s3fd import LEVEL_NAMES, MAXOUT_BACKGROUND_LOGITS

    device = next(model.parameters()).device
    size = resized_size(*frame_bgr.shape[:2], None, max_side)
    with torch.inference_mode():
        levels = model(prepare_images(frame_bgr[None], size, device))
        differences = torch.cat([(logits[:, 1] - logits[:, 0]).flatten() for logits, _ in levels])  # (A,)
    ranked = differences.sort(descending=True).values
    count = min(candidates, len(ranked) - 1)
    # halfway between the count-th and the next difference, moved onto the threshold's logit
    target = float(np.log(score_threshold / (1.0 - score_threshold)))
    shift = target - float(ranked[count - 1] + ranked[count]) / 2
    with torch.no_grad():
        for index, name in enumerate(LEVEL_NAMES):
            face_channel = MAXOUT_BACKGROUND_LOGITS if index == 0 else 1
            getattr(model, f"{name}_mbox_conf").bias[face_channel] += shift
    return shift


def machine_line(device) -> str:
    """The GPU (or CPU), torch, CUDA and cuDNN versions, in one line."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {cudnn}"
    name = platform.processor() or platform.machine()
    return f"{name} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def load_model(weights: Path | None, device):
    import torch

    from heygem.face.s3fd import load_s3fd
    from heygem.models.s3fd import S3FD

    if weights is not None:
        return load_s3fd(weights, str(device))
    torch.manual_seed(0)
    return S3FD().eval().to(device)  # random weights in the official layout


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    import cv2
    import torch

    from heygem.face.s3fd import prepare_s3fd, resized_size
    from heygem.runtime.device import configure_backends, pick_device

    device = pick_device(args.device)
    configure_backends(device=device)
    on_cuda = device.type == "cuda"
    batch_sizes = args.batch_sizes or ([8, 16, 32] if on_cuda else [1])
    sizes = args.sizes or ([(1920, 1080), (1280, 720)] if on_cuda else [(640, 360)])
    max_sides = args.max_sides or ([640, 480, 320] if on_cuda else [320])
    precisions = args.precisions or (["fp32", "fp16"] if on_cuda else ["fp32"])
    forms = args.forms or (list(FORMS) if on_cuda else ["prepared"])
    model = load_model(args.weights, device)
    portrait = cv2.imread(str(REPO / "assets" / "astronaut.jpg"))
    weights_text = args.weights.name if args.weights else "random weights (official layout)"
    candidates = 0 if args.weights is not None else (100 if args.candidates is None else args.candidates)
    if candidates > 0:
        width, height = sizes[0]
        shift = set_candidate_count(model, cover_frame(portrait, width, height), max_sides[0], candidates,
                                    args.score_threshold)
        weights_text += f", face logits shifted by {shift:+.3f} for ~{candidates} candidates per frame"
    if not args.markdown:
        print(f"{machine_line(device)}; S3FD, {weights_text}, score threshold {args.score_threshold}, "
              f"at most {args.max_candidates} candidates per frame")
    print("| precision | model | frames | input | batch | network frames/s | detect_faces frames/s "
          "| candidates/frame | boxes/frame |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for precision, form in itertools.product(precisions, forms):
        prepared = prepare_s3fd(model, precision) if form == "prepared" else model
        for (width, height), max_side, batch_size in itertools.product(sizes, max_sides, batch_sizes):
            input_height, input_width = resized_size(height, width, None, max_side)
            label = f"| {precision} | {form} | {width}x{height} | {input_width}x{input_height} | {batch_size} |"
            frames_bgr = np.repeat(cover_frame(portrait, width, height)[None], batch_size, axis=0)  # (B, H, W, 3)
            try:
                timing = time_configuration(prepared, frames_bgr, max_side, precision, args, device)
                print(f"{label} {timing.network_rate:.4g} | {timing.detect_rate:.4g} "
                      f"| {timing.candidates_per_frame:.0f} | {timing.boxes_per_frame:.1f} |", flush=True)
            except Exception as error:  # noqa: BLE001 - one failing configuration should not hide the others
                reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                print(f"{label} failed: {reason} | | | |", flush=True)
            if on_cuda:
                torch.cuda.empty_cache()
        del prepared


if __name__ == "__main__":
    main()
