"""A real browser (Debian's chromium through playwright) uses the page as a person would."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ASSETS, REPO, assert_playable_mp4

from heygem.media.ffmpeg import ffmpeg_binary
from heygem.media.probing import probe

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)"),
]


def free_port() -> int:
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return probe_socket.getsockname()[1]


@contextlib.contextmanager
def running_app(folder: Path, *extra_args: str, headers: dict | None = None) -> Iterator[str]:
    """`python app.py` on a free port with its own outputs folder (folder/outputs); yields its URL."""
    import httpx

    port = free_port()
    log_path = folder / "app.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--port", str(port),
                                    "--outputs", str(folder / "outputs"), *extra_args],
                                   cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            try:
                if httpx.get(f"{url}/api/jobs", timeout=5, headers=headers).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture(scope="module")
def app_folder(tmp_path_factory) -> Path:
    """The served app's folder: its outputs under outputs/."""
    return tmp_path_factory.mktemp("browser")


@pytest.fixture(scope="module")
def app_url(app_folder):
    with running_app(app_folder) as url:
        yield url


@pytest.fixture(scope="module")
def speech_clip(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("browser inputs") / "short speech.wav"
    subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-y", "-i", str(ASSETS / "speech_en.wav"), "-t", "1.2",
                    str(path)], check=True)
    return path


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            yield launched
        finally:
            launched.close()


@contextlib.contextmanager
def opened_page(browser, url: str, user: tuple[str, str] | None = None):
    """A fresh browser context on the page (signed in as ``user``); ``page.problems`` collects the console's
    errors and every HTTP answer of 400 or more."""
    context = browser.new_context(accept_downloads=True, viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.problems = []
    page.on("console", lambda message: page.problems.append(message.text) if message.type == "error" else None)
    page.on("response", lambda response: page.problems.append(f"HTTP {response.status} {response.url}")
            if response.status >= 400 else None)
    page.goto(url)
    if user is not None:
        page.locator("input[type=text]").fill(user[0])
        page.locator("input[type=password]").fill(user[1])
        page.get_by_role("button", name="Login").click()
    page.wait_for_selector("#generate-button")
    try:
        yield page
    finally:
        context.close()


@pytest.fixture()
def page(browser, app_url):
    with opened_page(browser, app_url) as opened:
        yield opened


def generate_and_download(page, tmp_path: Path) -> Path:
    page.click("#generate-button")
    page.wait_for_selector("#job-card .job-card", timeout=30_000)  # the job id and queue place show at once
    assert "job " in page.inner_text("#job-card")
    page.wait_for_selector("#job-card [data-status=done]", timeout=180_000)
    page.wait_for_selector("#result-video video[src]")
    with page.expect_download() as download_info:
        page.click("#download-button")
    download = download_info.value
    target = tmp_path / download.suggested_filename
    download.save_as(target)
    return target


def test_upload_generate_watch_and_download(page, speech_clip, tmp_path):
    page.locator("#face-input input[type=file]").set_input_files(str(ASSETS / "astronaut.jpg"))
    page.locator("#audio-input input[type=file]").set_input_files(str(speech_clip))
    page.wait_for_selector("#face-input :text('astronaut')")
    page.wait_for_selector("#audio-input a[data-testid=download-link]")  # the upload has reached the server
    page.locator("#options-accordion").click()
    page.locator("#output-height input").fill("256 px")
    page.locator("#output-height input").press("Enter")
    video = generate_and_download(page, tmp_path)
    assert video.name == "astronaut-short speech.mp4"  # named after the inputs, not result.mp4
    assert_playable_mp4(video, probe(speech_clip).duration)
    assert probe(video).height == 256
    assert page.locator("#stage-chart").is_visible()  # seconds per stage, for a finished job
    assert page.problems == []  # no failed request (e.g. a cancel with no event id) and no console error


def test_an_example_fills_the_form_and_generates(page, tmp_path):
    page.get_by_text("Astronaut photo + English speech").click()
    page.wait_for_selector("#audio-input a[data-testid=download-link]")
    page.locator("#options-accordion").click()
    page.locator("#output-height input").fill("256 px")
    page.locator("#output-height input").press("Enter")
    page.click("#generate-button")  # a first job, replaced at once by a second: the page follows the newest
    page.wait_for_selector("#job-card .job-card[data-status]:not([data-status=problem])")
    first = page.inner_text("#job-card .job-id")
    page.click("#generate-button")
    page.wait_for_function("first => { const shown = document.querySelector('#job-card .job-id'); "
                           "return shown && shown.textContent !== first; }", arg=first)
    page.wait_for_selector("#job-card [data-status=done]", timeout=180_000)
    # the first job's watch may deliver one last card just after the second job's (under load Gradio's
    # messages of two events can cross), but it ends there: the job followed to the end is the newer one
    assert page.inner_text("#job-card .job-id") != first
    with page.expect_download() as download_info:
        page.click("#download-button")
    video = tmp_path / download_info.value.suggested_filename
    download_info.value.save_as(video)
    assert video.name == "astronaut-speech_en.mp4"
    assert_playable_mp4(video, probe(ASSETS / "speech_en.wav").duration)
    assert page.problems == []


def test_typed_text_becomes_a_talking_video_with_subtitles(page, tmp_path):
    import av

    page.locator("#face-input input[type=file]").set_input_files(str(ASSETS / "astronaut.jpg"))
    page.wait_for_selector("#face-input :text('astronaut')")
    page.locator("#text-accordion").click()
    page.locator("#text-input textarea").fill("Good evening. I was typed into a web page.")
    page.locator("#options-accordion").click()
    page.locator("#output-height input").fill("256 px")
    page.locator("#output-height input").press("Enter")
    video = generate_and_download(page, tmp_path)
    with av.open(str(video)) as container:
        kinds = sorted(stream.type for stream in container.streams)
        seconds = float(container.duration) / 1e6
    assert kinds == ["audio", "subtitle", "video"] and 1.5 < seconds < 8 and probe(video).height == 256


def test_listen_speaks_the_typed_text_and_names_the_voice(page):
    page.locator("#text-accordion").click()
    page.locator("#text-input textarea").fill("Hello there. 你好。")
    page.click("#listen-button")
    page.wait_for_selector("#listen-note :text('Spoken by')", timeout=60_000)
    note = page.inner_text("#listen-note")
    assert "espeak-zh" in note and "weights/voices/" in note  # Chinese text: the fallback, and how to do better
    page.wait_for_selector("#listen-audio audio[src], #listen-audio [data-testid=waveform-Preview]", timeout=30_000,
                           state="attached")


@pytest.fixture(scope="module")
def two_faces(tmp_path_factory) -> Path:
    """The portrait twice, the smaller on the left: face 0 from the left, the largest is face 1."""
    import cv2
    import numpy as np

    portrait = cv2.imread(str(ASSETS / "astronaut.jpg"))
    canvas = np.full((512, 912, 3), 200, np.uint8)
    canvas[112:, :400] = cv2.resize(portrait, (400, 400), interpolation=cv2.INTER_AREA)
    canvas[:, 400:] = portrait
    path = tmp_path_factory.mktemp("two faces") / "two people.png"
    cv2.imwrite(str(path), canvas)
    return path


def test_a_face_is_picked_among_several_and_the_job_says_so_and_is_remembered(page, app_url, two_faces):
    import httpx

    page.locator("#face-input input[type=file]").set_input_files(str(two_faces))
    page.wait_for_selector("#face-picker img")
    assert page.locator("#face-picker img").count() == 2
    page.locator("#face-note").get_by_text("the largest (face 1) speaks").wait_for()
    page.locator("#own-audio").wait_for(state="hidden")  # a photo has no sound of its own
    page.locator("#face-picker button").first.click()  # face 0, the smaller one on the left
    page.locator("#face-note").get_by_text("Face 0 speaks.").wait_for()
    # the whole sample (7 s): the first job is still at work when the second is asked for
    page.locator("#audio-input input[type=file]").set_input_files(str(ASSETS / "speech_en.wav"))
    page.wait_for_selector("#audio-input a[data-testid=download-link]")
    page.locator("#options-accordion").click()
    page.locator("#output-height input").fill("256 px")
    page.locator("#output-height input").press("Enter")
    page.click("#generate-button")
    page.wait_for_selector("#job-card .job-id")
    first = page.inner_text("#job-card .job-id").split()[1]
    page.click("#generate-button")  # a second job while the first is followed: said, not silently queued
    page.get_by_text(f"is queued after job {first}").first.wait_for()
    page.wait_for_function("first => { const shown = document.querySelector('#job-card .job-id'); "
                           "return shown && !shown.textContent.includes(first); }", arg=first)
    job_id = page.inner_text("#job-card .job-id").split()[1]
    page.wait_for_selector("#job-card [data-status=done]", timeout=180_000)
    warning = "2 faces found; animated face 0 (as chosen)"
    page.locator("#job-card .job-warnings").get_by_text(warning).wait_for()
    job = httpx.get(f"{app_url}/api/jobs/{job_id}", timeout=30).json()
    assert job["options"]["face.face_index"] == 0 and job["warnings"] == [warning]
    page.screenshot(path=str(two_faces.parent / "picked.png"), full_page=True)
    page.reload()  # the page still follows its job, and lists both among the recent ones
    page.wait_for_selector("#job-card [data-status=done]")
    assert page.inner_text("#job-card .job-id").split()[1] == job_id
    page.locator("#recent-jobs").get_by_text(first).first.wait_for()  # listed once the page has loaded them
    recent = page.inner_text("#recent-jobs")
    assert job_id in recent and first in recent
    page.wait_for_selector("#result-video video[src]")
    assert page.problems == []


@pytest.fixture(scope="module")
def presenter_clip(tmp_path_factory) -> Path:
    """A 3 s clip of the portrait drifting (head motion) over the start of the English sample."""
    path = tmp_path_factory.mktemp("presenter clip") / "anna at work.mp4"
    drift = "scale=276:276,crop=256:256:x='10+8*sin(t*3)':y='10+6*cos(t*2)',format=yuv420p"
    subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-y", "-loop", "1", "-i", str(ASSETS / "astronaut.jpg"),
                    "-i", str(ASSETS / "speech_en.wav"), "-t", "3", "-vf", drift, "-r", "25", "-c:v", "libx264",
                    "-preset", "ultrafast", "-c:a", "aac", str(path)], check=True)
    return path


def test_a_presenter_is_made_on_its_tab_picked_on_generate_and_deleted(page, app_url, app_folder, presenter_clip,
                                                                        tmp_path):
    """Presenters tab: the clip checked and prepared (its thumbnail in the gallery); Generate: the presenter
    picked instead of a face, typed text, the MP4 made from the clip's frames with the kept track; then the
    presenter deleted."""
    import json

    import cv2
    import numpy as np
    from conftest import decode_frames

    page.get_by_role("tab", name="Presenters").click()
    page.locator("#presenter-clip input[type=file]").set_input_files(str(presenter_clip))
    page.wait_for_function("() => document.querySelector('#presenter-name textarea, #presenter-name input')"
                           ".value === 'anna at work'")  # named after the file until the user types one
    page.locator("#presenter-name input, #presenter-name textarea").first.fill("Anna")
    page.click("#presenter-save")
    page.locator("#presenter-note").get_by_text("Presenter Anna saved").wait_for()
    page.locator("#presenter-table").get_by_text("ready").filter(visible=True).first.wait_for(timeout=120_000)
    page.wait_for_selector("#presenter-gallery img")
    assert "Anna" in page.inner_text("#presenter-gallery")
    page.locator("#presenter-table").get_by_text("Anna").filter(visible=True).first.click()
    page.locator("#presenter-card").get_by_text("256x256").wait_for()

    page.get_by_role("tab", name="Generate").click()
    page.locator("#presenter-input input").click()  # the picker offers the presenters ready now
    page.get_by_role("option", name="Anna (3 s)").click()
    page.locator("#presenter-chosen").get_by_text("Anna speaks").wait_for()
    page.locator("#face-input").wait_for(state="hidden")  # the presenter takes the upload's place
    page.locator("#text-accordion").click()
    page.locator("#text-input textarea").fill("Good morning. I was made once and now I only read.")
    video = generate_and_download(page, tmp_path)
    job_id = page.inner_text("#job-card .job-id").split()[1]
    summary = json.loads((app_folder / "outputs" / job_id / "result.json").read_text())
    assert summary["avatar_cache"] == "hit"  # the presenter's track: nothing tracked again
    frames = decode_frames(video)
    assert frames.shape[1:3] == (256, 256)
    clip_frames = decode_frames(presenter_clip)
    # the output's first frame is the clip's first frame (mouth aside): the presenter's own footage
    top = slice(0, 120)  # above the mouth
    difference = np.abs(frames[0][top].astype(int) - clip_frames[0][top].astype(int)).mean()
    assert difference < 6, difference
    assert np.abs(frames[0][top].astype(int) - clip_frames[40][top].astype(int)).mean() > difference
    cv2.imwrite(str(tmp_path / "presenter frame.png"), frames[len(frames) // 2])

    page.get_by_role("tab", name="Presenters").click()
    page.locator("#presenter-table").get_by_text("Anna").filter(visible=True).first.click()
    page.screenshot(path=str(tmp_path / "presenters.png"), full_page=True)
    page.click("#presenter-delete")
    page.wait_for_function("() => !document.querySelector('#presenter-table').innerText.includes('Anna')")
    assert not list((app_folder / "outputs" / "presenters").glob("p-*"))
    assert page.problems == []


def test_a_presenter_of_two_faces_is_saved_with_the_face_picked(page, app_url, two_faces):
    import httpx

    page.get_by_role("tab", name="Presenters").click()
    page.locator("#presenter-clip input[type=file]").set_input_files(str(two_faces))
    page.wait_for_selector("#presenter-face-picker img")
    assert page.locator("#presenter-face-picker img").count() == 2
    page.locator("#presenter-face-picker button").first.click()  # face 0, the smaller one on the left
    page.locator("#presenter-face-note").get_by_text("Face 0 speaks.").wait_for()
    page.locator("#presenter-name input, #presenter-name textarea").first.fill("Left one")
    page.click("#presenter-save")
    page.locator("#presenter-table").get_by_text("ready").filter(visible=True).first.wait_for(timeout=120_000)
    shown = httpx.get(f"{app_url}/api/presenters", timeout=30).json()["presenters"]
    assert [(presenter["name"], presenter["face_index"]) for presenter in shown] == [("Left one", 0)]
    httpx.delete(f"{app_url}/api/presenters/{shown[0]['id']}", timeout=30)


def test_a_chinese_browser_gets_chinese_words(browser, app_url):
    context = browser.new_context(locale="zh-CN", viewport={"width": 1280, "height": 1000})
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(app_url)
        page.wait_for_selector("#generate-button")
        page.locator("#generate-button").get_by_text("生成").wait_for()
        page.locator("#job-card").get_by_text("任务进度显示在这里。").wait_for()  # a handler's words too
        page.locator("#options-accordion").click()
        page.get_by_text("输出高度").first.wait_for()  # the options are drawn once the accordion has opened
        shown = page.inner_text("body")
        for words in ("人脸：视频或照片", "或输入要说的话", "选项", "输出高度", "人脸检测器", "照片的帧率"):
            assert words in shown, words
        assert "Face: a video or a photo" not in shown and "Frames per second" not in shown
        page.get_by_role("tab", name="生成").wait_for()
    finally:
        context.close()


def test_a_file_of_another_kind_is_said_in_words(page, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture")
    page.locator("#face-input input[type=file]").set_input_files(str(notes))
    page.get_by_text("notes.txt is not a file this field takes: pick a video").first.wait_for()
    page.wait_for_selector("#face-input input[type=file]", state="attached")  # emptied again for the next try
    fake = tmp_path / "clip.mp4"
    fake.write_text("not a video either")
    page.locator("#face-input input[type=file]").set_input_files(str(fake))
    page.get_by_text("clip.mp4 could not be decoded").first.wait_for()
    assert page.locator("#face-input").get_by_text("Error", exact=True).count() == 0


def test_the_system_tab_shows_the_doctor_report_and_offers_the_benchmark_only_with_a_gpu(page):
    import torch

    page.get_by_role("tab", name="System").click()
    report = page.locator("#system-report")
    report.get_by_text("Ready: everything the default (landmark) engine needs works").wait_for(timeout=120_000)
    text = report.inner_text()
    for expected in (f"torch\t{torch.__version__}", "libx264\tencoder present", "aac\tencoder present",
                     "face_landmark.tflite", "--engine auto\tlandmark"):
        assert expected in text, text
    from heygem.doctor import SECTIONS

    assert page.locator("#system-report table").count() == len(SECTIONS)  # one per section
    assert page.inner_text("#system-benchmark").strip() == ""  # not run when the tab opens
    if not torch.cuda.is_available():
        assert page.locator("#benchmark-button").count() == 0 or not page.locator("#benchmark-button").is_visible()
        assert "No CUDA GPU here" in page.inner_text("#benchmark-note")
        return
    page.click("#benchmark-button")
    page.locator("#system-benchmark").get_by_text("faces/s").first.wait_for(timeout=60_000)


HEADER_EXTENTS = """(selector) => Array.from(document.querySelectorAll(selector + ' th')).map(cell => {
    const range = document.createRange();
    range.selectNodeContents(cell.querySelector('.header'));
    return {text: range.toString().trim(), lines: range.getClientRects().length,
            textRight: range.getBoundingClientRect().right, cellRight: cell.getBoundingClientRect().right};
})"""


def assert_headers_whole(page, selector: str, names: list[str]) -> None:
    """Each column header on one line and inside its cell ("progress", not "progr / ess" or "progres")."""
    headers = page.evaluate(HEADER_EXTENTS, selector)
    assert [header["text"] for header in headers] == names
    for header in headers:
        assert header["lines"] == 1 and header["textRight"] <= header["cellRight"] - 2, (selector, header)


def test_table_headers_stay_whole_and_dropdowns_show_their_text(page):
    from heygem.ui.common import BATCH_COLUMNS
    from heygem.ui.jobs import JOB_COLUMNS

    page.locator("#options-accordion").click()
    for dropdown in ("#engine", "#restorer", "#output-height", "#detector"):
        field = page.locator(f"{dropdown} input")
        assert field.evaluate("input => input.scrollWidth <= input.clientWidth"), dropdown  # no text under the arrow
    page.get_by_role("tab", name="Jobs").click()
    page.wait_for_selector("#jobs-table th")
    assert_headers_whole(page, "#jobs-table", JOB_COLUMNS)
    page.get_by_role("tab", name="Batch").click()
    page.wait_for_selector("#batch-table th")
    assert_headers_whole(page, "#batch-table", BATCH_COLUMNS)
    page.get_by_role("tab", name="System").click()
    page.locator("#system-weights").scroll_into_view_if_needed()  # the table draws its rows once in view
    page.locator("#system-weights [role=gridcell]").get_by_text("wav2lip_gan", exact=True).wait_for()
    assert_headers_whole(page, "#system-weights", ["name", "state", "for", "file", "enables"])
    table = page.locator("#system-weights table")
    assert table.evaluate("table => table.getBoundingClientRect().right") <= \
        page.locator("#system-weights").evaluate("block => block.getBoundingClientRect().right")  # not cut off


def test_the_batch_tab_lists_every_file_and_previews_the_pairing_before_start(page, speech_clip, tmp_path):
    files = []
    for name in ("anna", "ben"):
        shutil.copyfile(ASSETS / "astronaut.jpg", tmp_path / f"{name}.jpg")
        shutil.copyfile(speech_clip, tmp_path / f"{name}.wav")
        files += [tmp_path / f"{name}.jpg", tmp_path / f"{name}.wav"]
    page.get_by_role("tab", name="Batch").click()
    assert page.get_by_text("A folder on the server").count() == 0  # the app has no --batch-root
    page.locator("#batch-files input[type=file]").set_input_files([str(path) for path in files])
    for path in files:
        page.locator(f"#batch-files td.filename[aria-label='{path.name}']").wait_for()
    box = page.locator("#batch-files").bounding_box()
    for path in files:  # every file's row inside the box, none scrolled out of sight
        shown = page.locator(f"#batch-files td.filename[aria-label='{path.name}']").bounding_box()
        assert shown["y"] >= box["y"] and shown["y"] + shown["height"] <= box["y"] + box["height"], path.name
    page.locator("#batch-table [role=gridcell]").get_by_text("anna.wav").wait_for()  # the pairing, before Start
    rows = page.locator("#batch-table .virtual-row")  # the table's drawn rows (cells: role=gridcell)
    assert rows.count() == 2
    assert [cell.strip() for cell in rows.nth(0).locator("[role=gridcell]").all_inner_texts()[:4]] == \
        ["anna", "anna.jpg", "anna.wav", "not started"]
    page.get_by_text("2 of 2 item(s) will run").first.wait_for()
    assert page.problems == []


def submit_job(url: str, audio: Path, **data) -> str:
    """A job of the astronaut photo speaking ``audio`` (or ``data``'s text), queued through REST; its id."""
    import httpx

    files = {"face": ("astronaut.jpg", (ASSETS / "astronaut.jpg").read_bytes())}
    if audio is not None:
        files["audio"] = (audio.name, audio.read_bytes())
    response = httpx.post(f"{url}/api/jobs", files=files, timeout=60,
                          data={"options": '{"media.output_height": 160}', **data})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def wait_for_status(url: str, job_id: str, wanted: set[str], seconds: float = 180) -> str:
    import httpx

    deadline = time.monotonic() + seconds
    while (status := httpx.get(f"{url}/api/jobs/{job_id}", timeout=30).json()["status"]) not in wanted:
        assert time.monotonic() < deadline, (job_id, status)
        time.sleep(0.3)
    return status


def test_the_jobs_tab_keeps_the_picked_card_live_draws_stages_on_a_time_line_and_fits_a_phone(page, app_url,
                                                                                                 tmp_path):
    long_speech = tmp_path / "long speech.wav"  # long enough to be cancelled while it runs
    subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-y", "-stream_loop", "12", "-i",
                    str(ASSETS / "speech_en.wav"), str(long_speech)], check=True)
    spoken = submit_job(app_url, None, text="Good evening. I was typed into a form and spoken by a voice.")
    assert wait_for_status(app_url, spoken, {"done", "failed"}) == "done"
    running = submit_job(app_url, long_speech)
    wait_for_status(app_url, running, {"running"})
    page.get_by_role("tab", name="Jobs").click()
    page.locator("#jobs-table [role=gridcell]").get_by_text(running).click()
    page.wait_for_selector("#selected-card [data-status=running]")
    page.click("#cancel-job")
    # the worker stops at its next batch: the card says so without another click
    page.wait_for_selector("#selected-card [data-status=cancelled]", timeout=120_000)
    # a text job: the start of its words and a small picture of its face, not speech.wav
    row = page.locator("#jobs-table .virtual-row", has_text=spoken)
    assert "Good evening. I was typed" in row.inner_text() and "speech.wav" not in row.inner_text()
    page.wait_for_function("id => [...document.querySelectorAll('#jobs-table .virtual-row')].some(row => "
                           "row.innerText.includes(id) && row.querySelector('img.face-thumb[src^=\"data:image\"]'))",
                           arg=spoken)
    row.get_by_text(spoken).click()
    page.wait_for_selector("#selected-card [data-status=done]")
    timeline = page.locator("#stage-timeline")
    timeline.get_by_text("finding faces").wait_for()
    for words in ("drawing mouths", "encoding", "s in all"):
        assert words in timeline.inner_text()
    page.set_viewport_size({"width": 375, "height": 900})
    page.wait_for_function("() => [...document.querySelectorAll('#jobs-table th')]"
                           ".filter(cell => cell.offsetWidth > 0).length === 4")
    shown = page.evaluate("() => [...document.querySelectorAll('#jobs-table th')].filter(cell => cell.offsetWidth > 0)"
                          ".map(cell => cell.innerText.trim())")
    assert shown == ["face", "speech", "status", "stage / error"]
    assert page.problems == []


def test_the_batch_tab_warns_before_start_shows_an_item_and_zips_what_the_command_line_writes(page, speech_clip,
                                                                                                tmp_path):
    import zipfile

    shutil.copyfile(ASSETS / "astronaut.jpg", tmp_path / "anna.jpg")
    shutil.copyfile(speech_clip, tmp_path / "anna.wav")
    shutil.copyfile(ASSETS / "astronaut.jpg", tmp_path / "carl.jpg")
    (tmp_path / "carl.txt").write_text("Hello there.", encoding="utf-8")
    subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-y", "-f", "lavfi", "-i", "color=c=gray:s=64x64:d=1",
                    "-c:v", "libx264", "-pix_fmt", "yuv420p", str(tmp_path / "mute.mp4")], check=True)
    page.get_by_role("tab", name="Batch").click()
    page.locator("#batch-files input[type=file]").set_input_files(
        [str(tmp_path / name) for name in ("anna.jpg", "anna.wav", "carl.jpg", "carl.txt", "mute.mp4")])
    page.locator("#batch-table [role=gridcell]").get_by_text("will fail").wait_for()
    row = page.locator("#batch-table .virtual-row", has_text="mute.mp4")
    assert "has no sound of its own" in row.inner_text()
    assert "2 of 3 item(s) will run" in page.inner_text("#batch-summary")
    page.locator("#batch-options-accordion").click()
    page.locator("#batch-output-height input").fill("256 px")
    page.locator("#batch-output-height input").press("Enter")
    page.click("#batch-start")
    page.wait_for_selector("#batch-zip", state="visible", timeout=180_000)
    page.locator("#batch-table [role=gridcell]").get_by_text("anna.wav").click()
    page.wait_for_selector("#batch-item-card [data-status=done]")
    page.wait_for_selector("#batch-item-video video[src]")
    with page.expect_download() as download_info:
        page.click("#batch-zip")
    target = tmp_path / download_info.value.suggested_filename
    download_info.value.save_as(target)
    with zipfile.ZipFile(target) as archive:
        assert sorted(archive.namelist()) == ["anna.json", "anna.mp4", "carl.json", "carl.mp4", "carl.srt",
                                              "summary.csv"]
        rows = {line.split(",")[0]: line for line in archive.read("summary.csv").decode().splitlines()[1:]}
    assert set(rows) == {"anna", "carl", "mute"} and "has no sound of its own" in rows["mute"]
    assert page.problems == []


# ---------------------------------------------------------------------- a server shared by users

USERS = {"alice": "alice-long-secret", "bob": "bob-long-secret", "carol": "carol-long-secret"}


@pytest.fixture(scope="module")
def shared_app(tmp_path_factory, speech_clip):
    """`python app.py --users FILE` holding one finished job of bob's and one of carol's."""
    import httpx

    folder = tmp_path_factory.mktemp("shared")
    users_file = folder / "users.txt"
    users_file.write_text("admin alice:alice-long-secret\nbob:bob-long-secret\ncarol:carol-long-secret\n",
                          encoding="utf-8")
    with running_app(folder, "--users", str(users_file), headers={"Authorization": "Bearer alice-long-secret"}) as url:
        ids = {}
        for user in ("bob", "carol"):
            response = httpx.post(f"{url}/api/jobs", auth=(user, USERS[user]), timeout=60,
                                  files={"face": ("astronaut.jpg", (ASSETS / "astronaut.jpg").read_bytes()),
                                         "audio": ("hello.wav", speech_clip.read_bytes())},
                                  data={"options": '{"media.output_height": 256}'})
            assert response.status_code == 201, response.text
            ids[user] = response.json()["id"]
        deadline = time.monotonic() + 120
        for user, job_id in ids.items():
            while httpx.get(f"{url}/api/jobs/{job_id}", auth=(user, USERS[user])).json()["status"] != "done":
                assert time.monotonic() < deadline
                time.sleep(0.3)
        yield url, folder / "outputs", ids


def test_a_user_sees_only_their_jobs_and_files_and_deletes_after_confirming(browser, shared_app, tmp_path):
    url, outputs, ids = shared_app
    with opened_page(browser, url, ("carol", USERS["carol"])) as page:
        page.get_by_role("tab", name="Jobs").click()
        page.locator("#jobs-table [role=gridcell]").get_by_text(ids["carol"]).wait_for()
        table = page.locator("#jobs-table .virtual-row").all_inner_texts()
        assert len(table) == 1 and ids["carol"] in table[0] and "carol" in table[0]
        assert "1 done" in page.inner_text("body")
        for job_id in ids.values():  # the job folders are never served as they are, not even one's own
            for name in ("astronaut.jpg", "result.mp4", "result.json", "job.log"):
                answer = page.request.get(f"{url}/gradio_api/file={outputs / job_id / name}")
                assert answer.status in (403, 404), (job_id, name, answer.status)
        page.locator("#jobs-table [role=gridcell]").get_by_text(ids["carol"]).click()
        page.wait_for_selector("#selected-video video[src]")
        with page.expect_download() as download_info:
            page.click("#selected-download")
        assert download_info.value.suggested_filename == "astronaut-hello.mp4"
        target = tmp_path / "carol.mp4"
        download_info.value.save_as(target)
        assert probe(target).height == 256
        selected = page.locator("#selected-job textarea, #selected-job input").first
        selected.fill(ids["bob"])  # another's job id typed in is as no job at all
        selected.press("Enter")
        page.locator("#selected-card").get_by_text("Pick a job in the table.").wait_for()
        assert page.locator("#selected-video video[src]").count() == 0
        page.locator("#jobs-table [role=gridcell]").get_by_text(ids["carol"]).click()
        page.locator("#selected-card").get_by_text(ids["carol"]).wait_for()
        page.click("#delete-job")
        confirm = page.locator("#confirm-delete")
        confirm.get_by_text(f"Delete the job {ids['carol']}").wait_for()
        page.click("#keep-job-button")
        confirm.wait_for(state="hidden")
        assert (outputs / ids["carol"]).is_dir()  # kept
        page.click("#delete-job")
        page.click("#confirm-delete-button")
        page.get_by_text(f"{ids['carol']} deleted.").first.wait_for()
        assert not (outputs / ids["carol"]).exists() and (outputs / ids["bob"]).is_dir()
        page.get_by_role("tab", name="System").click()
        page.locator("#system-report").get_by_text("shown to the admins").wait_for()
        shown = page.inner_text("body")
        assert str(outputs) not in shown and str(REPO) not in shown  # no server folder on carol's page
        assert page.problems == []
    with opened_page(browser, url, ("alice", USERS["alice"])) as page:  # the admin sees every job
        page.get_by_role("tab", name="Jobs").click()
        page.locator("#jobs-table [role=gridcell]").get_by_text(ids["bob"]).wait_for()
        rows = page.locator("#jobs-table .virtual-row").all_inner_texts()
        assert len(rows) == 1 and rows[0].endswith("bob")  # carol's was deleted; the user column names bob
