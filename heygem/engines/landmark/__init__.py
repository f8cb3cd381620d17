"""The built-in landmark engine: no weights, no downloads. It animates the mouth from the audio with
the face's own mediapipe landmarks: the lower face warped so that the lips part along their own
curve, the mouth interior drawn inside the new lips.

- mouth_shapes: each frame's mouth shape (openness, spread or rounding) from the audio;
- geometry: the mouth's levels, where they move for a shape, and the warp that moves them;
- drawing: the warp applied, the interior drawn, the window blended (the CPU path);
- engine: the engine itself, drawing in this process or in rendering processes (processes);
- device: the same mouths drawn on a torch device, every face of a batch in one pass.
"""

from __future__ import annotations

import os
from pathlib import Path

from heygem.config import Config
from heygem.engines.base import EngineKind, LipSyncEngine, RenderPath
from heygem.errors import HeygemError
from heygem.render.cpu import CpuRender
from heygem.render.prepared import Prepared
from heygem.runtime.kept import KEPT, RENDERING_PROCESSES


def landmark_worker_count(config: Config) -> int:
    """Processes that draw the landmark engine's frames: none when the stages run one after another or
    on a small machine (starting them costs more than they give), else half the cores, at most 8."""
    cores = os.cpu_count() or 1
    return 0 if not config.run.concurrent or cores <= 4 else min(8, cores // 2)


class LandmarkKind(EngineKind):
    name = "landmark"
    synthesises_pixels = False  # it moves the frame's own pixels and draws the interior crisply
    needs_weights = False
    keeps_filmed_mouth_in_pauses = True  # its mouth shapes let go in pauses themselves (mouth_shapes.speaking)

    def load(self, weights: Path | None, config: Config, fps: float, owner: int) -> LipSyncEngine:
        """A new engine (its mouth shapes start afresh), drawing with the rendering processes ``owner``'s
        last job left if there are as many as wanted and all run: spawning eight processes that import
        NumPy and OpenCV took a second or more at the start of every job."""
        from heygem.engines.landmark.engine import LandmarkEngine

        workers = landmark_worker_count(config)
        # taken whatever the count: processes kept for another count are stopped
        pool = KEPT.take(RENDERING_PROCESSES, (workers,), owner, usable=lambda kept: kept.alive())
        return LandmarkEngine(config.engine, fps, workers=workers, pool=pool)

    def render(self, prepared: Prepared, config: Config, restorer: str) -> RenderPath:
        """With torch (--render torch, or on a GPU without a restorer) the mouths are drawn on the device
        (heygem.engines.landmark.device); else on the CPU, where without a restorer the engine blends
        I420 windows itself."""
        from heygem.runtime.device import gpu_expected

        wanted = config.run.render
        if wanted == "torch" and restorer != "none":
            raise HeygemError(f"--render torch draws the landmark engine's mouths without a restorer, not with "
                              f"--restorer {restorer}: use --restorer none or --render numpy")
        auto_on_gpu = wanted == "auto" and config.engine.device != "cpu" and gpu_expected()
        if wanted == "torch" or (auto_on_gpu and restorer == "none"):
            from heygem.engines.landmark.device import LandmarkDeviceRender

            return LandmarkDeviceRender(prepared, config)
        return CpuRender(prepared, config, windows=restorer == "none")

    def after_job(self, engine: LipSyncEngine, owner: int, ended_well: bool) -> None:
        """After a job that ended well its rendering processes are idle and in step: kept for ``owner``'s
        next job; after a failed one they may be out of step, so they stop."""
        if ended_well:
            pool = engine.detach_pool()
            if pool is not None:
                KEPT.put(RENDERING_PROCESSES, (pool.size,), pool, owner)
        engine.close()
