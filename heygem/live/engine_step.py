"""The engine a live session runs, behind one small interface: one frame and its mel window in, the frame
with its mouth out.

A step drives an engine's own public methods and the same blend a job uses, a frame at a time; adding an
engine to live mode is one class here and one line in :data:`LIVE_STEPS`. Only the landmark engine has a
step so far: the others' kinds are chosen as a job chooses them, and a session then says why it runs the
landmark engine instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from heygem.config import Config
from heygem.engines import choose_engine
from heygem.media.frames import paste_i420_window
from heygem.types import Face

logger = logging.getLogger("heygem")


class LiveEngineStep(Protocol):
    """One session's engine, fed every frame in order (it may keep state from frame to frame)."""

    name: str
    mel_columns: int  # columns of the mel window each frame reads: the sound after its time it waits for

    def render(self, frame_i420: np.ndarray, face: Face | None, mel_window: np.ndarray) -> np.ndarray:
        """The frame ((H * 3/2, W) uint8 I420, not changed) with the mouth of ``mel_window`` ((80, mel_columns)
        float32, Wav2Lip-normalised): a new array, or the frame itself where nothing is drawn."""
        ...

    def close(self) -> None: ...


class LandmarkStep:
    """The landmark engine, drawing in the session's thread: its mouth shapes from the first eight mel
    columns (the 0.1 s after the frame: the shapes read six, the lip closures before a burst eight), so a
    frame waits 0.11 s for its sound instead of a whole window's 0.21 s; only the pause that hands the
    mouth back to the face is noticed 0.1 s later than in a job."""

    name = "landmark"
    mel_columns = 8

    def __init__(self, config: Config, fps: float):
        from heygem.engines.landmark.engine import LandmarkEngine

        self.engine = LandmarkEngine(config.engine, fps, workers=0)
        self.blend = config.blend

    def render(self, frame_i420: np.ndarray, face: Face | None, mel_window: np.ndarray) -> np.ndarray:
        window = self.engine.generate_i420(frame_i420[None], [face], mel_window[None], self.blend)[0]
        if window is None:  # no face, or the speech's pause: the frame as it is
            return frame_i420
        frame = frame_i420.copy()
        paste_i420_window(frame, window.box, window.planes)
        return frame

    def close(self) -> None:
        self.engine.close()


LIVE_STEPS = {"landmark": LandmarkStep}


@dataclass(frozen=True)
class LiveEngineChoice:
    name: str
    reason: str


def choose_live_engine(config: Config) -> LiveEngineChoice:
    """The engine a session runs and why: the one a job would run (--engine, or auto's choice), when it has
    a live step; else the landmark engine, saying so."""
    choice = choose_engine(config.engine)
    if choice.name in LIVE_STEPS:
        return LiveEngineChoice(choice.name, choice.reason)
    return LiveEngineChoice("landmark", f"{choice.name} ({choice.reason}) has no live step yet: the landmark "
                                        f"engine runs live, on the CPU")


def start_step(choice: LiveEngineChoice, config: Config, fps: float) -> LiveEngineStep:
    return LIVE_STEPS[choice.name](config, fps)
