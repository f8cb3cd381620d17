"""The landmark engine's geometry: the mouth in its own frame (the line between the corners), the
seven levels of every column across it (under the nose, the lips' outer and inner edges, the jaw,
the neck), where they move for a target mouth shape, and the backward warp that moves them there.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from heygem.engines.landmark.mouth_shapes import clip, smoothstep
from heygem.types import Box

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
# The skin under the jaw keeps at least this share of its height when the chin drops: squeezed
# harder, the shadow under the chin would become a thin dark line across the neck.
UNDER_JAW_KEPT = 0.7
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


def _column_levels(geometry: MouthGeometry, columns: np.ndarray) -> np.ndarray:
    """(7, C) source v of every level at every column, ordered top to bottom."""
    levels = np.empty((7, len(columns)), np.float64)
    levels[TOP] = geometry.top
    for index, name in zip((UPPER_OUTER, UPPER_INNER, LOWER_INNER, LOWER_OUTER, JAW), LEVEL_NAMES[1:6]):
        u, v = geometry.contours[name]
        levels[index] = np.interp(columns, u, v)
    levels[NECK] = geometry.neck
    return np.maximum.accumulate(levels, axis=0)


def mouth_target(geometry: MouthGeometry, openness: float, width: float, speaking: float = 1.0) -> MouthTarget:
    """Move the levels toward a mouth opened by ``openness`` (0..~1.5) and spread by ``width`` (-1..1).

    ``speaking`` (0..1) is how much of that move is made: 0 leaves the face's own mouth as it is
    (nothing moves, nothing is drawn inside), values between go part of the way and draw the
    interior that much (the handover between a pause and the speech, see MouthShapeTracker)."""
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
    moves[JAW] = np.minimum(moves[JAW], (1.0 - UNDER_JAW_KEPT) * (source[NECK] - source[JAW]))
    moves *= fade_out
    target = np.maximum.accumulate(source + speaking * moves, axis=0)

    spread = SPREAD if width > 0 else ROUNDING
    corner_shift = (width * spread - OPENING_NARROWS * min(openness, 1.0)) * mouth_width
    interior = np.maximum(smoothstep(0.0, 1.5, gap_change), 1.0 - keep_source)
    return MouthTarget(
        columns=columns.astype(np.float32),
        source_levels=source.astype(np.float32),
        target_levels=target.astype(np.float32),
        corner_shift=float(speaking * corner_shift),
        closing=(speaking * np.maximum(-gap_change, 0.0)).astype(np.float32),
        interior=(speaking * interior).astype(np.float32),
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


def lips_window(target: MouthTarget, geometry: MouthGeometry, box: Box) -> tuple[slice, slice]:
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


def active_window(active: np.ndarray) -> tuple[slice, slice] | None:
    """The bounding rows and columns of the True pixels of ``active`` (h, w), or None."""
    rows, columns = np.flatnonzero(active.any(axis=1)), np.flatnonzero(active.any(axis=0))
    if len(rows) == 0:
        return None
    return slice(rows[0], rows[-1] + 1), slice(columns[0], columns[-1] + 1)


def coarse_shifts(geometry: MouthGeometry, target: MouthTarget, box: Box, step: int) -> tuple[np.ndarray, np.ndarray]:
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
