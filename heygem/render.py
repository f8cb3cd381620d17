"""Steps 5c-5e: mouth patches from the engine, restored, and blended into the frames.

On the CPU the frames are converted to BGR and the engine, the restorer and the blender run as
three stages (heygem.engines, heygem.restore, heygem.blend). On a GPU the wav2lip engine's whole
batch stays on the device from upload to download (heygem.gpu_blend).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from heygem import audio, media
from heygem.blend import blend_patch
from heygem.config import Config
from heygem.errors import HeygemError
from heygem.flow import Stage
from heygem.restore import restore_patches
from heygem.types import EngineBatch, FrameBatch


def choose_render(engine, mel: np.ndarray, window_starts: np.ndarray, fps: float, config: Config):
    """The render stages for this engine and device (see the --render option)."""
    wanted = config.run.render
    on_gpu = getattr(getattr(engine, "device", None), "type", "cpu") == "cuda"
    can_use_torch = hasattr(engine, "generate_faces")
    if wanted == "torch" and not can_use_torch:
        raise HeygemError(f"--render torch works with the wav2lip engine, not with {engine.name}")
    if wanted == "torch" or (wanted == "auto" and on_gpu and can_use_torch):
        return GpuRender(engine, mel, window_starts, config)
    return CpuRender(engine, mel, window_starts, fps, config)


class CpuRender:
    """Steps 5b-5d on the CPU: the engine's patches, restored, blended into BGR frames."""

    def __init__(self, engine, mel: np.ndarray, window_starts: np.ndarray, fps: float, config: Config):
        self.engine = engine
        self.mel = mel
        self.window_starts = window_starts
        self.fps = fps
        self.config = config

    def stages(self) -> list[Stage]:
        stages = [Stage("generate", self.generate)]
        if self.engine.needs_restoration and self.config.restore.enabled:
            stages.append(Stage("restore", self.restore))
        stages.append(Stage("blend", self.blend))
        return stages

    def generate(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        for batch in batches:
            batch.frames_bgr = media.i420_batch_to_bgr(batch.frames_i420)
            mel_windows = audio.mel_windows(self.mel, self.window_starts[batch.output_indices])
            batch.patches = self.engine.generate(EngineBatch(
                frame_indices=batch.output_indices, frames_bgr=batch.frames_bgr, faces=batch.faces,
                mel_windows=mel_windows, fps=self.fps))
            yield batch

    def restore(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        for batch in batches:
            batch.patches = restore_patches(batch.patches, batch.frames_bgr, self.config.restore)
            yield batch

    def blend(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        for batch in batches:
            for index, patch in enumerate(batch.patches):
                if patch is not None:  # frames without a patch keep their decoded I420 bytes
                    blend_patch(batch.frames_bgr[index], patch, self.config.blend)
                    batch.frames_i420[index] = media.bgr_to_yuv420(batch.frames_bgr[index])
            batch.frames_bgr = None
            yield batch


class GpuRender:
    """Steps 5c-5e on the GPU for the wav2lip engine: one stage, frames on the device from upload to download.

    Per batch: upload the I420 frames, crop every face to 96x96 (heygem.gpu_blend), run the
    generator on the masked crops and the mel windows, sharpen what it changed, paste the
    patches back with the feathered, colour-matched lower-face mask, and copy the frames back.
    Only the bytes under the masks change; ffmpeg gets the I420 frames as they come back.
    """

    def __init__(self, engine, mel: np.ndarray, window_starts: np.ndarray, config: Config):
        import torch

        self.engine = engine
        self.device = engine.device
        self.mel = mel  # (80, T) float32
        self.window_starts = window_starts
        self.config = config
        self._upload: torch.Tensor | None = None  # pinned host buffer, reused batch after batch

    def stages(self) -> list[Stage]:
        return [Stage("render", self.render)]

    def render(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        import torch

        for batch in batches:
            rows = [row for row, face in enumerate(batch.faces) if face is not None]
            if rows:
                with torch.inference_mode():
                    self._render(batch, rows)
            yield batch

    def _render(self, batch: FrameBatch, rows: list[int]) -> None:
        import torch

        from heygem import gpu_blend
        from heygem.engines.wav2lip import FACE_SIZE

        frames = torch.from_numpy(batch.frames_i420)  # (N, H * 3/2, W) uint8
        planes = self._pinned(frames).to(self.device, non_blocking=True)
        frame_index = torch.tensor(rows, dtype=torch.int64, device=self.device)  # (F,)
        boxes = torch.tensor([batch.faces[row].box for row in rows], dtype=torch.int64, device=self.device)
        crops = gpu_blend.crop_faces(planes, frame_index, boxes, FACE_SIZE)  # (F, 3, 96, 96) BGR in [0, 1]
        masked = crops.clone()
        masked[:, :, FACE_SIZE // 2:] = 0.0  # the lower half is what the generator makes
        mel_windows = torch.from_numpy(audio.mel_windows(self.mel, self.window_starts[batch.output_indices[rows]]))
        mel_windows = mel_windows.unsqueeze(1).to(self.device, non_blocking=True)  # (F, 1, 80, 16)
        generated = self.engine.generate_faces(torch.cat((masked, crops), dim=1), mel_windows)  # (F, 3, 96, 96)
        restore = self.config.restore
        if restore.enabled and restore.strength > 0:
            generated = gpu_blend.sharpen_changed(generated, crops, restore.strength)
        landmarks = np.stack([_landmarks_or_nan(batch.faces[row]) for row in rows])  # (F, 468, 2)
        gpu_blend.paste_faces(planes, frame_index, boxes, generated, landmarks,
                              feather=self.config.blend.feather, color_match=self.config.blend.color_match)
        frames.copy_(planes.cpu())

    def _pinned(self, frames):
        """``frames`` copied into a reused page-locked buffer, so the upload runs at full speed."""
        import torch

        if self.device.type != "cuda":
            return frames
        if self._upload is None or self._upload.shape[1:] != frames.shape[1:] or len(self._upload) < len(frames):
            self._upload = torch.empty(frames.shape, dtype=torch.uint8, pin_memory=True)
        buffer = self._upload[: len(frames)]
        buffer.copy_(frames)
        return buffer


def _landmarks_or_nan(face) -> np.ndarray:
    if face.landmarks is None:
        return np.full((468, 2), np.nan, dtype=np.float32)
    return face.landmarks
