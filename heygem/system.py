"""What this machine offers heygem: versions, the GPU, ffmpeg, the weights found.

``system_report()`` is what the web app's System tab shows. It never raises:
a part that cannot be inspected is reported as such.
"""

from __future__ import annotations

import logging
import platform
import subprocess
import sys
from pathlib import Path

from heygem import __version__
from heygem.media import ffmpeg_binary
from heygem.pipeline import weights_dir as configured_weights_dir
from heygem.weights import find_wav2lip_checkpoint

logger = logging.getLogger("heygem")



def _torch_report() -> dict:
    try:
        import torch
    except ImportError:
        return {"torch": "not installed"}
    cuda_available = torch.cuda.is_available()
    cudnn_available = bool(torch.backends.cudnn.is_available())
    devices = ["cpu"]
    if cuda_available:
        devices = [f"cuda:{index} {torch.cuda.get_device_name(index)}" for index in range(torch.cuda.device_count())]
    return {
        "torch": torch.__version__,
        "cuda_available": cuda_available,
        "cuda_version": torch.version.cuda or "none (CPU build)",
        "devices": devices,
        "cudnn_active": bool(cuda_available and cudnn_available and torch.backends.cudnn.enabled),
        "cudnn_available": cudnn_available,
        "cudnn_enabled": bool(torch.backends.cudnn.enabled),
        "cudnn_version": torch.backends.cudnn.version() if cudnn_available else None,
    }


def _ffmpeg_report() -> dict:
    try:
        binary = ffmpeg_binary()
    except Exception as error:  # HeygemError with advice when there is none
        return {"ffmpeg": f"not found: {error}"}
    version = ""
    try:
        completed = subprocess.run([binary, "-hide_banner", "-version"], capture_output=True, text=True, timeout=10)
        version = completed.stdout.splitlines()[0] if completed.stdout else ""
    except (OSError, subprocess.SubprocessError):
        version = "does not run"
    return {"ffmpeg": binary, "ffmpeg_version": version}


def _weights_report(weights_dir: Path) -> dict:
    found = sorted(path.name for path in weights_dir.glob("*") if path.is_file() and path.suffix in (".pth", ".pt",
                                                                                                      ".ckpt", ".onnx"))
    report = {"weights_dir": str(weights_dir), "weights_files": found}
    checkpoint = find_wav2lip_checkpoint(weights_dir)
    report["wav2lip_checkpoint"] = str(checkpoint) if checkpoint else None
    report["engine_auto_picks"] = "wav2lip" if checkpoint else "landmark (no Wav2Lip checkpoint in weights/)"
    return report


def _package_versions() -> dict:
    from importlib import metadata

    versions = {}
    for package in ("gradio", "mediapipe", "opencv-contrib-python", "opencv-python", "librosa", "av", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


def system_report(weights_dir: Path | None = None) -> dict:
    """Versions, device, cuDNN state, ffmpeg and checkpoints, as a flat-ish dict for display."""
    report: dict = {
        "heygem": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    for part in (_torch_report, _ffmpeg_report, lambda: _weights_report(Path(weights_dir or configured_weights_dir())),
                 lambda: {"packages": _package_versions()}):
        try:
            report.update(part())
        except Exception as error:  # a report must not break the page that shows it
            logger.warning("system report: %s", error)
            report.setdefault("problems", []).append(str(error))
    return report
