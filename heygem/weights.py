"""Finding and loading the public network weights the user put in weights/.

Nothing is ever downloaded. Checkpoints are read with ``weights_only=True``, so a
file that holds anything but tensors and plain values is refused instead of
having its pickled code run. torch is imported inside the functions.
"""

from __future__ import annotations

import logging
from pathlib import Path

from heygem.errors import HeygemError

logger = logging.getLogger("heygem")

# The released Wav2Lip generator files, best first: the GAN variant gives sharper mouths.
WAV2LIP_FILE_NAMES = ("wav2lip_gan.pth", "wav2lip.pth")
WAV2LIP_EXPECTED = "the official wav2lip_gan.pth or wav2lip.pth from the Wav2Lip release"

SHOWN_KEYS = 3  # how many missing or unexpected keys an error message lists


def find_wav2lip_checkpoint(weights_dir: Path) -> Path | None:
    """The Wav2Lip checkpoint in ``weights_dir`` (file names matched case-insensitively), or None.

    wav2lip_gan.pth is preferred over wav2lip.pth when both are there.
    """
    weights_dir = Path(weights_dir)
    if not weights_dir.is_dir():
        return None
    files_by_name: dict[str, Path] = {}
    for path in sorted(weights_dir.iterdir()):
        if path.is_file():
            files_by_name.setdefault(path.name.lower(), path)
    for name in WAV2LIP_FILE_NAMES:
        if name in files_by_name:
            return files_by_name[name]
    return None


def load_state_dict_strict(module, checkpoint_path: Path, what: str = "Wav2Lip",
                           expected: str = WAV2LIP_EXPECTED) -> None:
    """Load ``checkpoint_path`` into ``module`` with every key and shape matching.

    Accepts the training layout ``{"state_dict": ..., "optimizer": ..., "global_step": ...,
    "global_epoch": ...}`` and a bare state dict, with or without the "module."
    prefix that DataParallel adds. Raises HeygemError naming the file and the first
    problems found; ``expected`` says which file would fit.
    """
    checkpoint_path = Path(checkpoint_path)
    state_dict, global_step = read_state_dict(checkpoint_path, what, expected)
    problem = describe_mismatch(module.state_dict(), state_dict)
    if problem:
        raise HeygemError(f"{checkpoint_path} does not fit {what}: {problem}; expected {expected}")
    try:
        module.load_state_dict(state_dict, strict=True)
    except RuntimeError as error:
        first_line = str(error).strip().splitlines()[0]
        raise HeygemError(f"{checkpoint_path} does not fit {what}: {first_line}; expected {expected}") from None
    step_note = f" (trained for {global_step} steps)" if global_step is not None else ""
    logger.info("loaded %s weights from %s%s", what, checkpoint_path, step_note)


def read_state_dict(checkpoint_path: Path, what: str, expected: str) -> tuple[dict, int | None]:
    """The tensors of a checkpoint with any "module." prefix removed, and its training step if recorded."""
    import torch

    if not checkpoint_path.is_file():
        raise HeygemError(f"{what} checkpoint not found: {checkpoint_path}; expected {expected}")
    try:
        payload = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to unpickle means the file is not usable
        raise HeygemError(
            f"{checkpoint_path} is not a readable {what} checkpoint ({describe_unreadable(checkpoint_path, error)}); "
            f"expected {expected}") from None

    global_step = None
    if isinstance(payload, dict) and isinstance(payload.get("state_dict"), dict):
        global_step = payload.get("global_step")
        payload = payload["state_dict"]
    if not isinstance(payload, dict) or not payload or not all(
            isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in payload.items()):
        raise HeygemError(
            f"{checkpoint_path} holds no {what} weights (neither a state dict nor a dict with 'state_dict'); "
            f"expected {expected}")
    state_dict = {key.removeprefix("module."): value for key, value in payload.items()}
    return state_dict, global_step if isinstance(global_step, int) else None


def describe_unreadable(path: Path, error: Exception) -> str:
    """A short reason why torch.load failed, with a hint for the usual download mistakes."""
    with open(path, "rb") as file:
        head = file.read(64)
    if head.startswith(b"version https://git-lfs"):
        return "it is a Git LFS pointer, not the file itself; fetch the real file"
    if head.lstrip().lower().startswith((b"<!doctype", b"<html")):
        return "it is a web page, not the weights; the download went wrong"
    if "weights only load failed" in str(error).lower():
        return "it holds Python objects besides tensors, which heygem does not load"
    if not head.startswith((b"PK\x03\x04", b"\x80")):  # torch's zip format, or a bare pickle
        return f"{path.stat().st_size} bytes that are not a torch file"
    lines = str(error).strip().splitlines()
    return f"torch says {type(error).__name__}: {lines[0] if lines else 'no details'}"


def describe_mismatch(wanted: dict, found: dict) -> str:
    """Say what differs between two state dicts: missing keys, unexpected keys or the first shape."""
    missing = [key for key in wanted if key not in found]
    unexpected = [key for key in found if key not in wanted]
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing keys ({list_keys(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys ({list_keys(unexpected)})")
    if parts:
        return ", ".join(parts)
    for key, tensor in wanted.items():
        if tuple(found[key].shape) != tuple(tensor.shape):
            return f"{key} has shape {tuple(found[key].shape)} in the file but {tuple(tensor.shape)} in the model"
    return ""


def list_keys(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else "")
