"""Step 6 for the MuseTalk engine, with MuseTalk's own audio features: the CPU render path
(heygem.render.cpu; the networks on the engine's device, the frames, the blend and the restorer on
the CPU), or on a GPU the device path (heygem.render.regions), where only each face's region
travels and is pasted on the device.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from heygem.media.frames import i420_batch_to_bgr, yuv420_to_bgr
from heygem.render.cpu import CpuRender
from heygem.render.regions import Downloading, RegionRender
from heygem.types import FrameBatch


class MuseTalkRender(CpuRender):
    """The CPU render path whose generate stage asks the engine for patches with each frame's
    Whisper window (computed in the background once the engine has loaded), for several batches at
    once (:func:`model_groups`): the networks run on full batches of faces, not on the few frames a
    batch of big frames holds."""

    def generate(self, batches: Iterator[FrameBatch]) -> Iterator[FrameBatch]:
        for group in model_groups(batches, lambda: self.prepared.engine.batch_size):
            engine = self.prepared.engine
            audio_windows = self.prepared.engine_audio  # (frames, 50, 384), made in the background
            for batch in group:
                batch.frames_bgr = i420_batch_to_bgr(batch.frames_i420)
            frames = [frame for batch in group for frame in batch.frames_bgr]
            faces = [face for batch in group for face in batch.faces]
            rows = torch.from_numpy(np.concatenate([batch.output_indices for batch in group]))
            patches = engine.patches(frames, faces, audio_windows[rows])
            start = 0
            for batch in group:
                batch.patches = patches[start:start + len(batch.faces)]
                start += len(batch.faces)
                yield batch


def model_groups(batches: Iterator[FrameBatch], faces_wanted) -> Iterator[list[FrameBatch]]:
    """Consecutive batches, gathered while their faces fit in one model batch (``faces_wanted()``
    faces, asked as each group starts: an out-of-memory retry makes it smaller). A batch of 1080p
    frames holds 5 to 10 frames, and the UNet and the decoder run a fixed batch (64 by default)
    whatever it holds. A group is handed on as soon as the next batch would overflow it, or the
    input ends."""
    group: list[FrameBatch] = []
    count = 0
    wanted = 1
    for batch in batches:
        if not group:
            wanted = max(1, int(faces_wanted()))
        faces = sum(face is not None for face in batch.faces)
        if group and count + faces > wanted:
            yield group
            group, count = [], 0
        group.append(batch)
        count += faces
    if group:
        yield group


class MuseTalkDeviceRender(RegionRender):
    """Step 6 on the GPU for the musetalk engine (heygem.render.regions' two stages). "render", per
    group of batches that fills one model batch (:func:`model_groups`): cut each face's region
    around its MuseTalk box out of the I420 frames into a page-locked buffer and upload it; on the
    host, the region's 256x256 crop (the same bytes as the CPU path's, so the avatar cache's
    latents serve both); the UNet and the decoder on the device; the generated faces pasted into
    the regions there (heygem.render.gpu_blend: scaled to the box, colour-matched, with the
    feathered lower-face mask kept below the box's middle as MuseTalk pastes), and the copy back
    queued; the next group's host work runs while the device works on this one's. "paste": put the
    regions back into the frames. With a restorer or with face parsing (BiSeNet's masks), a batch
    takes the CPU path's steps instead.
    """

    def __init__(self, prepared, config):
        super().__init__(prepared, config)
        # crops being cut for this job, by (clip key, source frame, box): a frame the clip shows again before
        # its latents are known (the group ahead, a loop within a group) reuses the crop; dropped once known
        self._pending_crops: dict[tuple, object] = {}

    def audio_windows(self, rows: np.ndarray) -> torch.Tensor:
        """The Whisper windows of output frames ``rows`` (made in the background once per job)."""
        return self.prepared.engine_audio[torch.from_numpy(np.asarray(rows))]

    def render(self, batches: Iterator[FrameBatch]) -> Iterator[Downloading]:
        """Each group of batches (:func:`model_groups`) through one pass of the networks, the next
        group's regions cut out, uploaded and cropped on the host while the device runs this one's. A
        group's batches are handed on only once the next group's work is queued on the device: handing
        them on waits for the paste stage, which waits for the device, and the device would otherwise
        idle while this thread cuts the group after."""
        ahead = None  # (group, its host part): cut, not yet queued on the device
        queued: list[Downloading] = []  # the group queued on the device before, not yet handed on
        for group in model_groups(batches, lambda: self.prepared.engine.batch_size):
            with torch.inference_mode():
                cut = self._cut_group(group)
                following = self._render_group(*ahead) if ahead is not None else []
            yield from queued
            queued, ahead = following, (group, cut)
        if ahead is not None:
            with torch.inference_mode():
                following = self._render_group(*ahead)
        else:
            following = []
        yield from queued
        yield from following

    def _cut_group(self, group: list[FrameBatch]):
        """The host's part of a group, started: per batch its faces' rows, regions (cut out and
        uploaded), boxes on the regions and mask futures (None for a batch without a face), and per face
        (its crop future or None, its frame key or None, its latents when already known). Every region of the
        group has the same size (the group's largest box, on heygem.render.gpu_blend's canvas), so the paste
        runs once on the whole group. None for a group that takes the CPU path's steps.

        The crop (a 256x256 Lanczos resize on the host, then its digest for the avatar cache) is skipped where
        the engine still holds the latents of that frame of the clip (``prepared.source_key``: the avatar
        cache's key of the clip; MuseTalkEngine.remembered_latents): a clip that loops under longer speech, a
        kept engine's next job on the same presenter."""
        import heygem.engines.musetalk.crop as crop
        from heygem.render import gpu_blend

        engine = self.prepared.engine
        if engine.parser is not None or self.prepared.restoration.name != "none":
            return None
        sizes = {batch.frames_i420.shape[1:] for batch in group}
        if len(sizes) != 1:
            raise ValueError(f"a group of batches with frames of {len(sizes)} sizes")
        frame_height, frame_width = group[0].frames_i420.shape[1] * 2 // 3, group[0].frames_i420.shape[2]
        pool = host_pool()
        feather = self.config.blend.feather
        found = []  # per batch: (rows, boxes (F, 4) in the frames), or None
        for batch in group:
            rows, boxes = [], []
            for row, face in enumerate(batch.faces):
                box = (crop.musetalk_box(face, frame_height, frame_width, engine.extra_margin)
                       if face is not None else None)
                if box is not None:
                    rows.append(row)
                    boxes.append(box)
            found.append((rows, np.array(boxes, dtype=np.int64)) if rows else None)
        every_box = [item[1] for item in found if item is not None]
        if not every_box:
            return [None] * len(group), []
        every_box = np.concatenate(every_box)  # (F, 4), the group's faces in order
        canvas = gpu_blend.face_canvas(np.arange(len(every_box)), every_box, frame_height, frame_width, "cpu")
        every_origin = canvas.origin.numpy()  # (F, 2) even x, y
        cuts = []  # per batch: (rows, regions, planes, boxes on the regions, mask futures), or None
        crops = []  # every face's (crop future or None, frame key or None, latents or None), in the group's order
        clip = self.prepared.source_key
        start = 0
        for batch, item in zip(group, found):
            if item is None:
                cuts.append(None)
                continue
            rows, boxes_host = item
            origins = every_origin[start:start + len(rows)]
            start += len(rows)
            regions = self._cut(batch, rows, origins, canvas.height, canvas.width, engine.device)
            planes = regions.pinned.to(engine.device, non_blocking=True)  # (F, Hc * 3/2, Wc) uint8
            boxes_on_regions = boxes_host - np.concatenate([origins, origins], axis=1)  # (F, 4)

            def crop_region(index: int, host=regions.host, width=canvas.width, height=canvas.height,
                            boxes_here=boxes_on_regions) -> np.ndarray:
                bgr = yuv420_to_bgr(host[index], width, height)
                return crop.crop_256(bgr, boxes_here[index])

            for index, (row, box) in enumerate(zip(rows, boxes_host)):  # first: the networks wait for them
                key = (clip, int(batch.source_indices[row]), tuple(int(value) for value in box)) if clip else None
                known = engine.remembered_latents(key) if key is not None else None
                future = None if known is not None else self._crop_future(key, pool, crop_region, index)
                crops.append((future, key, known))
            # the hard masks only (cheap); they are feathered on the device (gpu_blend.feather_masks)
            masks = [pool.submit(inner_paste_mask, batch.faces[row], box, feather)
                     for row, box in zip(rows, boxes_host)]
            cuts.append((rows, regions, planes, boxes_on_regions, masks))
        return cuts, crops

    def _crop_future(self, key: tuple | None, pool, crop_region, index: int):
        """The future of a face's crop: the one already being cut for the same frame of the clip (``key``), else
        ``crop_region(index)`` submitted to ``pool`` (and kept under ``key`` until its latents are known)."""
        future = self._pending_crops.get(key) if key is not None else None
        if future is None:
            future = pool.submit(crop_region, index)
            if key is not None:
                self._pending_crops[key] = future
        return future

    def _render_group(self, group: list[FrameBatch], cut) -> list[Downloading]:
        """The networks and the paste for a group whose host part :meth:`_cut_group` started: one pass of
        the networks and one paste over all the group's faces (a batch of 1080p frames holds 5 to 10 faces,
        and the paste is some hundred small launches whatever it holds), then each batch's regions copied
        back."""
        if cut is None:
            return self._render_on_cpu(group)
        cuts, crops = cut
        engine = self.prepared.engine
        if not crops:
            return [Downloading(batch) for batch in group]
        latents = [known for _, _, known in crops]  # (8, 32, 32) each where known, else None
        wanted = [index for index, item in enumerate(latents) if item is None]
        if wanted:
            crops_bgr = np.stack([crops[index][0].result() for index in wanted])  # (W, 256, 256, 3)
            keys = [crops[index][1] for index in wanted]
            # (W, 8, 32, 32), from memory or the avatar cache where stored, else encoded
            found = engine.unet_input_latents(crops_bgr, keys).numpy()
            for index, item in zip(wanted, found):
                latents[index] = item
            for key in keys:
                self._pending_crops.pop(key, None)
        latents = torch.from_numpy(np.stack(latents))  # (F, 8, 32, 32)
        frames = np.concatenate([batch.output_indices[cut[0]] for batch, cut in zip(group, cuts) if cut is not None])
        generated = engine.generate_faces(latents, self.audio_windows(frames))
        # the CPU path's rounding to 8 bits, and RGB to BGR: (F, 3, 256, 256) in [0, 1]
        faces_bgr = (generated.float() * 255.0).round_().clamp_(0.0, 255.0).div_(255.0).flip(1)
        present = [cut for cut in cuts if cut is not None]
        planes = torch.cat([cut[2] for cut in present]) if len(present) > 1 else present[0][2]  # (F, Hc * 3/2, Wc)
        boxes_on_regions = np.concatenate([cut[3] for cut in present])  # (F, 4)
        masks = [mask.result() for cut in present for mask in cut[4]]  # made on the host while the device works
        blend = self.config.blend
        paste_faces(planes, boxes_on_regions, faces_bgr, masks, blend.feather, blend.color_match)
        downloads, start = [], 0
        for batch, cut in zip(group, cuts):
            if cut is None:
                downloads.append(Downloading(batch))
                continue
            rows, regions = cut[0], cut[1]
            downloads.append(self._download(batch, regions, planes[start:start + len(rows)]))
            start += len(rows)
        return downloads

    def _render_on_cpu(self, group: list[FrameBatch]) -> list[Downloading]:
        """The CPU path's steps for a group (face parsing's masks or a restorer): patches from one pass of
        the networks over the group, restored and blended into each batch's BGR frames, written back into
        its I420 frames."""
        from heygem.media.frames import write_region_i420
        from heygem.render.blend import blend_patch
        from heygem.render.restore import restore_patches

        engine = self.prepared.engine
        frames_bgr = [i420_batch_to_bgr(batch.frames_i420) for batch in group]  # (n, H, W, 3) each
        rows = np.concatenate([batch.output_indices for batch in group])
        patches = engine.patches([frame for frames in frames_bgr for frame in frames],
                                 [face for batch in group for face in batch.faces], self.audio_windows(rows))
        start = 0
        for batch, frames in zip(group, frames_bgr):
            mine = patches[start:start + len(frames)]
            start += len(frames)
            if self.prepared.restoration.name != "none":
                mine = restore_patches(mine, frames, self.prepared.restoration)
            for index, patch in enumerate(mine):
                if patch is not None:
                    blend_patch(frames[index], patch, self.config.blend)
                    write_region_i420(batch.frames_i420[index], frames[index], patch.box)
        return [Downloading(batch) for batch in group]


HOST_THREADS = 8  # threads for each face's host work (OpenCV and hashlib let go of the interpreter lock)
_HOST_POOL: list = []
_HOST_POOL_LOCK = threading.Lock()


def host_pool():
    """The threads shared by every device render path for the faces' host work (crops and masks)."""
    with _HOST_POOL_LOCK:
        if not _HOST_POOL:
            _HOST_POOL.append(ThreadPoolExecutor(min(HOST_THREADS, os.cpu_count() or 1),
                                                 thread_name_prefix="musetalk-host"))
        return _HOST_POOL[0]


def inner_paste_mask(face, box, feather: float) -> np.ndarray:
    """A face's (h, w) float32 hard paste mask over its box, before its soft edge: the CPU path's lower-face hull
    (blend.lower_face_hard_mask) with its border cut away (blend.inset_mask), made on the host from the
    landmarks (some 0.05 ms; the blur that feathers it, 5-7 ms of a core for a 1080p face, runs on the device)."""
    from heygem.render.blend import feather_width, inset_mask, lower_face_hard_mask
    from heygem.types import FacePatch

    patch = FacePatch(box=tuple(int(v) for v in box), image_bgr=None, mask=None, face=face)
    return inset_mask(lower_face_hard_mask(patch), feather_width(patch.box, feather))


def lower_half_ramp(boxes: np.ndarray, height: int, device) -> torch.Tensor:
    """(F, 1, height, 1) float32: engine.lower_half_only's ramp of each box ((F, 4) on the canvas), over the
    canvas's rows: 0 down to the box's middle row, 1 from a tenth of its height below, as float32 as the host's."""
    from heygem.render.gpu_blend import to_device

    box_heights = (boxes[:, 3] - boxes[:, 1]).astype(np.float64)
    half = to_device((box_heights / 2).astype(np.float32), device)[:, None]  # (F, 1)
    scale = to_device(np.maximum(1.0, 0.1 * box_heights).astype(np.float32), device)[:, None]  # (F, 1)
    top = to_device(boxes[:, 1].astype(np.int64), device)[:, None]  # (F, 1)
    rows = (torch.arange(height, device=device)[None] - top).float()  # (F, height): rows of each box
    return ((rows - half) / scale).clamp_(0.0, 1.0)[:, None, :, None]


def bilinear_matrices(source_size: int, lengths: np.ndarray, offsets: np.ndarray, target_size: int,
                      device) -> torch.Tensor:
    """(F, target_size, source_size) float32: each face's resize of one axis as cv2.resize's default
    (INTER_LINEAR, pixel centres aligned, the border pixel repeated) from ``source_size`` samples to
    ``lengths[f]`` samples at ``offsets[f]`` of a ``target_size`` axis; zero rows elsewhere."""
    from heygem.render.gpu_blend import to_device

    # queued, not waited for (torch.as_tensor onto a GPU waits for everything queued there, the networks included)
    lengths = to_device(np.asarray(lengths, np.float64), device)[:, None]  # (F, 1)
    target = torch.arange(target_size, dtype=torch.float64, device=device) - to_device(
        np.asarray(offsets, np.float64), device)[:, None]  # (F, T)
    inside = (target >= 0) & (target < lengths)
    centre = ((target + 0.5) * (source_size / lengths) - 0.5).clamp_(min=0.0)  # (F, T)
    start = torch.floor(centre)
    fraction = centre - start
    first = start.clamp(max=source_size - 1).long()
    second = (start + 1).clamp(max=source_size - 1).long()
    matrix = torch.zeros((len(lengths), target_size, source_size), dtype=torch.float64, device=device)
    matrix.scatter_add_(2, first[..., None], ((1 - fraction) * inside)[..., None])
    matrix.scatter_add_(2, second[..., None], (fraction * inside)[..., None])
    return matrix.to(torch.float32)


def paste_faces(planes: torch.Tensor, boxes: np.ndarray, faces_bgr: torch.Tensor, masks: list[np.ndarray],
                feather: float, color_match: bool) -> None:
    """Blend each generated face into its region of ``planes`` ((F, Hc * 3/2, Wc) I420, one face a
    region), in place, as the CPU path does: the (F, 3, S, S) BGR faces in [0, 1] resized to their
    boxes ((F, 4) on the regions) bilinearly and rounded, shifted to the frame's mean colour over the
    mask's soft edge (``color_match``), alpha-blended with the CPU path's mask and converted back to I420 as
    OpenCV does (each 2x2 block's top-left pixel for U and V). ``masks`` are the hard masks
    (:func:`inner_paste_mask`, (h, w) each over its box), feathered here on the device with ``feather`` as
    blend.lower_face_mask feathers them, then kept below each box's middle (engine.lower_half_only)."""
    from heygem.render import gpu_blend
    from heygem.render.blend import feather_sigma, feather_width

    height, width = planes.shape[1] * 2 // 3, planes.shape[2]
    frame_index = np.arange(len(boxes))
    host = gpu_blend.face_canvas(frame_index, boxes, height, width, "cpu")
    canvas = gpu_blend.face_canvas(frame_index, boxes, height, width, planes.device)
    offsets = boxes[:, :2] - host.origin.numpy()  # (F, 2) x, y of each box on its canvas
    sizes = boxes[:, 2:] - boxes[:, :2]  # (F, 2) width, height
    # page-locked on a GPU: a copy from pageable memory goes through the driver's small staging buffers, each
    # waiting for the work queued before it (the networks), which held this thread for half its time
    mask_host = torch.zeros((len(boxes), 1, host.height, host.width), dtype=torch.float32,
                            pin_memory=planes.device.type == "cuda")
    mask_view = mask_host.numpy()
    for index, ((x, y), (w, h), mask) in enumerate(zip(offsets, sizes, masks)):
        mask_view[index, 0, y:y + h, x:x + w] = mask
    on_canvas = np.concatenate([offsets, offsets + sizes], axis=1)  # (F, 4) each box on its canvas
    sigmas = np.array([feather_sigma(feather_width(box, feather)) for box in boxes])  # (F,)
    mask_canvas = gpu_blend.feather_masks(mask_host.to(planes.device, non_blocking=True), on_canvas, sigmas)
    mask_canvas *= lower_half_ramp(on_canvas, host.height, planes.device)  # (F, 1, Hc, Wc)
    y, u, v = gpu_blend.gather_canvas(planes, canvas)
    regions = gpu_blend.i420_to_bgr(y, u, v)  # (F, 3, Hc, Wc) BGR in 0..255
    size = faces_bgr.shape[-1]
    rows = bilinear_matrices(size, sizes[:, 1], offsets[:, 1], host.height, planes.device)  # (F, Hc, S)
    columns = bilinear_matrices(size, sizes[:, 0], offsets[:, 0], host.width, planes.device)  # (F, Wc, S)
    scaled = (rows[:, None] @ (faces_bgr.float() * 255.0) @ columns[:, None].transpose(2, 3)).round_().clamp_(0, 255)
    if color_match:
        band = (mask_canvas > 0.02) & (mask_canvas < 0.7)  # (F, 1, Hc, Wc)
        scaled += gpu_blend.colour_shift(regions, scaled, band)[:, :, None, None]
    gpu_blend.blend_canvas(planes, canvas, regions, scaled, mask_canvas, chroma="top_left")
