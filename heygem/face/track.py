"""Step 5, per video: the face track, every frame's landmarks and box, built run by run.

Boxes are padded as Wav2Lip pads them and averaged over a centred window of frames. Frames where
no face is found are recorded as such; the pipeline passes them through unchanged. The landmark
array can live in a memory-mapped file, so a long video costs disk, not RAM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heygem.config import FaceConfig
from heygem.face.detect import LANDMARK_COUNT
from heygem.types import Face


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


class TrackBuilder:
    """The face track of a video built run by run as frames stream past, with final boxes as soon as known.

    A frame's box is averaged over a centred window of ``smooth_window`` frames, so it is
    final once the frames up to half a window after it are tracked, or once the video has
    ended. ``add`` takes runs in order; ``face`` hands out finished frames only.
    """

    def __init__(self, config: FaceConfig, width: int, height: int, capacity: int,
                 landmarks_path: Path | None = None, track: FaceTrack | None = None, complete: bool = True):
        """``track``: what was tracked before (the avatar cache). ``complete``: it holds every frame this
        builder will be asked for, so nothing is added; otherwise it is the first frames of a track of
        ``capacity`` frames that goes on from its end."""
        self.config = config
        self.width, self.height = width, height
        if track is None:
            track = new_track(capacity, landmarks_path)
            self.tracked = 0
        elif complete:  # only the small arrays are copied, to be writable
            track = FaceTrack(found=np.array(track.found), raw_boxes=np.array(track.raw_boxes),
                              landmarks=track.landmarks)
            self.tracked = track.frame_count
        else:  # the frames tracked before, copied into a track with room for the rest
            before = track
            self.tracked = min(before.frame_count, capacity)
            track = new_track(max(capacity, self.tracked), landmarks_path)
            track.found[: self.tracked] = before.found[: self.tracked]
            track.raw_boxes[: self.tracked] = before.raw_boxes[: self.tracked]
            track.landmarks[: self.tracked] = before.landmarks[: self.tracked]
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
