"""Text to speech speed: a ~30 s paragraph spoken by ``python -m heygem say`` in a fresh process.

Each run is a whole process (Python start, imports, voice load and the first synthesis all counted),
as a user runs it. "x real time" is the speech's length over the process's wall time. The first run
starts with an empty voice cache (the optimised voice is made then), the later ones find it. "cpu s"
adds up the process's user and system time: on a busy, shared machine it shows the work done when the
wall time does not; the load average at each run's start is printed for the same reason.

    python bench/bench_tts.py                      # this checkout, 1 cold + 3 warm runs
    python bench/bench_tts.py --runs 5 --checkout /path/to/other/checkout --markdown table.md
    python bench/bench_tts.py --breakdown          # one process: import, voice load, first and second call
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PARAGRAPH = (
    "Welcome to heygem. You write a script, and a presenter reads it for you. "
    "The speech is made on this machine, with no download and no account. "
    "Each sentence becomes a subtitle cue, timed from the synthesis itself. "
    "Long texts are split into sentences and spoken one at a time, so memory stays flat. "
    "When you are happy with the voice, press generate and wait for the video. "
    "It takes a little while on a laptop, and much less on a machine with a graphics card. "
    "That is all there is to it; thank you for listening, and have a good day."
)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="warm-cache runs after the cold one")
    parser.add_argument("--checkout", type=Path, default=REPO, help="the heygem checkout whose `say` is timed")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to run it with")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    parser.add_argument("--breakdown", action="store_true",
                        help="time the steps of the first and second call inside one process instead")
    return parser.parse_args()


def speech_seconds(path: Path) -> float:
    with wave.open(str(path), "rb") as wav:
        return wav.getnframes() / wav.getframerate()


def time_say(python: str, checkout: Path, output: Path, cache: Path) -> dict:
    """One fresh `python -m heygem say PARAGRAPH`: wall and CPU seconds, speech seconds, load average."""
    env = {**os.environ, "HEYGEM_VOICE_CACHE": str(cache), "PYTHONPATH": str(checkout)}
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    completed = subprocess.run([python, "-m", "heygem", "say", PARAGRAPH, "-o", str(output)], cwd=checkout, env=env,
                               capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise SystemExit(f"say failed: {completed.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    audio = speech_seconds(output)
    return {"wall": wall, "cpu": cpu, "audio": audio, "load": load, "realtime": audio / wall}


def run_processes(args: argparse.Namespace) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="heygem-bench-tts-") as folder:
        cache = Path(folder) / "voice-cache"
        for number in range(args.runs + 1):
            result = time_say(args.python, args.checkout, Path(folder) / "speech.wav", cache)
            label = "first run, empty voice cache" if number == 0 else f"run {number + 1}, voice cache warm"
            rows.append(f"| {label} | {result['audio']:.1f} | {result['wall']:.2f} | {result['cpu']:.2f} | "
                        f"**{result['realtime']:.1f}** | {result['load']:.1f} |")
            print(rows[-1], flush=True)
    header = ["| run (whole process: start, imports, voice load, first call) | speech s | wall s | cpu s "
              "| x real time | load average |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    return header + rows


def run_breakdown(checkout: Path) -> list[str]:
    """Import, voice load, first and second call inside this process, with ``checkout``'s heygem."""
    timings = {}
    started = time.perf_counter()
    sys.path.insert(0, str(checkout))
    from heygem.speech.tts import choose_voice, load_voice, synthesize

    timings["import heygem.speech.tts"] = time.perf_counter() - started
    step = time.perf_counter()
    voice = choose_voice(PARAGRAPH).voice
    load_voice(voice)
    timings["voice load (onnxruntime session)"] = time.perf_counter() - step
    step = time.perf_counter()
    first = synthesize(PARAGRAPH, voice=voice)
    timings["first call"] = time.perf_counter() - step
    step = time.perf_counter()
    synthesize(PARAGRAPH, voice=voice)
    timings["second call"] = time.perf_counter() - step
    lines = ["| step | seconds |", "| --- | ---: |"] + [f"| {name} | {seconds:.2f} |"
                                                        for name, seconds in timings.items()]
    lines.append(f"| speech made per call | {first.duration:.1f} |")
    return lines


def main() -> None:
    args = parse_arguments()
    lines = run_breakdown(args.checkout) if args.breakdown else run_processes(args)
    table = "\n".join(lines)
    print(table)
    if args.markdown is not None:
        args.markdown.write_text(table + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
