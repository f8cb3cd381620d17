"""Random-init MuseTalk files in the official layout, for the tests and the benchmarks.

The full configurations are the public facts of MuseTalk 1.5's files (its musetalk.json,
sd-vae-ft-mse's AutoencoderKL config, whisper-tiny's config and feature extractor settings); the
reduced ones keep the same classes and block types with fewer, narrower layers, so the CPU runs
them in seconds. The files are written as the official ones are: plain state dicts under the
official names, the VAE attention weights under their former names, Whisper as a whole model
under "model.".
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

UNET_FULL = {
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.6.0.dev0", "act_fn": "silu",
    "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False,
    "cross_attention_dim": 384,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 8, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}
UNET_REDUCED = {**UNET_FULL, "attention_head_dim": 2, "block_out_channels": [32, 32, 64, 64], "layers_per_block": 1}

VAE_FULL = {
    "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4, "in_channels": 3, "latent_channels": 4, "layers_per_block": 2,
    "norm_num_groups": 32, "out_channels": 3, "sample_size": 256, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "scaling_factor": 0.18215,
}
VAE_REDUCED = {**VAE_FULL, "block_out_channels": [8, 16, 32, 32], "layers_per_block": 1, "norm_num_groups": 8}

WHISPER_FULL = {
    "model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"], "d_model": 384,
    "encoder_layers": 4, "encoder_attention_heads": 6, "decoder_layers": 4, "decoder_attention_heads": 6,
    "encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536, "num_mel_bins": 80, "vocab_size": 51865,
    "max_source_positions": 1500, "max_target_positions": 448, "activation_function": "gelu",
}
# d_model, the mel bins and the 1500 positions (30 s) stay: the features' shape follows them
WHISPER_REDUCED = {**WHISPER_FULL, "encoder_ffn_dim": 64, "decoder_layers": 1, "decoder_ffn_dim": 64,
                   "vocab_size": 64, "max_target_positions": 32, "pad_token_id": 0, "bos_token_id": 1,
                   "eos_token_id": 2, "decoder_start_token_id": 3, "begin_suppress_tokens": None,
                   "suppress_tokens": None}

PREPROCESSOR = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80, "sampling_rate": 16000,
                "hop_length": 160, "n_fft": 400, "chunk_length": 30, "n_samples": 480000, "nb_max_frames": 3000,
                "padding_side": "right", "padding_value": 0.0, "return_attention_mask": False}
VAE_RENAMES = {"to_q.": "query.", "to_k.": "key.", "to_v.": "value.", "to_out.0.": "proj_attn."}


def configs(size: str) -> tuple[dict, dict, dict]:
    """(UNet, VAE, Whisper) configs: "full" as published, "reduced" for the CPU."""
    if size == "full":
        return UNET_FULL, VAE_FULL, WHISPER_FULL
    if size == "reduced":
        return UNET_REDUCED, VAE_REDUCED, WHISPER_REDUCED
    raise ValueError(f"size is full or reduced, not {size!r}")


def random_networks(size: str = "reduced", seed: int = 0):
    """(unet, vae, whisper model) of the libraries' classes, randomly initialised from ``seed``.

    Every weight is drawn at a scale that keeps activations moving (a zero-initialised output layer
    would make every face the same)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import WhisperConfig, WhisperModel

    unet_config, vae_config, whisper_config = configs(size)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel.from_config(unet_config)
    vae = AutoencoderKL.from_config(vae_config)
    whisper = WhisperModel(WhisperConfig(**whisper_config))
    generator = torch.Generator().manual_seed(seed)
    for model in (unet, vae, whisper):
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1 and not name.endswith("embed_positions.weight"):
                fan_in = parameter[0].numel()
                parameter.data = torch.randn(parameter.shape, generator=generator) / fan_in ** 0.5
    return unet.eval(), vae.eval(), whisper.eval()


def write_random_files(folder: Path, size: str = "reduced", seed: int = 0, version: str = "v15") -> Path:
    """Write random-init files of ``size`` into ``folder`` (a weights/musetalk) in the official
    layout and names; returns ``folder``. ``version`` "v1" writes the 1.0 UNet's names instead."""
    folder = Path(folder)
    unet, vae, whisper = random_networks(size, seed)
    unet_config, vae_config, whisper_config = configs(size)
    unet_dir = folder / ("musetalkV15" if version == "v15" else "musetalk")
    for directory in (unet_dir, folder / "sd-vae", folder / "whisper"):
        directory.mkdir(parents=True, exist_ok=True)
    (unet_dir / "musetalk.json").write_text(json.dumps(unet_config, indent=2), encoding="utf-8")
    torch.save(unet.state_dict(), unet_dir / ("unet.pth" if version == "v15" else "pytorch_model.bin"))
    (folder / "sd-vae" / "config.json").write_text(json.dumps(vae_config, indent=2), encoding="utf-8")
    torch.save({former_attention_name(key): value for key, value in vae.state_dict().items()},
               folder / "sd-vae" / "diffusion_pytorch_model.bin")
    (folder / "whisper" / "config.json").write_text(json.dumps(whisper_config, indent=2), encoding="utf-8")
    whisper_state = {f"model.{key}": value for key, value in whisper.state_dict().items()}
    whisper_state["proj_out.weight"] = whisper_state["model.decoder.embed_tokens.weight"]
    torch.save(whisper_state, folder / "whisper" / "pytorch_model.bin")
    (folder / "whisper" / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2), encoding="utf-8")
    return folder


def former_attention_name(key: str) -> str:
    """A VAE key as sd-vae-ft-mse's file names it (attention projections under their former names)."""
    if ".attentions." not in key:
        return key
    head, _, leaf = key.rpartition(".attentions.")
    index, _, rest = leaf.partition(".")
    for new, old in VAE_RENAMES.items():
        if rest.startswith(new):
            return f"{head}.attentions.{index}.{old}{rest[len(new):]}"
    return key


def write_random_parsing_files(folder: Path, seed: int = 0) -> Path:
    """Random-init face-parse-bisent/79999_iter.pth (BiSeNet) and resnet18-5c106cde.pth (ResNet-18's
    layout, its classifier included, without batch-norm counters as that 2017 file has none)."""
    from heygem.models.bisenet import BiSeNet, ResNet18Features

    directory = Path(folder) / "face-parse-bisent"
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    network = BiSeNet()
    for module in network.modules():  # batch norms with statistics of their own, as trained ones have
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    torch.save(network.state_dict(), directory / "79999_iter.pth")
    backbone = {key: value for key, value in ResNet18Features().state_dict().items()
                if not key.endswith("num_batches_tracked")}
    backbone["fc.weight"], backbone["fc.bias"] = torch.randn(1000, 512) * 0.01, torch.zeros(1000)
    torch.save(backbone, directory / "resnet18-5c106cde.pth")
    return directory
