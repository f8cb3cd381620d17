"""How soon a job made from text can be watched: from the HTTP submission to its first streamed segment.

    python bench/bench_text_latency.py [--runs 3] [--repeat 6] [--height 360] [--trees TREE ...]

For each tree (a checkout of heygem; default this one), starts its ``python app.py`` on a free port,
runs one text job to warm it up, then ``--runs`` jobs of the bundled portrait speaking a script (a
paragraph said ``--repeat`` times), landmark engine, and measures from just before the POST: the
POST's answer (accepted), the first time GET /api/jobs/{id}/stream.m3u8 answers 200 (first segment
listed), and the job done. With several trees the runs alternate between them, one server each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

FACE = REPO / "assets" / "astronaut.jpg"
PARAGRAPH = ("Welcome to the weekly update. Our team shipped the new streaming player this week. "
             "It starts playing as soon as the first second of video is ready. ")


def one_job(server, text: str, height: int) -> dict:
    from bench_latency import follow

    files = {"face": (FACE.name, FACE.read_bytes())}
    options = {"engine.name": "landmark", "media.output_height": height}
    started = time.perf_counter()
    response = server.client.post("/api/jobs", files=files, data={"text": text, "options": json.dumps(options)})
    response.raise_for_status()
    return follow(server, response.json()["id"], started, time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=6, help="times the paragraph is said (6: about 60 s)")
    parser.add_argument("--height", type=int, default=360)
    parser.add_argument("--trees", type=Path, nargs="+", default=[REPO])
    args = parser.parse_args()

    from faults import Server

    text = PARAGRAPH * args.repeat
    results: dict[Path, list[dict]] = {tree: [] for tree in args.trees}
    with tempfile.TemporaryDirectory(prefix="heygem-text-latency-") as folder_name:
        servers = {}
        try:
            for number, tree in enumerate(args.trees):
                folder = Path(folder_name) / str(number)
                folder.mkdir()
                servers[tree] = Server(folder / "outputs", folder / "app.log", cwd=tree.resolve()).wait_ready()
                one_job(servers[tree], PARAGRAPH, args.height)  # warm-up
            for _ in range(args.runs):
                for tree in args.trees:
                    results[tree].append(one_job(servers[tree], text, args.height))
        finally:
            for server in servers.values():
                server.stop()
    print(f"a script of {len(text)} characters ({args.repeat} x the paragraph), the portrait, landmark engine, "
          f"{args.height}p, median of {args.runs} (each run):\n")
    print("| tree | accepted (s) | first segment listed (s) | job done (s) |\n|---|---|---|---|")
    for tree, runs in results.items():
        cells = []
        for key in ("accepted", "first", "done"):
            values = [run[key] for run in runs]
            cells.append(f"{statistics.median(values):.2f} ({', '.join(f'{value:.2f}' for value in values)})")
        print(f"| {tree.name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
