"""Face finding, the choice among several faces, padding and smoothing, ping-pong indices."""

from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
import pytest

from heygem.config import FaceConfig
from heygem.face.detect import (
    LANDMARK_COUNT,
    FaceMesh,
    MediapipeDetector,
    import_mediapipe,
    landmarks_from_wire,
    merge_boxes,
)
from heygem.face.finder import FaceFinder, box_overlap, choose_face, tile_windows
from heygem.face.track import finalize_track, new_track, pad_and_clip, record, smooth_boxes, tight_box
from heygem.media.decode import iter_video_i420
from heygem.media.frames import I420Frames, i420_batch_to_bgr
from heygem.media.probing import probe, working_geometry
from heygem.media.source import pingpong_indices


def test_the_portrait_face_is_found_with_its_mouth_where_it_belongs(face_photo):
    image = cv2.imread(str(face_photo))
    with FaceFinder(FaceConfig(), still_images=True) as finder:
        landmarks = finder.find(image)
        assert landmarks.shape == (468, 2)
    x1, y1, x2, y2 = tight_box(landmarks)
    assert 150 < x1 < 200 and 40 < y1 < 90 and 260 < x2 < 310 and 170 < y2 < 220  # the astronaut's face
    upper_lip, lower_lip, chin = landmarks[13], landmarks[14], landmarks[152]
    assert y1 < upper_lip[1] <= lower_lip[1] < chin[1] <= y2


def test_frames_tracked_from_i420_give_the_landmarks_of_their_bgr_conversions(face_video):
    info = probe(face_video)
    planes = next(iter_video_i420(info, working_geometry(info, None), 24))
    with FaceFinder(FaceConfig(redetect_every=5)) as finder:
        from_bgr = finder.track(list(i420_batch_to_bgr(planes)))
        finder.reset()
        from_i420 = finder.track(I420Frames(planes))  # only the crops around the face are converted
    assert all(landmarks is not None for landmarks in from_bgr)
    for expected, landmarks in zip(from_bgr, from_i420, strict=True):
        np.testing.assert_array_equal(landmarks, expected)


def test_tracking_processes_give_the_landmarks_of_a_finder_here_and_report_a_failed_run(face_video):
    from heygem.face.processes import TrackingProcesses
    from heygem.runtime.processes import WorkerProcessError

    info = probe(face_video)
    planes = next(iter_video_i420(info, working_geometry(info, None), 24))
    config = FaceConfig(redetect_every=5)
    with FaceFinder(config) as finder:
        expected = [finder.track(I420Frames(planes[:12]))]
        finder.reset()
        expected.append(finder.track(I420Frames(planes[12:])))
    pool = TrackingProcesses(config, 2)
    try:
        with ThreadPoolExecutor(2) as threads:  # two runs at once, one per process
            tracked = list(threads.map(pool.track_run, [I420Frames(planes[:12]), I420Frames(planes[12:])]))
        for expected_run, tracked_run in zip(expected, tracked, strict=True):
            assert len(tracked_run) == 12 and all(landmarks is not None for landmarks in tracked_run)
            for landmarks, wanted in zip(tracked_run, expected_run, strict=True):
                np.testing.assert_array_equal(landmarks, wanted)
        with pytest.raises(WorkerProcessError, match="face tracking process . failed: .*sz.height % 3 == 0"):
            pool.track_run(I420Frames(planes[:, :-1]))  # rows that are no I420 frame
        assert pool.alive()  # the process that failed goes on
        again = [pool.track_run(I420Frames(planes[:12])) for _ in range(2)]  # each process once
        for run in again:
            for landmarks, wanted in zip(run, expected[0], strict=True):
                np.testing.assert_array_equal(landmarks, wanted)
    finally:
        pool.close()
    assert not any(process.is_alive() for process in pool._processes.processes)


def test_the_face_mesh_read_directly_gives_what_mediapipe_process_gives(face_video):
    info = probe(face_video)
    planes = next(iter_video_i420(info, working_geometry(info, None), 12))
    mp = import_mediapipe()
    direct, by_process = FaceMesh(mp, still_images=False), FaceMesh(mp, still_images=False)
    try:
        assert direct._lean  # mediapipe 0.10.14: its graph is fed and read without process()
        for frame in I420Frames(planes):  # video mode: each result also steers the next frame's crop
            image = np.ascontiguousarray(frame.region(0, 0, frame.width, frame.height, rgb=True))
            expected = by_process._landmarks_by_process(image)
            assert expected is not None and expected.shape == (LANDMARK_COUNT, 2)
            np.testing.assert_array_equal(direct.landmarks(image), expected)
        assert direct.landmarks(np.zeros((240, 320, 3), np.uint8)) is None  # no face
    finally:
        direct.close()
        by_process.close()


def test_landmarks_are_read_from_their_serialized_bytes_or_refused():
    from mediapipe.framework.formats import landmark_pb2

    rng = np.random.default_rng(1)
    points = rng.random((LANDMARK_COUNT, 3), dtype=np.float32)
    landmarks = landmark_pb2.NormalizedLandmarkList()
    for x, y, z in points:
        landmarks.landmark.add(x=x, y=y, z=z)
    np.testing.assert_array_equal(landmarks_from_wire(landmarks.SerializeToString()), points[:, :2])
    landmarks.landmark[7].visibility = 0.5  # another layout: not read with numpy
    assert landmarks_from_wire(landmarks.SerializeToString()) is None
    landmarks.landmark[7].ClearField("visibility")
    landmarks.landmark[7].x = points[7, 0] = 0.0  # set, even to zero, a field is written (proto2)
    np.testing.assert_array_equal(landmarks_from_wire(landmarks.SerializeToString()), points[:, :2])
    landmarks.landmark[7].ClearField("z")  # a field left out: another layout again
    assert landmarks_from_wire(landmarks.SerializeToString()) is None
    assert landmarks_from_wire(b"") is None


def test_choice_policy_largest_or_index_from_the_left():
    boxes = np.array([[200, 0, 260, 60], [0, 0, 100, 100], [400, 0, 430, 30]], dtype=np.float32)
    assert choose_face(boxes, None) == 1
    assert choose_face(boxes, 0) == 1
    assert choose_face(boxes, 1) == 0
    assert choose_face(boxes, 2) == 2
    assert choose_face(boxes, 5) is None
    overlap = box_overlap(np.array([0, 0, 100, 100], dtype=np.float32), boxes)
    assert overlap[1] == 1.0 and overlap[0] == 0.0


def test_smoothing_averages_found_frames_only_and_padding_follows_wav2lip():
    boxes = np.array([[10, 10, 50, 50], [12, 10, 52, 50], [np.nan] * 4, [14, 10, 54, 50]], dtype=np.float32)
    found = np.array([True, True, False, True])
    smoothed = smooth_boxes(boxes, found, window=3)
    np.testing.assert_allclose(smoothed[1], [11, 10, 51, 50])  # mean of frames 0 and 1 (2 has no face)
    assert np.isnan(smoothed[2]).all()
    np.testing.assert_allclose(smooth_boxes(boxes, found, window=1)[found], boxes[found])
    padded = pad_and_clip(np.array([[10, 20, 50, 60]], dtype=np.float32), [0, 10, 0, 0], 100, 65)
    assert padded.tolist() == [[10, 20, 50, 65]]  # bottom pad of 10, clipped at the frame's edge


def test_fixed_box_overrides_detection_on_every_frame():
    track = new_track(3)
    record(track, 0, None)
    record(track, 1, np.full((468, 2), 30, dtype=np.float32))
    record(track, 2, None)
    finalize_track(track, FaceConfig(box=[5, 6, 70, 80]), width=64, height=64)
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
    with FaceFinder(FaceConfig(), still_images=True) as finder:
        assert len(finder.detect(wide)) == 1
        landmarks = finder.find(wide)
    with MediapipeDetector(0.5) as whole_frame_only, \
            FaceFinder(FaceConfig(), still_images=True) as finder:
        # found in the whole frame: no tiles, the same box and landmarks as before tiles existed
        np.testing.assert_array_equal(finder.detect(wide), whole_frame_only.detect([wide])[0])
        np.testing.assert_array_equal(landmarks, finder.mesh_around(wide, whole_frame_only.detect([wide])[0][0]))
    with FaceFinder(FaceConfig(), still_images=True) as finder:
        reference = finder.find(portrait)  # the same face on its own
    np.testing.assert_allclose(landmarks[[13, 14, 61, 291, 152]], reference[[13, 14, 61, 291, 152]] + [700, 100],
                               atol=3.0)  # the lips and chin land where they are in the portrait


@pytest.mark.parametrize("background", ["plain", "noise"])
def test_a_50_pixel_face_in_a_720p_frame_is_found_on_tiles_with_its_landmarks(face_photo, background):
    portrait = cv2.imread(str(face_photo))
    with FaceFinder(FaceConfig(), still_images=True) as finder:
        reference = finder.find(portrait)
    scale, left, top = 0.45, 900, 400  # the face's detection box becomes ~48 px wide
    small = cv2.resize(portrait, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
    if background == "plain":
        frame = np.full((720, 1280, 3), 120, np.uint8)
    else:
        frame = np.random.default_rng(0).integers(0, 256, (720, 1280, 3), dtype=np.uint8)
    frame[top:top + small.shape[0], left:left + small.shape[1]] = small
    expected = reference * scale + [left, top]  # (468, 2) where the small face's landmarks belong

    with MediapipeDetector(0.5) as whole_frame_only:
        assert len(whole_frame_only.detect([frame])[0]) == 0  # the whole frame alone misses it
    with FaceFinder(FaceConfig(), still_images=True) as finder:
        boxes = finder.detect(frame)
        landmarks = finder.find(frame)
    assert boxes.shape == (1, 4) and 36 < boxes[0, 2] - boxes[0, 0] < 64
    x1, y1, x2, y2 = boxes[0]
    inside = (landmarks[:, 0] > x1 - 8) & (landmarks[:, 0] < x2 + 8) & (landmarks[:, 1] > y1 - 8) & \
        (landmarks[:, 1] < y2 + 8)
    assert inside.all()  # every landmark on the small face (its box, give or take a few pixels)
    lips_and_chin = [13, 14, 61, 291, 152]
    np.testing.assert_allclose(landmarks[lips_and_chin], expected[lips_and_chin], atol=2.0)


def test_tiles_overlap_and_cover_the_frame_and_duplicates_merge():
    windows = tile_windows(720, 1280)
    assert {x2 - x1 for x1, _, x2, _ in windows} == {432} and {y2 - y1 for _, y1, _, y2 in windows} == {432}
    covered = np.zeros((720, 1280), bool)
    for x1, y1, x2, y2 in windows:
        covered[y1:y2, x1:x2] = True
    assert covered.all() and len(windows) == 8
    xs = sorted({x1 for x1, *_ in windows})
    assert all(432 - (b - a) >= 0.25 * 432 for a, b in zip(xs, xs[1:]))  # neighbours share a quarter or more
    assert tile_windows(100, 100, fraction=1.0) == [(0, 0, 100, 100)]

    boxes = np.array([[10, 10, 60, 60], [12, 11, 61, 59], [10, 10, 30, 60], [200, 200, 240, 240]], np.float32)
    merged = merge_boxes(boxes)  # the second is the first again, the third its half cut by a tile edge
    assert merged.tolist() == [[10, 10, 60, 60], [200, 200, 240, 240]]
    assert merge_boxes(np.zeros((0, 4), np.float32)).shape == (0, 4)


def test_mediapipe_loads_without_matplotlib_and_its_drawing_helpers_still_get_it(face_photo):
    import subprocess
    import sys

    script = f"""
import sys
from heygem.config import FaceConfig
from heygem.face.detect import _ImportedOnUse
from heygem.face.finder import FaceFinder
finder = FaceFinder(FaceConfig(), still_images=True)
import cv2
found = finder.find(cv2.imread({str(face_photo)!r}))
assert found is not None and found.shape == (468, 2), found
assert "matplotlib" not in sys.modules and "matplotlib.pyplot" not in sys.modules
from mediapipe.python.solutions import drawing_utils
figure = drawing_utils.plt.figure()  # the helpers' pyplot imports the real one when used
import matplotlib.pyplot
assert type(figure).__module__ == "matplotlib.figure" and sys.modules["matplotlib.pyplot"] is matplotlib.pyplot
assert not isinstance(sys.modules["matplotlib"], _ImportedOnUse)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
