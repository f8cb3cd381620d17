"""Every engine keeps the presenter's own mouth, as filmed, in the speech's pauses (heygem.speech.pauses,
heygem.render.pauses): wav2lip and musetalk on random-init files, on both render paths, on the CPU."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import soundfile
from conftest import ASSETS, decode_frames

from heygem.pipeline import generate
from heygem.speech.audio import SAMPLE_RATE, load_audio_16k

torch = pytest.importorskip("torch")

FPS = 25  # a photo's frame rate
SILENCE = (1.4, 2.4)  # seconds of the speech that are silent
SILENT_FRAMES = range(42, 54)  # inside the silence by more than the handover at both ends
SPOKEN_FRAMES = [*range(5, 30), *range(66, 78)]
MOUTH = (slice(140, 170), slice(205, 250))  # the portrait's mouth, in its pixels


@pytest.fixture(scope="module")
def speech_with_a_pause(tmp_path_factory):
    """3.2 s: 1.4 s of speech, 1 s of silence, 0.8 s of speech (16 kHz WAV)."""
    speech = load_audio_16k(ASSETS / "speech_en.wav")
    parts = [speech[int(0.2 * SAMPLE_RATE): int(1.6 * SAMPLE_RATE)], np.zeros(SAMPLE_RATE, np.float32),
             speech[int(0.2 * SAMPLE_RATE): int(1.0 * SAMPLE_RATE)]]
    path = tmp_path_factory.mktemp("speech") / "pause.wav"
    soundfile.write(path, np.concatenate(parts), SAMPLE_RATE)
    return path


@pytest.fixture(scope="module")
def wav2lip_checkpoint(tmp_path_factory):
    from heygem.models.wav2lip import Wav2Lip

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("wav2lip") / "wav2lip.pth"
    torch.save({"state_dict": Wav2Lip().state_dict()}, path)
    return path


@pytest.fixture(scope="module")
def musetalk_weights(tmp_path_factory):
    from heygem.engines.musetalk.random_files import write_random_files

    folder = tmp_path_factory.mktemp("weights")
    write_random_files(folder / "musetalk", size="reduced", seed=0)
    return folder


def mouth_change(output, source_bgr) -> np.ndarray:
    """(N,) the mean difference of each output frame's mouth from the filmed one."""
    frames = decode_frames(output).astype(np.int16)  # (N, H, W, 3)
    assert frames.shape[1:] == source_bgr.shape
    return np.abs(frames[:, MOUTH[0], MOUTH[1]] - source_bgr[None, MOUTH[0], MOUTH[1]]).mean(axis=(1, 2, 3))


def assert_filmed_in_the_pause_only(output, summary):
    source = cv2.imread(str(ASSETS / "astronaut.jpg")).astype(np.int16)
    change = mouth_change(output, source)
    assert len(change) == summary.frames == 80
    silent, spoken = change[list(SILENT_FRAMES)], change[SPOKEN_FRAMES]
    assert silent.max() < 4, (silent, spoken)  # the filmed mouth, through x264 and 4:2:0 only
    assert np.median(spoken) > 10, spoken  # the engine's mouth
    # no pop: from the generated mouth to the filmed one over a few frames
    assert "pauses" in summary.seconds_per_stage


@pytest.mark.parametrize("render", ["numpy", "torch"])
def test_wav2lip_shows_the_filmed_mouth_in_a_pause(tmp_path, speech_with_a_pause, wav2lip_checkpoint, render):
    output = tmp_path / "wav2lip.mp4"
    summary = generate(ASSETS / "astronaut.jpg", speech_with_a_pause, output, overrides={
        "engine.name": "wav2lip", "engine.checkpoint": str(wav2lip_checkpoint), "engine.device": "cpu",
        "restore.enabled": False, "run.render": render})
    assert summary.engine == "wav2lip"
    assert_filmed_in_the_pause_only(output, summary)


@pytest.mark.parametrize("render", ["numpy", "torch"])
def test_musetalk_shows_the_filmed_mouth_in_a_pause(tmp_path, speech_with_a_pause, musetalk_weights, render,
                                                   monkeypatch):
    monkeypatch.setenv("HEYGEM_WEIGHTS", str(musetalk_weights))
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path / "cache"))
    output = tmp_path / "musetalk.mp4"
    summary = generate(ASSETS / "astronaut.jpg", speech_with_a_pause, output, overrides={
        "engine.name": "musetalk", "engine.device": "cpu", "restore.enabled": False, "run.render": render})
    assert summary.engine == "musetalk"
    assert_filmed_in_the_pause_only(output, summary)


def test_the_mouth_fades_out_and_back_in_over_a_few_frames(speech_with_a_pause):
    from heygem.speech.pauses import mouth_weights

    weights = mouth_weights(load_audio_16k(speech_with_a_pause), FPS, 80)
    assert (weights[list(SILENT_FRAMES)] == 0).all() and (weights[SPOKEN_FRAMES] == 1).all()
    fading = np.flatnonzero((weights > 0) & (weights < 1))
    assert 4 <= len(fading) <= 8  # about 0.12 s at each end of the pause
    assert (np.abs(np.diff(weights)) <= 0.34).all()  # no step of more than a third: no pop
    assert (np.diff(weights[30:48]) <= 0).all() and (np.diff(weights[48:66]) >= 0).all()


def test_the_landmark_engine_lets_go_by_itself_and_gets_no_second_fade(tmp_path, speech_with_a_pause):
    summary = generate(ASSETS / "astronaut.jpg", speech_with_a_pause, tmp_path / "landmark.mp4",
                       overrides={"engine.name": "landmark"})
    assert "pauses" not in summary.seconds_per_stage
    source = cv2.imread(str(ASSETS / "astronaut.jpg")).astype(np.int16)
    assert mouth_change(tmp_path / "landmark.mp4", source)[list(SILENT_FRAMES)].max() < 4
