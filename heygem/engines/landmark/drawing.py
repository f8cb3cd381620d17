"""The landmark engine's drawing: the lower face warped by one cv2.remap (the skin keeps its real
texture), the mouth interior rendered inside the new inner-lip contour (a shaded cavity, the upper
teeth, a hint of the tongue and lower teeth, in the face's own colours), and the finished window
blended into the frame.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cv2
import numpy as np

from heygem.config import BlendConfig
from heygem.engines.landmark.geometry import (
    LOWER_INNER,
    LOWER_INNER_LIP,
    LOWER_OUTER_LIP,
    TEETH_LENGTH,
    UPPER_INNER,
    UPPER_INNER_LIP,
    UPPER_OUTER_LIP,
    MouthGeometry,
    active_window,
    coarse_shifts,
    lips_window,
    mouth_target,
    patch_box,
    warp_field,
)
from heygem.engines.landmark.mouth_shapes import clip, smoothstep
from heygem.media.frames import bgr_to_yuv420, cut_i420_window, even_box, i420_planes
from heygem.render.blend import colour_shift
from heygem.types import Box, Face, FacePatch, I420Window


@functools.lru_cache(maxsize=32)
def _border_fade(height: int, width: int) -> np.ndarray:
    """(h, w) float32: 0 on the box border, rising smoothly to 1 a few pixels in. Read-only:
    cached, since a face's box keeps its size over many frames."""
    margin = max(3.0, 0.06 * min(height, width))
    ys = np.arange(height, dtype=np.float32)
    xs = np.arange(width, dtype=np.float32)
    fade_y = smoothstep(0.0, margin, np.minimum(ys, height - 1 - ys))
    fade_x = smoothstep(0.0, margin, np.minimum(xs, width - 1 - xs))
    fade = np.outer(fade_y, fade_x).astype(np.float32)
    fade.setflags(write=False)
    return fade


@dataclass(frozen=True)
class FaceColours:
    """Colours sampled from the source face, BGR float32 in 0..255."""

    lips: np.ndarray  # (3,)
    skin: np.ndarray  # (3,)
    teeth: np.ndarray  # (3,)


def _polygon_mask(shape: tuple[int, int], polygons: list[np.ndarray], holes: list[np.ndarray] = ()) -> np.ndarray:
    """(h, w) uint8 mask, 1 inside ``polygons`` and 0 inside ``holes`` (arrays of (n, 2) pixel points)."""
    mask = np.zeros(shape, np.uint8)
    cv2.fillPoly(mask, [np.round(polygon * 4).astype(np.int32) for polygon in polygons], 1, cv2.LINE_8, 2)
    if holes:
        cv2.fillPoly(mask, [np.round(hole * 4).astype(np.int32) for hole in holes], 0, cv2.LINE_8, 2)
    return mask


def _mask_window(mask: np.ndarray) -> tuple[slice, slice] | None:
    """The bounding rows and columns of the non-zero pixels of a (h, w) uint8 mask, or None."""
    x, y, width, height = cv2.boundingRect(mask)
    if width == 0:
        return None
    return slice(y, y + height), slice(x, x + width)


class TeethColour:
    """The colour of the teeth over a video: what the source showed, smoothed over the frames
    that show them, so that it does not jump when the source mouth closes and opens."""

    def __init__(self):
        self.bgr: np.ndarray | None = None  # (3,) float32

    def update(self, seen_bgr: np.ndarray | None) -> np.ndarray | None:
        if seen_bgr is not None:
            self.bgr = seen_bgr if self.bgr is None else (0.8 * self.bgr + 0.2 * seen_bgr).astype(np.float32)
        return self.bgr


LUMA_WEIGHTS = np.array([0.114, 0.587, 0.299], np.float32)  # BGR -> luma


@dataclass(frozen=True)
class SourceColours:
    """What the source patch shows of the lips, the skin and (when visible) the teeth."""

    lips: np.ndarray  # (3,) float32 BGR
    skin: np.ndarray  # (3,) float32 BGR
    seen_teeth: np.ndarray | None  # (3,) float32 BGR, None when the source shows no teeth


def source_colours(patch_bgr: np.ndarray, patch_origin: np.ndarray, landmarks: np.ndarray,
                   geometry: MouthGeometry) -> SourceColours:
    """Lip and skin colours of the source patch, and its teeth where it shows them (the brightest
    pixels between the inner lips). Depends on this frame alone.

    ``patch_origin`` (2,) is the patch's top-left corner in the frame and ``landmarks``
    (468, 2) the face-mesh points in frame pixels.
    """
    shape = patch_bgr.shape[:2]
    luma_weights = LUMA_WEIGHTS
    outer = landmarks[list(UPPER_OUTER_LIP + LOWER_OUTER_LIP[-2:0:-1])] - patch_origin
    inner = landmarks[list(UPPER_INNER_LIP + LOWER_INNER_LIP[-2:0:-1])] - patch_origin
    frame = geometry.frame
    lower_lip_bottom = float(np.interp(0.0, *geometry.contours["lower_outer"]))
    chin_height = geometry.chin - lower_lip_bottom
    u = np.array([-0.5, 0.5, 0.5, -0.5]) * geometry.outer_half_width
    v = lower_lip_bottom + np.array([0.2, 0.2, 0.75, 0.75]) * chin_height
    chin_x, chin_y = frame.to_frame(u, v)
    chin = np.stack([chin_x, chin_y], axis=1) - patch_origin
    # The means stay over the whole patch: cv2.mean over a smaller window can round differently.
    lips_mask = _polygon_mask(shape, [outer], [inner])
    chin_mask = _polygon_mask(shape, [chin])
    skin = np.array(cv2.mean(patch_bgr, chin_mask if chin_mask.any() else None)[:3], np.float32)
    if lips_mask.any():
        lips = np.array(cv2.mean(patch_bgr, lips_mask)[:3], np.float32)
    else:
        lips = skin * np.array([0.8, 0.75, 1.0], np.float32)
    skin_luma = float(skin @ luma_weights)

    seen_teeth = None
    opening = _polygon_mask(shape, [inner])
    if cv2.countNonZero(opening) >= 12:
        opening_window = _mask_window(opening)  # the same pixels in the same order as over the whole patch
        inside = patch_bgr[opening_window][opening[opening_window] > 0].astype(np.float32)  # (n, 3)
        inside_luma = inside @ luma_weights
        bright = inside[inside_luma >= np.percentile(inside_luma, 70)]
        if len(bright) and float(bright.mean(axis=0) @ luma_weights) > 0.85 * skin_luma:
            seen_teeth = bright.mean(axis=0).astype(np.float32)
    return SourceColours(lips=lips, skin=skin, seen_teeth=seen_teeth)


def face_colours(source: SourceColours, teeth: np.ndarray | None) -> FaceColours:
    """The colours to draw with: ``teeth`` as remembered over the video (see TeethColour), or,
    when no frame so far showed teeth, from the skin's light: a warm off-white a little
    brighter than the skin."""
    if teeth is None:
        teeth = 0.4 * source.skin + 0.6 * min(float(source.skin @ LUMA_WEIGHTS) * 1.12, 235.0)
    return FaceColours(lips=source.lips, skin=source.skin, teeth=clip(teeth, 0, 255).astype(np.float32))


def sample_colours(patch_bgr: np.ndarray, patch_origin: np.ndarray, landmarks: np.ndarray,
                   geometry: MouthGeometry, teeth_memory: TeethColour | None = None) -> FaceColours:
    """Lip, skin and teeth colours of the source patch.

    Teeth come from the source when it shows them (remembered in ``teeth_memory`` for
    the frames that do not), otherwise from the skin's light (see face_colours).
    """
    source = source_colours(patch_bgr, patch_origin, landmarks, geometry)
    teeth = teeth_memory.update(source.seen_teeth) if teeth_memory is not None else source.seen_teeth
    return face_colours(source, teeth)


# Tooth edges of the upper front teeth, across the mouth from its centre, as fractions of the mouth width:
# central incisors, lateral incisors, canines, first premolars.
TOOTH_EDGES = np.array([-0.48, -0.40, -0.30, -0.17, 0.0, 0.17, 0.30, 0.40, 0.48], np.float32)
CAVITY_TINT = np.array([0.5, 0.55, 1.0], np.float32)  # the mouth's cavity: the lips' colour times this (BGR)
TONGUE_TINT = np.array([0.7, 0.72, 1.0], np.float32)  # the tongue: the lips' colour times this (BGR)


def _draw_upper_teeth(colour: list[np.ndarray], u: np.ndarray, v: np.ndarray, upper: np.ndarray, gap: np.ndarray,
                      across: np.ndarray, geometry: MouthGeometry, colours: FaceColours) -> list[np.ndarray]:
    """Composite the upper teeth over ``colour``, the B, G and R planes (h, w) each: rounded,
    slightly convex teeth hanging from the upper lip, in the lip's shadow at the top, darker
    toward the corners, with small dark notches between them at the biting edge."""
    mouth_width = geometry.mouth_width
    position = (u - geometry.inner_centre) / mouth_width  # (h, w) across the mouth, in mouth widths
    right_edge_index = clip(np.searchsorted(TOOTH_EDGES, position), 1, len(TOOTH_EDGES) - 1)
    left_edge, right_edge = TOOTH_EDGES[right_edge_index - 1], TOOTH_EDGES[right_edge_index]
    within_tooth = clip((position - (left_edge + right_edge) / 2) / ((right_edge - left_edge) / 2), -1.0, 1.0)
    near_edge = smoothstep(0.75, 1.0, np.abs(within_tooth))  # 0 in a tooth's middle, 1 at its edges

    length = TEETH_LENGTH * mouth_width * (1.0 - 0.45 * np.minimum(np.abs(position) / 0.45, 1.0) ** 2)
    length = np.minimum(length * (1.0 - 0.3 * near_edge**2), 0.62 * gap + 0.3)  # rounded corners of each tooth
    below_lip = v - upper
    alpha = clip(length - below_lip + 0.5, 0.0, 1.0) * (1.0 - smoothstep(0.6, 0.95, np.abs(across)))
    toward_edge = clip(below_lip / np.maximum(length, 1e-3), 0.0, 1.0)  # 0 at the lip, 1 at the biting edge

    lip_shadow = 0.74 + 0.26 * smoothstep(0.0, 0.4, toward_edge)
    convex = 1.0 - 0.1 * within_tooth**2
    notch = 1.0 - 0.2 * near_edge**2 * (0.25 + 0.75 * toward_edge)
    depth = 1.0 - 0.55 * np.minimum(np.abs(position) / 0.5, 1.0) ** 2
    shade = lip_shadow * convex * notch * depth
    translucent = 0.15 * smoothstep(0.6, 1.0, toward_edge)  # the biting edge is a little see-through
    composited = []
    for plane, teeth_value in zip(colour, colours.teeth):
        teeth = shade * teeth_value
        teeth = teeth + translucent * (plane - teeth)
        composited.append(plane + alpha * (teeth - plane))
    return composited


def render_interior(u: np.ndarray, u_column: np.ndarray, v: np.ndarray, target_levels_px: list[np.ndarray],
                    closing_px: np.ndarray, interior_weight: np.ndarray, geometry: MouthGeometry,
                    colours: FaceColours) -> tuple[np.ndarray, np.ndarray]:
    """The mouth's inside between the output inner lips.

    ``u``, ``v`` (h, w) are the output pixels in mouth coordinates, ``u_column`` the
    source column each comes from (the opening's shape follows the lips, so it is drawn
    in columns; the teeth are fixed to the skull, so they are drawn at ``u``). The levels
    are sampled at those columns; ``closing_px`` (h, w) is how far the source's opening was
    closed there and ``interior_weight`` (h, w) how much of the opening to draw (see
    MouthTarget.interior). Returns (colour (h, w, 3) float32 BGR, alpha (h, w) float32).
    """
    upper = target_levels_px[UPPER_INNER]  # (h, w)
    lower = target_levels_px[LOWER_INNER]
    gap = np.maximum(lower - upper, 0.0)
    mouth_width = geometry.mouth_width
    # Anti-aliased coverage of the opening: a one-pixel ramp at each lip edge.
    across = (u_column - geometry.inner_centre) / geometry.inner_half_width  # -1..1 between the inner corners
    inside_corners = 1.0 - smoothstep(0.92, 1.0, np.abs(across))
    coverage = (clip(v - upper + 0.5, 0.0, 1.0) * clip(lower - v + 0.5, 0.0, 1.0)
                * smoothstep(0.0, 1.0, gap) * inside_corners * interior_weight)
    # Where the warp pressed an open mouth shut, the lips meet along a soft dark line.
    middle = (upper + lower) / 2.0
    seam = (0.55 * smoothstep(0.0, 1.5, closing_px) * np.exp(-(((v - middle) / 0.8) ** 2))
            * smoothstep(2.0, 0.5, gap) * inside_corners)
    alpha = np.maximum(coverage, seam).astype(np.float32)

    depth_down = clip((v - upper) / np.maximum(gap, 1e-3), 0.0, 1.0)  # 0 at the upper lip, 1 at the lower
    # The cavity: red-brown from the lips' own colour, lit a little near the lips and the
    # corners, darkest at the back of the throat.
    cavity = colours.lips * CAVITY_TINT
    radial = np.sqrt(across**2 + ((depth_down - 0.45) / 0.55) ** 2)
    cavity_light = 0.07 + 0.38 * smoothstep(0.3, 1.15, radial)
    # The colour is kept as three (h, w) planes, B, G, R: the same arithmetic per pixel and
    # channel as on an (h, w, 3) image, without numpy's slow broadcasting over a last axis of 3.
    colour = [cavity_light * value for value in cavity]

    # A hint of the tongue, low in the mouth, rounded, shaded toward its back.
    tongue_shape = (across / 0.55) ** 2 + ((depth_down - 1.05) / 0.55) ** 2
    tongue_alpha = (1.0 - smoothstep(0.45, 1.0, tongue_shape)) * smoothstep(0.1, 0.24, gap / mouth_width) * 0.7
    tongue_light = 0.22 + 0.33 * smoothstep(0.4, 1.0, depth_down)
    for plane, value in zip(colour, colours.lips * TONGUE_TINT):
        plane += tongue_alpha * (tongue_light * value - plane)

    # A hint of the lower teeth just above the lower lip, in shadow, when the mouth is wide open.
    lower_teeth_height = 0.045 * mouth_width
    lower_teeth = (smoothstep(lower_teeth_height + 0.5, lower_teeth_height - 0.5, lower - v)
                   * (1.0 - smoothstep(0.35, 0.7, np.abs(across))) * smoothstep(0.2, 0.3, gap / mouth_width) * 0.35)
    for plane, value in zip(colour, colours.teeth * 0.55):
        plane += lower_teeth * (value - plane)

    # The upper teeth: a band under the upper lip, shorter toward the sides, limited by the opening.
    colour = _draw_upper_teeth(colour, u, v, upper, gap, across, geometry, colours)

    # Lips meeting after a closure show their own darkened colour, not the cavity's.
    seam_only = seam > coverage
    for plane, value in zip(colour, colours.lips * 0.45):
        plane[seam_only] = value
    # As soft as a photo: the drawn edges between teeth and cavity get a touch of blur.
    colour = cv2.GaussianBlur(cv2.merge(colour), (0, 0), 0.6)  # (h, w, 3)
    return colour, alpha


@dataclass
class MouthInterior:
    """What drawing the mouth's inside needs, over the patch window where it is drawn."""

    window: tuple[slice, slice]  # rows and columns of the patch
    u: np.ndarray  # (h, w) float32, output pixels in mouth coordinates (see render_interior)
    u_column: np.ndarray  # (h, w) float32
    v: np.ndarray  # (h, w) float32
    target_levels: list  # 7 x (h, w) float32
    closing_px: np.ndarray  # (h, w) float32
    interior_weight: np.ndarray  # (h, w) float32
    geometry: MouthGeometry
    colours: SourceColours


@dataclass
class WarpedMouth:
    """A frame after the warp, before the mouth interior is drawn: everything about it that
    depends on this frame alone. ``interior`` is None where nothing is drawn inside the lips."""

    box: Box
    image_bgr: np.ndarray  # (h, w, 3) uint8 BGR, the box after the warp
    mask: np.ndarray  # (h, w) float32 in [0, 1], where the warp moved pixels
    fade: np.ndarray  # (h, w) float32, the box's border fade
    mouth_width: float
    interior: MouthInterior | None


class RegionTooSmall(Exception):
    """The warp reads frame pixels outside the region it was given (see warp_mouth)."""


def _map_to_region(map_values: np.ndarray, start: int, size: int, frame_size: int) -> np.ndarray:
    """Frame coordinates -> coordinates in a region [start, start + size) of a frame axis of
    ``frame_size`` pixels. Bilinear sampling must find both its neighbours inside the region
    wherever the region ends inside the frame (at the frame's own edges the border is
    replicated, as for the whole frame). Subtracting the integer ``start`` from float32
    coordinates >= start is exact, so the sampling is bit-identical to the whole frame's."""
    if start > 0 and float(map_values.min()) < start:
        raise RegionTooSmall
    if start + size < frame_size and float(map_values.max()) > start + size - 2:
        raise RegionTooSmall
    return map_values - np.float32(start) if start else map_values


def remap_bgr(source_bgr: np.ndarray, map_x: np.ndarray, map_y: np.ndarray) -> np.ndarray:
    """cv2.remap(source_bgr, map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE) of a
    (H, W, 3) uint8 BGR image with (h, w) float32 maps: (h, w, 3) uint8, the same bytes, faster.

    OpenCV's bilinear remap of 4-channel 8-bit images is about 2.5x faster than of 3-channel
    ones and computes each channel the same way, so the part of the source the maps read (plus
    2 pixels, or up to the image's edge, where the border is replicated as before) is converted
    to BGRA, warped, and converted back. Subtracting the integer corner of that part from
    float32 coordinates at or beyond it is exact.
    """
    height, width = source_bgr.shape[:2]
    x1, x2 = max(int(np.floor(map_x.min())) - 2, 0), min(int(np.floor(map_x.max())) + 4, width)
    y1, y2 = max(int(np.floor(map_y.min())) - 2, 0), min(int(np.floor(map_y.max())) + 4, height)
    if x1 >= x2 or y1 >= y2:  # the maps read only the replicated border: nothing to gain
        return cv2.remap(source_bgr, map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    region_bgra = cv2.cvtColor(source_bgr[y1:y2, x1:x2], cv2.COLOR_BGR2BGRA)  # (y2 - y1, x2 - x1, 4)
    if x1:
        map_x = map_x - np.float32(x1)
    if y1:
        map_y = map_y - np.float32(y1)
    warped_bgra = cv2.remap(region_bgra, map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    return cv2.cvtColor(warped_bgra, cv2.COLOR_BGRA2BGR)  # (h, w, 3)


def warp_mouth(source_bgr: np.ndarray, landmarks: np.ndarray, openness: float, width: float,
               source_origin: tuple[int, int] = (0, 0),
               frame_size: tuple[int, int] | None = None, speaking: float = 1.0) -> WarpedMouth | None:
    """The first half of animate_mouth: the warp, the mask and the inputs of the interior.

    ``source_bgr`` is the frame, or a region of it whose top-left corner is at
    ``source_origin`` (x, y) in a frame of ``frame_size`` (width, height) pixels; a region
    must contain the patch box, and gives the same result as the whole frame unless the
    warp reads outside it, which raises RegionTooSmall.
    """
    if frame_size is None:
        frame_height, frame_width = source_bgr.shape[:2]
    else:
        frame_width, frame_height = frame_size
    origin_x, origin_y = source_origin
    geometry = MouthGeometry.from_landmarks(landmarks)
    box = patch_box(geometry, frame_width, frame_height)
    if box is None:
        return None
    x1, y1, x2, y2 = box
    if x1 < origin_x or y1 < origin_y or x2 > origin_x + source_bgr.shape[1] or y2 > origin_y + source_bgr.shape[0]:
        raise RegionTooSmall
    target = mouth_target(geometry, openness, width, speaking)

    # 1. The backward map: for each output pixel, where it comes from in the source. Coarse
    #    over the box (the field is smooth there), exact around the lips.
    step = int(np.clip(geometry.mouth_width // 50, 1, 6))
    shift_u, shift_v = coarse_shifts(geometry, target, box, step)  # (h, w) each
    lips = lips_window(target, geometry, box)
    xs, ys = np.meshgrid(np.arange(x1 + lips[1].start, x1 + lips[1].stop, dtype=np.float32),
                         np.arange(y1 + lips[0].start, y1 + lips[0].stop, dtype=np.float32))
    lips_field = warp_field(geometry, target, xs, ys)
    shift_u[lips] = lips_field.u_column - lips_field.u
    shift_v[lips] = lips_field.source_v - lips_field.v

    fade = _border_fade(y2 - y1, x2 - x1)
    shift_u *= fade
    shift_v *= fade
    (ux, uy), (vx, vy) = geometry.frame.axis_u.astype(np.float32), geometry.frame.axis_v.astype(np.float32)
    map_x = np.arange(x1, x2, dtype=np.float32)[None, :] + shift_u * ux + shift_v * vx
    map_y = np.arange(y1, y2, dtype=np.float32)[:, None] + shift_u * uy + shift_v * vy
    map_x = _map_to_region(map_x, origin_x, source_bgr.shape[1], frame_width)
    map_y = _map_to_region(map_y, origin_y, source_bgr.shape[0], frame_height)
    image = remap_bgr(source_bgr, map_x, map_y)  # (h, w, 3)
    mask = clip(np.sqrt(shift_u**2 + shift_v**2) * 2.0, 0.0, 1.0)  # (h, w): ours from half a pixel of movement on

    # 2. Where the lips parted (or closed lips meet), the interior will be drawn.
    closing_px = np.interp(lips_field.u_column, target.columns, target.closing).astype(np.float32)
    interior_weight = np.interp(lips_field.u_column, target.columns, target.interior).astype(np.float32)
    gap = lips_field.target_levels[LOWER_INNER] - lips_field.target_levels[UPPER_INNER]
    inside = active_window(((gap > 0.05) & (interior_weight > 0.0)) | (closing_px > 0.05))
    interior = None
    if inside is not None:
        source_box = source_bgr[y1 - origin_y:y2 - origin_y, x1 - origin_x:x2 - origin_x]
        colours = source_colours(source_box, np.array([x1, y1], np.float32), landmarks, geometry)
        window = (slice(lips[0].start + inside[0].start, lips[0].start + inside[0].stop),
                  slice(lips[1].start + inside[1].start, lips[1].start + inside[1].stop))
        interior = MouthInterior(window=window, u=lips_field.u[inside], u_column=lips_field.u_column[inside],
                                 v=lips_field.v[inside],
                                 target_levels=[level[inside] for level in lips_field.target_levels],
                                 closing_px=closing_px[inside], interior_weight=interior_weight[inside],
                                 geometry=geometry, colours=colours)
    return WarpedMouth(box=box, image_bgr=image, mask=mask, fade=fade, mouth_width=geometry.mouth_width,
                       interior=interior)


def finish_mouth(warped: WarpedMouth, teeth_bgr: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The second half of animate_mouth: draw the interior with ``teeth_bgr`` (the remembered
    teeth colour, or None for one from the skin), soften the mask. Returns (image (h, w, 3)
    uint8 BGR, mask (h, w) float32); ``warped`` is used up (its arrays are changed in place)."""
    image, mask, fade = warped.image_bgr, warped.mask, warped.fade
    interior = warped.interior
    if interior is not None:
        colours = face_colours(interior.colours, teeth_bgr)
        drawn, alpha = render_interior(interior.u, interior.u_column, interior.v, interior.target_levels,
                                       interior.closing_px, interior.interior_weight, interior.geometry, colours)
        window = interior.window
        alpha *= fade[window]
        region = image[window].astype(np.float32)
        image[window] = clip(region + alpha[..., None] * (drawn - region) + 0.5, 0, 255).astype(np.uint8)
        mask[window] = np.maximum(mask[window], alpha)

    if mask.max() > 0.0:
        mask = np.maximum(mask, cv2.GaussianBlur(mask, (0, 0), max(1.0, 0.04 * warped.mouth_width)))
    mask *= fade
    return image, mask.astype(np.float32)


def remembered_teeth(warped: WarpedMouth | None, teeth_memory: TeethColour | None) -> np.ndarray | None:
    """The teeth colour to draw ``warped`` with; updates ``teeth_memory`` (in frame order) when
    the frame draws an interior, as animate_mouth does."""
    if warped is None or warped.interior is None:
        return None
    seen = warped.interior.colours.seen_teeth
    return teeth_memory.update(seen) if teeth_memory is not None else seen


def animate_mouth(frame_bgr: np.ndarray, landmarks: np.ndarray, openness: float, width: float,
                  face: Face | None = None, teeth_memory: TeethColour | None = None,
                  speaking: float = 1.0) -> FacePatch | None:
    """New pixels for the lower face of ``frame_bgr`` with the mouth in the given shape.

    ``landmarks`` (468, 2) float32 are the frame's mediapipe face-mesh points in pixels;
    ``openness`` 0 (closed) .. ~1.5, ``width`` -1 (rounded) .. 1 (spread), ``speaking`` 0 (the
    face's own mouth) .. 1 (all of that shape; see geometry.mouth_target). Returns None
    when the face is too small or outside the frame. This is warp_mouth, then the teeth
    colour (the only state carried from frame to frame), then finish_mouth.
    """
    warped = warp_mouth(frame_bgr, landmarks, openness, width, speaking=speaking)
    if warped is None:
        return None
    image, mask = finish_mouth(warped, remembered_teeth(warped, teeth_memory))
    return FacePatch(box=warped.box, image_bgr=image, mask=mask, face=face)


def frame_size_of(frames: np.ndarray) -> tuple[int, int]:
    """(width, height) of the frames of a (N, H, W, 3) BGR or (N, H * 3/2, W) I420 batch."""
    if frames.ndim == 4:
        return frames.shape[2], frames.shape[1]
    return frames.shape[2], frames.shape[1] * 2 // 3


def cut_window(frame: np.ndarray, box: Box) -> tuple[np.ndarray, tuple[int, int]]:
    """The ``box`` of one frame as (window, its top-left (x, y)): of a (H, W, 3) BGR frame a copy of
    the region; of a (H * 3/2, W) I420 frame the box widened to even coordinates (whole 2x2 chroma
    blocks), packed as a (h * 3/2, w) I420 image."""
    if frame.ndim == 2:
        box = even_box(box, frame.shape[1], frame.shape[0] * 2 // 3)
        return cut_i420_window(frame, box), (box[0], box[1])
    x1, y1, x2, y2 = box
    return np.ascontiguousarray(frame[y1:y2, x1:x2]), (x1, y1)


@dataclass
class WarpedWindow:
    """A window of a frame after the warp (see warp_window)."""

    window_bgr: np.ndarray  # (h, w, 3) uint8 BGR, the window as the frame shows it
    window_i420: np.ndarray | None  # (h * 3/2, w) uint8, its decoded bytes (None for a BGR window)
    origin: tuple[int, int]  # (x, y) of its top-left corner in the frame
    frame_size: tuple[int, int]  # (width, height) of the frame
    warped: WarpedMouth  # its box and pixels in frame coordinates


def warp_window(window: np.ndarray, origin: tuple[int, int], frame_size: tuple[int, int], landmarks: np.ndarray,
                openness: float, width: float, speaking: float = 1.0) -> WarpedWindow | None:
    """warp_mouth on a window of the frame at ``origin`` (x, y): a (h, w, 3) BGR region, or a
    (h * 3/2, w) I420 window at an even origin, converted to BGR first (I420 chroma is per 2x2
    block, so the window converts to the bytes the whole frame has there). None when there is
    no patch; raises RegionTooSmall when the warp reads outside the window."""
    window_bgr = cv2.cvtColor(window, cv2.COLOR_YUV2BGR_I420) if window.ndim == 2 else window  # (h, w, 3)
    warped = warp_mouth(window_bgr, landmarks, openness, width, origin, frame_size, speaking)
    if warped is None:
        return None
    return WarpedWindow(window_bgr=window_bgr, window_i420=window if window.ndim == 2 else None, origin=origin,
                        frame_size=frame_size, warped=warped)


def blend_window(warped: WarpedWindow, teeth_bgr: np.ndarray | None, blend: BlendConfig) -> I420Window:
    """Finish the mouth (finish_mouth) and mix it into the window's own I420 bytes over the patch box,
    widened to even coordinates: the patch's colour is shifted to the frame's over the mask's soft edge
    (as blend.blend_patch does), converted to I420 (OpenCV's, chroma from each 2x2 block's top-left
    pixel), and each byte becomes rint(byte + mask * (patch byte - byte)), with the mask at the pixel
    for Y and at its block's top-left pixel for U and V. Bytes where the mask is 0 keep their decoded
    values exactly, also those that a conversion to BGR and back would change (Y below 16 or above
    235, colours outside BGR): such a change would show the box's edge as a line across the face or
    the neck. ``warped`` must come from an I420 window (warp_window)."""
    image, mask = finish_mouth(warped.warped, teeth_bgr)  # (h, w, 3) uint8, (h, w) float32 on the patch box
    origin_x, origin_y = warped.origin
    x1, y1, x2, y2 = warped.warped.box
    even_x1, even_y1, even_x2, even_y2 = even_box(warped.warped.box, *warped.frame_size)
    if blend.color_match:
        shift = colour_shift(image, warped.window_bgr[y1 - origin_y:y2 - origin_y, x1 - origin_x:x2 - origin_x], mask)
        if shift is not None:
            image = clip(np.rint(image + shift), 0, 255).astype(np.uint8)
    even_local = (even_x1 - origin_x, even_y1 - origin_y, even_x2 - origin_x, even_y2 - origin_y)
    patched = warped.window_bgr[even_local[1]:even_local[3], even_local[0]:even_local[2]].copy()  # (he, we, 3)
    inner = (slice(y1 - even_y1, y2 - even_y1), slice(x1 - even_x1, x2 - even_x1))
    patched[inner] = image
    weights = np.zeros(patched.shape[:2], np.float32)  # (he, we) the mask on the even box
    weights[inner] = mask
    height, width = weights.shape
    own = i420_planes(cut_i420_window(warped.window_i420, even_local))  # the decoded bytes
    new = i420_planes(bgr_to_yuv420(patched))  # Y (he, we), U and V (he/2, we/2)
    chroma_weights = weights[0::2, 0::2]
    planes = np.empty((height * 3 // 2, width), np.uint8)
    for target, before, after, weight in zip(i420_planes(planes), own, new,
                                             (weights, chroma_weights, chroma_weights)):
        before = before.astype(np.float32)
        target[...] = clip(np.rint(before + weight * (after.astype(np.float32) - before)), 0, 255)
    return I420Window(box=(even_x1, even_y1, even_x2, even_y2), planes=planes)
