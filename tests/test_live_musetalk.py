"""MuseTalk in live mode: a session forced to it answers with its engine and delay, and the frames it sends
carry MuseTalk's mouth (random-init reduced files: the mouth is noise, drawn where the mouth is and nowhere
above it). On the CPU its networks draw a frame or two a second: the test counts frames, not their rate."""

from __future__ import annotations

import asyncio

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

    speech = load_audio_16k(ASSETS / "speech_en.wav")[: 16000 * 4]
    with serving(tmp_path / "outputs", live=LiveSettings(max_sessions=1, idle_seconds=30, engine="musetalk")) as url:
        result = asyncio.run(talk(url, speech, seconds=5.0))
    assert result.answer["engine"] == "musetalk" and "--live-engine" in result.answer["engine_reason"]
    assert result.answer["delay_seconds"] == pytest.approx(0.24, abs=0.001), \
        "a frame waits for 0.14 s of sound after it and the next frame's, and 0.06 s for packets"
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
    from heygem.live.engine_step import MUSETALK_FRAMES_PER_FEATURES, MuseTalkStep

    speech = load_audio_16k(ASSETS / "speech_en.wav")[: 16000 * 3]
    step = MuseTalkStep(load_config(), 25.0, musetalk_weights / "musetalk")
    try:
        job = step.engine.audio_features(speech, 25.0, 75)  # (75, 50, 384): a job's windows of 3 s at 25 fps
        frame = 30  # 1.2 s in, while words are spoken
        first = step.audio_window(SoundWindow(speech, frame * 640, before=frame * 640))
        assert first.shape == (1, 50, 384)
        assert np.allclose(first[0], job[frame], atol=1e-5), "the window of the frame's own rows"
        nearby = step.audio_window(SoundWindow(np.zeros(100, np.float32), (frame + 1) * 640, before=0))
        assert np.allclose(nearby[0], job[frame + 1], atol=1e-5), "the next frame's window, kept from one pass"
        assert MUSETALK_FRAMES_PER_FEATURES == 2
        later = step.audio_window(SoundWindow(speech, (frame + 5) * 640, before=(frame + 5) * 640))
        assert np.allclose(later[0], job[frame + 5], atol=1e-5), "a frame past the kept ones: a new pass"
    finally:
        step.close()
