"""The cloned voice: typed text spoken in the voice of a few seconds of someone's speech (zero-shot), by
VibeVoice-1.5B as transformers 5 runs it (``VibeVoiceForConditionalGeneration``, ``VibeVoiceProcessor``).

    check_files(folder)                      # strict: one HeygemError line naming the file at fault
    model = load_model(folder, device)       # once per folder and device
    voice = ClonedVoice(model, samples, rate)
    voice.speak("Hello there.")              # (n,) float32 mono at voice.sample_rate (24 kHz)

The files are read from ``weights/vibevoice/`` only (the layout of ``vibevoice/VibeVoice-1.5B-hf``:
config.json, generation_config.json, processor_config.json, chat_template.jinja, tokenizer.json,
tokenizer_config.json, model.safetensors.index.json and its shards); nothing is fetched. Before
loading, every tensor the model needs is looked up in the shards' headers with its shape. The
DPM-Solver noise scheduler comes from diffusers, as generation_config.json names it.

Each sentence is one conversation: the voice sample as speaker 0's audio, the sentence as speaker
0's text. The model emits one audio frame (3200 samples, 0.133 s) per new token until it chooses to
stop; ``max_frames`` bounds a sentence by its length (and generation_config.json's max_new_tokens,
where lower). Classifier-free guidance (1.3) is applied to
the diffusion head only, as the original VibeVoice does: the logits processor that ``generate`` adds
for ``guidance_scale != 1`` would run the language model a third time per frame for nothing (the
model picks among four tokens by argmax).

Sentences are spoken by heygem.speech.clone_loop's frame loop (both branches in one batch-2 forward
over a static cache; CUDA graphs on a GPU), the same arithmetic as ``generate``;
``HEYGEM_VOICE_LOOP=generate`` (or ``ClonedVoice.loop``) speaks through ``generate`` itself.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heygem.errors import HeygemError

logger = logging.getLogger("heygem")

MODEL_FOLDER = "vibevoice"  # under the weights folder
MODEL_NAME = "VibeVoice-1.5B"
VOICE_NAME = "clone"  # what --voice takes
LANGUAGES = "en,zh"  # what the model was trained to speak
SAMPLE_RATE = 24_000  # of the voice sample it takes and of the speech it makes
CONFIG_FILES = ("config.json", "generation_config.json", "processor_config.json", "chat_template.jinja",
                "tokenizer.json", "tokenizer_config.json")
INDEX_FILE = "model.safetensors.index.json"
WHERE_TO_PUT = (f"put VibeVoice-1.5B-hf's files ({', '.join(CONFIG_FILES)}, {INDEX_FILE} and its "
                f"model-*.safetensors shards) into weights/{MODEL_FOLDER}/")
SPEAKER = "0"
SECONDS_PER_CHARACTER = 0.4  # the slowest speech a sentence is given room for
MIN_SENTENCE_SECONDS = 8.0
PREPARED_SENTENCE_CHARACTERS = 200  # the fast loop is sized for sentences this long before the first one

_GENERATION_LOCK = threading.Lock()  # one sentence at a time per process: the model's caches are per call


def model_folder(weights_dir: str | Path) -> Path:
    return Path(weights_dir) / MODEL_FOLDER


def files_present(folder: Path) -> bool:
    """True when the configuration files and the index are there (the shards are checked by ``check_files``)."""
    return all((Path(folder) / name).is_file() for name in (*CONFIG_FILES, INDEX_FILE))


def missing_files_message(folder: Path) -> str:
    missing = [name for name in (*CONFIG_FILES, INDEX_FILE) if not (Path(folder) / name).is_file()]
    return (f"the cloned voice needs {MODEL_NAME}: {folder} lacks {', '.join(missing)}; {WHERE_TO_PUT}")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise HeygemError(f"{path} cannot be read as JSON ({error}): replace it with the published file") from None
    if not isinstance(value, dict):
        raise HeygemError(f"{path} is not a JSON object: replace it with the published file")
    return value


def _config(folder: Path):
    """The VibeVoiceConfig of ``folder``'s config.json; HeygemError naming the file when it is not one."""
    from transformers import VibeVoiceConfig

    path = folder / "config.json"
    description = _read_json(path)
    if description.get("model_type") != "vibevoice":
        raise HeygemError(f"{path} describes a {description.get('model_type')!r} model, not VibeVoice "
                          f"(model_type 'vibevoice'): {WHERE_TO_PUT}")
    try:
        return VibeVoiceConfig.from_dict(description)
    except Exception as error:  # the config class validates its fields with its own exception types
        raise HeygemError(f"{path} is not a usable VibeVoice configuration ({str(error).splitlines()[0]})") from None


def expected_tensors(config) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` holds, with its shape (the tied lm_head is not stored)."""
    import torch
    from transformers import VibeVoiceForConditionalGeneration

    with torch.device("meta"):
        model = VibeVoiceForConditionalGeneration(config)
    tied = set(getattr(model, "_tied_weights_keys", None) or {}) if config.tie_word_embeddings else set()
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items() if name not in tied}


def check_files(folder: str | Path) -> None:
    """HeygemError, one line naming the file and what is wrong, unless ``folder`` holds every file the
    model needs, every tensor in the shard the index names with the shape the configuration gives,
    and nothing else. Reads the configuration and the shards' headers only."""
    import safetensors

    folder = Path(folder)
    if not files_present(folder):
        raise HeygemError(missing_files_message(folder))
    for name in ("generation_config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json"):
        _read_json(folder / name)
    expected = expected_tensors(_config(folder))
    index_path = folder / INDEX_FILE
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HeygemError(f"{index_path} has no weight_map: replace it with the published file")
    missing = sorted(set(expected) - set(weight_map))
    if missing:
        raise HeygemError(f"{index_path} lists no tensor {missing[0]}"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: "
                          f"the files are of another model or incomplete")
    for shard_name in sorted(set(weight_map.values())):
        shard_path = folder / shard_name
        if Path(shard_name).name != shard_name or not shard_path.is_file():
            raise HeygemError(f"{shard_path} is missing ({index_path.name} names it): {WHERE_TO_PUT}")
        try:
            with safetensors.safe_open(str(shard_path), "pt") as shard:
                stored = {name: tuple(shard.get_slice(name).get_shape()) for name in shard.keys()}
        except Exception as error:  # safetensors raises its own error type for a cut or foreign file
            raise HeygemError(f"{shard_path} is not a readable safetensors file ({error}): download it again") from None
        for name, owner in weight_map.items():
            if owner != shard_name:
                continue
            if name not in stored:
                raise HeygemError(f"{shard_path} lacks the tensor {name} ({index_path.name} says it is there): "
                                  f"download the shard again")
            if name not in expected:
                raise HeygemError(f"{shard_path} holds {name}, which this configuration has no place for: the "
                                  f"files are of another model")
            if tuple(stored[name]) != expected[name]:
                raise HeygemError(f"{shard_path}: {name} has the shape {list(stored[name])}, config.json "
                                  f"gives {list(expected[name])}: the files are of another model")


@dataclass
class CloneModel:
    """The loaded model and processor, on one device."""

    model: object  # VibeVoiceForConditionalGeneration without the logits guidance pass
    processor: object  # VibeVoiceProcessor
    device: object  # torch.device
    folder: Path
    name: str = MODEL_NAME
    frame_loop: object = None  # clone_loop.FrameLoop, made when a voice of this model first needs it

    @property
    def sample_rate(self) -> int:
        return int(self.processor.feature_extractor.sampling_rate)

    @property
    def samples_per_frame(self) -> int:
        return int(math.prod(self.model.config.audio_config.downsampling_ratios))


def _model_class():
    """``VibeVoiceForConditionalGeneration`` without the logits guidance that ``generate`` adds whenever
    ``guidance_scale != 1`` (a third language-model pass per frame); the diffusion head keeps its guidance."""
    from transformers import VibeVoiceForConditionalGeneration
    from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

    class VibeVoiceHeadGuidance(VibeVoiceForConditionalGeneration):
        logits_guidance = False  # True: generate's own behaviour, the third pass included (for comparisons)

        def _get_logits_processor(self, *args, **kwargs):
            processors = super()._get_logits_processor(*args, **kwargs)
            if self.logits_guidance:
                return processors
            return type(processors)(processor for processor in processors
                                    if not isinstance(processor, UnbatchedClassifierFreeGuidanceLogitsProcessor))

    return VibeVoiceHeadGuidance


@functools.lru_cache(maxsize=1)
def load_model(folder: Path, device_name: str = "auto") -> CloneModel:
    """``folder``'s model (checked first, see ``check_files``) on ``device_name`` ("auto": the first GPU,
    else the CPU), bf16 on a GPU that has it and float32 elsewhere; kept for the next call."""
    import torch
    from transformers import VibeVoiceProcessor

    from heygem.runtime.device import pick_device

    folder = Path(folder)
    check_files(folder)
    device = pick_device(device_name)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    dtype = torch.bfloat16 if bf16 else torch.float32  # float16 overflows; older GPUs run float32
    from transformers.utils import logging as transformers_logging

    bar_shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # "Loading weights: 100%": heygem logs the load itself
    try:
        processor = VibeVoiceProcessor.from_pretrained(str(folder), local_files_only=True)
        model = _model_class().from_pretrained(str(folder), local_files_only=True, dtype=dtype)
    except Exception as error:  # what the checks above cannot see (a tokenizer of another kind, ...)
        raise HeygemError(f"{MODEL_NAME} in {folder} cannot be loaded ({str(error).splitlines()[0]}); "
                          f"{WHERE_TO_PUT}") from None
    finally:
        if bar_shown:
            transformers_logging.enable_progress_bar()
    model = model.to(device).eval()
    # each sentence passes max_new_tokens; the files' max_length beside it only makes generate warn each time
    model.generation_config.max_length = None
    if int(processor.feature_extractor.sampling_rate) != SAMPLE_RATE:
        raise HeygemError(f"{folder / 'processor_config.json'} gives a sampling rate of "
                          f"{processor.feature_extractor.sampling_rate} Hz, not {SAMPLE_RATE}: {WHERE_TO_PUT}")
    logger.info("loaded %s from %s on %s (%s)", MODEL_NAME, folder, device, dtype)
    return CloneModel(model=model, processor=processor, device=device, folder=folder)


def max_frames(sentence: str, frames_per_second: float) -> int:
    """The most audio frames a sentence may take: room for very slow speech of its characters."""
    seconds = MIN_SENTENCE_SECONDS + SECONDS_PER_CHARACTER * len(sentence)
    return int(math.ceil(seconds * frames_per_second))


class ClonedVoice:
    """A voice cloned from ``reference`` ((S,) float32 mono at ``reference_rate``, 3-30 s of clean speech,
    see heygem.speech.reference): ``speak(sentence)`` gives that sentence's samples at ``sample_rate``."""

    def __init__(self, model: CloneModel, reference: np.ndarray, reference_rate: int, *,
                 logits_processors: list | None = None, diffusion_steps: int | None = None,
                 loop: str | None = None):
        self.model = model
        self.sample_rate = model.sample_rate
        self.reference = resample(np.asarray(reference, np.float32).reshape(-1), reference_rate, self.sample_rate)
        self.logits_processors = logits_processors  # extra steering of the stop (the tests bound it exactly)
        self.diffusion_steps = diffusion_steps
        self.loop = loop  # "fast" | "generate"; None: $HEYGEM_VOICE_LOOP, else fast

    def chosen_loop(self) -> str:
        """"fast" (heygem.speech.clone_loop) or "generate": ``loop``, else ``$HEYGEM_VOICE_LOOP``, else fast."""
        from heygem.speech.clone_loop import LOOPS, chosen_loop

        if getattr(self.model.model, "logits_guidance", False):  # generate's own third pass: only generate runs it
            return "generate"
        if self.loop is not None:
            if self.loop not in LOOPS:
                raise HeygemError(f"{self.loop!r} is not a voice loop: use {' or '.join(LOOPS)}")
            return self.loop
        return chosen_loop()

    def frame_loop(self):
        """The model's fast frame loop (made once per loaded model)."""
        from heygem.speech.clone_loop import FrameLoop

        if self.model.frame_loop is None:
            self.model.frame_loop = FrameLoop(self.model)
        return self.model.frame_loop

    def prepare(self, sentence_characters: int = PREPARED_SENTENCE_CHARACTERS) -> None:
        """Size the fast loop's cache (and capture its CUDA graphs) for sentences of up to
        ``sentence_characters`` now, so the first sentence does not wait for it; longer ones grow it."""
        if self.chosen_loop() != "fast":
            return
        import torch

        prompt_tokens = int(self.inputs("a " * (sentence_characters // 2))["input_ids"].shape[1])
        frames_per_second = self.sample_rate / self.model.samples_per_frame
        with _GENERATION_LOCK, torch.inference_mode():
            self.frame_loop().prepare(prompt_tokens + max_frames("a" * sentence_characters, frames_per_second) + 3,
                                      self.diffusion_steps)

    def inputs(self, sentence: str):
        """The processor's tensors for one sentence spoken by the reference's speaker."""
        conversation = [{"role": SPEAKER, "content": [{"type": "text", "text": sentence},
                                                      {"type": "audio", "audio": self.reference}]}]
        return self.model.processor.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                                        return_tensors="pt")

    def speak(self, sentence: str) -> np.ndarray:
        """(n,) float32 mono in [-1, 1] at ``sample_rate``; empty when the model stops before any frame."""
        import torch
        from transformers import LogitsProcessorList

        model_dtype = next(self.model.model.parameters()).dtype
        inputs = self.inputs(sentence).to(self.model.device, dtype=model_dtype)  # the sample's floats as the model's
        frames_per_second = self.sample_rate / self.model.samples_per_frame
        limit = max_frames(sentence, frames_per_second) + 2  # + audio end, end of text
        files_limit = self.model.model.generation_config.max_new_tokens  # generation_config.json's, if lower
        options = {"max_new_tokens": min(limit, files_limit) if files_limit else limit}
        if self.logits_processors:
            options["logits_processor"] = LogitsProcessorList(self.logits_processors)
        if self.diffusion_steps:
            options["num_diffusion_steps"] = self.diffusion_steps
        with _GENERATION_LOCK, torch.inference_mode():
            if self.chosen_loop() == "fast":
                waveform = self.frame_loop().speak(inputs, options["max_new_tokens"], self.logits_processors,
                                                   self.diffusion_steps)
            else:
                audio = self.model.model.generate(**inputs, **options)
                waveform = audio[0] if audio else None
        if waveform is None:
            return np.zeros(0, np.float32)
        samples = waveform.detach().float().cpu().numpy().reshape(-1)  # (frames * 3200,)
        return np.clip(np.nan_to_num(samples), -1.0, 1.0).astype(np.float32)


def cloned_voice(folder: Path, reference: Path | None, device_name: str = "auto") -> ClonedVoice:
    """The model of ``folder`` speaking in the voice of the cleanest 5-30 s of speech in ``reference``
    (an audio file or a video with sound, see heygem.speech.reference); kept for the next call with the
    same recording."""
    if reference is None:
        raise HeygemError("the cloned voice needs a voice sample: give --voice-sample FILE (REST: voice_sample), "
                          "or a face video with its own speech")
    reference = Path(reference)
    try:
        stamp = reference.stat().st_mtime_ns
    except OSError:
        raise HeygemError(f"the voice sample {reference} cannot be read") from None
    return _cloned_voice(Path(folder), reference, stamp, device_name)


@functools.lru_cache(maxsize=2)
def _cloned_voice(folder: Path, reference: Path, stamp: int, device_name: str) -> ClonedVoice:
    from heygem.speech.reference import cleanest_speech

    model = load_model(folder, device_name)
    samples, rate = cleanest_speech(reference, model.sample_rate)
    voice = ClonedVoice(model, samples, rate)
    voice.prepare()
    return voice


def check_consent(voice: str | None, consent: bool) -> None:
    """HeygemError unless the cloned voice (``voice`` "clone") comes with the speaker's consent."""
    if voice == VOICE_NAME and not consent:
        raise HeygemError("speaking in a cloned voice needs the consent of the person whose voice it is: once they "
                          "have agreed, add --voice-consent (REST and gradio_client: voice_consent=true)")


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """(S,) float32 from ``from_rate`` to ``to_rate`` Hz, band-limited through the FFT (what lies above
    the lower rate's Nyquist frequency is dropped)."""
    samples = np.asarray(samples, np.float32).reshape(-1)
    if from_rate == to_rate or len(samples) == 0:
        return samples
    count = max(1, int(round(len(samples) * to_rate / from_rate)))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    kept = np.zeros(count // 2 + 1, np.complex128)
    bins = min(len(kept), len(spectrum))
    kept[:bins] = spectrum[:bins]
    return (np.fft.irfft(kept, n=count) * (count / len(samples))).astype(np.float32)
