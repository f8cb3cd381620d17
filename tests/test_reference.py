"""The voice sample a cloned voice imitates: the cleanest 5-30 s of speech of a recording, or one line
saying there is none (silence, a tone, noise, music, clipping)."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
from conftest import ASSETS, run_ffmpeg

from heygem.errors import HeygemError
from heygem.speech.audio import decode_audio
from heygem.speech.reference import cleanest_speech, frame_features, speech_window

RATE = 24000


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE) -> Path:
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(pcm.tobytes())
    return path


def speech(name: str = "speech_en") -> np.ndarray:
    return decode_audio(ASSETS / f"{name}.wav", RATE)


def seconds(count: float) -> np.ndarray:
    return np.arange(int(count * RATE)) / RATE


@pytest.mark.parametrize("name", ["speech_en", "speech_zh"])
def test_real_speech_is_taken_whole(name):
    samples, rate = cleanest_speech(ASSETS / f"{name}.wav")
    whole = speech(name)
    assert rate == RATE and samples.dtype == np.float32 and samples.ndim == 1
    assert 5.0 <= len(samples) / RATE <= len(whole) / RATE + 0.02
    assert len(samples) / RATE > len(whole) / RATE - 1.0  # all of it but a silent end


def test_a_video_s_own_sound_gives_its_speech(tmp_path):
    video = tmp_path / "presenter.mp4"
    run_ffmpeg("-loop", "1", "-framerate", "5", "-i", str(ASSETS / "astronaut.jpg"),
               "-i", str(ASSETS / "speech_zh.wav"), "-vf", "scale=128:-2", "-c:v", "libx264", "-pix_fmt", "yuv420p",
               "-c:a", "aac", "-shortest", str(video))
    samples, rate = cleanest_speech(video)
    assert rate == RATE and len(samples) / RATE >= 5.0
    assert frame_features(samples, RATE).voiced.mean() > 0.3


def test_the_speech_is_found_between_noise_and_silence(tmp_path):
    rng = np.random.default_rng(0)
    noise = (0.05 * rng.standard_normal(int(12 * RATE))).astype(np.float32)
    tone = (0.3 * np.sin(2 * np.pi * 220 * seconds(10))).astype(np.float32)
    words = speech()
    recording = np.concatenate([noise, np.zeros(3 * RATE, np.float32), words, np.zeros(2 * RATE, np.float32), tone])
    start, end = speech_window(recording, RATE)
    speech_start = len(noise) + 3 * RATE
    speech_end = speech_start + len(words)
    overlap = min(end, speech_end) - max(start, speech_start)
    assert overlap >= 0.9 * (end - start), (start / RATE, end / RATE, speech_start / RATE, speech_end / RATE)
    assert 5 * RATE <= end - start <= 30 * RATE


def test_long_speech_gives_at_most_30_seconds():
    words = np.concatenate([speech(), speech("speech_zh")] * 4)  # 64 s
    start, end = speech_window(words, RATE)
    assert 20 * RATE <= end - start <= 30 * RATE + 1


def rejected(samples: np.ndarray, tmp_path: Path) -> str:
    path = write_wav(tmp_path / "sample.wav", samples.astype(np.float32))
    with pytest.raises(HeygemError) as caught:
        cleanest_speech(path)
    message = str(caught.value)
    assert "\n" not in message and "sample.wav" in message
    return message


def test_silence_is_refused(tmp_path):
    assert "silence" in rejected(np.zeros(10 * RATE), tmp_path)


def test_a_tone_is_refused(tmp_path):
    assert "tone" in rejected(0.3 * np.sin(2 * np.pi * 220 * seconds(10)), tmp_path)


@pytest.mark.parametrize("colour", ["white", "brown"])
def test_noise_is_refused(tmp_path, colour):
    rng = np.random.default_rng(1)
    noise = 0.1 * rng.standard_normal(10 * RATE)
    if colour == "brown":
        noise = np.cumsum(noise) * 0.01
    assert "noise" in rejected(noise, tmp_path)


def test_a_held_chord_is_refused_as_music(tmp_path):
    times = seconds(12)
    chord = sum(0.1 * np.sin(2 * np.pi * 220 * 2 ** (step / 12) * times) for step in (0, 4, 7))
    assert "music" in rejected(chord * (0.5 + 0.5 * np.sin(2 * np.pi * 0.25 * times)), tmp_path)


def test_clipped_speech_is_refused(tmp_path):
    assert "clipped" in rejected(np.clip(speech() * 20, -1, 1), tmp_path)


def test_too_short_a_sample_is_refused(tmp_path):
    assert "longer" in rejected(speech()[: 3 * RATE], tmp_path)


def test_a_file_without_sound_is_refused(tmp_path):
    video = tmp_path / "silent.mp4"
    run_ffmpeg("-loop", "1", "-framerate", "5", "-t", "1", "-i", str(ASSETS / "astronaut.jpg"), "-vf", "scale=128:-2",
               "-c:v", "libx264", "-pix_fmt", "yuv420p", str(video))
    with pytest.raises(HeygemError, match="no audio stream"):
        cleanest_speech(video)
