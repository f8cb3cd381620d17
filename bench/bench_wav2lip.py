"""Wav2Lip generator throughput on this machine, in faces per second.

Times the generator alone (random-init weights with BatchNorm folded, as the
engine runs it; inputs already on the device; no face cropping or video work)
through heygem.runtime.device.FixedBatchRunner, the runner the wav2lip engine uses, for
several precisions and batch sizes. On CUDA the time comes from CUDA events; on
the CPU from the wall clock. Prints the machine and a markdown table.

    python bench/bench_wav2lip.py                                   # CPU: quick, small batches
    python bench/bench_wav2lip.py --device cuda --batch-sizes 1 16 64 128 256 --seconds 3
    python bench/bench_wav2lip.py --variants fp16-cl-graph --batch-sizes 128
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


@dataclass(frozen=True)
class Variant:
    key: str  # what --variants takes
    label: str  # the table's row name
    precision: str  # as FixedBatchRunner takes it
    channels_last: bool = False
    cuda_graph: bool = False
    cudnn: bool = True
    cuda_only: bool = False  # meaningless or far too slow on the CPU


VARIANTS = [
    Variant("fp32", "fp32", "fp32"),
    Variant("fp32-no-cudnn", "fp32, cuDNN off", "fp32", cudnn=False, cuda_only=True),
    Variant("fp16", "fp16", "fp16", cuda_only=True),
    Variant("fp16-cl", "fp16 + channels_last", "fp16", channels_last=True, cuda_only=True),
    Variant("fp16-cl-graph", "fp16 + channels_last + CUDA graph", "fp16", channels_last=True, cuda_graph=True,
            cuda_only=True),
    Variant("bf16", "bf16", "bf16", cuda_only=True),
]
CPU_EXTRA = [Variant("fp32-cl", "fp32 + channels_last", "fp32", channels_last=True)]  # only the CPU default list


def parse_arguments() -> argparse.Namespace:
    keys = [variant.key for variant in VARIANTS + CPU_EXTRA]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="faces per forward pass (default: 1 16 64 128 on CUDA, 4 16 on the CPU)")
    parser.add_argument("--variants", nargs="+", choices=keys, default=None,
                        help="which variants to time (default: all that apply to the device)")
    parser.add_argument("--batches-per-call", type=int, default=None,
                        help="faces handed to the runner per call, in batches (default: 4 on CUDA, 1 on the CPU)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="time each measurement for at least this long (default: 2 on CUDA, 1 on the CPU)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    return parser.parse_args()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(device) -> list[str]:
    import torch

    lines = [f"CPU: {cpu_model()}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}"]
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        lines.append(f"GPU: {properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
                     f"compute capability {properties.major}.{properties.minor}")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda or '-'}, cuDNN {cudnn or '-'}, "
                 f"Python {platform.python_version()}, device {device}")
    return lines


def measure(base_model, device, variant: Variant, batch_size: int, batches_per_call: int, seconds: float) -> float:
    """Faces per second of the generator for one variant and batch size, through the engine's runner."""
    import torch

    from heygem.runtime.device import FixedBatchRunner, configure_backends

    configure_backends(cudnn=variant.cudnn, device=device)
    try:
        runner = FixedBatchRunner(copy.deepcopy(base_model), device, batch_size, precision=variant.precision,
                                  channels_last=variant.channels_last, use_cuda_graph=variant.cuda_graph,
                                  name=variant.label)
        count = batch_size * batches_per_call
        faces = torch.rand(count, 6, 96, 96, device=device)  # (N, 6, 96, 96)
        mel_windows = torch.randn(count, 1, 80, 16, device=device)  # (N, 1, 80, 16)
        for _ in range(2 if device.type == "cuda" else 1):  # warm-up: cuDNN autotuning, graph capture, allocator
            runner(mel_windows, faces)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            calls, wall_started = 0, time.perf_counter()
            started.record()
            while calls < 3 or time.perf_counter() - wall_started < seconds:
                runner(mel_windows, faces)
                calls += 1
                if calls % 8 == 0:
                    ended.record()
                    ended.synchronize()  # keep the wall clock (which only decides when to stop) near the GPU
            ended.record()
            ended.synchronize()
            elapsed = started.elapsed_time(ended) / 1000.0
        else:
            calls, started_seconds = 0, time.perf_counter()
            while calls < 1 or time.perf_counter() - started_seconds < seconds:
                runner(mel_windows, faces)
                calls += 1
            elapsed = time.perf_counter() - started_seconds
        if runner.batch_size != batch_size:
            print(f"  ({variant.label}: ran out of memory at {batch_size}, measured at {runner.batch_size})",
                  file=sys.stderr)
        return calls * count / elapsed
    finally:
        configure_backends(device=device)


def main() -> None:
    arguments = parse_arguments()

    import torch

    from heygem.models.wav2lip import Wav2Lip, fold_batchnorm
    from heygem.runtime.device import pick_device

    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    device = pick_device(arguments.device)
    on_gpu = device.type == "cuda"
    batch_sizes = arguments.batch_sizes or ([1, 16, 64, 128] if on_gpu else [4, 16])
    seconds = arguments.seconds if arguments.seconds is not None else (2.0 if on_gpu else 1.0)
    batches_per_call = arguments.batches_per_call or (4 if on_gpu else 1)
    if arguments.variants:
        chosen = [variant for variant in VARIANTS + CPU_EXTRA if variant.key in arguments.variants]
        skipped = [variant.key for variant in chosen if variant.cuda_only and not on_gpu]
        if skipped:
            print(f"skipping on the CPU: {', '.join(skipped)}", file=sys.stderr)
        chosen = [variant for variant in chosen if on_gpu or not variant.cuda_only]
    else:
        chosen = VARIANTS if on_gpu else [variant for variant in VARIANTS + CPU_EXTRA if not variant.cuda_only]

    torch.manual_seed(0)
    base_model = fold_batchnorm(Wav2Lip()).to(device)

    print("Wav2Lip generator throughput, faces/s (random-init weights, BatchNorm folded, inputs on the device, "
          f"{batches_per_call} batches per runner call, timed with "
          f"{'CUDA events' if on_gpu else 'the wall clock'})")
    for line in describe_machine(device):
        print(line)
    print()
    rows = []
    for variant in chosen:
        cells = []
        for batch_size in batch_sizes:
            faces_per_second = measure(base_model, device, variant, batch_size, batches_per_call, seconds)
            print(f"  {variant.label}, batch {batch_size}: {faces_per_second:.1f} faces/s", file=sys.stderr, flush=True)
            cells.append(f"{faces_per_second:.0f}" if faces_per_second >= 100 else f"{faces_per_second:.1f}")
        rows.append((variant.label, cells))
    print("| variant | " + " | ".join(f"batch {size}" for size in batch_sizes) + " |")
    print("| --- | " + " | ".join("---:" for _ in batch_sizes) + " |")
    for label, cells in rows:
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
