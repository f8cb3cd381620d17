"""The MuseTalk files in the weights folder, laid out as MuseTalk's own download script lays them out.

Users copy MuseTalk's ``models/`` folder into ``weights/musetalk/``::

    weights/musetalk/
        musetalkV15/unet.pth  musetalkV15/musetalk.json        the 1.5 UNet (preferred)
        musetalk/pytorch_model.bin  musetalk/musetalk.json     the 1.0 UNet (used when 1.5 is absent)
        sd-vae/config.json  sd-vae/diffusion_pytorch_model.bin the VAE (sd-vae-ft-mse)
        whisper/config.json  whisper/pytorch_model.bin  whisper/preprocessor_config.json  (whisper-tiny)
        face-parse-bisent/79999_iter.pth  face-parse-bisent/resnet18-5c106cde.pth  (optional: BiSeNet)

Only file names are looked at here (no torch): choosing the engine stays quick.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from heygem.runtime.kept import file_identity
from heygem.weights import weights_dir

FOLDER_NAME = "musetalk"
UNET_FILES = {  # version -> (weights, config), relative to the folder, best first
    "v15": ("musetalkV15/unet.pth", "musetalkV15/musetalk.json"),
    "v1": ("musetalk/pytorch_model.bin", "musetalk/musetalk.json"),
}
VAE_FILES = ("sd-vae/config.json", "sd-vae/diffusion_pytorch_model.bin")
WHISPER_FILES = ("whisper/config.json", "whisper/pytorch_model.bin", "whisper/preprocessor_config.json")
PARSING_FILES = ("face-parse-bisent/79999_iter.pth", "face-parse-bisent/resnet18-5c106cde.pth")
LIBRARIES = ("diffusers", "transformers")  # what the engine runs on: the musetalk extra
INSTALL_LINE = "pip install -e .[musetalk]"


@dataclass(frozen=True)
class MuseTalkFiles:
    """The files one MuseTalk engine loads (absolute paths)."""

    folder: Path
    version: str  # "v15" or "v1"
    unet: Path
    unet_config: Path
    vae_config: Path
    vae: Path
    whisper_config: Path
    whisper: Path
    whisper_preprocessor: Path
    parsing: Path | None  # 79999_iter.pth, or None without face parsing
    parsing_backbone: Path | None  # resnet18-5c106cde.pth

    @property
    def identity(self) -> tuple:
        """What must stay equal for an engine loaded from these files to be reused: every path, size
        and modification time (heygem.runtime.kept.file_identity), the UNet's first, so that an engine
        of an earlier UNet file is dropped as stale when a new one is kept."""
        paths = [self.unet, self.unet_config, self.vae_config, self.vae, self.whisper_config, self.whisper,
                 self.whisper_preprocessor, self.parsing, self.parsing_backbone]
        return tuple(file_identity(path) if path is not None else None for path in paths)


def musetalk_folder() -> Path:
    """weights/musetalk (under $HEYGEM_WEIGHTS when set)."""
    return weights_dir() / FOLDER_NAME


def missing_files(folder: Path | None = None) -> list[str]:
    """The required files not in ``folder`` (default weights/musetalk), relative to it: [] when
    complete. A UNet of either version counts; without any, the 1.5 files are named."""
    folder = Path(folder) if folder is not None else musetalk_folder()
    unet = next((pair for pair in UNET_FILES.values() if all((folder / name).is_file() for name in pair)), None)
    wanted = [*(unet or UNET_FILES["v15"]), *VAE_FILES, *WHISPER_FILES]
    return [name for name in wanted if not (folder / name).is_file()]


def find_musetalk_files(folder: Path | None = None) -> MuseTalkFiles | None:
    """The files in ``folder`` (default weights/musetalk), or None when any required one is missing.
    The 1.5 UNet is preferred over 1.0; face parsing is used only when both of its files are there."""
    folder = Path(folder) if folder is not None else musetalk_folder()
    if missing_files(folder):
        return None
    version = next(name for name, pair in UNET_FILES.items() if all((folder / file).is_file() for file in pair))
    unet, unet_config = (folder / name for name in UNET_FILES[version])
    parsing = [folder / name for name in PARSING_FILES]
    has_parsing = all(path.is_file() for path in parsing)
    return MuseTalkFiles(
        folder=folder, version=version, unet=unet, unet_config=unet_config,
        vae_config=folder / VAE_FILES[0], vae=folder / VAE_FILES[1],
        whisper_config=folder / WHISPER_FILES[0], whisper=folder / WHISPER_FILES[1],
        whisper_preprocessor=folder / WHISPER_FILES[2],
        parsing=parsing[0] if has_parsing else None, parsing_backbone=parsing[1] if has_parsing else None)


def missing_libraries() -> list[str]:
    """The libraries of the musetalk extra that are not installed ([] when both are)."""
    return [name for name in LIBRARIES if importlib.util.find_spec(name) is None]
