"""A finished job's stages on one time line: when each stage was busy, in words a user knows ("finding
faces", "drawing mouths", "encoding"). Stages run at the same time (decoding, face finding, drawing and
encoding overlap, the networks load in the background), so their seconds are not added up: each gets a
bar from when it first worked to when it last did, over the job's whole run.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

# the summary's stage names (heygem.pipeline.STEPS) as the page shows them
PLAIN_NAMES = {
    "probe": "reading the inputs",
    "audio": "preparing the sound",
    "load_engine": "loading the model",
    "load_restorer": "loading the restorer",
    "decode": "decoding the video",
    "faces": "finding faces",
    "plan": "placing mouths",
    "generate": "drawing mouths",
    "render": "drawing mouths",
    "restore": "restoring mouths",
    "blend": "blending into the frame",
    "paste": "pasting into the frame",
    "encode": "encoding",
}


@dataclass(frozen=True)
class StageBar:
    """One stage on the time line: seconds since the job's run started, and its busy seconds inside that."""

    stage: str  # the summary's name
    name: str  # as the page shows it
    start: float | None  # None: an older summary that kept only seconds per stage
    end: float | None
    busy: float


def plain_name(stage: str) -> str:
    return PLAIN_NAMES.get(stage, stage.replace("_", " "))


def stage_bars(summary: dict | None) -> list[StageBar]:
    """The summary's stages in the order they started (an older summary's in its own order, no times)."""
    summary = summary or {}
    seconds = summary.get("seconds_per_stage") or {}
    spans = summary.get("stage_spans") or {}
    bars = []
    for stage, busy in seconds.items():
        start, end = spans.get(stage, (None, None))
        bars.append(StageBar(stage, plain_name(stage), None if start is None else float(start),
                             None if end is None else float(end), float(busy)))
    if all(bar.start is not None for bar in bars):
        bars.sort(key=lambda bar: (bar.start, bar.end))
    return bars


def timeline_html(summary: dict | None) -> str:
    """The time line as HTML (one row per stage: its name, a bar where it ran, its busy seconds); "" when
    the summary has no stages."""
    bars = stage_bars(summary)
    if not bars:
        return ""
    timed = all(bar.start is not None for bar in bars)
    total = float((summary or {}).get("total_seconds") or 0.0)
    total = max([total] + [bar.end if timed else bar.busy for bar in bars]) or 1.0
    rows = []
    for bar in bars:
        start, end = (bar.start, bar.end) if timed else (0.0, bar.busy)
        left, width = 100 * start / total, max(100 * (end - start) / total, 0.6)
        when = f"from {start:.2f} s to {end:.2f} s, " if timed else ""
        tip = html.escape(f"{bar.name} ({bar.stage}): {when}busy {bar.busy:.2f} s")
        rows.append(f'<div class="stage-row" title="{tip}" data-stage="{html.escape(bar.stage)}">'
                    f'<span class="stage-name">{html.escape(bar.name)}</span>'
                    f'<span class="stage-track"><span class="stage-bar" style="left:{left:.2f}%;width:{width:.2f}%">'
                    f'</span></span><span class="stage-seconds">{bar.busy:.1f} s</span></div>')
    note = ("bars: when each stage worked (they overlap); numbers: its busy seconds" if timed else
            "when each stage ran was not recorded for this job: bars show busy seconds")
    return (f'<div class="stage-timeline"><div class="stage-title">Stages · {total:.1f} s in all</div>'
            f'{"".join(rows)}<div class="stage-row stage-axis"><span class="stage-name"></span>'
            f'<span class="stage-track"><span>0 s</span><span>{total:.1f} s</span></span>'
            f'<span class="stage-seconds"></span></div><div class="stage-note">{note}</div></div>')


TIMELINE_CSS = """
.stage-timeline {font-size: 0.9em; padding: 8px 0;}
.stage-timeline .stage-title {font-weight: 600; margin-bottom: 6px;}
.stage-timeline .stage-row {display: flex; align-items: center; gap: 8px; margin: 3px 0;}
.stage-timeline .stage-name {flex: 0 0 13em; text-align: right; white-space: nowrap; overflow: hidden;
                             text-overflow: ellipsis;}
.stage-timeline .stage-track {flex: 1 1 auto; position: relative; height: 14px; border-radius: 3px;
                              background: var(--neutral-100);}
.dark .stage-timeline .stage-track {background: var(--neutral-800);}
.stage-timeline .stage-bar {position: absolute; top: 0; bottom: 0; border-radius: 3px; background: var(--color-accent);}
.stage-timeline .stage-seconds {flex: 0 0 3.5em; font-variant-numeric: tabular-nums;}
.stage-timeline .stage-axis .stage-track {background: none; display: flex; justify-content: space-between;
                                          height: auto; color: var(--body-text-color-subdued); font-size: 0.85em;}
.stage-timeline .stage-note {color: var(--body-text-color-subdued); font-size: 0.85em; margin-top: 4px;}
@media (max-width: 600px) {.stage-timeline .stage-row {flex-wrap: wrap; row-gap: 0;}
  .stage-timeline .stage-name {flex-basis: 100%; text-align: left;}
  .stage-timeline .stage-axis .stage-name {display: none;}}
"""
