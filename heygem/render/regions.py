"""The device render paths' plumbing: each face's region of the I420 frames cut into a host buffer
(page-locked on CUDA), sent to the device, drawn on there, copied back and pasted into the frames,
as two stages so that one batch comes back while the next is drawn. Only the bytes under each
face's mask change.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from heygem.config import Config
from heygem.media.frames import i420_planes
from heygem.render.prepared import Prepared
from heygem.runtime.flow import Stage
from heygem.types import FrameBatch


class HostBuffer:
    """A uint8 host buffer, page-locked on CUDA so that copies to and from the device run at full speed
    and the copy back does not hold up the thread that queued it."""

    def __init__(self, size: int, pinned: bool):
        import torch

        self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        self.array = self.tensor.numpy()


@dataclass
class Regions:
    """The face regions of one batch, cut out of its frames into a host buffer."""

    rows: list[int]  # the batch's frame of each region
    origins: np.ndarray  # (F, 2) even x, y of each region in its frame
    buffer: HostBuffer
    host: np.ndarray  # (F, Hc * 3/2, Wc) uint8, a view of the buffer
    pinned: object  # the same bytes as a torch tensor: what is uploaded and copied back into


@dataclass
class Downloading:
    """A batch whose face regions are on their way back from the device into their host buffer."""

    batch: FrameBatch
    regions: Regions | None = None  # None: nothing to paste
    done: object = None  # a torch.cuda.Event recorded after the copy back (None on the CPU: already there)


class RegionRender:
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
        self._free: list[HostBuffer] = []
        self._free_lock = threading.Lock()

    def stages(self) -> list[Stage]:
        return [Stage("render", self.render), Stage("paste", self.paste)]

    def render(self, batches: Iterator) -> Iterator[Downloading]:
        import torch

        for batch in batches:
            with torch.inference_mode():
                downloading = self._render(batch)
            yield downloading

    def _render(self, batch) -> Downloading:
        raise NotImplementedError

    def paste(self, items: Iterator[Downloading]) -> Iterator[FrameBatch]:
        """Put each batch's regions back into its frames once they are back from the device."""
        for item in items:
            regions = item.regions
            if regions is not None:
                if item.done is not None:
                    item.done.synchronize()
                for region_plane, frame_window in region_windows(regions.host, item.batch.frames_i420, regions.rows,
                                                                  regions.origins):
                    frame_window[...] = region_plane
                with self._free_lock:
                    self._free.append(regions.buffer)
            yield item.batch

    def _cut(self, batch: FrameBatch, rows: list[int], origins: np.ndarray, height: int, width: int,
             device) -> Regions:
        """The regions at ``origins`` ((F, 2) even x, y, ``height`` x ``width`` each) of the batch's
        frames ``rows``, copied into a free host buffer for ``device``."""
        shape = (len(rows), height * 3 // 2, width)
        size = int(np.prod(shape))
        buffer = self._take_buffer(size, device)
        host = buffer.array[:size].reshape(shape)  # (F, Hc * 3/2, Wc)
        for region_plane, frame_window in region_windows(host, batch.frames_i420, rows, origins):
            region_plane[...] = frame_window
        return Regions(rows=rows, origins=origins, buffer=buffer, host=host, pinned=buffer.tensor[:size].view(shape))

    @staticmethod
    def _download(batch: FrameBatch, regions: Regions, planes) -> Downloading:
        """Queue the copy of ``planes`` (the regions on the device) back into their host buffer,
        after the work queued on them."""
        import torch

        regions.pinned.copy_(planes, non_blocking=True)
        done = None
        if planes.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Downloading(batch, regions, done)

    def _take_buffer(self, size: int, device) -> HostBuffer:
        """A free host buffer of at least ``size`` bytes (a new one, with room to spare, when none is)."""
        with self._free_lock:
            for index, buffer in enumerate(self._free):
                if buffer.array.size >= size:
                    return self._free.pop(index)
            if self._free:  # too small for this batch's regions: let it go
                self._free.pop(0)
        return HostBuffer(max(size + size // 4, 1 << 20), pinned=device.type == "cuda")


def region_windows(regions: np.ndarray, frames: np.ndarray, rows: list[int], origins: np.ndarray):
    """For each face and each I420 plane: (the plane of its region (F, Hc * 3/2, Wc), the same window of
    its frame's plane (N, H * 3/2, W) as a view, at the region's even ``origins`` (F, 2) x, y)."""
    for region, row, (x, y) in zip(regions, rows, origins):
        for region_plane, frame_plane, scale in zip(i420_planes(region), i420_planes(frames[row]),
                                                    (1, 2, 2)):
            height, width = region_plane.shape
            yield region_plane, frame_plane[y // scale: y // scale + height, x // scale: x // scale + width]


def landmarks_or_nan(face) -> np.ndarray:
    if face.landmarks is None:
        return np.full((468, 2), np.nan, dtype=np.float32)
    return face.landmarks
