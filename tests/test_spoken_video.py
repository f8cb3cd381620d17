"""Typed scripts on a presenter VIDEO: the speech comes sentence by sentence and the video is made in
parts (heygem.spoken), each part's face going on from the track that the parts before stored in the
avatar cache, whatever the cache held before: nothing, the first seconds from an earlier shorter job,
or less than the part needs (tracked on). A clip shorter than the speech plays back and forth."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import ASSETS, REPO, assert_playable_mp4, decode_frames, run_ffmpeg

from heygem.face import avatar_cache
from heygem.media.probing import probe
from heygem.media.source import looped_indices, pingpong_indices
from heygem.pipeline import generate
from heygem.speech.audio import load_audio_16k
from heygem.spoken import generate_spoken

# ~7 s of speech in the bundled voice, in two parts: longer than the short clip, shorter than the long one
SCRIPT = ("Good morning. Welcome to the show. This presenter was filmed once, "
          "and now it only reads what is typed. The clip plays on.")
OPTIONS = {"engine.name": "landmark"}  # rendered at the clip's own size (288 rows)


def presenter_clip(path, seconds: float):
    """A presenter video: the portrait turning and leaning a little as a speaker's head does, 29.97 fps."""
    run_ffmpeg("-loop", "1", "-i", str(ASSETS / "astronaut.jpg"), "-f", "lavfi", "-i",
               f"sine=frequency=220:duration={seconds}",
               "-vf", "scale=420:420,rotate=0.06*sin(2*PI*t/2.7):fillcolor=black,"
                      "crop=384:288:x='18+10*sin(t*1.7)':y='40+8*cos(t*1.3)',format=yuv420p",
               "-r", "30000/1001", "-t", str(seconds), "-c:v", "libx264", "-preset", "ultrafast", "-crf", "18",
               "-c:a", "aac", "-shortest", str(path))
    return path


@pytest.fixture(scope="module")
def short_clip(tmp_path_factory):
    return presenter_clip(tmp_path_factory.mktemp("clips") / "short presenter.mp4", 4.0)


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory):
    return presenter_clip(tmp_path_factory.mktemp("clips") / "long presenter.mp4", 10.0)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(folder))
    return folder


LIPS = [0, 13, 14, 17, 61, 78, 291, 308]  # face-mesh points around the mouth


def mouth_follows_speech(output, clip, speech_wav, fps: float, cache_folder, turns=None) -> None:
    """Around the mouth (found from the clip's track in the avatar cache) the output differs from the
    clip's own frames as the speech is loud or quiet, frame by frame, in every third of the output: the
    mouth is made from the speech across the parts (rendered at the clip's size). ``turns``: the summary's
    (where the clip turned back and forward, chosen from a track known before decoding), else its ends."""
    import hashlib

    digest = hashlib.sha256(clip.read_bytes()).hexdigest()
    entry = next(path.parent for path in cache_folder.glob("*/entry.json")
                 if json.loads(path.read_text())["file"]["sha256"] == digest)
    landmarks = np.load(entry / "landmarks.npy")  # (F, 468, 2) pixels
    made, filmed = decode_frames(output).astype(np.int16), decode_frames(clip).astype(np.int16)
    assert made.shape[1:] == filmed.shape[1:]
    sources = (looped_indices(np.arange(len(made)), turns) if turns
               else pingpong_indices(np.arange(len(made)), len(filmed)))
    change = []
    for index, source in enumerate(sources):
        (x1, y1), (x2, y2) = landmarks[source][LIPS].min(axis=0), landmarks[source][LIPS].max(axis=0)
        margin = 0.25 * (x2 - x1)
        rows = slice(int(y1 - margin), int(y2 + margin))
        columns = slice(int(x1 - margin), int(x2 + margin))
        change.append(np.abs(made[index, rows, columns] - filmed[source, rows, columns]).mean())
    samples = load_audio_16k(speech_wav)
    per_frame = 16000 / fps
    loudness = np.array([np.sqrt(np.mean(samples[int(i * per_frame): int((i + 1) * per_frame)] ** 2) + 1e-12)
                         for i in range(len(made))])
    # measured 0.47-0.55 in each third with the landmark engine; a mouth out of step with its speech is near 0
    for third in np.array_split(np.arange(len(made)), 3):
        correlation = np.corrcoef(loudness[third], np.array(change)[third])[0, 1]
        assert correlation > 0.25, (third[0], correlation)


def assert_spoken_mp4(path) -> None:
    """H.264 and AAC (and the subtitles' text track a text job adds), the video as long as its speech."""
    import av

    info = probe(path)
    assert info.kind == "video" and info.has_audio and abs(info.duration - info.audio_duration) < 0.1, info
    with av.open(str(path)) as container:
        codecs = {stream.type: stream.codec_context.name for stream in container.streams}
    assert codecs in ({"video": "h264", "audio": "aac"}, {"video": "h264", "audio": "aac", "subtitle": "mov_text"})


def spoken(face, output, **extra):
    summary, speech = generate_spoken(face, SCRIPT, output, overrides={**OPTIONS, **extra})
    assert summary.parts >= 2 and summary.frames_without_face == 0, summary
    assert_playable_mp4(output, speech.duration)
    assert probe(output).frame_count == summary.frames
    return summary, speech


def test_a_clip_shorter_than_the_speech_plays_back_and_forth_from_a_fresh_cache(tmp_path, short_clip, fresh_cache):
    output = tmp_path / "short.mp4"
    summary, speech = spoken(short_clip, output)
    assert summary.video_seconds > probe(short_clip).duration + 2  # played back from its end
    mouth_follows_speech(output, short_clip, output.with_suffix(".wav"), summary.fps, fresh_cache)
    entry = json.loads(next(fresh_cache.glob("*/entry.json")).read_text())
    assert entry["whole_video"] is True  # the parts tracked the clip once, to its end


def test_a_clip_longer_than_the_speech_is_tracked_on_part_by_part(tmp_path, long_clip, fresh_cache):
    output = tmp_path / "long.mp4"
    summary, _ = spoken(long_clip, output)
    assert summary.video_seconds < probe(long_clip).duration
    mouth_follows_speech(output, long_clip, output.with_suffix(".wav"), summary.fps, fresh_cache)
    entry = json.loads(next(fresh_cache.glob("*/entry.json")).read_text())
    assert entry["whole_video"] is False and entry["frames"] == summary.frames  # tracked as far as spoken


def test_a_clip_tracked_in_part_by_an_earlier_shorter_job(tmp_path, long_clip, short_speech, fresh_cache):
    generate(long_clip, short_speech, tmp_path / "earlier.mp4", overrides=OPTIONS)  # tracks the first 3.4 s
    before = json.loads(next(fresh_cache.glob("*/entry.json")).read_text())
    assert before["whole_video"] is False and before["frames"] < 4 * 30
    output = tmp_path / "later.mp4"
    summary, _ = spoken(long_clip, output)
    assert summary.avatar_cache == "hit"  # the first part is within what the earlier job tracked
    after = json.loads(next(fresh_cache.glob("*/entry.json")).read_text())
    assert after["frames"] == summary.frames > before["frames"]  # the later part tracked on from its end
    mouth_follows_speech(output, long_clip, output.with_suffix(".wav"), summary.fps, fresh_cache)


def test_a_part_whose_track_was_not_kept_tracks_the_frames_before_it(tmp_path, long_clip, fresh_cache, monkeypatch):
    """The avatar cache could not keep what the first part tracked (a full disk, a cleaning between
    two parts): the next part tracks the frames it passes over itself and goes on."""
    from heygem.face.track import truncate_finished

    store_track = avatar_cache.store_track
    stored = []

    def keep_little_the_first_time(key, track, whole_video):  # the first part's track: 10 frames kept
        stored.append(track.frame_count)
        if len(stored) == 1:
            track, whole_video = truncate_finished(track, 10), False
        store_track(key, track, whole_video)

    monkeypatch.setattr(avatar_cache, "store_track", keep_little_the_first_time)
    output = tmp_path / "unkept.mp4"
    summary, _ = spoken(long_clip, output)
    assert len(stored) >= 2 and stored[0] > 10
    mouth_follows_speech(output, long_clip, output.with_suffix(".wav"), summary.fps, fresh_cache)


def test_the_command_line_speaks_a_script_on_a_video(tmp_path, short_clip):
    output = tmp_path / "said on video.mp4"
    result = subprocess.run([sys.executable, "-m", "heygem", "generate", "--face", str(short_clip), "--text", SCRIPT,
                             "--output", str(output), "--engine", "landmark",
                             "--subtitles", "soft"], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, HEYGEM_CACHE_DIR=str(tmp_path / "cache")))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert_spoken_mp4(output)
    assert "The clip plays on" in output.with_suffix(".srt").read_text(encoding="utf-8")


def test_a_batch_folder_speaks_text_files_on_videos(tmp_path, short_clip, long_clip):
    from heygem.jobs.batch import run_batch

    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copyfile(short_clip, folder / "anna.mp4")
    (folder / "anna.txt").write_text(SCRIPT, encoding="utf-8")
    shutil.copyfile(long_clip, folder / "ben.mp4")
    (folder / "ben.txt").write_text("你好，欢迎收看。这段视频是由文字生成的。", encoding="utf-8")  # Chinese
    results = {result.item.name: result for result in run_batch(folder, tmp_path / "out", "stem", OPTIONS,
                                                                jobs_dir=tmp_path / "jobs", show_progress=False)}
    for name in ("anna", "ben"):
        assert results[name].status == "done", results[name].error
        assert_spoken_mp4(tmp_path / "out" / f"{name}.mp4")
    with open(tmp_path / "out" / "summary.csv", newline="", encoding="utf-8") as handle:
        assert {row["name"]: row["status"] for row in csv.DictReader(handle)} == {"anna": "done", "ben": "done"}


def test_rest_and_gradio_client_speak_a_script_on_a_video(served_app, avatar_cache_dir, short_clip):
    from gradio_client import Client, handle_file

    response = served_app.client.post("/api/jobs", files={"face": ("presenter.mp4", short_clip.read_bytes())},
                                      data={"text": SCRIPT, "options": json.dumps(OPTIONS)})
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    assert served_app.wait_finished([job_id], 600)[job_id]["status"] == "done", served_app.log_text()[-3000:]
    folder = served_app.outputs / job_id
    assert_spoken_mp4(folder / "result.mp4")
    summary = json.loads((folder / "result.json").read_text())
    assert summary["parts"] >= 2 and summary["frames_without_face"] == 0
    mouth_follows_speech(folder / "result.mp4", short_clip, folder / "speech.wav", summary["fps"],
                         avatar_cache_dir, summary.get("turns"))  # the server's avatar cache: the tests' (conftest)

    client = Client(served_app.url, verbose=False)
    video, job_id = client.predict(face=handle_file(str(short_clip)), text="Hello there. Nice to meet you again.",
                                   engine="landmark", options=json.dumps({"media.output_height": 192}),
                                   api_name="/generate")
    status = client.predict(job_id=job_id, api_name="/job_status")
    assert status["status"] == "done", status
    assert probe(video).has_audio and probe(video).height == 192
