"""Step 7: encode the output frames to an H.264/AAC MP4, with one x264 or several at once.

ffmpeg only ever receives raw I420 (yuv420p) bytes on its stdin: it is the
format x264 encodes, half the bytes of BGR, and it spares ffmpeg's scaler
(one x264 at 1080p runs at about twice the frame rate fed I420 than fed bgr24).
Callers that hold BGR frames use :meth:`write`, which converts with OpenCV in
the encoder's own threads; callers that already have I420 use :meth:`write_i420`.

With one encoder, one ffmpeg reads the frames and the audio and writes the MP4
in one go. One x264 process does not keep up with a GPU at 1080p, so with
``encoders`` = N > 1 the output is cut into consecutive segments that are
encoded at the same time, then joined:

- each segment is encoded by its own ffmpeg into an MP4 of its own (video only)
  in a private folder next to the output; at most N of them run at once, and a
  segment's ffmpeg starts as soon as its first frame arrives, so frames of
  segment k+1 flow to their encoder while segment k's encoder is still busy;
- one last ffmpeg joins the segments with the concat demuxer without
  re-encoding (``-c:v copy``), adds the audio (copied when it is AAC, else
  encoded) and writes the MP4 with ``+faststart``.

Why MP4 segments: x264 makes B-frames (presets from veryfast on), so the
decoding and presentation order differ; an MP4 keeps each frame's exact
timestamp and duration, including the last frame's, in the stream's own time
base (1/30000 for 30000/1001 fps), so the joined stream has exactly the frames
written, evenly spaced, and lasts as long as a single encoder's output. Raw
H.264 has no timestamps and MPEG-TS drops the last frame's duration. Each
segment starts with its own key frame, which also makes the joined file easy
to seek. Segments are at least :data:`MIN_SEGMENT_SECONDS` long: shorter ones
would spend more on starting a process and on key frames than they save.

The alternative, N long-lived encoders fed round-robin chunks with forced key
frames and the segment muxer, saves process starts but needs the chunks
reordered at the end and every encoder's key frames forced from outside; one
process per segment is simpler to stop, clean up and reason about.

Key frames are forced at fixed frames (heygem.media.stream.key_frames) in every
case. With ``stream_dir``, each x264 also writes the same packets as HLS
segments through the ``tee`` muxer (heygem.media.stream), so the MP4 stays byte
for byte the one written without a stream.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from heygem.errors import HeygemError
from heygem.media.ffmpeg import enlarge_pipe, ffmpeg_binary, ffmpeg_message
from heygem.media.frames import bgr_to_yuv420
from heygem.media.stream import (
    STREAM_AUDIO_BITRATE,
    StreamContinuation,
    StreamPart,
    key_frame_expression,
    mark_complete,
    start_stream,
    tee_outputs,
)
from heygem.types import FrameGeometry, MediaInfo

logger = logging.getLogger("heygem")

MIN_SEGMENT_SECONDS = 2.0  # shorter segments are not worth a process and a key frame
MAX_SEGMENT_SECONDS = 10.0  # longer ones leave a long tail when the last segments finish
BUFFER_BYTES = 384 << 20  # I420 bytes that all segments together may hold waiting for their encoders
MAX_AUTOMATIC_ENCODERS = 8


# ---------------------------------------------------------------------------- planning


def encoder_count(requested: int, frame_count: int, fps: float, cpu_count: int | None = None) -> int:
    """How many x264 processes to run: ``requested``, or from the cores when it is 0.

    Automatic: one on up to 4 cores (x264 already uses every core of a small
    machine), else one per 5 cores (the other stages need cores too), at most
    :data:`MAX_AUTOMATIC_ENCODERS`.
    Never more than the video has segments of :data:`MIN_SEGMENT_SECONDS`.
    """
    if requested > 0:
        wanted = requested
    else:
        cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
        wanted = 1 if cores <= 4 else min(MAX_AUTOMATIC_ENCODERS, cores // 5)
    worth = int(frame_count / max(fps * MIN_SEGMENT_SECONDS, 1.0))
    return max(1, min(wanted, worth))


def segment_lengths(frame_count: int, encoders: int, fps: float, frame_bytes: int,
                    buffer_bytes: int = BUFFER_BYTES) -> list[int]:
    """Frames in each consecutive segment: as equal as possible, summing to ``frame_count``.

    A segment lasts from :data:`MIN_SEGMENT_SECONDS` to :data:`MAX_SEGMENT_SECONDS`,
    shorter when ``encoders`` segments of ``frame_bytes`` frames would not fit in
    ``buffer_bytes``, and no longer than needed to give every encoder one.
    """
    if encoders <= 1 or frame_count <= 1:
        return [frame_count]
    shortest = math.ceil(MIN_SEGMENT_SECONDS * fps)
    longest = min(round(MAX_SEGMENT_SECONDS * fps), buffer_bytes // (encoders * frame_bytes))
    length = max(shortest, min(longest, math.ceil(frame_count / encoders)))
    count = max(1, math.ceil(frame_count / length))
    base, extra = divmod(frame_count, count)
    return [base + 1] * extra + [base] * (count - extra)


# ---------------------------------------------------------------------------- ffmpeg arguments


def _raw_frames_input(geometry: FrameGeometry, fps_fraction: str):
    import ffmpeg

    return ffmpeg.input("pipe:", format="rawvideo", pix_fmt="yuv420p",
                        s=f"{geometry.width}x{geometry.height}", framerate=fps_fraction)


def _audio_options(audio_info: MediaInfo, audio_bitrate: str) -> dict[str, str]:
    return {"c:a": "copy"} if audio_info.audio_codec == "aac" else {"c:a": "aac", "b:a": audio_bitrate}


def encode_args(
    geometry: FrameGeometry,
    fps_fraction: str,
    audio_path: Path,
    audio_info: MediaInfo,
    output_path: Path,
    *,
    crf: int = 18,
    preset: str = "veryfast",
    audio_bitrate: str = "192k",
    stream: StreamPart | None = None,
    key_frame_offset: int = 0,
) -> list[str]:
    """ffmpeg arguments that read raw I420 frames on stdin and write an H.264/AAC MP4 with the audio;
    with ``stream``, the same packets also go to its HLS segments (ffmpeg runs in its folder).
    ``key_frame_offset``: the frame of a longer whole this file starts at (key frames fall where that
    whole has them)."""
    import ffmpeg

    sound = ffmpeg.input(str(Path(audio_path).resolve() if stream is not None else audio_path))["a:0"]
    video = {"c:v": "libx264", "pix_fmt": "yuv420p", "preset": preset, "crf": crf,
             "force_key_frames": key_frame_expression(_fps(fps_fraction), key_frame_offset)}
    if stream is None:
        target, muxer = str(output_path), {"movflags": "+faststart", "f": "mp4"}
    else:  # the tee muxer cannot tell x264 to put its headers out of band, as the MP4 muxer does
        target = tee_outputs(Path(output_path).resolve(), {"f": "mp4", "movflags": "+faststart"}, stream)
        muxer = {"flags:v": "+global_header", "f": "tee"}
    output = ffmpeg.output(_raw_frames_input(geometry, fps_fraction), sound, target,
                           **video, **muxer, **_audio_options(audio_info, audio_bitrate))
    return ["-nostdin", "-v", "error", "-y", *output.get_args()]


def _fps(fps_fraction: str) -> float:
    from fractions import Fraction

    return float(Fraction(fps_fraction))


def encoder_threads(encoders: int, cpu_count: int | None = None) -> int:
    """x264 threads for each of ``encoders`` processes running at once: their share of x264's own
    default (1.5 per core), at least 2. Every x264 thread holds frames of its own, so several
    encoders with the default each would hold several times the memory for no more speed."""
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(2, round(1.5 * cores / max(encoders, 1)))


def segment_args(geometry: FrameGeometry, fps_fraction: str, segment_path: Path, *,
                 crf: int = 18, preset: str = "veryfast", threads: int = 0, first_frame: int = 0,
                 stream: StreamPart | None = None, audio_path: Path | None = None,
                 key_frame_offset: int | None = None) -> list[str]:
    """ffmpeg arguments that read raw I420 frames on stdin and write one video-only H.264 MP4 segment
    (``threads`` x264 threads; 0: x264's default) that starts at the output's frame ``first_frame``.

    With ``stream`` the same packets also go to HLS segments, with the part of ``audio_path`` they
    cover encoded to AAC for them alone (the MP4 gets the whole audio when the segments are joined).
    ``key_frame_offset``: the frame of a longer whole that ``first_frame`` 0 is (key frames fall
    where that whole has them); default ``first_frame``.
    """
    import ffmpeg

    options = {"threads": threads} if threads else {}
    fps = _fps(fps_fraction)
    video = {"c:v": "libx264", "pix_fmt": "yuv420p", "preset": preset, "crf": crf,
             "force_key_frames": key_frame_expression(fps, first_frame if key_frame_offset is None
                                                      else key_frame_offset)}
    frames = _raw_frames_input(geometry, fps_fraction)
    if stream is None or audio_path is None:
        output = ffmpeg.output(frames, str(segment_path), **video, an=None, f="mp4", **options)
    else:
        sound = ffmpeg.input(str(Path(audio_path).resolve()), ss=f"{first_frame / fps:.6f}",
                             t=f"{stream.count / fps:.6f}")["a:0"]
        target = tee_outputs(Path(segment_path).resolve(), {"f": "mp4", "select": "v"}, stream)
        output = ffmpeg.output(frames, sound, target, **video, **options,
                               **{"flags:v": "+global_header", "c:a": "aac", "b:a": STREAM_AUDIO_BITRATE, "f": "tee"})
    return ["-nostdin", "-v", "error", "-y", *output.get_args()]


def join_args(list_path: Path, audio_path: Path, audio_info: MediaInfo, output_path: Path, *,
              audio_bitrate: str = "192k") -> list[str]:
    """ffmpeg arguments that join the segments named in ``list_path`` without re-encoding and add the audio."""
    import ffmpeg

    segments = ffmpeg.input(str(list_path), format="concat", safe=0)["v:0"]
    sound = ffmpeg.input(str(audio_path))["a:0"]
    output = ffmpeg.output(
        segments, sound, str(output_path),
        **{"c:v": "copy", "movflags": "+faststart", "f": "mp4"},
        **_audio_options(audio_info, audio_bitrate),
    )
    return ["-nostdin", "-v", "error", "-y", *output.get_args()]


def comment_args(input_path: Path, output_path: Path, comment: str) -> list[str]:
    """ffmpeg arguments that copy every stream of the MP4 ``input_path`` into ``output_path`` with
    ``comment`` in its metadata."""
    return ["-nostdin", "-v", "error", "-y", "-i", str(input_path), "-map", "0", "-c", "copy",
            "-metadata", f"comment={comment}", "-movflags", "+faststart", "-f", "mp4", str(output_path)]


def concat_list(segment_names: list[str]) -> str:
    """The concat demuxer's list of segment files, in order (names relative to the list's folder)."""
    lines = ["ffconcat version 1.0"]
    for name in segment_names:
        lines.append("file '" + name.replace("'", "'\\''") + "'")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- one ffmpeg process


class _FfmpegFeed:
    """One ffmpeg reading raw I420 frames on stdin, fed from a queue by its own thread.

    Items are (frames, is_bgr): BGR frames are converted to I420 in the thread.
    After each item ``on_written(frame count)`` is called (also for items dropped
    after ffmpeg failed), and ``on_finished()`` once ffmpeg has exited.
    """

    def __init__(self, args: list[str], name: str, queue_depth: int = 0,
                 on_written: Callable[[int], None] | None = None,
                 on_finished: Callable[[], None] | None = None, cwd: Path | None = None):
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen([ffmpeg_binary(), *args], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=self._stderr, cwd=cwd)
        enlarge_pipe(self.process.stdin)
        self.error: BaseException | None = None  # a failed write to ffmpeg's stdin
        self.finished = False  # ffmpeg has exited and the thread is done
        self._finish_sent = False
        self._outcome: str | None = None  # kept once the stderr file is closed
        self._queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._on_written = on_written
        self._on_finished = on_finished
        self._thread = threading.Thread(target=self._pump, name=name, daemon=True)
        self._thread.start()

    def put(self, frames: np.ndarray, is_bgr: bool) -> None:
        self._queue.put((frames, is_bgr))

    def finish(self) -> None:
        """No more frames: ffmpeg's stdin is closed once the queued frames are written."""
        if not self._finish_sent:
            self._finish_sent = True
            self._queue.put(None)

    def _pump(self) -> None:
        stdin = self.process.stdin
        while True:
            item = self._queue.get()
            if item is None:
                break
            frames, is_bgr = item
            if self.error is None:
                try:
                    if is_bgr:  # BGR -> I420 here, in parallel with the caller's next batch
                        for frame in frames:
                            stdin.write(bgr_to_yuv420(frame).data)
                    else:  # (N, H * 3/2, W) uint8 I420, written in one go
                        stdin.write(np.ascontiguousarray(frames).data)
                except (OSError, ValueError) as error:  # broken pipe: ffmpeg has died
                    self.error = error
            if self._on_written is not None:
                self._on_written(len(frames))
        try:
            stdin.close()
        except OSError:
            pass
        self.process.wait()
        self.finished = True
        if self._on_finished is not None:
            self._on_finished()

    def failure(self) -> str | None:
        """What went wrong so far (ffmpeg's last stderr line), or None while all is well."""
        return_code = self.process.poll()
        if self.error is None and return_code in (None, 0):
            return None
        if self._stderr.closed:
            return self._outcome
        if return_code is None:  # the pipe broke: ffmpeg is exiting
            try:
                return_code = self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                return_code = None
        return ffmpeg_message(self._stderr, return_code, self.error)

    def wait(self) -> str | None:
        """Wait for ffmpeg to finish; None when it succeeded, else what went wrong (one line)."""
        self.finish()
        self._thread.join()
        self.process.wait()
        self._outcome = self.failure()
        self._stderr.close()
        return self._outcome

    def kill(self) -> None:
        """Stop ffmpeg at once and wait for the thread (queued frames are dropped)."""
        if self.process.poll() is None:
            self.process.kill()
        if self._thread.is_alive():
            self.finish()
            self._thread.join(timeout=10)
        self.process.wait()
        if not self._stderr.closed:
            self._outcome = self.failure()
            self._stderr.close()


def run_ffmpeg_to_end(args: list[str]) -> str | None:
    """Run one ffmpeg (``args`` without the binary) to the end; None when it succeeded, else its last
    stderr line."""
    return _run_ffmpeg(args, lambda process: None)


def _run_ffmpeg(args: list[str], register: Callable[[subprocess.Popen], None]) -> str | None:
    """Run one ffmpeg to the end; None when it succeeded, else its last stderr line."""
    with tempfile.TemporaryFile() as stderr_file:
        process = subprocess.Popen([ffmpeg_binary(), *args], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=stderr_file)
        register(process)
        return_code = process.wait()
        return None if return_code == 0 else ffmpeg_message(stderr_file, return_code)


def _count_video_frames(path: Path) -> int:
    """Frames in the MP4's video stream, from its index (0 when it cannot be read)."""
    import av

    try:
        with av.open(str(path)) as container:
            return int(container.streams.video[0].frames)
    except (av.error.FFmpegError, OSError, IndexError):
        return 0


# ---------------------------------------------------------------------------- encoders


class VideoEncoder:
    """One ffmpeg writes the MP4, audio included; the file appears atomically on close.

    ``write``/``write_i420`` only queue the batch and return, letting frame
    generation and encoding overlap; the queue holds at most ``queue_depth``
    batches, so memory stays bounded. Arrays are not copied: do not change them
    after handing them over.
    """

    def __init__(self, args: list[str], partial_path: Path, output_path: Path, queue_depth: int = 2,
                 frame_count: int | None = None, stream: StreamPart | None = None, stream_last: bool = True):
        self.output_path = Path(output_path)
        self.partial_path = Path(partial_path)  # ``args`` write here; renamed to output_path on close
        self.frame_count = frame_count  # frames expected, checked on close when given
        self.frames_written = 0
        self.stream = stream  # the HLS segments ``args`` also write, or None
        self.stream_last = stream_last  # whether closing completes the stream (else a later part goes on)
        self.stream_processes = 1  # the stream's process numbers this encoder used
        self._feed = _FfmpegFeed(args, "heygem-encoder", queue_depth=queue_depth,
                                 cwd=stream.folder if stream is not None else None)

    @property
    def processes(self) -> list[subprocess.Popen]:
        """Every ffmpeg this encoder started (one)."""
        return [self._feed.process]

    def write_i420(self, planes: np.ndarray) -> None:
        """Queue (N, H * 3/2, W) uint8 I420 frames (Y rows, then U, then V); blocks while the queue is full.

        Raises HeygemError once ffmpeg has failed.
        """
        self._write(planes, is_bgr=False)

    def write(self, frames_bgr: np.ndarray) -> None:
        """Queue (N, H, W, 3) uint8 BGR frames, converted to I420 in the encoder's thread."""
        self._write(frames_bgr, is_bgr=True)

    def _write(self, frames: np.ndarray, is_bgr: bool) -> None:
        failure = self._feed.failure()
        if failure is not None:
            raise HeygemError(f"encoding the output failed: {failure}")
        self._feed.put(frames, is_bgr)
        self.frames_written += len(frames)

    def close(self) -> Path:
        """Finish encoding, check the file and move it into place; raises HeygemError on failure."""
        failure = self._feed.wait()
        if failure is None:
            written = _count_video_frames(self.partial_path)
            if written != self.frames_written:
                failure = f"the file has {written} frames instead of {self.frames_written}"
        if failure is not None:
            self.partial_path.unlink(missing_ok=True)
            raise HeygemError(f"encoding the output failed: {failure}")
        os.replace(self.partial_path, self.output_path)
        if self.stream is not None:
            self.stream.done_path.touch()
            if self.stream_last:
                mark_complete(self.stream.folder)
        return self.output_path

    def abort(self) -> None:
        """Stop ffmpeg and remove the partial file and the stream (on a full disk its segments would keep
        the room a failed job needs to be recorded)."""
        self._feed.kill()
        self.partial_path.unlink(missing_ok=True)
        if self.stream is not None:
            shutil.rmtree(self.stream.folder, ignore_errors=True)


class SegmentedEncoder:
    """Several ffmpeg processes encode consecutive segments at once; one more joins them with the audio.

    ``lengths`` gives the frames of each segment (the last one takes any extra
    frames). Memory: at most ``encoders`` segments are open at a time and all of
    them together hold at most ``max(encoders * longest segment, one batch)``
    frames waiting for ffmpeg (as the arrays handed over: I420, or BGR before
    conversion); ``write*`` blocks until there is room. Arrays are not copied:
    do not change them after handing them over.
    """

    def __init__(self, geometry: FrameGeometry, fps_fraction: str, audio_path: Path, audio_info: MediaInfo,
                 output_path: Path, lengths: list[int], *, encoders: int, crf: int, preset: str,
                 audio_bitrate: str, stream_dir: Path | None = None,
                 continuing: StreamContinuation | None = None):
        self.output_path = Path(output_path)
        self.work_dir = self.output_path.with_name(f".{self.output_path.stem}.{uuid.uuid4().hex}.parts")
        self.work_dir.mkdir(parents=True)
        self.frame_count = sum(lengths)
        self.frames_written = 0
        self._geometry, self._fps_fraction = geometry, fps_fraction
        self._audio_path, self._audio_info, self._audio_bitrate = Path(audio_path), audio_info, audio_bitrate
        self._crf, self._preset = crf, preset
        self._encoders = encoders
        self._ends = np.cumsum(lengths).tolist()  # first frame after each segment
        self._lengths = list(lengths)
        self.stream_dir = stream_dir  # each segment's ffmpeg also writes HLS segments here, when given
        self.continuing = continuing or StreamContinuation()  # this output's place in a longer stream
        self.stream_processes = len(lengths)  # the stream's process numbers this encoder uses
        self._max_buffered = encoders * max(lengths)
        self._segments: list[_FfmpegFeed] = []
        self._join_process: subprocess.Popen | None = None
        self._buffered = 0
        self._stopped = False
        self._changed = threading.Condition()

    @property
    def processes(self) -> list[subprocess.Popen]:
        """Every ffmpeg this encoder started so far: one per segment begun, then the join."""
        started = [segment.process for segment in self._segments]
        return started + ([self._join_process] if self._join_process is not None else [])

    def segment_path(self, index: int) -> Path:
        return self.work_dir / f"segment-{index:04d}.mp4"

    def write_i420(self, planes: np.ndarray) -> None:
        """Hand over (N, H * 3/2, W) uint8 I420 frames (Y rows, then U, then V); may block, see the class."""
        self._write(planes, is_bgr=False)

    def write(self, frames_bgr: np.ndarray) -> None:
        """Hand over (N, H, W, 3) uint8 BGR frames, converted to I420 in the encoders' threads."""
        self._write(frames_bgr, is_bgr=True)

    def _write(self, frames: np.ndarray, is_bgr: bool) -> None:
        offset = 0
        while offset < len(frames):
            self._raise_failure()
            index = len(self._segments) - 1
            last = len(self._ends) - 1
            if index < 0 or (index < last and self.frames_written >= self._ends[index]):
                index += 1
                self._start_segment(index)
            room = self._ends[index] - self.frames_written if index < last else len(frames)
            piece = frames[offset: offset + room]
            with self._changed:
                while not self._stopped and self._buffered and self._buffered + len(piece) > self._max_buffered:
                    self._changed.wait()
                self._buffered += len(piece)
            self._raise_failure()
            self._segments[index].put(piece, is_bgr)
            offset += len(piece)
            self.frames_written += len(piece)
            if index < last and self.frames_written == self._ends[index]:
                self._segments[index].finish()  # its ffmpeg finishes while the next segment fills

    def _raise_failure(self) -> None:
        if self._stopped:
            raise HeygemError("the encoder was stopped")
        for segment in self._segments:
            failure = segment.failure()
            if failure is not None:
                raise HeygemError(f"encoding the output failed: {failure}")

    def _start_segment(self, index: int) -> None:
        with self._changed:  # at most ``encoders`` segment processes at once
            while not self._stopped and sum(not s.finished for s in self._segments) >= self._encoders:
                self._changed.wait()
        self._raise_failure()
        first = self._ends[index] - self._lengths[index]
        stream = None
        place = self.continuing
        if self.stream_dir is not None:
            stream = StreamPart(self.stream_dir, place.first_index + index, place.first_frame + first,
                                self._lengths[index], _fps(self._fps_fraction))
        args = segment_args(self._geometry, self._fps_fraction, self.segment_path(index),
                            crf=self._crf, preset=self._preset, threads=encoder_threads(self._encoders),
                            first_frame=first, stream=stream, audio_path=self._audio_path,
                            key_frame_offset=place.first_frame + first)
        feed: list[_FfmpegFeed] = []

        def finished() -> None:
            if stream is not None and feed and feed[0].process.returncode == 0:
                stream.done_path.touch()  # its part of the stream is whole: the playlist goes on past it
            self._notify()

        feed.append(_FfmpegFeed(args, f"heygem-encoder-{index}", on_written=self._release,
                                on_finished=finished, cwd=self.stream_dir))
        self._segments.append(feed[0])

    def _release(self, frame_count: int) -> None:
        with self._changed:
            self._buffered -= frame_count
            self._changed.notify_all()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def close(self) -> Path:
        """Finish every segment, join them with the audio, check and move the MP4 into place.

        Raises HeygemError with ffmpeg's last message when any ffmpeg failed;
        nothing is left behind then.
        """
        try:
            if not self._segments:
                raise HeygemError("encoding the output failed: no frames were written")
            self._segments[-1].finish()
            failures = [failure for failure in (segment.wait() for segment in self._segments) if failure]
            if failures:
                raise HeygemError(f"encoding the output failed: {failures[0]}")
            list_path = self.work_dir / "segments.txt"
            list_path.write_text(concat_list([self.segment_path(i).name for i in range(len(self._segments))]),
                                 encoding="utf-8")
            joined_path = self.work_dir / "joined.mp4"
            args = join_args(list_path, self._audio_path, self._audio_info, joined_path,
                             audio_bitrate=self._audio_bitrate)
            failure = _run_ffmpeg(args, self._register_join)
            if failure is not None:
                raise HeygemError(f"joining the encoded segments failed: {failure}")
            written = _count_video_frames(joined_path)
            if written != self.frames_written:
                raise HeygemError(f"encoding the output failed: the file has {written} frames "
                                  f"instead of {self.frames_written}")
            os.replace(joined_path, self.output_path)
            if self.stream_dir is not None and self.continuing.last:
                mark_complete(self.stream_dir)
            logger.info("encoded %d frames in %d segments", self.frames_written, len(self._segments))
            return self.output_path
        finally:
            self._stop()

    def _register_join(self, process: subprocess.Popen) -> None:
        self._join_process = process
        if self._stopped:  # aborted from another thread meanwhile
            process.kill()

    def abort(self) -> None:
        """Stop every ffmpeg and remove every segment and partial file, and the stream."""
        self._stop()
        if self.stream_dir is not None:
            shutil.rmtree(self.stream_dir, ignore_errors=True)

    def _stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        for segment in self._segments:
            segment.kill()
        if self._join_process is not None and self._join_process.poll() is None:
            self._join_process.kill()
            self._join_process.wait()
        shutil.rmtree(self.work_dir, ignore_errors=True)



OUTPUT_SUFFIX = ".mp4"  # the container every output is written as (ffmpeg's -f mp4)


def check_output_name(output_path: Path) -> None:
    """HeygemError unless ``output_path`` ends in .mp4: the output is always an MP4, and another suffix
    (.avi, .mkv) would name MP4 bytes as something else."""
    suffix = Path(output_path).suffix
    if suffix.lower() != OUTPUT_SUFFIX:
        shown = f"ends in {suffix}" if suffix else "has no suffix"
        raise HeygemError(f"the output {Path(output_path).name} {shown}: heygem writes MP4 video, name it "
                          f"{Path(output_path).stem or 'output'}.mp4")


def open_encoder(geometry: FrameGeometry, fps_fraction: str, audio_path: Path, audio_info: MediaInfo,
                 output_path: Path, *, crf: int, preset: str, audio_bitrate: str, frame_count: int,
                 encoders: int = 1, stream_dir: Path | None = None,
                 continuing: StreamContinuation | None = None) -> VideoEncoder | SegmentedEncoder:
    """Start encoding ``frame_count`` frames into ``output_path`` with the audio of ``audio_path``.

    ``encoders``: x264 processes working on consecutive segments (0: from the
    cores, see :func:`encoder_count`); with one, a single ffmpeg writes the file.
    ``stream_dir``: also publish the frames there as HLS while they are encoded
    (heygem.media.stream); the MP4 is the same either way. ``continuing``: this output is a part of a
    longer stream (numbers, key frames and completion as that says); encoders report how many of the
    stream's process numbers they used (``stream_processes``).
    """
    continuing = continuing or StreamContinuation()
    if stream_dir is not None and continuing.first_index == 0:
        start_stream(Path(stream_dir))
    from fractions import Fraction

    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    fps = float(Fraction(fps_fraction))
    count = encoder_count(encoders, frame_count, fps)
    if count > 1:
        frame_bytes = geometry.width * geometry.height * 3 // 2
        lengths = segment_lengths(frame_count, count, fps, frame_bytes)
        logger.info("encoding with %d x264 processes over %d segments", count, len(lengths))
        return SegmentedEncoder(geometry, fps_fraction, audio_path, audio_info, output_path, lengths,
                                encoders=count, crf=crf, preset=preset, audio_bitrate=audio_bitrate,
                                stream_dir=stream_dir, continuing=continuing)
    partial_path = output_path.with_name(f".{output_path.stem}.{uuid.uuid4().hex}.partial.mp4")
    stream = None
    if stream_dir is not None:
        stream = StreamPart(Path(stream_dir), continuing.first_index, continuing.first_frame, frame_count, fps)
    args = encode_args(geometry, fps_fraction, audio_path, audio_info, partial_path, crf=crf, preset=preset,
                       audio_bitrate=audio_bitrate, stream=stream, key_frame_offset=continuing.first_frame)
    return VideoEncoder(args, partial_path, output_path, frame_count=frame_count, stream=stream,
                        stream_last=continuing.last)
