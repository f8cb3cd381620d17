"""MuseTalk in live mode: a session forced to it answers with its engine and delay, and the frames it sends
carry MuseTalk's mouth (random-init reduced files: the mouth is noise, drawn where the mouth is and nowhere
above it). On the CPU its networks draw a frame or two a second: the test counts frames, not their rate."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import ASSETS
from live_client import portrait_mouth_box, serving, talk

from heygem.speech.audio import load_audio_16k

pytest.importorskip("aiortc")
pytest.importorskip("diffusers")


def test_musetalk_runs_live_where_forced_and_draws_the_mouth_only(tmp_path, musetalk_weights, monkeypatch):
    import av

    from heygem.config import apply_overrides, load_config
    from heygem.live.engine_step import choose_live_engine
    from heygem.live.face import BUNDLED_PORTRAIT, load_face
    from heygem.live.sessions import LiveSettings

    monkeypatch.setenv("HEYGEM_WEIGHTS", str(musetalk_weights))
    auto = choose_live_engine(load_config())
    assert auto.name == "landmark" and "musetalk" in auto.reason and "GPU" in auto.reason, \
        "a job's musetalk stays off live on a CPU unless forced"

    speech = load_audio_16k(ASSETS / "speech_en.wav")  # 6.9 s: the frames that come, even late, hear words
    with serving(tmp_path / "outputs", live=LiveSettings(max_sessions=1, idle_seconds=30, engine="musetalk")) as url:
        result = asyncio.run(talk(url, speech, seconds=5.0, at_least_frames=4))  # however busy the machine
    assert result.answer["engine"] == "musetalk" and "--live-engine" in result.answer["engine_reason"]
    assert result.answer["delay_seconds"] == pytest.approx(0.22, abs=0.001), \
        "a frame waits for 0.14 s of sound after it and the next frame's, and 0.04 s for packets"
    assert len(result.frames) >= 3, "frames came back (on 2 CPU cores, a frame or two a second)"

    untouched = load_face(BUNDLED_PORTRAIT, apply_overrides(load_config(), {"media.output_height": 360}), "portrait")
    original = av.VideoFrame.from_ndarray(untouched.frames_i420[0], format="yuv420p").to_ndarray(format="gray")
    x1, y1, x2, y2 = portrait_mouth_box()
    mouth, above = [], []
    for _, shown in result.frames[1:]:  # whole frames (H, W) grey
        difference = np.abs(shown.astype(np.float32) - original)
        mouth.append(difference[y1:y2, x1:x2].mean())
        above.append(difference[: y1 // 2].mean())  # the hair and the sky: never drawn
    assert np.median(mouth) > 12 and np.median(above) < 5, (np.median(mouth), np.median(above))


def test_the_live_whisper_windows_are_a_jobs_when_the_sound_read_is_the_whole_speech(musetalk_weights):
    from heygem.config import load_config
    from heygem.live.audio_in import SoundWindow
    from heygem.live.engine_step import MUSETALK_FRAMES_PER_FEATURES, MuseTalkStep, WhisperWindows, whisper_passes

    speech = load_audio_16k(ASSETS / "speech_en.wav")[: 16000 * 3]
    step = MuseTalkStep(load_config(), 25.0, musetalk_weights / "musetalk")
    try:
        engine = step.engine
        job = engine.audio_features(speech, 25.0, 75)  # (75, 50, 384): a job's windows of 3 s at 25 fps
        frame = 30  # 1.2 s in, while words are spoken
        sound = SoundWindow(speech, frame * 640, before=frame * 640)
        (first,) = whisper_passes(engine, [sound], 25.0)
        assert MUSETALK_FRAMES_PER_FEATURES == 2 and first.shape == (2, 50, 384)
        assert np.allclose(first, job[frame:frame + 2], atol=1e-5), "the windows of the frame's own rows and the next"
        later = SoundWindow(speech[: (frame + 5) * 640 + 4000], (frame + 5) * 640, before=(frame + 5) * 640)
        calls = []
        encoder = engine.encoder_hidden_states
        engine.encoder_hidden_states = lambda mels: calls.append(len(mels)) or encoder(mels)
        together = whisper_passes(engine, [sound, later], 25.0)  # two sessions' passes in one encoder call
        del engine.encoder_hidden_states
        assert calls == [2], "one pass of the encoder runner for both sounds"
        assert np.allclose(together[0], first, atol=1e-4)
        assert np.allclose(together[1], whisper_passes(engine, [later], 25.0)[0], atol=1e-4), \
            "a sound of another length in the batch: its windows as its own pass makes them"

        kept = WhisperWindows(25.0)
        assert kept.window(sound) is None
        kept.keep(sound, first)
        nearby = kept.window(SoundWindow(np.zeros(100, np.float32), (frame + 1) * 640, before=0))
        assert np.array_equal(nearby[0], first[1]), "the next frame's window, kept from one pass"
        assert kept.window(later) is None, "a frame past the kept ones needs a new pass"
    finally:
        step.close()


def test_musetalk_sessions_share_one_call_and_get_the_frames_they_would_get_alone(musetalk_weights, monkeypatch):
    from heygem.config import apply_overrides, load_config
    from heygem.live import batching
    from heygem.live.audio_in import SoundWindow
    from heygem.live.engine_step import MuseTalkStep
    from heygem.live.face import BUNDLED_PORTRAIT, load_face

    monkeypatch.setattr(batching, "GATHER_SECONDS", 600.0)  # a call waits for every seated session's frame
    face = load_face(BUNDLED_PORTRAIT, apply_overrides(load_config(), {"media.output_height": 360}), "portrait")
    speech = load_audio_16k(ASSETS / "speech_en.wav")[: 16000 * 3]
    sounds = [SoundWindow(speech[: frame * 640 + 4000], frame * 640, before=frame * 640) for frame in (20, 30)]
    frame_i420, portrait_face = face.frames_i420[0], face.faces[0]
    luma_rows = frame_i420.shape[0] * 2 // 3
    brighter = frame_i420.copy()  # a second session's frame, so that the two mouths differ
    brighter[:luma_rows] = np.clip(brighter[:luma_rows].astype(int) + 30, 0, 255)
    requests = [(frame_i420, portrait_face, sounds[0]), (brighter, portrait_face, sounds[1])]

    step = MuseTalkStep(load_config(), 25.0, musetalk_weights / "musetalk", batch_size=2)
    expected = [step.render(*request) for request in requests]  # alone: its own windows, its own call each
    step.close()
    steps = [MuseTalkStep(load_config(), 25.0, musetalk_weights / "musetalk", batch_size=2) for _ in range(2)]
    try:
        engine = steps[0].engine
        assert steps[1].engine is engine
        calls: list[int] = []
        mouths = engine.mouths
        monkeypatch.setattr(engine, "mouths", lambda crops, windows: calls.append(len(crops)) or
                            mouths(crops, windows))
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda step, request: step.render(*request), steps, requests))
        assert calls == [2], "one UNet and decoder call on both sessions' faces"
        for frame, wanted, request in zip(together, expected, requests):
            assert np.abs(wanted.astype(int) - request[0]).max() > 20, "a mouth was drawn"
            assert np.abs(frame.astype(int) - wanted).max() <= 1
    finally:
        for one in steps:
            one.close()


def test_a_live_musetalk_frame_is_the_frame_a_jobs_patches_make(musetalk_weights):
    """The session cuts the crop and makes the patch in its own thread, the shared thread runs the networks: the
    frame is the one the engine's ``patches`` (a job's path) makes of the same frame, face and Whisper windows,
    byte for byte."""
    import torch

    from heygem.config import apply_overrides, load_config
    from heygem.live.audio_in import SoundWindow
    from heygem.live.engine_step import MuseTalkStep, mouth_into_frame, whisper_passes
    from heygem.live.face import BUNDLED_PORTRAIT, load_face

    config = load_config()
    face = load_face(BUNDLED_PORTRAIT, apply_overrides(config, {"media.output_height": 360}), "portrait")
    frame_i420, portrait_face = face.frames_i420[0], face.faces[0]
    speech = load_audio_16k(ASSETS / "speech_en.wav")[: 16000 * 3]
    sound = SoundWindow(speech[: 30 * 640 + 4000], 30 * 640, before=30 * 640)
    step = MuseTalkStep(config, 25.0, musetalk_weights / "musetalk")
    try:
        engine = step.engine
        windows = torch.from_numpy(np.asarray(whisper_passes(engine, [sound], 25.0)[0][:1]))  # (1, 50, 384)
        expected = mouth_into_frame(frame_i420, portrait_face, config.blend,
                                    lambda frame_bgr: engine.patches([frame_bgr], [portrait_face], windows)[0])
        frame = step.render(frame_i420, portrait_face, sound)
    finally:
        step.close()
    assert np.abs(expected.astype(int) - frame_i420).max() > 20, "a mouth was drawn"
    np.testing.assert_array_equal(frame, expected)
