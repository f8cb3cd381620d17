"""bench/bench_live.py: its clients run in processes of their own, so the server's process (whose threads it
reports) holds only the server's work."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from bench_live import clients_per_process, thread_cpu_seconds, thread_kind, threads_by_kind

pytest.importorskip("aiortc")

REPO = Path(__file__).resolve().parent.parent


def test_sessions_are_split_evenly_over_at_most_one_process_each():
    assert clients_per_process(5, 2) == [3, 2]
    assert clients_per_process(2, 8) == [1, 1]
    assert clients_per_process(8, 8) == [1] * 8
    assert clients_per_process(1, 1) == [1]


def test_server_threads_are_grouped_by_kind_with_the_cpu_they_ran():
    assert thread_kind("heygem-live-a8ee54_0") == "session render"
    assert thread_kind("asyncio_12") == thread_kind("asyncio_3") == "asyncio_N"
    assert thread_kind("native 4242") == "outside Python"
    assert thread_kind("Thread-3 (run)") == "Thread-N (run)"
    assert thread_kind("heygem-live-wav2lip") == "heygem-live-wav2lip"  # a shared engine's thread

    before = thread_cpu_seconds()
    spun, finish = threading.Event(), threading.Event()

    def spin():  # runs until it has used 0.05 CPU seconds (however busy the machine), then stays alive
        me = threading.get_native_id()
        while thread_cpu_seconds().get(me, 0.0) < 0.05:
            sum(range(10_000))
        spun.set()
        finish.wait()

    spinner = threading.Thread(target=spin, name="spinner-7")
    spinner.start()
    spun.wait()
    kinds = {kind: (count, cores) for kind, count, cores in threads_by_kind(before, thread_cpu_seconds(), 0.5)}
    finish.set()
    spinner.join()
    assert kinds["spinner-N"][0] == 1 and kinds["spinner-N"][1] >= 0.05 / 0.5


def test_the_bench_serves_from_its_process_and_runs_each_client_in_another():
    command = [sys.executable, str(REPO / "bench" / "bench_live.py"), "--sessions", "2", "--seconds", "3",
               "--runs", "1"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "clients in 2 other process(es)," in lines[0] and lines[0].endswith("median of 2:")
    cells = [float(cell) for cell in lines[3].strip("|").split("|")]
    first_frame, fps = cells[0], cells[1]
    assert 0 < first_frame < 5 and fps > 1, "both sessions' frames came back to the client processes"
    server = next(line for line in lines if line.startswith("server process mid-run:"))
    assert "session render x2" in server, "the two sessions render in the server's process"
    assert "video-decoder" not in server, "no client decodes video in the server's process"
    rendered, render_ms = re.search(r"session frames: (\d+) rendered, ([\d.]+) ms each", server).groups()
    assert int(rendered) > 10 and float(render_ms) > 0, "the sessions' frames were timed as they were rendered"
    assert re.search(r"(\d+) skipped;", server), "the frames the pacers skipped are counted"
