"""Wav2Lip generator throughput on this machine, in frames per second.

Times the generator's forward pass alone (random-init weights, inputs already on
the device, no face cropping or video work) for several batch sizes. On CUDA it
compares fp32 with cuDNN autotuning, fp32 with cuDNN switched off, and fp16
autocast with channels-last memory, which is what the wav2lip engine uses.

    python bench/bench_wav2lip.py
    python bench/bench_wav2lip.py --device cuda --batch-sizes 1 16 64 128 --seconds 5
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


@dataclass
class Variant:
    label: str
    precision: str  # as heygem.device.inference_context takes it
    channels_last: bool
    cudnn_enabled: bool = True
    folded: bool = False  # BatchNorm folded into the convolutions, as the engine runs it


CPU_VARIANTS = [
    Variant("fp32", "fp32", channels_last=False),
    Variant("fp32 channels_last", "fp32", channels_last=True),
    Variant("fp32 folded", "fp32", channels_last=False, folded=True),
]
CUDA_VARIANTS = [
    Variant("fp32 cudnn", "fp32", channels_last=False),
    Variant("fp32 no cudnn", "fp32", channels_last=False, cudnn_enabled=False),
    Variant("fp16 channels_last", "fp16", channels_last=True),
    Variant("fp16 channels_last folded", "fp16", channels_last=True, folded=True),
]


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64], help="faces per forward pass")
    parser.add_argument("--seconds", type=float, default=3.0, help="time each measurement for at least this long")
    parser.add_argument("--min-iterations", type=int, default=2, help="timed forward passes per measurement, at least")
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
    import os

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


def measure(model, device, variant: Variant, batch_size: int, seconds: float, min_iterations: int) -> float:
    """Frames per second of the generator for one variant and batch size."""
    import torch

    from heygem.device import inference_context

    memory_format = torch.channels_last if variant.channels_last else torch.contiguous_format
    model.to(memory_format=memory_format)
    faces = torch.rand(batch_size, 6, 96, 96, device=device).contiguous(memory_format=memory_format)
    mel_windows = torch.randn(batch_size, 1, 80, 16, device=device)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    previous_cudnn = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = variant.cudnn_enabled
    try:
        with inference_context(device, variant.precision):
            for _ in range(3 if device.type == "cuda" else 1):  # warm-up, lets cuDNN pick its kernels
                model(mel_windows, faces)
            synchronize()
            iterations, started = 0, time.perf_counter()
            while iterations < min_iterations or time.perf_counter() - started < seconds:
                model(mel_windows, faces)
                iterations += 1
                if device.type != "cuda" or iterations % 10 == 0:
                    synchronize()
            synchronize()
            elapsed = time.perf_counter() - started
    finally:
        torch.backends.cudnn.enabled = previous_cudnn
    return iterations * batch_size / elapsed


def main() -> None:
    arguments = parse_arguments()

    import torch

    from heygem.device import configure_backends, pick_device
    from heygem.models.wav2lip import Wav2Lip, fold_batchnorm

    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    device = pick_device(arguments.device)
    configure_backends()
    model = Wav2Lip().eval().to(device)
    folded_model = fold_batchnorm(Wav2Lip().eval()).to(device)
    variants = CUDA_VARIANTS if device.type == "cuda" else CPU_VARIANTS

    print("Wav2Lip generator throughput (random-init weights, forward pass only, inputs on the device)")
    for line in describe_machine(device):
        print(line)
    print()
    print(f"{'variant':<26}{'batch':>7}{'frames/s':>12}{'ms/batch':>12}")
    for variant in variants:
        for batch_size in arguments.batch_sizes:
            frames_per_second = measure(folded_model if variant.folded else model, device, variant, batch_size,
                                        arguments.seconds, arguments.min_iterations)
            milliseconds = 1000.0 * batch_size / frames_per_second
            print(f"{variant.label:<26}{batch_size:>7}{frames_per_second:>12.1f}{milliseconds:>12.1f}", flush=True)


if __name__ == "__main__":
    main()
