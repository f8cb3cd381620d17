"""A job watched while it renders: HLS from the x264 that writes the MP4, over REST and in a real browser."""

from __future__ import annotations

import time
from pathlib import Path

import av
import cv2
import numpy as np
import pytest
from conftest import ASSETS, run_ffmpeg
from faults import Server

from heygem.jobs.stream import stream_url
from heygem.media import encode
from heygem.media.frames import bgr_to_yuv420
from heygem.media.probing import probe
from heygem.media.stream import key_frames, listed_segments, playlist, segment_path, stream_folder
from heygem.types import FrameGeometry

CHROMIUM = Path("/usr/bin/chromium")
OPTIONS = {"media.output_height": 256}


def astronaut_frames(count: int, width: int = 192, height: int = 144) -> np.ndarray:
    """(N, H * 3/2, W) uint8 I420: the portrait, its crop drifting a pixel a frame."""
    photo = cv2.imread(str(ASSETS / "astronaut.jpg"))
    photo = cv2.resize(photo, (width + count, height + 20))
    return np.stack([bgr_to_yuv420(np.ascontiguousarray(photo[10:10 + height, index:index + width]))
                     for index in range(count)])


def segment_streams(folder: Path) -> list[tuple[set[str], float, int, float]]:
    """For each listed segment: its stream kinds, video seconds, decoded video frames and audio seconds."""
    found = []
    for segment in listed_segments(folder):
        with av.open(str(folder / segment.name)) as container:
            kinds = {stream.type for stream in container.streams}
            video, audio = container.streams.video[0], container.streams.audio[0]
            frames = [frame.pts * video.time_base for frame in container.decode(video)]
            container.seek(0)
            samples = sum(frame.samples for frame in container.decode(audio))
        found.append((kinds, len(frames) / float(video.average_rate), len(frames), samples / audio.sample_rate))
    return found


def test_key_frames_make_a_short_first_segment_then_one_every_four_seconds():
    assert key_frames(1500, 25.0) == [0, 13, 50, *range(150, 1500, 100)]
    assert key_frames(10, 25.0) == [0]
    assert key_frames(1, 30.0) == [0]


@pytest.mark.parametrize("encoders", [1, 2])
def test_the_mp4_is_byte_identical_with_a_stream_and_the_segments_cover_it(tmp_path, encoders):
    fps, frame_count = 25, 110  # 4.4 s: two x264 processes get a part each
    speech = tmp_path / "speech.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", str(frame_count / fps), str(speech))
    frames = astronaut_frames(frame_count)
    geometry = FrameGeometry(192, 144)
    results = []
    for streamed in (False, True):
        output = tmp_path / f"it's | a [test]: x=1, streamed {streamed}" / "result.mp4"  # the tee muxer's escapes
        folder = stream_folder(output)
        encoder = encode.open_encoder(geometry, f"{fps}/1", speech, probe(speech), output, crf=18,
                                      preset="veryfast", audio_bitrate="128k", frame_count=frame_count,
                                      encoders=encoders, stream_dir=folder if streamed else None)
        assert type(encoder) is (encode.VideoEncoder if encoders == 1 else encode.SegmentedEncoder)
        encoder.write_i420(frames[:60])
        if streamed:  # the first segments are out while the rest is still to come
            deadline = time.monotonic() + 20
            while playlist(folder) is None:
                assert time.monotonic() < deadline, "no segment came out"
                time.sleep(0.02)
            running = playlist(folder)
            assert "#EXT-X-PLAYLIST-TYPE:EVENT" in running and "#EXT-X-ENDLIST" not in running
            assert not output.exists()
        encoder.write_i420(frames[60:])
        encoder.close()
        results.append(output.read_bytes())
        if not streamed:
            assert not folder.exists()
    assert results[0] == results[1]

    finished = playlist(folder)
    assert finished.startswith("#EXTM3U\n") and finished.rstrip().endswith("#EXT-X-ENDLIST")
    streams = segment_streams(folder)
    assert len(streams) >= 3 and all(kinds == {"video", "audio"} for kinds, *_ in streams)
    assert sum(count for _, _, count, _ in streams) == frame_count  # every frame once, none twice
    assert streams[0][2] == 13  # the first segment is half a second
    assert max(seconds for _, seconds, _, _ in streams) <= 4.0
    assert abs(sum(seconds for _, seconds, _, _ in streams) - frame_count / fps) < 1e-6
    # each x264 process's AAC adds its encoder's priming and padding (two or three 1024-sample frames)
    assert abs(sum(audio for *_, audio in streams) - frame_count / fps) < 0.08 * encoders
    listed = [line for line in finished.splitlines() if line.startswith("#EXTINF")]
    assert abs(sum(float(line[8:].rstrip(",")) for line in listed) - frame_count / fps) < 0.2


def test_only_listed_segment_names_are_served(tmp_path):
    folder = tmp_path / "result.hls"
    folder.mkdir()
    (folder / "0000-00000.ts").write_bytes(b"\x47" * 188)
    (folder / "0000-00001.ts").write_bytes(b"\x47" * 100)  # being written: not listed yet
    (folder / "0000.csv").write_text("0000-00000.ts,0.0,0.52\n0000-00001.ts,0.52,1.04\n")
    (tmp_path / "secret.txt").write_text("no")
    assert [segment.name for segment in listed_segments(folder)] == ["0000-00000.ts"]
    assert segment_path(folder, "0000-00000.ts") == folder / "0000-00000.ts"
    for name in ("0000-00001.ts", "../secret.txt", "0000-00000.ts/..", "0000.csv", "/etc/passwd", "0000-0000.ts"):
        assert segment_path(folder, name) is None, name
    assert "#EXT-X-ENDLIST" not in playlist(folder) and "#EXT-X-ENDLIST" in playlist(folder, ended=True)


def test_the_playlist_stops_at_the_first_x264_process_still_running(tmp_path):
    folder = tmp_path / "result.hls"
    folder.mkdir()
    for name in ("0000-00000.ts", "0000-00001.ts", "0001-00000.ts"):
        (folder / name).write_bytes(b"\x47" * 188)
    (folder / "0000.csv").write_text("0000-00000.ts,0.0,0.5\n0000-00001.ts,0.5,2.0\n")
    (folder / "0001.csv").write_text("0001-00000.ts,0.0,4.0\n")  # the next part, done before the first
    assert [segment.name for segment in listed_segments(folder)] == ["0000-00000.ts", "0000-00001.ts"]
    (folder / "0000.done").touch()
    segments = listed_segments(folder)
    assert [segment.name for segment in segments] == ["0000-00000.ts", "0000-00001.ts", "0001-00000.ts"]
    assert [round(segment.seconds, 3) for segment in segments] == [0.5, 1.5, 2.0]


def test_the_live_player_gets_each_finished_segment_once_in_order_then_goes(tmp_path, monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from heygem.ui import live

    monkeypatch.setattr(live, "FIRST_POLL_SECONDS", 0.001)
    monkeypatch.setattr(live, "POLL_SECONDS", 0.001)
    folder = stream_folder(tmp_path / "result.mp4")
    folder.mkdir()
    job = SimpleNamespace(status="queued", result_path=tmp_path / "result.mp4", is_finished=False)
    lines = ["0000-00000.ts,0.0,0.5", "0000-00001.ts,0.5,2.0", "0000-00002.ts,2.0,6.0"]

    def find(job_id, request):  # the page's access rules: only "mine" is this user's
        return job if job_id == "mine" else None

    def page_access(find_job):  # what the player asks of the page's access rules (heygem.ui.access.PageAccess)
        return SimpleNamespace(find=find_job, note_stream_user=lambda request: None)

    def step(polls: list[str]) -> None:  # what the encoder has written by each poll of the player
        index = len(polls)
        if index == 2:
            job.status = "running"
        if 3 <= index <= 5:  # one more listed segment, whole, at each poll; the last one still being written
            name = lines[index - 3].split(",")[0]
            (folder / name).write_bytes(b"\x47" * (188 if index < 5 else 10))  # 10 bytes: half a packet
            (folder / "0000.csv").write_text("\n".join(lines[:index - 2]) + "\n")
        if index == 7:
            job.status, job.is_finished = "done", True

    def run(job_id, followed=None) -> list:
        polls: list[str] = []

        def find_and_step(job_id, request):
            step(polls)
            polls.append(job_id)
            return find(job_id, request)

        follow = live.follow_stream(page_access(find_and_step), followed)

        async def collect():
            return [value async for value in follow(job_id, SimpleNamespace(session_hash="page"))]
        return asyncio.run(collect())

    shown = run("mine")
    assert shown[0] == gr_update(visible=True) and shown[-1] == gr_update(visible=False)
    assert shown[1:-1] == [str(folder / "0000-00000.ts"), str(folder / "0000-00001.ts")]  # never one being written
    for name in ("0000.csv", "0000-00000.ts", "0000-00001.ts", "0000-00002.ts"):
        (folder / name).unlink()
    job.status, job.is_finished = "queued", False
    assert run("someone else's") == [gr_update(visible=False)]  # a job this user may not see: nothing
    job.status = "running"
    assert run("mine", followed=lambda request, job_id: False) == [gr_update(visible=False)]  # a newer job
    job.status, job.is_finished = "done", True  # a page that hides the player as it shows the result:
    assert run_until_end(live.follow_stream(page_access(find), hide_when_done=False), "mine") == []
    job.status = "failed"  # ... hides it all the same when there is no result to show
    assert run_until_end(live.follow_stream(page_access(find), hide_when_done=False), "mine") == \
        [gr_update(visible=False)]


def run_until_end(follow, job_id: str) -> list:
    import asyncio
    from types import SimpleNamespace

    async def collect():
        return [value async for value in follow(job_id, SimpleNamespace(session_hash="page"))]
    return asyncio.run(collect())


def gr_update(**props) -> dict:
    import gradio as gr

    return gr.update(**props)


@pytest.fixture(scope="module")
def app(served_app):
    return served_app


def submit(app, speech: Path, options: dict) -> str:
    import json

    files = {"face": ("astronaut.jpg", (ASSETS / "astronaut.jpg").read_bytes()),
             "audio": (speech.name, speech.read_bytes())}
    response = app.client.post("/api/jobs", files=files, data={"options": json.dumps(options)})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_rest_stream_404_before_the_first_segment_then_event_then_endlist(app, tmp_path):
    speech = tmp_path / "speech.wav"  # all 7.4 s: a job long enough that the polls below meet it while it runs
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), str(speech))
    job_id = submit(app, speech, OPTIONS)
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        response = app.client.get(stream_url(job_id))
        status = app.client.get(f"/api/jobs/{job_id}").json()["status"]
        seen.append((response.status_code, "#EXT-X-ENDLIST" in response.text, status))
        if status in ("done", "failed", "cancelled"):
            break
        time.sleep(0.02)
    assert status == "done", app.log_text()[-2000:]
    assert any(code == 404 and not ended for code, ended, _ in seen)  # before the first segment
    assert any(code == 200 and not ended for code, ended, _ in seen)  # EVENT while it ran
    final = app.client.get(stream_url(job_id))
    assert final.status_code == 200 and final.headers["content-type"].startswith("application/vnd.apple.mpegurl")
    assert "#EXT-X-PLAYLIST-TYPE:EVENT" in final.text and final.text.rstrip().endswith("#EXT-X-ENDLIST")
    names = [line for line in final.text.splitlines() if line and not line.startswith("#")]
    assert names[0] == "stream/0000-00000.ts"
    for name in names:
        segment = app.client.get(f"/api/jobs/{job_id}/{name}")
        assert segment.status_code == 200 and segment.headers["content-type"] == "video/mp2t"
        assert segment.content[:1] == b"\x47"
    for bad in ("..%2Fresult.mp4", "0000.csv", "0000-00000.ts.bak", "..%2F..%2Fjobs.db", "0009-00000.ts"):
        assert app.client.get(f"/api/jobs/{job_id}/stream/{bad}").status_code == 404, bad
    assert app.client.get(stream_url("no-such-job")).status_code == 404
    assert app.client.get(f"/api/jobs/{job_id}").json()["stream"] == stream_url(job_id)

    # the job's MP4 (streamed) is the one the pipeline writes with no stream, byte for byte
    from heygem.pipeline import generate

    result = app.client.get(f"/api/jobs/{job_id}/result").content
    unstreamed = tmp_path / "unstreamed.mp4"
    generate(ASSETS / "astronaut.jpg", speech, unstreamed, overrides={**OPTIONS, "media.stream": False})
    assert unstreamed.read_bytes() == result
    assert not stream_folder(unstreamed).exists()


STREAM_USERS = {"dana": "dana-long-secret"}


@pytest.fixture(scope="module")
def users_app(tmp_path_factory):
    """`python app.py --users FILE`: the page is behind Gradio's login form."""
    folder = tmp_path_factory.mktemp("stream users app")
    users_file = folder / "users.txt"
    users_file.write_text("".join(f"{name}:{password}\n" for name, password in STREAM_USERS.items()),
                          encoding="utf-8")
    server = Server(folder / "outputs", folder / "app.log", extra_args=("--users", str(users_file)))
    server.client.auth = next(iter(STREAM_USERS.items()))  # REST as the same user
    yield server.wait_ready()
    server.stop()


PLAYING = """(player) => { const v = document.querySelector(`#${player} video`);
                           return v !== null && !v.paused && v.currentTime > 0.3; }"""
PLAYED_ON = """([player, from]) => { const v = document.querySelector(`#${player} video`);
                                   return v !== null && !v.paused && v.currentTime > from + 0.5; }"""


IN_VIEW = """(id) => { const box = document.getElementById(id).getBoundingClientRect();
                       return box.top >= -2 && box.top < window.innerHeight / 2; }"""
# a <track> of the player's video showing cues (the job's subtitles, as WebVTT)
SUBTITLES_SHOWN = """(player) => { const v = document.querySelector(`#${player} video`);
    if (v === null) return false;
    return Array.from(v.textTracks).some(track => track.mode === "showing" && track.cues && track.cues.length > 0)
        && v.querySelector("track") !== null; }"""
# where the live player was when last heard of, kept by the page for the test
NOTE_LIVE_TIME = """() => { window.lastLiveTime = 0; document.addEventListener("timeupdate", (event) => {
    if (event.target.closest && event.target.closest("#live-stream")) window.lastLiveTime = event.target.currentTime;
}, true); }"""


def generate_in_page(page, output_height: str) -> str:
    """Set the output height, press Generate and return the id of the job the page then follows."""
    page.locator("#options-accordion").click()
    page.locator("#output-height input").fill(output_height)
    page.locator("#output-height input").press("Enter")
    page.click("#generate-button")
    page.wait_for_selector("#job-card .job-id")
    return page.inner_text("#job-card .job-id").split()[1]


def assert_plays_while_running(page, server, player: str, job_id: str) -> None:
    """The player's video plays on (not paused, its time advancing) while the job is still running."""
    page.wait_for_function(PLAYING, arg=player, timeout=60_000)
    started = page.evaluate(f"() => document.querySelector('#{player} video').currentTime")
    page.wait_for_function(PLAYED_ON, arg=[player, started], timeout=20_000)
    status = server.client.get(f"/api/jobs/{job_id}").json()["status"]
    assert status == "running", status


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
@pytest.mark.parametrize("signed_in", [False, True], ids=["open server", "--users"])
def test_the_page_plays_the_stream_before_the_job_is_done(request, tmp_path, signed_in):
    """Generate plays the job's stream while it renders (on the open server the Jobs tab then plays it too:
    a longer speech leaves the time for both), then shows the final MP4."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    from test_browser import CHROMIUM_ARGS, opened_page

    server = request.getfixturevalue("users_app" if signed_in else "app")
    user = next(iter(STREAM_USERS.items())) if signed_in else None
    speech = tmp_path / "long speech.wav"  # 45 s or 75 s: the job renders for several seconds while the page plays
    loops = "5" if signed_in else "9"
    run_ffmpeg("-stream_loop", loops, "-i", str(ASSETS / "speech_en.wav"), "-c", "copy", str(speech))
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            with opened_page(browser, server.url, user) as page:
                fetched = []
                page.on("response", lambda response: fetched.append(response.url))
                page.locator("#face-input input[type=file]").set_input_files(str(ASSETS / "astronaut.jpg"))
                page.locator("#audio-input input[type=file]").set_input_files(str(speech))
                page.wait_for_selector("#audio-input a[data-testid=download-link]")
                job_id = generate_in_page(page, "360 px")
                assert_plays_while_running(page, server, "live-stream", job_id)
                page.screenshot(path=str(tmp_path / "playing.png"), full_page=True)
                if not signed_in:  # the Jobs tab plays the running job picked in its table
                    page.get_by_role("tab", name="Jobs").click()
                    page.get_by_role("button", name="Refresh now").click()
                    page.locator("#jobs-table [role=gridcell]").get_by_text(job_id).click()
                    assert_plays_while_running(page, server, "jobs-live-stream", job_id)
                    page.screenshot(path=str(tmp_path / "jobs tab.png"), full_page=True)
                    page.wait_for_selector("#jobs-live-stream", state="hidden", timeout=180_000)  # gone at the end
                    page.get_by_role("tab", name="Generate").click()
                page.wait_for_selector("#job-card [data-status=done]", timeout=180_000)
                page.wait_for_selector("#result-video video[src]")  # then the final MP4, as before
                page.wait_for_selector("#live-stream", state="hidden")  # and the live player is gone
                page.screenshot(path=str(tmp_path / "done.png"), full_page=True)
                assert page.problems == [], page.problems  # no console error, no failed request
                # the segments came through Gradio's own stream routes, under the page's session
                assert any("/gradio_api/stream/" in url and ".ts" in url for url in fetched), fetched
                assert not any("/api/jobs/" in url for url in fetched), fetched
        finally:
            browser.close()
    assert server.client.get(stream_url(job_id)).text.rstrip().endswith("#EXT-X-ENDLIST")  # REST as before
    if signed_in:  # ... with the REST credentials only
        assert server.client.get(stream_url(job_id), auth=("dana", "wrong")).status_code == 401


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_typed_text_plays_in_the_page_before_the_whole_script_is_spoken(app, tmp_path):
    """A job made from text: the page plays its stream while its worker is still speaking the script
    (the job's speech.wav is written once every sentence is spoken), then shows the final MP4."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    from test_browser import CHROMIUM_ARGS, opened_page

    paragraph = ("Welcome to the weekly update. Our team shipped the new streaming player this week. "
                 "It starts playing as soon as the first second of video is ready. ")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            with opened_page(browser, app.url, None) as page:
                page.locator("#face-input input[type=file]").set_input_files(str(ASSETS / "astronaut.jpg"))
                page.wait_for_selector("#face-input :text('astronaut')")
                page.locator("#text-accordion").click()
                page.locator("#text-input textarea").fill(paragraph * 12)  # about 100 s of speech
                page.evaluate(NOTE_LIVE_TIME)
                job_id = generate_in_page(page, "256 px")
                # the card in view after Generate, though the text and the options above it were open
                page.wait_for_function(IN_VIEW, arg="job-card", timeout=30_000)
                page.wait_for_function(PLAYING, arg="live-stream", timeout=60_000)
                speaking = not (app.outputs / job_id / "speech.wav").exists()
                assert_plays_while_running(page, app, "live-stream", job_id)
                page.wait_for_function(SUBTITLES_SHOWN, arg="live-stream", timeout=30_000)  # the cues so far
                page.wait_for_function("() => document.querySelector('#live-stream video').controls")  # pause, mute
                page.screenshot(path=str(tmp_path / "playing.png"), full_page=True)
                page.wait_for_selector("#job-card [data-status=done]", timeout=240_000)
                page.wait_for_selector("#result-video video[src]")
                live_seen = page.evaluate("() => window.lastLiveTime")  # where the live player was at the end
                assert live_seen > 1
                # the result takes over where the live player was, and plays on (not paused at 0:00)
                page.wait_for_function(PLAYED_ON, arg=["result-video", live_seen], timeout=30_000)
                page.wait_for_function(SUBTITLES_SHOWN, arg="result-video", timeout=30_000)
                page.screenshot(path=str(tmp_path / "handed over.png"), full_page=True)
                assert page.locator("#live-stream").count() == 0 or not page.locator("#live-stream").is_visible()
                assert page.problems == [], page.problems
        finally:
            browser.close()
    assert speaking  # it played while the script was still being spoken
    final = app.client.get(stream_url(job_id)).text
    assert final.rstrip().endswith("#EXT-X-ENDLIST") and "stream/0001-00000.ts" in final  # more than one part
