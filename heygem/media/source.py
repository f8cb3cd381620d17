"""Step 4: the face input as output batches: a still image repeated, or a video decoded in bounded batches.

Frames travel as I420 (what ffmpeg decodes and encodes), half the bytes of BGR; a video
shorter than the audio plays forward and backward from a raw frame file on disk, so memory
does not grow with the video's length. It turns at its last and first frames, or at the two
frames the job chose from a face track known before decoding (heygem.face.turns: where the
head is still, so the turn is not seen).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from heygem.errors import HeygemError
from heygem.media.decode import FrameFile, iter_video_i420, load_image
from heygem.media.frames import bgr_to_yuv420
from heygem.types import FrameBatch, FrameGeometry, MediaInfo

# a batch of frames holds at most this many bytes (a score of batches are in flight at once: decoding,
# tracking, rendering, encoding), but never fewer than MIN_BATCH_FRAMES frames. 32 MiB (10 frames at
# 1080p) rather than 64: with one batch per queue and per decoder, about 1 GiB less at the peak of a
# 1080p job on the GPU machine, as fast with the track from the avatar cache and 10-15 % slower with
# every frame tracked (docs/benchmarks.md)
BATCH_BYTES = 32 * 2**20
MIN_BATCH_FRAMES = 4
# a video shorter than the audio by more than this is kept in a frame file as it is decoded
CACHE_MARGIN_SECONDS = 0.5


def frames_per_batch(geometry: FrameGeometry, configured: int, bytes_per_pixel: float = 3) -> int:
    """``configured``, or fewer for big frames, so that one batch stays under BATCH_BYTES.

    ``bytes_per_pixel`` is 3 where the batch is converted to BGR on the CPU, 1.5 where it
    stays I420 all the way (the torch render path).
    """
    frame_bytes = int(geometry.width * geometry.height * bytes_per_pixel)
    return max(MIN_BATCH_FRAMES, min(configured, BATCH_BYTES // frame_bytes))


def looped_indices(output_indices: np.ndarray, turns: tuple[int, int] | list[int]) -> np.ndarray:
    """Source frame for each output frame: forward from frame 0 to the late turn, backward to the early
    turn, forward to the late one again, and so on (``turns`` = [late, early], late >= early >= 0).
    Consecutive output frames show neighbouring source frames, or the same one: the picture never jumps."""
    late, early = int(turns[0]), int(turns[1])
    output_indices = np.asarray(output_indices)
    span = late - early
    if span <= 0:
        return np.where(output_indices <= late, output_indices, late)
    phase = (output_indices - late) % (2 * span)  # 0 at the late turn, span at the early one
    looped = np.where(phase <= span, late - phase, early + (phase - span))
    return np.where(output_indices <= late, output_indices, looped)


def pingpong_indices(output_indices: np.ndarray, source_count: int) -> np.ndarray:
    """Source frame for each output frame: forward, then backward, and so on, never jumping (turning at the
    video's last and first frames)."""
    if source_count <= 1:
        return np.zeros_like(output_indices)
    return looped_indices(output_indices, (source_count - 1, 0))


class SourceFrames:
    """The face input as output batches: one still image, or a video decoded in bounded batches.

    Output frame i shows source frame i while the video lasts; a video shorter than the
    audio then plays backward and forward (``looped_indices``) from a raw frame file in
    the job's work folder, written while the video is decoded when probing already shows it
    is short, otherwise by one more decode when it turns out so. It turns at its last and first
    frames, or at ``turns`` ([late, early], set before the output's batches are asked for) when the
    job chose them from the whole video's face track (heygem.face.turns).
    """

    def __init__(self, info: MediaInfo, geometry: FrameGeometry, frames_needed: int,
                 still_i420: np.ndarray | None, work_dir: Path, audio_seconds: float, decoders: int = 1):
        self.info = info
        self.decoders = decoders  # ffmpeg processes sharing the decoding (media.DecoderShare)
        self.geometry = geometry
        self.frames_needed = frames_needed
        self.still_i420 = still_i420  # (H * 3/2, W) uint8 for a photo
        self.work_dir = work_dir
        self.frame_file: FrameFile | None = None
        if still_i420 is None and info.duration + CACHE_MARGIN_SECONDS < audio_seconds:
            self.frame_file = FrameFile(work_dir / "frames.yuv", geometry)
        self.frame_count = 1 if still_i420 is not None else None  # source frames, once known
        self.turns: tuple[int, int] | None = None  # [late, early] source frames to turn at; None: the ends

    @classmethod
    def open(cls, info: MediaInfo, geometry: FrameGeometry, frames_needed: int, audio_seconds: float,
             work_dir: Path, decoders: int = 1) -> SourceFrames:
        still = bgr_to_yuv420(load_image(info, geometry)) if info.kind == "image" else None
        return cls(info, geometry, frames_needed, still, work_dir, audio_seconds, decoders)

    @property
    def is_still(self) -> bool:
        return self.still_i420 is not None

    @property
    def tracking_capacity(self) -> int:
        """Source frames the face track may need: the video's (probing can undercount a little)."""
        return 1 if self.is_still else min(self.info.frame_count + 64, self.frames_needed)

    def output_batches(self, frame_count: int, batch_frames: int, first_frame: int = 0) -> Iterator[FrameBatch]:
        """Yield the output's frames in order, ``batch_frames`` at a time, as I420 batches.

        ``first_frame``: this output continues a longer one whose first ``first_frame`` frames another
        call made (speech rendered in consecutive parts): the face goes on from where that part left
        it (the frames before are decoded and passed over). Output indices count from 0 all the same.
        """
        if self.is_still:
            for output_indices in _batch_ranges(frame_count, batch_frames):
                frames = np.repeat(self.still_i420[None], len(output_indices), axis=0)
                yield FrameBatch(output_indices, np.zeros_like(output_indices), frames)
            return
        wanted = first_frame + frame_count  # frames of the whole output up to this part's end
        forward = wanted if self.turns is None else min(wanted, self.turns[0] + 1)  # played before turning
        decoded = 0
        for frames in iter_video_i420(self.info, self.geometry, batch_frames, self.decoders):
            frames = frames[: forward - decoded]
            if self.frame_file is not None:
                self.frame_file.append(frames)
            kept = frames[max(0, first_frame - decoded):]  # (n, H * 3/2, W): this part's
            start = max(decoded, first_frame)
            decoded += len(frames)
            if len(kept):
                sources = np.arange(start, start + len(kept))
                yield FrameBatch(sources - first_frame, sources, kept)
            if decoded >= forward:
                break
        if decoded >= wanted:
            return
        if decoded == 0:
            raise HeygemError(f"{self.info.path.name}: no video frames could be decoded")
        turns = self.turns
        if decoded < forward:  # the video ended: it turns at its last frame (and its first)
            self.frame_count = decoded
            turns = (decoded - 1, 0)
        if self.frame_file is None:  # shorter than probing said: keep it for playing backward
            self._fill_frame_file(batch_frames, decoded)
        for whole_indices in _batch_ranges(wanted, batch_frames, start=max(decoded, first_frame)):
            source_indices = looped_indices(whole_indices, turns)
            yield FrameBatch(whole_indices - first_frame, source_indices, self.frame_file.read(source_indices))

    def frames_between(self, start: int, stop: int, batch_frames: int) -> Iterator[tuple[int, np.ndarray]]:
        """The video's frames ``start`` to ``stop`` (fewer where it ends first), decoded anew, in batches of
        at most ``batch_frames``: (the batch's first frame number, (n, H * 3/2, W) uint8 I420)."""
        decoded = 0
        for frames in iter_video_i420(self.info, self.geometry, batch_frames, self.decoders):
            first = decoded
            decoded += len(frames)
            kept = frames[max(0, start - first): max(0, stop - first)]
            if len(kept):
                yield max(start, first), kept
            if decoded >= stop:
                return

    def close(self) -> None:
        if self.frame_file is not None:
            self.frame_file.close()

    def _fill_frame_file(self, batch_frames: int, count: int) -> None:
        """Decode the video's first ``count`` frames again into the frame file."""
        self.frame_file = FrameFile(self.work_dir / "frames.yuv", self.geometry)
        for frames in iter_video_i420(self.info, self.geometry, batch_frames, self.decoders):
            self.frame_file.append(frames[: count - self.frame_file.count])
            if self.frame_file.count >= count:
                break


def _batch_ranges(stop: int, size: int, start: int = 0) -> Iterator[np.ndarray]:
    for first in range(start, stop, size):
        yield np.arange(first, min(first + size, stop))
