"""A presenter's one-time preparation, and what a job made with it gets.

Preparing a video presenter tracks the face of every frame of its clip once, with the pipeline's
own face stage (step 5), which stores the complete track in the avatar cache; the raw arrays are also
kept in the presenter's ``track/`` folder (``found.npy``, ``raw_boxes.npy``, ``landmarks.npy`` and
``track.json`` with the frame size they were tracked at), so the presenter outlives a cleared cache.
Then each installed engine with a preparation of its own (:attr:`EngineKind.presenter_preparation`:
MuseTalk's crop latents) is loaded as a job loads it and handed the clip's frames with the track's faces
(:func:`prepare_engines`), so a job made from the presenter prepares nothing again; a failure there is a
warning (the job then prepares it itself). Then a thumbnail (a frame with the face box and the mouth region
drawn) and a speech sample (the cleanest 5-30 s of the clip's speech, WAV, as the cloned voice picks it) are
made, and the track's warnings recorded; the record says what was prepared (``prepared``).

:func:`use_for_job` is what a job's face resolves to: the clip's path and face index, with the track
put in the avatar cache under the key that job will compute (its own frame size and face options;
the kept track is scaled to its size), so the job's summary says ``avatar_cache: hit``.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from heygem.config import Config, apply_overrides, load_config
from heygem.errors import GenerationCancelled, HeygemError
from heygem.face import avatar_cache
from heygem.face.track import FaceTrack, TrackBuilder
from heygem.jobs.request import flatten_options
from heygem.media.decode import iter_video_i420, load_image
from heygem.media.frames import i420_batch_to_bgr, yuv420_to_bgr
from heygem.media.probing import probe, working_geometry
from heygem.media.source import SourceFrames, frames_per_batch
from heygem.presenters.checks import track_warnings
from heygem.presenters.records import READY, SAMPLE_NAME, Presenter, PresenterStore
from heygem.types import Face, FrameBatch, FrameGeometry, MediaInfo

if TYPE_CHECKING:
    from heygem.engines.base import EngineKind

logger = logging.getLogger("heygem")

TRACK_ARRAYS = ("found", "raw_boxes", "landmarks")
MOUTH_RING = (61, 146, 91, 181, 84, 17, 314, 405, 321, 375, 291, 409, 270, 269, 267, 0, 37, 39, 40, 185)  # outer lips
THUMBNAIL_HEIGHT = 360
PROGRESS_STEP = 0.01  # the preparation's progress is written when it has grown this much
TRACKING_SHARE = 0.6  # of the progress, when engines prepare too (their share runs from there to 0.95)


def presenter_config(face_index: int | None, config: Config | None = None) -> Config:
    """The config a presenter is prepared with: ``config`` (the defaults) with its face index."""
    return apply_overrides(config or load_config(), {"face.face_index": face_index})


def prepare(store: PresenterStore, presenter: Presenter, config: Config | None = None,
            progress: Callable[[float], None] | None = None) -> Presenter:
    """Prepare ``presenter`` (track, what the installed engines prepare once, thumbnail, speech sample,
    warnings) and mark it ready, with the list of what was prepared.
    HeygemError when the clip cannot serve (no face in any frame); the caller decides what that means."""
    config = presenter_config(presenter.face_index, config)
    info = probe(presenter.clip_path, role="face")
    geometry = working_geometry(info, config.media.output_height)
    prepared = ["track"]
    if info.kind == "video":
        engines = engines_to_prepare(config)
        tracked_until = TRACKING_SHARE if engines else 0.95
        track, thumbnail_bgr = track_clip(info, geometry, config, presenter.track_dir,
                                          spanned(progress, 0.0, tracked_until))
        prepared += prepare_engines(engines, info, geometry, config, track, spanned(progress, tracked_until, 0.95))
    else:
        track, thumbnail_bgr = find_in_photo(info, geometry, config)
    warnings = presenter.warnings + track_warnings(np.asarray(track.found), np.asarray(track.raw_boxes), info,
                                                   geometry)
    write_thumbnail(thumbnail_bgr, track, presenter.thumbnail_path)
    speech_seconds = cut_speech_sample(info, presenter.directory / SAMPLE_NAME) if info.has_audio else None
    store.mark_ready(presenter.id, warnings, speech_seconds, prepared)
    logger.info("presenter %s (%s) is ready: %d frames, %d warning(s), prepared: %s", presenter.id, presenter.name,
                track.frame_count, len(warnings), ", ".join(prepared))
    return store.get(presenter.id)


def track_clip(info: MediaInfo, geometry: FrameGeometry, config: Config, track_dir: Path,
               progress: Callable[[float], None] | None = None) -> tuple[FaceTrack, tuple[int, np.ndarray]]:
    """Track every frame of the clip with the face stage (which stores the whole track in the avatar
    cache), keep the raw arrays in ``track_dir`` (``progress`` told 0..1 of it); returns the track and
    (frame index, BGR frame) of the frame the thumbnail shows."""
    from heygem.face.stage import FaceStage
    from heygem.weights import require_s3fd_checkpoint

    config = apply_overrides(config, {"run.avatar_cache": True})
    work_dir = Path(tempfile.mkdtemp(prefix="heygem-presenter-"))
    try:
        source = SourceFrames(info, geometry, info.frame_count + 64, None, work_dir, info.duration)
        checkpoint = require_s3fd_checkpoint() if config.face.detector == "s3fd" else None
        stage = FaceStage(source, config, geometry, info.fps_fraction, work_dir, checkpoint)
        wanted = {info.frame_count // 2, info.frame_count // 4, 3 * info.frame_count // 4, 0}
        candidates: dict[int, np.ndarray] = {}

        def batches() -> Iterator[FrameBatch]:
            decoded, reported = 0, 0.0
            for frames in iter_video_i420(info, geometry, frames_per_batch(geometry, config.media.batch_frames)):
                indices = np.arange(decoded, decoded + len(frames))
                for index in wanted.intersection(indices.tolist()):
                    candidates[index] = frames[index - decoded].copy()
                yield FrameBatch(indices, indices, frames)
                decoded += len(frames)
                fraction = min(decoded / max(info.frame_count, 1), 1.0)
                if progress is not None and fraction - reported >= PROGRESS_STEP:
                    progress(fraction)
                    reported = fraction
            if decoded == 0:
                raise HeygemError(f"{info.path.name}: no video frames could be decoded")
            source.frame_count = decoded  # the face stage stores the track as the whole video's

        for _ in stage.run(batches()):
            pass
        builder = stage.builder
        track = FaceTrack(found=np.array(builder.track.found[: builder.tracked]),
                          raw_boxes=np.array(builder.track.raw_boxes[: builder.tracked]),
                          landmarks=builder.track.landmarks[: builder.tracked])
        keep_track(track, geometry, info, track_dir)
        track.landmarks = np.load(track_dir / "landmarks.npy", mmap_mode="r")  # the work folder goes next
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    shown = next((index for index in sorted(candidates, key=lambda i: abs(i - info.frame_count // 2))
                  if index < track.frame_count and track.found[index]), min(candidates))
    return track, (shown, yuv420_to_bgr(candidates[shown], geometry.width, geometry.height))


def spanned(progress: Callable[[float], None] | None, start: float, end: float) -> Callable[[float], None] | None:
    """``progress`` told a part's fraction 0..1 as ``start``..``end`` of the whole."""
    if progress is None:
        return None
    return lambda fraction: progress(start + (end - start) * min(max(fraction, 0.0), 1.0))


def engines_to_prepare(config: Config) -> list[tuple[EngineKind, Path | None]]:
    """(engine, its weights) of every engine with a preparation of its own that a job may run here: the
    one ``engine.name`` names, or with auto each whose files are installed. Quick: looks at file names."""
    from heygem.engines import ENGINES

    named = config.engine.name
    kinds = list(ENGINES.values()) if named == "auto" else [ENGINES[named]] if named in ENGINES else []
    chosen = []
    for kind in kinds:
        if not kind.presenter_preparation:
            continue
        try:
            weights = kind.find_weights(config.engine)
        except HeygemError:  # a named file that is not there: a job says so
            continue
        if weights is not None or not kind.needs_weights:
            chosen.append((kind, weights))
    return chosen


def prepare_engines(engines: list[tuple[EngineKind, Path | None]], info: MediaInfo, geometry: FrameGeometry,
                    config: Config, track: FaceTrack, progress: Callable[[float], None] | None = None) -> list[str]:
    """Each engine's own preparation for the clip (:meth:`EngineKind.prepare_presenter`), the engine loaded
    as a job of this thread loads it (heygem.runtime.kept: kept for the next), the clip decoded again in
    bounded batches with the faces a job's face stage gives from ``track``. What was prepared, by name; an
    engine that fails is a warning (its jobs prepare it themselves). ``progress`` is told 0..1 of it all."""
    config = apply_overrides(config, {"run.avatar_cache": True})  # what is prepared is kept there
    builder = TrackBuilder(config.face, geometry.width, geometry.height, track.frame_count, track=track)
    builder.end()  # every frame's box final, smoothed and padded as a job's face stage makes them
    owner = threading.get_ident()
    prepared = []
    for number, (kind, weights) in enumerate(engines):
        ended_well, engine = False, None
        try:
            engine = kind.load(weights, config, info.fps, owner)
            kind.prepare_presenter(engine, clip_batches(info, geometry, config, builder.face, track.frame_count,
                                                        spanned(progress, number / len(engines),
                                                                (number + 1) / len(engines))))
            ended_well = True
            prepared.append(kind.presenter_preparation)
        except GenerationCancelled:  # the presenter was deleted meanwhile
            raise
        except Exception as error:  # noqa: BLE001 - the presenter serves without it; a bug shows its traceback
            logger.warning("presenter: %s not prepared (%s); its jobs prepare them themselves",
                           kind.presenter_preparation, error, exc_info=not isinstance(error, HeygemError))
        finally:
            if engine is not None:
                kind.after_job(engine, owner, ended_well)
    return prepared


def clip_batches(info: MediaInfo, geometry: FrameGeometry, config: Config, face_of: Callable[[int], Face | None],
                 frame_count: int, progress: Callable[[float], None] | None = None
                 ) -> Iterator[tuple[np.ndarray, list[Face | None]]]:
    """The clip's first ``frame_count`` frames in bounded batches, (N, H, W, 3) uint8 BGR as a job's render
    stage converts them, each with its N faces (``face_of(frame index)``)."""
    decoded, reported = 0, 0.0
    for frames_i420 in iter_video_i420(info, geometry, frames_per_batch(geometry, config.media.batch_frames)):
        count = min(len(frames_i420), frame_count - decoded)
        if count <= 0:
            break
        yield i420_batch_to_bgr(frames_i420[:count]), [face_of(decoded + row) for row in range(count)]
        decoded += count
        fraction = decoded / max(frame_count, 1)
        if progress is not None and fraction - reported >= PROGRESS_STEP:
            progress(fraction)
            reported = fraction


def find_in_photo(info: MediaInfo, geometry: FrameGeometry, config: Config) -> tuple[FaceTrack, tuple]:
    """The photo's face as a one-frame track (a photo is never tracked by a job: nothing is cached)."""
    from heygem.face.finder import FaceFinder
    from heygem.face.track import new_track, record

    image_bgr = load_image(info, geometry)
    with FaceFinder(config.face, still_images=True) as finder:
        landmarks = finder.find(image_bgr)
    if landmarks is None:
        raise HeygemError(f"no face was found in {info.path.name}")
    track = new_track(1)
    record(track, 0, landmarks)
    return track, (0, image_bgr)


def keep_track(track: FaceTrack, geometry: FrameGeometry, info: MediaInfo, track_dir: Path) -> None:
    """Write the raw track's arrays and the size they were tracked at into ``track_dir``."""
    track_dir.mkdir(parents=True, exist_ok=True)
    for name in TRACK_ARRAYS:
        np.save(track_dir / f"{name}.npy", np.ascontiguousarray(getattr(track, name)), allow_pickle=False)
    (track_dir / "track.json").write_text(json.dumps(
        {"frames": track.frame_count, "width": geometry.width, "height": geometry.height,
         "fps": info.fps_fraction}, indent=2) + "\n", encoding="utf-8")


def kept_track(track_dir: Path, geometry: FrameGeometry) -> FaceTrack | None:
    """The kept raw track scaled to ``geometry``, or None when there is none (a photo) or it is unreadable."""
    try:
        meta = json.loads((track_dir / "track.json").read_text(encoding="utf-8"))
        arrays = {name: np.load(track_dir / f"{name}.npy", allow_pickle=False) for name in TRACK_ARRAYS}
    except (OSError, ValueError):
        return None
    scale = np.array([geometry.width / meta["width"], geometry.height / meta["height"]], np.float32)
    landmarks = arrays["landmarks"].astype(np.float32) * scale  # (F, 468, 2)
    raw_boxes = arrays["raw_boxes"].astype(np.float32) * np.tile(scale, 2)  # (F, 4)
    return FaceTrack(found=arrays["found"].astype(bool), raw_boxes=raw_boxes, landmarks=landmarks)


def use_for_job(presenter: Presenter, config: Config) -> Path:
    """The face path a job made with ``presenter`` takes (its options must carry the presenter's
    face_index: see :func:`job_options`), after putting the presenter's whole track in the avatar
    cache under the key that job computes from ``config``. HeygemError while it is not ready."""
    if presenter.status != READY:
        detail = f": {presenter.error}" if presenter.error else ""
        raise HeygemError(f"presenter {presenter.name!r} is {presenter.status}{detail}; a job can use it once "
                          "it is ready")
    if presenter.kind == "video" and config.run.avatar_cache:
        info = probe(presenter.clip_path, role="face")
        geometry = working_geometry(info, config.media.output_height)
        key = avatar_cache.avatar_key(presenter.clip_path, config.face, geometry, info.fps_fraction)
        if avatar_cache.load_track(key, info.frame_count) is None:
            track = kept_track(presenter.track_dir, geometry)
            if track is not None:
                avatar_cache.store_track(key, track, whole_video=True)
    return presenter.clip_path


def presenter_job(presenter: Presenter, options: dict | None, resolve_options) -> tuple[Path, dict]:
    """(face path, options) of a job made with ``presenter``: its options (flat) with the presenter's face
    chosen, and its clip, whose track is put in the avatar cache under the key the job's config gives
    (``resolve_options(options) -> (flat options, config)``). HeygemError while it is not ready."""
    options = job_options(presenter, options)
    return use_for_job(presenter, resolve_options(options)[1]), options


def job_options(presenter: Presenter, options: dict | None) -> dict:
    """A job's options (flat dotted keys, or nested by section) with the presenter's face chosen, flat."""
    return {**flatten_options(options), "face.face_index": presenter.face_index}


def write_thumbnail(shown: tuple[int, np.ndarray], track: FaceTrack, path: Path) -> None:
    """A JPEG of the shown frame with the face box (green) and the mouth region (red) drawn."""
    import cv2

    index, frame_bgr = shown
    image = frame_bgr.copy()
    if index < track.frame_count and track.found[index]:
        x1, y1, x2, y2 = (int(round(float(value))) for value in track.raw_boxes[index])
        thickness = max(2, image.shape[0] // 240)
        cv2.rectangle(image, (x1, y1), (x2, y2), (0, 200, 0), thickness)
        mouth = np.asarray(track.landmarks[index], np.float32)[list(MOUTH_RING)]  # (20, 2) pixels
        if np.isfinite(mouth).all():
            cv2.polylines(image, [np.round(mouth).astype(np.int32)], True, (0, 0, 230), thickness)
            mx1, my1 = mouth.min(axis=0)
            mx2, my2 = mouth.max(axis=0)
            cv2.rectangle(image, (int(mx1), int(my1)), (int(mx2), int(my2)), (0, 0, 230), 1)
    if image.shape[0] > THUMBNAIL_HEIGHT:
        width = round(image.shape[1] * THUMBNAIL_HEIGHT / image.shape[0])
        image = cv2.resize(image, (width, THUMBNAIL_HEIGHT), interpolation=cv2.INTER_AREA)
    if not cv2.imwrite(str(path), image, [cv2.IMWRITE_JPEG_QUALITY, 88]):
        raise OSError(f"could not write {path}")


def cut_speech_sample(info: MediaInfo, path: Path) -> float | None:
    """Write the clip's cleanest 5-30 s of speech to ``path`` (WAV, mono, at the cloned voice's rate), chosen
    as a cloned voice chooses its sample (heygem.speech.reference: voiced, not clipped, no music); its length
    in seconds, or None when the clip has no such speech (nothing is written)."""
    import wave

    from heygem.speech.reference import cleanest_speech
    from heygem.speech.tts import pcm16

    try:
        samples, rate = cleanest_speech(info.path)  # (S,) float32 mono
    except HeygemError as error:
        logger.info("presenter: no speech sample (%s)", error)
        return None
    with wave.open(str(path), "wb") as sample:
        sample.setnchannels(1)
        sample.setsampwidth(2)
        sample.setframerate(rate)
        sample.writeframes(pcm16(samples).tobytes())
    return round(len(samples) / rate, 3)
