"""The Batch tab: many faces and audio files (uploaded, or from a server folder under --batch-root),
paired by name, every face with every audio, or by a CSV manifest; previewed with the items that will
fail and why, queued, followed in a table (a row picked shows that item's job and video), the results
in a zip as the command line writes them (videos, subtitles, summary.csv).
"""

from __future__ import annotations

import html
from pathlib import Path

import gradio as gr
import pandas as pd

from heygem.errors import HeygemError
from heygem.jobs.batch import (
    BatchItem,
    BatchResult,
    collect_files,
    new_batch_id,
    plan_for_presenter,
    plan_items,
    resolve_under_roots,
    submit_items,
    zip_results,
)
from heygem.jobs.store import DONE, FAILED, JobStore
from heygem.media.probing import probe_inputs
from heygem.presenters.records import READY, PresenterStore
from heygem.ui.access import PageAccess
from heygem.ui.common import (
    BATCH_COLUMNS,
    STATUS_LABELS,
    error_text,
    job_card,
    option_controls,
    options_from_controls,
    say,
)
from heygem.ui.presenters import NO_PRESENTER, picker_update
from heygem.ui.tables import narrow_columns_css

NO_ITEM = "<div class='empty-card'>Pick an item in the table to see its job and video.</div>"
NARROW_SHOWN = {1: 0.2, 3: 0.22, 4: 0.22, 6: 0.36}  # a phone's columns (1-based): item, audio, status, stage / error
BATCH_CSS = """
#batch-table [role=gridcell] .cell-wrap, #batch-table [role=gridcell] .cell-wrap span {
    overflow-wrap: break-word !important; word-break: normal !important;}
""" + narrow_columns_css("batch-table", NARROW_SHOWN)


def face_label(item: BatchItem, presenters: PresenterStore | None = None) -> str:
    """The item's face as the table shows it: the file's name, or the saved presenter's."""
    if item.presenter:
        presenter = presenters.get(item.presenter) if presenters is not None else None
        return f"presenter {presenter.name if presenter else item.presenter}"
    return item.face_path.name if item.face_path else ""


def input_problem(item: BatchItem, probed: dict, presenters: PresenterStore | None = None) -> str | None:
    """Why the item's inputs will be refused when it is queued (the check a job's inputs go through), or
    None; ``probed`` keeps the answers for the pairs already looked at (every face with every audio). A
    saved presenter's item is looked at with the presenter's clip (one that is gone or not ready is said)."""
    speech = None if item.text is not None else item.audio_path
    face = item.face_path
    if item.presenter:
        presenter = presenters.get(item.presenter) if presenters is not None else None
        if presenter is None:
            return f"there is no presenter {item.presenter!r}"
        if presenter.status != READY:
            return f"presenter {presenter.name!r} is {presenter.status}; its jobs can start once it is ready"
        face = presenter.clip_path
    key = (face, speech, item.text is not None)
    if key not in probed:
        try:
            probe_inputs(face, speech, picture_only=item.text is not None)
            probed[key] = None
        except HeygemError as error:
            probed[key] = str(error)
    return probed[key]


def preview_table(items: list[BatchItem], presenters: PresenterStore | None = None) -> tuple[pd.DataFrame, str]:
    """The items Start would queue, before anything runs: which face speaks which audio (or text), and
    which will not run or will fail, each with why."""
    rows, failing = [], 0
    probed: dict = {}
    for item in items:
        problem = item.problem or input_problem(item, probed, presenters)
        status = "will not run" if item.problem else "will fail" if problem else "not started"
        failing += bool(problem) and not item.problem
        rows.append([item.name, face_label(item, presenters), item.speech_label, status, "",
                     problem or item.note or "", "", ""])
    ready = sum(1 for row in rows if row[3] == "not started")
    summary = f"**Preview:** {ready} of {len(items)} item(s) will run when you press Start batch"
    if failing:
        summary += f"; {failing} will fail (their inputs are refused: see why in the table)"
    return pd.DataFrame(rows, columns=BATCH_COLUMNS), summary + "."


def queue_batch(store: JobStore, items: list, options: dict, submitter: str | None = None) -> tuple[str, dict]:
    """Queue the planned items as remote requests (each checked as REST checks one, its manifest row's
    options included); returns the new batch's id and item name -> job id or the error that stopped it."""
    batch = new_batch_id()
    return batch, submit_items(store, items, options, batch, remote=True, submitter=submitter)


def batch_tab(store: JobStore, batch_roots: list[Path], access: PageAccess,
              presenters: PresenterStore | None = None) -> None:
    """Many faces and audio files (uploaded or from a server folder), paired, queued, followed in a table; or
    every audio and text file spoken by one saved presenter of ``presenters``."""
    presenters = presenters if presenters is not None else PresenterStore(store.outputs_dir)

    def plan_batch(source, uploaded, folder, pairing, manifest, presenter=NO_PRESENTER):
        if source == "folder":
            directory = resolve_under_roots(folder, batch_roots)
            files, base = collect_files(directory), directory
        else:
            if not uploaded:
                raise HeygemError("upload some faces and audio files first")
            files, base = [Path(path) for path in uploaded], None
        if presenter:  # one saved presenter speaks every audio and text file
            return plan_for_presenter(files, presenter, base_dir=base)
        if pairing == "manifest":
            if not manifest:
                raise HeygemError("upload the CSV manifest (columns face,audio[,text][,name][,options])")
            return plan_items(files, str(manifest), base_dir=base)
        return plan_items(files, pairing, base_dir=base)

    def preview_batch(source, uploaded, folder, pairing, manifest, presenter=NO_PRESENTER):
        """The items Start would queue, before anything runs: which face speaks which audio (or text)."""
        if (source == "upload" and not uploaded) or (source == "folder" and not (folder or "").strip()):
            return pd.DataFrame(columns=BATCH_COLUMNS), "Items and their progress show here."
        try:
            items = plan_batch(source, uploaded, folder, pairing, manifest, presenter)
        except HeygemError as error:
            return pd.DataFrame(columns=BATCH_COLUMNS), f"**Nothing to start yet:** {error}"
        return preview_table(items, presenters)

    def start_batch(request: gr.Request, source, uploaded, folder, pairing, manifest, presenter, *controls):
        try:
            items = plan_batch(source, uploaded, folder, pairing, manifest, presenter)
        except HeygemError as error:
            gr.Warning(str(error))
            return (gr.update(), gr.update(), f"**Nothing started:** {error}", gr.update(),
                    gr.Timer(active=False))
        batch, outcome = queue_batch(store, items, options_from_controls(*controls), access.submitter(request))
        state = {"batch": batch, "items": [
            {"name": item.name, "face": face_label(item, presenters),
             "audio": item.speech_label, "note": item.note,
             "job": outcome[item.name] if isinstance(outcome[item.name], str) else None,
             "error": None if isinstance(outcome[item.name], str) else error_text(outcome[item.name])}
            for item in items]}
        state["not_queued"] = [BatchResult(item, FAILED, error=error_text(outcome[item.name])) for item in items
                               if not isinstance(outcome[item.name], str)]
        table, summary, finished = batch_table(store, state)
        return state, table, summary, gr.update(visible=False, value=None), gr.Timer(active=not finished)

    def item_detail(job_id, request: gr.Request, note: str = ""):
        """The picked item's job card and video (only a job this user may see)."""
        job = access.find(job_id, request)
        if job is None:
            return (f"<div class='empty-card'>{html.escape(note)}</div>" if note else NO_ITEM), \
                gr.update(visible=False, value=None)
        video = access.deliver(job) if job.status == DONE else None
        return job_card(job), gr.update(visible=video is not None, value=video)

    def pick_item(table: pd.DataFrame, event: gr.SelectData, request: gr.Request):
        row = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
        if row is None or row >= len(table):
            return "", NO_ITEM, gr.update(visible=False, value=None)
        job_id, note = str(table["job"].iloc[row] or ""), str(table["stage / error"].iloc[row] or "")
        name = str(table["item"].iloc[row])
        return job_id, *item_detail(job_id, request, f"{name}: {note}" if note else f"{name}: not started yet")

    zipped: dict[str, str | None] = {}  # batch id -> its zip as the page serves it

    def refresh_batch(state, picked, shown_card, request: gr.Request):
        if not state:
            return gr.update(), gr.update(), gr.update(), gr.Timer(active=False), gr.update(), gr.update()
        table, summary, finished = batch_table(store, state)
        download = gr.update(visible=False)
        if finished:
            if state["batch"] not in zipped:  # made once: a tick still on its way must not replace the download
                archive = zip_results(store, state["batch"], state.get("not_queued", []))
                zipped[state["batch"]] = access.deliver_file(archive, archive.name) if archive else None
            served = zipped[state["batch"]]
            download = gr.update(visible=served is not None, value=served)
        card, video = gr.update(), gr.update()
        job = access.find(picked, request) if picked else None
        if job is not None and job_card(job) != shown_card:  # the picked item's card stays live
            card, video = item_detail(picked, request)
        return table, summary, download, gr.Timer(active=not finished), card, video

    with gr.Tab("Batch", id="batch"):
        batch_state = gr.State(None)
        picked_job = gr.State("")
        batch_timer = gr.Timer(1.5, active=False)
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=280):
                source = gr.Radio([("Upload files", "upload"), ("A folder on the server", "folder")],
                                  value="upload", label="Inputs", visible=bool(batch_roots))  # --batch-root only
                uploaded = gr.File(file_count="multiple", label="Faces and audio files (or .txt files to speak)",
                                   file_types=["video", "image", "audio", ".txt"], elem_id="batch-files")
                roots_text = ", ".join(f"`{root}`" for root in batch_roots) or \
                    "none (start the app with --batch-root DIR)"
                folder = gr.Textbox(label="Folder on the server", visible=False,
                                    placeholder=str(batch_roots[0]) if batch_roots else "",
                                    info=f"must be inside: {roots_text}".replace("`", ""))
                pairing = gr.Radio(
                    [("Same name: anna.mp4 + anna.wav (or anna.txt)", "stem"), ("Every face with every audio", "cross"),
                     ("A CSV manifest", "manifest")], value="stem", label="Pairing")
                manifest = gr.File(label="Manifest CSV: face (or presenter),audio[,text][,name][,options]",
                                   file_types=[".csv"], visible=False, height=90)
                presenter = gr.Dropdown([(say("presenter.none"), NO_PRESENTER)], value=NO_PRESENTER,
                                        label="Or a saved presenter speaks every audio and text file",
                                        elem_id="batch-presenter")
            with gr.Column(scale=2):
                batch_summary = gr.Markdown("Items and their progress show here.", elem_id="batch-summary")
                batch_items = gr.Dataframe(pd.DataFrame(columns=BATCH_COLUMNS), interactive=False, wrap=True,
                                           max_height=480, elem_id="batch-table", elem_classes=["heygem-table"],
                                           column_widths=["11%", "11%", "12%", "10%", "11%", "23%", "10%", "12%"])
                batch_zip = gr.DownloadButton("Download the results (.zip)", visible=False, elem_id="batch-zip")
                with gr.Row(equal_height=False):
                    item_card = gr.HTML(NO_ITEM, elem_id="batch-item-card")
                    item_video = gr.Video(label="The item's result", interactive=False, visible=False, height=260,
                                          elem_id="batch-item-video")
        batch_controls = option_controls(store, prefix="batch-")  # the whole width: the options need room
        start = gr.Button("Start batch", variant="primary", elem_id="batch-start")
        source.change(lambda choice: (gr.update(visible=choice == "upload"), gr.update(visible=choice == "folder")),
                      source, [uploaded, folder], queue=False, api_visibility="private")
        pairing.change(lambda choice: gr.update(visible=choice == "manifest"), pairing, manifest, queue=False,
                       api_visibility="private")
        planning = [source, uploaded, folder, pairing, manifest, presenter]

        def offer_presenters(chosen, request: gr.Request):
            return picker_update(presenters, access, chosen, request)

        presenter.focus(offer_presenters, presenter, presenter, queue=False, show_progress="hidden",
                        api_visibility="private")
        for control in (uploaded, pairing, manifest, presenter):
            control.change(preview_batch, planning, [batch_items, batch_summary], show_progress="hidden",
                           api_visibility="private")
        folder.submit(preview_batch, planning, [batch_items, batch_summary], api_visibility="private")
        start.click(start_batch, [*planning, *batch_controls],
                    [batch_state, batch_items, batch_summary, batch_zip, batch_timer],
                    concurrency_limit=2, api_visibility="private")
        batch_items.select(pick_item, batch_items, [picked_job, item_card, item_video], api_visibility="private")
        batch_timer.tick(refresh_batch, [batch_state, picked_job, item_card],
                         [batch_items, batch_summary, batch_zip, batch_timer, item_card, item_video],
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
