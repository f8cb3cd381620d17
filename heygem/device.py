"""The one place that asks for CUDA: device choice, cuDNN flags, precision, out-of-memory recovery.

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import sys
from typing import Callable, Iterator, Sequence, TypeVar

from heygem.errors import HeygemError

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


def configure_backends(deterministic: bool = False) -> None:
    """Set the process-wide cuDNN and matmul flags.

    Fast (default): cuDNN autotunes a kernel per input shape, which pays off
    because the engines run fixed-size batches; on Ampere and newer GPUs fp32
    matmuls and convolutions use TF32 tensor cores.
    Deterministic: the same input gives the same bits on every run, at some speed cost.
    """
    import torch

    cudnn = torch.backends.cudnn
    if deterministic:
        # cuBLAS needs a fixed workspace to be reproducible; it is read when CUDA starts.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        cudnn.benchmark = False
        cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        cudnn.benchmark = True
        cudnn.deterministic = False
        torch.use_deterministic_algorithms(False)
    use_tf32 = not deterministic and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch 2.9 and newer
        torch.backends.cuda.matmul.fp32_precision = "tf32" if use_tf32 else "ieee"
        cudnn.conv.fp32_precision = "tf32" if use_tf32 else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = use_tf32
        cudnn.allow_tf32 = use_tf32
    logger.debug("backends: deterministic=%s, cudnn.benchmark=%s, tf32=%s", deterministic, cudnn.benchmark, use_tf32)


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
