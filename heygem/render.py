"""Steps 5c-5e: mouth patches from the engine, restored, and blended into the frames.

On the CPU the frames are converted to BGR and the engine, the restorer and the blender run as
three stages (heygem.engines, heygem.restore, heygem.blend). On a GPU the wav2lip engine's whole
batch stays on the device from upload to download (heygem.gpu_blend), GFPGAN restoration included
(heygem.restore_gfpgan); with --render torch the landmark engine draws its mouths the same way
(heygem.engines.landmark_torch).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from heygem.blend import blend_patch
from heygem.config import Config
from heygem.errors import HeygemError
from heygem.media.frames import i420_batch_to_bgr, i420_planes, paste_i420_window, write_region_i420
from heygem.restore import Restoration, restore_patches
from heygem.runtime.flow import Stage, StageClock
from heygem.speech import audio
from heygem.types import EngineBatch, FrameBatch


class Prepared:
    """What the background threads prepare while the first frames are decoded and tracked: the
    mel spectrogram, the loaded engine and the restorer (with its network for gfpgan). The render
    stages ask for them when their first batch arrives, so loading the networks overlaps with
    decoding and face tracking."""

    def __init__(self, mel_future: Future, engine_future: Future, frame_count: int, fps: float, clock: StageClock,
                 restoration_future: Future | None = None):
        self._mel_future = mel_future
        self._engine_future = engine_future
        self._restoration_future = restoration_future  # None: no restoration
        self._frame_count = frame_count
        self.fps = fps
        self._clock = clock
        self._lock = threading.Lock()
        self._mel = self._engine = self._window_starts = self._restoration = None

    def _resolve(self) -> None:
        with self._lock:
            if self._engine is None:
                mel, mel_seconds = self._mel_future.result()
                engine, engine_seconds = self._engine_future.result()
                restoration = Restoration("none", 0.0)
                if self._restoration_future is not None:
                    restoration, restorer_seconds = self._restoration_future.result()
                    if restoration.network is not None:
                        self._clock.add("load_restorer", restorer_seconds)
                self._clock.add("audio", mel_seconds)
                self._clock.add("load_engine", engine_seconds)
                self._window_starts = audio.mel_window_starts(self._frame_count, self.fps, mel.shape[1])
                self._mel, self._engine, self._restoration = mel, engine, restoration

    @property
    def engine(self):
        self._resolve()
        return self._engine

    @property
    def restoration(self) -> Restoration:
        self._resolve()
        return self._restoration

    def mel_windows(self, output_indices: np.ndarray) -> np.ndarray:
        """(N, 80, 16) float32 mel windows of these output frames."""
        self._resolve()
        return audio.mel_windows(self._mel, self._window_starts[output_indices])


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


class CpuRender:
    """Steps 5b-5d on the CPU: the engine's patches, restored, blended into BGR frames. An engine
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
        """Restore the patches with the chosen restorer (heygem.restore.choose_restorer)."""
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


class _HostBuffer:
    """A uint8 host buffer, page-locked on CUDA so that copies to and from the device run at full speed
    and the copy back does not hold up the thread that queued it."""

    def __init__(self, size: int, pinned: bool):
        import torch

        self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        self.array = self.tensor.numpy()


@dataclass
class _Regions:
    """The face regions of one batch, cut out of its frames into a host buffer."""

    rows: list[int]  # the batch's frame of each region
    origins: np.ndarray  # (F, 2) even x, y of each region in its frame
    buffer: _HostBuffer
    host: np.ndarray  # (F, Hc * 3/2, Wc) uint8, a view of the buffer
    pinned: object  # the same bytes as a torch tensor: what is uploaded and copied back into


@dataclass
class _Downloading:
    """A batch whose face regions are on their way back from the device into their host buffer."""

    batch: FrameBatch
    regions: _Regions | None = None  # None: nothing to paste
    done: object = None  # a torch.cuda.Event recorded after the copy back (None on the CPU: already there)


class _RegionRender:
    """Stages shared by the device render paths. "render", per batch: cut each face's region out of
    the I420 frames into a host buffer (page-locked on CUDA; ``_cut``), upload it, draw on the device
    and queue the copy back (``_render``, per class; ``_download``). "paste": wait for that copy and
    put the regions back into the frames. So while one batch's bytes come back and are pasted, the
    next batch is cut out and queued on the device: nothing in "render" waits for it."""

    bytes_per_pixel = 1.5  # batches stay I420

    def __init__(self, prepared: Prepared, config: Config):
        self.prepared = prepared
        self.config = config
        # free buffers, reused batch after batch; as many exist as batches were in flight at once
        self._free: list[_HostBuffer] = []
        self._free_lock = threading.Lock()

    def stages(self) -> list[Stage]:
        return [Stage("render", self.render), Stage("paste", self.paste)]

    def render(self, batches: Iterator) -> Iterator[_Downloading]:
        import torch

        for batch in batches:
            with torch.inference_mode():
                downloading = self._render(batch)
            yield downloading

    def _render(self, batch) -> _Downloading:
        raise NotImplementedError

    def paste(self, items: Iterator[_Downloading]) -> Iterator[FrameBatch]:
        """Put each batch's regions back into its frames once they are back from the device."""
        for item in items:
            regions = item.regions
            if regions is not None:
                if item.done is not None:
                    item.done.synchronize()
                for region_plane, frame_window in _region_windows(regions.host, item.batch.frames_i420, regions.rows,
                                                                  regions.origins):
                    frame_window[...] = region_plane
                with self._free_lock:
                    self._free.append(regions.buffer)
            yield item.batch

    def _cut(self, batch: FrameBatch, rows: list[int], origins: np.ndarray, height: int, width: int,
             device) -> _Regions:
        """The regions at ``origins`` ((F, 2) even x, y, ``height`` x ``width`` each) of the batch's
        frames ``rows``, copied into a free host buffer for ``device``."""
        shape = (len(rows), height * 3 // 2, width)
        size = int(np.prod(shape))
        buffer = self._take_buffer(size, device)
        host = buffer.array[:size].reshape(shape)  # (F, Hc * 3/2, Wc)
        for region_plane, frame_window in _region_windows(host, batch.frames_i420, rows, origins):
            region_plane[...] = frame_window
        return _Regions(rows=rows, origins=origins, buffer=buffer, host=host, pinned=buffer.tensor[:size].view(shape))

    @staticmethod
    def _download(batch: FrameBatch, regions: _Regions, planes) -> _Downloading:
        """Queue the copy of ``planes`` (the regions on the device) back into their host buffer,
        after the work queued on them."""
        import torch

        regions.pinned.copy_(planes, non_blocking=True)
        done = None
        if planes.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return _Downloading(batch, regions, done)

    def _take_buffer(self, size: int, device) -> _HostBuffer:
        """A free host buffer of at least ``size`` bytes (a new one, with room to spare, when none is)."""
        with self._free_lock:
            for index, buffer in enumerate(self._free):
                if buffer.array.size >= size:
                    return self._free.pop(index)
            if self._free:  # too small for this batch's regions: let it go
                self._free.pop(0)
        return _HostBuffer(max(size + size // 4, 1 << 20), pinned=device.type == "cuda")


class GpuRender(_RegionRender):
    """Steps 5c-5e on the GPU for the wav2lip engine, frames on the device from upload to download.

    Two stages (see _RegionRender). "render", per batch: cut each face's region out of the I420
    frames into a page-locked buffer, upload it, crop every face to 96x96 (heygem.gpu_blend), run
    the generator on the masked crops and the mel windows, sharpen what it changed (--restorer
    sharpen), paste the patches back with the feathered, colour-matched lower-face mask, restore
    the pasted lower face with GFPGAN (--restorer gfpgan: aligned, restored and blended back on the
    device, heygem.restore_gfpgan), and queue the copy back. "paste": wait for that copy and put the
    regions back into the frames. Only the bytes under the masks change; ffmpeg gets the I420
    frames as they come back.
    """

    def _render(self, batch: FrameBatch) -> _Downloading:
        import torch

        from heygem import gpu_blend
        from heygem.engines.wav2lip import FACE_SIZE

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


def _region_windows(regions: np.ndarray, frames: np.ndarray, rows: list[int], origins: np.ndarray):
    """For each face and each I420 plane: (the plane of its region (F, Hc * 3/2, Wc), the same window of
    its frame's plane (N, H * 3/2, W) as a view, at the region's even ``origins`` (F, 2) x, y)."""
    for region, row, (x, y) in zip(regions, rows, origins):
        for region_plane, frame_plane, scale in zip(i420_planes(region), i420_planes(frames[row]),
                                                    (1, 2, 2)):
            height, width = region_plane.shape
            yield region_plane, frame_plane[y // scale: y // scale + height, x // scale: x // scale + width]


def _with_crop_footprints(boxes: np.ndarray, landmarks: np.ndarray, frame_height: int, frame_width: int) -> np.ndarray:
    """(F, 4) boxes widened to the frame pixels each face's aligned GFPGAN square is sampled from
    (faces without landmarks keep their box)."""
    from heygem.restore_gfpgan import alignment_matrices, crop_footprints

    widened = boxes.copy()
    usable = np.isfinite(landmarks).all(axis=(1, 2))  # (F,)
    if usable.any():
        footprints = crop_footprints(alignment_matrices(landmarks[usable]), frame_height, frame_width)  # (U, 4)
        widened[usable, :2] = np.minimum(boxes[usable, :2], footprints[:, :2])
        widened[usable, 2:] = np.maximum(boxes[usable, 2:], footprints[:, 2:])
    return widened


def _landmarks_or_nan(face) -> np.ndarray:
    if face.landmarks is None:
        return np.full((468, 2), np.nan, dtype=np.float32)
    return face.landmarks
