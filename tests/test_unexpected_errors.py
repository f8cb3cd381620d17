"""A bug of ours reaches the user as one line naming a log file with its traceback, exit status 1."""

from __future__ import annotations

import re
from pathlib import Path

from heygem import cli


def test_an_unexpected_error_is_one_line_and_its_traceback_goes_to_a_log(tmp_path, monkeypatch, capsys):
    def broken(args):
        raise ValueError("runs must come in order")

    monkeypatch.setattr(cli, "run_voices", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    assert cli.main(["voices"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith("error: unexpected error (ValueError: runs must come in order)")
    log = Path(re.search(r"details are in (\S+)$", lines[0]).group(1))
    assert log.parent == tmp_path and "Traceback" in log.read_text() and "broken" in log.read_text()
