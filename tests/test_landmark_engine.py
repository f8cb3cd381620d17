"""The built-in landmark engine on the bundled portrait, with landmarks from mediapipe's face mesh.

The portrait smiles with her upper teeth showing (her lips are parted by about a sixth of
the mouth's width), so a closed target (a short break between words) closes her mouth; a closed
mouth (that closed portrait, re-detected by the face mesh) is left exactly as it is. In a pause
of the speech the engine lets go and her smile stays as it is.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import decode_frames, run_ffmpeg, silent_frames

from heygem.config import BlendConfig, EngineConfig
from heygem.engines.landmark.drawing import animate_mouth
from heygem.engines.landmark.engine import LandmarkEngine
from heygem.engines.landmark.geometry import JAW_LINE, LOWER_INNER_LIP, UPPER_INNER_LIP
from heygem.engines.landmark.mouth_shapes import MouthShapeTracker
from heygem.media.frames import (
    bgr_to_yuv420,
    cut_i420_window,
    even_box,
    i420_batch_to_bgr,
    i420_planes,
    paste_i420_window,
    write_region_i420,
)
from heygem.pipeline import generate
from heygem.render.blend import blend_patch
from heygem.types import EngineBatch, Face, FacePatch

ASSETS = Path(__file__).resolve().parent.parent / "assets"
FPS = 25.0
SILENT_WINDOW = np.full((80, 16), -4.0, np.float32)
MEL_UNITS_PER_DB = 8.0 / 100.0  # Wav2Lip's normalisation: 100 dB span onto [-4, 4]


@pytest.fixture(scope="module")
def face_mesh():
    import mediapipe as mp

    with mp.solutions.face_mesh.FaceMesh(static_image_mode=True, refine_landmarks=False, max_num_faces=1) as mesh:
        yield mesh


def find_landmarks(face_mesh, image_bgr: np.ndarray) -> np.ndarray:
    """(468, 2) float32 face-mesh points in pixels, as the faces stage gives them."""
    result = face_mesh.process(cv2.cvtColor(image_bgr, cv2.COLOR_BGR2RGB))
    assert result.multi_face_landmarks, "the face mesh found no face"
    height, width = image_bgr.shape[:2]
    points = result.multi_face_landmarks[0].landmark
    return np.array([[point.x * width, point.y * height] for point in points], np.float32)


def lip_gap(landmarks: np.ndarray) -> float:
    """Inner-lip gap at the mouth's centre, in pixels."""
    return float(np.linalg.norm(landmarks[14] - landmarks[13]))


def mouth_width(landmarks: np.ndarray) -> float:
    return float(np.linalg.norm(landmarks[291] - landmarks[61]))


def paste(frame_bgr: np.ndarray, patch: FacePatch) -> np.ndarray:
    """The frame with the patch blended in through its mask, as the blend stage does."""
    result = frame_bgr.astype(np.float32)
    x1, y1, x2, y2 = patch.box
    alpha = patch.mask[:, :, None]
    result[y1:y2, x1:x2] = result[y1:y2, x1:x2] * (1.0 - alpha) + patch.image_bgr * alpha
    return np.clip(np.rint(result), 0, 255).astype(np.uint8)


def inner_lip_luma(image_bgr: np.ndarray, landmarks: np.ndarray) -> float:
    """Mean brightness inside the inner-lip contour."""
    polygon = landmarks[list(UPPER_INNER_LIP + LOWER_INNER_LIP[-2:0:-1])]
    mask = np.zeros(image_bgr.shape[:2], np.uint8)
    cv2.fillPoly(mask, [np.round(polygon).astype(np.int32)], 1)
    return float(cv2.cvtColor(image_bgr, cv2.COLOR_BGR2GRAY)[mask > 0].mean())


def count_dark_mouth_pixels(image_bgr: np.ndarray, landmarks: np.ndarray) -> int:
    """Dark pixels (an open mouth's cavity) around the mouth: corner to corner, nose to chin."""
    x1, x2 = int(landmarks[61, 0]) - 4, int(landmarks[291, 0]) + 4
    y1, y2 = int(landmarks[2, 1]), int(landmarks[152, 1])
    return int((cv2.cvtColor(image_bgr[y1:y2, x1:x2], cv2.COLOR_BGR2GRAY) < 60).sum())


@pytest.fixture(scope="module")
def portrait() -> np.ndarray:
    return cv2.imread(str(ASSETS / "astronaut.jpg"))


@pytest.fixture(scope="module")
def portrait_landmarks(face_mesh, portrait) -> np.ndarray:
    return find_landmarks(face_mesh, portrait)


@pytest.fixture(scope="module")
def speech_mel() -> np.ndarray:
    """(80, T) Wav2Lip mel of the English sample, computed with Wav2Lip's formula."""
    import librosa

    samples, _ = librosa.load(str(ASSETS / "speech_en.wav"), sr=16000)
    emphasised = np.append(samples[0], samples[1:] - 0.97 * samples[:-1])
    magnitude = np.abs(librosa.stft(y=emphasised, n_fft=800, hop_length=200, win_length=800))
    mel_basis = librosa.filters.mel(sr=16000, n_fft=800, n_mels=80, fmin=55, fmax=7600)
    decibels = 20.0 * np.log10(np.maximum(1e-5, mel_basis @ magnitude)) - 20.0
    return np.clip(8.0 * ((decibels + 100.0) / 100.0) - 4.0, -4.0, 4.0).astype(np.float32)


def speech_windows(mel: np.ndarray, count: int, first_frame: int = 0) -> np.ndarray:
    """(count, 80, 16) windows for output frames first_frame.., as the audio stage makes them."""
    starts = [min(int((first_frame + i) * 80 / FPS), mel.shape[1] - 16) for i in range(count)]
    return np.stack([mel[:, start:start + 16] for start in starts])


@pytest.fixture(scope="module")
def loud_window(speech_mel) -> np.ndarray:
    """The window of the sample's loudest vowel."""
    windows = speech_windows(speech_mel, int(speech_mel.shape[1] * FPS / 80) - 1)
    voiced_level = windows[:, 5:45, :4].mean(axis=(1, 2))
    return windows[int(np.argmax(voiced_level))]


def make_batch(frame_bgr: np.ndarray, landmarks: np.ndarray | None, windows: np.ndarray,
               first_index: int = 0, faces: list | None = None) -> EngineBatch:
    count = len(windows)
    if faces is None:
        faces = [Face(box=(0, 0, frame_bgr.shape[1], frame_bgr.shape[0]), landmarks=landmarks)] * count
    return EngineBatch(frame_indices=np.arange(first_index, first_index + count, dtype=np.int64),
                       frames_bgr=np.repeat(frame_bgr[None], count, axis=0), faces=faces,
                       mel_windows=windows, fps=FPS)


def held_patch(frame_bgr: np.ndarray, landmarks: np.ndarray, window: np.ndarray, frames: int = 6) -> FacePatch:
    """The patch after ``frames`` frames of the same sound (the smoothing has settled)."""
    engine = LandmarkEngine(EngineConfig(), FPS)
    patches = engine.generate(make_batch(frame_bgr, landmarks, np.repeat(window[None], frames, axis=0)))
    return patches[-1]


def closed_patch(frame_bgr: np.ndarray, landmarks: np.ndarray) -> FacePatch:
    """The patch of a closed target while the speech holds the mouth (a short break between words)."""
    return animate_mouth(frame_bgr, landmarks, 0.0, 0.0)


def assert_patch_shape(patch: FacePatch, frame_bgr: np.ndarray) -> None:
    x1, y1, x2, y2 = patch.box
    assert 0 <= x1 < x2 <= frame_bgr.shape[1] and 0 <= y1 < y2 <= frame_bgr.shape[0]
    assert patch.image_bgr.shape == (y2 - y1, x2 - x1, 3) and patch.image_bgr.dtype == np.uint8
    assert patch.mask.shape == (y2 - y1, x2 - x1) and patch.mask.dtype == np.float32
    assert patch.mask.min() >= 0.0 and patch.mask.max() <= 1.0
    border = np.concatenate([patch.mask[0], patch.mask[-1], patch.mask[:, 0], patch.mask[:, -1]])
    assert np.all(border == 0.0)


def test_frames_without_a_face_or_landmarks_get_no_patch(portrait, portrait_landmarks, loud_window):
    engine = LandmarkEngine(EngineConfig(), FPS)
    box = (150, 60, 300, 200)
    faces = [None, Face(box=box, landmarks=None), Face(box=box, landmarks=portrait_landmarks)]
    patches = engine.generate(make_batch(portrait, None, np.repeat(loud_window[None], 3, axis=0), faces=faces))
    assert patches[0] is None and patches[1] is None
    assert isinstance(patches[2], FacePatch)


def test_patch_covers_the_lower_face_and_its_mask_is_zero_on_the_border(portrait, portrait_landmarks, loud_window):
    for patch in (closed_patch(portrait, portrait_landmarks), held_patch(portrait, portrait_landmarks, loud_window)):
        assert_patch_shape(patch, portrait)
        x1, y1, x2, y2 = patch.box
        assert portrait_landmarks[[145, 374], 1].max() < y1 < portrait_landmarks[0, 1]  # from under the eyes...
        assert y2 > portrait_landmarks[152, 1] + 5  # ... to below the chin
        assert x1 < portrait_landmarks[61, 0] - 10 and x2 > portrait_landmarks[291, 0] + 10  # out to the cheeks
    # A face whose chin touches the frame's edge: the box is clipped and the mask still ends at 0.
    cropped = np.ascontiguousarray(portrait[:int(portrait_landmarks[152, 1]) + 4])
    patch = held_patch(cropped, portrait_landmarks, loud_window)
    assert patch.box[3] == cropped.shape[0]
    assert_patch_shape(patch, cropped)


def test_a_closed_target_closes_an_open_mouth_and_leaves_a_closed_one_untouched(face_mesh, portrait,
                                                                                portrait_landmarks):
    assert lip_gap(portrait_landmarks) > 0.12 * mouth_width(portrait_landmarks)  # she smiles with her teeth showing

    closed = paste(portrait, closed_patch(portrait, portrait_landmarks))
    closed_landmarks = find_landmarks(face_mesh, closed)
    assert lip_gap(closed_landmarks) < 0.07 * mouth_width(closed_landmarks)

    untouched = closed_patch(closed, closed_landmarks)
    assert_patch_shape(untouched, closed)
    x1, y1, x2, y2 = untouched.box
    difference = np.abs(untouched.image_bgr.astype(int) - closed[y1:y2, x1:x2].astype(int))
    assert difference.max() <= 2
    assert untouched.mask.max() == 0.0
    assert np.abs(paste(closed, untouched).astype(int) - closed.astype(int)).max() <= 2


def test_louder_speech_opens_the_mouth_wider_and_shows_a_dark_interior(face_mesh, portrait, portrait_landmarks,
                                                                        loud_window):
    gaps, dark_pixels, results = [], [], []
    for quieter_db in (24.0, 18.0, 12.0, 6.0):  # the loudest vowel, played quieter
        window = np.clip(loud_window - quieter_db * MEL_UNITS_PER_DB, -4.0, 4.0)
        result = paste(portrait, held_patch(portrait, portrait_landmarks, window))
        landmarks = find_landmarks(face_mesh, result)
        results.append((result, landmarks))
        gaps.append(lip_gap(landmarks))
        dark_pixels.append(count_dark_mouth_pixels(result, portrait_landmarks))
    # The face mesh sees the lips part further with each step up to a clear opening...
    assert gaps[0] < gaps[1] < gaps[2] and gaps[2] > gaps[0] + 3.0, gaps
    assert gaps[3] >= gaps[2] - 0.5, gaps
    # ... and the rendered cavity grows with every step.
    assert all(later > earlier for earlier, later in zip(dark_pixels, dark_pixels[1:])), dark_pixels
    assert dark_pixels[-1] > dark_pixels[0] + 80, dark_pixels
    # Inside the lips it is dark now, where her teeth were bright.
    loudest, loudest_landmarks = results[-1]
    assert inner_lip_luma(loudest, loudest_landmarks) < inner_lip_luma(portrait, portrait_landmarks) - 40


def with_neck(image_bgr: np.ndarray, landmarks: np.ndarray) -> np.ndarray:
    """The portrait with bare skin under her jaw (her collar hides her neck): a neck in the chin's
    colour with a soft shadow under the jaw line, as a presenter's neck is lit from above."""
    height, width = image_bgr.shape[:2]
    jaw = landmarks[list(JAW_LINE)]
    jaw = jaw[np.argsort(jaw[:, 0])]
    width_of_mouth = mouth_width(landmarks)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    below_jaw = ys - np.interp(xs, jaw[:, 0], jaw[:, 1])
    neck = ((np.abs(xs - landmarks[152, 0]) < 0.8 * width_of_mouth) & (below_jaw > 0)
            & (below_jaw < 1.5 * width_of_mouth))
    skin = image_bgr[int(landmarks[152, 1]) - 8, int(landmarks[152, 0])].astype(np.float32)
    shade = 1.0 - 0.45 * np.exp(-(((below_jaw - 0.08 * width_of_mouth) / (0.15 * width_of_mouth)) ** 2))
    result = image_bgr.astype(np.float32)
    result[neck] = skin * shade[neck][:, None]
    return np.clip(result, 0, 255).astype(np.uint8)


def under_chin_shadow(image_bgr: np.ndarray, landmarks: np.ndarray) -> tuple[int, float]:
    """(rows, darkest luma) of the shadow under the chin, down the middle of the neck: the rows darker
    than halfway between the darkest and the neck's skin further down."""
    width_of_mouth = mouth_width(landmarks)
    x, y = int(landmarks[152, 0]), int(landmarks[152, 1])
    rows = slice(y - int(0.1 * width_of_mouth), y + int(0.8 * width_of_mouth))
    columns = slice(x - int(0.2 * width_of_mouth), x + int(0.2 * width_of_mouth))
    luma = cv2.cvtColor(image_bgr, cv2.COLOR_BGR2GRAY)[rows, columns].astype(np.float32).mean(axis=1)
    darkest, skin = float(luma.min()), float(np.median(luma[-10:]))
    return int((luma < (darkest + skin) / 2).sum()), darkest


def test_a_wide_opening_leaves_the_shadow_under_the_chin_a_shadow(portrait, portrait_landmarks):
    """The chin drops with the jaw and the skin under it is squeezed, but not into a thin dark line:
    the shadow under her chin keeps most of its height, even at mouth strength 2 on a loud vowel."""
    frame = with_neck(cv2.resize(portrait, (1024, 1024), interpolation=cv2.INTER_CUBIC), portrait_landmarks * 2)
    landmarks = portrait_landmarks * 2
    shadow_rows, shadow_darkest = under_chin_shadow(frame, landmarks)
    assert shadow_rows >= 15, shadow_rows
    for openness in (1.0, 2.0):
        patch = animate_mouth(frame, landmarks, openness, 0.0)
        opened = frame.copy()
        blend_patch(opened, patch, BlendConfig())
        rows, darkest = under_chin_shadow(opened, landmarks)
        assert rows >= 0.68 * shadow_rows, (openness, rows, shadow_rows)
        assert darkest >= shadow_darkest - 3, (openness, darkest, shadow_darkest)
        assert count_dark_mouth_pixels(opened, landmarks) > count_dark_mouth_pixels(frame, landmarks) + 300  # wide open


def test_pixels_outside_the_mask_are_unchanged(portrait, portrait_landmarks, loud_window):
    patch = held_patch(portrait, portrait_landmarks, loud_window)
    x1, y1, x2, y2 = patch.box
    outside = patch.mask == 0.0
    assert outside.any() and (patch.mask == 1.0).any()
    assert np.array_equal(patch.image_bgr[outside], portrait[y1:y2, x1:x2][outside])
    changed = np.abs(paste(portrait, patch).astype(int) - portrait.astype(int)).max(axis=2) > 0
    rows, columns = np.nonzero(changed)
    assert rows.min() >= y1 and rows.max() < y2 and columns.min() >= x1 and columns.max() < x2
    assert rows.min() > portrait_landmarks[1, 1] - 1  # the nose tip and everything above it are untouched


def test_a_tilted_face_opens_along_its_own_axis(face_mesh, portrait, portrait_landmarks, loud_window):
    rotation = cv2.getRotationMatrix2D((256.0, 256.0), 20.0, 1.0)  # (2, 3)
    tilted = cv2.warpAffine(portrait, rotation, (512, 512), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REFLECT)
    landmarks = find_landmarks(face_mesh, tilted)
    closed = find_landmarks(face_mesh, paste(tilted, closed_patch(tilted, landmarks)))
    patch = held_patch(tilted, landmarks, loud_window)
    assert_patch_shape(patch, tilted)
    opened = find_landmarks(face_mesh, paste(tilted, patch))
    assert lip_gap(opened) > lip_gap(closed) + 4.0


def test_two_engines_give_identical_results(portrait, portrait_landmarks, speech_mel):
    windows = speech_windows(speech_mel, 12, first_frame=8)
    first = LandmarkEngine(EngineConfig(), FPS).generate(make_batch(portrait, portrait_landmarks, windows))
    second = LandmarkEngine(EngineConfig(), FPS).generate(make_batch(portrait, portrait_landmarks, windows))
    for a, b in zip(first, second):
        assert a.box == b.box and np.array_equal(a.image_bgr, b.image_bgr) and np.array_equal(a.mask, b.mask)


def test_a_batch_split_in_two_gives_the_same_frames(portrait, portrait_landmarks, speech_mel):
    windows = speech_windows(speech_mel, 20, first_frame=30)
    whole = LandmarkEngine(EngineConfig(), FPS).generate(make_batch(portrait, portrait_landmarks, windows))
    engine = LandmarkEngine(EngineConfig(), FPS)
    split = (engine.generate(make_batch(portrait, portrait_landmarks, windows[:7]))
             + engine.generate(make_batch(portrait, portrait_landmarks, windows[7:], first_index=7)))
    assert len(split) == len(whole)
    for a, b in zip(whole, split):
        assert a.box == b.box and np.array_equal(a.image_bgr, b.image_bgr) and np.array_equal(a.mask, b.mask)
    # The speech really moved the mouth over these frames.
    assert len({patch.image_bgr.tobytes() for patch in whole}) > 5


def test_mouth_strength_scales_the_opening(portrait, portrait_landmarks, loud_window):
    dark_pixels = []
    for strength in (0.4, 1.0, 1.5):
        engine = LandmarkEngine(EngineConfig(mouth_strength=strength), FPS)
        patch = engine.generate(make_batch(portrait, portrait_landmarks, np.repeat(loud_window[None], 6, axis=0)))[-1]
        dark_pixels.append(count_dark_mouth_pixels(paste(portrait, patch), portrait_landmarks))
    assert dark_pixels[0] < dark_pixels[1] < dark_pixels[2], dark_pixels


def test_mouth_shapes_follow_loudness_closure_and_vowels(speech_mel):
    tracker = MouthShapeTracker(FPS)
    silence = tracker.update(np.repeat(SILENT_WINDOW[None], 4, axis=0))
    assert np.all(silence.openness == 0.0) and np.all(silence.width == 0.0) and np.all(silence.speaking == 0.0)

    shapes = MouthShapeTracker(FPS).update(speech_windows(speech_mel, int(speech_mel.shape[1] * FPS / 80) - 1))
    assert shapes.openness.max() > 0.8
    assert 0.2 < (shapes.openness > 0.05).mean() < 0.9  # it talks, and it pauses
    pause = slice(int(2.4 * FPS), int(3.0 * FPS))  # the sample's 0.9 s break after "welcome to hey gem"
    assert np.all(shapes.openness[pause] == 0.0)
    assert shapes.width.min() < -0.2 and shapes.width.max() > 0.4  # rounded and spread vowels both occur


def test_the_speech_lets_go_of_the_mouth_in_its_pauses_only(speech_mel):
    """``speaking`` is 1 while the sample speaks, 0 in its 0.9 s pause (2.2 s to 3.1 s) from a few
    frames after the last word to the next, with a few frames of handover either side; a short break
    between words keeps it at 1."""
    shapes = MouthShapeTracker(FPS).update(speech_windows(speech_mel, int(4.0 * FPS)))
    speaking = shapes.speaking
    assert np.all(speaking[int(1.0 * FPS):int(2.2 * FPS)] == 1.0)  # words and the breaks between them
    assert np.all(speaking[int(2.5 * FPS):int(3.05 * FPS)] == 0.0)  # the pause, up to the next word
    assert np.all(speaking[int(3.25 * FPS):] == 1.0)  # the next words
    handover = np.flatnonzero((speaking > 0.0) & (speaking < 1.0))
    assert 4 <= len(handover) <= 10, handover
    assert np.all(np.abs(np.diff(speaking)) <= 0.35)  # no jump from one mouth to the other
    # where the speech lets go, nothing is drawn: the engine gives those frames no patch
    engine = LandmarkEngine(EngineConfig(), FPS)
    windows = speech_windows(speech_mel, int(3.0 * FPS))
    face = Face(box=(0, 0, 512, 512), landmarks=np.zeros((468, 2), np.float32))
    jobs = engine.mouth_jobs([face] * len(windows), windows)
    drawn = {index for index, *_ in jobs}
    assert drawn.isdisjoint(range(int(2.55 * FPS), int(2.85 * FPS)))
    assert set(range(int(1.0 * FPS), int(2.2 * FPS))) <= drawn


# ---------------------------------------------------------------------------- rendering processes


@pytest.fixture(scope="module")
def talking_sequence(face_mesh, portrait, portrait_landmarks, speech_mel):
    """Two batches of frames in which the source alternates between the portrait (teeth showing),
    her closed-mouth version (no teeth) and the portrait in a warmer light (yellower teeth), with
    one frame without a face, over speech that opens and closes the mouth: the remembered teeth
    colour changes along the way."""
    closed = paste(portrait, closed_patch(portrait, portrait_landmarks))
    closed_landmarks = find_landmarks(face_mesh, closed)
    warmer = np.clip(portrait * np.array([0.7, 0.9, 1.0]), 0, 255).astype(np.uint8)
    sources = ([(portrait, portrait_landmarks)] * 5 + [(closed, closed_landmarks)] * 6
               + [(warmer, portrait_landmarks)] * 3 + [(closed, closed_landmarks)] * 4) * 2  # 36 frames
    windows = speech_windows(speech_mel, len(sources), first_frame=20)
    frames = np.stack([frame for frame, _ in sources])
    faces = [Face(box=(0, 0, 512, 512), landmarks=landmarks) for _, landmarks in sources]
    faces[9] = None
    batches = []
    for start, stop in ((0, 20), (20, len(sources))):
        batches.append(EngineBatch(frame_indices=np.arange(start, stop, dtype=np.int64), frames_bgr=frames[start:stop],
                                   faces=faces[start:stop], mel_windows=windows[start:stop], fps=FPS))
    return batches


def generate_all(engine: LandmarkEngine, batches: list[EngineBatch]) -> list[FacePatch | None]:
    try:
        return [patch for batch in batches for patch in engine.generate(batch)]
    finally:
        engine.close()


def assert_same_patches(first: list, second: list) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.box == b.box and a.face is b.face
            assert np.array_equal(a.image_bgr, b.image_bgr) and np.array_equal(a.mask, b.mask)
            assert a.mask.dtype == b.mask.dtype == np.float32


def child_pids() -> set[int]:
    import multiprocessing

    return {process.pid for process in multiprocessing.active_children()}


def test_rendering_processes_give_the_same_bytes_as_the_calling_thread(talking_sequence):
    inline_engine = LandmarkEngine(EngineConfig(), FPS, workers=0)
    inline = generate_all(inline_engine, talking_sequence)
    pooled = generate_all(LandmarkEngine(EngineConfig(), FPS, workers=2), talking_sequence)
    assert_same_patches(inline, pooled)
    # A frame whose warp would read outside the region sent out is warped here instead (a region
    # smaller than the patch box forces that for every frame): still the same bytes.
    engine = LandmarkEngine(EngineConfig(), FPS, workers=2)
    engine.region_margin = -0.3
    assert_same_patches(inline, generate_all(engine, talking_sequence))

    # The sequence exercises the state: the mouth opens and closes, frames with and without a
    # source opening draw interiors, and the second batch depends on the teeth seen in the first.
    assert inline[9] is None
    assert len({patch.image_bgr.tobytes() for patch in inline if patch is not None}) > 20
    assert inline_engine.teeth.bgr is not None
    fresh = LandmarkEngine(EngineConfig(), FPS)
    fresh.shapes = MouthShapeTracker(FPS)
    fresh.shapes.update(talking_sequence[0].mel_windows)  # the same mouth shapes, but no teeth seen yet
    second_alone = fresh.generate(talking_sequence[1])
    assert any(not np.array_equal(a.image_bgr, b.image_bgr) for a, b in zip(inline[20:], second_alone))


def test_close_stops_every_rendering_process(talking_sequence):
    before = child_pids()
    engine = LandmarkEngine(EngineConfig(), FPS, workers=2)
    engine.generate(talking_sequence[0])
    started = child_pids() - before
    assert len(started) == 2
    engine.close()
    engine.close()  # a second close does nothing
    assert not child_pids() & started
    assert not any(Path(f"/proc/{pid}").exists() for pid in started)

    # An engine dropped without close() stops its processes when it is collected.
    import gc

    engine = LandmarkEngine(EngineConfig(), FPS, workers=2)
    engine.generate(talking_sequence[0])
    started = child_pids() - before
    assert len(started) == 2
    del engine
    gc.collect()
    assert not child_pids() & started


def test_a_failure_in_a_rendering_process_is_raised_by_generate(talking_sequence):
    from heygem.engines.landmark.processes import LandmarkWorkerError

    batch = talking_sequence[0]
    four_channels = EngineBatch(frame_indices=batch.frame_indices, faces=batch.faces, mel_windows=batch.mel_windows,
                                fps=FPS,
                                frames_bgr=np.concatenate([batch.frames_bgr, batch.frames_bgr[..., :1]], axis=3))
    with pytest.raises(ValueError) as inline_error:
        LandmarkEngine(EngineConfig(), FPS).generate(four_channels)
    before = child_pids()
    engine = LandmarkEngine(EngineConfig(), FPS, workers=2)
    with pytest.raises(LandmarkWorkerError) as pooled_error:
        engine.generate(four_channels)
    assert f"ValueError: {inline_error.value}" in str(pooled_error.value)
    assert not child_pids() - before  # the failed processes were stopped
    # The engine starts afresh on the next batch.
    assert all(patch is not None for patch in engine.generate(talking_sequence[1])[:5])
    # A process that dies is reported, not waited for.
    engine._pool.processes[1].kill()
    with pytest.raises(LandmarkWorkerError, match="exited unexpectedly|is gone"):
        engine.generate(talking_sequence[0])
    engine.close()
    assert not child_pids() - before


# ---------------------------------------------------------------------------- finished I420 windows


def test_even_aligned_i420_windows_convert_as_the_whole_frame_does():
    rng = np.random.default_rng(7)
    frame_i420 = rng.integers(0, 256, (72 * 3 // 2, 96), dtype=np.uint8)  # a 96 x 72 frame of noise
    frame_bgr = cv2.cvtColor(frame_i420, cv2.COLOR_YUV2BGR_I420)
    noise_bgr = rng.integers(0, 256, (72, 96, 3), dtype=np.uint8)
    whole_i420 = cv2.cvtColor(noise_bgr, cv2.COLOR_BGR2YUV_I420)
    for box in [(0, 0, 96, 72), (0, 0, 10, 8), (2, 4, 30, 20), (40, 30, 96, 72), (86, 0, 96, 72), (18, 62, 64, 72)]:
        x1, y1, x2, y2 = box
        window = cut_i420_window(frame_i420, box)
        assert window.shape == ((y2 - y1) * 3 // 2, x2 - x1)
        assert np.array_equal(cv2.cvtColor(window, cv2.COLOR_YUV2BGR_I420), frame_bgr[y1:y2, x1:x2])
        # and back: the window's I420 is the whole frame's I420 in that box
        back = i420_planes(cv2.cvtColor(np.ascontiguousarray(noise_bgr[y1:y2, x1:x2]), cv2.COLOR_BGR2YUV_I420))
        for window_plane, whole_plane, scale in zip(back, i420_planes(whole_i420), (1, 2, 2)):
            assert np.array_equal(window_plane, whole_plane[y1 // scale:y2 // scale, x1 // scale:x2 // scale])
    # An odd-aligned window splits 2x2 chroma blocks: its conversion is not the frame's.
    odd = np.ascontiguousarray(noise_bgr[1:21, 1:31])
    assert not np.array_equal(cv2.cvtColor(odd, cv2.COLOR_BGR2YUV_I420)[20:],
                              cut_i420_window(whole_i420, (0, 0, 30, 20))[20:])


def test_i420_windows_cut_and_paste_only_their_box():
    rng = np.random.default_rng(3)
    frame = rng.integers(0, 256, (48 * 3 // 2, 64), dtype=np.uint8)
    other = rng.integers(0, 256, frame.shape, dtype=np.uint8)
    box = (6, 10, 26, 40)
    pasted = frame.copy()
    paste_i420_window(pasted, box, cut_i420_window(other, box))
    frame_bgr, pasted_bgr, other_bgr = (cv2.cvtColor(image, cv2.COLOR_YUV2BGR_I420) for image in (frame, pasted, other))
    inside = np.zeros((48, 64), bool)
    inside[10:40, 6:26] = True
    assert np.array_equal(pasted_bgr[inside], other_bgr[inside])
    assert np.array_equal(pasted_bgr[~inside], frame_bgr[~inside])
    paste_i420_window(pasted, box, cut_i420_window(frame, box))
    assert np.array_equal(pasted, frame)
    assert even_box((5, 9, 25, 39), 64, 48) == (4, 8, 26, 40)
    assert even_box((1, 1, 63, 47), 64, 48) == (0, 0, 64, 48)
    with pytest.raises(ValueError, match="even"):
        cut_i420_window(frame, (5, 10, 26, 40))
    with pytest.raises(ValueError, match="does not fit"):
        paste_i420_window(frame, box, np.zeros((30, 20), np.uint8))


def whole_frame_render(batches: list[EngineBatch], frames_i420: np.ndarray, blend: BlendConfig) -> np.ndarray:
    """What the CPU render path did before the engine blended windows itself: every frame to BGR,
    the engine's patches blended into the whole frames, the patch boxes written back as I420."""
    result = frames_i420.copy()
    engine = LandmarkEngine(EngineConfig(), FPS)
    for batch in batches:
        frames_bgr = i420_batch_to_bgr(result[batch.frame_indices])
        for row, patch in enumerate(engine.generate(EngineBatch(
                frame_indices=batch.frame_indices, frames_bgr=frames_bgr, faces=batch.faces,
                mel_windows=batch.mel_windows, fps=FPS))):
            if patch is not None:
                blend_patch(frames_bgr[row], patch, blend)
                write_region_i420(result[batch.frame_indices[row]], frames_bgr[row], patch.box)
    return result


def window_render(engine: LandmarkEngine, batches: list[EngineBatch], frames_i420: np.ndarray,
                  blend: BlendConfig) -> tuple[np.ndarray, list]:
    """The frames with the engine's finished I420 windows pasted in, as the blend stage does, and the windows."""
    result, windows = frames_i420.copy(), []
    try:
        for batch in batches:
            decoded = frames_i420[batch.frame_indices]
            batch_windows = engine.generate_i420(decoded, batch.faces, batch.mel_windows, blend)
            assert np.array_equal(decoded, frames_i420[batch.frame_indices])  # the input is left alone
            for row, window in zip(batch.frame_indices, batch_windows):
                if window is not None:
                    paste_i420_window(result[row], window.box, window.planes)
            windows.extend(batch_windows)
    finally:
        engine.close()
    return result, windows


def stream_render(engine: LandmarkEngine, batches: list[EngineBatch], frames_i420: np.ndarray,
                  blend: BlendConfig) -> np.ndarray:
    """window_render through generate_i420_stream: the batches overlapping in the processes."""
    result = frames_i420.copy()
    inputs = ((frames_i420[batch.frame_indices], batch.faces, batch.mel_windows) for batch in batches)
    try:
        stream = engine.generate_i420_stream(inputs, blend)
        for batch, batch_windows in zip(batches, stream, strict=True):
            for row, window in zip(batch.frame_indices, batch_windows):
                if window is not None:
                    paste_i420_window(result[row], window.box, window.planes)
    finally:
        engine.close()
    return result


def rebatched(batches: list[EngineBatch], size: int) -> list[EngineBatch]:
    """The same frames in batches of ``size``."""
    frames = np.concatenate([batch.frames_bgr for batch in batches])
    faces = [face for batch in batches for face in batch.faces]
    windows = np.concatenate([batch.mel_windows for batch in batches])
    return [EngineBatch(frame_indices=np.arange(start, min(start + size, len(faces)), dtype=np.int64),
                        frames_bgr=frames[start:start + size], faces=faces[start:start + size],
                        mel_windows=windows[start:start + size], fps=FPS)
            for start in range(0, len(faces), size)]


def test_a_stream_of_batches_gives_the_bytes_of_one_batch_at_a_time(talking_sequence):
    frames_i420 = np.stack([bgr_to_yuv420(frame) for batch in talking_sequence for frame in batch.frames_bgr])
    talking_sequence = rebatched(talking_sequence, 7)  # 6 batches: the stream's steady state, and a short last one
    blend = BlendConfig()
    expected, _ = window_render(LandmarkEngine(EngineConfig(), FPS), talking_sequence, frames_i420, blend)
    for workers in (0, 2, 3):
        assert np.array_equal(stream_render(LandmarkEngine(EngineConfig(), FPS, workers=workers), talking_sequence,
                                            frames_i420, blend), expected), workers
    # a batch with too few faces for the processes lands the one in flight first, then is drawn here
    few = [dataclasses.replace(batch, faces=[batch.faces[0]] + [None] * (len(batch.faces) - 1))
           if position == 2 else batch for position, batch in enumerate(talking_sequence)]
    few_expected, _ = window_render(LandmarkEngine(EngineConfig(), FPS), few, frames_i420, blend)
    assert np.array_equal(stream_render(LandmarkEngine(EngineConfig(), FPS, workers=2), few, frames_i420, blend),
                          few_expected)
    # windows too small for the warp: warped again with the whole frame, here
    engine = LandmarkEngine(EngineConfig(), FPS, workers=2)
    engine.region_margin = -0.3
    assert np.array_equal(stream_render(engine, talking_sequence, frames_i420, blend), expected)


def test_a_stream_stopped_early_stops_its_processes(talking_sequence):
    frames_i420 = np.stack([bgr_to_yuv420(frame) for batch in talking_sequence for frame in batch.frames_bgr])
    engine = LandmarkEngine(EngineConfig(), FPS, workers=2)
    inputs = ((frames_i420[batch.frame_indices], batch.faces, batch.mel_windows)
              for batch in rebatched(talking_sequence, 7))
    stream = engine.generate_i420_stream(inputs, BlendConfig())
    next(stream)  # the second batch is in the processes now
    processes = list(engine._pool.processes)
    stream.close()
    assert engine._pool is None and not any(process.is_alive() for process in processes)


def test_finished_i420_windows_are_the_patches_mixed_into_the_decoded_bytes(talking_sequence):
    """The windows, drawn here or in processes, and warped again with the whole frame where theirs is
    too small, are the same bytes; they look as blending the patches into whole BGR frames does (the
    mix is made in I420, so that bytes under a zero mask stay as decoded)."""
    frames_i420 = np.stack([bgr_to_yuv420(frame) for batch in talking_sequence for frame in batch.frames_bgr])
    blend = BlendConfig()
    expected = whole_frame_render(talking_sequence, frames_i420, blend)
    inline, windows = window_render(LandmarkEngine(EngineConfig(), FPS), talking_sequence, frames_i420, blend)
    difference = np.abs(i420_batch_to_bgr(inline).astype(int) - i420_batch_to_bgr(expected).astype(int))
    assert difference.mean() < 0.05 and np.percentile(difference, 99.9) <= 4, (difference.mean(), difference.max())
    pooled, pooled_windows = window_render(LandmarkEngine(EngineConfig(), FPS, workers=2), talking_sequence,
                                           frames_i420, blend)
    assert np.array_equal(pooled, inline)
    # Windows too small for the warp are warped again with the whole frame, here or in the processes.
    for workers in (0, 2):
        engine = LandmarkEngine(EngineConfig(), FPS, workers=workers)
        engine.region_margin = -0.3
        assert np.array_equal(window_render(engine, talking_sequence, frames_i420, blend)[0], inline)

    assert windows[9] is None and np.array_equal(inline[9], frames_i420[9])  # no face: decoded bytes kept
    changed = [row for row in range(len(frames_i420)) if not np.array_equal(inline[row], frames_i420[row])]
    assert len(changed) > 20
    for window, pooled_window in zip(windows, pooled_windows):
        assert (window is None) == (pooled_window is None)
        if window is not None:
            assert window.box == pooled_window.box and all(value % 2 == 0 for value in window.box)
            assert window.planes.shape == ((window.box[3] - window.box[1]) * 3 // 2, window.box[2] - window.box[0])
            assert np.array_equal(window.planes, pooled_window.planes)
    # the frames outside the windows keep their decoded bytes
    for row, window in enumerate(windows):
        if window is not None:
            outside = frames_i420[row].copy()
            paste_i420_window(outside, window.box, window.planes)
            assert np.array_equal(outside, inline[row])

    # The blend options reach the processes: without colour matching the bytes differ, and still agree.
    plain = BlendConfig(color_match=False)
    plain_inline = window_render(LandmarkEngine(EngineConfig(), FPS), talking_sequence[:1], frames_i420, plain)[0]
    assert not np.array_equal(plain_inline, inline)
    pooled_engine = LandmarkEngine(EngineConfig(), FPS, workers=2)
    assert np.array_equal(window_render(pooled_engine, talking_sequence[:1], frames_i420, plain)[0], plain_inline)


def test_remap_bgr_gives_the_bytes_of_a_three_channel_remap():
    """The BGRA remap of the part the maps read equals cv2.remap on the whole BGR image, inside
    the image, across its edges (replicated border) and entirely outside it."""
    from heygem.engines.landmark.drawing import remap_bgr

    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (90, 140, 3), np.uint8)
    rows, columns = np.mgrid[0:40, 0:60].astype(np.float32)
    maps = [
        (columns + 30 + rng.normal(0, 3, rows.shape), rows + 20 + rng.normal(0, 3, rows.shape)),  # inside, smooth
        (columns * 2.5 - 8, rows * 2.4 - 6),  # across every edge
        (np.round((columns + 100.3) * 4) / 4, np.round((rows + 60.7) * 4) / 4),  # right and bottom edges, quarters
        (rng.uniform(-10, 150, rows.shape), rng.uniform(-10, 100, rows.shape)),  # scattered
        (columns - 200.5, rows - 100.25),  # only the border
    ]
    for map_x, map_y in maps:
        map_x, map_y = map_x.astype(np.float32), map_y.astype(np.float32)
        expected = cv2.remap(image, map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
        warped = remap_bgr(image, map_x, map_y)
        assert warped.shape == (40, 60, 3) and warped.dtype == np.uint8
        assert np.array_equal(warped, expected)


def _blend_as_written(frame_bgr: np.ndarray, patch: FacePatch, color_match: bool) -> np.ndarray:
    """blend_patch's formula on (h, w, 3) arrays, numpy's float32 means of the edge pixels included."""
    x1, y1, x2, y2 = patch.box
    frame = frame_bgr.copy()
    region = frame[y1:y2, x1:x2]
    new_pixels = patch.image_bgr.astype(np.float32)
    edge = (patch.mask > 0.02) & (patch.mask < 0.7)
    if color_match and edge.sum() >= 16:
        new_pixels = new_pixels + (region[edge].astype(np.float32).mean(axis=0) - new_pixels[edge].mean(axis=0))
    alpha = patch.mask[:, :, None]
    region[...] = np.clip(np.rint(region.astype(np.float32) * (1.0 - alpha) + new_pixels * alpha),
                          0, 255).astype(np.uint8)
    return frame


@pytest.mark.parametrize("color_match", [True, False])
def test_blend_patch_gives_the_bytes_of_its_formula_on_whole_arrays(color_match):
    """Blending plane by plane with the edge means from exact sums changes no byte: soft masks,
    a float64 mask, an edge too small to match colours, and sums too large for exact float32
    (where the pixels are averaged as numpy does)."""
    rng = np.random.default_rng(5)
    frame = rng.integers(0, 256, (120, 160, 3), np.uint8)
    rows, columns = np.mgrid[0:60, 0:80]
    soft = np.clip(1.2 - np.hypot(rows - 30, columns - 40) / 30, 0, 1).astype(np.float32)
    cases = [
        ((10, 20, 90, 80), rng.integers(0, 256, (60, 80, 3), np.uint8), soft),
        ((10, 20, 90, 80), rng.integers(0, 256, (60, 80, 3), np.uint8), rng.random((60, 80))),  # float64
        ((10, 20, 90, 80), rng.integers(0, 256, (60, 80, 3), np.uint8), (soft > 0.99).astype(np.float32)),  # no edge
    ]
    bright = np.full((120, 160, 3), 250, np.uint8)  # edge sums of 250 * 19200 > 2^24
    cases.append(((0, 0, 160, 120), bright, np.full((120, 160), 0.5, np.float32)))
    for box, image, mask in cases:
        patch = FacePatch(box=box, image_bgr=image, mask=mask)
        blended = frame.copy()
        blend_patch(blended, patch, BlendConfig(color_match=color_match))
        expected = _blend_as_written(frame, patch, color_match)
        assert np.array_equal(blended, expected)
        assert not np.array_equal(blended, frame)


def test_blend_patch_of_an_empty_box_changes_nothing():
    frame = np.full((10, 12, 3), 7, np.uint8)
    patch = FacePatch(box=(3, 2, 3, 8), image_bgr=np.zeros((6, 0, 3), np.uint8), mask=np.zeros((6, 0), np.float32))
    blend_patch(frame, patch, BlendConfig())
    assert np.array_equal(frame, np.full((10, 12, 3), 7, np.uint8))


# ---------------------------------------------------------------------------- pauses


@pytest.fixture(scope="module")
def pause_inputs(tmp_path_factory, face_photo, speech_wav):
    """A 4 s video of the portrait drifting slowly (her teeth showing in a smile), the English
    sample's first 4 s (speech, its 0.9 s pause from 2.2 s on, speech again from 3.1 s) and 4 s
    of silence."""
    folder = tmp_path_factory.mktemp("pause")
    video, speech = folder / "smiling presenter.mp4", folder / "speech with a pause.wav"
    silence = folder / "silence.wav"
    run_ffmpeg("-loop", "1", "-i", str(face_photo), "-vf",
               "scale=330:250,crop=320:240:x='4+4*sin(t*3)':y='4+3*cos(t*2)',format=yuv420p",
               "-r", "25", "-t", "4", "-c:v", "libx264", "-preset", "ultrafast", str(video))
    run_ffmpeg("-i", str(speech_wav), "-t", "4", str(speech))
    run_ffmpeg("-f", "lavfi", "-i", "anullsrc=r=16000:cl=mono", "-t", "4", str(silence))
    return video, speech, silence


@pytest.mark.parametrize("render", ["numpy", "torch"])
def test_a_video_face_keeps_its_own_mouth_in_a_pause(tmp_path, pause_inputs, render):
    """In the middle of a pause the frames are the presenter's own (her smile, not lips pressed shut):
    the bytes of a render of silence, which shows the video as filmed; where she speaks the mouth is
    drawn; around the pause the handover takes a few frames."""
    video, speech, silence = pause_inputs
    options = {"run.avatar_cache": False, "engine.name": "landmark", "engine.device": "cpu", "media.crf": 0,
               "run.render": render}
    summary = generate(video, speech, tmp_path / "speech.mp4", overrides=options)
    generate(video, silence, tmp_path / "silence.mp4", overrides=options)
    spoken = decode_frames(tmp_path / "speech.mp4").astype(int)
    kept = decode_frames(tmp_path / "silence.mp4").astype(int)
    source = decode_frames(video).astype(int)
    assert len(spoken) == len(kept) == len(source) == summary.frames == 100
    # silence shows the video as filmed: within the colour conversions' rounding everywhere
    assert np.abs(kept - source).max() <= 4
    difference = np.abs(spoken - kept).max(axis=3)  # (N, H, W)

    silent = set(silent_frames(speech, 25.0).tolist())
    deep_in_pause = [index for index in range(len(spoken))
                     if all(near in silent for near in range(index - 10, index + 6))]
    assert len(deep_in_pause) >= 5, sorted(silent)
    assert all(64 <= index <= 78 for index in deep_in_pause), deep_in_pause
    for index in deep_in_pause:
        assert difference[index].max() == 0, (index, difference[index].max())
    speaking = [index for index in range(len(spoken)) if index not in silent and 10 <= index < 50]
    moved = [int((difference[index] > 20).sum()) for index in speaking]
    assert np.mean(moved) > 50, moved
