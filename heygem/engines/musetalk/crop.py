"""MuseTalk's face box and 256x256 crops, from heygem's mediapipe landmarks.

MuseTalk 1.5 takes its box from 68 face landmarks (DWPose's whole-body face points, in the
iBUG 300-W order: jaw 0-16, brows 17-26, nose 27-35, eyes 36-47, mouth 48-67), cast to whole pixels:

- x1, x2: the smallest and largest x of the 68 points (in practice the jaw line's ends, 0 and 16);
- y2: the largest y (the chin, point 8), then ``extra_margin`` (10) pixels lower, within the frame;
- y1: point 29 (the lower nose bridge) as the box's middle, y29 - (max y - y29), at least 0;
- a box with no width or height, or x1 < 0, is replaced by the face detector's box.

heygem tracks mediapipe's 468-point face mesh, not those 68 points. The box needs only the points
that decide it, so each is taken from the mesh point at the same place on the face: the jaw line
0-16 from the face oval (:data:`JAW_FROM_MESH`), the chin from mesh point 152, and point 29 from
the nose ridge between mesh points 168 (between the eyes, 68-point 27) and 4 (the tip, 30), two
thirds of the way down (:data:`NOSE_29_FRACTION`), as 29 lies on 68-point layouts. docs/benchmarks.md
says how far these boxes lie from boxes of a 68-point detector on the photos heygem ships.
"""

from __future__ import annotations

import cv2
import numpy as np

from heygem.types import Box, Face

FACE_SIZE = 256  # the VAE's crops
# mesh points along the face oval at the 68-point jaw line's 17 places, from the image's left ear to its right
JAW_FROM_MESH = (127, 234, 93, 132, 58, 172, 136, 149, 152, 378, 365, 397, 288, 361, 323, 454, 356)
NOSE_BRIDGE_TOP, NOSE_TIP = 168, 4  # the 68-point layout's 27 and 30
NOSE_29_FRACTION = 2 / 3  # 29 lies two thirds of the way from 27 to 30


def landmarks_68_subset(landmarks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(17, 2) jaw line and (2,) point 29 of the 68-point layout from (468, 2) mesh points."""
    jaw = landmarks[list(JAW_FROM_MESH)]
    nose_29 = landmarks[NOSE_BRIDGE_TOP] + NOSE_29_FRACTION * (landmarks[NOSE_TIP] - landmarks[NOSE_BRIDGE_TOP])
    return jaw, nose_29


def box_from_68(points: np.ndarray, nose_29: np.ndarray) -> Box | None:
    """MuseTalk's box (before the extra margin) from 68-point landmarks (or the subset that decides
    it) in pixels: cast to whole pixels as MuseTalk does; None where it would be empty or x1 < 0."""
    points = points.astype(np.int32)
    nose_y = int(np.int32(nose_29[1]))
    x1, x2, y2 = int(points[:, 0].min()), int(points[:, 0].max()), int(points[:, 1].max())
    y1 = max(0, nose_y - (y2 - nose_y))
    if y2 - y1 <= 0 or x2 - x1 <= 0 or x1 < 0:
        return None
    return x1, y1, x2, y2


def musetalk_box(face: Face, frame_height: int, frame_width: int, extra_margin: int) -> Box | None:
    """The box MuseTalk 1.5 crops for ``face`` in a frame of this size: from its landmarks (see the
    module), else its detector box; ``extra_margin`` pixels added below, all within the frame.
    None when nothing of it is inside the frame."""
    box = None
    if face.landmarks is not None and np.isfinite(face.landmarks).all():
        box = box_from_68(*landmarks_68_subset(face.landmarks))
    x1, y1, x2, y2 = box if box is not None else face.box
    y2 = min(y2 + extra_margin, frame_height)
    x1, y1, x2 = max(0, x1), max(0, y1), min(x2, frame_width)
    return (x1, y1, x2, y2) if x2 > x1 and y2 > y1 else None


def crop_256(frame_bgr: np.ndarray, box: Box) -> np.ndarray:
    """(256, 256, 3) uint8 BGR: the box's pixels resized with Lanczos (cv2.INTER_LANCZOS4), as MuseTalk."""
    x1, y1, x2, y2 = box
    return cv2.resize(frame_bgr[y1:y2, x1:x2], (FACE_SIZE, FACE_SIZE), interpolation=cv2.INTER_LANCZOS4)


def vae_inputs(crops_bgr: np.ndarray):
    """(B, 256, 256, 3) uint8 BGR crops -> ((B, 3, 256, 256) masked, (B, 3, 256, 256) whole) float32
    RGB in [-1, 1] tensors: the masked one has its lower half (rows 128:) black, i.e. -1."""
    import torch

    whole = torch.from_numpy(np.ascontiguousarray(crops_bgr[..., ::-1])).permute(0, 3, 1, 2).contiguous()
    whole = whole.float() / 255.0  # (B, 3, 256, 256), channels first in memory too
    masked = whole.clone()
    masked[:, :, FACE_SIZE // 2:] = 0.0
    return masked * 2.0 - 1.0, whole * 2.0 - 1.0


def face_to_box(face_rgb: np.ndarray, box: Box) -> np.ndarray:
    """(256, 256, 3) uint8 RGB generated face -> (h, w, 3) uint8 BGR of the box's size (cv2's default
    bilinear resize, as MuseTalk pastes it)."""
    x1, y1, x2, y2 = box
    return cv2.resize(np.ascontiguousarray(face_rgb[..., ::-1]), (x2 - x1, y2 - y1))
