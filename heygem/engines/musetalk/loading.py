"""Loading the official MuseTalk files strictly: every key and every shape, or one line naming the file.

The networks are the libraries' own classes (diffusers' UNet2DConditionModel and AutoencoderKL,
transformers' Whisper encoder and feature extractor), built from the files' configs on the meta
device and given the files' tensors, so nothing is initialised at random and nothing is held twice.
Nothing is fetched: every path is a local file.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from pathlib import Path

import torch

from heygem.engines.musetalk.files import INSTALL_LINE, MuseTalkFiles, missing_libraries
from heygem.errors import HeygemError
from heygem.weights import describe_mismatch, read_state_dict

logger = logging.getLogger("heygem")

UNET_EXPECTED = "MuseTalk's musetalkV15/unet.pth (or musetalk/pytorch_model.bin) with its musetalk.json"
VAE_EXPECTED = "sd-vae-ft-mse's diffusion_pytorch_model.bin with its config.json in sd-vae/"
WHISPER_EXPECTED = "whisper-tiny's pytorch_model.bin with its config.json in whisper/"
# sd-vae-ft-mse was saved before diffusers renamed the VAE's attention projections
DEPRECATED_ATTENTION_NAMES = {"query.": "to_q.", "key.": "to_k.", "value.": "to_v.", "proj_attn.": "to_out.0."}
# optional packages the libraries import at their own import when installed, for features the engine never uses
# (diffusers' LoRA adapters: peft; transformers' assisted generation: scikit-learn); 3.2 and 2.1 s on an H100 host
UNUSED_OPTIONAL_PACKAGES = ("peft", "sklearn")
LIBRARY_MODULES = ("diffusers.models.unets.unet_2d_condition", "diffusers.models.autoencoders.autoencoder_kl",
                   "diffusers.models.attention_processor", "diffusers.models.upsampling",
                   "transformers.models.whisper.modeling_whisper",
                   "transformers.models.whisper.feature_extraction_whisper")
_IMPORT_LOCK = threading.Lock()


def require_libraries() -> None:
    """HeygemError saying how to install the musetalk extra when diffusers or transformers is missing."""
    missing = missing_libraries()
    if missing:
        raise HeygemError(f"--engine musetalk needs {' and '.join(missing)}: {INSTALL_LINE}")


def import_libraries() -> None:
    """Import the modules the engine runs on (the exact model modules, not the libraries' whole namespaces),
    once per process; safe from any thread (heygem.engines.musetalk.start_loading calls it at process start).

    peft and scikit-learn, when installed but not yet imported, are hidden while they import (a None entry in
    sys.modules: Python's own way to say a module cannot be imported, so the libraries' availability probes
    take the path they take on a machine without them). Both are optional for the libraries, never used by the
    engine, and importing them cost 5.3 of the 8.8 s the libraries took on an H100 host (docs/benchmarks.md).
    The entries are removed again afterwards, so a later ``import peft`` works as usual."""
    import importlib

    with _IMPORT_LOCK:
        if all(name in sys.modules for name in LIBRARY_MODULES):
            return
        hidden = [name for name in UNUSED_OPTIONAL_PACKAGES if name not in sys.modules]
        for name in hidden:
            sys.modules[name] = None  # type: ignore[assignment]
        try:
            for name in LIBRARY_MODULES:
                importlib.import_module(name)
        finally:
            for name in hidden:
                if name in sys.modules and sys.modules[name] is None:
                    del sys.modules[name]


def read_json(path: Path, what: str) -> dict:
    """A config file's dict, or HeygemError naming the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HeygemError(f"{path} is not a readable {what} config ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else 'no details'})") from None
    if not isinstance(data, dict):
        raise HeygemError(f"{path} is not a {what} config (it holds no settings)")
    return data


def build_from_config(model_class, config: dict, path: Path, what: str):
    """``model_class`` built on the meta device from ``config`` (keys of other library versions are
    ignored, as the libraries themselves ignore them); HeygemError naming ``path`` when it does not build."""
    try:
        with torch.device("meta"):
            return model_class.from_config(config) if hasattr(model_class, "from_config") else model_class(config)
    except Exception as error:  # noqa: BLE001 - any failure to build means the config does not fit
        raise HeygemError(f"{path} does not describe a {what} ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else 'no details'})") from None


def assign_strict(model, state_dict: dict, path: Path, what: str, expected: str) -> None:
    """Give ``model`` (built on the meta device) the file's tensors as float32, after checking every
    key and shape; HeygemError naming ``path`` and the first problems otherwise."""
    problem = describe_mismatch(model.state_dict(), state_dict)
    if problem:
        raise HeygemError(f"{path} does not fit the {what}: {problem}; expected {expected}")
    state_dict = {key: value.float() if value.is_floating_point() else value for key, value in state_dict.items()}
    model.load_state_dict(state_dict, strict=True, assign=True)
    leftover = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if leftover:  # a buffer the file does not hold (none in these libraries' versions): computed values
        raise HeygemError(f"{path} leaves {leftover[0]} of the {what} unset; expected {expected}")
    model.eval().requires_grad_(False)


def build_unet(files: MuseTalkFiles):
    """The MuseTalk UNet (diffusers UNet2DConditionModel) built from musetalk.json on the meta device (no weights)."""
    import_libraries()
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel

    config = read_json(files.unet_config, "MuseTalk UNet")
    return build_from_config(UNet2DConditionModel, config, files.unet_config, "UNet2DConditionModel")


def build_vae(files: MuseTalkFiles):
    """The VAE (diffusers AutoencoderKL) built from sd-vae/config.json on the meta device (no weights)."""
    import_libraries()
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL

    config = read_json(files.vae_config, "VAE")
    return build_from_config(AutoencoderKL, config, files.vae_config, "AutoencoderKL")


def load_unet(files: MuseTalkFiles):
    """The MuseTalk UNet (diffusers UNet2DConditionModel) from musetalk.json and its weights."""
    model = build_unet(files)
    state_dict, _ = read_state_dict(files.unet, "MuseTalk UNet", UNET_EXPECTED)
    assign_strict(model, state_dict, files.unet, "MuseTalk UNet", UNET_EXPECTED)
    return model


def load_vae(files: MuseTalkFiles):
    """The VAE (diffusers AutoencoderKL) from sd-vae/config.json and its weights; attention weights
    under their former names are renamed, as diffusers does when it loads such files."""
    model = build_vae(files)
    state_dict, _ = read_state_dict(files.vae, "VAE", VAE_EXPECTED)
    state_dict = rename_deprecated_attention(state_dict, set(model.state_dict()))
    assign_strict(model, state_dict, files.vae, "VAE", VAE_EXPECTED)
    return model


def rename_deprecated_attention(state_dict: dict, wanted: set[str]) -> dict:
    """``state_dict`` with attention keys of the former naming (query, key, value, proj_attn) given
    the current one where only the current one is wanted."""
    renamed = {}
    for key, value in state_dict.items():
        if key not in wanted and ".attentions." in key:
            head, _, leaf = key.rpartition(".attentions.")
            index, _, rest = leaf.partition(".")
            for old, new in DEPRECATED_ATTENTION_NAMES.items():
                if rest.startswith(old) and f"{head}.attentions.{index}.{new}{rest[len(old):]}" in wanted:
                    key = f"{head}.attentions.{index}.{new}{rest[len(old):]}"
                    break
        renamed[key] = value
    return renamed


def load_whisper_encoder(files: MuseTalkFiles):
    """Whisper's encoder (transformers) from whisper/config.json and pytorch_model.bin.

    The file is a whole Whisper model (WhisperForConditionalGeneration's layout: keys under
    "model.", and the output projection tied to the token embedding); every key and shape of the
    model is checked, then only the encoder is kept."""
    import_libraries()
    from transformers.models.whisper.configuration_whisper import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder, WhisperModel

    try:
        config = WhisperConfig(**read_json(files.whisper_config, "Whisper"))
    except (TypeError, ValueError) as error:
        raise HeygemError(f"{files.whisper_config} is not a Whisper config ({error})") from None
    whole = build_from_config(WhisperModel, config, files.whisper_config, "Whisper model")
    state_dict, _ = read_state_dict(files.whisper, "Whisper", WHISPER_EXPECTED)
    state_dict = {key.removeprefix("model."): value for key, value in state_dict.items() if key != "proj_out.weight"}
    problem = describe_mismatch(whole.state_dict(), state_dict)
    if problem:
        raise HeygemError(f"{files.whisper} does not fit the Whisper model: {problem}; expected {WHISPER_EXPECTED}")
    encoder = build_from_config(WhisperEncoder, config, files.whisper_config, "Whisper encoder")
    encoder_state = {key.removeprefix("encoder."): value for key, value in state_dict.items()
                     if key.startswith("encoder.")}
    assign_strict(encoder, encoder_state, files.whisper, "Whisper encoder", WHISPER_EXPECTED)
    return encoder


def load_feature_extractor(files: MuseTalkFiles):
    """transformers' WhisperFeatureExtractor from whisper/preprocessor_config.json (80 log-mel bins
    of 30 s windows at 16 kHz), read from the local folder only."""
    import_libraries()
    from transformers.models.whisper.feature_extraction_whisper import WhisperFeatureExtractor

    read_json(files.whisper_preprocessor, "Whisper feature extractor")  # one line naming a broken file
    try:
        return WhisperFeatureExtractor.from_pretrained(files.whisper_preprocessor.parent, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any failure means the file does not fit
        raise HeygemError(f"{files.whisper_preprocessor} is not a Whisper feature extractor config "
                          f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
