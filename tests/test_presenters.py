"""Saved presenters: checks, preparation, the command line and REST, each on small clips made with ffmpeg."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import REPO, assert_playable_mp4, decode_frames, run_ffmpeg

from heygem.errors import HeygemError
from heygem.media.probing import probe
from heygem.presenters import checks
from heygem.presenters.prepare import prepare
from heygem.presenters.records import READY, PresenterStore
from heygem.types import FrameGeometry


@pytest.fixture(scope="module")
def clips(tmp_path_factory, face_photo, speech_wav, face_video) -> dict[str, Path]:
    """Clips a presenter may or may not be made from."""
    folder = tmp_path_factory.mktemp("presenter clips")
    drift = "scale=330:250,crop=320:240:x='4+4*sin(t*3)':y='4+3*cos(t*2)',format=yuv420p"
    talking = folder / "talking.mp4"  # 7.4 s: the English sample spoken over the drifting portrait
    run_ffmpeg("-loop", "1", "-i", str(face_photo), "-i", str(speech_wav), "-vf", drift, "-r", "25",
               "-c:v", "libx264", "-preset", "ultrafast", "-c:a", "aac", "-shortest", str(talking))
    short = folder / "short.mp4"
    run_ffmpeg("-i", str(face_video), "-t", "1", "-c:v", "libx264", "-preset", "ultrafast", str(short))
    two = folder / "two faces.mp4"
    run_ffmpeg("-i", str(talking), "-t", "3", "-filter_complex", "[0:v]split[a][b];[a][b]hstack,format=yuv420p",
               "-c:v", "libx264", "-preset", "ultrafast", "-an", str(two))
    dark = folder / "dark.mp4"
    run_ffmpeg("-i", str(talking), "-t", "3", "-vf", "eq=brightness=-0.45", "-c:v", "libx264", "-preset",
               "ultrafast", str(dark))
    wall = folder / "wall.mp4"
    run_ffmpeg("-f", "lavfi", "-i", "color=c=gray:s=320x240:d=2.5:r=25", "-c:v", "libx264", "-preset",
               "ultrafast", str(wall))
    notes = folder / "notes.mp4"
    notes.write_text("not a video")
    return {"talking": talking, "face video": face_video, "short": short, "two faces": two, "dark": dark,
            "wall": wall, "notes": notes, "speech only": speech_wav, "photo": face_photo}


def presenter_folders(store: PresenterStore) -> list[str]:
    return sorted(path.name for path in store.folder.iterdir()) if store.folder.exists() else []


@pytest.mark.parametrize("clip, message", [
    ("short", "a presenter's clip lasts at least 2 s"),
    ("notes", "is not an image or video heygem can read"),
    ("speech only", "is sound only"),
    ("wall", "no face was found in wall.mp4 (looked at 0.3, 0.8, 1.3, 1.8, 2.3 s): use a clip"),
    ("two faces", "two faces.mp4 shows 2 faces (at "),
])
def test_refused_clips_leave_nothing(clip, message, clips, tmp_path):
    store = PresenterStore(tmp_path / "outputs")
    with pytest.raises(HeygemError) as refused:
        store.create(clips[clip], "refused")
    assert message in str(refused.value), str(refused.value)
    assert store.list() == [] and presenter_folders(store) == []


def test_too_long_and_face_index_past_the_faces_are_refused(clips, tmp_path):
    store = PresenterStore(tmp_path / "outputs", max_seconds=1.5)
    with pytest.raises(HeygemError, match="face video.mp4 lasts 2.0 s; presenters here are at most 1.5 s long"):
        store.create(clips["face video"], "long")
    store = PresenterStore(tmp_path / "outputs")
    with pytest.raises(HeygemError, match="face_index 2 asks for face 3 from the left, but two faces.mp4 shows at "
                                          "most 2"):
        store.create(clips["two faces"], "third", face_index=2)
    assert store.list() == [] and presenter_folders(store) == []


def test_a_dark_clip_is_a_warning_and_two_faces_need_an_index(clips, tmp_path):
    store = PresenterStore(tmp_path / "outputs")
    dark = store.create(clips["dark"], "dark")
    assert any(warning.startswith("too dark: the picture's mean brightness is")
               and "(at 0.3, 0.9, 1.5, 2.1, 2.7 s)" in warning for warning in dark.warnings), dark.warnings
    chosen = prepare(store, store.create(clips["two faces"], "right one", face_index=1))
    assert chosen.status == READY and chosen.face_index == 1
    found = np.load(chosen.track_dir / "found.npy")
    boxes = np.load(chosen.track_dir / "raw_boxes.npy")
    assert found.all() and (boxes[:, 0] > 320).all()  # the face on the right half, every frame
    with pytest.raises(HeygemError, match="you already have a presenter named 'dark'"):
        store.create(clips["face video"], "dark")


def test_track_warnings_name_the_seconds():
    frames = 50  # 2 s at 25 fps, 640x480
    found = np.ones(frames, bool)
    found[10:20] = False  # 0.4-0.8 s without a face
    boxes = np.tile(np.array([200, 100, 300, 250], np.float32), (frames, 1))
    boxes[30:35] = [0, 100, 60, 160]  # 1.2-1.4 s: small and at the left edge
    info = probe_like(frames, 25.0, 640, 480)
    warnings = checks.track_warnings(found, boxes, info, FrameGeometry(640, 480))
    assert warnings == [
        "the face is found in only 80 % of the frames (missing at 0.4-0.8 s): those frames are shown as they are, "
        "without lip-sync",
        "the face is under 80 pixels tall at 1.2-1.4 s (smallest 60 px): the mouth will look soft; use a closer shot",
        "the face is cut by the frame's edge at 1.2-1.4 s: keep the whole face in the picture",
    ]
    # measured in the clip's own pixels: the same boxes tracked at half size are twice as tall
    assert len(checks.track_warnings(found, boxes / 2, info, FrameGeometry(320, 240))) == 3
    assert checks.track_warnings(np.ones(frames, bool), np.tile(boxes[:1], (frames, 1)), info,
                                 FrameGeometry(640, 480)) == []


def probe_like(frames: int, fps: float, width: int, height: int):
    from heygem.types import MediaInfo

    return MediaInfo(path=Path("clip.mp4"), kind="video", width=width, height=height, fps=fps, frame_count=frames,
                     duration=frames / fps)


def test_the_speech_sample_is_what_the_cloned_voice_would_pick(clips, tmp_path):
    """The presenter's sample is cut by the cloned voice's own rule (heygem.speech.reference): the speech of
    a talking clip, nothing from a steady tone (voiced, but no speech)."""
    from heygem.presenters.prepare import cut_speech_sample
    from heygem.speech.audio import decode_audio
    from heygem.speech.reference import cleanest_speech

    sample = tmp_path / "speech.wav"
    seconds = cut_speech_sample(probe(clips["talking"]), sample)
    expected, rate = cleanest_speech(clips["talking"])
    assert seconds == round(len(expected) / rate, 3) and 5.0 <= seconds <= 7.5
    written = decode_audio(sample, rate)
    assert len(written) == len(expected) and np.abs(written - expected).max() < 1e-3  # 16-bit steps
    tone = tmp_path / "tone.wav"
    run_ffmpeg("-f", "lavfi", "-i", "sine=frequency=200:duration=12", str(tone))
    assert cut_speech_sample(probe(tone), tmp_path / "none.wav") is None
    assert not (tmp_path / "none.wav").exists()


def test_prepared_video_and_photo(clips, tmp_path):
    store = PresenterStore(tmp_path / "outputs")
    made = store.create(clips["talking"], "Ann")
    assert made.status == "preparing" and made.clip_path.is_file()
    ready = prepare(store, made)
    assert ready.status == READY and ready.kind == "video" and 7.3 < ready.seconds < 7.5
    assert (ready.width, ready.height) == (320, 240)
    found = np.load(ready.track_dir / "found.npy")
    assert found.shape == (probe(ready.clip_path).frame_count,) and found.all()
    thumbnail = cv2.imread(str(ready.thumbnail_path))
    assert thumbnail.shape == (240, 320, 3)
    green = (thumbnail[:, :, 1] > 150) & (thumbnail[:, :, 0] < 80) & (thumbnail[:, :, 2] < 80)
    red = (thumbnail[:, :, 2] > 170) & (thumbnail[:, :, 1] < 80) & (thumbnail[:, :, 0] < 80)
    assert green.sum() > 100 and red.sum() > 20  # the face box and the mouth
    sample = probe(ready.sample_path)
    assert sample.kind == "audio" and 5.0 <= sample.duration <= 7.5 and ready.speech_seconds >= 5.0
    photo = prepare(store, store.create(clips["photo"], "Ann's photo"))
    assert photo.kind == "image" and photo.seconds == 0 and photo.sample_path is None
    assert cv2.imread(str(photo.thumbnail_path)) is not None
    silent_tone = prepare(store, store.create(clips["face video"], "tone"))  # 2 s: too little for a sample
    assert silent_tone.speech_seconds is None and not (silent_tone.directory / "speech.wav").exists()
    assert [presenter.name for presenter in store.list()] == ["tone", "Ann's photo", "Ann"]


def heygem(*args, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HEYGEM_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "heygem", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def summary_of(output: Path) -> dict:
    return json.loads(output.with_suffix(".json").read_text(encoding="utf-8"))


def test_cli_add_generate_list_remove(clips, short_speech, tmp_path):
    outputs, cache = tmp_path / "outputs", tmp_path / "cache"
    added = heygem("presenters", "add", clips["face video"], "--name", "Bea", "--outputs", outputs, cache=cache)
    assert added.returncode == 0, added.stderr
    assert added.stdout.startswith("added presenter 'Bea' (p-") and "2.0 s video, 320x240" in added.stdout
    by_audio = tmp_path / "by audio.mp4"
    made = heygem("generate", "--presenter", "Bea", "--outputs", outputs, "--audio", short_speech, "-o", by_audio,
                  cache=cache)
    assert made.returncode == 0, made.stderr
    assert_playable_mp4(by_audio, probe(short_speech).duration)
    assert summary_of(by_audio)["avatar_cache"] == "hit"
    by_text = tmp_path / "by text.mp4"
    made = heygem("generate", "--presenter", "Bea", "--outputs", outputs, "--text", "Hello. I was recorded once.",
                  "-o", by_text, "--output-height", 120, cache=tmp_path / "an empty cache")
    assert made.returncode == 0, made.stderr
    summary = summary_of(by_text)
    frames = decode_frames(by_text)  # (N, 120, 160, 3): every frame decodes
    assert frames.shape[1:] == (120, 160, 3) and len(frames) == summary["frames"] > 30
    assert probe(by_text).has_audio
    assert summary["avatar_cache"] == "hit" and summary["height"] == 120  # the kept track, scaled to 120 rows
    listed = heygem("presenters", "list", "--outputs", outputs, cache=cache)
    assert listed.returncode == 0 and " Bea " in listed.stdout and " ready " in listed.stdout
    removed = heygem("presenters", "remove", "Bea", "--outputs", outputs, cache=cache)
    assert removed.returncode == 0 and removed.stdout.startswith("removed presenter 'Bea'")
    assert PresenterStore(outputs).list() == [] and presenter_folders(PresenterStore(outputs)) == []
    gone = heygem("generate", "--presenter", "Bea", "--outputs", outputs, "--audio", short_speech, "-o", by_audio,
                  cache=cache)
    assert gone.returncode == 2 and gone.stderr.strip() == ("error: there is no presenter 'Bea' (python -m heygem "
                                                            "presenters list shows them)")


def test_cli_refusal_is_one_line_exit_2(clips, tmp_path):
    refused = heygem("presenters", "add", clips["two faces"], "--name", "Two", "--outputs", tmp_path / "outputs",
                     cache=tmp_path / "cache")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "shows 2 faces" in refused.stderr
    assert "face_index 0 to 1" in refused.stderr
    assert presenter_folders(PresenterStore(tmp_path / "outputs")) == []
    for face in ((), ("--face", clips["photo"], "--presenter", "Two")):
        neither_or_both = heygem("generate", *face, "--audio", clips["speech only"], "-o", tmp_path / "out.mp4",
                                 cache=tmp_path / "cache")
        assert neither_or_both.returncode == 2
        assert neither_or_both.stderr == "error: give the face as --face FILE or --presenter NAME (one of them)\n"


def test_a_preparation_left_unfinished_starts_again(clips, tmp_path):
    from heygem.presenters.api import Preparer

    store = PresenterStore(tmp_path / "outputs")
    interrupted = store.create(clips["face video"], "interrupted")  # recorded, never prepared: a server stopped
    Preparer(store)
    deadline = time.monotonic() + 120
    while store.get(interrupted.id).status == "preparing" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert store.get(interrupted.id).status == READY


USERS = "admin alice:alice-long-secret\nbob:bob-long-secret\ncarol:carol-long-secret\n"


def test_a_clip_that_fails_its_preparation_is_failed_with_its_reason_and_its_files_go(clips, tmp_path):
    from heygem.presenters.api import Preparer

    store = PresenterStore(tmp_path / "outputs")
    presenter = store.create(clips["face video"], "swapped")
    shutil.copyfile(clips["wall"], presenter.clip_path)  # what the quick look saw is gone: no face anywhere
    Preparer(store)  # takes the presenter left preparing, as a server starting does
    deadline = time.monotonic() + 120
    while store.get(presenter.id).status == "preparing" and time.monotonic() < deadline:
        time.sleep(0.2)
    failed = store.get(presenter.id)
    assert failed.status == "failed" and failed.error.startswith("no face was found in face video.mp4"), failed
    assert not presenter.directory.exists() and failed.to_dict()["thumbnail"] is None


@pytest.fixture(scope="module")
def server(tmp_path_factory, clips):
    from faults import Server

    folder = tmp_path_factory.mktemp("presenters app")
    (folder / "users.txt").write_text(USERS)
    # recorded by a server that stopped before preparing it: the next one prepares it
    PresenterStore(folder / "outputs").create(clips["photo"], "left over", submitter="bob")
    live = Server(folder / "outputs", folder / "app.log", extra_args=("--users", str(folder / "users.txt")),
                  env={"HEYGEM_CACHE_DIR": str(folder / "cache")}, auth=("alice", "alice-long-secret")).wait_ready()
    live.client.auth = None  # each request names its user
    yield live
    live.stop()


def as_user(name: str) -> dict:
    return {"Authorization": f"Bearer {name}-long-secret"}


def wait_for(server, path: str, user: str, done, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = server.client.get(path, headers=as_user(user)).json()
        if done(body):
            return body
        time.sleep(0.3)
    raise AssertionError(f"{path} not done in {timeout} s: {body}")


def test_a_presenter_left_preparing_is_prepared_when_the_server_starts(server):
    listed = server.client.get("/api/presenters", headers=as_user("bob")).json()["presenters"]
    left_over = next(presenter for presenter in listed if presenter["name"] == "left over")
    shown = wait_for(server, f"/api/presenters/{left_over['id']}", "bob", lambda body: body["status"] != "preparing")
    assert shown["status"] == "ready" and shown["kind"] == "image" and shown["thumbnail"]
    assert server.client.delete(f"/api/presenters/{left_over['id']}", headers=as_user("bob")).status_code == 200


def test_rest_presenters_are_their_owners_and_make_jobs(server, clips, short_speech, tmp_path):
    client = server.client
    with open(clips["face video"], "rb") as clip:
        made = client.post("/api/presenters", headers=as_user("bob"), data={"name": "Bob"},
                           files={"video": ("bob.mp4", clip, "video/mp4")})
    assert made.status_code == 201, made.text
    presenter_id = made.json()["id"]
    assert made.json()["name"] == "Bob" and made.json()["status"] == "preparing"
    shown = wait_for(server, f"/api/presenters/{presenter_id}", "bob", lambda body: body["status"] != "preparing")
    assert shown["status"] == "ready" and 1.9 < shown["seconds"] < 2.1, shown
    assert shown["size"] == {"width": 320, "height": 240} and isinstance(shown["warnings"], list)
    assert shown["thumbnail"] == f"/api/presenters/{presenter_id}/thumbnail"
    thumbnail = client.get(shown["thumbnail"], headers=as_user("bob"))
    assert thumbnail.headers["content-type"] == "image/jpeg"
    assert cv2.imdecode(np.frombuffer(thumbnail.content, np.uint8), cv2.IMREAD_COLOR).shape == (240, 320, 3)
    assert presenter_id in [p["id"] for p in client.get("/api/presenters", headers=as_user("bob")).json()[
        "presenters"]]
    assert presenter_id in [p["id"] for p in client.get("/api/presenters", headers=as_user("alice")).json()[
        "presenters"]]  # an admin sees every user's

    # another user: as if it did not exist
    assert client.get("/api/presenters", headers=as_user("carol")).json() == {"presenters": []}
    for method, path in (("GET", ""), ("GET", "/thumbnail"), ("DELETE", "")):
        answer = client.request(method, f"/api/presenters/{presenter_id}{path}", headers=as_user("carol"))
        assert answer.status_code == 404 and answer.json() == {"error": f"there is no presenter {presenter_id!r}"}
    with open(short_speech, "rb") as speech:
        borrowed = client.post("/api/jobs", headers=as_user("carol"), data={"presenter": presenter_id},
                               files={"audio": ("speech.wav", speech, "audio/wav")})
    assert borrowed.status_code == 400 and borrowed.json()["error"] == f"there is no presenter {presenter_id!r}"

    # jobs with the presenter: speech, then typed text; neither tracks a face
    with open(short_speech, "rb") as speech:
        spoken = client.post("/api/jobs", headers=as_user("bob"), data={"presenter": presenter_id},
                             files={"audio": ("speech.wav", speech, "audio/wav")})
    assert spoken.status_code == 201, spoken.text
    typed = client.post("/api/jobs", headers=as_user("bob"),  # multipart, as every job: fields without files
                        files={"presenter": (None, presenter_id), "text": (None, "Hello. I was recorded once.")})
    assert typed.status_code == 201, typed.text
    for job_id in (spoken.json()["id"], typed.json()["id"]):
        job = wait_for(server, f"/api/jobs/{job_id}", "bob",
                       lambda body: body["status"] in ("done", "failed", "cancelled"))
        assert job["status"] == "done", job
        result = tmp_path / f"{job_id}.mp4"
        result.write_bytes(client.get(f"/api/jobs/{job_id}/result", headers=as_user("bob")).content)
        assert len(decode_frames(result)) > 30 and probe(result).has_audio
        summary = json.loads((server.outputs / job_id / "result.json").read_text())
        assert summary["avatar_cache"] == "hit" and (summary["width"], summary["height"]) == (320, 240)

    # gradio_client: the presenters listed, a job made from one by id, no other user's
    from gradio_client import Client

    as_bob = Client(server.url, verbose=False, auth=("bob", "bob-long-secret"))
    assert presenter_id in [shown["id"] for shown in as_bob.predict(api_name="/presenters")]
    video, job_id = as_bob.predict(presenter=presenter_id, text="Hello again.", api_name="/generate")
    assert probe(video).has_audio and len(decode_frames(Path(video))) > 10
    assert json.loads((server.outputs / job_id / "result.json").read_text())["avatar_cache"] == "hit"
    as_carol = Client(server.url, verbose=False, auth=("carol", "carol-long-secret"))
    assert as_carol.predict(api_name="/presenters") == []
    with pytest.raises(Exception, match="there is no presenter"):
        as_carol.predict(presenter=presenter_id, text="Hello.", api_name="/submit_job")

    gone = client.delete(f"/api/presenters/{presenter_id}", headers=as_user("bob"))
    assert gone.json() == {"id": presenter_id, "status": "deleted"}
    assert client.get(f"/api/presenters/{presenter_id}", headers=as_user("bob")).status_code == 404


@pytest.mark.parametrize("clip, fields, message", [
    ("two faces", {"name": "Two"}, "two faces.mp4 shows 2 faces"),
    ("short", {"name": "Short"}, "lasts at least 2 s"),
    ("face video", {"name": " "}, "give the presenter a name"),
    ("face video", {"name": "Index", "face_index": "left"}, "face_index counts faces from the left from 0"),
])
def test_rest_refusals_are_400_and_keep_nothing(server, clips, clip, fields, message):
    with open(clips[clip], "rb") as video:
        refused = server.client.post("/api/presenters", headers=as_user("carol"), data=fields,
                                     files={"video": (clips[clip].name, video, "video/mp4")})
    assert refused.status_code == 400 and message in refused.json()["error"], refused.text
    assert server.client.get("/api/presenters", headers=as_user("carol")).json() == {"presenters": []}
    assert list((server.outputs / "presenters").iterdir()) == []


def test_the_batch_tab_has_a_saved_presenter_speak_every_audio_and_text_file(server, clips, short_speech, tmp_path,
                                                                            monkeypatch):
    """The Batch tab's planning with a presenter (heygem.ui.batch over heygem.jobs.batch): every audio and .txt
    file becomes an item of the presenter, a face among the files is said to be unused, the preview names the
    presenter, and the queued jobs (run by the server's worker) use its track."""
    from heygem.jobs.batch import plan_for_presenter
    from heygem.jobs.store import JobStore
    from heygem.ui.batch import preview_table, queue_batch

    with open(clips["face video"], "rb") as clip:
        made = server.client.post("/api/presenters", headers=as_user("bob"), data={"name": "Batch Bob"},
                                  files={"video": ("bob.mp4", clip, "video/mp4")})
    presenter_id = made.json()["id"]
    wait_for(server, f"/api/presenters/{presenter_id}", "bob", lambda body: body["status"] != "preparing")
    greeting = tmp_path / "greeting.txt"
    greeting.write_text("Hello from a batch.", encoding="utf-8")
    files = [short_speech, greeting, clips["photo"]]
    items = plan_for_presenter(files, presenter_id)
    assert sorted((item.name, item.problem is None) for item in items) == sorted(
        [(short_speech.stem, True), ("greeting", True), (clips["photo"].stem, False)])
    presenters = PresenterStore(server.outputs)
    table, summary = preview_table(items, presenters)
    assert summary.startswith("**Preview:** 2 of 3 item(s) will run")
    assert set(table["face"]) == {"presenter Batch Bob"}
    with pytest.raises(HeygemError, match="no audio or text files"):
        plan_for_presenter([clips["photo"]], presenter_id)

    store = JobStore(server.outputs)
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(server.outputs.parent / "cache"))  # the page's: the server's own
    _, outcome = queue_batch(store, [item for item in items if item.problem is None],
                             {"media.output_height": 120}, submitter="bob")
    for name, job_id in outcome.items():
        assert isinstance(job_id, str), (name, job_id)
        job = wait_for(server, f"/api/jobs/{job_id}", "bob", lambda body: body["status"] in ("done", "failed"))
        assert job["status"] == "done", job
        summary = json.loads((server.outputs / job_id / "result.json").read_text())
        assert summary["avatar_cache"] == "hit" and summary["height"] == 120
        assert len(decode_frames(server.outputs / job_id / "result.mp4")) > 10


def blocked_preparer(store: PresenterStore):
    """A Preparer whose first progress report waits until the test lets it go: (preparer, started, go)."""
    import threading

    from heygem.presenters.api import Preparer

    started, go = threading.Event(), threading.Event()
    report = store.report_progress

    def held_report(presenter_id: str, fraction: float) -> None:
        report(presenter_id, fraction)
        started.set()
        go.wait(60)

    store.report_progress = held_report
    return Preparer(store), started, go


def test_deleting_a_presenter_under_preparation_stops_it_and_leaves_nothing(clips, tmp_path):
    """DELETE of a presenter being prepared (REST, the page) stops its preparation and removes it, files and
    all; the preparer goes on with the next one."""
    import threading

    from conftest import rest_client

    from heygem.jobs.store import JobStore

    store = PresenterStore(tmp_path / "outputs")
    doomed = store.create(clips["talking"], "Doomed")
    kept = store.create(clips["face video"], "Kept")
    preparer, started, go = blocked_preparer(store)  # picks both up: Doomed first
    assert started.wait(60)
    assert store.get(doomed.id).status == "preparing" and (store.folder / doomed.id).is_dir()
    client = rest_client(JobStore(tmp_path / "outputs"), presenters=store, preparer=preparer)
    threading.Timer(0.5, go.set).start()  # the preparation goes on, and meets the cancel at its next report
    answer = client.delete(f"/api/presenters/{doomed.id}")
    assert answer.status_code == 200 and answer.json() == {"id": doomed.id, "status": "deleted"}
    assert store.get(doomed.id) is None and not (store.folder / doomed.id).exists()
    deadline = time.monotonic() + 120
    while store.get(kept.id).status == "preparing":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert store.get(kept.id).status == READY
    assert [presenter.name for presenter in store.list()] == ["Kept"]


def test_gradio_client_makes_and_removes_presenters(server, clips):
    """gradio_client's /add_presenter checks the clip as REST does (one message, nothing kept for a refused
    one), the presenter is prepared in the background and listed by /presenters; /remove_presenter deletes
    only the user's own."""
    from gradio_client import Client, handle_file

    as_bob = Client(server.url, verbose=False, auth=("bob", "bob-long-secret"))
    with pytest.raises(Exception, match="no face was found in wall.mp4"):
        as_bob.predict(video=handle_file(str(clips["wall"])), name="Wall", api_name="/add_presenter")
    made = as_bob.predict(video=handle_file(str(clips["face video"])), name="Client Bob", face_index="",
                          api_name="/add_presenter")
    assert made["name"] == "Client Bob" and made["status"] == "preparing" and made["submitter"] == "bob"
    deadline = time.monotonic() + 120
    while True:
        listed = {shown["id"]: shown for shown in as_bob.predict(api_name="/presenters")}
        if listed[made["id"]]["status"] != "preparing" or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert listed[made["id"]]["status"] == "ready" and "Wall" not in [shown["name"] for shown in listed.values()]
    as_carol = Client(server.url, verbose=False, auth=("carol", "carol-long-secret"))
    with pytest.raises(Exception, match="there is no presenter"):
        as_carol.predict(presenter=made["id"], api_name="/remove_presenter")
    assert as_bob.predict(presenter=made["id"], api_name="/remove_presenter") == {"id": made["id"],
                                                                                  "status": "deleted"}
    assert made["id"] not in [shown["id"] for shown in as_bob.predict(api_name="/presenters")]


def test_deleting_a_presenter_whose_preparation_ended_meanwhile_removes_it_at_once(clips, tmp_path):
    """A presenter seen as preparing whose preparation ends before the delete is looked at again is removed
    there and then, not waited for (and nothing of it stays marked for stopping)."""
    store = PresenterStore(tmp_path / "outputs")
    busy = store.create(clips["talking"], "Busy")
    ended = store.create(clips["face video"], "Ended")
    preparer, started, go = blocked_preparer(store)  # held on Busy: Ended waits its turn
    assert started.wait(60)
    seen = store.get(ended.id)
    assert seen.status == "preparing"
    store.mark_ready(ended.id, [], None)  # as if its preparation had just ended
    assert preparer.delete(seen, wait_seconds=0.5)
    assert store.get(ended.id) is None and not (store.folder / ended.id).exists()
    assert ended.id not in preparer.cancelled
    go.set()
    deadline = time.monotonic() + 120
    while store.get(busy.id).status == "preparing":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert [presenter.name for presenter in store.list()] == ["Busy"]
