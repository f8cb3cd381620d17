"""What cuDNN buys on this machine's GPU: the Wav2Lip generator (random weights, batch 64, fp16 autocast,
channels_last, as the wav2lip engine runs it) timed for a second with cuDNN on and off, with CUDA events.
``python -m heygem.runtime.benchmark`` reports it; the web app's System tab runs it in a process of its own
(``python -m heygem.runtime.benchmark``), because switching cuDNN off is process-wide.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from heygem.errors import first_line

logger = logging.getLogger("heygem")

BENCHMARK_BATCH = 64  # faces per forward pass, the wav2lip engine's default batch on a GPU
BENCHMARK_SECONDS = 1.0  # timed time per variant, after the warm-up


@dataclass
class BenchmarkResult:
    """The Wav2Lip generator's throughput on one GPU, with cuDNN and without it."""

    device: str  # "cuda:0 NVIDIA H200"
    batch_size: int
    precision: str  # "fp16 autocast, channels_last"
    faces_per_second_cudnn: float
    faces_per_second_no_cudnn: float

    @property
    def speedup(self) -> float:
        return self.faces_per_second_cudnn / max(self.faces_per_second_no_cudnn, 1e-9)


@dataclass
class Benchmark:
    """The micro-benchmark's outcome: a result, or why there is none."""

    ran: bool
    note: str  # "skipped: ..." or "failed: ..." or a summary of the result
    result: BenchmarkResult | None = None

    def to_dict(self) -> dict:
        result = None
        if self.result is not None:
            result = {**dataclasses.asdict(self.result), "speedup": round(self.result.speedup, 3)}
        return {"ran": self.ran, "note": self.note, "result": result}

    @classmethod
    def from_dict(cls, data: dict) -> Benchmark:
        result = data.get("result")
        if result is not None:
            fields = {field.name for field in dataclasses.fields(BenchmarkResult)}
            result = BenchmarkResult(**{key: value for key, value in result.items() if key in fields})
        return cls(ran=bool(data["ran"]), note=str(data["note"]), result=result)


def torch_sees_gpu() -> bool:
    try:
        import torch
    except Exception:  # noqa: BLE001
        return False
    return torch.cuda.is_available()


@contextmanager
def cudnn_switched(enabled: bool) -> Iterator[None]:
    """Set torch.backends.cudnn.enabled (with autotuning on, as the engine runs) and restore both after."""
    import torch

    cudnn = torch.backends.cudnn
    previous = cudnn.enabled, cudnn.benchmark
    cudnn.enabled, cudnn.benchmark = enabled, True
    try:
        yield
    finally:
        cudnn.enabled, cudnn.benchmark = previous


def time_generator(model, mel_windows, faces, *, warmup: int = 3, seconds: float = BENCHMARK_SECONDS,
                   min_iterations: int = 3) -> float:
    """Faces per second of ``model(mel_windows, faces)`` under the caller's autocast and cuDNN settings.

    mel_windows: (B, 1, 80, 16); faces: (B, 6, 96, 96), both on the model's device.
    Runs ``warmup`` passes (cuDNN picks its kernels then), estimates one pass, then
    times enough passes to fill about ``seconds``. On a GPU the time comes from
    torch.cuda.Event pairs around the timed passes; on the CPU from perf_counter.
    """
    import torch

    device = faces.device
    batch_size = faces.shape[0]
    with torch.inference_mode():
        for _ in range(max(warmup, 1)):
            model(mel_windows, faces)
        if device.type == "cuda":
            def timed(count: int) -> float:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(device)
                start.record()
                for _ in range(count):
                    model(mel_windows, faces)
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / 1000.0
        else:
            def timed(count: int) -> float:
                started = time.perf_counter()
                for _ in range(count):
                    model(mel_windows, faces)
                return time.perf_counter() - started

        one_pass = max(timed(1), 1e-6)
        iterations = max(min_iterations, int(seconds / one_pass))
        return iterations * batch_size / timed(iterations)


def benchmark_generator(device_name: str = "cuda", batch_size: int = BENCHMARK_BATCH,
                        seconds: float = BENCHMARK_SECONDS) -> BenchmarkResult:
    """Time the random-init Wav2Lip generator (BatchNorm folded, as the engine runs it) with and without cuDNN.

    fp16 autocast and channels_last inputs, as the wav2lip engine uses on a GPU.
    The process's cuDNN flags are restored afterwards.
    """
    import torch

    from heygem.models.wav2lip import Wav2Lip, fold_batchnorm
    from heygem.runtime.device import inference_context

    device = torch.device(device_name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    model = fold_batchnorm(Wav2Lip().eval()).to(device, memory_format=torch.channels_last)
    faces = torch.rand(batch_size, 6, 96, 96, device=device).contiguous(memory_format=torch.channels_last)
    mel_windows = torch.randn(batch_size, 1, 80, 16, device=device)  # (B, 1, 80, 16)
    speeds = {}
    try:
        for enabled in (True, False):
            with cudnn_switched(enabled), inference_context(device, "fp16"):
                speeds[enabled] = time_generator(model, mel_windows, faces, seconds=seconds)
    finally:
        del model, faces, mel_windows
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    return BenchmarkResult(device=f"{device} {name}", batch_size=batch_size, precision="fp16 autocast, channels_last",
                           faces_per_second_cudnn=speeds[True], faces_per_second_no_cudnn=speeds[False])


def run_benchmark(separate_process: bool = False) -> Benchmark:
    """The micro-benchmark on the first GPU, or a note saying why it did not run. Never raises.

    ``separate_process`` runs it in a fresh Python (``python -m heygem.runtime.benchmark``): the web app
    asks for that, because switching cuDNN off is process-wide and would slow the jobs its
    workers run meanwhile.
    """
    try:
        if not torch_sees_gpu():
            return Benchmark(False, "skipped: no CUDA GPU on this machine (the benchmark times GPU convolutions)")
        if separate_process:
            return benchmark_in_child_process()
        result = benchmark_generator()
    except Exception as error:  # noqa: BLE001 - the report must come out whatever happened
        logger.warning("GPU benchmark failed: %s", error)
        return Benchmark(False, f"failed: {type(error).__name__}: {first_line(error)}")
    note = (f"{result.faces_per_second_cudnn:,.0f} faces/s with cuDNN, {result.faces_per_second_no_cudnn:,.0f} "
            f"without: {result.speedup:.1f}x")
    return Benchmark(True, note, result)


def benchmark_in_child_process() -> Benchmark:
    """``run_benchmark()`` in a new Python process; its JSON comes back on the last line of stdout."""
    import json

    package_parent = Path(__file__).resolve().parents[2]  # the folder that holds heygem/
    completed = subprocess.run([sys.executable, "-m", "heygem.runtime.benchmark"], cwd=package_parent,
                               capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        errors = completed.stderr.strip().splitlines()
        raise RuntimeError(f"the benchmark process exited with status {completed.returncode}: "
                           f"{errors[-1] if errors else 'no message'}")
    return Benchmark.from_dict(json.loads(lines[-1]))


if __name__ == "__main__":  # the web app's benchmark button runs this in a process of its own
    import json

    print(json.dumps(run_benchmark().to_dict()))
