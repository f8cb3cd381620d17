"""The wav2lip engine: the public Wav2Lip or Wav2Lip-GAN generator (its 96x96 mouths scaled to the face
box, then restored). The generator itself is heygem.models.wav2lip; running it is heygem.engines.wav2lip.engine
(the CPU path's patches, and the tensors the device path feeds it), and heygem.engines.wav2lip.device is
its device path. Nothing here imports torch: choosing the engine only looks at files.
"""

from __future__ import annotations

from pathlib import Path

from heygem.config import Config, EngineConfig
from heygem.engines.base import EngineKind, LipSyncEngine, RenderPath
from heygem.errors import HeygemError
from heygem.render.cpu import CpuRender
from heygem.render.prepared import Prepared
from heygem.runtime.kept import KEPT, WAV2LIP_ENGINE, file_identity
from heygem.weights import WAV2LIP_FILE_NAMES, find_wav2lip_checkpoint, weights_dir


class Wav2LipKind(EngineKind):
    name = "wav2lip"
    synthesises_pixels = True  # its 96x96 output is scaled up to the face box: a restorer helps
    weights_label = "Wav2Lip checkpoint"

    def find_weights(self, config: EngineConfig) -> Path | None:
        if config.checkpoint:
            checkpoint = Path(config.checkpoint)
            if not checkpoint.is_file():
                raise HeygemError(f"checkpoint not found: {checkpoint}")
            return checkpoint
        return find_wav2lip_checkpoint()

    def missing_weights(self) -> str:
        return (f"--engine wav2lip needs a checkpoint: put {' or '.join(WAV2LIP_FILE_NAMES)} into {weights_dir()} "
                f"or pass --checkpoint PATH")

    def load(self, weights: Path | None, config: Config, fps: float, owner: int) -> LipSyncEngine:
        """The generator loaded for ``owner``'s previous job if the file and the options are unchanged,
        else a new one, kept for its next job (importing torch, starting CUDA and loading the weights
        take 10-15 s, longer than a minute of 1080p takes to render; an engine serves one thread)."""
        from heygem.runtime import timeline

        with timeline.span("import torch and the wav2lip engine"):
            from heygem.engines.wav2lip.engine import Wav2LipEngine

        options = config.engine
        key = (file_identity(weights), options.device, options.batch_size, options.precision, options.cuda_graph,
               options.cudnn, options.deterministic)
        return KEPT.shared(WAV2LIP_ENGINE, key, lambda: Wav2LipEngine(weights, options), owner=owner)

    def render(self, prepared: Prepared, config: Config, restorer: str) -> RenderPath:
        """On a GPU (or with --render torch) each face's region goes to the device for the whole of step 6
        (heygem.engines.wav2lip.device); else the CPU path."""
        from heygem.runtime.device import gpu_expected

        wanted = config.run.render
        if wanted == "torch" or (wanted == "auto" and config.engine.device != "cpu" and gpu_expected()):
            from heygem.engines.wav2lip.device import Wav2LipDeviceRender

            return Wav2LipDeviceRender(prepared, config)
        return CpuRender(prepared, config)

    def after_job(self, engine: LipSyncEngine, owner: int, ended_well: bool) -> None:
        """Nothing to stop: the generator stays loaded for ``owner``'s next job (heygem.runtime.kept)."""
