"""Stage 2: audio features, exactly as the public Wav2Lip analyses speech.

16 kHz mono; pre-emphasis 0.97; STFT with n_fft 800, window 800, hop 200
(80 mel frames per second, centred frames with reflect padding as librosa 0.7 did); 80 mel bands from 55 to 7600 Hz; amplitude to dB
(floor 1e-5) minus a 20 dB reference; symmetric normalisation of
[-100 dB, 0 dB] onto [-4, 4] with clipping. Written against librosa's keyword
API so that librosa releases do not break it.
"""

from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from heygem.errors import HeygemError
from heygem.media import ffmpeg_binary

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


def audio_decode_args(path: Path) -> list[str]:
    """ffmpeg arguments that decode the first audio stream of ``path`` to 16 kHz mono float32 on stdout."""
    import ffmpeg

    output = ffmpeg.input(str(path))["a:0"].output("pipe:", format="f32le", ac=1, ar=SAMPLE_RATE)
    return ["-nostdin", "-v", "error", *output.get_args()]


def load_audio_16k(path: str | Path) -> np.ndarray:
    """Decode any audio (or a video's audio track) to (S,) float32 mono samples at 16 kHz."""
    path = Path(path)
    with tempfile.TemporaryFile() as stderr_file:
        result = subprocess.run([ffmpeg_binary(), *audio_decode_args(path)], stdout=subprocess.PIPE,
                                stderr=stderr_file, stdin=subprocess.DEVNULL)
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


@functools.lru_cache(maxsize=1)
def _mel_basis() -> np.ndarray:
    import librosa

    # (80, 401) float32 triangular filters on the linear-frequency STFT bins
    return librosa.filters.mel(sr=SAMPLE_RATE, n_fft=N_FFT, n_mels=N_MELS, fmin=FMIN, fmax=FMAX).astype(np.float32)


def preemphasis(samples: np.ndarray, coefficient: float = PREEMPHASIS) -> np.ndarray:
    """y[n] = x[n] - coefficient * x[n-1], with x[-1] = 0."""
    emphasised = samples.astype(np.float32, copy=True)
    emphasised[1:] -= coefficient * samples[:-1]
    return emphasised


def melspectrogram(samples_16k: np.ndarray) -> np.ndarray:
    """Wav2Lip's normalised log-mel spectrogram: (80, T) float32 in [-4, 4], T = 1 + S // 200."""
    import librosa

    spectrum = librosa.stft(y=preemphasis(samples_16k), n_fft=N_FFT, hop_length=HOP_LENGTH,
                            win_length=WIN_LENGTH, center=True, pad_mode="reflect")
    mel = _mel_basis() @ np.abs(spectrum).astype(np.float32)  # (80, T) linear amplitude
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
