"""Audio -> mouth shape for the landmark engine.

Each output frame gets a Wav2Lip mel window (80 bands x 16 columns, 80 columns
per second, values in [-4, 4] where -4 is silence). The first few columns are
the sound at that frame's time; a little look-ahead is natural, since lips move
slightly before the sound they make. From them we read:

- loudness of the voiced band (150-3000 Hz): how far the mouth opens;
- the first-formant region's centroid (200-1000 Hz): "ah" opens wider than "ee"/"oo";
- the second-formant region's centroid (700-3000 Hz): "ee" spreads the corners, "oo" rounds them;
- the high band (3.5-7.6 kHz): fricatives (s, sh, f) part the lips a little;
- nasal murmur (low band strong, mid band weak, quiet) and a near-silence just before a
  sharp onset: the lips are closed (m, b, p);
- a pause (no voice in the whole window for a while): the speech lets go of the mouth, and the
  face shows its own mouth as filmed (a presenter's resting smile stays a smile).

A :class:`MouthShapeTracker` keeps the state between batches: a slowly decaying
reference level (so quiet and loud recordings both animate) and attack/release
smoothing, so the mouth neither flickers nor lags. The same audio fed in the same
order always gives the same shapes, however it is split into batches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from heygem.speech import audio
from heygem.speech.pauses import HANDOVER_SECONDS, PAUSE_SECONDS  # the pause rule every engine follows

# Weights of the window's first columns (12.5 ms each): the frame's own sound plus ~60 ms look-ahead.
COLUMN_WEIGHTS = np.array([0.5, 1.0, 1.0, 1.0, 0.7, 0.4], np.float32)
PLOSIVE_NOW_COLUMNS = slice(0, 2)  # the sound at the frame's time
PLOSIVE_AHEAD_COLUMNS = slice(2, 8)  # where a burst after a lip closure would be heard

REFERENCE_START_DB = -42.0  # typical vowel level of speech at a normal recording level
REFERENCE_FLOOR_DB = -50.0  # the reference never sinks below this, so noise never looks like speech
REFERENCE_DECAY_DB_PER_SECOND = 3.0

ATTACK_SECONDS = 0.025  # opening follows the sound quickly
RELEASE_SECONDS = 0.05  # closing a little slower
CLOSURE_RELEASE_SECONDS = 0.012  # m/b/p close the lips at once
WIDTH_SECONDS = 0.06  # spreading and rounding change smoothly
DEAD_ZONE = 0.02  # openness below this counts as closed, so silence leaves the face untouched
HEARD_DB = -30.0  # a window column this close to the reference level (voiced or high band) is speech


@dataclass(frozen=True)
class MouthShapes:
    """Mouth parameters for a run of frames."""

    openness: np.ndarray  # (N,) float32, 0 closed .. 1 wide open ("ah" spoken loudly)
    width: np.ndarray  # (N,) float32, -1 rounded ("oo") .. 0 neutral .. +1 spread ("ee")
    # (N,) float32, 1 while the speech moves the mouth .. 0 in a pause, where the face keeps its own mouth
    speaking: np.ndarray


try:  # np.clip's own ufunc, without the Python wrapper around it (~15 us a call; most arrays here are small)
    from numpy._core.umath import clip
except ImportError:  # pragma: no cover - a numpy that moved it: the wrapper gives the same values
    clip = np.clip


def smoothstep(edge0: float, edge1: float, x: np.ndarray) -> np.ndarray:
    """0 below edge0, 1 above edge1, a smooth S-curve in between (edge0 > edge1 flips it)."""
    t = clip((np.asarray(x, np.float32) - edge0) / (edge1 - edge0), 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def mel_band_centres_hz() -> np.ndarray:
    """(80,) float64 centre frequency of each of heygem.speech.audio's mel bands."""
    return audio.mel_frequencies(audio.N_MELS + 2)[1:-1]


@dataclass(frozen=True)
class MelBands:
    """Which of the 80 mel bands make up each region the cues read, as (80,) bool masks."""

    centres_hz: np.ndarray  # (80,) float64
    voiced: np.ndarray  # 150-3000 Hz
    low: np.ndarray  # 80-400 Hz
    first_formant: np.ndarray  # 200-1000 Hz
    second_formant: np.ndarray  # 700-3000 Hz
    mid: np.ndarray  # 1000-3000 Hz
    high: np.ndarray  # 3500-7600 Hz


@functools.lru_cache(maxsize=1)
def mel_bands() -> MelBands:
    """The band masks, computed on first use (the landmark engine's rendering processes never need them)."""
    centres = mel_band_centres_hz()

    def band(low_hz: float, high_hz: float) -> np.ndarray:
        return (centres >= low_hz) & (centres < high_hz)

    return MelBands(centres_hz=centres, voiced=band(150, 3000), low=band(80, 400), first_formant=band(200, 1000),
                    second_formant=band(700, 3000), mid=band(1000, 3000), high=band(3500, 7600))


def _power_db(power: np.ndarray) -> np.ndarray:
    return 10.0 * np.log10(power + 1e-12)


def _centroid_hz(power: np.ndarray, band: np.ndarray) -> np.ndarray:
    """(N,) spectral centroid in Hz of ``power`` (N, 80) within ``band``; 0 where silent."""
    band_power = power[:, band]  # (N, B)
    total = band_power.sum(axis=1)
    centroid = (band_power * mel_bands().centres_hz[band]).sum(axis=1) / np.maximum(total, 1e-12)
    return np.where(total > 1e-10, centroid, 0.0)


@dataclass(frozen=True)
class AudioCues:
    """What one mel window says about the mouth, before smoothing over time."""

    voiced_db: np.ndarray  # (N,) level of the voiced band, dB (0 dB = Wav2Lip's clipping level)
    high_db: np.ndarray  # (N,) level of the fricative band
    first_formant_hz: np.ndarray  # (N,) centroid of the 200-1000 Hz region
    second_formant_hz: np.ndarray  # (N,) centroid of the 700-3000 Hz region
    nasal_db: np.ndarray  # (N,) low band minus mid band: high for m/n murmur (and "oo")
    onset_db: np.ndarray  # (N,) how much louder the next ~70 ms is than now: high before a plosive burst
    now_db: np.ndarray  # (N,) voiced level of the window's first two columns
    heard_now_db: np.ndarray  # (N,) the louder of the voiced and high bands in the window's first two columns
    heard_ahead_db: np.ndarray  # (N,) ... in the loudest column of the whole window
    window_seconds: float  # how far the window reaches


def audio_cues(mel_windows: np.ndarray) -> AudioCues:
    """Read the per-frame cues from ``mel_windows`` (N, 80, 16) Wav2Lip-normalised mels."""
    bands = mel_bands()
    decibels = (mel_windows.astype(np.float32) + 4.0) * 12.5 - 100.0  # (N, 80, 16) back to dB
    power = np.power(10.0, decibels / 10.0)  # (N, 80, 16)
    columns = min(power.shape[2], len(COLUMN_WEIGHTS))
    weights = COLUMN_WEIGHTS[:columns] / COLUMN_WEIGHTS[:columns].sum()
    frame_power = (power[:, :, :columns] * weights).sum(axis=2)  # (N, 80)

    voiced_per_column = _power_db(power[:, bands.voiced, :].mean(axis=1))  # (N, 16)
    high_per_column = _power_db(power[:, bands.high, :].mean(axis=1))  # (N, 16)
    now_db = _power_db(power[:, bands.voiced, PLOSIVE_NOW_COLUMNS].mean(axis=(1, 2)))
    ahead = voiced_per_column[:, PLOSIVE_AHEAD_COLUMNS]
    ahead_db = ahead.max(axis=1) if ahead.shape[1] else now_db
    return AudioCues(
        voiced_db=_power_db(frame_power[:, bands.voiced].mean(axis=1)),
        high_db=_power_db(frame_power[:, bands.high].mean(axis=1)),
        first_formant_hz=_centroid_hz(frame_power, bands.first_formant),
        second_formant_hz=_centroid_hz(frame_power, bands.second_formant),
        nasal_db=_power_db(frame_power[:, bands.low].mean(axis=1)) - _power_db(frame_power[:, bands.mid].mean(axis=1)),
        onset_db=ahead_db - now_db,
        now_db=now_db,
        heard_now_db=np.maximum(now_db, _power_db(power[:, bands.high, PLOSIVE_NOW_COLUMNS].mean(axis=(1, 2)))),
        heard_ahead_db=np.maximum(voiced_per_column, high_per_column).max(axis=1, initial=-120.0),
        window_seconds=power.shape[2] / audio.MEL_FRAMES_PER_SECOND,
    )


class MouthShapeTracker:
    """Turns mel windows into smoothed mouth shapes, keeping state between batches.

    The speech holds the mouth while it is heard and lets go in its pauses: once a silence is
    known to last PAUSE_SECONDS (the silence so far and the whole window after it), ``speaking``
    falls to 0 over HANDOVER_SECONDS; it rises again over as long from the frame whose own
    sound is speech, as the mouth starts to open for it. Before the first words the face is at
    rest (``speaking`` 0).
    """

    def __init__(self, fps: float):
        self.frame_seconds = 1.0 / float(fps)
        self.reference_db = REFERENCE_START_DB
        self.openness = 0.0
        self.width = 0.0
        self.speaking = 0.0
        self.holds = False  # whether the speech holds the mouth (``speaking`` moves toward 1, else 0)
        self.quiet_seconds = float("inf")  # since the last frame whose own sound was speech

    def _follow(self, current: float, target: float, seconds: float) -> float:
        return current + (target - current) * (1.0 - float(np.exp(-self.frame_seconds / seconds)))

    def update(self, mel_windows: np.ndarray) -> MouthShapes:
        """Shapes for the next ``len(mel_windows)`` frames, in order."""
        cues = audio_cues(mel_windows)
        count = len(mel_windows)
        openness = np.zeros(count, np.float32)
        width = np.zeros(count, np.float32)
        speaking = np.zeros(count, np.float32)
        handover_step = self.frame_seconds / HANDOVER_SECONDS
        decay_db = REFERENCE_DECAY_DB_PER_SECOND * self.frame_seconds
        for index in range(count):
            voiced_db = float(cues.voiced_db[index])
            self.reference_db = max(voiced_db, self.reference_db - decay_db, REFERENCE_FLOOR_DB)
            relative_db = voiced_db - self.reference_db  # <= 0

            loudness = smoothstep(-26.0, -4.0, relative_db)
            vowel_height = 0.45 + 0.55 * smoothstep(300.0, 700.0, cues.first_formant_hz[index])
            fricative = 0.16 * smoothstep(-32.0, -12.0, cues.high_db[index] - self.reference_db)
            target_openness = max(float(loudness * vowel_height), float(fricative))

            nasal = smoothstep(-5.0, 1.0, cues.nasal_db[index]) * smoothstep(-6.0, -14.0, relative_db)
            plosive = smoothstep(10.0, 20.0, cues.onset_db[index]) * smoothstep(
                -14.0, -22.0, cues.now_db[index] - self.reference_db)
            closure = float(max(nasal, plosive))
            target_openness *= 1.0 - closure

            if target_openness > self.openness:
                time_constant = ATTACK_SECONDS
            else:
                time_constant = CLOSURE_RELEASE_SECONDS if closure > 0.5 else RELEASE_SECONDS
            self.openness = self._follow(self.openness, target_openness, time_constant)

            spread = float(np.clip((cues.second_formant_hz[index] - 1500.0) / 700.0, -1.0, 1.0))
            self.width = self._follow(self.width, spread * float(loudness), WIDTH_SECONDS)

            heard_now = float(cues.heard_now_db[index]) - self.reference_db > HEARD_DB
            heard_ahead = float(cues.heard_ahead_db[index]) - self.reference_db > HEARD_DB
            self.quiet_seconds = 0.0 if heard_now else self.quiet_seconds + self.frame_seconds
            if heard_now:
                self.holds = True
            elif not heard_ahead and self.quiet_seconds + cues.window_seconds >= PAUSE_SECONDS:
                self.holds = False
            if self.holds:
                self.speaking = min(1.0, self.speaking + handover_step)
            else:
                self.speaking = max(0.0, self.speaking - handover_step)

            openness[index] = max(0.0, self.openness - DEAD_ZONE) / (1.0 - DEAD_ZONE)
            width[index] = self.width
            speaking[index] = self.speaking
        return MouthShapes(openness=openness, width=width, speaking=speaking)
