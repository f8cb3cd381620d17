"""Step 6 on the CPU: the engine's mouth patches, restored (heygem.render.restore) and blended into
the frames (heygem.render.blend), as three stages. An engine that blends I420 windows itself (the
landmark engine with no restorer after it) does so over the stream of batches, and the blend stage
only pastes the finished bytes: no frame is converted to BGR.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from collections.abc import Iterator

from heygem.config import Config
from heygem.media.frames import i420_batch_to_bgr, paste_i420_window, write_region_i420
from heygem.render.blend import blend_patch
from heygem.render.prepared import Prepared
from heygem.render.restore import restore_patches
from heygem.runtime.flow import Stage
from heygem.types import EngineBatch, FrameBatch


class CpuRender:
    """Step 6 on the CPU: the engine's patches, restored, blended into BGR frames. An engine
    with generate_i420 (the landmark engine) blends windows of the I420 frames itself, in its
    rendering processes where it has them: no frame is converted to BGR, and the blend stage only
    pastes the finished bytes."""

    def __init__(self, prepared: Prepared, config: Config, windows: bool = False):
        self.prepared = prepared
        self.config = config
        # windows: the engine blends I420 windows itself (the landmark engine with no restorer after it)
        self.windows = windows
        self.bytes_per_pixel = 1.5 if windows else 3  # batches stay I420, or are converted to BGR

    def stages(self) -> list[Stage]:
        return [Stage("generate", self.generate), Stage("restore", self.restore), Stage("blend", self.blend)]

    def generate(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        if self.windows:
            yield from self._generate_windows(batches)
            return
        for batch in batches:
            engine = self.prepared.engine
            batch.frames_bgr = i420_batch_to_bgr(batch.frames_i420)
            batch.patches = engine.generate(EngineBatch(
                frame_indices=batch.output_indices, frames_bgr=batch.frames_bgr, faces=batch.faces,
                mel_windows=self.prepared.mel_windows(batch.output_indices), fps=self.prepared.fps))
            yield batch

    def _generate_windows(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        """The engine blends I420 windows itself (no BGR frames), over the stream of batches, so that
        its rendering processes work on the next batch while this one is handed on."""
        batches = iter(batches)
        first = next(batches, None)
        if first is None:
            return
        engine = self.prepared.engine  # asked for once the first batch is here (it may still be loading)
        handed: deque[FrameBatch] = deque()  # batches given to the engine, their windows not back yet

        def inputs():
            for batch in itertools.chain([first], batches):
                handed.append(batch)
                yield batch.frames_i420, batch.faces, self.prepared.mel_windows(batch.output_indices)

        with contextlib.closing(engine.generate_i420_stream(inputs(), self.config.blend)) as stream:
            for windows in stream:
                batch = handed.popleft()
                batch.windows_i420 = windows
                yield batch

    def restore(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        """Restore the patches with the chosen restorer (heygem.render.restore.choose_restorer)."""
        for batch in batches:
            restoration = self.prepared.restoration
            if restoration.name != "none":
                batch.patches = restore_patches(batch.patches, batch.frames_bgr, restoration)
            yield batch

    def blend(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        for batch in batches:
            for index, window in enumerate(batch.windows_i420):
                if window is not None:  # finished by the engine: only its bytes to paste
                    paste_i420_window(batch.frames_i420[index], window.box, window.planes)
            for index, patch in enumerate(batch.patches):
                if patch is not None:  # frames without a patch keep their decoded I420 bytes
                    blend_patch(batch.frames_bgr[index], patch, self.config.blend)
                    write_region_i420(batch.frames_i420[index], batch.frames_bgr[index], patch.box)
            batch.frames_bgr = None
            yield batch
