"""Words instead of a recording: spoken sentence by sentence while the video is made in parts
(heygem.spoken), from the command line and as a server's job whose stream plays before the whole
script is spoken."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import av
import numpy as np
import pytest
from conftest import ASSETS, REPO, assert_playable_mp4, decode_frames

from heygem.jobs.stream import stream_url
from heygem.media.probing import probe
from heygem.media.stream import listed_segments, stream_folder
from heygem.pipeline import generate
from heygem.spoken import generate_spoken

TEXT = ("Hello there. This is heygem speaking from a photo, sentence by sentence. The video is made in parts "
        "while the speech comes. Each part goes on where the last one ended.")
LOSSLESS = {"engine.name": "landmark", "media.output_height": 256, "media.crf": 0}


@pytest.mark.parametrize("face", ["photo", "video"])
def test_parts_give_the_frames_of_one_render_of_the_whole_speech_but_where_they_meet(tmp_path, face, face_video,
                                                                                     monkeypatch):
    """The speech comes in parts; the video is their frames one after another, the face going on where
    each part left it (the photo; the video's frames and their track from the avatar cache). Rendered
    losslessly, it equals one render of the whole speech except for a few frames where the parts meet,
    whose audio windows end at a part's end; the speech is the whole text's."""
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path / "cache"))
    face_path = ASSETS / "astronaut.jpg" if face == "photo" else face_video
    output = tmp_path / "spoken.mp4"
    shown = []
    summary, speech = generate_spoken(face_path, TEXT, output, overrides={**LOSSLESS, "media.stream": True},
                                      progress=lambda phase, fraction: shown.append(fraction))
    # one progress over the parts, as the script's length is foreseen from the characters spoken so far
    assert shown == sorted(shown) and shown[-1] == 1.0 and len(shown) > 10
    assert summary.parts >= 2 and summary.stream_processes >= 2  # the first part is ~2 s of speech
    assert summary.frames_without_face == 0
    fps = summary.fps
    assert summary.frames == round(speech.duration * fps) or abs(summary.frames - speech.duration * fps) < 1.5
    assert_playable_mp4(output, speech.duration)
    info = probe(output)
    assert info.frame_count == summary.frames and abs(info.audio_duration - speech.duration) < 0.05
    assert output.with_suffix(".wav").is_file() and len(speech.cues) == 4
    saved = json.loads(output.with_suffix(".json").read_text())
    assert saved["parts"] == summary.parts and saved["frames"] == summary.frames

    whole = tmp_path / "whole.mp4"  # the same speech in one render, with its own avatar cache
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path / "cache-whole"))
    generate(face_path, output.with_suffix(".wav"), whole, overrides=LOSSLESS)
    ours, theirs = decode_frames(output).astype(np.int16), decode_frames(whole).astype(np.int16)
    assert ours.shape == theirs.shape
    difference = np.abs(ours - theirs)  # (N, H, W, 3)
    differing = np.nonzero(difference.max(axis=(1, 2, 3)) > 0)[0]
    assert len(differing) == 0 or differing.min() > 2 * fps - 3  # the first part (2 s at least): the same frames
    # after it the mouth's smoothing starts again from the pause where the parts meet: measured 0.01-0.02
    # levels on average, a few pixels of the lips' edge on some frames
    assert difference.mean() < 0.1 and (difference.max(axis=3) > 8).mean() < 0.002, (
        difference.mean(), (difference.max(axis=3) > 8).mean())

    # the stream: the parts' segments one after another, video and audio, as long as the speech
    segments = listed_segments(stream_folder(output))
    assert {segment.name[:4] for segment in segments} >= {"0000", "0001"}
    assert abs(sum(segment.seconds for segment in segments) - summary.frames / fps) < 0.1
    for segment in segments:
        with av.open(str(stream_folder(output) / segment.name)) as container:
            assert {stream.type for stream in container.streams} == {"video", "audio"}


def test_the_command_line_speaks_in_parts_and_writes_the_speech_and_subtitles(tmp_path):
    output = tmp_path / "said.mp4"
    result = subprocess.run([sys.executable, "-m", "heygem", "generate", "--face", str(ASSETS / "astronaut.jpg"),
                             "--text", TEXT, "--output", str(output), "--engine", "landmark", "--output-height",
                             "256", "--subtitles", "soft"], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, HEYGEM_CACHE_DIR=str(tmp_path / "cache")))
    assert result.returncode == 0, result.stderr
    speech, video = probe(output.with_suffix(".wav")), probe(output)
    assert abs(video.duration - speech.audio_duration) < 0.05 and video.frame_count == round(video.duration * 25)
    assert json.loads(output.with_suffix(".json").read_text())["parts"] >= 2
    cues = output.with_suffix(".srt").read_text(encoding="utf-8")
    assert "Each part goes on where the last one ended." in cues
    with av.open(str(output)) as container:
        assert {stream.type for stream in container.streams} == {"video", "audio", "subtitle"}


def test_bad_words_are_refused_with_one_line_before_anything_renders(tmp_path):
    result = subprocess.run([sys.executable, "-m", "heygem", "generate", "--face", str(ASSETS / "astronaut.jpg"),
                             "--text", "   ", "--output", str(tmp_path / "x.mp4")], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "empty" in result.stderr and not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def app(served_app):
    return served_app


def test_a_text_job_is_queued_at_once_and_streams_before_its_whole_speech_is_spoken(app):
    """The POST keeps the words (nothing is spoken before the job is queued); the worker speaks them
    sentence by sentence, and the first segment is listed while the speech is not yet whole (the job's
    speech.wav is written once every sentence is spoken)."""
    text = " ".join([TEXT] * 3)  # twelve sentences: ~25 s of speech
    files = {"face": ("astronaut.jpg", (ASSETS / "astronaut.jpg").read_bytes())}
    response = app.client.post("/api/jobs", files=files, data={
        "text": text, "options": json.dumps({"engine.name": "landmark", "media.output_height": 256})})
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    folder = app.outputs / job_id
    seen_before_whole = False
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = app.client.get(f"/api/jobs/{job_id}").json()["status"]
        listed = app.client.get(stream_url(job_id)).status_code == 200
        if listed and not (folder / "speech.wav").exists() and status == "running":
            seen_before_whole = True
        if status in ("done", "failed", "cancelled"):
            break
        time.sleep(0.02)
    assert status == "done", app.log_text()[-2000:]
    assert seen_before_whole, app.log_text()[-3000:]
    final = app.client.get(stream_url(job_id)).text
    assert final.rstrip().endswith("#EXT-X-ENDLIST") and "stream/0001-00000.ts" in final
    speech, video = probe(folder / "speech.wav"), probe(folder / "result.mp4")
    assert abs(video.duration - speech.audio_duration) < 0.05 and video.has_audio
    assert "Each part goes on" in (folder / "result.srt").read_text(encoding="utf-8")
    assert json.loads((folder / "result.json").read_text())["parts"] >= 2


def test_a_text_job_with_an_unknown_voice_is_refused_before_it_is_queued(app):
    files = {"face": ("astronaut.jpg", (ASSETS / "astronaut.jpg").read_bytes())}
    before = set(app.outputs.iterdir())
    response = app.client.post("/api/jobs", files=files, data={"text": "Hello.", "voice": "no-such-voice"})
    assert response.status_code == 400 and "no-such-voice" in response.text
    assert set(app.outputs.iterdir()) == before
