"""heygem's web app: upload a face and speech, get a lip-synced video.

    python app.py [--host 127.0.0.1] [--port 7860] [--auth user:pass] [--share] [--outputs DIR]

The page (Gradio Blocks) and the REST API (heygem/api.py, under /api) are
served by one process, which also runs the job worker(s). Everything the page
does goes through the job store in heygem/jobs/, so a job started here shows
up in the REST API and in ``python -m heygem jobs list``, and survives a restart.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import logging
import os
import sys
import threading
import time
from pathlib import Path

import gradio as gr
import pandas as pd

from heygem import __version__
from heygem.cli import add_devices_flag
from heygem.config import REPO_ROOT
from heygem.doctor import benchmark_markdown, format_markdown, run_benchmark, run_checks
from heygem.errors import HeygemError
from heygem.jobs.api import create_router
from heygem.jobs.batch import collect_files, plan_items, resolve_under_roots, submit_items, zip_results
from heygem.jobs.files import DEFAULT_OUTPUTS
from heygem.jobs.ray_executor import add_ray_flag, start_ray_workers
from heygem.jobs.request import parse_options
from heygem.jobs.store import DONE, RUNNING, JobLimits, JobStore
from heygem.jobs.worker import devices_from_flags, start_workers, warm_up
from heygem.runtime import library_logs
from heygem.weights import weights_dir

logger = logging.getLogger("heygem")

ASSETS = REPO_ROOT / "assets"
OUTPUT_HEIGHTS = [("as the input", 0), ("256 px", 256), ("360 px", 360), ("480 px", 480), ("720 px", 720),
                  ("1080 px", 1080)]
JOB_COLUMNS = ["id", "status", "stage / error", "engine", "created", "seconds", "face", "audio", "result"]
BATCH_COLUMNS = ["item", "face", "audio", "status", "progress", "stage / error", "seconds", "job"]
WATCH_INTERVAL = 0.5  # seconds between job polls while a page watches a job
STATUS_LABELS = {"queued": "Queued", "running": "Running", "done": "Done", "failed": "Failed",
                 "cancelled": "Cancelled"}

CSS = """
.job-card {border: 1px solid var(--border-color-primary); border-radius: var(--radius-lg); padding: 12px 14px;
           background: var(--block-background-fill);}
.job-card .job-head {display: flex; justify-content: space-between; gap: 8px; flex-wrap: wrap;}
.job-card .job-id {font-family: var(--font-mono); font-size: 0.9em; color: var(--body-text-color-subdued);}
.job-card .job-state {font-weight: 600;}
.job-card .job-state.failed {color: var(--color-red-500, #dc2626);}
.job-card .job-state.done {color: var(--color-green-600, #16a34a);}
.job-card .bar {height: 10px; border-radius: 5px; background: var(--neutral-200); overflow: hidden; margin: 10px 0 6px;}
.dark .job-card .bar {background: var(--neutral-700);}
.job-card .bar > div {height: 100%; background: var(--color-accent); transition: width 0.4s ease;}
.job-card .job-detail {font-size: 0.92em; color: var(--body-text-color-subdued);}
.job-card .job-error {margin-top: 6px; color: var(--color-red-500, #dc2626);}
.empty-card {color: var(--body-text-color-subdued); padding: 12px 0;}
#system-report td:nth-child(-n+2) {white-space: nowrap;}
"""


# ---------------------------------------------------------------------- small helpers


def options_from_controls(engine: str, pad_top: float, pad_bottom: float, pad_left: float, pad_right: float,
                          smooth_window: float, restorer: str, output_height: int, fps: float,
                          detector: str = "mediapipe") -> dict:
    """The option dict (dotted keys of heygem.config) for what the form shows."""
    options = {
        "engine.name": engine,
        "face.pads": [int(pad_top), int(pad_bottom), int(pad_left), int(pad_right)],
        "face.smooth_window": int(smooth_window),
        "restore.enabled": restorer != "none",
        "restore.method": restorer,
        "media.output_height": int(output_height) or None,
        "media.fps": float(fps),
        "face.detector": detector,
    }
    return options


def installed_weights() -> set[str]:
    """Names of the registry entries (configs/weights.yaml) with a file in the weights folder."""
    from heygem.weights import installed_names

    try:
        return installed_names(weights_dir())
    except HeygemError as error:  # an unreadable registry: offer only what needs no weights
        logger.warning("%s", error)
        return set()


def engine_choices(installed: set[str]) -> list[tuple[str, str]]:
    """Engines the form offers: Wav2Lip only when one of its checkpoints is installed."""
    choices = [("auto (Wav2Lip when its weights are in weights/)", "auto")]
    if installed & {"wav2lip", "wav2lip_gan"}:
        choices.append(("Wav2Lip", "wav2lip"))
    return choices + [("built-in landmark engine", "landmark")]


def restorer_choices(installed: set[str]) -> list[tuple[str, str]]:
    """Restorers the form offers: GFPGAN only when GFPGANv1.4.pth is installed."""
    choices = [("auto (GFPGAN when installed, for Wav2Lip)", "auto")]
    if "gfpgan_v1.4" in installed:
        choices.append(("GFPGAN v1.4", "gfpgan"))
    return choices + [("sharpen", "sharpen"), ("none", "none")]


def detector_choices(installed: set[str]) -> list[tuple[str, str]]:
    """Face detectors the form offers: S3FD only when its file is installed."""
    choices = [("mediapipe", "mediapipe")]
    if "s3fd" in installed:
        choices.append(("S3FD", "s3fd"))
    return choices


def offered(value: str, choices: list[tuple[str, str]], fallback: str) -> str:
    return value if value in {choice for _, choice in choices} else fallback


def option_controls(store: JobStore, prefix: str) -> list[gr.components.Component]:
    """The options people actually change, with the defaults of configs/default.yaml; engines,
    restorers and detectors that need weights are offered only when their files are installed."""
    defaults = store.base_config
    installed = installed_weights()
    engines, restorers, detectors = engine_choices(installed), restorer_choices(installed), detector_choices(installed)
    restorer_default = defaults.restore.method if defaults.restore.enabled else "none"
    with gr.Accordion("Options", open=False, elem_id=f"{prefix}options-accordion"):
        with gr.Row():
            engine = gr.Dropdown(engines, value=offered(defaults.engine.name, engines, "auto"), label="Engine",
                                 elem_id=f"{prefix}engine")
            output_height = gr.Dropdown(OUTPUT_HEIGHTS, value=defaults.media.output_height or 0, label="Output height",
                                        elem_id=f"{prefix}output-height")
        with gr.Row():
            restorer = gr.Dropdown(restorers, value=offered(restorer_default, restorers, "auto"),
                                   label="Restore the mouth region", elem_id=f"{prefix}restorer")
            detector = gr.Dropdown(detectors, label="Face detector", elem_id=f"{prefix}detector",
                                   value=offered(defaults.face.detector, detectors, "mediapipe"))
        gr.Markdown("Extra pixels around the detected face (more chin padding helps when the mouth is cut off):")
        with gr.Row():
            pads = [gr.Number(value=value, label=label, precision=0, minimum=-200, maximum=200, min_width=80)
                    for value, label in zip(defaults.face.pads, ("top", "bottom", "left", "right"))]
        with gr.Row():
            smooth = gr.Slider(1, 15, value=defaults.face.smooth_window, step=1, label="Face smoothing (frames)",
                               info="boxes averaged over this many frames; 1 switches it off")
            fps = gr.Slider(10, 60, value=defaults.media.fps, step=1, label="Frames per second for photos",
                            info="videos keep their own rate")
    return [engine, *pads, smooth, restorer, output_height, fps, detector]


def format_time(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds else ""


def job_card(job) -> str:
    """The status card: job id, state, queue place, a progress bar with the stage."""
    state = STATUS_LABELS.get(job.status, job.status)
    if job.status == "queued":
        ahead = job.jobs_ahead or 0
        detail = "next in line" if ahead == 0 else f"{ahead} job{'s' if ahead != 1 else ''} ahead of it"
        detail = f"Place in the queue: {ahead + 1} ({detail})"
    elif job.status == RUNNING:
        detail = f"{html.escape(job.stage or 'starting')} · {job.progress:.0%}"
    elif job.status == DONE:
        detail = f"Finished in {job.seconds:.1f} s with the {html.escape(job.engine)} engine" if job.seconds else "Finished"
        restorer = (job.read_summary() or {}).get("restorer")
        if restorer:
            detail += f" · restorer: {html.escape(str(restorer))}"
    else:
        detail = f"after {job.seconds:.1f} s" if job.seconds else ""
    width = 100 if job.status == DONE else int(round(job.progress * 100))
    error = f'<div class="job-error">{html.escape(job.error)}</div>' if job.error else ""
    label = f" · {html.escape(job.label)}" if job.label else ""
    return (f'<div class="job-card" data-status="{job.status}">'
            f'<div class="job-head"><span class="job-state {job.status}">{state}</span>'
            f'<span class="job-id">job {html.escape(job.id)}{label}</span></div>'
            f'<div class="bar" role="progressbar" aria-valuenow="{width}" aria-valuemin="0" aria-valuemax="100">'
            f'<div style="width:{width}%"></div></div>'
            f'<div class="job-detail">{detail}</div>{error}</div>')


def problem_card(message: str) -> str:
    """The card's place when nothing could be queued: what to fix."""
    return f'<div class="job-card" data-status="problem"><div class="job-error">{html.escape(message)}</div></div>'


def stage_frame(job) -> pd.DataFrame | None:
    """Seconds per pipeline stage of a finished job, for the bar chart."""
    summary = job.read_summary() if job is not None else None
    stages = (summary or {}).get("seconds_per_stage") or {}
    if not stages:
        return None
    return pd.DataFrame({"stage": [f"{index + 1} {name}" for index, name in enumerate(stages)],
                         "seconds": [round(float(value), 2) for value in stages.values()]})


def chart_update(job) -> dict:
    frame = stage_frame(job)
    if frame is None:
        return gr.update(visible=False)
    total = (job.read_summary() or {}).get("total_seconds") or frame["seconds"].sum()
    return gr.update(value=frame, visible=True, label=f"Seconds per stage · {total:.1f} s in all")


def weights_frame() -> pd.DataFrame:
    """What `python -m heygem weights list` reports: one row per recognised file."""
    from heygem.cli import describe_path
    from heygem.weights import check_weights, load_registry

    folder = weights_dir()
    rows = [(state.entry.name, state.state, state.entry.purpose, describe_path(state.path), state.entry.enables)
            for state in (check_weights(entry, folder) for entry in load_registry())]
    return pd.DataFrame(rows, columns=["name", "state", "for", "file", "enables"])


def system_markdown() -> str:
    """The doctor's checks (heygem.doctor) as Markdown, without the GPU benchmark."""
    return format_markdown(run_checks(benchmark=False))


def benchmark_markdown_now() -> str:
    """Run the doctor's GPU micro-benchmark (seconds) in a process of its own, so the jobs here keep cuDNN."""
    return benchmark_markdown(run_benchmark(separate_process=True))


def error_text(error: Exception) -> str:
    return str(error) if isinstance(error, HeygemError) else f"{type(error).__name__}: {error}"


def preview_face(face_path):
    """Show an uploaded face in the image or the video preview, whichever fits."""
    if not face_path:
        return gr.update(visible=False, value=None), gr.update(visible=False, value=None)
    is_image = Path(face_path).suffix.lower() in {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"}
    return (gr.update(visible=is_image, value=face_path if is_image else None),
            gr.update(visible=not is_image, value=None if is_image else face_path))


def voice_choices() -> list[tuple[str, str]]:
    """The voices text can be spoken with, for the Voice dropdown: auto first (the bundled voice, or
    espeak-ng for a language without a Piper voice)."""
    choices = [("auto (natural English; espeak-ng for other languages)", "auto")]
    try:
        from heygem.speech.tts import list_voices
        from heygem.weights import weights_dir

        choices += [(f"{voice.name} ({voice.language})", voice.name) for voice in list_voices(weights_dir())]
    except Exception as error:  # a page must not fail to build over a voice file
        logger.warning("text-to-speech voices could not be listed: %s", error)
    return choices


def example_pairs() -> list[list[str]]:
    """The bundled face + speech samples the Generate tab offers as examples (those present)."""
    return [[str(ASSETS / face), str(ASSETS / audio)] for face, audio in
            (("astronaut.jpg", "speech_en.wav"), ("astronaut.jpg", "speech_zh.wav"))
            if (ASSETS / face).is_file() and (ASSETS / audio).is_file()]


# ---------------------------------------------------------------------- the tabs


def generate_tab(store: JobStore) -> None:
    """One face + speech in: queue a job, follow it in a card, then show the video and its stage times."""

    def submit(face_path, audio_path, use_video_audio, text, voice, speed, subtitles, *controls):
        """Queue a job; a problem with the inputs is shown in the card and nothing is queued."""
        problem = None
        text = (text or "").strip()
        if not face_path:
            problem = "Add a face first: a video or a photo."
        elif text and (audio_path or use_video_audio):
            problem = "Give speech or text, not both: clear one of them."
        elif not text and not use_video_audio and not audio_path:
            problem = "Add speech (upload or record) or type some text, or tick \"use the face video's own audio\"."
        else:
            try:
                options = options_from_controls(*controls)
                if text:
                    options["text.subtitles"] = subtitles
                job_id = store.create_job(face_path, None if use_video_audio or text else audio_path,
                                          options, text=text or None,
                                          voice=None if voice in (None, "", "auto") else voice, speed=float(speed))
            except HeygemError as error:
                problem = str(error)
        if problem:
            gr.Warning(problem)
            return ("", problem_card(problem), gr.update(value=None), gr.update(visible=False, value=None),
                    gr.update(visible=False), gr.update(visible=False))
        job = store.get(job_id)
        return (job_id, job_card(job), gr.update(value=None), gr.update(visible=False, value=None),
                gr.update(visible=False), gr.update(visible=True))

    async def watch(job_id):
        """Follow one job until it ends: card, then the video, the download and the chart."""
        if not job_id:  # nothing was queued: leave what submit showed
            yield gr.update(), gr.update(), gr.update(), gr.update(), gr.update()
            return
        last_card = None
        while True:
            job = await asyncio.to_thread(store.find, job_id)
            if job is None:
                yield "<div class='empty-card'>This job was deleted.</div>", None, gr.update(visible=False), \
                    gr.update(visible=False), gr.update(visible=False)
                return
            card = job_card(job)
            if job.is_finished:
                done = job.status == DONE and job.result_path.is_file()
                yield (card, str(job.result_path) if done else None,
                       gr.update(visible=done, value=str(job.result_path) if done else None),
                       chart_update(job), gr.update(visible=False))
                return
            if card != last_card:
                last_card = card
                yield card, gr.update(), gr.update(), gr.update(), gr.update(visible=True)
            await asyncio.sleep(WATCH_INTERVAL)

    def cancel(job_id):
        if job_id:
            store.cancel(job_id)

    def listen(text, voice, speed):
        """Speak the typed text as a job would (same voice, speed and length limit): the audio and a note."""
        import numpy as np

        from heygem.speech.tts import HOW_TO_ADD_A_VOICE, synthesize
        from heygem.weights import weights_dir

        limit = store.limits.max_text_characters
        try:
            speech = synthesize(text or "", voice=None if voice in (None, "", "auto") else voice,
                                    speed=float(speed), weights_dir=weights_dir(),
                                    max_characters=store.base_config.text.max_characters if limit is None else limit)
        except HeygemError as error:
            gr.Warning(str(error))
            return None, f"Nothing to play: {error}"
        pcm = np.clip(np.round(speech.samples * 32767.0), -32768, 32767).astype(np.int16)  # (N,) mono
        note = f"Spoken by **{speech.voice.name}** ({speech.voice.language}), {speech.duration:.1f} s."
        if speech.voice_note:
            note += f" Note: {speech.voice_note}."
        elif speech.voice.kind == "espeak":
            note += f" espeak-ng sounds robotic: {HOW_TO_ADD_A_VOICE}."
        return (speech.sample_rate, pcm), note

    examples = example_pairs()
    with gr.Tab("Generate", id="generate"):
        job_id_state = gr.State("")
        with gr.Row(equal_height=False):
            with gr.Column(scale=1):
                face = gr.File(label="Face: a video or a photo", file_types=["video", "image"],
                               elem_id="face-input", height=120)
                face_image = gr.Image(label="Face preview", visible=False, interactive=False, height=220)
                face_video = gr.Video(label="Face preview", visible=False, interactive=False, height=220)
                audio = gr.Audio(label="Speech: upload or record", sources=["upload", "microphone"],
                                 type="filepath", elem_id="audio-input", buttons=["download"])
                use_video_audio = gr.Checkbox(label="Use the face video's own audio instead", value=False)
                with gr.Accordion("Or type what the face should say", open=False, elem_id="text-accordion"):
                    text = gr.Textbox(label="Text", lines=3, elem_id="text-input",
                                      placeholder="Hello! Speech is made on this machine, with subtitles.")
                    voice = gr.Dropdown(voice_choices(), value="auto", label="Voice", elem_id="voice-input")
                    with gr.Row():
                        speed = gr.Slider(0.5, 2.0, value=1.0, step=0.05, label="Speed", elem_id="speed-input")
                        subtitles = gr.Radio([("soft track", "soft"), ("drawn in", "burn"), ("none", "none")],
                                             value=store.base_config.text.subtitles, label="Subtitles",
                                             elem_id="subtitles-input")
                    listen_button = gr.Button("Listen", size="sm", elem_id="listen-button")
                    preview = gr.Audio(label="Preview", type="numpy", interactive=False, elem_id="listen-audio")
                    preview_note = gr.Markdown("", elem_id="listen-note")
                controls = option_controls(store, prefix="")
                generate = gr.Button("Generate", variant="primary", elem_id="generate-button")
                if examples:
                    gr.Examples(examples, inputs=[face, audio], label="Examples: click one, then Generate",
                                example_labels=["Astronaut photo + English speech",
                                                "Astronaut photo + Chinese speech"][:len(examples)])
            with gr.Column(scale=1):
                card = gr.HTML("<div class='empty-card'>Your job's progress shows here.</div>", elem_id="job-card")
                result = gr.Video(label="Result", interactive=False, elem_id="result-video", buttons=["download"])
                with gr.Row():
                    download = gr.DownloadButton("Download MP4", visible=False, elem_id="download-button")
                    cancel_button = gr.Button("Cancel", visible=False, variant="stop", size="lg")
                chart = gr.BarPlot(x="stage", y="seconds", visible=False, height=260, sort=None,
                                   x_label_angle=-35, x_title="", label="Seconds per stage", elem_id="stage-chart")
        face.change(preview_face, face, [face_image, face_video], queue=False, show_progress="hidden",
                    api_visibility="private")
        watching = generate.click(
            submit, [face, audio, use_video_audio, text, voice, speed, subtitles, *controls],
            [job_id_state, card, result, download, chart, cancel_button],
            concurrency_limit=8, show_progress="minimal", api_visibility="private",
        ).success(
            watch, job_id_state, [card, result, download, chart, cancel_button],
            concurrency_limit=None, show_progress="hidden", api_visibility="private",
        )
        # A new job replaces the one this page was following (that one keeps running; see Jobs).
        generate.click(None, None, None, cancels=[watching], queue=False, api_visibility="private")
        cancel_button.click(cancel, job_id_state, None, queue=False, api_visibility="private")
        listen_button.click(listen, [text, voice, speed], [preview, preview_note], concurrency_limit=2,
                            api_visibility="private")


def batch_tab(store: JobStore, batch_roots: list[Path]) -> None:
    """Many faces and audio files (uploaded or from a server folder), paired, queued, followed in a table."""

    def plan_batch(source, uploaded, folder, pairing, manifest):
        if source == "folder":
            directory = resolve_under_roots(folder, batch_roots)
            files, base = collect_files(directory), directory
        else:
            if not uploaded:
                raise HeygemError("upload some faces and audio files first")
            files, base = [Path(path) for path in uploaded], None
        if pairing == "manifest":
            if not manifest:
                raise HeygemError("upload the CSV manifest (columns face,audio[,text][,name][,options])")
            return plan_items(files, str(manifest), base_dir=base)
        return plan_items(files, pairing, base_dir=base)

    def start_batch(source, uploaded, folder, pairing, manifest, *controls):
        try:
            items = plan_batch(source, uploaded, folder, pairing, manifest)
        except HeygemError as error:
            gr.Warning(str(error))
            return (gr.update(), gr.update(), f"**Nothing started:** {error}", gr.update(),
                    gr.Timer(active=False))
        batch = f"batch-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"
        outcome = submit_items(store, items, options_from_controls(*controls), batch)
        state = {"batch": batch, "items": [
            {"name": item.name, "face": item.face_path.name if item.face_path else "",
             "audio": item.speech_label, "note": item.note,
             "job": outcome[item.name] if isinstance(outcome[item.name], str) else None,
             "error": None if isinstance(outcome[item.name], str) else error_text(outcome[item.name])}
            for item in items]}
        table, summary, finished = batch_table(store, state)
        return state, table, summary, gr.update(visible=False, value=None), gr.Timer(active=not finished)

    def refresh_batch(state):
        if not state:
            return gr.update(), gr.update(), gr.update(), gr.Timer(active=False)
        table, summary, finished = batch_table(store, state)
        download = gr.update(visible=False)
        if finished:
            archive = zip_results(store, state["batch"])
            download = gr.update(visible=archive is not None, value=str(archive) if archive else None)
        return table, summary, download, gr.Timer(active=not finished)

    with gr.Tab("Batch", id="batch"):
        batch_state = gr.State(None)
        batch_timer = gr.Timer(1.5, active=False)
        with gr.Row(equal_height=False):
            with gr.Column(scale=1):
                source = gr.Radio([("Upload files", "upload"), ("A folder on the server", "folder")],
                                  value="upload", label="Inputs")
                uploaded = gr.File(file_count="multiple", label="Faces and audio files (or .txt files to speak)",
                                   file_types=["video", "image", "audio", ".txt"], height=160)
                roots_text = ", ".join(f"`{root}`" for root in batch_roots) or \
                    "none (start the app with --batch-root DIR)"
                folder = gr.Textbox(label="Folder on the server", visible=False,
                                    placeholder=str(batch_roots[0]) if batch_roots else "",
                                    info=f"must be inside: {roots_text}".replace("`", ""))
                pairing = gr.Radio(
                    [("Same name: anna.mp4 + anna.wav (or anna.txt)", "stem"), ("Every face with every audio", "cross"),
                     ("A CSV manifest", "manifest")], value="stem", label="Pairing")
                manifest = gr.File(label="Manifest CSV: face,audio[,text][,name][,options]", file_types=[".csv"],
                                   visible=False, height=90)
                batch_controls = option_controls(store, prefix="batch-")
                start = gr.Button("Start batch", variant="primary")
            with gr.Column(scale=2):
                batch_summary = gr.Markdown("Items and their progress show here.")
                batch_items = gr.Dataframe(pd.DataFrame(columns=BATCH_COLUMNS), interactive=False, wrap=True,
                                           max_height=480, elem_id="batch-table",
                                           column_widths=["12%", "12%", "12%", "9%", "8%", "27%", "7%", "13%"])
                batch_zip = gr.DownloadButton("Download the results (.zip)", visible=False)
        source.change(lambda choice: (gr.update(visible=choice == "upload"), gr.update(visible=choice == "folder")),
                      source, [uploaded, folder], queue=False, api_visibility="private")
        pairing.change(lambda choice: gr.update(visible=choice == "manifest"), pairing, manifest, queue=False,
                       api_visibility="private")
        start.click(start_batch, [source, uploaded, folder, pairing, manifest, *batch_controls],
                    [batch_state, batch_items, batch_summary, batch_zip, batch_timer],
                    concurrency_limit=2, api_visibility="private")
        batch_timer.tick(refresh_batch, batch_state, [batch_items, batch_summary, batch_zip, batch_timer],
                         show_progress="hidden", concurrency_limit=None, api_visibility="private")


def batch_table(store: JobStore, state: dict) -> tuple[pd.DataFrame, str, bool]:
    """The batch's rows (one per item, with its job's state), a one-line summary, and whether all ended."""
    rows, finished = [], True
    counts: dict[str, int] = {}
    for item in state["items"]:
        job = store.find(item["job"]) if item["job"] else None
        status = job.status if job else "failed" if item["error"] else "deleted"
        if job is not None and not job.is_finished:
            finished = False
        counts[status] = counts.get(status, 0) + 1
        detail = item["error"] or (job.error or job.stage if job else "") or item.get("note")
        rows.append([item["name"], item["face"], item["audio"], STATUS_LABELS.get(status, status),
                     f"{job.progress:.0%}" if job else "", detail or "",
                     f"{job.seconds:.1f}" if job and job.seconds else "", item["job"] or ""])
    frame = pd.DataFrame(rows, columns=BATCH_COLUMNS)
    summary = f"**{state['batch']}** · {len(rows)} item(s): " + ", ".join(
        f"{count} {status}" for status, count in sorted(counts.items()))
    return frame, summary, finished


def jobs_tab(store: JobStore) -> None:
    """Every job in the store: a filtered, self-refreshing table; cancel, retry or delete the selected one."""

    def jobs_table(status_filter):
        jobs = store.list(status=None if status_filter == "all" else status_filter, limit=500)
        rows = []
        for job in jobs:
            link = f"[result.mp4](/gradio_api/file={job.result_path})" if job.status == DONE else ""
            status = STATUS_LABELS.get(job.status, job.status)
            if job.status == "queued":
                status += f" ({job.jobs_ahead + 1})"
            elif job.status == RUNNING:
                status += f" {job.progress:.0%}"
            rows.append([job.id, status, job.error or job.stage, job.engine, format_time(job.created),
                         f"{job.seconds:.1f}" if job.seconds else "", job.face_name,
                         job.audio_name or "(video's own audio)", link])
        counts = store.counts()
        summary = " · ".join(f"{count} {status}" for status, count in counts.items())
        return pd.DataFrame(rows, columns=JOB_COLUMNS), summary

    def refresh_jobs(status_filter, shown: pd.DataFrame):
        """The timer's refresh: leave the table alone (selection, scrolling) when nothing changed."""
        table, summary = jobs_table(status_filter)
        if shown is not None and table.astype(str).equals(shown.astype(str)):
            return gr.update(), summary
        return table, summary

    def select_job(table: pd.DataFrame, event: gr.SelectData):
        row = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
        job_id = str(table.iloc[row, 0]) if row is not None and row < len(table) else ""
        return job_id, *show_job(job_id)

    def show_job(job_id):
        job = store.find(job_id.strip()) if job_id else None
        if job is None:
            return ("<div class='empty-card'>Pick a job in the table.</div>", None, gr.update(visible=False), "")
        log = job.log_path.read_text(encoding="utf-8", errors="replace")[-6000:] if job.log_path.is_file() else ""
        video = str(job.result_path) if job.status == DONE and job.result_path.is_file() else None
        return job_card(job), video, chart_update(job), log

    def job_action(action, job_id, status_filter):
        job_id = (job_id or "").strip()
        try:
            if not job_id:
                raise HeygemError("Pick a job in the table first.")
            if action == "cancel":
                store.cancel(job_id)
                message = f"Cancel requested for {job_id}."
            elif action == "retry":
                store.retry(job_id)
                message = f"{job_id} is queued again."
            else:
                store.delete(job_id)
                message = f"{job_id} deleted."
                job_id = ""
        except HeygemError as error:
            gr.Warning(str(error))
            return (gr.update(),) * 7
        gr.Info(message)
        table, summary = jobs_table(status_filter)
        return table, summary, job_id, *show_job(job_id)

    with gr.Tab("Jobs", id="jobs") as tab:
        with gr.Row(equal_height=True):
            status_filter = gr.Dropdown(["all", "queued", "running", "done", "failed", "cancelled"],
                                        value="all", label="Show", scale=2, min_width=160)
            auto_refresh = gr.Checkbox(value=True, label="Refresh every 3 s", scale=1, min_width=160)
            refresh = gr.Button("Refresh now", scale=1, min_width=120, size="md")
        jobs_summary = gr.Markdown()
        jobs_timer = gr.Timer(3.0, active=False)
        jobs = gr.Dataframe(pd.DataFrame(columns=JOB_COLUMNS), interactive=False, wrap=True, max_height=420,
                            elem_id="jobs-table", datatype=["str"] * (len(JOB_COLUMNS) - 1) + ["markdown"],
                            column_widths=["19%", "9%", "16%", "8%", "14%", "6%", "10%", "10%", "8%"])
        with gr.Row():
            selected = gr.Textbox(label="Selected job", placeholder="click a row", scale=3)
            cancel_job = gr.Button("Cancel", variant="stop", scale=1)
            retry_job = gr.Button("Retry", scale=1)
            delete_job = gr.Button("Delete", scale=1)
        with gr.Row(equal_height=False):
            with gr.Column():
                selected_card = gr.HTML("<div class='empty-card'>Pick a job in the table.</div>")
                selected_chart = gr.BarPlot(x="stage", y="seconds", visible=False, height=260, sort=None,
                                            x_label_angle=-35, x_title="", label="Seconds per stage")
                selected_log = gr.Textbox(label="job.log", lines=8, max_lines=16, interactive=False)
            selected_video = gr.Video(label="Result", interactive=False)
        detail = [selected_card, selected_video, selected_chart, selected_log]
        for trigger in (tab.select, refresh.click, status_filter.change):
            trigger(jobs_table, status_filter, [jobs, jobs_summary], show_progress="hidden",
                    api_visibility="private")
        tab.select(lambda on: gr.Timer(active=on), auto_refresh, jobs_timer, api_visibility="private")
        auto_refresh.change(lambda on: gr.Timer(active=on), auto_refresh, jobs_timer, api_visibility="private")
        jobs_timer.tick(refresh_jobs, [status_filter, jobs], [jobs, jobs_summary], show_progress="hidden",
                        concurrency_limit=None, api_visibility="private")
        jobs.select(select_job, jobs, [selected, *detail], api_visibility="private")
        selected.submit(show_job, selected, detail, api_visibility="private")
        for button, action in ((cancel_job, "cancel"), (retry_job, "retry"), (delete_job, "delete")):
            button.click(lambda job_id, shown, action=action: job_action(action, job_id, shown),
                         [selected, status_filter], [jobs, jobs_summary, selected, *detail],
                         api_visibility="private")


def system_tab() -> None:
    """What `python -m heygem doctor` reports, checked when the tab opens; the GPU benchmark on request."""
    with gr.Tab("System", id="system") as tab:
        gr.Markdown("The same checks as `python -m heygem doctor` on the machine that serves this page.")
        report = gr.Markdown("Loading…", elem_id="system-report")
        gr.Markdown(f"Network weights in `{weights_dir()}`, as `python -m heygem weights list` reports them "
                    "(`python -m heygem weights download NAME` fetches one):")
        weights = gr.Dataframe(headers=["name", "state", "for", "file", "enables"], interactive=False,
                               elem_id="system-weights", wrap=True)
        system_refresh = gr.Button("Check again")
        gr.Markdown("The GPU benchmark runs the Wav2Lip generator for a few seconds with cuDNN on and off "
                    "(jobs running on the same GPU slow it down).")
        benchmark_button = gr.Button("Run the GPU benchmark", elem_id="benchmark-button")
        benchmark = gr.Markdown(elem_id="system-benchmark")
        for trigger in (tab.select, system_refresh.click):
            trigger(system_markdown, None, report, api_visibility="private")
            trigger(weights_frame, None, weights, api_visibility="private")
        benchmark_button.click(benchmark_markdown_now, None, benchmark, concurrency_limit=1,
                               api_visibility="private")


# ---------------------------------------------------------------------- the page


def client_api(store: JobStore) -> None:
    """Named endpoints for scripts that use gradio_client: /generate waits for its job and returns the
    MP4 (with progress), /job_status reports any job. Nothing of this shows on the page."""

    async def generate(face: str, audio: str | None, engine: str = "auto", options: str = "{}", text: str = "",
                       voice: str = "", progress=gr.Progress()) -> str:
        """Make a lip-synced MP4 of ``face`` (a video or photo) speaking ``audio``, or ``text`` spoken offline
        by ``voice`` (see `python -m heygem voices`; the result then carries subtitles); with neither, the face
        video's own sound. ``engine``: auto, wav2lip or landmark. ``options``: JSON of more options with the
        dotted names of configs/default.yaml, e.g. {"media.output_height": 360}. Returns the MP4."""
        try:
            chosen = parse_options(options)
            if engine:
                chosen["engine.name"] = engine
            job_id = await asyncio.to_thread(lambda: store.create_job(
                face, audio or None, chosen, text=text if text else None, voice=voice or None, remote=True))
        except HeygemError as error:
            raise gr.Error(str(error)) from None
        try:
            while True:
                job = await asyncio.to_thread(store.get, job_id)
                if job.is_finished:
                    break
                progress(job.progress, desc=job.stage or job.status)
                await asyncio.sleep(WATCH_INTERVAL)
        except asyncio.CancelledError:  # the client went away: the job stops too
            await asyncio.to_thread(store.cancel, job_id)
            raise
        if job.status != DONE or not job.result_path.is_file():
            raise gr.Error(f"job {job_id} {job.status}: {job.error or 'no result'}")
        return str(job.result_path)

    def job_status(job_id: str) -> dict:
        """Where a job stands: status, progress, stage, error, times, engine (as GET /api/jobs/ID gives)."""
        job = store.find(job_id.strip())
        if job is None:
            raise gr.Error(f"no job {job_id!r}")
        return job.to_dict()

    with gr.Column(visible=False):
        face = gr.File(label="face")
        audio = gr.File(label="audio")
        engine = gr.Textbox("auto", label="engine")
        options = gr.Textbox("{}", label="options")
        text = gr.Textbox("", label="text")
        voice = gr.Textbox("", label="voice")
        video = gr.File(label="video")
        job_id = gr.Textbox(label="job_id")
        status = gr.JSON(label="status")
        run = gr.Button()
        look = gr.Button()
    run.click(generate, [face, audio, engine, options, text, voice], video, api_name="generate", concurrency_limit=8)
    look.click(job_status, job_id, status, api_name="job_status", queue=False)


def build_ui(store: JobStore, batch_roots: list[Path]) -> gr.Blocks:
    """The Blocks app: Generate, Batch, Jobs and System tabs over ``store``."""
    with gr.Blocks(title="heygem", delete_cache=(3600, 86400)) as demo:  # Gradio's copies of files: a day
        gr.Markdown(f"# heygem\nA face (video or photo) and some speech in, a lip-synced talking video out. "
                    f"<small>v{__version__} · jobs are kept in `{store.outputs_dir}` · REST API under `/api/jobs`</small>")
        with gr.Tabs():
            generate_tab(store)
            batch_tab(store, batch_roots)
            jobs_tab(store)
            system_tab()
        client_api(store)
    return demo


# ---------------------------------------------------------------------- launch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="heygem web app and REST API")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every network)")
    parser.add_argument("--port", type=int, default=7860, help="port to listen on")
    parser.add_argument("--auth", metavar="USER:PASS", default=os.environ.get("HEYGEM_AUTH"),
                        help="ask for this user name and password on the page and the REST API "
                             "(default: $HEYGEM_AUTH, or none)")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    parser.add_argument("--outputs", default=str(DEFAULT_OUTPUTS), help="where jobs are kept (default: outputs/)")
    parser.add_argument("--max-upload-mb", type=float, default=500, help="largest file accepted, in MB")
    parser.add_argument("--max-queued", type=int, default=100,
                        help="jobs that may wait at once; more are refused (HTTP 429) until some run (0: no limit)")
    parser.add_argument("--max-audio-seconds", type=float, default=600,
                        help="longest speech a job may have, so the longest video (0: no limit)")
    parser.add_argument("--max-text-chars", type=int, default=5000,
                        help="longest text a job may have spoken, in characters (HTTP 400 above it; 0: no limit)")
    parser.add_argument("--max-output-height", type=int, default=2160,
                        help="tallest output frame a job may ask for (0: no limit)")
    parser.add_argument("--min-free-mb", type=float, default=1024,
                        help="free disk space under --outputs needed to accept a job (HTTP 507 below it; 0: no check)")
    parser.add_argument("--batch-root", action="append", default=[], metavar="DIR",
                        help="a server folder the Batch tab may read from (repeat for more); none by default")
    parser.add_argument("--workers", type=int, default=None,
                        help="job workers in this process (default: one per GPU, or one; with --devices: one per "
                             "listed device; 0: run them elsewhere with `python -m heygem jobs work`)")
    add_devices_flag(parser)
    add_ray_flag(parser, "jobs")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log more, and show the libraries' own log lines (as HEYGEM_LOG=debug)")
    return parser.parse_args(argv)


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
    auth = None
    if args.auth:
        user, colon, password = args.auth.partition(":")
        if not colon or not user or not password:
            raise SystemExit("--auth takes USER:PASS")
        auth = (user, password)
    try:  # a bad --devices ends here with one line, before anything starts
        if args.ray is not None and args.devices is not None:
            raise HeygemError("--devices is for the workers of this machine; with --ray each job gets one GPU "
                              "of the cluster: leave --devices out")
        devices = devices_from_flags(args.devices, args.workers)
    except HeygemError as problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2) from None
    max_upload_bytes = int(args.max_upload_mb * 2**20)
    limits = JobLimits(max_queued=args.max_queued or None, max_audio_seconds=args.max_audio_seconds or None,
                       max_output_height=args.max_output_height or None,
                       min_free_bytes=int(args.min_free_mb * 2**20) or None,
                       max_text_characters=max(args.max_text_chars, 0))
    store = JobStore(args.outputs, max_upload_bytes=max_upload_bytes, limits=limits)
    if args.ray is not None:
        try:
            start_ray_workers(store, args.ray)
        except HeygemError as problem:
            print(f"error: {problem}", file=sys.stderr)
            raise SystemExit(2) from None
    elif args.workers != 0:
        start_workers(store, args.workers, devices=devices)
        threading.Thread(target=warm_up, name="heygem-warm-up", daemon=True).start()
    demo = build_ui(store, [Path(root).resolve() for root in args.batch_root])
    demo.queue(default_concurrency_limit=4, max_size=256)
    router = create_router(store, auth=auth, max_upload_bytes=max_upload_bytes)
    # The REST routes go into the FastAPI app Gradio builds, so that one server (and --share's
    # tunnel) serves the page, Gradio's own API under /gradio_api and ours under /api.
    demo.launch(
        server_name=args.host, server_port=args.port, share=args.share, auth=auth, quiet=True,
        prevent_thread_lock=True,
        auth_message="heygem: sign in with the user name and password the server was started with",
        max_file_size=max_upload_bytes, allowed_paths=[str(store.outputs_dir)],
        blocked_paths=[str(store.database_path) + suffix for suffix in ("", "-wal", "-shm")],
        app_kwargs={"routes": router.routes}, show_error=True, footer_links=["api", "gradio"],
        theme=gr.themes.Soft(), css=CSS,
    )
    logger.info("serving the page on %s and the REST API under %sapi/jobs", demo.local_url, demo.local_url)
    if demo.share_url:
        logger.info("public link: %s", demo.share_url)
    demo.block_thread()


if __name__ == "__main__":
    main()
