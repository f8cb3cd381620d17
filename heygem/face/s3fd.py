"""Face detection with S3FD: pre-processing, anchors, box decoding and NMS around the network.

``detect_faces`` takes whole video frames, shrinks them for speed, runs the
network in batches on the device the model is on (halving the batch when that
device runs out of memory), and returns each frame's face boxes in the frame's
own pixels. Everything after the frames are uploaded (resizing, decoding,
the box overlaps for NMS) is torch, on the same device, for a whole batch at
once; only the greedy suppression itself runs on the host, per image, on the
overlap matrices of the batch brought back in one transfer. On CUDA the
detector's model is a copy with its weights in the compute precision and laid
out channels-last (:func:`prepare_s3fd`), so no convolution casts or re-lays
out its weights on each call.

Box conventions: boxes are ``x1, y1, x2, y2`` in pixels (float), width
``x2 - x1``; anchors are ``cx, cy, w, h``. Boxes are not clipped to the frame:
a face cut by the frame edge may have a box reaching past it.

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from heygem.runtime.device import inference_context, pick_device, run_in_batches
from heygem.runtime.kept import KEPT, S3FD_DETECTOR, file_identity

logger = logging.getLogger("heygem")

S3FD_EXPECTED = "the public s3fd.pth face detector (the one the face-alignment package and Wav2Lip use)"

BGR_MEANS = (104.0, 117.0, 123.0)  # subtracted from 0-255 BGR pixels; nothing is divided by 255
LEVEL_STRIDES = (4, 8, 16, 32, 64, 128)  # input pixels per cell of each detection map, finest first
ANCHOR_SIZE_PER_STRIDE = 4  # one square anchor per cell, 4 strides a side: 16, 32, ..., 512 pixels
OFFSET_VARIANCES = (0.1, 0.2)  # scales of the centre and of the log-size offsets
DEFAULT_MAX_SIDE = 640  # frames are shrunk until their longest side is at most this


def load_s3fd(checkpoint_path: Path, device: str = "auto"):
    """The S3FD network with the weights of ``checkpoint_path``, in eval mode on ``device``.

    Raises HeygemError when the file is missing, unreadable, or any key or shape differs.
    """
    from heygem.models.s3fd import S3FD
    from heygem.weights import load_state_dict_strict

    model = S3FD()
    load_state_dict_strict(model, Path(checkpoint_path), what="S3FD", expected=S3FD_EXPECTED)
    return model.to(pick_device(device)).eval()


class S3FDDetector:
    """S3FD as the face detector of heygem.face.finder: boxes for a list of frames in batched calls.

    One model serves every tracking thread; the forward passes take turns under a lock.
    Get it with :func:`shared_detector`, which loads each checkpoint once per process.
    """

    name = "s3fd"

    def __init__(self, model, precision: str = "auto", max_side: int = DEFAULT_MAX_SIDE, batch_size: int = 8):
        self.model = prepare_s3fd(model, precision)  # on CUDA a copy in the compute precision, channels-last
        self.precision = precision
        self.max_side = max_side  # frames are shrunk to this; tiles of small-face searches are enlarged to it
        self.input_side = max_side
        self.batch_size = batch_size
        self._lock = threading.Lock()

    def detect(self, frames: list, min_confidence: float = 0.5) -> list[np.ndarray]:
        """Face boxes (K, 4) float32 x1 y1 x2 y2 frame pixels, best first, for each frame ((H, W, 3) uint8 BGR
        or a heygem.media.frames frame)."""
        from heygem.media.frames import as_frame

        frames_bgr = [as_frame(frame).bgr() for frame in frames]
        results: list[np.ndarray | None] = [None] * len(frames_bgr)
        by_shape: dict[tuple, list[int]] = {}
        for index, frame in enumerate(frames_bgr):
            by_shape.setdefault(frame.shape, []).append(index)
        for indices in by_shape.values():  # one call per frame size (a run's frames share one)
            stacked = np.stack([frames_bgr[index] for index in indices])  # (N, H, W, 3)
            with self._lock:
                detections = detect_faces(self.model, stacked, max_side=self.max_side, score_threshold=min_confidence,
                                          batch_size=self.batch_size, precision=self.precision)
            for index, boxes in zip(indices, detections):
                results[index] = boxes[:, :4]
        return results

    def reset(self) -> None:
        """Nothing to forget: S3FD looks at each frame on its own."""

    def close(self) -> None:
        """The model stays loaded for the next job (see :func:`shared_detector`)."""


def shared_detector(checkpoint_path: Path, device: str = "auto", precision: str = "auto") -> S3FDDetector:
    """The detector for ``checkpoint_path`` on ``device``, loaded on first use and kept for the process
    (heygem.runtime.kept: a replaced file is loaded again)."""
    checkpoint_path = Path(checkpoint_path)

    def load() -> S3FDDetector:
        detector = S3FDDetector(load_s3fd(checkpoint_path, device), precision=precision)
        logger.info("faces: S3FD loaded from %s", checkpoint_path.name)
        return detector

    return KEPT.shared(S3FD_DETECTOR, (file_identity(checkpoint_path), device, precision), load)


def feature_map_sizes(height: int, width: int) -> list[tuple[int, int]]:
    """(rows, columns) of the six detection maps S3FD makes from a ``height`` x ``width`` input.

    Each 2x2 pool floors (strides 4 to 32), fc6's padding of 3 adds 4 cells
    to the stride-32 map, and the two stride-2 3x3 convolutions with padding 1
    round up (strides 64 and 128).
    """
    sizes = []
    rows, columns = height, width
    for level, _ in enumerate(LEVEL_STRIDES):
        if level == 0:
            rows, columns = rows // 4, columns // 4
        elif level < 3:
            rows, columns = rows // 2, columns // 2
        elif level == 3:
            rows, columns = rows // 2 + 4, columns // 2 + 4
        else:
            rows, columns = (rows + 1) // 2, (columns + 1) // 2
        sizes.append((rows, columns))
    return sizes


def make_anchors(map_sizes: list[tuple[int, int]], device=None):
    """All anchors of the detection maps, (A, 4) cx, cy, w, h in input pixels, finest level first.

    ``map_sizes`` gives (rows, columns) per level. Within a level the order is
    row by row, matching a (h, w) map flattened; a cell's anchor is centred at
    ``stride * (index + 0.5)`` and is ``4 * stride`` pixels a side. The maps from
    stride 32 on have more cells than fit in the input (see heygem.models.s3fd),
    and their last anchors lie past its edge, as they did in training.
    """
    import torch

    anchors = []
    for (rows, columns), stride in zip(map_sizes, LEVEL_STRIDES):
        centre_y = (torch.arange(rows, dtype=torch.float32, device=device) + 0.5) * stride  # (rows,)
        centre_x = (torch.arange(columns, dtype=torch.float32, device=device) + 0.5) * stride  # (columns,)
        grid_y, grid_x = torch.meshgrid(centre_y, centre_x, indexing="ij")  # (rows, columns) each
        size = torch.full_like(grid_x, float(ANCHOR_SIZE_PER_STRIDE * stride))
        anchors.append(torch.stack([grid_x, grid_y, size, size], dim=-1).reshape(-1, 4))  # (rows*columns, 4)
    return torch.cat(anchors, dim=0)  # (A, 4)


def decode_boxes(offsets, anchors):
    """Boxes x1, y1, x2, y2 from regression ``offsets`` (..., A, 4) dx, dy, dw, dh and ``anchors`` (A, 4)
    or (..., A, 4), one per offset row.

    The centre moves by ``dx * 0.1 * anchor width`` (likewise y) and the size is
    ``anchor size * exp(dw * 0.2)``: zero offsets give the anchor itself.
    """
    import torch

    centre_variance, size_variance = OFFSET_VARIANCES
    centres = anchors[..., :2] + offsets[..., :2] * centre_variance * anchors[..., 2:]  # (..., A, 2)
    sizes = anchors[..., 2:] * torch.exp(offsets[..., 2:] * size_variance)  # (..., A, 2)
    return torch.cat([centres - sizes / 2, centres + sizes / 2], dim=-1)  # (..., A, 4)


def box_overlaps(boxes_a, boxes_b):
    """Intersection over union of every box in ``boxes_a`` (..., K, 4) with every box in ``boxes_b`` (..., M, 4):
    (..., K, M). Leading dimensions (a batch of images) pair up one to one."""
    import torch

    def overlap_along(low: int, high: int):  # the overlap of the two boxes' extents along x (0, 2) or y (1, 3)
        start = torch.maximum(boxes_a[..., :, None, low], boxes_b[..., None, :, low])  # (..., K, M)
        end = torch.minimum(boxes_a[..., :, None, high], boxes_b[..., None, :, high])  # (..., K, M)
        return (end - start).clamp(min=0)

    intersection = overlap_along(0, 2) * overlap_along(1, 3)  # (..., K, M)
    area_a = (boxes_a[..., 2:] - boxes_a[..., :2]).clamp(min=0).prod(dim=-1)  # (..., K)
    area_b = (boxes_b[..., 2:] - boxes_b[..., :2]).clamp(min=0).prod(dim=-1)  # (..., M)
    union = area_a[..., :, None] + area_b[..., None, :] - intersection  # (..., K, M)
    return intersection / union.clamp(min=1e-9)


def greedy_keep(overlapping: np.ndarray) -> list[int]:
    """Positions kept by greedy suppression of boxes already sorted best first: each kept box drops every
    later box it overlaps. ``overlapping``: (K, K) bool, True where two boxes overlap too much."""
    suppressed = np.zeros(len(overlapping), dtype=bool)
    kept = []
    for position in range(len(overlapping)):
        if suppressed[position]:
            continue
        kept.append(position)
        suppressed |= overlapping[position]
    return kept


def non_maximum_suppression(boxes, scores, iou_threshold: float):
    """Indices of the boxes to keep, best score first: greedily, each kept box drops every
    lower-scored box that overlaps it by more than ``iou_threshold`` (intersection over union).
    Equal scores keep the boxes' order.

    boxes: (K, 4) x1, y1, x2, y2; scores: (K,). Returns a (kept,) int64 tensor on the boxes' device.
    """
    import torch

    order = torch.argsort(scores, descending=True, stable=True)  # (K,)
    overlapping = (box_overlaps(boxes[order], boxes[order]) > iou_threshold).cpu().numpy()  # (K, K) bool
    kept = greedy_keep(overlapping)
    return order[torch.tensor(kept, dtype=torch.int64, device=order.device)]


def resized_size(height: int, width: int, scale: float | None, max_side: int) -> tuple[int, int]:
    """The (height, width) frames are resized to: by ``scale``, or when it is None by the largest
    factor of at most 1 that fits the longest side in ``max_side``."""
    if scale is None:
        scale = min(1.0, max_side / max(height, width))
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    return max(1, round(height * scale)), max(1, round(width * scale))


def prepare_images(frames_bgr: np.ndarray, size: tuple[int, int], device, dtype=None, channels_last: bool = False):
    """Frames (N, H, W, 3) uint8 BGR as the network's input (N, 3, h, w): resized, means subtracted.

    The arithmetic is fp32; the result is cast to ``dtype`` when given (the dtype of the
    model's weights) and laid out channels-last when asked, in one copy.
    """
    import torch
    from torch.nn import functional

    frames = torch.from_numpy(np.ascontiguousarray(frames_bgr)).to(device)  # (N, H, W, 3) uint8
    images = frames.permute(0, 3, 1, 2).float()  # (N, 3, H, W) BGR 0-255
    if tuple(images.shape[2:]) != tuple(size):
        images = functional.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=True)
    means = torch.tensor(BGR_MEANS, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    images = images - means  # (N, 3, h, w) fp32
    if dtype is not None or channels_last:
        memory_format = torch.channels_last if channels_last else torch.preserve_format
        images = images.to(dtype=dtype or images.dtype, memory_format=memory_format)
    return images


def prepare_s3fd(model, precision: str = "auto", *, cast_weights: bool | None = None,
                 channels_last: bool | None = None):
    """The S3FD ``model`` as :func:`detect_faces` runs it fastest on its device.

    ``cast_weights``: the weights in the dtype of ``precision`` (fp16 or bf16), so
    the convolutions run without autocast's per-call weight casts; None does it on
    CUDA only (the CPU keeps fp32 weights, autocast does the rest there).
    ``channels_last``: the 4-D weights laid out channels-last, matching the input
    (see :func:`prepare_images`), so no convolution re-lays out its weights on each
    call; None does it on CUDA only. Returns a converted copy when anything changes
    (the given model stays as it was, since a caller may share it), else ``model``.
    """
    import copy

    import torch

    from heygem.runtime.device import autocast_dtype

    device = next(model.parameters()).device
    on_cuda = device.type == "cuda"
    dtype = autocast_dtype(device, precision)  # None: fp32
    cast = dtype is not None and (on_cuda if cast_weights is None else cast_weights)
    to_channels_last = on_cuda if channels_last is None else channels_last
    if not cast and not to_channels_last:
        return model
    prepared = copy.deepcopy(model).eval()
    if cast:
        prepared.to(dtype=dtype)
    if to_channels_last:
        for parameter in prepared.parameters():
            if parameter.dim() == 4:
                parameter.data = parameter.data.contiguous(memory_format=torch.channels_last)
    return prepared


def model_layout(model) -> tuple:
    """(dtype of the weights, whether the first convolution's weights are channels-last) of an S3FD."""
    import torch

    weight = model.conv1_1.weight
    return weight.dtype, weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()


def detect_faces(model, frames_bgr: np.ndarray, *, scale: float | None = None, max_side: int = DEFAULT_MAX_SIDE,
                 score_threshold: float = 0.5, nms_threshold: float = 0.3, batch_size: int = 8,
                 max_candidates: int = 1000, precision: str = "fp32") -> list[np.ndarray]:
    """Face boxes for each frame: a list of N arrays (K, 5) float32 ``x1, y1, x2, y2, score``.

    frames_bgr: (N, H, W, 3) uint8 BGR, all of one size. They are resized by
    ``scale`` (None: shrunk so the longest side is at most ``max_side``; never
    enlarged), and the boxes are mapped back to the frames' pixels. Boxes score
    above ``score_threshold`` (the face probability); at most ``max_candidates``
    of the best go through NMS at ``nms_threshold``. Rows are sorted by score,
    best first; a frame without a face gives a (0, 5) array. The model runs on
    its own device, ``batch_size`` frames at a time, halved on out-of-memory.
    A model whose weights are fp16 or bf16 (see :func:`prepare_s3fd`) gets its
    input in that dtype and runs without autocast; ``precision`` then has no effect.
    """
    import torch

    frames_bgr = np.asarray(frames_bgr)
    if frames_bgr.ndim != 4 or frames_bgr.shape[-1] != 3 or frames_bgr.dtype != np.uint8:
        raise ValueError(f"frames_bgr must be (N, H, W, 3) uint8, got {frames_bgr.shape} {frames_bgr.dtype}")
    if len(frames_bgr) == 0:
        return []
    device = next(model.parameters()).device
    weights_dtype, channels_last = model_layout(model)
    input_dtype = None if weights_dtype == torch.float32 else weights_dtype
    run_precision = precision if input_dtype is None else "fp32"  # cast weights: no autocast on top
    frame_height, frame_width = frames_bgr.shape[1:3]
    input_height, input_width = resized_size(frame_height, frame_width, scale, max_side)
    # input pixels -> frame pixels, for x1, y1, x2, y2
    to_frame = torch.tensor([frame_width / input_width, frame_height / input_height] * 2, device=device)

    def detect_batch(chunk: np.ndarray) -> list[np.ndarray]:
        images = prepare_images(chunk, (input_height, input_width), device, dtype=input_dtype,
                                channels_last=channels_last)  # (B, 3, h, w)
        with inference_context(device, run_precision):
            levels = model(images)
        map_sizes = tuple(tuple(logits.shape[2:]) for logits, _ in levels)
        anchors = cached_anchors(map_sizes, device)  # (A, 4)
        face_scores = torch.cat([logits.float().softmax(dim=1)[:, 1].flatten(1) for logits, _ in levels],
                                dim=1)  # (B, A)
        offsets = torch.cat([offsets.float().flatten(2).transpose(1, 2) for _, offsets in levels],
                            dim=1)  # (B, A, 4)
        return select_boxes_batch(offsets, face_scores, anchors, to_frame, score_threshold, nms_threshold,
                                  max_candidates)

    outputs, final_batch_size = run_in_batches(detect_batch, frames_bgr, batch_size)
    if final_batch_size < batch_size:
        logger.info("S3FD ran with batches of %d frames after running out of memory", final_batch_size)
    return [boxes for batch in outputs for boxes in batch]


_ANCHORS: dict[tuple, object] = {}
MAX_CACHED_ANCHORS = 8  # input sizes whose anchors are kept (a run uses one or two)


def cached_anchors(map_sizes: tuple, device):
    """:func:`make_anchors` for these map sizes on ``device``, made once per process (read-only)."""
    key = (map_sizes, str(device))
    anchors = _ANCHORS.get(key)
    if anchors is None:
        while len(_ANCHORS) >= MAX_CACHED_ANCHORS:
            del _ANCHORS[next(iter(_ANCHORS))]  # the oldest
        anchors = _ANCHORS[key] = make_anchors(list(map_sizes), device)
    return anchors


def select_boxes_batch(offsets, face_scores, anchors, to_frame, score_threshold: float, nms_threshold: float,
                       max_candidates: int, per_image_overlaps: bool | None = None) -> list[np.ndarray]:
    """Each image's detections (K, 5) float32 in frame pixels from offsets (B, A, 4) and face scores (B, A).

    The whole batch is thresholded, sorted, decoded and compared box against box on
    the device, with three transfers to the host per batch (the candidate counts, the
    overlaps, the boxes); only the greedy suppression runs per image, on the host.
    Per image it gives what :func:`select_boxes` gives. ``per_image_overlaps``: the
    overlaps image by image rather than for the batch at once (None: on the CPU, where
    a batch's (B, C, C) intermediates fall out of the cache; same values either way).
    """
    import torch

    batch, anchor_count = face_scores.shape
    top_scores, top_indices = face_scores.topk(min(max_candidates, anchor_count), dim=1)  # (B, k) each
    # equal scores in anchor order, as non_maximum_suppression's stable sort of the candidates has them
    top_indices = top_indices.sort(dim=1).values  # (B, k) anchor order
    top_scores = face_scores.gather(1, top_indices)  # (B, k)
    order = torch.argsort(top_scores, dim=1, descending=True, stable=True)  # (B, k)
    top_indices, top_scores = top_indices.gather(1, order), top_scores.gather(1, order)  # (B, k) best first
    counts = (top_scores > score_threshold).sum(dim=1).tolist()  # candidates per image: a prefix of each row
    candidate_count = max(counts)
    if candidate_count == 0:
        return [np.zeros((0, 5), dtype=np.float32) for _ in range(batch)]
    top_indices, top_scores = top_indices[:, :candidate_count], top_scores[:, :candidate_count]  # (B, C)
    boxes = decode_boxes(offsets.gather(1, top_indices[..., None].expand(-1, -1, 4)),
                         anchors[top_indices])  # (B, C, 4) input pixels
    if per_image_overlaps is None:
        per_image_overlaps = boxes.device.type == "cpu"
    if not per_image_overlaps:  # one set of kernels for the whole batch
        overlapping = box_overlaps(boxes, boxes) > nms_threshold  # (B, C, C) bool
    else:  # image by image: each image's (C, C) intermediates stay in the cache, and no padding rows
        overlapping = torch.zeros((batch, candidate_count, candidate_count), dtype=torch.bool,
                                  device=boxes.device)  # (B, C, C)
        for item, count in enumerate(counts):
            overlapping[item, :count, :count] = box_overlaps(boxes[item, :count], boxes[item, :count]) > nms_threshold
    overlapping = overlapping.cpu().numpy()  # (B, C, C) bool
    detections = torch.cat([boxes * to_frame, top_scores[..., None]], dim=2).cpu().numpy()  # (B, C, 5) frame pixels
    results = []
    for item, count in enumerate(counts):
        kept = greedy_keep(overlapping[item, :count, :count])  # positions, best first
        results.append(detections[item, kept].astype(np.float32))  # (K, 5)
    return results


def select_boxes(offsets, face_scores, anchors, to_frame, score_threshold: float, nms_threshold: float,
                 max_candidates: int) -> np.ndarray:
    """One image's detections (K, 5) float32 in frame pixels from offsets (A, 4) and face scores (A,).

    The plain per-image form of :func:`select_boxes_batch` (several host round trips per image).
    """
    import torch

    candidates = torch.nonzero(face_scores > score_threshold).flatten()  # (C,)
    if len(candidates) > max_candidates:
        candidates = candidates[face_scores[candidates].topk(max_candidates).indices]
    if len(candidates) == 0:
        return np.zeros((0, 5), dtype=np.float32)
    boxes = decode_boxes(offsets[candidates], anchors[candidates])  # (C, 4) input pixels
    scores = face_scores[candidates]  # (C,)
    kept = non_maximum_suppression(boxes, scores, nms_threshold)  # (K,)
    detections = torch.cat([boxes[kept] * to_frame, scores[kept, None]], dim=1)  # (K, 5) frame pixels
    return detections.cpu().numpy().astype(np.float32)
