"""The interface every lip-sync engine implements.

An engine is two things:

- an :class:`EngineKind`, one per engine, in the registry (heygem.engines): what the pipeline asks
  before anything loads (step 3): which weights it runs on, how to load it, which render stages
  carry its mouths into the frames (step 6), and what is kept for the next job;
- the loaded engine (:class:`LipSyncEngine`), which the render stages ask for mouths through its
  public methods only.

Adding an engine is one module (or small package) with its kind, and one line in the registry.
An engine module imports nothing heavy at the top (torch, say): choosing an engine only looks at
files.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from heygem.config import Config, EngineConfig
from heygem.types import EngineBatch, FacePatch

if TYPE_CHECKING:
    from heygem.render.prepared import Prepared
    from heygem.runtime.flow import Stage


class LipSyncEngine(Protocol):
    """A loaded engine: turns a batch of frames, faces and audio features into mouth patches.

    Engines are created once per generation (or kept between jobs of one worker thread) and fed
    batches in output order, so they may keep state between batches (the landmark engine's mouth
    shapes, say). Engines with a device path of their own offer more methods, which that path uses.
    """

    name: str

    def generate(self, batch: EngineBatch) -> list[FacePatch | None]:
        """One patch per frame of ``batch`` (BGR frames on the CPU); None where the frame has no face."""
        ...

    def close(self) -> None:
        """Stop what the engine started (processes); safe to call more than once."""
        ...


class RenderPath(Protocol):
    """The render stages that put an engine's mouths into the frames (heygem.render)."""

    bytes_per_pixel: float  # what a frame of a batch costs in its stages: 1.5 (I420 only) or 3 (BGR too)

    def stages(self) -> list[Stage]: ...


@dataclass(frozen=True)
class EngineChoice:
    """The engine a job runs, and why: what :func:`heygem.engines.choose_engine` settles."""

    kind: EngineKind
    weights: Path | None  # the checkpoint it loads, None for an engine that needs none
    reason: str  # "auto: found wav2lip_gan.pth", "chosen with --engine"

    @property
    def name(self) -> str:
        return self.kind.name


class EngineKind(ABC):
    """One lip-sync engine as the pipeline sees it before anything is loaded."""

    name: str  # what --engine calls it
    synthesises_pixels: bool  # its mouths are made pixels (a restorer helps), else the frame's own, moved
    sharp_face_size: int | None = None  # the side of faces made sharp enough that auto restores nothing
    reads_mel: bool = True  # whether it reads the speech's Wav2Lip mel windows (else features of its own)
    needs_weights: bool = True  # whether it runs on a checkpoint the user brings
    # whether its mouths let go in the speech's pauses by themselves (else heygem.render.pauses puts the
    # filmed mouth back there)
    keeps_filmed_mouth_in_pauses: bool = False
    weights_label: str = ""  # what its weights are called in messages: "Wav2Lip checkpoint"

    def find_weights(self, config: EngineConfig) -> Path | None:
        """The checkpoint this engine would run on (the option's file, else the first one found in the
        weights folder), or None when there is none (always None for an engine that needs none).
        Quick: looks at file names only. HeygemError for a named file that does not exist."""
        return None

    def found_note(self, weights: Path) -> str:
        """What --engine auto adds after "found NAME" (", preferred to ...", say); "" by default."""
        return ""

    def missing_weights(self) -> str:
        """What to do when the weights are missing (--engine NAME chosen without them)."""
        return f"--engine {self.name} needs its weights in the weights folder"

    @abstractmethod
    def load(self, weights: Path | None, config: Config, fps: float, owner: int) -> LipSyncEngine:
        """The loaded engine for one job of thread ``owner`` (it may be one kept from that thread's
        earlier job, heygem.runtime.kept). Can take seconds; runs while the first frames are decoded."""

    def start_loading(self, config: EngineConfig) -> None:
        """Begin, in the background, what a later :meth:`load` will need (library imports): called as soon
        as the caller knows this engine will run, before the inputs are probed. Nothing by default."""
        return None

    def audio_features(self, engine: LipSyncEngine, samples_16k, fps: float, frame_count: int):
        """The engine's own audio features for a job's speech ((S,) float32 at 16 kHz), made in the
        background as soon as the engine has loaded (heygem.render.prepared); None for an engine that
        reads the mel windows only."""
        return None

    @abstractmethod
    def render(self, prepared: Prepared, config: Config, restorer: str) -> RenderPath:
        """The render stages for this engine, the chosen restorer and this machine (--render): decided
        before the engine has loaded. HeygemError for a combination that cannot run."""

    def after_job(self, engine: LipSyncEngine, owner: int, ended_well: bool) -> None:
        """Called once a job is over: what the engine keeps for ``owner``'s next job is kept (only after
        a job that ended well), the rest is stopped."""
        engine.close()
