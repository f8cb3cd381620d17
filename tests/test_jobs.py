"""The job store: inputs kept per job, options checked at submission, states, recovery, the worker."""

from __future__ import annotations

import io
import json
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ASSETS, REPO, assert_playable_mp4, run_ffmpeg

from heygem.config import apply_overrides, load_config
from heygem.errors import GenerationCancelled, HeygemError
from heygem.jobs.files import Upload, UploadTooLarge, sanitize_filename
from heygem.jobs.store import CANCELLED, DONE, FAILED, QUEUED, RUNNING, JobStore, process_owner
from heygem.jobs.worker import devices_from_flags, parse_devices, plan_devices, start_workers
from heygem.media.probing import probe


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    """Inputs with awkward names: a 1.2 s speech clip, the portrait, a face-less picture, a corrupt file."""
    folder = tmp_path_factory.mktemp("job inputs")
    speech = folder / "speech 语音.v1.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "1.2", str(speech))
    face = folder / "my face.élan.jpg"
    shutil.copyfile(ASSETS / "astronaut.jpg", face)
    import cv2

    gradient = np.tile(np.linspace(30, 220, 256, dtype=np.uint8)[None, :, None], (256, 1, 3))
    faceless = folder / "no face.png"
    cv2.imwrite(str(faceless), gradient)
    corrupt = folder / "broken.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not really a video" * 20)
    return {"speech": speech, "face": face, "faceless": faceless, "corrupt": corrupt}


def wait_for(store: JobStore, job_ids: list[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(store.get(job_id).is_finished for job_id in job_ids):
            return
        time.sleep(0.2)
    raise AssertionError(f"jobs not finished after {timeout} s: {[store.get(j).to_dict() for j in job_ids]}")


@pytest.mark.parametrize("name, expected", [
    ("my face.jpg", "my face.jpg"),
    ("../../etc/passwd", "passwd"),
    ("C:\\Users\\anna\\clip.final.MP4", "clip.final.MP4"),
    ("语音 录音.wav", "语音 录音.wav"),
    ("..", "face"),
    ("a<b>|c?.png", "a_b_c_.png"),
    (".hidden.wav", "hidden.wav"),
    ("", "face"),
])
def test_sanitize_filename_keeps_readable_names(name, expected):
    assert sanitize_filename(name, fallback="face") == expected


def test_sanitize_filename_limits_length_and_keeps_suffix():
    name = sanitize_filename("é" * 300 + ".mp4", fallback="face")
    assert name.endswith(".mp4") and len(name.encode("utf-8")) <= 120


def test_create_job_keeps_inputs_options_and_queue_order(tmp_path, media):
    store = JobStore(tmp_path / "outputs")
    first = store.create_job(media["face"], media["speech"],
                             {"face": {"pads": [0, 20, 0, 0]}, "media.output_height": 256})
    second = store.create_job(Upload("result.mp4", io.BytesIO(media["face"].read_bytes())), media["speech"], {})
    job = store.get(first)
    assert job.status == QUEUED and job.jobs_ahead == 0 and job.engine == "auto"
    assert sorted(path.name for path in job.directory.iterdir()) == sorted(
        ["my face.élan.jpg", "speech 语音.v1.wav", "options.json", "job.log"])
    assert json.loads((job.directory / "options.json").read_text(encoding="utf-8")) == {
        "face.pads": [0, 20, 0, 0], "media.output_height": 256}
    assert job.face_path.read_bytes() == media["face"].read_bytes()
    other = store.get(second)
    assert other.jobs_ahead == 1 and other.to_dict()["queue_position"] == 2
    assert other.face_name == "face-result.mp4"  # an upload may not take the result's name
    assert [j.id for j in store.list()] == [second, first]
    assert store.counts()[QUEUED] == 2


def test_use_the_face_videos_own_audio(tmp_path, media):
    video = tmp_path / "talk.mp4"
    run_ffmpeg("-loop", "1", "-i", str(media["face"]), "-i", str(media["speech"]), "-vf", "scale=128:128",
               "-t", "1", "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", "-c:a", "aac", str(video))
    store = JobStore(tmp_path / "outputs")
    job = store.get(store.create_job(video, None, {}))
    assert job.audio_name is None and job.audio_path == job.face_path


@pytest.mark.parametrize("options, message", [
    ({"face.padding": 3}, "unknown option face.padding"),
    ({"nonsense": 1}, "unknown option 'nonsense'"),
    ({"media.output_height": "tall"}, "invalid value"),
    ({"engine.name": "magic"}, "--engine must be one of"),
])
def test_bad_options_fail_at_submission_and_leave_nothing(tmp_path, media, options, message):
    store = JobStore(tmp_path / "outputs")
    with pytest.raises(HeygemError, match=message):
        store.create_job(media["face"], media["speech"], options)
    assert store.list() == []
    assert [path.name for path in store.outputs_dir.iterdir() if path.is_dir()] == []


def test_bad_files_fail_at_submission(tmp_path, media):
    store = JobStore(tmp_path / "outputs")
    with pytest.raises(HeygemError, match="broken.mp4"):
        store.create_job(media["corrupt"], media["speech"], {})
    with pytest.raises(HeygemError, match="no sound of its own"):
        store.create_job(media["faceless"], None, {})
    small_limit = JobStore(tmp_path / "outputs", max_upload_bytes=70_000)
    with pytest.raises(UploadTooLarge, match="my face.élan.jpg is larger than the upload limit of 68 kB"):
        small_limit.create_job(media["face"], media["speech"], {})  # the portrait is 75 kB
    with pytest.raises(HeygemError, match="empty"):
        store.create_job(Upload("face.jpg", io.BytesIO(b"")), media["speech"], {})
    assert store.list() == [] and [path for path in store.outputs_dir.iterdir() if path.is_dir()] == []


def test_worker_runs_jobs_records_failures_and_goes_on(tmp_path, media):
    store = JobStore(tmp_path / "outputs")
    good = store.create_job(media["face"], media["speech"], {"media.output_height": 256})
    faceless = store.create_job(media["faceless"], media["speech"], {"media.output_height": 256})
    padded = store.create_job(media["face"], media["speech"], {"media.output_height": 256, "face.pads": [0, 20, 0, 0]})
    workers = start_workers(store, 1)
    try:
        wait_for(store, [good, faceless, padded])
    finally:
        for worker in workers:
            worker.stop(wait=30)
    audio_seconds = probe(media["speech"]).duration
    for job_id in (good, padded):
        job = store.get(job_id)
        assert job.status == DONE and job.progress == 1.0 and job.error is None, job
        assert job.engine in ("landmark", "wav2lip")
        assert_playable_mp4(job.result_path, audio_seconds)
        summary = job.read_summary()
        assert summary["seconds_per_stage"] and job.to_dict()["seconds_per_stage"] == summary["seconds_per_stage"]
        assert "done in" in job.log_path.read_text(encoding="utf-8")
    failed = store.get(faceless)
    assert failed.status == FAILED and "face" in failed.error.lower() and not failed.result_path.exists()
    assert "failed" in failed.log_path.read_text(encoding="utf-8")


def test_a_worker_keeps_its_rendering_processes_between_jobs_and_stops_them_when_it_stops(tmp_path, media,
                                                                                          monkeypatch):
    import multiprocessing


    def rendering_processes() -> set[int]:
        return {process.pid for process in multiprocessing.active_children()}

    monkeypatch.setattr("heygem.engines.landmark.landmark_worker_count", lambda config: 2)
    before = rendering_processes()
    store = JobStore(tmp_path / "outputs")
    options = {"media.output_height": 256, "engine.name": "landmark"}
    workers = start_workers(store, 1)
    try:
        first = store.create_job(media["face"], media["speech"], options)
        wait_for(store, [first])
        kept = rendering_processes() - before
        assert store.get(first).status == DONE and len(kept) == 2
        second = store.create_job(media["face"], media["speech"], options)
        wait_for(store, [second])
        assert store.get(second).status == DONE and rendering_processes() - before == kept
    finally:
        for worker in workers:
            worker.stop(wait=30)
    assert rendering_processes() - before == set()


def never_ending_generate(face_path, audio_path, output_path, *, overrides, progress, should_stop):
    """Stands in for the pipeline where only the job states matter: runs until told to stop."""
    for step in range(600):
        progress("generate", step / 600)
        if should_stop():
            raise GenerationCancelled()
        time.sleep(0.02)
    raise HeygemError("never told to stop")


def test_cancel_retry_delete_and_clean(tmp_path, media):
    store = JobStore(tmp_path / "outputs")
    running = store.create_job(media["face"], media["speech"], {})
    queued = store.create_job(media["face"], media["speech"], {})
    workers = start_workers(store, 1, generate=never_ending_generate)
    try:
        deadline = time.monotonic() + 10
        while store.get(running).status != RUNNING or store.get(running).progress == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert store.get(running).stage == "generate"
        with pytest.raises(HeygemError, match="cancel it first"):
            store.delete(running)
        assert store.cancel(queued).status == CANCELLED
        store.cancel(running)
        wait_for(store, [running], timeout=10)
        assert store.get(running).status == CANCELLED
        assert store.retry(queued).status in (QUEUED, RUNNING)
        with pytest.raises(HeygemError, match="only failed or cancelled"):
            store.retry(queued)
        store.cancel(queued)
        wait_for(store, [queued], timeout=10)
    finally:
        for worker in workers:
            worker.stop(wait=10)
    assert store.clean(older_than_seconds=3600) == []
    store.delete(queued)
    assert store.find(queued) is None and not (store.outputs_dir / queued).exists()
    assert store.clean(older_than_seconds=0) == [running]
    assert store.list() == [] and not (store.outputs_dir / running).exists()
    with pytest.raises(HeygemError, match="no job"):
        store.get(running)


def dead_owner() -> str:
    """An owner string naming a process that has exited."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return process_owner("worker-0").split(":")[0] + f":{int(child.stdout)}:0000:worker-0"


def test_a_job_left_running_by_a_dead_process_runs_again_and_only_once(tmp_path, media):
    store = JobStore(tmp_path / "outputs")
    job_id = store.create_job(media["face"], media["speech"], {})
    gone = dead_owner()
    assert store.claim_next(gone).id == job_id
    alive = process_owner("worker-9")
    assert store.recover_interrupted() == [job_id]
    job = store.get(job_id)
    assert job.status == QUEUED and job.started is None and job.attempts == 1
    assert store.claim_next(alive).id == job_id
    assert store.recover_interrupted() == []  # this process is alive: its job stays running
    assert store.get(job_id).attempts == 2
    assert not store.finish(job_id, gone, DONE)  # the old owner cannot finish it any more
    assert store.should_stop(job_id, gone) and not store.should_stop(job_id, alive)
    assert store.finish(job_id, alive, DONE)
    assert not store.finish(job_id, alive, DONE)
    assert "queued again" in store.get(job_id).log_path.read_text(encoding="utf-8")


def test_a_cancel_asked_before_a_crash_is_honoured(tmp_path, media):
    store = JobStore(tmp_path / "outputs")
    job_id = store.create_job(media["face"], media["speech"], {})
    store.claim_next(dead_owner())
    store.cancel(job_id)
    assert store.recover_interrupted() == [job_id]
    assert store.get(job_id).status == CANCELLED


def test_the_store_is_shared_between_threads(tmp_path, media):
    from concurrent.futures import ThreadPoolExecutor

    store = JobStore(tmp_path / "outputs")
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: store.create_job(media["face"], media["speech"], {}), range(16)))
    assert len(set(ids)) == 16
    positions = sorted(store.get(job_id).jobs_ahead for job_id in ids)
    assert positions == list(range(16))
    owners = [process_owner(f"worker-{index}") for index in range(4)]
    with ThreadPoolExecutor(4) as pool:
        claimed = list(pool.map(lambda owner: [job.id for job in iter(lambda: store.claim_next(owner), None)], owners))
    flat = [job_id for batch in claimed for job_id in batch]
    assert sorted(flat) == sorted(ids)  # every job claimed exactly once


class SlowGeneration:
    """Stands in for the pipeline: takes ``seconds``, records when it ran and with which device, writes a result."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.runs: dict[str, dict] = {}  # job id -> start, end, device
        self.lock = threading.Lock()

    def __call__(self, face_path, audio_path, output_path, *, overrides, progress, should_stop):
        started = time.monotonic()
        while time.monotonic() - started < self.seconds:
            progress("generate", (time.monotonic() - started) / self.seconds)
            if should_stop():
                raise GenerationCancelled()
            time.sleep(0.02)
        output_path.write_bytes(b"not really a video")
        output_path.with_suffix(".json").write_text(json.dumps({"seconds_per_stage": {"generate": self.seconds}}))
        with self.lock:
            self.runs[output_path.parent.name] = {"start": started, "end": time.monotonic(),
                                                  "device": overrides.get("engine.device")}


def run_on_workers(store: JobStore, job_ids: list[str], generation: SlowGeneration, **worker_options) -> list:
    workers = start_workers(store, generate=generation, **worker_options)
    try:
        wait_for(store, job_ids, timeout=30)
    finally:
        for worker in workers:
            worker.stop(wait=10)
    return workers


def test_two_cpu_workers_run_two_jobs_at_the_same_time(tmp_path, media):
    store = JobStore(tmp_path / "outputs")
    job_ids = [store.create_job(media["face"], media["speech"], {}) for _ in range(2)]
    generation = SlowGeneration(seconds=1.5)
    workers = run_on_workers(store, job_ids, generation, devices=parse_devices("cpu,cpu"))
    assert [worker.device for worker in workers] == ["cpu", "cpu"]
    first, second = (generation.runs[job_id] for job_id in job_ids)
    overlap = min(first["end"], second["end"]) - max(first["start"], second["start"])
    assert overlap > 1.0, generation.runs  # they ran side by side, not one after the other
    jobs = [store.get(job_id) for job_id in job_ids]
    assert {job.worker for job in jobs} == {"worker-0", "worker-1"}
    for job in jobs:
        assert job.status == DONE and generation.runs[job.id]["device"] == "cpu" and job.device == "cpu"
        assert job.to_dict()["device"] == "cpu" and job.to_dict()["worker"] == job.worker
        summary = json.loads(job.summary_path.read_text(encoding="utf-8"))
        assert summary == {"seconds_per_stage": {"generate": 1.5}, "worker": job.worker, "device": "cpu"}
        assert f"{job.worker} on cpu" in job.log_path.read_text(encoding="utf-8")


def test_each_job_runs_on_its_workers_device_unless_it_names_one(tmp_path, media):
    # The fake generation touches no GPU, so GPU names work here without one.
    store = JobStore(tmp_path / "outputs")
    own_device = store.create_job(media["face"], media["speech"], {"engine.device": "cpu"})
    others = [store.create_job(media["face"], media["speech"], {}) for _ in range(3)]
    generation = SlowGeneration(seconds=0.3)
    run_on_workers(store, [own_device, *others], generation, devices=["cuda:0", "cuda:1"])
    worker_devices = {"worker-0": "cuda:0", "worker-1": "cuda:1"}
    for job_id in others:
        job = store.get(job_id)
        assert generation.runs[job_id]["device"] == worker_devices[job.worker] == job.device, job
        assert job.read_summary()["device"] == job.device and job.read_summary()["worker"] == job.worker
    job = store.get(own_device)
    assert generation.runs[own_device]["device"] == "cpu" == job.device and job.worker in worker_devices


def test_worker_devices_from_the_flags(monkeypatch):
    assert parse_devices(" cpu, CPU ") == ["cpu", "cpu"]
    for bad in ("gpu0", "cuda:x", "cpu,,cpu", "", "cuda:0;cuda:1"):
        with pytest.raises(HeygemError, match="--devices"):
            parse_devices(bad)
    assert plan_devices(None, ["cuda:0", "cuda:1"]) == ["cuda:0", "cuda:1"]
    assert plan_devices(3, ["cuda:0", "cuda:1"]) == ["cuda:0", "cuda:1", "cuda:0"]
    with pytest.raises(HeygemError, match="--workers 0"):
        plan_devices(0, ["cpu"])
    assert devices_from_flags(None, 0) is None and devices_from_flags("cpu,cpu", 3) == ["cpu", "cpu"]
    # --workers alone: one per GPU, N spread over the GPUs, or on auto without several GPUs.
    monkeypatch.setattr("heygem.jobs.worker.worker_devices", lambda: ["cuda:0", "cuda:1"])
    assert plan_devices() == ["cuda:0", "cuda:1"]
    assert plan_devices(3) == ["cuda:0", "cuda:1", "cuda:0"]
    assert plan_devices(1) == [None]
    monkeypatch.setattr("heygem.jobs.worker.worker_devices", lambda: [None])
    assert plan_devices() == [None] and plan_devices(2) == [None, None] and plan_devices(0) == []


@pytest.mark.parametrize("command", [
    ["-m", "heygem", "jobs", "--jobs-dir", "{outputs}", "work", "--devices", "gpu0"],
    ["-m", "heygem", "batch", "{inputs}", "--output", "{outputs}", "--devices", "cpu,,cpu"],
    ["-m", "heygem", "jobs", "--jobs-dir", "{outputs}", "work", "--devices", "cpu", "--workers", "0"],
    ["app.py", "--outputs", "{outputs}", "--devices", "cuda:x"],
], ids=["jobs-work", "batch", "no-workers", "app"])
def test_a_bad_device_list_is_one_line_and_exit_status_2(command, tmp_path):
    outputs = tmp_path / "outputs"
    arguments = [part.format(outputs=outputs, inputs=tmp_path) for part in command]
    result = subprocess.run([sys.executable, *arguments], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --") and "Traceback" not in result.stderr, result.stderr
    assert "--devices" in lines[0] or "--workers 0" in lines[0]
    assert not outputs.exists()  # refused before anything was started or written


def test_a_job_store_from_before_the_worker_columns_is_upgraded(tmp_path, media):
    store = JobStore(tmp_path / "outputs")
    job_id = store.create_job(media["face"], media["speech"], {})
    store.close()
    db = sqlite3.connect(store.database_path, isolation_level=None)
    columns = [row[1] for row in db.execute("PRAGMA table_info(jobs)") if row[1] not in ("worker", "device")]
    db.executescript(f"CREATE TABLE earlier AS SELECT {', '.join(columns)} FROM jobs; DROP TABLE jobs; "
                     "ALTER TABLE earlier RENAME TO jobs;")
    assert "device" not in [row[1] for row in db.execute("PRAGMA table_info(jobs)")]
    db.close()
    reopened = JobStore(tmp_path / "outputs")
    job = reopened.get(job_id)
    assert job.status == QUEUED and job.worker is None and job.device is None
    claimed = reopened.claim_next(process_owner("worker-3"), device="cuda:1")
    assert (claimed.id, claimed.worker, claimed.device) == (job_id, "worker-3", "cuda:1")
    assert reopened.finish(job_id, process_owner("worker-3"), FAILED, error="stopped here")
    assert reopened.retry(job_id).device is None  # a queued job has not run anywhere yet


def test_limits_refuse_a_job_before_anything_is_written(tmp_path, face_photo, speech_wav, monkeypatch):
    from heygem.jobs.limits import JobLimits, NotEnoughDisk, QueueFull

    store = JobStore(tmp_path / "out", limits=JobLimits(max_queued=1, max_audio_seconds=60, max_output_height=512))
    store.create_job(face_photo, speech_wav)
    with pytest.raises(QueueFull, match="1 jobs are already waiting") as full:
        store.create_job(face_photo, speech_wav)
    assert full.value.retry_after > 0
    short = JobStore(tmp_path / "short", limits=JobLimits(max_audio_seconds=2.0))
    with pytest.raises(HeygemError, match="at most 2 s per job"):
        short.create_job(face_photo, speech_wav)
    tall = JobStore(tmp_path / "tall", limits=JobLimits(max_output_height=256))
    with pytest.raises(HeygemError, match="at most 256"):
        tall.create_job(face_photo, speech_wav)  # the portrait is 512 tall
    tall.create_job(face_photo, speech_wav, {"media.output_height": 256})
    full_disk = JobStore(tmp_path / "disk", limits=JobLimits(min_free_bytes=1 << 60))
    with pytest.raises(NotEnoughDisk, match="nearly full"):
        full_disk.create_job(face_photo, speech_wav)
    for refused in ("short", "disk"):
        assert full_disk.list() == [] and not [p for p in (tmp_path / refused).iterdir() if p.is_dir()]


def test_the_rest_api_answers_429_with_retry_after_and_507(tmp_path, face_photo, speech_wav):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from heygem.jobs.api import create_router
    from heygem.jobs.limits import JobLimits

    def client_for(limits):
        store = JobStore(tmp_path / f"out{id(limits)}", limits=limits)
        return TestClient(FastAPI(routes=create_router(store).routes)), store

    def submit(client):
        return client.post("/api/jobs", files={"face": ("face.jpg", face_photo.read_bytes()),
                                               "audio": ("speech.wav", speech_wav.read_bytes())})

    client, store = client_for(JobLimits(max_queued=1))
    assert submit(client).status_code == 201
    refused = submit(client)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0
    assert "already waiting" in refused.json()["error"] and len(store.list()) == 1
    client, store = client_for(JobLimits(min_free_bytes=1 << 60))
    refused = submit(client)
    assert refused.status_code == 507 and "nearly full" in refused.json()["error"] and store.list() == []


def test_an_upload_that_meets_a_full_disk_is_refused_with_507_and_leaves_nothing(tmp_path, face_photo, speech_wav,
                                                                                 monkeypatch):
    import errno

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from heygem.jobs import files
    from heygem.jobs.api import create_router
    from heygem.jobs.limits import NotEnoughDisk

    real_open = open

    class FullDisk:
        """A file opened for writing on a disk with no room left: every write fails as the kernel says."""

        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exception):
            self.handle.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        return FullDisk(handle) if "b" in mode and ("w" in mode or "x" in mode) else handle

    monkeypatch.setattr(files, "open", open_on_a_full_disk, raising=False)
    store = JobStore(tmp_path / "out")
    with pytest.raises(NotEnoughDisk, match="disk is full"):
        store.create_job(face_photo, speech_wav)
    client = TestClient(FastAPI(routes=create_router(store).routes))
    refused = client.post("/api/jobs", files={"face": ("face.jpg", face_photo.read_bytes()),
                                              "audio": ("speech.wav", speech_wav.read_bytes())})
    assert refused.status_code == 507 and "disk is full" in refused.json()["error"]
    assert store.list() == [] and not [path for path in store.outputs_dir.iterdir() if path.is_dir()]
    monkeypatch.setattr(files, "open", real_open, raising=False)
    assert store.create_job(face_photo, speech_wav)  # the same upload is taken once there is room


def test_an_outcome_the_store_cannot_write_yet_is_recorded_once_it_can(tmp_path, media, monkeypatch, caplog):
    """A full disk can stop SQLite's commit after the job has run: the worker tries again (one line each
    time) and the job ends recorded, not left running until the server restarts."""

    from heygem.jobs import worker as worker_module

    store = JobStore(tmp_path / "outputs")
    job_id = store.create_job(media["face"], media["speech"], {"media.output_height": 256})
    real_finish = JobStore.finish
    tries = []

    def finish_on_the_third_try(self, *args, **kwargs):
        tries.append(args[2])
        if len(tries) < 3:
            raise sqlite3.OperationalError("database or disk is full")
        return real_finish(self, *args, **kwargs)

    monkeypatch.setattr(JobStore, "finish", finish_on_the_third_try)
    monkeypatch.setattr(worker_module, "FINISH_RETRY_SECONDS", (0.01, 0.01, 0.01))
    owner = process_owner("worker-9")
    job = store.claim_next(owner)
    with caplog.at_level("WARNING", logger="heygem"):
        status = worker_module.run_job(store, job, owner)
    assert status == DONE and tries == [DONE, DONE, DONE]
    assert store.get(job_id).status == DONE
    refusals = [record.getMessage() for record in caplog.records if "cannot record" in record.getMessage()]
    assert len(refusals) == 2 and all("database or disk is full" in line for line in refusals)
    assert not any(record.exc_info for record in caplog.records)


def test_an_outcome_the_store_never_takes_is_raised_after_the_last_try(tmp_path, media, monkeypatch):

    from heygem.jobs import worker as worker_module

    store = JobStore(tmp_path / "outputs")
    store.create_job(media["face"], media["speech"], {"media.output_height": 256})

    def never(self, *args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(JobStore, "finish", never)
    monkeypatch.setattr(worker_module, "FINISH_RETRY_SECONDS", (0.01,))
    owner = process_owner("worker-9")
    job = store.claim_next(owner)
    with pytest.raises(sqlite3.OperationalError):
        worker_module.run_job(store, job, owner)


def test_a_workers_jobs_ask_for_the_compiled_musetalk_step_unless_they_say_otherwise(tmp_path, media):
    # a worker keeps its engine for the next job, so --musetalk-compile's auto becomes always; a job's own
    # always or never is kept (the fake generation touches no network)
    seen: dict[str, str] = {}

    def generation(face_path, audio_path, output_path, *, overrides, progress, should_stop):
        seen[output_path.parent.name] = overrides.get("engine.musetalk_compile")
        output_path.write_bytes(b"not really a video")

    store = JobStore(tmp_path / "outputs")
    asked = {store.create_job(media["face"], media["speech"], options): expected for options, expected in (
        ({}, "always"), ({"engine.musetalk_compile": "auto"}, "always"),
        ({"engine.musetalk_compile": "never"}, "never"), ({"engine.musetalk_compile": "always"}, "always"))}
    run_on_workers(store, list(asked), generation, count=1)
    assert seen == asked

    # a server whose own config says never: its jobs keep never unless they ask for always
    seen.clear()
    store = JobStore(tmp_path / "outputs-never", base_config=apply_overrides(load_config(),
                                                                             {"engine.musetalk_compile": "never"}))
    asked = {store.create_job(media["face"], media["speech"], options): expected for options, expected in (
        ({}, "never"), ({"engine.musetalk_compile": "always"}, "always"))}
    run_on_workers(store, list(asked), generation, count=1)
    assert seen == asked
