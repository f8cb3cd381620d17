"""The face a live session shows: the presenter's frames (its clip, at most LIVE_CLIP_SECONDS of it, played
back and forth while nobody speaks) and each frame's face.

A prepared presenter brings its track (heygem.presenters.prepare.kept_track), so a session tracks nothing;
a photo (the bundled portrait, or a photo presenter) is found once, and a clip whose track is missing is
tracked once when the session starts, frame after frame as a job tracks it (heygem.face.finder).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heygem.config import REPO_ROOT, Config
from heygem.errors import HeygemError
from heygem.face.track import FaceTrack, finalize_track, new_track, record
from heygem.media.decode import iter_video_i420, load_image
from heygem.media.frames import bgr_to_yuv420, yuv420_to_bgr
from heygem.media.probing import probe, working_geometry
from heygem.media.source import pingpong_indices
from heygem.types import Face, FrameGeometry

logger = logging.getLogger("heygem")

BUNDLED_PORTRAIT = REPO_ROOT / "assets" / "astronaut.jpg"
LIVE_CLIP_SECONDS = 10.0  # the part of a clip a session keeps in memory and loops (10 s of 360p: ~86 MB)


@dataclass
class LiveFace:
    """The frames a session shows and their faces."""

    frames_i420: np.ndarray  # (F, H * 3/2, W) uint8 I420, the clip's first frames (F = 1 for a photo)
    faces: list[Face | None]  # one per frame, None where there is no face
    fps: float  # the clip's own frame rate (a photo: any)
    geometry: FrameGeometry
    description: str  # what the session shows, for its answer and the log

    def frame_at(self, seconds: float) -> int:
        """The frame shown ``seconds`` into the session: the clip forward, then backward, never jumping."""
        index = np.array([int(round(seconds * self.fps))])
        return int(pingpong_indices(index, len(self.frames_i420))[0])


def load_face(face_path: Path, config: Config, description: str, track_dir: Path | None = None) -> LiveFace:
    """The live face of a photo or clip at ``config.media.output_height``: its track from ``track_dir``
    (a prepared presenter's), else found or tracked now. HeygemError when no frame shows a face."""
    from heygem.presenters.prepare import kept_track  # the presenter's arrays, scaled to this size

    info = probe(face_path, role="face")
    geometry = working_geometry(info, config.media.output_height)
    if info.kind == "video":
        limit = max(1, int(LIVE_CLIP_SECONDS * info.fps))
        batches, count = [], 0
        for batch in iter_video_i420(info, geometry, 32):
            batches.append(batch[: limit - count])
            count += len(batches[-1])
            if count >= limit:
                break
        if not batches:
            raise HeygemError(f"{face_path.name}: no video frames could be decoded")
        frames = np.concatenate(batches)
        fps = info.fps
    else:
        frames = bgr_to_yuv420(load_image(info, geometry))[None]
        fps = config.media.fps
    track = kept_track(track_dir, geometry) if track_dir is not None else None
    if track is not None and track.frame_count >= len(frames):
        how = "its saved track"
        track = FaceTrack(found=track.found[: len(frames)], raw_boxes=track.raw_boxes[: len(frames)],
                          landmarks=track.landmarks[: len(frames)])
    else:
        how = "found in the photo" if len(frames) == 1 else f"tracked now ({len(frames)} frames)"
        track = _track_frames(frames, geometry, config, still=info.kind != "video")
    if not track.found.any():
        raise HeygemError(f"no face was found in {face_path.name}")
    finalize_track(track, config.face, geometry.width, geometry.height)
    faces = [track.face(index) for index in range(len(frames))]
    logger.info("live face: %s, %d frame(s) at %dx%d, %s", description, len(frames), geometry.width,
                geometry.height, how)
    return LiveFace(frames_i420=frames, faces=faces, fps=fps, geometry=geometry, description=f"{description}, {how}")


def _track_frames(frames_i420: np.ndarray, geometry: FrameGeometry, config: Config, still: bool) -> FaceTrack:
    """The face of every frame, followed from frame to frame (a photo: found in its one frame)."""
    from heygem.face.finder import FaceFinder

    track = new_track(len(frames_i420))
    with FaceFinder(config.face, still_images=still) as finder:
        for index, frame in enumerate(frames_i420):
            record(track, index, finder.find(yuv420_to_bgr(frame, geometry.width, geometry.height)))
    return track
