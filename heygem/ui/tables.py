"""The page's tables on a phone: only the columns that matter there, their headers and cells equally wide."""

from __future__ import annotations


def narrow_columns_css(table_id: str, shown: dict[int, float], below_px: int = 600) -> str:
    """CSS for screens under ``below_px``: the table ``table_id`` (an elem_id) shows only the columns in
    ``shown`` (1-based column -> share of the width), every other one left out."""
    table = f"#{table_id}"
    rules = [f"{table} [aria-colindex] {{display: none !important;}}",
             f"{table} th, {table} [role=gridcell] {{font-size: 0.8em; padding-left: 4px !important; "
             "padding-right: 2px !important;}", f"{table} [role=gridcell] .cell-wrap {{padding: 4px 2px !important;}}",
             f"{table} [role=gridcell] button {{display: none !important;}}",  # the picked cell's menu: no room
             f"{table} [role=gridcell].cell-selected .cell-wrap {{width: 100% !important; box-sizing: border-box;}}",
             f"{table} [role=gridcell].cell-selected .cell-wrap > span {{position: static !important; "
             "width: auto !important;}"]
    for column, share in shown.items():
        width = f"calc((100vw - 66px) * {share})"  # the page's margins taken out
        rules.append(f'{table} [aria-colindex="{column}"] {{display: revert !important; width: {width} !important; '
                     f'min-width: {width} !important; max-width: {width} !important; flex: 0 0 {width} !important;}}')
        rules.append(f'{table} [role=gridcell][aria-colindex="{column}"] {{display: flex !important;}}')
    return f"@media (max-width: {below_px}px) {{\n  " + "\n  ".join(rules) + "\n}\n"
