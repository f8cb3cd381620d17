"""Step 6 for the MuseTalk engine: the CPU render path (heygem.render.cpu) with MuseTalk's own
audio features. The networks run on the engine's device; the frames, the blend and the restorer
stay on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from heygem.media.frames import i420_batch_to_bgr
from heygem.render.cpu import CpuRender
from heygem.types import FrameBatch


class MuseTalkRender(CpuRender):
    """The CPU render path whose generate stage asks the engine for patches with each frame's
    Whisper window (computed once per job, when the first batch arrives)."""

    def generate(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        audio_windows = None
        for batch in batches:
            engine = self.prepared.engine
            if audio_windows is None:
                audio_windows = engine.audio_features(self.prepared.samples_16k, self.prepared.fps,
                                                      self.prepared.frame_count)  # (frames, 50, 384)
            batch.frames_bgr = i420_batch_to_bgr(batch.frames_i420)
            rows = torch.from_numpy(batch.output_indices)
            batch.patches = engine.patches(batch.frames_bgr, batch.faces, audio_windows[rows])
            yield batch
