"""Stage 5: restoration (deblur) of the generated mouth region.

The built-in method is an unsharp mask applied only where the engine changed
pixels, so untouched skin is left exactly as it was. Networks plug in through
``RESTORERS``: a callable taking (patches, frames) and returning patches.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from heygem.config import RestoreConfig
from heygem.types import FacePatch

CHANGE_THRESHOLD = 3.0  # grey levels: smaller differences from the source count as unchanged


def sharpen_changed(patch: FacePatch, source_region_bgr: np.ndarray, strength: float) -> FacePatch:
    """Unsharp-mask ``patch`` where it differs from ``source_region_bgr`` (both (h, w, 3) uint8 BGR)."""
    import cv2

    image = patch.image_bgr.astype(np.float32)
    height, width = image.shape[:2]
    sigma = max(1.0, min(height, width) / 96.0)  # about one pixel of a 96-pixel generator output
    blurred = cv2.GaussianBlur(image, (0, 0), sigma)
    difference = np.abs(image - source_region_bgr.astype(np.float32)).max(axis=2)  # (h, w)
    changed = cv2.GaussianBlur((difference > CHANGE_THRESHOLD).astype(np.float32), (0, 0), sigma * 2)
    amount = (strength * changed)[:, :, None]
    sharpened = image + amount * (image - blurred)
    restored = np.clip(np.rint(sharpened), 0, 255).astype(np.uint8)
    return FacePatch(box=patch.box, image_bgr=restored, mask=patch.mask, face=patch.face)


def restore_patches(patches: list[FacePatch | None], frames_bgr: np.ndarray, config: RestoreConfig) -> list[FacePatch | None]:
    """Apply the configured restoration to each patch (frames are (N, H, W, 3) uint8 BGR)."""
    if not config.enabled or config.strength <= 0:
        return patches
    restorer = RESTORERS[config.method]
    return restorer(patches, frames_bgr, config)


def _sharpen_all(patches, frames_bgr, config: RestoreConfig):
    restored = []
    for patch, frame in zip(patches, frames_bgr):
        if patch is None:
            restored.append(None)
            continue
        x1, y1, x2, y2 = patch.box
        restored.append(sharpen_changed(patch, frame[y1:y2, x1:x2], config.strength))
    return restored


RESTORERS: dict[str, Callable] = {"sharpen": _sharpen_all}
