"""Step 5, per frame: the chosen face's landmarks, frame after frame or in single images.

heygem picks one face (the largest, or the N-th from the left), re-applies that choice every
``redetect_every`` frames and in between follows the same face with the mesh. When a detection
finds nothing in a large frame, it looks again on overlapping tiles, so that small faces in wide
frames are found too. The face mesh always sees the face in the middle of its crop, black where
the crop reaches past the frame's edge. Runs of frames tracked from a fresh start give the same
landmarks whichever finder tracks them, so runs are tracked several at once (FinderPool, and
heygem.face.processes).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Sequence

import numpy as np

from heygem.config import FaceConfig
from heygem.errors import HeygemError
from heygem.face.detect import FaceDetector, FaceMesh, MediapipeDetector, import_mediapipe, merge_boxes
from heygem.face.track import tight_box
from heygem.media.frames import Frame, as_frame

logger = logging.getLogger("heygem")
CROP_FACTOR = 1.8  # the face mesh sees a square this many times the face's box, centred on it
CROP_PIXELS = 384  # crops larger than this are shrunk first: the mesh itself works at 192x192
MESH_MIN_PIXELS = 192  # crops smaller than this (small faces) are enlarged to it first
TILE_FRACTION = 0.6  # tiles of the small-face search are squares this fraction of the frame's shorter side
TILE_OVERLAP = 0.25  # neighbouring tiles share this fraction of a tile, more than a small face's width
TILE_MIN_PIXELS = 192  # smaller tiles (in small frames) show the detector only parts of a face, no new faces


class FaceFinder:
    """The chosen face's landmarks, frame after frame (video) or in single images.

    The detector (mediapipe's full-range one unless ``detector`` is given) finds
    every face; the face mesh then runs on a square crop around the chosen face,
    in video mode so that it tracks the face smoothly from one frame to the next.
    Between detections the crop follows the previous frame's landmarks.
    ``detector`` is shared, not owned: closing the finder leaves it open.
    """

    def __init__(self, config: FaceConfig, still_images: bool = False, detector: FaceDetector | None = None):
        try:
            mp = import_mediapipe()
        except ImportError:  # pragma: no cover - mediapipe is a hard requirement
            raise HeygemError("mediapipe is not installed: pip install 'mediapipe==0.10.14'") from None
        self.config = config
        self._owns_detector = detector is None
        self._detector: FaceDetector = detector if detector is not None else MediapipeDetector(config.min_confidence)
        self._mesh = FaceMesh(mp, still_images)
        self._frames_seen = 0
        self._previous_box: np.ndarray | None = None  # tight landmark box of the face followed

    @property
    def detector_name(self) -> str:
        return self._detector.name

    def close(self) -> None:
        if self._owns_detector:
            self._detector.close()
        self._mesh.close()

    def reset(self) -> None:
        """Forget the face followed so far: the next frame is treated as the first of a new video.

        Runs of frames tracked after a reset give the same landmarks whichever finder
        tracks them and whatever it saw before, so runs can be tracked in parallel.
        """
        self._frames_seen = 0
        self._previous_box = None
        self._mesh.reset()
        self._detector.reset()

    def __enter__(self) -> FaceFinder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def detect(self, frame: Frame) -> np.ndarray:
        """Boxes of every face in ``frame``: (K, 4) float32 x1 y1 x2 y2 pixels."""
        return self.detect_many([frame])[0]

    def detect_many(self, frames: list[Frame]) -> list[np.ndarray]:
        """Face boxes (K, 4) of each frame, in one detector call; frames where the whole frame shows
        none are searched again on overlapping tiles (one more call for all their tiles), if they
        are large enough for tiles of ``TILE_MIN_PIXELS``."""
        import cv2

        confidence = self.config.min_confidence
        found = self._detector.detect(list(frames), confidence)
        tiled = [index for index, boxes in enumerate(found) if len(boxes) == 0]
        tiles, placements = [], []  # placements: (frame index, x offset, y offset, tile pixels per input pixel)
        for index in tiled:
            frame = as_frame(frames[index])
            if TILE_FRACTION * min(frame.height, frame.width) < TILE_MIN_PIXELS:
                continue
            frame_bgr = frame.bgr()
            for x1, y1, x2, y2 in tile_windows(frame.height, frame.width):
                tile = frame_bgr[y1:y2, x1:x2]
                factor = 1.0
                if self._detector.input_side is not None:
                    factor = self._detector.input_side / max(tile.shape[:2])
                    tile = cv2.resize(tile, (round(tile.shape[1] * factor), round(tile.shape[0] * factor)),
                                      interpolation=cv2.INTER_LINEAR if factor > 1 else cv2.INTER_AREA)
                tiles.append(np.ascontiguousarray(tile))
                placements.append((index, x1, y1, factor))
        if not tiles:
            return found
        by_frame: dict[int, list[np.ndarray]] = {}
        for boxes, (index, x1, y1, factor) in zip(self._detector.detect(tiles, confidence), placements):
            by_frame.setdefault(index, []).append(boxes / factor + np.array([x1, y1, x1, y1], dtype=np.float32))
        for index, pieces in by_frame.items():
            found[index] = merge_boxes(np.concatenate(pieces, axis=0))
            if len(found[index]):
                logger.debug("faces: %d small face(s) found on tiles", len(found[index]))
        return found

    def mesh_around(self, frame: Frame, box: np.ndarray) -> np.ndarray | None:
        """Face-mesh landmarks (468, 2) float32 frame pixels of the face in ``box``, or None."""
        frame = as_frame(frame)
        center_x, center_y = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        half = CROP_FACTOR * max(box[2] - box[0], box[3] - box[1]) / 2
        # the whole square, also where it reaches past the frame (black there): a face at the frame's
        # edge or filling the frame is still in the middle of what the mesh sees, as it was trained
        x1, y1 = int(np.floor(center_x - half)), int(np.floor(center_y - half))
        x2, y2 = int(np.ceil(center_x + half)), int(np.ceil(center_y + half))
        if x2 - x1 < 8 or y2 - y1 < 8 or x2 <= 0 or y2 <= 0 or x1 >= frame.width or y1 >= frame.height:
            return None
        longest = max(x2 - x1, y2 - y1)
        scale = min(1.0, CROP_PIXELS / longest)  # the mesh sees 192x192: no need for more
        if longest < MESH_MIN_PIXELS:  # a small face: enlarged, its landmarks are steadier
            scale = MESH_MIN_PIXELS / longest
        size = (max(1, round((x2 - x1) * scale)), max(1, round((y2 - y1) * scale)))
        crop = frame.region(x1, y1, x2, y2, rgb=True, size=size)  # (h, w, 3) RGB, as the mesh takes it
        points = self._mesh.landmarks(crop)  # (468, 2) relative to the crop
        if points is None:
            return None
        points *= np.array([x2 - x1, y2 - y1], dtype=np.float32)  # -> crop pixels
        return points + np.array([x1, y1], dtype=np.float32)

    def track(self, frames: Sequence[Frame]) -> list[np.ndarray | None]:
        """Landmarks (or None) for each of the next frames of the stream, as :meth:`find` gives them;
        the frames where detection is due are detected together first, in one batched call."""
        redetect_every = self.config.redetect_every
        frames = [as_frame(frame) for frame in frames]
        due = [offset for offset in range(len(frames)) if (self._frames_seen + offset) % redetect_every == 0]
        detected = dict(zip(due, self.detect_many([frames[offset] for offset in due]))) if due else {}
        return [self.find(frame, detected.get(offset)) for offset, frame in enumerate(frames)]

    def find(self, frame: Frame, boxes: np.ndarray | None = None) -> np.ndarray | None:
        """The chosen face's landmarks in the next frame of the stream, or None.

        ``boxes`` (K, 4) are this frame's detections when they were made already (see :meth:`track`).
        """
        frame = as_frame(frame)
        frame_number = self._frames_seen
        self._frames_seen += 1
        landmarks = None
        if self._previous_box is not None and frame_number % self.config.redetect_every != 0:
            landmarks = self.mesh_around(frame, self._previous_box)  # follow the same face
        if landmarks is None:
            if boxes is None:
                boxes = self.detect(frame)
            chosen = choose_face(boxes, self.config.face_index) if len(boxes) else None
            if chosen is not None and self._previous_box is not None and self.config.face_index is None \
                    and frame_number % self.config.redetect_every != 0:
                chosen = int(np.argmax(box_overlap(self._previous_box, boxes)))  # lost it: find the same one
            landmarks = self.mesh_around(frame, boxes[chosen]) if chosen is not None else None
        self._previous_box = tight_box(landmarks) if landmarks is not None else None
        return landmarks


class FinderPool:
    """Face finders for tracking runs of frames on several threads at once, one run per finder."""

    def __init__(self, config: FaceConfig, size: int, still_images: bool = False,
                 detector: FaceDetector | None = None):
        self.key = pool_key(config, size, still_images, detector)
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._finders = [FaceFinder(config, still_images=still_images, detector=detector)
                         for _ in range(max(1, size))]
        for finder in self._finders:
            self._idle.put(finder)

    def track_run(self, frames: Sequence[Frame]) -> list[np.ndarray | None]:
        """Landmarks (or None) for each frame of a run, tracked from a fresh start."""
        finder = self._idle.get()
        try:
            finder.reset()
            return finder.track(frames)
        finally:
            self._idle.put(finder)

    def use_options(self, config: FaceConfig) -> None:
        """Track with ``config`` from now on (options that the graphs were built with are in :attr:`key`)."""
        for finder in self._finders:
            finder.config = config

    def alive(self) -> bool:
        return True  # threads of this process: nothing that can have died

    def close(self) -> None:
        for finder in self._finders:
            finder.close()

    def __enter__(self) -> FinderPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pool_key(config: FaceConfig, size: int, still_images: bool, detector: FaceDetector | None) -> tuple:
    """What a pool's graphs were built with: pools with equal keys are interchangeable."""
    return config.min_confidence, max(1, size), still_images, detector


def count_faces(config: FaceConfig, frames: Sequence[Frame], detector: FaceDetector | None = None) -> list[int]:
    """How many faces the detector finds in each of ``frames`` (small faces searched again on tiles, as a
    job finds them): for a message naming how many there are."""
    finder = FaceFinder(config, still_images=True, detector=detector)
    try:
        return [len(boxes) for boxes in finder.detect_many(list(frames))]
    finally:
        finder.close()


def choose_face(boxes: np.ndarray, face_index: int | None) -> int | None:
    """Index into ``boxes`` (K, 4): the largest face, or the ``face_index``-th from the left."""
    if face_index is None:
        areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        return int(np.argmax(areas))
    order = np.argsort(boxes[:, 0])
    return int(order[face_index]) if face_index < len(order) else None


def tile_windows(height: int, width: int, fraction: float = TILE_FRACTION,
                 overlap: float = TILE_OVERLAP) -> list[tuple[int, int, int, int]]:
    """Overlapping square tiles x1 y1 x2 y2 covering a ``height`` x ``width`` frame, row by row.

    Each tile is ``fraction`` of the shorter side; along each axis the tiles are
    spread evenly from edge to edge, neighbours sharing at least ``overlap`` of a
    tile, so any face narrower than that shared strip lies whole inside one tile.
    """
    side = max(1, round(fraction * min(height, width)))
    step = side * (1.0 - overlap)

    def starts(length: int) -> list[int]:
        count = 1 if length <= side else int(np.ceil((length - side) / step)) + 1
        return [round(position) for position in np.linspace(0, length - side, count)] if count > 1 else [0]

    return [(x, y, x + side, y + side) for y in starts(height) for x in starts(width)]


def box_overlap(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """Intersection over union of ``box`` (4,) with each of ``boxes`` (K, 4)."""
    x1 = np.maximum(box[0], boxes[:, 0])
    y1 = np.maximum(box[1], boxes[:, 1])
    x2 = np.minimum(box[2], boxes[:, 2])
    y2 = np.minimum(box[3], boxes[:, 3])
    intersection = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    return intersection / np.maximum(area + areas - intersection, 1e-6)
