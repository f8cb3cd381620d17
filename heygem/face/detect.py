"""Face detection with mediapipe, and its face mesh: the models ship inside the mediapipe wheel.

mediapipe's full-range detector looks at the whole frame and its short-range detector at the frame
zoomed out (a face filling the frame fills half of that view); the face mesh gives 468 landmarks of
one face, read straight from the bytes the graph writes. ``--detector s3fd`` swaps the detector
(heygem.face.s3fd); the landmarks come from the face mesh either way.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from typing import Protocol

import numpy as np

from heygem.media.frames import Frame, as_frame
from heygem.runtime import library_logs

LANDMARK_COUNT = 468
SAME_FACE_OVERLAP = 0.5  # boxes from two tiles are one face when this much of the smaller one is shared
ZOOM_OUT_MARGIN = 0.5  # the zoomed-out view: the frame with a black margin this fraction of its longer side
ZOOM_OUT_PIXELS = 256  # ... shrunk first to at most this longest side (the short-range detector works at 128)


class FaceDetector(Protocol):
    """What FaceFinder needs of a face detector (MediapipeDetector here, heygem.face.s3fd.S3FDDetector)."""

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
    # the real spec (found without importing): libraries that look for matplotlib meanwhile (diffusers, in
    # another thread) see it installed instead of failing on a module without a spec
    parent.__spec__ = importlib.util.find_spec("matplotlib")
    pyplot.__spec__ = importlib.machinery.ModuleSpec("matplotlib.pyplot", None)
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
            results.append(merge_boxes(np.concatenate([whole,
                                                       self._boxes(self._short_range, canvas_rgb, x, y, scale)])))
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
