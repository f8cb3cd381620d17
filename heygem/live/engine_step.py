"""The engine a live session runs, behind one small interface: one frame and its mel window in, the frame
with its mouth out.

A step drives an engine's own public methods and the same blend a job uses, a frame at a time; adding an
engine to live mode is one class here and one line in :data:`LIVE_STEPS`. The landmark engine draws on the
CPU; Wav2Lip runs live where a GPU is (on the CPU its generator draws fewer than 25 faces a second, so
``--live-engine auto`` keeps the landmark engine there, and ``--live-engine wav2lip`` forces it). MuseTalk
has no step yet: a server whose jobs run it says why its sessions run another engine.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from heygem.config import Config
from heygem.engines import ENGINES, choose_engine
from heygem.errors import HeygemError
from heygem.media.frames import paste_i420_window, write_region_i420, yuv420_to_bgr
from heygem.render.blend import blend_patch
from heygem.runtime.device import gpu_expected
from heygem.speech.audio import MEL_WINDOW
from heygem.types import EngineBatch, Face

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

    def __init__(self, config: Config, fps: float, weights: Path | None = None):
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


class Wav2LipStep:
    """The Wav2Lip generator on one frame at a time (heygem.engines.wav2lip.engine.Wav2LipEngine.generate on a
    batch of one: the 96x96 mouth scaled to the face box), blended into the frame as a job's CPU path blends
    it (heygem.render.blend), without a restorer. Its mel window is a job's: the 16 columns (0.2 s) starting
    at the frame's time, which the generator was trained on, so a frame waits 0.21 s for its sound. A window
    centred on the frame would wait 0.1 s less but show each mouth 0.1 s after its sound, which viewers
    notice (sound ahead of the picture shows from ~45 ms)."""

    name = "wav2lip"
    mel_columns = MEL_WINDOW  # 16

    def __init__(self, config: Config, fps: float, weights: Path | None = None):
        from heygem.engines.wav2lip.engine import Wav2LipEngine

        if weights is None:
            raise HeygemError(ENGINES["wav2lip"].missing_weights())
        # one face a pass: the generator's fixed batch (and its CUDA graph) is one frame, not a job's 64
        options = dataclasses.replace(config.engine, batch_size=1)
        stat = Path(weights).stat()
        self.key = (str(Path(weights).resolve()), stat.st_mtime_ns, stat.st_size, options.device, options.precision,
                    options.cuda_graph, options.cudnn, options.deterministic)
        with _IDLE_LOCK:
            idle = _IDLE_WAV2LIP.get(self.key)
            self.engine = idle.pop() if idle else None
        if self.engine is None:  # loading, moving to the GPU and capturing the graph: a second or two
            self.engine = Wav2LipEngine(weights, options)
        self.blend = config.blend
        self.fps = fps

    def render(self, frame_i420: np.ndarray, face: Face | None, mel_window: np.ndarray) -> np.ndarray:
        if face is None:
            return frame_i420
        height, width = frame_i420.shape[0] * 2 // 3, frame_i420.shape[1]
        frame_bgr = yuv420_to_bgr(frame_i420, width, height)  # (H, W, 3) uint8
        patch = self.engine.generate(EngineBatch(
            frame_indices=np.zeros(1, np.int64), frames_bgr=frame_bgr[None], faces=[face],
            mel_windows=mel_window[None], fps=self.fps))[0]
        if patch is None:  # the box lies outside the frame
            return frame_i420
        blend_patch(frame_bgr, patch, self.blend)
        frame = frame_i420.copy()
        write_region_i420(frame, frame_bgr, patch.box)  # only the box's bytes change
        return frame

    def close(self) -> None:
        """The generator is kept for the next session on the same checkpoint (KEEP_IDLE at most)."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        with _IDLE_LOCK:
            idle = _IDLE_WAV2LIP.setdefault(self.key, [])
            if len(idle) < KEEP_IDLE:
                idle.append(engine)


KEEP_IDLE = 2  # Wav2Lip generators kept loaded for the next sessions, per checkpoint and options
_IDLE_WAV2LIP: dict[tuple, list] = {}  # (checkpoint, its stamp, options) -> generators no session uses now
_IDLE_LOCK = threading.Lock()

LIVE_STEPS = {"landmark": LandmarkStep, "wav2lip": Wav2LipStep}
LIVE_ENGINES = ("auto", *LIVE_STEPS)  # what --live-engine takes
NEEDS_GPU = {"wav2lip"}  # steps that draw fewer than 25 frames a second on a CPU


@dataclass(frozen=True)
class LiveEngineChoice:
    name: str
    reason: str
    weights: Path | None = None


def choose_live_engine(config: Config, wanted: str = "auto") -> LiveEngineChoice:
    """The engine a session runs and why. ``wanted`` (--live-engine): an engine's name runs that engine (its
    weights must be there), on a GPU or not; auto runs the one a job would run (--engine, or auto's choice)
    when it has a live step and, for an engine that needs one, a GPU is there; else the landmark engine,
    saying why. HeygemError for an engine that cannot run."""
    if wanted not in LIVE_ENGINES:
        raise HeygemError(f"--live-engine must be one of {', '.join(LIVE_ENGINES)}, not {wanted!r}")
    if wanted != "auto":
        choice = choose_engine(dataclasses.replace(config.engine, name=wanted))
        on_cpu = wanted in NEEDS_GPU and not _gpu_for(config)
        return LiveEngineChoice(wanted, "chosen with --live-engine" + (
            " (on the CPU: fewer than 25 frames a second)" if on_cpu else ""), choice.weights)
    choice = choose_engine(config.engine)
    if choice.name not in LIVE_STEPS:
        return LiveEngineChoice("landmark", f"{choice.name} ({choice.reason}) has no live step yet: the landmark "
                                            f"engine runs live, on the CPU")
    if choice.name in NEEDS_GPU and not _gpu_for(config):
        return LiveEngineChoice("landmark", f"{choice.name} ({choice.reason}) runs live on a GPU only, and there "
                                            f"is none: the landmark engine runs live, on the CPU "
                                            f"(--live-engine {choice.name} forces it)")
    return LiveEngineChoice(choice.name, choice.reason, choice.weights)


def _gpu_for(config: Config) -> bool:
    return config.engine.device != "cpu" and gpu_expected()


def start_step(choice: LiveEngineChoice, config: Config, fps: float) -> LiveEngineStep:
    return LIVE_STEPS[choice.name](config, fps, choice.weights)
