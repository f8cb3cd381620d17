"""Frames as the stages hold them: I420 planes (what ffmpeg decodes and x264 encodes, half the bytes
of BGR), their colour conversion, windows cut out of them and pasted back, and frames that convert
only the region a face tracker looks at.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def yuv420_to_bgr(planes: np.ndarray, width: int, height: int) -> np.ndarray:
    """One (H * 3/2, W) uint8 I420 frame to (H, W, 3) uint8 BGR (BT.601, limited range).

    The same conversion backwards is used when encoding, so pixels that heygem
    does not touch come out as they went in.
    """
    import cv2

    return cv2.cvtColor(planes.reshape(height * 3 // 2, width), cv2.COLOR_YUV2BGR_I420)


def bgr_to_yuv420(frame_bgr: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 BGR to one (H * 3/2, W) uint8 I420 frame; the inverse of :func:`yuv420_to_bgr`."""
    import cv2

    return cv2.cvtColor(frame_bgr, cv2.COLOR_BGR2YUV_I420)


def i420_planes(frame: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of the Y (H, W), U and V (H/2, W/2) planes of one (H * 3/2, W) I420 frame."""
    rows, width = frame.shape
    height = rows * 2 // 3
    flat = frame.reshape(-1)
    luma, chroma = height * width, height * width // 4
    return (flat[:luma].reshape(height, width), flat[luma:luma + chroma].reshape(height // 2, width // 2),
            flat[luma + chroma:].reshape(height // 2, width // 2))


def write_region_i420(frame_i420: np.ndarray, frame_bgr: np.ndarray, box: tuple[int, int, int, int]) -> None:
    """Convert the ``box`` region of ``frame_bgr`` (H, W, 3) back into ``frame_i420`` (H * 3/2, W) in place.

    The region is widened to even coordinates so that every 2x2 chroma block it touches is
    whole; the bytes written are those a conversion of the whole frame would give there.
    """
    height, width = frame_bgr.shape[:2]
    x1, y1, x2, y2 = box
    x1, y1 = max(0, x1 - x1 % 2), max(0, y1 - y1 % 2)
    x2, y2 = min(width, x2 + x2 % 2), min(height, y2 + y2 % 2)
    if x2 <= x1 or y2 <= y1:
        return
    region = bgr_to_yuv420(np.ascontiguousarray(frame_bgr[y1:y2, x1:x2]))  # ((y2-y1) * 3/2, x2-x1)
    for frame_plane, region_plane, scale in zip(i420_planes(frame_i420), i420_planes(region), (1, 2, 2)):
        frame_plane[y1 // scale: y2 // scale, x1 // scale: x2 // scale] = region_plane


def even_box(box: tuple[int, int, int, int], width: int, height: int) -> tuple[int, int, int, int]:
    """``box`` widened to even coordinates (whole 2x2 chroma blocks) and clipped to a ``width`` x ``height`` frame."""
    x1, y1, x2, y2 = box
    return (max(0, x1 - x1 % 2), max(0, y1 - y1 % 2), min(width, x2 + x2 % 2), min(height, y2 + y2 % 2))


def cut_i420_window(frame_i420: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    """A copy of the even-aligned ``box`` of one (H * 3/2, W) I420 frame, packed as its own
    ((y2 - y1) * 3/2, x2 - x1) I420 image: the box's Y rows, then its U and V half-size windows."""
    x1, y1, x2, y2 = _checked_even(box)
    window = np.empty(((y2 - y1) * 3 // 2, x2 - x1), dtype=np.uint8)
    for window_plane, frame_plane, scale in zip(i420_planes(window), i420_planes(frame_i420), (1, 2, 2)):
        window_plane[...] = frame_plane[y1 // scale: y2 // scale, x1 // scale: x2 // scale]
    return window


def paste_i420_window(frame_i420: np.ndarray, box: tuple[int, int, int, int], window_i420: np.ndarray) -> None:
    """Write a packed I420 ``window_i420`` (see cut_i420_window) into the even-aligned ``box`` of
    one (H * 3/2, W) I420 frame, in place: three plane slices."""
    x1, y1, x2, y2 = _checked_even(box)
    if window_i420.shape != ((y2 - y1) * 3 // 2, x2 - x1):
        raise ValueError(f"an I420 window of shape {window_i420.shape} does not fit the box {box}")
    for frame_plane, window_plane, scale in zip(i420_planes(frame_i420), i420_planes(window_i420), (1, 2, 2)):
        frame_plane[y1 // scale: y2 // scale, x1 // scale: x2 // scale] = window_plane


def _checked_even(box: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    if any(value % 2 for value in box) or box[2] <= box[0] or box[3] <= box[1]:
        raise ValueError(f"an I420 window needs a non-empty box with even coordinates, not {box}")
    return box


class I420Frame:
    """One (H * 3/2, W) I420 frame that converts to BGR only what is looked at: a face tracker needs
    the whole frame for a detection but only the crop around the face for the mesh."""

    def __init__(self, planes: np.ndarray):
        self.planes = planes
        self.height, self.width = planes.shape[0] * 2 // 3, planes.shape[1]

    def bgr(self) -> np.ndarray:
        """The whole frame, (H, W, 3) uint8 BGR."""
        return yuv420_to_bgr(self.planes, self.width, self.height)

    def region(self, x1: int, y1: int, x2: int, y2: int, rgb: bool = False,
               size: tuple[int, int] | None = None) -> np.ndarray:
        """Pixels [y1:y2, x1:x2] as (y2-y1, x2-x1, 3) uint8 BGR (RGB if ``rgb``), or resampled to ``size``
        (width, height) as :func:`resample_region` does; only a resampled region may reach past the
        frame's edges (black there).

        Only whole 2x2 chroma blocks around the region are converted, so the pixels are those a
        conversion of the whole frame gives. A region that shrinks to half its size or less is
        halved in I420 first (each plane averaged over 2x2 blocks): the colour conversion then sees
        a quarter of the pixels.
        """
        import cv2

        code = cv2.COLOR_YUV2RGB_I420 if rgb else cv2.COLOR_YUV2BGR_I420
        if size is None and (x1, y1, x2, y2) == (0, 0, self.width, self.height):  # the whole frame: no block to cut
            return cv2.cvtColor(self.planes, code)
        halve = size is not None and x2 - x1 >= 2 * size[0] and y2 - y1 >= 2 * size[1]
        align = 4 if halve else 2  # a halved I420 block needs whole 4x4 blocks for its halved chroma
        block_x1, block_y1 = max(0, x1 - x1 % align), max(0, y1 - y1 % align)
        block_x2, block_y2 = min(self.width, x2 + (-x2) % align), min(self.height, y2 + (-y2) % align)
        if halve and ((block_x2 - block_x1) % 4 or (block_y2 - block_y1) % 4):  # at a frame edge not on 4
            halve = False
        pixel_size = 2 if halve else 1  # frame pixels per block pixel
        block = np.empty(((block_y2 - block_y1) // pixel_size * 3 // 2, (block_x2 - block_x1) // pixel_size),
                         dtype=np.uint8)
        for block_plane, frame_plane, plane_scale in zip(i420_planes(block), i420_planes(self.planes), (1, 2, 2)):
            source = frame_plane[block_y1 // plane_scale: block_y2 // plane_scale,
                                 block_x1 // plane_scale: block_x2 // plane_scale]
            if halve:  # bilinear sampling at exactly half the size averages each 2x2 block
                cv2.resize(source, block_plane.shape[::-1], dst=block_plane, interpolation=cv2.INTER_LINEAR)
            else:
                block_plane[:] = source
        pixels = cv2.cvtColor(block, code)
        if size is None:
            return pixels[y1 - block_y1: y2 - block_y1, x1 - block_x1: x2 - block_x1]
        return resample_region(pixels, (block_x1, block_y1), pixel_size, (x1, y1, x2, y2), size)


class BgrImage:
    """An (H, W, 3) uint8 BGR image behind the same two calls as :class:`I420Frame`."""

    def __init__(self, image_bgr: np.ndarray):
        self.image_bgr = image_bgr
        self.height, self.width = image_bgr.shape[:2]

    def bgr(self) -> np.ndarray:
        return self.image_bgr

    def region(self, x1: int, y1: int, x2: int, y2: int, rgb: bool = False,
               size: tuple[int, int] | None = None) -> np.ndarray:
        import cv2

        if size is None:
            pixels = self.image_bgr[y1:y2, x1:x2]
        else:  # from the block an I420 frame converts when it does not halve, so that both give the same
            block_x1, block_y1 = max(0, x1 - x1 % 2), max(0, y1 - y1 % 2)
            block = self.image_bgr[block_y1: min(self.height, y2 + y2 % 2), block_x1: min(self.width, x2 + x2 % 2)]
            pixels = resample_region(block, (block_x1, block_y1), 1, (x1, y1, x2, y2), size)
        return cv2.cvtColor(pixels, cv2.COLOR_BGR2RGB) if rgb else pixels


def resample_region(image: np.ndarray, origin: tuple[int, int], pixel_size: int, box: tuple[int, int, int, int],
                    size: tuple[int, int]) -> np.ndarray:
    """The part ``box`` (x1, y1, x2, y2 frame pixels) of ``image`` (H, W, C), resampled to ``size``
    (width, height) with the box's edges on the result's edges.

    ``image`` pixel (0, 0) starts at frame pixel ``origin`` and each of its pixels spans
    ``pixel_size`` frame pixels. While the result is half the image's resolution or less, the
    image is halved (2x2 blocks averaged); one bilinear warp then does the rest, which at less than
    2:1 still averages every pixel (as area averaging does, within a level, at a tenth of its
    cost), or a bicubic one when the result is larger. Result pixels whose centres lie past the
    image's edges are black (the warp itself repeats the edge pixels, so the pixels inside are
    those of a box within the image).
    """
    import cv2

    x1, y1, x2, y2 = box
    width, height = size
    step_x, step_y = (x2 - x1) / width, (y2 - y1) / height  # frame pixels per result pixel
    image_x2, image_y2 = origin[0] + image.shape[1] * pixel_size, origin[1] + image.shape[0] * pixel_size
    while step_x >= 2 * pixel_size and step_y >= 2 * pixel_size and min(image.shape[:2]) >= 2:
        even = image[: image.shape[0] // 2 * 2, : image.shape[1] // 2 * 2]
        image = cv2.resize(even, (even.shape[1] // 2, even.shape[0] // 2), interpolation=cv2.INTER_LINEAR)
        pixel_size *= 2
    # result pixel u's centre lies at frame x1 + (u + 0.5) * step_x, which is image pixel
    # (that - origin) / pixel_size - 0.5 (pixel centres at .5, as cv2 counts them)
    to_image = np.array([[step_x / pixel_size, 0, (x1 - origin[0] + 0.5 * step_x) / pixel_size - 0.5],
                         [0, step_y / pixel_size, (y1 - origin[1] + 0.5 * step_y) / pixel_size - 0.5]])
    interpolation = cv2.INTER_CUBIC if step_x < pixel_size or step_y < pixel_size else cv2.INTER_LINEAR
    result = cv2.warpAffine(image, to_image, (width, height), flags=interpolation | cv2.WARP_INVERSE_MAP,
                            borderMode=cv2.BORDER_REPLICATE)
    if x1 < origin[0] or y1 < origin[1] or x2 > image_x2 or y2 > image_y2:
        centres_x = x1 + (np.arange(width) + 0.5) * step_x
        centres_y = y1 + (np.arange(height) + 0.5) * step_y
        result[:, (centres_x < origin[0]) | (centres_x >= image_x2)] = 0
        result[(centres_y < origin[1]) | (centres_y >= image_y2)] = 0
    return result


Frame = np.ndarray | I420Frame | BgrImage  # (H, W, 3) uint8 BGR, or a frame converted where it is looked at


def as_frame(frame: Frame) -> I420Frame | BgrImage:
    """``frame`` behind the calls that face finding uses (``bgr()``, ``region()``): an array is a BGR image."""
    return BgrImage(frame) if isinstance(frame, np.ndarray) else frame


class I420Frames:
    """(N, H * 3/2, W) I420 frames seen as a sequence of :class:`I420Frame`: a face tracker converts
    one frame, or the part of it that it needs, at a time instead of its whole batch (at 1080p a
    batch of 21 frames is 130 MiB of BGR, and several trackers run at once)."""

    def __init__(self, planes: np.ndarray):
        self.planes = planes

    def __len__(self) -> int:
        return len(self.planes)

    def __getitem__(self, index: int) -> I420Frame:
        return I420Frame(self.planes[index])

    def __iter__(self) -> Iterator[I420Frame]:
        return (self[index] for index in range(len(self)))


def i420_batch_to_bgr(planes: np.ndarray) -> np.ndarray:
    """(N, H * 3/2, W) uint8 I420 frames to a new (N, H, W, 3) uint8 BGR array."""
    count, rows, width = planes.shape
    height = rows * 2 // 3
    frames = np.empty((count, height, width, 3), dtype=np.uint8)
    for index in range(count):
        frames[index] = yuv420_to_bgr(planes[index], width, height)
    return frames


def bgr_batch_to_i420(frames_bgr: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(N, H, W, 3) uint8 BGR frames to (N, H * 3/2, W) uint8 I420, written into ``out`` if given."""
    count, height, width = frames_bgr.shape[:3]
    if out is None:
        out = np.empty((count, height * 3 // 2, width), dtype=np.uint8)
    for index in range(count):
        out[index] = bgr_to_yuv420(frames_bgr[index])
    return out
