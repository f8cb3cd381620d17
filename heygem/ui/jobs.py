"""The Jobs tab: every job in the store in a filtered, self-refreshing table; the selected one's card,
log, chart and video; cancel, retry, delete.
"""

from __future__ import annotations

import gradio as gr
import pandas as pd

from heygem.errors import HeygemError
from heygem.jobs.store import DONE, RUNNING, JobStore
from heygem.ui.common import JOB_COLUMNS, STATUS_LABELS, chart_update, format_time, job_card
from heygem.ui.live import job_stream, live_player


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
            with gr.Column():
                selected_live = live_player("jobs-live-stream")  # a running job's stream
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
        selected.change(lambda job_id: job_stream(store, job_id), selected, selected_live, show_progress="hidden",
                        api_visibility="private")
        for button, action in ((cancel_job, "cancel"), (retry_job, "retry"), (delete_job, "delete")):
            button.click(lambda job_id, shown, action=action: job_action(action, job_id, shown),
                         [selected, status_filter], [jobs, jobs_summary, selected, *detail],
                         api_visibility="private")
