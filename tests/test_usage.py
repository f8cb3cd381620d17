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
