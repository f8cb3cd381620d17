"""The command line as a user runs it: exit codes, one-line errors, a Wav2Lip checkpoint in the official layout."""

import subprocess
import sys

import cv2
import numpy as np
import pytest
from conftest import REPO, decode_frames

from heygem.media.ffmpeg import ffmpeg_binary


def heygem(*args, env_weights=None):
    import os

    env = dict(os.environ)
    if env_weights is not None:
        env["HEYGEM_WEIGHTS"] = str(env_weights)
    return subprocess.run([sys.executable, "-m", "heygem", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_help_lists_every_option():
    result = heygem("generate", "--help")
    assert result.returncode == 0
    for flag in ("--face", "--audio", "--output", "--engine", "--pads", "--box", "--fps", "--output-height",
                 "--smooth-window", "--face-index", "--no-restore", "--checkpoint"):
        assert flag in result.stdout


@pytest.fixture(scope="module")
def user_error_inputs(tmp_path_factory, face_video):
    folder = tmp_path_factory.mktemp("user errors")
    (folder / "notes.txt").write_text("hello")
    cv2.imwrite(str(folder / "wall.png"), np.full((64, 64, 3), 90, np.uint8))
    silent_video = folder / "silent.mp4"
    subprocess.run([ffmpeg_binary(), "-v", "error", "-i", str(face_video), "-an", "-c:v", "copy",
                    str(silent_video)], check=True)
    return folder


@pytest.mark.parametrize("case, message", [
    ("missing face", "file not found"),
    ("not media", "not a media file"),
    ("no face", "no face was found"),
    ("no audio stream", "has no audio stream"),
    ("bad option value", "--output-height must be"),
    ("wav2lip without weights", "needs a checkpoint"),
])
def test_user_errors_exit_2_with_one_line(case, message, user_error_inputs, face_photo, short_speech, tmp_path):
    folder = user_error_inputs
    face, audio, extra = face_photo, short_speech, []
    if case == "missing face":
        face = folder / "nobody.jpg"
    elif case == "not media":
        audio = folder / "notes.txt"
    elif case == "no face":
        face = folder / "wall.png"
    elif case == "no audio stream":
        audio = folder / "silent.mp4"
    elif case == "bad option value":
        extra = ["--output-height", "4"]
    elif case == "wav2lip without weights":
        extra = ["--engine", "wav2lip"]
    result = heygem("generate", "--face", face, "--audio", audio, "--output", tmp_path / "out.mp4", *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out.mp4").exists()


def test_unsupported_choice_is_refused_by_the_parser(tmp_path, face_photo, short_speech):
    result = heygem("generate", "--face", face_photo, "--audio", short_speech, "--output", tmp_path / "o.mp4",
                    "--engine", "sadtalker")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_silent_speech_is_made_and_said(tmp_path, face_photo):
    silence = tmp_path / "silence.wav"
    subprocess.run([ffmpeg_binary(), "-v", "error", "-f", "lavfi", "-i", "anullsrc=r=16000:cl=mono", "-t", "0.6",
                    str(silence)], check=True)
    result = heygem("generate", "--face", face_photo, "--audio", silence, "--output", tmp_path / "quiet.mp4",
                    "--output-height", "128")
    assert result.returncode == 0 and "warning: the speech is silent" in result.stderr.splitlines()


def test_wav2lip_checkpoint_in_the_official_layout_runs_end_to_end(tmp_path, face_photo, short_speech):
    import torch

    from heygem.models.wav2lip import Wav2Lip

    weights = tmp_path / "weights"
    weights.mkdir()
    torch.manual_seed(0)
    model = Wav2Lip()
    state = {f"module.{key}": value for key, value in model.state_dict().items()}
    torch.save({"state_dict": state, "optimizer": {}, "global_step": 1, "global_epoch": 1}, weights / "wav2lip_gan.pth")
    output = tmp_path / "wav2lip.mp4"
    result = heygem("generate", "--face", face_photo, "--audio", short_speech, "--output", output,
                    "--output-height", "256", env_weights=weights)
    assert result.returncode == 0, result.stderr
    assert "wav2lip engine" in result.stdout and "wav2lip_gan.pth" in result.stdout
    frames = decode_frames(output)
    assert frames.shape == (85, 256, 256, 3)
    # random weights paint noise into the lower face, and only there
    source = cv2.resize(cv2.imread(str(face_photo)), (256, 256), interpolation=cv2.INTER_AREA).astype(np.int16)
    difference = np.abs(frames[10].astype(np.int16) - source).mean(axis=2)
    assert np.median(difference[:40]) < 4 and np.median(difference[150:]) < 4  # x264 noise only
    assert difference[60:110, 80:150].mean() > 6


def test_text_becomes_speech_a_talking_video_and_its_subtitles(tmp_path):
    import av
    from conftest import ASSETS

    output = tmp_path / "from text.mp4"
    text = "Hello there. I am your presenter, and this is a test of speech made from text!"
    result = heygem("generate", "--face", str(ASSETS / "astronaut.jpg"), "--text", text, "-o", str(output))
    assert result.returncode == 0, result.stderr
    subtitles = (tmp_path / "from text.srt").read_text(encoding="utf-8")
    blocks = [block.splitlines() for block in subtitles.strip().split("\n\n")]
    assert [lines[2] for lines in blocks] == ["Hello there.", "I am your presenter, and this is a test of speech "
                                              "made from text!"]

    def seconds(stamp):
        hours, minutes, rest = stamp.split(":")
        return int(hours) * 3600 + int(minutes) * 60 + float(rest.replace(",", "."))

    cues = [tuple(seconds(part) for part in lines[1].split(" --> ")) for lines in blocks]
    assert all(start < end for start, end in cues) and cues[0][1] <= cues[1][0]  # ordered, not overlapping
    with av.open(str(output)) as container:
        kinds = {stream.type: stream.codec_context.name for stream in container.streams}
        duration = float(container.duration) / 1e6
    assert kinds == {"video": "h264", "audio": "aac", "subtitle": "mov_text"}
    assert cues[-1][1] <= duration + 0.05 and duration > 2.0  # the speech sets the length; cues lie within it
    frames = decode_frames(output).astype(np.int16)
    assert abs(len(frames) / 25 - duration) < 0.1
    assert np.abs(np.diff(frames[:, 170:230, 200:300], axis=0)).max() > 30  # the mouth moves while speaking

    empty = heygem("generate", "--face", str(ASSETS / "astronaut.jpg"), "--text", "   ", "-o", str(tmp_path / "x.mp4"))
    assert empty.returncode == 2 and empty.stderr.strip().startswith("error:") and "empty" in empty.stderr
    both = heygem("generate", "--face", str(ASSETS / "astronaut.jpg"), "--text", "Hi.", "--audio",
                  str(ASSETS / "speech_en.wav"), "-o", str(tmp_path / "y.mp4"))
    assert both.returncode == 2 and "not allowed with" in both.stderr


# A command in place of heygem.cli.main, run as `python -m heygem` runs it: it registers an exit handler,
# writes more than a pipe's buffer and returns 3; an object of the calling module reports its teardown.
FINISHED_COMMAND = r"""
import atexit, runpy, sys
import heygem.cli


class Teardown:
    def __del__(self):
        sys.stderr.write("teardown\n")


marker = Teardown()


def command(argv=None):
    atexit.register(lambda: sys.stderr.write("handler\n"))
    print("result " * 3000)
    print("done")
    return 3


heygem.cli.main = command
sys.argv = ["heygem"]
runpy.run_module("heygem", run_name="__main__")
"""


def test_a_finished_command_leaves_without_the_interpreter_teardown():
    result = subprocess.run([sys.executable, "-c", FINISHED_COMMAND], cwd=REPO, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 3  # the command's own code
    assert result.stdout.endswith("done\n") and result.stdout.count("result") == 3000  # all of it, through a pipe
    assert result.stderr.splitlines() == ["handler"]  # its exit handler ran; the teardown (torch's: 0.4 s) did not
