"""Steps 3 and 6: the lip-sync engines, each behind the interface in heygem.engines.base.

The registry below lists every engine's kind in the order ``--engine auto`` tries them: the first
whose weights are in the weights folder runs, and the built-in landmark engine needs none.
"""

from __future__ import annotations

from pathlib import Path

from heygem.config import EngineConfig
from heygem.engines.base import EngineChoice, EngineKind
from heygem.engines.landmark import LandmarkKind
from heygem.engines.musetalk import MuseTalkKind
from heygem.engines.wav2lip import Wav2LipKind
from heygem.errors import HeygemError
from heygem.weights import weights_dir

ENGINES: dict[str, EngineKind] = {kind.name: kind for kind in (MuseTalkKind(), Wav2LipKind(), LandmarkKind())}


def choose_engine(config: EngineConfig) -> EngineChoice:
    """The engine to run and why: the one ``config.name`` names, or with auto the first in
    :data:`ENGINES` whose weights are there. Quick (file names only); HeygemError for an engine
    that cannot run."""
    if config.name != "auto":
        kind = ENGINES.get(config.name)
        if kind is None:
            raise HeygemError(f"--engine must be auto or one of {', '.join(ENGINES)}, not {config.name!r}")
        weights = kind.find_weights(config)
        if kind.needs_weights and weights is None:
            raise HeygemError(kind.missing_weights())
        return EngineChoice(kind, weights, "chosen with --engine")
    looked_for = []
    for kind in ENGINES.values():
        if not kind.needs_weights:
            return EngineChoice(kind, None, f"auto: no {' or '.join(looked_for)} in {weights_dir()}, using the "
                                            f"built-in engine")
        weights = kind.find_weights(config)
        if weights is not None:
            return EngineChoice(kind, weights, f"auto: found {Path(weights).name}{kind.found_note(weights)}")
        looked_for.append(kind.weights_label)
    raise HeygemError("no engine can run")  # pragma: no cover - the landmark engine needs nothing


def start_loading(config: EngineConfig) -> None:
    """Let the engine ``config`` chooses begin its imports in the background (EngineKind.start_loading), as
    early as a command knows its options; nothing when no engine can be chosen (the job says why later)."""
    try:
        choice = choose_engine(config)
    except HeygemError:
        return
    choice.kind.start_loading(config)
