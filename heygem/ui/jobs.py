"""The Jobs tab: the signed-in user's jobs (an admin's: every job) in a filtered, self-refreshing table;
the selected one's card, log, chart, video and download; cancel, retry, and delete after a confirmation.
"""

from __future__ import annotations

import gradio as gr
import pandas as pd

from heygem.errors import HeygemError
from heygem.jobs.api import server_folders
from heygem.jobs.store import DONE, RUNNING, JobStore
from heygem.jobs.users import log_for
from heygem.ui.access import PageAccess
from heygem.ui.common import JOB_COLUMNS, STATUS_LABELS, chart_update, format_time, job_card
from heygem.ui.live import follow_stream, live_player

NO_JOB = "<div class='empty-card'>Pick a job in the table.</div>"


def jobs_tab(store: JobStore, access: PageAccess) -> None:
    """The user's jobs: a filtered, self-refreshing table; cancel, retry or delete the selected one."""
    columns = JOB_COLUMNS + (["user"] if access.users is not None else [])

    def jobs_table(status_filter, request: gr.Request):
        jobs = access.jobs(request, status=None if status_filter == "all" else status_filter, limit=500)
        rows = []
        for job in jobs:
            status = STATUS_LABELS.get(job.status, job.status)
            if job.status == "queued":
                status += f" ({job.jobs_ahead + 1})"
            elif job.status == RUNNING:
                status += f" {job.progress:.0%}"
            row = [job.id, status, job.error or job.stage, job.engine, format_time(job.created),
                   f"{job.seconds:.1f}" if job.seconds else "", job.face_name,
                   job.audio_name or "(video's own audio)"]
            rows.append(row + ([job.submitter or "(none)"] if access.users is not None else []))
        summary = " · ".join(f"{count} {status}" for status, count in access.counts(request).items())
        return pd.DataFrame(rows, columns=columns), summary

    def refresh_jobs(status_filter, shown: pd.DataFrame, request: gr.Request):
        """The timer's refresh: leave the table alone (selection, scrolling) when nothing changed."""
        table, summary = jobs_table(status_filter, request)
        if shown is not None and table.astype(str).equals(shown.astype(str)):
            return gr.update(), summary
        return table, summary

    def select_job(table: pd.DataFrame, event: gr.SelectData, request: gr.Request):
        row = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
        job_id = str(table.iloc[row, 0]) if row is not None and row < len(table) else ""
        return job_id, *show_job(job_id, request)

    def show_job(job_id, request: gr.Request):
        job = access.find(job_id, request)
        if job is None:
            return NO_JOB, None, gr.update(visible=False), "", gr.update(visible=False, value=None)
        log = job.log_path.read_text(encoding="utf-8", errors="replace") if job.log_path.is_file() else ""
        log = log_for(access.user(request), log, server_folders(store, job))[-6000:]
        video = access.deliver(job) if job.status == DONE else None
        return job_card(job), video, chart_update(job), log, gr.update(visible=video is not None, value=video)

    picked: dict[str, str] = {}  # page (Gradio session) -> the job its live player streams
    stream_picked = follow_stream(access, followed=lambda request, job_id: picked.get(
        request.session_hash or "") == job_id)

    def pick_stream(job_id, request: gr.Request):
        """The picked job is the one to stream: the stream of the job picked before ends."""
        picked[request.session_hash or ""] = job_id

    async def stream_of(job_id, request: gr.Request):
        """The picked job's stream while it runs (only a job this user may see)."""
        pick_stream(job_id, request)
        try:
            async for update in stream_picked(job_id, request):
                yield update
        finally:
            if picked.get(request.session_hash or "") == job_id:
                picked.pop(request.session_hash or "", None)

    def job_action(action, job_id, status_filter, request):
        job = access.find(job_id, request)
        try:
            if job is None:
                raise HeygemError("Pick a job in the table first." if not (job_id or "").strip()
                                  else f"There is no job {job_id.strip()!r}.")
            job_id = job.id
            if action == "cancel":
                store.cancel(job_id)
                message = f"Cancel requested for {job_id}."
            elif action == "retry":
                store.retry(job_id)
                message = f"{job_id} is queued again."
            else:
                store.delete(job_id)
                access.forget(job_id)
                message = f"{job_id} deleted."
                job_id = ""
        except HeygemError as error:
            gr.Warning(str(error))
            return (gr.update(),) * 8
        gr.Info(message)
        table, summary = jobs_table(status_filter, request)
        return table, summary, job_id, *show_job(job_id, request)

    def cancel_selected(job_id, status_filter, request: gr.Request):
        return job_action("cancel", job_id, status_filter, request)

    def retry_selected(job_id, status_filter, request: gr.Request):
        return job_action("retry", job_id, status_filter, request)

    def delete_selected(job_id, status_filter, request: gr.Request):
        return (*job_action("delete", job_id, status_filter, request), gr.update(visible=False))

    def ask_to_delete(job_id, request: gr.Request):
        """Delete asks first: the job's name in a confirmation row, or a warning when none is picked."""
        job = access.find(job_id, request)
        if job is None:
            gr.Warning("Pick a job in the table first.")
            return gr.update(visible=False), gr.update()
        what = f"the job {job.id}" + (f" ({job.face_name} + {job.audio_name})" if job.audio_name else "")
        return (gr.update(visible=True),
                f"**Delete {what} and all its files?** This cannot be undone.")

    with gr.Tab("Jobs", id="jobs") as tab:
        with gr.Row(equal_height=True):
            status_filter = gr.Dropdown(["all", "queued", "running", "done", "failed", "cancelled"],
                                        value="all", label="Show", scale=2, min_width=160)
            auto_refresh = gr.Checkbox(value=True, label="Refresh every 3 s", scale=1, min_width=160)
            refresh = gr.Button("Refresh now", scale=1, min_width=120, size="md")
        jobs_summary = gr.Markdown()
        jobs_timer = gr.Timer(3.0, active=False)
        widths = ["20%", "9%", "15%", "9%", "11%", "8%", "14%", "14%"]
        if access.users is not None:
            widths = ["19%", "9%", "13%", "8%", "11%", "8%", "12%", "12%", "8%"]
        jobs = gr.Dataframe(pd.DataFrame(columns=columns), interactive=False, wrap=True, max_height=420,
                            elem_id="jobs-table", elem_classes=["heygem-table"], column_widths=widths)
        with gr.Row():
            selected = gr.Textbox(label="Selected job", placeholder="click a row", scale=3, elem_id="selected-job")
            cancel_job = gr.Button("Cancel", variant="stop", scale=1, elem_id="cancel-job")
            retry_job = gr.Button("Retry", scale=1, elem_id="retry-job")
            delete_job = gr.Button("Delete", scale=1, elem_id="delete-job")
        with gr.Row(visible=False, elem_id="confirm-delete", elem_classes=["confirm-delete"]) as confirm_row:
            confirm_text = gr.Markdown(scale=3)
            confirm_delete = gr.Button("Delete for good", variant="stop", scale=1, elem_id="confirm-delete-button")
            keep_job = gr.Button("Keep it", scale=1, elem_id="keep-job-button")
        with gr.Row(equal_height=False):
            with gr.Column():
                selected_card = gr.HTML(NO_JOB, elem_id="selected-card")
                selected_chart = gr.BarPlot(x="stage", y="seconds", visible=False, height=260, sort=None,
                                            x_label_angle=-35, x_title="", label="Seconds per stage")
                selected_log = gr.Textbox(label="job.log", lines=8, max_lines=16, interactive=False)
            with gr.Column():
                selected_live = live_player("jobs-live-stream")  # a running job's stream
                selected_video = gr.Video(label="Result", interactive=False, elem_id="selected-video")
                selected_download = gr.DownloadButton("Download MP4", visible=False, elem_id="selected-download")
        detail = [selected_card, selected_video, selected_chart, selected_log, selected_download]
        for trigger in (tab.select, refresh.click, status_filter.change):
            trigger(jobs_table, status_filter, [jobs, jobs_summary], show_progress="hidden",
                    api_visibility="private")
        tab.select(lambda on: gr.Timer(active=on), auto_refresh, jobs_timer, api_visibility="private")
        auto_refresh.change(lambda on: gr.Timer(active=on), auto_refresh, jobs_timer, api_visibility="private")
        jobs_timer.tick(refresh_jobs, [status_filter, jobs], [jobs, jobs_summary], show_progress="hidden",
                        concurrency_limit=None, api_visibility="private")
        jobs.select(select_job, jobs, [selected, *detail], api_visibility="private")
        selected.submit(show_job, selected, detail, api_visibility="private")
        selected.change(lambda: gr.update(visible=False), None, confirm_row, queue=False, api_visibility="private")
        outputs = [jobs, jobs_summary, selected, *detail]
        cancel_job.click(cancel_selected, [selected, status_filter], outputs, api_visibility="private")
        retry_job.click(retry_selected, [selected, status_filter], outputs, api_visibility="private")
        delete_job.click(ask_to_delete, selected, [confirm_row, confirm_text], api_visibility="private")
        keep_job.click(lambda: gr.update(visible=False), None, confirm_row, queue=False, api_visibility="private")
        confirm_delete.click(delete_selected, [selected, status_filter], [*outputs, confirm_row],
                             api_visibility="private")
        # A running job's stream plays while it is the picked one (only a job this user may see).
        selected.change(pick_stream, selected, None, queue=False, api_visibility="private")
        selected.change(stream_of, selected, selected_live, concurrency_limit=None, show_progress="hidden",
                        api_visibility="private", trigger_mode="always_last")
