"""Real faces that fill small frames: tight and loose crops of the bundled portrait, faces at the frame's edge.

Each crop is made into a short video that drifts a little (so no two frames are alike), decoded to
I420 as the pipeline decodes it, and tracked as the pipeline tracks it; the face must be found on
every frame, with its landmarks where they are in the portrait.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import ASSETS, PORTRAIT_FACE_BOX, REPO, assert_playable_mp4, face_crop, run_ffmpeg, write_tight_face_photo

from heygem.config import FaceConfig
from heygem.face.finder import FaceFinder, FinderPool
from heygem.media.decode import iter_video_i420
from heygem.media.ffmpeg import ffmpeg_binary
from heygem.media.frames import BgrImage, I420Frame, I420Frames
from heygem.media.probing import probe, working_geometry

SIZES = (64, 96, 112, 128, 160)
LIPS_AND_CHIN = [13, 14, 61, 291, 152]


def portrait() -> np.ndarray:
    return cv2.imread(str(ASSETS / "astronaut.jpg"))


def drifting_video(folder: Path, name: str, frame_bgr_at, count: int = 12) -> Path:
    """An H.264 video of ``count`` frames, frame i being ``frame_bgr_at(i)``."""
    frames = np.stack([frame_bgr_at(index) for index in range(count)])
    height, width = frames.shape[1:3]
    path = folder / f"{name}.mp4"
    subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "bgr24",
                    "-s", f"{width}x{height}", "-r", "25", "-i", "pipe:", "-c:v", "libx264", "-crf", "12",
                    "-pix_fmt", "yuv420p", str(path)], input=frames.tobytes(), check=True)
    return path


def decoded_i420(path: Path) -> np.ndarray:
    info = probe(path)
    return np.concatenate(list(iter_video_i420(info, working_geometry(info, None), 64)))


def reference_landmarks() -> np.ndarray:
    with FaceFinder(FaceConfig(), still_images=True) as finder:
        return finder.find(portrait())


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return reference_landmarks()


def track_every_frame(path: Path, config: FaceConfig | None = None, detector=None) -> list[np.ndarray | None]:
    """The landmarks of each frame of ``path``, tracked as the pipeline tracks a run of frames."""
    with FinderPool(config or FaceConfig(), 1, detector=detector) as pool:
        return pool.track_run(I420Frames(decoded_i420(path)))


def crop_cases() -> list[tuple[str, float]]:
    # tight: the frame is the face's own box (a face-recognition crop); loose: half as much again
    return [("tight", 1.0), ("loose", 1.5)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind, margin", crop_cases())
def test_a_face_crop_is_found_on_every_frame_with_its_landmarks(tmp_path, reference, kind, margin, size):
    def frame_at(index: int) -> np.ndarray:
        return face_crop(margin, size, shift=(0.01 * np.sin(index), 0.01 * np.cos(index)))[0]

    video = drifting_video(tmp_path, f"{kind}-{size}", frame_at)
    tracked = track_every_frame(video)
    assert all(points is not None for points in tracked), [points is not None for points in tracked]
    for index, points in enumerate(tracked):
        _, to_crop = face_crop(margin, size, shift=(0.01 * np.sin(index), 0.01 * np.cos(index)))
        expected = reference @ to_crop[:, :2].T + to_crop[:, 2]
        # the lips and the chin within 4 % of the frame of where they are in the portrait
        np.testing.assert_allclose(points[LIPS_AND_CHIN], expected[LIPS_AND_CHIN], atol=0.04 * size)


@pytest.mark.parametrize("size", [112, 320])
def test_a_face_larger_than_the_frame_is_found_on_every_frame(tmp_path, reference, size):
    """The frame shows 80 % of the face's box: forehead and chin are cut off."""
    video = drifting_video(tmp_path, f"filling-{size}",
                           lambda index: face_crop(0.8, size, shift=(0.005 * index, 0.0))[0])
    tracked = track_every_frame(video)
    assert all(points is not None for points in tracked)
    _, to_crop = face_crop(0.8, size)
    expected = reference @ to_crop[:, :2].T + to_crop[:, 2]
    np.testing.assert_allclose(tracked[0][[13, 14, 61, 291]], expected[[13, 14, 61, 291]], atol=0.05 * size)


@pytest.mark.parametrize("edge", ["left", "right", "top", "bottom"])
def test_a_face_touching_the_frame_s_edge_is_found_on_every_frame(tmp_path, reference, edge):
    """A 320x240 frame whose edge runs along the face's box (the face inside, touching it)."""
    x1, y1, x2, y2 = PORTRAIT_FACE_BOX
    width, height = 320, 240
    left = {"left": x1, "right": x2 - width}.get(edge, (x1 + x2) / 2 - width / 2)
    top = {"top": y1, "bottom": y2 - height}.get(edge, (y1 + y2) / 2 - height / 2)

    def frame_at(index: int) -> np.ndarray:
        drift = 0.3 * np.sin(index)  # sub-pixel, along the edge
        along = (drift, 0.0) if edge in ("top", "bottom") else (0.0, drift)
        to_frame = np.array([[1.0, 0, -left + along[0]], [0, 1.0, -top + along[1]]])
        return cv2.warpAffine(portrait(), to_frame, (width, height), flags=cv2.INTER_LINEAR,
                              borderMode=cv2.BORDER_REFLECT)

    tracked = track_every_frame(drifting_video(tmp_path, f"edge-{edge}", frame_at))
    assert all(points is not None for points in tracked)
    expected = reference - [left, top]
    np.testing.assert_allclose(tracked[0][LIPS_AND_CHIN], expected[LIPS_AND_CHIN], atol=6.0)


def test_the_mesh_crop_reaching_past_the_frame_is_black_there_and_the_frame_inside():
    frame_bgr = face_crop(1.0, 112)[0]
    planes = cv2.cvtColor(frame_bgr, cv2.COLOR_BGR2YUV_I420)
    converted = cv2.cvtColor(planes, cv2.COLOR_YUV2BGR_I420)  # what the pipeline's frame holds
    for frame in (I420Frame(planes), BgrImage(converted)):
        around = frame.region(-56, -40, 168, 184, size=(224, 224))  # one pixel per pixel, a margin on every side
        np.testing.assert_array_equal(around[40:152, 56:168], converted)  # the frame, to the edge, unchanged
        outside = np.ones((224, 224), bool)
        outside[40:152, 56:168] = False
        assert around[outside].max() == 0  # black past the frame's edges
        shrunk = frame.region(-56, -40, 168, 184, size=(112, 112))
        assert shrunk[:18].max() == 0 and shrunk[-18:].max() == 0 and shrunk[40:70, 40:70].mean() > 60


def real_s3fd_checkpoint() -> Path | None:
    path = REPO / "weights" / "s3fd.pth"
    return path if path.is_file() and path.stat().st_size > 50_000_000 else None


@pytest.mark.skipif(real_s3fd_checkpoint() is None, reason="the public s3fd.pth is not in weights/")
@pytest.mark.parametrize("size", SIZES)
def test_s3fd_finds_tight_and_loose_crops_on_every_frame(tmp_path, size):
    from heygem.face.s3fd import S3FDDetector, load_s3fd

    detector = S3FDDetector(load_s3fd(real_s3fd_checkpoint(), device="cpu"))
    for kind, margin in crop_cases():
        video = drifting_video(tmp_path, f"{kind}-{size}",
                               lambda index, margin=margin: face_crop(margin, size, (0.01 * index, 0))[0])
        tracked = track_every_frame(video, FaceConfig(detector="s3fd"), detector=detector)
        assert all(points is not None for points in tracked), (kind, size)


def test_the_cli_makes_a_video_of_a_tight_112_pixel_face_photo(tmp_path):
    """The command that failed: a face-recognition crop, 112x112, the face filling it."""
    photo = write_tight_face_photo(tmp_path / "face_112.png")
    speech = tmp_path / "speech.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "1.5", str(speech))
    output = tmp_path / "out.mp4"
    completed = subprocess.run([sys.executable, "-m", "heygem", "generate", "--face", str(photo), "--audio",
                                str(speech), "-o", str(output)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert "frames without a face: 0" in completed.stdout
    assert_playable_mp4(output, probe(speech).duration)
