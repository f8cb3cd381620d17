"""Face finding, the choice among several faces, padding and smoothing, ping-pong indices."""

import cv2
import numpy as np

from heygem import faces
from heygem.config import FaceConfig
from heygem.source import pingpong_indices


def test_the_portrait_face_is_found_with_its_mouth_where_it_belongs(face_photo):
    image = cv2.imread(str(face_photo))
    with faces.FaceFinder(FaceConfig(), still_images=True) as finder:
        landmarks = finder.find(image)
        assert landmarks.shape == (468, 2)
    x1, y1, x2, y2 = faces.tight_box(landmarks)
    assert 150 < x1 < 200 and 40 < y1 < 90 and 260 < x2 < 310 and 170 < y2 < 220  # the astronaut's face
    upper_lip, lower_lip, chin = landmarks[13], landmarks[14], landmarks[152]
    assert y1 < upper_lip[1] <= lower_lip[1] < chin[1] <= y2


def test_choice_policy_largest_or_index_from_the_left():
    boxes = np.array([[200, 0, 260, 60], [0, 0, 100, 100], [400, 0, 430, 30]], dtype=np.float32)
    assert faces.choose_face(boxes, None) == 1
    assert faces.choose_face(boxes, 0) == 1
    assert faces.choose_face(boxes, 1) == 0
    assert faces.choose_face(boxes, 2) == 2
    assert faces.choose_face(boxes, 5) is None
    overlap = faces.box_overlap(np.array([0, 0, 100, 100], dtype=np.float32), boxes)
    assert overlap[1] == 1.0 and overlap[0] == 0.0


def test_smoothing_averages_found_frames_only_and_padding_follows_wav2lip():
    boxes = np.array([[10, 10, 50, 50], [12, 10, 52, 50], [np.nan] * 4, [14, 10, 54, 50]], dtype=np.float32)
    found = np.array([True, True, False, True])
    smoothed = faces.smooth_boxes(boxes, found, window=3)
    np.testing.assert_allclose(smoothed[1], [11, 10, 51, 50])  # mean of frames 0 and 1 (2 has no face)
    assert np.isnan(smoothed[2]).all()
    np.testing.assert_allclose(faces.smooth_boxes(boxes, found, window=1)[found], boxes[found])
    padded = faces.pad_and_clip(np.array([[10, 20, 50, 60]], dtype=np.float32), [0, 10, 0, 0], 100, 65)
    assert padded.tolist() == [[10, 20, 50, 65]]  # bottom pad of 10, clipped at the frame's edge


def test_fixed_box_overrides_detection_on_every_frame():
    track = faces.new_track(3)
    faces.record(track, 0, None)
    faces.record(track, 1, np.full((468, 2), 30, dtype=np.float32))
    faces.record(track, 2, None)
    faces.finalize_track(track, FaceConfig(box=[5, 6, 70, 80]), width=64, height=64)
    assert track.found.all()
    assert track.face(0).box == (5, 6, 64, 64) and track.face(0).landmarks is None
    assert track.face(1).landmarks is not None


def test_pingpong_plays_forward_then_backward_without_jumps():
    indices = pingpong_indices(np.arange(12), 4)
    assert indices.tolist() == [0, 1, 2, 3, 2, 1, 0, 1, 2, 3, 2, 1]
    assert np.abs(np.diff(indices)).max() == 1
    assert pingpong_indices(np.arange(5), 1).tolist() == [0] * 5


def test_a_face_in_a_wide_frame_is_found_where_the_mesh_alone_finds_none(face_photo):
    import mediapipe as mp

    portrait = cv2.imread(str(face_photo))
    wide = np.full((720, 1280, 3), 190, np.uint8)  # 16:9, as most videos; the face is 110 px wide
    wide[100:612, 700:1212] = portrait
    with mp.solutions.face_mesh.FaceMesh(static_image_mode=True, max_num_faces=4) as mesh_alone:
        assert not mesh_alone.process(cv2.cvtColor(wide, cv2.COLOR_BGR2RGB)).multi_face_landmarks
    with faces.FaceFinder(FaceConfig(), still_images=True) as finder:
        assert len(finder.detect(wide)) == 1
        landmarks = finder.find(wide)
    with faces.FaceFinder(FaceConfig(), still_images=True) as finder:
        reference = finder.find(portrait)  # the same face on its own
    np.testing.assert_allclose(landmarks[[13, 14, 61, 291, 152]], reference[[13, 14, 61, 291, 152]] + [700, 100],
                               atol=3.0)  # the lips and chin land where they are in the portrait
