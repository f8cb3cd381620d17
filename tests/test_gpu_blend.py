"""Face crops, sharpening, masks and pasting on I420 frames (heygem.render.gpu_blend), checked against
OpenCV and the CPU stages."""

from __future__ import annotations

import dataclasses

import cv2
import numpy as np
import pytest
import torch
from conftest import ASSETS

from heygem.config import BlendConfig
from heygem.engines.wav2lip.engine import crop_face, resize_to_box
from heygem.render import gpu_blend
from heygem.render.blend import LOWER_FACE_POINTS, blend_patch
from heygem.render.sharpen import sharpen_changed as cpu_sharpen_changed
from heygem.types import Face, FacePatch


@pytest.fixture(scope="module")
def portrait() -> np.ndarray:
    """The bundled portrait as (512, 512, 3) uint8 BGR."""
    return cv2.imread(str(ASSETS / "astronaut.jpg"))


def to_planes(frames_bgr: list[np.ndarray]) -> torch.Tensor:
    """(N, H * 3/2, W) uint8 I420 frames made by OpenCV."""
    return torch.from_numpy(np.stack([cv2.cvtColor(frame, cv2.COLOR_BGR2YUV_I420) for frame in frames_bgr]))


def to_bgr(planes: torch.Tensor) -> np.ndarray:
    """(N, H, W, 3) uint8 BGR decoded by OpenCV."""
    return np.stack([cv2.cvtColor(frame, cv2.COLOR_YUV2BGR_I420) for frame in planes.numpy()])


def lower_face_landmarks(box) -> np.ndarray:
    """(468, 2) float32 landmarks whose lower-face points lie on an ellipse in the lower part of ``box``."""
    x1, y1, x2, y2 = box
    width, height = x2 - x1, y2 - y1
    centre = np.array([x1 + 0.5 * width, y1 + 0.66 * height], dtype=np.float32)
    landmarks = np.tile(centre, (468, 1))
    angles = np.linspace(0.0, 2.0 * np.pi, len(LOWER_FACE_POINTS), endpoint=False)
    landmarks[LOWER_FACE_POINTS] = centre + np.stack(
        (0.38 * width * np.cos(angles), 0.27 * height * np.sin(angles)), axis=1)
    return landmarks


def frame_masks(canvas: gpu_blend.FaceCanvas, masks: torch.Tensor, frame_count: int, height: int,
                width: int) -> np.ndarray:
    """Each face's canvas mask placed on its frame: (N, H, W) float32, the largest where faces meet."""
    placed = np.zeros((frame_count, height, width), dtype=np.float32)
    for face, (x, y) in enumerate(canvas.origin.tolist()):
        frame = int(canvas.frame_index[face])
        region = placed[frame, y:y + canvas.height, x:x + canvas.width]
        np.maximum(region, masks[face, 0].numpy(), out=region)
    return placed


# --- colour conversion --------------------------------------------------------------------------


@pytest.mark.parametrize("image_kind", ["random", "portrait"])
def test_i420_to_bgr_matches_opencv(portrait, image_kind):
    image = (np.random.default_rng(1).integers(0, 256, (48, 62, 3), dtype=np.uint8) if image_kind == "random"
             else portrait)
    planes = to_planes([image])
    y, u, v = gpu_blend.split_planes(planes)
    converted = gpu_blend.i420_to_bgr(y, u, v)  # (1, 3, h, w)
    expected = to_bgr(planes)[0].astype(np.float32)
    assert converted.dtype == torch.float32 and converted.shape == (1, 3) + image.shape[:2]
    assert np.abs(converted[0].permute(1, 2, 0).numpy() - expected).max() <= 1


@pytest.mark.parametrize("image_kind", ["random", "portrait"])
def test_bgr_to_i420_matches_opencv(portrait, image_kind):
    image = (np.random.default_rng(2).integers(0, 256, (48, 62, 3), dtype=np.uint8) if image_kind == "random"
             else portrait)
    height, width = image.shape[:2]
    bgr = torch.from_numpy(image).permute(2, 0, 1)[None].float()  # (1, 3, h, w)

    planes = torch.cat([plane.reshape(-1) for plane in gpu_blend.bgr_to_i420(bgr, chroma="top_left")])
    expected = cv2.cvtColor(image, cv2.COLOR_BGR2YUV_I420).reshape(-1)
    assert np.abs(planes.numpy().astype(int) - expected.astype(int)).max() <= 1

    # averaged chroma: OpenCV's conversion of the image whose 2x2 blocks hold their mean colour
    y, u, v = gpu_blend.bgr_to_i420(bgr)
    block_means = cv2.resize(image, (width // 2, height // 2), interpolation=cv2.INTER_AREA)
    blocky = cv2.resize(block_means, (width, height), interpolation=cv2.INTER_NEAREST)
    blocky_planes = cv2.cvtColor(blocky, cv2.COLOR_BGR2YUV_I420)
    luma_size, chroma_size = height * width, height * width // 4
    expected_u = blocky_planes.reshape(-1)[luma_size:luma_size + chroma_size].reshape(height // 2, width // 2)
    expected_v = blocky_planes.reshape(-1)[luma_size + chroma_size:].reshape(height // 2, width // 2)
    assert np.abs(y[0].numpy().astype(int) - expected[:luma_size].reshape(height, width)).max() <= 1
    assert np.abs(u[0].numpy().astype(int) - expected_u).max() <= 1
    assert np.abs(v[0].numpy().astype(int) - expected_v).max() <= 1


def test_split_planes_are_views_and_reject_odd_sizes():
    planes = torch.zeros((2, 12, 10), dtype=torch.uint8)  # two 10x8 frames
    y, u, v = gpu_blend.split_planes(planes)
    assert (y.shape, u.shape, v.shape) == ((2, 8, 10), (2, 4, 5), (2, 4, 5))
    v[1, 3, 4] = 7
    assert planes[1, 11, 9] == 7  # the last byte of frame 1
    u[0, 0, 0] = 5
    assert planes[0, 8, 0] == 5  # the first byte after the Y plane
    with pytest.raises(ValueError, match="even"):
        gpu_blend.split_planes(torch.zeros((1, 12, 9), dtype=torch.uint8))


# --- crops -------------------------------------------------------------------------------------


def test_crop_faces_matches_opencv_inter_area(portrait):
    frames = [portrait, np.ascontiguousarray(portrait[:, ::-1]), np.ascontiguousarray(portrait[::-1])]
    planes = to_planes(frames)
    frames_bgr = to_bgr(planes)  # what the CPU path crops from
    boxes = np.array([[100, 60, 440, 420],  # 340x360: averaging
                      [151, 101, 452, 403],  # odd corners, 301x302
                      [200, 200, 260, 270],  # smaller than 96 both ways: INTER_AREA's linear form
                      [33, 47, 130, 140],  # 97x93: wider, shorter
                      [0, 0, 512, 512]])  # the whole frame
    frame_index = np.array([0, 1, 2, 0, 1])
    crops = gpu_blend.crop_faces(planes, frame_index, boxes)
    assert crops.shape == (5, 3, 96, 96) and crops.dtype == torch.float32
    assert 0.0 <= crops.min() and crops.max() <= 1.0
    for crop, frame, box in zip(crops, frame_index, boxes):
        expected = crop_face(frames_bgr[frame], tuple(box)).astype(np.float32)
        difference = np.abs(crop.permute(1, 2, 0).numpy() * 255.0 - expected)
        assert difference.mean() < 1.5 and difference.max() <= 2, (box, difference.mean(), difference.max())


def test_canvas_is_even_and_inside_the_frame():
    boxes = np.array([[1, 3, 100, 81], [420, 300, 511, 359]])
    canvas = gpu_blend.face_canvas(np.array([0, 0]), boxes, 360, 512, "cpu")
    assert canvas.height % 2 == 0 and canvas.width % 2 == 0
    assert (canvas.origin % 2 == 0).all()
    assert (canvas.origin[:, 0] + canvas.width <= 512).all() and (canvas.origin[:, 1] + canvas.height <= 360).all()
    assert (canvas.origin <= torch.from_numpy(boxes[:, :2])).all()
    assert (canvas.origin + torch.tensor([canvas.width, canvas.height]) >= torch.from_numpy(boxes[:, 2:])).all()
    with pytest.raises(ValueError, match="inside"):
        gpu_blend.face_canvas(np.array([0]), np.array([[0, 0, 513, 10]]), 360, 512, "cpu")


# --- sharpening --------------------------------------------------------------------------------


def test_sharpen_changed_matches_restore_and_leaves_unchanged_pixels(portrait):
    source = crop_face(portrait, (170, 60, 290, 190))  # (96, 96, 3) uint8
    generated = source.copy()
    generated[55:80, 25:70] = np.clip(generated[55:80, 25:70].astype(int) + np.where(
        (np.arange(45) // 3) % 2 == 0, 40, -40)[None, :, None], 0, 255)  # a striped "mouth"
    to_tensor = lambda image: torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255.0

    sharpened = gpu_blend.sharpen_changed(to_tensor(generated), to_tensor(source), 0.6)
    result = sharpened[0].permute(1, 2, 0).numpy() * 255.0
    # restore.py at a 96-pixel box works at the same scale (sigma 1 and 2)
    expected = cpu_sharpen_changed(FacePatch(box=(0, 0, 96, 96), image_bgr=generated), source, 0.6).image_bgr
    assert np.abs(result - expected).max() <= 1.0

    far = np.ones((96, 96), dtype=bool)
    far[35:96, 5:90] = False  # beyond the reach of the changed area's blur
    assert np.abs(result[far] - generated[far]).max() < 1e-3
    stripes = lambda image: np.abs(np.diff(image[60:75, 30:65].astype(np.float32), axis=1)).mean()
    assert stripes(result) > 1.1 * stripes(generated)  # more local contrast where it changed

    same = to_tensor(generated)
    assert gpu_blend.sharpen_changed(same, to_tensor(source), 0.0) is same


# --- masks -------------------------------------------------------------------------------------


def test_face_masks_follow_hull_and_box(portrait):
    boxes = np.array([[100, 80, 400, 380], [150, 90, 350, 340]])
    landmarks = np.stack([lower_face_landmarks(boxes[0]), np.full((468, 2), np.nan, dtype=np.float32)])
    canvas = gpu_blend.face_canvas(np.array([0, 1]), boxes, 512, 512, "cpu")
    masks = gpu_blend.face_masks(boxes, landmarks, 0.15, canvas)
    assert masks.shape == (2, 1, canvas.height, canvas.width) and masks.dtype == torch.float32
    assert masks.min() >= 0.0 and masks.max() <= 1.0
    placed = frame_masks(canvas, masks, 2, 512, 512)
    for frame, (x1, y1, x2, y2) in enumerate(boxes):
        inside = np.zeros((512, 512), dtype=bool)
        inside[y1 + 1:y2 - 1, x1 + 1:x2 - 1] = True
        assert (placed[frame][~inside] == 0).all()  # box border and everything outside the box
        assert placed[frame].max() == 1.0

    # face 0: 0 outside the landmark hull, 1 one feather width inside it, a smooth ramp between
    hull = cv2.convexHull(np.round(landmarks[0][LOWER_FACE_POINTS]).astype(np.int32))
    ys, xs = np.mgrid[0:512, 0:512]
    signed = np.array([cv2.pointPolygonTest(hull, (float(x), float(y)), True)
                       for x, y in zip(xs[::7, ::7].ravel(), ys[::7, ::7].ravel())]).reshape(xs[::7, ::7].shape)
    sampled = placed[0][::7, ::7]
    assert (sampled[signed <= 0] == 0).all()
    assert (sampled[signed >= 0.15 * 300 + 1] == 1.0).all()
    ramp = sampled[(signed > 5) & (signed < 40)]
    assert ramp.size and (ramp > 0).all() and (ramp < 1).any()

    # face 1 has no landmarks: blend.py's ellipse, centred at 70% of the box height
    rows = np.nonzero(placed[1].max(axis=1) > 0.5)[0]
    columns = np.nonzero(placed[1].max(axis=0) > 0.5)[0]
    assert abs((rows[0] + rows[-1]) / 2 - (90 + 0.7 * 250)) < 3
    assert abs((columns[0] + columns[-1]) / 2 - 250) < 3
    assert 0.5 * 200 < columns[-1] - columns[0] < 0.72 * 200


# --- pasting -----------------------------------------------------------------------------------


def paste_batch(portrait):
    """Three frames with faces of different sizes, one without landmarks; patches with a purple mouth."""
    frames = [portrait, np.ascontiguousarray(portrait[:, ::-1]), cv2.GaussianBlur(portrait, (0, 0), 2)]
    planes = to_planes(frames)
    boxes = np.array([[169, 59, 283, 186], [101, 31, 420, 370], [211, 151, 272, 218]])
    frame_index = np.array([0, 1, 2])
    landmarks = np.stack([lower_face_landmarks(boxes[0]), lower_face_landmarks(boxes[1]),
                          np.full((468, 2), np.nan, dtype=np.float32)])
    patches = gpu_blend.crop_faces(planes, frame_index, boxes).clone()
    patches[:, 0, 60:78, 30:66] = 0.85  # a visibly different mouth colour
    patches[:, 1, 60:78, 30:66] = 0.2
    return planes, frame_index, boxes, landmarks, patches


def test_paste_faces_writes_only_inside_the_masks(portrait):
    planes, frame_index, boxes, landmarks, patches = paste_batch(portrait)
    before = planes.clone()
    gpu_blend.paste_faces(planes, frame_index, boxes, patches, landmarks, feather=0.15, color_match=True)

    canvas = gpu_blend.face_canvas(frame_index, boxes, 512, 512, "cpu")
    masked = frame_masks(canvas, gpu_blend.face_masks(boxes, landmarks, 0.15, canvas), 3, 512, 512) > 0  # (3, H, W)
    blocks = masked.reshape(3, 256, 2, 256, 2).any(axis=(2, 4))  # (3, H/2, W/2)
    y_before, u_before, v_before = gpu_blend.split_planes(before)
    y_after, u_after, v_after = gpu_blend.split_planes(planes)
    assert torch.equal(y_after[torch.from_numpy(~masked)], y_before[torch.from_numpy(~masked)])
    assert torch.equal(u_after[torch.from_numpy(~blocks)], u_before[torch.from_numpy(~blocks)])
    assert torch.equal(v_after[torch.from_numpy(~blocks)], v_before[torch.from_numpy(~blocks)])
    for frame in range(3):  # every face was pasted: its mouth turned purple
        assert (y_after[frame] != y_before[frame]).sum() > 100
        assert (u_after[frame].int() - u_before[frame].int()).max() > 20


def test_blend_canvas_writes_the_same_bytes_whole_canvas_or_pixel_by_pixel(portrait):
    """Faces on frames of their own are written canvas by canvas (no waiting for the device to count
    the changed pixels); the bytes are those of writing only the pixels under the masks."""
    planes, frame_index, boxes, landmarks, _ = paste_batch(portrait)
    canvas = gpu_blend.face_canvas(frame_index, boxes, 512, 512, "cpu")
    assert canvas.one_per_frame and not gpu_blend.face_canvas(np.array([0, 0, 1]), boxes, 512, 512, "cpu").one_per_frame
    masks = gpu_blend.face_masks(boxes, landmarks, 0.15, canvas)
    regions = gpu_blend.i420_to_bgr(*gpu_blend.gather_canvas(planes, canvas))
    new_pixels = torch.full_like(regions, 200.0)
    written = {}
    for whole in (True, False):
        result = planes.clone()
        gpu_blend.blend_canvas(result, dataclasses.replace(canvas, one_per_frame=whole), regions, new_pixels, masks)
        written[whole] = result
    assert torch.equal(written[True], written[False])
    assert (written[True] != planes).sum() > 3000


def test_paste_faces_core_is_the_colour_shifted_patch(portrait):
    planes = to_planes([portrait] * 3)
    boxes = np.array([[150, 40, 330, 260]] * 3)
    frame_index = np.array([0, 1, 2])
    landmarks = np.stack([lower_face_landmarks(boxes[0])] * 3)
    crops = gpu_blend.crop_faces(planes, frame_index, boxes)
    patches = torch.stack((torch.tensor([0.8, 0.5, 0.3]).view(3, 1, 1).expand(3, 96, 96),  # one flat colour
                           crops[1],  # the frame's own pixels
                           (crops[2] + 30 / 255).clamp(0, 1)))  # the same, 30 grey levels brighter
    masks = gpu_blend.face_masks(boxes, landmarks, 0.15, gpu_blend.face_canvas(frame_index, boxes, 512, 512, "cpu"))
    gpu_blend.paste_faces(planes[:2], frame_index[:2], boxes[:2], patches[:2], landmarks[:2], color_match=False)
    gpu_blend.paste_faces(planes[2:], [0], boxes[2:], patches[2:], landmarks[2:], color_match=True)
    result = to_bgr(planes).astype(np.float32)

    canvas = gpu_blend.face_canvas(frame_index, boxes, 512, 512, "cpu")
    core = frame_masks(canvas, masks, 3, 512, 512)[0] == 1.0
    assert core.sum() > 3000
    assert np.abs(result[0][core] - np.array([0.8, 0.5, 0.3]) * 255).max() <= 2
    # colour matching takes the brightening back out: the same as pasting the unchanged crop
    shifted = result[2][core] - result[1][core]
    assert abs(shifted.mean()) < 1.5 and np.abs(shifted).mean() < 2.5, (shifted.mean(), np.abs(shifted).mean())


def test_paste_faces_scales_patches_like_resize_to_box(portrait):
    grey = cv2.cvtColor(cv2.cvtColor(portrait, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)  # no chroma to lose
    planes = to_planes([grey] * 3)
    boxes = np.array([[101, 31, 420, 370], [201, 151, 271, 216], [33, 47, 130, 140]])  # cubic, area, area
    frame_index = np.array([0, 1, 2])
    rng = np.random.default_rng(3)
    patch_grey = cv2.GaussianBlur(rng.integers(0, 256, (3, 96, 96)).astype(np.uint8).transpose(1, 2, 0), (0, 0), 1.5)
    patches_uint8 = np.repeat(patch_grey.transpose(2, 0, 1)[:, :, :, None], 3, axis=3)  # (3, 96, 96, 3) grey
    patches = torch.from_numpy(patches_uint8).permute(0, 3, 1, 2).float() / 255.0
    canvas = gpu_blend.face_canvas(frame_index, boxes, 512, 512, "cpu")
    masks = torch.zeros((3, 1, canvas.height, canvas.width))
    for face, (x, y) in enumerate(canvas.box_offset.tolist()):  # the whole box, border included
        width, height = canvas.box_size[face].tolist()
        masks[face, :, y:y + height, x:x + width] = 1.0
    gpu_blend.paste_faces(planes, frame_index, boxes, patches, masks=masks, color_match=False)
    result = to_bgr(planes)
    for face, (x1, y1, x2, y2) in enumerate(boxes):
        expected = resize_to_box(patches_uint8[face], (x1, y1, x2, y2)).astype(np.float32)
        difference = np.abs(result[face, y1:y2, x1:x2].astype(np.float32) - expected)
        assert difference.mean() < 0.6 and difference.max() <= 3, (face, difference.mean(), difference.max())


def test_paste_faces_two_faces_on_one_frame(portrait):
    planes = to_planes([portrait])
    before = planes.clone()
    boxes = np.array([[20, 20, 200, 220], [290, 250, 500, 500]])
    landmarks = np.stack([lower_face_landmarks(box) for box in boxes])
    patches = torch.zeros((2, 3, 96, 96))
    patches[:, 2] = 1.0  # red
    gpu_blend.paste_faces(planes, np.array([0, 0]), boxes, patches, landmarks, color_match=False)
    changed = (planes[0, :512] != before[0, :512]).numpy()  # the Y plane
    rows, columns = np.nonzero(changed)
    in_first = (columns >= 20) & (columns < 200) & (rows >= 20) & (rows < 220)
    in_second = (columns >= 290) & (columns < 500) & (rows >= 250) & (rows < 500)
    assert in_first.sum() > 1000 and in_second.sum() > 1000
    assert (in_first | in_second).all()
    result = to_bgr(planes)[0]
    for x1, y1, x2, y2 in boxes:
        centre = result[(y1 + y2) // 2 + (y2 - y1) // 6, (x1 + x2) // 2].astype(int)
        assert centre[2] > 200 and centre[0] < 60 and centre[1] < 60, centre


def test_crop_then_paste_returns_the_frame(portrait):
    planes = to_planes([portrait])
    original = to_bgr(planes)[0].astype(np.float32)
    boxes = np.array([[140, 40, 320, 240]])
    landmarks = lower_face_landmarks(boxes[0])[None]
    crops = gpu_blend.crop_faces(planes, [0], boxes)
    gpu_blend.paste_faces(planes, [0], boxes, crops, landmarks)
    x1, y1, x2, y2 = boxes[0]
    difference = np.abs(to_bgr(planes)[0].astype(np.float32) - original)[y1:y2, x1:x2]
    assert difference.mean() < 2.5  # what shrinking to 96 and back loses, nothing more
    assert difference[np.abs(difference).max(axis=2) > 0].size > 0


def test_paste_faces_is_close_to_the_cpu_blend(portrait):
    planes, frame_index, boxes, landmarks, patches = paste_batch(portrait)
    frames_bgr = to_bgr(planes)
    gpu_blend.paste_faces(planes, frame_index, boxes, patches, landmarks)
    result = to_bgr(planes)
    for face, box in enumerate(boxes[:2]):
        box = tuple(int(value) for value in box)
        patch = np.rint(patches[face].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
        cpu = frames_bgr[face].copy()
        blend_patch(cpu, FacePatch(box=box, image_bgr=resize_to_box(patch, box),
                                   face=Face(box=box, landmarks=landmarks[face])), BlendConfig())
        x1, y1, x2, y2 = box
        difference = np.abs(result[face].astype(np.float32) - cpu)[y1:y2, x1:x2]
        assert difference.mean() < 4, difference.mean()  # the masks' soft edges differ a little


def test_batches_without_faces(portrait):
    planes = to_planes([portrait])
    before = planes.clone()
    no_boxes = np.zeros((0, 4), dtype=np.int64)
    assert gpu_blend.crop_faces(planes, np.zeros(0, dtype=np.int64), no_boxes).shape == (0, 3, 96, 96)
    gpu_blend.paste_faces(planes, np.zeros(0, dtype=np.int64), no_boxes, torch.zeros((0, 3, 96, 96)), None)
    assert torch.equal(planes, before)


def test_feather_masks_blur_on_the_device_as_blend_feathers_on_the_host():
    # boxes of different sizes, so each face has its own sigma and kernel length (one of them wider than the
    # canvas's slack around it), and one too small for its inset: the host's feather_mask, placed on the canvas
    from heygem.render.blend import feather_mask, feather_sigma, feather_width, inset_mask, lower_face_hard_mask

    canvas_height, canvas_width = 300, 260
    boxes = np.array([[0, 0, 260, 300], [20, 30, 200, 250], [50, 60, 120, 140], [100, 100, 110, 112]])
    inner = np.zeros((len(boxes), 1, canvas_height, canvas_width), np.float32)
    expected = np.zeros_like(inner)
    sigmas = []
    for index, box in enumerate(boxes):
        x1, y1, x2, y2 = (int(value) for value in box)
        face = Face(box=(x1, y1, x2, y2), landmarks=lower_face_landmarks((x1, y1, x2, y2)))
        hard = lower_face_hard_mask(FacePatch(box=(x1, y1, x2, y2), image_bgr=None, face=face))
        width = feather_width(box, 0.15)
        inner[index, 0, y1:y2, x1:x2] = inset_mask(hard, width)
        expected[index, 0, y1:y2, x1:x2] = feather_mask(hard, width)
        sigmas.append(feather_sigma(width))
    soft = gpu_blend.feather_masks(torch.from_numpy(inner), boxes, np.array(sigmas)).numpy()
    assert soft.shape == inner.shape and expected[:3].max() > 0.99  # the three larger masks reach 1 inside
    assert np.abs(soft - expected).max() < 1e-5
    assert (soft[expected == 0] == 0).all()  # nothing outside a mask, the box's border rows and columns included
