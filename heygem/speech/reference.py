"""The voice sample a cloned voice imitates: the cleanest 5-30 s of one recording's speech.

    samples, rate = cleanest_speech("presenter.mp4")   # (S,) float32 mono, 24000 by default
    start, end = speech_window(samples, rate)          # the same choice on samples already decoded

The recording (an audio file, or a video's own sound) is cut into 20 ms frames, each described by
its loudness, whether it is clipped (three or more samples in a row pinned at full scale) and
whether it is voiced (a strong autocorrelation peak at a pitch of 60-400 Hz, as vowels have). A
window of 5 to 30 s is speech when a good share of its frames is voiced but not nearly all of them
(a steady tone or a held note is voiced throughout; noise is hardly ever voiced), when its loudness
rises and falls as syllables do, when it is mostly not silent, when almost none of it is clipped
and when few of its voiced frames belong to runs of over 1.5 s (sustained notes: music, a hum).
Of the windows that pass, the cleanest is taken: the most of its sounding frames voiced (noise or
music beside the speech lowers that), little silence, no clipping, and longer up to 20 s. numpy only:
nothing beyond the runtime's packages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heygem.errors import HeygemError

logger = logging.getLogger("heygem")

SAMPLE_RATE = 24_000  # what the cloning model takes
MIN_SECONDS, MAX_SECONDS = 5.0, 30.0
PREFERRED_SECONDS = 20.0  # longer windows score better up to this length
ANALYSED_SECONDS = 600.0  # a long recording's first ten minutes are searched
FRAME_SECONDS = 0.02
STEP_SECONDS = 0.25  # windows start every quarter second
SILENCE_FLOOR_DB = -50.0  # a frame quieter than this (dBFS) is silent
SILENCE_BELOW_LOUD_DB = 35.0  # ... as is one this far below the recording's loud frames
VOICED_CORRELATION = 0.5  # normalised autocorrelation peak of a voiced frame
PITCH_RANGE_HZ = (60.0, 400.0)
CLIP_LEVEL = 0.98
SUSTAINED_SECONDS = 1.5  # a voiced run longer than this is a held note, not a syllable


@dataclass(frozen=True)
class SpeechRules:
    """What a window of speech must show (fractions are of the window's frames)."""

    min_voiced: float = 0.2
    max_voiced: float = 0.9
    max_silent: float = 0.5
    max_clipped: float = 0.005
    min_loudness_spread_db: float = 3.0  # standard deviation of the sounding frames' loudness
    max_sustained: float = 0.5  # share of voiced frames in runs longer than SUSTAINED_SECONDS


@dataclass
class FrameFeatures:
    """Per 20 ms frame of a recording, all (F,)."""

    loudness_db: np.ndarray  # float64 RMS in dBFS
    silent: np.ndarray  # bool
    voiced: np.ndarray  # bool
    clipped: np.ndarray  # bool
    sustained: np.ndarray  # bool: voiced, in a voiced run longer than SUSTAINED_SECONDS


def cleanest_speech(path: str | Path, sample_rate: int = SAMPLE_RATE,
                    rules: SpeechRules | None = None) -> tuple[np.ndarray, int]:
    """The cleanest 5-30 s of speech in ``path`` (an audio file or a video with sound) as ((S,) float32
    mono in [-1, 1], ``sample_rate``). HeygemError, one line, when the file has no sound or no 5 s of
    usable speech (silence, a tone, noise, music, clipping)."""
    from heygem.speech.audio import decode_audio

    path = Path(path)
    samples = decode_audio(path, sample_rate, max_seconds=ANALYSED_SECONDS)  # (S,) float32
    try:
        start, end = speech_window(samples, sample_rate, rules)
    except HeygemError as error:
        raise HeygemError(f"{path.name}: {error}") from None
    logger.info("voice sample: %.1f-%.1f s of %s", start / sample_rate, end / sample_rate, path.name)
    return samples[start:end].copy(), sample_rate


def speech_window(samples: np.ndarray, sample_rate: int, rules: SpeechRules | None = None) -> tuple[int, int]:
    """(start, end) sample indices of the cleanest 5-30 s of speech in ``samples`` ((S,) float mono);
    HeygemError when there is none."""
    rules = rules or SpeechRules()
    frame = int(round(FRAME_SECONDS * sample_rate))
    seconds = len(samples) / sample_rate
    if seconds < MIN_SECONDS:
        raise HeygemError(f"the sound lasts {seconds:.1f} s; a voice is cloned from {MIN_SECONDS:g}-{MAX_SECONDS:g} s "
                          f"of clear speech of one person: give a longer voice sample")
    features = frame_features(samples, sample_rate)
    count = len(features.loudness_db)
    step = max(1, int(round(STEP_SECONDS / FRAME_SECONDS)))
    shortest = int(round(MIN_SECONDS / FRAME_SECONDS))
    longest = min(count, int(round(MAX_SECONDS / FRAME_SECONDS)))
    lengths = sorted({*range(shortest, longest + 1, step), longest}) if longest >= shortest else []

    def sums(values: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])

    sounding = ~features.silent
    silent, voiced, clipped = sums(features.silent), sums(features.voiced), sums(features.clipped)
    sustained, sounding_count = sums(features.sustained), sums(sounding)
    loud = sums(np.where(sounding, features.loudness_db, 0.0))
    loud_square = sums(np.where(sounding, features.loudness_db ** 2, 0.0))
    best, best_score, seen = None, -np.inf, "no speech"
    for length in lengths:
        starts = np.arange(0, count - length + 1, step)
        ends = starts + length

        def share(table, starts=starts, ends=ends, length=length):
            return (table[ends] - table[starts]) / length

        voiced_share, silent_share, clipped_share = share(voiced), share(silent), share(clipped)
        heard = np.maximum(sounding_count[ends] - sounding_count[starts], 1.0)
        mean = (loud[ends] - loud[starts]) / heard
        spread = np.sqrt(np.maximum((loud_square[ends] - loud_square[starts]) / heard - mean ** 2, 0.0))
        sustained_share = (sustained[ends] - sustained[starts]) / np.maximum(voiced[ends] - voiced[starts], 1.0)
        passes = ((voiced_share >= rules.min_voiced) & (voiced_share <= rules.max_voiced)
                  & (silent_share <= rules.max_silent) & (clipped_share <= rules.max_clipped)
                  & (spread >= rules.min_loudness_spread_db) & (sustained_share <= rules.max_sustained))
        seen = _closest_failure(seen, voiced_share, silent_share, clipped_share, spread, sustained_share, rules)
        if not passes.any():
            continue
        window_seconds = length * FRAME_SECONDS
        # syllables' voicing among the sounding frames: noise lowers it, held notes do not count
        syllables = voiced_share * (1.0 - sustained_share)
        voiced_when_heard = syllables / np.maximum(1.0 - silent_share, 1e-6)
        score = (0.5 * min(window_seconds, PREFERRED_SECONDS) / PREFERRED_SECONDS + voiced_when_heard
                 - silent_share - 20.0 * clipped_share)
        score = np.where(passes, score, -np.inf)
        index = int(np.argmax(score))
        if score[index] > best_score:
            best_score, best = score[index], (int(starts[index]), int(ends[index]))
    if best is None:
        raise HeygemError(f"no {MIN_SECONDS:g}-{MAX_SECONDS:g} s of clear speech found ({seen}); give a voice "
                          f"sample of one person speaking without music or noise")
    return best[0] * frame, min(len(samples), best[1] * frame)


def _closest_failure(seen: str, voiced, silent, clipped, spread, sustained, rules: SpeechRules) -> str:
    """Why the windows fail, in words (the first reason that holds for every window of this length)."""
    if seen != "no speech":
        return seen
    if (silent > rules.max_silent).all():
        return "it is mostly silence"
    if (clipped > rules.max_clipped).all():
        return "it is clipped (distorted)"
    if (voiced < rules.min_voiced).all():
        return "it sounds like noise, not a voice"
    if (voiced > rules.max_voiced).all() or (spread < rules.min_loudness_spread_db).all():
        return "it sounds like a steady tone, not speech"
    if (sustained > rules.max_sustained).all():
        return "it sounds like music or humming"
    return seen


def frame_features(samples: np.ndarray, sample_rate: int) -> FrameFeatures:
    """Loudness, silence, voicing, clipping and sustained voicing per 20 ms frame of ``samples``."""
    samples = np.asarray(samples, np.float32).reshape(-1)
    frame = int(round(FRAME_SECONDS * sample_rate))
    count = len(samples) // frame
    frames = samples[: count * frame].reshape(count, frame)  # (F, frame)
    loudness_db = 10.0 * np.log10(np.mean(np.square(frames, dtype=np.float64), axis=1) + 1e-12)
    loud_level = np.percentile(loudness_db, 95) if count else SILENCE_FLOOR_DB
    silent = loudness_db < max(SILENCE_FLOOR_DB, loud_level - SILENCE_BELOW_LOUD_DB)
    voiced = _voiced(samples, frame, count, sample_rate) & ~silent
    pinned = np.abs(samples[: count * frame]) >= CLIP_LEVEL
    runs = np.convolve(pinned.astype(np.int8), np.ones(3, np.int8), mode="same") >= 3  # 3 in a row at full scale
    clipped = runs.reshape(count, frame).any(axis=1)
    return FrameFeatures(loudness_db=loudness_db, silent=silent, voiced=voiced, clipped=clipped,
                         sustained=_long_runs(voiced, int(round(SUSTAINED_SECONDS / FRAME_SECONDS))))


def _voiced(samples: np.ndarray, frame: int, count: int, sample_rate: int, chunk: int = 1024) -> np.ndarray:
    """(F,) bool: the 40 ms around each frame has a normalised autocorrelation peak of at least
    VOICED_CORRELATION at a lag of one pitch period in PITCH_RANGE_HZ."""
    window = 2 * frame
    padded = np.concatenate([samples[: count * frame], np.zeros(frame, np.float32)])
    size = 1 << int(np.ceil(np.log2(2 * window)))
    low_lag = int(sample_rate / PITCH_RANGE_HZ[1])
    high_lag = min(window - 2, int(sample_rate / PITCH_RANGE_HZ[0]))
    taper = np.hanning(window).astype(np.float32)
    # the taper's own autocorrelation, to undo its fall with the lag
    taper_spectrum = np.fft.rfft(taper, size)
    taper_correlation = np.fft.irfft(np.abs(taper_spectrum) ** 2, size)[: high_lag + 2]
    taper_correlation = taper_correlation / taper_correlation[0]
    voiced = np.zeros(count, bool)
    for first in range(0, count, chunk):
        last = min(count, first + chunk)
        starts = np.arange(first, last) * frame
        pieces = padded[starts[:, None] + np.arange(window)[None, :]]  # (n, window)
        pieces = (pieces - pieces.mean(axis=1, keepdims=True)) * taper
        spectrum = np.fft.rfft(pieces, size, axis=1)
        correlation = np.fft.irfft(np.abs(spectrum) ** 2, size, axis=1)[:, : high_lag + 2]  # (n, lags)
        energy = np.maximum(correlation[:, :1], 1e-12)
        normalised = correlation / energy / np.maximum(taper_correlation, 0.05)
        in_range = normalised[:, low_lag - 1:high_lag + 2]  # one lag either side, to see a peak's flanks
        peak = np.argmax(in_range[:, 1:-1], axis=1) + 1  # (n,)
        rows = np.arange(len(peak))
        height = in_range[rows, peak]
        is_peak = (height > in_range[rows, peak - 1]) & (height >= in_range[rows, peak + 1])
        voiced[first:last] = is_peak & (height >= VOICED_CORRELATION)  # a falling slope (rumble) is no pitch
    return voiced


def _long_runs(mask: np.ndarray, longer_than: int) -> np.ndarray:
    """(F,) bool: the frames of ``mask`` that lie in a run of True longer than ``longer_than`` frames."""
    result = np.zeros_like(mask)
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    for start, end in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):
        if end - start > longer_than:
            result[start:end] = True
    return result
