"""GFPGAN v1.4 restorer throughput on this machine, in faces per second at 512x512.

Times the network alone (random-init weights in the released layout; aligned faces already
on the device; no alignment or pasting) through heygem.runtime.device.FixedBatchRunner, the runner
the restorer uses, for each batch size and configuration: the modulated convolutions as
per-sample grouped convolutions or in the fused form (one shared convolution, input scaled
by the style, output by the demodulation factors), fp32/fp16/bf16, channels_last on or off,
CUDA graph replay, and the fp16 channels_last model through torch.compile (compiled and warmed
up before the timing; the compile time is printed in a second table). On CUDA the time comes
from CUDA events; on the CPU from the wall clock. A configuration that fails prints its reason
in its row, and the run goes on.

    python bench/bench_gfpgan.py --device cuda --batch-sizes 1 8 16 32 64 --seconds 3 --markdown
    python bench/bench_gfpgan.py --device cuda --batch-sizes 8 16 32 --seconds 2 \\
        --variants fused-fp16-cl fused-fp16-cl-graph fused-fp16-cl-compile [--compile-mode max-autotune-no-cudagraphs]
    python bench/bench_gfpgan.py --device cpu --batch-sizes 1 --repeats 1   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


@dataclass(frozen=True)
class Variant:
    key: str  # what --variants takes
    fused: bool  # the shared-convolution form of the modulated convolutions
    precision: str  # as FixedBatchRunner takes it
    channels_last: bool = False
    cuda_graph: bool = False
    compiled: bool = False  # through torch.compile (--compile-mode); run only when --variants names it
    cuda_only: bool = False  # meaningless or far too slow on the CPU

    @property
    def label(self) -> str:
        parts = ["fused" if self.fused else "grouped", self.precision]
        if self.channels_last:
            parts.append("channels_last")
        if self.cuda_graph:
            parts.append("CUDA graph")
        if self.compiled:
            parts.append("torch.compile")
        return " + ".join(parts)


VARIANTS = [
    Variant("grouped-fp32", False, "fp32"),
    Variant("fused-fp32", True, "fp32"),
    Variant("fused-fp32-cl", True, "fp32", channels_last=True),
    Variant("grouped-fp16", False, "fp16", cuda_only=True),
    Variant("fused-fp16", True, "fp16", cuda_only=True),
    Variant("fused-fp16-cl", True, "fp16", channels_last=True, cuda_only=True),
    Variant("fused-fp16-cl-graph", True, "fp16", channels_last=True, cuda_graph=True, cuda_only=True),
    Variant("fused-bf16-cl", True, "bf16", channels_last=True, cuda_only=True),
    Variant("fused-fp16-cl-compile", True, "fp16", channels_last=True, compiled=True, cuda_only=True),
]
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")


class CompileFailed(Exception):
    """torch.compile could not compile (or run) the network; the message is its first line."""


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="faces per forward pass (default: 1 8 16 32 on CUDA, 1 on the CPU)")
    parser.add_argument("--variants", nargs="+", choices=[variant.key for variant in VARIANTS], default=None,
                        help="which configurations to time (default: all that apply to the device, "
                             "except the torch.compile one, which compiles for minutes)")
    parser.add_argument("--seconds", type=float, default=2.0, help="time each configuration at least this long")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed forward passes per configuration (default: as many as --seconds takes)")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                        help="torch.compile mode of the compiled variant (default: default; "
                             "max-autotune-no-cudagraphs searches kernels for longer)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled variant (default: inductor)")
    parser.add_argument("--markdown", action="store_true",
                        help="print only a markdown table, one row per configuration")
    return parser.parse_args(argv)


def compile_runner(runner, faces, mode: str = "default", backend: str = "inductor") -> float:
    """Put ``runner``'s network through torch.compile and run it on ``faces`` (which compiles it);
    returns the seconds that took. Raises CompileFailed when compiling or running the result fails
    (an out-of-memory error is re-raised as it is)."""
    import torch

    from heygem.runtime.device import is_out_of_memory

    torch._dynamo.reset()  # each configuration compiles from scratch, so its compile time is its own
    started = time.perf_counter()
    try:
        runner.module = torch.compile(runner.module, mode=mode, backend=backend, dynamic=False)
        runner(faces)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    except Exception as error:  # noqa: BLE001 - whatever the compiler raises, the run goes on without it
        if is_out_of_memory(error):
            raise
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CompileFailed(f"{type(error).__name__}: {reason[:200]}".replace("|", "/")) from error
    return time.perf_counter() - started


def time_variant(model, variant: Variant, batch_size: int, device, seconds: float, repeats: int | None,
                 compile_mode: str = "default", compile_backend: str = "inductor") -> tuple[float, float | None]:
    """Faces per second of ``model`` (a copy is taken over by the runner) in ``variant``, and the
    seconds torch.compile took (None when the variant is not compiled)."""
    import torch

    from heygem.runtime.device import FixedBatchRunner

    network = copy.deepcopy(model).set_fused_modulation(variant.fused)
    runner = FixedBatchRunner(network, device, batch_size, precision=variant.precision,
                              channels_last=variant.channels_last, use_cuda_graph=variant.cuda_graph,
                              name=f"GFPGAN ({variant.label})")
    faces = torch.rand((batch_size, 3, 512, 512), device=device).mul_(2.0).sub_(1.0)  # (B, 3, 512, 512) RGB in [-1, 1]
    on_cuda = device.type == "cuda"
    compile_seconds = compile_runner(runner, faces, compile_mode, compile_backend) if variant.compiled else None
    for _ in range(3 if on_cuda else 1):  # warm-up: cuDNN autotuning, graph capture
        runner(faces)
    if on_cuda:
        torch.cuda.synchronize(device)
    calls, elapsed = 0, 0.0
    while (repeats is None and elapsed < seconds) or (repeats is not None and calls < repeats):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner(faces)
            end.record()
            end.synchronize()
            elapsed += start.elapsed_time(end) / 1000.0
        else:
            started = time.perf_counter()
            runner(faces)
            elapsed += time.perf_counter() - started
        calls += 1
    return calls * batch_size / elapsed, compile_seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    import torch

    from heygem.models.gfpgan import GFPGANClean
    from heygem.runtime.device import configure_backends, pick_device

    device = pick_device(args.device)
    configure_backends(device=device)
    on_cuda = device.type == "cuda"
    batch_sizes = args.batch_sizes or ([1, 8, 16, 32] if on_cuda else [1])
    chosen = [variant for variant in VARIANTS
              if (variant.key in args.variants if args.variants is not None else not variant.compiled)
              and (on_cuda or not variant.cuda_only)]
    torch.manual_seed(0)
    model = GFPGANClean().eval().to(device)
    name = torch.cuda.get_device_name(device) if on_cuda else platform.processor() or platform.machine()
    if not args.markdown:
        print(f"{name}, torch {torch.__version__}; GFPGAN v1.4 at 512x512, random-init weights")
    print("| configuration | batch | faces/s |")
    print("|---|---:|---:|")
    compile_times = []  # (label, batch size, seconds)
    for variant in chosen:
        for batch_size in batch_sizes:
            try:
                rate, compile_seconds = time_variant(model, variant, batch_size, device, args.seconds, args.repeats,
                                                     args.compile_mode, args.compile_backend)
                print(f"| {variant.label} | {batch_size} | {rate:.4g} |", flush=True)
                if compile_seconds is not None:
                    compile_times.append((variant.label, batch_size, compile_seconds))
            except CompileFailed as error:  # it would fail the same way at the other batch sizes
                print(f"| {variant.label} | {batch_size} | torch.compile failed, variant skipped: {error} |",
                      flush=True)
                break
            except Exception as error:  # noqa: BLE001 - one failing configuration should not hide the others
                reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                print(f"| {variant.label} | {batch_size} | failed: {reason} |", flush=True)
            finally:
                if on_cuda:
                    torch.cuda.empty_cache()
    if compile_times:
        print()
        print(f"| compiled configuration (mode {args.compile_mode}) | batch | compile + first run, s |")
        print("|---|---:|---:|")
        for label, batch_size, seconds in compile_times:
            print(f"| {label} | {batch_size} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
