"""Sharpening what an engine changed: an unsharp mask applied only where its patch differs from the
source frame, so untouched skin is left exactly as it was (the CPU path; heygem.render.gpu_blend
has the same on the device).
"""

from __future__ import annotations

import numpy as np

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
