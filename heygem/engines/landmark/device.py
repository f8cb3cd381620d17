"""The landmark engine's drawing as one batched torch pass over I420 face regions.

The CPU engine (heygem.engines.landmark) draws each face on its own: a dense backward warp
of the lower face, the mouth interior, the softened mask, the colour-matched blend and the
conversion back to I420. Here the same steps run for a whole batch of faces at once, on
whichever device the regions are on:

1. on the host, per face: the mouth geometry, its patch box and the target levels (the same
   functions as the CPU engine), the source colours of the lips, skin and teeth and the
   remembered teeth colour (in face order, as the CPU engine advances it);
2. on the device, per pixel of every region: the warp field (exact everywhere; the CPU
   computes it coarsely away from the lips), one grid_sample for the whole batch, the warp
   mask, the interior drawing, the border fade, the mask softening (a separable Gaussian blur
   with each face's own kernel), the colour shift and the blend, and the conversion back to
   I420, mixed into the region's own bytes through the mask (unchanged where it is 0).

Regions are (F, Hc * 3/2, Wc) uint8 I420 images, one face each, at even positions of their
frames (as heygem.render cuts them). torch is imported by the caller's first use of a function.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import cv2
import numpy as np

from heygem.config import BlendConfig, Config
from heygem.engines.landmark.drawing import (
    CAVITY_TINT,
    TONGUE_TINT,
    TOOTH_EDGES,
    SourceColours,
    TeethColour,
    cut_window,
    face_colours,
    source_colours,
)
from heygem.engines.landmark.geometry import (
    LOWER_INNER,
    NECK,
    REGION_MARGIN,
    TEETH_LENGTH,
    UPPER_INNER,
    MouthGeometry,
    lips_window,
    mouth_target,
    patch_box,
    window_box,
)
from heygem.render.prepared import Prepared
from heygem.render.regions import Downloading, RegionRender, Regions
from heygem.runtime.flow import Stage
from heygem.types import FrameBatch

LEVELS = NECK + 1  # 7 levels per column
# Rows of the per-face column table: the 7 target levels, the 7 source levels, closing, interior.
TABLE_ROWS = 2 * LEVELS + 2
INTERIOR_BLUR_SIGMA = 0.6  # as render_interior's final blur


@dataclass(frozen=True)
class RegionFace:
    """One face to draw on its region."""

    landmarks: np.ndarray  # (468, 2) float32 face-mesh points in frame pixels
    openness: float  # 0 (closed) .. ~1.5, mouth_strength applied
    width: float  # -1 (rounded) .. 1 (spread)
    speaking: float  # 0 (the face's own mouth) .. 1 (all of that shape), see geometry.mouth_target
    origin: tuple[int, int]  # even (x, y) of its region's top-left pixel in the frame


@dataclass
class MouthPlan:
    """The host-side geometry of a batch of faces, padded to the batch's largest column count.

    Only the faces with a patch box are in it; ``region`` says which region each one is.
    Positions are in region pixels.
    """

    region: np.ndarray  # (P,) int64, index of each face's region
    scalars: np.ndarray  # (P, len(SCALARS)) float32, see SCALARS
    boxes: np.ndarray  # (P, 4) int64 patch box x1, y1, x2, y2 on the region (x2, y2 exclusive)
    lips: np.ndarray  # (P, 4) int64 the lips window x1, y1, x2, y2 on the region, where the interior may be drawn
    table: np.ndarray  # (P, TABLE_ROWS, Cmax) float32 levels, closing and interior per column, edge-padded
    colours: np.ndarray  # (P, 2, 3) float32 BGR lips and teeth colours to draw with
    drawn: np.ndarray  # (P,) bool, whether the face draws an interior (as warp_mouth's interior is not None)


@dataclass(frozen=True)
class RegionLayout:
    """Where the faces of a batch of frames are cut out: one region each, all of one even size."""

    rows: list  # the frame of each region
    origins: np.ndarray  # (F, 2) int64 even x, y of each region's top-left pixel in its frame
    height: int  # even region height
    width: int  # even region width
    faces: list  # RegionFace of each region


def region_layout(jobs: list, frame_size: tuple[int, int], margin: float = REGION_MARGIN) -> RegionLayout | None:
    """The regions for the landmark engine's ``jobs`` ((frame index, landmarks, openness, width, speaking), see
    LandmarkEngine.mouth_jobs) in frames of ``frame_size`` (width, height): around each face the window the
    CPU engine reads (landmark.window_box), widened to even coordinates and to the batch's largest
    size (heygem.render.gpu_blend.face_canvas). None when no job has a patch."""
    from heygem.render.gpu_blend import face_canvas

    frame_width, frame_height = frame_size
    rows, boxes, kept = [], [], []
    for index, landmarks, *shape in jobs:
        box = window_box(landmarks, frame_width, frame_height, margin)
        if box is not None:
            rows.append(index)
            boxes.append(box)
            kept.append((landmarks, *shape))
    if not rows:
        return None
    canvas = face_canvas(np.arange(len(rows)), np.array(boxes, np.int64), frame_height, frame_width, "cpu")
    origins = canvas.origin.numpy()  # (F, 2)
    faces = [RegionFace(landmarks=landmarks, openness=openness, width=width, speaking=speaking, origin=(int(x), int(y)))
             for (landmarks, openness, width, speaking), (x, y) in zip(kept, origins)]
    return RegionLayout(rows=rows, origins=origins, height=canvas.height, width=canvas.width, faces=faces)


# The per-face scalars, in the order of MouthPlan.scalars' columns.
SCALARS = ("origin_x", "origin_y", "axis_ux", "axis_uy", "axis_vx", "axis_vy", "outer_half_width", "top",
           "upper_lip_top", "lower_lip_bottom", "chin", "corner_shift", "inner_centre", "inner_half_width",
           "mouth_width", "first_column", "mask_sigma")


def _draws_interior(target, geometry: MouthGeometry) -> bool:
    """Whether warp_mouth draws an interior, decided on the target's columns around the lips
    (warp_mouth decides it on the pixels there, which sample the same columns)."""
    near = np.abs(target.columns) <= geometry.outer_half_width + 1.0 + abs(target.corner_shift) + 2.0
    gap = target.target_levels[LOWER_INNER] - target.target_levels[UPPER_INNER]
    active = ((gap > 0.05) & (target.interior > 0.0)) | (target.closing > 0.05)
    return bool(active[near].any())


@dataclass(frozen=True)
class FacePlan:
    """Step 1 for one face, but for the colours to draw with: they need the remembered teeth
    colour, which advances in face order (gather_plans). Positions are in region pixels."""

    scalars: np.ndarray  # (len(SCALARS),) float32, see SCALARS
    box: tuple[int, int, int, int]  # the patch box x1, y1, x2, y2 (x2, y2 exclusive)
    lips: tuple[int, int, int, int]  # the lips window x1, y1, x2, y2, where the interior may be drawn
    table: np.ndarray  # (TABLE_ROWS, C) float32 levels, closing and interior per column
    source: SourceColours | None  # what the source shows; None when the face draws no interior


def plan_face(face: RegionFace, region_i420: np.ndarray, frame_size: tuple[int, int]) -> FacePlan | None:
    """Step 1 for ``face`` on its region (``region_i420`` (Hc * 3/2, Wc) uint8, read for the source
    colours) in a frame of ``frame_size`` (width, height); None when the face has no patch box.
    Depends on this face alone, so it may run anywhere (heygem.engines.landmark.processes)."""
    frame_width, frame_height = frame_size
    region_width = region_i420.shape[1]
    region_height = region_i420.shape[0] * 2 // 3
    geometry = MouthGeometry.from_landmarks(face.landmarks)
    box = patch_box(geometry, frame_width, frame_height)
    if box is None:
        return None
    origin_x, origin_y = face.origin
    x1, y1, x2, y2 = box[0] - origin_x, box[1] - origin_y, box[2] - origin_x, box[3] - origin_y
    if x1 < 0 or y1 < 0 or x2 > region_width or y2 > region_height:
        raise ValueError(f"the patch box {box} lies outside the region at {face.origin}")
    target = mouth_target(geometry, face.openness, face.width, face.speaking)
    lips_rows, lips_columns = lips_window(target, geometry, box)
    source = None
    if _draws_interior(target, geometry):
        # only the patch box is read: converted from its 2x2 chroma blocks, the same bytes as
        # converting the whole region and cutting the box out
        window, (even_x1, even_y1) = cut_window(region_i420, (x1, y1, x2, y2))
        patch = cv2.cvtColor(window, cv2.COLOR_YUV2BGR_I420)[y1 - even_y1:y2 - even_y1, x1 - even_x1:x2 - even_x1]
        source = source_colours(patch, np.array(box[:2], np.float32), face.landmarks, geometry)
    contours = geometry.contours
    frame = geometry.frame
    scalars = np.array([
        frame.origin[0] - origin_x, frame.origin[1] - origin_y, *frame.axis_u, *frame.axis_v,
        geometry.outer_half_width, geometry.top,
        float(np.interp(0.0, *contours["upper_outer"])), float(np.interp(0.0, *contours["lower_outer"])),
        geometry.chin, target.corner_shift, geometry.inner_centre, geometry.inner_half_width,
        geometry.mouth_width, float(target.columns[0]), max(1.0, 0.04 * geometry.mouth_width)], np.float32)
    table = np.concatenate([target.target_levels, target.source_levels, target.closing[None],
                            target.interior[None]]).astype(np.float32)  # (TABLE_ROWS, C)
    lips = (x1 + lips_columns.start, y1 + lips_rows.start, x1 + lips_columns.stop, y1 + lips_rows.stop)
    return FacePlan(scalars=scalars, box=(x1, y1, x2, y2), lips=lips, table=table, source=source)


def gather_plans(plans: list[FacePlan | None], teeth_memory: TeethColour | None) -> MouthPlan | None:
    """The batch's MouthPlan from each region's FacePlan (None: no patch), in face order: the colours
    to draw with, advancing ``teeth_memory`` over the faces that draw an interior as
    remembered_teeth does. None when no face has a patch box."""
    rows = [index for index, plan in enumerate(plans) if plan is not None]
    if not rows:
        return None
    kept = [plans[index] for index in rows]
    colours = []
    for plan in kept:
        if plan.source is None:
            colours.append((np.zeros(3, np.float32), np.zeros(3, np.float32)))
            continue
        seen = plan.source.seen_teeth
        teeth = teeth_memory.update(seen) if teeth_memory is not None else seen
        drawing = face_colours(plan.source, teeth)
        colours.append((drawing.lips, drawing.teeth))
    column_count = max(plan.table.shape[1] for plan in kept)
    table = np.stack([np.pad(plan.table, ((0, 0), (0, column_count - plan.table.shape[1])), mode="edge")
                      for plan in kept])
    return MouthPlan(region=np.array(rows, np.int64), scalars=np.stack([plan.scalars for plan in kept]),
                     boxes=np.array([plan.box for plan in kept], np.int64),
                     lips=np.array([plan.lips for plan in kept], np.int64), table=table,
                     colours=np.array(colours, np.float32),
                     drawn=np.array([plan.source is not None for plan in kept], bool))


def plan_mouths(faces: list[RegionFace], regions_host: np.ndarray, frame_size: tuple[int, int],
                teeth_memory: TeethColour | None, pool=None) -> MouthPlan | None:
    """Step 1 on the host for ``faces`` on ``regions_host`` ((F, Hc * 3/2, Wc) uint8 I420, one per
    face, used for the source colours): each face's FacePlan, in the landmark engine's rendering
    processes when a ``pool`` (heygem.engines.landmark.processes.RenderPool) is given, then gathered
    here in face order. None when no face has a patch box."""
    if pool is not None:
        plans = pool.plan_faces(faces, regions_host, frame_size)
    else:
        plans = [plan_face(face, region, frame_size) for face, region in zip(faces, regions_host)]
    return gather_plans(plans, teeth_memory)


def draw_mouths(planes, faces: list[RegionFace], frame_size: tuple[int, int], blend: BlendConfig,
                teeth_memory: TeethColour | None, regions_host: np.ndarray | None = None) -> np.ndarray:
    """Draw every face's mouth into its region of ``planes`` ((F, Hc * 3/2, Wc) uint8 I420 tensor,
    contiguous, one region per face, on any device), in place: the finished bytes of the CPU
    engine's generate_i420 for the same frames, up to rounding. Only Y bytes where a face's mask
    is above 0, and U/V bytes of 2x2 blocks whose top-left pixel's mask is, can change.

    ``regions_host`` is the same bytes on the host (read back from ``planes`` when None, which
    waits for the device). Returns (F,) bool: the regions that got a patch."""
    if regions_host is None:
        regions_host = planes.cpu().numpy()
    plan = plan_mouths(faces, regions_host, frame_size, teeth_memory)
    changed = np.zeros(len(faces), bool)
    if plan is not None:
        render_mouths(planes, plan, blend)
        changed[plan.region] = True
    return changed


# ---------------------------------------------------------------------------- the device side

def _smoothstep(edge0, edge1, x):
    """mouth_shapes.smoothstep on tensors; edges are numbers or tensors broadcasting with ``x``."""
    t = ((x - edge0) / (edge1 - edge0)).clamp(0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def _gaussian_kernels(sigmas) -> np.ndarray:
    """(P, K) float32 Gaussian kernels as OpenCV builds them for float images (gpu_blend.gaussian_radius;
    normalised), each centred in the batch's largest length K (zeros around the shorter ones)."""
    from heygem.render.gpu_blend import gaussian_radius

    radii = [gaussian_radius(sigma) for sigma in sigmas]
    radius = max(radii)
    taps = np.arange(-radius, radius + 1, dtype=np.float64)
    kernels = np.zeros((len(sigmas), 2 * radius + 1), np.float64)
    for face, (sigma, own) in enumerate(zip(sigmas, radii)):
        inside = np.abs(taps) <= own
        weights = np.exp(-(taps[inside] ** 2) / (2.0 * float(sigma) ** 2))
        kernels[face, inside] = weights / weights.sum()
    return kernels.astype(np.float32)


def _blur(images, kernels):
    """Separable blur of (P, C, h, w) float32 with each face's own (P, K) kernel, zeros beyond the edges."""
    from torch.nn import functional

    faces, channels, height, width = images.shape
    radius = kernels.shape[1] // 2
    weight = kernels.repeat_interleave(channels, dim=0)  # (P * C, K)
    flat = images.reshape(1, faces * channels, height, width)
    flat = functional.conv2d(flat, weight[:, None, None, :], padding=(0, radius), groups=faces * channels)
    flat = functional.conv2d(flat, weight[:, None, :, None], padding=(radius, 0), groups=faces * channels)
    return flat.view(faces, channels, height, width)


def _column_values(table, position):
    """The (P, R, Cmax) column table sampled linearly at fractional columns ``position`` (P, h, w),
    edge values beyond its ends (cv2.remap with BORDER_REPLICATE, np.interp): (P, R, h, w)."""
    import torch
    from torch.nn import functional

    faces, height, width = position.shape
    column_count = table.shape[2]
    x = position / max(column_count - 1, 1) * 2.0 - 1.0  # align_corners: -1 and 1 are the end columns
    grid = torch.stack((x, torch.zeros_like(x)), dim=-1).view(faces, 1, height * width, 2)
    sampled = functional.grid_sample(table[:, :, None, :], grid, mode="bilinear", padding_mode="border",
                                     align_corners=True)  # (P, R, 1, h * w)
    return sampled.view(faces, table.shape[1], height, width)


def _box_fade(boxes, height: int, width: int):
    """(P, h, w) landmark._border_fade of each patch box, placed on the region; 0 outside the box."""
    import torch

    device = boxes.device
    box = boxes.float()
    box_width, box_height = box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]  # (P,)
    margin = torch.clamp(0.06 * torch.minimum(box_width, box_height), min=3.0)[:, None]  # (P, 1)
    xs = torch.arange(width, device=device, dtype=torch.float32)[None] - box[:, 0:1]  # (P, w) box columns
    ys = torch.arange(height, device=device, dtype=torch.float32)[None] - box[:, 1:2]  # (P, h)
    inside_x = (xs >= 0) & (xs < box_width[:, None])
    inside_y = (ys >= 0) & (ys < box_height[:, None])
    fade_x = _smoothstep(0.0, margin, torch.minimum(xs, box_width[:, None] - 1 - xs)) * inside_x
    fade_y = _smoothstep(0.0, margin, torch.minimum(ys, box_height[:, None] - 1 - ys)) * inside_y
    return fade_y[:, :, None] * fade_x[:, None, :]


def _lips_crops(lips: np.ndarray, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each face's lips window ((P, 4) x1, y1, x2, y2 on an h x w region) padded to the batch's largest
    and shifted to lie inside the region: (rows (P, Lh), columns (P, Lw)) int64."""
    crop_height = int(max((lips[:, 3] - lips[:, 1]).max(), 1))
    crop_width = int(max((lips[:, 2] - lips[:, 0]).max(), 1))
    top = np.clip(lips[:, 1], 0, height - crop_height)[:, None]  # (P, 1)
    left = np.clip(lips[:, 0], 0, width - crop_width)[:, None]
    return top + np.arange(crop_height), left + np.arange(crop_width)  # (P, Lh), (P, Lw)


def _upper_teeth(colour, u, v, upper, gap, across, scalar, teeth, edges):
    """landmark._draw_upper_teeth on (P, 3, h, w) colour planes; teeth (P, 3, 1, 1) BGR; ``edges``
    TOOTH_EDGES on the device."""
    import torch

    mouth_width = scalar("mouth_width")
    position = (u - scalar("inner_centre")) / mouth_width  # (P, h, w) across the mouth, in mouth widths
    right_index = torch.searchsorted(edges, position.contiguous()).clamp(1, len(TOOTH_EDGES) - 1)
    left_edge, right_edge = edges[right_index - 1], edges[right_index]
    within_tooth = ((position - (left_edge + right_edge) / 2) / ((right_edge - left_edge) / 2)).clamp(-1.0, 1.0)
    near_edge = _smoothstep(0.75, 1.0, within_tooth.abs())

    length = TEETH_LENGTH * mouth_width * (1.0 - 0.45 * torch.clamp(position.abs() / 0.45, max=1.0) ** 2)
    length = torch.minimum(length * (1.0 - 0.3 * near_edge**2), 0.62 * gap + 0.3)
    below_lip = v - upper
    alpha = (length - below_lip + 0.5).clamp(0.0, 1.0) * (1.0 - _smoothstep(0.6, 0.95, across.abs()))
    toward_edge = (below_lip / torch.clamp(length, min=1e-3)).clamp(0.0, 1.0)

    lip_shadow = 0.74 + 0.26 * _smoothstep(0.0, 0.4, toward_edge)
    convex = 1.0 - 0.1 * within_tooth**2
    notch = 1.0 - 0.2 * near_edge**2 * (0.25 + 0.75 * toward_edge)
    depth = 1.0 - 0.55 * torch.clamp(position.abs() / 0.5, max=1.0) ** 2
    shade = (lip_shadow * convex * notch * depth)[:, None]  # (P, 1, h, w)
    translucent = (0.15 * _smoothstep(0.6, 1.0, toward_edge))[:, None]
    drawn = shade * teeth
    drawn = drawn + translucent * (colour - drawn)
    return colour + alpha[:, None] * (drawn - colour)


def _interior(u, u_column, v, levels, closing, weight, scalar, lips, teeth, constants: DrawConstants):
    """landmark.render_interior on (P, h, w) pixels: (colour (P, 3, h, w) BGR, alpha (P, h, w)).
    ``levels`` (P, 7, h, w) are the output levels at each pixel's column; lips, teeth (P, 3, 1, 1)."""
    import torch

    from heygem.render.gpu_blend import gaussian_blur

    upper, lower = levels[:, UPPER_INNER], levels[:, LOWER_INNER]
    gap = torch.clamp(lower - upper, min=0.0)
    mouth_width = scalar("mouth_width")
    across = (u_column - scalar("inner_centre")) / scalar("inner_half_width")
    inside_corners = 1.0 - _smoothstep(0.92, 1.0, across.abs())
    coverage = ((v - upper + 0.5).clamp(0.0, 1.0) * (lower - v + 0.5).clamp(0.0, 1.0)
                * _smoothstep(0.0, 1.0, gap) * inside_corners * weight)
    middle = (upper + lower) / 2.0
    seam = (0.55 * _smoothstep(0.0, 1.5, closing) * torch.exp(-(((v - middle) / 0.8) ** 2))
            * _smoothstep(2.0, 0.5, gap) * inside_corners)
    alpha = torch.maximum(coverage, seam)

    depth_down = ((v - upper) / torch.clamp(gap, min=1e-3)).clamp(0.0, 1.0)
    cavity = lips * constants.cavity_tint.view(1, 3, 1, 1)  # (P, 3, 1, 1)
    radial = torch.sqrt(across**2 + ((depth_down - 0.45) / 0.55) ** 2)
    cavity_light = 0.07 + 0.38 * _smoothstep(0.3, 1.15, radial)
    colour = cavity_light[:, None] * cavity  # (P, 3, h, w)

    tongue_shape = (across / 0.55) ** 2 + ((depth_down - 1.05) / 0.55) ** 2
    tongue_alpha = (1.0 - _smoothstep(0.45, 1.0, tongue_shape)) * _smoothstep(0.1, 0.24, gap / mouth_width) * 0.7
    tongue_light = 0.22 + 0.33 * _smoothstep(0.4, 1.0, depth_down)
    tongue = lips * constants.tongue_tint.view(1, 3, 1, 1)
    colour = colour + tongue_alpha[:, None] * (tongue_light[:, None] * tongue - colour)

    lower_teeth_height = 0.045 * mouth_width
    lower_teeth = (_smoothstep(lower_teeth_height + 0.5, lower_teeth_height - 0.5, lower - v)
                   * (1.0 - _smoothstep(0.35, 0.7, across.abs())) * _smoothstep(0.2, 0.3, gap / mouth_width) * 0.35)
    colour = colour + lower_teeth[:, None] * (teeth * 0.55 - colour)

    colour = _upper_teeth(colour, u, v, upper, gap, across, scalar, teeth, constants.tooth_edges)
    seam_only = (seam > coverage)[:, None]  # (P, 1, h, w)
    colour = torch.where(seam_only, lips * 0.45, colour)
    return gaussian_blur(colour, INTERIOR_BLUR_SIGMA), alpha


@dataclass
class DrawInputs:
    """A batch's MouthPlan on the device, in the shapes the device pass takes (upload_plan)."""

    region: object  # (P,) int64 the region of each face
    scalars: object  # (P, len(SCALARS)) float32
    boxes: object  # (P, 4) int64 patch boxes
    table: object  # (P, TABLE_ROWS, Cmax) float32
    colours: object  # (P, 2, 3) float32 lips and teeth BGR
    lips: object  # (P, 4) int64 lips windows
    lips_rows: object  # (P, Lh) int64 the region rows the interior is computed on
    lips_columns: object  # (P, Lw) int64 and its columns
    drawn: object  # (P,) bool
    kernels: object  # (P, K) float32 each face's mask blur


@dataclass(frozen=True)
class DrawConstants:
    """The drawing's constant tables on one device."""

    tooth_edges: object  # TOOTH_EDGES
    cavity_tint: object  # CAVITY_TINT
    tongue_tint: object  # TONGUE_TINT


_CONSTANTS: dict[str, DrawConstants] = {}


def _constants(device) -> DrawConstants:
    from heygem.render.gpu_blend import to_device

    key = str(device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = DrawConstants(*(to_device(table, device)
                                          for table in (TOOTH_EDGES, CAVITY_TINT, TONGUE_TINT)))
    return _CONSTANTS[key]


def upload_plan(plan: MouthPlan, height: int, width: int, device) -> DrawInputs:
    """``plan`` for regions of ``height`` x ``width`` as tensors on ``device``, queued without waiting."""
    from heygem.render.gpu_blend import to_device

    rows, columns = _lips_crops(plan.lips, height, width)
    kernels = _gaussian_kernels(plan.scalars[:, SCALARS.index("mask_sigma")])
    return DrawInputs(*(to_device(array, device) for array in (
        plan.region, plan.scalars, plan.boxes, plan.table, plan.colours, plan.lips, rows, columns, plan.drawn,
        kernels)))


def render_mouths(planes, plan: MouthPlan, blend: BlendConfig) -> None:
    """Step 2 on the device: draw the planned faces into their regions of ``planes`` ((F, Hc * 3/2, Wc)
    uint8) in place."""
    height, width = planes.shape[1] * 2 // 3, planes.shape[2]
    inputs = upload_plan(plan, height, width, planes.device)
    _draw(planes, inputs, _constants(planes.device), blend.color_match)


def _draw(planes, inputs: DrawInputs, constants: DrawConstants, color_match: bool) -> None:
    """Step 2's device pass over ``inputs`` (upload_plan), in place on ``planes``: only device work,
    never a wait for the device."""
    import torch
    from torch.nn import functional

    from heygem.render.gpu_blend import bgr_to_i420, colour_shift, i420_to_bgr, split_planes

    device = planes.device
    y_all, u_all, v_all = split_planes(planes)
    region = inputs.region  # (P,)
    y, u_plane, v_plane = y_all[region], u_all[region], v_all[region]  # copies: (P, Hc, Wc), (P, Hc/2, Wc/2)
    faces, height, width = y.shape
    source = i420_to_bgr(y, u_plane, v_plane)  # (P, 3, Hc, Wc) BGR, whole numbers in 0..255
    scalars = inputs.scalars  # (P, S)

    def scalar(name: str):
        return scalars[:, SCALARS.index(name)].view(faces, 1, 1)  # (P, 1, 1)

    boxes, table, colours = inputs.boxes, inputs.table, inputs.colours  # (P, 4), (P, TABLE_ROWS, Cmax), (P, 2, 3)
    lips_colour, teeth_colour = colours[:, 0, :, None, None], colours[:, 1, :, None, None]  # (P, 3, 1, 1)

    # 1. The backward warp, exact at every pixel of the region (landmark.warp_field).
    xs = torch.arange(width, device=device, dtype=torch.float32).view(1, 1, width)  # region pixels
    ys = torch.arange(height, device=device, dtype=torch.float32).view(1, height, 1)
    axis_ux, axis_uy, axis_vx, axis_vy = (scalar(name) for name in ("axis_ux", "axis_uy", "axis_vx", "axis_vy"))
    offset_x, offset_y = xs - scalar("origin_x"), ys - scalar("origin_y")
    u = offset_x * axis_ux + offset_y * axis_uy  # (P, Hc, Wc) mouth coordinates
    v = offset_x * axis_vx + offset_y * axis_vy
    along = u / scalar("outer_half_width")
    along_profile = along * torch.exp((1.0 / 1.4) ** 4 - (along / 1.4) ** 4)
    height_profile = (_smoothstep(scalar("top"), scalar("upper_lip_top"), v)
                      * (1.0 - _smoothstep(scalar("lower_lip_bottom"), scalar("chin"), v)))
    u_column = u - scalar("corner_shift") * along_profile * height_profile
    columns = _column_values(table, u_column - scalar("first_column"))  # (P, TABLE_ROWS, Hc, Wc)
    target, source_levels = columns[:, :LEVELS], columns[:, LEVELS:2 * LEVELS]
    closing, interior_weight = columns[:, 2 * LEVELS], columns[:, 2 * LEVELS + 1]
    source_v = v + (source_levels[:, 0] - target[:, 0])
    for level in range(LEVELS - 1):  # piecewise linear between the levels (landmark._inverse_vertical)
        target_span = target[:, level + 1] - target[:, level]
        extra = (source_levels[:, level + 1] - source_levels[:, level]) - target_span
        source_v = source_v + extra * ((v - target[:, level]) / torch.clamp(target_span, min=1e-3)).clamp(0.0, 1.0)

    fade = _box_fade(boxes, height, width)  # (P, Hc, Wc), 0 outside the patch box
    shift_u, shift_v = (u_column - u) * fade, (source_v - v) * fade
    map_x = xs + shift_u * axis_ux + shift_v * axis_vx  # (P, Hc, Wc) region pixels read
    map_y = ys + shift_u * axis_uy + shift_v * axis_vy
    grid = torch.stack((map_x / max(width - 1, 1) * 2.0 - 1.0, map_y / max(height - 1, 1) * 2.0 - 1.0), dim=-1)
    image = functional.grid_sample(source, grid, mode="bilinear", padding_mode="border",
                                   align_corners=True).round_()  # (P, 3, Hc, Wc), uint8 values as cv2.remap's
    mask = (torch.sqrt(shift_u**2 + shift_v**2) * 2.0).clamp_(0.0, 1.0)  # (P, Hc, Wc)

    # 2. The mouth interior inside the lips window of the faces that draw one (landmark.finish_mouth),
    #    computed on each face's lips window only, padded to the batch's largest.
    rows, columns, lips_window = inputs.lips_rows, inputs.lips_columns, inputs.lips  # (P, Lh), (P, Lw), (P, 4)
    face = torch.arange(faces, device=device)[:, None, None]  # (P, 1, 1)
    at_rows, at_columns = rows[:, :, None], columns[:, None, :]  # (P, Lh, 1), (P, 1, Lw)

    def crop(values):  # (P, Hc, Wc) -> (P, Lh, Lw)
        return values[face, at_rows, at_columns]

    def crop_planes(values):  # (P, C, Hc, Wc) -> (P, C, Lh, Lw)
        return values[face, :, at_rows, at_columns].permute(0, 3, 1, 2)

    drawn, alpha = _interior(crop(u), crop(u_column), crop(v), crop_planes(target), crop(closing),
                             crop(interior_weight), scalar, lips_colour, teeth_colour, constants)
    where = ((at_columns >= lips_window[:, 0:1, None]) & (at_columns < lips_window[:, 2:3, None])
             & (at_rows >= lips_window[:, 1:2, None]) & (at_rows < lips_window[:, 3:4, None])
             & inputs.drawn[:, None, None])  # (P, Lh, Lw)
    alpha = alpha * crop(fade) * where  # (P, Lh, Lw)
    under = crop_planes(image)  # (P, 3, Lh, Lw)
    image[face, :, at_rows, at_columns] = torch.floor(
        (under + alpha[:, None] * (drawn - under) + 0.5).clamp_(0.0, 255.0)).permute(0, 2, 3, 1)
    mask[face, at_rows, at_columns] = torch.maximum(crop(mask), alpha)

    # 3. The softened mask: each face's own Gaussian (sigma max(1, 0.04 * mouth width)), then the fade.
    mask = torch.maximum(mask, _blur(mask[:, None], inputs.kernels)[:, 0]) * fade  # (P, Hc, Wc)

    # 4. The patch's colour shifted to the frame's over the mask's soft edge (as blend.blend_patch), in I420
    #    (OpenCV's chroma: each 2x2 block's top-left pixel).
    if color_match:
        image = image + colour_shift(source, image, ((mask > 0.02) & (mask < 0.7))[:, None])[:, :, None, None]
        image = image.round_().clamp_(0.0, 255.0)
    new_y, new_u, new_v = bgr_to_i420(image, "top_left")

    # 5. Mixed into the region's own bytes through the mask (landmark.blend_window): a zero mask keeps a byte
    #    exactly, also one that a conversion to BGR and back would change.
    def mixed(before, after, weight):
        before = before.float()
        return (before + weight * (after.float() - before)).round_().clamp_(0.0, 255.0).to(torch.uint8)

    block_mask = mask[:, 0::2, 0::2]  # (P, Hc/2, Wc/2) at each block's top-left pixel
    y_all[region] = mixed(y, new_y, mask)
    u_all[region] = mixed(u_plane, new_u, block_mask)
    v_all[region] = mixed(v_plane, new_v, block_mask)


__all__ = ["MouthPlan", "RegionFace", "RegionLayout", "draw_mouths", "plan_mouths", "region_layout", "render_mouths"]


@dataclass
class _Planned:
    """A batch of the landmark engine with its faces' regions cut out and their mouths planned."""

    batch: FrameBatch
    regions: Regions | None = None  # None: no face to draw
    plan: object = None  # MouthPlan, None when no face has a patch


class LandmarkDeviceRender(RegionRender):
    """Step 6 for the landmark engine with torch (--render torch), on the engine's --device.

    Three stages. "plan", per batch, on the host: the engine's mouth shapes advance over every
    frame as on the CPU path (LandmarkEngine.mouth_jobs), each face with landmarks gets a region around
    the window the CPU engine reads, cut into a host buffer, and each face's geometry and source
    colours are computed (heygem.engines.landmark.device.plan_face) in the engine's rendering
    processes when it has them, then gathered in frame order (the remembered teeth colour).
    "render": the regions go up and every mouth of the batch is drawn in one batched pass on the
    device. "paste" puts the regions back (see RegionRender). Only the bytes under each face's
    mask change.
    """

    def __init__(self, prepared: Prepared, config: Config):
        super().__init__(prepared, config)
        self._device = None  # picked with the first batch (torch is imported then)

    def stages(self) -> list[Stage]:
        return [Stage("plan", self.plan), Stage("render", self.render), Stage("paste", self.paste)]

    def plan(self, batches: Iterator[FrameBatch]) -> Iterator[_Planned]:
        from heygem.engines.landmark.device import plan_mouths, region_layout
        from heygem.runtime.device import pick_device

        for batch in batches:
            engine = self.prepared.engine
            # the mouth shapes advance with every frame, face or not
            jobs = engine.mouth_jobs(batch.faces, self.prepared.mel_windows(batch.output_indices))
            frame_size = (batch.frames_i420.shape[2], batch.frames_i420.shape[1] * 2 // 3)
            layout = region_layout(jobs, frame_size, engine.region_margin)
            if layout is None:
                yield _Planned(batch)
                continue
            if self._device is None:
                self._device = pick_device(self.config.engine.device)
            regions = self._cut(batch, layout.rows, layout.origins, layout.height, layout.width, self._device)
            pool = engine.rendering_processes() if engine.draws_in_processes(layout.faces) else None
            plan = plan_mouths(layout.faces, regions.host, frame_size, engine.teeth, pool)
            yield _Planned(batch, regions, plan)

    def _render(self, planned: _Planned) -> Downloading:
        from heygem.engines.landmark.device import render_mouths

        if planned.plan is None:  # nothing drawn: the frames stay as decoded
            if planned.regions is not None:
                with self._free_lock:
                    self._free.append(planned.regions.buffer)
            return Downloading(planned.batch)
        planes = planned.regions.pinned.to(self._device, non_blocking=True)  # (F, Hc * 3/2, Wc) uint8
        render_mouths(planes, planned.plan, self.config.blend)
        return self._download(planned.batch, planned.regions, planes)
