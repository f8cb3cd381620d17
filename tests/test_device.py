"""heygem.runtime.device: the backend flags and the fixed-shape batch runner, on the CPU."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

from heygem.errors import HeygemError
from heygem.runtime import device as device_module
from heygem.runtime.device import FixedBatchRunner, configure_backends, cudnn_problem

CPU = torch.device("cpu")


class RecordingNet(nn.Module):
    """A small two-input network that remembers the batch sizes it was called with.

    images (B, 3, 8, 8), codes (B, 4) -> (B, 2, 8, 8); ``fail_above`` makes it
    raise ``error`` for batches larger than that, as a device out of memory would.
    """

    def __init__(self, fail_above: int | None = None, error: Exception | None = None):
        super().__init__()
        torch.manual_seed(5)
        self.convolution = nn.Conv2d(3, 2, 3, padding=1)
        self.code_to_bias = nn.Linear(4, 2)
        self.batch_sizes: list[int] = []
        self.fail_above = fail_above
        self.error = error

    def forward(self, images: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(images.shape[0])
        if self.fail_above is not None and images.shape[0] > self.fail_above:
            raise self.error
        bias = self.code_to_bias(codes)[:, :, None, None]  # (B, 2, 1, 1)
        return torch.sigmoid(self.convolution(images) + bias)  # (B, 2, 8, 8)


def random_items(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(count)
    return torch.rand(count, 3, 8, 8, generator=generator), torch.randn(count, 4, generator=generator)


def plain_forward(module: nn.Module, images: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return module(images, codes).clone()


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("pad, sizes, short_sizes", [(True, [4, 4, 4], [4]),  # as on CUDA: one shape
                                                      (None, [4, 4, 3], [2])])  # the CPU's default: no padding
def test_runner_batches_the_items_and_pads_the_last_batch_only_when_padding(channels_last, pad, sizes, short_sizes):
    net = RecordingNet()
    images, codes = random_items(11)
    expected = plain_forward(net, images, codes)
    net.batch_sizes.clear()

    runner = FixedBatchRunner(net, CPU, batch_size=4, precision="fp32", channels_last=channels_last,
                              pad_last_batch=pad)
    assert runner.pad_last_batch is (pad is True)
    generated = runner(images, codes)
    assert net.batch_sizes == sizes  # 11 items: two full batches, then 3 items (padded to 4 when padding)
    assert generated.shape == (11, 2, 8, 8)
    assert generated.dtype == torch.float32
    assert not generated.is_inference()  # callers may change it in place
    torch.testing.assert_close(generated, expected, atol=1e-6, rtol=1e-5)

    generated = runner(images[:2], codes[:2])  # fewer items than one batch
    assert net.batch_sizes[3:] == short_sizes
    torch.testing.assert_close(generated, expected[:2], atol=1e-6, rtol=1e-5)


def test_runner_pads_with_copies_of_the_last_item():
    seen = []

    class Remember(nn.Module):
        def forward(self, values):
            seen.append(values.clone())
            return values * 2

    runner = FixedBatchRunner(Remember(), CPU, batch_size=4, pad_last_batch=True)
    assert torch.equal(runner(torch.arange(6.0)), torch.arange(6.0) * 2)
    assert torch.equal(seen[1], torch.tensor([4.0, 5.0, 5.0, 5.0]))


def test_runner_bf16_autocast_on_the_cpu_stays_close_and_returns_float32():
    net = RecordingNet()
    images, codes = random_items(5)
    expected = plain_forward(net, images, codes)
    generated = FixedBatchRunner(net, CPU, batch_size=2, precision="bf16")(images, codes)
    assert generated.dtype == torch.float32
    assert next(net.parameters()).dtype == torch.float32  # on the CPU autocast casts, the weights stay fp32
    torch.testing.assert_close(generated, expected, atol=2e-2, rtol=0)


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")])
def test_runner_halves_the_batch_on_out_of_memory_and_keeps_order(error, caplog):
    images, codes = random_items(11)
    expected = plain_forward(RecordingNet(), images, codes)
    net = RecordingNet(fail_above=2, error=error)
    runner = FixedBatchRunner(net, CPU, batch_size=8, name="test net", pad_last_batch=True)
    with caplog.at_level(logging.WARNING, logger="heygem"):
        generated = runner(images, codes)
    assert net.batch_sizes == [8, 4, 2, 2, 2, 2, 2, 2]  # 11 items at 2: five full batches, one padded
    assert runner.batch_size == 2  # kept for the next call
    torch.testing.assert_close(generated, expected, atol=1e-6, rtol=1e-5)
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["test net: out of memory with a batch of 8, retrying with 4",
                        "test net: out of memory with a batch of 4, retrying with 2"]


def test_runner_gives_up_at_one_and_passes_other_errors_through():
    net = RecordingNet(fail_above=0, error=torch.cuda.OutOfMemoryError("CUDA out of memory"))
    runner = FixedBatchRunner(net, CPU, batch_size=4, name="test net", pad_last_batch=True)
    with pytest.raises(HeygemError, match="test net ran out of memory even with a batch of 1.*--device cpu"):
        runner(*random_items(3))
    assert net.batch_sizes == [4, 2, 1]

    broken = RecordingNet(fail_above=0, error=RuntimeError("shape mismatch"))
    runner = FixedBatchRunner(broken, CPU, batch_size=4, pad_last_batch=True)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        runner(*random_items(3))
    assert broken.batch_sizes == [4] and runner.batch_size == 4


def test_runner_refuses_bad_inputs():
    runner = FixedBatchRunner(RecordingNet(), CPU, batch_size=4)
    images, codes = random_items(3)
    with pytest.raises(ValueError, match="different item counts"):
        runner(images, codes[:2])
    with pytest.raises(ValueError, match="no items"):
        runner(images[:0], codes[:0])
    with pytest.raises(ValueError, match="at least 1"):
        FixedBatchRunner(RecordingNet(), CPU, batch_size=0)
    with pytest.raises(HeygemError, match="precision"):
        FixedBatchRunner(RecordingNet(), CPU, batch_size=4, precision="fp8")
    # the graph option is for CUDA only; on the CPU the runner runs op by op
    assert not FixedBatchRunner(RecordingNet(), CPU, batch_size=4, use_cuda_graph=True).use_cuda_graph


@pytest.fixture
def restore_backend_flags(monkeypatch):
    """configure_backends changes process-wide state: put it back after each test."""
    cudnn = torch.backends.cudnn
    saved = (cudnn.benchmark, cudnn.deterministic, cudnn.enabled, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cuda.matmul.fp32_precision,
             cudnn.conv.fp32_precision)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield
    (cudnn.benchmark, cudnn.deterministic, cudnn.enabled, deterministic, warn_only,
     torch.backends.cuda.matmul.fp32_precision, cudnn.conv.fp32_precision) = saved
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


def test_configure_backends_sets_the_flags_of_each_mode(restore_backend_flags):
    cudnn = torch.backends.cudnn

    configure_backends(deterministic=True)
    assert (cudnn.benchmark, cudnn.deterministic, cudnn.enabled) == (False, True, True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"

    configure_backends()  # fast: cuDNN's heuristics pick the kernels, no autotuning at the start
    assert (cudnn.benchmark, cudnn.deterministic, cudnn.enabled) == (False, False, True)
    assert not torch.are_deterministic_algorithms_enabled()

    configure_backends(cudnn=False)
    assert (cudnn.benchmark, cudnn.enabled) == (False, False)
    configure_backends(cudnn=True)
    assert cudnn.enabled


def test_the_fast_mode_does_not_import_torchs_compiler():
    # torch.use_deterministic_algorithms imports torch._inductor (about a second of every job's start);
    # the default mode only calls it when the deterministic mode is on
    import subprocess
    import sys

    code = ("import sys, torch; from heygem.runtime.device import configure_backends; "
            "configure_backends(device='cpu'); print('torch._inductor' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_cudnn_problem_is_none_here():
    assert cudnn_problem() is None


def test_cuda_without_cudnn_is_explained_and_logged_once(restore_backend_flags, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    monkeypatch.setattr(device_module, "_WARNED", set())
    problem = cudnn_problem()
    assert problem is not None and "\n" not in problem
    assert "finds no cuDNN library" in problem and "install the torch build" in problem

    with caplog.at_level(logging.WARNING, logger="heygem"):
        configure_backends(device=torch.device("cpu"))  # networks on the CPU: cuDNN is not looked at
        assert torch.backends.cudnn.enabled and not caplog.records
        configure_backends()
        configure_backends(device=torch.device("cuda", 0))
    assert not torch.backends.cudnn.enabled  # runs without it
    assert [record.getMessage() for record in caplog.records] == [problem]
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # fast mode on an Ampere-or-newer GPU


def test_the_runner_serves_callers_inside_and_outside_inference_mode_alike():
    # a job worker keeps its engine: one job renders in inference mode, the next may not
    runner = FixedBatchRunner(torch.nn.Linear(3, 2), torch.device("cpu"), batch_size=4, precision="fp32")
    items = torch.randn(5, 3)
    with torch.inference_mode():
        inside = runner(items)
    outside = runner(items)
    torch.testing.assert_close(inside, outside)


def test_channels_last_runner_takes_networks_with_five_dimensional_weights():
    """GFPGAN's modulated convolutions hold (1, C_out, C_in, k, k) weights, which have no channels_last
    form: the runner converts the 4-D weights only, and the output is the network's own."""
    import torch

    from heygem.models.gfpgan import StyleConv
    from heygem.runtime.device import FixedBatchRunner

    class Network(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.style = StyleConv(16, 16, upsample=True)

        def forward(self, images):
            return self.style(self.conv(images), torch.ones(images.shape[0], 512), None)

    torch.manual_seed(0)
    network = Network().eval()
    images = torch.randn(3, 3, 8, 8)
    with torch.inference_mode():
        expected = network(images)
    runner = FixedBatchRunner(network, torch.device("cpu"), 2, precision="fp32", channels_last=True)
    produced = runner(images)
    assert network.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert network.style.modulated_conv.weight.dim() == 5
    torch.testing.assert_close(produced, expected, rtol=1e-5, atol=1e-5)


def test_warm_up_does_nothing_on_the_cpu():
    net = RecordingNet()
    runner = FixedBatchRunner(net, CPU, batch_size=4)
    runner.warm_up(((3, 8, 8), torch.float32), ((4,), torch.float32))
    assert net.batch_sizes == [] and runner._batch is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_warm_up_captures_the_graph_before_the_first_batch_and_changes_no_result():
    cuda = torch.device("cuda")
    images, codes = random_items(6)
    expected = FixedBatchRunner(RecordingNet().to(cuda), cuda, batch_size=4, precision="fp32")(
        images.to(cuda), codes.to(cuda))  # op by op
    net = RecordingNet().to(cuda)
    runner = FixedBatchRunner(net, cuda, batch_size=4, precision="fp32", use_cuda_graph=True)
    runner.warm_up(((3, 8, 8), torch.float32), ((4,), torch.float32))
    assert runner._batch is not None and runner._batch.graph is not None
    calls = len(net.batch_sizes)  # the warm-up's passes and the capture
    result = runner(images.to(cuda), codes.to(cuda))
    assert len(net.batch_sizes) == calls  # the batches were replays of the graph captured before
    assert torch.equal(result, expected)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_module_that_fails_before_capture_raises_its_own_error_not_a_capture_warning(caplog):
    """A module failing in the passes before the capture (a compiler that cannot compile, say) fails op by op
    too: its error reaches the caller, with no "CUDA graph capture failed" line naming the wrong cause."""
    cuda = torch.device("cuda")

    class Failing(torch.nn.Module):
        def forward(self, images, codes):
            raise RuntimeError("cannot compile")

    runner = FixedBatchRunner(Failing(), cuda, batch_size=4, precision="fp32", use_cuda_graph=True)
    with caplog.at_level(logging.WARNING, logger="heygem"), pytest.raises(RuntimeError, match="cannot compile"):
        runner.warm_up(((3, 8, 8), torch.float32), ((4,), torch.float32))
    assert not [record for record in caplog.records if "capture failed" in record.getMessage()]


def test_choosing_a_render_path_imports_no_torch(tmp_path):
    """A cold start must not wait seconds for torch's import before it decodes and tracks: the render
    path's GPU guess looks at NVIDIA's device files and torch's presence only, and every engine's
    choice of render path then follows that guess."""
    import subprocess
    import sys

    from conftest import REPO

    probe = ("import sys; from heygem.runtime.device import gpu_expected; from heygem.engines import ENGINES; "
             "from heygem.config import load_config; import types; expected = gpu_expected(); "
             "paths = [type(ENGINES[name].render(types.SimpleNamespace(), "
             "load_config(overrides={'engine.name': name}), 'none')).__name__ for name in ('wav2lip', 'landmark')]; "
             "print(expected, 'torch' in sys.modules, paths)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    expected, imported, paths = result.stdout.split(" ", 2)
    assert imported == "False", result.stdout
    assert expected == str(bool(__import__("glob").glob("/dev/nvidia[0-9]*")))
    assert ("Wav2LipDeviceRender" in paths) == (expected == "True"), paths


def test_each_engine_takes_its_device_render_path_where_a_gpu_is_expected(monkeypatch):
    from types import SimpleNamespace

    from heygem.config import load_config
    from heygem.engines import ENGINES
    from heygem.engines.musetalk.render import MuseTalkDeviceRender, MuseTalkRender
    from heygem.engines.wav2lip.device import Wav2LipDeviceRender
    from heygem.render.cpu import CpuRender

    prepared = SimpleNamespace()
    for expected, wav2lip_path, musetalk_path in ((False, CpuRender, MuseTalkRender),
                                                  (True, Wav2LipDeviceRender, MuseTalkDeviceRender)):
        monkeypatch.setattr(device_module, "gpu_expected", lambda expected=expected: expected)
        for name, path in (("wav2lip", wav2lip_path), ("musetalk", musetalk_path)):
            config = load_config(overrides={"engine.name": name})
            assert type(ENGINES[name].render(prepared, config, "none")) is path, (name, expected)
            on_cpu = load_config(overrides={"engine.name": name, "engine.device": "cpu"})
            assert not isinstance(ENGINES[name].render(prepared, on_cpu, "none"), (Wav2LipDeviceRender,
                                                                                    MuseTalkDeviceRender))
