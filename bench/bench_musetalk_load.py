"""How long the MuseTalk engine takes to be ready, and where that time goes, in a fresh process.

    python bench/bench_musetalk_load.py --weights DIR [--write-random] [--size full] [--runs 3] [--json OUT]

DIR holds ``musetalk/`` in the official layout (``--write-random`` writes random-init files there first,
full size by default). Each run is a new Python process (the page cache warm after the first) that starts
the engine's imports at its first line as the command line does (EngineKind.start_loading), builds the engine
as a job does (heygem.engines.musetalk.engine.MuseTalkEngine on ``--device``) and runs its first batch of faces.
The first run is "cold": the network copy beside the files (weights/musetalk/.heygem-cache) is removed before
it, so it loads the official files and writes the copy; the next ``--runs`` are "warm": they read the copy.
Each reports the engine's own load phases (engine.load_seconds), when the engine was ready (seconds since
the process's first line), the first batch (on a GPU: waiting for the warm-up thread's autotuning and graph
capture, which ran beside nothing here, so this is its whole cost) and the whole. Prints a markdown table
of the cold run and the warm runs' medians last.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

HEAD = ("import heygem", "engine ready", "first batch", "process")


def one_run(weights: Path, device: str, batch: int) -> dict:
    """In this process: build the engine and run its first batch, timing each phase (seconds)."""
    started = time.perf_counter()
    sys.path.insert(0, str(REPO))
    from heygem.config import EngineConfig
    from heygem.engines.musetalk import MuseTalkKind

    config = EngineConfig(name="musetalk", device=device, batch_size=batch, musetalk_parsing="landmarks")
    MuseTalkKind().start_loading(config)  # as the command line does at its start
    import torch

    from heygem.engines.musetalk.engine import MuseTalkEngine
    from heygem.engines.musetalk.files import find_musetalk_files

    times: dict[str, float] = {"import heygem": time.perf_counter() - started}
    engine = MuseTalkEngine(find_musetalk_files(weights / "musetalk"), config, use_cache=False)
    times["engine ready"] = time.perf_counter() - started
    times["source"] = engine.weights_source
    times.update({f"load: {phase}": seconds for phase, seconds in engine.load_seconds.items()})
    latents = torch.randn(batch, 8, 32, 32)
    windows = torch.randn(batch, 50, 384)
    begun = time.perf_counter()
    faces = engine.generate_faces(latents, windows)
    faces.float().mean().item()
    times["first batch"] = time.perf_counter() - begun
    begun = time.perf_counter()
    engine.generate_faces(latents, windows).float().mean().item()
    times["second batch"] = time.perf_counter() - begun
    times["process"] = time.perf_counter() - started
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--write-random", action="store_true", help="write random-init files into WEIGHTS first")
    parser.add_argument("--size", default="full", choices=("full", "reduced"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="warm runs after the cold one")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        print(json.dumps(one_run(args.weights, args.device, args.batch)))
        return
    sys.path.insert(0, str(REPO))
    if args.write_random:
        from heygem.engines.musetalk.random_files import write_random_files

        begun = time.perf_counter()
        write_random_files(args.weights / "musetalk", size=args.size)
        print(f"wrote random-init {args.size} files in {time.perf_counter() - begun:.1f} s", flush=True)
    from heygem.engines.musetalk.network_copy import FOLDER_NAME

    runs = []
    for number in range(args.runs + 1):
        if number == 0:  # cold: no copy yet
            shutil.rmtree(args.weights / "musetalk" / FOLDER_NAME, ignore_errors=True)
        begun = time.perf_counter()
        result = subprocess.run([sys.executable, __file__, "--one-run", "--weights", str(args.weights), "--device",
                                 args.device, "--batch", str(args.batch)], capture_output=True, text=True)
        wall = time.perf_counter() - begun
        if result.returncode != 0:
            raise SystemExit(f"run {number} failed:\n{result.stderr[-3000:]}")
        times = json.loads(result.stdout.strip().splitlines()[-1])
        times["wall"] = wall
        runs.append(times)
        print(f"run {number} ({'cold' if number == 0 else 'warm'}, {times['source']}): "
              + ", ".join(f"{name} {value:.2f}" for name, value in times.items() if name != "source"), flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    shown = ("source", *HEAD, "wall", "second batch")
    names = list(dict.fromkeys(name for run in runs for name in run if name not in shown))
    cold, warm = runs[0], runs[1:]
    print(f"\n| phase | cold: {cold['source']} | warm: median of {len(warm)} ({warm[0]['source'] if warm else '-'}) "
          "| warm min | warm max |\n| --- | --- | --- | --- | --- |")
    for name in ("import heygem", *names, "engine ready", "first batch", "second batch", "process", "wall"):
        values = [run[name] for run in warm if name in run]
        warm_cells = (f"{statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f}" if values
                      else "- | - | -")
        print(f"| {name} | {cold[name]:.2f} | {warm_cells} |" if name in cold else f"| {name} | - | {warm_cells} |")
    copies = sorted((args.weights / "musetalk" / FOLDER_NAME).glob("*.safetensors"))
    print(f"\nnetwork copy: {', '.join(f'{path.name} {path.stat().st_size / 2**20:.0f} MiB' for path in copies)}")


if __name__ == "__main__":
    main()
