"""Random-init VibeVoice files in the layout transformers 5 loads (``vibevoice/VibeVoice-1.5B-hf``), for
the tests and the benchmark.

The full configuration is the public one (a Qwen2.5-1.5B language model, the sigma-VAE acoustic
tokenizer, the semantic encoder, a 4-layer diffusion head; audio start/end/frame tokens 151652-151654,
end of text 151643, 151936 embeddings). The reduced one keeps the same classes and the acoustic
geometry (24 kHz, 3200 samples per frame) with narrow, shallow layers and a vocabulary of 320, its
special tokens at ids 300-303 (the audio frame first), so the CPU speaks a sentence in seconds.
The tokenizer is a byte-level BPE trained here on a few lines (the real one is Qwen2.5's), padded
with unused tokens so that the special tokens sit at the configuration's ids; the chat template is
written here in the structure the processor expects (a voice-input part with one placeholder per
speaker, the text lines, the speech output start).
"""

from __future__ import annotations

import json
from pathlib import Path

END_OF_TEXT, AUDIO_START = "<|endoftext|>", "<|vision_start|>"
AUDIO_END, AUDIO_FRAME = "<|vision_end|>", "<|vision_pad|>"

TEXT_FULL = {
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 65536,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
}
TEXT_REDUCED = {**TEXT_FULL, "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
ACOUSTIC_FULL = {"model_type": "vibevoice_acoustic_tokenizer", "hidden_size": 64, "num_filters": 32,
                 "downsampling_ratios": [2, 2, 4, 5, 5, 8], "depths": [3, 3, 3, 3, 3, 3, 8], "vae_std": 0.625}
ACOUSTIC_REDUCED = {**ACOUSTIC_FULL, "hidden_size": 8, "num_filters": 2, "depths": [1] * 7}
SEMANTIC_FULL = {**ACOUSTIC_FULL, "model_type": "vibevoice_acoustic_tokenizer_encoder", "hidden_size": 128}
SEMANTIC_REDUCED = {**SEMANTIC_FULL, "hidden_size": 16, "num_filters": 2, "depths": [1] * 7}
HEAD_FULL = {"num_hidden_layers": 4, "intermediate_size": 4608, "frequency_embedding_size": 256}
HEAD_REDUCED = {"num_hidden_layers": 1, "intermediate_size": 48, "frequency_embedding_size": 16}
TOKEN_IDS_FULL = {END_OF_TEXT: 151643, AUDIO_START: 151652, AUDIO_END: 151653, AUDIO_FRAME: 151654}
TOKEN_IDS_REDUCED = {AUDIO_FRAME: 300, END_OF_TEXT: 301, AUDIO_START: 302, AUDIO_END: 303}

GENERATION = {
    "do_sample": False, "guidance_scale": 1.3, "max_new_tokens": 40500, "max_length": 40500,
    "noise_scheduler_class": "DPMSolverMultistepScheduler",
    "noise_scheduler_config": {"num_train_timesteps": 1000, "beta_schedule": "squaredcos_cap_v2",
                               "prediction_type": "v_prediction"},
}
FEATURE_EXTRACTOR = {"sampling_rate": 24000, "normalize_audio": True, "target_dB_FS": -25, "eps": 1e-6,
                     "pad_to_multiple_of": 3200}

# One system line; " Voice input:" with one "<start><frame><end>" per speaker that brings audio (the
# processor repeats the frame token once per 3200 samples); " Text input:" with a line per text; then
# " Speech output:" and the audio start token, after which the model speaks.
CHAT_TEMPLATE = (
    '{{- " Speak the lines below, each in the voice its speaker was given.\\n" -}}\n'
    "{%- set seen = namespace(roles=[]) -%}\n"
    "{%- for message in messages -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' and message['role'] not in seen.roles -%}"
    "{%- set seen.roles = seen.roles + [message['role']] -%}{%- endif -%}{%- endfor -%}{%- endfor -%}\n"
    "{%- if seen.roles %} Voice input:\n"
    "{% for role in seen.roles %} Speaker {{ role }}:"
    f"{AUDIO_START}{AUDIO_FRAME}{AUDIO_END}\n"
    "{% endfor -%}{%- endif %} Text input:\n"
    "{% for message in messages -%}{%- for part in message['content'] -%}{%- if part['type'] == 'text' %}"
    " Speaker {{ message['role'] }}: {{ part['text'] }}\n"
    "{% endif -%}{%- endfor -%}{%- endfor %} Speech output:\n"
    f"{AUDIO_START}"
)
CORPUS = ["Hello there, this is a short test of the voice.", "Speak the lines below.", " Speaker 0: Text input:",
          "你好，这是一个测试。", "The quick brown fox jumps over the lazy dog. 1234567890"]


def forced_frames(config, frames: int):
    """A logits processor that makes ``config``'s model speak exactly ``frames`` audio frames, then the
    audio end and the end of text (a random model stops wherever it likes): for tests and timings."""
    import torch
    from transformers import LogitsProcessor

    class ForcedFrames(LogitsProcessor):
        def __call__(self, input_ids, scores):
            starts = (input_ids[0] == config.audio_bos_token_id).nonzero()
            step = input_ids.shape[1] - 1 - int(starts[-1])  # tokens made since the prompt's audio start
            token = (config.audio_token_id if step < frames
                     else config.audio_eos_token_id if step == frames else config.eos_token_id)
            forced = torch.full_like(scores, float("-inf"))
            forced[:, token] = 0.0
            return forced

    return ForcedFrames()


def scripted_tokens(tokens: list[int]):
    """A logits processor that makes a model choose ``tokens`` in order, then the last one again: any mix of
    audio frames, audio ends and starts, for tests. One sentence per processor (its first call is the
    prompt's last position)."""
    import torch
    from transformers import LogitsProcessor

    class ScriptedTokens(LogitsProcessor):
        prompt_length = None

        def __call__(self, input_ids, scores):
            if self.prompt_length is None:
                self.prompt_length = input_ids.shape[1]
            step = input_ids.shape[1] - self.prompt_length
            forced = torch.full_like(scores, float("-inf"))
            forced[:, tokens[min(step, len(tokens) - 1)]] = 0.0
            return forced

    return ScriptedTokens()


def configs(size: str) -> tuple[dict, dict]:
    """(config.json, the special tokens' ids) for "full" (as published) or "reduced" (for the CPU)."""
    if size == "full":
        text, acoustic, semantic, head, ids = TEXT_FULL, ACOUSTIC_FULL, SEMANTIC_FULL, HEAD_FULL, TOKEN_IDS_FULL
    elif size == "reduced":
        text, acoustic, semantic, head, ids = (TEXT_REDUCED, ACOUSTIC_REDUCED, SEMANTIC_REDUCED, HEAD_REDUCED,
                                               TOKEN_IDS_REDUCED)
    else:
        raise ValueError(f"size is full or reduced, not {size!r}")
    config = {
        "model_type": "vibevoice", "architectures": ["VibeVoiceForConditionalGeneration"],
        "text_config": text, "audio_config": acoustic, "semantic_model_config": semantic,
        "diffusion_head_config": head, "pad_token_id": ids[END_OF_TEXT], "eos_token_id": ids[END_OF_TEXT],
        "audio_bos_token_id": ids[AUDIO_START], "audio_eos_token_id": ids[AUDIO_END],
        "audio_token_id": ids[AUDIO_FRAME],
    }
    return config, ids


def train_tokenizer(special_ids: dict[str, int]):
    """A byte-level BPE (as Qwen2.5's) trained on ``CORPUS``, its vocabulary padded with unused tokens so
    that each of ``special_ids`` (token -> id) gets exactly that id; a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trained.train_from_iterator(CORPUS, trainer)
    state = json.loads(trained.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" "))
              for merge in state["model"]["merges"]]
    by_id = {number: token for token, number in vocab.items()}
    if max(by_id) >= min(special_ids.values()):
        raise ValueError("the trained vocabulary reaches the special tokens' ids")
    for number in range(max(by_id) + 1, max(special_ids.values()) + 1):
        vocab[f"<|unused_{number}|>"] = number
    for token, number in special_ids.items():
        del vocab[f"<|unused_{number}|>"]
        vocab[token] = number
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(sorted(special_ids, key=special_ids.get))
    return tokenizer


def random_model(size: str = "reduced", seed: int = 0, dtype=None):
    """A ``VibeVoiceForConditionalGeneration`` of ``size`` randomly initialised from ``seed``: the library's
    init, except that the acoustic and semantic tokenizers' weights are drawn at 1/sqrt(fan-in) (with
    the library's small init the decoder's waveform is ~1e-9, silence once written as 16-bit PCM)."""
    import torch
    from transformers import GenerationConfig, VibeVoiceConfig, VibeVoiceForConditionalGeneration

    config, ids = configs(size)
    torch.manual_seed(seed)
    model = VibeVoiceForConditionalGeneration(VibeVoiceConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    for tower in (model.model.audio_tower, model.model.semantic_tokenizer_encoder):
        for parameter in tower.parameters():
            if parameter.dim() > 1:
                parameter.data = torch.randn(parameter.shape, generator=generator) / parameter[0].numel() ** 0.5
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config = GenerationConfig(**GENERATION, bos_token_id=None, eos_token_id=ids[END_OF_TEXT],
                                               pad_token_id=ids[END_OF_TEXT])
    return model.eval()


def write_random_files(folder: Path, size: str = "reduced", seed: int = 0, shard_size: str = "2GB",
                       dtype=None, frames_per_sentence: int | None = None) -> Path:
    """Write random-init files of ``size`` into ``folder`` (a weights/vibevoice) as transformers 5 saves
    the published ones: config.json, generation_config.json, processor_config.json, chat_template.jinja,
    tokenizer.json, tokenizer_config.json, model.safetensors.index.json and its shards (``shard_size``
    each at most). Returns ``folder``.

    ``frames_per_sentence`` N makes a model that speaks exactly N audio frames per sentence, in any
    process: its language model's last norm is zero, so the four tokens it may choose tie and argmax
    takes the lowest id, the audio frame; generation_config.json's max_new_tokens N ends the sentence.
    A random model stops wherever it likes otherwise (often before any frame)."""
    from transformers import Qwen2TokenizerFast, VibeVoiceAcousticTokenizerFeatureExtractor, VibeVoiceProcessor

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _, ids = configs(size)
    tokenizer = Qwen2TokenizerFast(tokenizer_object=train_tokenizer(ids), eos_token=END_OF_TEXT,
                                   pad_token=END_OF_TEXT, unk_token=None, bos_token=None)
    processor = VibeVoiceProcessor(feature_extractor=VibeVoiceAcousticTokenizerFeatureExtractor(**FEATURE_EXTRACTOR),
                                   tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    model = random_model(size, seed, dtype)
    if frames_per_sentence is not None:
        if ids[AUDIO_FRAME] != min(ids.values()):
            raise ValueError("a steady model needs the audio frame's id below the other special tokens'")
        model.model.language_model.norm.weight.data.zero_()
        model.generation_config.max_new_tokens = model.generation_config.max_length = frames_per_sentence
    model.save_pretrained(folder, max_shard_size=shard_size)
    if not (folder / "model.safetensors.index.json").is_file():  # one shard: written under the index's name too
        import safetensors

        only = folder / "model.safetensors"
        with safetensors.safe_open(str(only), "pt") as shard:
            names = list(shard.keys())
        shard_name = "model-00001-of-00001.safetensors"
        only.rename(folder / shard_name)
        index = {"metadata": {"total_size": (folder / shard_name).stat().st_size},
                 "weight_map": {name: shard_name for name in names}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    return folder
