"""Where a face video shorter than its speech turns back, chosen from its face track.

A video shorter than the speech plays forward, then backward, then forward again
(heygem.media.source.looped_indices). Reversing the picture while the head moves shows a
bounce; reversing it while the head is still does not. When the whole video's face track is
known before a frame is decoded (a presenter, or the avatar cache), :func:`turn_frames` picks the
two frames to turn at: the *late* turn among the video's last frames, the *early* turn among its
first, each where the head is nearly still and looks most as it does at the first frame (so
every pass starts and ends in the same pose). Without a known track the video turns at its
first and last frames.
"""

from __future__ import annotations

import numpy as np

from heygem.face.track import FaceTrack

EDGE_SHARE = 1 / 3  # the late turn lies in the video's last third, the early one in its first third
MIN_FRAMES = 6  # a shorter video turns at its ends
MOTION_RADIUS = 2  # a frame's motion is averaged over this many frames either side: a still stretch, not one frame
DISTANCE_WEIGHT = 0.5  # how much being far from the first frame's pose counts against a frame, beside its motion
POINT_STEP = 4  # every 4th face-mesh point is measured (117 of 468): the same answer, a quarter of the reading


def turn_frames(track: FaceTrack) -> list[int]:
    """[late, early]: the source frames where the video turns back (late) and forward again (early).

    Each frame is scored by the face's motion around it (the mean landmark step to its neighbouring
    frames, averaged over a few frames) plus, weighted by DISTANCE_WEIGHT, its landmarks' distance
    from the first frame's; both are divided by their median over the video, so neither unit nor
    face size matters. The lowest score of the last third is the late turn, of the first third the
    early turn. Frames without a face are never chosen; a video under MIN_FRAMES frames, or with
    too few faces, turns at its ends: [frames - 1, 0].
    """
    count = track.frame_count
    ends = [max(count - 1, 0), 0]
    if count < MIN_FRAMES:
        return ends
    found = np.asarray(track.found, dtype=bool)
    landmarks = np.asarray(track.landmarks[:, ::POINT_STEP], dtype=np.float32)  # (F, 117, 2) pixels
    first = int(np.argmax(found)) if found.any() else -1
    if first < 0 or found.sum() < 2:
        return ends
    steps = np.linalg.norm(np.diff(landmarks, axis=0), axis=2).mean(axis=1)  # (F - 1,) pixels between frames
    steps[~(found[1:] & found[:-1])] = np.nan
    # a frame's own motion: the mean of its steps to the frame before and after
    padded = np.concatenate([[np.nan], steps, [np.nan]])  # (F + 1,)
    sides = np.stack([padded[:-1], padded[1:]])  # (2, F): the step from the frame before, to the frame after
    known = np.isfinite(sides)
    motion = np.where(known.any(axis=0), np.where(known, sides, 0.0).sum(axis=0) / np.maximum(known.sum(axis=0), 1),
                      np.nan)  # (F,), NaN without a face on either side
    motion = _window_mean(motion, MOTION_RADIUS)
    distance = np.linalg.norm(landmarks - landmarks[first], axis=2).mean(axis=1)  # (F,) pixels from the first pose
    score = motion / _scale(motion) + DISTANCE_WEIGHT * distance / _scale(distance)
    score[~found | ~np.isfinite(score)] = np.inf
    edge = max(1, int(count * EDGE_SHARE))
    late_from = count - edge
    late = late_from + int(np.argmin(score[late_from:]))
    early = int(np.argmin(score[:edge]))
    if not np.isfinite(score[late]):
        late = ends[0]
    if not np.isfinite(score[early]):
        early = 0
    return [late, early]


def _window_mean(values: np.ndarray, radius: int) -> np.ndarray:
    """(F,) the mean of the finite ``values`` within ``radius`` frames either side; NaN where none is finite."""
    finite = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    index = np.arange(len(values))
    low, high = np.clip(index - radius, 0, len(values)), np.clip(index + radius + 1, 0, len(values))
    taken = counts[high] - counts[low]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(taken > 0, (sums[high] - sums[low]) / np.maximum(taken, 1), np.nan)


def _scale(values: np.ndarray) -> float:
    """The median of the finite values, kept above a tiny floor (a video that never moves)."""
    finite = values[np.isfinite(values)]
    return max(float(np.median(finite)) if finite.size else 0.0, 1e-3)
