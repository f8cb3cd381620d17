"""What the doctor asks of the MuseTalk files: whether each one loads, how long the engine takes to load and how
fast the model step runs here.

Plain results (no report types): heygem.doctor turns them into its lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from heygem.engines.musetalk.files import (
    INSTALL_LINE,
    PARSING_FILES,
    find_musetalk_files,
    missing_files,
    missing_libraries,
)
from heygem.errors import HeygemError

CPU_STEP_FACES = 1  # faces timed on the CPU (seconds each)
GPU_STEP_FACES = 32  # faces per timed pass on a GPU
TIMED_PASSES = 3


@dataclass(frozen=True)
class FileCheck:
    name: str  # "musetalkV15/unet.pth", "model step"
    problem: str | None  # one line, None when it is fine
    detail: str  # what was found
    fix: str = ""
    slow: bool = False  # fine but slow (the CPU): a warning


def check_musetalk_files(folder: Path, time_step: bool = True) -> list[FileCheck]:
    """Every MuseTalk file in ``folder`` loaded strictly, the optional face parsing files, and the model
    step timed on this machine's device (``time_step``). [] when the folder does not exist."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    libraries = missing_libraries()
    if libraries:
        return [FileCheck("libraries", f"{' and '.join(libraries)} not installed", "the engine cannot load",
                          INSTALL_LINE)]
    missing = missing_files(folder)
    if missing:
        return [FileCheck(name, "missing", f"not in {folder}", "copy MuseTalk's models/ folder into "
                          f"{folder} (python -m heygem weights list names each file)") for name in missing]
    from heygem.engines.musetalk import loading

    files = find_musetalk_files(folder)
    checks, networks = [], {}
    for label, path, load in (("UNet", files.unet, loading.load_unet), ("VAE", files.vae, loading.load_vae),
                              ("Whisper encoder", files.whisper, loading.load_whisper_encoder),
                              ("feature extractor", files.whisper_preprocessor, loading.load_feature_extractor)):
        name = str(path.relative_to(folder))
        try:
            networks[label] = load(files)
        except HeygemError as error:
            checks.append(FileCheck(name, str(error).splitlines()[0], "does not load",
                                    "replace it with the file MuseTalk's download_weights.sh fetches"))
            continue
        checks.append(FileCheck(name, None, f"loads into the {label} ({path.stat().st_size / 2**20:.0f} MiB)"))
    checks += parsing_checks(files, folder)
    if time_step and "UNet" in networks and "VAE" in networks:
        del networks  # the engine below loads its own
        checks += time_engine(files)
    return checks


def parsing_checks(files, folder: Path) -> list[FileCheck]:
    """The optional BiSeNet files: loaded when both are there, else which paste mask is used."""
    if files.parsing is None:
        present = [name for name in PARSING_FILES if (folder / name).is_file()]
        detail = (f"only {present[0]} of the two face parsing files" if present else "no face parsing files") + \
            ": the paste mask is heygem's landmark lower-face mask"
        return [FileCheck("face-parse-bisent", None, detail)]
    import torch

    from heygem.engines.musetalk.parsing import load_bisenet

    try:
        load_bisenet(files, torch.device("cpu"))
    except HeygemError as error:
        return [FileCheck("face-parse-bisent", str(error).splitlines()[0], "does not load",
                          "replace both files with the ones MuseTalk's download_weights.sh fetches, or remove them")]
    return [FileCheck("face-parse-bisent", None, "BiSeNet loads: the paste mask is MuseTalk 1.5's jaw mask")]


def time_engine(files) -> list[FileCheck]:
    """The engine loaded as a job loads it (from the network copy when one matches the files, else from the
    files, then the copy written: heygem.engines.musetalk.network_copy), timed phase by phase; then its model
    step (UNet + decode) timed on the first GPU (faces a second) or on the CPU (seconds a face: slow)."""
    import torch

    from heygem.config import EngineConfig
    from heygem.engines.musetalk.engine import MuseTalkEngine

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    faces = GPU_STEP_FACES if on_gpu else CPU_STEP_FACES
    started = time.perf_counter()
    engine = MuseTalkEngine(files, EngineConfig(name="musetalk", device=device.type, batch_size=faces,
                                                musetalk_parsing="landmarks"), use_cache=False)
    seconds = time.perf_counter() - started
    phases = ", ".join(f"{phase} {value:.2f}" for phase, value in engine.load_seconds.items() if value >= 0.005)
    next_start = (" (the network copy is written: the next start reads it)"
                  if engine.weights_source == "official files" and engine.load_seconds.get("write copy") else "")
    load = FileCheck("engine load", None, f"{seconds:.1f} s from the {engine.weights_source} in this process, "
                                          f"libraries already imported: {phases}{next_start}")
    latents = torch.randn(faces, 8, 32, 32, device=device)
    audio = torch.randn(faces, 50, 384, device=device)
    started = time.perf_counter()
    engine.generate_faces(latents, audio)  # the first batch: waits for the warm-up (autotuning, graph capture)
    if on_gpu:
        torch.cuda.synchronize()
    first = time.perf_counter() - started
    times = []
    for _ in range(TIMED_PASSES):  # the quickest pass: other work on the machine only slows one down
        if on_gpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        engine.generate_faces(latents, audio)
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    seconds = min(times)
    if on_gpu:
        detail = (f"{faces / seconds:.0f} faces/s on {torch.cuda.get_device_name(0)} (UNet + decode, fp16, batches "
                  f"of {faces}; the first batch, warm-up included, {first:.1f} s)")
        return [load, FileCheck("model step", None, detail)]
    per_face = seconds / faces
    detail = f"{per_face:.1f} s a face on the CPU: a minute of 25 fps video takes about {per_face * 25:.0f} min"
    return [load, FileCheck("model step", None, detail, "use a CUDA GPU for MuseTalk", slow=True)]
