"""A copy of the MuseTalk mouth network as the model step runs it, kept beside the official files for quick starts.

The official files are pickles of float32 tensors (unet.pth: 3.4 GB); loading them means unpickling, checking
every key and shape, casting to the compute dtype and, for the fast step, turning each nearest-upsample
convolution into its transposed convolution (taps summed in float64, heygem.engines.musetalk.model_step).
After the first strict load the engine writes what the step ended up with (the UNet's and the VAE's state
after those transforms, in the dtype it runs in: float16 on a GPU) as one safetensors file::

    weights/musetalk/.heygem-cache/mouth-network-<key>.safetensors

and later starts read that file straight to the device (safetensors.torch.load_file) onto networks built
on the meta device: the same tensors, so the same frames, bit for bit. ``<key>`` names what the copy is
made from: each of the four UNet and VAE files' name, size, modification time and a digest of its first and
last MiB (torch writes its files as zip archives whose directory at the end holds a CRC-32 of every tensor,
so the tail's digest changes with any tensor's content), the step's options that change its tensors
(dtype, transposed upsampling, fused projections) and the diffusers and torch versions (the layers' names).
A changed official file gives another key: the copy is not used, the files are loaded and checked strictly
again, and a new copy replaces the old one. The copy is written under a temporary name and renamed (two
processes may start at once); a folder that cannot be written, or a copy that cannot be read, costs one
log line and the slow path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from heygem.engines.musetalk.files import MuseTalkFiles

logger = logging.getLogger("heygem")

FOLDER_NAME = ".heygem-cache"  # hidden beside the official folders, which users copy in as MuseTalk lays them out
PREFIX = "mouth-network-"
FORMAT = "heygem-musetalk-mouth-network-1"
EDGE_BYTES = 1 << 20  # bytes read at each end of an official file for its digest


def edge_digest(path: Path) -> str:
    """sha256 of the file's first and last EDGE_BYTES (the whole file when it is shorter than both)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        digest.update(handle.read(EDGE_BYTES))
        size = os.fstat(handle.fileno()).st_size
        if size > EDGE_BYTES:
            handle.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            digest.update(handle.read())
    return digest.hexdigest()


def source_identity(files: MuseTalkFiles) -> list:
    """What the copy is made from: name, size, modification time (ns) and edge digest of each UNet and VAE file."""
    identity = []
    for path in (files.unet, files.unet_config, files.vae, files.vae_config):
        stat = Path(path).stat()
        identity.append([Path(path).relative_to(files.folder).as_posix(), stat.st_size, stat.st_mtime_ns,
                         edge_digest(path)])
    return identity


class NetworkCopy:
    """The copy of one set of files for one step configuration: where it lies, reading it, writing it."""

    def __init__(self, files: MuseTalkFiles, options: dict):
        from importlib import metadata

        import torch

        self.folder = Path(files.folder) / FOLDER_NAME
        self.options = {key: str(value) for key, value in sorted(options.items())}
        description = {"format": FORMAT, "files": source_identity(files), "options": self.options,
                       "diffusers": metadata.version("diffusers"), "torch": torch.__version__.split("+")[0]}
        self.description = json.dumps(description, sort_keys=True)
        self.key = hashlib.sha256(self.description.encode()).hexdigest()[:24]
        self.path = self.folder / f"{PREFIX}{self.key}.safetensors"

    def read(self, device) -> dict | None:
        """The copy's tensors on ``device``, or None when there is none for these files and options, or it
        cannot be read (one log line: the official files are loaded instead)."""
        if not self.path.is_file():
            return None
        from safetensors import safe_open
        from safetensors.torch import load_file

        try:
            with safe_open(str(self.path), framework="pt") as handle:
                if (handle.metadata() or {}).get("source") != self.description:
                    raise ValueError("it was made from other files")
            tensors = load_file(str(self.path), device=str(device))
        except Exception as error:  # noqa: BLE001 - a damaged file raises anything; the files are there
            logger.warning("musetalk: cannot use the network copy %s (%s: %s); loading the official files",
                           self.path.name, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
            return None
        if str(device) == "cpu":
            # fresh allocations: on the CPU the file's tensors lie at its own offsets, and kernels that meet
            # data aligned otherwise than torch aligns it may sum in another order (1e-6 apart, measured)
            tensors = {name: tensor.clone() for name, tensor in tensors.items()}
        return tensors

    def write(self, state: dict) -> bool:
        """Write ``state`` (name -> tensor) as the copy, under a temporary name then renamed; copies of other
        files for the same options are removed. False, with one log line, when the folder cannot be written."""
        from safetensors.torch import save_file

        temporary = None
        try:
            self.folder.mkdir(exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=f".{PREFIX}", suffix=".tmp", dir=self.folder)
            os.close(handle)
            tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}
            save_file(tensors, temporary, metadata={"source": self.description})
            os.replace(temporary, self.path)
        except (OSError, RuntimeError, ValueError) as error:
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
            logger.info("musetalk: no network copy written in %s (%s); each start loads the official files",
                        self.folder, str(error).splitlines()[0] if str(error) else type(error).__name__)
            return False
        for other in self.folder.glob(f"{PREFIX}*.safetensors"):
            if other != self.path and other_options(other) == self.options:
                other.unlink(missing_ok=True)  # made from files that changed since
        return True


def other_options(path: Path) -> dict | None:
    """The step options another copy was made for (None when unreadable)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return json.loads((handle.metadata() or {}).get("source", "{}")).get("options")
    except Exception:  # noqa: BLE001 - anything unreadable is left alone
        return None
