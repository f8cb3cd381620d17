"""The web page (Gradio Blocks), one module per tab; the only package that imports gradio. ``python app.py``
serves it with the REST API (heygem.jobs.api) beside it, and everything it does goes through the job
store (heygem.jobs), so a job started here shows up in the REST API and ``python -m heygem jobs list``.
"""

from __future__ import annotations

import os
from pathlib import Path

# Unless told not to, Gradio checks for a newer version (api.gradio.app) and reports usage (huggingface.co)
# when a page is built and launched; nothing of heygem reaches the network, so both are off before it loads.
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

import gradio as gr  # noqa: E402 - after the switches above

from heygem import __version__  # noqa: E402
from heygem.jobs.store import JobStore
from heygem.live.sessions import LiveSettings
from heygem.presenters.api import Preparer
from heygem.presenters.records import PresenterStore
from heygem.ui.access import PageAccess
from heygem.ui.batch import BATCH_CSS, batch_tab
from heygem.ui.client_api import client_api
from heygem.ui.common import CSS, PAGE_SCRIPT, page_i18n, ui_text
from heygem.ui.generate import generate_tab
from heygem.ui.jobs import JOBS_CSS, jobs_tab
from heygem.ui.live_tab import LIVE_CSS, LIVE_SCRIPT, live_tab
from heygem.ui.presenters import PRESENTERS_CSS, presenters_tab
from heygem.ui.system import system_tab
from heygem.ui.timeline import TIMELINE_CSS


def build_ui(store: JobStore, batch_roots: list[Path], access: PageAccess | None = None,
             presenters: PresenterStore | None = None, preparer: Preparer | None = None,
             live: LiveSettings | None = None) -> gr.Blocks:
    """The Blocks app: Generate, Presenters, Batch, Jobs, Live and System tabs over ``store``; ``access``: who sees
    which jobs (default: a server for one person, who sees every job); ``presenters`` and ``preparer``: the
    saved presenters and what prepares new ones, shared with the REST API (default: the store's folder's,
    and a preparer of the page's own); ``live``: the live settings the REST API's routes were given (the
    Live tab's tickets are theirs to check)."""
    access = access if access is not None else PageAccess(store)
    presenters = presenters if presenters is not None else PresenterStore(store.outputs_dir)
    preparer = preparer if preparer is not None else Preparer(presenters, store.base_config)
    with gr.Blocks(title="heygem", delete_cache=(3600, 86400)) as demo:  # Gradio's copies of files: a day
        gr.Markdown("# heygem")
        gr.Markdown(ui_text("intro"))
        gr.Markdown(f"<small>v{__version__} · REST API under `/api/jobs`</small>")
        with gr.Tabs():
            generate_tab(store, access, presenters)
            presenters_tab(presenters, preparer, access)
            batch_tab(store, batch_roots, access, presenters)
            jobs_tab(store, access)
            live_tab(store, access, presenters, live)
            system_tab(access)
        client_api(store, access, presenters, preparer)
    return demo


def page_style() -> dict:
    """The page's theme, CSS, script and words in English and Chinese, as launch() takes them."""
    return {"theme": gr.themes.Soft(), "css": CSS + JOBS_CSS + BATCH_CSS + TIMELINE_CSS + PRESENTERS_CSS + LIVE_CSS,
            "head": PAGE_SCRIPT + LIVE_SCRIPT, "i18n": page_i18n()}
