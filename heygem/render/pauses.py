"""Step 6's last word on the mouth: in the speech's pauses the frame shows the face's own mouth, as filmed.

Whatever an engine drew, on whichever render path (the CPU's blend, the device's paste, the
engine's own paste), is undone here where the speech pauses (heygem.speech.pauses): two stages
around the engine's render stages. The first keeps a copy of each frame a pause touches as it was
decoded; the last puts it back (weight 0) or mixes it with the rendered frame (the fade of the
handover). The I420 bytes are mixed as they are: blending in YUV is blending in BGR, up to
rounding, so a frame faded to weight w is the frame blended with the engine's mask times w.
An engine that lets go of the mouth in pauses itself (the landmark engine) is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from heygem.runtime.flow import Stage
from heygem.types import FrameBatch


class FilmedMouth:
    """The stages that keep the filmed frames of the speech's pauses and put them back after the render:
    ``weights`` (N,) float32, per output frame how much of the engine's mouth shows (heygem.speech.pauses)."""

    def __init__(self, weights: np.ndarray):
        self.weights = np.asarray(weights, np.float32)

    @property
    def has_pauses(self) -> bool:
        return bool((self.weights < 1.0).any())

    def around(self, render_stages: list[Stage]) -> list[Stage]:
        """``render_stages`` with the keeping before them and the putting back after; unchanged without pauses."""
        if not self.has_pauses:
            return render_stages
        return [Stage("keep_filmed", self.keep), *render_stages, Stage("pauses", self.put_back)]

    def keep(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        for batch in batches:
            rows = np.flatnonzero(self.weights[batch.output_indices] < 1.0)
            if len(rows):
                batch.filmed_i420 = (rows, batch.frames_i420[rows].copy())  # (R,), (R, H * 3/2, W) as decoded
            yield batch

    def put_back(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        for batch in batches:
            if batch.filmed_i420 is not None:
                rows, filmed = batch.filmed_i420
                for row, filmed_frame in zip(rows, filmed):
                    weight = float(self.weights[batch.output_indices[row]])
                    rendered = batch.frames_i420[row]
                    if weight <= 0.0:
                        rendered[...] = filmed_frame
                        continue
                    changed = np.flatnonzero((rendered != filmed_frame).any(axis=1))  # rows the engine drew on
                    if len(changed):
                        band = slice(changed[0], changed[-1] + 1)
                        old = filmed_frame[band].astype(np.float32)
                        rendered[band] = np.rint(old + (rendered[band].astype(np.float32) - old) * weight)
                batch.filmed_i420 = None
            yield batch
