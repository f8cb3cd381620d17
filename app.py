"""heygem's web app and REST API: arguments and launch only (the page is heygem.ui, the API heygem.jobs.api).

    python app.py [--host 127.0.0.1] [--port 7860] [--users FILE | --auth user:pass] [--share] [--outputs DIR]

One process serves the page (Gradio Blocks) and the REST API under /api, and runs the job
worker(s). Everything either does goes through the job store (heygem.jobs), so a job started here
shows up in the REST API and in ``python -m heygem jobs list``, and survives a restart. A server
that several people share needs ``--users`` (heygem.jobs.users): each then sees only their own jobs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path

from heygem.cli import add_devices_flag
from heygem.errors import HeygemError
from heygem.jobs.api import create_router
from heygem.jobs.files import DEFAULT_OUTPUTS, keep_server_files_under
from heygem.jobs.limits import JobLimits, ProcessCaps
from heygem.jobs.ray_executor import add_ray_flag, start_ray_workers
from heygem.jobs.store import JobStore
from heygem.jobs.users import server_sign_in
from heygem.jobs.worker import devices_from_flags, start_workers, warm_up
from heygem.live.engine_step import LIVE_ENGINES
from heygem.live.sessions import LIVE_HEIGHT, LIVE_HEIGHTS, LiveSettings
from heygem.presenters.api import Preparer
from heygem.presenters.records import PresenterStore
from heygem.runtime import library_logs

logger = logging.getLogger("heygem")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="heygem web app and REST API")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every network)")
    parser.add_argument("--port", type=int, default=7860, help="port to listen on")
    parser.add_argument("--auth", metavar="USER:PASS", default=os.environ.get("HEYGEM_AUTH"),
                        help="ask for this user name and password (12 characters at least) on the page and "
                             "the REST API (default: $HEYGEM_AUTH, or none); one person's server: a shared one "
                             "needs --users")
    parser.add_argument("--users", metavar="FILE", default=os.environ.get("HEYGEM_USERS"),
                        help="the users who may sign in, one a line: NAME:SECRET or admin NAME:SECRET (see "
                             "`python -m heygem users --help`); each sees only their own jobs, an admin all; read "
                             "again when it changes and on SIGHUP (default: $HEYGEM_USERS, or none)")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    parser.add_argument("--outputs", default=str(DEFAULT_OUTPUTS), help="where jobs are kept (default: outputs/)")
    parser.add_argument("--max-upload-mb", type=float, default=500, help="largest file accepted, in MB")
    parser.add_argument("--max-queued", type=int, default=100,
                        help="jobs that may wait at once; more are refused (HTTP 429) until some run (0: no limit)")
    parser.add_argument("--max-audio-seconds", type=float, default=600,
                        help="longest speech a job may have, so the longest video (0: no limit)")
    parser.add_argument("--max-presenter-seconds", type=float, default=600,
                        help="longest clip a saved presenter may be made from (HTTP 400 above it; 0: no limit)")
    parser.add_argument("--max-text-chars", type=int, default=5000,
                        help="longest text a job may have spoken, in characters (HTTP 400 above it; 0: no limit)")
    parser.add_argument("--max-output-height", type=int, default=2160,
                        help="tallest output frame a job may ask for (0: no limit)")
    parser.add_argument("--min-free-mb", type=float, default=1024,
                        help="free disk space under --outputs needed to accept a job (HTTP 507 below it; 0: no check)")
    parser.add_argument("--max-job-processes", type=int, default=os.cpu_count() or 1, metavar="N",
                        help="most face tracker, decoder and encoder processes one job from the page, gradio_client "
                             "or REST may ask for (run.face_workers, run.decoders, run.encoders; more is refused "
                             "with HTTP 400; default: the core count)")
    parser.add_argument("--batch-root", action="append", default=[], metavar="DIR",
                        help="a server folder the Batch tab may read from (repeat for more); none by default")
    parser.add_argument("--workers", type=int, default=None,
                        help="job workers in this process (default: one per GPU, or one; with --devices: one per "
                             "listed device; 0: run them elsewhere with `python -m heygem jobs work`)")
    parser.add_argument("--max-live", type=int, default=2, metavar="N",
                        help="live sessions (the Live tab, POST /api/live) at once; more are refused with HTTP 429 "
                             "(0: no limit); also the batch of the Wav2Lip or MuseTalk engine the sessions share "
                             "(8 at most)")
    parser.add_argument("--live-idle-seconds", type=float, default=120, metavar="S",
                        help="a live session in which nobody speaks this long ends")
    parser.add_argument("--ice-server", action="append", default=[], metavar="URL",
                        help="a STUN or TURN server for live sessions beyond the LAN (repeat for more): "
                             "stun:stun.example.org:3478, turn:NAME:SECRET@turn.example.org:3478")
    parser.add_argument("--live-height", type=int, default=LIVE_HEIGHT, metavar="PIXELS",
                        help=f"the height of the frames live sessions send, the presenter's clip scaled to it "
                             f"(default {LIVE_HEIGHT}; even, {LIVE_HEIGHTS[0]} to {LIVE_HEIGHTS[1]}: a taller frame "
                             f"shows a larger face and costs each session more)")
    parser.add_argument("--live-engine", choices=LIVE_ENGINES, default="auto",
                        help="the engine live sessions run: auto runs the jobs' engine where it keeps up live (wav2lip "
                             "or musetalk on a GPU), else the landmark engine; a name forces that engine (wav2lip and "
                             "musetalk on a CPU draw fewer than 25 frames a second)")
    add_devices_flag(parser)
    add_ray_flag(parser, "jobs")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log more, and show the libraries' own log lines (as HEYGEM_LOG=debug)")
    return parser.parse_args(argv)


def job_limits(args: argparse.Namespace) -> JobLimits:
    """What the store accepts before it queues a job, from the flags."""
    return JobLimits(max_queued=args.max_queued or None, max_audio_seconds=args.max_audio_seconds or None,
                     max_output_height=args.max_output_height or None,
                     min_free_bytes=int(args.min_free_mb * 2**20) or None,
                     max_text_characters=max(args.max_text_chars, 0),
                     process_caps=ProcessCaps.every(args.max_job_processes))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    debug = library_logs.library_logs_shown()  # HEYGEM_LOG=debug
    if args.verbose:
        library_logs.show_library_logs()
    library_logs.quiet()  # before the first log line: the server log shows heygem's lines only
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if debug or args.verbose else logging.INFO)
    try:  # a bad --users file or --auth value ends here with one line; --share without either warns
        auth, users = server_sign_in(args.users, args.auth, args.share)
    except HeygemError as problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2) from None
    if users is not None:
        users.reread_on_hangup()  # and when the file changes
    try:  # a bad --devices or --live-height ends here with one line, before anything starts
        devices = devices_from_flags(args.devices, args.workers, ray=args.ray)
        # one for the page and the REST API: the Live tab's tickets are issued by one and checked by the other
        live = LiveSettings(args.max_live, args.live_idle_seconds, tuple(args.ice_server),
                            output_height=args.live_height, engine=args.live_engine)
    except HeygemError as problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2) from None
    keep_server_files_under(Path(args.outputs))  # before gradio is imported: it reads its folder then
    from heygem.ui import build_ui, page_style
    from heygem.ui.request_log import one_line_request_errors

    one_line_request_errors()  # a forged page request: one line in the log, not a traceback

    max_upload_bytes = int(args.max_upload_mb * 2**20)
    store = JobStore(args.outputs, max_upload_bytes=max_upload_bytes, limits=job_limits(args),
                     upload_folder=Path(os.environ["GRADIO_TEMP_DIR"]))
    if args.ray is not None:
        try:
            start_ray_workers(store, args.ray)
        except HeygemError as problem:
            print(f"error: {problem}", file=sys.stderr)
            raise SystemExit(2) from None
    elif args.workers != 0:
        start_workers(store, args.workers, devices=devices)
        threading.Thread(target=warm_up, name="heygem-warm-up", daemon=True).start()
    from heygem.ui.access import PageAccess  # the page's rules over the store and the users (imports gradio)

    access = PageAccess(store, users)
    presenters = PresenterStore(args.outputs, max_seconds=args.max_presenter_seconds or None,
                                max_upload_bytes=max_upload_bytes)
    preparer = Preparer(presenters, store.base_config)  # one for the page and the REST API: one clip at a time
    demo = build_ui(store, [Path(root).resolve() for root in args.batch_root], access, presenters, preparer, live)
    demo.queue(default_concurrency_limit=4, max_size=256)
    router = create_router(store, auth=auth, users=users, max_upload_bytes=max_upload_bytes, sign_ins=access.sign_ins,
                           presenters=presenters, preparer=preparer,
                           live=live)
    # The REST routes go into the FastAPI app Gradio builds, so that one server (and --share's
    # tunnel) serves the page, Gradio's own API under /gradio_api and ours under /api.
    demo.launch(
        server_name=args.host, server_port=args.port, share=args.share, auth=access.page_auth(auth), quiet=True,
        prevent_thread_lock=True,
        auth_message="heygem: sign in with your user name and secret" if users else
                     "heygem: sign in with the user name and password the server was started with",
        max_file_size=max_upload_bytes, **access.served_paths(),
        app_kwargs={"routes": router.routes, "middleware": [access.middleware()]},  # PageGuard: login, streams
        show_error=True, footer_links=["api", "gradio"],
        **page_style(),
    )
    logger.info("serving the page on %s and the REST API under %sapi/jobs", demo.local_url, demo.local_url)
    if demo.share_url:
        logger.info("public link: %s", demo.share_url)
    demo.block_thread()


if __name__ == "__main__":
    main()
