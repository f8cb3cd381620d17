"""The built-in lip-sync engine: no weights, no downloads.

It animates the mouth from the audio with the face's own mediapipe landmarks:

1. the audio gives each frame a mouth shape (openness, spread/rounding; see mouth_shapes.py);
2. the lower face is warped so that the lips part along their own curve: the upper lip
   lifts a little, the lower lip, the jaw and the chin move down, the corners spread or
   round. A mouth that is already open in the source is closed or opened toward the target;
3. the mouth interior is rendered inside the new inner-lip contour: a shaded cavity,
   darker toward the throat, the upper teeth under the upper lip, a hint of the tongue
   and of the lower teeth, with colours taken from the face's own lips and skin.

The warp is one dense backward map per face, applied with a single cv2.remap, so the
skin keeps its real texture. It is built in a "mouth frame" aligned with the line
between the mouth corners: within each column across the mouth, seven levels (under
the nose, the outer and inner edges of both lips, the jaw line, the neck) move
vertically and the map between them is piecewise linear, which lets the lips part
(a gap opens) or close (a gap collapses) without folding the skin around them.

A frame whose source mouth is closed and whose target is closed comes back unchanged,
with an all-zero mask.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import cv2
import numpy as np

from heygem.config import BlendConfig, EngineConfig
from heygem.engines.mouth_shapes import MouthShapeTracker, clip, smoothstep
from heygem.media.frames import bgr_to_yuv420, cut_i420_window, even_box
from heygem.render.blend import blend_patch
from heygem.types import Box, EngineBatch, Face, FacePatch, I420Window

logger = logging.getLogger("heygem")

# Mediapipe face-mesh (468 points) contours, each from the left mouth corner (in the image) to the right.
UPPER_OUTER_LIP = (61, 185, 40, 39, 37, 0, 267, 269, 270, 409, 291)
LOWER_OUTER_LIP = (61, 146, 91, 181, 84, 17, 314, 405, 321, 375, 291)
UPPER_INNER_LIP = (78, 191, 80, 81, 82, 13, 312, 311, 310, 415, 308)
LOWER_INNER_LIP = (78, 95, 88, 178, 87, 14, 317, 402, 318, 324, 308)
JAW_LINE = (93, 132, 58, 172, 136, 150, 149, 176, 148, 152, 377, 400, 378, 379, 365, 397, 288, 361, 323)
LEFT_MOUTH_CORNER, RIGHT_MOUTH_CORNER = 61, 291
UNDER_NOSE = 2
CHIN = 152

# Mouth motion, as fractions of the mouth width (corner to corner).
MAX_LIP_GAP = 0.30  # inner-lip gap at the centre for openness 1
CLOSED_GAP = 0.07  # a source gap up to this counts as a closed mouth and is left as it is
OPEN_GAP = 0.12  # a source gap from this on is closed when the target is closed
SPREAD = 0.07  # each corner moves out this much for a full "ee"
ROUNDING = 0.10  # ... and in this much for a full "oo"
OPENING_NARROWS = 0.04  # a wide-open mouth is a little narrower
UPPER_LIP_SHARE = 0.25  # the upper lip takes this share of a change of the gap, the lower lip the rest
UPPER_LIP_STRETCH = 0.35  # the upper lip's outer edge moves this fraction of its inner edge
LOWER_LIP_STRETCH = 0.9  # the lower lip's outer edge moves this fraction of its inner edge
CORNER_DROP = 0.15  # the corners follow the lower lip down by this fraction
JAW_FOLLOWS = 0.8  # the chin moves this fraction of the lower lip
TEETH_LENGTH = 0.12  # visible upper incisors at most, as a fraction of the mouth width
GAP_SHAPE_POWER = 0.6  # profile of the opening across the mouth: (1 - s^2) ** power

# The seven levels of every column across the mouth, top to bottom: rows of the (7, C) level arrays.
LEVEL_NAMES = ("under_nose", "upper_outer", "upper_inner", "lower_inner", "lower_outer", "jaw", "neck")
TOP, UPPER_OUTER, UPPER_INNER, LOWER_INNER, LOWER_OUTER, JAW, NECK = range(7)


@dataclass(frozen=True)
class MouthFrame:
    """A coordinate frame on the mouth: u along the corner line (to the image right), v down."""

    origin: np.ndarray  # (2,) float64, midpoint of the mouth corners, frame pixels
    axis_u: np.ndarray  # (2,) unit vector from the left corner to the right corner
    axis_v: np.ndarray  # (2,) unit vector perpendicular to axis_u, pointing down the face

    @classmethod
    def from_landmarks(cls, landmarks: np.ndarray) -> MouthFrame:
        left = landmarks[LEFT_MOUTH_CORNER].astype(np.float64)
        right = landmarks[RIGHT_MOUTH_CORNER].astype(np.float64)
        axis_u = (right - left) / max(float(np.linalg.norm(right - left)), 1e-6)
        return cls(origin=(left + right) / 2.0, axis_u=axis_u, axis_v=np.array([-axis_u[1], axis_u[0]]))

    def to_mouth(self, points: np.ndarray) -> np.ndarray:
        """(N, 2) frame pixels -> (N, 2) mouth coordinates (u, v)."""
        offsets = points.astype(np.float64) - self.origin
        return np.stack([offsets @ self.axis_u, offsets @ self.axis_v], axis=1)

    def to_frame(self, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mouth coordinates -> frame pixel x, y (arrays of the same shape)."""
        return (self.origin[0] + u * self.axis_u[0] + v * self.axis_v[0],
                self.origin[1] + u * self.axis_u[1] + v * self.axis_v[1])


def _contour(mouth_points: np.ndarray, indices: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A contour as (u, v) arrays with u increasing, ready for np.interp."""
    points = mouth_points[list(indices)]
    points = points[np.argsort(points[:, 0], kind="stable")]
    return points[:, 0], points[:, 1]


@dataclass(frozen=True)
class MouthGeometry:
    """The source face's mouth and jaw in mouth coordinates."""

    frame: MouthFrame
    mouth_width: float  # corner to corner, pixels
    outer_half_width: float  # half the outer lip width along u
    inner_centre: float  # u of the middle between the inner corners
    inner_half_width: float
    under_nose: float  # v of the point under the nose
    chin: float  # v of the chin's lowest point
    jaw_half_width: float  # widest |u| of the jaw line
    contours: dict  # level name -> (u, v) arrays

    @classmethod
    def from_landmarks(cls, landmarks: np.ndarray) -> MouthGeometry:
        frame = MouthFrame.from_landmarks(landmarks)
        mouth_points = frame.to_mouth(landmarks)  # (468, 2)
        contours = {
            "upper_outer": _contour(mouth_points, UPPER_OUTER_LIP),
            "upper_inner": _contour(mouth_points, UPPER_INNER_LIP),
            "lower_inner": _contour(mouth_points, LOWER_INNER_LIP),
            "lower_outer": _contour(mouth_points, LOWER_OUTER_LIP),
            "jaw": _contour(mouth_points, JAW_LINE),
        }
        left_inner, right_inner = mouth_points[UPPER_INNER_LIP[0], 0], mouth_points[UPPER_INNER_LIP[-1], 0]
        mouth_width = float(np.linalg.norm(landmarks[RIGHT_MOUTH_CORNER] - landmarks[LEFT_MOUTH_CORNER]))
        return cls(
            frame=frame,
            mouth_width=max(mouth_width, 1.0),
            outer_half_width=max(mouth_width / 2.0, 1.0),
            inner_centre=float(left_inner + right_inner) / 2.0,
            inner_half_width=max(float(right_inner - left_inner) / 2.0, 1.0),
            under_nose=float(mouth_points[UNDER_NOSE, 1]),
            chin=float(mouth_points[CHIN, 1]),
            jaw_half_width=float(np.abs(contours["jaw"][0]).max()),
            contours=contours,
        )

    @property
    def half_extent_u(self) -> float:
        """Half the width of the region that may move, along u."""
        return 1.1 * max(self.jaw_half_width, 1.8 * self.outer_half_width)

    @property
    def top(self) -> float:
        return min(self.under_nose, -2.0)

    @property
    def neck(self) -> float:
        """v below which nothing moves: under the chin, into the neck."""
        return self.chin + 0.6 * max(self.chin, 4.0)


def patch_box(geometry: MouthGeometry, frame_width: int, frame_height: int) -> Box | None:
    """The frame-aligned box around the region that may move, clipped to the frame."""
    half_u = geometry.half_extent_u
    u = np.array([-half_u, half_u, half_u, -half_u])
    v = np.array([geometry.top - 2.0, geometry.top - 2.0, geometry.neck + 2.0, geometry.neck + 2.0])
    xs, ys = geometry.frame.to_frame(u, v)
    x1, y1 = max(int(np.floor(xs.min())), 0), max(int(np.floor(ys.min())), 0)
    x2, y2 = min(int(np.ceil(xs.max())) + 1, frame_width), min(int(np.ceil(ys.max())) + 1, frame_height)
    if x2 - x1 < 8 or y2 - y1 < 8:
        return None
    return (x1, y1, x2, y2)


@dataclass(frozen=True)
class MouthTarget:
    """Where each level goes, per column of the mouth frame."""

    columns: np.ndarray  # (C,) float32, u of each column, 1 pixel apart
    source_levels: np.ndarray  # (7, C) float32, v of each level in the source
    target_levels: np.ndarray  # (7, C) float32, v of each level in the output
    corner_shift: float  # pixels each corner moves outward (negative: inward)
    closing: np.ndarray  # (C,) float32, pixels by which the source gap was closed (>= 0)
    interior: np.ndarray  # (C,) float32 in [0, 1], how much of the opening is drawn anew: all of it when
    # the source mouth was open (its own inside is replaced), only what was added when it was closed


def _column_levels(geometry: MouthGeometry, columns: np.ndarray) -> np.ndarray:
    """(7, C) source v of every level at every column, ordered top to bottom."""
    levels = np.empty((7, len(columns)), np.float64)
    levels[TOP] = geometry.top
    for index, name in zip((UPPER_OUTER, UPPER_INNER, LOWER_INNER, LOWER_OUTER, JAW), LEVEL_NAMES[1:6]):
        u, v = geometry.contours[name]
        levels[index] = np.interp(columns, u, v)
    levels[NECK] = geometry.neck
    return np.maximum.accumulate(levels, axis=0)


def mouth_target(geometry: MouthGeometry, openness: float, width: float) -> MouthTarget:
    """Move the levels toward a mouth opened by ``openness`` (0..~1.5) and spread by ``width`` (-1..1)."""
    half_u = geometry.half_extent_u
    columns = np.arange(-np.ceil(half_u), np.ceil(half_u) + 1.0)  # (C,)
    source = _column_levels(geometry, columns)  # (7, C)
    mouth_width = geometry.mouth_width

    across = (columns - geometry.inner_centre) / geometry.inner_half_width
    gap_profile = clip(1.0 - across**2, 0.0, 1.0) ** GAP_SHAPE_POWER  # (C,) 1 at the centre, 0 at the corners
    source_gap = source[LOWER_INNER] - source[UPPER_INNER]  # (C,)
    centre_column = int(np.argmin(np.abs(columns - geometry.inner_centre)))
    keep_source = 1.0 - float(smoothstep(CLOSED_GAP, OPEN_GAP, source_gap[centre_column] / mouth_width))
    target_gap = np.maximum(openness * MAX_LIP_GAP * mouth_width * gap_profile, keep_source * source_gap)
    gap_change = target_gap - source_gap  # (C,) > 0 opens, < 0 closes

    lower_drop_centre = (1.0 - UPPER_LIP_SHARE) * gap_change[centre_column]
    distance = np.abs(columns)
    corner_profile = 1.0 - smoothstep(geometry.outer_half_width, 1.8 * geometry.outer_half_width, distance)
    jaw_profile = 1.0 - smoothstep(0.35 * geometry.jaw_half_width, geometry.jaw_half_width, distance)
    fade_out = 1.0 - smoothstep(0.85 * half_u, half_u, distance)  # nothing moves at the region's sides
    corners_down = CORNER_DROP * lower_drop_centre * corner_profile

    moves = np.zeros_like(source)  # (7, C) vertical displacement of each level
    moves[UPPER_INNER] = -UPPER_LIP_SHARE * gap_change + corners_down
    moves[UPPER_OUTER] = -UPPER_LIP_SHARE * UPPER_LIP_STRETCH * gap_change + corners_down
    moves[LOWER_INNER] = (1.0 - UPPER_LIP_SHARE) * gap_change + corners_down
    moves[LOWER_OUTER] = (1.0 - UPPER_LIP_SHARE) * LOWER_LIP_STRETCH * gap_change + corners_down
    moves[JAW] = JAW_FOLLOWS * lower_drop_centre * jaw_profile
    moves *= fade_out
    target = np.maximum.accumulate(source + moves, axis=0)

    spread = SPREAD if width > 0 else ROUNDING
    corner_shift = (width * spread - OPENING_NARROWS * min(openness, 1.0)) * mouth_width
    return MouthTarget(
        columns=columns.astype(np.float32),
        source_levels=source.astype(np.float32),
        target_levels=target.astype(np.float32),
        corner_shift=float(corner_shift),
        closing=np.maximum(-gap_change, 0.0).astype(np.float32),
        interior=np.maximum(smoothstep(0.0, 1.5, gap_change), 1.0 - keep_source).astype(np.float32),
    )


def _horizontal_shift(geometry: MouthGeometry, corner_shift: float, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Outward displacement along u of output points (u, v) when the corners move by ``corner_shift``."""
    if corner_shift == 0.0:
        return np.zeros_like(u)
    along = u / geometry.outer_half_width
    # t * exp(-(t/1.4)^4), normalised to 1 at the corners: linear across the mouth, fading out by ~2 half-widths.
    along_profile = along * np.exp((1.0 / 1.4) ** 4 - (along / 1.4) ** 4)
    upper_lip_top = float(np.interp(0.0, *geometry.contours["upper_outer"]))
    lower_lip_bottom = float(np.interp(0.0, *geometry.contours["lower_outer"]))
    height_profile = smoothstep(geometry.top, upper_lip_top, v) * (1.0 - smoothstep(lower_lip_bottom, geometry.chin, v))
    return (corner_shift * along_profile * height_profile).astype(np.float32)


def _levels_at(levels: np.ndarray, columns: np.ndarray, u: np.ndarray) -> list[np.ndarray]:
    """(L, C) levels sampled at fractional columns ``u`` (h, w): L arrays (h, w), linear between columns."""
    table = np.ascontiguousarray(levels.T[None], dtype=np.float32)  # (1, C, L) a one-row image
    position = (u - columns[0]).astype(np.float32)
    sampled = cv2.remap(table, position, np.zeros_like(position), cv2.INTER_LINEAR,
                        borderMode=cv2.BORDER_REPLICATE)  # (h, w, L)
    return list(cv2.split(sampled))


def _inverse_vertical(v: np.ndarray, source: list[np.ndarray], target: list[np.ndarray]) -> np.ndarray:
    """Source v for output v, piecewise linear between the levels (a gap collapsed in the output is a jump)."""
    source_v = v + (source[0] - target[0])
    for k in range(len(source) - 1):
        target_span = target[k + 1] - target[k]
        extra = (source[k + 1] - source[k]) - target_span
        step = clip((v - target[k]) / np.maximum(target_span, 1e-3), 0.0, 1.0)
        source_v += extra * step
    return source_v


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


@dataclass(frozen=True)
class WarpField:
    """The backward warp at a set of output pixels, in mouth coordinates."""

    u: np.ndarray  # (h, w) float32, output pixel positions along the corner line
    v: np.ndarray  # (h, w) float32, ... and down the face
    u_column: np.ndarray  # (h, w) float32, the source column each output pixel comes from
    source_v: np.ndarray  # (h, w) float32, the source height each output pixel comes from
    target_levels: list  # 7 x (h, w) float32, output v of each level at each pixel's column


def warp_field(geometry: MouthGeometry, target: MouthTarget, xs: np.ndarray, ys: np.ndarray) -> WarpField:
    """Where the output pixels at frame positions ``xs``, ``ys`` (h, w) come from."""
    frame = geometry.frame
    origin_x, origin_y = float(frame.origin[0]), float(frame.origin[1])
    (ux, uy), (vx, vy) = frame.axis_u.astype(np.float32), frame.axis_v.astype(np.float32)
    u = (xs - origin_x) * ux + (ys - origin_y) * uy
    v = (xs - origin_x) * vx + (ys - origin_y) * vy
    u_column = u - _horizontal_shift(geometry, target.corner_shift, u, v)
    levels_px = _levels_at(np.concatenate([target.target_levels, target.source_levels]), target.columns, u_column)
    target_px, source_px = levels_px[:7], levels_px[7:]
    return WarpField(u=u, v=v, u_column=u_column, source_v=_inverse_vertical(v, source_px, target_px),
                     target_levels=target_px)


def _lips_window(target: MouthTarget, geometry: MouthGeometry, box: Box) -> tuple[slice, slice]:
    """Patch rows and columns around the lips: where the warp has its sharp features (a gap
    opening or collapsing) and the interior is drawn; computed exactly, pixel by pixel."""
    near_mouth = np.abs(target.columns) <= geometry.outer_half_width + 1.0
    margin_u = abs(target.corner_shift) + 2.0
    u = np.array([target.columns[near_mouth].min() - margin_u, target.columns[near_mouth].max() + margin_u])
    levels = np.concatenate([target.target_levels[:, near_mouth], target.source_levels[:, near_mouth]], axis=1)
    v = np.array([levels[UPPER_OUTER].min() - 2.0, levels[LOWER_OUTER].max() + 2.0])
    xs, ys = geometry.frame.to_frame(np.repeat(u, 2), np.tile(v, 2))
    x1, y1, x2, y2 = box
    left, right = max(int(np.floor(xs.min())) - x1, 0), min(int(np.ceil(xs.max())) + 1 - x1, x2 - x1)
    top, bottom = max(int(np.floor(ys.min())) - y1, 0), min(int(np.ceil(ys.max())) + 1 - y1, y2 - y1)
    return slice(top, max(bottom, top)), slice(left, max(right, left))


def _active_window(active: np.ndarray) -> tuple[slice, slice] | None:
    """The bounding rows and columns of the True pixels of ``active`` (h, w), or None."""
    rows, columns = np.flatnonzero(active.any(axis=1)), np.flatnonzero(active.any(axis=0))
    if len(rows) == 0:
        return None
    return slice(rows[0], rows[-1] + 1), slice(columns[0], columns[-1] + 1)


def _coarse_shifts(geometry: MouthGeometry, target: MouthTarget, box: Box, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The warp's shifts along u and v over the whole box, computed every ``step`` pixels and
    interpolated: the field is smooth away from the lips (which are computed exactly)."""
    x1, y1, x2, y2 = box
    height, width = y2 - y1, x2 - x1
    coarse_height, coarse_width = -(-height // step), -(-width // step)
    offset = (step - 1) / 2.0  # coarse samples sit at the centres of step x step blocks, as cv2.resize expects
    xs, ys = np.meshgrid(x1 + offset + step * np.arange(coarse_width, dtype=np.float32),
                         y1 + offset + step * np.arange(coarse_height, dtype=np.float32))
    field = warp_field(geometry, target, xs, ys)
    size = (coarse_width * step, coarse_height * step)
    shift_u = cv2.resize(field.u_column - field.u, size, interpolation=cv2.INTER_LINEAR)[:height, :width]
    shift_v = cv2.resize(field.source_v - field.v, size, interpolation=cv2.INTER_LINEAR)[:height, :width]
    return shift_u, shift_v


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
               frame_size: tuple[int, int] | None = None) -> WarpedMouth | None:
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
    target = mouth_target(geometry, openness, width)

    # 1. The backward map: for each output pixel, where it comes from in the source. Coarse
    #    over the box (the field is smooth there), exact around the lips.
    step = int(np.clip(geometry.mouth_width // 50, 1, 6))
    shift_u, shift_v = _coarse_shifts(geometry, target, box, step)  # (h, w) each
    lips = _lips_window(target, geometry, box)
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
    inside = _active_window(((gap > 0.05) & (interior_weight > 0.0)) | (closing_px > 0.05))
    interior = None
    if inside is not None:
        source_box = source_bgr[y1 - origin_y:y2 - origin_y, x1 - origin_x:x2 - origin_x]
        colours = source_colours(source_box, np.array([x1, y1], np.float32), landmarks, geometry)
        window = (slice(lips[0].start + inside[0].start, lips[0].start + inside[0].stop),
                  slice(lips[1].start + inside[1].start, lips[1].start + inside[1].stop))
        interior = MouthInterior(window=window, u=lips_field.u[inside], u_column=lips_field.u_column[inside],
                                 v=lips_field.v[inside], target_levels=[level[inside] for level in lips_field.target_levels],
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
                  face: Face | None = None, teeth_memory: TeethColour | None = None) -> FacePatch | None:
    """New pixels for the lower face of ``frame_bgr`` with the mouth in the given shape.

    ``landmarks`` (468, 2) float32 are the frame's mediapipe face-mesh points in pixels;
    ``openness`` 0 (closed) .. ~1.5, ``width`` -1 (rounded) .. 1 (spread). Returns None
    when the face is too small or outside the frame. This is warp_mouth, then the teeth
    colour (the only state carried from frame to frame), then finish_mouth.
    """
    warped = warp_mouth(frame_bgr, landmarks, openness, width)
    if warped is None:
        return None
    image, mask = finish_mouth(warped, remembered_teeth(warped, teeth_memory))
    return FacePatch(box=warped.box, image_bgr=image, mask=mask, face=face)


# ---------------------------------------------------------------------------- windows of a frame

# The window of the frame that the warp reads: the patch box plus this fraction of the mouth
# width on every side (it moves pixels by a fraction of the mouth's size). A frame whose warp
# reaches further is warped again with the whole frame as its window.
REGION_MARGIN = 0.1


def window_box(landmarks: np.ndarray, frame_width: int, frame_height: int, margin: float = REGION_MARGIN) -> Box | None:
    """The box of the frame that warp_mouth reads for these landmarks: the patch box plus ``margin``
    mouth widths (and 2 pixels) on every side, clipped to the frame; None when there is no patch."""
    geometry = MouthGeometry.from_landmarks(landmarks)
    box = patch_box(geometry, frame_width, frame_height)
    if box is None:
        return None
    pad = int(np.ceil(margin * geometry.mouth_width)) + 2
    return (max(box[0] - pad, 0), max(box[1] - pad, 0), min(box[2] + pad, frame_width), min(box[3] + pad, frame_height))


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
    origin: tuple[int, int]  # (x, y) of its top-left corner in the frame
    frame_size: tuple[int, int]  # (width, height) of the frame
    warped: WarpedMouth  # its box and pixels in frame coordinates


def warp_window(window: np.ndarray, origin: tuple[int, int], frame_size: tuple[int, int], landmarks: np.ndarray,
                openness: float, width: float) -> WarpedWindow | None:
    """warp_mouth on a window of the frame at ``origin`` (x, y): a (h, w, 3) BGR region, or a
    (h * 3/2, w) I420 window at an even origin, converted to BGR first (I420 chroma is per 2x2
    block, so the window converts to the bytes the whole frame has there). None when there is
    no patch; raises RegionTooSmall when the warp reads outside the window."""
    window_bgr = cv2.cvtColor(window, cv2.COLOR_YUV2BGR_I420) if window.ndim == 2 else window  # (h, w, 3)
    warped = warp_mouth(window_bgr, landmarks, openness, width, origin, frame_size)
    if warped is None:
        return None
    return WarpedWindow(window_bgr=window_bgr, origin=origin, frame_size=frame_size, warped=warped)


def blend_window(warped: WarpedWindow, teeth_bgr: np.ndarray | None, blend: BlendConfig) -> I420Window:
    """Finish the mouth (finish_mouth), blend the patch into the window as blend.blend_patch does
    into a frame, and convert the patch box, widened to even coordinates, back to I420 as
    media.write_region_i420 does: the bytes the whole-frame path writes there. Changes the
    window's pixels."""
    image, mask = finish_mouth(warped.warped, teeth_bgr)
    origin_x, origin_y = warped.origin
    x1, y1, x2, y2 = warped.warped.box
    local_box = (x1 - origin_x, y1 - origin_y, x2 - origin_x, y2 - origin_y)
    blend_patch(warped.window_bgr, FacePatch(box=local_box, image_bgr=image, mask=mask), blend)
    even_x1, even_y1, even_x2, even_y2 = even_box(warped.warped.box, *warped.frame_size)
    region = warped.window_bgr[even_y1 - origin_y:even_y2 - origin_y, even_x1 - origin_x:even_x2 - origin_x]
    planes = bgr_to_yuv420(np.ascontiguousarray(region))  # ((y2 - y1) * 3/2, x2 - x1) I420
    return I420Window(box=(even_x1, even_y1, even_x2, even_y2), planes=planes)


# ---------------------------------------------------------------------------- the engine

@dataclass
class _InFlight:
    """A batch handed to the rendering processes: its inputs and each process's warp items."""

    frames: np.ndarray  # (N, H * 3/2, W) I420 or (N, H, W, 3) BGR
    faces: list
    jobs: list  # (frame index, landmarks, openness, width), see LandmarkEngine._jobs
    blend: BlendConfig | None  # None: patches back (generate), else finished I420 windows
    items_by_worker: list  # per process, its ("warp") items



POOL_MIN_FRAMES = 2  # a batch with fewer faces than this is drawn in the calling process


class LandmarkEngine:
    """Lip sync from landmarks and audio alone: a warp of the lower face plus a rendered mouth interior.

    generate() gives BGR patches for BGR frames (the blend stage pastes them); generate_i420()
    gives finished I420 windows for I420 frames, blended here with the blend options, so that
    the caller only pastes bytes. ``workers`` rendering processes (heygem.engines.landmark_pool)
    draw the frames of a batch in parallel (0: all in the calling thread); the main process
    then only cuts windows out of the frames and, for generate_i420, pastes the finished ones
    back. The result is the same, byte for byte, for every worker count: the only state carried
    from frame to frame (the mouth shapes and the remembered teeth colour) is computed here, in
    frame order, between the warp and the drawing of the interior.
    """

    name = "landmark"
    # it moves the frame's own pixels and draws the mouth interior crisply: nothing to deblur
    needs_restoration = False

    def __init__(self, config: EngineConfig, fps: float, workers: int = 0, pool=None):
        """``pool``: rendering processes already running and idle (kept from an earlier job, see
        detach_pool), used instead of starting ``workers`` new ones."""
        self.mouth_strength = float(config.mouth_strength)
        self.fps = float(fps)
        self.workers = int(workers)
        self.region_margin = REGION_MARGIN
        self.shapes = MouthShapeTracker(fps)
        self.teeth = TeethColour()
        self._pool = pool  # a landmark_pool.RenderPool, else started with the first batch that needs it
        logger.debug("landmark engine at %.3f fps, mouth strength %.2f, %d rendering processes",
                     self.fps, self.mouth_strength, self.workers)

    def _jobs(self, faces: list[Face | None], mel_windows: np.ndarray) -> list[tuple]:
        """(frame index, landmarks, openness, width) of the frames with landmarks, in frame order."""
        shapes = self.shapes.update(mel_windows)  # advances with every frame, face or not
        return [(index, face.landmarks, float(openness) * self.mouth_strength, float(width))
                for index, (face, openness, width) in enumerate(zip(faces, shapes.openness, shapes.width))
                if face is not None and face.landmarks is not None]

    def _in_processes(self, jobs: list) -> bool:
        return self.workers > 0 and len(jobs) >= POOL_MIN_FRAMES

    def generate(self, batch: EngineBatch) -> list[FacePatch | None]:
        """One patch per frame; None where the frame has no face or no landmarks."""
        jobs = self._jobs(batch.faces, batch.mel_windows)
        if self._in_processes(jobs):
            return self._generate_in_processes(batch.frames_bgr, batch.faces, jobs, blend=None)
        patches: list[FacePatch | None] = [None] * len(batch.faces)
        for index, landmarks, openness, width in jobs:
            patches[index] = animate_mouth(batch.frames_bgr[index], landmarks, openness, width,
                                           face=batch.faces[index], teeth_memory=self.teeth)
        return patches

    def generate_i420(self, frames_i420: np.ndarray, faces: list[Face | None], mel_windows: np.ndarray,
                      blend: BlendConfig) -> list[I420Window | None]:
        """The frames' finished pixels: one I420Window per frame, None where the frame has no face,
        no landmarks or no patch. ``frames_i420`` (N, H * 3/2, W) uint8 are not changed; pasting
        the windows into them (media.paste_i420_window) gives the bytes that generate(), then
        blend.blend_patch and media.write_region_i420 on whole BGR frames give."""
        jobs = self._jobs(faces, mel_windows)
        if self._in_processes(jobs):
            return self._generate_in_processes(frames_i420, faces, jobs, blend)
        return self._generate_i420_here(frames_i420, faces, jobs, blend)

    def generate_i420_stream(self, batches: Iterator[tuple[np.ndarray, list[Face | None], np.ndarray]],
                             blend: BlendConfig) -> Iterator[list[I420Window | None]]:
        """generate_i420 over a stream of ``(frames_i420, faces, mel_windows)`` batches: one list of
        windows per batch, in order, the same bytes as calling generate_i420 batch after batch.

        With rendering processes the batches overlap: one message per process carries the
        finishing of batch b and the warp of batch b + 1, so the processes warp b + 1 while this
        thread hands b on and waits for the next batch (the teeth colour still advances over the
        frames in order: b's reports are read before b + 1's). A batch too small for the
        processes first lands the one in flight.
        """
        in_flight: _InFlight | None = None
        try:
            for frames, faces, mel_windows in batches:
                if self.workers <= 0:
                    yield self.generate_i420(frames, faces, mel_windows, blend)
                    continue
                jobs = self._jobs(faces, mel_windows)
                if not self._in_processes(jobs):
                    if in_flight is not None:
                        yield self._land(in_flight)
                        in_flight = None
                    yield self._generate_i420_here(frames, faces, jobs, blend)
                    continue
                arriving = self._plan(frames, faces, jobs, blend)
                if in_flight is None:
                    self._take_off(arriving)
                else:
                    yield self._land(in_flight, then=arriving)
                in_flight = arriving
            if in_flight is not None:
                yield self._land(in_flight)
        except BaseException:  # an error, or the caller stopped early: the processes are out of step
            self.close()
            raise

    def _generate_i420_here(self, frames_i420: np.ndarray, faces: list[Face | None], jobs: list,
                            blend: BlendConfig) -> list[I420Window | None]:
        """generate_i420's work in this thread, for jobs already made (_jobs)."""
        windows: list[I420Window | None] = [None] * len(faces)
        frame_size = frame_size_of(frames_i420)
        for index, landmarks, openness, width in jobs:
            box = window_box(landmarks, *frame_size, self.region_margin)
            if box is None:
                continue
            window, origin = cut_window(frames_i420[index], box)
            try:
                warped = warp_window(window, origin, frame_size, landmarks, openness, width)
            except RegionTooSmall:  # rare: the whole frame is the window
                warped = warp_window(frames_i420[index], (0, 0), frame_size, landmarks, openness, width)
            if warped is not None:
                windows[index] = blend_window(warped, remembered_teeth(warped.warped, self.teeth), blend)
        return windows

    def _generate_in_processes(self, frames: np.ndarray, faces: list[Face | None], jobs: list,
                               blend: BlendConfig | None) -> list:
        """generate() (``blend`` None: BGR ``frames``, FacePatch results) or generate_i420() (I420
        ``frames``, I420Window results) with the frames split into one run of consecutive frames
        per process, following the protocol in heygem.engines.landmark_pool:
        1. each process warps its frames' windows and reports which draw an interior, with the teeth they show;
        2. here, in frame order, the remembered teeth colour advances over those reports;
        3. each process draws its frames' interiors with the colours sent back (and blends them into
           the windows), and returns the patches (or the finished windows)."""
        flight = self._plan(frames, faces, jobs, blend)
        try:
            self._take_off(flight)
            return self._land(flight)
        except BaseException:
            self.close()  # the processes' state is out of step with ours: start afresh next time
            raise

    def rendering_processes(self):
        """The rendering processes (heygem.engines.landmark_pool.RenderPool), started if need be;
        only with ``workers`` above 0."""
        from heygem.engines.landmark_pool import RenderPool

        if self._pool is not None and self._pool.size != self.workers:
            self.close()
        if self._pool is None:
            self._pool = RenderPool(self.workers)
        return self._pool

    def _plan(self, frames: np.ndarray, faces: list[Face | None], jobs: list, blend: BlendConfig | None) -> _InFlight:
        """The batch's warp items for each rendering process (started here if need be): consecutive runs
        of its frames, one per process (some empty when there are fewer frames than processes)."""
        pool = self.rendering_processes()
        frame_size = frame_size_of(frames)
        items_by_worker = []
        for run in np.array_split(np.arange(len(jobs)), pool.size):
            items = []
            for job in run:
                index, landmarks, openness, width = jobs[job]
                box = window_box(landmarks, *frame_size, self.region_margin)
                if box is not None:
                    window, origin = cut_window(frames[index], box)
                    items.append((index, window, origin, frame_size, landmarks, openness, width))
            items_by_worker.append(items)
        return _InFlight(frames=frames, faces=faces, jobs=jobs, blend=blend, items_by_worker=items_by_worker)

    def _take_off(self, flight: _InFlight) -> None:
        """Step 1 for ``flight``: every process starts warping its items."""
        for worker, items in enumerate(flight.items_by_worker):
            self._pool.send(worker, ("warp", (flight.blend, items)))

    def _land(self, flight: _InFlight, then: _InFlight | None = None) -> list:
        """Steps 2 and 3 for ``flight`` (whose warp was sent): the teeth colours in frame order, the
        finished results back. With ``then``, each process's finishing message also starts
        ``then``'s warp (its reports are read by the next _land)."""
        pool = self._pool
        frame_size = frame_size_of(flight.frames)
        results: list = [None] * len(flight.faces)
        warped_here: list[tuple[int, WarpedWindow, np.ndarray | None]] = []
        for worker in range(len(flight.items_by_worker)):
            teeth_colours = []
            for index, status, seen_teeth in pool.receive(worker, "observed"):
                if status == "region too small":  # rare: warp with the whole frame as the window, here
                    _, landmarks, openness, width = next(job for job in flight.jobs if job[0] == index)
                    warped = warp_window(flight.frames[index], (0, 0), frame_size, landmarks, openness, width)
                    if warped is not None:
                        warped_here.append((index, warped, remembered_teeth(warped.warped, self.teeth)))
                elif status == "interior":
                    teeth_colours.append((index, self.teeth.update(seen_teeth)))
                elif status == "warp only":
                    teeth_colours.append((index, None))
            if then is None:
                pool.send(worker, ("finish", teeth_colours))
            else:
                pool.send(worker, ("finish+warp", (teeth_colours, then.blend, then.items_by_worker[worker])))
        for worker in range(len(flight.items_by_worker)):
            if flight.blend is None:
                for index, box, image, mask in pool.receive(worker, "patches"):
                    results[index] = FacePatch(box=box, image_bgr=image, mask=mask, face=flight.faces[index])
            else:
                for index, box, planes in pool.receive(worker, "windows"):
                    results[index] = I420Window(box=box, planes=planes)
        for index, warped, teeth_bgr in warped_here:
            if flight.blend is None:
                image, mask = finish_mouth(warped.warped, teeth_bgr)
                results[index] = FacePatch(box=warped.warped.box, image_bgr=image, mask=mask, face=flight.faces[index])
            else:
                results[index] = blend_window(warped, teeth_bgr, flight.blend)
        return results

    def detach_pool(self):
        """The rendering processes (None if none run), handed to the caller instead of being stopped
        by close(): for the next job's engine, once this one's last batch is back (every answer read)."""
        pool, self._pool = self._pool, None
        return pool

    def close(self) -> None:
        """Stop the rendering processes, if any; safe to call more than once."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.close()

    def __del__(self):
        self.close()
