"""A small picture of a face input (a photo, or a video's first frame) for lists of jobs."""

from __future__ import annotations

import subprocess
from pathlib import Path

from heygem.media.ffmpeg import ffmpeg_binary

THUMBNAIL_HEIGHT = 48  # pixels; twice the height it is shown at, for sharp screens
THUMBNAIL_SECONDS = 10  # the longest an unreadable or odd file may keep ffmpeg busy


def thumbnail_args(face_path: Path, height: int) -> list[str]:
    """ffmpeg's arguments for a JPEG of the first picture of ``face_path``, ``height`` pixels tall, on stdout."""
    return [ffmpeg_binary(), "-nostdin", "-v", "error", "-i", str(face_path), "-frames:v", "1",
            "-vf", f"scale=-2:{height}", "-f", "image2pipe", "-c:v", "mjpeg", "-q:v", "5", "-"]


def thumbnail_jpeg(face_path: Path, height: int = THUMBNAIL_HEIGHT) -> bytes | None:
    """The JPEG bytes of a small picture of the face input; None when ffmpeg cannot make one."""
    try:
        done = subprocess.run(thumbnail_args(Path(face_path), height), capture_output=True,
                              timeout=THUMBNAIL_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.startswith(b"\xff\xd8") else None
