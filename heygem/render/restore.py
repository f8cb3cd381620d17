"""Step 6: restoration (deblur) of the generated mouth region.

``choose_restorer`` settles the --restorer option before anything loads: "sharpen" is an
unsharp mask applied only where the engine changed pixels, so untouched skin is left
exactly as it was; "gfpgan" runs the GFPGAN v1.4 network on the aligned face and blends
its lower face back (heygem.render.gfpgan); "none" leaves the patches as they are.
Every method is a ``RESTORERS`` callable taking (patches, frames, Restoration) and
returning patches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from heygem.config import BlendConfig, Config, RestoreConfig
from heygem.render.sharpen import sharpen_changed
from heygem.types import FacePatch
from heygem.weights import find_gfpgan_checkpoint, require_gfpgan_checkpoint, weights_dir

logger = logging.getLogger("heygem")
RESTORER_NAMES = ("gfpgan", "sharpen", "none")


@dataclass(frozen=True)
class RestorerChoice:
    """Which restorer runs, decided from the options, the engine and the weights folder."""

    name: str  # "gfpgan", "sharpen" or "none"
    checkpoint: Path | None  # GFPGANv1.4.pth for gfpgan
    reason: str  # one short phrase for the log


@dataclass
class Restoration:
    """What a restorer needs for a job: its settings and, for gfpgan, the loaded network."""

    name: str  # "gfpgan", "sharpen" or "none"
    strength: float
    network: object | None = None  # heygem.render.gfpgan.GfpganRestorer for gfpgan
    blend: BlendConfig = field(default_factory=BlendConfig)  # gfpgan pastes the mouth before restoring it


def choose_restorer(config: RestoreConfig, engine_name: str, synthesises_pixels: bool,
                    folder: Path | None = None, face_size: int | None = None) -> RestorerChoice:
    """The restorer for the engine ``engine_name``, which makes its mouths' pixels (wav2lip, musetalk) or
    moves the frame's own (landmark); ``face_size``: the side of the faces it makes, where a restorer
    adds nothing by default (MuseTalk's 256), None for faces that need one (Wav2Lip's 96).

    auto: gfpgan when GFPGANv1.4.pth is in the weights folder and the engine synthesises
    low-resolution pixels, else sharpen for such an engine and none for the others. Quick: nothing loads.
    Raises HeygemError for gfpgan without its file. ``folder``: the weights folder (default: heygem.weights).
    """
    folder = Path(folder) if folder is not None else weights_dir()
    method = config.method
    if not config.enabled or method == "none":
        return RestorerChoice("none", None, "switched off")
    if config.strength <= 0:
        return RestorerChoice("none", None, "--restore-strength is 0")
    if method == "gfpgan":
        return RestorerChoice("gfpgan", require_gfpgan_checkpoint(folder), "chosen with --restorer")
    if method == "sharpen":
        return RestorerChoice("sharpen", None, "chosen with --restorer")
    if not synthesises_pixels:
        return RestorerChoice("none", None, f"auto: the {engine_name} engine moves real pixels")
    if face_size is not None:
        return RestorerChoice("none", None, f"auto: the {engine_name} engine makes its faces at {face_size} px")
    checkpoint = find_gfpgan_checkpoint(folder)
    if checkpoint is not None:
        return RestorerChoice("gfpgan", checkpoint, f"auto: found {checkpoint.name}")
    return RestorerChoice("sharpen", None, f"auto: no GFPGANv1.4.pth in {folder}")


def restore_patches(patches: list[FacePatch | None], frames_bgr: np.ndarray,
                    restoration: Restoration) -> list[FacePatch | None]:
    """Apply ``restoration`` to each patch (frames are (N, H, W, 3) uint8 BGR, the source frames)."""
    if restoration.name == "none" or restoration.strength <= 0:
        return patches
    return RESTORERS[restoration.name](patches, frames_bgr, restoration)


def _sharpen_all(patches, frames_bgr, restoration: Restoration):
    restored = []
    for patch, frame in zip(patches, frames_bgr):
        if patch is None:
            restored.append(None)
            continue
        x1, y1, x2, y2 = patch.box
        restored.append(sharpen_changed(patch, frame[y1:y2, x1:x2], restoration.strength))
    return restored


def _gfpgan_all(patches, frames_bgr, restoration: Restoration):
    from heygem.render.gfpgan import restore_patches_gfpgan

    return restore_patches_gfpgan(restoration.network, patches, frames_bgr, restoration.strength, restoration.blend)


RESTORERS: dict[str, Callable] = {"sharpen": _sharpen_all, "gfpgan": _gfpgan_all}


def create_restoration(choice: RestorerChoice, config: Config) -> Restoration:
    """The restoration ``choice`` names, ready to run (loads GFPGAN for gfpgan: seconds the first time)."""
    network = None
    if choice.name == "gfpgan":
        from heygem.render.gfpgan import load_restorer

        network = load_restorer(choice.checkpoint, config.engine)
    return Restoration(choice.name, config.restore.strength, network=network, blend=config.blend)
