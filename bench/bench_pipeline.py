"""Whole-pipeline throughput, per configuration, each in a fresh process.

    python bench/bench_pipeline.py [--seconds 60] [--size 1920x1080] [--configs NAME ...]
                                   [--markdown OUT.md] [--weights DIR]

Makes a synthetic talking-head input (the bundled portrait drifting slowly, 25 fps, with the
bundled speech looped to the same length), then runs :func:`heygem.pipeline.generate` once per
configuration in a child process (so each pays its own imports and start-up, and its peak
memory is its own), and prints frames per second end to end, the real-time factor, peak
resident memory (heygem plus its ffmpeg children, sampled every 50 ms), peak GPU memory,
busy seconds per stage (with the CPU seconds of the stage's own thread in that time: a stage
busy much longer than that waits for the GPU, other processes or the interpreter lock), and the
CPU seconds each kind of process used (the main process with all its threads, the x264
encoders, the ffmpeg decoders, rendering and tracking processes):
their sum over the wall time is how many cores the run kept busy. The wav2lip engine runs a
random-init checkpoint in the official layout
(the same speed as trained weights) unless --weights names a folder with real ones; the musetalk
engine random-init files in MuseTalk's layout (heygem.engines.musetalk.random_files; full size
by default, --musetalk-size reduced for a quick CPU run of the same command).

Configurations (--configs picks some, run in the order given: "cold cache" clears the avatar
cache first, "warm cache" reuses what the run before it stored):
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from sampling import Sampling, ThreadSampler

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# name -> (engine, option overrides, clear the avatar cache first); "second job" configurations run the
# same job twice in one process and time the second, as a job worker that keeps its engine does
CONFIGURATIONS: dict[str, tuple[str, dict, bool]] = {
    "wav2lip sequential": ("wav2lip", {"run.concurrent": False, "run.render": "numpy", "run.encoders": 1,
                                       "run.avatar_cache": False}, False),
    "wav2lip cold cache": ("wav2lip", {}, True),
    "wav2lip warm cache": ("wav2lip", {}, False),
    "wav2lip warm cache, second job": ("wav2lip", {}, False),
    "wav2lip warm cache, second job, one decoder": ("wav2lip", {"run.decoders": 1}, False),
    "wav2lip fp32, no graph": ("wav2lip", {"engine.precision": "fp32", "engine.cuda_graph": False}, False),
    "wav2lip fp16 + channels_last, no graph": ("wav2lip", {"engine.cuda_graph": False}, False),
    "wav2lip cuDNN off": ("wav2lip", {"engine.cudnn": False}, False),
    "wav2lip numpy render": ("wav2lip", {"run.render": "numpy"}, False),
    # a worker's next job on a face video it has not seen: the engine kept, every frame tracked
    "wav2lip tracked, second job": ("wav2lip", {"run.avatar_cache": False}, False),
    "landmark sequential": ("landmark", {"run.concurrent": False, "run.encoders": 1, "run.avatar_cache": False}, False),
    "landmark cold cache": ("landmark", {}, True),
    "landmark warm cache": ("landmark", {}, False),
    "landmark warm cache, second job": ("landmark", {}, False),
    "landmark torch render, second job": ("landmark", {"run.render": "torch"}, False),
    "landmark numpy render, second job": ("landmark", {"run.render": "numpy"}, False),
    "landmark tracked, second job": ("landmark", {"run.avatar_cache": False}, False),
    # MuseTalk 1.5 from random-init files in the official layout (--musetalk-size): "cold cache" tracks
    # every frame and encodes every crop (and stores both), "warm cache" reuses the tracking and the crops'
    # latents, "tracked" tracks every frame (and encodes every crop: no avatar cache at all)
    "musetalk cold cache": ("musetalk", {}, True),
    "musetalk warm cache": ("musetalk", {}, False),
    "musetalk warm cache, second job": ("musetalk", {}, False),
    "musetalk tracked, second job": ("musetalk", {"run.avatar_cache": False}, False),
}


def machine_description() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    if torch.cuda.is_available():
        gpu = (f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, CUDA {torch.version.cuda}, "
               f"cuDNN {torch.backends.cudnn.version()}")
    else:
        gpu = "no GPU"
    return f"{cpu}, {os.cpu_count()} cores; {gpu}; torch {torch.__version__}, Python {platform.python_version()}"


def process_table() -> dict[int, tuple[int, str]]:
    """Every process on this Linux machine: pid -> (parent pid, state letter, "Z" for a zombie), from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                table[int(entry.name)] = (int(fields[1]), fields[0])
            except (OSError, IndexError, ValueError):
                continue  # gone while being read
    return table


def child_pids(pid: int, living: bool = False) -> list[int]:
    """The processes whose parent is ``pid`` (only those not yet exited when ``living``)."""
    return [child for child, (parent, state) in process_table().items()
            if parent == pid and not (living and state == "Z")]


class MemorySampler(Sampling):
    """Peak resident memory of this process plus its children (ffmpeg), sampled every 50 ms, and the
    CPU seconds each process used while sampled.

    (getrusage's figure for children is useless here: a forked child reports the parent's
    size at the moment of the fork.) A child's CPU time is its last sample's: up to 50 ms of a
    child that exits between samples is missed. Children that were already running when the
    sampling started (a warm engine's processes) count from their first sample.
    """

    def __init__(self):
        self.peak_kib = 0
        self.peak_parts: dict[str, tuple[int, int]] = {}  # at the peak: "main" / a child's name -> (count, KiB)
        self._cpu_first: dict[int, float] = {}  # child pid -> CPU seconds at its first sample
        self._cpu_last: dict[int, tuple[str, float]] = {}  # child pid -> (name, CPU seconds at its last sample)
        self._main_cpu = os.times()
        self._names: dict[int, str] = {}
        self.cpu_seconds: dict[str, tuple[int, float]] = {}  # after the run: "main" / a child's name -> (count, s)
        self._first = True  # the next sample is the first
        super().__init__(0.05)

    @staticmethod
    def _rss_kib(pid) -> int:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    @staticmethod
    def _children() -> list[int]:
        """This process's children, from each of its threads' /proc children list; the sampler runs
        inside the measured process, so it does not scan every process on the machine where the
        kernel keeps those lists."""
        if not Path(f"/proc/self/task/{os.getpid()}/children").exists():
            return child_pids(os.getpid())
        pids = []
        for task in Path("/proc/self/task").iterdir():
            try:
                pids.extend(int(pid) for pid in (task / "children").read_text().split())
            except OSError:
                continue  # a thread that ended meanwhile
        return pids

    def _name(self, pid) -> str:
        if pid not in self._names:
            self._names[pid] = self._read_name(pid)
        return self._names[pid]

    @staticmethod
    def _read_name(pid) -> str:
        """ffmpeg children as "x264" or "ffmpeg" (decoding, joining), others by their command name."""
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            if "ffmpeg" in name:
                return "x264" if b"libx264" in Path(f"/proc/{pid}/cmdline").read_bytes() else "ffmpeg"
            return name
        except OSError:
            return "?"

    @staticmethod
    def _cpu(pid) -> float | None:
        """User plus system CPU seconds of a process so far (None when it is gone)."""
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None

    def sample(self) -> None:
        parts = {"main": (1, self._rss_kib("self"))}
        for pid in self._children():
            name = self._name(pid)
            count, kib = parts.get(name, (0, 0))
            parts[name] = (count + 1, kib + self._rss_kib(pid))
            cpu = self._cpu(pid)
            if cpu is not None:
                # a child first seen in the first sample ran before the job: count from there
                self._cpu_first.setdefault(pid, cpu if self._first else 0.0)
                self._cpu_last[pid] = (name, cpu)
        self._first = False
        total = sum(kib for _, kib in parts.values())
        if total > self.peak_kib:
            self.peak_kib, self.peak_parts = total, parts

    def describe_peak(self) -> str:
        """The peak split by process, e.g. "main 2104, ffmpeg x4 812" (MiB)."""
        return ", ".join(f"{name}{f' x{count}' if count > 1 else ''} {kib / 1024:.0f}"
                         for name, (count, kib) in sorted(self.peak_parts.items(), key=lambda item: -item[1][1]))

    def __exit__(self, *exc):
        super().__exit__(*exc)
        now = os.times()
        seconds = {"main": (1, now.user + now.system - self._main_cpu.user - self._main_cpu.system)}
        for pid, (name, cpu) in self._cpu_last.items():
            count, total = seconds.get(name, (0, 0.0))
            seconds[name] = (count + 1, total + cpu - self._cpu_first[pid])
        self.cpu_seconds = seconds

    def describe_cpu(self) -> str:
        """CPU seconds by process, e.g. "x264 x3 30.1, main 12.0; all 50.2" ."""
        parts = sorted(self.cpu_seconds.items(), key=lambda item: -item[1][1])
        total = sum(seconds for _, seconds in self.cpu_seconds.values())
        return ", ".join(f"{name}{f' x{count}' if count > 1 else ''} {seconds:.1f}"
                         for name, (count, seconds) in parts) + f"; all {total:.1f}"


def make_inputs(folder: Path, seconds: float, width: int, height: int) -> tuple[Path, Path]:
    """A width x height, 25 fps video of the portrait drifting slowly (limited-range 4:2:0, as cameras
    and phones write), and speech of the same length."""
    from heygem.media.ffmpeg import ffmpeg_binary

    video = folder / f"face_{width}x{height}_{seconds:g}s.mp4"
    audio = folder / f"speech_{seconds:g}s.wav"
    if video.exists() and audio.exists():  # kept from an earlier run (--inputs)
        return video, audio
    folder.mkdir(parents=True, exist_ok=True)
    portrait = REPO / "assets" / "astronaut.jpg"
    side = max(width, height) + 40
    subprocess.run([ffmpeg_binary(), "-v", "error", "-y", "-loop", "1", "-i", str(portrait),
                    "-vf", f"scale={side}:{side}:out_range=tv,crop={width}:{height}:x='(iw-ow)/2+10*sin(t)':"
                           "y='20+8*cos(t*0.7)',format=yuv420p",
                    "-color_range", "tv", "-r", "25", "-t", str(seconds), "-c:v", "libx264", "-preset", "veryfast",
                    str(video)], check=True)
    subprocess.run([ffmpeg_binary(), "-v", "error", "-y", "-stream_loop", "-1", "-i",
                    str(REPO / "assets" / "speech_en.wav"), "-t", str(seconds), str(audio)], check=True)
    return video, audio


def run_one(video: Path, audio: Path, output: Path, engine: str, overrides: dict, second_job: bool,
            profile_stage: str = "") -> dict:
    """One generation in this process (after a first, untimed one when ``second_job``); what the parent prints.
    ``profile_stage``: sample that stage's thread over the timed generation (sampling.ThreadSampler, on stderr)."""
    if second_job:
        from heygem.pipeline import generate

        generate(video, audio, output, overrides={"engine.name": engine, **overrides})
    from contextlib import nullcontext

    started = time.perf_counter()
    stage_sampler = ThreadSampler(f"heygem-{profile_stage}") if profile_stage else nullcontext()
    with MemorySampler() as memory, stage_sampler as sampler:
        from heygem.pipeline import generate

        summary = generate(video, audio, output, overrides={"engine.name": engine, **overrides})
    elapsed = time.perf_counter() - started
    if sampler is not None:
        print(sampler.report(), file=sys.stderr)
    peak_vram = 0
    import torch

    if torch.cuda.is_available():
        peak_vram = torch.cuda.max_memory_reserved()
    return {"frames": summary.frames, "seconds": elapsed, "video_seconds": summary.video_seconds,
            "peak_rss_mib": memory.peak_kib / 1024, "peak_rss_parts": memory.describe_peak(),
            "cpu_seconds": memory.describe_cpu(),
            "peak_vram_mib": peak_vram / 2**20,
            "stages": summary.seconds_per_stage, "stage_cpu": summary.cpu_seconds_per_stage,
            "avatar_cache": summary.avatar_cache}


def _stage_time(stage: str, busy: float, cpu: float | None) -> str:
    """``render 4.0 (1.2)``: busy seconds, and in brackets the CPU seconds of the stage's thread."""
    return f"{stage} {busy:.1f}" + (f" ({cpu:.1f})" if cpu is not None else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__ + "\n".join(f"  {name}" for name in CONFIGURATIONS),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the test video and audio")
    parser.add_argument("--size", default="1280x720", help="WIDTHxHEIGHT of the test video")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGURATIONS), choices=list(CONFIGURATIONS),
                        metavar="NAME", help="configurations to run, in this order")
    parser.add_argument("--seconds-for", nargs=2, action="append", default=[], metavar=("NAME", "SECONDS"),
                        help="a shorter input for one slow configuration (its frames/s stays comparable)")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--inputs", type=Path,
                        help="keep the test inputs in this folder and reuse them when a later run asks for the "
                             "same size and length (making ten minutes of 1080p takes minutes)")
    parser.add_argument("--weights", type=Path, help="a folder with real checkpoints (default: random-init)")
    parser.add_argument("--gfpgan", action="store_true",
                        help="also put a random-init GFPGANv1.4.pth (official layout) into the weights, so that "
                             "the wav2lip engine restores with GFPGAN (restore.method auto)")
    parser.add_argument("--musetalk-size", choices=("full", "reduced"), default="full",
                        help="the random-init MuseTalk files' size (reduced: the same classes, small, for the CPU)")
    parser.add_argument("--set", nargs=2, action="append", default=[], metavar=("OPTION", "VALUE"),
                        help="an option for every configuration, e.g. --set media.preset ultrafast "
                             "(VALUE is read as YAML: 3, true, fp16)")
    parser.add_argument("--profile-stage", default="", metavar="STAGE",
                        help="print where that stage's thread (e.g. render) spent the timed job, sampled")
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        video, audio, output, engine, overrides, second_job, profile_stage = args.child
        print("RESULT " + json.dumps(run_one(Path(video), Path(audio), Path(output), engine, json.loads(overrides),
                                             second_job == "yes", profile_stage)))
        return

    width, height = (int(v) for v in args.size.lower().split("x"))
    lengths = {name: float(seconds) for name, seconds in args.seconds_for}
    with tempfile.TemporaryDirectory(prefix="heygem-bench-") as folder_name:
        folder = Path(folder_name)
        environment = dict(os.environ, HEYGEM_CACHE_DIR=str(folder / "avatar-cache"), PYTHONUNBUFFERED="1")
        if args.weights is None:
            import torch

            from heygem.models.wav2lip import Wav2Lip

            weights = folder / "weights"
            weights.mkdir()
            torch.save({"state_dict": Wav2Lip().state_dict()}, weights / "wav2lip.pth")
            if any(CONFIGURATIONS[name][0] == "musetalk" for name in args.configs):
                from heygem.engines.musetalk.random_files import write_random_files

                write_random_files(weights / "musetalk", size=args.musetalk_size)
            if args.gfpgan:
                from heygem.models.gfpgan import GFPGANClean

                torch.save({"params_ema": GFPGANClean().state_dict()}, weights / "GFPGANv1.4.pth")
            environment["HEYGEM_WEIGHTS"] = str(weights)
        else:
            environment["HEYGEM_WEIGHTS"] = str(args.weights)
        inputs = {}
        machine = machine_description()
        print(f"machine: {machine}")
        print(f"input: {width}x{height}, 25 fps, {args.seconds:g} s (shorter where noted); "
              "output at the input's size\n")
        common = {option: yaml.safe_load(value) for option, value in args.set}
        if common:
            print("every configuration with " + ", ".join(f"{key}={value}" for key, value in common.items()) + "\n")
        header = ("| configuration | frames | wall s | frames/s | x real time | peak RSS MiB | peak VRAM MiB "
                  "| avatar cache | busy seconds per stage (its thread's CPU seconds) "
                  "| peak RSS by process, MiB | CPU seconds by process |")
        rows = [header, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- |"]
        print(header)
        for name in args.configs:
            engine, overrides, clear_cache = CONFIGURATIONS[name]
            overrides = {**common, **overrides}
            seconds = lengths.get(name, args.seconds)
            if seconds not in inputs:
                inputs[seconds] = make_inputs(args.inputs or folder, seconds, width, height)
            video, audio = inputs[seconds]
            if clear_cache:
                shutil.rmtree(folder / "avatar-cache", ignore_errors=True)
            child = subprocess.run(
                [sys.executable, __file__, "--child", str(video), str(audio), str(folder / "out.mp4"), engine,
                 json.dumps(overrides), "yes" if name.endswith("second job") else "no", args.profile_stage],
                env=environment, capture_output=True, text=True)
            result_lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
            if child.returncode != 0 or not result_lines:
                print(f"| {name} | failed: {(child.stderr.strip().splitlines() or ['?'])[-1]} |")
                continue
            result = json.loads(result_lines[-1][len("RESULT "):])
            if args.profile_stage:
                where = child.stderr.find(f"heygem-{args.profile_stage}: ")
                report = child.stderr[where:] if where >= 0 else f"no stage named {args.profile_stage} ran"
                print(f"{name}, {report}", file=sys.stderr)
            stages = ", ".join(_stage_time(stage, value, result["stage_cpu"].get(stage))
                               for stage, value in result["stages"].items() if value >= 0.05)
            label = name if seconds == args.seconds else f"{name} ({seconds:g} s input)"
            row = (f"| {label} | {result['frames']} | {result['seconds']:.1f} | "
                   f"{result['frames'] / result['seconds']:.1f} | {result['video_seconds'] / result['seconds']:.2f} | "
                   f"{result['peak_rss_mib']:.0f} | {result['peak_vram_mib']:.0f} | "
                   f"{result['avatar_cache']} | {stages} | "
                   f"{result['peak_rss_parts']} | {result['cpu_seconds']} |")
            rows.append(row)
            print(row)
        if args.markdown:
            options = "".join(f", {key}={value}" for key, value in common.items())
            args.markdown.write_text(f"Machine: {machine}\n\n"
                                     f"Input: {width}x{height}, 25 fps, {args.seconds:g} s{options}\n\n"
                                     + "\n".join(rows) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
