"""A real browser (Debian's chromium through playwright) uses the page as a person would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
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


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    """`python app.py` on a free port with its own outputs folder."""
    import httpx

    folder = tmp_path_factory.mktemp("browser")
    port = free_port()
    log_path = folder / "app.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--port", str(port),
                                    "--outputs", str(folder / "outputs")],
                                   cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            try:
                if httpx.get(f"{url}/api/jobs", timeout=5).status_code == 200:
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
def speech_clip(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("browser inputs") / "short speech.wav"
    subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-y", "-i", str(ASSETS / "speech_en.wav"), "-t", "1.2",
                    str(path)], check=True)
    return path


@pytest.fixture()
def page(app_url):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(accept_downloads=True, viewport={"width": 1280, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(app_url)
        page.wait_for_selector("#generate-button")
        try:
            yield page
        finally:
            context.close()
            browser.close()


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
    assert video.suffix == ".mp4"
    assert_playable_mp4(video, probe(speech_clip).duration)
    assert probe(video).height == 256
    assert page.locator("#stage-chart").is_visible()  # seconds per stage, for a finished job


def test_an_example_fills_the_form_and_generates(page, tmp_path):
    page.get_by_text("Astronaut photo + English speech").click()
    page.wait_for_selector("#audio-input a[data-testid=download-link]")
    page.locator("#options-accordion").click()
    page.locator("#output-height input").fill("256 px")
    page.locator("#output-height input").press("Enter")
    video = generate_and_download(page, tmp_path)
    assert_playable_mp4(video, probe(ASSETS / "speech_en.wav").duration)


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


def test_the_system_tab_shows_the_doctor_report_and_runs_the_benchmark_on_request(page):
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
    page.click("#benchmark-button")
    expected = "faces/s" if torch.cuda.is_available() else "skipped: no CUDA GPU"
    page.locator("#system-benchmark").get_by_text(expected).first.wait_for(timeout=60_000)
