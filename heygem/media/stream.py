"""Step 7, watched as it happens: the encoded frames published as HLS while the MP4 is written.

No frame is encoded twice. The x264 that writes the MP4 (or each of the x264 processes that write
consecutive parts of it) writes through ffmpeg's ``tee`` muxer to two places at once: the MP4 and
the ``segment`` muxer, which cuts the same H.264 packets, with AAC audio, into MPEG-TS files.

- Key frames are forced at the same frames whether anyone watches or not (:func:`key_frames`:
  0, 0.5 s, 2 s, then every 4 s), so the MP4 is byte for byte the one written without a stream,
  and the first segment, half a second long, is out as soon as half a second is encoded. Few
  early key frames: each one re-codes still parts of the picture, which then shimmer a little.
- The stream lives in a folder beside the output (:func:`stream_folder`): for each x264 process
  ``k``, its segments ``kkkk-nnnnn.ts``, the list ffmpeg appends a line to as each one is
  complete (``kkkk.csv``), and ``kkkk.done`` once that process has finished; ``complete`` once
  the MP4 is in place.
- The playlist is made from those lists when it is asked for (:func:`playlist`), in order, up to
  the first process still running, so a client never sees a segment that is still being written.
  It is an ``EVENT`` playlist, closed with ``#EXT-X-ENDLIST`` once the stream is complete.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

FIRST_KEY_SECONDS = (0.0, 0.5, 2.0)  # a short first segment: the first frame shows fast
PERIOD_SECONDS = 4.0  # then one key frame, and one segment, every 4 s
TARGET_DURATION = 4  # the playlist's EXT-X-TARGETDURATION: no segment is longer than the period
STREAM_AUDIO_BITRATE = "128k"  # the stream's AAC where x264 processes cut the audio each for its part
SEGMENT_NAME = re.compile(r"[0-9]{4}-[0-9]{5}\.ts")  # the only names a segment can have
COMPLETE_NAME = "complete"
TS_PACKET_BYTES = 188


def stream_folder(output_path: Path) -> Path:
    """Where the stream of ``output_path`` is written: ``result.mp4`` -> ``result.hls/`` beside it."""
    output_path = Path(output_path)
    return output_path.with_name(f"{output_path.stem}.hls")


def key_frames(frame_count: int, fps: float) -> list[int]:
    """The frames, counted from 0, that are key frames (and start a segment), up to ``frame_count``."""
    frames = [math.ceil(seconds * fps - 1e-6) for seconds in FIRST_KEY_SECONDS]
    period = max(1, round(PERIOD_SECONDS * fps))
    while frames[-1] + period < frame_count:
        frames.append(frames[-1] + period)
    return sorted({frame for frame in frames if frame < frame_count} | {0})


def key_frame_expression(fps: float, offset: int = 0) -> str:
    """``-force_key_frames`` for an x264 whose frame ``n`` is the output's frame ``n + offset``."""
    frame = f"(n+{offset})" if offset else "n"
    first = [math.ceil(seconds * fps - 1e-6) for seconds in FIRST_KEY_SECONDS]
    period = max(1, round(PERIOD_SECONDS * fps))
    terms = [f"eq({frame},{value})" for value in first[:-1]]
    terms.append(f"gte({frame},{first[-1]})*not(mod({frame}-{first[-1]},{period}))")
    return "expr:" + "+".join(terms)


def _escape(text: str, specials: str) -> str:
    return "".join("\\" + character if character in specials or character == "\\" else character
                   for character in text)


def tee_outputs(mp4_path: Path, mp4_options: dict[str, str], stream: StreamPart | None) -> str:
    """The ``tee`` muxer's output: the MP4, and the stream's segments when ``stream`` is given.

    File names are escaped for the muxer; the stream's own names are relative to ffmpeg's working
    folder, the stream folder, so that no option value needs escaping.
    """
    mp4 = "[" + ":".join(f"{key}={value}" for key, value in mp4_options.items()) + "]" + str(mp4_path)
    slaves = [_escape(mp4, "|' ")]
    if stream is not None:
        slaves.append(_escape(stream.segment_slave(), "|' "))
    return "|".join(slaves)


@dataclass(frozen=True)
class StreamPart:
    """What one x264 process publishes: frames ``first`` to ``first + count`` of the output."""

    folder: Path
    index: int  # which process, counted from 0
    first: int  # the output's frame this process starts with
    count: int  # frames it encodes
    fps: float

    @property
    def list_name(self) -> str:
        return f"{self.index:04d}.csv"

    @property
    def done_path(self) -> Path:
        return self.folder / f"{self.index:04d}.done"

    def cut_frames(self) -> list[int]:
        """Where its segments after the first begin, counted from its own first frame."""
        ends = [frame - self.first for frame in key_frames(self.first + self.count, self.fps)
                if self.first < frame < self.first + self.count]
        return ends or [self.count + 1]  # one segment: the muxer needs a cut, past the end

    def segment_slave(self) -> str:
        options = {"f": "segment", "segment_format": "mpegts", "segment_list": self.list_name,
                   "segment_list_type": "csv", "segment_frames": ",".join(map(str, self.cut_frames()))}
        if self.first:
            options["output_ts_offset"] = f"{self.first / self.fps:.6f}"
        return "[" + ":".join(f"{key}={value}" for key, value in options.items()) + "]" + \
            f"{self.index:04d}-%05d.ts"


@dataclass(frozen=True)
class StreamContinuation:
    """Where an encoder's part of a longer stream goes, when the output is made in consecutive parts
    (speech synthesised sentence by sentence, heygem.spoken): its x264 processes are numbered from
    ``first_index`` and its frames from ``first_frame`` of the whole; only the ``last`` part marks the
    stream complete, and only the first starts it afresh. ``folder``: the whole's stream folder
    (None: the one beside the output being written). ``turns``: where the face video turns back and
    forward again as the first part chose them (its summary's ``turns``), so that every part plays the
    same way; None: at its last and first frames."""

    first_index: int = 0
    first_frame: int = 0
    last: bool = True
    folder: Path | None = None
    turns: tuple[int, int] | None = None


def start_stream(folder: Path) -> Path:
    """An empty stream folder (what an earlier attempt left is removed)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def mark_complete(folder: Path) -> None:
    (folder / COMPLETE_NAME).touch()


@dataclass(frozen=True)
class Segment:
    name: str
    seconds: float


def listed_segments(folder: Path) -> list[Segment]:
    """The finished segments, in order: every process's list up to the first process still running."""
    segments: list[Segment] = []
    index = 0
    previous_end = None  # times run on across the processes (each but the first starts at an offset)
    while True:
        list_path = folder / f"{index:04d}.csv"
        done = (folder / f"{index:04d}.done").is_file()  # looked at first: its list is whole then
        try:
            lines = list_path.read_text(encoding="utf-8").splitlines()
        except OSError:
            return segments
        for line in lines:
            name, _, times = line.partition(",")
            start_text, _, end_text = times.partition(",")
            try:
                start, end = float(start_text), float(end_text)
            except ValueError:  # a line being written
                break
            if not SEGMENT_NAME.fullmatch(name):
                break
            if not done and not _whole(folder / name):
                break
            begin = start if previous_end is None else previous_end
            segments.append(Segment(name, max(end - begin, 0.001)))
            previous_end = end
        if not done:
            return segments
        index += 1


def _whole(path: Path) -> bool:
    """A listed segment is closed right after its line is written: a whole number of TS packets."""
    try:
        size = path.stat().st_size
    except OSError:
        return False
    return size > 0 and size % TS_PACKET_BYTES == 0


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_NAME).is_file()


def playlist(folder: Path, ended: bool = False, prefix: str = "") -> str | None:
    """The HLS playlist of the stream in ``folder``, or None while no segment is finished.

    ``ended``: close it even when the stream is not complete (its job failed or was cancelled).
    ``prefix`` goes before each segment's name (the URL path the segments are served under).
    """
    segments = listed_segments(folder)
    if not segments:
        return None
    lines = ["#EXTM3U", "#EXT-X-VERSION:3", f"#EXT-X-TARGETDURATION:{TARGET_DURATION}",
             "#EXT-X-MEDIA-SEQUENCE:0", "#EXT-X-PLAYLIST-TYPE:EVENT", "#EXT-X-INDEPENDENT-SEGMENTS",
             "#EXT-X-START:TIME-OFFSET=0,PRECISE=YES"]  # watched from the start, not from the live edge
    for segment in segments:
        lines += [f"#EXTINF:{segment.seconds:.3f},", prefix + segment.name]
    if ended or is_complete(folder):
        lines.append("#EXT-X-ENDLIST")
    return "\n".join(lines) + "\n"


def segment_path(folder: Path, name: str) -> Path | None:
    """The file of a listed segment called ``name``; None for any other name (no path leaves the folder)."""
    if not SEGMENT_NAME.fullmatch(name):
        return None
    if not any(segment.name == name for segment in listed_segments(folder)):
        return None
    return folder / name
