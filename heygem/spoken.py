"""Step 2 for words instead of a recording: the text spoken sentence by sentence, and the video
rendered in consecutive parts as the speech comes, so that its stream plays before the whole
script is spoken.

    speak    the sentences, in a background thread (heygem.speech.tts.stream_sentences: several at
             once where there are cores)
    parts    the first part as soon as FIRST_PART_SECONDS of speech are there, then each next part
             with every sentence spoken meanwhile; each part is one heygem.pipeline.generate, cut at
             a whole frame, its face going on where the part before left it (the still photo, or the
             video's frames and their track, which the parts before stored in the avatar cache), its
             stream going on after theirs
    join     the parts' video without re-encoding, with the whole speech, into the output (a cloned
             voice's output says so in its metadata: "voice: clone, model: VibeVoice-1.5B")

Where the parts meet, what a single render of the whole speech would give differs only a little:
each part's audio features end at its own end (a sentence's pause, silent), and its x264 starts
with a key frame. A video face without the avatar cache cannot go on from a stored track: it is
rendered in one part once the whole text is spoken.
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from heygem.config import Config, apply_overrides, load_config
from heygem.errors import HeygemError
from heygem.media.encode import check_output_name, comment_args, concat_list, join_args, run_ffmpeg_to_end
from heygem.media.probing import MIN_SPEECH_SECONDS, check_written, probe, probe_inputs
from heygem.media.stream import StreamContinuation, mark_complete, stream_folder
from heygem.pipeline import PROGRESS_SPANS, generate
from heygem.speech import audio
from heygem.speech.clone import MODEL_NAME as CLONE_MODEL_NAME
from heygem.speech.subtitles import write_srt
from heygem.speech.tts import Speech, check_length, check_text, choose_voice, stream_sentences, write_wav
from heygem.types import GenerationSummary

logger = logging.getLogger("heygem")

FIRST_PART_SECONDS = 2.0  # speech in the first part: short, so the first frame comes soon
PART_GROWTH = 4  # each next part waits for this many times more speech than the one before (or the end)
_END = object()  # the speaker's last item


def generate_spoken(face_path: str | Path, text: str, output_path: str | Path, config: Config | None = None, *,
                    voice: str | None = None, speed: float = 1.0, weights_folder: Path | None = None,
                    voice_sample: str | Path | None = None,
                    max_characters: int | None = None, max_seconds: float | None = None,
                    overrides: dict | None = None, progress: Callable[[str, float], None] | None = None,
                    should_stop: Callable[[], bool] | None = None) -> tuple[GenerationSummary, Speech]:
    """Make ``output_path`` of the face in ``face_path`` speaking ``text`` (in parts, see the module);
    returns the summary (also written beside the output as JSON) and the whole speech (its samples
    and cues, for OUT.wav and the subtitles). The speech is written to ``output_path`` with suffix
    .wav; the cues spoken so far to ``output_path`` with suffix .srt as they come (players that show the
    stream show them). ``max_characters``: the longest text taken (default ``config.text.max_characters``);
    ``max_seconds``: the longest speech (None: any), a HeygemError as soon as it is longer.
    ``voice`` "clone" speaks in the voice of ``voice_sample`` (a recording), else of the face video's own
    sound (heygem.speech.reference picks its cleanest speech). Raises HeygemError for unusable text,
    voice or options, as heygem.pipeline.generate does for the rest."""
    started = time.perf_counter()
    config = apply_overrides(config if config is not None else load_config(), overrides or {})
    face_path, output_path = Path(face_path), Path(output_path)
    check_output_name(output_path)
    if max_characters is None:
        max_characters = config.text.max_characters
    check_text(text, max_characters)
    face_info, _ = probe_inputs(face_path, None, picture_only=True)  # the speech is not there yet
    choice = choose_voice(text, voice, weights_folder)
    if choice.voice.kind == "clone":
        choice = replace(choice, voice=replace(choice.voice, reference=_voice_sample(voice_sample, face_path,
                                                                                     face_info)))
    elif voice_sample is not None:
        raise HeygemError("a voice sample is for the cloned voice: give --voice clone with it, or leave it out")
    if choice.note:
        logger.info("%s", choice.note)
    sentences: queue.Queue = queue.Queue()
    stop = threading.Event()
    speaker = threading.Thread(target=_speak, args=(text, choice, speed, max_characters, sentences, stop),
                               name="heygem-speech", daemon=True)
    speaker.start()
    rate = choice.voice.sample_rate
    fps = face_info.fps if face_info.kind == "video" else config.media.fps
    in_parts = face_info.kind == "image" or config.run.avatar_cache
    stream_dir = stream_folder(output_path) if config.media.stream else None
    output_path.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{output_path.stem}.", suffix=".parts", dir=output_path.parent))
    spoken: list[np.ndarray] = []  # every sentence's samples so far, in order
    cues = []
    summaries: list[GenerationSummary] = []
    part_offsets: list[float] = []  # when each part's render started, seconds since this call
    done_frames = 0  # frames rendered by the parts so far
    cut_sample = 0  # where the next part's samples start in the whole speech
    stream_index = 0
    shown = [0.0]  # the progress shown so far: it never goes back when the foreseen length changes
    ended = False
    try:
        while not ended:
            minimum = FIRST_PART_SECONDS * PART_GROWTH ** len(summaries)  # parts that grow: few renders
            ended = _take(sentences, spoken, cues, rate, cut_sample, minimum, wait_for_all=not in_parts)
            check_length(sum(len(samples) for samples in spoken) / rate, max_seconds)
            _write_cues_so_far(cues, output_path.with_suffix(".srt"))
            whole = np.concatenate(spoken) if spoken else np.zeros(0, np.float32)  # (N,) float32
            if ended and summaries and len(whole) - cut_sample < MIN_SPEECH_SECONDS * rate:
                break  # too little left for a part of its own (what the last whole frame left over)
            if ended:
                end_frame = done_frames + max(1, audio.output_frame_count(len(whole) / rate, fps) - done_frames)
                end_sample = len(whole)
            else:  # a whole number of frames; what is left of the last frame goes to the next part
                end_frame = int(len(whole) / rate * fps)
                end_sample = int(round(end_frame / fps * rate))
                if end_frame <= done_frames:
                    continue  # under one frame of new speech: wait for more
            part_path = work_dir / f"part-{len(summaries):03d}.mp4"
            part_speech = Speech(samples=whole[cut_sample:end_sample], sample_rate=rate, cues=[], voice=choice.voice)
            part_audio = write_wav(part_speech, part_path.with_suffix(".wav"))
            turns = tuple(summaries[0].turns) if summaries and summaries[0].turns else None  # as the first part
            place = StreamContinuation(first_index=stream_index, first_frame=done_frames, last=False, folder=stream_dir,
                                       turns=turns)
            # the whole's length foreseen from the characters spoken so far (exact once the last is spoken)
            said = sum(len(cue.text) for cue in cues)
            foreseen = end_frame if ended else max(end_frame, round(end_frame * len(text.strip()) / max(said, 1)))
            part_offsets.append(time.perf_counter() - started)
            summary = generate(face_path, part_audio, part_path, config, part=place, should_stop=should_stop,
                               progress=_part_progress(progress, done_frames, end_frame, foreseen, len(summaries),
                                                       ended, shown))
            summaries.append(summary)
            stream_index += summary.stream_processes
            done_frames += summary.frames
            cut_sample = end_sample
        speech = Speech(samples=whole, sample_rate=rate, cues=cues, voice=choice.voice,  # every sentence: ended
                        voice_note=choice.note)
        speech_path = write_wav(speech, output_path.with_suffix(".wav"))
        _join([summary.output_path for summary in summaries], speech_path, output_path, config)
        if choice.voice.kind == "clone":
            mark_cloned_voice(output_path)
        check_written(output_path, done_frames, fps)
        if stream_dir is not None:
            mark_complete(stream_dir)
    except BaseException:
        stop.set()
        if stream_dir is not None:
            shutil.rmtree(stream_dir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    summary = _joined_summary(summaries, output_path, speech_path, done_frames, fps, time.perf_counter() - started,
                              part_offsets)
    summary = replace(summary, voice=choice.voice.name,
                      voice_model=CLONE_MODEL_NAME if choice.voice.kind == "clone" else "")
    output_path.with_suffix(".json").write_text(json.dumps(summary.to_json_dict(), indent=2, default=str),
                                                encoding="utf-8")
    logger.info("spoken in %d part%s", len(summaries), "" if len(summaries) == 1 else "s")
    return summary, speech


def _write_cues_so_far(cues: list, srt_path: Path) -> None:
    """The cues spoken so far as SubRip, replaced whole (a reader never sees half a file)."""
    partial = srt_path.with_name(f".{srt_path.name}.partial")
    write_srt(cues, partial)
    partial.replace(srt_path)


def _voice_sample(voice_sample: str | Path | None, face_path: Path, face_info) -> Path:
    """The recording the cloned voice imitates: the voice sample given, else the face video itself."""
    if voice_sample is not None:
        voice_sample = Path(voice_sample)
        if not voice_sample.is_file():
            raise HeygemError(f"the voice sample {voice_sample} is not a file")
        return voice_sample
    if face_info.kind != "video" or not face_info.has_audio:
        raise HeygemError(f"{face_path.name} has no sound to take the voice from: give a voice sample "
                          f"(--voice-sample FILE; REST: voice_sample) of 5-30 s of the person speaking")
    return face_path


def mark_cloned_voice(output_path: Path, summary_path: Path | None = None) -> None:
    """The MP4's metadata ("voice: clone, model: VibeVoice-1.5B" as its comment, nothing re-encoded) and
    the JSON summary at ``summary_path``, where given, say that the cloned voice spoke."""
    tagged = output_path.with_name(f".{output_path.stem}.tagged.mp4")
    try:
        failure = run_ffmpeg_to_end(comment_args(output_path, tagged, f"voice: clone, model: {CLONE_MODEL_NAME}"))
        if failure is not None:
            raise HeygemError(f"writing the video's metadata failed: {failure}")
        tagged.replace(output_path)
    finally:
        tagged.unlink(missing_ok=True)
    if summary_path is not None and summary_path.is_file():
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        summary.update(voice="clone", voice_model=CLONE_MODEL_NAME)
        summary_path.write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")


def _speak(text, choice, speed, max_characters, sentences: queue.Queue, stop: threading.Event) -> None:
    """The speaker's thread: each sentence's audio onto ``sentences`` as it is spoken, then _END (or
    the error that stopped it)."""
    try:
        for sentence in stream_sentences(text, choice, speed, max_characters=max_characters):
            if stop.is_set():
                return
            sentences.put(sentence)
        sentences.put(_END)
    except BaseException as error:  # noqa: BLE001 - handed to the thread that renders
        sentences.put(error)


def _take(sentences: queue.Queue, spoken: list, cues: list, rate: int, cut_sample: int, minimum_seconds: float,
          wait_for_all: bool) -> bool:
    """Move what the speaker has spoken onto ``spoken`` and ``cues``: at least one sentence, at least
    ``minimum_seconds`` past ``cut_sample``, everything when ``wait_for_all``. True once the last
    sentence is taken."""
    waited_one = False
    while True:
        have = sum(len(samples) for samples in spoken) - cut_sample
        must_wait = wait_for_all or not waited_one or have < minimum_seconds * rate
        try:
            item = sentences.get() if must_wait else sentences.get_nowait()
        except queue.Empty:
            return False
        if item is _END:
            if not spoken:
                raise HeygemError("the voice made no sound for this text: try another voice")
            return True
        if isinstance(item, BaseException):
            raise item
        spoken.append(item.samples)
        cues.append(item.cue)
        waited_one = True


def _part_progress(progress, first: int, end: int, whole: int, number: int, last: bool, shown: list[float]):
    """A part's progress (heygem.pipeline's overall fractions) as the whole's: its prepare shown for the
    first part only, its frames ``first`` to ``end`` counted among the ``whole``'s foreseen, its finish
    for the last only; never below what was ``shown`` before."""
    if progress is None:
        return None
    low, high = PROGRESS_SPANS["generate"]

    def report(phase: str, overall: float) -> None:
        if (phase == "prepare" and number > 0) or (phase == "finish" and not last):
            return
        if phase == "generate":
            in_part = (overall - low) / (high - low)
            overall = low + (high - low) * min(1.0, (first + in_part * (end - first)) / max(whole, 1))
        shown[0] = overall = max(overall, shown[0])
        progress(phase, overall)

    return report


def _join(parts: list[Path], speech_path: Path, output_path: Path, config: Config) -> None:
    """The parts' video, one after another without re-encoding, with the whole speech, into ``output_path``."""
    if len(parts) == 1:
        # one part: its own file, its audio the whole speech already
        shutil.move(str(parts[0]), output_path)
        return
    folder = parts[0].parent
    video_only = []  # each part's video alone: its own audio's priming would shift the joined timestamps
    for part in parts:
        target = part.with_name(f"{part.stem}.video.mp4")
        failure = run_ffmpeg_to_end(["-nostdin", "-v", "error", "-y", "-i", str(part), "-map", "0:v:0", "-c", "copy",
                                     "-f", "mp4", str(target)])
        if failure is not None:
            raise HeygemError(f"joining the spoken parts failed: {failure}")
        video_only.append(target.name)
    list_path = folder / "parts.txt"
    list_path.write_text(concat_list(video_only), encoding="utf-8")
    joined = folder / "joined.mp4"
    args = join_args(list_path, speech_path, probe(speech_path), joined, audio_bitrate=config.media.audio_bitrate)
    failure = run_ffmpeg_to_end(args)
    if failure is not None:
        raise HeygemError(f"joining the spoken parts failed: {failure}")
    shutil.move(str(joined), output_path)


def _joined_summary(summaries: list[GenerationSummary], output_path: Path, speech_path: Path, frames: int,
                    fps: float, seconds: float, part_offsets: list[float]) -> GenerationSummary:
    """The parts' summaries as one: the whole's frames, speech and time, the stages' seconds added up and
    their spans on the whole's time line (each part's moved by when the part started, ``part_offsets``)."""
    stages: dict[str, float] = {}
    cpu: dict[str, float] = {}
    spans: dict[str, list[float]] = {}
    for part, offset in zip(summaries, part_offsets):
        for stage, (start, end) in part.stage_spans.items():
            first, last = spans.get(stage, (start + offset, end + offset))
            spans[stage] = [round(min(first, start + offset), 3), round(max(last, end + offset), 3)]
        for stage, value in part.seconds_per_stage.items():
            stages[stage] = round(stages.get(stage, 0.0) + value, 3)
        for stage, value in part.cpu_seconds_per_stage.items():
            cpu[stage] = round(cpu.get(stage, 0.0) + value, 3)
    last = summaries[-1]
    return replace(last, output_path=output_path, audio_path=speech_path, frames=frames,
                   frames_without_face=sum(part.frames_without_face for part in summaries),
                   audio_seconds=sum(part.audio_seconds for part in summaries), video_seconds=frames / fps,
                   seconds_per_stage=stages, cpu_seconds_per_stage=cpu, stage_spans=spans,
                   total_seconds=round(seconds, 3),
                   parts=len(summaries), stream_processes=sum(part.stream_processes for part in summaries),
                   avatar_cache=summaries[0].avatar_cache,
                   warnings=list(dict.fromkeys(warning for part in summaries for warning in part.warnings)))
