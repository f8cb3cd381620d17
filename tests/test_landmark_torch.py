"""The landmark engine's batched torch drawing (on the CPU) against the CPU engine's generate_i420.

Frames and landmarks are bench_landmark.py's: the bundled portrait drifting over a 640x360
frame, its face-mesh landmarks found with mediapipe once per distinct frame.
"""

from __future__ import annotations

from concurrent.futures import Future

import cv2
import numpy as np
import pytest
import torch
from bench_landmark import make_frames, speech_windows
from conftest import ASSETS, decode_frames, run_ffmpeg

from heygem.config import BlendConfig, EngineConfig, load_config
from heygem.engines import ENGINES
from heygem.engines.landmark.device import LandmarkDeviceRender, draw_mouths, region_layout
from heygem.engines.landmark.drawing import animate_mouth
from heygem.engines.landmark.engine import LandmarkEngine
from heygem.engines.landmark.geometry import MouthGeometry, patch_box
from heygem.errors import HeygemError
from heygem.media.frames import bgr_to_yuv420, even_box, i420_batch_to_bgr, i420_planes, paste_i420_window
from heygem.pipeline import generate
from heygem.render.blend import blend_patch
from heygem.render.cpu import CpuRender
from heygem.render.prepared import Prepared
from heygem.render.regions import region_windows
from heygem.runtime.flow import StageClock
from heygem.speech import audio
from heygem.types import EngineBatch, Face, FrameBatch

WIDTH, HEIGHT = 640, 360
FPS = 25.0
BLEND = BlendConfig()


@pytest.fixture(scope="module")
def sample():
    """(8, H * 3/2, W) I420 frames of the drifting portrait and their (468, 2) landmarks."""
    frames_bgr, landmarks = make_frames(WIDTH, HEIGHT)
    frames_i420 = np.stack([bgr_to_yuv420(frame) for frame in frames_bgr])
    return frames_i420, landmarks


def with_faces(frames_i420: np.ndarray, landmarks: list) -> list[Face]:
    return [Face(box=(0, 0, WIDTH, HEIGHT), landmarks=points) for points in landmarks]


def cpu_render(frames_i420: np.ndarray, faces: list, windows: np.ndarray) -> tuple[np.ndarray, LandmarkEngine]:
    """The frames with the CPU engine's finished windows pasted in, and the engine after them."""
    engine = LandmarkEngine(EngineConfig(), FPS)
    frames = frames_i420.copy()
    for frame, window in zip(frames, engine.generate_i420(frames_i420, faces, windows, BLEND)):
        if window is not None:
            paste_i420_window(frame, window.box, window.planes)
    return frames, engine


def torch_render(frames_i420: np.ndarray, faces: list, windows: np.ndarray) -> tuple[np.ndarray, LandmarkEngine]:
    """The same frames drawn by heygem.engines.landmark.device on CPU tensors, regions cut and pasted as
    the render stage does."""
    engine = LandmarkEngine(EngineConfig(), FPS)
    jobs = engine.mouth_jobs(faces, windows)
    frames = frames_i420.copy()
    layout = region_layout(jobs, (WIDTH, HEIGHT))
    if layout is None:
        return frames, engine
    regions = np.empty((len(layout.rows), layout.height * 3 // 2, layout.width), np.uint8)
    for region_plane, frame_window in region_windows(regions, frames, layout.rows, layout.origins):
        region_plane[...] = frame_window
    planes = torch.from_numpy(regions.copy())
    with torch.inference_mode():
        draw_mouths(planes, layout.faces, (WIDTH, HEIGHT), BLEND, engine.teeth, regions)
    for region_plane, frame_window in region_windows(planes.numpy(), frames, layout.rows, layout.origins):
        frame_window[...] = region_plane
    return frames, engine


def to_bgr(frame_i420: np.ndarray) -> np.ndarray:
    return cv2.cvtColor(frame_i420, cv2.COLOR_YUV2BGR_I420).astype(np.int32)


def changed_pixels(frame_i420: np.ndarray, source_i420: np.ndarray) -> np.ndarray:
    """(H, W) bool: pixels whose Y byte or 2x2 block's U/V bytes differ from the source."""
    y, u, v = i420_planes(frame_i420)
    source_y, source_u, source_v = i420_planes(source_i420)
    chroma = (u != source_u) | (v != source_v)
    return (y != source_y) | np.kron(chroma, np.ones((2, 2), bool)).astype(bool)


def box_mask(landmarks: np.ndarray) -> np.ndarray:
    """(H, W) bool: the face's patch box, where the engines may change pixels (even-widened)."""
    box = patch_box(MouthGeometry.from_landmarks(landmarks), WIDTH, HEIGHT)
    x1, y1, x2, y2 = even_box(box, WIDTH, HEIGHT)
    inside = np.zeros((HEIGHT, WIDTH), bool)
    inside[y1:y2, x1:x2] = True
    return inside


def dark_pixels(frame_i420: np.ndarray, landmarks: np.ndarray) -> int:
    """Dark pixels (an open mouth's cavity) from corner to corner, nose to chin."""
    x1, x2 = int(landmarks[61, 0]) - 4, int(landmarks[291, 0]) + 4
    y1, y2 = int(landmarks[2, 1]), int(landmarks[152, 1])
    return int((i420_planes(frame_i420)[0][y1:y2, x1:x2] < 60).sum())


def test_torch_drawing_matches_the_cpu_engine_frame_by_frame(sample):
    frames_i420, landmarks = sample
    count = 16  # speech that opens and closes the mouth, over the 8 distinct frames twice
    frames = frames_i420[np.arange(count) % len(frames_i420)]
    faces = with_faces(frames, [landmarks[index % len(landmarks)] for index in range(count)])
    windows = speech_windows(count + 40)[40:]
    expected, cpu_engine = cpu_render(frames, faces, windows)
    drawn, torch_engine = torch_render(frames, faces, windows)
    for index in range(count):
        on_cpu, on_torch = changed_pixels(expected[index], frames[index]), changed_pixels(drawn[index], frames[index])
        assert on_torch.sum() > 1000  # every frame's mouth moved
        # the same pixels change: a few differ where the mask's edge rounds to 0 on one side only
        assert (on_cpu ^ on_torch).sum() <= 0.01 * on_cpu.sum()
        # and to the same values: measured 0.01 grey levels on average, at most 4, over the changed area
        difference = np.abs(to_bgr(expected[index]) - to_bgr(drawn[index])).max(axis=2)
        area = on_cpu | on_torch
        assert difference[area].mean() < 0.1 and difference.max() <= 16
        # nothing outside the face's patch box changes
        assert not on_torch[~box_mask(faces[index].landmarks)].any()
    # the remembered teeth colour advanced over the same frames
    np.testing.assert_allclose(torch_engine.teeth.bgr, cpu_engine.teeth.bgr, atol=1e-3)
    # the engines' mouth shapes advanced alike
    np.testing.assert_array_equal(torch_engine.shapes.update(windows[:2]).openness,
                                  cpu_engine.shapes.update(windows[:2]).openness)


def test_an_open_target_opens_the_mouth(sample):
    frames_i420, landmarks = sample
    frame = frames_i420[:1]
    region = region_layout([(0, landmarks[0], 1.2, 0.0, 1.0)], (WIDTH, HEIGHT))
    regions = np.empty((1, region.height * 3 // 2, region.width), np.uint8)
    for region_plane, frame_window in region_windows(regions, frame, region.rows, region.origins):
        region_plane[...] = frame_window
    planes = torch.from_numpy(regions.copy())
    changed = draw_mouths(planes, region.faces, (WIDTH, HEIGHT), BLEND, None)
    assert changed.tolist() == [True]
    opened = frame.copy()
    for region_plane, frame_window in region_windows(planes.numpy(), opened, region.rows, region.origins):
        frame_window[...] = region_plane
    before, after = dark_pixels(frame[0], landmarks[0]), dark_pixels(opened[0], landmarks[0])
    assert after > before + 100, (before, after)


def draw_one(frame_i420: np.ndarray, landmarks: np.ndarray, openness: float, speaking: float = 1.0) -> np.ndarray:
    """(H * 3/2, W) the frame with its mouth drawn by heygem.engines.landmark.device for this shape."""
    region = region_layout([(0, landmarks, openness, 0.0, speaking)], (WIDTH, HEIGHT))
    regions = np.empty((1, region.height * 3 // 2, region.width), np.uint8)
    for region_plane, frame_window in region_windows(regions, frame_i420[None], region.rows, region.origins):
        region_plane[...] = frame_window
    planes = torch.from_numpy(regions.copy())
    draw_mouths(planes, region.faces, (WIDTH, HEIGHT), BLEND, None)
    drawn = frame_i420[None].copy()
    for region_plane, frame_window in region_windows(planes.numpy(), drawn, region.rows, region.origins):
        frame_window[...] = region_plane
    return drawn[0]


@pytest.fixture(scope="module")
def closed_sample(sample):
    """The first frame with its mouth closed by the CPU engine (a closed target between words), and its
    re-detected landmarks."""
    import mediapipe as mp

    frames_i420, landmarks = sample
    frame_bgr = cv2.cvtColor(frames_i420[0], cv2.COLOR_YUV2BGR_I420)
    blend_patch(frame_bgr, animate_mouth(frame_bgr, landmarks[0], 0.0, 0.0), BLEND)
    with mp.solutions.face_mesh.FaceMesh(static_image_mode=True, max_num_faces=1) as mesh:
        found = mesh.process(cv2.cvtColor(frame_bgr, cv2.COLOR_BGR2RGB)).multi_face_landmarks[0].landmark
    closed_landmarks = np.array([[point.x * WIDTH, point.y * HEIGHT] for point in found], np.float32)
    return bgr_to_yuv420(frame_bgr)[None], closed_landmarks


def test_a_closed_mouth_with_a_closed_target_keeps_its_bytes(closed_sample):
    frame, landmarks = closed_sample
    patch = animate_mouth(cv2.cvtColor(frame[0], cv2.COLOR_YUV2BGR_I420), landmarks, 0.0, 0.0)
    assert patch is not None and not patch.mask.any()  # the CPU engine's all-zero mask
    np.testing.assert_array_equal(draw_one(frame[0], landmarks, 0.0), frame[0])


def test_silence_keeps_every_byte_and_a_handover_draws_part_of_the_way(sample):
    """Speech that has let go of the mouth (silence from the start) leaves the frames as they are on both
    paths; halfway through a handover the mouth is opened part of the way, alike on both."""
    frames_i420, landmarks = sample
    frames = frames_i420[:4].copy()
    faces = with_faces(frames, landmarks[:4])
    silence = np.full((4, 80, 16), -4.0, np.float32)
    patches = LandmarkEngine(EngineConfig(), FPS).generate(EngineBatch(
        frame_indices=np.arange(4), frames_bgr=i420_batch_to_bgr(frames), faces=faces, mel_windows=silence,
        fps=FPS))
    assert patches == [None] * 4
    expected, _ = cpu_render(frames, faces, silence)
    drawn, _ = torch_render(frames, faces, silence)
    np.testing.assert_array_equal(expected, frames)
    np.testing.assert_array_equal(drawn, frames)

    np.testing.assert_array_equal(draw_one(frames[0], landmarks[0], 1.2, 0.0), frames[0])
    x1, x2 = int(landmarks[0][61, 0]) - 4, int(landmarks[0][291, 0]) + 4  # the mouth, nose to chin
    y1, y2 = int(landmarks[0][2, 1]), int(landmarks[0][152, 1])
    moved = [np.abs(to_bgr(draw_one(frames[0], landmarks[0], 1.2, speaking)) - to_bgr(frames[0]))[y1:y2, x1:x2].mean()
             for speaking in (0.25, 0.5, 1.0)]
    assert 1.0 < moved[0] < moved[1] < moved[2], moved
    opened = draw_one(frames[0], landmarks[0], 1.2, 1.0)
    assert dark_pixels(opened, landmarks[0]) > dark_pixels(frames[0], landmarks[0]) + 100


def test_frames_without_a_face_or_landmarks_keep_their_bytes(sample):
    frames_i420, landmarks = sample
    frames = frames_i420[:4].copy()
    faces = [Face(box=(0, 0, WIDTH, HEIGHT), landmarks=landmarks[0]), None,
             Face(box=(0, 0, WIDTH, HEIGHT), landmarks=None), Face(box=(0, 0, WIDTH, HEIGHT), landmarks=landmarks[3])]
    windows = speech_windows(44)[40:]
    expected, _ = cpu_render(frames, faces, windows)
    drawn, _ = torch_render(frames, faces, windows)
    np.testing.assert_array_equal(drawn[1:3], frames[1:3])
    for index in (0, 3):
        assert changed_pixels(drawn[index], frames[index]).sum() > 1000
        assert np.abs(to_bgr(expected[index]) - to_bgr(drawn[index])).mean() < 0.05


def prepared_for(engine: LandmarkEngine, frame_count: int) -> Prepared:
    mel_future, engine_future = Future(), Future()
    mel_future.set_result((audio.melspectrogram(audio.load_audio_16k(ASSETS / "speech_en.wav")), 0.0))
    engine_future.set_result((engine, 0.0))
    return Prepared(mel_future, engine_future, frame_count, FPS, StageClock())


def run_stages_in_turn(render, batches: list) -> np.ndarray:
    """The frames out of the render's stages, each stage run over the whole output of the one before."""
    items = iter(batches)
    for stage in render.stages():
        items = stage.run(items)
    return np.concatenate([batch.frames_i420 for batch in items])


def test_the_render_stages_give_the_frames_of_the_cpu_engine(sample):
    """LandmarkDeviceRender's stages over batches with a frame without a face and one without landmarks,
    the faces planned here and in two rendering processes."""
    frames_i420, landmarks = sample
    count = 12
    frames = frames_i420[np.arange(count) % len(frames_i420)]
    faces: list = with_faces(frames, [landmarks[index % len(landmarks)] for index in range(count)])
    faces[2] = None
    faces[7] = Face(box=(0, 0, WIDTH, HEIGHT), landmarks=None)
    config = load_config(overrides={"engine.name": "landmark", "run.render": "torch", "engine.device": "cpu"})
    drawn = {}
    for processes in (0, 2):
        torch_engine = LandmarkEngine(EngineConfig(), FPS, workers=processes)
        render = ENGINES["landmark"].render(prepared_for(torch_engine, count), config, "none")
        assert isinstance(render, LandmarkDeviceRender)
        batches = [FrameBatch(output_indices=np.arange(start, start + 6), source_indices=np.arange(start, start + 6),
                              frames_i420=frames[start:start + 6].copy(), faces=faces[start:start + 6])
                   for start in (0, 6)]
        try:
            drawn[processes] = run_stages_in_turn(render, batches)
            assert (torch_engine._pool is not None) == (processes > 0)  # the processes planned the faces
        finally:
            torch_engine.close()
    np.testing.assert_array_equal(drawn[2], drawn[0])

    cpu_engine = LandmarkEngine(EngineConfig(), FPS)
    cpu_prepared = prepared_for(cpu_engine, count)
    expected = frames.copy()
    windows = cpu_engine.generate_i420(frames, faces, cpu_prepared.mel_windows(np.arange(count)), BLEND)
    for frame, window in zip(expected, windows):
        if window is not None:
            paste_i420_window(frame, window.box, window.planes)
    np.testing.assert_array_equal(drawn[0][[2, 7]], frames[[2, 7]])
    for index in set(range(count)) - {2, 7}:
        assert changed_pixels(drawn[0][index], frames[index]).sum() > 1000
        assert np.abs(to_bgr(expected[index]) - to_bgr(drawn[0][index])).mean() < 0.05


def test_render_choice_for_the_landmark_engine(monkeypatch):
    import heygem.runtime.device

    prepared = prepared_for(LandmarkEngine(EngineConfig(), FPS), 1)
    auto = load_config(overrides={"engine.name": "landmark", "run.render": "auto"})
    monkeypatch.setattr(heygem.runtime.device, "gpu_expected", lambda: False)
    assert isinstance(ENGINES["landmark"].render(prepared, auto, "none"), CpuRender)  # no GPU: the CPU processes
    monkeypatch.setattr(heygem.runtime.device, "gpu_expected", lambda: True)
    assert isinstance(ENGINES["landmark"].render(prepared, auto, "none"), LandmarkDeviceRender)  # measured faster there
    assert isinstance(ENGINES["landmark"].render(prepared, auto, "gfpgan"), CpuRender)
    on_cpu = load_config(overrides={"engine.name": "landmark", "run.render": "auto", "engine.device": "cpu"})
    assert isinstance(ENGINES["landmark"].render(prepared, on_cpu, "none"), CpuRender)
    on_torch = load_config(overrides={"engine.name": "landmark", "run.render": "torch"})
    with pytest.raises(HeygemError, match="--restorer none or --render numpy"):
        ENGINES["landmark"].render(prepared, on_torch, "gfpgan")


def test_generate_with_the_torch_render_path(tmp_path, face_video, media_dir):
    speech = media_dir / "one second for the landmark engine.wav"
    run_ffmpeg("-i", str(face_video), "-t", "1", "-vn", str(speech))
    # lossless x264, so that the frames compare as drawn (at --crf 18 the encoder's choices alone differ by
    # ~3.7 grey levels on average over the mouth)
    options = {"run.avatar_cache": False, "engine.name": "landmark", "engine.device": "cpu", "media.crf": 0}
    on_torch = generate(face_video, speech, tmp_path / "torch.mp4", overrides={**options, "run.render": "torch"})
    on_cpu = generate(face_video, speech, tmp_path / "cpu.mp4", overrides={**options, "run.render": "numpy"})
    assert on_torch.engine == on_cpu.engine == "landmark"
    assert "render" in on_torch.seconds_per_stage and "blend" in on_cpu.seconds_per_stage
    torch_frames = decode_frames(tmp_path / "torch.mp4").astype(int)
    cpu_frames = decode_frames(tmp_path / "cpu.mp4").astype(int)
    source = decode_frames(face_video)[: len(torch_frames)].astype(int)
    assert len(torch_frames) == len(cpu_frames) == on_torch.frames == 30
    changed = np.abs(torch_frames - source).max(axis=3) > 20  # (N, H, W) the mouth moved
    assert changed.sum() > 30 * 50
    # both paths draw the same mouths: measured 0.001 grey levels on average, 0.07 over the moved mouth
    assert np.abs(torch_frames - cpu_frames).mean() < 0.02
    assert np.abs(torch_frames - cpu_frames)[changed].mean() < 0.5


def test_bytes_under_a_zero_mask_keep_their_decoded_values_even_outside_bgr(sample):
    """Camera video often holds Y below 16 or above 235, which a conversion to BGR and back clips: such
    bytes in the patch box but under a zero or all but zero mask (its edges, the neck under the chin) stay
    as decoded on both paths, so the box's edge never shows as a line."""
    frames_i420, landmarks = sample
    count = 8
    frames = frames_i420[:count].copy()
    faces = with_faces(frames, landmarks[:count])
    for frame, points in zip(frames, landmarks[:count]):
        x1, y1, x2, y2 = patch_box(MouthGeometry.from_landmarks(points), WIDTH, HEIGHT)
        luma = i420_planes(frame)[0]
        for rows in (slice(y1, y1 + 8), slice(y2 - 8, y2 + 2)):  # the box's top and bottom, and just below
            luma[rows, x1:x2] = np.where(np.arange(x1, x2) % 2 == 0, 4, 250).astype(np.uint8)[None]
    windows = speech_windows(count + 40)[40:]
    patches = LandmarkEngine(EngineConfig(), FPS).generate(EngineBatch(
        frame_indices=np.arange(count), frames_bgr=i420_batch_to_bgr(frames), faces=faces, mel_windows=windows,
        fps=FPS))
    for drawn, _ in (cpu_render(frames, faces, windows), torch_render(frames, faces, windows)):
        for index, patch in enumerate(patches):
            x1, y1, x2, y2 = patch.box
            mask = np.zeros((HEIGHT, WIDTH), np.float32)
            mask[y1:y2, x1:x2] = patch.mask
            change = np.abs(i420_planes(drawn[index])[0].astype(int) - i420_planes(frames[index])[0].astype(int))
            assert change.max() > 40  # the mouth moved
            assert change[mask < 0.005].max() <= 2, (index, change[mask < 0.005].max())
