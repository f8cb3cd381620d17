"""The faces of a face input's first frame, as the numbers ``face.face_index`` counts them (left to right
from 0): what a job says when it found several, and what the page offers to pick from."""

from __future__ import annotations

import dataclasses

import numpy as np

from heygem.config import FaceConfig
from heygem.types import Box, MediaInfo

THUMBNAIL_SIDE = 96  # pixels of the longer side of a face's preview


@dataclasses.dataclass(frozen=True)
class FoundFaces:
    """The faces of one frame, left to right (``face.face_index`` 0 is the first)."""

    boxes: list[Box]  # (x1, y1, x2, y2) in the input's display pixels
    frame_bgr: np.ndarray  # (H, W, 3) uint8 BGR, the frame they were found in

    def __len__(self) -> int:
        return len(self.boxes)

    def chosen(self, face_index: int | None) -> int | None:
        """The index (left to right) of the face a job animates: ``face_index``, or the largest face."""
        if not self.boxes:
            return None
        if face_index is not None:
            return face_index if face_index < len(self.boxes) else None
        areas = [(x2 - x1) * (y2 - y1) for x1, y1, x2, y2 in self.boxes]
        return int(np.argmax(areas))

    def thumbnails(self, side: int = THUMBNAIL_SIDE) -> list[np.ndarray]:
        """(h, w, 3) uint8 RGB previews of each face (its box with a margin), longer side ``side``."""
        import cv2

        height, width = self.frame_bgr.shape[:2]
        previews = []
        for x1, y1, x2, y2 in self.boxes:
            margin = (x2 - x1 + y2 - y1) // 8
            crop = self.frame_bgr[max(0, y1 - margin):min(height, y2 + margin),
                                  max(0, x1 - margin):min(width, x2 + margin)]
            scale = side / max(crop.shape[:2])
            crop = cv2.resize(crop, (max(1, round(crop.shape[1] * scale)), max(1, round(crop.shape[0] * scale))),
                              interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)
            previews.append(np.ascontiguousarray(crop[:, :, ::-1]))
        return previews


def first_frame(info: MediaInfo) -> np.ndarray:
    """(H, W, 3) uint8 BGR: a photo, or a video's first frame, at its display size (made even)."""
    from heygem.media.decode import iter_video_i420, load_image
    from heygem.media.frames import i420_batch_to_bgr
    from heygem.media.probing import working_geometry

    geometry = working_geometry(info, None)
    if info.kind == "image":
        return load_image(info, geometry)
    batches = iter_video_i420(info, geometry, 1)
    try:
        return i420_batch_to_bgr(next(batches))[0]
    finally:
        batches.close()


def find_faces(info: MediaInfo, config: FaceConfig | None = None) -> FoundFaces:
    """The faces of the first frame of the face input ``info`` (heygem.media.probing.probe), found as a
    job finds them (mediapipe's detectors, small faces searched again on tiles), left to right."""
    from heygem.face.finder import FaceFinder

    config = config if config is not None else FaceConfig()
    frame_bgr = first_frame(info)
    with FaceFinder(config, still_images=True) as finder:
        boxes = finder.detect(frame_bgr)  # (K, 4) float32
    ordered = sorted((tuple(int(round(value)) for value in box) for box in boxes), key=lambda box: box[0])
    height, width = frame_bgr.shape[:2]
    clipped = [(max(0, x1), max(0, y1), min(width, x2), min(height, y2)) for x1, y1, x2, y2 in ordered]
    return FoundFaces([box for box in clipped if box[2] > box[0] and box[3] > box[1]], frame_bgr)


def faces_warning(found: FoundFaces, face_index: int | None) -> str | None:
    """What a job says when its input shows several faces (None for one or none)."""
    if len(found) < 2:
        return None
    chosen = found.chosen(face_index)
    if chosen is None:
        return None
    how = "the largest" if face_index is None else "as chosen"
    return f"{len(found)} faces found; animated face {chosen} ({how})"
