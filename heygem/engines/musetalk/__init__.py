"""The musetalk engine: MuseTalk 1.5's single-step latent inpainting at 256x256, from the official
files in weights/musetalk/ (heygem.engines.musetalk.files), run by diffusers and transformers (the
musetalk extra). Its parts: files (the layout), loading (strict), audio_features (Whisper
windows), crop (the face box from our landmarks), model_step (UNet + decode), engine, parsing
(BiSeNet's paste mask), render (step 6). Nothing here imports torch: choosing the engine only
looks at files.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from heygem.config import Config, EngineConfig
from heygem.engines.base import EngineKind, LipSyncEngine, RenderPath
from heygem.engines.musetalk.files import (
    FOLDER_NAME,
    INSTALL_LINE,
    find_musetalk_files,
    missing_files,
    missing_libraries,
    musetalk_folder,
)
from heygem.errors import HeygemError
from heygem.render.prepared import Prepared
from heygem.runtime.kept import KEPT, KeptKind
from heygem.types import Face

if TYPE_CHECKING:
    import numpy as np

MUSETALK_ENGINE = KeptKind("musetalk engine", most=2, per_owner=True)
logger = logging.getLogger("heygem")
_EARLY_IMPORTS: list[threading.Thread] = []  # the one thread start_loading started in this process
_EARLY_LOCK = threading.Lock()


def _import_early(device: str) -> None:
    """torch and the libraries' model modules imported (and CUDA started unless ``device`` is cpu)."""
    try:
        import torch

        from heygem.engines.musetalk import loading

        loading.import_libraries()
        if device != "cpu" and torch.cuda.is_available():
            torch.cuda.init()
    except Exception as error:  # noqa: BLE001 - the engine's own load reports any problem, in the job
        logger.debug("musetalk: early imports failed (%s)", error)


def kept_engine_compile(setting: str) -> str:
    """--musetalk-compile for an engine kept for many jobs or live sessions: auto becomes always (torch.compile's
    first batch, about a minute, is paid once and every batch after it runs about twice as fast); a one-off
    command-line run keeps auto, which the engine reads as never."""
    return "always" if setting == "auto" else setting


class MuseTalkKind(EngineKind):
    name = "musetalk"
    synthesises_pixels = True  # its mouths are decoded pixels
    sharp_face_size = 256  # decoded at 256x256: auto adds no restorer (MuseTalk itself restores nothing)
    reads_mel = False  # its audio features are Whisper's
    weights_label = "complete MuseTalk files (with the musetalk extra installed)"
    presenter_preparation = "musetalk latents"

    def find_weights(self, config: EngineConfig) -> Path | None:
        """weights/musetalk when every required file is there and diffusers and transformers import."""
        if missing_libraries() or find_musetalk_files() is None:
            return None
        return musetalk_folder()

    def found_note(self, weights: Path) -> str:
        files = find_musetalk_files(weights)
        return f" (MuseTalk {files.version}, preferred to Wav2Lip)" if files is not None else ""

    def missing_weights(self) -> str:
        return self.missing() or f"--engine musetalk cannot run on {musetalk_folder()}"

    def missing(self, weights_folder: Path | None = None) -> str:
        """What keeps the engine from running, in one line ("" when nothing does): the musetalk extra, or
        the files missing from ``weights_folder``/musetalk (default: the weights folder's)."""
        libraries = missing_libraries()
        if libraries:
            return f"--engine musetalk needs {' and '.join(libraries)}: {INSTALL_LINE}"
        folder = weights_folder / FOLDER_NAME if weights_folder is not None else musetalk_folder()
        missing = missing_files(folder)
        if not missing:
            return ""
        return (f"--engine musetalk needs MuseTalk's files in {folder}: {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} missing (copy MuseTalk's models/ folder there)")

    def start_loading(self, config: EngineConfig) -> None:
        """torch and diffusers' and transformers' model modules (8.8 s on an H100 host, docs/benchmarks.md)
        imported in a thread of their own, once per process, while the inputs are probed and decoded."""
        with _EARLY_LOCK:
            if not _EARLY_IMPORTS and not missing_libraries():
                thread = threading.Thread(target=_import_early, args=(config.device,), name="musetalk-imports",
                                          daemon=True)
                thread.start()
                _EARLY_IMPORTS.append(thread)

    def load(self, weights: Path | None, config: Config, fps: float, owner: int) -> LipSyncEngine:
        """The engine loaded for ``owner``'s previous job if the files and options are unchanged,
        else a new one, kept for its next job."""
        from heygem.engines.musetalk.engine import MuseTalkEngine

        files = find_musetalk_files(weights)
        if files is None:
            raise HeygemError(self.missing_weights())
        options = config.engine
        use_cache = config.run.avatar_cache
        key = (*files.identity, options.device, options.batch_size, options.precision, options.cuda_graph,
               options.cudnn, options.deterministic, options.musetalk_margin, options.musetalk_parsing,
               options.musetalk_cheek_width, options.musetalk_compile, use_cache, config.blend.feather)
        feather = config.blend.feather
        return KEPT.shared(MUSETALK_ENGINE, key, lambda: MuseTalkEngine(files, options, use_cache, feather),
                           owner=owner)

    def audio_features(self, engine: LipSyncEngine, samples_16k, fps: float, frame_count: int):
        """(frame_count, 50, 384) float32: each output frame's Whisper window with the positional encoding."""
        return engine.audio_features(samples_16k, fps, frame_count)

    def render(self, prepared: Prepared, config: Config, restorer: str) -> RenderPath:
        """On a GPU (or with --render torch) each face's region goes to the engine's device, where the
        face is pasted (heygem.engines.musetalk.render.MuseTalkDeviceRender: 2.5x the CPU path's frames/s
        on an H200, docs/benchmarks.md); else the CPU render path. Both take MuseTalk's audio features;
        the networks run on the engine's device."""
        from heygem.engines.musetalk.render import MuseTalkDeviceRender, MuseTalkRender
        from heygem.runtime.device import gpu_expected

        wanted = config.run.render
        if wanted == "torch" or (wanted == "auto" and config.engine.device != "cpu" and gpu_expected()):
            return MuseTalkDeviceRender(prepared, config)
        return MuseTalkRender(prepared, config)

    def prepare_presenter(self, engine: LipSyncEngine, batches: Iterator[tuple[np.ndarray, list[Face | None]]]
                          ) -> None:
        """Every face crop's latents (the VAE's, for the UNet's input) encoded and kept in the avatar cache,
        where a job made from the presenter finds them: it runs no encoder."""
        encoded = engine.prepare_latents(batches)
        logger.info("musetalk: %d face crops of the presenter encoded", encoded)

    def after_job(self, engine: LipSyncEngine, owner: int, ended_well: bool) -> None:
        """Nothing to stop: the networks stay loaded for ``owner``'s next job (heygem.runtime.kept)."""
