"""What a clip must pass to become a presenter: refusals where it cannot work, warnings where it can.

Two looks. :func:`look` is quick (a probe and a few frames spread over the clip) and runs before
anything is stored: a file that is neither a video nor a photo, a clip shorter than
:data:`MIN_SECONDS` or longer than the server's limit, no face, or several faces without a
``face_index`` are refused (HeygemError); a dark picture is a warning. :func:`track_warnings` runs on
the whole clip's face track once it is prepared: a face found in under 90 % of the frames, smaller
than :data:`MIN_FACE_PIXELS` tall, or cut by the frame's edge are warnings naming the seconds.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from heygem.config import Config, load_config
from heygem.errors import HeygemError
from heygem.media.decode import load_image
from heygem.media.ffmpeg import ffmpeg_binary
from heygem.media.probing import probe, working_geometry
from heygem.types import FrameGeometry, MediaInfo

MIN_SECONDS = 2.0  # a shorter clip is refused: a face that barely moves is better as a photo
SECONDS_TOLERANCE = 0.05  # a "2 s" clip may probe a frame shorter
LOOKED_AT_FRAMES = 5  # frames of a clip the quick look detects faces in, spread evenly
MIN_FOUND_SHARE = 0.9  # a face found in fewer of the frames is a warning
MIN_FACE_PIXELS = 80  # a face box less tall than this, in the clip's own pixels, is a warning
DARK_BRIGHTNESS = 50  # a looked-at frame whose mean brightness (0-255) is under this is a warning
EDGE_PIXELS = 1.0  # a face box this close to the frame's border is cut by it
LISTED_SPANS = 4  # spans of seconds a warning lists before "and N more"


@dataclass
class Look:
    """What the quick look found: the probe, the warnings so far, the most faces in one looked-at frame."""

    info: MediaInfo
    geometry: FrameGeometry
    faces_seen: int
    warnings: list[str] = field(default_factory=list)


def look(clip_path: Path, face_index: int | None = None, max_seconds: float | None = None,
         config: Config | None = None) -> Look:
    """The quick checks of a clip or photo, before it is stored as a presenter; HeygemError refuses it."""
    config = config or load_config()
    info = probe(clip_path, role="face")
    name = clip_path.name
    if info.kind == "audio":
        raise HeygemError(f"{name} is sound only: a presenter is made from a video or a photo of a face")
    if info.kind == "video":
        if info.duration + SECONDS_TOLERANCE < MIN_SECONDS:
            raise HeygemError(f"{name} lasts {info.duration:.2f} s; a presenter's clip lasts at least "
                              f"{MIN_SECONDS:g} s (or use a photo)")
        if max_seconds is not None and info.duration > max_seconds:
            raise HeygemError(f"{name} lasts {info.duration:.1f} s; presenters here are at most {max_seconds:g} s "
                              "long: cut the clip")
    geometry = working_geometry(info, config.media.output_height)
    times, frames_bgr = looked_at_frames(info, geometry)
    from heygem.face.finder import count_faces

    faces = count_faces(config.face, frames_bgr)
    most = max(faces)
    if most == 0:
        raise HeygemError(f"no face was found in {name} (looked {moments(info, times)}): use a clip where one "
                          "face is clearly visible, looks at the camera and is not tiny")
    busiest = moments(info, [times[faces.index(most)]])
    if most > 1 and face_index is None:
        raise HeygemError(f"{name} shows {most} faces ({busiest}): say which one speaks with face_index 0 to "
                          f"{most - 1}, counted from the left")
    if face_index is not None and face_index >= most:
        raise HeygemError(f"face_index {face_index} asks for face {face_index + 1} from the left, but {name} "
                          f"shows at most {most} ({busiest})")
    seen = Look(info=info, geometry=geometry, faces_seen=most)
    brightness = [float(frame.mean()) for frame in frames_bgr]
    dark = [seconds for seconds, value in zip(times, brightness) if value < DARK_BRIGHTNESS]
    if dark:
        seen.warnings.append(f"too dark: the picture's mean brightness is {min(brightness):.0f} of 255 "
                             f"({moments(info, dark)}); light the face evenly for a cleaner mouth")
    return seen


def moments(info: MediaInfo, times: list[float]) -> str:
    """Where in the clip: "at 0.3, 0.8 s", or "in the photo"."""
    return "in the photo" if info.kind == "image" else f"at {', '.join(f'{seconds:.1f}' for seconds in times)} s"


def looked_at_frames(info: MediaInfo, geometry: FrameGeometry) -> tuple[list[float], list[np.ndarray]]:
    """The seconds and (H, W, 3) uint8 BGR frames at the working size that the quick look examines."""
    if info.kind == "image":
        return [0.0], [load_image(info, geometry)]
    count = max(1, min(LOOKED_AT_FRAMES, info.frame_count))
    times = [info.duration * (index + 0.5) / count for index in range(count)]
    frames = []
    for seconds in times:
        frame = _frame_at(info.path, seconds, geometry)
        if frame is None:
            raise HeygemError(f"{info.path.name}: its frame at {seconds:.1f} s cannot be decoded")
        frames.append(frame)
    return times, frames


def frame_at_args(path: Path, seconds: float, geometry: FrameGeometry) -> list[str]:
    """ffmpeg's arguments for one BGR frame at ``seconds``, scaled to ``geometry``, on stdout."""
    return ["-nostdin", "-v", "error", "-ss", f"{seconds:.3f}", "-i", str(path), "-frames:v", "1",
            "-vf", f"scale={geometry.width}:{geometry.height}", "-f", "rawvideo", "-pix_fmt", "bgr24", "pipe:"]


def _frame_at(path: Path, seconds: float, geometry: FrameGeometry) -> np.ndarray | None:
    result = subprocess.run([ffmpeg_binary(), *frame_at_args(path, seconds, geometry)], capture_output=True,
                            timeout=120)
    frame_bytes = geometry.width * geometry.height * 3
    if result.returncode != 0 or len(result.stdout) < frame_bytes:
        return None
    return np.frombuffer(result.stdout[:frame_bytes], np.uint8).reshape(geometry.height, geometry.width, 3)


def frame_spans(frames: np.ndarray, fps: float) -> str:
    """The runs of true ``frames`` (F,) bool as seconds: "0.0-1.2 s, 3.4 s and 2 more"."""
    indices = np.flatnonzero(frames)
    if len(indices) == 0:
        return ""
    breaks = np.flatnonzero(np.diff(indices) > 1)
    starts = np.concatenate([[indices[0]], indices[breaks + 1]])
    ends = np.concatenate([indices[breaks], [indices[-1]]])
    spans = []
    for start, end in zip(starts[:LISTED_SPANS], ends[:LISTED_SPANS]):
        first, last = start / fps, (end + 1) / fps
        spans.append(f"{first:.1f} s" if end == start else f"{first:.1f}-{last:.1f} s")
    more = len(starts) - LISTED_SPANS
    return ", ".join(spans) + (f" and {more} more" if more > 0 else "")


def track_warnings(found: np.ndarray, raw_boxes: np.ndarray, info: MediaInfo, geometry: FrameGeometry) -> list[str]:
    """Warnings about the whole track: ``found`` (F,) bool, ``raw_boxes`` (F, 4) float32 x1 y1 x2 y2 in
    ``geometry``'s pixels (NaN where not found), of the clip ``info``."""
    warnings = []
    fps = info.fps if info.kind == "video" else 1.0
    photo = info.kind == "image"
    count = len(found)
    share = float(found.mean()) if count else 0.0
    if count and share < MIN_FOUND_SHARE:
        warnings.append(f"the face is found in only {100 * share:.0f} % of the frames (missing at "
                        f"{frame_spans(~found, fps)}): those frames are shown as they are, without lip-sync")
    boxes = np.where(found[:, None], raw_boxes, 0.0)  # (F, 4)
    scale = info.height / max(geometry.height, 1)
    heights = (boxes[:, 3] - boxes[:, 1]) * scale
    small = found & (heights < MIN_FACE_PIXELS)
    if small.any():
        where = "in the photo" if photo else f"at {frame_spans(small, fps)}"
        warnings.append(f"the face is under {MIN_FACE_PIXELS} pixels tall {where} (smallest "
                        f"{heights[small].min():.0f} px): the mouth will look soft; use a closer shot")
    cut = found & ((boxes[:, 0] < EDGE_PIXELS) | (boxes[:, 1] < EDGE_PIXELS)
                   | (boxes[:, 2] > geometry.width - EDGE_PIXELS) | (boxes[:, 3] > geometry.height - EDGE_PIXELS))
    if cut.any():
        where = "in the photo" if photo else f"at {frame_spans(cut, fps)}"
        warnings.append(f"the face is cut by the frame's edge {where}: keep the whole face in the picture")
    return warnings
