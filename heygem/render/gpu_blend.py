"""Stages 4-6 on the device: crop faces out of I420 frames, sharpen, mask, colour-match, paste back.

Frames stay in the layout ffmpeg decodes and encodes: a batch of I420 frames is
(N, H * 3/2, W) uint8, H rows of Y, then the U plane, then the V plane (each
(H/2, W/2), stored one after the other), BT.601 limited range, as OpenCV's
COLOR_BGR2YUV_I420 lays them out. Only each face box's region is converted to
BGR and back; bytes outside the blend mask are never written.

All faces of a batch share one canvas: each box's region, widened to even
coordinates so that it covers whole 2x2 chroma blocks, and padded to the
batch's largest region. Canvas pixels are gathered with index tensors, and
every resampling is a pair of per-face matrices applied with batched matmuls,
so a batch costs a fixed number of tensor operations whatever its face count.

Everything runs on whichever device the planes are on (the CPU in tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional

from heygem.render.blend import LOWER_FACE_POINTS, MIN_EDGE_PIXELS
from heygem.render.sharpen import CHANGE_THRESHOLD

FACE_SIZE = 96  # the Wav2Lip generator's input and output size

# OpenCV's BT.601 limited-range coefficients (fixed point, 20 fractional bits)
_SCALE = float(1 << 20)
_Y_FROM_RGB = (269484 / _SCALE, 528482 / _SCALE, 102760 / _SCALE)
_U_FROM_RGB = (-155188 / _SCALE, -305135 / _SCALE, 460324 / _SCALE)
_V_FROM_RGB = (460324 / _SCALE, -385875 / _SCALE, -74448 / _SCALE)
_RGB_FROM_Y = 1220542 / _SCALE
_R_FROM_V = 1673527 / _SCALE
_G_FROM_V = -852492 / _SCALE
_G_FROM_U = -409993 / _SCALE
_B_FROM_U = 2116026 / _SCALE

_CUBIC_A = -0.75  # OpenCV's INTER_CUBIC kernel parameter
_ELLIPSE_VERTICES = 48  # a fallback ellipse is this polygon; under half a pixel off for 300-pixel boxes
_NO_EDGE = 1.0e9  # distance reported by padding edges of a hull, so they never win the minimum
_EDGES_AT_ONCE = 8  # hull edges whose distances are computed in one pass (F x 8 canvases of float32)


# ---------------------------------------------------------------------------------------------
# Colour conversion of regions


def i420_to_bgr(y: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """I420 regions to BGR, as OpenCV's COLOR_YUV2BGR_I420 does (chroma nearest-upsampled).

    y: (N, h, w) uint8; u, v: (N, h/2, w/2) uint8 -> (N, 3, h, w) float32 BGR, whole numbers in 0..255.
    """
    count, height, width = y.shape
    luma = (y.float() - 16.0).mul_(_RGB_FROM_Y).view(count, 1, height // 2, 2, width // 2, 2)
    chroma_u = u.float() - 128.0  # (N, h/2, w/2)
    chroma_v = v.float() - 128.0
    offsets = torch.stack((_B_FROM_U * chroma_u,
                           _G_FROM_U * chroma_u + _G_FROM_V * chroma_v,
                           _R_FROM_V * chroma_v), dim=1)  # (N, 3, h/2, w/2) B, G, R offsets
    # each chroma sample serves its 2x2 block: (N, 1, h/2, 2, w/2, 2) + (N, 3, h/2, 1, w/2, 1)
    bgr = (luma + offsets[:, :, :, None, :, None]).view(count, 3, height, width)
    return bgr.round_().clamp_(0.0, 255.0)


def bgr_to_i420(bgr: torch.Tensor, chroma: str = "average") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BGR regions to I420 planes, the inverse of :func:`i420_to_bgr`.

    bgr: (N, 3, h, w) float32 in 0..255 (h, w even) -> y (N, h, w), u and v (N, h/2, w/2), uint8.
    ``chroma="average"`` takes each 2x2 block's mean colour for U and V (no aliasing on sharp
    edges); ``"top_left"`` takes the block's top-left pixel, which is what OpenCV's
    COLOR_BGR2YUV_I420 does, for output that must match OpenCV's.
    """
    blue, green, red = bgr.unbind(1)  # each (N, h, w)
    luma = red * _Y_FROM_RGB[0] + green * _Y_FROM_RGB[1] + blue * _Y_FROM_RGB[2] + 16.0
    if chroma == "average":
        block = functional.avg_pool2d(bgr, 2)  # (N, 3, h/2, w/2)
    elif chroma == "top_left":
        block = bgr[:, :, 0::2, 0::2]  # (N, 3, h/2, w/2)
    else:
        raise ValueError(f"chroma must be 'average' or 'top_left', not {chroma!r}")
    blue, green, red = block.unbind(1)  # each (N, h/2, w/2)
    chroma_u = red * _U_FROM_RGB[0] + green * _U_FROM_RGB[1] + blue * _U_FROM_RGB[2] + 128.0
    chroma_v = red * _V_FROM_RGB[0] + green * _V_FROM_RGB[1] + blue * _V_FROM_RGB[2] + 128.0
    return tuple(plane.round().clamp_(0.0, 255.0).to(torch.uint8) for plane in (luma, chroma_u, chroma_v))


def split_planes(planes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the Y (N, H, W), U and V (N, H/2, W/2) planes of contiguous (N, H * 3/2, W) I420 frames."""
    count, rows, width = planes.shape
    height = rows * 2 // 3
    if rows != height * 3 // 2 or height % 2 or width % 2:
        raise ValueError(f"I420 frames need an even height and width; got planes of shape {tuple(planes.shape)}")
    if not planes.is_contiguous():
        raise ValueError("I420 planes must be contiguous so that they can be written in place")
    flat = planes.view(count, rows * width)
    luma_size, chroma_size = height * width, height * width // 4
    y = flat[:, :luma_size].view(count, height, width)
    u = flat[:, luma_size:luma_size + chroma_size].view(count, height // 2, width // 2)
    v = flat[:, luma_size + chroma_size:].view(count, height // 2, width // 2)
    return y, u, v


# ---------------------------------------------------------------------------------------------
# The per-batch canvas


@dataclass(frozen=True)
class FaceCanvas:
    """Where each face's canvas lies in its frame; every canvas has the same even size.

    A canvas covers its box widened to even coordinates and lies wholly inside its frame.
    """

    frame_index: torch.Tensor  # (F,) int64, which frame of the batch each face is in
    boxes: torch.Tensor  # (F, 4) int64 x1, y1, x2, y2 in frame pixels, x2/y2 exclusive
    origin: torch.Tensor  # (F, 2) int64 even x, y of each canvas's top-left pixel in its frame
    height: int  # even
    width: int  # even
    host_boxes: np.ndarray | None = None  # (F, 4) int64, ``boxes`` on the host (None: read them back)
    one_per_frame: bool = False  # no two faces share a frame, so no two canvases overlap

    @property
    def box_offset(self) -> torch.Tensor:
        """(F, 2) int64 x, y of each box's top-left pixel on its canvas."""
        return self.boxes[:, :2] - self.origin

    @property
    def box_size(self) -> torch.Tensor:
        """(F, 2) int64 width, height of each box."""
        return self.boxes[:, 2:] - self.boxes[:, :2]


def face_canvas(frame_index, boxes, frame_height: int, frame_width: int, device: torch.device | str) -> FaceCanvas:
    """The canvas for faces at ``boxes`` ((F, 4) x1 y1 x2 y2) in frames ``frame_index`` ((F,)).

    Give host arrays where you have them: tensors on a GPU are read back, which waits for
    everything queued on it.
    """
    boxes_cpu = np.asarray(torch.as_tensor(boxes).cpu(), dtype=np.int64).reshape(-1, 4)  # (F, 4)
    index_cpu = np.asarray(torch.as_tensor(frame_index).cpu(), dtype=np.int64).reshape(-1)  # (F,)
    if len(index_cpu) != len(boxes_cpu) or len(boxes_cpu) == 0:
        raise ValueError("need one frame index per box and at least one box; "
                         f"got {len(index_cpu)} and {len(boxes_cpu)}")
    x1, y1, x2, y2 = boxes_cpu.T
    if (x1 < 0).any() or (y1 < 0).any() or (x2 > frame_width).any() or (y2 > frame_height).any() \
            or (x2 <= x1).any() or (y2 <= y1).any():
        raise ValueError(f"boxes must be non-empty and inside the {frame_width}x{frame_height} frame: "
                         f"{boxes_cpu.tolist()}")
    left, top = x1 & ~1, y1 & ~1  # (F,) even
    right, bottom = x2 + (x2 & 1), y2 + (y2 & 1)  # (F,) even, at most the (even) frame size
    width, height = int((right - left).max()), int((bottom - top).max())
    # shift canvases that would run off the frame's right or bottom edge back inside (still even)
    origin = np.stack((np.minimum(left, frame_width - width), np.minimum(top, frame_height - height)), axis=1)
    return FaceCanvas(frame_index=to_device(index_cpu, device), boxes=to_device(boxes_cpu, device),
                      origin=to_device(origin, device), height=height, width=width, host_boxes=boxes_cpu,
                      one_per_frame=len(np.unique(index_cpu)) == len(index_cpu))


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A small host array as a tensor on ``device`` without waiting for the work queued there: CUDA copies
    pageable memory to its own staging buffer before the call returns, so the array may change
    afterwards (a blocking copy would wait for the GPU to finish everything queued first). Not for large
    arrays (megabytes): those pass through several staging buffers, each waiting for the work queued before
    it; copy them from page-locked memory instead."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


def _plane_rows(planes: torch.Tensor, canvas: FaceCanvas) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each plane: a (rows, row length) view of ``planes`` and the canvas's rows (F, h) and columns (F, w) in it.

    Y rows are frame rows: frame n's row r is row n * 3H/2 + r of the (N * 3H/2, W) view. U and V
    rows are half as long, so they index a (N * 3H, W/2) view: frame n's U row j is row
    n * 3H + 2H + j there, its V row j is row n * 3H + 2H + H/2 + j.
    """
    count, rows, width = planes.shape
    height = rows * 2 // 3
    device = canvas.origin.device
    frame = canvas.frame_index[:, None]  # (F, 1)
    luma_rows = canvas.origin[:, 1:2] + torch.arange(canvas.height, device=device)  # (F, Hc) frame rows
    luma_columns = canvas.origin[:, 0:1] + torch.arange(canvas.width, device=device)  # (F, Wc)
    chroma_rows = luma_rows[:, 0::2] // 2  # (F, Hc/2) chroma-plane rows
    chroma_columns = luma_columns[:, 0::2] // 2  # (F, Wc/2)
    half_rows = planes.view(count * 3 * height, width // 2)
    return {
        "y": (planes.view(count * rows, width), frame * rows + luma_rows, luma_columns),
        "u": (half_rows, frame * 3 * height + 2 * height + chroma_rows, chroma_columns),
        "v": (half_rows, frame * 3 * height + 2 * height + height // 2 + chroma_rows, chroma_columns),
    }


def _gather(rows_view: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """rows_view[rows[f, i], columns[f, j]] as (F, h, w): whole rows first, then the columns of each."""
    faces, height = rows.shape
    picked = rows_view.index_select(0, rows.reshape(-1)).view(faces, height, -1)  # (F, h, row length)
    return torch.gather(picked, 2, columns[:, None, :].expand(faces, height, columns.shape[1]))  # (F, h, w)


def gather_canvas(planes: torch.Tensor, canvas: FaceCanvas) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each face's canvas of I420 ``planes``: y (F, Hc, Wc), u and v (F, Hc/2, Wc/2) uint8 copies."""
    split_planes(planes)  # checks the layout
    views = _plane_rows(planes, canvas)
    return tuple(_gather(*views[name]) for name in ("y", "u", "v"))


# ---------------------------------------------------------------------------------------------
# Resampling as per-face matrices


def _cubic_weights(fraction: torch.Tensor) -> torch.Tensor:
    """OpenCV's INTER_CUBIC weights of the 4 taps around each sample: (...,) -> (..., 4)."""
    a = _CUBIC_A
    x = fraction
    w0 = ((a * (x + 1) - 5 * a) * (x + 1) + 8 * a) * (x + 1) - 4 * a
    w1 = ((a + 2) * x - (a + 3)) * x * x + 1
    w2 = ((a + 2) * (1 - x) - (a + 3)) * (1 - x) * (1 - x) + 1
    return torch.stack((w0, w1, w2, 1 - w0 - w1 - w2), dim=-1)


def _resize_matrix(source_length: torch.Tensor, target_length: torch.Tensor,
                   source_offset: torch.Tensor, target_offset: torch.Tensor,
                   source_size: int, target_size: int, method: torch.Tensor) -> torch.Tensor:
    """Per-face matrices that resize one axis as cv2.resize does: (F, target_size, source_size) float32.

    Face f's samples lie at source_offset[f] .. + source_length[f] on a source axis of
    ``source_size`` positions and go to target_offset[f] .. + target_length[f] on a target axis of
    ``target_size`` positions; every other row and column of its matrix is 0. ``method`` (F,) int64:
    0 averages the covered source pixels (INTER_AREA shrinking), 1 is INTER_AREA's two-tap linear
    form (INTER_AREA enlarging), 2 is INTER_CUBIC with the border pixels repeated.
    """
    device = source_length.device
    source_length = source_length.to(torch.float64)[:, None]  # (F, 1)
    target_length = target_length.to(torch.float64)[:, None]  # (F, 1)
    scale = source_length / target_length  # (F, 1) source pixels per target pixel
    target = torch.arange(target_size, device=device, dtype=torch.float64) - target_offset[:, None]  # (F, T)
    inside = (target >= 0) & (target < target_length)  # (F, T)

    # area: the overlap of source pixel [x, x + 1) with the target pixel's span [t * scale, (t + 1) * scale)
    source = torch.arange(source_size, device=device, dtype=torch.float64) - source_offset[:, None]  # (F, S)
    span_start, span_end = (target * scale)[:, :, None], ((target + 1) * scale)[:, :, None]  # (F, T, 1)
    overlap = (torch.minimum(source[:, None, :] + 1, span_end)
               - torch.maximum(source[:, None, :], span_start)).clamp_(min=0)  # (F, T, S)
    area = overlap / scale[:, :, None]

    # linear (INTER_AREA enlarging) and cubic taps: (F, T, 4) source positions and weights
    start = torch.floor(target * scale)  # (F, T)
    fraction = (target + 1) - (start + 1) / scale
    fraction = torch.where(fraction <= 0, torch.zeros_like(fraction), fraction - torch.floor(fraction))
    linear_taps = torch.stack((start, start + 1, start, start), dim=-1)  # (F, T, 4), last two weigh 0
    zero = torch.zeros_like(fraction)
    linear_weights = torch.stack((1 - fraction, fraction, zero, zero), dim=-1)
    centre = (target + 0.5) * scale - 0.5  # (F, T)
    cubic_start = torch.floor(centre)
    cubic_taps = cubic_start[..., None] + torch.arange(-1, 3, device=device, dtype=torch.float64)  # (F, T, 4)
    cubic_weights = _cubic_weights(centre - cubic_start)  # (F, T, 4)

    cubic = (method == 2)[:, None, None]  # (F, 1, 1)
    taps = torch.where(cubic, cubic_taps, linear_taps)
    taps = torch.minimum(taps.clamp(min=0), source_length[:, :, None] - 1)  # repeat the border pixels
    taps = (taps + source_offset[:, None, None]).clamp_(0, source_size - 1).long()  # (F, T, 4)
    weights = torch.where(cubic, cubic_weights, linear_weights) * inside[:, :, None]  # (F, T, 4)
    tapped = torch.zeros_like(area).scatter_add_(2, taps, weights)  # (F, T, S)

    matrix = torch.where((method == 0)[:, None, None], area * inside[:, :, None], tapped)
    return matrix.to(torch.float32)


def _resize_methods(source_size: torch.Tensor, target_size: torch.Tensor, cubic_when_larger: bool) -> torch.Tensor:
    """(F,) method codes for :func:`_resize_matrix`; sizes are (F, 2) width, height."""
    shrinking = (target_size <= source_size).all(dim=1)  # INTER_AREA averages only when both axes shrink
    method = torch.where(shrinking, 0, 1)
    if cubic_when_larger:  # as engines.wav2lip.resize_to_box: cubic unless the box has fewer pixels
        larger = target_size.prod(dim=1) >= source_size.prod(dim=1)
        method = torch.where(larger, 2, method)
    return method


# ---------------------------------------------------------------------------------------------
# The stages


def crop_faces(planes: torch.Tensor, frame_index, boxes, size: int = FACE_SIZE) -> torch.Tensor:
    """Each box of I420 ``planes`` (N, H * 3/2, W) uint8, resized to (F, 3, size, size) float32 BGR in [0, 1].

    ``boxes`` (F, 4) x1 y1 x2 y2 (x2/y2 exclusive) lie in frames ``frame_index`` (F,). Boxes larger
    than ``size`` are shrunk by averaging like cv2.resize(INTER_AREA); smaller ones are enlarged
    with INTER_AREA's linear form, so the crops match engines.wav2lip.crop_face of the BGR frame.
    """
    frame_height, frame_width = planes.shape[1] * 2 // 3, planes.shape[2]
    if len(boxes) == 0:
        return torch.zeros((0, 3, size, size), dtype=torch.float32, device=planes.device)
    canvas = face_canvas(frame_index, boxes, frame_height, frame_width, planes.device)
    y, u, v = gather_canvas(planes, canvas)
    regions = i420_to_bgr(y, u, v)  # (F, 3, Hc, Wc) BGR in 0..255
    offset, box_size = canvas.box_offset, canvas.box_size  # (F, 2) x, y
    target = torch.full_like(box_size, size)
    method = _resize_methods(box_size, target, cubic_when_larger=False)  # (F,)
    no_offset = torch.zeros_like(offset[:, 0])
    # rows: (F, S, Hc), columns: (F, S, Wc)
    rows = _resize_matrix(box_size[:, 1], target[:, 1], offset[:, 1], no_offset, canvas.height, size, method)
    columns = _resize_matrix(box_size[:, 0], target[:, 0], offset[:, 0], no_offset, canvas.width, size, method)
    crops = rows[:, None] @ regions @ columns[:, None].transpose(2, 3)  # (F, 3, S, S)
    return crops.round_().clamp_(0.0, 255.0).div_(255.0)  # rounded like OpenCV's uint8 result


def gaussian_radius(sigma: float) -> int:
    """Half the tap count of OpenCV's Gaussian kernel for float images and ksize 0: round(8 sigma + 1)
    taps, made odd."""
    return (round(8.0 * float(sigma) + 1.0) | 1) // 2


def gaussian_blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """cv2.GaussianBlur(images, (0, 0), sigma) of (B, C, h, w) float32: separable, BORDER_REFLECT_101."""
    radius = gaussian_radius(sigma)
    taps = torch.arange(-radius, radius + 1, device=images.device, dtype=torch.float32)
    kernel = torch.exp(-(taps ** 2) / (2 * sigma * sigma))
    kernel = kernel / kernel.sum()  # (K,)
    channels = images.shape[1]
    padded = functional.pad(images, (radius, radius, radius, radius), mode="reflect")  # (B, C, h + 2r, w + 2r)
    horizontal = kernel.view(1, 1, 1, -1).expand(channels, 1, 1, -1)
    vertical = kernel.view(1, 1, -1, 1).expand(channels, 1, -1, 1)
    blurred = functional.conv2d(padded, horizontal, groups=channels)  # (B, C, h + 2r, w)
    return functional.conv2d(blurred, vertical, groups=channels)  # (B, C, h, w)


def feather_masks(inner: torch.Tensor, boxes: np.ndarray, sigmas: np.ndarray) -> torch.Tensor:
    """blend.feather_mask of each face, on its canvas: (F, 1, Hc, Wc) float32 in [0, 1].

    ``inner`` (F, 1, Hc, Wc) float32 holds each face's blend.inset_mask inside its box (``boxes``, (F, 4) x1 y1
    x2 y2 on the canvas, a host array) and 0 elsewhere; each is blurred with OpenCV's Gaussian kernel for float
    images of its own sigma (``sigmas`` (F,), host) and a constant 0 border (the canvas is 0 around the box, as
    the host's box-sized image is 0 past its edge), then kept only inside its box less the box's outermost rows
    and columns, and clipped to [0, 1]. Every kernel is padded with zero taps to the longest one, so that one
    grouped convolution per axis blurs every face: equal to the host's within float32 rounding (1e-5 measured)."""
    import cv2

    count = len(boxes)
    kernels = [cv2.getGaussianKernel(2 * gaussian_radius(sigma) + 1, float(sigma), cv2.CV_32F)[:, 0]
               for sigma in sigmas]
    radius = max(len(kernel) for kernel in kernels) // 2
    taps = np.zeros((count, 2 * radius + 1), np.float32)  # (F, K), each kernel centred
    for index, kernel in enumerate(kernels):
        start = radius - len(kernel) // 2
        taps[index, start:start + len(kernel)] = kernel
    weights = to_device(taps, inner.device)
    faces = inner.transpose(0, 1)  # (1, F, Hc, Wc): one channel per face, each blurred with its own kernel
    blurred = functional.conv2d(faces, weights.view(count, 1, 1, -1), padding=(0, radius), groups=count)
    blurred = functional.conv2d(blurred, weights.view(count, 1, -1, 1), padding=(radius, 0), groups=count)
    height, width = inner.shape[-2:]
    box = to_device(np.asarray(boxes, np.int64), inner.device)  # (F, 4)
    rows = torch.arange(height, device=inner.device)[None]  # (1, Hc)
    columns = torch.arange(width, device=inner.device)[None]  # (1, Wc)
    inside_rows = (rows > box[:, 1:2]) & (rows < box[:, 3:4] - 1)  # (F, Hc)
    inside_columns = (columns > box[:, 0:1]) & (columns < box[:, 2:3] - 1)  # (F, Wc)
    keep = inside_rows[:, :, None] & inside_columns[:, None, :]  # (F, Hc, Wc)
    return (blurred.transpose(0, 1) * keep[:, None]).clamp_(0.0, 1.0)


def sharpen_changed(generated: torch.Tensor, source_crops: torch.Tensor, strength: float) -> torch.Tensor:
    """Unsharp-mask ``generated`` where it differs from ``source_crops``, as restore.sharpen_changed does.

    Both (F, 3, S, S) BGR in [0, 1], in the generator's own pixels: blur sigma 1 pixel, changed
    area (more than restore.CHANGE_THRESHOLD grey levels in any channel) blurred with sigma 2.
    Returns (F, 3, S, S) in [0, 1]; ``generated`` itself when ``strength`` is 0.
    """
    if strength <= 0:
        return generated
    generated = generated.float()
    blurred = gaussian_blur(generated, 1.0)  # (F, 3, S, S)
    difference = (generated - source_crops.float()).abs_().amax(dim=1, keepdim=True)  # (F, 1, S, S)
    changed = gaussian_blur((difference > CHANGE_THRESHOLD / 255.0).float(), 2.0)  # (F, 1, S, S) in [0, 1]
    detail = generated - blurred  # (F, 3, S, S)
    return (generated + strength * changed * detail).clamp_(0.0, 1.0)


def _hull_edges(boxes: np.ndarray, landmarks: np.ndarray | None) -> np.ndarray:
    """Each face's mask polygon as inward edge lines: (F, K, 3) float32 a, b, c with a x + b y + c >= 0 inside.

    The polygon is the convex hull of blend.LOWER_FACE_POINTS (rounded like blend.lower_face_mask),
    or blend's ellipse in the box where a face has no landmarks (None or NaN). Hulls with fewer
    edges are padded with lines that are never the nearest.
    """
    import cv2

    polygons = []
    for face, (x1, y1, x2, y2) in enumerate(boxes):  # small per-face geometry, CPU
        points = None if landmarks is None else landmarks[face][LOWER_FACE_POINTS]  # (31, 2)
        if points is not None and np.isfinite(points).all():
            hull = cv2.convexHull(np.round(points).astype(np.int32))[:, 0].astype(np.float64)  # (k, 2)
        else:
            width, height = x2 - x1, y2 - y1
            centre_x, centre_y = x1 + int(width * 0.5), y1 + int(height * 0.7)
            axis_x, axis_y = int(width * 0.36), int(height * 0.26)
            angles = np.linspace(0.0, 2.0 * np.pi, _ELLIPSE_VERTICES, endpoint=False)
            hull = np.stack((centre_x + axis_x * np.cos(angles), centre_y + axis_y * np.sin(angles)), axis=1)
        polygons.append(hull)
    edge_count = max(len(hull) for hull in polygons)
    edges = np.zeros((len(polygons), edge_count, 3), dtype=np.float64)
    edges[:, :, 2] = _NO_EDGE
    for face, hull in enumerate(polygons):
        if len(hull) < 3:  # a point or a line: nothing inside
            edges[face, 0] = (0.0, 0.0, -1.0)
            continue
        start, end = hull, np.roll(hull, -1, axis=0)  # (k, 2) each
        direction = end - start
        length = np.hypot(direction[:, 0], direction[:, 1])
        usable = length > 1e-9
        normal = np.stack((-direction[:, 1], direction[:, 0]), axis=1) / np.maximum(length, 1e-9)[:, None]
        offset = -(normal * start).sum(axis=1)  # (k,)
        centre = hull.mean(axis=0)
        flip = np.where((normal @ centre + offset) < 0, -1.0, 1.0)  # make the inside positive
        lines = np.concatenate((normal * flip[:, None], (offset * flip)[:, None]), axis=1)  # (k, 3)
        edges[face, :int(usable.sum())] = lines[usable]
    return edges.astype(np.float32)


def _feather_pixels(box_size: torch.Tensor, feather: float) -> torch.Tensor:
    """(F,) width of the soft mask edge in pixels, as blend.lower_face_mask: box_size (F, 2) width, height."""
    return torch.clamp(feather * box_size.float().min(dim=1).values, min=2.0)


def _edge_distances(boxes, landmarks, canvas: FaceCanvas) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed distances of every canvas pixel, positive inside: to the mask polygon and to the box border.

    Returns two (F, Hc, Wc) float32 tensors. Inside a convex polygon the distance to its boundary
    is the least distance to its edges' lines; outside it this least value is negative (and no
    further from 0 than the true distance). The box distance is 0 on the box's border pixels.
    """
    device = canvas.origin.device
    boxes_host = np.asarray(boxes.cpu() if isinstance(boxes, torch.Tensor) else boxes, dtype=np.int64).reshape(-1, 4)
    if boxes_host.shape[0] != canvas.boxes.shape[0]:
        raise ValueError(f"{boxes_host.shape[0]} boxes for a canvas of {canvas.boxes.shape[0]} faces")
    boxes = to_device(boxes_host, device)  # (F, 4)
    landmarks_cpu = None if landmarks is None else np.asarray(torch.as_tensor(landmarks).cpu(), dtype=np.float32)
    edges = to_device(_hull_edges(boxes_host, landmarks_cpu), device)  # (F, K, 3)

    xs = (canvas.origin[:, 0:1] + torch.arange(canvas.width, device=device)).float()  # (F, Wc) frame x
    ys = (canvas.origin[:, 1:2] + torch.arange(canvas.height, device=device)).float()  # (F, Hc) frame y
    boxes_float = boxes.float()
    distance_x = torch.minimum(xs - boxes_float[:, 0:1], boxes_float[:, 2:3] - 1 - xs)  # (F, Wc)
    distance_y = torch.minimum(ys - boxes_float[:, 1:2], boxes_float[:, 3:4] - 1 - ys)  # (F, Hc)
    box_distance = torch.minimum(distance_x[:, None, :], distance_y[:, :, None])  # (F, Hc, Wc)
    hull_distance = torch.full_like(box_distance, _NO_EDGE)  # (F, Hc, Wc)
    a, b, c = (part[:, :, None] for part in edges.unbind(2))  # (F, K, 1) each
    along_x = a * xs[:, None, :] + c  # (F, K, Wc)
    along_y = b * ys[:, None, :]  # (F, K, Hc)
    for start in range(0, edges.shape[1], _EDGES_AT_ONCE):  # 20-50 edges, a few at a time, not per face
        stop = start + _EDGES_AT_ONCE
        line_distance = along_x[:, start:stop, None, :] + along_y[:, start:stop, :, None]  # (F, k, Hc, Wc)
        torch.minimum(hull_distance, line_distance.amin(dim=1), out=hull_distance)
    return hull_distance, box_distance


def _smoothstep_mask(distance: torch.Tensor, feather_pixels: torch.Tensor) -> torch.Tensor:
    """(F, Hc, Wc) signed distances -> (F, 1, Hc, Wc) mask: 0 where distance <= 0, 1 from feather_pixels in."""
    ramp = (distance / feather_pixels[:, None, None]).clamp_(0.0, 1.0)  # (F, Hc, Wc)
    return (ramp * ramp * (3.0 - 2.0 * ramp)).unsqueeze(1)


def face_masks(boxes, landmarks, feather: float, canvas: FaceCanvas) -> torch.Tensor:
    """The feathered lower-face mask of each face on its canvas: (F, 1, Hc, Wc) float32 in [0, 1].

    The region is blend.lower_face_mask's: the convex hull of the lower-face landmarks
    ((F, 468, 2) frame pixels, None or NaN rows for faces without them, which get blend's ellipse).
    The mask is exactly 0 outside the hull, on the box border and outside the box, and rises
    to 1 with a smoothstep of the distance to the nearest of these edges over
    max(2, feather * min(box height, box width)) pixels. ``boxes`` (F, 4) are the canvas's boxes.
    """
    hull_distance, box_distance = _edge_distances(boxes, landmarks, canvas)
    return _smoothstep_mask(torch.minimum(hull_distance, box_distance), _feather_pixels(canvas.box_size, feather))


def _colour_band(hull_distance: torch.Tensor, box_distance: torch.Tensor, feather_pixels: torch.Tensor) -> torch.Tensor:
    """(F, 1, Hc, Wc) bool: where blend.lower_face_mask's blurred mask lies between 0.02 and 0.7.

    blend.py blurs the hard hull (with a box border of ceil(feather) pixels cut away) with sigma
    feather / 2.5, so its soft edge straddles the hull: from 2.05 sigma outside to 0.52 sigma
    inside. Sampling the colours there, rather than on this module's mask edge (which lies
    wholly inside the hull, close to the mouth), compares skin with skin.
    """
    sigma = (feather_pixels / 2.5)[:, None, None]  # (F, 1, 1)
    distance = torch.minimum(hull_distance, box_distance - torch.ceil(feather_pixels)[:, None, None])
    return ((distance > -2.05 * sigma) & (distance < 0.52 * sigma) & (box_distance > 0)).unsqueeze(1)


def paste_faces(planes: torch.Tensor, frame_index, boxes, patches: torch.Tensor, landmarks=None, *,
                feather: float = 0.15, color_match: bool = True, masks: torch.Tensor | None = None,
                chroma: str = "average") -> None:
    """Blend each face's generated patch into its frame of ``planes``, in place.

    planes: (N, H * 3/2, W) uint8 I420 frames, contiguous; frame_index (F,) and boxes (F, 4)
    x1 y1 x2 y2 as for :func:`crop_faces`; patches (F, 3, S, S) BGR in [0, 1], scaled to each box
    as engines.wav2lip.resize_to_box does (bicubic, clamped to 0..255; INTER_AREA for boxes with
    fewer pixels than the patch). ``masks`` (F, 1, Hc, Wc) on the canvas of :func:`face_canvas`, or
    None for :func:`face_masks` of ``landmarks`` with ``feather``. With ``color_match`` the patch's
    mean colour is shifted to the frame's as blend.match_colour does, over the pixels where
    blend.py's own mask is soft (see :func:`_colour_band`), or over a given mask's soft edge.

    Only Y bytes where the mask is above 0, and U/V bytes of 2x2 blocks with any such pixel,
    are written; every other byte of ``planes`` keeps its value. Faces on the same frame should
    not overlap: where they do, one of them wins.
    """
    frame_height, frame_width = planes.shape[1] * 2 // 3, planes.shape[2]
    if len(boxes) == 0:
        return
    canvas = face_canvas(frame_index, boxes, frame_height, frame_width, planes.device)
    if masks is None:
        boxes_known = canvas.host_boxes if canvas.host_boxes is not None else canvas.boxes
        hull_distance, box_distance = _edge_distances(boxes_known, landmarks, canvas)  # (F, Hc, Wc) each
        feather_pixels = _feather_pixels(canvas.box_size, feather)  # (F,)
        masks = _smoothstep_mask(torch.minimum(hull_distance, box_distance), feather_pixels)  # (F, 1, Hc, Wc)
        colour_band = _colour_band(hull_distance, box_distance, feather_pixels)  # (F, 1, Hc, Wc)
    elif masks.shape != (len(canvas.boxes), 1, canvas.height, canvas.width):
        raise ValueError(f"masks must be (F, 1, {canvas.height}, {canvas.width}) on the face canvas; "
                         f"got {tuple(masks.shape)}")
    else:
        colour_band = (masks > 0.02) & (masks < 0.7)  # (F, 1, Hc, Wc) the given mask's soft edge
    y, u, v = gather_canvas(planes, canvas)
    regions = i420_to_bgr(y, u, v)  # (F, 3, Hc, Wc) BGR in 0..255, the frame under each canvas

    patch_size = patches.shape[-1]
    offset, box_size = canvas.box_offset, canvas.box_size  # (F, 2) x, y
    source = torch.full_like(box_size, patch_size)
    method = _resize_methods(source, box_size, cubic_when_larger=True)  # (F,)
    no_offset = torch.zeros_like(offset[:, 0])
    # rows: (F, Hc, S), columns: (F, Wc, S)
    rows = _resize_matrix(source[:, 1], box_size[:, 1], no_offset, offset[:, 1], patch_size, canvas.height, method)
    columns = _resize_matrix(source[:, 0], box_size[:, 0], no_offset, offset[:, 0], patch_size, canvas.width, method)
    scaled = rows[:, None] @ (patches.float() * 255.0) @ columns[:, None].transpose(2, 3)  # (F, 3, Hc, Wc)
    scaled = scaled.clamp_(0.0, 255.0)

    if color_match:
        scaled += colour_shift(regions, scaled, colour_band)[:, :, None, None]
    blend_canvas(planes, canvas, regions, scaled, masks, chroma)


def colour_shift(frame: torch.Tensor, patch: torch.Tensor, band: torch.Tensor) -> torch.Tensor:
    """(F, 3) what to add to each patch so that its mean colour over ``band`` matches the frame's, as
    blend.colour_shift: frame and patch (F, 3, h, w), band (F, 1, h, w) bool; 0 for a face whose band
    has fewer than blend.MIN_EDGE_PIXELS pixels."""
    edge = band.float().flatten(1)  # (F, h * w)
    edge_count = edge.sum(dim=1)  # (F,)
    difference = torch.einsum("fcp,fp->fc", (frame - patch).flatten(2), edge)  # (F, 3) summed over the band
    shift = difference / edge_count.clamp(min=1)[:, None]  # (F, 3) mean colour difference
    return torch.where((edge_count >= MIN_EDGE_PIXELS)[:, None], shift, torch.zeros_like(shift))


def blend_canvas(planes: torch.Tensor, canvas: FaceCanvas, regions: torch.Tensor, new_pixels: torch.Tensor,
                 masks: torch.Tensor, chroma: str = "average") -> None:
    """Alpha-blend ``new_pixels`` over ``regions`` with ``masks`` and write the result into ``planes``.

    planes (N, H * 3/2, W) uint8 I420; regions, the frame under each canvas, and new_pixels are
    (F, 3, Hc, Wc) BGR in 0..255 on ``canvas``; masks (F, 1, Hc, Wc) in [0, 1]. Only Y bytes where
    the mask is above 0, and U/V bytes of 2x2 blocks with any such pixel, are written.
    """
    mixed = (new_pixels - regions).mul_(masks).add_(regions).clamp_(0.0, 255.0)  # (F, 3, Hc, Wc) alpha blend
    new_y, new_u, new_v = bgr_to_i420(mixed, chroma)

    views = _plane_rows(planes, canvas)
    written = masks[:, 0] > 0  # (F, Hc, Wc)
    written_blocks = functional.max_pool2d(written[:, None].float(), 2)[:, 0] > 0  # (F, Hc/2, Wc/2)
    for name, values, where in (("y", new_y, written), ("u", new_u, written_blocks), ("v", new_v, written_blocks)):
        rows_view, rows, columns = views[name]
        if canvas.one_per_frame:
            # no canvas overlaps another: write whole canvases, their own bytes back where nothing changes
            # (finding the changed pixels' positions would wait for the GPU to count them)
            kept = _gather(rows_view, rows, columns)  # (F, h, w)
            rows_view[rows[:, :, None], columns[:, None, :]] = torch.where(where, values, kept)
        else:
            face, row, column = where.nonzero(as_tuple=True)  # (P,) each: the pixels (blocks) to write
            rows_view[rows[face, row], columns[face, column]] = values[face, row, column]


__all__ = ["FACE_SIZE", "FaceCanvas", "bgr_to_i420", "blend_canvas", "colour_shift", "crop_faces", "face_canvas",
           "face_masks", "feather_masks", "gather_canvas", "gaussian_blur", "gaussian_radius", "i420_to_bgr",
           "paste_faces", "sharpen_changed", "split_planes"]
