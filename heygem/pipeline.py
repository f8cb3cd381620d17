"""The whole generation: a face (video or photo) plus speech in, a lip-synced MP4 out, in eight steps.

    1. probe     the inputs; the output's size, rate and length             heygem.media.probing
    2. speech    decode the audio; its features computed in the background   heygem.speech
    3. choose    the engine, the restorer and the face detector; their
                 networks loaded in the background                           heygem.engines, heygem.render.restore
    4. decode    the face input, in bounded batches of I420 frames (a video   heygem.media.decode, .source
                 shorter than the speech turns where its head is still)       heygem.face.turns
    5. faces     a face for every frame: from the avatar cache, or tracked   heygem.face
    6. render    the engine's mouths, restored and blended into the frames;  heygem.engines, heygem.render
                 in the speech's pauses the filmed mouth                     heygem.render.pauses
    7. encode    x264 and the audio into the MP4                             heygem.media.encode
    8. finish    check the file, write the JSON summary beside it

Steps 4-7 run at the same time, each stage in a thread of its own with bounded queues between
them (heygem.runtime.flow), face tracking several runs at once; ``--no-concurrent`` runs them one
after another, and both give the same frames. The summary's seconds per stage name the stages;
:data:`STEPS` says which step each belongs to.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from heygem.config import Config, apply_overrides, load_config
from heygem.engines import choose_engine, start_loading
from heygem.errors import GenerationCancelled
from heygem.face.found import faces_warning, find_faces
from heygem.face.stage import FaceStage
from heygem.media import encode
from heygem.media.decode import decoder_count
from heygem.media.probing import check_written, fps_to_fraction, probe_inputs, working_geometry
from heygem.media.source import SourceFrames, frames_per_batch
from heygem.media.stream import StreamContinuation, stream_folder
from heygem.render.pauses import FilmedMouth
from heygem.render.prepared import Prepared
from heygem.render.restore import choose_restorer, create_restoration
from heygem.runtime import allocator, timeline
from heygem.runtime.flow import Stage, StageClock, run_stages
from heygem.runtime.workdir import new_work_dir
from heygem.speech import audio
from heygem.speech.pauses import mouth_weights
from heygem.types import FrameBatch, GenerationSummary
from heygem.weights import require_s3fd_checkpoint

logger = logging.getLogger("heygem")

ProgressCallback = Callable[[str, float], None]

# the steps, and the stages of the summary's seconds_per_stage that belong to each
STEPS = (
    (1, "probe", ("probe",)),
    (2, "speech", ("audio",)),
    (3, "choose", ("load_engine", "load_restorer")),
    (4, "decode", ("decode",)),
    (5, "faces", ("faces",)),
    (6, "render", ("keep_filmed", "generate", "restore", "blend", "plan", "render", "paste", "pauses")),
    (7, "encode", ("encode",)),
    (8, "finish", ()),
)

# share of the progress bar each phase takes, (start, end): prepare is steps 1-3, generate 4-7, finish 8
PROGRESS_SPANS = {"prepare": (0.0, 0.04), "generate": (0.04, 0.97), "finish": (0.97, 1.0)}


def step_of(stage: str) -> str:
    """The step a stage of the summary belongs to, as "6 render" ("" for a stage of no step)."""
    for number, name, stages in STEPS:
        if stage in stages:
            return f"{number} {name}"
    return ""


def generate(
    face_path: str | Path,
    audio_path: str | Path,
    output_path: str | Path,
    config: Config | None = None,
    *,
    overrides: dict | None = None,
    progress: ProgressCallback | None = None,
    should_stop: Callable[[], bool] | None = None,
    part: StreamContinuation | None = None,
) -> GenerationSummary:
    """Make a lip-synced MP4 of the face in ``face_path`` speaking ``audio_path``.

    ``face_path`` is a video or a still image; ``audio_path`` an audio file or a
    video whose first audio track is used (pass the face video itself to keep its
    own sound). ``config`` defaults to configs/default.yaml; ``overrides`` are
    applied on top ({"face.pads": [0, 20, 0, 0]}). ``progress(phase, fraction)``
    is called as work advances; ``should_stop()`` is polled between batches and
    aborts with :class:`GenerationCancelled`. Writes ``output_path`` and
    ``output_path`` with suffix .json (the summary) and returns the summary.
    ``part``: this call renders a part of a longer output (heygem.spoken: speech that comes sentence
    by sentence), its frames from ``part.first_frame`` of the whole: the face video goes on from there
    and the stream (``media.stream``, written to ``part``'s numbers) goes on from the parts before.

    Raises :class:`HeygemError` with a message for the user when an input or
    option is unusable.
    """
    started = time.perf_counter()
    part = part or StreamContinuation()
    timeline.mark("generate called")
    allocator.tune()  # on machines of many cores: freed frames go back to the kernel, not to an arena
    config = apply_overrides(config if config is not None else load_config(), overrides or {})
    face_path, audio_path, output_path = Path(face_path), Path(audio_path), Path(output_path)
    clock = StageClock(origin=started)
    report = _Reporter(progress, should_stop)
    owner = threading.get_ident()  # what a job keeps for the next is kept for this thread's next job
    start_loading(config.engine)  # an engine's imports begin now, beside steps 1 and 2 (EngineKind.start_loading)

    # 1. probe: the inputs, the output's size, rate and length
    encode.check_output_name(output_path)
    with _timed(clock, "probe"):
        face_info, audio_info = probe_inputs(face_path, audio_path)
        geometry = working_geometry(face_info, config.media.output_height)
        fps = face_info.fps if face_info.kind == "video" else config.media.fps
        fps_fraction = face_info.fps_fraction if face_info.kind == "video" else fps_to_fraction(fps)
    timeline.mark("1 probed")
    report("prepare", 0.3)

    # 2. speech: decoded now (the output's length follows it); its features are computed in the
    #    background while the first frames are decoded and tracked (once the engine is chosen, below)
    with _timed(clock, "audio"):
        samples_16k = audio.load_audio_16k(audio_path)
        audio_seconds = samples_16k.shape[0] / audio.SAMPLE_RATE
        frame_count = audio.output_frame_count(audio_seconds, fps)
    timeline.mark("2 speech decoded")
    report("prepare", 0.7)

    # 3. choose: the engine, the restorer and the face detector now; the networks load in the background
    engine = choose_engine(config.engine)
    restorer = choose_restorer(config.restore, engine.name, engine.kind.synthesises_pixels,
                               face_size=engine.kind.sharp_face_size)
    detector_checkpoint = require_s3fd_checkpoint() if config.face.detector == "s3fd" else None
    engine_future = _BACKGROUND.submit(_timed_call, engine.kind.load, engine.weights, config, fps, owner)
    if engine.kind.reads_mel:
        mel_future, features_future = _BACKGROUND.submit(_timed_call, audio.melspectrogram, samples_16k), None
    else:  # the engine's own features instead, made as soon as it has loaded
        mel_future = None
        features_future = _once_loaded(engine_future, engine.kind.audio_features, samples_16k, fps, frame_count)
    restoration_future = _BACKGROUND.submit(_timed_call, create_restoration, restorer, config)
    # what the user should know although the job works: several faces (one of them speaks), no sound
    warnings_future = _BACKGROUND.submit(_input_warnings, face_info, config, samples_16k) \
        if part.first_frame == 0 else None
    logger.info("engine: %s (%s); restorer: %s (%s); face detector: %s", engine.name, engine.reason, restorer.name,
                restorer.reason, config.face.detector)
    timeline.mark("3 engine chosen")
    report("prepare", 1.0)

    work_dir = new_work_dir()
    encoder = None
    source = None
    finished = False
    try:
        # 4. decode and 5. faces: the face input in bounded batches, each with its faces (the face
        #    video's track from the avatar cache, or tracked as the frames stream past)
        source = SourceFrames.open(face_info, geometry, part.first_frame + frame_count,
                                   part.first_frame / fps + audio_seconds, work_dir,
                                   decoder_count(config.run.decoders, geometry))
        face_stage = FaceStage(source, config, geometry, fps_fraction, work_dir, detector_checkpoint,
                               first_frame=part.first_frame)
        source.turns = _turns(face_stage, part, part.first_frame + frame_count)

        # 6. render, 7. encode: the engine's render stages, then x264
        encoder = encode.open_encoder(geometry, fps_fraction, audio_path, audio_info, output_path,
                                      crf=config.media.crf, preset=config.media.preset,
                                      audio_bitrate=config.media.audio_bitrate, frame_count=frame_count,
                                      encoders=config.run.encoders,
                                      stream_dir=(part.folder or stream_folder(output_path)) if config.media.stream
                                      else None,
                                      continuing=part)
        timeline.mark("x264 started")
        prepared = Prepared(mel_future, engine_future, frame_count, fps, clock, restoration_future, features_future,
                            source_key=face_stage.cache_key)
        render = engine.kind.render(prepared, config, restorer.name)
        # in the speech's pauses the face's own mouth, as filmed, whatever the engine drew (heygem.render.pauses)
        filmed_mouth = FilmedMouth(mouth_weights(samples_16k, fps, frame_count)
                                   if not engine.kind.keeps_filmed_mouth_in_pauses else np.ones(frame_count))
        written = {"frames": 0, "without_face": 0}

        def encode_frames(batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
            for batch in batches:
                encoder.write_i420(batch.frames_i420)
                written["frames"] += len(batch.output_indices)
                written["without_face"] += sum(face is None for face in batch.faces)
                report("generate", written["frames"] / frame_count)
                yield batch

        batch_frames = frames_per_batch(geometry, config.media.batch_frames, render.bytes_per_pixel)
        run_stages(source.output_batches(frame_count, batch_frames, part.first_frame),
                   [Stage("faces", face_stage.run), *filmed_mouth.around(render.stages()),
                    Stage("encode", encode_frames)],
                   concurrent=config.run.concurrent, should_stop=should_stop, clock=clock)
        report("finish", 0.0)

        # 8. finish: the file closed and checked, the summary written
        with _timed(clock, "encode"):
            stream_processes = encoder.stream_processes if config.media.stream else 0
            encoder.close()
            encoder = None
        check_written(output_path, frame_count, fps)
        timeline.mark("8 finished")
        logger.info("timeline (seconds since the process started): %s", timeline.describe())
        finished = True
    except BaseException:
        if encoder is not None:
            encoder.abort()
        raise
    finally:
        if source is not None:
            source.close()
        shutil.rmtree(work_dir, ignore_errors=True)
        _after_job(engine.kind, engine_future, owner, finished)

    summary = GenerationSummary(
        output_path=output_path, face_path=face_path, audio_path=audio_path, engine=engine.name,
        engine_reason=engine.reason, restorer=restorer.name, restorer_reason=restorer.reason,
        width=geometry.width, height=geometry.height, fps=fps, frames=frame_count,
        frames_without_face=written["without_face"], audio_seconds=audio_seconds, video_seconds=frame_count / fps,
        seconds_per_stage={stage: round(value, 3) for stage, value in clock.seconds.items()},
        cpu_seconds_per_stage={stage: round(value, 3) for stage, value in clock.cpu_seconds.items()},
        stage_spans={stage: [round(max(0.0, start), 3), round(end, 3)] for stage, (start, end) in clock.spans.items()},
        total_seconds=round(time.perf_counter() - started, 3), options=config.to_dict(),
        avatar_cache=face_stage.cache_outcome, detector=config.face.detector, stream_processes=stream_processes,
        warnings=warnings_future.result() if warnings_future is not None else [],
        turns=list(source.turns) if source.turns is not None else None,
    )
    output_path.with_suffix(".json").write_text(json.dumps(summary.to_json_dict(), indent=2, default=str),
                                                encoding="utf-8")
    report("finish", 1.0)
    return summary


_BACKGROUND = ThreadPoolExecutor(max_workers=4, thread_name_prefix="heygem-background")


def _turns(face_stage: FaceStage, part: StreamContinuation, frames_wanted: int) -> tuple[int, int] | None:
    """Where a face video shorter than the speech turns back and forward again: a later part of a longer
    output (heygem.spoken) as the first part chose; else, when the whole video's track is known before
    decoding (a presenter, the avatar cache), the frames heygem.face.turns picks from it, if the video is
    shorter than this output or the output is made in parts (its length not known yet); else None (at
    the video's last and first frames)."""
    if part.first_frame > 0:
        return part.turns
    track = face_stage.whole_track
    if track is None or (part.last and frames_wanted <= track.frame_count):
        return None
    from heygem.face.turns import turn_frames

    late, early = turn_frames(track)
    logger.info("the face video (%d frames) turns back at frame %d and forward at frame %d", track.frame_count,
                late, early)
    return late, early


def _input_warnings(face_info, config: Config, samples_16k) -> list[str]:
    """What a job tells its user of its inputs: the faces of the first frame when there are several
    (which one speaks), speech without sound. Never fails the job: a look that fails says nothing."""
    warnings = []
    try:  # a fixed --box picks no face among several
        several = None if config.face.box else faces_warning(find_faces(face_info, config.face),
                                                             config.face.face_index)
    except Exception as problem:  # noqa: BLE001 - the job itself finds the faces; this only tells of them
        logger.debug("faces of the first frame not counted: %s", problem)
        several = None
    if several:
        warnings.append(several)
    if audio.is_silent(samples_16k):
        warnings.append("the speech is silent")
    for warning in warnings:  # the command line prints them from the summary, the page shows them in the card
        logger.info("warning: %s", warning)
    return warnings


def _once_loaded(engine_future: Future, function, *args) -> Future:
    """``function(engine, *args)``, timed, in the background once ``engine_future`` has its engine (chained,
    not waited for in a pool thread, so that jobs in parallel cannot hold every thread waiting)."""
    result: Future = Future()

    def start(loaded: Future) -> None:
        if loaded.exception() is not None:
            result.set_exception(loaded.exception())
            return

        def run() -> None:
            try:
                result.set_result(_timed_call(function, loaded.result()[0], *args))
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits for it
                result.set_exception(error)

        _BACKGROUND.submit(run)

    engine_future.add_done_callback(start)
    return result


def _timed_call(function, *args):
    """(``function(*args)``, the seconds it took, when it started as perf_counter())."""
    started = time.perf_counter()
    result = function(*args)
    timeline.mark(f"{getattr(function, '__qualname__', 'background work')} done")
    return result, time.perf_counter() - started, started


@contextmanager
def _timed(clock: StageClock, stage: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        clock.add(stage, time.perf_counter() - started)


def _after_job(kind, engine_future, owner: int, ended_well: bool) -> None:
    """The engine's end of the job (kept for ``owner``'s next job or stopped), once it has loaded; a
    failed load was reported where it was awaited."""
    try:
        engine = engine_future.result()[0]  # (engine, seconds, when it started): heygem.pipeline._timed_call
    except BaseException:  # noqa: BLE001
        return
    kind.after_job(engine, owner, ended_well)


class _Reporter:
    """Maps (phase, fraction of that phase) to overall progress and honours cancellation."""

    def __init__(self, callback: ProgressCallback | None, should_stop: Callable[[], bool] | None):
        self.callback = callback
        self.should_stop = should_stop

    def __call__(self, phase: str, fraction: float) -> None:
        if self.should_stop is not None and self.should_stop():
            raise GenerationCancelled("the job was cancelled")
        if self.callback is not None:
            start, end = PROGRESS_SPANS[phase]
            self.callback(phase, start + (end - start) * min(max(fraction, 0.0), 1.0))
