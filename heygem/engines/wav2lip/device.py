"""The wav2lip engine's device path (step 6 on a GPU): each face's region of the I420 frames goes to
the device, where it is cropped to 96x96, the generator runs on the masked crops and the mel
windows, what it changed is sharpened (--restorer sharpen), the patches are pasted back with the
feathered, colour-matched lower-face mask and the pasted lower face is restored with GFPGAN
(--restorer gfpgan); only the regions come back (heygem.render.regions).
"""

from __future__ import annotations

import numpy as np

from heygem.render.regions import Downloading, RegionRender, landmarks_or_nan
from heygem.types import FrameBatch


class Wav2LipDeviceRender(RegionRender):
    """Step 6 on the GPU for the wav2lip engine, frames on the device from upload to download.

    Two stages (see RegionRender). "render", per batch: cut each face's region out of the I420
    frames into a page-locked buffer, upload it, crop every face to 96x96 (heygem.render.gpu_blend), run
    the generator on the masked crops and the mel windows, sharpen what it changed (--restorer
    sharpen), paste the patches back with the feathered, colour-matched lower-face mask, restore
    the pasted lower face with GFPGAN (--restorer gfpgan: aligned, restored and blended back on the
    device, heygem.render.gfpgan), and queue the copy back. "paste": wait for that copy and put the
    regions back into the frames. Only the bytes under the masks change; ffmpeg gets the I420
    frames as they come back.
    """

    def _render(self, batch: FrameBatch) -> Downloading:
        import torch

        from heygem.engines.wav2lip.engine import FACE_SIZE
        from heygem.render import gpu_blend

        rows = [row for row, face in enumerate(batch.faces) if face is not None]
        if not rows:
            return Downloading(batch)
        engine = self.prepared.engine
        device = engine.device
        restoration = self.prepared.restoration
        frame_height, frame_width = batch.frames_i420.shape[1] * 2 // 3, batch.frames_i420.shape[2]
        boxes_host = np.array([batch.faces[row].box for row in rows], dtype=np.int64)  # (F, 4)
        landmarks_frame = np.stack([landmarks_or_nan(batch.faces[row]) for row in rows])  # (F, 468, 2)
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
