"""The command line's own words: help grouped by purpose, one-line usage errors, output names it refuses,
and the warnings a finished video comes with."""

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
