"""The workers: threads that claim queued jobs and run them, one at a time each.

:func:`run_job` is the only place a job turns into a call of
:func:`heygem.pipeline.generate`; it records the outcome in the store and
copies the thread's log records into the job's job.log.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from heygem.engines.musetalk import kept_engine_compile
from heygem.errors import GenerationCancelled, HeygemError
from heygem.jobs.files import RESULT_SUBTITLES_NAME, SUBTITLES_NAME, is_disk_full, without_server_paths
from heygem.jobs.speech import keep_speech, kept_text, speak_whole, voice_sample_path
from heygem.jobs.store import CANCELLED, DONE, FAILED, Job, JobStore, job_device, owner_worker, process_owner
from heygem.media.stream import stream_folder
from heygem.runtime import timeline
from heygem.runtime.device import pick_device, worker_devices
from heygem.runtime.kept import KEPT
from heygem.speech.subtitles import add_subtitles, read_srt
from heygem.weights import weights_dir

logger = logging.getLogger("heygem")

PROGRESS_WRITE_INTERVAL = 0.25  # seconds between progress writes within one stage
STOP_POLL_INTERVAL = 0.25  # seconds between cancellation checks
IDLE_POLL_INTERVAL = 1.0  # seconds an idle worker waits before looking for jobs again
DEVICE_NAME = re.compile(r"cpu|cuda(:[0-9]+)?")


class _OneLine(logging.Formatter):
    """A record's time, level and message only: its traceback (from logger.exception) stays in the
    server's own log, as job.log is read by the job's owner."""

    def format(self, record: logging.LogRecord) -> str:
        record.asctime = self.formatTime(record, self.datefmt)
        return f"{record.asctime} {record.levelname} {record.getMessage()}"


SERVER_ONLY = {"server_only": True}  # logger.error(..., extra=SERVER_ONLY): a record kept out of job.log


class _JobLogHandler(logging.FileHandler):
    """Copies the heygem log records of one thread into a job's job.log, one line each."""

    def __init__(self, path: Path):
        super().__init__(path, mode="a", encoding="utf-8")
        self.setFormatter(_OneLine(datefmt="%Y-%m-%d %H:%M:%S"))
        thread_id = threading.get_ident()
        self.addFilter(lambda record: record.thread == thread_id and not getattr(record, "server_only", False))


FINISH_RETRY_SECONDS = (1.0, 2.0, 4.0, 8.0)  # waits between tries to record an outcome the store could not take


def finish_when_the_store_can(store: JobStore, job_id: str, owner: str, status: str, **outcome) -> bool:
    """``store.finish``, tried again while the database cannot write (a full disk, a locked file): the job
    a worker ran is recorded once room is made, instead of showing as running until the server restarts.
    One line per failed try; the last failure is raised (the worker logs it, the next start recovers the job)."""
    for wait in FINISH_RETRY_SECONDS:
        try:
            return store.finish(job_id, owner, status, **outcome)
        except sqlite3.OperationalError as problem:
            logger.warning("job %s: the job store cannot record it %s yet (%s); trying again in %.0f s",
                           job_id, status, problem, wait)
            time.sleep(wait)
    return store.finish(job_id, owner, status, **outcome)


def run_job(store: JobStore, job: Job, owner: str, device: str | None = None,
            generate: Callable | None = None) -> str:
    """Run one claimed job to its end and record the outcome; return the final status.

    ``device`` (e.g. "cuda:1", the worker's) pins the job to one GPU when its
    options leave the device on auto; result.json records the worker and the
    device the job ran with. A HeygemError becomes the job's error message; a full disk
    says so; any other exception is recorded as an unexpected error with its traceback in the server's
    log only (job.log gets one line per record), so the worker can go on with the next job.
    """
    local = generate is None  # the pipeline in this process (else a renderer such as a Ray node's)
    if generate is None:
        from heygem.pipeline import generate

    handler = _JobLogHandler(job.log_path)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    started = time.monotonic()
    try:
        run_on = job_device(job.options, device)
        logger.info("job %s: attempt %d started by %s on %s", job.id, job.attempts, owner, run_on)
        # left by an interrupted attempt
        for stale in (job.result_path, job.summary_path, job.directory / RESULT_SUBTITLES_NAME,
                      job.result_path.with_suffix(".wav")):
            stale.unlink(missing_ok=True)
        shutil.rmtree(stream_folder(job.result_path), ignore_errors=True)
        for stale in job.directory.glob(".*.partial*"):  # an encode's or a summary's unfinished file
            stale.unlink(missing_ok=True)
        for stale in job.directory.glob(".*.parts"):  # a spoken job's parts (heygem.spoken)
            shutil.rmtree(stale, ignore_errors=True)
        overrides = dict(job.options)
        overrides.setdefault("media.stream", True)  # watched while it renders (heygem.jobs.stream)
        # the worker keeps its engine for the next job: a compiled MuseTalk step pays for itself (unless the job or
        # the server's own config says never)
        overrides["engine.musetalk_compile"] = kept_engine_compile(
            overrides.get("engine.musetalk_compile", store.base_config.engine.musetalk_compile))
        timeline.clear()  # the job's start-up marks, logged at its end (times since the server started)
        if run_on != "auto":
            overrides["engine.device"] = run_on

        last_write = {"stage": None, "time": 0.0}

        def report(stage: str, fraction: float) -> None:
            now = time.monotonic()
            if stage != last_write["stage"] or now - last_write["time"] >= PROGRESS_WRITE_INTERVAL:
                last_write.update(stage=stage, time=now)
                store.report_progress(job.id, owner, stage, fraction)

        last_check = {"time": 0.0, "stop": False}

        def should_stop() -> bool:
            now = time.monotonic()
            if now - last_check["time"] >= STOP_POLL_INTERVAL:
                last_check.update(time=now, stop=store.should_stop(job.id, owner))
            return last_check["stop"]

        try:
            kept = kept_text(job.directory)
            if kept is not None and local:  # spoken sentence by sentence while the video is made
                from heygem.spoken import generate_spoken

                summary, speech = generate_spoken(
                    job.face_path, kept["text"], job.result_path, voice=kept["voice"], speed=kept["speed"],
                    max_characters=kept["max_characters"], max_seconds=kept.get("max_seconds"),
                    weights_folder=weights_dir(), overrides=overrides,
                    voice_sample=voice_sample_path(job.directory, kept), progress=report, should_stop=should_stop)
                keep_speech(job.directory, speech, wav_path=job.result_path.with_suffix(".wav"))
            else:
                if kept is not None:
                    speak_whole(job.directory, kept)
                summary = generate(job.face_path, job.audio_path, job.result_path, overrides=overrides,
                                   progress=report, should_stop=should_stop)
                if kept is not None and voice_sample_path(job.directory, kept) is not None and \
                        job.result_path.is_file():  # a cloned voice spoke: the MP4 and its summary say so
                    from heygem.spoken import mark_cloned_voice

                    mark_cloned_voice(job.result_path, job.summary_path)
        except GenerationCancelled:
            logger.info("job %s cancelled after %.1f s", job.id, time.monotonic() - started)
            status, error, engine = CANCELLED, None, None
        except HeygemError as problem:
            logger.error("job %s failed: %s", job.id, problem)
            status, error, engine = FAILED, str(problem), None
        except Exception as problem:
            if is_disk_full(problem):  # the job store or a file could not be written
                logger.warning("job %s: %s", job.id, problem, exc_info=True)  # the traceback: server log only
                error = "the disk is full: the server could not write the job's files; retry it once old jobs " \
                        "are cleaned"
                logger.error("job %s failed: %s", job.id, error)
            else:  # a bug, not the user's input: its traceback goes to the server's log (not to job.log)
                logger.exception("job %s failed with an unexpected error", job.id)
                error = f"unexpected error ({type(problem).__name__}); the server's log has the details"
            status, engine = FAILED, None
        else:
            subtitles = job.directory / SUBTITLES_NAME
            if job.result_path.is_file() and subtitles.is_file():  # made from text: the cues go along
                try:
                    config = store.resolve_options(job.options)[1]
                    mode = add_subtitles(job.result_path, subtitles, read_srt(subtitles), config.text.subtitles,
                                         crf=config.media.crf, preset=config.media.preset,
                                         size=config.text.subtitle_size, position=config.text.subtitle_position)
                    logger.info("job %s: subtitles %s", job.id, {"soft": "added as a track", "burn": "drawn into "
                                "the frames", "none": "left out of the video"}[mode])
                    shutil.copyfile(subtitles, job.directory / RESULT_SUBTITLES_NAME)
                except (HeygemError, OSError) as problem:
                    logger.error("job %s: %s", job.id, problem)
                    job.result_path.unlink(missing_ok=True)
            if job.result_path.is_file():
                status, error, engine = DONE, None, getattr(summary, "engine", None)
                _record_placement(job.summary_path, owner_worker(owner), run_on)
                logger.info("job %s done in %.1f s", job.id, time.monotonic() - started)
            else:
                status, error, engine = FAILED, "the pipeline finished without writing result.mp4; see job.log", None
                logger.error("job %s: %s", job.id, error)
        error = without_server_paths(error, {job.directory: job.id, store.outputs_dir: "outputs",
                                             weights_dir(): "weights"})  # the owner reads it: no server paths
        if not finish_when_the_store_can(store, job.id, owner, status, error=error, engine=engine):
            logger.warning("job %s was cancelled, deleted or taken over while running; its outcome is dropped",
                           job.id)
            current = store.find(job.id)
            return current.status if current is not None else CANCELLED
        return status
    finally:
        logger.removeHandler(handler)
        handler.close()


def _record_placement(summary_path: Path, worker: str, device: str) -> None:
    """Add the worker and the device to the job's result.json (made here when the pipeline wrote none)."""
    partial = summary_path.with_name(f".{summary_path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
        summary.update(worker=worker, device=device)
        partial.write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
        os.replace(partial, summary_path)
    except (OSError, ValueError, AttributeError) as problem:  # the video is there; only the note is missing
        partial.unlink(missing_ok=True)
        logger.warning("could not add the worker and device to %s: %s", summary_path, problem)


class Worker(threading.Thread):
    """Runs queued jobs one at a time, on one device."""

    def __init__(self, store: JobStore, device: str | None = None, *, batch: str | None = None,
                 name: str = "worker-0", generate: Callable | None = None):
        super().__init__(name=f"heygem-{name}", daemon=True)
        self.store = store
        self.device = device
        self.batch = batch
        self.owner = process_owner(name)
        self.generate = generate
        self.current_job_id: str | None = None
        self._stopping = threading.Event()

    def run(self) -> None:
        logger.info("%s started (device %s)", self.name, self.device or "auto")
        while not self._stopping.is_set():
            try:
                self.store.recover_interrupted()
                job = self.store.claim_next(self.owner, batch=self.batch, device=self.device)
            except sqlite3.Error:
                logger.exception("%s: the job store is not reachable; trying again", self.name)
                job = None
            if job is None:
                self.store.job_added.wait(IDLE_POLL_INTERVAL)
                self.store.job_added.clear()
                continue
            self.current_job_id = job.id
            try:
                run_job(self.store, job, self.owner, self.device, generate=self.generate)
            except Exception:  # the store itself failed; the job is recovered on the next start
                logger.exception("%s: could not record job %s", self.name, job.id)
            finally:
                self.current_job_id = None
        # this thread's generator and rendering processes, and the face trackers kept for any next job
        KEPT.release(threading.get_ident())

    def stop(self, wait: float | None = None) -> None:
        """Stop after the current job (cancel it first to stop sooner)."""
        self._stopping.set()
        self.store.job_added.set()
        if wait is not None:
            self.join(wait)


def parse_devices(text: str) -> list[str]:
    """The devices of ``--devices`` ("cuda:0,cuda:1", "cpu,cpu"), one worker each; a device may repeat.

    Raises HeygemError with one line that says what to write instead when an
    entry is not cpu, cuda or cuda:N, or names a GPU this machine does not have.
    """
    entries = [entry.strip().lower() for entry in (text or "").split(",")]
    if not any(entries):
        raise HeygemError("--devices needs at least one device, e.g. --devices cuda:0,cuda:1 or --devices cpu")
    for entry in entries:
        if not DEVICE_NAME.fullmatch(entry):
            shown = repr(entry) if entry else "an empty entry"
            raise HeygemError(f"--devices: {shown} is not a device; list cpu, cuda or cuda:N separated by commas, "
                              "e.g. --devices cuda:0,cuda:1")
    for entry in dict.fromkeys(entries):
        if entry != "cpu":
            try:
                pick_device(entry)
            except HeygemError as problem:
                raise HeygemError(f"--devices lists {entry}, which cannot be used here: {problem}") from None
    return entries


def plan_devices(count: int | None = None, devices: list[str] | None = None) -> list[str | None]:
    """The device of each worker to start (None: the engine picks).

    With ``devices``: one worker each, or ``count`` workers taking them in
    turn. Without: one per GPU when there are several, else one; ``count``
    workers spread over the GPUs when there are several, else on auto.
    """
    if devices:
        if count is None:
            return list(devices)
        if count == 0:
            raise HeygemError("--workers 0 starts no worker here, so --devices has nothing to run on: "
                              "leave one of the two out")
        return [devices[index % len(devices)] for index in range(count)]
    if count is None:
        return worker_devices()
    if count > 1:
        gpus = worker_devices()
        if gpus[0] is not None:
            return [gpus[index % len(gpus)] for index in range(count)]
    return [None] * count


def devices_from_flags(devices: str | None, workers: int | None = None, *, ray: str | None = None,
                       what: str = "job") -> list[str] | None:
    """``--devices`` checked against this machine and against ``--workers``; None when it was not given.
    With ``--ray`` (``ray`` not None) each ``what`` gets one GPU of the cluster: --devices is refused."""
    if ray is not None and devices is not None:
        raise HeygemError(f"--devices is for the workers of this machine; with --ray each {what} gets one GPU of "
                          f"the cluster: leave --devices out")
    if devices is None:
        return None
    names = parse_devices(devices)
    plan_devices(workers, names)
    return names


def start_workers(store: JobStore, count: int | None = None, *, devices: list[str] | None = None,
                  batch: str | None = None, generate: Callable | None = None) -> list[Worker]:
    """Start the workers :func:`plan_devices` gives; they run until the process ends (or are stopped)."""
    planned = plan_devices(count, devices)
    store.recover_interrupted()
    workers = [Worker(store, device, batch=batch, name=f"worker-{index}", generate=generate)
               for index, device in enumerate(planned)]
    for worker in workers:
        worker.start()
    return workers


def warm_up() -> None:
    """Load the heavy libraries before the first job needs them (mediapipe takes seconds to import)."""
    import numpy as np

    from heygem.face.detect import import_mediapipe
    from heygem.speech import audio

    audio.melspectrogram(np.zeros(audio.SAMPLE_RATE // 10, dtype=np.float32))
    import_mediapipe()
