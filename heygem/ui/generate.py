"""The Generate tab: one face and speech (an upload, the microphone, the face video's own sound, or typed
text spoken offline) in; a job queued, followed in a card, then the video, its download and its
seconds per stage.
"""

from __future__ import annotations

import asyncio
import html
import logging

import gradio as gr
from gradio.context import Context

from heygem.errors import HeygemError
from heygem.jobs.files import RESULT_SUBTITLES_NAME, server_folders, without_server_paths
from heygem.jobs.request import check_speech
from heygem.jobs.store import DONE, JobStore
from heygem.presenters.api import job_face, voice_sample_for
from heygem.presenters.records import PresenterStore
from heygem.speech.tts import pcm16
from heygem.ui.access import PageAccess
from heygem.ui.common import (
    ASSETS,
    FORGET_LIVE_TIME_JS,
    SCROLL_TO_JOB_JS,
    STATUS_LABELS,
    WATCH_INTERVAL,
    chart_update,
    job_card,
    language,
    option_controls,
    options_from_controls,
    problem_card,
    say,
    ui_text,
    uploaded_file,
)
from heygem.ui.faces import face_choices, picked_face, preview_face
from heygem.ui.live import follow_stream, live_player
from heygem.ui.presenters import NO_PRESENTER, picker_update

logger = logging.getLogger("heygem")
RECENT_JOBS = 5  # jobs in the recent jobs strip


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
                     *controls, submitter: str | None = None, face_index: int | None = None,
                     voice_consent: bool = False, presenter: str | None = None,
                     presenters: PresenterStore | None = None, user=None, voice_sample: str | None = None) -> str:
    """Queue the form's job as a remote request (checked as REST checks one); HeygemError says what to fix.
    ``face_index``: the face picked among several (face.face_index; None: the largest). ``voice_consent``:
    the user says they may use the voice the cloned voice ("clone") takes from the face video.
    ``presenter``: a saved presenter's id (of ``presenters``, one ``user`` may see) instead of the face.
    ``voice_sample``: a recording whose voice "clone" speaks in, instead of the face video's own sound."""
    text = (text or "").strip()
    if not face_path and not presenter:
        raise HeygemError("Add a face first: a video or a photo, or pick a saved presenter.")
    check_speech(bool(audio_path), text, own_audio=use_video_audio)
    options = options_from_controls(*controls)
    if text:
        options["text.subtitles"] = subtitles
    if presenter:  # its clip, face, track and voice instead of the upload (as REST and gradio_client take one)
        presenters = presenters or PresenterStore(store.outputs_dir)
        face_path, options = job_face(presenters, presenter, user, None, options,
                                      lambda given: store.resolve_options(given, remote=True))
        voice_sample = voice_sample_for(presenters, presenter, voice, voice_sample)
    elif face_index is not None:
        options["face.face_index"] = int(face_index)
    try:
        speed = float(speed)
    except (TypeError, ValueError):
        raise HeygemError(f"the speed must be a number such as 1.0, not {speed!r}") from None
    return store.create_job(face_path, None if use_video_audio or text else audio_path, options, text=text or None,
                            voice=None if voice in (None, "", "auto") else voice, speed=speed, remote=True,
                            submitter=submitter, voice_consent=bool(voice_consent),
                            voice_sample=voice_sample if voice == "clone" and voice_sample else None)


def recent_choices(jobs, language_code: str = "en") -> list[tuple[str, str]]:
    """The recent jobs strip's entries: "id · state · face + speech", newest first."""
    entries = []
    for job in jobs:
        state = say(f"state.{job.status}", language_code) if job.status in STATUS_LABELS else job.status
        entries.append((f"{job.id} · {state} · {job.face_name} + {job.audio_name or 'own audio'}", job.id))
    return entries


def cues_html(job) -> str:
    """The job's subtitles spoken so far (all of them once it is done) as WebVTT, hidden in the page for
    its script to give the players (heygem.ui.common.PAGE_SCRIPT); empty for a job without any."""
    from heygem.speech.subtitles import format_vtt, read_srt

    path = job.directory / RESULT_SUBTITLES_NAME
    try:
        cues = read_srt(path) if path.is_file() else []
    except HeygemError:  # being written, or empty so far
        cues = []
    return f'<pre class="vtt">{html.escape(format_vtt(cues))}</pre>' if cues else ""


def generate_tab(store: JobStore, access: PageAccess, presenters: PresenterStore | None = None) -> None:
    """One face (or a saved presenter of ``presenters``) + speech in: queue a job, follow it in a card (with
    its live stream and subtitles), then show the video and its stage times. The page remembers the job it
    follows across reloads and lists the user's recent jobs to follow one again."""
    presenters = presenters if presenters is not None else PresenterStore(store.outputs_dir)
    following: dict[str, str] = {}  # page (Gradio session) -> the job it follows; a new job replaces the old

    def recent_update(request, followed: str | None = None) -> dict:
        choices = recent_choices(access.jobs(request, limit=RECENT_JOBS), language(request))
        return gr.update(choices=choices, value=followed if followed in {job_id for _, job_id in choices} else None,
                         visible=bool(choices))

    def start_following(job, request) -> tuple:
        """Follow ``job`` on this page: what the follow outputs show at once."""
        following[request.session_hash or ""] = job.id
        return (job.id, job_card(job, language(request)), gr.update(value=None), gr.update(visible=False, value=None),
                gr.update(visible=False), gr.update(visible=not job.is_finished), job.id, "",
                recent_update(request, job.id), gr.update(visible=False))

    def nothing_followed(card: str, request, remembered: str = "") -> tuple:
        return ("", card, gr.update(value=None), gr.update(visible=False, value=None), gr.update(visible=False),
                gr.update(visible=False), remembered, "", recent_update(request), gr.update(visible=False))

    def submit(request: gr.Request, face_path, audio_path, use_video_audio, text, voice, speed, subtitles,
               face_index, voice_consent, voice_sample, presenter, *controls):
        """Queue a job; a problem with the inputs is shown in the card and nothing is queued. A job queued
        while the page follows an unfinished one is said to be queued after it."""
        words = language(request)
        try:
            job_id = queue_generation(store, face_path, audio_path, use_video_audio, text, voice, speed, subtitles,
                                      *controls, submitter=access.submitter(request), face_index=face_index,
                                      voice_consent=voice_consent, presenter=presenter, presenters=presenters,
                                      user=access.user(request), voice_sample=voice_sample)
        except HeygemError as error:
            problem = without_server_paths(str(error), server_folders(store.outputs_dir), every_path=False)
            gr.Warning(problem)
            return nothing_followed(problem_card(problem), request, gr.update())
        earlier = access.find(following.get(request.session_hash or ""), request)
        if earlier is not None and not earlier.is_finished:
            gr.Info(say("second.job", words, new=job_id, old=earlier.id), duration=12)
        return start_following(store.get(job_id), request)

    def follow_again(job_id, request: gr.Request):
        """Follow a job picked in the recent jobs strip, or the one remembered when the page loads."""
        job = access.find(job_id, request)
        if job is None:  # the empty card in the browser's language (what the page is built with is English)
            return nothing_followed(f"<div class='empty-card'>{say('card.empty', language(request))}</div>", request)
        return start_following(job, request)

    async def watch(job_id, request: gr.Request):
        """Follow one job until it ends (or the page starts another): card and subtitles, then the video,
        the download and the chart, the live player going in the same moment."""
        unchanged = tuple(gr.update() for _ in range(8))  # (a generator that yields nothing empties its outputs)
        if not job_id:  # nothing was queued: leave what submit showed
            yield unchanged
            return
        page, words = request.session_hash or "", language(request)
        last = None
        try:
            while True:
                job = await asyncio.to_thread(access.find, job_id, request)
                if following.get(page) != job_id:  # a newer job of this page is followed now: leave it be
                    yield unchanged
                    return
                if job is None:
                    yield (f"<div class='empty-card'>{say('job.deleted', words)}</div>", None, gr.update(visible=False),
                           gr.update(visible=False), gr.update(visible=False), "", recent_update(request),
                           gr.update(visible=False))
                    return
                card, cues = job_card(job, words), await asyncio.to_thread(cues_html, job)
                if job.is_finished:
                    video = await asyncio.to_thread(access.deliver, job) if job.status == DONE else None
                    yield (card, video, gr.update(visible=video is not None, value=video), chart_update(job, words),
                           gr.update(visible=False), cues, recent_update(request, job_id), gr.update(visible=False))
                    return
                if (card, cues) != last:
                    last = card, cues
                    yield card, gr.update(), gr.update(), gr.update(), gr.update(visible=True), cues, gr.update(), \
                        gr.update()
                await asyncio.sleep(WATCH_INTERVAL)
        finally:  # ended, replaced or the page went away
            if following.get(page) == job_id:
                following.pop(page, None)

    def cancel(job_id, request: gr.Request):
        job = access.find(job_id, request)
        if job is not None:
            store.cancel(job.id)

    def offer_presenters(chosen, request: gr.Request):
        return picker_update(presenters, access, chosen, request)

    def choose_presenter(chosen, face_path, request: gr.Request):
        """A saved presenter takes the face upload's place (hidden, with its previews and picker); none
        brings the upload back as it was."""
        if not chosen:
            image, video, own_audio = preview_face(face_path)
            return gr.update(visible=True), image, video, gr.update(), gr.update(visible=False, value=""), own_audio
        presenter = presenters.get(chosen)
        note = say("presenter.chosen", language(request), name=presenter.name) if presenter else \
            say("presenter.missing", language(request))
        hidden = gr.update(visible=False)
        own_audio = gr.update(visible=True, interactive=True) if presenter and presenter.kind == "video" else \
            gr.update(visible=False, value=False)
        return hidden, hidden, hidden, hidden, gr.update(visible=True, value=note), own_audio

    def look_at_face(face_path, request: gr.Request):
        return face_choices(face_path, language(request))

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
    with gr.Tab(ui_text("tab.generate"), id="generate"):
        job_id_state = gr.State("")
        face_index = gr.State(None)  # the face picked among several; None: the largest
        remembered = gr.BrowserState("", storage_key="heygem-followed-job")  # the followed job, across reloads
        with gr.Row(equal_height=False):
            with gr.Column(scale=1):
                # any file is taken, and one of another kind is said in words (Gradio's own check of the
                # kind leaves a bare "Error" in the field)
                presenter = gr.Dropdown([(say("presenter.none"), NO_PRESENTER)], value=NO_PRESENTER,
                                        label=ui_text("presenter"), elem_id="presenter-input")
                presenter_note = gr.Markdown("", visible=False, elem_id="presenter-chosen")
                face = uploaded_file(label=ui_text("face"), elem_id="face-input", height=120)
                face_image = gr.Image(label=ui_text("face.preview"), visible=False, interactive=False, height=220)
                face_video = gr.Video(label=ui_text("face.preview"), visible=False, interactive=False, height=220)
                faces = gr.Gallery(label=ui_text("faces.found"), visible=False, elem_id="face-picker", columns=5,
                                   height="auto", allow_preview=False, object_fit="contain", interactive=False,
                                   buttons=[])
                faces_note = gr.Markdown("", visible=False, elem_id="face-note")
                audio = gr.Audio(label=ui_text("speech"), sources=["upload", "microphone"],
                                 type="filepath", elem_id="audio-input", buttons=["download"])
                use_video_audio = gr.Checkbox(label=ui_text("own.audio"), value=False, elem_id="own-audio")
                with gr.Accordion(ui_text("text.accordion"), open=False, elem_id="text-accordion"):
                    text = gr.Textbox(label=ui_text("text"), lines=3, elem_id="text-input",
                                      placeholder=ui_text("text.placeholder"))
                    voice = gr.Dropdown(voice_choices(), value="auto", label=ui_text("voice"), elem_id="voice-input")
                    # the cloned voice speaks in the face video's own voice: only with the user's word that they may
                    voice_consent = gr.Checkbox(False, label=ui_text("voice.consent"), visible=False,
                                                elem_id="voice-consent")
                    voice_sample = gr.Audio(label=ui_text("voice.sample"), sources=["upload", "microphone"],
                                            type="filepath", visible=False, elem_id="voice-sample")
                    with gr.Row():
                        speed = gr.Slider(0.5, 2.0, value=1.0, step=0.05, label=ui_text("speed"), elem_id="speed-input")
                        modes = [(ui_text(f"subtitles.{mode}"), mode) for mode in ("soft", "burn", "none")]
                        subtitles = gr.Radio(modes, value=store.base_config.text.subtitles, label=ui_text("subtitles"),
                                             elem_id="subtitles-input")
                    listen_button = gr.Button(ui_text("listen"), size="sm", elem_id="listen-button")
                    preview = gr.Audio(label=ui_text("listen.preview"), type="numpy", interactive=False,
                                       elem_id="listen-audio")
                    preview_note = gr.Markdown("", elem_id="listen-note")
                controls = option_controls(store, prefix="")
                generate = gr.Button(ui_text("generate"), variant="primary", elem_id="generate-button")
                if examples:
                    gr.Examples(examples, inputs=[face, audio], label=ui_text("examples"),
                                example_labels=["Astronaut photo + English speech",  # Gradio shows these as given
                                                "Astronaut photo + Chinese speech"][:len(examples)])
            with gr.Column(scale=1):
                recent = gr.Radio([], label=ui_text("recent"), visible=False, elem_id="recent-jobs")
                card = gr.HTML(f"<div class='empty-card'>{say('card.empty')}</div>", elem_id="job-card")
                cues = gr.HTML("", elem_id="subtitle-cues", elem_classes=["subtitle-cues"])  # for the players
                live = live_player("live-stream")  # the job's stream, played while it renders
                result = gr.Video(label=ui_text("result"), interactive=False, elem_id="result-video",
                                  buttons=["download"])
                with gr.Row():
                    download = gr.DownloadButton(ui_text("download"), visible=False, elem_id="download-button")
                    cancel_button = gr.Button(ui_text("cancel"), visible=False, variant="stop", size="lg")
                chart = gr.HTML(visible=False, elem_id="stage-chart")  # the stages on a time line
        voice.change(lambda chosen: (gr.update(visible=chosen == "clone", value=False),
                                     gr.update(visible=chosen == "clone")), voice, [voice_consent, voice_sample],
                     queue=False, show_progress="hidden", api_visibility="private")
        face.change(preview_face, face, [face_image, face_video, use_video_audio], queue=False,
                    show_progress="hidden", api_visibility="private")
        face.change(look_at_face, face, [face, face_image, face_video, faces, faces_note, face_index],
                    concurrency_limit=2, show_progress="hidden", api_visibility="private", trigger_mode="always_last")
        faces.select(picked_face, None, [face_index, faces_note], queue=False, api_visibility="private")
        presenter.focus(offer_presenters, presenter, presenter, queue=False, show_progress="hidden",
                        api_visibility="private")
        presenter.change(choose_presenter, [presenter, face], [face, face_image, face_video, faces, presenter_note,
                                                       use_video_audio],
                         queue=False, show_progress="hidden", api_visibility="private")

        # What following a job shows at once, then its watch (card, subtitles, result) and its live stream.
        # A new job replaces the one this page was following (that one keeps running; see Jobs): the old
        # watch sees it is no longer followed and ends, then the new one starts (always_last).
        follow_outputs = [job_id_state, card, result, download, chart, cancel_button, remembered, cues, recent, live]
        stream = follow_stream(access, followed=lambda request, job_id: following.get(
            request.session_hash or "") == job_id, hide_when_done=False)

        def then_watch(event):
            event.success(watch, job_id_state, [card, result, download, chart, cancel_button, cues, recent, live],
                          concurrency_limit=None, show_progress="hidden", api_visibility="private",
                          trigger_mode="always_last")
            event.success(stream, job_id_state, live, concurrency_limit=None, show_progress="hidden",
                          api_visibility="private", trigger_mode="always_last")
            return event

        submitted = then_watch(generate.click(
            submit, [face, audio, use_video_audio, text, voice, speed, subtitles, face_index, voice_consent,
                     voice_sample, presenter, *controls],
            follow_outputs, concurrency_limit=8, show_progress="minimal", api_visibility="private",
            js=FORGET_LIVE_TIME_JS))
        # the card and the live player in view, whatever was open (the newest Generate's, as the watch)
        submitted.success(None, js=SCROLL_TO_JOB_JS, trigger_mode="always_last")
        then_watch(recent.input(follow_again, recent, follow_outputs, api_visibility="private", show_progress="hidden",
                                js=FORGET_LIVE_TIME_JS))
        page_blocks = Context.root_block
        if page_blocks is not None:  # the job this browser followed before a reload, followed again
            page_blocks.load(offer_presenters, presenter, presenter, show_progress="hidden", api_visibility="private")
            then_watch(page_blocks.load(follow_again, remembered, follow_outputs, api_visibility="private",
                                        show_progress="hidden"))
        cancel_button.click(cancel, job_id_state, None, queue=False, api_visibility="private")
        listen_button.click(listen, [text, voice, speed], [preview, preview_note], concurrency_limit=2,
                            api_visibility="private")
