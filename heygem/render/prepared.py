"""What the render stages wait for: the networks and audio features loaded in the background while
the first frames are decoded and tracked (step 3), handed over when the first batch arrives.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from heygem.render.restore import Restoration
from heygem.runtime.flow import StageClock
from heygem.speech import audio


class Prepared:
    """What the background threads prepare while the first frames are decoded and tracked: the
    mel spectrogram, the loaded engine and the restorer (with its network for gfpgan). The render
    stages ask for them when their first batch arrives, so loading the networks overlaps with
    decoding and face tracking."""

    def __init__(self, mel_future: Future | None, engine_future: Future, frame_count: int, fps: float,
                 clock: StageClock, restoration_future: Future | None = None, features_future: Future | None = None,
                 source_key: str | None = None):
        self._mel_future = mel_future  # None for an engine that reads no mel windows
        # the face video's avatar cache key (its content, the face options, size and rate): a source frame
        # number of it names the same pixels in every job; None for a photo or with the avatar cache off
        self.source_key = source_key
        self._features_future = features_future  # the engine's own audio features (EngineKind.audio_features)
        self._engine_future = engine_future
        self._restoration_future = restoration_future  # None: no restoration
        self._frame_count = frame_count
        self.fps = fps
        self._clock = clock
        self._lock = threading.Lock()
        self._mel = self._engine = self._window_starts = self._restoration = None
        self._features_seconds = None

    def _resolve(self) -> None:
        with self._lock:
            if self._engine is None:
                mel, mel_seconds, mel_started = (_timed(self._mel_future) if self._mel_future is not None
                                                 else (None, 0.0, None))
                engine, engine_seconds, engine_started = _timed(self._engine_future)
                restoration = Restoration("none", 0.0)
                if self._restoration_future is not None:
                    restoration, restorer_seconds, restorer_started = _timed(self._restoration_future)
                    if restoration.network is not None:
                        self._clock.add("load_restorer", restorer_seconds, started=restorer_started)
                if self._mel_future is not None:
                    self._clock.add("audio", mel_seconds, started=mel_started)
                self._clock.add("load_engine", engine_seconds, started=engine_started)
                if mel is not None:
                    self._window_starts = audio.mel_window_starts(self._frame_count, self.fps, mel.shape[1])
                self._mel, self._engine, self._restoration = mel, engine, restoration

    @property
    def engine(self):
        self._resolve()
        return self._engine

    @property
    def restoration(self) -> Restoration:
        self._resolve()
        return self._restoration

    @property
    def engine_audio(self):
        """The engine's own audio features for every output frame (made once it had loaded), or None."""
        self._resolve()
        if self._features_future is None:
            return None
        features, seconds, started = _timed(self._features_future)
        with self._lock:
            if self._features_seconds is None:
                self._features_seconds = seconds
                self._clock.add("audio", seconds, started=started)
        return features

    def mel_windows(self, output_indices: np.ndarray) -> np.ndarray:
        """(N, 80, 16) float32 mel windows of these output frames."""
        self._resolve()
        return audio.mel_windows(self._mel, self._window_starts[output_indices])


def _timed(future: Future) -> tuple:
    """A background call's (result, seconds, when it started as perf_counter() or None where not known)."""
    result, seconds, *started = future.result()
    return result, seconds, started[0] if started else None
