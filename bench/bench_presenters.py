"""What a saved presenter saves: a job made from it against the same clip uploaded anew.

    python bench/bench_presenters.py [--seconds 20] [--size 640x360] [--output-height 0] [--runs 3]
                                     [--engine landmark|wav2lip|musetalk] [--weights DIR]
                                     [--musetalk-size full|reduced] [--markdown OUT.md]
                                     [--text [--voice piper|clone] [--voice-folder DIR] [--voice-size full|reduced]]

Makes a ``--seconds`` clip of the bundled portrait drifting (``--size``, 25 fps) and speech of the same
length (the English sample looped), prepares the clip as a presenter (heygem.presenters: the checks, the
whole clip's track, what the installed engines prepare once (MuseTalk: every face crop's latents), the
thumbnail, the speech sample) and times that once, saying what was prepared and how long the track took.
Then, in this one process as a server's worker runs them (the engine loaded by an untimed first job and
kept), ``--runs`` times each way, alternated:

- presenter: the job made from the presenter (its track and, for MuseTalk, its crops' latents from the
  avatar cache, put there by the preparation: ``avatar_cache: hit``, no crop encoded);
- new upload: the same clip as a face never seen before (``run.avatar_cache`` off: every frame tracked,
  every MuseTalk crop encoded).

Each job streams as a server's jobs do (``media.stream``); measured from the call: the first streamed
segment listed (heygem.media.stream.listed_segments, polled every 5 ms) and done. wav2lip and musetalk run
random-init files in the official layouts unless ``--weights`` names real ones. Prints a Markdown table of
the medians.

``--text``: the jobs are typed scripts instead (heygem.spoken.generate_spoken, as a text job runs: sentence by
sentence, the first part rendered while the rest is spoken), about ``--seconds`` of speech, in the bundled
Piper voice or ``--voice clone`` (VibeVoice through transformers; the files of ``--voice-folder``, else
random-init ones of ``--voice-size`` written for the run; the presenter's kept speech sample, else the
bundled English sample, as the voice to clone). A random-init voice model stops wherever it likes, so it is
made to speak each sentence for ``--sentence-frames`` audio frames (30: 4 s, about what the script's sentences
take when spoken).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def random_weights(folder: Path, engine: str, musetalk_size: str) -> Path:
    """A weights folder with the engine's random-init files in the official layout."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    if engine == "wav2lip":
        from heygem.models.wav2lip import Wav2Lip

        torch.save({"state_dict": Wav2Lip().state_dict()}, folder / "wav2lip.pth")
    elif engine == "musetalk":
        from heygem.engines.musetalk.random_files import write_random_files

        write_random_files(folder / "musetalk", size=musetalk_size)
    return folder


def stored_latents(cache: Path) -> int:
    """How many crops' latents the avatar cache holds (heygem.face.avatar_cache: latents/NAMESPACE/DIGEST.npy)."""
    return sum(1 for _ in (cache / "latents").glob("*/*.npy"))


SCRIPT = ("Welcome to the weekly update. Our team shipped the new streaming player this week. "
          "It starts playing as soon as the first second of video is ready. ")


def timed_job(face: Path, speech: Path | str, output: Path, overrides: dict, text_options: dict | None = None) -> dict:
    """One job with its stream: seconds to the first listed segment and to done, and its summary. With
    ``text_options`` (generate_spoken's voice options) ``speech`` is the script to speak."""
    from heygem.media.stream import listed_segments, stream_folder
    from heygem.pipeline import generate
    from heygem.spoken import generate_spoken

    finished: dict = {}

    def run() -> None:
        try:
            options = {"media.stream": True, **overrides}
            if text_options is None:
                finished["summary"] = generate(face, speech, output, overrides=options)
            else:
                finished["summary"] = generate_spoken(face, speech, output, overrides=options, **text_options)[0]
        except BaseException as error:  # shown by the caller
            finished["error"] = error

    started = time.perf_counter()
    worker = threading.Thread(target=run)
    worker.start()
    first = None
    stream = stream_folder(output)
    while worker.is_alive():
        if first is None and stream.is_dir() and listed_segments(stream):
            first = time.perf_counter() - started
        time.sleep(0.005)
    done = time.perf_counter() - started
    if "error" in finished:
        raise finished["error"]
    summary = finished["summary"]
    return {"first": first if first is not None else done, "done": done, "avatar_cache": summary.avatar_cache,
            "faces": summary.seconds_per_stage.get("faces", 0.0), "frames": summary.frames}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the clip and of the speech")
    parser.add_argument("--size", default="640x360", help="WIDTHxHEIGHT of the clip")
    parser.add_argument("--output-height", type=int, default=0, help="the jobs' output height (0: the clip's)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engine", choices=("landmark", "wav2lip", "musetalk"), default="landmark")
    parser.add_argument("--weights", type=Path, default=None, help="real checkpoints (default: random-init files)")
    parser.add_argument("--musetalk-size", choices=("full", "reduced"), default="full")
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--text", action="store_true", help="typed scripts instead of a speech file")
    parser.add_argument("--voice", choices=("piper", "clone"), default="piper", help="the scripts' voice (--text)")
    parser.add_argument("--voice-folder", type=Path, default=None,
                        help="VibeVoice files for --voice clone (default: random-init files written for the run)")
    parser.add_argument("--voice-size", choices=("full", "reduced"), default="full")
    parser.add_argument("--sentence-frames", type=int, default=30,
                        help="audio frames of each sentence of the random-init voice (7.5 a second; 30: 4 s)")
    parser.add_argument("--log", action="store_true", help="show heygem's log lines, with the seconds since the start")
    args = parser.parse_args()
    if args.log:
        import logging

        logging.basicConfig(format="%(relativeCreated)8.0f ms %(threadName)s: %(message)s")
        logging.getLogger("heygem").setLevel(logging.INFO)

    folder = Path(tempfile.mkdtemp(prefix="heygem-bench-presenters-"))
    os.environ["HEYGEM_CACHE_DIR"] = str(folder / "avatar-cache")
    if args.engine != "landmark":
        os.environ["HEYGEM_WEIGHTS"] = str(args.weights or random_weights(folder / "weights", args.engine,
                                                                          args.musetalk_size))
    from bench_pipeline import machine_description, make_inputs

    from heygem.config import apply_overrides, load_config
    from heygem.presenters.prepare import (
        TRACKING_SHARE,
        engines_to_prepare,
        job_options,
        prepare,
        presenter_config,
        use_for_job,
    )
    from heygem.presenters.records import PresenterStore

    width, height = (int(value) for value in args.size.lower().split("x"))
    clip, speech = make_inputs(folder / "inputs", args.seconds, width, height)
    options = {"engine.name": args.engine}
    if args.output_height:
        options["media.output_height"] = args.output_height
    store = PresenterStore(folder / "outputs", max_seconds=None)
    track_share = TRACKING_SHARE if engines_to_prepare(load_config()) else 0.95  # of the preparation's progress
    tracked: list[float] = []  # when the preparation's progress passed the track's share
    started = time.perf_counter()

    def progress(fraction: float) -> None:
        if not tracked and fraction >= track_share:
            tracked.append(time.perf_counter() - started)

    presenter = prepare(store, store.create(clip, "bench"), progress=progress)
    prepared_seconds = time.perf_counter() - started
    print(f"presenter prepared in {prepared_seconds:.1f} s (track {tracked[0] if tracked else 0.0:.1f} s): "
          f"{', '.join(presenter.prepared)}", flush=True)
    text_options = None
    if args.text:
        speech = " ".join([SCRIPT] * max(1, round(args.seconds / 10)))  # about 10 s of speech a paragraph
        text_options = {}
        if args.voice == "clone":
            voice_folder = args.voice_folder
            if voice_folder is None:
                from heygem.speech.clone_files import write_random_files

                voice_folder = write_random_files(folder / "weights" / "vibevoice", size=args.voice_size)
            sample = presenter.sample_path or REPO / "assets" / "speech_en.wav"
            if args.voice_folder is None:  # each sentence exactly --sentence-frames frames long
                from heygem.speech.clone import cloned_voice, model_folder
                from heygem.speech.clone_files import forced_frames

                voice = cloned_voice(model_folder(voice_folder.parent), sample)
                voice.logits_processors = [forced_frames(voice.model.model.config, args.sentence_frames)]
            text_options = {"voice": "clone", "voice_sample": sample, "weights_folder": voice_folder.parent}
    config = presenter_config(presenter.face_index, apply_overrides(load_config(), options))  # the jobs' own

    # the engine (and the voice) loaded, kept
    timed_job(clip, speech, folder / "warm-up.mp4", {**options, "run.avatar_cache": False}, text_options)
    ways = {"presenter": [], "new upload": []}
    latents_before = stored_latents(folder / "avatar-cache")
    for run in range(args.runs):
        face = use_for_job(presenter, config)
        made = timed_job(face, speech, folder / f"presenter-{run}.mp4", job_options(presenter, options), text_options)
        assert made["avatar_cache"] == "hit", made["avatar_cache"]
        if run == 0 and args.engine == "musetalk":  # the new uploads keep none (run.avatar_cache off)
            print(f"crop latents the presenter's first job encoded: "
                  f"{stored_latents(folder / 'avatar-cache') - latents_before}", flush=True)
        ways["presenter"].append(made)
        ways["new upload"].append(timed_job(clip, speech, folder / f"new-{run}.mp4",
                                            {**options, "run.avatar_cache": False}, text_options))

    frames = ways["presenter"][0]["frames"]
    lines = [f"{machine_description()}; {args.engine}; a {args.size} clip of {args.seconds:g} s prepared as a "
             f"presenter in {prepared_seconds:.1f} s ({', '.join(presenter.prepared)}); jobs of {frames} frames "
             f"(output height {args.output_height or height}), engine kept, median of {args.runs}"
             + (f"; typed scripts, voice {args.voice}" if args.text else "") + ":", "",
             "| face | first streamed segment (s) | done (s) | faces stage (s) |", "| --- | --- | --- | --- |"]
    for name, measured in ways.items():
        lines.append(f"| {name} | {statistics.median(job['first'] for job in measured):.2f} | "
                     f"{statistics.median(job['done'] for job in measured):.2f} | "
                     f"{statistics.median(job['faces'] for job in measured):.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
