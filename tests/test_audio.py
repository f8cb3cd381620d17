"""Mel features against Wav2Lip's formula, and mel window placement at common frame rates."""

import numpy as np
import pytest

from heygem.speech import audio


def reference_mel(samples: np.ndarray) -> np.ndarray:
    """Wav2Lip's analysis written out with numpy: pre-emphasis, reflect-padded Hann STFT, mel, dB, normalise."""
    import librosa

    emphasised = np.append(samples[0], samples[1:] - 0.97 * samples[:-1])
    padded = np.pad(emphasised, 400, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(800) / 800)  # periodic Hann
    frame_count = 1 + (len(padded) - 800) // 200
    frames = np.stack([padded[i * 200: i * 200 + 800] * window for i in range(frame_count)], axis=1)
    magnitude = np.abs(np.fft.rfft(frames, axis=0))  # (401, T)
    basis = librosa.filters.mel(sr=16000, n_fft=800, n_mels=80, fmin=55, fmax=7600)
    decibels = 20 * np.log10(np.maximum(1e-5, basis @ magnitude)) - 20
    return np.clip(8 * ((decibels + 100) / 100) - 4, -4, 4)


def test_mel_matches_the_formula_on_a_chirp():
    time = np.arange(16000) / 16000
    chirp = (0.5 * np.sin(2 * np.pi * (100 + 1500 * time) * time)).astype(np.float32)
    ours = audio.melspectrogram(chirp)
    assert ours.shape == (80, 81) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, reference_mel(chirp.astype(np.float64)), atol=2e-3)


def test_mel_in_chunks_equals_the_whole_input_at_once(monkeypatch):
    time = np.arange(3 * 16000 + 77) / 16000  # 241 frames: chunks of 64 leave a short last one
    chirp = (0.5 * np.sin(2 * np.pi * (100 + 1500 * time) * time)).astype(np.float32)
    whole = audio.melspectrogram(chirp)  # one chunk: 241 frames < MEL_CHUNK_FRAMES
    monkeypatch.setattr(audio, "MEL_CHUNK_FRAMES", 64)
    chunked = audio.melspectrogram(chirp)
    assert chunked.shape == whole.shape == (80, 241)
    np.testing.assert_allclose(chunked, whole, atol=1e-5)  # only the matrix product's summation order may differ
    np.testing.assert_allclose(chunked, reference_mel(chirp.astype(np.float64)), atol=2e-3)


def test_silence_is_minus_four_and_a_tone_peaks_in_its_band():
    assert np.all(audio.melspectrogram(np.zeros(8000, dtype=np.float32)) == -4.0)
    tone = (0.8 * np.sin(2 * np.pi * 1000 * np.arange(16000) / 16000)).astype(np.float32)
    mel = audio.melspectrogram(tone)
    import librosa

    centres = librosa.mel_frequencies(n_mels=82, fmin=55, fmax=7600)[1:-1]
    peak_band = int(np.argmax(mel[:, 10:-10].mean(axis=1)))
    assert abs(centres[peak_band] - 1000) < 80
    assert mel.max() <= 4.0 and mel[:, 10:-10].max() > 2.0  # loud, clipped at the top of the range


@pytest.mark.parametrize("fps", [25.0, 30000 / 1001, 30.0, 60.0])
def test_window_starts_follow_the_frame_times(fps):
    seconds = 3.0
    mel_length = int(seconds * 80) + 1
    frame_count = audio.output_frame_count(seconds, fps)
    starts = audio.mel_window_starts(frame_count, fps, mel_length)
    assert frame_count == round(seconds * fps)
    expected = [int(i * 80 / fps) for i in range(frame_count)]
    expected = [min(start, mel_length - 16) for start in expected]
    assert starts.tolist() == expected
    assert starts[-1] + 16 <= mel_length  # the last window is right-aligned, never past the end
    # the window of frame i starts within one mel frame (12.5 ms) of the frame's time
    # (frames whose window would run past the end are the right-aligned ones)
    unclamped = np.arange(frame_count) * 80 / fps + 16 <= mel_length
    frame_times = np.arange(frame_count) / fps
    assert np.all(np.abs(starts / 80 - frame_times)[unclamped] < 1 / 80)
    assert np.all(starts[~unclamped] == mel_length - 16)


def test_windows_are_slices_of_the_mel_and_short_audio_is_padded():
    mel = np.random.default_rng(0).uniform(-4, 4, size=(80, 50)).astype(np.float32)
    windows = audio.mel_windows(mel, np.array([0, 7, 34]))
    assert windows.shape == (3, 80, 16)
    np.testing.assert_array_equal(windows[1], mel[:, 7:23])
    short = audio.mel_windows(mel[:, :5], np.array([0]))
    assert short.shape == (1, 80, 16) and np.all(short[0, :, 5:] == -4)


def test_audio_is_decoded_from_any_container(media_dir, speech_wav):
    from conftest import run_ffmpeg

    reference = audio.load_audio_16k(speech_wav)
    for suffix, codec in [(".mp3", "libmp3lame"), (".m4a", "aac"), (".flac", "flac"), (".ogg", "libopus")]:
        path = media_dir / f"speech{suffix}"
        if codec == "libmp3lame":
            run_ffmpeg("-i", str(speech_wav), "-ac", "2", "-ar", "44100", str(path))
        else:
            run_ffmpeg("-i", str(speech_wav), "-c:a", codec, "-ar", "48000", str(path))
        samples = audio.load_audio_16k(path)
        assert abs(len(samples) - len(reference)) < 0.06 * 16000, suffix  # codec padding only
        assert samples.dtype == np.float32 and 0.05 < np.abs(samples).max() <= 1.0


def test_mel_filters_and_frequencies_equal_librosas():
    import librosa

    expected = librosa.filters.mel(sr=16000, n_fft=800, n_mels=80, fmin=55, fmax=7600)
    np.testing.assert_allclose(audio._mel_basis(), expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(audio.mel_frequencies(82), librosa.mel_frequencies(n_mels=82, fmin=55, fmax=7600),
                               rtol=1e-9)


def test_stft_equals_librosas_centred_reflect_padded_stft():
    import librosa

    samples = np.random.default_rng(3).normal(0, 0.2, 16000 + 123).astype(np.float32)
    expected = np.abs(librosa.stft(y=samples, n_fft=800, hop_length=200, win_length=800, center=True,
                                   pad_mode="reflect"))
    ours = audio.stft_magnitude(samples)
    assert ours.shape == expected.shape == (401, 1 + len(samples) // 200)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)


def test_mel_memory_does_not_grow_with_the_audio_beyond_its_own_size():
    import tracemalloc

    samples = np.random.default_rng(5).normal(0, 0.1, 16000 * 120).astype(np.float32)  # 2 minutes, 7.7 MB
    tracemalloc.start()
    try:
        mel = audio.melspectrogram(samples)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert mel.shape == (80, 9601)
    # copies of the audio (pre-emphasis, padding) plus one chunk's spectra: whole-input spectra would be
    # ~10x the audio (the windowed frames alone are 4x its size)
    assert peak < 4 * samples.nbytes + 64 * 2**20, peak / 2**20  # the whole-input form peaked at 26x the audio
