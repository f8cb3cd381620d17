"""Stage 1: probe and decode the inputs through ffmpeg (encoding the output is in heygem.encode).

ffmpeg is the system binary when one is on PATH, otherwise the one bundled in
the imageio-ffmpeg wheel, so ``pip install`` alone is enough. Arguments are
built by small pure functions (``*_args``) with ffmpeg-python and run without a
shell; frames travel through pipes in bounded batches, so memory does not grow
with the length of the video.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from heygem.errors import HeygemError
from heygem.types import FrameGeometry, MediaInfo

logger = logging.getLogger("heygem")

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"}
_IMAGE_FORMATS = {"image2", "png_pipe", "jpeg_pipe", "webp_pipe", "bmp_pipe", "tiff_pipe", "jpegls_pipe"}


@functools.lru_cache(maxsize=1)
def ffmpeg_binary() -> str:
    """The ffmpeg executable: the system one if present, else imageio-ffmpeg's bundled binary."""
    override = os.environ.get("HEYGEM_FFMPEG")
    if override:
        return override
    system = shutil.which("ffmpeg")
    if system:
        return system
    try:
        import imageio_ffmpeg
    except ImportError:
        imageio_ffmpeg = None
    for attempt in range(3 if imageio_ffmpeg is not None else 0):
        try:
            return imageio_ffmpeg.get_ffmpeg_exe()
        except RuntimeError:
            # imageio-ffmpeg remembers a failed look-up for the life of the process, even one that failed for a
            # passing reason (its check runs `ffmpeg -version`): forget it and look again before giving up
            lookup = getattr(getattr(imageio_ffmpeg, "_utils", None), "_get_ffmpeg_exe", None)
            if not hasattr(lookup, "cache_clear"):
                break
            lookup.cache_clear()
            logger.warning("the bundled ffmpeg did not answer; looking again (%d of 3)", attempt + 1)
            time.sleep(0.2 * (attempt + 1))
    raise HeygemError(
        "ffmpeg was not found: install it (apt install ffmpeg, brew install ffmpeg) "
        "or `pip install imageio-ffmpeg`, which bundles one"
    )


def ffmpeg_message(stderr_file, return_code: int | None, error: BaseException | None = None) -> str:
    """ffmpeg's last stderr line, or how it ended when it said nothing (killed, say)."""
    stderr_file.seek(0)
    lines = stderr_file.read().decode(errors="replace").strip().splitlines()
    if any("No space left on device" in line for line in lines):
        return "the disk holding the output is full (no space left on device): free some space and try again"
    if lines:
        return lines[-1]
    if return_code is not None and return_code < 0:
        return f"ffmpeg was stopped by signal {-return_code}"
    return str(error) if error is not None else f"ffmpeg exited with status {return_code}"



# ---------------------------------------------------------------------------- probing


def probe(path: str | Path) -> MediaInfo:
    """Describe a face or audio file: kind, display size (rotation applied), fps, audio stream."""
    import av

    path = Path(path)
    if not path.is_file():
        raise HeygemError(f"file not found: {path}")
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError, ValueError):
        raise HeygemError(f"{path.name} is not a media file heygem can read (expected a video, image or audio file)") from None
    with container:
        video = next((s for s in container.streams.video), None)
        audio = next((s for s in container.streams.audio), None)
        format_names = set(container.format.name.split(","))
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
        try:
            first_frame = next(container.decode(video))
            width, height = first_frame.width, first_frame.height
            rotation = int(getattr(first_frame, "rotation", 0) or 0)
            # decoded as it is stored, no scaler needed: 4:2:0 in limited range, not rotated
            plain_yuv420 = (first_frame.format.name == "yuv420p" and int(first_frame.color_range or 1) != 2
                            and rotation == 0)
        except (av.error.FFmpegError, StopIteration):
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


def probe_inputs(face_path: Path, audio_path: Path | None) -> tuple[MediaInfo, MediaInfo]:
    """Probe a face and its speech and refuse what cannot work; returns (face info, audio info).

    ``audio_path`` None (or the face's own path) means the face video's own sound.
    """
    face_info = probe(face_path)
    if face_info.kind == "audio":
        raise HeygemError(f"{Path(face_path).name} has no picture: the face must be a video or an image")
    if audio_path is None or Path(audio_path) == Path(face_path):
        if not face_info.has_audio:
            raise HeygemError(f"{Path(face_path).name} has no sound of its own: add an audio file")
        return face_info, face_info
    audio_info = probe(audio_path)
    if not audio_info.has_audio:
        raise HeygemError(f"{Path(audio_path).name} has no audio stream")
    return face_info, audio_info


def working_geometry(info: MediaInfo, output_height: int | None) -> FrameGeometry:
    """The frame size heygem works at: the display size made even, or scaled to ``output_height``."""
    if output_height:
        height = output_height - output_height % 2
        width = int(round(info.width * height / info.height / 2)) * 2
        return FrameGeometry(width=max(width, 2), height=max(height, 2))
    return FrameGeometry(width=info.width - info.width % 2, height=info.height - info.height % 2)


# ---------------------------------------------------------------------------- decoding


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
    same_size = (geometry.width, geometry.height) == (source.width - source.width % 2, source.height - source.height % 2)
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


def yuv420_to_bgr(planes: np.ndarray, width: int, height: int) -> np.ndarray:
    """One (H * 3/2, W) uint8 I420 frame to (H, W, 3) uint8 BGR (BT.601, limited range).

    The same conversion backwards is used when encoding, so pixels that heygem
    does not touch come out as they went in.
    """
    import cv2

    return cv2.cvtColor(planes.reshape(height * 3 // 2, width), cv2.COLOR_YUV2BGR_I420)


def bgr_to_yuv420(frame_bgr: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 BGR to one (H * 3/2, W) uint8 I420 frame; the inverse of :func:`yuv420_to_bgr`."""
    import cv2

    return cv2.cvtColor(frame_bgr, cv2.COLOR_BGR2YUV_I420)


def i420_planes(frame: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of the Y (H, W), U and V (H/2, W/2) planes of one (H * 3/2, W) I420 frame."""
    rows, width = frame.shape
    height = rows * 2 // 3
    flat = frame.reshape(-1)
    luma, chroma = height * width, height * width // 4
    return (flat[:luma].reshape(height, width), flat[luma:luma + chroma].reshape(height // 2, width // 2),
            flat[luma + chroma:].reshape(height // 2, width // 2))


def write_region_i420(frame_i420: np.ndarray, frame_bgr: np.ndarray, box: tuple[int, int, int, int]) -> None:
    """Convert the ``box`` region of ``frame_bgr`` (H, W, 3) back into ``frame_i420`` (H * 3/2, W) in place.

    The region is widened to even coordinates so that every 2x2 chroma block it touches is
    whole; the bytes written are those a conversion of the whole frame would give there.
    """
    height, width = frame_bgr.shape[:2]
    x1, y1, x2, y2 = box
    x1, y1 = max(0, x1 - x1 % 2), max(0, y1 - y1 % 2)
    x2, y2 = min(width, x2 + x2 % 2), min(height, y2 + y2 % 2)
    if x2 <= x1 or y2 <= y1:
        return
    region = bgr_to_yuv420(np.ascontiguousarray(frame_bgr[y1:y2, x1:x2]))  # ((y2-y1) * 3/2, x2-x1)
    for frame_plane, region_plane, scale in zip(i420_planes(frame_i420), i420_planes(region), (1, 2, 2)):
        frame_plane[y1 // scale: y2 // scale, x1 // scale: x2 // scale] = region_plane


def even_box(box: tuple[int, int, int, int], width: int, height: int) -> tuple[int, int, int, int]:
    """``box`` widened to even coordinates (whole 2x2 chroma blocks) and clipped to a ``width`` x ``height`` frame."""
    x1, y1, x2, y2 = box
    return (max(0, x1 - x1 % 2), max(0, y1 - y1 % 2), min(width, x2 + x2 % 2), min(height, y2 + y2 % 2))


def cut_i420_window(frame_i420: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    """A copy of the even-aligned ``box`` of one (H * 3/2, W) I420 frame, packed as its own
    ((y2 - y1) * 3/2, x2 - x1) I420 image: the box's Y rows, then its U and V half-size windows."""
    x1, y1, x2, y2 = _checked_even(box)
    window = np.empty(((y2 - y1) * 3 // 2, x2 - x1), dtype=np.uint8)
    for window_plane, frame_plane, scale in zip(i420_planes(window), i420_planes(frame_i420), (1, 2, 2)):
        window_plane[...] = frame_plane[y1 // scale: y2 // scale, x1 // scale: x2 // scale]
    return window


def paste_i420_window(frame_i420: np.ndarray, box: tuple[int, int, int, int], window_i420: np.ndarray) -> None:
    """Write a packed I420 ``window_i420`` (see cut_i420_window) into the even-aligned ``box`` of
    one (H * 3/2, W) I420 frame, in place: three plane slices."""
    x1, y1, x2, y2 = _checked_even(box)
    if window_i420.shape != ((y2 - y1) * 3 // 2, x2 - x1):
        raise ValueError(f"an I420 window of shape {window_i420.shape} does not fit the box {box}")
    for frame_plane, window_plane, scale in zip(i420_planes(frame_i420), i420_planes(window_i420), (1, 2, 2)):
        frame_plane[y1 // scale: y2 // scale, x1 // scale: x2 // scale] = window_plane


def _checked_even(box: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    if any(value % 2 for value in box) or box[2] <= box[0] or box[3] <= box[1]:
        raise ValueError(f"an I420 window needs a non-empty box with even coordinates, not {box}")
    return box


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
        count = _read_into(self.process.stdout, batch.reshape(-1)) // (geometry.width * geometry.height * 3 // 2)
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


class I420Frame:
    """One (H * 3/2, W) I420 frame that converts to BGR only what is looked at: a face tracker needs
    the whole frame for a detection but only the crop around the face for the mesh."""

    def __init__(self, planes: np.ndarray):
        self.planes = planes
        self.height, self.width = planes.shape[0] * 2 // 3, planes.shape[1]

    def bgr(self) -> np.ndarray:
        """The whole frame, (H, W, 3) uint8 BGR."""
        return yuv420_to_bgr(self.planes, self.width, self.height)

    def region(self, x1: int, y1: int, x2: int, y2: int, rgb: bool = False,
               size: tuple[int, int] | None = None) -> np.ndarray:
        """Pixels [y1:y2, x1:x2] as (y2-y1, x2-x1, 3) uint8 BGR (RGB if ``rgb``), or resampled to ``size``
        (width, height) as :func:`resample_region` does; only a resampled region may reach past the
        frame's edges (black there).

        Only whole 2x2 chroma blocks around the region are converted, so the pixels are those a
        conversion of the whole frame gives. A region that shrinks to half its size or less is
        halved in I420 first (each plane averaged over 2x2 blocks): the colour conversion then sees
        a quarter of the pixels.
        """
        import cv2

        code = cv2.COLOR_YUV2RGB_I420 if rgb else cv2.COLOR_YUV2BGR_I420
        if size is None and (x1, y1, x2, y2) == (0, 0, self.width, self.height):  # the whole frame: no block to cut
            return cv2.cvtColor(self.planes, code)
        halve = size is not None and x2 - x1 >= 2 * size[0] and y2 - y1 >= 2 * size[1]
        align = 4 if halve else 2  # a halved I420 block needs whole 4x4 blocks for its halved chroma
        block_x1, block_y1 = max(0, x1 - x1 % align), max(0, y1 - y1 % align)
        block_x2, block_y2 = min(self.width, x2 + (-x2) % align), min(self.height, y2 + (-y2) % align)
        if halve and ((block_x2 - block_x1) % 4 or (block_y2 - block_y1) % 4):  # at a frame edge not on 4
            halve = False
        pixel_size = 2 if halve else 1  # frame pixels per block pixel
        block = np.empty(((block_y2 - block_y1) // pixel_size * 3 // 2, (block_x2 - block_x1) // pixel_size),
                         dtype=np.uint8)
        for block_plane, frame_plane, plane_scale in zip(i420_planes(block), i420_planes(self.planes), (1, 2, 2)):
            source = frame_plane[block_y1 // plane_scale: block_y2 // plane_scale,
                                 block_x1 // plane_scale: block_x2 // plane_scale]
            if halve:  # bilinear sampling at exactly half the size averages each 2x2 block
                cv2.resize(source, block_plane.shape[::-1], dst=block_plane, interpolation=cv2.INTER_LINEAR)
            else:
                block_plane[:] = source
        pixels = cv2.cvtColor(block, code)
        if size is None:
            return pixels[y1 - block_y1: y2 - block_y1, x1 - block_x1: x2 - block_x1]
        return resample_region(pixels, (block_x1, block_y1), pixel_size, (x1, y1, x2, y2), size)


class BgrImage:
    """An (H, W, 3) uint8 BGR image behind the same two calls as :class:`I420Frame`."""

    def __init__(self, image_bgr: np.ndarray):
        self.image_bgr = image_bgr
        self.height, self.width = image_bgr.shape[:2]

    def bgr(self) -> np.ndarray:
        return self.image_bgr

    def region(self, x1: int, y1: int, x2: int, y2: int, rgb: bool = False,
               size: tuple[int, int] | None = None) -> np.ndarray:
        import cv2

        if size is None:
            pixels = self.image_bgr[y1:y2, x1:x2]
        else:  # from the block an I420 frame converts when it does not halve, so that both give the same
            block_x1, block_y1 = max(0, x1 - x1 % 2), max(0, y1 - y1 % 2)
            block = self.image_bgr[block_y1: min(self.height, y2 + y2 % 2), block_x1: min(self.width, x2 + x2 % 2)]
            pixels = resample_region(block, (block_x1, block_y1), 1, (x1, y1, x2, y2), size)
        return cv2.cvtColor(pixels, cv2.COLOR_BGR2RGB) if rgb else pixels


def resample_region(image: np.ndarray, origin: tuple[int, int], pixel_size: int, box: tuple[int, int, int, int],
                    size: tuple[int, int]) -> np.ndarray:
    """The part ``box`` (x1, y1, x2, y2 frame pixels) of ``image`` (H, W, C), resampled to ``size``
    (width, height) with the box's edges on the result's edges.

    ``image`` pixel (0, 0) starts at frame pixel ``origin`` and each of its pixels spans
    ``pixel_size`` frame pixels. While the result is half the image's resolution or less, the
    image is halved (2x2 blocks averaged); one bilinear warp then does the rest, which at less than
    2:1 still averages every pixel (as area averaging does, within a level, at a tenth of its
    cost), or a bicubic one when the result is larger. Result pixels whose centres lie past the
    image's edges are black (the warp itself repeats the edge pixels, so the pixels inside are
    those of a box within the image).
    """
    import cv2

    x1, y1, x2, y2 = box
    width, height = size
    step_x, step_y = (x2 - x1) / width, (y2 - y1) / height  # frame pixels per result pixel
    image_x2, image_y2 = origin[0] + image.shape[1] * pixel_size, origin[1] + image.shape[0] * pixel_size
    while step_x >= 2 * pixel_size and step_y >= 2 * pixel_size and min(image.shape[:2]) >= 2:
        even = image[: image.shape[0] // 2 * 2, : image.shape[1] // 2 * 2]
        image = cv2.resize(even, (even.shape[1] // 2, even.shape[0] // 2), interpolation=cv2.INTER_LINEAR)
        pixel_size *= 2
    # result pixel u's centre lies at frame x1 + (u + 0.5) * step_x, which is image pixel
    # (that - origin) / pixel_size - 0.5 (pixel centres at .5, as cv2 counts them)
    to_image = np.array([[step_x / pixel_size, 0, (x1 - origin[0] + 0.5 * step_x) / pixel_size - 0.5],
                         [0, step_y / pixel_size, (y1 - origin[1] + 0.5 * step_y) / pixel_size - 0.5]])
    interpolation = cv2.INTER_CUBIC if step_x < pixel_size or step_y < pixel_size else cv2.INTER_LINEAR
    result = cv2.warpAffine(image, to_image, (width, height), flags=interpolation | cv2.WARP_INVERSE_MAP,
                            borderMode=cv2.BORDER_REPLICATE)
    if x1 < origin[0] or y1 < origin[1] or x2 > image_x2 or y2 > image_y2:
        centres_x = x1 + (np.arange(width) + 0.5) * step_x
        centres_y = y1 + (np.arange(height) + 0.5) * step_y
        result[:, (centres_x < origin[0]) | (centres_x >= image_x2)] = 0
        result[(centres_y < origin[1]) | (centres_y >= image_y2)] = 0
    return result


Frame = np.ndarray | I420Frame | BgrImage  # (H, W, 3) uint8 BGR, or a frame converted where it is looked at


def as_frame(frame: Frame) -> I420Frame | BgrImage:
    """``frame`` behind the calls that face finding uses (``bgr()``, ``region()``): an array is a BGR image."""
    return BgrImage(frame) if isinstance(frame, np.ndarray) else frame


class I420Frames:
    """(N, H * 3/2, W) I420 frames seen as a sequence of :class:`I420Frame`: a face tracker converts
    one frame, or the part of it that it needs, at a time instead of its whole batch (at 1080p a
    batch of 21 frames is 130 MiB of BGR, and several trackers run at once)."""

    def __init__(self, planes: np.ndarray):
        self.planes = planes

    def __len__(self) -> int:
        return len(self.planes)

    def __getitem__(self, index: int) -> I420Frame:
        return I420Frame(self.planes[index])

    def __iter__(self) -> Iterator[I420Frame]:
        return (self[index] for index in range(len(self)))


def i420_batch_to_bgr(planes: np.ndarray) -> np.ndarray:
    """(N, H * 3/2, W) uint8 I420 frames to a new (N, H, W, 3) uint8 BGR array."""
    count, rows, width = planes.shape
    height = rows * 2 // 3
    frames = np.empty((count, height, width, 3), dtype=np.uint8)
    for index in range(count):
        frames[index] = yuv420_to_bgr(planes[index], width, height)
    return frames


def bgr_batch_to_i420(frames_bgr: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(N, H, W, 3) uint8 BGR frames to (N, H * 3/2, W) uint8 I420, written into ``out`` if given."""
    count, height, width = frames_bgr.shape[:3]
    if out is None:
        out = np.empty((count, height * 3 // 2, width), dtype=np.uint8)
    for index in range(count):
        out[index] = bgr_to_yuv420(frames_bgr[index])
    return out


PIPE_BYTES = 1 << 20  # a 1080p frame is 3 MiB: 64 KiB pipes cost ~50 wake-ups per frame each way


def enlarge_pipe(pipe) -> None:
    """Ask Linux for a 1 MiB pipe buffer (F_SETPIPE_SZ), so raw frames cross in few large steps.

    Elsewhere, or above the system's limit for an unprivileged user, the pipe stays as it is.
    """
    if not sys.platform.startswith("linux"):
        return
    import fcntl

    try:
        fcntl.fcntl(pipe.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:
        pass


def _read_into(stream, buffer: np.ndarray) -> int:
    """Fill ``buffer`` (a flat uint8 array) from ``stream`` until it is full or the stream ends; bytes read."""
    view = memoryview(buffer).cast("B")
    filled = 0
    while filled < len(view):
        count = stream.readinto(view[filled:])
        if not count:
            break
        filled += count
    return filled


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


def fps_to_fraction(fps: float) -> str:
    """A frame rate as an exact ffmpeg fraction: 29.97 -> 30000/1001, 25 -> 25/1."""
    rate = Fraction(fps).limit_denominator(1001)
    return f"{rate.numerator}/{rate.denominator}"


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


# ---------------------------------------------------------------------------- subtitles

SUBTITLE_MODES = ("none", "soft", "burn")


@functools.lru_cache(maxsize=8)
def subtitle_font(size: int):
    """Pillow's built-in scalable font (Pillow >= 10.1) at ``size`` pixels: no system font is needed."""
    from PIL import ImageFont

    return ImageFont.load_default(size)


def _glyph_signature(font, character: str) -> tuple:
    mask = font.getmask(character)
    return mask.size, bytes(mask)


def characters_missing_from_font(text: str, font=None) -> list[str]:
    """The characters of ``text`` that ``font`` (default: the subtitle font) has no glyph for, in order.

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


def _wrap_words(text: str, font, max_width: float) -> list[str]:
    """Break ``text`` into lines no wider than ``max_width`` pixels, at spaces (a longer word stays whole)."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        candidate = f"{current} {word}" if current else word
        if current and font.getlength(candidate) > max_width:
            lines.append(current)
            current = word
        else:
            current = candidate
    if current:
        lines.append(current)
    return lines


def render_subtitle(text: str, width: int, height: int) -> tuple[np.ndarray, int]:
    """One cue drawn for a ``width`` x ``height`` frame: ((h, width, 4) uint8 RGBA overlay, its top row).

    White text on a half-transparent dark band in the lower part of the frame; wrapped to 90% of the width.
    """
    from PIL import Image, ImageDraw

    size = max(12, int(round(height / 16)))
    font = subtitle_font(size)
    lines = _wrap_words(text, font, width * 0.9) or [""]
    line_height = int(round(size * 1.25))
    padding = max(4, size // 3)
    band_height = min(height, line_height * len(lines) + 2 * padding)
    top = max(0, height - band_height - max(2, height // 20))
    band = Image.new("RGBA", (width, band_height), (0, 0, 0, 140))
    draw = ImageDraw.Draw(band)
    for number, line in enumerate(lines):
        x = (width - font.getlength(line)) / 2
        draw.text((x, padding + number * line_height), line, font=font, fill=(255, 255, 255, 255),
                  stroke_width=max(1, size // 14), stroke_fill=(0, 0, 0, 255))
    return np.asarray(band), top


def burn_encode_args(width: int, height: int, fps_fraction: str, source_path: Path, output_path: Path,
                     crf: int = 18, preset: str = "veryfast") -> list[str]:
    """ffmpeg arguments that encode raw RGB frames from stdin with x264 and copy ``source_path``'s audio."""
    return ["-nostdin", "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}",
            "-framerate", fps_fraction, "-i", "pipe:", "-i", str(source_path), "-map", "0:v:0", "-map", "1:a?",
            "-c:v", "libx264", "-preset", preset, "-crf", str(crf), "-pix_fmt", "yuv420p", "-c:a", "copy",
            "-movflags", "+faststart", "-f", "mp4", str(output_path)]


def burn_decode_args(source_path: Path) -> list[str]:
    """ffmpeg arguments that decode ``source_path``'s video, frame for frame, to raw RGB on stdout.

    (No -fps_mode: ffmpeg before 5.1 lacks it, 8 and later lack -vsync; the video is heygem's own
    constant-rate output, which the default constant-rate output keeps frame for frame.)"""
    return ["-nostdin", "-v", "error", "-i", str(source_path), "-map", "0:v:0",
            "-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:"]


def burn_subtitles(video_path: Path, cues, crf: int = 18, preset: str = "veryfast") -> None:
    """Draw ``cues`` (objects with start, end in seconds and text) into the frames of the MP4 ``video_path``.

    The video is decoded once, each frame whose time (index / fps) falls in a cue's [start, end) gets the
    cue's text in its lower part, and the frames are encoded again with x264; the audio is copied. The
    file is replaced only when all went well. See ``characters_missing_from_font`` for what can be drawn.
    """
    video_path = Path(video_path)
    info = probe(video_path)
    if info.kind != "video":
        raise HeygemError(f"{video_path.name} has no video to draw subtitles into")
    width, height, fps = info.width, info.height, info.fps
    overlays = [render_subtitle(cue.text, width, height) for cue in cues]
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
            while _read_into(decoder.stdout, frame.reshape(-1)) == frame_bytes:
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
            raise HeygemError(f"drawing the subtitles failed: {lines[-1] if lines else 'the encoder stopped'}") from None
        finally:
            for process in (decoder, encoder):
                if process.poll() is None:
                    process.kill()
                    process.wait()
            if decoder.stdout:
                decoder.stdout.close()
            partial.unlink(missing_ok=True)


def add_subtitles(video_path: Path, srt_path: Path, cues, mode: str = "soft", crf: int = 18,
                  preset: str = "veryfast") -> str:
    """Give the MP4 ``video_path`` its subtitles by ``mode`` and return the mode used.

    "none": nothing; "soft": ``srt_path`` as a mov_text track; "burn": ``cues`` drawn into the frames, or
    soft with one warning when the font has no glyph for some of the text (Chinese, say).
    """
    if mode not in SUBTITLE_MODES:
        raise HeygemError(f"subtitles must be one of {', '.join(SUBTITLE_MODES)}, not {mode!r}")
    if mode == "burn":
        missing = characters_missing_from_font(" ".join(cue.text for cue in cues))
        if missing:
            logger.warning("subtitles are added as a soft track instead of burned in: the built-in font cannot "
                           "draw %s", "".join(missing[:10]) + ("..." if len(missing) > 10 else ""))
            mode = "soft"
        else:
            burn_subtitles(video_path, cues, crf=crf, preset=preset)
    if mode == "soft":
        add_soft_subtitles(video_path, srt_path)
    return mode
