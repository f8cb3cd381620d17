"""Step 1: probe the inputs: what kind of file each is, its display size, rate, length and audio,
and the frame size and rate the output is made at.
"""

from __future__ import annotations

import logging
import stat
import struct
from fractions import Fraction
from pathlib import Path

from heygem.config import MAX_FRAME_SIDE
from heygem.errors import HeygemError
from heygem.types import FrameGeometry, MediaInfo

logger = logging.getLogger("heygem")

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"}
VIDEO_SUFFIXES = {".mp4", ".mov", ".mkv", ".avi", ".webm", ".m4v", ".mpg", ".mpeg", ".flv", ".wmv", ".ts"}
AUDIO_SUFFIXES = {".wav", ".mp3", ".m4a", ".aac", ".flac", ".ogg", ".oga", ".opus", ".wma"}
_IMAGE_FORMATS = {"image2", "png_pipe", "jpeg_pipe", "webp_pipe", "bmp_pipe", "tiff_pipe", "jpegls_pipe"}
# Demuxers that "open" plain text as a picture (ANSI art, subtitles): a text file is no face or speech.
_TEXT_FORMATS = {"tty", "ansi", "bin", "xbin", "idf", "adf", "srt", "ass", "webvtt", "subviewer", "microdvd",
                 "mpl2", "jacosub", "sami", "realtext", "pjs", "stl", "subviewer1", "vplayer", "lrc"}
MIN_SPEECH_SECONDS = 0.1  # shorter speech makes a video of two frames or fewer: refused


def header_size(path: Path) -> tuple[int, int] | None:
    """(width, height) from a PNG's or JPEG's header, read without decoding; None for other files.

    ffmpeg does not tell an image's size before decoding it, and refuses to decode a huge one."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(64 * 1024)
    except OSError:
        return None
    if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        width, height = struct.unpack(">II", head[16:24])
        return int(width), int(height)
    if head[:2] == b"\xff\xd8":  # JPEG: walk the markers to the first start-of-frame
        position = 2
        while position + 9 < len(head):
            if head[position] != 0xFF:
                return None
            marker = head[position + 1]
            length = struct.unpack(">H", head[position + 2:position + 4])[0]
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                height, width = struct.unpack(">HH", head[position + 5:position + 9])
                return int(width), int(height)
            position += 2 + length
    return None


def _check_side(path: Path, width: int, height: int) -> None:
    if max(width, height) > MAX_FRAME_SIDE:  # refused before a frame is decoded (a 20000x20000 PNG is 1.2 GB)
        raise HeygemError(f"{path.name} is {width}x{height} pixels: too large (heygem takes at most "
                          f"{MAX_FRAME_SIDE} on a side); scale it down")


def check_regular_file(path: Path, what: str = "file") -> None:
    """HeygemError unless ``path`` is a regular file (links followed), saying what it is instead: missing,
    a folder, or a device, pipe or socket (which never end or cannot be read twice)."""
    try:
        mode = Path(path).stat().st_mode
    except FileNotFoundError:
        raise HeygemError(f"{what} not found: {path}") from None
    except OSError as error:
        raise HeygemError(f"cannot read {what} {path}: {error.strerror or error}") from None
    if stat.S_ISDIR(mode):
        raise HeygemError(f"{what} {path} is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise HeygemError(f"{what} {path} is not a regular file (a device, a pipe or a socket): give a file")


def probe(path: str | Path, role: str | None = None) -> MediaInfo:
    """Describe a face or audio file: kind, display size (rotation applied), fps, audio stream.

    ``role`` "face" words the message for a file that is no picture as the face slot needs it."""
    import av

    path = Path(path)
    check_regular_file(path)
    unreadable = (f"{path.name} is not an image or video heygem can read: the face must be a photo (.jpg, .png) or "
                  "a video (.mp4, .mov)" if role == "face" else
                  f"{path.name} is not a media file heygem can read (expected a video, image or audio file)")
    named_as = "a photo" if path.suffix.lower() in IMAGE_SUFFIXES else \
        "a video" if path.suffix.lower() in VIDEO_SUFFIXES else None
    if named_as:  # its name promises what it does not hold: say that it could not be decoded
        unreadable = (f"{path.name} could not be decoded: it is named as {named_as} but is "
                      f"{'not an image or video' if role == 'face' else 'not a media file'} heygem can read "
                      "(a damaged file, or one of another kind renamed?)")
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError, ValueError):
        raise HeygemError(unreadable) from None
    with container:
        format_names = set(container.format.name.split(","))
        if format_names & _TEXT_FORMATS:
            raise HeygemError(unreadable)
        video = next((s for s in container.streams.video), None)
        audio = next((s for s in container.streams.audio), None)
        container_seconds = float(container.duration / 1_000_000) if container.duration else 0.0

        audio_fields = {}
        if audio is not None:
            audio_seconds = float(audio.duration * audio.time_base) if audio.duration else container_seconds
            audio_fields = dict(
                has_audio=True,
                audio_codec=audio.codec_context.name,
                audio_sample_rate=int(audio.codec_context.sample_rate or 0),
                audio_channels=int(audio.codec_context.channels or 0),
                audio_duration=audio_seconds,
            )
        if video is None:
            if audio is None:
                raise HeygemError(f"{path.name} has neither video nor audio")
            return MediaInfo(path=path, kind="audio", duration=audio_fields["audio_duration"], **audio_fields)

        is_image = bool(format_names & _IMAGE_FORMATS) or (
            path.suffix.lower() in IMAGE_SUFFIXES and (video.frames or 1) <= 1
        )
        width, height, rotation = video.codec_context.width, video.codec_context.height, 0
        _check_side(path, width, height)
        if is_image:
            _check_side(path, *(header_size(path) or (0, 0)))
        try:
            first_frame = next(container.decode(video))
            width, height = first_frame.width, first_frame.height
            rotation = int(getattr(first_frame, "rotation", 0) or 0)
            # decoded as it is stored, no scaler needed: 4:2:0 in limited range, not rotated
            plain_yuv420 = (first_frame.format.name == "yuv420p" and int(first_frame.color_range or 1) != 2
                            and rotation == 0)
        except (av.error.FFmpegError, StopIteration):
            if role == "face" and is_image:
                raise HeygemError(unreadable) from None
            raise HeygemError(f"{path.name}: its video stream cannot be decoded") from None
        if rotation % 180 == 90 or rotation % 180 == -90:
            width, height = height, width
        if is_image:
            return MediaInfo(path=path, kind="image", width=width, height=height, frame_count=1, **audio_fields)

        rate = video.average_rate or video.guessed_rate or video.base_rate
        if not rate or rate <= 0:
            raise HeygemError(f"{path.name}: cannot tell its frame rate")
        rate = Fraction(rate).limit_denominator(1001)
        video_seconds = float(video.duration * video.time_base) if video.duration else container_seconds
        frame_count = int(video.frames) if video.frames else int(round(video_seconds * float(rate)))
        return MediaInfo(
            path=path,
            kind="video",
            width=width,
            height=height,
            plain_yuv420=plain_yuv420,
            fps=float(rate),
            fps_fraction=f"{rate.numerator}/{rate.denominator}",
            frame_count=max(frame_count, 1),
            duration=max(video_seconds, audio_fields.get("audio_duration", 0.0)),
            **audio_fields,
        )


def probe_inputs(face_path: Path, audio_path: Path | None, picture_only: bool = False
                 ) -> tuple[MediaInfo, MediaInfo | None]:
    """Probe a face and its speech and refuse what cannot work; returns (face info, audio info).

    ``audio_path`` None (or the face's own path) means the face video's own sound. ``picture_only``:
    the speech is not there yet (words spoken later, heygem.jobs.speech): the face alone, audio info None.
    """
    face_info = probe(face_path, role="face")
    if face_info.kind == "audio":
        raise HeygemError(f"{Path(face_path).name} has no picture: the face must be a video or an image")
    if picture_only:
        return face_info, None
    if audio_path is None or Path(audio_path) == Path(face_path):
        if not face_info.has_audio:
            raise HeygemError(f"{Path(face_path).name} has no sound of its own: add an audio file")
        audio_info = face_info
    else:
        audio_info = probe(audio_path)
        if not audio_info.has_audio:
            raise HeygemError(f"{Path(audio_path).name} has no audio stream")
    seconds = audio_info.audio_duration or audio_info.duration
    if 0 < seconds < MIN_SPEECH_SECONDS:  # 0: a stream that does not say its length (decoded as it comes)
        raise HeygemError(f"the speech in {audio_info.path.name} lasts {seconds:.2f} s: too short, heygem needs at "
                          f"least {MIN_SPEECH_SECONDS:g} s of speech")
    return face_info, audio_info


def working_geometry(info: MediaInfo, output_height: int | None) -> FrameGeometry:
    """The frame size heygem works at: the display size made even, or scaled to ``output_height``."""
    if output_height:
        height = output_height - output_height % 2
        width = int(round(info.width * height / info.height / 2)) * 2
        return FrameGeometry(width=max(width, 2), height=max(height, 2))
    return FrameGeometry(width=info.width - info.width % 2, height=info.height - info.height % 2)


def fps_to_fraction(fps: float) -> str:
    """A frame rate as an exact ffmpeg fraction: 29.97 -> 30000/1001, 25 -> 25/1."""
    rate = Fraction(fps).limit_denominator(1001)
    return f"{rate.numerator}/{rate.denominator}"


def check_written(output_path: Path, frame_count: int, fps: float) -> None:
    """Step 8: probe the written MP4: a video and an audio stream, the expected length."""
    info = probe(output_path)
    if info.kind != "video" or not info.has_audio:
        raise HeygemError(f"the output {output_path.name} is missing its video or audio stream")
    expected_seconds = frame_count / fps
    if abs(info.audio_duration - expected_seconds) > 1.5 / fps + 0.05:
        logger.warning("output audio lasts %.3f s, video %.3f s", info.audio_duration, expected_seconds)
