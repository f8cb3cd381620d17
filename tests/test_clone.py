"""The cloned voice (VibeVoice through transformers 5): random-init files of a reduced configuration in
the published layout, loaded strictly from the folder, speaking sentence by sentence on the CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

import torch

from heygem.errors import HeygemError
from heygem.speech import clone
from heygem.speech.clone_files import forced_frames, scripted_tokens, write_random_files


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return write_random_files(tmp_path_factory.mktemp("weights") / "vibevoice", size="reduced", seed=0,
                              shard_size="300KB")


def copy_of(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "vibevoice"
    shutil.copytree(folder, target)
    return target


def reference_speech(seconds: float = 3.0, rate: int = 24000) -> np.ndarray:
    """A voiced, pitch-gliding buzz: enough for the processor (the model is random anyway)."""
    times = np.arange(int(seconds * rate)) / rate
    pitch = 120 + 30 * np.sin(2 * np.pi * 0.5 * times)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    return (0.2 * np.sign(np.sin(phase)) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * times))).astype(np.float32)


def test_random_files_are_in_the_published_layout(model_folder):
    names = {path.name for path in model_folder.iterdir()}
    assert {"config.json", "generation_config.json", "processor_config.json", "chat_template.jinja",
            "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"} <= names
    shards = sorted(name for name in names if name.endswith(".safetensors"))
    assert len(shards) > 1 and all(name.startswith("model-000") for name in shards)
    config = json.loads((model_folder / "config.json").read_text())
    assert config["model_type"] == "vibevoice" and config["architectures"] == ["VibeVoiceForConditionalGeneration"]
    processor = json.loads((model_folder / "processor_config.json").read_text())
    assert processor["processor_class"] == "VibeVoiceProcessor"
    assert processor["feature_extractor"]["sampling_rate"] == 24000
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_folder), local_files_only=True)
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>"])
    assert ids == [config["eos_token_id"], config["audio_bos_token_id"], config["audio_eos_token_id"],
                   config["audio_token_id"]]


def test_the_full_configuration_has_the_published_tensor_count():
    from transformers import VibeVoiceConfig

    from heygem.speech.clone_files import configs

    expected = clone.expected_tensors(VibeVoiceConfig(**configs("full")[0]))
    assert len(expected) == 1204
    assert expected["model.language_model.embed_tokens.weight"] == (151936, 1536)
    assert "lm_head.weight" not in expected  # tied: not stored


def test_check_files_accepts_the_folder(model_folder):
    clone.check_files(model_folder)


def test_a_missing_folder_says_where_to_put_the_files(tmp_path):
    with pytest.raises(HeygemError) as caught:
        clone.check_files(tmp_path / "vibevoice")
    message = str(caught.value)
    assert "\n" not in message and "weights/vibevoice/" in message and "config.json" in message


def refused_after_changing(folder: Path, name: str, change) -> tuple[Path, str]:
    """Rewrite the shard holding tensor ``name`` with ``change(tensors)`` applied; the shard and the one-line
    refusal of check_files."""
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(HeygemError) as caught:
        clone.check_files(folder)
    message = str(caught.value)
    assert "\n" not in message and shard.name in message and name in message
    return shard, message


def test_a_missing_tensor_is_named_with_its_shard(model_folder, tmp_path):
    name = "model.diffusion_head.final_layer.linear_2.weight"
    refused_after_changing(copy_of(model_folder, tmp_path), name, lambda tensors: tensors.pop(name))


def test_a_tensor_of_the_wrong_shape_is_named_with_its_shard(model_folder, tmp_path):
    name = "model.multi_modal_projector.linear_1.weight"

    def widen(tensors):
        tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)

    _, message = refused_after_changing(copy_of(model_folder, tmp_path), name, widen)
    assert "shape" in message


def test_a_missing_shard_and_a_cut_shard_are_named(model_folder, tmp_path):
    folder = copy_of(model_folder, tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    (folder / shards[0]).unlink()
    with pytest.raises(HeygemError, match=shards[0]):
        clone.check_files(folder)
    shutil.copy(model_folder / shards[0], folder / shards[0])
    data = (folder / shards[1]).read_bytes()
    (folder / shards[1]).write_bytes(data[: len(data) // 2])
    with pytest.raises(HeygemError, match=shards[1]):
        clone.check_files(folder)


def test_a_config_of_another_model_is_refused(model_folder, tmp_path):
    folder = copy_of(model_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["hidden_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeygemError) as caught:
        clone.check_files(folder)
    assert "\n" not in str(caught.value) and "shape" in str(caught.value)


def test_loading_and_speaking_never_reach_the_network(model_folder, monkeypatch):
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("the network was reached")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    clone.load_model.cache_clear()
    model = clone.load_model(model_folder, "cpu")
    voice = clone.ClonedVoice(model, reference_speech(), 24000,
                              logits_processors=[forced_frames(model.model.config, 1)])
    assert voice.speak("Hi.").shape == (3200,)
    assert model.sample_rate == 24000 and model.samples_per_frame == 3200
    assert model.device.type == "cpu"


def test_speaks_a_sentence_of_the_forced_length(model_folder):
    model = clone.load_model(model_folder, "cpu")
    voice = clone.ClonedVoice(model, reference_speech(), 24000,
                              logits_processors=[forced_frames(model.model.config, 5)])
    assert voice.sample_rate == 24000
    samples = voice.speak("Hello there.")
    assert samples.dtype == np.float32 and samples.shape == (5 * 3200,)
    assert np.all(np.isfinite(samples)) and np.abs(samples).max() <= 1.0
    assert samples.std() > 1e-3  # the decoder made a waveform, not silence
    assert voice.speak("你好。").shape == (5 * 3200,)


def test_the_reference_is_in_the_prompt_one_frame_token_per_3200_samples(model_folder):
    model = clone.load_model(model_folder, "cpu")
    reference = reference_speech(2.0, 16000)  # resampled to 24 kHz: 48000 samples = 15 frames
    voice = clone.ClonedVoice(model, reference, 16000)
    assert len(voice.reference) == 48000
    inputs = voice.inputs("Hello.")
    frames = int((inputs["input_ids"][0] == model.model.config.audio_token_id).sum())
    assert frames == 15 and inputs["input_values"].shape[-1] == 48000


def test_without_forcing_the_sentence_is_bounded(model_folder):
    model = clone.load_model(model_folder, "cpu")
    assert clone.max_frames("Hi.", 7.5) == int(np.ceil((8 + 0.4 * 3) * 7.5))
    samples = clone.ClonedVoice(model, reference_speech(), 24000).speak("Hi.")
    assert len(samples) % 3200 == 0 and len(samples) <= clone.max_frames("Hi.", 7.5) * 3200


def test_generate_runs_no_logits_guidance_pass(model_folder):
    from transformers import GenerationConfig
    from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

    model = clone.load_model(model_folder, "cpu")
    assert model.model.generation_config.guidance_scale == 1.3  # the diffusion head keeps its guidance
    processors = model.model._get_logits_processor(GenerationConfig(guidance_scale=1.3), device="cpu")
    assert not any(isinstance(p, UnbatchedClassifierFreeGuidanceLogitsProcessor) for p in processors)


def test_a_steady_model_speaks_exactly_its_frames_per_sentence(tmp_path):
    folder = write_random_files(tmp_path / "vibevoice", size="reduced", seed=3, frames_per_sentence=4)
    model = clone.load_model(folder, "cpu")
    voice = clone.ClonedVoice(model, reference_speech(), 24000)
    assert voice.speak("Hello there.").shape == (4 * 3200,)
    assert voice.speak("A longer sentence than the one before it.").shape == (4 * 3200,)


def test_the_doctor_checks_the_folder_and_names_a_broken_file(model_folder, tmp_path):
    from heygem.doctor import PROBLEM, check_clone_voice

    weights = model_folder.parent
    (good,) = check_clone_voice(weights)
    assert good.status == "ok" and "VibeVoice-1.5B" in good.detail and "shards" in good.detail
    (absent,) = check_clone_voice(tmp_path / "none")
    assert absent.status == "ok" and "weights/vibevoice/" in absent.detail
    broken = copy_of(model_folder, tmp_path)
    (broken / "tokenizer.json").unlink()
    (problem,) = check_clone_voice(broken.parent)
    assert problem.status == PROBLEM and "tokenizer.json" in problem.detail


def test_weights_list_and_verify_know_the_folder(model_folder, tmp_path):
    import os
    import subprocess
    import sys

    from conftest import REPO

    from heygem.weights import load_registry

    entries = [entry for entry in load_registry() if entry.files[0].startswith("vibevoice/")]
    assert {entry.files[0] for entry in entries} == {f"vibevoice/{name}" for name in
                                                     (*clone.CONFIG_FILES, clone.INDEX_FILE)}
    env = dict(os.environ, HEYGEM_WEIGHTS=str(model_folder.parent))
    listed = subprocess.run([sys.executable, "-m", "heygem", "weights", "list"], cwd=REPO, capture_output=True,
                            text=True, env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    rows = [line for line in listed.stdout.splitlines() if "vibevoice" in line]
    assert len(rows) == len(entries) and all(" voice " in row and "missing" not in row for row in rows)
    verified = subprocess.run([sys.executable, "-m", "heygem", "weights", "verify", "vibevoice_index"], cwd=REPO,
                              capture_output=True, text=True, env=env, timeout=120)
    assert verified.returncode == 0 and "unverified" in verified.stdout, verified.stdout + verified.stderr


def test_language_model_passes_per_frame_with_and_without_logits_guidance(model_folder):
    model = clone.load_model(model_folder, "cpu")
    voice = clone.ClonedVoice(model, reference_speech(), 24000, loop="generate")
    calls = []
    hook = model.model.model.language_model.register_forward_hook(lambda *args: calls.append(1))
    try:
        counts = {}
        for logits_guidance in (False, True):
            model.model.logits_guidance = logits_guidance
            voice.logits_processors = [forced_frames(model.model.config, 4)]
            calls.clear()
            voice.speak("Hello.")
            counts[logits_guidance] = len(calls)
    finally:
        model.model.logits_guidance = False
        hook.remove()
    # 6 tokens (4 frames, audio end, end of text): the prompt's branch 6 times, the negative branch per frame
    assert counts == {False: 6 + 4, True: 6 + 4 + 6}


def test_the_voice_benchmark_runs_the_reduced_model_on_the_cpu():
    import subprocess
    import sys

    from conftest import REPO

    command = [sys.executable, str(REPO / "bench" / "bench_voice.py"), "--tiny", "--device", "cpu", "--frames", "4",
               "--first-frames", "2", "--repeats", "1"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "first sentence: 2 frames" in result.stdout
    assert "CUDA graphs: language-model step no, decoder and encoder no, 10-step denoising no" in result.stdout
    assert "fast against generate, same seed, 2 frames: max abs difference" in result.stdout
    rows = [line.strip("|").split("|") for line in result.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| loop")]
    assert [row[0].strip() for row in rows] == ["generate", "fast"]
    for row in rows:
        prepare, cold, first, stream, per_frame, rtf = (float(cell) for cell in row[1:7])
        assert min(cold, first, stream, per_frame, rtf) > 0 and prepare >= 0
        assert abs(per_frame - 1000 * stream / 4) < 1.5  # stream is printed to 10 ms


def test_a_bf16_model_speaks_from_a_float32_voice_sample(tmp_path):
    """On a GPU the model runs in bf16 while the processor gives float32 samples."""
    folder = write_random_files(tmp_path / "vibevoice", size="reduced", seed=4, frames_per_sentence=3)
    clone.load_model.cache_clear()
    model = clone.load_model(folder, "cpu")
    model.model.to(torch.bfloat16)
    try:
        samples = clone.ClonedVoice(model, reference_speech(), 24000).speak("Hello there.")
    finally:
        clone.load_model.cache_clear()
    assert samples.dtype == np.float32 and samples.shape == (3 * 3200,) and np.all(np.isfinite(samples))


SCRIPTS = {  # F frame, E audio end, S audio start, X end of text
    "frames": "FFFFFFEX",
    "a frame after an audio end": "FFEFFX",  # the negative branch skips the end's step
    "a second audio part": "FFESFFX",  # the negative branch starts over at S
    "ends before the first frame": "EEFFX",  # the negative branch's first token is a frame's input
}


@pytest.fixture(scope="module")
def sensitive_model(model_folder):
    """The reduced model (its own copy) with the language model, the diffusion head and the connectors
    redrawn at 1/sqrt(fan-in): with the library's small init the head barely hears its condition, so a
    wrong negative branch would not show in the audio."""
    model = clone.load_model.__wrapped__(model_folder, "cpu")
    generator = torch.Generator().manual_seed(1)
    core = model.model.model
    with torch.no_grad():
        for part in (core.language_model, core.diffusion_head, core.multi_modal_projector, core.semantic_connector):
            for parameter in part.parameters():
                if parameter.dim() > 1:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5)
    return model


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_the_fast_loop_speaks_what_generate_speaks(sensitive_model, script):
    """Same seed, same tokens: the batch-2 static-cache loop's audio is generate's, to float rounding (a
    wrong position or mask in the negative branch moves the audio by 0.007-0.03)."""
    config = sensitive_model.model.config
    ids = {"F": config.audio_token_id, "E": config.audio_eos_token_id, "S": config.audio_bos_token_id,
           "X": config.eos_token_id}
    voice = clone.ClonedVoice(sensitive_model, reference_speech(), 24000)
    spoken = {}
    for loop in ("generate", "fast"):
        voice.loop = loop
        voice.logits_processors = [scripted_tokens([ids[letter] for letter in script])]
        torch.manual_seed(11)
        spoken[loop] = voice.speak("Hello there, nice to meet you.")
    frames = script.count("F")
    assert spoken["generate"].shape == spoken["fast"].shape == (frames * 3200,)
    assert spoken["generate"].std() > 0.02
    difference = np.abs(spoken["fast"] - spoken["generate"]).max()
    assert difference < 1e-5, difference  # measured: 4e-7 to 1.1e-6 (batch-2 against batch-1 products)


def test_the_fast_loop_runs_the_language_model_once_per_frame(model_folder):
    model = clone.load_model(model_folder, "cpu")
    voice = clone.ClonedVoice(model, reference_speech(), 24000, loop="fast",
                              logits_processors=[forced_frames(model.model.config, 4)])
    calls = []
    hook = model.model.model.language_model.register_forward_hook(
        lambda module, args, kwargs, output: calls.append(kwargs["inputs_embeds"].shape[0]), with_kwargs=True)
    try:
        assert voice.speak("Hello.").shape == (4 * 3200,)
    finally:
        hook.remove()
    # the prompt, the negative branch's audio start (batch 1 each), then one batch-2 step per further token
    assert calls == [1, 1] + [2] * 5


def test_the_voice_loop_is_chosen_by_the_environment(model_folder, monkeypatch):
    model = clone.load_model(model_folder, "cpu")
    voice = clone.ClonedVoice(model, reference_speech(), 24000)
    monkeypatch.delenv("HEYGEM_VOICE_LOOP", raising=False)
    assert voice.chosen_loop() == "fast"
    monkeypatch.setenv("HEYGEM_VOICE_LOOP", "generate")
    assert voice.chosen_loop() == "generate"
    monkeypatch.setenv("HEYGEM_VOICE_LOOP", "quick")
    with pytest.raises(HeygemError, match="HEYGEM_VOICE_LOOP"):
        voice.speak("Hi.")


def test_without_cuda_graphs_the_fast_loop_falls_back_to_running_eagerly(sensitive_model, caplog):
    """Asked for graphs where none can be captured (here: no CUDA), each piece says so once and runs eagerly,
    speaking what generate speaks."""
    import logging

    from heygem.speech.clone_loop import FrameLoop

    config = sensitive_model.model.config
    voice = clone.ClonedVoice(sensitive_model, reference_speech(), 24000, loop="fast",
                              logits_processors=[forced_frames(config, 3)])
    sensitive_model.frame_loop = None
    with caplog.at_level(logging.WARNING, logger="heygem"):
        sensitive_model.frame_loop = FrameLoop(sensitive_model, use_graphs=True)
        torch.manual_seed(5)
        fast = voice.speak("Hello there.")
    sensitive_model.frame_loop = None
    warnings = [record.getMessage() for record in caplog.records if "without a CUDA graph" in record.getMessage()]
    assert len(warnings) == 3, warnings  # the language-model step, the decoder and encoder, the denoising loop
    voice.loop = "generate"
    voice.logits_processors = [forced_frames(config, 3)]
    torch.manual_seed(5)
    assert np.abs(voice.speak("Hello there.") - fast).max() < 1e-5
