"""The System tab: what ``python -m heygem doctor`` reports, the weights folder as ``python -m heygem
weights list`` shows it, and the GPU benchmark on request (offered only on a machine with a CUDA GPU).
On a server with ``--users`` the machine's report (its folders, packages and devices) is for admins.
"""

from __future__ import annotations

import gradio as gr
import pandas as pd

from heygem.doctor import benchmark_markdown, format_markdown, run_checks
from heygem.runtime.benchmark import run_benchmark
from heygem.runtime.device import gpu_present
from heygem.ui.access import PageAccess
from heygem.weights import weights_dir

WEIGHTS_COLUMNS = ["name", "state", "for", "file", "enables"]
FOR_ADMINS = "The machine's report is shown to the admins of this server."


def weights_frame() -> pd.DataFrame:
    """What `python -m heygem weights list` reports: one row per recognised file."""
    from heygem.weights import check_weights, describe_path, load_registry

    folder = weights_dir()
    rows = [(state.entry.name, state.state, state.entry.purpose, describe_path(state.path), state.entry.enables)
            for state in (check_weights(entry, folder) for entry in load_registry())]
    return pd.DataFrame(rows, columns=WEIGHTS_COLUMNS)


def system_markdown() -> str:
    """The doctor's checks (heygem.doctor) as Markdown, without the GPU benchmark."""
    return format_markdown(run_checks(benchmark=False))


def benchmark_markdown_now() -> str:
    """Run the doctor's GPU micro-benchmark (seconds) in a process of its own, so the jobs here keep cuDNN."""
    return benchmark_markdown(run_benchmark(separate_process=True))


def system_tab(access: PageAccess | None = None) -> None:
    """What `python -m heygem doctor` reports, checked when the tab opens; the GPU benchmark on request."""

    def for_admins(request) -> bool:
        return access is None or access.sees_all(request)

    def report(request: gr.Request):
        if not for_admins(request):
            return FOR_ADMINS, "", pd.DataFrame(columns=WEIGHTS_COLUMNS)
        note = (f"Network weights in `{weights_dir()}`, as `python -m heygem weights list` reports them "
                "(`python -m heygem weights download NAME` fetches one):")
        return system_markdown(), note, weights_frame()

    def benchmark_now(request: gr.Request) -> str:
        return benchmark_markdown_now() if for_admins(request) else FOR_ADMINS

    with gr.Tab("System", id="system") as tab:
        gr.Markdown("The same checks as `python -m heygem doctor` on the machine that serves this page.")
        report_text = gr.Markdown("Loading…", elem_id="system-report")
        weights_note = gr.Markdown()
        weights = gr.Dataframe(headers=WEIGHTS_COLUMNS, interactive=False,
                               elem_id="system-weights", elem_classes=["heygem-table"], wrap=True,
                               column_widths=["12%", "14%", "9%", "25%", "40%"])
        system_refresh = gr.Button("Check again")
        gpu = gpu_present()  # the benchmark has nothing to measure otherwise
        gr.Markdown("The GPU benchmark runs the Wav2Lip generator for a few seconds with cuDNN on and off "
                    "(jobs running on the same GPU slow it down)." if gpu else
                    "No CUDA GPU here, so there is no GPU benchmark to run.", elem_id="benchmark-note")
        benchmark_button = gr.Button("Run the GPU benchmark", elem_id="benchmark-button", visible=gpu)
        benchmark = gr.Markdown(elem_id="system-benchmark")
        for trigger in (tab.select, system_refresh.click):
            trigger(report, None, [report_text, weights_note, weights], api_visibility="private")
        benchmark_button.click(benchmark_now, None, benchmark, concurrency_limit=1, api_visibility="private")
