"""The S3FD and GFPGAN benchmarks run on the CPU at their smallest settings and print their tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def table_rows(output: str) -> list[list[str]]:
    """The cells of each markdown table row in ``output`` that is neither a header nor a rule."""
    rows = []
    for line in output.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows if row[0] not in ("precision", "configuration")
            and not row[0].startswith("compiled configuration")]


def test_s3fd_benchmark_prints_one_row_per_configuration_with_both_rates():
    command = [sys.executable, str(REPO / "bench" / "bench_s3fd.py"), "--device", "cpu", "--batch-sizes", "2",
               "--sizes", "160x120", "--max-sides", "96", "--precisions", "fp32", "--repeats", "1"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "torch" in lines[0] and "CPU" in lines[0] and "~100 candidates per frame" in lines[0]
    assert lines[1].startswith("| precision | model | frames | input | batch | network frames/s")
    rows = table_rows(result.stdout)
    assert len(rows) == 1
    precision, form, frames, network_input, batch, network_rate, detect_rate, candidates, boxes = rows[0]
    assert (precision, form, frames, network_input, batch) == ("fp32", "prepared", "160x120", "96x72", "2")
    assert float(network_rate) > 0 and float(detect_rate) > 0
    assert candidates == "100"  # the face logits were shifted for 100 candidates on exactly this input
    assert 1 <= float(boxes) <= 100  # NMS merged some of them


def test_s3fd_candidate_count_is_set_through_the_face_logits(face_photo):
    import cv2
    from bench_s3fd import cover_frame, set_candidate_count

    from heygem.face.s3fd import detect_faces
    from heygem.models.s3fd import S3FD

    torch.manual_seed(0)
    model = S3FD().eval()
    frame = cover_frame(cv2.imread(str(face_photo)), 128, 96)
    assert frame.shape == (96, 128, 3)
    shift = set_candidate_count(model, frame, 128, 25, 0.5)
    assert shift != 0.0
    (everything,) = detect_faces(model, frame[None], score_threshold=0.5, nms_threshold=1.0)  # NMS keeps all
    assert len(everything) == 25
    (merged,) = detect_faces(model, frame[None], score_threshold=0.5)
    assert 1 <= len(merged) < 25


def tiny_runner():
    from heygem.runtime.device import FixedBatchRunner

    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU())
    return FixedBatchRunner(network, "cpu", 2, precision="fp32", channels_last=True, name="tiny")


def test_gfpgan_benchmark_compiles_the_runner_s_network_and_gives_the_same_output():
    from bench_gfpgan import compile_runner

    runner = tiny_runner()
    faces = torch.rand(3, 3, 8, 8)  # (N, 3, 8, 8)
    expected = runner(faces)
    seconds = compile_runner(runner, faces, mode="default", backend="eager")  # dynamo only: fast on the CPU
    assert seconds > 0 and type(runner.module).__name__ == "OptimizedModule"
    torch.testing.assert_close(runner(faces), expected)


@pytest.fixture
def compiler_without_a_toolchain(monkeypatch) -> list:
    """torch.compile failing as it does where inductor finds no C++ compiler; the list counts the calls."""
    calls = []

    def failing_compile(*args, **kwargs):
        calls.append(kwargs)
        raise RuntimeError("InductorError: no working C++ compiler found\nsecond line of the traceback")

    monkeypatch.setattr(torch, "compile", failing_compile)
    return calls


FAILED_COMPILE = "torch.compile failed, variant skipped: RuntimeError: InductorError: no working C++ compiler found"


def test_a_failed_compile_raises_compile_failed_with_the_first_line(compiler_without_a_toolchain):
    from bench_gfpgan import CompileFailed, compile_runner

    with pytest.raises(CompileFailed) as raised:
        compile_runner(tiny_runner(), torch.rand(2, 3, 8, 8), mode="max-autotune-no-cudagraphs")
    assert str(raised.value) == "RuntimeError: InductorError: no working C++ compiler found"
    assert compiler_without_a_toolchain == [{"mode": "max-autotune-no-cudagraphs", "backend": "inductor",
                                             "dynamic": False}]


def run_gfpgan_benchmark(monkeypatch, capsys, variants, batch_sizes) -> str:
    """bench_gfpgan's main on the CPU, the compiled variant allowed there (it is CUDA-only in the script)."""
    import bench_gfpgan
    from bench_gfpgan import Variant

    compiled = Variant("fused-fp32-compile", True, "fp32", compiled=True)
    plain = Variant("fused-fp32", True, "fp32")
    monkeypatch.setattr(bench_gfpgan, "VARIANTS", [compiled, plain])
    bench_gfpgan.main(["--device", "cpu", "--repeats", "1", "--markdown", "--batch-sizes", *batch_sizes,
                       "--variants", *variants])
    return capsys.readouterr().out


def test_gfpgan_benchmark_skips_a_variant_that_does_not_compile_after_one_line(monkeypatch, capsys,
                                                                              compiler_without_a_toolchain):
    output = run_gfpgan_benchmark(monkeypatch, capsys, ["fused-fp32-compile"], ["1", "2"])
    assert table_rows(output) == [["fused + fp32 + torch.compile", "1", FAILED_COMPILE]]
    assert len(compiler_without_a_toolchain) == 1  # not tried again at batch 2
    assert "compile + first run" not in output  # nothing compiled, no compile-time table


def test_gfpgan_benchmark_times_the_other_variants_after_a_failed_compile(monkeypatch, capsys,
                                                                         compiler_without_a_toolchain):
    output = run_gfpgan_benchmark(monkeypatch, capsys, ["fused-fp32-compile", "fused-fp32"], ["1"])
    assert output.splitlines()[0] == "| configuration | batch | faces/s |"
    compiled_row, plain_row = table_rows(output)
    assert compiled_row == ["fused + fp32 + torch.compile", "1", FAILED_COMPILE]
    assert plain_row[:2] == ["fused + fp32", "1"] and float(plain_row[2]) > 0  # GFPGAN v1.4 ran and was timed
