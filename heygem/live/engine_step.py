"""The engine a live session runs, behind one small interface: one frame and the sound it reads in, the frame
with its mouth out.

A step states what sound it reads: a mel window of ``mel_columns`` columns (cut by the session, as a job
cuts it), or, with ``mel_columns`` 0, the timeline's samples from ``sound_before`` seconds before the frame to
``lookahead`` seconds after it (heygem.live.audio_in.SoundWindow), for an engine that computes its own
features; ``lookahead`` is the sound after a frame's time it waits for, which the session's delay follows.
A step drives an engine's own public methods and the same blend a job uses, a frame at a time; adding an
engine to live mode is one class here and one line in :data:`LIVE_STEPS`. The landmark engine draws on the
CPU; Wav2Lip and MuseTalk run live where a GPU is (on the CPU their networks draw fewer than 25 faces a
second, so ``--live-engine auto`` keeps the landmark engine there, and ``--live-engine NAME`` forces one).
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
from heygem.live.audio_in import SAMPLE_RATE, SoundWindow, lookahead_seconds
from heygem.media.frames import paste_i420_window, write_region_i420, yuv420_to_bgr
from heygem.render.blend import blend_patch
from heygem.runtime.device import gpu_expected
from heygem.speech.audio import MEL_WINDOW
from heygem.types import EngineBatch, Face

logger = logging.getLogger("heygem")


class LiveEngineStep(Protocol):
    """One session's engine, fed every frame in order (it may keep state from frame to frame)."""

    name: str
    mel_columns: int  # columns of the mel window each frame reads; 0: it reads the samples (a SoundWindow)
    sound_before: float  # with mel_columns 0: seconds of samples before the frame's time it reads
    lookahead: float  # seconds of sound after a frame's time it waits for (the session's delay, less packets')

    def render(self, frame_i420: np.ndarray, face: Face | None, sound: np.ndarray | SoundWindow) -> np.ndarray:
        """The frame ((H * 3/2, W) uint8 I420, not changed) with the mouth of ``sound``: its mel window
        ((80, mel_columns) float32, Wav2Lip-normalised), or with mel_columns 0 the samples around it; a new
        array, or the frame itself where nothing is drawn."""
        ...

    def close(self) -> None: ...


class LandmarkStep:
    """The landmark engine, drawing in the session's thread: its mouth shapes from the first eight mel
    columns (the 0.1 s after the frame: the shapes read six, the lip closures before a burst eight), so a
    frame waits 0.11 s for its sound instead of a whole window's 0.21 s; only the pause that hands the
    mouth back to the face is noticed 0.1 s later than in a job."""

    name = "landmark"
    mel_columns = 8
    sound_before = 0.0
    lookahead = lookahead_seconds(mel_columns)  # 0.1125 s

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
    sound_before = 0.0
    lookahead = lookahead_seconds(mel_columns)  # 0.2125 s

    def __init__(self, config: Config, fps: float, weights: Path | None = None):
        from heygem.engines.wav2lip.engine import Wav2LipEngine

        if weights is None:
            raise HeygemError(ENGINES["wav2lip"].missing_weights())
        # one face a pass: the generator's fixed batch (and its CUDA graph) is one frame, not a job's 64
        options = dataclasses.replace(config.engine, batch_size=1)
        stat = Path(weights).stat()
        self.key = ("wav2lip", str(Path(weights).resolve()), stat.st_mtime_ns, stat.st_size, options.device,
                    options.precision, options.cuda_graph, options.cudnn, options.deterministic)
        self.engine = _take_idle(self.key)
        if self.engine is None:  # loading, moving to the GPU and capturing the graph: a second or two
            self.engine = Wav2LipEngine(weights, options)
        self.blend = config.blend
        self.fps = fps

    def render(self, frame_i420: np.ndarray, face: Face | None, mel_window: np.ndarray) -> np.ndarray:
        return mouth_into_frame(frame_i420, face, self.blend, lambda frame_bgr: self.engine.generate(EngineBatch(
            frame_indices=np.zeros(1, np.int64), frames_bgr=frame_bgr[None], faces=[face],
            mel_windows=mel_window[None], fps=self.fps))[0])

    def close(self) -> None:
        """The generator is kept for the next session on the same checkpoint (KEEP_IDLE at most)."""
        engine, self.engine = self.engine, None
        _keep_idle(self.key, engine)


def mouth_into_frame(frame_i420: np.ndarray, face: Face | None, blend, patch_of) -> np.ndarray:
    """The I420 frame with the engine's mouth (``patch_of(frame_bgr)``: its patch, or None where the box lies
    outside the frame) blended in as a job's render stage blends it; only the box's bytes change. The frame as
    it is without a face or a patch."""
    if face is None:
        return frame_i420
    height, width = frame_i420.shape[0] * 2 // 3, frame_i420.shape[1]
    frame_bgr = yuv420_to_bgr(frame_i420, width, height)  # (H, W, 3) uint8
    patch = patch_of(frame_bgr)
    if patch is None:
        return frame_i420
    blend_patch(frame_bgr, patch, blend)
    frame = frame_i420.copy()
    write_region_i420(frame, frame_bgr, patch.box)
    return frame


MUSETALK_SOUND_AFTER = 0.14  # seconds of sound after a frame's time its Whisper window reads (see MuseTalkStep)
MUSETALK_CONTEXT_SECONDS = 8.0  # sound before each pass's first frame, for the encoder's attention (it is free:
# the encoder runs on 30 s whatever it is given; the timeline keeps 10 s)
MUSETALK_FRAMES_PER_FEATURES = 2  # frames whose Whisper windows one encoder pass makes


class MuseTalkStep:
    """MuseTalk on one frame at a time: the engine's own public methods (heygem.engines.musetalk.engine:
    ``audio_features``, then ``patches``: the crop's latents from memory or the avatar cache, the UNet
    and the decoder on a batch of one), blended into the frame as a job's CPU path blends it.

    Its mouths read Whisper's encoder states, not mel windows: the step takes the timeline's samples and
    runs the encoder itself, once every MUSETALK_FRAMES_PER_FEATURES frames, on the sound from
    MUSETALK_CONTEXT_SECONDS (whole frames) before the first of them to MUSETALK_SOUND_AFTER after the last (one
    30 s encoder pass whatever its length: Whisper pads to 30 s), and keeps the windows of those frames.
    A frame's window is 10 rows of 20 ms, 2 frames each side of its own 40 ms at 25 fps: it ends 0.12 s
    after the frame's time, and Whisper's two 3-wide convolutions over 25 ms STFT windows reach 12.5 ms
    beyond, 0.1325 s, rounded up to a whole row: 0.14 s. The encoder's attention spans its whole input, so
    the states differ a little from a job's, which sees the whole speech around each frame. A frame thus
    waits 0.14 s for its own sound and one frame's 0.04 s for the next one's: 0.18 s."""

    name = "musetalk"
    mel_columns = 0

    def __init__(self, config: Config, fps: float, weights: Path | None = None):
        from heygem.engines.musetalk.engine import MuseTalkEngine
        from heygem.engines.musetalk.files import find_musetalk_files

        files = find_musetalk_files(weights) if weights is not None else None
        if files is None:
            raise HeygemError(ENGINES["musetalk"].missing_weights())
        # one face a pass: the step's fixed batch (and its CUDA graph) is one frame, not a job's
        options = dataclasses.replace(config.engine, batch_size=1)
        use_cache, feather = config.run.avatar_cache, config.blend.feather
        self.key = ("musetalk", *files.identity, options.device, options.precision, options.cuda_graph,
                    options.cudnn, options.deterministic, options.musetalk_margin, options.musetalk_parsing,
                    options.musetalk_cheek_width, use_cache, feather)
        self.engine = _take_idle(self.key)
        if self.engine is None:  # loading, moving to the GPU, autotuning and capturing the graph
            self.engine = MuseTalkEngine(files, options, use_cache, feather)
            self.engine.wait_until_warm()
        self.blend = config.blend
        self.fps = fps
        self.frame_samples = SAMPLE_RATE / fps  # 640 at 25 fps
        self.sound_before = round(MUSETALK_CONTEXT_SECONDS * fps) / fps  # whole frames: the windows' rows align
        self.lookahead = (MUSETALK_FRAMES_PER_FEATURES - 1) / fps + MUSETALK_SOUND_AFTER
        self.first_sample: int | None = None  # the timeline's sample at the first kept window's frame
        self.windows = None  # (MUSETALK_FRAMES_PER_FEATURES, 50, 384) float32: the kept frames' windows

    def audio_window(self, sound: SoundWindow):
        """(1, 50, 384) float32: the Whisper window of the frame at ``sound.frame_sample``, from the kept
        windows, or from a new encoder pass over ``sound`` for it and the frames after it."""
        if self.first_sample is not None:
            ahead = (sound.frame_sample - self.first_sample) / self.frame_samples
            index = int(round(ahead))
            if 0 <= index < len(self.windows) and abs(ahead - index) < 0.25:
                return self.windows[index:index + 1]
        context = int(round(sound.before / self.frame_samples))  # whole frames before the frame
        windows = self.engine.audio_features(sound.samples, self.fps, context + MUSETALK_FRAMES_PER_FEATURES)
        self.windows = windows[context:]  # (MUSETALK_FRAMES_PER_FEATURES, 50, 384)
        self.first_sample = sound.frame_sample
        return self.windows[:1]

    def render(self, frame_i420: np.ndarray, face: Face | None, sound: SoundWindow) -> np.ndarray:
        import torch

        def patch_of(frame_bgr: np.ndarray):
            with torch.inference_mode():
                return self.engine.patches(frame_bgr[None], [face], self.audio_window(sound))[0]

        return mouth_into_frame(frame_i420, face, self.blend, patch_of)

    def close(self) -> None:
        """The networks are kept for the next session on the same files (KEEP_IDLE at most)."""
        engine, self.engine = self.engine, None
        _keep_idle(self.key, engine)


KEEP_IDLE = 2  # engines (Wav2Lip's generator, MuseTalk's networks) kept loaded for the next sessions, per key
_IDLE_ENGINES: dict[tuple, list] = {}  # (engine, its files and their stamps, options) -> engines no session uses
_IDLE_LOCK = threading.Lock()


def _take_idle(key: tuple):
    """An engine a session ended with, loaded on the same files and options; None when there is none."""
    with _IDLE_LOCK:
        idle = _IDLE_ENGINES.get(key)
        return idle.pop() if idle else None


def _keep_idle(key: tuple, engine) -> None:
    if engine is None:
        return
    with _IDLE_LOCK:
        idle = _IDLE_ENGINES.setdefault(key, [])
        if len(idle) < KEEP_IDLE:
            idle.append(engine)


LIVE_STEPS = {"landmark": LandmarkStep, "wav2lip": Wav2LipStep, "musetalk": MuseTalkStep}
LIVE_ENGINES = ("auto", *LIVE_STEPS)  # what --live-engine takes
NEEDS_GPU = {"wav2lip", "musetalk"}  # steps that draw fewer than 25 frames a second on a CPU


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
