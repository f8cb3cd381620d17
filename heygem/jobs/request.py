"""The one check of a job request, for every entry point: the page, gradio_client, REST, batch and the CLI.

A request's options (JSON text of at most 64 kB and four levels, finite numbers only) are flattened to
dotted names, checked against heygem.config (names, types, finite numbers, ranges, choices, bitrates,
device names), the device is checked against this machine's, and for a remote client (anyone but
the local command line) limited to what a server may let strangers ask for: files named by options
must be names of checkpoint files inside the server's weights folder, and process counts stay
under the server's caps (heygem.jobs.limits). The weight files an option needs must be there (a
missing file is the user's to fix before anything is queued). Uploaded file names must be plain
names of a media type.
"""

from __future__ import annotations

import json
import math
import unicodedata
from pathlib import Path

from heygem.config import Config, apply_overrides, iter_options
from heygem.errors import HeygemError
from heygem.jobs.limits import PROCESS_OPTIONS, ProcessCaps, check_process_caps
from heygem.media.probing import AUDIO_SUFFIXES, IMAGE_SUFFIXES, VIDEO_SUFFIXES
from heygem.weights import (
    WAV2LIP_FILE_NAMES,
    find_wav2lip_checkpoint,
    require_gfpgan_checkpoint,
    require_s3fd_checkpoint,
    weights_dir,
)

# Options whose value names a file on the server (kind "weights file" in heygem.config). A remote client
# may give only the name of a checkpoint file in the server's weights folder; paths are for the local
# command line and config files.
SERVER_FILE_OPTIONS = tuple(f"{section}.{leaf.name}" for section, leaf in iter_options()
                            if leaf.metadata.get("kind") == "weights file")
CHECKPOINT_SUFFIXES = {".pth", ".pt", ".ckpt", ".bin", ".safetensors"}
MAX_OPTIONS_BYTES = 64 * 1024  # longest options JSON a request may send
MAX_OPTIONS_DEPTH = 4  # {"face": {"pads": [0, 10, 0, 0]}} is three levels deep
MAX_UPLOAD_NAME_BYTES = 255  # longest upload file name accepted (a file name on most filesystems)
UPLOAD_SUFFIXES = {  # what each upload may be, by the name's extension
    "face": VIDEO_SUFFIXES | IMAGE_SUFFIXES,
    "audio": AUDIO_SUFFIXES | VIDEO_SUFFIXES,
}


def flatten_options(options: dict | None) -> dict:
    """Options as flat dotted keys: {"face": {"pads": x}} and {"face.pads": x} both give the latter."""
    flat: dict = {}
    for key, value in (options or {}).items():
        if "." not in key and isinstance(value, dict):
            for leaf, leaf_value in value.items():
                flat[f"{key}.{leaf}"] = leaf_value
        else:
            flat[key] = value
    return flat


def _refuse_constant(name: str):
    raise HeygemError(f"options may hold finite numbers only, not {name}")


def _depth(value, limit: int) -> int:
    """How deep ``value`` nests (a scalar is 0), counting no further than ``limit`` + 1."""
    if limit < 0 or not isinstance(value, (dict, list)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(item, limit - 1) for item in items), default=0)


def parse_options(text: str | None) -> dict:
    """The options a client sent as JSON text, as flat dotted keys; HeygemError says what is wrong
    (not JSON, not an object, NaN or infinity, longer than 64 kB, nested deeper than options go)."""
    text = text or "{}"
    if len(text.encode("utf-8", "surrogatepass")) > MAX_OPTIONS_BYTES:
        raise HeygemError(f"options is longer than {MAX_OPTIONS_BYTES // 1024} kB: send only the options you change")
    try:
        options = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise HeygemError("options nest too deeply: send an object of option names and values") from None
    except ValueError as error:
        raise HeygemError(f"options is not valid JSON: {error}") from None
    if not isinstance(options, dict):
        raise HeygemError('options must be a JSON object, e.g. {"media.output_height": 360}')
    if _depth(options, MAX_OPTIONS_DEPTH) > MAX_OPTIONS_DEPTH:
        raise HeygemError('options nest too deeply: send {"section.name": value}, e.g. {"face.pads": [0, 20, 0, 0]}')
    return flatten_options(options)


def limit_remote_options(flat: dict, folder: Path | None = None) -> dict:
    """``flat`` ({"section.name": value}) with server-file options turned from a file name in the
    weights folder (``folder``, default heygem.weights.weights_dir) into its path; HeygemError for a
    path, a missing file or anything else."""
    folder = Path(folder) if folder is not None else weights_dir()
    limited = dict(flat)
    for key in SERVER_FILE_OPTIONS:
        value = limited.get(key)
        if value is None or value == "":
            continue
        name = str(value)
        if not isinstance(value, str) or Path(name).name != name or name in (".", "..") or "\\" in name:
            raise HeygemError(f"{key} takes the name of a file in the server's weights folder, not a path")
        candidate = folder / name
        if not candidate.is_file():
            raise HeygemError(f"{key}: the server's weights folder has no file named {name!r}")
        if not candidate.resolve().is_relative_to(folder.resolve()):
            raise HeygemError(f"{key}: {name!r} leads outside the server's weights folder; name a checkpoint "
                              "file that is in it")
        limited[key] = str(candidate)
    return limited


def looks_like_checkpoint(path: Path) -> bool:
    """Whether ``path`` has a checkpoint's suffix and starts as torch.save (a zip or a pickle) or a
    safetensors file does; a text file, an image or a system file does not."""
    if path.suffix.lower() not in CHECKPOINT_SUFFIXES:
        return False
    try:
        with open(path, "rb") as handle:
            head = handle.read(16)
    except OSError:
        return False
    if head.startswith(b"PK\x03\x04") or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return True
    if len(head) >= 9:  # safetensors: an 8-byte little-endian header size, then the JSON header
        header_size = int.from_bytes(head[:8], "little")
        return 0 < header_size < 100 * 2**20 and head[8:9] == b"{"
    return False


def check_checkpoint_files(flat: dict) -> None:
    """HeygemError unless every server-file option of ``flat`` (already turned into paths by
    :func:`limit_remote_options`) is a checkpoint file; the message names the option, not the file's size."""
    for key in SERVER_FILE_OPTIONS:
        value = flat.get(key)
        if value and not looks_like_checkpoint(Path(value)):
            raise HeygemError(f"{key}: {Path(value).name!r} is not a checkpoint file (.pth, .pt, .ckpt, .bin or "
                              ".safetensors as torch or safetensors write them)")


def check_device(name: str) -> None:
    """HeygemError unless the engine.device ``name`` (auto, cpu, cuda, cuda:N) exists on this machine."""
    name = (name or "auto").strip().lower()
    if name in ("auto", "cpu"):
        return
    from heygem.runtime.device import gpu_present

    count = 0
    if gpu_present():  # cheap where there is no NVIDIA device: torch is not imported then
        import torch

        count = torch.cuda.device_count()
    index = int(name.partition(":")[2] or 0)
    if count == 0:
        raise HeygemError(f"--device {name} asks for a CUDA GPU, but this machine has none: use auto or cpu")
    if index >= count:
        raise HeygemError(f"--device {name} asks for GPU {index}, but this machine has {count} "
                          f"(cuda:0 to cuda:{count - 1})")


def check_weight_files(config: Config, folder: Path | None = None, remote: bool = False) -> None:
    """HeygemError when an option asks for a weights file the weights folder lacks (--engine wav2lip
    without --checkpoint, --engine musetalk, --restorer gfpgan, --detector s3fd). ``remote``: the
    message is for a client of a server: what the server lacks and what to choose instead, not where
    its files are or which command fetches them."""
    missing = _missing_weights(config, folder)
    if missing is None:
        return
    local_message, asked, needed, instead = missing
    if remote:
        raise HeygemError(f"{asked} needs {needed}, which this server does not have: choose {instead}, or ask the "
                          "server's operator to add it")
    raise HeygemError(local_message)


def _missing_weights(config: Config, folder: Path | None) -> tuple[str, str, str, str] | None:
    """(the command line's message, the option asked for, what it needs, what to choose instead) for the
    first weights file an option needs and the folder lacks; None when nothing is missing."""
    folder = Path(folder) if folder is not None else weights_dir()
    if config.engine.name == "wav2lip" and not config.engine.checkpoint and find_wav2lip_checkpoint(folder) is None:
        return (f"--engine wav2lip needs a checkpoint: put {' or '.join(WAV2LIP_FILE_NAMES)} into {folder} or pass "
                "--checkpoint PATH", "engine.name wav2lip", f"a Wav2Lip checkpoint ({' or '.join(WAV2LIP_FILE_NAMES)})",
                "engine.name auto or landmark")
    if config.engine.name == "musetalk":  # its libraries and files, before the job is queued
        from heygem.engines.musetalk import MuseTalkKind

        problem = MuseTalkKind().missing(folder)
        if problem:
            return problem, "engine.name musetalk", "MuseTalk's files and libraries", "engine.name auto or landmark"
    if config.restore.enabled and config.restore.method == "gfpgan":
        try:
            require_gfpgan_checkpoint(folder)
        except HeygemError as problem:
            return str(problem), "restore.method gfpgan", "GFPGANv1.4.pth", "restore.method auto, sharpen or none"
    if config.face.detector == "s3fd":
        try:
            require_s3fd_checkpoint(folder)
        except HeygemError as problem:
            return str(problem), "face.detector s3fd", "the S3FD detector's s3fd.pth", "face.detector mediapipe"
    return None


def check_options(options: dict | None, base: Config, *, remote: bool = False,
                  folder: Path | None = None, caps: ProcessCaps | None = None) -> tuple[dict, Config]:
    """(the options as flat dotted keys, the config they give on top of ``base``) for a job request;
    ``remote``: the request comes from a client of a server (see :func:`limit_remote_options`; process
    counts are held under ``caps``, default heygem.jobs.limits.ProcessCaps.for_machine).
    HeygemError says what is wrong; nothing else is raised for a bad option."""
    flat = flatten_options(options)
    if remote:
        flat = limit_remote_options(flat, folder)
    try:
        config = apply_overrides(base, flat)
    except RecursionError:
        raise HeygemError("options nest too deeply: send {\"section.name\": value}") from None
    if remote:
        check_checkpoint_files(flat)
        check_process_caps({key: getattr(config.run, key.split(".", 1)[1]) for key in PROCESS_OPTIONS if key in flat},
                           caps)
    check_device(config.engine.device)
    check_weight_files(config, folder, remote)
    return flat, config


def check_speech(audio_given: bool, text: str | None, own_audio: bool = False) -> None:
    """HeygemError unless a request names exactly one kind of speech: an audio file, text to speak, or
    (``own_audio``) the face video's own sound."""
    if text and (audio_given or own_audio):
        raise HeygemError("give speech or text, not both: clear one of them")
    if not text and not audio_given and not own_audio:
        raise HeygemError("add speech (an audio file or a recording) or text to speak, or use the face video's "
                          "own sound")


def finite_json(value):
    """``value`` with every NaN or infinity (a row stored before requests were checked) as None, so that
    a stored job always turns into valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite_json(item) for item in value]
    return value


def check_speed(speed: float) -> float:
    """The speaking speed of a text job, a finite number from 0.5 to 2.0; HeygemError otherwise."""
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.5 <= speed <= 2.0:
        raise HeygemError(f"speed must be a number from 0.5 to 2.0, not {speed!r}")
    return float(speed)


def check_upload_name(name: str, role: str) -> None:
    """HeygemError unless ``name`` is a plain file name of a type the ``role`` ("face" or "audio") takes.

    A remote client's file name is never a path: one with folder parts, control characters (NUL,
    newlines, U+0085, the Unicode line and paragraph separators), only dots, or over 255 bytes is refused
    rather than quietly renamed, and so is an extension that is not a video, image or audio type (the
    contents are probed as well, once the file is stored)."""
    shown = repr(name[:60] + ("..." if len(name) > 60 else ""))
    if any(unicodedata.category(character) in ("Cc", "Cs", "Zl", "Zp") for character in name):
        raise HeygemError(f"the {role} file name {shown} has control characters (such as NUL or a line break); "
                          "rename the file")
    if "/" in name or "\\" in name or name.strip(" .") == "":
        raise HeygemError(f"the {role} file name {shown} is not a plain file name; send the file's own name "
                          "without folders")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_UPLOAD_NAME_BYTES:
        raise HeygemError(f"the {role} file name is longer than {MAX_UPLOAD_NAME_BYTES} bytes; rename the file")
    suffix = ("." + name.rpartition(".")[2].lower()) if "." in name else ""
    if suffix not in UPLOAD_SUFFIXES[role]:
        kinds = "a video or a photo" if role == "face" else "an audio file or a video with sound"
        raise HeygemError(f"the {role} file {shown} is not {kinds} by its extension; send e.g. "
                          + (".mp4, .mov, .jpg or .png" if role == "face" else ".wav, .mp3, .m4a or .mp4"))
