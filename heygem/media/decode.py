"""Step 4: decode the face input: a video as bounded batches of raw I420 frames through ffmpeg's
pipe (several ffmpeg processes sharing the work on larger machines), a still image as one frame,
and the raw frame file a video shorter than the speech plays back and forth from.

Frames travel through pipes in bounded batches, so memory does not grow with the video's length.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heygem.errors import HeygemError
from heygem.media.ffmpeg import enlarge_pipe, ffmpeg_binary, ffmpeg_message, read_into
from heygem.media.frames import i420_batch_to_bgr
from heygem.types import FrameGeometry, MediaInfo


def video_decode_args(path: Path, fps_fraction: str, geometry: FrameGeometry, source: MediaInfo,
                      share: DecoderShare | None = None) -> list[str]:
    """ffmpeg arguments that decode ``path`` to raw I420 frames of ``geometry`` at a constant rate.

    With a ``share``, only that decoder's chunks of frames reach the pipe (see DecoderShare).
    """
    import ffmpeg

    # shared decoders each decode the whole video: their share of the cores each, not all of them
    threads = {"threads": max(2, (os.cpu_count() or 1) // share.count)} if share is not None else {}
    stream = ffmpeg.input(str(path), **threads).video.filter("fps", fps=fps_fraction)
    if share is not None:  # picked right after the rate is made constant: frame n is the same n for every share
        stream = stream.filter("select", f"eq(mod(floor(n/{share.chunk_frames}),{share.count}),{share.index})")
        # the frames kept, retimed back to back: a constant-rate output then neither repeats nor drops any
        stream = stream.filter("setpts", "N/FRAME_RATE/TB")
    same_size = (geometry.width, geometry.height) == (source.width - source.width % 2,
                                                      source.height - source.height % 2)
    if same_size and source.plain_yuv420:  # the decoder's own frames: no scaler (~5x faster at 1080p)
        if (geometry.width, geometry.height) != (source.width, source.height):
            stream = stream.filter("crop", geometry.width, geometry.height, 0, 0)
    elif same_size:
        stream = stream.filter("crop", geometry.width, geometry.height, 0, 0).filter("scale", out_range="tv")
    else:
        stream = stream.filter("scale", geometry.width, geometry.height, flags="area", out_range="tv")
    # limited ("tv") range on the pipe whatever the input's range: full-range (JPEG-style) videos
    # would otherwise reach yuv420_to_bgr with the wrong black and white levels
    # raw yuv420p on the pipe: half the bytes of BGR, and OpenCV converts it several times
    # faster than ffmpeg's scaler does (and rounds exactly, see yuv420_to_bgr)
    output = stream.output("pipe:", format="rawvideo", pix_fmt="yuv420p")
    return ["-nostdin", "-v", "error", *output.get_args()]


@dataclass(frozen=True)
class DecoderShare:
    """One of ``count`` decoders of the same video: frames are dealt out in chunks of
    ``chunk_frames``, chunk c to decoder c % count, and this is decoder ``index``.

    Every decoder decodes the whole video (cheap: ~1,300 1080p frames/s per process) but only
    its chunks cross its pipe, and a pipe is what limits one decoder (~450 1080p frames/s
    into Python); the reader takes the chunks back in turn, so the frames arrive in order.
    """

    index: int
    count: int
    chunk_frames: int


MAX_AUTOMATIC_DECODERS = 3
CORES_PER_DECODER = 5  # cores a machine needs per automatic decoder (the other stages need them too)
SHARED_DECODE_PIXELS = 1280 * 720  # smaller frames cross one pipe fast enough


def decoder_count(requested: int, geometry: FrameGeometry, cpu_count: int | None = None) -> int:
    """How many ffmpeg processes decode the face video together: ``requested``, or when it is 0
    one per :data:`CORES_PER_DECODER` cores (at most :data:`MAX_AUTOMATIC_DECODERS`) for frames of
    at least 720p, else one."""
    if requested > 0:
        return requested
    if geometry.width * geometry.height < SHARED_DECODE_PIXELS:
        return 1
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(MAX_AUTOMATIC_DECODERS, cores // CORES_PER_DECODER))


class _Decoder:
    """One ffmpeg process decoding to its stdout, its messages kept in a temporary file."""

    def __init__(self, info: MediaInfo, args: list[str]):
        self.info = info
        self.ended = False  # its output ended (a short read): it exits by itself, with its own status
        self.killed = False  # stopped by kill() before its output ended: an early stop, not an error
        self.stderr_file = tempfile.TemporaryFile()
        self.process = subprocess.Popen([ffmpeg_binary(), *args], stdout=subprocess.PIPE, stderr=self.stderr_file,
                                        stdin=subprocess.DEVNULL)
        enlarge_pipe(self.process.stdout)

    def read_batch(self, batch_frames: int, geometry: FrameGeometry) -> np.ndarray:
        """The next (N <= batch_frames, H * 3/2, W) frames; N is below batch_frames only at the end."""
        batch = np.empty((batch_frames, geometry.height * 3 // 2, geometry.width), dtype=np.uint8)
        count = read_into(self.process.stdout, batch.reshape(-1)) // (geometry.width * geometry.height * 3 // 2)
        if count < batch_frames:
            self.ended = True
        return batch[:count]

    def batches(self, batch_frames: int, geometry: FrameGeometry) -> Iterator[np.ndarray]:
        """read_batch until the output ends: full batches, then the last one if it has frames."""
        while not self.ended:
            batch = self.read_batch(batch_frames, geometry)
            if len(batch):
                yield batch

    def kill(self) -> None:
        """Stop the process before its output ended (its frames are not needed any more)."""
        if not self.ended and self.process.returncode is None:
            self.killed = True
            self.process.kill()

    def finish(self) -> None:
        """Stop the process (killed if its output had not ended) and raise HeygemError if it failed.

        A process whose output ended must exit with 0: one stopped by a signal then was killed
        by someone else (the out-of-memory killer, say), and its frames stopped short of the video's end.
        """
        try:
            self.kill()
            self.process.stdout.close()
            return_code = self.process.wait()
            if return_code != 0 and not self.killed:
                raise HeygemError(f"could not decode {self.info.path.name}: "
                                  f"{ffmpeg_message(self.stderr_file, return_code)}")
        finally:
            self.stderr_file.close()


def iter_video_i420(info: MediaInfo, geometry: FrameGeometry, batch_frames: int,
                    decoders: int = 1) -> Iterator[np.ndarray]:
    """Decode a video as (N, H * 3/2, W) uint8 I420 batches of at most ``batch_frames`` frames.

    Each frame is its Y plane's H rows followed by U and V (H/4 rows each), as OpenCV's
    COLOR_BGR2YUV_I420 lays them out; the arrays are new and writable. With ``decoders``
    above 1, that many ffmpeg processes share the work (DecoderShare): the same frames,
    in the same batches.
    """
    if decoders > 1:
        yield from _iter_shared(info, geometry, batch_frames, decoders)
        return
    decoder = _Decoder(info, video_decode_args(info.path, info.fps_fraction, geometry, info))
    try:
        yield from decoder.batches(batch_frames, geometry)
    finally:
        decoder.finish()


_END = object()  # a decoder's pipe is exhausted
# batches each of several decoders may hold at once, the one it is reading included: one is enough,
# since together they read faster than the stages take batches (three carried about 600 1080p
# frames/s into Python on the GPU machine) and the batch handed on waits in a queue anyway
DECODER_BATCHES = 1


def _iter_shared(info: MediaInfo, geometry: FrameGeometry, batch_frames: int, count: int) -> Iterator[np.ndarray]:
    """iter_video_i420 over ``count`` decoders, each read by its own thread, at most
    :data:`DECODER_BATCHES` batches each in hand (the one it reads included)."""
    import queue

    decoders = [_Decoder(info, video_decode_args(info.path, info.fps_fraction, geometry, info,
                                                 DecoderShare(index, count, batch_frames)))
                for index in range(count)]
    queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in decoders]
    slots = [threading.Semaphore(DECODER_BATCHES) for _ in decoders]  # given back when a batch is taken
    stopping = threading.Event()

    def free_slot(slot: threading.Semaphore) -> bool:
        """Wait until ``slot`` has room for one more batch; False once the reading stops."""
        while not slot.acquire(timeout=0.1):
            if stopping.is_set():
                return False
        return not stopping.is_set()

    def read(decoder: _Decoder, target: queue.SimpleQueue, slot: threading.Semaphore) -> None:
        try:
            batches = decoder.batches(batch_frames, geometry)
            while free_slot(slot):  # a batch is read only once there is room for it
                batch = next(batches, None)
                if batch is None:
                    target.put(_END)  # its exit status is read by finish(), in the reading thread only
                    return
                target.put(batch)
        except BaseException as error:  # noqa: BLE001 - handed to the reading thread
            target.put(error)

    threads = [threading.Thread(target=read, args=(decoder, target, slot), name=f"decode-{index}", daemon=True)
               for index, (decoder, target, slot) in enumerate(zip(decoders, queues, slots))]
    for thread in threads:
        thread.start()
    try:
        chunk = 0
        while True:
            item = queues[chunk % count].get()
            slots[chunk % count].release()
            if item is _END:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
            if len(item) < batch_frames:
                break
            chunk += 1
    finally:
        stopping.set()
        for decoder in decoders:
            decoder.kill()
        for thread in threads:
            thread.join()
        failures = []
        for decoder in decoders:
            try:
                decoder.finish()
            except HeygemError as error:
                failures.append(error)
        if failures and sys.exc_info()[0] is None:
            raise failures[0]


def iter_video_batches(info: MediaInfo, geometry: FrameGeometry, batch_frames: int) -> Iterator[np.ndarray]:
    """Decode a video as (N, H, W, 3) uint8 BGR batches of at most ``batch_frames`` frames."""
    for planes in iter_video_i420(info, geometry, batch_frames):
        yield i420_batch_to_bgr(planes)


def load_image(info: MediaInfo, geometry: FrameGeometry) -> np.ndarray:
    """Read a still image as (H, W, 3) uint8 BGR: EXIF orientation applied, grey expanded,
    alpha composited over white, 16-bit reduced to 8-bit."""
    import cv2

    raw = np.fromfile(str(info.path), dtype=np.uint8)
    image = cv2.imdecode(raw, cv2.IMREAD_COLOR)  # applies EXIF orientation
    if image is None:
        raise HeygemError(f"{info.path.name} is not an image heygem can read")
    unchanged = cv2.imdecode(raw, cv2.IMREAD_UNCHANGED)
    if unchanged is not None and unchanged.ndim == 3 and unchanged.shape[2] == 4 \
            and unchanged.shape[:2] == image.shape[:2]:
        alpha = unchanged[:, :, 3:4].astype(np.float32)
        alpha /= 65535.0 if unchanged.dtype == np.uint16 else 255.0
        image = (image.astype(np.float32) * alpha + 255.0 * (1.0 - alpha)).round().astype(np.uint8)
    height, width = image.shape[:2]
    if (width, height) == (geometry.width + width % 2, geometry.height + height % 2):
        return np.ascontiguousarray(image[: geometry.height, : geometry.width])
    return cv2.resize(image, (geometry.width, geometry.height), interpolation=cv2.INTER_AREA)


class FrameFile:
    """Frames kept on disk as raw I420, read back in any order.

    Used when a video has to play backward. Reads go through ``os.pread`` rather
    than a memory map, so the process's resident memory does not grow with the
    number of frames; the file is half the size of BGR frames.
    """

    def __init__(self, path: Path, geometry: FrameGeometry):
        self.path = Path(path)
        self.width, self.height = geometry.width, geometry.height
        self.frame_bytes = self.width * self.height * 3 // 2
        self.count = 0
        self._file = open(self.path, "w+b")

    def append(self, frames_i420: np.ndarray) -> None:
        """Add (N, H * 3/2, W) uint8 I420 frames at the end."""
        self._file.write(np.ascontiguousarray(frames_i420).data)
        self.count += len(frames_i420)

    def read(self, indices: np.ndarray) -> np.ndarray:
        """Frames ``indices`` (N,) as a new (N, H * 3/2, W) uint8 I420 array."""
        self._file.flush()
        descriptor = self._file.fileno()
        frames = np.empty((len(indices), self.height * 3 // 2, self.width), dtype=np.uint8)
        for slot, index in enumerate(indices):
            frames[slot].reshape(-1)[:] = np.frombuffer(
                os.pread(descriptor, self.frame_bytes, int(index) * self.frame_bytes), dtype=np.uint8)
        return frames

    def close(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)
