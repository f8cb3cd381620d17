"""Step 2: audio features, exactly as the public Wav2Lip analyses speech.

16 kHz mono; pre-emphasis 0.97; STFT with n_fft 800, window 800, hop 200
(80 mel frames per second, centred frames with reflect padding as librosa 0.7 did); 80 mel bands
from 55 to 7600 Hz; amplitude to dB
(floor 1e-5) minus a 20 dB reference; symmetric normalisation of
[-100 dB, 0 dB] onto [-4, 4] with clipping. The STFT and the Slaney-style mel
filters are written out here with numpy (the same numbers librosa gives, see
tests/test_audio.py), so no librosa release can change them and no job waits
for librosa's import and first-call compilation.
"""

from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from heygem.errors import HeygemError
from heygem.media.ffmpeg import ffmpeg_binary

SAMPLE_RATE = 16_000
N_FFT = 800
HOP_LENGTH = 200
WIN_LENGTH = 800
N_MELS = 80
FMIN = 55.0
FMAX = 7600.0
PREEMPHASIS = 0.97
REF_LEVEL_DB = 20.0
MIN_LEVEL_DB = -100.0
MAX_ABS_VALUE = 4.0
MEL_FRAMES_PER_SECOND = SAMPLE_RATE / HOP_LENGTH  # 80.0
MEL_WINDOW = 16  # mel frames per Wav2Lip window (0.2 s)


def audio_decode_args(path: Path, sample_rate: int = SAMPLE_RATE, max_seconds: float | None = None) -> list[str]:
    """ffmpeg arguments that decode the first audio stream of ``path`` to mono float32 on stdout at
    ``sample_rate`` (16 kHz), its first ``max_seconds`` only when given."""
    import ffmpeg

    limit = {} if max_seconds is None else {"t": f"{max_seconds:g}"}
    output = ffmpeg.input(str(path), **limit)["a:0"].output("pipe:", format="f32le", ac=1, ar=sample_rate)
    return ["-nostdin", "-v", "error", *output.get_args()]


def load_audio_16k(path: str | Path) -> np.ndarray:
    """Decode any audio (or a video's audio track) to (S,) float32 mono samples at 16 kHz."""
    return decode_audio(path, SAMPLE_RATE)


def decode_audio(path: str | Path, sample_rate: int, max_seconds: float | None = None) -> np.ndarray:
    """Decode any audio (or a video's audio track) to (S,) float32 mono samples at ``sample_rate``; only
    its first ``max_seconds`` when given. HeygemError when there is no sound to decode."""
    path = Path(path)
    with tempfile.TemporaryFile() as stderr_file:
        result = subprocess.run([ffmpeg_binary(), *audio_decode_args(path, sample_rate, max_seconds)],
                                stdout=subprocess.PIPE, stderr=stderr_file, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            stderr_file.seek(0)
            lines = stderr_file.read().decode(errors="replace").strip().splitlines()
            if any("matches no streams" in line for line in lines):
                raise HeygemError(f"{path.name} has no audio stream")
            raise HeygemError(f"could not decode the audio of {path.name}: {lines[-1] if lines else 'ffmpeg failed'}")
    samples = np.frombuffer(result.stdout, dtype=np.float32).copy()
    if samples.size == 0:
        raise HeygemError(f"{path.name} has no audio samples")
    return samples


SILENCE_RMS = 0.003  # -50 dBFS: speech whose loudest 50 ms stay below this moves no mouth


def is_silent(samples_16k: np.ndarray) -> bool:
    """True when no 50 ms of ``samples_16k`` ((S,) float32 in [-1, 1]) is louder than :data:`SILENCE_RMS`."""
    window = SAMPLE_RATE // 20
    count = max(1, samples_16k.shape[0] // window)
    windows = np.resize(samples_16k, count * window).reshape(count, window).astype(np.float64)  # (count, 800)
    return float(np.sqrt(np.mean(np.square(windows), axis=1)).max()) < SILENCE_RMS


# The Slaney mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above.
_HZ_PER_MEL = 200.0 / 3.0
_LOG_START_HZ = 1000.0
_LOG_START_MEL = _LOG_START_HZ / _HZ_PER_MEL  # 15
_MELS_PER_LOG_HZ = 27.0 / np.log(6.4)


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / _HZ_PER_MEL
    logarithmic = _LOG_START_MEL + np.log(np.maximum(hz, _LOG_START_HZ) / _LOG_START_HZ) * _MELS_PER_LOG_HZ
    return np.where(hz >= _LOG_START_HZ, logarithmic, linear)


def mel_to_hz(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    linear = mels * _HZ_PER_MEL
    logarithmic = _LOG_START_HZ * np.exp((mels - _LOG_START_MEL) / _MELS_PER_LOG_HZ)
    return np.where(mels >= _LOG_START_MEL, logarithmic, linear)


def mel_frequencies(count: int, fmin: float = FMIN, fmax: float = FMAX) -> np.ndarray:
    """``count`` frequencies in Hz, evenly spaced on the mel scale from ``fmin`` to ``fmax``."""
    return mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), count))


@functools.lru_cache(maxsize=1)
def _mel_basis() -> np.ndarray:
    """(80, 401) float32 triangular filters on the STFT bins, each scaled to unit area (Slaney)."""
    bin_hz = np.linspace(0.0, SAMPLE_RATE / 2, 1 + N_FFT // 2)  # (401,)
    edges_hz = mel_frequencies(N_MELS + 2)  # (82,) lower edge, centre, upper edge of each band
    widths = np.diff(edges_hz)  # (81,)
    rising = (bin_hz[None, :] - edges_hz[:-2, None]) / widths[:-1, None]  # (80, 401)
    falling = (edges_hz[2:, None] - bin_hz[None, :]) / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]
    return weights.astype(np.float32)


@functools.lru_cache(maxsize=1)
def _hann_window() -> np.ndarray:
    """The periodic Hann window of WIN_LENGTH samples (as spectral analysis uses it)."""
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(WIN_LENGTH) / WIN_LENGTH)).astype(np.float32)


def preemphasis(samples: np.ndarray, coefficient: float = PREEMPHASIS) -> np.ndarray:
    """y[n] = x[n] - coefficient * x[n-1], with x[-1] = 0."""
    emphasised = samples.astype(np.float32, copy=True)
    emphasised[1:] -= coefficient * samples[:-1]
    return emphasised


def _stft_frames(samples: np.ndarray) -> np.ndarray:
    """(T, 800) views of the centred STFT's frames: reflect-padded by N_FFT/2, hop 200."""
    padded = np.pad(samples.astype(np.float32, copy=False), N_FFT // 2, mode="reflect")
    return np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH]


def _magnitude(frames: np.ndarray) -> np.ndarray:
    """(401, t) float32 magnitude spectra of (t, 800) frames under the Hann window."""
    return np.abs(np.fft.rfft(frames * _hann_window(), axis=1)).astype(np.float32).T


def stft_magnitude(samples: np.ndarray) -> np.ndarray:
    """(401, T) float32 magnitude of the centred STFT: reflect-padded by N_FFT/2, Hann window, hop 200."""
    return _magnitude(_stft_frames(samples))


# STFT frames transformed at once: the windowed frames, their spectrum and its magnitude are each
# several times the audio's size, so a 10-minute input done whole held ~0.7 GiB for a moment
MEL_CHUNK_FRAMES = 1024


def melspectrogram(samples_16k: np.ndarray) -> np.ndarray:
    """Wav2Lip's normalised log-mel spectrogram: (80, T) float32 in [-4, 4], T = 1 + S // 200.

    Computed MEL_CHUNK_FRAMES frames at a time (each frame on its own samples, so the chunks
    join to the whole-input result), keeping memory flat in the audio's length."""
    frames = _stft_frames(preemphasis(samples_16k))  # (T, 800) views
    basis = _mel_basis()  # (80, 401)
    mel = np.empty((basis.shape[0], len(frames)), dtype=np.float32)  # (80, T) linear amplitude
    for start in range(0, len(frames), MEL_CHUNK_FRAMES):
        chunk = frames[start:start + MEL_CHUNK_FRAMES]  # (t, 800)
        mel[:, start:start + len(chunk)] = basis @ _magnitude(chunk)
    decibels = 20.0 * np.log10(np.maximum(1e-5, mel)) - REF_LEVEL_DB
    normalised = 2 * MAX_ABS_VALUE * ((decibels - MIN_LEVEL_DB) / -MIN_LEVEL_DB) - MAX_ABS_VALUE
    return np.clip(normalised, -MAX_ABS_VALUE, MAX_ABS_VALUE).astype(np.float32)


def mel_window_starts(frame_count: int, fps: float, mel_length: int) -> np.ndarray:
    """First mel column of each output frame's 80x16 window: int(i * 80 / fps), the last ones right-aligned."""
    starts = (np.arange(frame_count) * (MEL_FRAMES_PER_SECOND / fps)).astype(np.int64)
    return np.minimum(starts, max(mel_length - MEL_WINDOW, 0))


def mel_windows(mel: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """(N, 80, 16) float32 windows of ``mel`` (80, T) starting at ``starts``; short audio is padded with silence."""
    if mel.shape[1] < MEL_WINDOW:
        pad = np.full((mel.shape[0], MEL_WINDOW - mel.shape[1]), -MAX_ABS_VALUE, dtype=mel.dtype)
        mel = np.concatenate([mel, pad], axis=1)
    columns = starts[:, None] + np.arange(MEL_WINDOW)[None, :]  # (N, 16)
    return np.ascontiguousarray(mel[:, columns].transpose(1, 0, 2))


def output_frame_count(audio_seconds: float, fps: float) -> int:
    """Frames in the output: the audio's length at the output rate, at least one."""
    return max(1, int(round(audio_seconds * fps)))
