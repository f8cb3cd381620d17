"""A live session's sound: one 16 kHz mono timeline tied to the wall clock, and the features read from it.

Sample ``s`` of the timeline is what sounds ``s / 16000`` seconds after the session's origin. What comes
in live (the microphone's frames, PCM chunks from a voice agent's WebSocket) is placed where it arrives:
a source that falls silent (no packets) leaves silence, and a source whose chunks come early in a burst
writes ahead of the clock, played when their time comes. Typed sentences, spoken with the bundled voice,
are queued from now on, one after another. Several sources sound at once, added.

The engines read the timeline behind the clock (heygem.live.tracks delays everything by the same amount):
a frame's mel window is cut from the samples around its time with the same STFT as a job's
(heygem.speech.audio.melspectrogram), so the mouths are the ones a job would draw; an engine with features
of its own (MuseTalk's Whisper states) is handed the samples around the frame's time instead
(:func:`sound_window`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from heygem.speech import audio

SAMPLE_RATE = audio.SAMPLE_RATE  # 16 kHz, what the engines read
KEEP_SECONDS = 10.0  # the timeline keeps this much sound behind the clock (what the delayed output still reads)
MAX_AHEAD_SECONDS = 120.0  # a source may write this far ahead of the clock; more is dropped
LATE_SECONDS = 0.1  # a live chunk that comes this much after its source's last one starts afresh at the clock
VOICE_RMS = 0.01  # a chunk louder than this (of full scale) is someone speaking: the session is not idle


class AudioTimeline:
    """The session's sound at 16 kHz, float32 mono in [-1, 1], written by several sources, read by time.

    Safe to share between the event loop (writes) and the render thread (reads)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.origin = clock()  # wall time of sample 0
        self.last_voice = self.origin  # wall time of the last voice heard (or the end of speech queued)
        self._samples = np.zeros(0, np.float32)  # (n,) the timeline from sample self._first on
        self._first = 0
        self._next: dict[str, int] = {}  # source -> the sample its next chunk goes to
        self._lock = threading.Lock()

    def now(self) -> int:
        """The sample that sounds now."""
        return int((self.clock() - self.origin) * SAMPLE_RATE)

    def write_live(self, source: str, samples: np.ndarray) -> None:
        """A chunk of ``source`` (the microphone, a WebSocket) that arrived now: it follows the source's last
        chunk, or, when that one is long past (packets lost, the source paused), ends at the clock."""
        with self._lock:
            now = self.now()
            position = self._next.get(source)
            if position is None or position < now - len(samples) - int(LATE_SECONDS * SAMPLE_RATE):
                position = now - len(samples)
            self._add(source, position, samples)

    def queue(self, source: str, samples: np.ndarray) -> float:
        """Sound that plays from now on, after what ``source`` queued before (sentences, one after another);
        returns the seconds until it has been heard."""
        with self._lock:
            position = max(self._next.get(source, 0), self.now())
            self._add(source, position, samples)
            self.last_voice = max(self.last_voice, self.origin + (position + len(samples)) / SAMPLE_RATE)
            return (position + len(samples) - self.now()) / SAMPLE_RATE

    def _add(self, source: str, position: int, samples: np.ndarray) -> None:
        samples = np.asarray(samples, np.float32).reshape(-1)
        now = self.now()
        if position + len(samples) > now + MAX_AHEAD_SECONDS * SAMPLE_RATE:
            return  # a source far ahead of real time: dropped rather than kept without end
        start = max(position, self._first)
        samples = samples[start - position:]
        end = start + len(samples)
        if end > self._first + len(self._samples):
            grown = np.zeros(end - self._first, np.float32)
            grown[: len(self._samples)] = self._samples
            self._samples = grown
        window = self._samples[start - self._first: end - self._first]
        np.clip(window + samples, -1.0, 1.0, out=window)
        self._next[source] = end
        if len(samples) and float(np.sqrt(np.mean(samples ** 2))) > VOICE_RMS:
            self.last_voice = max(self.last_voice, self.clock())
        keep_from = now - int(KEEP_SECONDS * SAMPLE_RATE)
        if keep_from - self._first > SAMPLE_RATE:  # drop what nobody reads any more, a second at a time
            drop = min(keep_from - self._first, len(self._samples))
            self._samples = self._samples[drop:].copy()
            self._first += drop

    def read(self, start: int, count: int) -> np.ndarray:
        """(count,) float32 samples from sample ``start``: silence where nothing was written (or was dropped)."""
        out = np.zeros(count, np.float32)
        with self._lock:
            begin, end = max(start, self._first), min(start + count, self._first + len(self._samples))
            if end > begin:
                out[begin - start: end - start] = self._samples[begin - self._first: end - self._first]
        return out

    def idle_seconds(self) -> float:
        """Seconds since someone last spoke (or queued speech ended)."""
        return max(0.0, self.clock() - self.last_voice)


def lookahead_seconds(columns: int) -> float:
    """How much sound after a frame's time its mel window of ``columns`` columns needs: the columns after
    the first, and half an STFT window after the last (the 25 ms its analysis reaches)."""
    return ((columns - 1) * audio.HOP_LENGTH + audio.N_FFT // 2) / SAMPLE_RATE


def mel_window(timeline: AudioTimeline, seconds: float, columns: int = audio.MEL_WINDOW) -> np.ndarray:
    """(80, columns) float32 Wav2Lip-normalised mel window of the frame at ``seconds`` on the timeline: the
    columns a job would compute from the whole speech (int(seconds * 80) on), from the samples around it.

    The STFT is centred: column c looks at samples c * 200 - 400 .. c * 200 + 400. The slice read starts two
    columns early and ends two after, so that the reflect padding at its ends touches no column kept."""
    first = max(0, int(seconds * audio.MEL_FRAMES_PER_SECOND))
    start = (first - 2) * audio.HOP_LENGTH
    samples = timeline.read(start, (columns + 3) * audio.HOP_LENGTH)  # before sample 0: silence
    mel = audio.melspectrogram(samples)  # (80, columns + 4)
    return mel[:, 2: 2 + columns]


@dataclass(frozen=True)
class SoundWindow:
    """The timeline's samples around one frame's time, for an engine that computes its own features."""

    samples: np.ndarray  # (before + after,) float32 mono at 16 kHz; before sample 0: silence
    frame_sample: int  # the timeline's sample at the frame's time (samples[before] is that sample)
    before: int  # samples before the frame's time


def sound_window(timeline: AudioTimeline, seconds: float, before_seconds: float, after_seconds: float) -> SoundWindow:
    """The samples from ``before_seconds`` before the frame at ``seconds`` on the timeline to ``after_seconds``
    after it."""
    frame_sample = int(round(seconds * SAMPLE_RATE))
    before, after = int(round(before_seconds * SAMPLE_RATE)), int(round(after_seconds * SAMPLE_RATE))
    return SoundWindow(timeline.read(frame_sample - before, before + after), frame_sample, before)


class Resampler:
    """Any audio frame (PyAV, as aiortc gives the microphone's: 48 kHz stereo s16 usually) as 16 kHz mono."""

    def __init__(self):
        import av

        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)

    def to_16k(self, frame) -> np.ndarray:
        """(n,) float32 in [-1, 1]; n may be 0 while the resampler fills."""
        pieces = [piece.to_ndarray().reshape(-1) for piece in self._resampler.resample(frame)]
        if not pieces:
            return np.zeros(0, np.float32)
        return np.concatenate(pieces).astype(np.float32) / 32768.0


def samples_to_16k(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """(n,) float32 mono at ``sample_rate`` (a voice's) as (m,) float32 at 16 kHz, through PyAV's resampler."""
    import av

    samples = np.asarray(samples, np.float32).reshape(1, -1)
    if sample_rate == SAMPLE_RATE:
        return samples[0].copy()
    frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
    frame.sample_rate = sample_rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    pieces = [piece.to_ndarray().reshape(-1) for piece in [*resampler.resample(frame), *resampler.resample(None)]]
    return np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
