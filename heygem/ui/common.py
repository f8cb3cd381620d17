"""What the tabs share: the job card, the option controls (engines, restorers and detectors offered only
when their weights are installed), the seconds-per-stage chart, the page's CSS.
"""

from __future__ import annotations

import html
import logging
import time
from pathlib import Path

import gradio as gr
import pandas as pd

from heygem.config import REPO_ROOT
from heygem.errors import HeygemError
from heygem.jobs.store import DONE, RUNNING, JobStore
from heygem.pipeline import step_of
from heygem.weights import weights_dir

logger = logging.getLogger("heygem")
ASSETS = REPO_ROOT / "assets"
OUTPUT_HEIGHTS = [("as the input", 0), ("256 px", 256), ("360 px", 360), ("480 px", 480), ("720 px", 720),
                  ("1080 px", 1080)]
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
.heygem-table th .header {word-break: normal !important; overflow-wrap: normal !important; white-space: nowrap;}
.heygem-table td .cell-wrap {overflow-wrap: anywhere;}
.confirm-delete {border: 1px solid var(--color-red-500, #dc2626); border-radius: var(--radius-lg); padding: 8px;}
"""


def uploaded_file(**settings) -> gr.File:
    """A gr.File (type "filepath") whose handler gets the uploaded file's path with nothing else written:
    Gradio's own preprocessing leaves an empty temporary file in its folder for every file it passes on.
    (An instance's method is replaced, not the class subclassed: Gradio writes a .pyi stub beside the
    module of every Component subclass.)"""
    from gradio_client import utils as client_utils

    component = gr.File(**settings)

    def preprocess(payload):
        if payload is None:
            return None
        files = list(payload) if isinstance(payload, gr.data_classes.ListFiles) else [payload]
        for file in files:
            if component.file_types and not client_utils.is_valid_file(file.path, component.file_types):
                kinds = " or ".join("an image" if kind == "image" else f"a {kind}" if kind in ("video", "audio")
                                    else kind for kind in component.file_types)
                raise gr.Error(f"{Path(file.path).name} is not {kinds} file", print_exception=False)
        paths = [file.path for file in files]
        return paths[0] if component.file_count == "single" else paths

    component.preprocess = preprocess
    return component


def options_from_controls(engine: str, pad_top: float, pad_bottom: float, pad_left: float, pad_right: float,
                          smooth_window: float, restorer: str, output_height: int, fps: float,
                          detector: str = "mediapipe", musetalk_margin: float = 10,
                          musetalk_parsing: str = "auto") -> dict:
    """The option dict (dotted keys of heygem.config) for what the form shows; numbers go on as the controls
    gave them (whole ones as ints), so that the one request check refuses a bad one with one line."""

    def whole(value):
        return int(value) if isinstance(value, float) and value.is_integer() else value

    options = {
        "engine.name": engine,
        "face.pads": [whole(pad_top), whole(pad_bottom), whole(pad_left), whole(pad_right)],
        "face.smooth_window": whole(smooth_window),
        "restore.enabled": restorer != "none",
        "restore.method": restorer,
        "media.output_height": whole(output_height) or None,
        "media.fps": fps,
        "face.detector": detector,
        "engine.musetalk_margin": whole(musetalk_margin),
        "engine.musetalk_parsing": musetalk_parsing,
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
    """Engines the form offers: MuseTalk only when its files are complete and its libraries installed,
    Wav2Lip only when one of its checkpoints is installed."""
    from heygem.engines.musetalk.files import find_musetalk_files, missing_libraries

    choices = [("auto", "auto")]
    if not missing_libraries() and find_musetalk_files() is not None:
        choices.append(("MuseTalk 1.5", "musetalk"))
    if installed & {"wav2lip", "wav2lip_gan"}:
        choices.append(("Wav2Lip", "wav2lip"))
    return choices + [("built-in landmark engine", "landmark")]


def restorer_choices(installed: set[str]) -> list[tuple[str, str]]:
    """Restorers the form offers: GFPGAN only when GFPGANv1.4.pth is installed."""
    choices = [("auto", "auto")]
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
                                 elem_id=f"{prefix}engine", info="auto: MuseTalk, then Wav2Lip, if installed")
            output_height = gr.Dropdown(OUTPUT_HEIGHTS, value=defaults.media.output_height or 0, label="Output height",
                                        elem_id=f"{prefix}output-height", info="as the input: the face's own size")
        with gr.Row():
            restorer = gr.Dropdown(restorers, value=offered(restorer_default, restorers, "auto"),
                                   label="Restore the mouth region", elem_id=f"{prefix}restorer",
                                   info="auto: GFPGAN when installed, for Wav2Lip")
            detector = gr.Dropdown(detectors, label="Face detector", elem_id=f"{prefix}detector",
                                   value=offered(defaults.face.detector, detectors, "mediapipe"),
                                   info="S3FD is offered once its weights are installed")
        gr.Markdown("Extra pixels around the detected face (more chin padding helps when the mouth is cut off):")
        with gr.Row():
            # no precision: the value reaches the request check as given (Gradio's int() fails on NaN)
            pads = [gr.Number(value=value, label=label, minimum=0, maximum=1000, step=1, min_width=80)
                    for value, label in zip(defaults.face.pads, ("top", "bottom", "left", "right"))]
        with gr.Row():
            smooth = gr.Slider(1, 15, value=defaults.face.smooth_window, step=1, label="Face smoothing (frames)",
                               info="boxes averaged over this many frames; 1 switches it off")
            fps = gr.Slider(10, 60, value=defaults.media.fps, step=1, label="Frames per second for photos",
                            info="videos keep their own rate")
        # MuseTalk's own options, shown only where it is offered (their defaults otherwise)
        with gr.Row(visible="musetalk" in {value for _, value in engines}):
            musetalk_margin = gr.Number(value=defaults.engine.musetalk_margin, precision=0, minimum=0, maximum=200,
                                        label="MuseTalk: pixels below the chin",
                                        info="added to the face box, as MuseTalk 1.5's extra margin")
            musetalk_parsing = gr.Dropdown(["auto", "jaw", "neck", "raw", "landmarks"],
                                           value=defaults.engine.musetalk_parsing, label="MuseTalk: paste mask",
                                           info="auto: the jaw face parsing when its BiSeNet files are there")
    return [engine, *pads, smooth, restorer, output_height, fps, detector, musetalk_margin, musetalk_parsing]


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
        detail = (f"Finished in {job.seconds:.1f} s with the {html.escape(job.engine)} engine" if job.seconds
                  else "Finished")
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
    """Seconds per stage of a finished job, each named with its pipeline step ("6 render: blend"), in
    the steps' order, for the bar chart."""
    summary = job.read_summary() if job is not None else None
    stages = (summary or {}).get("seconds_per_stage") or {}
    if not stages:
        return None
    labelled = sorted(((step_of(name) or "·", name, value) for name, value in stages.items()),
                      key=lambda entry: entry[0])
    return pd.DataFrame({"stage": [f"{step}: {name}" if name != step.split(" ", 1)[-1] else step
                                   for step, name, _ in labelled],
                         "seconds": [round(float(value), 2) for _, _, value in labelled]})


def chart_update(job) -> dict:
    frame = stage_frame(job)
    if frame is None:
        return gr.update(visible=False)
    total = (job.read_summary() or {}).get("total_seconds") or frame["seconds"].sum()
    return gr.update(value=frame, visible=True, label=f"Seconds per stage · {total:.1f} s in all")


def error_text(error: Exception) -> str:
    return str(error) if isinstance(error, HeygemError) else f"{type(error).__name__}: {error}"
