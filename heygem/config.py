"""Every option heygem has, as nested dataclasses loaded from configs/*.yaml.

Each leaf field carries its command-line flag and a one-line help text in its
metadata; the CLI, the web app and the REST API all build on these, so an
option is described once. Unknown keys in a YAML file or an options dict are
an error, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from heygem.errors import HeygemError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_PATH = REPO_ROOT / "configs" / "default.yaml"


MAX_FRAME_SIDE = 16384  # pixels: the largest width or height of a face (or a face box coordinate) heygem takes
BITRATE_PATTERN = re.compile(r"[1-9][0-9]{0,3}k")  # an AAC bitrate as ffmpeg takes it: 8k .. 9999k
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]{1,3})?")


# the groups of the command line's --help, in order, with their descriptions; an option is in its section's
# group (SECTION_GROUPS) unless it names another
OPTION_GROUPS = {
    "inputs": "the face and what it says",
    "output": "the video written",
    "engine": "how the mouth is made and pasted back",
    "advanced": "speed, memory and tracking details: the defaults suit most runs",
}
SECTION_GROUPS = {"media": "output", "face": "inputs", "engine": "engine", "restore": "engine", "blend": "engine",
                  "run": "advanced", "text": "output"}


def option(default: Any, flag: str, help: str, choices: tuple | None = None, *, minimum: float | None = None,
           maximum: float | None = None, kind: str | None = None, group: str | None = None):
    """A config field with its CLI flag and help text; ``minimum``/``maximum`` bound a number (each item of a
    list), ``kind`` names a value with a shape of its own: "bitrate", "device" or "weights file" (a file in
    the weights folder; for a server's remote clients only a file name there, see heygem.jobs.request);
    ``group``: the --help group it is listed in (OPTION_GROUPS), when not its section's."""
    metadata = {"flag": flag, "help": help, "choices": choices, "minimum": minimum, "maximum": maximum, "kind": kind,
                "group": group}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class MediaConfig:
    output_height: int | None = option(
        None, "--output-height", "scale the output to this height in pixels (width follows, kept even); empty keeps the input's size")
    fps: float = option(25.0, "--fps", "output frame rate when the face is a still image (videos keep their own rate)")
    crf: int = option(18, "--crf", "x264 quality: lower is better and larger, 18 looks lossless", minimum=0, maximum=51)
    preset: str = option("veryfast", "--preset", "x264 speed preset", (
        "ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow"))
    audio_bitrate: str = option("192k", "--audio-bitrate", "AAC bitrate when the audio has to be re-encoded, e.g. 128k",
                                kind="bitrate")
    stream: bool = option(False, "--stream", "also publish the frames as HLS while they are encoded, in OUT.hls/ beside the output (jobs of a server always do: watch them at /api/jobs/ID/stream.m3u8); the MP4 is the same either way")
    batch_frames: int = option(32, "--batch-frames", "frames per batch through the stages (fewer for big frames: a batch stays under 32 MiB); memory is bounded by this, not by the video's length",
                              minimum=1, maximum=4096, group="advanced")


@dataclass
class FaceConfig:
    pads: list[int] = option(
        [0, 10, 0, 0], "--pads", "extra pixels around the detected face box: top bottom left right (Wav2Lip's convention), 0 to 1000",
        minimum=0, maximum=1000, group="engine")
    smooth_window: int = option(5, "--smooth-window", "frames over which face boxes are averaged (1 switches smoothing off)",
                               minimum=1, maximum=1000, group="advanced")
    box: list[int] | None = option(
        None, "--box", "a fixed face box x1 y1 x2 y2 used on every frame instead of detection's box",
        minimum=0, maximum=MAX_FRAME_SIDE)
    face_index: int | None = option(
        None, "--face-index", "which face to animate when there are several, counted left to right from 0; empty picks the largest",
        minimum=0, maximum=1000)
    redetect_every: int = option(
        10, "--redetect-every", "run full face detection every N frames and track landmarks in between",
        minimum=1, maximum=100_000, group="advanced")
    min_confidence: float = option(0.5, "--min-face-confidence", "faces found with less confidence than this are ignored",
                                  minimum=0, maximum=1, group="advanced")
    detector: str = option("mediapipe", "--detector", "face detector: mediapipe (built in) or s3fd (needs s3fd.pth in weights/); landmarks come from the face mesh either way",
                           ("mediapipe", "s3fd"), group="engine")


@dataclass
class EngineConfig:
    name: str = option("auto", "--engine", "lip-sync engine: auto uses musetalk when its files are complete in weights/musetalk/ (and the musetalk extra is installed), else wav2lip when its weights are in weights/, otherwise the built-in landmark engine",
                       ("auto", "musetalk", "wav2lip", "landmark"))
    checkpoint: str | None = option(
        None, "--checkpoint", "a Wav2Lip or Wav2Lip-GAN checkpoint (.pth); default: the first one found in weights/",
        kind="weights file")
    device: str = option("auto", "--device", "where the networks run: auto, cpu, cuda or cuda:N", kind="device")
    batch_size: int = option(64, "--wav2lip-batch", "faces per Wav2Lip (or MuseTalk) forward pass", minimum=1, maximum=4096, group="advanced")
    musetalk_margin: int = option(10, "--musetalk-margin", "musetalk engine (1.5): pixels added below the chin to the face box, as MuseTalk's extra_margin",
                                  minimum=0, maximum=200)
    musetalk_parsing: str = option("auto", "--musetalk-parsing", "musetalk engine: the paste mask; auto is MuseTalk 1.5's jaw face parsing when the BiSeNet files are in weights/musetalk/face-parse-bisent/, else heygem's landmark lower-face mask; jaw, neck and raw are MuseTalk's parsing modes",
                                   ("auto", "jaw", "neck", "raw", "landmarks"))
    musetalk_cheek_width: int = option(90, "--musetalk-cheek-width", "musetalk engine, jaw parsing: the cheeks' width kept out of the jaw mask, in pixels of the 512x512 parsing image (MuseTalk 1.5's 90)",
                                       minimum=0, maximum=256)
    musetalk_compile: str = option("auto", "--musetalk-compile", "musetalk engine on a GPU: run the UNet and the decoder compiled by torch.compile (about twice the faces per second; the first batch of a process then waits about a minute for the compiler, some 15 s once torch's compile cache on this machine is warm); auto compiles where the engine is kept for many jobs (the server's workers, batch, Ray nodes) and for live sessions, not for a one-off command-line run",
                                   ("auto", "always", "never"), group="advanced")
    mouth_strength: float = option(1.0, "--mouth-strength", "landmark engine: how wide the mouth opens, 1.0 is natural (0 to 3)",
                                   minimum=0, maximum=3)
    precision: str = option("auto", "--precision", "number format of the networks: auto is fp16 on a GPU and fp32 on the CPU",
                            ("auto", "fp32", "fp16", "bf16"), group="advanced")
    cuda_graph: bool = option(True, "--cuda-graph", "on a GPU, replay full batches of the generator as a CUDA graph (--no-cuda-graph runs it op by op)", group="advanced")
    cudnn: bool = option(True, "--cudnn", "use cuDNN for the convolutions on a GPU (--no-cudnn only to measure what it buys)", group="advanced")
    cudnn_benchmark: bool = option(False, "--cudnn-benchmark", "on a GPU, let cuDNN time candidate kernels for each batch shape (benchmark mode; MuseTalk's compiled step always does); off picks them by heuristics: on an H200 autotuning cost Wav2Lip 3.5 s at start and found no faster kernel", group="advanced")
    deterministic: bool = option(False, "--deterministic", "the same output bits on every run: cuDNN's deterministic algorithms, no autotuning (slower)", group="advanced")


@dataclass
class RestoreConfig:
    enabled: bool = option(True, "--restore", "restore the generated mouth region with the --restorer method; --no-restore switches restoration off, as --restorer none does")
    method: str = option("auto", "--restorer", "how the generated mouth region is restored: auto picks gfpgan when GFPGANv1.4.pth is in weights/ and the engine synthesises pixels (wav2lip), else sharpen for wav2lip and none for the landmark engine, which moves real pixels",
                         ("auto", "gfpgan", "sharpen", "none"))
    strength: float = option(0.6, "--restore-strength", "how strongly the mouth region is restored: 0..2 for sharpen, 0..1 for gfpgan (1 shows only the restored pixels; more counts as 1)",
                             minimum=0, maximum=2)


@dataclass
class BlendConfig:
    feather: float = option(0.15, "--feather", "width of the soft mask edge as a fraction of the face box, 0 to 1",
                           minimum=0, maximum=1)
    color_match: bool = option(True, "--color-match", "match the generated region's colour to the frame before pasting (use --no-color-match to switch off)")


@dataclass
class RunConfig:
    concurrent: bool = option(True, "--concurrent", "run decoding, face tracking, generation and encoding at the same time (--no-concurrent runs them one after another)")
    face_workers: int = option(0, "--face-workers", "face trackers working in parallel, each on its own run of frames; 0 picks from the cores",
                               minimum=0, maximum=1024)
    face_processes: bool = option(True, "--face-processes", "run several face trackers as processes of their own, beside the other stages (--no-face-processes keeps them as threads of the main process)")
    decoders: int = option(0, "--decoders", "ffmpeg processes decoding the face video together, each passing on its share of the frames; 0 picks from the cores and the frame size",
                           minimum=0, maximum=1024)
    encoders: int = option(0, "--encoders", "x264 encoders working on consecutive segments of the output; 0 picks from the cores",
                           minimum=0, maximum=1024)
    render: str = option("auto", "--render", "where cropping, drawing, restoring and blending run: auto picks torch when the wav2lip or musetalk engine is on a GPU, else numpy; torch also draws the landmark engine (without a restorer) and runs on the CPU",
                         ("auto", "numpy", "torch"))
    avatar_cache: bool = option(True, "--avatar-cache", "keep the face tracking of a face video under outputs/avatar-cache and reuse it when the same video comes with other audio")


@dataclass
class TextConfig:
    subtitles: str = option("soft", "--subtitles", "a video made from text carries its cues: soft adds a subtitle track, burn draws them into the frames (Chinese, Japanese and Korean in a CJK font; soft when no font has the text's characters), none leaves them out (OUT.srt is written either way)",
                            ("none", "soft", "burn"))
    subtitle_size: float = option(0.045, "--subtitle-size", "burned subtitles: the letters' height as a fraction of the frame's height (0.045: 16 pixels on a 360-pixel frame)",
                                  minimum=0.02, maximum=0.2)
    subtitle_position: str = option("bottom", "--subtitle-position", "burned subtitles: drawn near the bottom or the top of the frame",
                                    ("bottom", "top"))
    max_characters: int = option(5000, "--max-text-chars", "longest text spoken for one video, in characters (0: no limit)",
                                minimum=0, group="inputs")


@dataclass
class Config:
    media: MediaConfig = field(default_factory=MediaConfig)
    face: FaceConfig = field(default_factory=FaceConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    restore: RestoreConfig = field(default_factory=RestoreConfig)
    blend: BlendConfig = field(default_factory=BlendConfig)
    run: RunConfig = field(default_factory=RunConfig)
    text: TextConfig = field(default_factory=TextConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def iter_options():
    """Yield (section_name, field) for every leaf option, in declaration order."""
    hints = get_type_hints(Config)
    for section in dataclasses.fields(Config):
        for leaf in dataclasses.fields(hints[section.name]):
            yield section.name, leaf


MAX_LIST_ITEMS = 16  # longest list an option takes (pads and box take four)


def _shown(value: Any) -> str:
    """A value as a message shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(value: Any, kind: type, where: str) -> int | float:
    """``value`` (a number, or a number's text) as ``kind`` (int or float): finite, and whole for an int."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(value)
    number: int | float = value
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)
        except ValueError:
            number = float(text)
    if isinstance(number, float) and not math.isfinite(number):
        raise HeygemError(f"option {where} must be a finite number, not {_shown(value)}")
    if kind is int:
        if isinstance(number, float) and not number.is_integer():
            raise HeygemError(f"option {where} must be a whole number, not {_shown(value)}")
        return int(number)
    return float(number)


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a YAML/JSON/CLI value to the field's type, or raise HeygemError: numbers must be finite
    (no NaN or infinity) and whole where the option counts something; a string option takes a string."""
    args = get_args(annotation)
    if value is None:
        if type(None) in args:
            return None
        raise HeygemError(f"option {where} may not be empty")
    if type(None) in args:
        annotation = next(a for a in args if a is not type(None))
    origin = get_origin(annotation)
    try:
        if origin is list:
            (item_type,) = get_args(annotation)
            if isinstance(value, str):
                value = value.replace(",", " ").split()
            if not isinstance(value, (list, tuple)) or len(value) > MAX_LIST_ITEMS:
                raise ValueError(value)
            return [_number(item, item_type, where) for item in value]
        if annotation is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
                return bool(value)
            raise ValueError(value)
        if annotation in (int, float):
            return _number(value, annotation, where)
        if annotation is str:
            if not isinstance(value, str):
                raise ValueError(value)
            return value
        return annotation(value)
    except (TypeError, ValueError, OverflowError):
        raise HeygemError(f"option {where} has an invalid value {_shown(value)}") from None


def _range_text(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f"between {minimum:g} and {maximum:g}"
    return f"at least {minimum:g}" if minimum is not None else f"at most {maximum:g}"


def _check_leaf(leaf: dataclasses.Field, value: Any) -> None:
    """HeygemError when ``value`` is outside the option's range or not of its kind (see :func:`option`)."""
    meta = leaf.metadata
    flag, minimum, maximum, kind = meta["flag"], meta.get("minimum"), meta.get("maximum"), meta.get("kind")
    if value is None:
        return
    if minimum is not None or maximum is not None:
        for number in value if isinstance(value, list) else [value]:
            if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
                each = " (each number)" if isinstance(value, list) else ""
                raise HeygemError(f"{flag} must be {_range_text(minimum, maximum)}{each}, not {_shown(number)}")
    if kind == "bitrate" and not BITRATE_PATTERN.fullmatch(value):
        raise HeygemError(f"{flag} takes an audio bitrate such as 128k (a number of kilobits and k), "
                          f"not {_shown(value)}")
    if kind == "device" and not DEVICE_PATTERN.fullmatch(value.strip().lower()):
        raise HeygemError(f"{flag} must be auto, cpu, cuda or cuda:N (N a GPU number), not {_shown(value)}")


def apply_overrides(config: Config, overrides: dict) -> Config:
    """Return a copy of ``config`` with ``overrides`` applied.

    ``overrides`` is nested ({"face": {"pads": [0, 20, 0, 0]}}) or flat with
    dotted keys ({"face.pads": ...}); unknown sections or keys raise HeygemError.
    """
    nested: dict[str, dict] = {}
    for key, value in (overrides or {}).items():
        if "." in key:
            section, leaf = key.split(".", 1)
            nested.setdefault(section, {})[leaf] = value
        elif isinstance(value, dict):
            nested.setdefault(key, {}).update(value)
        else:
            raise HeygemError(f"unknown option {key!r}: options are grouped as section.name, e.g. face.pads")
    hints = get_type_hints(Config)
    sections = {}
    for section_field in dataclasses.fields(Config):
        section_name = section_field.name
        current = getattr(config, section_name)
        changes = nested.pop(section_name, {})
        section_hints = get_type_hints(hints[section_name])
        known = {f.name for f in dataclasses.fields(current)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise HeygemError(f"unknown option {section_name}.{unknown[0]} (known: {', '.join(sorted(known))})")
        coerced = {
            name: _coerce(value, section_hints[name], f"{section_name}.{name}") for name, value in changes.items()
        }
        sections[section_name] = dataclasses.replace(current, **coerced)
    if nested:
        raise HeygemError(f"unknown option section {sorted(nested)[0]!r} (known: {', '.join(SECTIONS)})")
    result = Config(**sections)
    validate(result)
    return result


def validate(config: Config) -> None:
    """Check ranges and choices; raise HeygemError naming the option."""
    for section, leaf in iter_options():
        choices = leaf.metadata.get("choices")
        value = getattr(getattr(config, section), leaf.name)
        if choices and value not in choices:
            raise HeygemError(f"{leaf.metadata['flag']} must be one of {', '.join(choices)}, not {_shown(value)}")
        _check_leaf(leaf, value)
    face, media = config.face, config.media
    if len(face.pads) != 4:
        raise HeygemError("--pads takes four numbers: top bottom left right")
    if face.box is not None and (len(face.box) != 4 or face.box[2] <= face.box[0] or face.box[3] <= face.box[1]):
        raise HeygemError("--box takes four numbers x1 y1 x2 y2 with x2 > x1 and y2 > y1")
    # the other ranges are the options' own (option(minimum=..., maximum=...)), checked in the loop above
    if not 0 < media.fps <= 120:
        raise HeygemError("--fps must be between 0 and 120")
    if media.output_height is not None and not 16 <= media.output_height <= 4320:
        raise HeygemError("--output-height must be between 16 and 4320")


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> Config:
    """Load defaults, then the YAML file (default: configs/default.yaml), then ``overrides``."""
    import yaml

    config = Config()
    config_path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    if path is not None or config_path.exists():
        if not config_path.is_file():
            raise HeygemError(f"config file not found: {config_path}")
        try:
            data = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as error:
            raise HeygemError(f"config file {config_path} is not valid YAML: {error}") from None
        if not isinstance(data, dict):
            raise HeygemError(f"config file {config_path} must hold sections such as media: and face:")
        config = apply_overrides(config, data)
    return apply_overrides(config, overrides or {})
