"""The interface every lip-sync engine implements."""

from __future__ import annotations

from typing import Protocol

from heygem.types import EngineBatch, FacePatch


class LipSyncEngine(Protocol):
    """Turns a batch of frames, faces and mel windows into mouth patches.

    Engines are created once per generation and fed batches in output order, so
    they may keep state between batches (for example temporal smoothing).
    """

    name: str
    needs_restoration: bool  # whether the restoration stage should sharpen this engine's patches

    def generate(self, batch: EngineBatch) -> list[FacePatch | None]:
        """One patch per frame of ``batch``; None where the frame has no face."""
        ...
