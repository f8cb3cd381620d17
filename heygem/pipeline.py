"""The whole generation: a face (video or photo) plus speech in, a lip-synced MP4 out.

    1. probe the inputs and settle the output's size, rate and length
    2. decode the audio and compute one Wav2Lip mel window per output frame
    3. choose the lip-sync engine (wav2lip when its weights are present, else landmark)
    4. find the face in every source frame (decoded in bounded batches)
    5. for each bounded batch of output frames: generate mouth patches, restore them,
       blend them into the frames and hand the frames to the encoder
    6. finish the MP4, check it, and write the JSON summary next to it

Decoding and encoding run in background threads and ffmpeg processes, so they
overlap with the engine's work on the current batch.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from heygem import audio, encode, faces, media
from heygem.blend import blend_patch
from heygem.config import REPO_ROOT, Config, EngineConfig, apply_overrides, load_config
from heygem.errors import GenerationCancelled, HeygemError
from heygem.restore import restore_patches
from heygem.types import EngineBatch, FrameGeometry, GenerationSummary, MediaInfo

logger = logging.getLogger("heygem")

ProgressCallback = Callable[[str, float], None]

# share of the progress bar each stage takes: (start, end)
PROGRESS_SPANS = {"prepare": (0.0, 0.04), "faces": (0.04, 0.3), "generate": (0.3, 0.97), "finish": (0.97, 1.0)}
# a batch of frames holds at most this many bytes (a few batches are in flight at once: decoding,
# working, encoding), but never fewer than MIN_BATCH_FRAMES frames
BATCH_BYTES = 64 * 2**20
MIN_BATCH_FRAMES = 4
# a video shorter than the audio by more than this is kept in a frame file during the face pass
CACHE_MARGIN_SECONDS = 0.5


def weights_dir() -> Path:
    """Where checkpoints are looked for: $HEYGEM_WEIGHTS or the repository's weights/ folder."""
    return Path(os.environ.get("HEYGEM_WEIGHTS", REPO_ROOT / "weights"))


def generate(
    face_path: str | Path,
    audio_path: str | Path,
    output_path: str | Path,
    config: Config | None = None,
    *,
    overrides: dict | None = None,
    progress: ProgressCallback | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> GenerationSummary:
    """Make a lip-synced MP4 of the face in ``face_path`` speaking ``audio_path``.

    ``face_path`` is a video or a still image; ``audio_path`` an audio file or a
    video whose first audio track is used (pass the face video itself to keep its
    own sound). ``config`` defaults to configs/default.yaml; ``overrides`` are
    applied on top ({"face.pads": [0, 20, 0, 0]}). ``progress(stage, fraction)``
    is called as work advances; ``should_stop()`` is polled between batches and
    aborts with :class:`GenerationCancelled`. Writes ``output_path`` and
    ``output_path`` with suffix .json (the summary) and returns the summary.

    Raises :class:`HeygemError` with a message for the user when an input or
    option is unusable.
    """
    started = time.perf_counter()
    config = apply_overrides(config if config is not None else load_config(), overrides or {})
    face_path, audio_path, output_path = Path(face_path), Path(audio_path), Path(output_path)
    timer = StageTimer()
    report = _Reporter(progress, should_stop)

    # 1. inputs, output size, rate and length
    with timer("probe"):
        face_info, audio_info = media.probe_inputs(face_path, audio_path)
        geometry = media.working_geometry(face_info, config.media.output_height)
        fps = face_info.fps if face_info.kind == "video" else config.media.fps
        fps_fraction = face_info.fps_fraction if face_info.kind == "video" else media.fps_to_fraction(fps)
    report("prepare", 0.3)

    # 2. audio: decode now (the output's length follows it); the mel is computed in the
    #    background while faces are found
    with timer("audio"):
        samples_16k = audio.load_audio_16k(audio_path)
        audio_seconds = samples_16k.shape[0] / audio.SAMPLE_RATE
        frame_count = audio.output_frame_count(audio_seconds, fps)
    mel_future = _BACKGROUND.submit(_timed, audio.melspectrogram, samples_16k)
    report("prepare", 0.7)

    # 3. engine: chosen now, loaded in the background while faces are found
    engine_name, checkpoint, engine_reason = choose_engine(config.engine)
    engine_future = _BACKGROUND.submit(_timed, create_engine, engine_name, checkpoint, config.engine, fps)
    logger.info("engine: %s (%s)", engine_name, engine_reason)
    report("prepare", 1.0)

    work_dir = Path(tempfile.mkdtemp(prefix="heygem-"))
    encoder = None
    source = None
    try:
        # 4. faces in every source frame that the output uses
        with timer("faces"):
            source = SourceFrames.open(face_info, geometry, frame_count, audio_seconds, work_dir)
            track = source.track_faces(config, report)
        if not track.found.any():
            raise HeygemError(f"no face was found in {face_path.name}: use a clearer frontal face or give --box")
        logger.info("faces found in %d of %d source frames", track.frame_count - track.frames_without_face,
                    track.frame_count)

        with timer("wait_background"):
            mel, mel_seconds = mel_future.result()
            engine, engine_seconds = engine_future.result()
        timer.add("audio", mel_seconds)
        timer.add("load_engine", engine_seconds)
        window_starts = audio.mel_window_starts(frame_count, fps, mel.shape[1])

        # 5. generate, restore, blend, encode in bounded batches
        encoder = encode.open_encoder(geometry, fps_fraction, audio_path, audio_info, output_path,
                                      crf=config.media.crf, preset=config.media.preset,
                                      audio_bitrate=config.media.audio_bitrate, frame_count=frame_count,
                                      encoders=config.run.encoders)
        frames_without_face = 0
        batch_frames = frames_per_batch(geometry, config.media.batch_frames)
        batches = source.output_batches(frame_count, batch_frames)
        for batch_start in range(0, frame_count, batch_frames):
            report("generate", batch_start / frame_count)
            output_indices = np.arange(batch_start, min(batch_start + batch_frames, frame_count))
            with timer("decode"):
                source_indices, frames_bgr = next(batches)
            face_list = [track.face(int(index)) for index in source_indices]
            frames_without_face += sum(face is None for face in face_list)
            batch = EngineBatch(frame_indices=output_indices, frames_bgr=frames_bgr, faces=face_list,
                                mel_windows=audio.mel_windows(mel, window_starts[output_indices]), fps=fps)
            with timer("generate"):
                patches = engine.generate(batch)
            if engine.needs_restoration:
                with timer("restore"):
                    patches = restore_patches(patches, frames_bgr, config.restore)
            with timer("blend"):
                for frame, patch in zip(frames_bgr, patches):
                    if patch is not None:
                        blend_patch(frame, patch, config.blend)
            with timer("encode"):
                encoder.write(frames_bgr)
        report("finish", 0.0)

        # 6. finish and check the file, write the summary
        with timer("encode"):
            encoder.close()
            encoder = None
        check_output(output_path, frame_count, fps)
    except BaseException:
        if encoder is not None:
            encoder.abort()
        raise
    finally:
        if source is not None:
            source.close()
        shutil.rmtree(work_dir, ignore_errors=True)

    summary = GenerationSummary(
        output_path=output_path, face_path=face_path, audio_path=audio_path, engine=engine.name,
        engine_reason=engine_reason, width=geometry.width, height=geometry.height, fps=fps, frames=frame_count,
        frames_without_face=frames_without_face, audio_seconds=audio_seconds, video_seconds=frame_count / fps,
        seconds_per_stage=timer.rounded(), total_seconds=round(time.perf_counter() - started, 3),
        options=config.to_dict(),
    )
    output_path.with_suffix(".json").write_text(json.dumps(summary.to_json_dict(), indent=2, default=str),
                                                encoding="utf-8")
    report("finish", 1.0)
    return summary


_BACKGROUND = ThreadPoolExecutor(max_workers=4, thread_name_prefix="heygem-background")


def _timed(function, *args):
    started = time.perf_counter()
    return function(*args), time.perf_counter() - started


def warm_up() -> None:
    """Load the heavy libraries before the first job needs them (librosa's first call takes seconds)."""
    audio.melspectrogram(np.zeros(audio.SAMPLE_RATE // 10, dtype=np.float32))
    import mediapipe  # noqa: F401


# ---------------------------------------------------------------------------- engine choice


def choose_engine(config: EngineConfig) -> tuple[str, Path | None, str]:
    """Which engine to run: (name, checkpoint or None, why). Quick; raises HeygemError for unusable choices."""
    from heygem.weights import find_wav2lip_checkpoint

    checkpoint = Path(config.checkpoint) if config.checkpoint else find_wav2lip_checkpoint(weights_dir())
    if config.checkpoint and not checkpoint.is_file():
        raise HeygemError(f"checkpoint not found: {checkpoint}")
    name = config.name
    if name == "auto":
        name = "wav2lip" if checkpoint is not None else "landmark"
        reason = (f"auto: found {checkpoint.name}" if checkpoint is not None
                  else f"auto: no Wav2Lip checkpoint in {weights_dir()}, using the built-in engine")
    else:
        reason = "chosen with --engine"
    if name == "wav2lip" and checkpoint is None:
        raise HeygemError(f"--engine wav2lip needs a checkpoint: put wav2lip_gan.pth or wav2lip.pth into "
                          f"{weights_dir()} or pass --checkpoint PATH")
    return name, checkpoint, reason


def create_engine(name: str, checkpoint: Path | None, config: EngineConfig, fps: float):
    """Build the engine ``choose_engine`` picked (loads weights; can take seconds)."""
    if name == "wav2lip":
        from heygem.engines.wav2lip import Wav2LipEngine

        return Wav2LipEngine(checkpoint, config)
    from heygem.engines.landmark import LandmarkEngine

    return LandmarkEngine(config, fps)


# ---------------------------------------------------------------------------- source frames


def frames_per_batch(geometry: FrameGeometry, configured: int) -> int:
    """``configured``, or fewer for big frames, so that one batch of BGR frames stays under BATCH_BYTES."""
    frame_bytes = geometry.width * geometry.height * 3
    return max(MIN_BATCH_FRAMES, min(configured, BATCH_BYTES // frame_bytes))


def pingpong_indices(output_indices: np.ndarray, source_count: int) -> np.ndarray:
    """Source frame for each output frame: forward, then backward, and so on, never jumping."""
    if source_count <= 1:
        return np.zeros_like(output_indices)
    period = 2 * source_count - 2
    phase = output_indices % period
    return np.where(phase < source_count, phase, period - phase)


class SourceFrames:
    """The face input as frames: one still image, or a video read in bounded batches.

    A video at least as long as the audio is simply decoded a second time. One
    that has to play backward (audio longer than video) is kept in a raw frame
    file in the job's own work folder, written during the face pass when probing
    already shows it is short, otherwise by one more decode when it turns out so.
    """

    def __init__(self, info: MediaInfo, geometry: FrameGeometry, frames_needed: int,
                 still_bgr: np.ndarray | None, work_dir: Path, audio_seconds: float):
        self.info = info
        self.geometry = geometry
        self.frames_needed = frames_needed
        self.still_bgr = still_bgr
        self.work_dir = work_dir
        self.frame_file: media.FrameFile | None = None
        if still_bgr is None and info.duration + CACHE_MARGIN_SECONDS < audio_seconds:
            self.frame_file = media.FrameFile(work_dir / "frames.yuv", geometry)
        self.frame_count = 1 if still_bgr is not None else 0
        self.track: faces.FaceTrack | None = None

    @classmethod
    def open(cls, info: MediaInfo, geometry: FrameGeometry, frames_needed: int, audio_seconds: float,
             work_dir: Path) -> "SourceFrames":
        still = media.load_image(info, geometry) if info.kind == "image" else None
        return cls(info, geometry, frames_needed, still, work_dir, audio_seconds)

    def track_faces(self, config: Config, report: "_Reporter") -> faces.FaceTrack:
        """Find the face in every source frame the output will use (stage 4)."""
        width, height = self.geometry.width, self.geometry.height
        if self.still_bgr is not None:
            with faces.FaceFinder(config.face, still_images=True) as finder:
                landmarks = finder.find(self.still_bgr)
            track = faces.new_track(1)
            faces.record(track, 0, landmarks)
            self.track = faces.finalize_track(track, config.face, width, height)
            return self.track

        capacity = min(self.info.frame_count + 64, self.frames_needed)  # probing can undercount a little
        track = faces.new_track(capacity, self.work_dir / "landmarks.npy")
        decoded = 0
        with faces.FaceFinder(config.face) as finder:
            batch_frames = frames_per_batch(self.geometry, config.media.batch_frames)
            for frames_bgr in prefetch(media.iter_video_batches(self.info, self.geometry, batch_frames)):
                frames_bgr = frames_bgr[: capacity - decoded]
                for frame in frames_bgr:
                    faces.record(track, decoded, finder.find(frame))
                    decoded += 1
                if self.frame_file is not None:
                    self.frame_file.append(frames_bgr)
                report("faces", decoded / max(min(self.info.frame_count, capacity), 1))
                if decoded >= capacity:
                    break
        if decoded == 0:
            raise HeygemError(f"{self.info.path.name}: no video frames could be decoded")
        self.frame_count = decoded
        self.track = faces.finalize_track(faces.truncate(track, decoded), config.face, width, height)
        return self.track

    def output_batches(self, frame_count: int, batch_frames: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (source indices (N,), writable frames (N, H, W, 3) uint8 BGR) for each output batch."""
        if self.still_bgr is None and self.frame_file is None:
            if self.frame_count >= frame_count:
                yield from self._decoded_batches(frame_count, batch_frames)
                return
            self._fill_frame_file(batch_frames)  # shorter than probing said: keep it for playing backward
        for batch_start in range(0, frame_count, batch_frames):
            output_indices = np.arange(batch_start, min(batch_start + batch_frames, frame_count))
            source_indices = pingpong_indices(output_indices, self.frame_count)
            if self.still_bgr is not None:
                yield source_indices, np.repeat(self.still_bgr[None], len(output_indices), axis=0)
            else:
                yield source_indices, self.frame_file.read(source_indices)

    def close(self) -> None:
        if self.frame_file is not None:
            self.frame_file.close()

    def _fill_frame_file(self, batch_frames: int) -> None:
        self.frame_file = media.FrameFile(self.work_dir / "frames.yuv", self.geometry)
        for frames_bgr in media.iter_video_batches(self.info, self.geometry, batch_frames):
            self.frame_file.append(frames_bgr[: self.frame_count - self.frame_file.count])
            if self.frame_file.count >= self.frame_count:
                break

    def _decoded_batches(self, frame_count: int, batch_frames: int):
        """Output frames i = source frames i, decoded again in order, in batches of ``batch_frames``."""
        produced = 0
        for frames_bgr in prefetch(media.iter_video_batches(self.info, self.geometry, batch_frames)):
            frames_bgr = frames_bgr[: frame_count - produced]  # the decoder's arrays are new and writable
            yield np.arange(produced, produced + len(frames_bgr)), frames_bgr
            produced += len(frames_bgr)
            if produced >= frame_count:
                return
        raise HeygemError(f"{self.info.path.name} gave fewer frames on a second read; re-encode it and retry")


def prefetch(iterator: Iterator, depth: int = 2) -> Iterator:
    """Run ``iterator`` in a background thread, ``depth`` items ahead; errors re-raised here."""
    items: queue.Queue = queue.Queue(maxsize=depth)
    finished = object()
    stop = threading.Event()

    def produce():
        try:
            for item in iterator:
                while not stop.is_set():
                    try:
                        items.put(item, timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    break
        except BaseException as error:  # handed to the consumer
            items.put(error)
            return
        finally:
            close = getattr(iterator, "close", None)
            if stop.is_set() and close is not None:
                close()
        items.put(finished)

    thread = threading.Thread(target=produce, name="heygem-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if item is finished:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                items.get(timeout=0.1)
            except queue.Empty:
                pass


# ---------------------------------------------------------------------------- checks and helpers


def check_output(output_path: Path, frame_count: int, fps: float) -> None:
    """Probe the written MP4: a video and an audio stream, the expected length."""
    info = media.probe(output_path)
    if info.kind != "video" or not info.has_audio:
        raise HeygemError(f"the output {output_path.name} is missing its video or audio stream")
    expected_seconds = frame_count / fps
    if abs(info.audio_duration - expected_seconds) > 1.5 / fps + 0.05:
        logger.warning("output audio lasts %.3f s, video %.3f s", info.audio_duration, expected_seconds)


class StageTimer:
    """Adds up wall seconds per named stage."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - started)

    def add(self, stage: str, seconds: float) -> None:
        """Count ``seconds`` spent elsewhere (a background thread) towards ``stage``."""
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def rounded(self) -> dict[str, float]:
        return {stage: round(value, 3) for stage, value in self.seconds.items()}


class _Reporter:
    """Maps (stage, fraction of that stage) to overall progress and honours cancellation."""

    def __init__(self, callback: ProgressCallback | None, should_stop: Callable[[], bool] | None):
        self.callback = callback
        self.should_stop = should_stop

    def __call__(self, stage: str, fraction: float) -> None:
        if self.should_stop is not None and self.should_stop():
            raise GenerationCancelled("the job was cancelled")
        if self.callback is not None:
            start, end = PROGRESS_SPANS[stage]
            self.callback(stage, start + (end - start) * min(max(fraction, 0.0), 1.0))
