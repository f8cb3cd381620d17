"""Jobs from the store run as Ray tasks on a local cluster: results, progress, a dead worker, cancel, batch."""

from __future__ import annotations

import csv
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ASSETS, REPO, assert_playable_mp4, decode_frames, run_ffmpeg, write_tight_face_photo

from heygem.jobs.store import CANCELLED, DONE, RUNNING, JobStore
from heygem.media.probing import probe

ray = pytest.importorskip("ray")

from heygem.jobs.batch import run_batch  # noqa: E402
from heygem.jobs.ray_executor import start_ray_workers  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """One local Ray instance with two CPUs for the whole module."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("ray inputs")
    speech = folder / "speech 1.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "1.2", str(speech))
    face = folder / "face.jpg"
    shutil.copyfile(ASSETS / "astronaut.jpg", face)
    video = folder / "talking.mp4"  # carries its own speech
    run_ffmpeg("-loop", "1", "-i", str(face), "-i", str(speech), "-vf", "scale=320:240,format=yuv420p",
               "-r", "25", "-t", "1.2", "-c:v", "libx264", "-preset", "ultrafast", "-c:a", "aac", "-shortest",
               str(video))
    tight = write_tight_face_photo(folder / "tight.png")  # a small photo the face fills
    return {"speech": speech, "face": face, "video": video, "tight": tight}


def follow(store: JobStore, job_ids: list[str], timeout: float = 180.0) -> set[str]:
    """Wait until every job is finished; return the stages seen while they ran."""
    stages = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = [store.get(job_id) for job_id in job_ids]
        stages |= {job.stage for job in jobs if job.status == RUNNING}
        if all(job.is_finished for job in jobs):
            return stages
        time.sleep(0.1)
    raise AssertionError(f"jobs not finished after {timeout} s: {[store.get(j).to_dict() for j in job_ids]}")


def stop(workers) -> None:
    for worker in workers:
        worker.stop(wait=30)


def test_jobs_from_the_store_run_as_ray_tasks(tmp_path, media):
    store = JobStore(tmp_path / "outputs")
    options = {"media.output_height": 256, "engine.name": "landmark"}
    photo = store.create_job(media["face"], media["speech"], options)
    own_audio = store.create_job(media["video"], None, options)
    interrupted = store.create_job(media["face"], media["speech"], options)
    tight = store.create_job(media["tight"], media["speech"], {"engine.name": "landmark"})
    # The first one was running in an app that was killed: the next start queues it again.
    finished_process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                      text=True, check=True)
    assert store.claim_next(f"{socket.gethostname()}:{finished_process.stdout.strip()}:0:ray-0").id == photo
    assert store.get(photo).status == RUNNING
    workers = start_ray_workers(store)
    try:
        stages = follow(store, [photo, own_audio, interrupted, tight])
    finally:
        stop(workers)
    assert [worker.name for worker in workers] == ["heygem-ray-0", "heygem-ray-1"]  # two CPUs: two at once
    assert stages & {"prepare", "generate", "finish"}, stages  # the pipeline's stages came back while they ran
    audio_seconds = probe(media["speech"]).duration
    tight_job = store.get(tight)
    assert tight_job.status == DONE, tight_job.error
    assert_playable_mp4(tight_job.result_path, audio_seconds)
    assert json.loads(tight_job.summary_path.read_text(encoding="utf-8"))["frames_without_face"] == 0
    for job_id in (photo, own_audio, interrupted):
        job = store.get(job_id)
        assert job.status == DONE and job.progress == 1.0 and job.engine == "landmark", job
        assert job.worker.startswith("ray-") and job.device == "cpu"
        assert_playable_mp4(job.result_path, audio_seconds)
        info = probe(job.result_path)
        frames = decode_frames(job.result_path)
        assert frames.shape == (info.frame_count, 256, info.width, 3) and info.frame_count >= 25
        assert frames.std() > 10  # a picture, not a blank
        summary = json.loads(job.summary_path.read_text(encoding="utf-8"))
        assert summary["seconds_per_stage"] and summary["worker"] == job.worker and summary["device"] == "cpu"
        assert summary["output_path"] == str(job.result_path) and summary["face_path"] == str(job.face_path)
        assert summary["audio_path"] == str(job.audio_path) and summary["frames"] == info.frame_count
        log = job.log_path.read_text(encoding="utf-8")
        assert "ran on the Ray node" in log and log.count("done in") == 1
        assert not list(job.directory.glob(".*partial"))
    assert "queued again" in store.get(photo).log_path.read_text(encoding="utf-8")
    assert store.get(photo).attempts == 2


def test_a_job_whose_ray_worker_dies_runs_again_and_completes_once(tmp_path, media):
    store = JobStore(tmp_path / "outputs")
    marker = tmp_path / "kill the first attempt"
    marker.write_text("", encoding="utf-8")
    marker_path = str(marker)

    def dying_generate(face_path, audio_path, output_path, *, overrides, progress, should_stop):
        import os
        import signal

        from heygem.pipeline import generate

        def progress_then_die(stage, fraction):
            progress(stage, fraction)
            if stage == "generate" and fraction > 0.3 and os.path.exists(marker_path):
                os.unlink(marker_path)
                os.kill(os.getpid(), signal.SIGKILL)  # the Ray worker process dies mid-run

        return generate(face_path, audio_path, output_path, overrides=overrides, progress=progress_then_die,
                        should_stop=should_stop)

    job_id = store.create_job(media["face"], media["speech"], {"media.output_height": 256})
    workers = start_ray_workers(store, generate=dying_generate)
    try:
        follow(store, [job_id])
    finally:
        stop(workers)
    job = store.get(job_id)
    assert job.status == DONE and job.attempts == 1 and not marker.exists(), job
    assert_playable_mp4(job.result_path, probe(media["speech"]).duration)
    log = job.log_path.read_text(encoding="utf-8")
    assert "retried after the Ray worker died (attempt 2 of 3)" in log, log
    assert "attempt 3 of 3" not in log
    assert log.count("ran on the Ray node") == 1 and log.count("done in") == 1


def test_cancel_in_the_store_stops_the_ray_task(tmp_path, media):
    store = JobStore(tmp_path / "outputs")
    started, ended = tmp_path / "started", tmp_path / "ended"
    started_path, ended_path = str(started), str(ended)

    def endless_generate(face_path, audio_path, output_path, *, overrides, progress, should_stop):
        import time as clock
        from pathlib import Path as FilePath

        progress("engine", 0.0)  # reported at once (a new stage), before the loop
        FilePath(started_path).write_text("", encoding="utf-8")
        try:
            # Never looks at should_stop: only ray.cancel can end it early. Nothing but Python's own sleep runs
            # here, so the interrupt always lands in the test's code, never in Ray's (a progress message).
            for _ in range(6000):  # ten minutes
                clock.sleep(0.1)
        except BaseException as interruption:
            FilePath(ended_path).write_text(type(interruption).__name__, encoding="utf-8")
            raise
        FilePath(ended_path).write_text("finished", encoding="utf-8")

    job_id = store.create_job(media["face"], media["speech"], {})
    workers = start_ray_workers(store, generate=endless_generate)
    try:
        deadline = time.monotonic() + 300  # a bound for a loaded machine, not a measurement
        while not (started.exists() and store.get(job_id).stage == "engine") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.get(job_id).status == RUNNING and started.exists()
        store.cancel(job_id)
        follow(store, [job_id], timeout=300)  # well before the task's own end
    finally:
        stop(workers)
    job = store.get(job_id)
    assert job.status == CANCELLED and not job.result_path.exists(), job
    assert ended.read_text(encoding="utf-8") == "KeyboardInterrupt"  # ray.cancel interrupted the task
    assert "cancelled after" in job.log_path.read_text(encoding="utf-8")


def test_batch_over_ray_gives_the_same_summary(tmp_path):
    import cv2

    folder = tmp_path / "batch"
    folder.mkdir()
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "1.2", str(folder / "anna.wav"))
    shutil.copyfile(ASSETS / "astronaut.jpg", folder / "anna.jpg")
    shutil.copyfile(ASSETS / "astronaut.jpg", folder / "bé 2.jpg")
    shutil.copyfile(folder / "anna.wav", folder / "bé 2.wav")
    gradient = np.tile(np.linspace(30, 220, 256, dtype=np.uint8)[None, :, None], (256, 1, 3))
    cv2.imwrite(str(folder / "blank.png"), gradient)  # no face: fails inside the pipeline
    shutil.copyfile(folder / "anna.wav", folder / "blank.wav")
    shutil.copyfile(folder / "anna.wav", folder / "lonely.wav")  # no face at all: fails while planning

    summaries = {}
    for where, address in (("local", None), ("ray", "local")):
        output = tmp_path / f"out {where}"
        results = run_batch(folder, output, "stem", {"media.output_height": 256}, jobs_dir=tmp_path / f"jobs {where}",
                            show_progress=False, ray_address=address)
        assert {result.item.name: result.status for result in results} == {
            "anna": "done", "bé 2": "done", "blank": "failed", "lonely": "failed"}
        with open(output / "summary.csv", newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        summaries[where] = rows
        for name in ("anna", "bé 2"):
            assert_playable_mp4(output / f"{name}.mp4", probe(folder / "anna.wav").duration)
            assert json.loads((output / f"{name}.json").read_text(encoding="utf-8"))["seconds_per_stage"]
    assert {row["name"]: row["device"] for row in summaries["ray"]} == {
        "anna": "cpu", "bé 2": "cpu", "blank": "cpu", "lonely": ""}  # lonely never became a job

    def comparable(rows):  # timing, job ids and the device name differ by nature
        return [{key: value for key, value in row.items() if key not in ("seconds", "job_id", "device")}
                for row in rows]

    assert comparable(summaries["ray"]) == comparable(summaries["local"])
    local_frames = decode_frames(tmp_path / "out local" / "anna.mp4")
    ray_frames = decode_frames(tmp_path / "out ray" / "anna.mp4")
    assert local_frames.shape == ray_frames.shape


def test_without_ray_the_app_and_a_job_never_import_it(tmp_path, media):
    code = (
        "import sys, app, heygem.cli, heygem.jobs.batch, heygem.doctor, heygem.jobs.ray_executor\n"
        "from heygem.jobs.store import JobStore\nfrom heygem.jobs.worker import start_workers\n"
        "heygem.cli.build_parser(); app.parse_args([])\n"
        f"store = JobStore({str(tmp_path / 'outputs')!r})\n"
        f"job_id = store.create_job({str(media['face'])!r}, {str(media['speech'])!r}, {{'media.output_height': 128}})\n"
        "workers = start_workers(store, 1)\n"
        "import time\n"
        "while not store.get(job_id).is_finished: time.sleep(0.1)\n"
        "assert store.get(job_id).status == 'done', store.get(job_id)\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("arguments, message", [
    (["batch", "IN", "-o", "OUT", "--ray", "--devices", "cpu"],
     "error: --devices is for the workers of this machine; with --ray each item gets one GPU of the cluster: "
     "leave --devices out"),
    (["doctor", "--ray", "127.0.0.1:1"],
     "error: nothing answers at 127.0.0.1:1 (Connection refused): start the head node there with `ray start "
     "--head`, or check the address and port (6379 by default)"),
])
def test_ray_flag_mistakes_are_one_line_and_exit_status_2(tmp_path, arguments, message):
    arguments = [str(tmp_path / argument) if argument in ("IN", "OUT") else argument for argument in arguments]
    result = subprocess.run([sys.executable, "-m", "heygem", *arguments], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [message], result.stderr


def test_the_doctor_reports_each_node(capsys):
    from heygem import doctor

    assert doctor.main_on_cluster("auto", as_json=True) == 0  # joined already: the module's cluster
    nodes = json.loads(capsys.readouterr().out)
    assert [node["node"] for node in nodes] == [ray.util.get_node_ip_address()]
    report = nodes[0]["report"]
    assert {"packages", "torch", "ffmpeg", "mediapipe", "weights", "engine"} <= {
        check["section"] for check in report["checks"]}
    assert report["exit_code"] == nodes[0]["exit_code"] == 0 and report["benchmark"]["ran"] is False

    assert doctor.main_on_cluster("auto") == 0
    text = capsys.readouterr().out
    assert text.startswith(f"=== node {nodes[0]['node']} ") and "\nmediapipe\n" in text
    assert text.rstrip().endswith("1 of 1 node ready")
