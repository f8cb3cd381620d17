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
