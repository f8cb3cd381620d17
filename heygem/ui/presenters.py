"""The Presenters tab: a presenter made once from a clip (or photo) and then used by every job that names it.

New presenter: the clip, the face that speaks (picked among several as on Generate), a name; Save runs the
same checks as ``POST /api/presenters`` and ``python -m heygem presenters add`` (heygem.presenters.checks),
says what they found, and hands the presenter to the server's one preparer (heygem.presenters.api.Preparer),
whose progress the tab follows. Your presenters: the ready ones' thumbnails (the face box and the mouth
region drawn) and a table of all with their state, length, size and warnings; one picked can be deleted.

Generate (and Batch) offer the ready ones through :func:`presenter_choices`, and a job made from one goes
through :func:`heygem.presenters.api.job_face`, as REST and gradio_client jobs do.
"""

from __future__ import annotations

import html
import logging
from pathlib import Path

import gradio as gr
import pandas as pd

from heygem.errors import HeygemError
from heygem.jobs.files import human_size, server_folders, without_server_paths
from heygem.jobs.users import sees_every_job
from heygem.presenters.api import Preparer
from heygem.presenters.records import PREPARING, READY, Presenter, PresenterStore
from heygem.ui.access import PageAccess
from heygem.ui.common import language, say, say_warning, ui_text, uploaded_file
from heygem.ui.faces import face_choices, picked_face, preview_face

logger = logging.getLogger("heygem")

PRESENTER_COLUMNS = ["name", "status", "length", "size", "warnings", "id"]
REFRESH_SECONDS = 1.5  # how often the tab looks again while a presenter is being prepared
NO_PRESENTER = ""  # the presenter picker's value for "upload a face instead"
PRESENTERS_CSS = """
#presenter-card {padding: 8px 0; line-height: 1.6;}
#presenter-gallery .thumbnail-item {max-width: 220px;}
#presenter-table [role=gridcell] .cell-wrap span {overflow-wrap: anywhere !important;}
"""


def visible_presenters(presenters: PresenterStore, access: PageAccess, request) -> list[Presenter]:
    """The presenters this page's user may see and use (an admin: everyone's), newest first."""
    user = access.user(request)
    return presenters.list(user and user.name, every_user=sees_every_job(user))


def presenter_choices(presenters: PresenterStore, access: PageAccess, request, language_code: str = "en",
                      none_label: str | None = None) -> list[tuple[str, str]]:
    """The picker's entries: ``none_label`` ("upload a face" by default) first, then the ready presenters the
    page's user may use as "name (12 s)"."""
    choices = [(none_label or say("presenter.none", language_code), NO_PRESENTER)]
    for presenter in visible_presenters(presenters, access, request):
        if presenter.status == READY:
            length = say("presenter.photo", language_code) if presenter.kind == "image" else \
                f"{presenter.seconds:.0f} s"
            choices.append((f"{presenter.name} ({length})", presenter.id))
    return choices


def picker_update(presenters: PresenterStore, access: PageAccess, chosen: str | None, request,
                  none_label: str | None = None) -> dict:
    """A presenter picker's entries as they are now (:func:`presenter_choices`); the one ``chosen`` stays
    picked if it still is there, else none."""
    choices = presenter_choices(presenters, access, request, language(request), none_label)
    return gr.update(choices=choices, value=chosen if chosen in {value for _, value in choices} else NO_PRESENTER)


def status_text(presenter: Presenter, language_code: str = "en") -> str:
    if presenter.status == PREPARING:
        return f"{say('presenter.preparing', language_code)} {presenter.progress:.0%}"
    return say(f"presenter.{presenter.status}", language_code)


def presenter_table(shown: list[Presenter], language_code: str = "en") -> pd.DataFrame:
    rows = [[presenter.name, status_text(presenter, language_code),
             say("presenter.photo", language_code) if presenter.kind == "image" else f"{presenter.seconds:.1f} s",
             f"{presenter.width}x{presenter.height}",
             "; ".join(say_warning(warning, language_code) for warning in presenter.warnings)
             or (presenter.error or ""), presenter.id]
            for presenter in shown]
    return pd.DataFrame(rows, columns=PRESENTER_COLUMNS)


def presenter_details(presenter: Presenter | None, language_code: str = "en") -> str:
    """The picked presenter in a few lines: name, state, length, size, the speech sample, warnings."""
    if presenter is None:
        return f"<div class='empty-card'>{say('presenter.pick', language_code)}</div>"
    length = say("presenter.photo", language_code) if presenter.kind == "image" else f"{presenter.seconds:.1f} s"
    lines = [f"<b>{html.escape(presenter.name)}</b> · {html.escape(status_text(presenter, language_code))}",
             f"{presenter.width}x{presenter.height} · {length} · {human_size(presenter.bytes)}"]
    if presenter.speech_seconds:
        lines.append(say("presenter.sample", language_code, seconds=presenter.speech_seconds))
    if presenter.error:
        lines.append(html.escape(presenter.error))
    lines += [f"⚠ {html.escape(say_warning(warning, language_code))}" for warning in presenter.warnings]
    lines.append(f"<small>{presenter.id}</small>")
    return "<div class='presenter-card'>" + "<br>".join(lines) + "</div>"


def presenters_tab(presenters: PresenterStore, preparer: Preparer, access: PageAccess) -> None:
    """New presenters made and checked here, prepared by ``preparer``; the user's presenters listed,
    followed while they are prepared, and deleted."""

    def gallery(shown: list[Presenter]) -> list[tuple[str, str]]:
        """The ready presenters' thumbnails, each a copy the page may serve, captioned with the name."""
        pictures = []
        for presenter in shown:
            if presenter.status == READY:
                copy = access.deliver_file(presenter.thumbnail_path, f"{presenter.id}.jpg", key_prefix=presenter.id)
                if copy is not None:
                    pictures.append((copy, presenter.name))
        return pictures

    def listing(request: gr.Request, picked: str | None = None):
        """The gallery, the table, the picked presenter's card and the delete button, and whether to look
        again (while one is being prepared)."""
        words = language(request)
        shown = visible_presenters(presenters, access, request)
        chosen = next((presenter for presenter in shown if presenter.id == picked), None)
        return (gallery(shown), presenter_table(shown, words), presenter_details(chosen, words),
                gr.update(visible=chosen is not None),
                gr.Timer(active=any(presenter.status == PREPARING for presenter in shown)))

    def look_at_clip(clip_path, request: gr.Request):
        field, image, video, faces, note, index = face_choices(clip_path, language(request))
        name = gr.update(value=Path(clip_path).stem[:80]) if clip_path and field is not None else gr.update()
        return field, image, video, faces, note, index, name

    def save(request: gr.Request, clip_path, name, face_index):
        """Check the clip and keep it as a presenter being prepared; what the checks found is said."""
        words = language(request)
        if not clip_path:
            gr.Warning(say("presenter.no.clip", words))
            return (gr.update(), say("presenter.no.clip", words), *listing(request))
        user = access.user(request)
        try:
            presenter = presenters.create(Path(clip_path), name, face_index=face_index,
                                          submitter=user and user.name)
        except HeygemError as problem:
            message = without_server_paths(str(problem), server_folders(presenters.outputs_dir), every_path=False)
            logger.warning("presenter refused: %s", message)
            gr.Warning(message)
            return (gr.update(), f"**{say('presenter.refused', words)}** {html.escape(message)}", *listing(request))
        preparer.submit(presenter)
        note = say("presenter.saved", words, name=presenter.name)
        if presenter.warnings:
            note += " " + say("card.warnings", words) + " " + "; ".join(
                say_warning(warning, words) for warning in presenter.warnings)
        return (presenter.id, note, *listing(request, presenter.id))

    def pick_row(table: pd.DataFrame, event: gr.SelectData, request: gr.Request):
        row = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
        picked = str(table["id"].iloc[row]) if row is not None and row < len(table) else ""
        return (picked, *listing(request, picked))

    def pick_picture(pictures, event: gr.SelectData, request: gr.Request):
        ready = [presenter for presenter in visible_presenters(presenters, access, request)
                 if presenter.status == READY]
        picked = ready[event.index].id if event.index is not None and event.index < len(ready) else ""
        return (picked, *listing(request, picked))

    def delete(picked: str, request: gr.Request):
        presenter = presenters.get(picked or "")
        user = access.user(request)
        shown = {presenter.id for presenter in visible_presenters(presenters, access, request)}
        if presenter is None or presenter.id not in shown:
            return ("", *listing(request))
        preparer.delete(presenter)  # one being prepared: stopped first (it goes once it has)
        logger.info("presenter %s (%s) deleted by %s", presenter.id, presenter.name, user.name if user else "the page")
        return ("", *listing(request))

    def refresh(picked: str, request: gr.Request):
        return listing(request, picked)

    with gr.Tab(ui_text("tab.presenters"), id="presenters") as tab:
        picked = gr.State("")
        face_index = gr.State(None)
        timer = gr.Timer(REFRESH_SECONDS, active=False)
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=280):
                gr.Markdown(ui_text("presenter.new"))
                clip = uploaded_file(label=ui_text("presenter.clip"), elem_id="presenter-clip", height=120)
                clip_image = gr.Image(label=ui_text("face.preview"), visible=False, interactive=False, height=200)
                clip_video = gr.Video(label=ui_text("face.preview"), visible=False, interactive=False, height=200)
                faces = gr.Gallery(label=ui_text("faces.found"), visible=False, elem_id="presenter-face-picker",
                                   columns=5, height="auto", allow_preview=False, object_fit="contain",
                                   interactive=False, buttons=[])
                faces_note = gr.Markdown("", visible=False, elem_id="presenter-face-note")
                name = gr.Textbox(label=ui_text("presenter.name"), max_length=80, elem_id="presenter-name")
                save_button = gr.Button(ui_text("presenter.save"), variant="primary", elem_id="presenter-save")
                save_note = gr.Markdown("", elem_id="presenter-note")
            with gr.Column(scale=2):
                pictures = gr.Gallery(label=ui_text("presenter.yours"), columns=5, height=240, object_fit="contain",
                                      allow_preview=False, interactive=False, buttons=[], elem_id="presenter-gallery")
                table = gr.Dataframe(pd.DataFrame(columns=PRESENTER_COLUMNS), interactive=False, wrap=True,
                                     max_height=360, elem_id="presenter-table", elem_classes=["heygem-table"])
                card = gr.HTML(presenter_details(None), elem_id="presenter-card")
                delete_button = gr.Button(ui_text("presenter.delete"), variant="stop", visible=False,
                                          elem_id="presenter-delete")
        shown = [pictures, table, card, delete_button, timer]
        clip.change(lambda path: preview_face(path)[:2], clip, [clip_image, clip_video], queue=False,
                    show_progress="hidden", api_visibility="private")
        clip.change(look_at_clip, clip, [clip, clip_image, clip_video, faces, faces_note, face_index, name],
                    concurrency_limit=2, show_progress="hidden", api_visibility="private",
                    trigger_mode="always_last")
        faces.select(picked_face, None, [face_index, faces_note], queue=False, api_visibility="private")
        save_button.click(save, [clip, name, face_index], [picked, save_note, *shown], concurrency_limit=2,
                          api_visibility="private")
        table.select(pick_row, table, [picked, *shown], api_visibility="private")
        pictures.select(pick_picture, pictures, [picked, *shown], api_visibility="private")
        delete_button.click(delete, picked, [picked, *shown], api_visibility="private")
        timer.tick(refresh, picked, shown, show_progress="hidden", api_visibility="private")
        tab.select(refresh, picked, shown, show_progress="hidden", api_visibility="private")
