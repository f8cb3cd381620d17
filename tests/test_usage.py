"""The command line's own words: help grouped by purpose, one-line usage errors, output names it refuses,
and the warnings a finished video comes with."""

import json
import subprocess
import sys

import pytest
from conftest import REPO


def heygem(*args):
    return subprocess.run([sys.executable, "-m", "heygem", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("name", ["out.avi", "out.mkv", "out.webm", "out"])
def test_an_output_that_is_not_mp4_is_refused_in_one_line(name, tmp_path, face_photo, short_speech):
    output = tmp_path / name
    result = heygem("generate", "--face", face_photo, "--audio", short_speech, "-o", output)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and ".mp4" in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the summary
    text = heygem("generate", "--face", face_photo, "--text", "Hello.", "-o", output)
    assert text.returncode == 2 and ".mp4" in text.stderr and list(tmp_path.iterdir()) == []


def help_sections(text: str) -> dict[str, str]:
    """A --help text cut at its section titles ("inputs:", "engine:", ...)."""
    sections, title = {}, ""
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
        sections[title] = sections.get(title, "") + line + "\n"
    return sections


def test_generate_help_groups_the_options_by_purpose():
    result = heygem("generate", "--help")
    assert result.returncode == 0
    sections = help_sections(result.stdout)
    assert list(sections)[-4:] == ["inputs", "output", "engine", "advanced"], list(sections)
    for flag in ("--face", "--audio", "--text", "--text-file", "--voice", "--face-index"):
        assert flag in sections["inputs"], flag
    for flag in ("--output", "--output-height", "--subtitles", "--crf"):
        assert flag in sections["output"], flag
    for flag in ("--engine", "--checkpoint", "--device", "--restorer"):
        assert flag in sections["engine"], flag
    for flag in ("--cuda-graph", "--cudnn-benchmark", "--precision", "--encoders", "--batch-frames", "--config"):
        assert flag in sections["advanced"], flag
    for flag in ("--cuda-graph", "--encoders"):
        assert flag not in sections["inputs"] + sections["output"] + sections["engine"]


@pytest.mark.parametrize("args", [
    ["generate"],
    ["generate", "--face", "a.jpg", "--audio", "b.wav", "-o", "c.mp4", "--engine", "sadtalker"],
    ["generate", "--face", "a.jpg", "--audio", "b.wav", "-o", "c.mp4", "--no-such-flag"],
])
def test_a_usage_error_is_one_line_with_a_hint(args):
    result = heygem(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "see python -m heygem generate --help" in lines[0]


def test_a_usage_error_of_the_command_itself_names_the_top_help():
    result = heygem("generat")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "see python -m heygem --help" in result.stderr


# ---------------------------------------------------------------- warnings of a finished video

TWO_FACES_WARNING = "2 faces found; animated face 1 (the largest)"


@pytest.fixture(scope="module")
def two_faces(tmp_path_factory, face_photo):
    """The portrait twice side by side, the right one larger: face 1 from the left is the largest."""
    import cv2
    import numpy as np

    portrait = cv2.imread(str(face_photo))
    height, width = portrait.shape[:2]
    small = cv2.resize(portrait, (width * 3 // 4, height * 3 // 4), interpolation=cv2.INTER_AREA)
    left = np.full_like(portrait, 255)
    left[height - small.shape[0]:, : small.shape[1]] = small
    path = tmp_path_factory.mktemp("two faces") / "two faces.png"
    cv2.imwrite(str(path), np.hstack([left, portrait]))
    return path


@pytest.fixture(scope="module")
def silence(tmp_path_factory):
    from conftest import run_ffmpeg

    path = tmp_path_factory.mktemp("silence") / "silence.wav"
    run_ffmpeg("-f", "lavfi", "-i", "anullsrc=r=16000:cl=mono", "-t", "1.5", str(path))
    return path


def generate_warnings(tmp_path, face, audio, *extra) -> tuple[list[str], list[str]]:
    """(the warning lines a generate run printed, its summary's warnings)."""
    output = tmp_path / "out.mp4"
    result = heygem("generate", "--face", face, "--audio", audio, "--engine", "landmark", "--output-height", "160",
                    "-o", output, *extra)
    assert result.returncode == 0, result.stderr
    printed = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    return printed, json.loads(output.with_suffix(".json").read_text(encoding="utf-8"))["warnings"]


def test_two_faces_finish_with_a_warning_that_says_which_was_animated(tmp_path, two_faces, short_speech):
    printed, summarised = generate_warnings(tmp_path, two_faces, short_speech)
    assert summarised == [TWO_FACES_WARNING]
    assert printed == [f"warning: {TWO_FACES_WARNING}"]
    chosen = "2 faces found; animated face 0 (as chosen)"  # the face asked for: said which one spoke
    assert generate_warnings(tmp_path, two_faces, short_speech, "--face-index", "0") == ([f"warning: {chosen}"],
                                                                                          [chosen])


def test_silent_speech_finishes_with_a_warning(tmp_path, face_photo, silence, short_speech):
    printed, summarised = generate_warnings(tmp_path, face_photo, silence)
    assert len(summarised) == 1 and "silent" in summarised[0]
    assert printed == [f"warning: {summarised[0]}"]
    assert generate_warnings(tmp_path, face_photo, short_speech) == ([], [])  # one face, speech: no warning


def test_a_job_of_two_faces_reports_its_warning_over_rest(tmp_path, two_faces, short_speech):
    import time

    from faults import Server

    server = Server(tmp_path / "outputs", tmp_path / "app.log").wait_ready()
    try:
        created = server.client.post(
            "/api/jobs", files={"face": (two_faces.name, two_faces.read_bytes()),
                                "audio": (short_speech.name, short_speech.read_bytes())},
            data={"options": json.dumps({"media.output_height": 160, "engine.name": "landmark"})})
        assert created.status_code in (200, 201, 202), created.text
        job_id = created.json()["id"]
        deadline = time.monotonic() + 300
        while (job := server.client.get(f"/api/jobs/{job_id}").json())["status"] not in ("done", "failed"):
            assert time.monotonic() < deadline, job
            time.sleep(0.3)
        assert job["status"] == "done" and job["warnings"] == [TWO_FACES_WARNING], job
    finally:
        server.stop()
