"""The REST API against a live `python app.py` on a free port, plus a hard kill and restart."""

from __future__ import annotations

import base64
import io
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import ASSETS, add_piper_voice, assert_playable_mp4, run_ffmpeg
from faults import Server  # the fault script's `python app.py` on a free port

from heygem.media.probing import probe

OPTIONS = {"media.output_height": 256}


class LiveApp(Server):
    """`python app.py` in a subprocess, on a free port, with its own outputs folder."""

    def __init__(self, outputs: Path, *extra_args: str, env: dict | None = None):
        super().__init__(outputs, outputs.parent / f"app-{outputs.name}-{time.monotonic_ns()}.log",
                         extra_args=extra_args, env=env)

    def submit(self, face: Path, audio: Path | None, options: dict | None = None, face_name: str | None = None):
        files = {"face": (face_name or face.name, face.read_bytes())}
        if audio is not None:
            files["audio"] = (audio.name, audio.read_bytes())
        data = {"options": json.dumps(options if options is not None else OPTIONS)}
        return self.client.post("/api/jobs", files=files, data=data)

    def wait_finished(self, job_ids: list[str], timeout: float = 180) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = {job_id: self.client.get(f"/api/jobs/{job_id}").json() for job_id in job_ids}
            if all(job["status"] in ("done", "failed", "cancelled") for job in jobs.values()):
                return jobs
            time.sleep(0.3)
        raise AssertionError(f"not finished in {timeout} s: {jobs}")


@pytest.fixture(scope="module")
def speech_clip(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("api inputs") / "short speech.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "1.2", str(path))
    return path


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The server, with a Chinese Piper voice added to its weights folder."""
    weights = tmp_path_factory.mktemp("api weights")
    add_piper_voice(weights, "zh_CN-test-medium", "zh_CN")
    live = LiveApp(tmp_path_factory.mktemp("api") / "outputs", env={"HEYGEM_WEIGHTS": str(weights)}).wait_ready()
    yield live
    live.stop()


def test_submit_poll_download_and_decode(app, speech_clip, tmp_path):
    response = app.submit(ASSETS / "astronaut.jpg", speech_clip, face_name="my portrait ü.v2.jpg")
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    assert response.headers["location"] == f"/api/jobs/{job_id}"
    seen_progress = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = app.client.get(f"/api/jobs/{job_id}").json()
        seen_progress.append(job["progress"])
        if job["status"] in ("done", "failed", "cancelled"):
            break
        assert 0.0 <= job["progress"] <= 1.0
        time.sleep(0.1)
    assert job["status"] == "done", job
    for key in ("id", "status", "progress", "stage", "error", "created", "started", "finished", "engine"):
        assert key in job
    assert job["progress"] == 1.0 and job["error"] is None and job["engine"] in ("landmark", "wav2lip")
    assert job["face"] == "my portrait ü.v2.jpg" and job["options"] == OPTIONS
    assert job["seconds_per_stage"] and job["result"] == f"/api/jobs/{job_id}/result"
    assert seen_progress == sorted(seen_progress)  # progress never goes backwards

    result = app.client.get(f"/api/jobs/{job_id}/result")
    assert result.status_code == 200 and result.headers["content-type"] == "video/mp4"
    # named after its inputs, as the page names it
    from urllib.parse import quote

    expected = f"my portrait ü.v2-{Path(job['audio']).stem}.mp4"
    assert quote(expected) in result.headers["content-disposition"], result.headers
    downloaded = tmp_path / "downloaded.mp4"
    downloaded.write_bytes(result.content)
    assert_playable_mp4(downloaded, probe(speech_clip).duration)
    assert probe(downloaded).height == 256
    assert (app.outputs / job_id / "my portrait ü.v2.jpg").is_file()
    assert "done in" in app.client.get(f"/api/jobs/{job_id}/log").text
    listed = app.client.get("/api/jobs").json()
    assert job_id in [entry["id"] for entry in listed["jobs"]] and listed["counts"]["done"] >= 1
    # the server's log holds heygem's own lines only: no mediapipe, TensorFlow Lite or Gradio banner lines
    log_lines = [line for line in app.log_text().splitlines() if line.strip()]
    assert log_lines and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) ", line)
                             for line in log_lines), log_lines
    assert any(f"job {job_id} done in" in line for line in log_lines)


def test_bad_requests_get_a_message(app, speech_clip, tmp_path):
    def error_of(response, status):
        assert response.status_code == status, response.text
        return response.json()["error"]

    face = ASSETS / "astronaut.jpg"
    assert "unknown option face.padding" in error_of(app.submit(face, speech_clip, {"face.padding": 3}), 400)
    assert "JSON" in error_of(app.client.post("/api/jobs", files={"face": ("a.jpg", face.read_bytes())},
                                              data={"options": "{not json"}), 400)
    assert "face file is missing" in error_of(
        app.client.post("/api/jobs", files={"audio": ("a.wav", speech_clip.read_bytes())}), 400)
    assert "no sound of its own" in error_of(app.submit(face, None), 400)
    corrupt = tmp_path / "broken clip.mp4"
    corrupt.write_bytes(b"definitely not a video" * 50)
    assert "broken clip.mp4" in error_of(app.submit(corrupt, speech_clip), 400)
    assert "no job" in error_of(app.client.get("/api/jobs/nope"), 404)
    assert app.client.get("/api/jobs/..%2F..%2Fetc/result").status_code == 404
    assert "no job" in error_of(app.client.get("/api/jobs/..jobs.db/result"), 404)
    assert "multipart" in error_of(app.client.post("/api/jobs", json={"face": "x"}), 400)
    # options that name server files take only names of files in the server's weights folder
    jobs_before = len(app.client.get("/api/jobs").json()["jobs"])
    for checkpoint in ("/etc/passwd", "../../etc/passwd", "sub/wav2lip.pth"):
        problem = error_of(app.submit(face, speech_clip, {"engine.checkpoint": checkpoint, "engine.name": "wav2lip"}),
                           400)
        assert "not a path" in problem and "passwd" not in problem
    assert "no file named 'missing.pth'" in error_of(
        app.submit(face, speech_clip, {"engine": {"checkpoint": "missing.pth"}}), 400)
    assert len(app.client.get("/api/jobs").json()["jobs"]) == jobs_before  # nothing was queued

    job_id = app.submit(face, speech_clip).json()["id"]
    second = app.submit(face, speech_clip).json()["id"]
    assert "no result yet" in error_of(app.client.get(f"/api/jobs/{second}/result"), 404)
    cancelled = app.client.delete(f"/api/jobs/{second}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelled", "running")
    finished = app.wait_finished([job_id, second])
    assert finished[job_id]["status"] == "done" and finished[second]["status"] == "cancelled"
    deleted = app.client.delete(f"/api/jobs/{job_id}")  # a finished job: deleted, with its files
    assert deleted.status_code == 200 and deleted.json() == {"id": job_id, "status": "deleted"}
    assert app.client.get(f"/api/jobs/{job_id}").status_code == 404 and not (app.outputs / job_id).exists()
    assert app.client.post(f"/api/jobs/{second}/retry").json()["status"] in ("queued", "running")
    assert app.wait_finished([second])[second]["status"] == "done"


def test_ten_concurrent_submissions_all_finish_and_a_bad_upload_fails_alone(app, speech_clip, tmp_path):
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 100)
    uploads = [(ASSETS / "astronaut.jpg", f"face {index}.jpg") for index in range(10)] + [(corrupt, "corrupt.png")]
    with ThreadPoolExecutor(len(uploads)) as pool:
        responses = list(pool.map(lambda upload: app.submit(upload[0], speech_clip, face_name=upload[1]), uploads))
    assert [response.status_code for response in responses] == [201] * 10 + [400], [r.text for r in responses]
    job_ids = [response.json()["id"] for response in responses[:10]]
    assert len(set(job_ids)) == 10
    finished = app.wait_finished(job_ids)
    assert all(job["status"] == "done" for job in finished.values()), finished
    assert sorted(job["face"] for job in finished.values()) == sorted(name for _, name in uploads[:10])
    listed = {job["id"] for job in app.client.get("/api/jobs", params={"status": "done"}).json()["jobs"]}
    assert set(job_ids) <= listed
    audio_seconds = probe(speech_clip).duration
    for index, job_id in enumerate(job_ids):
        assert_playable_mp4(app.outputs / job_id / "result.mp4", audio_seconds, full_decode=index == 0)


def test_the_page_and_gradios_api_are_served_and_only_outputs_files(app):
    page = app.client.get("/")
    assert page.status_code == 200 and "heygem" in page.text
    assert app.client.get("/gradio_api/info").status_code == 200
    assert app.client.get(f"/gradio_api/file={app.outputs / 'jobs.db'}").status_code in (403, 404)
    assert app.client.get("/gradio_api/file=/etc/passwd").status_code in (403, 404)


def test_kill_9_mid_job_then_restart_runs_every_job_once(tmp_path, speech_clip):
    outputs = tmp_path / "outputs"
    first = LiveApp(outputs).wait_ready()
    try:
        job_ids = [first.submit(ASSETS / "astronaut.jpg", speech_clip).json()["id"] for _ in range(4)]
        deadline = time.monotonic() + 60
        while first.client.get(f"/api/jobs/{job_ids[0]}").json()["status"] != "running":
            assert time.monotonic() < deadline, "the first job never started"
            time.sleep(0.05)
        first.kill_hard()
    finally:
        first.stop()
    second = LiveApp(outputs).wait_ready()
    try:
        finished = second.wait_finished(job_ids)
    finally:
        second.stop()
    assert [finished[job_id]["status"] for job_id in job_ids] == ["done"] * 4, finished
    assert finished[job_ids[0]]["attempts"] == 2
    audio_seconds = probe(speech_clip).duration
    for job_id in job_ids:
        log = (outputs / job_id / "job.log").read_text(encoding="utf-8")
        assert log.count(f"job {job_id} done in") == 1, log
        assert_playable_mp4(outputs / job_id / "result.mp4", audio_seconds, full_decode=False)
    assert "queued again" in (outputs / job_ids[0] / "job.log").read_text(encoding="utf-8")


def test_basic_auth_and_upload_limit(tmp_path, speech_clip):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from heygem.jobs.api import create_router
    from heygem.jobs.store import JobStore

    store = JobStore(tmp_path / "outputs", max_upload_bytes=60_000)
    application = FastAPI()
    application.include_router(create_router(store, auth=("anna", "sécret"), max_upload_bytes=60_000))
    client = TestClient(application)
    assert client.get("/api/jobs").status_code == 401
    assert client.get("/api/jobs").headers["www-authenticate"].startswith("Basic")
    assert client.get("/api/jobs", auth=("anna", "wrong")).status_code == 401
    assert client.get("/api/jobs", auth=("anna", "sécret")).status_code == 200
    broken = {"Authorization": "Basic " + base64.b64encode(b"\xff\xfe").decode()}
    assert client.get("/api/jobs", headers=broken).status_code == 401
    big = client.post("/api/jobs", auth=("anna", "sécret"),
                      files={"face": ("face.jpg", (ASSETS / "astronaut.jpg").read_bytes()),
                             "audio": ("a.wav", speech_clip.read_bytes())})
    assert big.status_code == 413 and "upload limit" in big.json()["error"]
    huge = client.post("/api/jobs", auth=("anna", "sécret"),
                       files={"face": ("face.jpg", io.BytesIO(b"0" * 2_000_000))})
    assert huge.status_code == 413
    assert store.list() == [] and not [path for path in store.outputs_dir.iterdir() if path.is_dir()]


def test_gradio_client_generates_a_video_by_named_parameters(app, speech_clip):
    from gradio_client import Client, handle_file

    client = Client(app.url, verbose=False)
    endpoints = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    # the page's own events are not offered
    assert set(endpoints) == {"/generate", "/submit_job", "/job_status", "/presenters", "/add_presenter",
                              "/remove_presenter", "/voices"}
    voices = {voice["name"]: voice for voice in client.predict(api_name="/voices")}
    assert voices["zh_CN-test-medium"]["kind"] == "piper" and voices["zh_CN-test-medium"]["language"] == "zh_CN"
    assert app.client.get("/api/voices").json()["voices"] == list(voices.values())
    assert [parameter["parameter_name"] for parameter in endpoints["/generate"]["parameters"]] == [
        "face", "audio", "engine", "options", "text", "voice", "voice_sample", "voice_consent", "presenter"]
    video, job_id = client.predict(face=handle_file(str(ASSETS / "astronaut.jpg")),
                                   audio=handle_file(str(speech_clip)), engine="landmark",
                                   options='{"media.output_height": 256}', api_name="/generate")
    assert_playable_mp4(Path(video), probe(speech_clip).duration, full_decode=False)
    assert probe(Path(video)).height == 256
    status = client.predict(job_id=job_id, api_name="/job_status")
    assert status["id"] == job_id and status["status"] == "done" and status["engine"] == "landmark"
    with pytest.raises(Exception, match="not a path"):
        client.predict(face=handle_file(str(ASSETS / "astronaut.jpg")), audio=handle_file(str(speech_clip)),
                       engine="wav2lip", options='{"engine.checkpoint": "/etc/passwd"}', api_name="/generate")
    with pytest.raises(Exception, match="no job"):
        client.predict(job_id="nope", api_name="/job_status")


def test_text_instead_of_audio_makes_speech_and_subtitles(app, tmp_path):
    import av

    face = ("face.jpg", (ASSETS / "astronaut.jpg").read_bytes())
    response = app.client.post("/api/jobs", files={"face": face},
                               data={"text": "Good morning. This video was made from text.", "speed": "1.1",
                                     "options": json.dumps({"media.output_height": 256})})
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    assert app.wait_finished([job_id])[job_id]["status"] == "done"
    result = tmp_path / "result.mp4"
    result.write_bytes(app.client.get(f"/api/jobs/{job_id}/result").content)
    with av.open(str(result)) as container:
        kinds = sorted(stream.type for stream in container.streams)
    assert kinds == ["audio", "subtitle", "video"]
    cues = (app.outputs / job_id / "result.srt").read_text(encoding="utf-8")
    assert "Good morning." in cues and "This video was made from text." in cues

    def error_of(response):
        assert response.status_code == 400, response.text
        return response.json()["error"]

    jobs_before = len(app.client.get("/api/jobs").json()["jobs"])
    assert "empty" in error_of(app.client.post("/api/jobs", files={"face": face}, data={"text": "  "}))
    assert "not both" in error_of(app.client.post(
        "/api/jobs", files={"face": face, "audio": ("a.wav", (ASSETS / "speech_en.wav").read_bytes())},
        data={"text": "Hello."}))
    assert "voice" in error_of(app.client.post("/api/jobs", files={"face": face},
                                               data={"text": "Hello.", "voice": "no-such-voice"}))
    assert len(app.client.get("/api/jobs").json()["jobs"]) == jobs_before


@pytest.mark.parametrize("name, message", [
    (b"../../etc/passwd.jpg", "not a plain file name"),
    (b"..", "not a plain file name"),
    (b"face\x00.jpg", "control characters"),
    (b"face\n.jpg", "control characters"),
    (b"a" * 300 + b".jpg", "longer than 255 bytes"),
    (b"setup.exe", "not a video or a photo by its extension"),
    (b"face", "not a video or a photo by its extension"),
])
def test_hostile_or_wrong_type_upload_names_are_refused_and_nothing_is_queued(tmp_path, name, message):
    """The names go into the multipart body byte for byte (a client library would escape some of them)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from heygem.jobs.api import create_router
    from heygem.jobs.store import JobStore

    store = JobStore(tmp_path / "outputs")
    client = TestClient(FastAPI(routes=create_router(store).routes))
    boundary = "faultsboundary"

    def body(face_name: bytes) -> bytes:
        return (f"--{boundary}\r\n".encode() + b'Content-Disposition: form-data; name="face"; filename="'
                + face_name + b'"\r\nContent-Type: application/octet-stream\r\n\r\n'
                + (ASSETS / "astronaut.jpg").read_bytes() + f"\r\n--{boundary}--\r\n".encode())

    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    refused = client.post("/api/jobs", content=body(name), headers=headers)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert message in error and "\n" not in error and "Traceback" not in error
    assert store.list() == [] and not [path for path in store.outputs_dir.iterdir() if path.is_dir()]
    # the same photo under a plain (even unusual) name is taken; it has no sound, so that is the complaint
    plain = client.post("/api/jobs", content=body("my portrait ü.v2.jpg".encode()), headers=headers)
    assert plain.status_code == 400 and "no sound of its own" in plain.json()["error"]
