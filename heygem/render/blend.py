"""Step 6: paste generated patches back into their frames without a visible edge.

The patch is colour-matched to the frame on the soft edge of its mask (where a
seam would show), then alpha-blended with a feathered mask that is exactly 0
on the box border, so nothing outside the mask changes.
"""

from __future__ import annotations

import numpy as np

from heygem.config import BlendConfig
from heygem.types import FacePatch

# mediapipe face-mesh points of the lower face: jaw line from ear to ear under the nose,
# the nose base and the cheeks beside the mouth
LOWER_FACE_POINTS = [
    234, 93, 132, 58, 172, 136, 150, 149, 176, 148, 152, 377, 400, 378, 379, 365, 397, 288, 361, 323, 454,
    205, 425, 36, 266, 203, 423, 98, 327, 2, 164,
]


def feather_sigma(feather_pixels: float) -> float:
    """The Gaussian blur's sigma for a soft edge of ``feather_pixels``."""
    return max(feather_pixels / 2.5, 0.5)


def inset_mask(mask: np.ndarray, feather_pixels: float) -> np.ndarray:
    """(h, w) float32: ``mask`` with a border of ceil(feather_pixels) cut away (all of it when the box is no
    wider than twice that), so that the blurred edge stays inside the box: what :func:`feather_mask` blurs."""
    height, width = mask.shape
    inset = int(np.ceil(feather_pixels))
    inner = np.zeros_like(mask, dtype=np.float32)
    if height > 2 * inset and width > 2 * inset:
        inner[inset:height - inset, inset:width - inset] = mask[inset:height - inset, inset:width - inset]
    return inner


def feather_mask(mask: np.ndarray, feather_pixels: float) -> np.ndarray:
    """Blur a binary (h, w) mask into a soft one that is 0 on the whole border; float32 in [0, 1]."""
    import cv2

    sigma = feather_sigma(feather_pixels)
    soft = cv2.GaussianBlur(inset_mask(mask, feather_pixels), (0, 0), sigmaX=sigma, sigmaY=sigma,
                            borderType=cv2.BORDER_CONSTANT)
    soft[0, :] = soft[-1, :] = 0.0
    soft[:, 0] = soft[:, -1] = 0.0
    return np.clip(soft, 0.0, 1.0)


def feather_width(box, feather: float) -> float:
    """The soft edge's width in pixels for a box (x1, y1, x2, y2): ``feather`` of its shorter side, 2 at least."""
    x1, y1, x2, y2 = box
    return max(2.0, feather * min(y2 - y1, x2 - x1))


def lower_face_hard_mask(patch: FacePatch) -> np.ndarray:
    """(h, w) float32 over the patch's box: the lower face's hull from the landmarks, else an ellipse in the box,
    filled with 1 (anti-aliased edges), 0 elsewhere: what :func:`lower_face_mask` feathers."""
    import cv2

    x1, y1, x2, y2 = patch.box
    height, width = y2 - y1, x2 - x1
    hard = np.zeros((height, width), dtype=np.float32)
    face = patch.face
    if face is not None and face.landmarks is not None:
        points = face.landmarks[LOWER_FACE_POINTS] - np.array([x1, y1], dtype=np.float32)
        hull = cv2.convexHull(np.round(points).astype(np.int32))
        cv2.fillConvexPoly(hard, hull, 1.0, lineType=cv2.LINE_AA)
    else:
        center = (int(width * 0.5), int(height * 0.7))
        axes = (int(width * 0.36), int(height * 0.26))
        cv2.ellipse(hard, center, axes, 0, 0, 360, 1.0, thickness=-1, lineType=cv2.LINE_AA)
    return hard


def lower_face_mask(patch: FacePatch, feather: float) -> np.ndarray:
    """The default (h, w) mask for a patch: the lower face from landmarks, else an ellipse in the box."""
    return feather_mask(lower_face_hard_mask(patch), feather_width(patch.box, feather))


# A float32 sum of whole numbers is exact, in any order, while it stays below 2^24.
EXACT_FLOAT32_INTEGERS = 2**24
MIN_EDGE_PIXELS = 16  # fewer soft-edge pixels than this and the colour is left as it is


def colour_shift(patch_bgr: np.ndarray, target_bgr: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
    """(3,) float32: the target's mean colour minus the patch's over the mask's soft edge, or None
    when the edge has fewer than MIN_EDGE_PIXELS pixels.

    The means are numpy's float32 means of the edge pixels. For 8-bit images whose edge sums
    stay below 2^24 those sums are whole numbers, exact in any order, so they are taken with
    cv2.sumElems over the masked images (a pass each, instead of gathering the pixels).
    """
    import cv2

    edge = (mask > 0.02) & (mask < 0.7)  # (h, w) bool
    count = int(np.count_nonzero(edge))
    if count < MIN_EDGE_PIXELS:
        return None
    if patch_bgr.dtype == np.uint8 and target_bgr.dtype == np.uint8:
        edge_mask = edge.view(np.uint8)
        target_sums = cv2.sumElems(cv2.bitwise_and(target_bgr, target_bgr, mask=edge_mask))[:3]
        patch_sums = cv2.sumElems(cv2.bitwise_and(patch_bgr, patch_bgr, mask=edge_mask))[:3]
        if max(target_sums + patch_sums) < EXACT_FLOAT32_INTEGERS:
            pixels = np.float32(count)
            return np.array(target_sums, np.float32) / pixels - np.array(patch_sums, np.float32) / pixels
    return target_bgr[edge].astype(np.float32).mean(axis=0) - patch_bgr.astype(np.float32)[edge].mean(axis=0)


def match_colour(patch_bgr: np.ndarray, target_bgr: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Shift the patch's mean colour to the target's over the mask's soft edge; (h, w, 3) float32."""
    patch = patch_bgr.astype(np.float32)
    shift = colour_shift(patch_bgr, target_bgr, mask)
    return patch if shift is None else patch + shift


def blend_patch(frame_bgr: np.ndarray, patch: FacePatch, config: BlendConfig) -> None:
    """Blend ``patch`` into ``frame_bgr`` (H, W, 3) uint8 BGR in place: per pixel and channel
    rint(frame * (1 - mask) + (patch + colour shift) * mask), clipped to 0..255."""
    import cv2

    x1, y1, x2, y2 = patch.box
    region = frame_bgr[y1:y2, x1:x2]
    if region.size == 0:  # nothing to blend (cv2.split does not take empty images)
        return
    mask = patch.mask if patch.mask is not None else lower_face_mask(patch, config.feather)
    shift = colour_shift(patch.image_bgr, region, mask) if config.color_match else None
    keep = 1.0 - mask
    # One (h, w) plane per channel: the same arithmetic as on (h, w, 3) arrays with the mask
    # broadcast over a last axis of 3, which numpy runs several times slower.
    blended = []
    for channel, (old_plane, new_plane) in enumerate(zip(cv2.split(region), cv2.split(patch.image_bgr))):
        new_plane = new_plane.astype(np.float32)
        if shift is not None:
            new_plane += shift[channel]
        mixed = old_plane.astype(np.float32) * keep
        mixed += new_plane * mask
        blended.append(np.clip(np.rint(mixed), 0, 255).astype(np.uint8))
    region[...] = cv2.merge(blended)
