"""The one place that asks for CUDA: device choice, cuDNN flags, precision, out-of-memory recovery.

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from heygem.errors import HeygemError
from heygem.runtime import timeline

logger = logging.getLogger("heygem")

PRECISIONS = ("auto", "fp32", "fp16", "bf16")

# Messages of RuntimeErrors that mean an allocation failed rather than a bug.
OUT_OF_MEMORY_MARKERS = (
    "out of memory",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "can't allocate memory",  # the CPU allocator
)

Output = TypeVar("Output")


def pick_device(name: str = "auto"):
    """Turn the --device option into a torch.device.

    "auto" picks the first CUDA GPU when there is one and the CPU otherwise;
    "cpu", "cuda" and "cuda:N" are taken as asked, and a CUDA request on a
    machine without a usable GPU raises HeygemError.
    """
    import torch

    name = (name or "auto").strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        index_text = name.partition(":")[2]
        if index_text and not index_text.isdigit():
            raise HeygemError(f"--device {name!r} is not valid: use auto, cpu, cuda or cuda:N with N a GPU number")
        if not torch.cuda.is_available():
            raise HeygemError(
                f"--device {name} asks for a CUDA GPU, but this torch build ({torch.__version__}) sees none; "
                "use --device cpu (slower) or install a CUDA build of torch and an NVIDIA driver")
        index = int(index_text) if index_text else torch.cuda.current_device()
        count = torch.cuda.device_count()
        if index >= count:
            raise HeygemError(f"--device {name} asks for GPU {index}, but this machine has {count} (0..{count - 1})")
        return torch.device("cuda", index)
    raise HeygemError(f"--device {name!r} is not valid: use auto, cpu, cuda or cuda:N")


def configure_backends(deterministic: bool = False, cudnn: bool = True, device=None, autotune: bool = False) -> None:
    """Set the process-wide cuDNN and matmul flags.

    Fast (default): cuDNN picks each convolution's kernel by its heuristics, without
    timing the candidates: autotuning (``cudnn.benchmark``) added 3.5 s to the wav2lip
    generator's start on an H200 and found kernels no faster (docs/benchmarks.md,
    "Streaming and start-up latency"), and it searches again for every new input
    shape (the blend's blurs change shape with the face box). ``autotune`` (benchmark
    mode) times the candidates once per shape: for networks that only see fixed-size
    batches (FixedBatchRunner) and run long enough to pay the search back, as MuseTalk's
    step, whose speeds were measured so. On Ampere and newer GPUs fp32 matmuls and
    convolutions use TF32 tensor cores.
    Deterministic: the same input gives the same bits on every run, at some speed cost.
    ``cudnn=False`` switches cuDNN off, only to measure what it buys; when cuDNN is
    asked for but does not work (see cudnn_problem) it is switched off with one warning.
    ``device`` is where the networks will run: cuDNN is checked on it when it is a GPU,
    and not at all when it is the CPU (so a CPU run never starts CUDA); None checks the current GPU.
    """
    import torch

    backend = torch.backends.cudnn
    if deterministic:
        # cuBLAS needs a fixed workspace to be reproducible; it is read when CUDA starts.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        backend.benchmark = False
        backend.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        backend.benchmark = autotune
        backend.deterministic = False
        if torch.are_deterministic_algorithms_enabled():  # the call imports torch's compiler: ~1 s, so only when needed
            torch.use_deterministic_algorithms(False)
    runs_on_gpu = device is None or torch.device(device).type == "cuda"
    problem = cudnn_problem(device) if cudnn and runs_on_gpu else None
    if problem is not None:
        _warn_once(problem)
    backend.enabled = cudnn and problem is None
    use_tf32 = not deterministic and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch 2.9 and newer
        torch.backends.cuda.matmul.fp32_precision = "tf32" if use_tf32 else "ieee"
        backend.conv.fp32_precision = "tf32" if use_tf32 else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = use_tf32
        backend.allow_tf32 = use_tf32
    logger.debug("backends: deterministic=%s, cudnn.enabled=%s, cudnn.benchmark=%s, tf32=%s",
                 deterministic, backend.enabled, backend.benchmark, use_tf32)


_WARNED: set[str] = set()
# One CUDA graph capture at a time in the process: torch registers the random generators' state with
# the capture process-wide, and two captures at once (workers on two GPUs starting together) fail.
_CAPTURE_LOCK = threading.Lock()
# Graphs whose capture failed are kept, never destroyed: destroying one throws inside torch's
# destructor, which ends the whole process.
_FAILED_GRAPHS: list = []


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("%s", message)


def cudnn_problem(device=None) -> str | None:
    """Why cuDNN cannot be used although CUDA can, in one line; None when it works or there is no CUDA.

    Checks that torch finds the library, that its version loads, and that one tiny
    convolution runs through it on ``device`` (default: the current GPU), since a
    missing sub-library only shows up there.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    advice = ("heygem runs the convolutions without it, several times slower; install the torch build "
              "for your CUDA version (it brings a matching cuDNN) to get the speed back")
    if not torch.backends.cudnn.is_available():
        return f"CUDA works but torch {torch.__version__} finds no cuDNN library: {advice}"
    try:
        version = torch.backends.cudnn.version()  # raises when the loaded cuDNN does not match the build
        device = torch.device(device if device is not None else "cuda")
        # only the enabled flag, set and restored by hand: cudnn.flags() also reads and restores the TF32 flags,
        # which raises in torch 2.11 once configure_backends has set the convolutions' precision alone
        was_enabled = torch.backends.cudnn.enabled
        torch.backends.cudnn.enabled = True
        try:
            probe = torch.ones(1, 1, 4, 4, device=device)  # (1, 1, 4, 4)
            torch.nn.functional.conv2d(probe, torch.ones(1, 1, 3, 3, device=device))  # (1, 1, 2, 2)
            torch.cuda.synchronize(device)
        finally:
            torch.backends.cudnn.enabled = was_enabled
    except RuntimeError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"cuDNN does not work here ({reason}): {advice}"
    if version is None:
        return f"CUDA works but cuDNN reports no version: {advice}"
    return None


def autocast_dtype(device, precision: str = "auto"):
    """The dtype autocast should use for ``precision`` on ``device``, or None for plain fp32.

    "auto" is fp16 on CUDA (tensor cores, half the memory) and fp32 on the CPU,
    where half precision is slower, not faster.
    """
    import torch

    if precision not in PRECISIONS:
        raise HeygemError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "auto":
        precision = "fp16" if device.type == "cuda" else "fp32"
    return {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]


@contextlib.contextmanager
def inference_context(device, precision: str = "auto") -> Iterator[None]:
    """torch.inference_mode plus autocast at the precision ``autocast_dtype`` picks."""
    import torch

    dtype = autocast_dtype(device, precision)
    with torch.inference_mode():
        if dtype is None:
            yield
        else:
            with torch.autocast(device_type=device.type, dtype=dtype):
                yield


def upload(tensor, device):
    """``tensor`` (on the CPU) on ``device``, the copy queued behind the work there rather than waited for: on a
    GPU it goes through page-locked memory (torch's cached pinned blocks, kept until the copy is done). A copy
    from pageable memory larger than the driver's staging buffer waits for all the work queued before it, and
    a thread that feeds the GPU would then leave it idle while it prepares the next batch."""
    import torch

    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def is_out_of_memory(error: BaseException) -> bool:
    """True when ``error`` means an allocation failed (GPU or CPU), so a smaller batch may work."""
    torch = sys.modules.get("torch")  # whoever raised a torch error has imported it already
    if torch is not None and isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    if isinstance(error, MemoryError):
        return True
    if isinstance(error, RuntimeError):
        message = str(error)
        return any(marker.lower() in message.lower() for marker in OUT_OF_MEMORY_MARKERS)
    return False


def release_cached_memory() -> None:
    """Give cached but unused CUDA memory back so a retry starts from a clean pool."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_in_batches(
    run_batch: Callable[[Sequence], Output], items: Sequence, batch_size: int
) -> tuple[list[Output], int]:
    """Call ``run_batch`` on consecutive slices of ``items``, halving the batch on out-of-memory.

    ``items`` is anything that slices and has a length (a list, a numpy array, a
    tensor). Returns the outputs of the successful calls in order, and the batch
    size that worked, so a caller can start there next time. Concatenating the
    outputs gives one result per item whatever batch sizes were used.
    Raises HeygemError when even a single item does not fit.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    outputs: list[Output] = []
    start = 0
    while start < len(items):
        chunk = items[start:start + batch_size]
        try:
            outputs.append(run_batch(chunk))
            start += len(chunk)
            continue
        except Exception as error:  # noqa: BLE001 - anything but an out-of-memory is re-raised
            if not is_out_of_memory(error):
                raise
            if batch_size == 1:
                raise HeygemError(
                    "out of memory even with a batch of 1; close other programs that use the GPU, "
                    "or use --device cpu") from error
        # Outside the except block, so the traceback no longer holds the failed batch's tensors.
        failed_size, batch_size = batch_size, batch_size // 2
        release_cached_memory()
        logger.warning("out of memory with a batch of %d, retrying with %d", failed_size, batch_size)
    return outputs, batch_size


class _FixedBatch:
    """What the runner keeps for one batch size: static input buffers and, on CUDA, a captured graph."""

    def __init__(self, batch_size: int, item_layout: tuple, inputs: list):
        self.batch_size = batch_size
        self.item_layout = item_layout  # per input: (shape of one item, dtype); a change needs new buffers
        self.inputs = inputs  # one (batch_size, ...) buffer per network input, filled before each run
        self.graph = None  # torch.cuda.CUDAGraph once captured
        self.output = None  # the graph's static output, overwritten by each replay


class FixedBatchRunner:
    """Runs a network on any number of items in batches of exactly ``batch_size``.

    On CUDA the last batch is padded by repeating its last item, and the padding
    is dropped from the result, so the network only ever sees one input shape:
    cuDNN picks its kernels once, and the forward pass can be captured once
    as a CUDA graph (static input and output buffers) and replayed for every
    batch; ``warm_up`` does that before the first batch arrives. On the CPU, where one
    shape buys nothing, the last batch runs at its own size (``pad_last_batch`` chooses
    either way). When the device runs out of memory the batch size is halved (a new
    graph is captured) and the batch retried, down to 1.

    The runner takes the module over: it is put in eval mode, its weights are
    converted to the compute precision on CUDA (on the CPU autocast is used
    instead, which keeps fp32 weights) and to channels-last when asked.
    Inputs must already be on ``device``; nothing crosses the bus inside the
    runner. It is not thread-safe: one runner per thread.
    """

    def __init__(self, module, device, batch_size: int, precision: str = "auto", channels_last: bool = False,
                 use_cuda_graph: bool = False, name: str = "network", pad_last_batch: bool | None = None):
        import torch

        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.device = torch.device(device)
        self.batch_size = batch_size  # lowered for good when a batch runs out of memory
        self.precision = precision
        self.compute_dtype = autocast_dtype(self.device, precision)  # None: fp32
        # On CUDA the weights themselves are cast: no per-op casts to run (or to capture in a graph).
        self.cast_weights = self.compute_dtype is not None and self.device.type == "cuda"
        self.channels_last = channels_last
        self.use_cuda_graph = use_cuda_graph and self.device.type == "cuda"
        # padding costs whole extra items; only cuDNN's search and CUDA graphs need one shape
        self.pad_last_batch = self.device.type == "cuda" if pad_last_batch is None else pad_last_batch
        self.name = name
        module.eval()
        if self.cast_weights:
            module.to(dtype=self.compute_dtype)
        if channels_last:  # 4-D weights only: some networks (GFPGAN's modulated convolutions) hold 5-D ones
            for parameter in module.parameters():
                if parameter.dim() == 4:
                    parameter.data = parameter.data.contiguous(memory_format=torch.channels_last)
        self.module = module
        self._batch: _FixedBatch | None = None

    def __call__(self, *inputs):
        """One output row per item: ``inputs`` are tensors of N items each (dim 0) on the device.

        Returns the module's output for all N items, (N, ...), on the device;
        floating-point outputs come back as float32 whatever precision ran inside.
        """
        import torch

        count = self._check_inputs(inputs)
        device_scope = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        results = None
        start = 0
        with device_scope:
            while start < count:
                size = min(self.batch_size, count - start)
                try:
                    # always in inference mode, whatever the caller's mode: the reused buffers are then inference
                    # tensors on every call (one made in inference mode cannot be written outside it); the
                    # results below are ordinary tensors, so callers may change them in place
                    with torch.inference_mode():
                        outputs = self._run_batch(inputs, start, size)  # (batch_size, ...), padding rows included
                    if results is None:
                        dtype = torch.float32 if outputs.is_floating_point() else outputs.dtype
                        results = torch.empty((count, *outputs.shape[1:]), dtype=dtype, device=self.device)
                    results[start:start + size].copy_(outputs[:size])  # (size, ...), padding dropped
                    start += size
                    continue
                except Exception as error:  # noqa: BLE001 - anything but an out-of-memory is re-raised
                    if not is_out_of_memory(error):
                        raise
                    if self.batch_size == 1:
                        raise HeygemError(
                            f"the {self.name} ran out of memory even with a batch of 1; close other programs "
                            "that use the GPU, or use --device cpu") from error
                # Outside the except block, so the traceback no longer holds the failed batch's tensors.
                failed_size, self.batch_size = self.batch_size, self.batch_size // 2
                outputs = self._batch = None  # buffers, graph and its output were sized for the failed batch
                release_cached_memory()
                logger.warning("%s: out of memory with a batch of %d, retrying with %d",
                               self.name, failed_size, self.batch_size)
        return results

    def warm_up(self, *item_layouts: tuple[tuple[int, ...], object]) -> None:
        """Ready the batch buffers, cuDNN's kernels and (on CUDA) the graph for inputs of these layouts, one
        (shape of one item, dtype) per input, before the first batch: the loading thread calls it while the
        first frames are decoded and tracked, so the first batch is a plain replay. Does nothing on the CPU;
        running out of memory here leaves it to the first batch (which halves the batch size)."""
        import torch

        if self.device.type != "cuda":
            return
        examples = [torch.empty((1, *shape), dtype=dtype, device=self.device) for shape, dtype in item_layouts]
        with timeline.span(f"{self.name} warm-up"), torch.cuda.device(self.device):
            try:
                with torch.inference_mode():
                    batch = self._batch_for(examples)
                    if self.use_cuda_graph:
                        self._capture(batch)
                    else:
                        with inference_context(self.device, "fp32" if self.cast_weights else self.precision):
                            self.module(*batch.inputs)
                torch.cuda.synchronize(self.device)
            except Exception as error:  # noqa: BLE001 - anything but an out-of-memory is re-raised
                if not is_out_of_memory(error):
                    raise
            else:
                return
        self._batch = None  # outside the except block: the traceback no longer holds the buffers
        release_cached_memory()
        logger.debug("%s: out of memory while warming up batches of %d", self.name, self.batch_size)

    def _check_inputs(self, inputs) -> int:
        if not inputs:
            raise ValueError("FixedBatchRunner needs at least one input tensor")
        count = len(inputs[0])
        for tensor in inputs:
            if tensor.device != self.device and not (tensor.device.type == self.device.type == "cuda"
                                                    and self.device.index is None):
                raise ValueError(f"inputs must already be on {self.device}, got one on {tensor.device}")
            if len(tensor) != count:
                raise ValueError(f"inputs have different item counts: {[len(tensor) for tensor in inputs]}")
        if count == 0:
            raise ValueError("FixedBatchRunner got no items to run")
        return count

    def _run_batch(self, inputs, start: int, size: int):
        """Run items start..start+size, padded to the batch size when padding; returns the
        (batch_size, ...) output, or (size, ...) for an unpadded short batch."""
        batch = self._batch_for(inputs)
        for buffer, tensor in zip(batch.inputs, inputs):
            buffer[:size].copy_(tensor[start:start + size])  # casts and changes layout in the same copy
            if size < batch.batch_size and self.pad_last_batch:
                buffer[size:].copy_(tensor[start + size - 1])  # repeat the last item into the padding rows
        unpadded = size < batch.batch_size and not self.pad_last_batch  # a short batch at its own size
        if not unpadded:
            if self.use_cuda_graph and batch.graph is None:
                self._capture(batch)
            if batch.graph is not None:
                batch.graph.replay()
                return batch.output
        inputs = [buffer[:size] for buffer in batch.inputs] if unpadded else batch.inputs
        with inference_context(self.device, "fp32" if self.cast_weights else self.precision):
            return self.module(*inputs)

    def _batch_for(self, inputs) -> _FixedBatch:
        """The buffers for the current batch size and these inputs' item shapes, made when they change."""
        import torch

        item_layout = tuple((tuple(tensor.shape[1:]), tensor.dtype) for tensor in inputs)
        batch = self._batch
        if batch is not None and batch.batch_size == self.batch_size and batch.item_layout == item_layout:
            return batch
        self._batch = None
        buffers = []
        for tensor in inputs:
            dtype = self.compute_dtype if self.cast_weights and tensor.is_floating_point() else tensor.dtype
            memory_format = torch.channels_last if self.channels_last and tensor.dim() == 4 else torch.contiguous_format
            buffer = torch.empty((self.batch_size, *tensor.shape[1:]), dtype=dtype, device=self.device,
                                 memory_format=memory_format)  # (batch_size, ...) as the network will see it
            buffers.append(buffer.zero_())
        self._batch = _FixedBatch(self.batch_size, item_layout, buffers)
        return self._batch

    def _capture(self, batch: _FixedBatch) -> None:
        """Capture the forward pass on ``batch``'s buffers as a CUDA graph, or fall back to running it op by op.

        Warm-up runs on a side stream first, as CUDA graph capture wants: they let
        cuDNN choose its kernels and the allocator settle before anything is recorded.
        A failure in those runs is the module's own (a compiled module's compiler, say), not the
        capture's: it is raised to the caller, which would meet it op by op all the same.
        """
        import torch

        side_stream = torch.cuda.Stream(self.device)
        side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side_stream), torch.inference_mode():
            for _ in range(3):
                self.module(*batch.inputs)
        torch.cuda.current_stream(self.device).wait_stream(side_stream)
        graph = None
        try:
            with _CAPTURE_LOCK, _no_cyclic_collection():
                graph = torch.cuda.CUDAGraph()
                # thread_local: other stages may use the GPU from their own threads while this one captures
                with torch.inference_mode(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    output = self.module(*batch.inputs)
        except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager
            if graph is not None:
                _FAILED_GRAPHS.append(graph)
            if is_out_of_memory(error):
                raise
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            logger.warning("%s: CUDA graph capture failed (%s); running it op by op", self.name, reason)
            self.use_cuda_graph = False
            return
        batch.graph, batch.output = graph, output
        logger.debug("%s: captured a CUDA graph for batches of %d", self.name, batch.batch_size)


@contextlib.contextmanager
def _no_cyclic_collection():
    """Python's cycle collector off while a graph is captured: run from another thread, it could free a
    tensor of the capturing device there, and freeing records an event on that tensor's stream."""
    import gc

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def gpu_expected() -> bool:
    """Whether a job here will find a CUDA GPU, judged without importing torch (seconds, which a cold
    start would wait for): on Linux, NVIDIA's device files and an installed torch; elsewhere torch's
    own answer (:func:`gpu_present`). Where the guess is wrong (a driver torch cannot use), the engine
    runs on the CPU and a device render path chosen on it runs there too, correctly, only slower."""
    if not sys.platform.startswith("linux"):
        return gpu_present()
    import importlib.util

    return bool(glob.glob("/dev/nvidia[0-9]*")) and importlib.util.find_spec("torch") is not None


def gpu_present() -> bool:
    """Whether torch sees a CUDA GPU; cheap on a machine without NVIDIA devices (torch is not imported)."""
    if sys.platform.startswith("linux") and not glob.glob("/dev/nvidia[0-9]*"):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def worker_devices() -> list[str | None]:
    """One entry per worker to start: a GPU name each when there are several, else [None] (auto)."""
    if sys.platform.startswith("linux") and not glob.glob("/dev/nvidia[0-9]*"):
        return [None]  # no NVIDIA GPU here: do not import torch just to count none
    try:
        import torch
    except ImportError:
        return [None]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{index}" for index in range(count)] if count > 1 else [None]
