"""Subtitles on a finished MP4: a soft track muxed in, or the cues drawn into the frames.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heygem.errors import HeygemError
from heygem.media.ffmpeg import enlarge_pipe, ffmpeg_binary, read_into
from heygem.media.probing import probe

logger = logging.getLogger("heygem")


def soft_subtitle_args(video_path: Path, srt_path: Path, output_path: Path) -> list[str]:
    """ffmpeg arguments that copy ``video_path``'s streams and add ``srt_path`` as a mov_text subtitle track."""
    return ["-nostdin", "-v", "error", "-y", "-i", str(video_path), "-i", str(srt_path), "-map", "0", "-map", "1",
            "-c", "copy", "-c:s", "mov_text", "-metadata:s:s:0", "handler_name=Subtitles",
            "-movflags", "+faststart", "-f", "mp4", str(output_path)]


def add_soft_subtitles(video_path: Path, srt_path: Path) -> None:
    """Mux ``srt_path`` into the MP4 ``video_path`` as a soft subtitle track (nothing is re-encoded)."""
    video_path = Path(video_path)
    partial = video_path.with_name(f".{video_path.stem}.{os.getpid()}.{threading.get_ident()}.subtitled.mp4")
    try:
        completed = subprocess.run([ffmpeg_binary(), *soft_subtitle_args(video_path, srt_path, partial)],
                                   capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if completed.returncode != 0:
            lines = completed.stderr.strip().splitlines()
            raise HeygemError(f"adding subtitles failed: {lines[-1] if lines else 'ffmpeg failed'}")
        os.replace(partial, video_path)
    finally:
        partial.unlink(missing_ok=True)


SUBTITLE_MODES = ("none", "soft", "burn")
SUBTITLE_POSITIONS = ("bottom", "top")
CJK_FONT_PACKAGE = "paperang_p2_fonts_cjk"  # pip paperang-p2-fonts-cjk: WenQuanYi Micro Hei, with CJK glyphs
CJK_FONT_FILE = "fonts/wqy-microhei.ttc"


@functools.lru_cache(maxsize=8)
def subtitle_font(size: int):
    """Pillow's built-in scalable font (Pillow >= 10.1) at ``size`` pixels: no system font is needed."""
    from PIL import ImageFont

    return ImageFont.load_default(size)


@functools.lru_cache(maxsize=8)
def cjk_subtitle_font(size: int):
    """WenQuanYi Micro Hei at ``size`` pixels, from the paperang-p2-fonts-cjk package (a dependency): Chinese,
    Japanese and Korean glyphs, and Latin ones; None when the package is not installed."""
    import importlib.resources

    from PIL import ImageFont

    try:
        font_file = importlib.resources.files(CJK_FONT_PACKAGE).joinpath(CJK_FONT_FILE)
    except ModuleNotFoundError:
        return None
    if not font_file.is_file():
        return None
    return ImageFont.truetype(str(font_file), size)


def _glyph_signature(font, character: str) -> tuple:
    mask = font.getmask(character)
    return mask.size, bytes(mask)


def characters_missing_from_font(text: str, font=None) -> list[str]:
    """The characters of ``text`` that ``font`` (default: the built-in subtitle font) has no glyph for, in
    order.

    A missing glyph is drawn as the font's empty box; a character whose mask equals that box's is missing.
    """
    font = font if font is not None else subtitle_font(24)
    empty_box = _glyph_signature(font, "\U000f0000")  # a private-use code point no font draws
    missing: list[str] = []
    for character in dict.fromkeys(text):
        if character.isspace() or not character.isprintable():
            continue
        if _glyph_signature(font, character) == empty_box:
            missing.append(character)
    return missing


def font_for(text: str, size: int = 24):
    """The font that draws all of ``text`` at ``size`` pixels: the built-in one, else the CJK font
    (Chinese, say); None when neither has every glyph."""
    for font in (subtitle_font(size), cjk_subtitle_font(size)):
        if font is not None and not characters_missing_from_font(text, font):
            return font
    return None


def _wrap_words(text: str, font, max_width: float) -> list[str]:
    """Break ``text`` into lines no wider than ``max_width`` pixels, at spaces; a word wider than a line
    (Chinese has no spaces) is broken between its characters."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        candidate = f"{current} {word}" if current else word
        if current and font.getlength(candidate) > max_width:
            lines.append(current)
            current = word
        else:
            current = candidate
        while font.getlength(current) > max_width and len(current) > 1:
            cut = len(current) - 1
            while cut > 1 and font.getlength(current[:cut]) > max_width:
                cut -= 1
            lines.append(current[:cut].rstrip())
            current = current[cut:].lstrip()
    if current:
        lines.append(current)
    return lines


def render_subtitle(text: str, width: int, height: int, size: float = 0.045,
                    position: str = "bottom") -> tuple[np.ndarray, int]:
    """One cue drawn for a ``width`` x ``height`` frame: ((h, width, 4) uint8 RGBA overlay, its top row).

    White text on a half-transparent dark band near the bottom (or the top) of the frame, its letters
    ``size`` times the frame's height (at least 10 pixels), wrapped to 90% of the width; in the CJK font
    where the built-in one lacks the text's characters (see :func:`font_for`).
    """
    from PIL import Image, ImageDraw

    pixels = max(10, int(round(height * size)))
    font = font_for(text, pixels) or subtitle_font(pixels)
    lines = _wrap_words(text, font, width * 0.9) or [""]
    line_height = int(round(pixels * 1.25))
    padding = max(3, pixels // 4)
    band_height = min(height, line_height * len(lines) + 2 * padding)
    margin = max(2, height // 30)
    top = margin if position == "top" else max(0, height - band_height - margin)
    band = Image.new("RGBA", (width, band_height), (0, 0, 0, 140))
    draw = ImageDraw.Draw(band)
    for number, line in enumerate(lines):
        x = (width - font.getlength(line)) / 2
        draw.text((x, padding + number * line_height), line, font=font, fill=(255, 255, 255, 255),
                  stroke_width=max(1, pixels // 14), stroke_fill=(0, 0, 0, 255))
    return np.asarray(band), top


def burn_encode_args(width: int, height: int, fps_fraction: str, source_path: Path, output_path: Path,
                     crf: int = 18, preset: str = "veryfast") -> list[str]:
    """ffmpeg arguments that encode raw RGB frames from stdin with x264 and copy ``source_path``'s audio and
    metadata (a cloned voice's comment, say)."""
    return ["-nostdin", "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}",
            "-framerate", fps_fraction, "-i", "pipe:", "-i", str(source_path), "-map", "0:v:0", "-map", "1:a?",
            "-map_metadata", "1",
            "-c:v", "libx264", "-preset", preset, "-crf", str(crf), "-pix_fmt", "yuv420p", "-c:a", "copy",
            "-movflags", "+faststart", "-f", "mp4", str(output_path)]


def burn_decode_args(source_path: Path) -> list[str]:
    """ffmpeg arguments that decode ``source_path``'s video, frame for frame, to raw RGB on stdout.

    (No -fps_mode: ffmpeg before 5.1 lacks it, 8 and later lack -vsync; the video is heygem's own
    constant-rate output, which the default constant-rate output keeps frame for frame.)"""
    return ["-nostdin", "-v", "error", "-i", str(source_path), "-map", "0:v:0",
            "-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:"]


def burn_subtitles(video_path: Path, cues, crf: int = 18, preset: str = "veryfast", size: float = 0.045,
                   position: str = "bottom") -> None:
    """Draw ``cues`` (objects with start, end in seconds and text) into the frames of the MP4 ``video_path``.

    The video is decoded once, each frame whose time (index / fps) falls in a cue's [start, end) gets the
    cue's text (``size`` and ``position`` as :func:`render_subtitle` takes them), and the frames are encoded
    again with x264; the audio is copied. The file is replaced only when all went well. See
    :func:`font_for` for what can be drawn.
    """
    video_path = Path(video_path)
    info = probe(video_path)
    if info.kind != "video":
        raise HeygemError(f"{video_path.name} has no video to draw subtitles into")
    width, height, fps = info.width, info.height, info.fps
    overlays = [render_subtitle(cue.text, width, height, size, position) for cue in cues]
    frame_bytes = width * height * 3
    partial = video_path.with_name(f".{video_path.stem}.{os.getpid()}.{threading.get_ident()}.burned.mp4")
    with tempfile.TemporaryFile() as decode_errors, tempfile.TemporaryFile() as encode_errors:
        decoder = subprocess.Popen([ffmpeg_binary(), *burn_decode_args(video_path)], stdout=subprocess.PIPE,
                                   stderr=decode_errors, stdin=subprocess.DEVNULL)
        encoder = subprocess.Popen(
            [ffmpeg_binary(), *burn_encode_args(width, height, info.fps_fraction, video_path, partial, crf, preset)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=encode_errors)
        enlarge_pipe(decoder.stdout)
        frame = np.empty((height, width, 3), dtype=np.uint8)  # (H, W, 3) RGB
        index = 0
        try:
            while read_into(decoder.stdout, frame.reshape(-1)) == frame_bytes:
                seconds = index / fps
                for cue, (overlay, top) in zip(cues, overlays):
                    if cue.start <= seconds < cue.end:
                        region = frame[top:top + overlay.shape[0]]  # (h, W, 3)
                        alpha = overlay[:, :, 3:4].astype(np.float32) / 255.0  # (h, W, 1)
                        region[:] = (overlay[:, :, :3] * alpha + region * (1.0 - alpha) + 0.5).astype(np.uint8)
                encoder.stdin.write(frame.data)
                index += 1
            encoder.stdin.close()
            decoded, encoded = decoder.wait(), encoder.wait()
            if decoded != 0 or encoded != 0 or index == 0:
                errors = encode_errors if encoded != 0 else decode_errors
                errors.seek(0)
                lines = errors.read().decode(errors="replace").strip().splitlines()
                raise HeygemError(f"drawing the subtitles into {video_path.name} failed: "
                                  f"{lines[-1] if lines else 'ffmpeg made no frames'}")
            os.replace(partial, video_path)
        except BrokenPipeError:
            encode_errors.seek(0)
            lines = encode_errors.read().decode(errors="replace").strip().splitlines()
            raise HeygemError("drawing the subtitles failed: "
                              f"{lines[-1] if lines else 'the encoder stopped'}") from None
        finally:
            for process in (decoder, encoder):
                if process.poll() is None:
                    process.kill()
                    process.wait()
            if decoder.stdout:
                decoder.stdout.close()
            partial.unlink(missing_ok=True)


def add_subtitles(video_path: Path, srt_path: Path, cues, mode: str = "soft", crf: int = 18,
                  preset: str = "veryfast", size: float = 0.045, position: str = "bottom") -> str:
    """Give the MP4 ``video_path`` its subtitles by ``mode`` and return the mode used.

    "none": nothing; "soft": ``srt_path`` as a mov_text track; "burn": ``cues`` drawn into the frames
    (``size``: the letters' height as a fraction of the frame's, ``position``: "bottom" or "top"), in the
    built-in font or, for Chinese, Japanese and Korean, the CJK one; soft with one warning when neither font
    has a glyph for some of the text.
    """
    if mode not in SUBTITLE_MODES:
        raise HeygemError(f"subtitles must be one of {', '.join(SUBTITLE_MODES)}, not {mode!r}")
    if position not in SUBTITLE_POSITIONS:
        raise HeygemError(f"the subtitle position must be one of {', '.join(SUBTITLE_POSITIONS)}, not {position!r}")
    if mode == "burn":
        text = " ".join(cue.text for cue in cues)
        missing = [character for character in characters_missing_from_font(text)
                   if font_for(character) is None]
        if missing:
            logger.warning("subtitles are added as a soft track instead of burned in: no subtitle font can "
                           "draw %s", "".join(missing[:10]) + ("..." if len(missing) > 10 else ""))
            mode = "soft"
        else:
            burn_subtitles(video_path, cues, crf=crf, preset=preset, size=size, position=position)
    if mode == "soft":
        add_soft_subtitles(video_path, srt_path)
    return mode


@dataclass(frozen=True)
class Cue:
    start: float  # seconds from the start of the speech
    end: float  # seconds; end > start
    text: str  # the sentence spoken in [start, end)


def srt_timestamp(seconds: float) -> str:
    """1.5 -> "00:00:01,500" (HH:MM:SS,mmm); rounded down, so a cue never ends after the audio."""
    milliseconds = max(0, math.floor(seconds * 1000 + 1e-6))
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    secs, milliseconds = divmod(milliseconds, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d},{milliseconds:03d}"


def format_srt(cues: list[Cue]) -> str:
    blocks = []
    for number, cue in enumerate(cues, start=1):
        text = " ".join(cue.text.split())
        blocks.append(f"{number}\n{srt_timestamp(cue.start)} --> {srt_timestamp(cue.end)}\n{text}\n")
    return "\n".join(blocks)


def format_vtt(cues: list[Cue]) -> str:
    """WebVTT, as a browser's <track> takes it: one cue per sentence, times as SubRip's with a dot."""
    blocks = ["WEBVTT\n"]
    for cue in cues:
        text = " ".join(cue.text.split()).replace("-->", "->")
        blocks.append(f"{srt_timestamp(cue.start).replace(',', '.')} --> {srt_timestamp(cue.end).replace(',', '.')}\n"
                      f"{text}\n")
    return "\n".join(blocks)


def write_srt(cues: list[Cue], path: str | Path) -> Path:
    """SubRip subtitles, one numbered cue per sentence, UTF-8."""
    path = Path(path)
    path.write_text(format_srt(cues), encoding="utf-8")
    return path


_SRT_TIMING = re.compile(r"(\d+):(\d{2}):(\d{2})[,.](\d{3})\s*-->\s*(\d+):(\d{2}):(\d{2})[,.](\d{3})")


def read_srt(path: str | Path) -> list[Cue]:
    """The cues of a SubRip file (as ``write_srt`` writes them); lines of one cue are joined by a space.

    HeygemError when the file cannot be read or holds no timed cue."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        raise HeygemError(f"cannot read the subtitles {path.name}: {error}") from None
    cues: list[Cue] = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n").strip()):
        lines = block.splitlines()
        for index, line in enumerate(lines):
            timing = _SRT_TIMING.search(line)
            if timing:
                h1, m1, s1, ms1, h2, m2, s2, ms2 = (int(part) for part in timing.groups())
                start = h1 * 3600 + m1 * 60 + s1 + ms1 / 1000
                end = h2 * 3600 + m2 * 60 + s2 + ms2 / 1000
                words = " ".join(part.strip() for part in lines[index + 1:] if part.strip())
                if words and end > start:
                    cues.append(Cue(start=start, end=end, text=words))
                break
    if not cues:
        raise HeygemError(f"{path.name} holds no subtitle cues")
    return cues
