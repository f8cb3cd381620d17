"""GFPGAN restoration of the generated lower face: alignment, the mask it is limited to, the
numpy and torch paths, the --restorer choice and a short end-to-end run.

GFPGAN costs about 400 GFLOP per face (4 s on two cores), so only three tests run the
random-init network; the others run the same plumbing around a cheap stand-in network.
"""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from conftest import ASSETS, assert_playable_mp4, decode_frames, run_ffmpeg

from heygem.config import BlendConfig, Config, FaceConfig, RestoreConfig
from heygem.engines.wav2lip.engine import resize_to_box
from heygem.errors import HeygemError
from heygem.models.gfpgan import GFPGANClean
from heygem.render import gpu_blend
from heygem.render.blend import blend_patch
from heygem.render.gfpgan import (
    FFHQ_TEMPLATE_512,
    GfpganRestorer,
    alignment_matrices,
    crop_footprints,
    even_batch_size,
    five_points,
    invert_affine,
    restore_masks,
    restore_patches_gfpgan,
    warp_images,
)
from heygem.render.restore import Restoration, choose_restorer, restore_patches
from heygem.types import Face, FacePatch

BLEND = BlendConfig()


class ColourNegative(torch.nn.Module):
    """A stand-in restorer network: RGB in [-1, 1] -> its negative, so every restored pixel changes."""

    def forward(self, faces: torch.Tensor) -> torch.Tensor:
        return -faces


@pytest.fixture(scope="module")
def portrait() -> np.ndarray:
    return cv2.imread(str(ASSETS / "astronaut.jpg"))  # (512, 512, 3) uint8 BGR


@pytest.fixture(scope="module")
def portrait_face(portrait) -> Face:
    """The portrait's face with its face-mesh landmarks, as the face stage tracks it."""
    from heygem.face.finder import FaceFinder

    with FaceFinder(FaceConfig(), still_images=True) as finder:
        landmarks = finder.find(portrait)
    assert landmarks is not None
    x1, y1 = np.floor(landmarks.min(axis=0)).astype(int) - 10
    x2, y2 = np.ceil(landmarks.max(axis=0)).astype(int) + 10
    return Face(box=(int(x1), int(y1), int(x2), int(y2)), landmarks=landmarks.astype(np.float32))


@pytest.fixture(scope="module")
def generated_patch(portrait, portrait_face) -> FacePatch:
    """What a generator returns for the portrait: its box with a brighter, noisy lower half (96x96 scaled up)."""
    x1, y1, x2, y2 = portrait_face.box
    crop = cv2.resize(portrait[y1:y2, x1:x2], (96, 96), interpolation=cv2.INTER_AREA).astype(np.int16)
    rng = np.random.default_rng(3)
    crop[48:] += 40 + rng.integers(-20, 20, crop[48:].shape)
    image = resize_to_box(np.clip(crop, 0, 255).astype(np.uint8), portrait_face.box)
    return FacePatch(box=portrait_face.box, image_bgr=image, face=portrait_face)


@pytest.fixture(scope="module")
def random_gfpgan() -> GFPGANClean:
    torch.manual_seed(0)
    return GFPGANClean().eval()


def pasted(frame: np.ndarray, patch: FacePatch) -> np.ndarray:
    """The frame with the patch blended in as the blend stage does."""
    result = frame.copy()
    blend_patch(result, patch, BLEND)
    return result


# --- alignment ------------------------------------------------------------------------------------


def test_the_restorer_splits_the_pipelines_batch_into_equal_passes():
    # at 1080p the pipeline's batches are 21 frames: passes of 7, not 8 + 8 + 5 padded to 24 on a GPU
    assert [even_batch_size(count, 8) for count in (21, 32, 5, 17, 8, 9, 0)] == [7, 8, 5, 6, 8, 5, 8]
    seen = []

    class Recording(ColourNegative):
        def forward(self, faces):
            seen.append(len(faces))
            return super().forward(faces)

    restorer = GfpganRestorer(Recording(), "cpu", batch_size=8)
    faces = torch.rand(21, 3, 16, 16) * 255
    restored = restorer.restore_faces(faces)
    assert seen == [7, 7, 7]
    torch.testing.assert_close(restored, 255.0 - faces, atol=1e-3, rtol=0)  # the negative, in 0..255


def test_alignment_maps_the_five_points_onto_the_template():
    # landmarks whose five points are the template turned 12 degrees, scaled by 0.4 and moved
    angle, scale = np.deg2rad(12.0), 0.4
    rotation = scale * np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    wanted = FFHQ_TEMPLATE_512 @ rotation.T + [300.0, 170.0]  # (5, 2) frame pixels
    rng = np.random.default_rng(0)
    landmarks = rng.uniform(0, 640, (468, 2))
    from heygem.render.gfpgan import IMAGE_LEFT_EYE_POINTS, IMAGE_RIGHT_EYE_POINTS, MOUTH_CORNER_POINTS, NOSE_TIP_POINT

    for index, points in ((0, IMAGE_LEFT_EYE_POINTS), (1, IMAGE_RIGHT_EYE_POINTS)):
        ring = rng.normal(0, 6, (len(points), 2))
        landmarks[points] = wanted[index] + ring - ring.mean(axis=0)  # the ring's centre is the eye
    landmarks[NOSE_TIP_POINT] = wanted[2]
    landmarks[list(MOUTH_CORNER_POINTS)] = wanted[3:]
    np.testing.assert_allclose(five_points(landmarks), wanted, atol=1e-9)

    matrix = alignment_matrices(landmarks[None])[0]  # (2, 3)
    mapped = np.c_[wanted, np.ones(5)] @ matrix.T
    assert np.abs(mapped - FFHQ_TEMPLATE_512).max() < 1.0
    np.testing.assert_allclose(matrix[:, :2], np.linalg.inv(rotation), atol=1e-9)
    np.testing.assert_allclose(invert_affine(matrix[None])[0][:, :2], rotation, atol=1e-9)


def test_a_real_face_aligns_close_to_the_template_and_both_warps_agree(portrait, portrait_face):
    matrix = alignment_matrices(portrait_face.landmarks[None])  # (1, 2, 3)
    mapped = np.c_[five_points(portrait_face.landmarks), np.ones(5)] @ matrix[0].T
    assert np.hypot(*(mapped - FFHQ_TEMPLATE_512).T).max() < 25  # a real face is close to a similarity of it
    aligned_cv2 = cv2.warpAffine(portrait, matrix[0], (512, 512), flags=cv2.INTER_LINEAR,
                                 borderMode=cv2.BORDER_REPLICATE).astype(np.float32)
    image = torch.from_numpy(portrait).permute(2, 0, 1)[None].float()
    aligned_torch = warp_images(image, invert_affine(matrix), 512, 512, "border")[0].permute(1, 2, 0).numpy()
    difference = np.abs(aligned_torch - aligned_cv2)
    assert difference.mean() < 0.3 and np.percentile(difference, 99.9) < 4, (difference.mean(), difference.max())
    footprint = crop_footprints(matrix, 512, 512)[0]
    assert footprint[0] >= 0 and footprint[1] >= 0 and footprint[2] <= 512 and footprint[3] <= 512
    x1, y1, x2, y2 = portrait_face.box
    assert footprint[0] <= x1 and footprint[1] <= y1 and footprint[2] >= x2 and footprint[3] >= y2


# --- the CPU path ---------------------------------------------------------------------------------


def test_only_the_lower_face_mask_changes_and_strength_scales_it(portrait, portrait_face, generated_patch):
    restorer = GfpganRestorer(ColourNegative(), "cpu")
    frames = portrait[None]
    reference = pasted(portrait, generated_patch)
    (restored,) = restore_patches_gfpgan(restorer, [generated_patch], frames, 1.0, BLEND)
    x1, y1, x2, y2 = generated_patch.box
    before = reference[y1:y2, x1:x2].astype(int)
    after = restored.image_bgr.astype(int)
    mask = restore_masks(np.array([[0, 0, x2 - x1, y2 - y1]]),
                         (portrait_face.landmarks - [x1, y1])[None], BLEND.feather, y2 - y1, x2 - x1)[0]
    assert np.array_equal(after[mask == 0], before[mask == 0])  # bit-identical outside the mask
    inner = mask > 0.9
    assert inner.sum() > 1000 and np.abs(after - before)[inner].mean() > 30  # restored inside
    # the eyes and everything above the nose are the source's
    eyes = five_points(portrait_face.landmarks)[:2] - [x1, y1]
    for x, y in np.round(eyes).astype(int):
        assert np.array_equal(after[y - 8:y + 8, x - 8:x + 8], before[y - 8:y + 8, x - 8:x + 8])
    # the blend stage copies the restored box as it is
    final = portrait.copy()
    blend_patch(final, restored, BLEND)
    assert np.array_equal(final[y1:y2, x1:x2], restored.image_bgr)

    (half,) = restore_patches_gfpgan(restorer, [generated_patch], frames, 0.5, BLEND)
    half_change = np.abs(half.image_bgr.astype(int) - before)[inner].mean()
    assert 0.4 < half_change / np.abs(after - before)[inner].mean() < 0.6

    unchanged = restore_patches([generated_patch], frames, Restoration("gfpgan", 0.0, restorer, BLEND))
    assert unchanged[0] is generated_patch  # strength 0: no change at all
    no_landmarks = FacePatch(box=generated_patch.box, image_bgr=generated_patch.image_bgr,
                             face=Face(box=generated_patch.box, landmarks=None))
    assert restore_patches_gfpgan(restorer, [None, no_landmarks], np.stack([portrait, portrait]), 1.0,
                                  BLEND) == [None, no_landmarks]  # skipped, no error


# --- the torch path -------------------------------------------------------------------------------


def torch_render(portrait, patch: FacePatch, restorer: GfpganRestorer, strength: float):
    """The torch render's steps on the whole frame as one region: paste the 96x96 patch, restore.
    Returns the I420 planes (1, 768, 512) after restoring and as they were after pasting."""
    generated = cv2.resize(patch.image_bgr, (96, 96), interpolation=cv2.INTER_AREA)
    planes = torch.from_numpy(cv2.cvtColor(portrait, cv2.COLOR_BGR2YUV_I420))[None].contiguous()
    boxes = np.array([patch.box])
    landmarks = patch.face.landmarks[None].astype(np.float32)
    patches = torch.from_numpy(generated).permute(2, 0, 1)[None].float() / 255.0
    gpu_blend.paste_faces(planes, np.array([0]), boxes, patches, landmarks, feather=BLEND.feather)
    pasted_planes = planes.clone()
    with torch.inference_mode():
        count = restorer.restore_regions(planes, boxes, landmarks, strength, feather=BLEND.feather)
    assert count == 1
    return planes, pasted_planes


def test_torch_path_writes_only_the_mask_and_agrees_with_the_numpy_path(portrait, portrait_face, generated_patch,
                                                                       random_gfpgan):
    restorer = GfpganRestorer(random_gfpgan, "cpu")
    planes, pasted_planes = torch_render(portrait, generated_patch, restorer, 1.0)
    y_after, y_before = gpu_blend.split_planes(planes)[0][0], gpu_blend.split_planes(pasted_planes)[0][0]
    mask = restore_masks(np.array([generated_patch.box]), portrait_face.landmarks[None], BLEND.feather, 512, 512)[0]
    assert torch.equal(y_after[torch.from_numpy(mask == 0)], y_before[torch.from_numpy(mask == 0)])
    assert (y_after.int() - y_before.int()).abs()[torch.from_numpy(mask > 0.9)].float().mean() > 5

    # the same pasted frame through both paths: numpy (OpenCV warps on BGR) and torch (grid_sample on I420)
    composite = pasted(portrait, generated_patch)
    x1, y1, x2, y2 = generated_patch.box
    as_pasted = FacePatch(box=generated_patch.box, image_bgr=composite[y1:y2, x1:x2].copy(),
                          mask=np.ones((y2 - y1, x2 - x1), np.float32), face=portrait_face)
    (restored,) = restore_patches_gfpgan(restorer, [as_pasted], composite[None], 1.0, BLEND)
    numpy_frame = composite.copy()
    blend_patch(numpy_frame, restored, BLEND)
    planes = torch.from_numpy(cv2.cvtColor(composite, cv2.COLOR_BGR2YUV_I420))[None].contiguous()
    with torch.inference_mode():
        restorer.restore_regions(planes, np.array([generated_patch.box]), portrait_face.landmarks[None], 1.0,
                                 feather=BLEND.feather)
    torch_frame = cv2.cvtColor(planes[0].numpy(), cv2.COLOR_YUV2BGR_I420)
    inside = mask > 0
    luma = lambda image: cv2.cvtColor(image, cv2.COLOR_BGR2GRAY).astype(int)
    restored_change = np.abs(luma(numpy_frame) - luma(composite))[inside].mean()
    assert restored_change > 20  # the comparison is about restored pixels, not two copies of the input
    assert np.abs(luma(torch_frame) - luma(numpy_frame))[inside].mean() < 1.0
    # colour differs by what I420's shared chroma of 2x2 pixels loses on the noisy random output
    colour_difference = np.abs(torch_frame.astype(int) - numpy_frame.astype(int))[inside].mean()
    assert colour_difference < 4.0, colour_difference


def test_torch_path_strength_zero_and_faces_without_landmarks_change_nothing(portrait, generated_patch):
    restorer = GfpganRestorer(ColourNegative(), "cpu")
    planes = torch.from_numpy(cv2.cvtColor(portrait, cv2.COLOR_BGR2YUV_I420))[None].contiguous()
    before = planes.clone()
    boxes = np.array([generated_patch.box])
    assert restorer.restore_regions(planes, boxes, generated_patch.face.landmarks[None], 0.0, BLEND.feather) == 0
    assert restorer.restore_regions(planes, boxes, np.full((1, 468, 2), np.nan, np.float32), 1.0, BLEND.feather) == 0
    assert torch.equal(planes, before)


# --- choosing the restorer ------------------------------------------------------------------------


def save_random_gfpgan(path: Path, model: GFPGANClean) -> Path:
    torch.save({"params_ema": model.state_dict()}, path)
    return path


def test_the_restorer_choice(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    installed = tmp_path / "installed"
    installed.mkdir()
    (installed / "GFPGANv1.4.pth").write_bytes(b"checked when it loads")
    auto = RestoreConfig()
    assert auto.method == "auto"
    assert choose_restorer(auto, "wav2lip", True, installed).name == "gfpgan"
    assert choose_restorer(auto, "wav2lip", True, empty).name == "sharpen"
    assert choose_restorer(auto, "landmark", False, installed).name == "none"
    musetalk = choose_restorer(auto, "musetalk", True, installed, face_size=256)  # its faces are made at 256 px
    assert musetalk.name == "none" and "256 px" in musetalk.reason
    assert choose_restorer(RestoreConfig(method="gfpgan"), "musetalk", True, installed, face_size=256).name == "gfpgan"
    assert choose_restorer(RestoreConfig(method="sharpen"), "landmark", False, installed).name == "sharpen"
    assert choose_restorer(RestoreConfig(enabled=False, method="gfpgan"), "wav2lip", True, installed).name == "none"
    assert choose_restorer(RestoreConfig(method="none"), "wav2lip", True, installed).name == "none"
    chosen = choose_restorer(RestoreConfig(method="gfpgan"), "landmark", False, installed)
    assert chosen.name == "gfpgan" and chosen.checkpoint == installed / "GFPGANv1.4.pth"
    with pytest.raises(HeygemError, match="--restorer gfpgan needs GFPGANv1.4.pth in .*weights download gfpgan_v1.4"):
        choose_restorer(RestoreConfig(method="gfpgan"), "wav2lip", True, empty)


def test_restorer_gfpgan_without_its_file_is_a_user_error_everywhere(tmp_path, monkeypatch, face_photo, short_speech):
    import subprocess
    import sys

    from conftest import REPO

    monkeypatch.setenv("HEYGEM_WEIGHTS", str(tmp_path))
    from heygem.jobs.request import check_options

    with pytest.raises(HeygemError, match="GFPGANv1.4.pth"):
        check_options({"restore.method": "gfpgan"}, Config())  # a job request is checked before it is queued
    assert check_options({"restore.method": "gfpgan", "restore.enabled": False}, Config())[1].restore.method == "gfpgan"
    result = subprocess.run([sys.executable, "-m", "heygem", "generate", "--face", str(face_photo), "--audio",
                             str(short_speech), "--output", str(tmp_path / "out.mp4"), "--restorer", "gfpgan"],
                            cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2
    assert "--restorer gfpgan needs GFPGANv1.4.pth" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out.mp4").exists()


# --- end to end -----------------------------------------------------------------------------------


def test_three_frames_with_gfpgan_make_a_playable_mp4(tmp_path, monkeypatch, face_photo, random_gfpgan,
                                                      portrait_face):
    from heygem.models.wav2lip import Wav2Lip
    from heygem.pipeline import generate

    weights = tmp_path / "weights"
    weights.mkdir()
    torch.manual_seed(1)
    torch.save({"state_dict": Wav2Lip().state_dict()}, weights / "wav2lip.pth")
    save_random_gfpgan(weights / "GFPGANv1.4.pth", random_gfpgan)
    monkeypatch.setenv("HEYGEM_WEIGHTS", str(weights))
    speech = tmp_path / "speech.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-ss", "0.5", "-t", "0.12", str(speech))
    options = {"engine.device": "cpu", "media.output_height": 256, "run.avatar_cache": False}

    summary = generate(face_photo, speech, tmp_path / "gfpgan.mp4", overrides={**options, "run.render": "torch"})
    assert summary.restorer == "gfpgan" and summary.engine == "wav2lip" and summary.frames == 3
    assert "load_restorer" in summary.seconds_per_stage
    assert json.loads((tmp_path / "gfpgan.json").read_text())["restorer"] == "gfpgan"
    assert_playable_mp4(tmp_path / "gfpgan.mp4", summary.audio_seconds)

    plain = generate(face_photo, speech, tmp_path / "sharpen.mp4",
                     overrides={**options, "run.render": "torch", "restore.method": "sharpen"})
    assert plain.restorer == "sharpen"
    restored, sharpened = decode_frames(tmp_path / "gfpgan.mp4"), decode_frames(tmp_path / "sharpen.mp4")
    assert restored.shape == sharpened.shape == (3, 256, 256, 3)
    difference = np.abs(restored.astype(int) - sharpened.astype(int)).mean(axis=(0, 3))  # (256, 256)
    points = five_points(portrait_face.landmarks) / 2  # (5, 2) in the 256x256 output
    (left, top), (right, bottom) = (np.floor(points[3:].min(axis=0)).astype(int),
                                    np.ceil(points[3:].max(axis=0)).astype(int))
    assert difference[top - 3:bottom + 4, left:right + 1].mean() > 5  # around the mouth: restored
    eyes_row = int(points[:2, 1].min())
    assert difference[:eyes_row].mean() < 1.0  # the eyes and above: the source's (up to x264)
