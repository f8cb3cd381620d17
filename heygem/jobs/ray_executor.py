"""Run the job store's jobs on a Ray cluster instead of on this machine.

The store stays the one source of truth: a dispatcher thread per free slot of
the cluster claims the next queued job, exactly as a local worker does, and
:func:`heygem.jobs.worker.run_job` records its outcome. Only the generation
itself moves: :class:`RayGeneration` (a stand-in for
:func:`heygem.pipeline.generate`) sends the job's input files as bytes through
Ray's object store (nodes need not share a filesystem), runs the pipeline in a
temporary folder on whichever node Ray picks (one GPU per job on a GPU cluster,
``cpus_per_job`` CPUs otherwise), and writes the returned MP4 and summary into
the job's folder. The face video's track travels with it when this machine's avatar cache holds it
(a saved presenter's always does: heygem.presenters.prepare.use_for_job put it there), and the node
puts it into its own cache before the job runs, so the node tracks no face. Progress and stage flow
back through a small actor while the task runs; a cancel in the store cancels the task; a task whose
Ray worker or node dies runs again, a bounded number of times, and the job log says so.

Ray is imported only when one of these functions is called, so the app and
the CLI never load it without ``--ray``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import socket
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from heygem.errors import GenerationCancelled, HeygemError, first_line
from heygem.jobs.files import RESULT_NAME
from heygem.jobs.store import JobStore
from heygem.jobs.worker import SERVER_ONLY, Worker

logger = logging.getLogger("heygem")

LOCAL = "local"  # --ray without an address: start a Ray instance on this machine
WORKER_DEATH_RETRIES = 2  # runs of a job after its Ray worker or node died, on top of the first
POLL_INTERVAL = 0.2  # seconds between looks at a running task (its progress, a cancel in the store)
STOP_POLL_INTERVAL = 0.25  # seconds between the task's own looks for a stop request
CONNECT_TIMEOUT = 5.0  # seconds to wait for a given cluster address to answer
CANCEL_GRACE = 20.0  # seconds a cancelled task may take to stop before its worker process is killed
# Ray's errors for a task that died with its process or node, not because of the job (names, as some
# exist only in some Ray versions)
WORKER_DEATH_ERRORS = ("WorkerCrashedError", "NodeDiedError", "LocalRayletDiedError", "RayActorError",
                       "ObjectLostError", "OwnerDiedError", "OutOfMemoryError")


def import_ray():
    """The ray module, or a HeygemError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise HeygemError("--ray needs Ray on this machine and on every node: pip install ray") from None
    return ray


def add_ray_flag(parser: argparse.ArgumentParser, what: str = "jobs", help: str | None = None) -> None:
    """``--ray [ADDRESS]``: left out, Ray is not used; without an address, a local instance starts."""
    where = ("'auto' joins the cluster this machine belongs to, HOST:6379 joins that one, no value starts one on "
             "this machine")
    parser.add_argument("--ray", nargs="?", const=LOCAL, default=None, metavar="ADDRESS",
                        help=f"{help}: {where}" if help else
                        f"run the {what} on a Ray cluster instead of local workers, one GPU each (CPUs on a "
                        f"cluster without GPUs; pip install ray): {where}")


def connect(address: str | None = LOCAL) -> None:
    """Join the Ray cluster at ``address`` ("auto", "HOST:PORT") or start a local one (None or "local").

    Does nothing when this process is connected already. The workers' own
    output stays in Ray's logs on each node (the heygem log records of a job
    come back into its job.log), so it does not run through the terminal.
    """
    ray = import_ray()
    if ray.is_initialized():
        return
    try:
        if address in (None, "", LOCAL):
            ray.init(log_to_driver=False)
        else:
            _check_reachable(address)
            ray.init(address=address, log_to_driver=False)
    except ConnectionError as problem:
        raise HeygemError(f"cannot join the Ray cluster at {address} ({first_line(problem).rstrip('.')}): start "
                          "it with `ray start --head`, or give --ray no address to start one here") from None
    resources = ray.cluster_resources()
    logger.info("Ray cluster: %d node(s), %g CPU(s), %g GPU(s)", len(alive_nodes()),
                resources.get("CPU", 0), resources.get("GPU", 0))


def _check_reachable(address: str) -> None:
    """A HOST:PORT nobody answers at is a one-line error now (Ray itself keeps trying for minutes)."""
    host, colon, port = address.rpartition(":")
    if address == "auto" or "://" in address or not colon or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as problem:
        raise HeygemError(f"nothing answers at {address} ({problem.strerror or problem}): start the head node "
                          "there with `ray start --head`, or check the address and port (6379 by default)") from None


def alive_nodes() -> list[dict]:
    """Ray's description of each node that is up (NodeID, NodeManagerAddress, NodeManagerHostname, ...)."""
    return [node for node in import_ray().nodes() if node.get("Alive")]


def cluster_slots(cpus_per_job: int = 1) -> tuple[int, bool]:
    """How many jobs the cluster runs at once, and whether each gets a GPU (one per GPU, else by CPUs)."""
    resources = import_ray().cluster_resources()
    gpus = int(resources.get("GPU", 0))
    if gpus:
        return gpus, True
    return max(1, int(resources.get("CPU", 1)) // max(1, cpus_per_job)), False


# ---------------------------------------------------------------------------- on the nodes


class _ProgressChannel:
    """A Ray actor between running tasks and the dispatcher: the latest stage of each, and stop requests."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[str, float]] = {}
        self.stopping: set[str] = set()

    def report(self, key: str, stage: str, fraction: float) -> None:
        self.latest[key] = (stage, fraction)

    def take(self, key: str) -> tuple[str, float] | None:
        return self.latest.pop(key, None)

    def stop(self, key: str) -> None:
        self.stopping.add(key)

    def should_stop(self, key: str) -> bool:
        return key in self.stopping

    def forget(self, key: str) -> None:
        self.latest.pop(key, None)
        self.stopping.discard(key)


class _RecordList(logging.Handler):
    """Keeps the heygem log records of a task, to be written into the job's job.log by the dispatcher."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


def generate_on_node(key: str, channel, face_name: str, face_bytes: bytes, audio_name: str | None,
                     audio_bytes: bytes | None, overrides: dict, generate: Callable | None = None,
                     face_track: dict | None = None) -> dict:
    """The Ray task: write the inputs into a temporary folder, run the pipeline there, return what it made.
    ``face_track``: the face video's track from the dispatcher's avatar cache (:func:`cached_face_track`),
    stored in this node's cache first.

    Returns {"outcome": "done" | "cancelled" | "failed" | "error", "result": MP4 bytes or None,
    "summary": result.json's text or None, "engine", "error", "traceback", "node", "folder" (the
    temporary one), "log": [(level, line)]}.
    ``audio_name`` None means the face file carries the speech.
    """
    import ray

    if generate is None:
        from heygem.pipeline import generate
    records = _RecordList()
    logger.addHandler(records)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    last = {"report": 0.0, "stage": None, "check": 0.0, "stop": False}

    def progress(stage: str, fraction: float) -> None:
        now = time.monotonic()
        if stage != last["stage"] or now - last["report"] >= POLL_INTERVAL:
            last.update(stage=stage, report=now)
            channel.report.remote(key, stage, fraction)

    def should_stop() -> bool:
        now = time.monotonic()
        if now - last["check"] >= STOP_POLL_INTERVAL:
            last.update(check=now, stop=ray.get(channel.should_stop.remote(key)))
        return last["stop"]

    outcome: dict[str, Any] = {"result": None, "summary": None, "engine": None, "error": None, "traceback": None,
                               "node": ray.util.get_node_ip_address()}
    try:
        with tempfile.TemporaryDirectory(prefix="heygem-ray-") as folder:
            outcome["folder"] = folder
            face_path = Path(folder) / face_name
            face_path.write_bytes(face_bytes)
            audio_path = face_path
            if audio_name is not None:
                audio_path = Path(folder) / audio_name
                audio_path.write_bytes(audio_bytes)
            result_path = Path(folder) / RESULT_NAME
            if face_track is not None:
                keep_face_track(face_track)
            try:
                summary = generate(face_path, audio_path, result_path, overrides=overrides, progress=progress,
                                   should_stop=should_stop)
            except GenerationCancelled:
                outcome["outcome"] = "cancelled"
            except HeygemError as problem:
                outcome.update(outcome="failed", error=str(problem))
            except Exception as problem:  # a bug: its traceback goes back for the job log
                outcome.update(outcome="error", error=f"{type(problem).__name__}: {problem}",
                               traceback=traceback.format_exc())
            else:
                summary_path = result_path.with_suffix(".json")
                outcome.update(outcome="done", engine=getattr(summary, "engine", None),
                               result=result_path.read_bytes() if result_path.is_file() else None,
                               summary=summary_path.read_text(encoding="utf-8") if summary_path.is_file() else None)
    finally:
        logger.removeHandler(records)
    outcome["log"] = records.lines
    return outcome


def keep_face_track(face_track: dict) -> None:
    """Store a track sent with a job (:func:`cached_face_track`) in this node's avatar cache."""
    from heygem.face import avatar_cache
    from heygem.face.track import FaceTrack

    track = FaceTrack(found=face_track["found"], raw_boxes=face_track["raw_boxes"], landmarks=face_track["landmarks"])
    avatar_cache.store_track(face_track["key"], track, face_track["whole_video"])


# ---------------------------------------------------------------------------- on the dispatcher


def cached_face_track(face_path: Path, overrides: dict) -> dict | None:
    """The face video's raw track from this machine's avatar cache, under the key the job computes from
    ``overrides`` (a saved presenter's is there: heygem.presenters.prepare.use_for_job), to travel with the
    job: {"key", "whole_video", "found", "raw_boxes", "landmarks"}; None for a photo, with the cache
    off, or when nothing is cached (the node tracks the face)."""
    import numpy as np

    from heygem.config import apply_overrides, load_config
    from heygem.face import avatar_cache
    from heygem.media.probing import probe, working_geometry

    try:
        config = apply_overrides(load_config(), overrides)
        if not config.run.avatar_cache:
            return None
        info = probe(face_path, role="face")
        if info.kind != "video":
            return None
        geometry = working_geometry(info, config.media.output_height)
        key = avatar_cache.avatar_key(face_path, config.face, geometry, info.fps_fraction)
    except (HeygemError, OSError, ValueError):  # the node says what is wrong with the job
        return None
    cached = avatar_cache.load_track(key)
    if cached is None:
        return None
    track = cached.track
    return {"key": key, "whole_video": cached.whole_video, "found": np.array(track.found),
            "raw_boxes": np.array(track.raw_boxes), "landmarks": np.array(track.landmarks)}


class RemoteFailure(Exception):
    """An unexpected error inside a Ray task (its traceback is in the server's log)."""


@functools.cache
def _remote(function: Callable):
    """``function`` as a Ray remote function (made once per process, after ray is imported).

    max_calls 0: a Ray worker process runs task after task and so keeps its engine loaded between
    jobs; Ray's default for tasks that ask for a GPU is a fresh process per task, which would pay
    the imports and the engine's loading for every job."""
    return import_ray().remote(max_calls=0)(function)


class RayGeneration:
    """Has the signature of :func:`heygem.pipeline.generate`, and runs it as a Ray task.

    ``generate`` replaces the pipeline inside the task (it is pickled to the
    nodes); ``retries`` is how many times a job runs again after its Ray
    worker or node died.
    """

    def __init__(self, channel, *, use_gpu: bool, cpus_per_job: int = 1, retries: int = WORKER_DEATH_RETRIES,
                 generate: Callable | None = None):
        self.channel = channel
        self.use_gpu = use_gpu
        self.cpus_per_job = cpus_per_job
        self.retries = retries
        self.generate = generate

    def __call__(self, face_path: Path, audio_path: Path, output_path: Path, *, overrides: dict | None = None,
                 progress: Callable[[str, float], None] | None = None,
                 should_stop: Callable[[], bool] | None = None):
        ray = import_ray()
        face_path, audio_path, output_path = Path(face_path), Path(audio_path), Path(output_path)
        job_id = output_path.parent.name
        overrides = dict(overrides or {})
        if self.use_gpu and str(overrides.get("engine.device", "")).startswith("cuda"):
            overrides["engine.device"] = "cuda"  # the one GPU Ray gives the task, whichever it is on its node
        face_ref = ray.put(face_path.read_bytes())
        same_file = audio_path.resolve() == face_path.resolve()
        audio_ref = None if same_file else ray.put(audio_path.read_bytes())
        face_track = cached_face_track(face_path, overrides)
        track_ref = ray.put(face_track) if face_track is not None else None
        options = {"max_retries": 0, "num_gpus": 1 if self.use_gpu else 0, "num_cpus": self.cpus_per_job}
        task = _remote(generate_on_node).options(**options)
        death_errors = tuple(getattr(ray.exceptions, name) for name in WORKER_DEATH_ERRORS
                             if hasattr(ray.exceptions, name))
        runs = 1 + self.retries
        for attempt in range(1, runs + 1):
            if attempt > 1:
                logger.warning("job %s retried after the Ray worker died (attempt %d of %d)", job_id, attempt, runs)
            key = uuid.uuid4().hex
            reference = task.remote(key, self.channel, face_path.name, face_ref,
                                    None if same_file else audio_path.name, audio_ref, overrides, self.generate,
                                    track_ref)
            try:
                outcome = self._wait(ray, reference, key, progress, should_stop)
            except death_errors as problem:
                logger.warning("job %s: the Ray worker running it died (%s)", job_id, first_line(problem))
                if attempt == runs:
                    raise HeygemError(f"the Ray worker running this job died {runs} times; see job.log") from None
                continue
            finally:
                self.channel.forget.remote(key)
            return self._take(outcome, job_id, output_path)
        raise AssertionError("unreachable")

    def _wait(self, ray, reference, key: str, progress, should_stop) -> dict:
        """Follow the task to its end: relay its progress, cancel it when the store says stop."""
        cancelled_at = None
        while True:
            ready, _ = ray.wait([reference], timeout=POLL_INTERVAL)
            try:
                latest = ray.get(self.channel.take.remote(key))
            except ray.exceptions.RayError:  # no progress this time; the task itself decides the outcome
                latest = None
            if latest is not None and progress is not None:
                progress(*latest)
            if ready:
                try:
                    return ray.get(reference)
                except ray.exceptions.TaskCancelledError:
                    raise GenerationCancelled() from None
                except ray.exceptions.RayError:
                    if cancelled_at is not None:  # killed because it did not stop in time
                        raise GenerationCancelled() from None
                    raise
            if cancelled_at is None and should_stop is not None and should_stop():
                cancelled_at = time.monotonic()
                self.channel.stop.remote(key)
                ray.cancel(reference)
            elif cancelled_at is not None and time.monotonic() - cancelled_at > CANCEL_GRACE:
                ray.cancel(reference, force=True)
                cancelled_at = float("inf")  # forced once

    @staticmethod
    def _take(outcome: dict, job_id: str, output_path: Path):
        """Write the task's log, result and summary here; raise what the pipeline raised there."""
        logger.info("job %s ran on the Ray node %s", job_id, outcome.get("node"))
        for level, line in outcome.get("log", []):
            logger.log(level, "%s", line)
        if outcome["outcome"] == "cancelled":
            raise GenerationCancelled()
        if outcome["outcome"] == "failed":
            raise HeygemError(outcome["error"])
        if outcome["outcome"] == "error":
            logger.error("the traceback on the node:\n%s", outcome["traceback"], extra=SERVER_ONLY)
            raise RemoteFailure(outcome["error"])
        if outcome["summary"] is not None:
            summary = _moved(json.loads(outcome["summary"]), outcome["folder"], output_path.parent)
            output_path.with_suffix(".json").write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
        if outcome["result"] is not None:
            _write_atomically(output_path, outcome["result"])
        return argparse.Namespace(engine=outcome["engine"])


def _moved(summary: dict, node_folder: str, job_folder: Path) -> dict:
    """The summary with the paths of files in the node's temporary folder made the job folder's."""
    prefix = node_folder.rstrip("/") + "/"
    return {key: str(job_folder / value[len(prefix):]) if isinstance(value, str) and value.startswith(prefix)
            else value for key, value in summary.items()}


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        partial.write_bytes(data)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def start_ray_workers(store: JobStore, address: str | None = LOCAL, *, batch: str | None = None,
                      cpus_per_job: int = 1, retries: int = WORKER_DEATH_RETRIES,
                      generate: Callable | None = None) -> list[Worker]:
    """Join (or start) the cluster and start one dispatching worker per job the cluster can run at once.

    The workers claim jobs from ``store`` (of ``batch`` only, if given) like
    local ones and stop like them (:meth:`Worker.stop`); ``generate`` replaces
    the pipeline inside the tasks (tests).
    """
    connect(address)
    ray = import_ray()
    slots, use_gpu = cluster_slots(cpus_per_job)
    channel = ray.remote(num_cpus=0)(_ProgressChannel).remote()
    generation = RayGeneration(channel, use_gpu=use_gpu, cpus_per_job=cpus_per_job, retries=retries,
                               generate=generate)
    store.recover_interrupted()
    workers = [Worker(store, "cuda" if use_gpu else "cpu", batch=batch, name=f"ray-{index}", generate=generation)
               for index in range(slots)]
    for worker in workers:
        worker.start()
    logger.info("%d Ray worker(s) take jobs from %s, %s each", slots, store.outputs_dir,
                "one GPU" if use_gpu else f"{cpus_per_job} CPU(s)")
    return workers


def run_on_every_node(function: Callable, *args) -> list[tuple[dict, Any]]:
    """Run ``function(*args)`` once on each alive node, pinned there; return (node, result) pairs.

    A node where the call fails gives the exception as its result.
    """
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = _remote(function)
    nodes = alive_nodes()
    references = [remote.options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        node["NodeID"], soft=False)).remote(*args) for node in nodes]
    results = []
    for node, reference in zip(nodes, references):
        try:
            results.append((node, ray.get(reference)))
        except ray.exceptions.RayError as problem:
            results.append((node, problem))
    return results
