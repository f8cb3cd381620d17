"""The S3FD face detector: checkpoint layout, anchors, box decoding, NMS and whole-frame detection."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from heygem.errors import HeygemError
from heygem.face.s3fd import (
    LEVEL_STRIDES,
    decode_boxes,
    detect_faces,
    feature_map_sizes,
    load_s3fd,
    make_anchors,
    non_maximum_suppression,
    prepare_images,
    resized_size,
)
from heygem.models.s3fd import LEVEL_NAMES, S3FD

# The public s3fd.pth: every tensor, float32, in file order.
PUBLIC_LAYOUT = (
    ("conv1_1.weight", (64, 3, 3, 3)),
    ("conv1_1.bias", (64,)),
    ("conv1_2.weight", (64, 64, 3, 3)),
    ("conv1_2.bias", (64,)),
    ("conv2_1.weight", (128, 64, 3, 3)),
    ("conv2_1.bias", (128,)),
    ("conv2_2.weight", (128, 128, 3, 3)),
    ("conv2_2.bias", (128,)),
    ("conv3_1.weight", (256, 128, 3, 3)),
    ("conv3_1.bias", (256,)),
    ("conv3_2.weight", (256, 256, 3, 3)),
    ("conv3_2.bias", (256,)),
    ("conv3_3.weight", (256, 256, 3, 3)),
    ("conv3_3.bias", (256,)),
    ("conv4_1.weight", (512, 256, 3, 3)),
    ("conv4_1.bias", (512,)),
    ("conv4_2.weight", (512, 512, 3, 3)),
    ("conv4_2.bias", (512,)),
    ("conv4_3.weight", (512, 512, 3, 3)),
    ("conv4_3.bias", (512,)),
    ("conv5_1.weight", (512, 512, 3, 3)),
    ("conv5_1.bias", (512,)),
    ("conv5_2.weight", (512, 512, 3, 3)),
    ("conv5_2.bias", (512,)),
    ("conv5_3.weight", (512, 512, 3, 3)),
    ("conv5_3.bias", (512,)),
    ("fc6.weight", (1024, 512, 3, 3)),
    ("fc6.bias", (1024,)),
    ("fc7.weight", (1024, 1024, 1, 1)),
    ("fc7.bias", (1024,)),
    ("conv6_1.weight", (256, 1024, 1, 1)),
    ("conv6_1.bias", (256,)),
    ("conv6_2.weight", (512, 256, 3, 3)),
    ("conv6_2.bias", (512,)),
    ("conv7_1.weight", (128, 512, 1, 1)),
    ("conv7_1.bias", (128,)),
    ("conv7_2.weight", (256, 128, 3, 3)),
    ("conv7_2.bias", (256,)),
    ("conv3_3_norm.weight", (256,)),
    ("conv4_3_norm.weight", (512,)),
    ("conv5_3_norm.weight", (512,)),
    ("conv3_3_norm_mbox_conf.weight", (4, 256, 3, 3)),
    ("conv3_3_norm_mbox_conf.bias", (4,)),
    ("conv3_3_norm_mbox_loc.weight", (4, 256, 3, 3)),
    ("conv3_3_norm_mbox_loc.bias", (4,)),
    ("conv4_3_norm_mbox_conf.weight", (2, 512, 3, 3)),
    ("conv4_3_norm_mbox_conf.bias", (2,)),
    ("conv4_3_norm_mbox_loc.weight", (4, 512, 3, 3)),
    ("conv4_3_norm_mbox_loc.bias", (4,)),
    ("conv5_3_norm_mbox_conf.weight", (2, 512, 3, 3)),
    ("conv5_3_norm_mbox_conf.bias", (2,)),
    ("conv5_3_norm_mbox_loc.weight", (4, 512, 3, 3)),
    ("conv5_3_norm_mbox_loc.bias", (4,)),
    ("fc7_mbox_conf.weight", (2, 1024, 3, 3)),
    ("fc7_mbox_conf.bias", (2,)),
    ("fc7_mbox_loc.weight", (4, 1024, 3, 3)),
    ("fc7_mbox_loc.bias", (4,)),
    ("conv6_2_mbox_conf.weight", (2, 512, 3, 3)),
    ("conv6_2_mbox_conf.bias", (2,)),
    ("conv6_2_mbox_loc.weight", (4, 512, 3, 3)),
    ("conv6_2_mbox_loc.bias", (4,)),
    ("conv7_2_mbox_conf.weight", (2, 256, 3, 3)),
    ("conv7_2_mbox_conf.bias", (2,)),
    ("conv7_2_mbox_loc.weight", (4, 256, 3, 3)),
    ("conv7_2_mbox_loc.bias", (4,)),
)


@pytest.fixture(scope="module")
def public_state_dict() -> dict:
    """Random tensors in the public file's layout, built from the layout alone."""
    generator = torch.Generator().manual_seed(7)
    return {key: torch.randn(shape, generator=generator) * 0.05 for key, shape in PUBLIC_LAYOUT}


@pytest.fixture(scope="module")
def random_model() -> S3FD:
    torch.manual_seed(3)
    return S3FD().eval()


def test_state_dict_matches_the_public_layout_key_for_key():
    state_dict = S3FD().state_dict()
    assert [(key, tuple(tensor.shape)) for key, tensor in state_dict.items()] == list(PUBLIC_LAYOUT)
    assert len(state_dict) == 65 and all(tensor.dtype == torch.float32 for tensor in state_dict.values())


def test_public_layout_checkpoint_loads_strictly(tmp_path, public_state_dict):
    checkpoint_path = tmp_path / "s3fd.pth"
    torch.save(public_state_dict, checkpoint_path)
    model = load_s3fd(checkpoint_path, device="cpu")
    assert not model.training
    loaded = model.state_dict()
    for key, tensor in public_state_dict.items():
        assert torch.equal(loaded[key], tensor), key


@pytest.mark.parametrize("change, named_key", [
    ("missing", "conv4_3_norm.weight"),
    ("extra", "conv8_2_mbox_conf.weight"),
    ("shape", "conv3_3_norm_mbox_conf.weight"),
])
def test_checkpoint_with_a_wrong_key_is_refused_naming_it(tmp_path, public_state_dict, change, named_key):
    state_dict = dict(public_state_dict)
    if change == "missing":
        del state_dict[named_key]
    elif change == "extra":
        state_dict[named_key] = torch.zeros(2, 256, 3, 3)
    else:
        state_dict[named_key] = torch.zeros(2, 256, 3, 3)  # a 2-logit head where the file has 4
    checkpoint_path = tmp_path / "s3fd.pth"
    torch.save(state_dict, checkpoint_path)
    with pytest.raises(HeygemError) as raised:
        load_s3fd(checkpoint_path, device="cpu")
    message = str(raised.value)
    assert named_key in message and "s3fd.pth" in message
    if change == "shape":
        assert "(2, 256, 3, 3)" in message and "(4, 256, 3, 3)" in message


def shape_only_model() -> S3FD:
    """An S3FD on the meta device: it computes output shapes, no values, at no cost."""
    with torch.device("meta"):
        return S3FD().eval()


def zeroed_model(model_type: type = S3FD) -> S3FD:
    """An S3FD with every parameter zero, built without the cost of random initialisation."""
    with torch.device("meta"):
        model = model_type()
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    return model


@pytest.mark.parametrize("height, width", [(96, 128), (101, 75), (480, 640), (719, 1283)])
def test_anchor_count_per_level_follows_the_network_maps(height, width):
    with torch.inference_mode():
        levels = shape_only_model()(torch.zeros(1, 3, height, width, device="meta"))
    network_sizes = [tuple(logits.shape[2:]) for logits, _ in levels]
    assert feature_map_sizes(height, width) == network_sizes
    assert all(tuple(offsets.shape[1:]) == (4, *size) for (_, offsets), size in zip(levels, network_sizes))

    anchors = make_anchors(network_sizes)
    counts = [rows * columns for rows, columns in network_sizes]
    assert anchors.shape == (sum(counts), 4)
    start = 0
    for (rows, columns), count, stride in zip(network_sizes, counts, LEVEL_STRIDES):
        level = anchors[start:start + count].reshape(rows, columns, 4)
        assert level[0, 0].tolist() == [stride / 2, stride / 2, 4 * stride, 4 * stride]
        assert level[-1, -1, :2].tolist() == [stride * (columns - 0.5), stride * (rows - 0.5)]
        start += count


def test_anchor_counts_for_a_640_by_480_input():
    sizes = feature_map_sizes(480, 640)
    assert sizes == [(120, 160), (60, 80), (30, 40), (19, 24), (10, 12), (5, 6)]  # fc6 pads by 3
    assert len(make_anchors(sizes)) == sum(rows * columns for rows, columns in sizes)


def test_zero_offsets_decode_to_the_anchor_box_and_offsets_move_it():
    anchors = torch.tensor([[50.0, 40.0, 16.0, 16.0], [200.0, 100.0, 128.0, 128.0]])  # cx, cy, w, h
    zero = decode_boxes(torch.zeros(2, 4), anchors)
    assert torch.allclose(zero, torch.tensor([[42.0, 32.0, 58.0, 48.0], [136.0, 36.0, 264.0, 164.0]]))

    # dx = 1 moves the centre by 0.1 anchor widths; dw = 5 scales the width by exp(1)
    moved = decode_boxes(torch.tensor([[1.0, -2.0, 5.0, 0.0]]), anchors[1:])
    centre_x, centre_y = 200.0 + 12.8, 100.0 - 25.6
    half_width = 64.0 * float(np.exp(1.0))
    assert torch.allclose(moved, torch.tensor([[centre_x - half_width, centre_y - 64.0,
                                                centre_x + half_width, centre_y + 64.0]]))


def test_nms_keeps_the_best_of_overlapping_boxes_and_every_disjoint_one():
    boxes = torch.tensor([
        [0.0, 0.0, 100.0, 100.0],
        [5.0, 5.0, 105.0, 105.0],  # overlaps the first by IoU ~0.82
        [300.0, 300.0, 350.0, 350.0],  # far from both
        [10.0, 0.0, 110.0, 100.0],  # overlaps the first by IoU ~0.82
    ])
    scores = torch.tensor([0.7, 0.9, 0.6, 0.8])
    assert non_maximum_suppression(boxes, scores, 0.3).tolist() == [1, 2]
    assert non_maximum_suppression(boxes[[0, 2]], scores[[0, 2]], 0.3).tolist() == [0, 1]
    # a threshold above their overlap keeps all, best first
    assert non_maximum_suppression(boxes, scores, 0.9).tolist() == [1, 3, 0, 2]


def test_prepare_images_subtracts_the_bgr_means_and_resizes():
    frames = np.empty((2, 40, 60, 3), dtype=np.uint8)
    frames[...] = (104, 117, 123)
    frames[1, :, :, 0] = 204
    images = prepare_images(frames, (20, 30), torch.device("cpu"))
    assert images.shape == (2, 3, 20, 30)
    assert torch.allclose(images[0], torch.zeros(3, 20, 30), atol=1e-4)
    assert torch.allclose(images[1, 0], torch.full((20, 30), 100.0), atol=1e-3)
    assert resized_size(1080, 1920, None, 640) == (360, 640)
    assert resized_size(200, 300, None, 640) == (200, 300)  # never enlarged
    assert resized_size(200, 300, 0.5, 640) == (100, 150)


def bright_square_model(model_type: type = S3FD) -> S3FD:
    """A model that sees faces only in bright blue squares, through the stride-4 level alone.

    conv1_1 .. conv3_3 pass the blue channel on unchanged (centre tap 1, all else
    0), so after the means are subtracted and the ReLUs applied, a conv3_3 cell
    is positive only where its 4x4 input pixels hold blue above 104. The L2 norm
    turns such a cell's channel vector (v, 0, ..., 0) into (10, 0, ..., 0). The
    finest head reads channel 0 at its centre tap: face logit 1 x 10, background
    logits 0, 0 and 0.5 x 10 (max-out takes 5), so a bright cell scores
    sigmoid(10 - 5). Everything else is zero: other cells and levels score 0.5.
    """
    model = zeroed_model(model_type)
    with torch.no_grad():
        for name in ("conv1_1", "conv1_2", "conv2_1", "conv2_2", "conv3_1", "conv3_2", "conv3_3"):
            getattr(model, name).weight[0, 0, 1, 1] = 1.0
        model.conv3_3_norm.weight.fill_(10.0)
        model.conv3_3_norm_mbox_conf.weight[3, 0, 1, 1] = 1.0  # face
        model.conv3_3_norm_mbox_conf.weight[2, 0, 1, 1] = 0.5  # the largest of the three background logits
    return model


BRIGHT_CELL_SCORE = 1.0 / (1.0 + np.exp(-5.0))


def frames_with_a_bright_square(count: int, height: int, width: int, top: int, left: int, side: int) -> np.ndarray:
    frames = np.zeros((count, height, width, 3), dtype=np.uint8)
    frames[:, top:top + side, left:left + side] = 255
    return frames


def test_hand_set_weights_detect_the_anchor_box_in_frame_pixels():
    model = bright_square_model()
    assert LEVEL_NAMES[0] == "conv3_3_norm" and LEVEL_STRIDES[0] == 4
    # 128x192 frames shrink to 64x96: the 8-pixel square at rows 40-47, columns 72-79 becomes
    # the stride-4 cell in row 5, column 9, whose anchor is centred at (38, 22), 16 pixels a side
    frames = frames_with_a_bright_square(2, 128, 192, top=40, left=72, side=8)
    detections = detect_faces(model, frames, max_side=96, score_threshold=0.6)
    assert len(detections) == 2
    for boxes in detections:
        assert boxes.dtype == np.float32 and boxes.shape == (1, 5)
        # (30, 14, 46, 30) in the input is twice that in the frame, centred on the square
        np.testing.assert_allclose(boxes[0, :4], [60.0, 28.0, 92.0, 60.0], atol=1e-3)
        assert boxes[0, 4] == pytest.approx(BRIGHT_CELL_SCORE, abs=1e-5)

    # without the square nothing scores above one half
    empty = detect_faces(model, np.zeros((1, 128, 192, 3), dtype=np.uint8), max_side=96, score_threshold=0.6)
    assert empty[0].shape == (0, 5)


def test_two_squares_far_apart_give_two_boxes_at_full_size():
    model = bright_square_model()
    frames = frames_with_a_bright_square(1, 64, 80, top=8, left=12, side=4)
    frames[0, 48:52, 60:64] = 255
    (boxes,) = detect_faces(model, frames, score_threshold=0.6)  # 80 pixels: not resized
    assert boxes.shape == (2, 5)
    found = sorted(boxes[:, :4].tolist())
    np.testing.assert_allclose(found, [[6.0, 2.0, 22.0, 18.0], [54.0, 42.0, 70.0, 58.0]], atol=1e-3)


def test_hand_set_offsets_move_the_detected_box():
    model = bright_square_model()
    with torch.no_grad():
        model.conv3_3_norm_mbox_loc.weight[0, 0, 1, 1] = 0.1  # dx = 1 on a bright cell
        model.conv3_3_norm_mbox_loc.weight[1, 0, 1, 1] = -0.05  # dy = -0.5
        model.conv3_3_norm_mbox_loc.weight[2, 0, 1, 1] = 0.5  # dw = 5: the width grows by e
    frames = frames_with_a_bright_square(1, 64, 96, top=20, left=36, side=4)
    (boxes,) = detect_faces(model, frames, score_threshold=0.6)
    # anchor (30, 14, 46, 30); the centre moves by 0.1 * 16 along x and -0.05 * 16 along y
    half_width = 8.0 * float(np.exp(1.0))
    np.testing.assert_allclose(boxes[0, :4], [39.6 - half_width, 14.0 - 0.8, 39.6 + half_width, 30.0 - 0.8],
                               atol=1e-3)


def test_random_weights_give_sorted_boxes_the_same_in_any_batch_size(random_model):
    frames = np.random.default_rng(1).integers(0, 256, size=(2, 96, 128, 3), dtype=np.uint8)
    together = detect_faces(random_model, frames, max_side=64, score_threshold=0.5, batch_size=2)
    one_by_one = detect_faces(random_model, frames, max_side=64, score_threshold=0.5, batch_size=1)
    assert len(together) == 2
    for boxes, single in zip(together, one_by_one):
        assert boxes.dtype == np.float32 and boxes.ndim == 2 and boxes.shape[1] == 5
        assert np.all(boxes[:, 4] > 0.5) and np.all(np.diff(boxes[:, 4]) <= 0)
        assert np.all(boxes[:, 2] > boxes[:, 0]) and np.all(boxes[:, 3] > boxes[:, 1])
        np.testing.assert_allclose(boxes, single, rtol=1e-4, atol=1e-3)
    assert detect_faces(random_model, np.zeros((0, 96, 128, 3), dtype=np.uint8)) == []


class RunsOutOfMemoryAboveOneFrame(S3FD):
    batch_sizes: list[int]

    def forward(self, images):
        self.__dict__.setdefault("batch_sizes", []).append(len(images))
        if len(images) > 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(images)


def test_detection_halves_the_batch_on_out_of_memory():
    flaky = bright_square_model(RunsOutOfMemoryAboveOneFrame)
    frames = frames_with_a_bright_square(2, 64, 96, top=20, left=36, side=4)
    detections = detect_faces(flaky, frames, score_threshold=0.6, batch_size=2)
    assert flaky.batch_sizes == [2, 1, 1]
    assert [boxes.shape for boxes in detections] == [(1, 5)] * 2


def test_frames_of_the_wrong_shape_are_refused(random_model):
    with pytest.raises(ValueError, match="uint8"):
        detect_faces(random_model, np.zeros((2, 64, 64), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        detect_faces(random_model, np.zeros((1, 64, 64, 3), dtype=np.float32))


def test_importing_the_detection_module_leaves_torch_unloaded():
    import subprocess
    import sys

    check = "import sys, heygem.face.s3fd; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.stdout.strip() == "False"


# --------------------------------------------------------------------------- S3FD as heygem's face detector


def blue_marker_model(box_side: float, shift_x: float = 0.0, shift_y: float = 0.0) -> S3FD:
    """A model that sees a face only where a pure blue marker is, and draws its box where the test wants it.

    conv1_1's first channel is B - G - R (means subtracted) less 300: positive only for
    a blue far purer than any photo holds (B - G - R above 164; the astronaut's reaches
    33). conv1_2 .. conv3_3 pass it on, so a stride-4 cell fires when its 4x4 pixels
    touch the marker; the L2 norm makes that 10, the finest head scores it sigmoid(5)
    and moves its box: the centre by (shift_x, shift_y) pixels from the cell's centre,
    the side from the anchor's 16 pixels to ``box_side``.
    """
    model = bright_square_model()
    with torch.no_grad():
        model.conv1_1.weight[0, :, 1, 1] = torch.tensor([1.0, -1.0, -1.0])  # BGR input
        model.conv1_1.bias[0] = -300.0
        loc = model.conv3_3_norm_mbox_loc.weight  # offsets = weight x 10 on a marker cell
        loc[0, 0, 1, 1] = shift_x / (0.1 * 16) / 10  # dx: the centre moves by 0.1 x 16 pixels per unit
        loc[1, 0, 1, 1] = shift_y / (0.1 * 16) / 10
        loc[2, 0, 1, 1] = loc[3, 0, 1, 1] = float(np.log(box_side / 16) / 0.2) / 10  # dw, dh: 16 x exp(0.2 d)
    return model


def test_the_blue_marker_model_draws_the_box_it_was_set_to_draw():
    frames = np.full((1, 96, 128, 3), 128, dtype=np.uint8)
    frames[0, 40:44, 60:64] = (255, 0, 0)  # one stride-4 cell, centred at (62, 42)
    frames[0, 0:20, 0:20] = (230, 120, 110)  # sky blue: no face
    (boxes,) = detect_faces(blue_marker_model(40.0, shift_x=8.0, shift_y=-4.0), frames)
    np.testing.assert_allclose(boxes[:, :4], [[50.0, 18.0, 90.0, 58.0]], atol=1e-3)


TWO_FACES_SIZE = (240, 320)  # height, width of the frames with two astronauts
SMALL_FACE = (160, 70, 160)  # the right astronaut: left, top, side of the portrait pasted there
MARKER = (228, 40, 8)  # left, top, side of the blue marker above the right astronaut's head
S3FD_BOX_CENTRE = (231.0, 108.0)  # where the marker model draws its box: on the right astronaut's face
S3FD_BOX_SIDE = 48.0


def two_astronauts(face_photo: Path) -> np.ndarray:
    """A (240, 320, 3) frame: a larger astronaut on the left, a smaller one on the right, a blue marker above it."""
    import cv2

    portrait = cv2.imread(str(face_photo))
    frame = np.full((*TWO_FACES_SIZE, 3), 120, dtype=np.uint8)
    frame[10:230, 0:220] = cv2.resize(portrait, (220, 220), interpolation=cv2.INTER_AREA)
    left, top, side = SMALL_FACE
    frame[top:top + side, left:left + side] = cv2.resize(portrait, (side, side), interpolation=cv2.INTER_AREA)
    left, top, side = MARKER
    frame[top:top + side, left:left + side] = (255, 0, 0)
    return frame


def marker_checkpoint(folder: Path) -> Path:
    """The marker model saved as the public s3fd.pth (the official layout, loaded strictly)."""
    cell_x = MARKER[0] + 2  # the first marker cell's centre: NMS keeps it among equal scores
    cell_y = MARKER[1] + 2
    model = blue_marker_model(S3FD_BOX_SIDE, S3FD_BOX_CENTRE[0] - cell_x, S3FD_BOX_CENTRE[1] - cell_y)
    path = folder / "s3fd.pth"
    torch.save(model.state_dict(), path)
    return path


def test_the_face_mesh_runs_on_s3fd_s_box_not_on_mediapipe_s_choice(tmp_path, face_photo):
    from heygem.config import FaceConfig
    from heygem.face.finder import FaceFinder
    from heygem.face.s3fd import S3FDDetector
    from heygem.face.track import tight_box

    frame = two_astronauts(face_photo)
    with FaceFinder(FaceConfig(), still_images=True) as finder:
        mediapipe_landmarks = finder.find(frame)
    assert tight_box(mediapipe_landmarks)[2] < 160  # mediapipe picks the larger face, on the left

    detector = S3FDDetector(load_s3fd(marker_checkpoint(tmp_path), device="cpu"))
    with FaceFinder(FaceConfig(detector="s3fd"), still_images=True, detector=detector) as finder:
        assert finder.detector_name == "s3fd"
        boxes = finder.detect(frame)
        landmarks = finder.find(frame)
    centre_x, centre_y = S3FD_BOX_CENTRE
    half = S3FD_BOX_SIDE / 2
    np.testing.assert_allclose(boxes, [[centre_x - half, centre_y - half, centre_x + half, centre_y + half]],
                               atol=1e-3)
    x1, y1, x2, y2 = tight_box(landmarks)  # the right astronaut's face, inside S3FD's box
    assert centre_x - half < x1 < x2 < centre_x + half and centre_y - half < y1 < y2 < centre_y + half + 4
    assert 20 < x2 - x1 and 20 < y2 - y1
    upper_lip, chin = landmarks[13], landmarks[152]
    assert y1 < upper_lip[1] < chin[1] <= y2 and x1 < upper_lip[0] < x2


def test_s3fd_finds_a_small_marker_on_tiles_when_the_shrunk_frame_shows_none():
    from heygem.config import FaceConfig
    from heygem.face.finder import FaceFinder
    from heygem.face.s3fd import S3FDDetector

    frame = np.full((720, 1280, 3), 120, dtype=np.uint8)
    frame[346:358, 346:358] = (255, 0, 0)  # in the overlap of four tiles
    detector = S3FDDetector(blue_marker_model(20.0), max_side=96)  # frames shrink 13x, tiles (432 px) 4.5x
    assert len(detector.detect([frame])[0]) == 0  # shrunk with the frame, the marker is no longer pure blue
    with FaceFinder(FaceConfig(), detector=detector) as finder:
        boxes = finder.detect(frame)
    assert boxes.shape == (1, 4)  # four tiles saw it: one box
    centre = (boxes[0, :2] + boxes[0, 2:]) / 2
    side = boxes[0, 2:] - boxes[0, :2]
    np.testing.assert_allclose(side, [20.0 * 432 / 96] * 2, rtol=1e-4)  # 20 input pixels of a 4.5x tile
    assert np.abs(centre - 352).max() < 432 / 96 * 4  # within one cell of the marker's centre


def test_s3fd_without_its_file_says_which_file_to_put_where(tmp_path, no_weights, face_video, short_speech):
    from heygem.config import Config
    from heygem.jobs.request import check_options
    from heygem.pipeline import generate
    from heygem.weights import find_s3fd_checkpoint, require_s3fd_checkpoint

    with pytest.raises(HeygemError) as raised:
        generate(face_video, short_speech, tmp_path / "never.mp4", overrides={"face.detector": "s3fd"})
    message = str(raised.value)
    assert "s3fd.pth" in message and str(no_weights) in message and "\n" not in message
    assert not (tmp_path / "never.mp4").exists()
    with pytest.raises(HeygemError, match="s3fd.pth"):  # a REST or Gradio client's options: a 400
        check_options({"face.detector": "s3fd"}, Config(), remote=True, folder=no_weights)
    assert check_options({"face.detector": "mediapipe"}, Config(), remote=True,
                         folder=no_weights)[0] == {"face.detector": "mediapipe"}

    published = no_weights / "S3FD-619a316812.pth"  # the other published name, any case
    published.write_bytes(b"")
    assert find_s3fd_checkpoint(no_weights) == require_s3fd_checkpoint(no_weights) == published
    assert check_options({"face.detector": "s3fd"}, Config(), remote=True, folder=no_weights)[0] == {
        "face.detector": "s3fd"}


def test_the_detector_option_round_trips_through_flag_yaml_and_cache_key(tmp_path, face_video):
    import argparse

    from heygem.cli import add_option_flags, option_overrides
    from heygem.config import apply_overrides, load_config
    from heygem.face import avatar_cache
    from heygem.types import FrameGeometry

    default = load_config()
    assert default.face.detector == "mediapipe"
    chosen = apply_overrides(default, {"face.detector": "s3fd"})
    assert chosen.face.detector == "s3fd" and chosen.to_dict()["face"]["detector"] == "s3fd"
    config_file = tmp_path / "s3fd.yaml"
    config_file.write_text("face:\n  detector: s3fd\n", encoding="utf-8")
    assert load_config(config_file).face.detector == "s3fd"
    with pytest.raises(HeygemError, match="--detector must be one of mediapipe, s3fd"):
        apply_overrides(default, {"face.detector": "retinaface"})

    parser = argparse.ArgumentParser()
    add_option_flags(parser)
    overrides = option_overrides(parser.parse_args(["--detector", "s3fd"]))
    assert apply_overrides(default, overrides) == chosen
    assert apply_overrides(default, option_overrides(parser.parse_args([]))).face.detector == "mediapipe"
    with pytest.raises(SystemExit):
        parser.parse_args(["--detector", "retinaface"])

    geometry = FrameGeometry(width=320, height=240)
    keys = {name: avatar_cache.avatar_key(face_video, config.face, geometry, "30000/1001")
            for name, config in (("mediapipe", default), ("s3fd", chosen))}
    assert keys["mediapipe"] != keys["s3fd"]  # tracking made with one detector is never reused for the other
    assert keys["s3fd"] == avatar_cache.avatar_key(face_video, chosen.face, geometry, "30000/1001")


def test_s3fd_tracks_a_clip_through_the_pipeline_and_the_mesh_follows_its_box(tmp_path, no_weights, face_photo,
                                                                               short_speech):
    import cv2
    from conftest import decode_frames, run_ffmpeg

    from heygem.pipeline import generate

    still = tmp_path / "two astronauts.png"
    cv2.imwrite(str(still), two_astronauts(face_photo))
    clip = tmp_path / "two astronauts.mp4"
    run_ffmpeg("-loop", "1", "-i", str(still), "-t", "0.4", "-r", "25", "-c:v", "libx264", "-preset", "ultrafast",
               "-crf", "4", "-pix_fmt", "yuv420p", str(clip))
    marker_checkpoint(no_weights)
    motion = {}
    for detector in ("mediapipe", "s3fd"):
        output = tmp_path / f"{detector}.mp4"
        summary = generate(clip, short_speech, output, overrides={"face.detector": detector})
        assert summary.detector == detector and summary.frames_without_face == 0
        assert summary.avatar_cache == "miss"  # the other detector's tracking of this clip is not reused
        assert json.loads(output.with_suffix(".json").read_text())["detector"] == detector
        frames = decode_frames(output).astype(np.int16)
        moving = np.abs(np.diff(frames[5:50], axis=0)).mean(axis=(0, 3))  # (240, 320)
        motion[detector] = moving[:, :SMALL_FACE[0]].max(), moving[:, SMALL_FACE[0]:].max()
    mediapipe_left, mediapipe_right = motion["mediapipe"]
    s3fd_left, s3fd_right = motion["s3fd"]
    assert mediapipe_left > 5 and mediapipe_right < 1.5, motion  # mediapipe: the larger face speaks
    assert s3fd_right > 5 and s3fd_left < 1.5, motion  # S3FD's box: the face under the marker speaks


# --------------------------------------------------------------------------- the batched post-processing


def astronaut_frames(face_photo: Path) -> np.ndarray:
    """(2, 144, 192, 3) uint8: the portrait and its mirror image."""
    import cv2

    portrait = cv2.resize(cv2.imread(str(face_photo)), (192, 144), interpolation=cv2.INTER_AREA)
    return np.ascontiguousarray(np.stack([portrait, portrait[:, ::-1]]))


def network_outputs(model, frames, max_side) -> tuple:
    """(offsets (B, A, 4), face scores (B, A), anchors (A, 4), input -> frame factors (4,)) as detect_faces has them."""
    size = resized_size(*frames.shape[1:3], None, max_side)
    with torch.inference_mode():
        levels = model(prepare_images(frames, size, torch.device("cpu")))
    anchors = make_anchors([tuple(logits.shape[2:]) for logits, _ in levels])
    face_scores = torch.cat([logits.softmax(dim=1)[:, 1].flatten(1) for logits, _ in levels], dim=1)  # (B, A)
    offsets = torch.cat([offsets.flatten(2).transpose(1, 2) for _, offsets in levels], dim=1)  # (B, A, 4)
    to_frame = torch.tensor([frames.shape[2] / size[1], frames.shape[1] / size[0]] * 2)
    return offsets, face_scores, anchors, to_frame


def per_image_detections(model, frames, max_side, score_threshold, max_candidates) -> list[np.ndarray]:
    """What detect_faces gives, written out image by image through select_boxes (the plain form)."""
    from heygem.face.s3fd import select_boxes

    offsets, face_scores, anchors, to_frame = network_outputs(model, frames, max_side)
    return [select_boxes(offsets[item], face_scores[item], anchors, to_frame, score_threshold, 0.3, max_candidates)
            for item in range(len(frames))]


@pytest.mark.parametrize("score_threshold, max_candidates", [(0.5, 1000), (0.5, 40), (0.3, 1000)])
def test_batched_selection_gives_the_per_image_boxes_bit_for_bit(random_model, face_photo, score_threshold,
                                                                 max_candidates):
    frames = astronaut_frames(face_photo)
    expected = per_image_detections(random_model, frames, 128, score_threshold, max_candidates)
    found = detect_faces(random_model, frames, max_side=128, score_threshold=score_threshold,
                         max_candidates=max_candidates, batch_size=2)
    assert [len(boxes) for boxes in expected] == [len(boxes) for boxes in found]
    assert all(len(boxes) > 10 for boxes in found)  # many candidates overlap: NMS has work to do
    if max_candidates < 1000:
        assert all(len(boxes) < max_candidates for boxes in found)
    for boxes, reference in zip(found, expected):
        assert boxes.dtype == np.float32
        np.testing.assert_array_equal(boxes, reference)
    # the overlaps for the whole batch at once (the CUDA form) give the same boxes
    from heygem.face.s3fd import select_boxes_batch

    batched = select_boxes_batch(*network_outputs(random_model, frames, 128), score_threshold, 0.3, max_candidates,
                                 per_image_overlaps=False)
    for boxes, reference in zip(batched, expected):
        np.testing.assert_array_equal(boxes, reference)


def test_equal_scores_keep_the_first_anchor_and_an_empty_frame_gives_no_rows():
    # the square covers two stride-4 cells side by side: equal scores, overlapping boxes; the first one is kept
    frames = frames_with_a_bright_square(2, 64, 96, top=20, left=36, side=8)
    frames[1] = 0
    with_square, empty = detect_faces(bright_square_model(), frames, score_threshold=0.6, batch_size=2)
    assert empty.shape == (0, 5) and empty.dtype == np.float32
    np.testing.assert_allclose(with_square[:, :4], [[30.0, 14.0, 46.0, 30.0]], atol=1e-4)  # row 5, column 9


def test_prepared_models_leave_the_given_one_alone_and_find_the_same_faces(random_model, face_photo):
    from heygem.face.s3fd import model_layout, prepare_s3fd

    assert prepare_s3fd(random_model, "auto") is random_model  # on the CPU nothing changes by default
    frames = astronaut_frames(face_photo)
    reference = detect_faces(random_model, frames, max_side=128)

    channels_last = prepare_s3fd(random_model, "fp32", channels_last=True)
    assert model_layout(channels_last) == (torch.float32, True)
    assert model_layout(random_model) == (torch.float32, False)
    for boxes, expected in zip(detect_faces(channels_last, frames, max_side=128), reference):
        np.testing.assert_array_equal(boxes, expected)

    half = prepare_s3fd(bright_square_model(), "fp16", cast_weights=True, channels_last=True)
    assert model_layout(half) == (torch.float16, True)
    seen = []

    def record_input(module, inputs):
        images = inputs[0]
        layout_is_channels_last = images.is_contiguous(memory_format=torch.channels_last)
        seen.append((images.dtype, torch.is_autocast_enabled("cpu"), layout_is_channels_last))

    half.register_forward_pre_hook(record_input)
    frames = frames_with_a_bright_square(1, 128, 192, top=40, left=72, side=8)
    (boxes,) = detect_faces(half, frames, max_side=96, score_threshold=0.6, precision="fp16")
    assert seen == [(torch.float16, False, True)]  # the weights' dtype, no autocast on top, the weights' layout
    np.testing.assert_allclose(boxes[:, :4], [[60.0, 28.0, 92.0, 60.0]], atol=0.1)
    assert boxes[0, 4] == pytest.approx(BRIGHT_CELL_SCORE, abs=2e-3)
