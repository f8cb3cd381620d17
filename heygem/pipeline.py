"""The whole generation: a face (video or photo) plus speech in, a lip-synced MP4 out.

    1. probe the inputs and settle the output's size, rate and length
    2. decode the audio and compute one Wav2Lip mel window per output frame
    3. choose the lip-sync engine (wav2lip when its weights are present, else landmark), the face
       detector and the restorer (gfpgan when its weights are present and the engine synthesises pixels)
    4. faces: take the face video's tracking from the avatar cache, or track it as it streams past
    5. for each bounded batch of output frames: decode, attach faces, generate mouth patches,
       restore them, blend them into the frames, and encode
    6. finish the MP4, check it, and write the JSON summary next to it

Step 5's stages run at the same time, each in a thread of its own with bounded queues between
them (heygem/flow.py), face tracking on several threads at once; ``--no-concurrent`` runs them
one after another, and both give the same frames. The first job of a process tunes its C
allocator for frame-sized buffers (heygem/allocator.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from heygem.config import (
    Config,
    EngineConfig,
    FaceConfig,
    apply_overrides,
    load_config,
)
from heygem.errors import GenerationCancelled, HeygemError
from heygem.face.stage import FaceStage
from heygem.media import encode
from heygem.media.decode import decoder_count
from heygem.media.probing import fps_to_fraction, probe, probe_inputs, working_geometry
from heygem.media.source import SourceFrames, frames_per_batch
from heygem.render.paths import choose_render
from heygem.render.prepared import Prepared
from heygem.render.restore import choose_restorer, create_restoration
from heygem.runtime import allocator
from heygem.runtime.flow import Stage, StageClock, run_stages
from heygem.runtime.kept import KEPT
from heygem.speech import audio
from heygem.types import FrameBatch, GenerationSummary
from heygem.weights import weights_dir

logger = logging.getLogger("heygem")

ProgressCallback = Callable[[str, float], None]

# share of the progress bar each stage takes: (start, end)
PROGRESS_SPANS = {"prepare": (0.0, 0.04), "generate": (0.04, 0.97), "finish": (0.97, 1.0)}


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
    allocator.tune()  # on machines of many cores: freed frames go back to the kernel, not to an arena
    config = apply_overrides(config if config is not None else load_config(), overrides or {})
    face_path, audio_path, output_path = Path(face_path), Path(audio_path), Path(output_path)
    clock = StageClock()
    report = _Reporter(progress, should_stop)

    # 1. inputs, output size, rate and length
    with _timed(clock, "probe"):
        face_info, audio_info = probe_inputs(face_path, audio_path)
        geometry = working_geometry(face_info, config.media.output_height)
        fps = face_info.fps if face_info.kind == "video" else config.media.fps
        fps_fraction = face_info.fps_fraction if face_info.kind == "video" else fps_to_fraction(fps)
    report("prepare", 0.3)

    # 2. audio: decode now (the output's length follows it); the mel is computed in the
    #    background while the first frames are decoded and tracked
    with _timed(clock, "audio"):
        samples_16k = audio.load_audio_16k(audio_path)
        audio_seconds = samples_16k.shape[0] / audio.SAMPLE_RATE
        frame_count = audio.output_frame_count(audio_seconds, fps)
    mel_future = _BACKGROUND.submit(_timed_call, audio.melspectrogram, samples_16k)
    report("prepare", 0.7)

    # 3. engine, restorer and face detector: chosen now, the networks loaded in the background
    engine_name, checkpoint, engine_reason = choose_engine(config.engine)
    restorer = choose_restorer(config.restore, engine_name, weights_dir())
    detector_checkpoint = choose_detector(config.face)
    engine_future = _BACKGROUND.submit(_timed_call, create_engine, engine_name, checkpoint, config.engine, fps,
                                       landmark_worker_count(config), threading.get_ident())
    restoration_future = _BACKGROUND.submit(_timed_call, create_restoration, restorer, config)
    logger.info("engine: %s (%s); restorer: %s (%s); face detector: %s", engine_name, engine_reason, restorer.name,
                restorer.reason, config.face.detector)
    report("prepare", 1.0)

    work_dir = Path(tempfile.mkdtemp(prefix="heygem-"))
    encoder = None
    source = None
    finished = False
    try:
        # 4. faces: the tracking of this face video if it was tracked before, else tracked as it streams
        source = SourceFrames.open(face_info, geometry, frame_count, audio_seconds, work_dir,
                                   decoder_count(config.run.decoders, geometry))
        face_stage = FaceStage(source, config, geometry, fps_fraction, work_dir, detector_checkpoint)

        # 5. decode -> faces -> generate -> restore -> blend -> encode, in bounded batches
        encoder = encode.open_encoder(geometry, fps_fraction, audio_path, audio_info, output_path,
                                      crf=config.media.crf, preset=config.media.preset,
                                      audio_bitrate=config.media.audio_bitrate, frame_count=frame_count,
                                      encoders=config.run.encoders)
        prepared = Prepared(mel_future, engine_future, frame_count, fps, clock, restoration_future)
        render = choose_render(engine_name, prepared, config, restorer.name)
        written = {"frames": 0, "without_face": 0}

        def encode_frames(batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
            for batch in batches:
                encoder.write_i420(batch.frames_i420)
                written["frames"] += len(batch.output_indices)
                written["without_face"] += sum(face is None for face in batch.faces)
                report("generate", written["frames"] / frame_count)
                yield batch

        batch_frames = frames_per_batch(geometry, config.media.batch_frames, render.bytes_per_pixel)
        run_stages(source.output_batches(frame_count, batch_frames),
                   [Stage("faces", face_stage.run), *render.stages(), Stage("encode", encode_frames)],
                   concurrent=config.run.concurrent, should_stop=should_stop, clock=clock)
        report("finish", 0.0)

        # 6. finish and check the file, write the summary
        with _timed(clock, "encode"):
            encoder.close()
            encoder = None
        check_output(output_path, frame_count, fps)
        finished = True
    except BaseException:
        if encoder is not None:
            encoder.abort()
        raise
    finally:
        if source is not None:
            source.close()
        shutil.rmtree(work_dir, ignore_errors=True)
        # after an error the rendering processes may be out of step: only a finished job keeps them
        close_engine(engine_future, keep_for=threading.get_ident() if finished else None)

    summary = GenerationSummary(
        output_path=output_path, face_path=face_path, audio_path=audio_path, engine=engine_name,
        engine_reason=engine_reason, restorer=restorer.name, restorer_reason=restorer.reason,
        width=geometry.width, height=geometry.height, fps=fps, frames=frame_count,
        frames_without_face=written["without_face"], audio_seconds=audio_seconds, video_seconds=frame_count / fps,
        seconds_per_stage={stage: round(value, 3) for stage, value in clock.seconds.items()},
        cpu_seconds_per_stage={stage: round(value, 3) for stage, value in clock.cpu_seconds.items()},
        total_seconds=round(time.perf_counter() - started, 3), options=config.to_dict(),
        avatar_cache=face_stage.cache_outcome, detector=config.face.detector,
    )
    output_path.with_suffix(".json").write_text(json.dumps(summary.to_json_dict(), indent=2, default=str),
                                                encoding="utf-8")
    report("finish", 1.0)
    return summary


_BACKGROUND = ThreadPoolExecutor(max_workers=4, thread_name_prefix="heygem-background")


def _timed_call(function, *args):
    started = time.perf_counter()
    return function(*args), time.perf_counter() - started


@contextmanager
def _timed(clock: StageClock, stage: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        clock.add(stage, time.perf_counter() - started)


def warm_up() -> None:
    """Load the heavy libraries before the first job needs them (mediapipe takes seconds to import)."""
    audio.melspectrogram(np.zeros(audio.SAMPLE_RATE // 10, dtype=np.float32))
    from heygem.face.detect import import_mediapipe

    import_mediapipe()


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


def choose_detector(config: FaceConfig) -> Path | None:
    """The S3FD file for ``--detector s3fd`` (HeygemError when weights/ lacks it); None for mediapipe."""
    if config.detector != "s3fd":
        return None
    from heygem.weights import require_s3fd_checkpoint

    return require_s3fd_checkpoint(weights_dir())


def create_engine(name: str, checkpoint: Path | None, config: EngineConfig, fps: float, workers: int = 0,
                  owner: int | None = None):
    """Build the engine ``choose_engine`` picked (loads weights; can take seconds); ``workers``
    processes draw the landmark engine's frames (0: in this process). A Wav2Lip engine is kept
    for the next job of the thread ``owner`` (the job's own thread: engines are not shared)."""
    owner = owner if owner is not None else threading.get_ident()
    if name == "wav2lip":
        return _kept_wav2lip_engine(checkpoint, config, owner)
    from heygem.engines.landmark import LandmarkEngine

    return LandmarkEngine(config, fps, workers=workers, pool=_kept_pool(owner, workers))


# Loaded generators, kept for the next job of the same thread (a job worker runs job after job):
# importing torch, starting CUDA and loading the weights take 10-15 s, longer than a minute of
# 1080p video takes to render. The key holds everything the engine was built from.
_KEPT_ENGINES: dict[tuple, object] = {}
_KEPT_LOCK = threading.Lock()
MAX_KEPT_ENGINES = 4


def _kept_wav2lip_engine(checkpoint: Path, config: EngineConfig, owner: int):
    """The Wav2Lip engine for ``checkpoint`` and ``config``: the one loaded for ``owner``'s previous
    job if the file and the options are unchanged, else a new one (an engine serves one thread)."""
    from heygem.engines.wav2lip import Wav2LipEngine

    status = checkpoint.stat()
    key = (owner, str(checkpoint.resolve()), status.st_size, status.st_mtime_ns,
           config.device, config.batch_size, config.precision, config.cuda_graph, config.cudnn, config.deterministic)
    with _KEPT_LOCK:
        engine = _KEPT_ENGINES.get(key)
    if engine is not None:
        logger.info("wav2lip engine: the one loaded for the previous job")
        return engine
    engine = Wav2LipEngine(checkpoint, config)
    with _KEPT_LOCK:
        mine = [other for other in _KEPT_ENGINES if other[0] == key[0]]
        for other in mine:  # one engine per thread: the newest
            del _KEPT_ENGINES[other]
        if len(_KEPT_ENGINES) >= MAX_KEPT_ENGINES:
            del _KEPT_ENGINES[next(iter(_KEPT_ENGINES))]
        _KEPT_ENGINES[key] = engine
    return engine


# The landmark engine's rendering processes, kept idle for the next job of the same thread: spawning
# eight processes that import NumPy and OpenCV took a second or more at the start of every job.
_KEPT_POOLS: dict[int, object] = {}


def _kept_pool(owner: int, workers: int):
    """The rendering processes ``owner``'s last job left, if there are ``workers`` of them and all run;
    else None (and what was kept is stopped)."""
    with _KEPT_LOCK:
        pool = _KEPT_POOLS.pop(owner, None)
    if pool is None:
        return None
    if pool.size == workers and pool.alive():
        logger.info("landmark engine: the rendering processes of the previous job")
        return pool
    pool.close()
    return None


def _keep_pool(owner: int, pool) -> None:
    with _KEPT_LOCK:
        earlier = _KEPT_POOLS.pop(owner, None)
        dropped = [earlier] if earlier is not None and earlier is not pool else []
        while len(_KEPT_POOLS) >= MAX_KEPT_ENGINES:
            dropped.append(_KEPT_POOLS.pop(next(iter(_KEPT_POOLS))))
        _KEPT_POOLS[owner] = pool
    for other in dropped:
        other.close()


def release_kept(owner: int | None = None) -> None:
    """Drop what was kept for the next job of thread ``owner`` (every thread's when None): its
    generator, and stop its rendering processes; and the face trackers kept for any next job (a
    job that is running holds its own). A job worker calls it when it stops."""
    with _KEPT_LOCK:
        for key in [key for key in _KEPT_ENGINES if owner is None or key[0] == owner]:
            del _KEPT_ENGINES[key]
        pools = [_KEPT_POOLS.pop(key) for key in list(_KEPT_POOLS) if owner is None or key == owner]
    for pool in pools:
        pool.close()
    KEPT.release(owner)


def landmark_worker_count(config: Config) -> int:
    """Processes that draw the landmark engine's frames: none when the stages run one after another or
    on a small machine (starting them costs more than they give), else half the cores, at most 8."""
    cores = os.cpu_count() or 1
    return 0 if not config.run.concurrent or cores <= 4 else min(8, cores // 2)


def close_engine(engine_future, keep_for: int | None = None) -> None:
    """Stop what an engine started (the landmark engine's processes), once it has loaded or failed;
    with ``keep_for`` (a thread, after a job that finished) its processes are kept for that thread's
    next job instead."""
    try:
        engine, _ = engine_future.result()
    except BaseException:  # a failed load was reported where it was awaited
        return
    detach = getattr(engine, "detach_pool", None)
    if keep_for is not None and detach is not None:
        pool = detach()
        if pool is not None:
            _keep_pool(keep_for, pool)
    close = getattr(engine, "close", None)
    if close is not None:
        close()


# ---------------------------------------------------------------------------- checks and helpers


def check_output(output_path: Path, frame_count: int, fps: float) -> None:
    """Probe the written MP4: a video and an audio stream, the expected length."""
    info = probe(output_path)
    if info.kind != "video" or not info.has_audio:
        raise HeygemError(f"the output {output_path.name} is missing its video or audio stream")
    expected_seconds = frame_count / fps
    if abs(info.audio_duration - expected_seconds) > 1.5 / fps + 0.05:
        logger.warning("output audio lasts %.3f s, video %.3f s", info.audio_duration, expected_seconds)


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
