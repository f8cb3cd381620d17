"""bench/faults.py --quick against a live app: a kill -9 and restart under submissions, bad uploads, hostile and
careless requests (one row per case of docs/reliability.md), and (as root, on a tmpfs) a full disk. Nothing
accepted may be lost or run twice; nothing invalid may be queued."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def test_the_quick_fault_run_loses_and_duplicates_nothing(tmp_path):
    report_path = tmp_path / "faults.json"
    parts = ["load", "uploads", "requests"] + (["disk"] if os.getuid() == 0 else [])  # disk needs a tmpfs mount
    finished = subprocess.run([sys.executable, "bench/faults.py", "--quick", "--parts", *parts,
                               "--json", str(report_path)], cwd=REPO, capture_output=True, text=True, timeout=300,
                              check=False)
    assert report_path.is_file(), finished.stdout + finished.stderr
    report = json.loads(report_path.read_text(encoding="utf-8"))
    load = report["load"]
    assert load["kills"] == 1 and load["submitted"] == 8
    assert load["accepted"] >= 4 and load["accepted"] + load["refused"] + load["unanswered"] == load["submitted"]
    assert load["lost"] == 0 and load["duplicated"] == 0, load
    assert load["done"] == load["accepted"] and load["results_good"] == load["done"], load
    assert load["rerun_after_kill"] >= 1, load  # the kill hit a running job, which ran again from the start
    rows = {row["fault"]: row for row in report["rows"]}
    uploads = [row for name, row in rows.items() if "name" in name or "MP4" in name or "extension" in name]
    assert len(uploads) >= 10 and all(row["outcome"].startswith("HTTP 400") for row in uploads), uploads
    if "disk" in parts and report["disk_method"].startswith("a 24 MB tmpfs"):  # else mounting was not allowed
        assert sum(row["outcome"].startswith("HTTP 507") for row in report["rows"]) == 2
    numbered = {row["fault"].split(".", 1)[0] for row in report["rows"] if row["fault"][:2].rstrip(".").isdigit()}
    assert numbered >= {"1", "2", "3", "4", "5", "6", "7", "8", "10", "11"}, numbered  # every case of the probe
    failed = [row for row in report["rows"] if not row["passed"]]
    assert not failed, failed
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
