"""Step 5: a face (or None) for every frame of every batch, as the frames stream past.

The face video's tracking comes from the avatar cache when the same video was tracked before
with the same face options. Otherwise every batch of new source frames is tracked as a run of
its own from a fresh start (heygem.face.finder), several runs at once in tracking processes
(heygem.face.processes) or on threads, and a batch moves on as soon as the boxes of all its frames
are final.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from heygem.config import Config, FaceConfig
from heygem.errors import HeygemError
from heygem.face.detect import FaceDetector
from heygem.face.finder import FinderPool, pool_key
from heygem.face.processes import TrackingProcesses
from heygem.face.processes import pool_key as processes_pool_key
from heygem.face.track import TrackBuilder
from heygem.media.frames import I420Frames
from heygem.media.source import SourceFrames, frames_per_batch
from heygem.runtime.flow import ordered_map
from heygem.runtime.kept import FACE_TRACKERS, KEPT
from heygem.types import FrameBatch, FrameGeometry

logger = logging.getLogger("heygem")


class FaceStage:
    """Step 5: attach a face (or None) to every frame of every batch.

    The face video's tracking comes from the avatar cache when it was tracked before with
    the same options; otherwise each batch of new source frames is tracked as a run from a
    fresh start, several at once (in processes, or on threads with --no-face-processes or the
    S3FD detector, which the threads share), and a batch is passed on once the boxes of all its
    frames are final (box smoothing looks half a window ahead).
    """

    def __init__(self, source: SourceFrames, config: Config, geometry: FrameGeometry, fps_fraction: str,
                 work_dir: Path, detector_checkpoint: Path | None = None, first_frame: int = 0):
        if config.face.detector == "s3fd" and detector_checkpoint is None:
            raise ValueError("--detector s3fd needs its checkpoint (heygem.face.s3fd.require_s3fd_checkpoint)")
        self.source = source
        self.config = config
        self.detector_checkpoint = detector_checkpoint
        self.workers = face_worker_count(config) if not source.is_still else 1
        self.cache_key = None
        self.cache_outcome = "off"
        cached = None
        if not source.is_still and config.run.avatar_cache:
            from heygem.face import avatar_cache

            self.cache_key = avatar_cache.avatar_key(source.info.path, config.face, geometry, fps_fraction)
            cached = avatar_cache.load_track(self.cache_key)  # all it holds: tracked on from its end
            self.cache_outcome = "hit" if cached is not None else "miss"
        complete = cached is not None and cached.covers(source.tracking_capacity)
        # the whole video's track, known before a frame is decoded (heygem.face.turns chooses from it)
        self.whole_track = cached.track if cached is not None and cached.whole_video else None
        self.builder = TrackBuilder(config.face, geometry.width, geometry.height, source.tracking_capacity,
                                    work_dir / "landmarks.npy", track=cached.track if cached else None,
                                    complete=complete)
        self.first_frame = first_frame
        self._pool: FinderPool | None = None
        self._first_new_i420 = None  # the first new source frame tracked, (1, ...) I420
        if complete:
            self.builder.end()
            logger.info("faces: %d frames from the avatar cache", self.builder.tracked)
        elif cached is not None:  # an earlier job, or the parts before this one (heygem.spoken), tracked its start
            self.cache_outcome = "continued"
            logger.info("faces: %d frames from the avatar cache, the rest tracked", self.builder.tracked)

    def run(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        builder = self.builder
        if builder.ended:  # tracked before: everything is known
            for batch in batches:
                yield self._attach(batch)
            return
        if self.workers > 1:
            opencv_on_one_thread()
        self._pool = take_trackers(self.config.face, self.workers, still_images=self.source.is_still,
                                   detector=self._shared_detector(),
                                   processes=self.workers > 1 and tracks_in_processes(self.config))
        ended_well = False
        try:
            if not self.source.is_still and builder.tracked < self.first_frame:  # a later part whose frames
                # before it were not all tracked
                self._catch_up(self.first_frame)
            waiting: deque[FrameBatch] = deque()
            # one batch waiting beyond the workers' (not one per worker): a 1080p batch is tens of MiB, and
            # tracking is not what limits the pipeline (24 s 1080p, 8 trackers, 2 cores, batches of 21 frames:
            # same speed, 0.46 GiB less)
            runs = self._new_runs(batches, builder.tracked)
            last_source = -1
            for batch, start, landmarks in ordered_map(self._track, runs, self.workers, ahead=1):
                if landmarks is not None:
                    builder.add(start, landmarks)
                elif not builder.ended and int(batch.source_indices[0]) <= last_source:
                    self._end_of_video()  # the frames go back: the video has ended and plays backward
                last_source = int(batch.source_indices[-1])
                waiting.append(batch)
                while waiting and builder.is_final(int(waiting[0].source_indices.max())):
                    yield self._attach(waiting.popleft())
            if not builder.ended:
                self._end_of_video()
            while waiting:
                yield self._attach(waiting.popleft())
            ended_well = True
        finally:
            if ended_well:  # its finders are idle and whole: the next job of this process tracks with them
                KEPT.put(FACE_TRACKERS, self._pool.key, self._pool)
            else:
                self._pool.close()

    @staticmethod
    def _new_runs(batches: Iterator[FrameBatch], tracked_until: int = 0) -> Iterator[tuple[FrameBatch, int | None]]:
        """(batch, its first source frame when it brings new ones, else None), in order; the frames
        before ``tracked_until`` are tracked already."""
        for batch in batches:
            if int(batch.source_indices.max()) >= tracked_until:
                yield batch, tracked_until
                tracked_until = int(batch.source_indices.max()) + 1
            else:
                yield batch, None

    def _shared_detector(self) -> FaceDetector | None:
        """S3FD, loaded once per process and shared by the tracking threads; None: each finder's mediapipe."""
        if self.config.face.detector != "s3fd":
            return None
        from heygem.face.s3fd import shared_detector

        engine = self.config.engine
        return shared_detector(self.detector_checkpoint, engine.device, engine.precision)

    def _catch_up(self, until: int) -> None:
        """Track the video's frames from where the track ends to ``until`` (or the video's end), decoded
        anew: a part of a longer output (heygem.spoken) passes over the frames before its first, and the
        avatar cache did not keep (all) the track the parts before made of them."""
        builder = self.builder
        logger.info("faces: tracking source frames %d to %d, which the parts before left untracked",
                    builder.tracked, until)
        runs = self.source.frames_between(builder.tracked, until,
                                          frames_per_batch(self.source.geometry, self.config.media.batch_frames))
        for start, landmarks in ordered_map(lambda run: (run[0], self._pool.track_run(I420Frames(run[1]))), runs,
                                            self.workers, ahead=1):
            builder.add(start, landmarks)
        if builder.tracked < until:  # the video is shorter: this part shows its frames played backward
            self._end_of_video()

    def _track(self, item: tuple[FrameBatch, int | None]) -> tuple[FrameBatch, int | None, list | None]:
        batch, start = item
        if start is None:
            return batch, None, None
        if start < int(batch.source_indices.min()) and not self.source.is_still:
            raise ValueError(f"tracking must go on from frame {start}, the batch starts at "
                             f"{int(batch.source_indices.min())}: a later part needs the track of the parts before")
        new_frames = batch.frames_i420[batch.source_indices >= start]
        if self.source.is_still:
            new_frames = new_frames[:1]
        if self._first_new_i420 is None and len(new_frames):
            self._first_new_i420 = new_frames[:1].copy()  # faces counted there when face_index finds none
        return batch, start, self._pool.track_run(I420Frames(new_frames))

    def _end_of_video(self) -> None:
        builder = self.builder
        builder.end()
        if not builder.any_face:
            self._check_face_index()
            raise HeygemError(f"no face was found in {self.source.info.path.name}: use a photo or video where one "
                              "face is clearly visible, looks at the camera and is not tiny")
        logger.info("faces found in %d of %d source frames", int(builder.track.found[: builder.tracked].sum()),
                    builder.tracked)
        if self.cache_key is not None:
            from heygem.face import avatar_cache

            whole_video = self.source.frame_count is not None and builder.tracked >= self.source.frame_count
            avatar_cache.store_track(self.cache_key, builder.finished_track(), whole_video)

    def _check_face_index(self) -> None:
        """HeygemError saying how many faces there are when face.face_index asks for one past them."""
        index = self.config.face.face_index
        if index is None or self._first_new_i420 is None:
            return
        from heygem.face.finder import count_faces

        found = count_faces(self.config.face, list(I420Frames(self._first_new_i420)), self._shared_detector())[0]
        if 0 < found <= index:
            raise HeygemError(f"face_index {index}: only {found} face{' was' if found == 1 else 's were'} found in "
                              f"{self.source.info.path.name} (counted from 0, left to right): give "
                              f"{'0' if found == 1 else f'0 to {found - 1}'}, or leave it empty for the largest face")

    def _attach(self, batch: FrameBatch) -> FrameBatch:
        batch.faces = [self.builder.face(int(index)) for index in batch.source_indices]
        return batch

def take_trackers(config: FaceConfig, size: int, still_images: bool = False,
                  detector: FaceDetector | None = None, processes: bool = False):
    """The face trackers the last job that ended well left (heygem.runtime.kept), if they were built
    with the same options and all still run, else new ones: a FinderPool, or with ``processes``
    (mediapipe's own detector only) tracking processes (heygem.face.processes.TrackingProcesses)
    with the same interface. Building and closing a job's sixteen mediapipe graphs held the
    interpreter lock for 0.8 s on the 16-core GPU machine while every other stage waited
    (docs/benchmarks.md)."""
    if processes and detector is not None:
        raise ValueError("tracking processes use mediapipe's own detector")
    key = (processes_pool_key(config, size, still_images) if processes
           else pool_key(config, size, still_images, detector))
    pool = KEPT.take(FACE_TRACKERS, key, usable=lambda kept: kept.alive())
    if pool is not None:
        pool.use_options(config)
        return pool
    if processes:
        return TrackingProcesses(config, size, still_images=still_images)
    return FinderPool(config, size, still_images=still_images, detector=detector)


def face_worker_count(config: Config) -> int:
    """Face trackers at once: --face-workers, or when concurrent half the cores, at most 4 processes
    (--face-processes, mediapipe's detector) or 8 threads. Four processes tracked 1080p nearly as
    fast as eight on the 16-core GPU machine with half their memory (docs/benchmarks.md); threads
    take less memory but share the main process's interpreter lock, so more of them help."""
    if not config.run.concurrent:
        return 1
    if config.run.face_workers:
        return config.run.face_workers
    most = 4 if tracks_in_processes(config) else 8
    return max(1, min(most, (os.cpu_count() or 1) // 2))


def tracks_in_processes(config: Config) -> bool:
    """Whether several face trackers run as processes (--face-processes); S3FD is one network on the
    device, shared by tracking threads."""
    return config.run.face_processes and config.face.detector != "s3fd"


def opencv_on_one_thread() -> None:
    """Run OpenCV's calls on the thread that makes them, for the rest of the process.

    The tracking threads are the parallelism: each crops, converts and resizes small images, and
    OpenCV's own pool (a thread per core) only adds threads that wait for work by spinning. On the
    16-core GPU machine, 8 tracking threads spent 15.5-17 ms of CPU per 1080p frame with the pool
    and 8.4-10.1 without it, and tracked 533-566 frames/s instead of 562-658 (docs/benchmarks.md).
    A thread count the user gave OpenCV through ``OPENCV_FOR_THREADS_NUM`` is kept.
    """
    import cv2

    if os.environ.get("OPENCV_FOR_THREADS_NUM") is None and cv2.getNumThreads() != 1:
        cv2.setNumThreads(1)
        logger.debug("faces: OpenCV runs on the calling threads (its own pool is off)")

