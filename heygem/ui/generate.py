"""The Generate tab: one face and speech (an upload, the microphone, the face video's own sound, or typed
text spoken offline) in; a job queued, followed in a card, then the video, its download and its
seconds per stage.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import gradio as gr

from heygem.errors import HeygemError
from heygem.jobs.files import server_folders, without_server_paths
from heygem.jobs.request import check_speech
from heygem.jobs.store import DONE, JobStore
from heygem.media.probing import IMAGE_SUFFIXES
from heygem.speech.tts import pcm16
from heygem.ui.access import PageAccess
from heygem.ui.common import (
    ASSETS,
    WATCH_INTERVAL,
    chart_update,
    job_card,
    option_controls,
    options_from_controls,
    problem_card,
    uploaded_file,
)
from heygem.ui.live import follow_stream, live_player

logger = logging.getLogger("heygem")


def preview_face(face_path):
    """Show an uploaded face in the image or the video preview, whichever fits."""
    if not face_path:
        return gr.update(visible=False, value=None), gr.update(visible=False, value=None)
    is_image = Path(face_path).suffix.lower() in IMAGE_SUFFIXES
    return (gr.update(visible=is_image, value=face_path if is_image else None),
            gr.update(visible=not is_image, value=None if is_image else face_path))


def voice_choices() -> list[tuple[str, str]]:
    """The voices text can be spoken with, for the Voice dropdown: auto first (the bundled voice, or
    espeak-ng for a language without a Piper voice)."""
    choices = [("auto", "auto")]
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


def queue_generation(store: JobStore, face_path, audio_path, use_video_audio, text, voice, speed, subtitles,
                     *controls, submitter: str | None = None) -> str:
    """Queue the form's job as a remote request (checked as REST checks one); HeygemError says what to fix."""
    text = (text or "").strip()
    if not face_path:
        raise HeygemError("Add a face first: a video or a photo.")
    check_speech(bool(audio_path), text, own_audio=use_video_audio)
    options = options_from_controls(*controls)
    if text:
        options["text.subtitles"] = subtitles
    try:
        speed = float(speed)
    except (TypeError, ValueError):
        raise HeygemError(f"the speed must be a number such as 1.0, not {speed!r}") from None
    return store.create_job(face_path, None if use_video_audio or text else audio_path, options, text=text or None,
                            voice=None if voice in (None, "", "auto") else voice, speed=speed, remote=True,
                            submitter=submitter)


def generate_tab(store: JobStore, access: PageAccess) -> None:
    """One face + speech in: queue a job, follow it in a card, then show the video and its stage times."""
    following: dict[str, str] = {}  # page (Gradio session) -> the job it follows; a new job replaces the old

    def submit(request: gr.Request, face_path, audio_path, use_video_audio, text, voice, speed, subtitles,
               *controls):
        """Queue a job; a problem with the inputs is shown in the card and nothing is queued."""
        problem = None
        try:
            job_id = queue_generation(store, face_path, audio_path, use_video_audio, text, voice, speed, subtitles,
                                      *controls, submitter=access.submitter(request))
        except HeygemError as error:
            problem = without_server_paths(str(error), server_folders(store.outputs_dir), every_path=False)
        if problem:
            gr.Warning(problem)
            return ("", problem_card(problem), gr.update(value=None), gr.update(visible=False, value=None),
                    gr.update(visible=False), gr.update(visible=False))
        job = store.get(job_id)
        following[request.session_hash or ""] = job_id
        return (job_id, job_card(job), gr.update(value=None), gr.update(visible=False, value=None),
                gr.update(visible=False), gr.update(visible=True))

    async def watch(job_id, request: gr.Request):
        """Follow one job until it ends (or the page starts another): card, then the video, the download and
        the chart."""
        if not job_id:  # nothing was queued: leave what submit showed
            yield gr.update(), gr.update(), gr.update(), gr.update(), gr.update()
            return
        page = request.session_hash or ""
        last_card = None
        try:
            while True:
                job = await asyncio.to_thread(access.find, job_id, request)
                if following.get(page) != job_id:  # a newer job of this page is followed now
                    return
                if job is None:
                    yield "<div class='empty-card'>This job was deleted.</div>", None, gr.update(visible=False), \
                        gr.update(visible=False), gr.update(visible=False)
                    return
                card = job_card(job)
                if job.is_finished:
                    video = await asyncio.to_thread(access.deliver, job) if job.status == DONE else None
                    yield (card, video, gr.update(visible=video is not None, value=video),
                           chart_update(job), gr.update(visible=False))
                    return
                if card != last_card:
                    last_card = card
                    yield card, gr.update(), gr.update(), gr.update(), gr.update(visible=True)
                await asyncio.sleep(WATCH_INTERVAL)
        finally:  # ended, replaced or the page went away
            if following.get(page) == job_id:
                following.pop(page, None)

    def cancel(job_id, request: gr.Request):
        job = access.find(job_id, request)
        if job is not None:
            store.cancel(job.id)

    def listen(text, voice, speed):
        """Speak the typed text as a job would (same voice, speed and length limit): the audio and a note."""

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
        pcm = pcm16(speech.samples)  # (N,) mono
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
                face = uploaded_file(label="Face: a video or a photo", file_types=["video", "image"],
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
                live = live_player("live-stream")  # the job's stream, played while it renders
                result = gr.Video(label="Result", interactive=False, elem_id="result-video", buttons=["download"])
                with gr.Row():
                    download = gr.DownloadButton("Download MP4", visible=False, elem_id="download-button")
                    cancel_button = gr.Button("Cancel", visible=False, variant="stop", size="lg")
                chart = gr.BarPlot(x="stage", y="seconds", visible=False, height=260, sort=None,
                                   x_label_angle=-35, x_title="", label="Seconds per stage", elem_id="stage-chart")
        face.change(preview_face, face, [face_image, face_video], queue=False, show_progress="hidden",
                    api_visibility="private")
        # A new job replaces the one this page was following (that one keeps running; see Jobs): the old
        # watch sees it is no longer followed and ends, then the new one starts (always_last).
        submitted = generate.click(
            submit, [face, audio, use_video_audio, text, voice, speed, subtitles, *controls],
            [job_id_state, card, result, download, chart, cancel_button],
            concurrency_limit=8, show_progress="minimal", api_visibility="private",
        )
        submitted.success(
            watch, job_id_state, [card, result, download, chart, cancel_button],
            concurrency_limit=None, show_progress="hidden", api_visibility="private", trigger_mode="always_last",
        )
        submitted.success(follow_stream(access, followed=lambda request, job_id: following.get(
            request.session_hash or "") == job_id), job_id_state, live, concurrency_limit=None,
            show_progress="hidden", api_visibility="private", trigger_mode="always_last")
        cancel_button.click(cancel, job_id_state, None, queue=False, api_visibility="private")
        listen_button.click(listen, [text, voice, speed], [preview, preview_note], concurrency_limit=2,
                            api_visibility="private")
