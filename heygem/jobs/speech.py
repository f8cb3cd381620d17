"""A job made from text: its words kept with the job when it is queued and spoken by the worker that
runs it, sentence by sentence while the video is made (heygem.spoken), so that its stream plays before
the whole script is spoken. A server's --max-audio-seconds stops the speaking (and fails the job) as
soon as the speech is longer; the text's length is checked at the door. Where a Ray node renders the
job, the whole text is spoken first instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from heygem.errors import HeygemError
from heygem.jobs.files import SPEECH_NAME, SUBTITLES_NAME, TEXT_NAME


def keep_text(directory: Path, text: str, voice: str | None, speed: float, max_characters: int | None,
              max_seconds: float | None = None, *, voice_consent: bool = False, voice_sample: str | None = None,
              face_name: str | None = None) -> str:
    """Check the words and the voice now (one line for the user, before anything is queued) and keep
    them in the job's folder for its worker; returns the name the job's speech will have. The cloned
    voice (``voice`` "clone") needs ``voice_consent`` and speaks in the voice of the job's file
    ``voice_sample``, else of its face video ``face_name``'s own sound."""
    from heygem.speech.clone import VOICE_NAME, check_consent
    from heygem.speech.reference import cleanest_speech
    from heygem.speech.tts import check_text, choose_voice
    from heygem.weights import weights_dir

    check_text(text, max_characters)
    check_consent(voice or None, voice_consent)
    choose_voice(text, voice or None, weights_dir())  # an unknown voice (or clone without its files) is refused
    if voice == VOICE_NAME:
        voice_sample = voice_sample or _face_with_sound(directory, face_name)
        cleanest_speech(directory / voice_sample)  # a sample without usable speech is refused now, not later
    elif voice_sample is not None:
        raise HeygemError("a voice sample is for the cloned voice: set the voice to clone, or leave the sample out")
    description = {"text": text, "voice": voice or None, "speed": speed, "max_characters": max_characters,
                   "max_seconds": max_seconds, "voice_sample": voice_sample,
                   "voice_consent": bool(voice_consent)}  # kept with the job: the speaker agreed
    (directory / TEXT_NAME).write_text(json.dumps(description, ensure_ascii=False), encoding="utf-8")
    return SPEECH_NAME


def _face_with_sound(directory: Path, face_name: str | None) -> str:
    """``face_name`` when it is a video with sound (the cloned voice's sample); HeygemError otherwise."""
    from heygem.media.probing import probe

    if face_name is not None:
        info = probe(directory / face_name)
        if info.kind == "video" and info.has_audio:
            return face_name
    raise HeygemError("the face has no sound to take the voice from: send a voice sample (voice_sample, 5-30 s of "
                      "the person speaking) with voice=clone")


def voice_sample_path(directory: Path, kept: dict) -> Path | None:
    """The recording a job's cloned voice imitates, or None for other voices."""
    return directory / kept["voice_sample"] if kept.get("voice_sample") else None


def kept_text(directory: Path) -> dict | None:
    """The words a job keeps for its worker to speak, or None once they are spoken (or for other jobs)."""
    if (directory / SPEECH_NAME).is_file():
        return None  # spoken by an earlier attempt, or before it was queued: the same speech again
    try:
        return json.loads((directory / TEXT_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as problem:
        raise HeygemError(f"the job's text cannot be read: {problem}") from None


def speak_whole(directory: Path, kept: dict) -> None:
    """Speak the ``kept`` words (:func:`kept_text`) into the job's speech.wav and speech.srt at once (for
    a renderer that takes a finished speech file)."""
    from heygem.speech.tts import check_length, clone_voice, synthesize
    from heygem.weights import weights_dir

    sample = voice_sample_path(directory, kept)
    voice = kept["voice"] if sample is None else clone_voice(weights_dir(), sample)
    speech = synthesize(kept["text"], voice=voice, speed=kept["speed"], weights_dir=weights_dir(),
                        max_characters=kept["max_characters"])
    check_length(speech.duration, kept.get("max_seconds"))  # from the store's limits
    keep_speech(directory, speech)


def keep_speech(directory: Path, speech, wav_path: Path | None = None) -> None:
    """The job's speech.wav (moved from ``wav_path`` where it was written already) and speech.srt."""
    from heygem.speech.subtitles import write_srt
    from heygem.speech.tts import write_wav

    write_srt(speech.cues, directory / SUBTITLES_NAME)
    if wav_path is not None:
        os.replace(wav_path, directory / SPEECH_NAME)
    else:
        write_wav(speech, directory / SPEECH_NAME)

