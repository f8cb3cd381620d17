"""Steps 5c-5e: mouth patches from the engine, restored, and blended into the frames.

On the CPU the frames are converted to BGR and the engine, the restorer and the blender run as
three stages (heygem.engines, heygem.render.restore, heygem.render.blend). On a GPU the wav2lip engine's whole
batch stays on the device from upload to download (heygem.render.gpu_blend), GFPGAN restoration included
(heygem.render.gfpgan); with --render torch the landmark engine draws its mouths the same way
(heygem.engines.landmark_torch).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from heygem.config import Config
from heygem.errors import HeygemError
from heygem.render.cpu import CpuRender
from heygem.render.prepared import Prepared
from heygem.render.regions import _Downloading, _landmarks_or_nan, _RegionRender, _Regions
from heygem.runtime.flow import Stage
from heygem.types import FrameBatch


def choose_render(engine_name: str, prepared: Prepared, config: Config, restorer: str = "none"):
    """The render stages for this engine, restorer and device (see the --render option); decided
    before the networks have loaded, from the options and whether this machine has an NVIDIA GPU."""
    from heygem.runtime.device import gpu_present

    wanted = config.run.render
    auto_on_gpu = wanted == "auto" and config.engine.device != "cpu" and gpu_present()
    if wanted == "torch" and engine_name == "landmark" and restorer != "none":
        raise HeygemError(f"--render torch draws the landmark engine's mouths without a restorer, not with "
                          f"--restorer {restorer}: use --restorer none or --render numpy")
    if engine_name == "landmark" and (wanted == "torch" or (auto_on_gpu and restorer == "none")):
        return LandmarkTorchRender(prepared, config)
    if wanted == "torch" and engine_name != "wav2lip":
        raise HeygemError(f"--render torch works with the wav2lip and landmark engines, not with {engine_name}")
    if wanted == "torch" or (auto_on_gpu and engine_name == "wav2lip"):
        return GpuRender(prepared, config)
    return CpuRender(prepared, config, windows=engine_name == "landmark" and restorer == "none")


class GpuRender(_RegionRender):
    """Steps 5c-5e on the GPU for the wav2lip engine, frames on the device from upload to download.

    Two stages (see _RegionRender). "render", per batch: cut each face's region out of the I420
    frames into a page-locked buffer, upload it, crop every face to 96x96 (heygem.render.gpu_blend), run
    the generator on the masked crops and the mel windows, sharpen what it changed (--restorer
    sharpen), paste the patches back with the feathered, colour-matched lower-face mask, restore
    the pasted lower face with GFPGAN (--restorer gfpgan: aligned, restored and blended back on the
    device, heygem.render.gfpgan), and queue the copy back. "paste": wait for that copy and put the
    regions back into the frames. Only the bytes under the masks change; ffmpeg gets the I420
    frames as they come back.
    """

    def _render(self, batch: FrameBatch) -> _Downloading:
        import torch

        from heygem.engines.wav2lip import FACE_SIZE
        from heygem.render import gpu_blend

        rows = [row for row, face in enumerate(batch.faces) if face is not None]
        if not rows:
            return _Downloading(batch)
        engine = self.prepared.engine
        device = engine.device
        restoration = self.prepared.restoration
        frame_height, frame_width = batch.frames_i420.shape[1] * 2 // 3, batch.frames_i420.shape[2]
        boxes_host = np.array([batch.faces[row].box for row in rows], dtype=np.int64)  # (F, 4)
        landmarks_frame = np.stack([_landmarks_or_nan(batch.faces[row]) for row in rows])  # (F, 468, 2)
        region_boxes = boxes_host
        if restoration.name == "gfpgan":  # GFPGAN aligns from around the box: those pixels travel too
            region_boxes = _with_crop_footprints(boxes_host, landmarks_frame, frame_height, frame_width)
        # Only each face's region travels: the same even-sized region around every box, as I420
        canvas = gpu_blend.face_canvas(np.array(rows), region_boxes, frame_height, frame_width, "cpu")
        origins = canvas.origin.numpy()  # (F, 2) even x, y
        regions = self._cut(batch, rows, origins, canvas.height, canvas.width, device)
        planes = regions.pinned.to(device, non_blocking=True)  # (F, Hc * 3/2, Wc) uint8
        # host arrays: the GPU steps take them as they are, without waiting for the device
        frame_index = np.arange(len(rows))  # each face on a region of its own
        shift = np.concatenate([origins, origins], axis=1)  # (F, 4)
        boxes = boxes_host - shift  # (F, 4) on the regions
        crops = gpu_blend.crop_faces(planes, frame_index, boxes, FACE_SIZE)  # (F, 3, 96, 96) BGR in [0, 1]
        masked = crops.clone()
        masked[:, :, FACE_SIZE // 2:] = 0.0  # the lower half is what the generator makes
        mel_windows = torch.from_numpy(self.prepared.mel_windows(batch.output_indices[rows]))
        mel_windows = mel_windows.unsqueeze(1).to(device, non_blocking=True)  # (F, 1, 80, 16)
        generated = engine.generate_faces(torch.cat((masked, crops), dim=1), mel_windows)  # (F, 3, 96, 96)
        if restoration.name == "sharpen":
            generated = gpu_blend.sharpen_changed(generated, crops, restoration.strength)
        landmarks = (landmarks_frame - origins[:, None, :]).astype(np.float32)  # (F, 468, 2) on the regions
        gpu_blend.paste_faces(planes, frame_index, boxes, generated, landmarks,
                              feather=self.config.blend.feather, color_match=self.config.blend.color_match)
        if restoration.name == "gfpgan":
            restoration.network.restore_regions(planes, boxes, landmarks, restoration.strength,
                                                feather=self.config.blend.feather)
        # back into the buffer, queued after the work above
        return self._download(batch, regions, planes)


@dataclass
class _Planned:
    """A batch of the landmark engine with its faces' regions cut out and their mouths planned."""

    batch: FrameBatch
    regions: _Regions | None = None  # None: no face to draw
    plan: object = None  # landmark_torch.MouthPlan, None when no face has a patch


class LandmarkTorchRender(_RegionRender):
    """Steps 5c-5e for the landmark engine with torch (--render torch), on the engine's --device.

    Three stages. "plan", per batch, on the host: the engine's mouth shapes advance over every
    frame as on the CPU path (LandmarkEngine._jobs), each face with landmarks gets a region around
    the window the CPU engine reads, cut into a host buffer, and each face's geometry and source
    colours are computed (heygem.engines.landmark_torch.plan_face) in the engine's rendering
    processes when it has them, then gathered in frame order (the remembered teeth colour).
    "render": the regions go up and every mouth of the batch is drawn in one batched pass on the
    device. "paste" puts the regions back (see _RegionRender). Only the bytes under each face's
    mask change.
    """

    def __init__(self, prepared: Prepared, config: Config):
        super().__init__(prepared, config)
        self._device = None  # picked with the first batch (torch is imported then)

    def stages(self) -> list[Stage]:
        return [Stage("plan", self.plan), Stage("render", self.render), Stage("paste", self.paste)]

    def plan(self, batches: Iterator[FrameBatch]) -> Iterator[_Planned]:
        from heygem.engines import landmark_torch
        from heygem.runtime.device import pick_device

        for batch in batches:
            engine = self.prepared.engine
            # the mouth shapes advance with every frame, face or not
            jobs = engine._jobs(batch.faces, self.prepared.mel_windows(batch.output_indices))
            frame_size = (batch.frames_i420.shape[2], batch.frames_i420.shape[1] * 2 // 3)
            layout = landmark_torch.region_layout(jobs, frame_size, engine.region_margin)
            if layout is None:
                yield _Planned(batch)
                continue
            if self._device is None:
                self._device = pick_device(self.config.engine.device)
            regions = self._cut(batch, layout.rows, layout.origins, layout.height, layout.width, self._device)
            pool = engine.rendering_processes() if engine._in_processes(layout.faces) else None
            plan = landmark_torch.plan_mouths(layout.faces, regions.host, frame_size, engine.teeth, pool)
            yield _Planned(batch, regions, plan)

    def _render(self, planned: _Planned) -> _Downloading:
        from heygem.engines import landmark_torch

        if planned.plan is None:  # nothing drawn: the frames stay as decoded
            if planned.regions is not None:
                with self._free_lock:
                    self._free.append(planned.regions.buffer)
            return _Downloading(planned.batch)
        planes = planned.regions.pinned.to(self._device, non_blocking=True)  # (F, Hc * 3/2, Wc) uint8
        landmark_torch.render_mouths(planes, planned.plan, self.config.blend)
        return self._download(planned.batch, planned.regions, planes)


def _with_crop_footprints(boxes: np.ndarray, landmarks: np.ndarray, frame_height: int, frame_width: int) -> np.ndarray:
    """(F, 4) boxes widened to the frame pixels each face's aligned GFPGAN square is sampled from
    (faces without landmarks keep their box)."""
    from heygem.render.gfpgan import alignment_matrices, crop_footprints

    widened = boxes.copy()
    usable = np.isfinite(landmarks).all(axis=(1, 2))  # (F,)
    if usable.any():
        footprints = crop_footprints(alignment_matrices(landmarks[usable]), frame_height, frame_width)  # (U, 4)
        widened[usable, :2] = np.minimum(boxes[usable, :2], footprints[:, :2])
        widened[usable, 2:] = np.maximum(boxes[usable, 2:], footprints[:, 2:])
    return widened
