"""The engine a live session runs, behind one small interface: one frame and the sound it reads in, the frame
with its mouth out.

A step states what sound it reads: a mel window of ``mel_columns`` columns (cut by the session, as a job
cuts it), or, with ``mel_columns`` 0, the timeline's samples from ``sound_before`` seconds before the frame to
``lookahead`` seconds after it (heygem.live.audio_in.SoundWindow), for an engine that computes its own
features; ``lookahead`` is the sound after a frame's time it waits for, which the session's delay follows.
A step drives an engine's own public methods and the same blend a job uses, a frame at a time; adding an
engine to live mode is one class here and one line in :data:`LIVE_STEPS`. The landmark engine draws on the
CPU, in each session's thread; Wav2Lip's and MuseTalk's steps hand their frames to the engine the sessions on
the same files share (heygem.live.batching), whose batch functions here draw every due face in one call.
Wav2Lip and MuseTalk run live where a GPU is (on the CPU their networks draw fewer than 25 faces a second, so
``--live-engine auto`` keeps the landmark engine there, and ``--live-engine NAME`` forces one).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from heygem.config import Config
from heygem.engines import ENGINES, choose_engine
from heygem.engines.musetalk import kept_engine_compile
from heygem.errors import HeygemError
from heygem.live.audio_in import SAMPLE_RATE, SoundWindow, lookahead_seconds
from heygem.live.batching import take_seat
from heygem.media.frames import paste_i420_window, write_region_i420, yuv420_to_bgr
from heygem.render.blend import blend_patch
from heygem.runtime.device import gpu_expected
from heygem.speech.audio import MEL_WINDOW
from heygem.types import Face, FacePatch

logger = logging.getLogger("heygem")


class LiveEngineStep(Protocol):
    """One session's engine, fed every frame in order (it may keep state from frame to frame)."""

    name: str
    mel_columns: int  # columns of the mel window each frame reads; 0: it reads the samples (a SoundWindow)
    sound_before: float  # with mel_columns 0: seconds of samples before the frame's time it reads
    lookahead: float  # seconds of sound after a frame's time it waits for (the session's delay, less packets')
    mouth_lead: float  # seconds by which its mouth shows a sound before that sound's time: the sound goes out sooner

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
    mouth back to the face is noticed 0.1 s later than in a job. Its mouth opens for a sound about a frame
    before the sound's time (measured on the received streams, bench/bench_live.py: 55-60 ms), as lips move
    before the sound they make: the session sends the sound one frame sooner, so the two meet."""

    name = "landmark"
    mel_columns = 8
    sound_before = 0.0
    lookahead = lookahead_seconds(mel_columns)  # 0.1125 s
    mouth_lead = 0.04

    def __init__(self, config: Config, fps: float, weights: Path | None = None, batch_size: int = 1):
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


class SeatedStep:
    """A step whose mouths are drawn by the engine its sessions share (heygem.live.batching): in the session's
    thread, the step's ``patch_of`` cuts what the engine reads from the frame (in BGR), hands it with the face,
    the sound and the session's ``kept`` state to its seat (``self.seat``, a heygem.live.batching.Seat, taken in
    the step's ``__init__``) and makes a patch of the mouth that comes back, which is blended into the frame
    there too. Only the networks run in the shared thread, which every session waits on: each call of it lets
    the interpreter's lock go and waits to take it back, so the per-face host work (crops, resizes, masks) runs
    in the sessions' own threads, side by side."""

    kept = None  # the session's own state the engine's batch function reads and keeps (MuseTalk: WhisperWindows)

    @property
    def engine(self):
        return self.seat.engine

    def render(self, frame_i420: np.ndarray, face: Face | None, sound) -> np.ndarray:
        return mouth_into_frame(frame_i420, face, self.blend, lambda frame_bgr: self.patch_of(frame_bgr, face, sound))

    def patch_of(self, frame_bgr: np.ndarray, face: Face, sound) -> FacePatch | None:
        """The patch of the mouth the shared engine draws for ``face`` in ``frame_bgr`` ((H, W, 3) uint8) and
        ``sound``; None where the face's box lies outside the frame."""
        raise NotImplementedError

    def close(self) -> None:
        """The session leaves the engine; the last to leave keeps it loaded for the next session."""
        self.seat.leave()


class Wav2LipStep(SeatedStep):
    """The Wav2Lip generator, one frame at a time for the session and in one batch with the other sessions' due
    frames (heygem.live.batching: the sessions on one checkpoint share one generator and one thread, whose
    call is Wav2LipEngine.mouths on every due face's 96x96 crop; each session cuts its crop and scales its mouth
    to the box in its own thread, as Wav2LipEngine.generate does for a job), blended into the frame as a job's
    CPU path blends it (heygem.render.blend), without a restorer. Its mel window is a job's:
    the 16 columns (0.2 s) starting at the frame's time, which the generator was trained on, so a frame waits
    0.21 s for its sound. A window centred on the frame would wait 0.1 s less but show each mouth 0.1 s after
    its sound, which viewers notice (sound ahead of the picture shows from ~45 ms)."""

    name = "wav2lip"
    mouth_lead = 0.0  # its window starts at the frame's time, as the generator was trained
    mel_columns = MEL_WINDOW  # 16
    sound_before = 0.0
    lookahead = lookahead_seconds(mel_columns)  # 0.2125 s

    def __init__(self, config: Config, fps: float, weights: Path | None = None, batch_size: int = 1):
        from heygem.engines.wav2lip.engine import Wav2LipEngine

        if weights is None:
            raise HeygemError(ENGINES["wav2lip"].missing_weights())
        # the generator's fixed batch (and its CUDA graph): the sessions drawn in one call, not a job's 64
        options = dataclasses.replace(config.engine, batch_size=batch_size)
        stat = Path(weights).stat()
        key = ("wav2lip", str(Path(weights).resolve()), stat.st_mtime_ns, stat.st_size, options.device,
               options.precision, options.cuda_graph, options.cudnn, options.deterministic, batch_size, fps)

        def load():  # loading, moving to the GPU and capturing the graphs (a second or two), by the first session
            engine = Wav2LipEngine(weights, options)
            engine.warm_up_mouths()
            return engine

        self.seat = take_seat(key, load, lambda engine: functools.partial(wav2lip_mouths, engine))
        self.blend = config.blend

    def patch_of(self, frame_bgr: np.ndarray, face: Face, sound) -> FacePatch | None:
        """The box's 96x96 crop to the shared generator, its mouth scaled back to the box, as ``generate`` does."""
        from heygem.engines.wav2lip.engine import face_crop, mouth_patch

        cropped = face_crop(frame_bgr, face)
        if cropped is None:
            return None
        box, crop = cropped
        return mouth_patch(self.seat.draw(MouthRequest(crop, face, sound)), box, face)  # mouth (96, 96, 3) BGR


@dataclass(frozen=True)
class MouthRequest:
    """One session's due face, as its step hands it to the shared engine (heygem.live.batching)."""

    image_bgr: np.ndarray  # the face's uint8 BGR crop the engine reads: (96, 96, 3) Wav2Lip, (256, 256, 3) MuseTalk
    face: Face
    sound: np.ndarray | SoundWindow  # the step's sound: a mel window (80, columns) or the samples around the frame
    kept: object = None  # the session's own state the engine's batch reads and keeps (MuseTalk: WhisperWindows)


def wav2lip_mouths(engine, requests: list[MouthRequest]) -> list:
    """The (96, 96, 3) uint8 mouth of each request's crop, from one Wav2LipEngine.mouths on all of them; a request
    whose mel window is not (80, 16) or whose crop is not 96x96 gets its error instead, the others their mouths."""
    from heygem.engines.wav2lip.engine import FACE_SIZE

    results: list = [None] * len(requests)
    usable = []  # positions of the requests the generator can read
    for index, request in enumerate(requests):
        if np.shape(request.sound) != (80, MEL_WINDOW):
            results[index] = ValueError(f"a Wav2Lip frame reads an (80, {MEL_WINDOW}) mel window, "
                                        f"not {np.shape(request.sound)}")
        elif np.shape(request.image_bgr) != (FACE_SIZE, FACE_SIZE, 3):
            results[index] = ValueError(f"a Wav2Lip mouth is drawn from a ({FACE_SIZE}, {FACE_SIZE}, 3) crop, "
                                        f"not {np.shape(request.image_bgr)}")
        else:
            usable.append(index)
    if usable:
        mouths = engine.mouths(np.stack([requests[row].image_bgr for row in usable]),
                               np.stack([requests[row].sound for row in usable]))  # (F, 96, 96, 3)
        for row, mouth in zip(usable, mouths):
            results[row] = mouth
    return results


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


class MuseTalkStep(SeatedStep):
    """MuseTalk, one frame at a time for the session and in one batch with the other sessions' due frames
    (heygem.live.batching: the sessions on the same files share one engine and one thread), through the
    engine's own public methods (heygem.engines.musetalk.engine, the steps of ``patches``: each session cuts its
    face's crop and makes its patch in its own thread; the shared thread runs ``mouths``, the crops' latents
    from memory or the avatar cache, the UNet and the decoder on every due face at once), blended into the
    frame as a job's CPU path blends it.

    Its mouths read Whisper's encoder states, not mel windows: the step takes the timeline's samples and
    the shared thread runs the encoder on them, once every MUSETALK_FRAMES_PER_FEATURES frames of a session,
    on the sound from MUSETALK_CONTEXT_SECONDS (whole frames) before the first of them to
    MUSETALK_SOUND_AFTER after the last (one 30 s encoder pass whatever its length: Whisper pads to 30 s),
    and keeps the windows of those frames (:class:`WhisperWindows`); the sessions that need a pass in the
    same call share one encoder call (:func:`whisper_passes`).
    A frame's window is 10 rows of 20 ms, 2 frames each side of its own 40 ms at 25 fps: it ends 0.12 s
    after the frame's time, and Whisper's two 3-wide convolutions over 25 ms STFT windows reach 12.5 ms
    beyond, 0.1325 s, rounded up to a whole row: 0.14 s. The encoder's attention spans its whole input, so
    the states differ a little from a job's, which sees the whole speech around each frame. A frame thus
    waits 0.14 s for its own sound and one frame's 0.04 s for the next one's: 0.18 s."""

    name = "musetalk"
    mel_columns = 0
    mouth_lead = 0.0  # its window is centred on the frame's time

    def __init__(self, config: Config, fps: float, weights: Path | None = None, batch_size: int = 1):
        from heygem.engines.musetalk.engine import MuseTalkEngine
        from heygem.engines.musetalk.files import find_musetalk_files

        files = find_musetalk_files(weights) if weights is not None else None
        if files is None:
            raise HeygemError(ENGINES["musetalk"].missing_weights())
        # the step's fixed batch (and its CUDA graph): the sessions drawn in one call, not a job's
        # and compiled unless asked not to be: a live server keeps its engine for every session
        options = dataclasses.replace(config.engine, batch_size=batch_size,
                                      musetalk_compile=kept_engine_compile(config.engine.musetalk_compile))
        use_cache, feather = config.run.avatar_cache, config.blend.feather
        key = ("musetalk", *files.identity, options.device, options.precision, options.cuda_graph,
               options.cudnn, options.deterministic, options.musetalk_margin, options.musetalk_parsing,
               options.musetalk_cheek_width, options.musetalk_compile, use_cache, feather, batch_size, fps)

        def load():  # loading, moving to the GPU, autotuning and capturing the graphs
            engine = MuseTalkEngine(files, options, use_cache, feather)
            engine.wait_until_warm()
            engine.warm_up_encoder()
            return engine

        self.seat = take_seat(key, load, lambda engine: functools.partial(musetalk_mouths, engine, fps))
        self.blend = config.blend
        self.sound_before = round(MUSETALK_CONTEXT_SECONDS * fps) / fps  # whole frames: the windows' rows align
        self.lookahead = (MUSETALK_FRAMES_PER_FEATURES - 1) / fps + MUSETALK_SOUND_AFTER
        self.kept = WhisperWindows(fps)  # the windows its last encoder pass made

    def patch_of(self, frame_bgr: np.ndarray, face: Face, sound) -> FacePatch | None:
        """The face's 256x256 crop to the shared engine, the face it generates scaled and masked as a job's."""
        engine = self.engine
        rows, boxes, crops = engine.face_crops([frame_bgr], [face])
        if not rows:
            return None
        face_rgb = self.seat.draw(MouthRequest(crops[0], face, sound, self.kept))  # (256, 256, 3) RGB
        return engine.face_patch(frame_bgr, face, boxes[0], face_rgb)


class WhisperWindows:
    """A MuseTalk session's Whisper windows of the frames its last encoder pass made them for."""

    def __init__(self, fps: float):
        self.frame_samples = SAMPLE_RATE / fps  # 640 at 25 fps
        self.first_sample: int | None = None  # the timeline's sample at the first kept window's frame
        self.kept = None  # (MUSETALK_FRAMES_PER_FEATURES, 50, 384) float32

    def window(self, sound: SoundWindow):
        """(1, 50, 384) float32: the kept window of the frame at ``sound.frame_sample``; None when none is kept."""
        if self.first_sample is None:
            return None
        ahead = (sound.frame_sample - self.first_sample) / self.frame_samples
        index = int(round(ahead))
        if 0 <= index < len(self.kept) and abs(ahead - index) < 0.25:
            return self.kept[index:index + 1]
        return None

    def keep(self, sound: SoundWindow, windows) -> None:
        """The windows of the frame at ``sound.frame_sample`` and the frames after it."""
        self.first_sample, self.kept = sound.frame_sample, windows


def whisper_passes(engine, sounds: list[SoundWindow], fps: float) -> list:
    """For each sound, (MUSETALK_FRAMES_PER_FEATURES, 50, 384) float32: the Whisper windows of its frame and
    the next ones, read from the encoder's states over the sound around them, as a job's
    ``engine.audio_features`` makes them (each sound padded to Whisper's 30 s). All the sounds in one pass of the
    engine's encoder runner (``encoder_hidden_states``: a CUDA graph on a GPU), the spectrograms computed on the
    engine's device (the feature extractor's own option), and only the windows of the frames asked for cut out,
    there, before one copy back; a sound longer than 30 s takes ``engine.audio_features``."""
    import torch

    from heygem.engines.musetalk import audio_features as features

    frame_samples = SAMPLE_RATE / fps
    contexts = [int(round(sound.before / frame_samples)) for sound in sounds]  # whole frames before each frame
    counts = [context + MUSETALK_FRAMES_PER_FEATURES for context in contexts]
    if max(len(sound.samples) for sound in sounds) > features.SEGMENT_SECONDS * SAMPLE_RATE:
        return [engine.audio_features(sound.samples, fps, count, features_on_device=True)[context:]
                for sound, count, context in zip(sounds, counts, contexts)]
    mels = engine.feature_extractor([sound.samples for sound in sounds], sampling_rate=SAMPLE_RATE,
                                    return_tensors="pt", device=str(engine.device)).input_features  # (B, 80, 3000)
    with torch.inference_mode():
        states = engine.encoder_hidden_states(mels)  # (B, 1500, L + 1, 384) on the device
        windows = []
        for row, (sound, count, context) in enumerate(zip(sounds, counts, contexts)):
            length = math.floor(len(sound.samples) / SAMPLE_RATE * features.FEATURE_RATE)
            windows.append(features.frame_windows(states[row, :length], fps, count, first=context))  # (2, 50, 384)
        windows = torch.stack(windows)  # (B, 2, 50, 384)
        windows = (windows + _positional_encoding(windows.shape[2], windows.shape[3], windows.device)).cpu()
    return list(windows)


@functools.lru_cache(maxsize=4)
def _positional_encoding(length: int, d_model: int, device):
    from heygem.engines.musetalk import audio_features as features

    return features.positional_encoding(length, d_model).to(device)


def musetalk_mouths(engine, fps: float, requests: list[MouthRequest]) -> list:
    """The generated face ((256, 256, 3) uint8 RGB) of each request's crop: the Whisper windows of the sessions
    that need a pass in one encoder call (:func:`whisper_passes`), then one MuseTalkEngine.mouths on every crop."""
    import torch

    with torch.inference_mode():
        missing = [request for request in requests if request.kept.window(request.sound) is None]
        if missing:
            for request, windows in zip(missing, whisper_passes(engine, [request.sound for request in missing], fps)):
                request.kept.keep(request.sound, windows)
        windows = torch.cat([request.kept.window(request.sound) for request in requests])  # (F, 50, 384)
        return list(engine.mouths(np.stack([request.image_bgr for request in requests]), windows))


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


MOST_FACES_A_CALL = 8  # the shared engines' fixed batch where a server takes more sessions, or any number


def live_batch_size(max_sessions: int) -> int:
    """Faces an engine shared by a server's sessions draws per call: as many as the sessions it allows (a
    smaller batch is padded to it on a GPU), at most MOST_FACES_A_CALL (more sessions take more passes)."""
    return min(max_sessions, MOST_FACES_A_CALL) if max_sessions > 0 else MOST_FACES_A_CALL


def start_step(choice: LiveEngineChoice, config: Config, fps: float, batch_size: int = 1) -> LiveEngineStep:
    """A session's step; ``batch_size``: faces per call of the engine its sessions share (live_batch_size)."""
    return LIVE_STEPS[choice.name](config, fps, choice.weights, batch_size)
