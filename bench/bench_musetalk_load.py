"""How long the MuseTalk engine takes to be ready, and where that time goes, in a fresh process.

    python bench/bench_musetalk_load.py --weights DIR [--write-random] [--size full] [--runs 3] [--json OUT]

DIR holds ``musetalk/`` in the official layout (``--write-random`` writes random-init files there first,
full size by default). Each run is a new Python process (the page cache warm after the first) that
imports heygem, builds the engine as a job does (heygem.engines.musetalk.engine.MuseTalkEngine on
``--device``) and runs its first batch of faces; it reports the seconds of each phase (imports, each
file read, the networks moved to the device, the first batch: graph capture and autotuning) and the
whole. Prints a markdown table of medians last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PHASES = ("import", "import libraries", "read unet", "read vae", "read whisper", "feature extractor", "to device",
          "engine ready", "first batch", "process")


def one_run(weights: Path, device: str, batch: int) -> dict:
    """In this process: build the engine and run its first batch, timing each phase (seconds)."""
    started = time.perf_counter()
    sys.path.insert(0, str(REPO))
    import torch

    from heygem.config import EngineConfig
    from heygem.engines.musetalk import engine as engine_module
    from heygem.engines.musetalk import loading
    from heygem.engines.musetalk.files import find_musetalk_files

    times: dict[str, float] = {"import": time.perf_counter() - started}
    begun = time.perf_counter()
    from diffusers import AutoencoderKL, UNet2DConditionModel  # noqa: F401 - what the loaders import first
    from transformers import WhisperFeatureExtractor, WhisperModel  # noqa: F401

    times["import libraries"] = time.perf_counter() - begun

    def timed(name, function):
        def wrapper(*args, **kwargs):
            begun = time.perf_counter()
            result = function(*args, **kwargs)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name] = times.get(name, 0.0) + time.perf_counter() - begun
            return result
        return wrapper

    loading.load_unet = timed("read unet", loading.load_unet)
    loading.load_vae = timed("read vae", loading.load_vae)
    loading.load_whisper_encoder = timed("read whisper", loading.load_whisper_encoder)
    loading.load_feature_extractor = timed("feature extractor", loading.load_feature_extractor)
    engine_module.MouthModelStep = timed("to device", engine_module.MouthModelStep)
    files = find_musetalk_files(weights / "musetalk")
    engine = engine_module.MuseTalkEngine(files, EngineConfig(name="musetalk", device=device, batch_size=batch))
    times["engine ready"] = time.perf_counter() - started
    latents = torch.randn(batch, 8, 32, 32)
    windows = torch.randn(batch, 50, 384)
    begun = time.perf_counter()
    faces = engine.generate_faces(latents, windows)
    faces.float().mean().item()
    times["first batch"] = time.perf_counter() - begun
    times["process"] = time.perf_counter() - started
    probe = weights / "half-copy-probe.safetensors"
    if probe.is_file():  # what reading a half-precision copy of the UNet straight to the device would take
        from safetensors.torch import load_file

        begun = time.perf_counter()
        tensors = load_file(probe, device=device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times["probe: fp16 unet copy to device"] = time.perf_counter() - begun
        del tensors
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--write-random", action="store_true", help="write random-init files into WEIGHTS first")
    parser.add_argument("--size", default="full", choices=("full", "reduced"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--half-copy-probe", action="store_true",
                        help="also time reading a float16 safetensors copy of the UNet to the device")
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        print(json.dumps(one_run(args.weights, args.device, args.batch)))
        return
    if args.write_random:
        sys.path.insert(0, str(REPO))
        from heygem.engines.musetalk.random_files import write_random_files

        begun = time.perf_counter()
        write_random_files(args.weights / "musetalk", size=args.size)
        print(f"wrote random-init {args.size} files in {time.perf_counter() - begun:.1f} s", flush=True)
    if args.half_copy_probe:
        import torch
        from safetensors.torch import save_file

        unet_path = args.weights / "musetalk" / "musetalkV15" / "unet.pth"
        state = torch.load(unet_path, map_location="cpu", weights_only=True)
        save_file({key: value.half().contiguous() for key, value in state.items()},
                  args.weights / "half-copy-probe.safetensors")
        del state
    runs = []
    for number in range(args.runs):
        begun = time.perf_counter()
        result = subprocess.run([sys.executable, __file__, "--one-run", "--weights", str(args.weights), "--device",
                                 args.device, "--batch", str(args.batch)], capture_output=True, text=True)
        wall = time.perf_counter() - begun
        if result.returncode != 0:
            raise SystemExit(f"run {number} failed:\n{result.stderr[-3000:]}")
        times = json.loads(result.stdout.strip().splitlines()[-1])
        times["wall"] = wall
        runs.append(times)
        print(f"run {number}: " + ", ".join(f"{name} {value:.2f}" for name, value in times.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    print("\n| phase | median s | min | max |\n| --- | --- | --- | --- |")
    for name in (*PHASES, "wall", "probe: fp16 unet copy to device"):
        values = [run[name] for run in runs if name in run]
        if values:
            print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")


if __name__ == "__main__":
    main()
