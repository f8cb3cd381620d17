"""The one check of a job request, for every entry point: the page, gradio_client, REST, batch and the CLI.

A request's options are flattened to dotted names, checked against heygem.config (names, types,
ranges, choices) and, for a remote client (anyone but the local command line), limited to what a
server may let strangers ask for: files named by options must be file names inside the server's
weights folder. The weight files an option needs must be there (a missing file is the user's to
fix before anything is queued). Uploaded file names must be plain names of a media type.
"""

from __future__ import annotations

import json
from pathlib import Path

from heygem.config import Config, apply_overrides
from heygem.errors import HeygemError
from heygem.media.probing import AUDIO_SUFFIXES, IMAGE_SUFFIXES, VIDEO_SUFFIXES
from heygem.weights import require_gfpgan_checkpoint, require_s3fd_checkpoint, weights_dir

# Options whose value names a file on the server. A remote client (REST) may give only the name of a
# file in the server's weights folder; paths are for the local command line and config files.
SERVER_FILE_OPTIONS = ("engine.checkpoint",)
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


def parse_options(text: str | None) -> dict:
    """The options a client sent as JSON text, as flat dotted keys; HeygemError says what is wrong."""
    try:
        options = json.loads(text or "{}")
    except ValueError as error:
        raise HeygemError(f"options is not valid JSON: {error}") from None
    if not isinstance(options, dict):
        raise HeygemError('options must be a JSON object, e.g. {"media.output_height": 360}')
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
        limited[key] = str(candidate)
    return limited


def check_weight_files(config: Config, folder: Path | None = None) -> None:
    """HeygemError when an option asks for a weights file the weights folder lacks (--restorer gfpgan,
    --detector s3fd, --engine musetalk)."""
    if config.restore.enabled and config.restore.method == "gfpgan":
        require_gfpgan_checkpoint(folder)
    if config.face.detector == "s3fd":
        require_s3fd_checkpoint(folder)
    if config.engine.name == "musetalk":  # its libraries and files, before the job is queued
        from heygem.engines.musetalk import MuseTalkKind

        problem = MuseTalkKind().missing(Path(folder) if folder is not None else None)
        if problem:
            raise HeygemError(problem)


def check_options(options: dict | None, base: Config, *, remote: bool = False,
                  folder: Path | None = None) -> tuple[dict, Config]:
    """(the options as flat dotted keys, the config they give on top of ``base``) for a job request;
    ``remote``: the request comes from a client of a server (see :func:`limit_remote_options`).
    HeygemError says what is wrong; nothing else is raised for a bad option."""
    flat = flatten_options(options)
    if remote:
        flat = limit_remote_options(flat, folder)
    config = apply_overrides(base, flat)
    check_weight_files(config, folder)
    return flat, config


def check_speech(audio_given: bool, text: str | None, own_audio: bool = False) -> None:
    """HeygemError unless a request names exactly one kind of speech: an audio file, text to speak, or
    (``own_audio``) the face video's own sound."""
    if text and (audio_given or own_audio):
        raise HeygemError("give speech or text, not both: clear one of them")
    if not text and not audio_given and not own_audio:
        raise HeygemError("add speech (an audio file or a recording) or text to speak, or use the face video's "
                          "own sound")


def check_upload_name(name: str, role: str) -> None:
    """HeygemError unless ``name`` is a plain file name of a type the ``role`` ("face" or "audio") takes.

    A remote client's file name is never a path: one with folder parts, control characters (NUL,
    newlines), only dots, or over 255 bytes is refused rather than quietly renamed, and so is an
    extension that is not a video, image or audio type (the contents are probed as well, once the
    file is stored)."""
    shown = repr(name[:60] + ("..." if len(name) > 60 else ""))
    if any(ord(character) < 32 or ord(character) == 127 for character in name):
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
