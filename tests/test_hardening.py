"""Hostile and careless job requests at every door (REST, the page, gradio_client, batch, the command line):
one check refuses them with one line before anything is queued; the server keeps its files under --outputs,
caps the processes a remote request may start, holds its queue limit under concurrent submissions and stops
reading an over-large chunked upload early."""

from __future__ import annotations

import json
import os
import select
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import ASSETS, REPO, rest_client, run_ffmpeg

from heygem.errors import HeygemError
from heygem.jobs.limits import JobLimits
from heygem.jobs.request import check_options, parse_options
from heygem.jobs.store import JobStore
from heygem.media.probing import probe

FACE = ASSETS / "astronaut.jpg"


@pytest.fixture(scope="module")
def speech(second_of_speech) -> Path:
    return second_of_speech


def post_job(client, speech: Path, options_text: str, face: Path = FACE):
    return client.post("/api/jobs", files={"face": (face.name, face.read_bytes()),
                                           "audio": (speech.name, speech.read_bytes())},
                       data={"options": options_text})


def one_line_400(response) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error and "\n" not in error and "Traceback" not in error, error
    return error


def nothing_queued(store: JobStore) -> bool:
    return store.list() == [] and not [path for path in store.outputs_dir.iterdir() if path.is_dir()]


# ---------------------------------------------------------------------- one check at the door


@pytest.mark.parametrize("options_text, words", [
    ('{"engine.mouth_strength": NaN}', "finite"),
    ('{"engine.mouth_strength": Infinity}', "finite"),
    ('{"blend.feather": -Infinity}', "finite"),
    ('{"engine.mouth_strength": 1e400}', "finite"),
    ('{"face.pads": [0, Infinity, 0, 0]}', "finite"),
    ('{"face.box": [0, 0, Infinity, 10]}', "finite"),
    ('{"face.pads": [0, 1.5, 0, 0]}', "whole number"),
    ('{"face.pads": [0, -5, 0, 0]}', "--pads"),
    ('{"face.box": [-10, 0, 50, 50]}', "--box"),
    ('{"face.box": [0, 0, 99999999, 50]}', "--box"),
    ('{"blend.feather": -0.1}', "--feather"),
    ('{"engine.mouth_strength": -1}', "--mouth-strength"),
    ('{"media.crf": true}', "media.crf"),
    ('{"engine.device": [1]}', "engine.device"),
    ('{"face.pads": [[[[0]]]]}', "face.pads"),
    ('{"media.audio_bitrate": "-f null /tmp/x"}', "bitrate"),
    ('{"media.audio_bitrate": "128"}', "bitrate"),
    ('{"engine.device": "/dev/sda"}', "device"),
    ('{"engine.device": "cuda:64"}', "cuda:64"),
    ("[" * 50_000 + "]" * 50_000, "options"),
    ('{"face": {"pads": ' + "[" * 5000 + "]" * 5000 + "}}", "options"),
    ('{"face.pads": [' + ",".join(["0"] * 40_000) + "]}", "options"),
])
def test_bad_option_values_are_one_line_400s_over_rest_and_nothing_is_queued(tmp_path, speech, options_text, words):
    store = JobStore(tmp_path / "outputs")
    error = one_line_400(post_job(rest_client(store), speech, options_text))
    assert words in error, error
    assert nothing_queued(store)


def test_good_option_values_still_pass(tmp_path, speech):
    flat, config = check_options({"media.audio_bitrate": "128k", "engine.device": "cpu", "face.pads": [0, 12.0, 0, 0],
                                  "face.box": [10, 20, 200, 220], "blend.feather": 0.3,
                                  "engine.mouth_strength": 1.5}, JobStore(tmp_path / "o").base_config, remote=True)
    assert config.face.pads == [0, 12, 0, 0] and config.media.audio_bitrate == "128k"
    assert config.engine.device == "cpu" and config.face.box == [10, 20, 200, 220]
    assert parse_options('{"face": {"pads": [0, 20, 0, 0]}}') == {"face.pads": [0, 20, 0, 0]}


def test_the_config_file_and_the_command_line_take_the_same_rules(tmp_path, speech):
    from heygem.config import load_config

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("engine:\n  mouth_strength: .nan\n", encoding="utf-8")
    with pytest.raises(HeygemError, match="finite"):
        load_config(bad_yaml)
    result = subprocess.run([sys.executable, "-m", "heygem", "generate", "--face", str(FACE), "--audio", str(speech),
                             "--output", str(tmp_path / "out.mp4"), "--mouth-strength", "nan",
                             "--device", "/dev/sda"], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "finite" in lines[-1] and "Traceback" not in result.stderr
    assert not (tmp_path / "out.mp4").exists()


# ---------------------------------------------------------------------- files named by options


@pytest.fixture()
def weights(no_weights) -> Path:
    import torch

    torch.save({"state_dict": {}}, no_weights / "good.pth")
    (no_weights / "notes.pth").write_text("these are not weights\n" * 10, encoding="utf-8")
    (no_weights / "passwd.pth").symlink_to("/etc/passwd")
    (no_weights / "readme.txt").write_text("hello\n", encoding="utf-8")
    return no_weights


@pytest.mark.parametrize("name, words", [
    ("/etc/passwd", "not a path"),
    ("passwd.pth", "outside the server's weights folder"),
    ("notes.pth", "not a checkpoint"),
    ("readme.txt", "not a checkpoint"),
])
def test_checkpoint_options_name_a_checkpoint_file_inside_weights(tmp_path, speech, weights, name, words):
    store = JobStore(tmp_path / "outputs")
    options = json.dumps({"engine.name": "wav2lip", "engine.checkpoint": name})
    error = one_line_400(post_job(rest_client(store), speech, options))
    assert words in error and "1294" not in error and "bytes" not in error, error
    assert nothing_queued(store)
    flat, _ = check_options({"engine.checkpoint": "good.pth"}, store.base_config, remote=True)
    assert flat["engine.checkpoint"] == str(weights / "good.pth")


def test_a_batch_manifest_row_is_checked_as_rest_checks_a_request(tmp_path, speech, weights):
    from heygem.jobs.batch import plan_items, submit_items
    from heygem.ui.batch import queue_batch

    face = tmp_path / "anna.jpg"
    face.write_bytes(FACE.read_bytes())
    manifest = tmp_path / "manifest.csv"
    rows = [("passwd", {"engine.name": "wav2lip", "engine.checkpoint": "/etc/passwd"}),
            ("link", {"engine.name": "wav2lip", "engine.checkpoint": "passwd.pth"}),
            ("nan", {"engine.mouth_strength": "NaN"}),
            ("workers", {"run.face_workers": 500}),
            ("device", {"engine.device": "/dev/sda"})]
    with open(manifest, "w", encoding="utf-8", newline="") as handle:
        handle.write("face,audio,name,options\n")
        for name, options in rows:
            handle.write(f'anna.jpg,speech.wav,{name},"{json.dumps(options).replace(chr(34), chr(34) * 2)}"\n')
    nan_manifest = tmp_path / "nan.csv"
    nan_manifest.write_text('face,audio,name,options\nanna.jpg,speech.wav,bare,"{""engine.mouth_strength"": NaN}"\n',
                            encoding="utf-8")
    store = JobStore(tmp_path / "outputs")
    for path in (manifest, nan_manifest):
        items = plan_items([face, speech], str(path))
        batch, outcome = queue_batch(store, items, {})
        assert outcome and all(isinstance(result, HeygemError) for result in outcome.values()), outcome
        for result in outcome.values():
            assert "\n" not in str(result) and "1294" not in str(result)
        remote = submit_items(store, items, {}, "batch-x", remote=True)
        assert all(isinstance(result, HeygemError) for result in remote.values()), remote
    assert nothing_queued(store)
    # the tab's own controls go through the same check: a NaN pad from the page is one line, not a ValueError
    anna_speech = tmp_path / "anna.wav"
    anna_speech.write_bytes(speech.read_bytes())
    items = plan_items([face, anna_speech], "stem")
    controls = ("auto", 0, float("nan"), 0, 0, 5, "none", 0, 25)
    from heygem.ui.common import options_from_controls

    _, outcome = queue_batch(store, items, options_from_controls(*controls))
    assert all(isinstance(result, HeygemError) and "finite" in str(result) for result in outcome.values()), outcome
    assert nothing_queued(store)


def test_the_generate_tab_applies_the_same_check(tmp_path, speech):
    from heygem.ui.generate import queue_generation

    store = JobStore(tmp_path / "outputs")
    for bad_pad in (float("nan"), float("inf"), -5):
        with pytest.raises(HeygemError) as problem:
            queue_generation(store, str(FACE), str(speech), False, "", "auto", 1.0, "soft",
                             "landmark", 0, bad_pad, 0, 0, 5, "none", 0, 25, "mediapipe")
        assert "\n" not in str(problem.value)
    assert nothing_queued(store)
    job_id = queue_generation(store, str(FACE), str(speech), False, "", "auto", 1.0, "soft",
                              "landmark", 0, 10, 0, 0, 5, "none", 0, 25, "mediapipe")
    assert store.get(job_id).options["face.pads"] == [0, 10, 0, 0]


def test_the_generate_tab_takes_the_users_word_before_a_cloned_voice(tmp_path):
    from heygem.ui.generate import queue_generation

    store = JobStore(tmp_path / "outputs")
    controls = ("landmark", 0, 10, 0, 0, 5, "none", 0, 25, "mediapipe")
    with pytest.raises(HeygemError, match="consent"):
        queue_generation(store, str(FACE), None, False, "Hello there.", "clone", 1.0, "soft", *controls)
    assert nothing_queued(store)
    asked = {}
    store.create_job = lambda *args, **kwargs: asked.update(kwargs) or "queued"
    assert queue_generation(store, str(FACE), None, False, "Hello there.", "clone", 1.0, "soft", *controls,
                            voice_consent=True) == "queued"
    assert asked["voice"] == "clone" and asked["voice_consent"] is True and asked["voice_sample"] is None
    # the page's voice sample goes with a cloned voice only (another voice has no use for it)
    for voice, sent in (("clone", str(FACE)), ("auto", None)):
        queue_generation(store, str(FACE), None, False, "Hello there.", voice, 1.0, "soft", *controls,
                         voice_consent=True, voice_sample=str(FACE))
        assert asked["voice_sample"] == sent


# ---------------------------------------------------------------------- caps on processes


def test_remote_process_counts_are_capped_by_the_server(tmp_path, speech):
    from heygem.jobs.limits import ProcessCaps

    cores = os.cpu_count() or 1
    store = JobStore(tmp_path / "outputs")  # default caps: the machine's cores
    client = rest_client(store)
    for option in ("run.face_workers", "run.decoders", "run.encoders"):
        error = one_line_400(post_job(client, speech, json.dumps({option: cores + 1})))
        assert option in error and f"at most {cores}" in error, error
    assert nothing_queued(store)
    capped = JobStore(tmp_path / "capped", limits=JobLimits(process_caps=ProcessCaps(face_workers=3, decoders=2,
                                                                                     encoders=1)))
    client = rest_client(capped)
    assert "at most 3" in one_line_400(post_job(client, speech, '{"run.face_workers": 4}'))
    assert "at most 1" in one_line_400(post_job(client, speech, '{"run.encoders": 2}'))
    assert "at most 2" in one_line_400(post_job(client, speech, '{"run": {"decoders": 3}}'))  # the nested form too
    accepted = post_job(client, speech, '{"run.face_workers": 3, "run.decoders": 2, "run.encoders": 1}')
    assert accepted.status_code == 201, accepted.text
    # the command line on this machine keeps its own limits
    flat, config = check_options({"run.face_workers": 32}, store.base_config)
    assert config.run.face_workers == 32


def test_the_operator_sets_the_caps_with_a_flag():
    sys.path.insert(0, str(REPO))
    import app

    limits = app.job_limits(app.parse_args(["--max-job-processes", "3"]))
    assert (limits.process_caps.face_workers, limits.process_caps.decoders, limits.process_caps.encoders) == (3, 3, 3)
    default = app.job_limits(app.parse_args([])).process_caps
    assert default.face_workers == default.decoders == default.encoders == (os.cpu_count() or 1)


# ---------------------------------------------------------------------- the job list survives a bad row


def test_a_stored_job_with_non_finite_numbers_never_breaks_the_job_list(tmp_path, speech):
    store = JobStore(tmp_path / "outputs")
    job_id = store.create_job(FACE, speech, {})
    with sqlite3.connect(store.database_path) as db:  # a row written by an older version that let NaN through
        db.execute("UPDATE jobs SET options = ? WHERE id = ?",
                   ('{"engine.mouth_strength": NaN, "face.pads": [0, Infinity, 0, 0]}', job_id))
    client = rest_client(store)
    listed = client.get("/api/jobs")
    assert listed.status_code == 200, listed.text
    one = client.get(f"/api/jobs/{job_id}")
    assert one.status_code == 200, one.text
    assert one.json()["options"]["engine.mouth_strength"] is None
    assert one.json()["options"]["face.pads"] == [0, None, 0, 0]


# ---------------------------------------------------------------------- over real HTTP


class LocalServer:
    """The REST routes served by uvicorn in a thread on 127.0.0.1 (real sockets, real concurrency)."""

    def __init__(self, store: JobStore, **router_options):
        import uvicorn
        from fastapi import FastAPI

        from heygem.jobs.api import create_router

        with socket.socket() as probe_socket:
            probe_socket.bind(("127.0.0.1", 0))
            self.port = probe_socket.getsockname()[1]
        config = uvicorn.Config(FastAPI(routes=create_router(store, **router_options).routes), host="127.0.0.1",
                                port=self.port, log_level="warning", limit_concurrency=64)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_max_queued_holds_under_twenty_parallel_submissions(tmp_path, speech):
    store = JobStore(tmp_path / "outputs", limits=JobLimits(max_queued=3))
    server = LocalServer(store)
    face, audio = FACE.read_bytes(), speech.read_bytes()
    barrier = threading.Barrier(20)

    def send(_):
        with httpx.Client(base_url=server.url, timeout=120) as client:
            barrier.wait()
            return client.post("/api/jobs", files={"face": ("face.jpg", face), "audio": ("speech.wav", audio)},
                               data={"options": "{}"})

    try:
        with ThreadPoolExecutor(20) as pool:
            responses = list(pool.map(send, range(20)))
    finally:
        server.stop()
    codes = sorted(response.status_code for response in responses)
    assert codes == [201] * 3 + [429] * 17, [response.text for response in responses]
    assert store.counts()["queued"] == 3
    assert len([path for path in store.outputs_dir.iterdir() if path.is_dir()]) == 3


def test_a_chunked_upload_over_the_limit_is_refused_while_it_arrives(tmp_path):
    store = JobStore(tmp_path / "outputs", max_upload_bytes=1 << 20)
    server = LocalServer(store, max_upload_bytes=1 << 20)
    boundary = "chunkedboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"face\"; filename=\"big.mp4\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    chunk = b"\0" * 65536
    total_limit = 64 << 20  # far more than the server may take (2 files of 1 MB and the form's overhead)
    sent = 0
    answer = b""
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as connection:
            connection.sendall(f"POST /api/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                               f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n".encode())
            connection.sendall(f"{len(head):x}\r\n".encode() + head + b"\r\n")
            connection.settimeout(5)
            try:
                while sent < total_limit:
                    connection.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    sent += len(chunk)
                    if select.select([connection], [], [], 0)[0]:  # the server answered before the end
                        break
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                pass
            connection.settimeout(10)
            while b"\r\n\r\n" not in answer:
                try:
                    data = connection.recv(65536)
                except (ConnectionResetError, TimeoutError):
                    break
                if not data:
                    break
                answer += data
    finally:
        server.stop()
    assert answer.startswith(b"HTTP/1.1 413"), (sent, answer[:300])
    assert sent < 16 << 20, sent  # refused long before the whole body was sent
    assert nothing_queued(store)


# ---------------------------------------------------------------------- messages


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A valid 1-bit grey PNG of ``width`` x ``height``, all black (it compresses to little)."""
    row = b"\0" + b"\0" * ((width + 7) // 8)
    compressor = zlib.compressobj(9)
    data = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", data) + chunk(b"IEND", b""))
    return path


def test_the_messages_say_what_is_wrong_with_the_face_or_the_speech(tmp_path, speech):
    store = JobStore(tmp_path / "outputs", limits=JobLimits(max_output_height=2160))
    text = tmp_path / "notes.png"
    text.write_text("just some words, not a picture\n" * 40, encoding="utf-8")
    with pytest.raises(HeygemError, match="not an image or video"):
        store.create_job(text, speech)
    huge = png_header_only(tmp_path / "huge.png", 20000, 20000)
    with pytest.raises(HeygemError, match="too large") as problem:
        store.create_job(huge, speech)
    assert "20000x20000" in str(problem.value)
    wide = png_header_only(tmp_path / "wide.png", 16000, 1000)
    with pytest.raises(HeygemError, match="wide") as problem:
        store.create_job(wide, speech)
    assert "16000" in str(problem.value)
    blip = tmp_path / "blip.wav"
    run_ffmpeg("-f", "lavfi", "-i", "sine=frequency=300:duration=0.01", str(blip))
    with pytest.raises(HeygemError, match=r"at least 0\.1 s"):
        store.create_job(FACE, blip)
    assert nothing_queued(store)


# ---------------------------------------------------------------------- a live `python app.py`


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from faults import Server

    folder = tmp_path_factory.mktemp("live")
    private_tmp = folder / "tmp"
    private_tmp.mkdir()
    env = {"TMPDIR": str(private_tmp)}  # where /tmp/gradio would be: nothing of the server may land there
    server = Server(folder / "outputs", folder / "server.log", env=env, drop_env=("HEYGEM_CACHE_DIR",
                                                                                  "GRADIO_TEMP_DIR"))
    server.private_tmp = private_tmp
    yield server.wait_ready()
    server.stop()


def test_gradio_client_text_only_job_id_and_quiet_errors(live, speech):
    from gradio_client import Client, handle_file

    client = Client(live.url, verbose=False)
    log_start = len(live.log_text())
    video, job_id = client.predict(face=handle_file(str(FACE)), text="Hello there.",
                                   options='{"media.output_height": 256}', api_name="/generate")
    made = probe(Path(video))
    assert made.kind == "video" and made.has_audio and made.height == 256 and made.duration > 0.5
    status = client.predict(job_id=job_id, api_name="/job_status")
    assert status["id"] == job_id and status["status"] == "done"
    queued = client.predict(face=handle_file(str(FACE)), audio=handle_file(str(speech)),
                            options='{"media.output_height": 256}', api_name="/submit_job")
    assert client.predict(job_id=queued, api_name="/job_status")["id"] == queued
    for options, words in (('{"engine.mouth_strength": NaN}', "finite"),
                           ('{"run.face_workers": 500}', "at most"),
                           ('{"face.pads": [0, Infinity, 0, 0]}', "finite")):
        with pytest.raises(Exception, match=words):
            client.predict(face=handle_file(str(FACE)), audio=handle_file(str(speech)), options=options,
                           api_name="/generate")
    with pytest.raises(Exception, match="no sound of its own"):
        client.predict(face=handle_file(str(FACE)), api_name="/generate")
    live.wait_finished([queued], 120)
    new_log = live.log_text()[log_start:]
    assert "Traceback" not in new_log, new_log[-3000:]
    # Gradio's copies of the uploads are under --outputs: nothing of Gradio's in the temp folder, no empty files
    leftovers = [path for path in live.private_tmp.rglob("*")
                 if path.is_file() and ("gradio" in path.parts or path.stat().st_size == 0)]
    assert not leftovers, leftovers
    assert any((live.outputs / "gradio-temp").rglob("astronaut.jpg"))
    empty = [path for path in (live.outputs / "gradio-temp").rglob("*") if path.is_file() and not path.stat().st_size]
    assert not empty, empty  # Gradio's gr.File leaves one per uploaded file


def test_a_face_videos_avatar_cache_and_the_no_face_message_stay_with_the_server(live, speech, tmp_path):
    import cv2
    import numpy as np

    clip = tmp_path / "clip.mp4"
    run_ffmpeg("-loop", "1", "-i", str(FACE), "-f", "lavfi", "-i", "sine=frequency=300:duration=1",
               "-t", "1", "-vf", "scale=256:256", "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p",
               "-c:a", "aac", str(clip))
    wall = tmp_path / "wall.png"
    cv2.imwrite(str(wall), np.full((128, 128, 3), 90, np.uint8))
    repo_cache = REPO / "outputs" / "avatar-cache"
    before = set(os.listdir(repo_cache)) if repo_cache.is_dir() else set()
    video_job = post_job(live.client, speech, '{"engine.name": "landmark"}', face=clip)
    wall_job = post_job(live.client, speech, '{"engine.name": "landmark"}', face=wall)
    assert video_job.status_code == wall_job.status_code == 201, (video_job.text, wall_job.text)
    finished = live.wait_finished([video_job.json()["id"], wall_job.json()["id"]], 120)
    assert finished[video_job.json()["id"]]["status"] == "done", finished
    assert list((live.outputs / "avatar-cache").glob("*/entry.json"))
    assert (set(os.listdir(repo_cache)) if repo_cache.is_dir() else set()) == before
    failed = finished[wall_job.json()["id"]]
    assert failed["status"] == "failed" and "no face was found" in failed["error"], failed
    assert "--box" not in failed["error"] and "clearly" in failed["error"], failed


def test_the_pages_face_slot_says_a_text_file_is_not_an_image_or_video(tmp_path):
    import gradio as gr
    from gradio.data_classes import FileData

    from heygem.ui.common import uploaded_file

    with gr.Blocks():
        face = uploaded_file(file_types=["video", "image"])
    assert face.preprocess(FileData(path=str(FACE))) == str(FACE)
    with pytest.raises(gr.Error, match="notes.txt is not a file this field takes: pick a video"):
        face.preprocess(FileData(path=str(tmp_path / "notes.txt")))


def test_a_non_finite_speaking_speed_is_refused(tmp_path):
    store = JobStore(tmp_path / "outputs")
    client = rest_client(store)
    for speed in ("nan", "inf", "5"):
        response = client.post("/api/jobs", files={"face": (FACE.name, FACE.read_bytes())},
                               data={"text": "Hello there.", "speed": speed})
        assert "speed" in one_line_400(response)
    assert nothing_queued(store)


def test_a_server_keeps_its_caches_under_its_outputs(tmp_path, monkeypatch):
    from heygem.face.avatar_cache import cache_dir
    from heygem.jobs.files import keep_server_files_under

    folders = {"HEYGEM_CACHE_DIR", "GRADIO_TEMP_DIR", "HEYGEM_VOICE_CACHE", "HEYGEM_WORK_DIR"}
    for name in folders:
        monkeypatch.setenv(name, "recorded")  # so that the end of the test restores what was there before
        monkeypatch.delenv(name)
    outputs = (tmp_path / "outputs").resolve()
    assert set(keep_server_files_under(outputs)) == folders
    assert cache_dir() == outputs / "avatar-cache" and os.environ["GRADIO_TEMP_DIR"] == str(outputs / "gradio-temp")
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "elsewhere"))  # an operator's own choice is kept
    assert "GRADIO_TEMP_DIR" not in keep_server_files_under(tmp_path / "other")
