"""bench/faults.py --quick against a live app: a kill -9 and restart under submissions, bad uploads, hostile and
careless requests and the page's rough edges (rows for every case of docs/reliability.md), a server shared by
users, and (as root, on a tmpfs) a full disk. Nothing accepted may be lost or run twice; nothing invalid may be
queued; no user may reach another's job."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def test_the_quick_fault_run_loses_and_duplicates_nothing(tmp_path):
    report_path = tmp_path / "faults.json"
    parts = ["load", "uploads", "requests", "users", "probe2"] + (["disk"] if os.getuid() == 0 else [])  # disk: tmpfs
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
    uploads = [row for name, row in rows.items() if not name[:1].isdigit()  # the probe's rows are numbered
               and ("name" in name or "MP4" in name or "extension" in name)]
    assert len(uploads) >= 10 and all(row["outcome"].startswith("HTTP 400") for row in uploads), uploads
    if "disk" in parts and report["disk_method"].startswith("a 24 MB tmpfs"):  # else mounting was not allowed
        assert sum(row["outcome"].startswith("HTTP 507") for row in report["rows"]) == 2
    numbered = {row["fault"].split(".", 1)[0] for row in report["rows"] if row["fault"][:2].rstrip(".").isdigit()}
    assert numbered >= {str(case) for case in range(1, 13)}, numbered  # every case of the probe
    second = {row["fault"].split(".", 1)[0] for row in report["rows"] if row["fault"].startswith("B")}
    assert second >= {f"B{case}" for case in (4, 5, 6, 8, 10, 12, 13, 14, 16, 19, 20, 21, 22)}, second
    users = [name for name in rows if name.startswith("9. ")]
    for words in ("without credentials", "carol's GET /api/jobs/<bob's job>", "carol's DELETE", "/result", "/log",
                  "the admin's GET", "job JSON", "/gradio_api/file=", "bob's DELETE",
                  "jobs delete", "--users FILE with a line", "/job_status"):
        assert any(words in name for name in users), (words, users)
    assert "9. carol's GET /api/jobs" in rows  # her listing holds none of bob's
    page = [name for name in rows if name.startswith("12. ")]
    assert len(page) == 10 and all("test_" in rows[name]["expected"] for name in page), page  # each names its test
    failed = [row for row in report["rows"] if not row["passed"]]
    assert not failed, failed
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
