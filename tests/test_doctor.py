"""`python -m heygem doctor` on this machine, with a broken ffmpeg, and with bad or good weights."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from heygem import doctor
from heygem.runtime.benchmark import Benchmark, cudnn_switched, run_benchmark, time_generator


def run_doctor(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heygem", "doctor", *args], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


def by_name(checks, section: str) -> dict:
    return {check["name"] if isinstance(check, dict) else check.name: check for check in checks
            if (check["section"] if isinstance(check, dict) else check.section) == section}


@pytest.fixture()
def no_weights(tmp_path, monkeypatch):
    folder = tmp_path / "weights"
    folder.mkdir()
    monkeypatch.setenv("HEYGEM_WEIGHTS", str(folder))
    return folder


def test_this_machine_is_ready_in_text_and_json(no_weights):
    text = run_doctor(env={"HEYGEM_WEIGHTS": str(no_weights)})
    assert text.returncode == 0, text.stdout + text.stderr
    assert "Traceback" not in text.stderr
    lines = text.stdout.splitlines()
    assert any(line.split()[:3] == ["ok", "torch", torch.__version__] for line in lines), text.stdout
    assert any(line.split()[:2] == ["ok", "libx264"] for line in lines)
    assert any(line.split()[:2] == ["ok", "aac"] for line in lines)
    assert "face_detection_full_range" in text.stdout and "face_landmark.tflite" in text.stdout
    assert text.stdout.rstrip().splitlines()[-1].startswith("Ready:")
    if not torch.cuda.is_available():
        assert "no GPU" in text.stdout
        benchmark_line = lines[lines.index("GPU benchmark") + 1].split()
        assert benchmark_line[:4] == ["skipped", "no", "CUDA", "GPU"], lines

    result = run_doctor("--json", "--no-benchmark", env={"HEYGEM_WEIGHTS": str(no_weights)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["exit_code"] == 0
    assert report["benchmark"] == {"ran": False, "note": "skipped: not asked for (--no-benchmark)", "result": None}
    assert by_name(report["checks"], "torch")["torch"]["detail"] == torch.__version__
    ffmpeg_checks = by_name(report["checks"], "ffmpeg")
    assert ffmpeg_checks["libx264"]["status"] == ffmpeg_checks["aac"]["status"] == "ok"
    assert ffmpeg_checks["version"]["detail"].startswith("ffmpeg version")
    mediapipe_checks = by_name(report["checks"], "mediapipe")
    assert all(check["status"] == "ok" and check["required"] for check in mediapipe_checks.values())
    assert mediapipe_checks["full-range face detector"]["detail"].endswith(".tflite")
    assert by_name(report["checks"], "engine")["--engine auto"]["detail"].startswith("landmark")
    assert {check["status"] for check in report["checks"]} <= {"ok", "warning"}


def test_a_non_executable_ffmpeg_fails_the_doctor_with_its_fix(tmp_path, no_weights, monkeypatch):
    fake = tmp_path / "ffmpeg"
    fake.write_text("not a program\n")
    fake.chmod(0o644)
    result = run_doctor("--no-benchmark", env={"HEYGEM_FFMPEG": str(fake), "HEYGEM_WEIGHTS": str(no_weights)})
    assert result.returncode == 1, result.stdout
    assert "Traceback" not in result.stderr
    lines = result.stdout.splitlines()
    problem = next(index for index, line in enumerate(lines) if line.split()[:2] == ["problem", "ffmpeg"])
    assert str(fake) in lines[problem] and "does not run" in lines[problem]
    assert lines[problem + 1].strip().startswith("fix:") and "HEYGEM_FFMPEG" in lines[problem + 1]
    assert result.stdout.rstrip().splitlines()[-1].startswith("NOT READY")


@pytest.fixture()
def fresh_ffmpeg_lookup():
    """heygem.media.ffmpeg caches the ffmpeg it found: forget it before and after a test that changes HEYGEM_FFMPEG."""
    from heygem.media.ffmpeg import ffmpeg_binary

    ffmpeg_binary.cache_clear()
    yield
    ffmpeg_binary.cache_clear()


def test_an_ffmpeg_without_aac_is_a_problem(tmp_path, no_weights, monkeypatch, fresh_ffmpeg_lookup):
    """A stand-in ffmpeg (a Python script) that lists libx264 but no aac encoder."""
    fake = tmp_path / "ffmpeg-without-aac"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "if '-version' in sys.argv:\n"
        "    print('ffmpeg version 0.0-test Copyright (c) the testers')\n"
        "else:\n"
        "    print('Encoders:\\n V..... = Video\\n ------\\n V....D libx264    H.264\\n A....D libmp3lame  MP3')\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("HEYGEM_FFMPEG", str(fake))
    report = doctor.run_checks(weights_dir=no_weights)
    checks = by_name(report.checks, "ffmpeg")
    assert checks["version"].detail == "ffmpeg version 0.0-test"
    assert checks["libx264"].status == "ok"
    assert checks["aac"].status == "problem" and checks["aac"].required and "imageio-ffmpeg" in checks["aac"].fix
    assert report.exit_code == 1


def test_a_corrupt_checkpoint_is_reported_but_the_default_engine_still_works(no_weights):
    (no_weights / "wav2lip_gan.pth").write_bytes(b"\x80\x02garbage" * 100)
    report = doctor.run_checks(weights_dir=no_weights)
    weights = by_name(report.checks, "weights")
    assert weights["wav2lip_gan.pth"].status == "problem"
    assert weights["wav2lip_gan.pth"].detail.startswith("does not load:")
    assert "wav2lip_gan.pth is not a readable Wav2Lip checkpoint" in weights["wav2lip_gan.pth"].detail
    assert "official Wav2Lip release" in weights["wav2lip_gan.pth"].fix
    engine = by_name(report.checks, "engine")["--engine auto"]
    assert engine.status == "problem" and "--engine landmark" in engine.fix  # auto would pick the broken file
    assert report.exit_code == 0, report.problems
    assert "wav2lip_gan.pth" in doctor.format_text(report) and "does not load" in doctor.format_markdown(report)


def test_a_checkpoint_in_the_public_layout_loads(no_weights):
    from heygem.models.wav2lip import Wav2Lip

    state_dict = {f"module.{key}": value for key, value in Wav2Lip().state_dict().items()}
    torch.save({"state_dict": state_dict, "optimizer": {}, "global_step": 7, "global_epoch": 1},
               no_weights / "wav2lip.pth")
    (no_weights / "something_else.onnx").write_bytes(b"onnx")
    report = doctor.run_checks(weights_dir=no_weights)
    weights = by_name(report.checks, "weights")
    assert weights["folder"].detail.endswith("2 checkpoint files")
    assert weights["wav2lip.pth"].status == "ok" and "loads" in weights["wav2lip.pth"].detail
    assert weights["something_else.onnx"].status == "warning"
    engine = by_name(report.checks, "engine")["--engine auto"]
    assert engine.status == "ok" and engine.detail.startswith("wav2lip with wav2lip.pth")


def test_a_check_that_raises_becomes_a_problem_line(no_weights, monkeypatch):
    def broken() -> list:
        raise RuntimeError("mediapipe exploded\nsecond line")

    monkeypatch.setattr(doctor, "check_mediapipe", broken)
    report = doctor.run_checks(weights_dir=no_weights)
    check = by_name(report.checks, "mediapipe")["check"]
    assert check.status == "problem" and check.required
    assert check.detail == "the check itself failed: RuntimeError: mediapipe exploded"
    assert report.exit_code == 1
    json.dumps(report.to_dict())  # still serialisable


def test_encoder_listing_and_cudnn_versions():
    listing = "Encoders:\n V..... = Video\n ------\n V....D libx264  libx264 H.264\n A....D aac   AAC\n"
    assert doctor.encoder_names(listing) == {"libx264", "aac"}
    assert doctor.encoder_names("no table here\n V....D libx264") == set()
    assert doctor.cudnn_version_text(91900) == "9.19.0"
    assert doctor.cudnn_version_text(8902) == "8.9.2"


def test_the_timing_function_counts_faces_and_restores_cudnn_flags():
    calls = []

    class CountingModel(torch.nn.Module):
        def forward(self, mel_windows, faces):
            calls.append(faces.shape[0])
            return faces[:, :3]

    mel_windows, faces = torch.zeros(4, 1, 80, 16), torch.zeros(4, 6, 96, 96)
    faces_per_second = time_generator(CountingModel(), mel_windows, faces, warmup=2, seconds=0.05,
                                             min_iterations=5)
    assert faces_per_second > 0
    assert len(calls) >= 2 + 1 + 5 and set(calls) == {4}  # warm-up, the one-pass estimate, the timed passes

    cudnn = torch.backends.cudnn
    before = cudnn.enabled, cudnn.benchmark
    with cudnn_switched(False):
        assert cudnn.enabled is False and cudnn.benchmark is True
    assert (cudnn.enabled, cudnn.benchmark) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only wording")
def test_the_benchmark_is_skipped_without_a_gpu():
    outcome = run_benchmark()
    assert not outcome.ran and outcome.result is None and outcome.note.startswith("skipped: no CUDA GPU")
    assert "no CUDA GPU" in doctor.benchmark_markdown(outcome)


def test_the_benchmark_process_answers_in_json():
    """What the web app's benchmark button runs: `python -m heygem.runtime.benchmark`, one JSON line back."""
    result = subprocess.run([sys.executable, "-m", "heygem.runtime.benchmark"], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    outcome = Benchmark.from_dict(json.loads(result.stdout.strip().splitlines()[-1]))
    if torch.cuda.is_available():
        assert outcome.ran and outcome.result.faces_per_second_cudnn > 0 and outcome.result.batch_size == 64
        assert Benchmark.from_dict(outcome.to_dict()) == outcome
    else:
        assert outcome == Benchmark(False, "skipped: no CUDA GPU on this machine (the benchmark times GPU "
                                                  "convolutions)")
