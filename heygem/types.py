"""Data passed between the pipeline stages.

Conventions used everywhere in heygem:
- images are numpy ``uint8`` arrays in BGR order, shape (H, W, 3), as OpenCV uses;
- a batch of frames is (N, H, W, 3) ``uint8`` BGR;
- coordinates are pixels in the (possibly resized) working frame, x to the right, y down;
- boxes are ``(x1, y1, x2, y2)`` with x2/y2 exclusive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

Box = tuple[int, int, int, int]  # (x1, y1, x2, y2), pixels, x2/y2 exclusive


@dataclass(frozen=True)
class MediaInfo:
    """What probing a face or audio file found."""

    path: Path
    kind: str  # "video", "image" or "audio"
    width: int = 0  # display width after rotation, before any resizing (0 for audio)
    height: int = 0  # display height after rotation
    fps: float = 0.0  # average frame rate (0 for images and audio)
    fps_fraction: str = ""  # exact rate for ffmpeg, e.g. "30000/1001"
    frame_count: int = 0  # frames expected when decoded at ``fps`` (1 for images)
    duration: float = 0.0  # seconds of the longest stream
    has_audio: bool = False
    audio_codec: str = ""  # e.g. "aac", "mp3", "pcm_s16le"
    audio_sample_rate: int = 0
    audio_channels: int = 0
    audio_duration: float = 0.0
    plain_yuv420: bool = False  # a video stored as 4:2:0 in limited range, unrotated: decoded without scaling


@dataclass(frozen=True)
class FrameGeometry:
    """The working frame size: the input's display size, made even, optionally scaled."""

    width: int
    height: int


@dataclass
class Face:
    """One face in one frame.

    ``box`` is the crop the lip-sync engines work on (padded and smoothed).
    ``landmarks`` are mediapipe face-mesh points (468, 2) float32 in frame pixels,
    or None when the box came from a fixed override and no mesh was fitted.
    """

    box: Box
    landmarks: np.ndarray | None = None  # (468, 2) float32, x/y in frame pixels
    score: float = 1.0


@dataclass
class AudioFeatures:
    """Audio prepared for the lip-sync engines."""

    samples_16k: np.ndarray  # (S,) float32 mono at 16 kHz, in [-1, 1]
    mel: np.ndarray  # (80, T) float32, Wav2Lip-normalised to [-4, 4], 80 mel frames per second
    duration: float  # seconds of the user's audio


@dataclass
class EngineBatch:
    """A bounded batch of output frames handed to a lip-sync engine."""

    frame_indices: np.ndarray  # (N,) int64, output frame numbers
    frames_bgr: np.ndarray | list[np.ndarray]  # (N, H, W, 3) uint8 BGR, the source frames for these outputs
    # (or a list of N (H, W, 3) frames, of different sizes: live sessions of several presenters in one call)
    faces: list[Face | None]  # one per frame; None where no face was found
    mel_windows: np.ndarray  # (N, 80, 16) float32, one Wav2Lip mel window per frame
    fps: float  # output frame rate


@dataclass
class FrameBatch:
    """A bounded batch of output frames on its way from the decoder to the encoder.

    The decoder fills the first three fields; the face stage adds ``faces``; the
    render stages replace the pixels of ``frames_i420`` in place.
    """

    output_indices: np.ndarray  # (N,) int64, output frame numbers
    source_indices: np.ndarray  # (N,) int64, the source frame each output frame shows
    frames_i420: np.ndarray  # (N, H * 3/2, W) uint8 I420: each frame's Y rows, then U, then V
    faces: list[Face | None] = field(default_factory=list)  # one per frame, None where there is none
    frames_bgr: np.ndarray | None = None  # (N, H, W, 3) uint8 BGR, for engines that work on the CPU
    patches: list[FacePatch | None] = field(default_factory=list)  # what the engine made, one per frame
    # finished pixels, one per frame, from an engine that blends them itself (see I420Window); frames
    # without one keep their decoded bytes
    windows_i420: list[I420Window | None] = field(default_factory=list)
    # the frames a pause in the speech touches, as decoded: (rows (R,), (R, H * 3/2, W) uint8), put back after
    # the render (heygem.render.pauses); None: none
    filmed_i420: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class FacePatch:
    """What an engine generated for one frame: new pixels for ``box``.

    ``mask`` says where the new pixels should replace the frame (1) and where the
    frame shows through (0); None lets the blend stage use its own lower-face mask.
    """

    box: Box
    image_bgr: np.ndarray  # (h, w, 3) uint8 BGR, h = y2 - y1, w = x2 - x1
    mask: np.ndarray | None = None  # (h, w) float32 in [0, 1]
    face: Face | None = None  # the face the patch was made for


@dataclass
class I420Window:
    """Finished pixels for one frame, ready to paste: the I420 bytes of an even-aligned box of it.

    An engine that blends its patches itself (the landmark engine) returns these instead of
    FacePatch; writing them into the frame is three plane slices (media.paste_i420_window).
    """

    box: Box  # even x1, y1, x2, y2 (clipped to the frame, whose sides are even)
    planes: np.ndarray  # ((y2 - y1) * 3/2, x2 - x1) uint8 I420: the box's Y rows, then its U, then its V


@dataclass
class GenerationSummary:
    """The result of one generation; also written as JSON next to the output."""

    output_path: Path
    face_path: Path
    audio_path: Path
    engine: str
    engine_reason: str
    width: int
    height: int
    fps: float
    frames: int
    frames_without_face: int
    audio_seconds: float
    video_seconds: float
    seconds_per_stage: dict[str, float] = field(default_factory=dict)
    cpu_seconds_per_stage: dict[str, float] = field(default_factory=dict)  # the stage thread's CPU time
    # stage -> [when it was first busy, when it was last busy], seconds since the run started: stages overlap
    stage_spans: dict[str, list[float]] = field(default_factory=dict)
    total_seconds: float = 0.0
    options: dict = field(default_factory=dict)
    avatar_cache: str = "off"  # "hit": face tracking reused from an earlier run, "miss": tracked and stored
    detector: str = "mediapipe"  # the face detector that found the faces: mediapipe or s3fd
    restorer: str = "none"  # the restoration that ran: "gfpgan", "sharpen" or "none"
    restorer_reason: str = ""
    parts: int = 1  # consecutive renders the output was made in (speech that came sentence by sentence)
    stream_processes: int = 0  # x264 processes that wrote the HLS stream (0: not streamed)
    voice: str = ""  # typed text: the voice that spoke it ("clone": in the voice of a sample)
    voice_model: str = ""  # the cloned voice's model ("VibeVoice-1.5B")
    warnings: list[str] = field(default_factory=list)  # what the user should know of a job that worked
    # [late, early]: the source frames where a face video shorter than the speech turns back and forward again,
    # chosen from its face track known before decoding (heygem.face.turns); None: at its last and first frames
    turns: list[int] | None = None

    def to_json_dict(self) -> dict:
        data = dict(self.__dict__)
        for key in ("output_path", "face_path", "audio_path"):
            data[key] = str(data[key])
        return data
