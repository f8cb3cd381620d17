"""``python -m heygem presenters add|list|remove`` and ``generate --presenter``: the presenters of the
outputs folder a server uses (``--outputs``, default ``outputs/``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from heygem.errors import HeygemError
from heygem.jobs.files import DEFAULT_OUTPUTS, keep_server_files_under
from heygem.presenters.records import DEFAULT_MAX_SECONDS, PresenterStore

OUTPUTS_HELP = "the outputs folder whose presenters these are, as app.py's --outputs (default: outputs/)"


def add_presenters_parser(subparsers) -> argparse.ArgumentParser:
    """``python -m heygem presenters add FILE --name NAME [--face-index N] | list | remove NAME|ID``."""
    parser = subparsers.add_parser(
        "presenters", help="save a face clip once as a presenter, list or remove presenters",
        description="A presenter is a face clip (or photo) checked and prepared once: its whole face track, a "
                    "thumbnail and a sample of its speech are kept, so `generate --presenter NAME` (or a REST "
                    "job with presenter=ID) only needs the words or the speech.")
    parser.add_argument("--outputs", default=str(DEFAULT_OUTPUTS), help=OUTPUTS_HELP)
    actions = parser.add_subparsers(dest="presenters_action", required=True)
    adding = actions.add_parser("add", help="check and prepare a clip or photo as a presenter")
    adding.add_argument("file", type=Path, help="the presenter's video (mp4, mov, mkv, webm) or photo (jpg, png)")
    adding.add_argument("--name", required=True, help="the presenter's name (unique among yours)")
    adding.add_argument("--face-index", type=int, default=None,
                        help="which face speaks when the clip shows several, counted from the left from 0")
    adding.add_argument("--max-presenter-seconds", type=float, default=DEFAULT_MAX_SECONDS,
                        help="refuse clips longer than this (0: no limit)")
    actions.add_parser("list", help="the presenters, newest first")
    removing = actions.add_parser("remove", help="delete a presenter and its files")
    removing.add_argument("presenter", metavar="NAME|ID")
    for action in actions.choices.values():  # also after the action: presenters list --outputs DIR
        action.add_argument("--outputs", default=argparse.SUPPRESS, help=OUTPUTS_HELP)
    parser.set_defaults(handler=presenters_command)
    return parser


def presenters_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from heygem.presenters.prepare import prepare

    keep_server_files_under(Path(args.outputs))  # the avatar cache beside the jobs, as a server keeps it
    if args.presenters_action == "add":
        store = PresenterStore(args.outputs, max_seconds=args.max_presenter_seconds or None)
        presenter = store.create(args.file, args.name, face_index=args.face_index)
        bar = tqdm(total=100, desc="preparing", unit="%", bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}",
                   disable=not sys.stderr.isatty())

        def show(fraction: float) -> None:
            bar.n = int(round(100 * fraction))
            bar.refresh()

        try:
            presenter = prepare(store, presenter, progress=show)
        except BaseException:
            store.remove(presenter.id)  # refused: nothing is kept
            raise
        finally:
            bar.close()
        sample = f"{presenter.speech_seconds:.1f} s" if presenter.speech_seconds else "none (too little speech)"
        length = f"{presenter.seconds:.1f} s video" if presenter.kind == "video" else "photo"
        print(f"added presenter {presenter.name!r} ({presenter.id}): {length}, {presenter.width}x{presenter.height}, "
              f"speech sample {sample}")
        for warning in presenter.warnings:
            print(f"warning: {warning}")
        return 0
    store = PresenterStore(args.outputs)
    if args.presenters_action == "list":
        print(f"{'id':26} {'name':20} {'status':10} {'kind':6} {'seconds':>8} {'size':>10}  {'user':10} speech")
        for presenter in store.list():
            size = f"{presenter.width}x{presenter.height}"
            speech = f"{presenter.speech_seconds:.1f} s" if presenter.speech_seconds else "-"
            print(f"{presenter.id:26} {presenter.name[:20]:20} {presenter.status:10} {presenter.kind:6} "
                  f"{presenter.seconds:8.1f} {size:>10}  {presenter.submitter or '':10} {speech}")
            for note in presenter.warnings + ([presenter.error] if presenter.error else []):
                print(f"    {note}")
        return 0
    if args.presenters_action == "remove":
        presenter = store.find(args.presenter)
        store.remove(presenter.id)
        print(f"removed presenter {presenter.name!r} ({presenter.id})")
        return 0
    raise HeygemError("choose a presenters action: add, list or remove")


def add_presenter_flags(generate: argparse.ArgumentParser) -> None:
    """``generate --presenter NAME|ID [--outputs DIR]`` instead of ``--face``, which stops being required
    (:func:`presenter_face` asks for one of the two). argparse has no public way to change an added
    argument, so the flag's action is looked up by its option string."""
    generate._option_string_actions["--face"].required = False
    inputs = next((group for group in generate._action_groups if group.title == "inputs"), generate)  # beside --face
    inputs.add_argument("--presenter", metavar="NAME|ID", default=None,
                        help="a saved presenter (`presenters add`) instead of --face")
    inputs.add_argument("--outputs", default=str(DEFAULT_OUTPUTS),
                        help="with --presenter: the outputs folder it was saved in")


def presenter_face(args: argparse.Namespace, overrides: dict) -> Path:
    """The face path ``generate --presenter`` renders: the presenter's clip, its face index put into ``args``
    (as --face-index), its track in the avatar cache under the key of this run's options."""
    from heygem.config import load_config
    from heygem.jobs.request import check_options
    from heygem.presenters.prepare import presenter_job

    if (args.face is None) == (args.presenter is None):
        raise HeygemError("give the face as --face FILE or --presenter NAME (one of them)")
    keep_server_files_under(Path(args.outputs))
    presenter = PresenterStore(args.outputs).find(args.presenter)
    face, options = presenter_job(presenter, overrides, lambda given: check_options(given, load_config(args.config)))
    setattr(args, "face.face_index", options["face.face_index"])
    if getattr(args, "voice", None) == "clone" and args.voice_sample is None and presenter.sample_path is not None:
        args.voice_sample = presenter.sample_path  # the presenter's own voice, cut once when it was prepared
    return face
