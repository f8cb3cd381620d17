"""What a server keeps to itself: it reaches no other machine, its users see no server paths or tracebacks,
and what a job leaves behind (its work files, its uploads) stays under --outputs and goes with the job."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from conftest import REPO
from faults import free_port

RECORDER = '''
import os, socket

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "", None}
_RECORD = os.environ["HEYGEM_TEST_NETWORK_RECORD"]


def _note(host):
    if isinstance(host, bytes):
        host = host.decode()
    if host not in _LOOPBACK and not str(host).startswith("127."):
        with open(_RECORD, "a") as record:
            record.write(f"{host}\\n")
        raise OSError("no network in this test")


_getaddrinfo, _connect, _create_connection = socket.getaddrinfo, socket.socket.connect, socket.create_connection


def getaddrinfo(host, *args, **kwargs):
    _note(host)
    return _getaddrinfo(host, *args, **kwargs)


def connect(self, address):
    if isinstance(address, tuple):
        _note(address[0])
    return _connect(self, address)


socket.getaddrinfo, socket.socket.connect = getaddrinfo, connect
'''


def test_the_app_reaches_no_other_machine_while_it_starts_and_serves(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(RECORDER)
    record = tmp_path / "hosts.txt"
    record.touch()
    env = {name: value for name, value in os.environ.items() if not name.startswith(("GRADIO_", "HF_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]), PYTHONUNBUFFERED="1",
               HEYGEM_TEST_NETWORK_RECORD=str(record))
    port = free_port()
    with open(tmp_path / "app.log", "wb") as log:
        app = subprocess.Popen([sys.executable, "app.py", "--host", "127.0.0.1", "--port", str(port), "--outputs",
                                str(tmp_path / "outputs"), "--workers", "0"], cwd=REPO, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert app.poll() is None, (tmp_path / "app.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/jobs", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "app.log").read_text()
            time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=30).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/config", timeout=30).status_code == 200
    finally:
        app.terminate()
        app.wait(30)
    assert record.read_text() == "", record.read_text()


# ---------------------------------------------------------------------- what a job's owner reads


def queued_job(tmp_path):
    from conftest import ASSETS

    from heygem.jobs.store import JobStore, process_owner

    store = JobStore(tmp_path / "outputs")
    store.create_job(ASSETS / "astronaut.jpg", ASSETS / "speech_en.wav")
    owner = process_owner("worker-test")
    return store, store.claim_next(owner), owner


def run_logged(store, job, owner, generate) -> tuple[str, list[str]]:
    """Run ``job`` with ``generate`` as a worker does: its status, and the records the heygem logger handed
    the server's own handlers meanwhile, with their tracebacks."""
    import logging

    from heygem.jobs.worker import run_job

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(logging.Formatter().format(record))

    handler = Keep()
    logging.getLogger("heygem").addHandler(handler)
    try:
        return run_job(store, job, owner, generate=generate), records
    finally:
        logging.getLogger("heygem").removeHandler(handler)


def test_a_full_disk_mid_job_says_so_and_the_traceback_stays_in_the_server_log(tmp_path):
    import sqlite3

    store, job, owner = queued_job(tmp_path)

    def generate(face, audio, output, *, progress, **_):
        progress("render", 0.5)
        raise sqlite3.OperationalError("database or disk is full")

    status, records = run_logged(store, job, owner, generate)
    assert status == "failed"
    error = store.get(job.id).error
    assert "disk is full" in error and "OperationalError" not in error, error
    log = job.log_path.read_text()
    assert "disk is full" in log and "Traceback" not in log, log
    assert any("Traceback" in record for record in records), records


def test_an_unexpected_error_keeps_its_traceback_out_of_the_job_log(tmp_path):
    store, job, owner = queued_job(tmp_path)

    def generate(face, audio, output, **_):
        raise KeyError("a bug")

    status, records = run_logged(store, job, owner, generate)
    assert status == "failed"
    assert "unexpected error" in store.get(job.id).error
    log = job.log_path.read_text()
    assert "unexpected error" in log and "Traceback" not in log and "line " not in log, log
    assert any("Traceback" in record and "KeyError" in record for record in records), records


def test_a_jobs_error_and_the_rest_answers_carry_no_server_path(tmp_path):
    from conftest import ASSETS
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from heygem.errors import HeygemError
    from heygem.jobs.api import create_router
    from heygem.jobs.files import without_server_paths
    from heygem.jobs.worker import run_job
    from heygem.weights import weights_dir

    store, job, owner = queued_job(tmp_path)
    elsewhere = tmp_path / "srv" / "cache.npy"

    def generate(face, audio, output, **_):
        raise HeygemError(f"checkpoint not found: {weights_dir() / 'my wav2lip.pth'}; the job folder is "
                          f"{output.parent}; {elsewhere} is damaged")

    assert run_job(store, job, owner, generate=generate) == "failed"
    client = TestClient(FastAPI(routes=create_router(store).routes))
    shown = client.get(f"/api/jobs/{job.id}").json()["error"]
    assert shown == f"checkpoint not found: weights/my wav2lip.pth; the job folder is {job.id}; cache.npy is " \
                    "damaged", shown
    listed = client.get("/api/jobs").json()["jobs"][0]["error"]
    assert listed == shown
    echoed = client.post("/api/jobs", files={"face": ("a.jpg", (ASSETS / "astronaut.jpg").read_bytes())},
                         data={"options": '{"engine.device": "/dev/sda"}'}).json()["error"]
    assert "'/dev/sda'" in echoed, echoed  # the client's own words come back as they were
    assert without_server_paths("see /api/jobs/ID/result or outputs/x.mp4 (16:9)") == \
        "see /api/jobs/ID/result or outputs/x.mp4 (16:9)"
    assert without_server_paths(f"'{ASSETS / 'astronaut.jpg'}' is bad") == "'astronaut.jpg' is bad"


# ---------------------------------------------------------------------- what a job leaves behind


SERVER_FOLDER_VARIABLES = ("HEYGEM_CACHE_DIR", "GRADIO_TEMP_DIR", "HEYGEM_VOICE_CACHE", "HEYGEM_WORK_DIR")


def clear_server_folders(monkeypatch) -> None:
    for name in SERVER_FOLDER_VARIABLES:
        monkeypatch.setenv(name, "recorded")  # so that the end of the test restores what was there before
        monkeypatch.delenv(name)


def test_the_voice_cache_and_the_work_folders_go_under_the_servers_outputs(tmp_path, monkeypatch):
    from heygem.jobs.files import keep_server_files_under
    from heygem.speech.tts import voice_cache_dir

    clear_server_folders(monkeypatch)
    outputs = (tmp_path / "outputs").resolve()
    keep_server_files_under(outputs)
    assert voice_cache_dir() == outputs / "voice-cache"
    from heygem.runtime.workdir import new_work_dir

    work = new_work_dir()
    assert work.parent == outputs / "tmp", work


def test_a_start_sweeps_the_work_folders_of_processes_that_are_gone(tmp_path, monkeypatch):
    import socket

    from heygem.jobs.files import keep_server_files_under

    clear_server_folders(monkeypatch)
    outputs = (tmp_path / "outputs").resolve()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    left = outputs / "tmp" / f"heygem-{dead_pid}@{socket.gethostname()}-abc123"
    live = outputs / "tmp" / f"heygem-{os.getpid()}@{socket.gethostname()}-def456"
    other_host = outputs / "tmp" / f"heygem-{dead_pid}@another-machine-ghi789"
    for folder in (left, live, other_host):
        folder.mkdir(parents=True)
        (folder / "frames.yuv").write_bytes(b"\0" * 1024)
    keep_server_files_under(outputs)
    assert not left.exists() and live.exists() and other_host.exists()


def test_a_rerun_removes_what_the_interrupted_attempt_left_in_the_job_folder(tmp_path):
    from heygem.jobs.worker import run_job

    store, job, owner = queued_job(tmp_path)
    partial = job.directory / ".result.0f3a.partial.mp4"
    partial.write_bytes(b"\0" * 4096)
    parts = job.directory / ".result.k2j3.parts"
    parts.mkdir()
    (parts / "part-0.mp4").write_bytes(b"\0")

    def generate(face, audio, output, **_):
        output.write_bytes(b"video")
        return None

    assert run_job(store, job, owner, generate=generate) == "done"
    assert not partial.exists() and not parts.exists()
    assert sorted(path.name for path in job.directory.iterdir() if path.name.startswith(".")) == []


def test_deleting_a_job_deletes_the_servers_copies_of_its_uploads(tmp_path, monkeypatch):
    import shutil

    from conftest import ASSETS

    from heygem.jobs.store import JobStore

    clear_server_folders(monkeypatch)
    outputs = tmp_path / "outputs"
    from heygem.jobs.files import keep_server_files_under

    keep_server_files_under(outputs)
    uploads = Path(os.environ["GRADIO_TEMP_DIR"])
    (uploads / "3fa2c1").mkdir(parents=True)
    face = uploads / "3fa2c1" / "my face.jpg"
    shutil.copy(ASSETS / "astronaut.jpg", face)
    speech = ASSETS / "speech_en.wav"  # a file of the server's own, not an upload
    store = JobStore(outputs, upload_folder=uploads)
    job_id = store.create_job(face, speech)
    store.cancel(job_id)
    store.delete(job_id)
    assert not face.exists() and not (uploads / "3fa2c1").exists()
    assert speech.is_file() and uploads.is_dir()


def test_a_job_deleted_over_rest_takes_the_pages_copies_of_its_uploads_along(tmp_path):
    from conftest import ASSETS
    from faults import Server
    from gradio_client import Client, handle_file

    face = tmp_path / "only mine.jpg"
    face.write_bytes((ASSETS / "astronaut.jpg").read_bytes() + b"this upload and no other")
    server = Server(tmp_path / "outputs", tmp_path / "server.log", extra_args=("--workers", "0"),
                    drop_env=SERVER_FOLDER_VARIABLES).wait_ready()
    try:
        client = Client(server.url, verbose=False)
        job_id = client.predict(face=handle_file(str(face)), audio=handle_file(str(ASSETS / "speech_en.wav")),
                                api_name="/submit_job")
        copies = list((tmp_path / "outputs" / "gradio-temp").rglob(face.name))
        assert copies
        assert server.client.delete(f"/api/jobs/{job_id}").json()["status"] == "cancelled"
        assert server.client.delete(f"/api/jobs/{job_id}").json()["status"] == "deleted"
        left = [path for path in (tmp_path / "outputs" / "gradio-temp").rglob("*") if path.name == face.name]
        assert not left, left
    finally:
        server.stop()


# ---------------------------------------------------------------------- forged page requests


def test_forged_page_requests_leave_one_line_each_in_the_server_log(tmp_path):
    from faults import Server

    server = Server(tmp_path / "outputs", tmp_path / "server.log", extra_args=("--workers", "0")).wait_ready()
    try:
        client = server.client
        dependencies = client.get("/config").json()["dependencies"]
        submit = next(index for index, event in enumerate(dependencies) if event.get("api_name") == "submit_job")
        before = len(server.log_text().splitlines())
        forged = [{"data": [{"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}}], "fn_index": submit,
                   "session_hash": "forged1"},
                  {"data": ["not a file", 5], "fn_index": submit, "session_hash": "forged2"}]
        for request in forged:
            assert client.post("/gradio_api/queue/join", json=request).status_code == 200
            with client.stream("GET", "/gradio_api/queue/data", params={"session_hash": request["session_hash"]},
                               timeout=60) as events:
                assert any("process_completed" in line for line in events.iter_lines())
        for path, request in (("/gradio_api/queue/join", {"data": [], "fn_index": 9999, "session_hash": "forged3"}),
                              ("/gradio_api/run/predict", {"data": [1, 2], "fn_index": submit})):
            assert httpx.post(server.url + path, json=request, timeout=60).status_code >= 400  # a connection each
        assert client.get("/api/jobs").status_code == 200  # still serving
    finally:
        server.stop()
    lines = server.log_text().splitlines()[before:]
    assert not [line for line in lines if "Traceback" in line or line.startswith(" ")], "\n".join(lines)
    assert sum("input values" in line for line in lines) >= 3 and any("KeyError" in line for line in lines), lines
