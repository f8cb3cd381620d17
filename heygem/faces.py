"""Stage 3: find the face and its landmarks in every frame.

A face detector (mediapipe's, or S3FD with ``--detector s3fd``) finds the faces
and mediapipe's face mesh (its models ship inside the wheel, nothing is
downloaded) gives 468 landmarks on the chosen one. heygem picks one face (the
largest, or the N-th from the left), re-applies that choice every
``redetect_every`` frames and in between follows the same face with the mesh.
mediapipe's detection looks at the whole frame (its full-range detector) and at
the frame zoomed out, in the middle of a black canvas twice its size (its
short-range detector), so that a face filling the frame, a tight face crop, is
found too. When a detection finds nothing in a large frame, it looks again on
overlapping tiles, so that small faces in wide frames are found too. The face
mesh always sees the face in the middle of its crop, black where the crop
reaches past the frame's edge. Boxes are
padded as Wav2Lip pads them and averaged over a centred window of frames.
Frames where no face is found are recorded as such; the pipeline passes them
through unchanged.
"""

from __future__ import annotations

import importlib
import logging
import queue
import sys
import threading
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from heygem.config import FaceConfig
from heygem.errors import HeygemError
from heygem.media import frames as frames_module
from heygem.media.frames import as_frame
from heygem.runtime import library_logs
from heygem.types import Face

Frame = frames_module.Frame

logger = logging.getLogger("heygem")

LANDMARK_COUNT = 468
CROP_FACTOR = 1.8  # the face mesh sees a square this many times the face's box, centred on it
CROP_PIXELS = 384  # crops larger than this are shrunk first: the mesh itself works at 192x192
MESH_MIN_PIXELS = 192  # crops smaller than this (small faces) are enlarged to it first
TILE_FRACTION = 0.6  # tiles of the small-face search are squares this fraction of the frame's shorter side
TILE_OVERLAP = 0.25  # neighbouring tiles share this fraction of a tile, more than a small face's width
TILE_MIN_PIXELS = 192  # smaller tiles (in small frames) show the detector only parts of a face, no new faces
SAME_FACE_OVERLAP = 0.5  # boxes from two tiles are one face when this much of the smaller one is shared
ZOOM_OUT_MARGIN = 0.5  # the zoomed-out view: the frame with a black margin this fraction of its longer side
ZOOM_OUT_PIXELS = 256  # ... shrunk first to at most this longest side (the short-range detector works at 128)


@dataclass
class FaceTrack:
    """Per-frame face results for a whole source video, stored as arrays.

    The landmark array can live in a memory-mapped file, so a long video costs
    disk, not RAM.
    """

    found: np.ndarray  # (F,) bool, a face was found in source frame f
    raw_boxes: np.ndarray  # (F, 4) float32, tight landmark box x1 y1 x2 y2 (NaN where not found)
    landmarks: np.ndarray  # (F, 468, 2) float32 pixels (NaN where not found)
    boxes: np.ndarray | None = None  # (F, 4) int32 padded, smoothed crop boxes, set by finalize()

    @property
    def frame_count(self) -> int:
        return int(self.found.shape[0])

    @property
    def frames_without_face(self) -> int:
        return int((~self.found).sum())

    def face(self, index: int) -> Face | None:
        """The face of source frame ``index`` (after :func:`finalize_track`), or None."""
        if not self.found[index]:
            return None
        landmarks = np.asarray(self.landmarks[index], dtype=np.float32)
        if np.isnan(landmarks).any():
            landmarks = None  # a fixed box on a frame where the mesh found nothing
        return Face(box=tuple(int(v) for v in self.boxes[index]), landmarks=landmarks)


class FaceDetector(Protocol):
    """What FaceFinder needs of a face detector (MediapipeDetector here, heygem.detect_s3fd.S3FDDetector)."""

    name: str
    input_side: int | None  # tiles of the small-face search are resized to this longest side (None: as cut)

    def detect(self, frames: list[Frame], min_confidence: float = 0.5) -> list[np.ndarray]:
        """Face boxes (K, 4) float32 x1 y1 x2 y2 pixels for each frame ((H, W, 3) uint8 BGR or a media frame)."""

    def reset(self) -> None: ...

    def close(self) -> None: ...


class _ImportedOnUse(types.ModuleType):
    """Stands in for a module in sys.modules: the first attribute asked of it imports the real module
    (taking every stand-in out of sys.modules first) and answers from it."""

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        with _STAND_IN_LOCK:
            for name in ("matplotlib.pyplot", "matplotlib"):
                if isinstance(sys.modules.get(name), _ImportedOnUse):
                    del sys.modules[name]
        return getattr(importlib.import_module(self.__name__), attribute)


_STAND_IN_LOCK = threading.Lock()


def import_mediapipe():
    """``import mediapipe`` without importing matplotlib: mediapipe's drawing helpers, which heygem
    does not use, import matplotlib.pyplot when mediapipe loads (half a second of every job's start
    on a 2-core CPU). While mediapipe loads, stand-ins take matplotlib's place, and the helpers keep a
    stand-in that imports the real pyplot if they are ever used. The native libraries' log lines are
    dropped from standard error first (heygem.runtime.library_logs)."""
    library_logs.quiet()
    if "mediapipe" in sys.modules or "matplotlib" in sys.modules:
        import mediapipe

        return mediapipe
    parent, pyplot = _ImportedOnUse("matplotlib"), _ImportedOnUse("matplotlib.pyplot")
    parent.pyplot = pyplot
    with _STAND_IN_LOCK:
        sys.modules.setdefault("matplotlib", parent)
        sys.modules.setdefault("matplotlib.pyplot", pyplot)
    try:
        import mediapipe
    finally:
        with _STAND_IN_LOCK:
            for name, stand_in in (("matplotlib.pyplot", pyplot), ("matplotlib", parent)):
                if sys.modules.get(name) is stand_in:
                    del sys.modules[name]
    return mediapipe


class MediapipeDetector:
    """mediapipe's two face detectors, one frame at a time (each finder has its own: not thread-safe).

    The full-range one looks at the whole frame: it sees small faces in wide frames better than
    the face mesh's own detector, but misses most faces that fill its input, or takes an eye for
    one. The short-range one, made for faces close to the camera, looks at the frame zoomed out
    (:func:`zoomed_out`), where such a face fills half of the view. Their boxes are merged.
    """

    name = "mediapipe"
    input_side = None  # it resizes every image to 192x192 itself

    def __init__(self, min_confidence: float):
        mp = import_mediapipe()
        self._full_range = mp.solutions.face_detection.FaceDetection(
            model_selection=1, min_detection_confidence=min_confidence)
        self._short_range = mp.solutions.face_detection.FaceDetection(
            model_selection=0, min_detection_confidence=min_confidence)

    def detect(self, frames: list[Frame], min_confidence: float = 0.5) -> list[np.ndarray]:
        results = []
        for frame in frames:
            frame = as_frame(frame)
            width, height = frame.width, frame.height
            image_rgb = np.ascontiguousarray(frame.region(0, 0, width, height, rgb=True))
            whole = self._boxes(self._full_range, image_rgb, 0.0, 0.0, 1.0)
            canvas_bgr, x, y, scale = zoomed_out(frame)
            canvas_rgb = np.ascontiguousarray(canvas_bgr[:, :, ::-1])
            results.append(merge_boxes(np.concatenate([whole, self._boxes(self._short_range, canvas_rgb, x, y, scale)])))
        return results

    @staticmethod
    def _boxes(detection, image_rgb: np.ndarray, x: float, y: float, scale: float) -> np.ndarray:
        """(K, 4) float32 boxes in frame pixels that ``detection`` finds in ``image_rgb``, a view of the
        frame whose top left corner is frame pixel (x, y), ``scale`` view pixels per frame pixel."""
        image_rgb.flags.writeable = False  # mediapipe then refers to the pixels instead of copying them
        result = detection.process(image_rgb)
        height, width = image_rgb.shape[:2]
        boxes = []
        for found in result.detections or []:
            relative = found.location_data.relative_bounding_box
            boxes.append([relative.xmin * width, relative.ymin * height, (relative.xmin + relative.width) * width,
                          (relative.ymin + relative.height) * height])
        return np.array(boxes, dtype=np.float32).reshape(-1, 4) / scale + np.array([x, y, x, y], dtype=np.float32)

    def reset(self) -> None:
        """Nothing to forget: the detectors keep no state between images (restarting their graphs
        would cost more than a detection)."""

    def close(self) -> None:
        self._full_range.close()
        self._short_range.close()

    def __enter__(self) -> MediapipeDetector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# one landmark of a NormalizedLandmarkList as the face mesh serializes it: a length-delimited entry
# (field 1, 15 bytes) holding x, y and z as 32-bit floats (fields 1, 2, 3)
_LANDMARK_WIRE = np.dtype([("entry_tag", "u1"), ("entry_size", "u1"), ("x_tag", "u1"), ("x", "<f4"),
                           ("y_tag", "u1"), ("y", "<f4"), ("z_tag", "u1"), ("z", "<f4")])
_LANDMARK_WIRE_COLUMNS = np.array([0, 1, 2, 7, 12])  # the byte of each tag and of the entry's size
_LANDMARK_WIRE_BYTES = np.array([0x0A, 15, 0x0D, 0x15, 0x1D], dtype=np.uint8)


class FaceMesh:
    """mediapipe's face mesh on one face: (468, 2) landmarks relative to the image, or None.

    mediapipe's ``process`` builds a new result class on every call and hands the landmarks over
    as 468 protobuf messages, which Python then reads one attribute at a time: 0.6 ms of holding
    the interpreter lock per frame, which the other stages of the job wait for. This feeds the
    same graph the same packet and reads the landmarks' serialized bytes with numpy instead,
    falling back to ``process`` where mediapipe's internals or the bytes are not as expected.
    """

    def __init__(self, mp, still_images: bool):
        self._solution = mp.solutions.face_mesh.FaceMesh(
            static_image_mode=still_images, max_num_faces=1, refine_landmarks=False,
            min_detection_confidence=0.3, min_tracking_confidence=0.5)
        try:
            from mediapipe.python._framework_bindings import _packet_getter

            self._serialized_list = _packet_getter._get_serialized_proto_list
            self._image_type = self._solution._input_stream_type_info["image"]
            self._lean = hasattr(self._solution, "_graph_outputs") and hasattr(self._solution, "_simulated_timestamp")
        except (ImportError, AttributeError, KeyError, TypeError):  # pragma: no cover - another mediapipe
            self._lean = False

    def landmarks(self, image_rgb: np.ndarray) -> np.ndarray | None:
        """(468, 2) float32 x, y in [0, 1] of the face in ``image_rgb`` (H, W, 3) uint8, or None."""
        if not self._lean:
            return self._landmarks_by_process(image_rgb)
        solution = self._solution
        solution._graph_outputs.clear()
        solution._simulated_timestamp += 33333  # as process() counts: 30 frames a second
        image_rgb = np.ascontiguousarray(image_rgb).view()
        image_rgb.flags.writeable = False  # the packet refers to the pixels instead of copying them
        packet = solution._make_packet(self._image_type, image_rgb).at(solution._simulated_timestamp)
        solution._graph.add_packet_to_input_stream(stream="image", packet=packet)
        solution._graph.wait_until_idle()
        faces_packet = solution._graph_outputs.get("multi_face_landmarks")
        if faces_packet is None or faces_packet.is_empty():
            return None
        serialized = self._serialized_list(faces_packet)
        if not serialized:
            return None
        points = landmarks_from_wire(serialized[0])
        if points is None:  # pragma: no cover - written differently: read it as protobuf
            points = self._parse(serialized[0])
        return points

    def _landmarks_by_process(self, image_rgb: np.ndarray) -> np.ndarray | None:
        result = self._solution.process(image_rgb)
        return landmark_points(result.multi_face_landmarks[0]) if result.multi_face_landmarks else None

    @staticmethod
    def _parse(serialized: bytes) -> np.ndarray:
        from mediapipe.framework.formats import landmark_pb2

        return landmark_points(landmark_pb2.NormalizedLandmarkList.FromString(serialized))

    def reset(self) -> None:
        self._solution.reset()

    def close(self) -> None:
        self._solution.close()


def landmark_points(landmark_list) -> np.ndarray:
    """(N, 2) float32 x, y of a NormalizedLandmarkList message, read attribute by attribute."""
    return np.array([(point.x, point.y) for point in landmark_list.landmark], dtype=np.float32)


def landmarks_from_wire(serialized: bytes) -> np.ndarray | None:
    """(N, 2) float32 x, y of a serialized NormalizedLandmarkList whose every landmark holds x, y
    and z only (as the face mesh writes them), read with numpy; None if it is laid out otherwise."""
    if len(serialized) == 0 or len(serialized) % _LANDMARK_WIRE.itemsize:
        return None
    raw = np.frombuffer(serialized, dtype=np.uint8).reshape(-1, _LANDMARK_WIRE.itemsize)
    if not np.array_equal(raw[:, _LANDMARK_WIRE_COLUMNS], np.broadcast_to(_LANDMARK_WIRE_BYTES, (len(raw), 5))):
        return None
    records = np.frombuffer(serialized, dtype=_LANDMARK_WIRE)
    points = np.empty((len(records), 2), dtype=np.float32)
    points[:, 0], points[:, 1] = records["x"], records["y"]
    return points


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


# The finders of the last job that ended well, kept for the next one: building and closing a job's
# sixteen mediapipe graphs held the interpreter lock for 0.8 s on the 16-core GPU machine, while
# every other stage of the job waited (docs/benchmarks.md). Tracking processes are kept the same way.
_kept_pool = None  # a FinderPool or a face_processes.TrackingProcesses
_kept_lock = threading.Lock()


def pool_key(config: FaceConfig, size: int, still_images: bool, detector: FaceDetector | None) -> tuple:
    """What a pool's graphs were built with: pools with equal keys are interchangeable."""
    return config.min_confidence, max(1, size), still_images, detector


def take_pool(config: FaceConfig, size: int, still_images: bool = False,
              detector: FaceDetector | None = None, processes: bool = False):
    """The pool the last job left if it was built with the same options and still works, otherwise a
    new one: a FinderPool, or with ``processes`` (mediapipe's own detector only) a pool of spawned
    tracking processes (heygem.face_processes.TrackingProcesses) with the same interface."""
    global _kept_pool
    from heygem import face_processes

    if processes and detector is not None:
        raise ValueError("tracking processes use mediapipe's own detector")
    key = face_processes.pool_key(config, size, still_images) if processes else \
        pool_key(config, size, still_images, detector)
    with _kept_lock:
        pool, _kept_pool = _kept_pool, None
    if pool is not None and (pool.key != key or not pool.alive()):
        pool.close()
        pool = None
    if pool is None:
        if processes:
            return face_processes.TrackingProcesses(config, size, still_images=still_images)
        return FinderPool(config, size, still_images=still_images, detector=detector)
    pool.use_options(config)
    return pool


def release_pool() -> None:
    """Close the pool kept for the next job, if any (its tracking processes stop)."""
    global _kept_pool
    with _kept_lock:
        pool, _kept_pool = _kept_pool, None
    if pool is not None:
        pool.close()


def keep_pool(pool) -> None:
    """Keep ``pool`` (whose job ended well) for the next job of this process, in place of any other."""
    global _kept_pool
    with _kept_lock:
        previous, _kept_pool = _kept_pool, pool
    if previous is not None:
        previous.close()


class TrackBuilder:
    """The face track of a video built run by run as frames stream past, with final boxes as soon as known.

    A frame's box is averaged over a centred window of ``smooth_window`` frames, so it is
    final once the frames up to half a window after it are tracked, or once the video has
    ended. ``add`` takes runs in order; ``face`` hands out finished frames only.
    """

    def __init__(self, config: FaceConfig, width: int, height: int, capacity: int,
                 landmarks_path: Path | None = None, track: FaceTrack | None = None):
        self.config = config
        self.width, self.height = width, height
        if track is None:
            track = new_track(capacity, landmarks_path)
            self.tracked = 0
        else:  # tracked before (the avatar cache): only the small arrays are copied, to be writable
            track = FaceTrack(found=np.array(track.found), raw_boxes=np.array(track.raw_boxes),
                              landmarks=track.landmarks)
            self.tracked = track.frame_count
        track.boxes = np.zeros((track.frame_count, 4), dtype=np.int32)
        self.track = track
        self.ended = False  # no frames will be added any more
        self.final = 0  # frames [0, final) have their boxes

    def add(self, start: int, landmarks: list[np.ndarray | None]) -> None:
        """Record the landmarks of frames ``start`` .. ``start + len(landmarks)`` (the next run)."""
        if start != self.tracked:
            raise ValueError(f"runs must come in order: expected frame {self.tracked}, got {start}")
        landmarks = landmarks[: self.track.frame_count - start]  # probing can overcount a little
        for offset, points in enumerate(landmarks):
            record(self.track, start + offset, points)
        self.tracked += len(landmarks)
        self._finish_boxes()

    def end(self) -> None:
        """No more frames: every tracked frame's box becomes final."""
        self.ended = True
        self._finish_boxes()

    def is_final(self, index: int) -> bool:
        return index < self.final

    def face(self, index: int) -> Face | None:
        """Frame ``index``'s face; with a fixed box (--box) every frame has one, landmarks or not."""
        if index >= self.final:
            raise ValueError(f"frame {index} has no final box yet")
        if self.config.box is not None:
            landmarks = self.track.landmarks[index] if self.track.found[index] else None
            return Face(box=tuple(int(v) for v in self.track.boxes[index]),
                        landmarks=None if landmarks is None else np.asarray(landmarks, dtype=np.float32))
        return self.track.face(index)

    @property
    def any_face(self) -> bool:
        """Whether any tracked frame has a face (always, with a fixed box)."""
        return self.config.box is not None or bool(self.track.found[: self.tracked].any())

    def finished_track(self) -> FaceTrack:
        """The track of the frames tracked: raw landmarks and boxes, every box final (after :meth:`end`)."""
        return truncate_finished(self.track, self.tracked)

    def _finish_boxes(self) -> None:
        half = self.config.smooth_window // 2 if self.config.box is None else 0
        final = self.tracked if self.ended else max(self.tracked - half, 0)
        if final <= self.final:
            return
        start, stop = self.final, final
        # smoothing sees the same neighbours it would see over the whole track
        window_start, window_stop = max(start - half, 0), min(stop + half, self.tracked)
        boxes = crop_boxes(self.track.raw_boxes[window_start:window_stop], self.track.found[window_start:window_stop],
                           self.config, self.width, self.height)
        self.track.boxes[start:stop] = boxes[start - window_start: stop - window_start]
        self.final = final


def truncate_finished(track: FaceTrack, frame_count: int) -> FaceTrack:
    """The first ``frame_count`` frames of a track, boxes included."""
    boxes = track.boxes[:frame_count] if track.boxes is not None else None
    return FaceTrack(found=track.found[:frame_count], raw_boxes=track.raw_boxes[:frame_count],
                     landmarks=track.landmarks[:frame_count], boxes=boxes)


def tight_box(landmarks: np.ndarray) -> np.ndarray:
    """(4,) float32 x1 y1 x2 y2 around (468, 2) landmarks."""
    return np.concatenate([landmarks.min(axis=0), landmarks.max(axis=0)]).astype(np.float32)


def choose_face(boxes: np.ndarray, face_index: int | None) -> int | None:
    """Index into ``boxes`` (K, 4): the largest face, or the ``face_index``-th from the left."""
    if face_index is None:
        areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        return int(np.argmax(areas))
    order = np.argsort(boxes[:, 0])
    return int(order[face_index]) if face_index < len(order) else None


def zoomed_out(frame: Frame, margin: float = ZOOM_OUT_MARGIN,
               most_pixels: int = ZOOM_OUT_PIXELS) -> tuple[np.ndarray, float, float, float]:
    """The frame in the middle of a black canvas, a margin of ``margin`` times its longer side on every
    side, shrunk first so the canvas's longer side is at most ``most_pixels``: (canvas (h, w, 3)
    uint8 BGR, frame x and y of its top left corner, canvas pixels per frame pixel). A face that
    fills the frame fills about half of the canvas, as the faces the detectors were trained on do."""
    import cv2

    frame = as_frame(frame)
    width, height = frame.width, frame.height
    scale = min(1.0, most_pixels / ((1 + 2 * margin) * max(height, width)))
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    image_bgr = frame.region(0, 0, width, height, size=size if scale < 1.0 else None)
    pad = round(margin * max(size))
    canvas = cv2.copyMakeBorder(image_bgr, pad, pad, pad, pad, cv2.BORDER_CONSTANT, value=(0, 0, 0))
    scale = size[0] / width
    return canvas, -pad / scale, -pad / scale, scale


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


def merge_boxes(boxes: np.ndarray) -> np.ndarray:
    """Boxes (K, 4) with duplicates from overlapping tiles merged: largest first, a box is dropped when
    more than half of it lies in a larger one kept (the same face, or a part of it cut by a tile's edge)."""
    if len(boxes) == 0:
        return boxes.reshape(0, 4).astype(np.float32)
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    kept: list[int] = []
    for index in np.argsort(-areas, kind="stable"):
        box = boxes[index]
        if kept:
            others = boxes[kept]
            width = np.clip(np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0]), 0, None)
            height = np.clip(np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1]), 0, None)
            if (width * height / max(float(areas[index]), 1e-6)).max() > SAME_FACE_OVERLAP:
                continue
        kept.append(int(index))
    return boxes[kept].astype(np.float32)


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


def new_track(frame_count: int, landmarks_path: Path | None = None) -> FaceTrack:
    """An empty track for ``frame_count`` frames; landmarks memory-mapped to ``landmarks_path`` if given."""
    if landmarks_path is not None:
        landmarks = np.lib.format.open_memmap(landmarks_path, mode="w+", dtype=np.float32,
                                              shape=(frame_count, LANDMARK_COUNT, 2))
    else:
        landmarks = np.empty((frame_count, LANDMARK_COUNT, 2), dtype=np.float32)
    return FaceTrack(found=np.zeros(frame_count, dtype=bool),
                     raw_boxes=np.full((frame_count, 4), np.nan, dtype=np.float32),
                     landmarks=landmarks)


def record(track: FaceTrack, index: int, landmarks: np.ndarray | None) -> None:
    """Store frame ``index``'s landmarks (or the absence of a face) in ``track``."""
    if landmarks is None:
        track.found[index] = False
        track.landmarks[index] = np.nan
        return
    track.found[index] = True
    track.landmarks[index] = landmarks
    track.raw_boxes[index] = tight_box(landmarks)


def smooth_boxes(boxes: np.ndarray, found: np.ndarray, window: int) -> np.ndarray:
    """Average each found frame's box (F, 4) over a centred window of found frames."""
    if window <= 1 or not found.any():
        return boxes.copy()
    valid = found.astype(np.float64)
    filled = np.where(found[:, None], boxes, 0.0).astype(np.float64)
    kernel = np.ones(window, dtype=np.float64)
    offset, length = (window - 1) // 2, len(found)

    def centred_sums(values: np.ndarray) -> np.ndarray:  # np.convolve's "same", also for runs shorter than the window
        return np.convolve(values, kernel, mode="full")[offset:offset + length]

    sums = np.stack([centred_sums(filled[:, k]) for k in range(4)], axis=1)
    counts = centred_sums(valid)[:, None]
    smoothed = sums / np.maximum(counts, 1e-9)
    return np.where(found[:, None], smoothed, np.nan).astype(np.float32)


def pad_and_clip(boxes: np.ndarray, pads: list[int], width: int, height: int) -> np.ndarray:
    """Apply Wav2Lip's padding (top, bottom, left, right) to (F, 4) boxes and clip them to the frame."""
    top, bottom, left, right = pads
    padded = boxes + np.array([-left, -top, right, bottom], dtype=np.float32)
    padded = np.nan_to_num(padded, nan=0.0)
    x1 = np.clip(np.floor(padded[:, 0]), 0, width - 2)
    y1 = np.clip(np.floor(padded[:, 1]), 0, height - 2)
    x2 = np.clip(np.ceil(padded[:, 2]), x1 + 2, width)
    y2 = np.clip(np.ceil(padded[:, 3]), y1 + 2, height)
    return np.stack([x1, y1, x2, y2], axis=1).astype(np.int32)


def crop_boxes(raw_boxes: np.ndarray, found: np.ndarray, config: FaceConfig, width: int, height: int) -> np.ndarray:
    """(F, 4) int32 crop boxes for consecutive frames: the fixed --box clipped to the frame, or the raw
    landmark boxes (F, 4) smoothed over ``config.smooth_window`` found frames, padded and clipped."""
    if config.box is not None:
        x1, y1, x2, y2 = config.box
        fixed = np.array([[max(0, x1), max(0, y1), min(width, x2), min(height, y2)]], dtype=np.int32)
        return np.repeat(fixed, len(found), axis=0)
    return pad_and_clip(smooth_boxes(raw_boxes, found, config.smooth_window), config.pads, width, height)


def finalize_track(track: FaceTrack, config: FaceConfig, width: int, height: int) -> FaceTrack:
    """Turn a whole track's raw landmark boxes into the crop boxes the engines use."""
    track.boxes = crop_boxes(track.raw_boxes, track.found, config, width, height)
    if config.box is not None:
        track.found[:] = True  # a fixed box is a face on every frame
    return track
