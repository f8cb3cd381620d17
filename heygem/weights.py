"""Finding, checking, fetching and loading the public network weights in weights/.

configs/weights.yaml lists the checkpoint files heygem recognises with their published
size and SHA-256 where a public source states them; ``python -m heygem weights
list|verify|download`` reads it. Nothing is downloaded unless the user runs
``weights download``. Checkpoints are read with ``weights_only=True``, so a file that
holds anything but tensors and plain values is refused instead of having its pickled
code run. torch and urllib's network code are imported inside the functions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from heygem.config import REPO_ROOT
from heygem.errors import HeygemError

logger = logging.getLogger("heygem")

# The released Wav2Lip generator files, best first: the GAN variant gives sharper mouths.
WAV2LIP_FILE_NAMES = ("wav2lip_gan.pth", "wav2lip.pth")
WAV2LIP_EXPECTED = "the official wav2lip_gan.pth or wav2lip.pth from the Wav2Lip release"

# The released GFPGAN v1.4 restorer file (heygem.render.gfpgan).
GFPGAN_FILE_NAMES = ("GFPGANv1.4.pth",)

S3FD_FILE_NAME = "s3fd.pth"
S3FD_FILE_NAMES = (S3FD_FILE_NAME, "s3fd-619a316812.pth")  # the names it is published under, as in configs/weights.yaml

SHOWN_KEYS = 3  # how many missing or unexpected keys an error message lists


def weights_dir() -> Path:
    """Where checkpoints are looked for: $HEYGEM_WEIGHTS or the repository's weights/ folder."""
    return Path(os.environ.get("HEYGEM_WEIGHTS", REPO_ROOT / "weights"))


def find_wav2lip_checkpoint(folder: Path | None = None) -> Path | None:
    """The Wav2Lip checkpoint in ``folder`` (default: :func:`weights_dir`; names matched case-insensitively),
    or None. wav2lip_gan.pth is preferred over wav2lip.pth when both are there."""
    return find_first_file(folder, WAV2LIP_FILE_NAMES)


def find_gfpgan_checkpoint(folder: Path | None = None) -> Path | None:
    """GFPGANv1.4.pth in ``folder`` (default: :func:`weights_dir`; matched case-insensitively), or None."""
    return find_first_file(folder, GFPGAN_FILE_NAMES)


def require_gfpgan_checkpoint(folder: Path | None = None) -> Path:
    """GFPGANv1.4.pth in ``folder`` (default: :func:`weights_dir`), or a HeygemError saying how to get it."""
    return require_first_file(folder, GFPGAN_FILE_NAMES, "--restorer gfpgan needs GFPGANv1.4.pth in {folder}: run "
                              "`python -m heygem weights download gfpgan_v1.4` or put the file there (or choose "
                              "--restorer auto, sharpen or none)")


def find_s3fd_checkpoint(folder: Path | None = None) -> Path | None:
    """The S3FD file in ``folder`` (default: :func:`weights_dir`; either published name, matched
    case-insensitively), or None."""
    return find_first_file(folder, S3FD_FILE_NAMES)


def require_s3fd_checkpoint(folder: Path | None = None) -> Path:
    """The S3FD file in ``folder`` (default: :func:`weights_dir`); HeygemError saying which file to put
    there when it is missing."""
    return require_first_file(folder, S3FD_FILE_NAMES,
                              f"--detector s3fd needs the S3FD weights: put {S3FD_FILE_NAME} (or {S3FD_FILE_NAMES[1]}) "
                              "into {folder}, or run python -m heygem weights download s3fd")


def require_first_file(folder: Path | None, names, missing: str) -> Path:
    """:func:`find_first_file`, or HeygemError(``missing``, its ``{folder}`` filled in) when none is there."""
    folder = Path(folder) if folder is not None else weights_dir()
    found = find_first_file(folder, names)
    if found is None:
        raise HeygemError(missing.format(folder=folder))
    return found


def find_first_file(folder: Path | None, names) -> Path | None:
    """The first of ``names`` present as a file in ``folder`` (default: :func:`weights_dir`; matched
    case-insensitively), or None. A name with slashes is a path inside the folder (musetalk/sd-vae/
    config.json), its last part matched case-insensitively."""
    folder = Path(folder) if folder is not None else weights_dir()
    for name in names:
        directory = folder / Path(name).parent
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.is_file() and path.name.lower() == Path(name).name.lower():
                return path
    return None


def is_relative_name(name: str) -> bool:
    """Whether ``name`` is a file name, or a path of names inside a folder (no "..", no root, no backslash)."""
    parts = name.split("/")
    return bool(name) and "\\" not in name and all(part not in ("", ".", "..") for part in parts)


def load_state_dict_strict(module, checkpoint_path: Path, what: str = "Wav2Lip",
                           expected: str = WAV2LIP_EXPECTED, assign: bool = False) -> None:
    """Load ``checkpoint_path`` into ``module`` with every key and shape matching.

    Accepts the training layout ``{"state_dict": ..., "optimizer": ..., "global_step": ...,
    "global_epoch": ...}`` and a bare state dict, with or without the "module."
    prefix that DataParallel adds. Raises HeygemError naming the file and the first
    problems found; ``expected`` says which file would fit. With ``assign`` the file's
    tensors (as float32) become the module's own, for a module built on the meta device:
    nothing is allocated twice, and float32 tensors are not copied.
    """
    checkpoint_path = Path(checkpoint_path)
    state_dict, global_step = read_state_dict(checkpoint_path, what, expected)
    problem = describe_mismatch(module.state_dict(), state_dict)
    if problem:
        raise HeygemError(f"{checkpoint_path} does not fit {what}: {problem}; expected {expected}")
    if assign:
        state_dict = {key: value.float() if value.is_floating_point() else value for key, value in state_dict.items()}
    try:
        module.load_state_dict(state_dict, strict=True, assign=assign)
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


# ---------------------------------------------------------------------------------------------
# The registry of recognised files: list, verify, download
# ---------------------------------------------------------------------------------------------

REGISTRY_PATH = REPO_ROOT / "configs" / "weights.yaml"
PURPOSES = ("engine", "restorer", "detector", "voice")
ENTRY_FIELDS = ("name", "files", "purpose", "enables", "size_bytes", "sha256", "sha256_prefix", "source", "url")
HASH_CHUNK_BYTES = 1 << 20
DOWNLOAD_CHUNK_BYTES = 1 << 16
DOWNLOAD_TIMEOUT_S = 30.0

# What `weights list` and `weights verify` report for an entry.
MISSING = "missing"                # no accepted file in the weights folder
INSTALLED = "installed"            # a file is there, its size fits, its contents were not hashed
VERIFIED = "verified"              # its SHA-256 (or the published prefix of it) matches
UNVERIFIED = "unverified"          # a file is there but no public checksum exists to compare with
WRONG_CHECKSUM = "wrong checksum"  # its size or SHA-256 differs from the published one


@dataclass(frozen=True)
class WeightsEntry:
    """One checkpoint file heygem recognises (an entry of configs/weights.yaml)."""

    name: str
    files: tuple[str, ...]      # accepted file names; a download is saved under files[0]
    purpose: str                # engine | restorer | detector | voice
    enables: str                # what having the file gives the user
    size_bytes: int | None      # published size, None where no public source states it
    sha256: str | None          # published full SHA-256 (64 lowercase hex digits) or None
    sha256_prefix: str | None   # leading hex digits of the SHA-256 from a torch.hub style file name
    source: str                 # public page that publishes the file
    url: str | None             # where `weights download` fetches it from


@dataclass(frozen=True)
class WeightsState:
    """What the weights folder holds for one registry entry."""

    entry: WeightsEntry
    state: str              # MISSING, INSTALLED, VERIFIED, UNVERIFIED or WRONG_CHECKSUM
    path: Path | None       # the accepted file found, if any
    detail: str             # one short sentence: what was compared


def load_registry(path: str | Path | None = None) -> list[WeightsEntry]:
    """The entries of ``path`` (default configs/weights.yaml), checked field by field.

    Raises HeygemError naming the file and the entry when a field is missing, unknown or malformed.
    """
    import yaml

    path = Path(path) if path is not None else REGISTRY_PATH
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise HeygemError(f"cannot read the weights registry {path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise HeygemError(f"the weights registry {path} is not valid YAML: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("weights"), list):
        raise HeygemError(f"the weights registry {path} must hold a list under 'weights:'")
    entries, names = [], set()
    for index, raw in enumerate(document["weights"]):
        entry = parse_entry(raw, f"{path} entry {index + 1}")
        if entry.name in names:
            raise HeygemError(f"{path}: the name {entry.name!r} appears twice")
        names.add(entry.name)
        entries.append(entry)
    return entries


def parse_entry(raw: object, where: str) -> WeightsEntry:
    """One registry entry from its YAML mapping; ``where`` names it in error messages."""
    if not isinstance(raw, dict):
        raise HeygemError(f"{where} must be a mapping with the fields {', '.join(ENTRY_FIELDS)}")
    unknown = sorted(set(raw) - set(ENTRY_FIELDS))
    missing = [field for field in ENTRY_FIELDS if field not in raw]
    if unknown or missing:
        raise HeygemError(f"{where}: unknown fields {unknown}, missing fields {missing}")

    def text(field: str, optional: bool = False) -> str | None:
        value = raw[field]
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value.strip():
            raise HeygemError(f"{where}: {field} must be a non-empty string (quote it if YAML reads it as a number)")
        return value.strip()

    files = raw["files"]
    if not isinstance(files, list) or not files or not all(isinstance(f, str) and is_relative_name(f) for f in files):
        raise HeygemError(f"{where}: files must be a non-empty list of file names (or paths inside the weights "
                          "folder, such as musetalk/sd-vae/config.json)")
    purpose = text("purpose")
    if purpose not in PURPOSES:
        raise HeygemError(f"{where}: purpose must be one of {', '.join(PURPOSES)}, not {purpose!r}")
    size_bytes = raw["size_bytes"]
    if size_bytes is not None and (isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes <= 0):
        raise HeygemError(f"{where}: size_bytes must be a positive whole number or null")
    sha256 = text("sha256", optional=True)
    if sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise HeygemError(f"{where}: sha256 must be 64 lowercase hex digits or null")
    prefix = raw["sha256_prefix"]
    prefix = None if prefix is None else str(prefix)  # YAML reads an all-digit prefix as a number
    if prefix is not None and not re.fullmatch(r"[0-9a-f]{6,63}", prefix):
        raise HeygemError(f"{where}: sha256_prefix must be 6 to 63 lowercase hex digits or null")
    if sha256 is not None and prefix is not None and not sha256.startswith(prefix):
        raise HeygemError(f"{where}: sha256 does not start with sha256_prefix")
    url = text("url", optional=True)
    source = text("source")
    for field, value in (("url", url), ("source", source)):
        if value is not None and not value.startswith("https://"):
            raise HeygemError(f"{where}: {field} must be an https:// address")
    return WeightsEntry(name=text("name"), files=tuple(files), purpose=purpose, enables=text("enables"),
                        size_bytes=size_bytes, sha256=sha256, sha256_prefix=prefix, source=source, url=url)


def find_entry(entries: list[WeightsEntry], name: str) -> WeightsEntry:
    """The entry called ``name`` (case-insensitive); HeygemError listing the known names otherwise."""
    for entry in entries:
        if entry.name.lower() == name.lower():
            return entry
    raise HeygemError(f"no weights called {name!r}; known: {', '.join(entry.name for entry in entries)}")


def find_installed(entry: WeightsEntry, weights_dir: Path) -> Path | None:
    """The first of ``entry.files`` present in ``weights_dir`` (names matched case-insensitively), or None."""
    return find_first_file(weights_dir, entry.files)


def installed_names(weights_dir: Path, registry: str | Path | None = None) -> set[str]:
    """Names of the registry entries with a file in ``weights_dir`` (present, contents not checked)."""
    return {entry.name for entry in load_registry(registry) if find_installed(entry, weights_dir) is not None}


def describe_path(path: Path | None) -> str:
    """A file's path for a table, or "-" for none."""
    return "-" if path is None else str(path)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes as 64 lowercase hex digits, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def compare_with_entry(entry: WeightsEntry, path: Path, hash_contents: bool = True) -> tuple[str, str]:
    """(state, detail) for ``path`` against what the registry publishes for ``entry``."""
    size = path.stat().st_size
    if entry.size_bytes is not None and size != entry.size_bytes:
        return WRONG_CHECKSUM, f"{size} bytes, expected {entry.size_bytes}"
    if not hash_contents:
        return INSTALLED, f"{size} bytes, contents not hashed"
    if entry.sha256 is None and entry.sha256_prefix is None:
        size_note = "size matches" if entry.size_bytes is not None else f"{size} bytes"
        return UNVERIFIED, f"{size_note}; no published checksum to compare with"
    digest = file_sha256(path)
    if entry.sha256 is not None:
        if digest != entry.sha256:
            return WRONG_CHECKSUM, f"sha256 {digest}, expected {entry.sha256}"
        return VERIFIED, "sha256 matches"
    if not digest.startswith(entry.sha256_prefix):
        return WRONG_CHECKSUM, f"sha256 {digest} does not start with {entry.sha256_prefix}"
    return VERIFIED, f"sha256 starts with the published {entry.sha256_prefix}"


def check_weights(entry: WeightsEntry, weights_dir: Path, hash_contents: bool = True) -> WeightsState:
    """What ``weights_dir`` holds for ``entry``; hashing the file unless ``hash_contents`` is False."""
    path = find_installed(entry, weights_dir)
    if path is None:
        return WeightsState(entry, MISSING, None, f"put {entry.files[0]} into {weights_dir}")
    state, detail = compare_with_entry(entry, path, hash_contents)
    return WeightsState(entry, state, path, detail)


def download_weights(entry: WeightsEntry, weights_dir: Path, url: str | None = None,
                     progress: Callable[[int, int | None], None] | None = None,
                     timeout: float = DOWNLOAD_TIMEOUT_S) -> WeightsState:
    """Fetch ``entry`` into ``weights_dir`` as ``entry.files[0]``; the state of the saved file.

    The bytes go to ``<file>.part`` first; a ``.part`` left by an interrupted run is resumed
    with an HTTP Range request. The finished file is checked against the published size and
    SHA-256 (or SHA-256 prefix) where known, then renamed into place in one step. On a
    mismatch the bad file is removed. Problems raise HeygemError with a one-line message.
    ``progress(bytes_done, bytes_total_or_None)`` is called as data arrives.
    """
    url = url or entry.url
    if not url:
        raise HeygemError(f"{entry.name} has no download address; get it from {entry.source} or pass --url")
    if not url.startswith(("https://", "http://")):
        raise HeygemError(f"--url must be an http:// or https:// address, not {url!r}")
    weights_dir = Path(weights_dir)
    weights_dir.mkdir(parents=True, exist_ok=True)
    final_path = weights_dir / entry.files[0]
    part_path = weights_dir / (entry.files[0] + ".part")
    final_path.parent.mkdir(parents=True, exist_ok=True)  # a path inside the folder (musetalk/...)

    fetch_to_part(url, part_path, entry, progress, timeout)
    state, detail = compare_with_entry(entry, part_path)
    if state == WRONG_CHECKSUM:
        part_path.unlink(missing_ok=True)
        raise HeygemError(f"{final_path.name} from {url} is not the published file ({detail}); it was removed")
    os.replace(part_path, final_path)
    logger.info("saved %s (%s)", final_path, detail)
    return WeightsState(entry, state, final_path, detail)


def fetch_to_part(url: str, part_path: Path, entry: WeightsEntry,
                  progress: Callable[[int, int | None], None] | None, timeout: float) -> None:
    """Write the bytes at ``url`` into ``part_path``, continuing after the bytes it already holds."""
    import urllib.error
    import urllib.request

    have = part_path.stat().st_size if part_path.is_file() else 0
    if entry.size_bytes is not None and have > entry.size_bytes:
        part_path.unlink()  # longer than the published file: it cannot be a prefix of it
        have = 0
    if entry.size_bytes is not None and have == entry.size_bytes:
        return  # complete already; checked by the caller
    request = urllib.request.Request(url, headers={"User-Agent": "heygem-weights"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as error:
        if error.code == 416 and have:  # nothing after what we have: the .part is the whole file
            logger.info("%s: the server has no bytes after %d; checking the partial file", url, have)
            return
        raise HeygemError(f"downloading {part_path.name[:-5]} failed: {url} answered HTTP {error.code} "
                          f"{error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise HeygemError(f"cannot download {part_path.name[:-5]}: {url} is unreachable ({reason}); "
                          "check the network connection or pass --url") from None
    with response:
        if response.headers.get_content_type() == "text/html":
            raise HeygemError(f"{url} answered with a web page, not {part_path.name[:-5]}; open "
                              f"{entry.source} in a browser, download the file and put it into {part_path.parent}")
        resumed = response.status == 206 and have > 0
        if resumed and not response.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
            raise HeygemError(f"{url} resumed at the wrong place ({response.headers.get('Content-Range')}); "
                              f"delete {part_path} and try again")
        if not resumed:
            have = 0  # the server sent the whole file
        length = response.headers.get("Content-Length")
        total = have + int(length) if length and length.isdigit() else entry.size_bytes
        logger.info("downloading %s from %s%s", part_path.name[:-5], url, f" from byte {have}" if have else "")
        try:
            with open(part_path, "ab" if have else "wb") as file:
                done = have
                while chunk := response.read(DOWNLOAD_CHUNK_BYTES):
                    file.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
                file.flush()
                os.fsync(file.fileno())
        except OSError as error:  # connection dropped or disk full: what arrived stays for a resume
            raise HeygemError(f"downloading {part_path.name[:-5]} stopped ({error}); run the same command "
                              "again to continue") from None
    if total is not None and done != total:
        raise HeygemError(f"downloading {part_path.name[:-5]} stopped after {done} of {total} bytes; run the "
                          "same command again to continue")


# ---------------------------------------------------------------------------------------------
# python -m heygem weights list|verify|download
# ---------------------------------------------------------------------------------------------


