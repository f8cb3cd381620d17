"""Fault tests against a live `python app.py` on 127.0.0.1, each ending in a table row.

Everything runs on 127.0.0.1 with a temporary outputs folder, the landmark
engine and small inputs made from assets/ (a photo and a short piece of speech):

  load    N REST submissions from 8 client threads (2 with --quick); the server
          is killed with SIGKILL once about a third are accepted and a job runs,
          started again on the same outputs folder and port, and the clients go
          on (a client turned away while it is down waits for it before its next
          submission). Every accepted job must
          end done exactly once (job.log says "done in" once), none lost, and
          every result.mp4 must decode to the speech's length.
  ffmpeg  the x264 child of a longer job is killed mid-encode: that job fails
          with a readable message and the next job is done.
  disk    the outputs folder on a small tmpfs (as root; else the server runs
          with RLIMIT_FSIZE and SIGXFSZ ignored): a job whose result cannot be
          written fails with a disk-space message, no partial result is kept or
          marked done, an upload while the disk is full is refused cleanly, the
          server keeps answering, and --min-free-mb refuses jobs with 507.
  uploads truncated, empty, wrong-type and hostile-name uploads: each a 400 with
          a one-line JSON error, no traceback in the answer or the server log,
          nothing queued, nothing written outside the outputs folder.

    python bench/faults.py                                   # the full run (50 submissions)
    python bench/faults.py --quick                           # 8 submissions, shorter jobs
    python bench/faults.py --markdown docs/reliability.md    # also write the tables there
    python bench/faults.py --json faults.json --parts load uploads
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from bench_pipeline import process_table  # noqa: E402 - found through the sys.path entry above

from heygem.media.ffmpeg import ffmpeg_binary  # noqa: E402 - found through the sys.path entry above
from heygem.media.probing import probe  # noqa: E402 - found through the sys.path entry above

ASSETS = REPO / "assets"
FINISHED = ("done", "failed", "cancelled")
OPTIONS = {"media.output_height": 256, "engine.name": "landmark"}
PARTS = ("load", "ffmpeg", "disk", "uploads")


@dataclass
class Row:
    """One fault and how the server took it."""

    fault: str
    expected: str
    outcome: str
    passed: bool


@dataclass
class LoadFigures:
    """What happened to the submissions of the load part."""

    submitted: int = 0
    accepted: int = 0
    refused: int = 0
    refused_why: dict = field(default_factory=dict)
    unanswered: int = 0  # the server died while the request was in flight
    done: int = 0
    failed: int = 0
    lost: int = 0
    duplicated: int = 0
    rerun_after_kill: int = 0  # accepted jobs that were running at the kill and ran again
    created_unanswered: int = 0  # jobs in the store whose answer never reached a client
    results_checked: int = 0
    results_good: int = 0
    kills: int = 0
    restart_seconds: float = 0.0
    seconds: float = 0.0


# ---------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return probe_socket.getsockname()[1]


class Server:
    """`python app.py` on 127.0.0.1 in a child process, its output in a log file."""

    def __init__(self, outputs: Path, log_path: Path, port: int | None = None, extra_args: tuple[str, ...] = (),
                 file_size_limit: int | None = None, env: dict | None = None, drop_env: tuple[str, ...] = ()):
        self.outputs, self.log_path = outputs, log_path
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**{name: value for name, value in os.environ.items() if name not in drop_env},
               "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})}

        def limit_file_size() -> None:  # runs in the child before app.py starts
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

        with open(log_path, "ab") as log:  # preexec_fn only for the file size limit, started with no threads about
            self.process = subprocess.Popen(
                [sys.executable, "app.py", "--host", "127.0.0.1", "--port", str(self.port), "--outputs", str(outputs),
                 *extra_args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                preexec_fn=limit_file_size if file_size_limit else None)
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def wait_ready(self, timeout: float = 120) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the app exited:\n{self.log_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if self.client.get("/api/jobs", params={"limit": 1}).status_code == 200:
                    return self
            time.sleep(0.2)
        raise RuntimeError(f"the app did not start in {timeout} s:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def kill_hard(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def job(self, job_id: str) -> dict:
        return self.client.get(f"/api/jobs/{job_id}").json()

    def counts(self) -> dict:
        return self.client.get("/api/jobs", params={"limit": 1}).json()["counts"]

    def all_jobs(self) -> list[dict]:
        return self.client.get("/api/jobs", params={"limit": 1000}).json()["jobs"]

    def wait_finished(self, job_ids: list[str], timeout: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        jobs: dict[str, dict] = {}
        while time.monotonic() < deadline:
            listed = {job["id"]: job for job in self.all_jobs()}
            jobs = {job_id: listed.get(job_id) or {"id": job_id, "status": "unknown"} for job_id in job_ids}
            if all(job["status"] in FINISHED or job["status"] == "unknown" for job in jobs.values()):
                break
            time.sleep(0.3)
        return jobs


def multipart(fields: list[tuple[str, bytes | None, bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body built by hand, so file names reach the server byte for byte.

    ``fields``: (name, file name or None for a plain field, content).
    """
    boundary = secrets.token_hex(12)
    parts = []
    for name, file_name, content in fields:
        disposition = f'form-data; name="{name}"'.encode()
        if file_name is not None:
            disposition += b'; filename="' + file_name + b'"'
        parts.append(b"--" + boundary.encode() + b"\r\nContent-Disposition: " + disposition + b"\r\n"
                     + (b"Content-Type: application/octet-stream\r\n" if file_name is not None else b"")
                     + b"\r\n" + content + b"\r\n")
    body = b"".join(parts) + b"--" + boundary.encode() + b"--\r\n"
    return body, f"multipart/form-data; boundary={boundary}"


def submit(client: httpx.Client, face: Path, audio: Path, options: dict | None = None,
           face_name: bytes | None = None, face_bytes: bytes | None = None) -> httpx.Response:
    body, content_type = multipart([
        ("face", face_name or face.name.encode(), face.read_bytes() if face_bytes is None else face_bytes),
        ("audio", audio.name.encode(), audio.read_bytes()),
        ("options", None, json.dumps(options or OPTIONS).encode()),
    ])
    return client.post("/api/jobs", content=body, headers={"content-type": content_type})


# ---------------------------------------------------------------------- inputs


def run_ffmpeg(*args: str) -> None:
    subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-y", *args], check=True)


@dataclass
class Inputs:
    face: Path  # a photo
    short_speech: Path  # a job of ~1-3 s
    long_speech: Path  # a job long enough to be hit mid-encode
    clip: Path  # a small MP4 with sound (for the truncated upload)


def make_inputs(folder: Path, quick: bool) -> Inputs:
    short_speech, long_speech, clip = folder / "short speech.wav", folder / "long speech.wav", folder / "clip.mp4"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "1.0" if quick else "1.2", str(short_speech))
    run_ffmpeg("-stream_loop", "2", "-i", str(ASSETS / "speech_en.wav"), "-t", "16", str(long_speech))
    run_ffmpeg("-loop", "1", "-i", str(ASSETS / "astronaut.jpg"), "-f", "lavfi", "-i", "sine=frequency=300:duration=2",
               "-t", "2", "-vf", "scale=256:256", "-c:v", "libx264", "-pix_fmt", "yuv420p", "-c:a", "aac",
               "-movflags", "+faststart", str(clip))
    return Inputs(ASSETS / "astronaut.jpg", short_speech, long_speech, clip)


def result_is_good(path: Path, seconds: float) -> bool:
    """An MP4 with video and sound, as long as the speech (0.25 s), that ffmpeg decodes without a word."""
    try:
        info = probe(path)
    except Exception:  # noqa: BLE001 - any failure to read it is a bad result
        return False
    if info.kind != "video" or not info.has_audio or abs(info.duration - seconds) > 0.25:
        return False
    decoded = subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-i", str(path), "-f", "null", "-"],
                             capture_output=True, text=True, check=False)
    return decoded.returncode == 0 and not decoded.stderr.strip()


def done_count(outputs: Path, job_id: str) -> int:
    """How many attempts of the job ran to the end, from its job.log (one line per finished attempt)."""
    log = outputs / job_id / "job.log"
    return log.read_text(encoding="utf-8", errors="replace").count(f"job {job_id} done in") if log.is_file() else 0


# ---------------------------------------------------------------------- 1. load with a kill -9


def load_part(work: Path, inputs: Inputs, submissions: int, timeout: float) -> tuple[list[Row], LoadFigures]:
    outputs = work / "load-outputs"
    log_path = work / "load-server.log"
    figures = LoadFigures(submitted=submissions)
    server = Server(outputs, log_path).wait_ready()
    port = server.port
    lock = threading.Lock()
    server_up = threading.Event()
    server_up.set()
    accepted: list[str] = []
    speech_seconds = probe(inputs.short_speech).duration
    started = time.monotonic()

    kill_after = max(1, submissions // 3)
    killed = threading.Event()

    def send(index: int) -> None:
        if index >= kill_after:  # the rest go after the kill: some meet the server down, the others the new one
            killed.wait(180)
        else:
            server_up.wait(180)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        try:
            response = submit(client, inputs.face, inputs.short_speech, face_name=f"face {index}.jpg".encode())
        except httpx.ConnectError:
            why = "connection refused (server down)"
        except httpx.TransportError:
            why = "no answer (server killed mid-request)"
        else:
            if response.status_code == 201:
                with lock:
                    accepted.append(response.json()["id"])
                return
            why = f"HTTP {response.status_code}"
        finally:
            client.close()
        with lock:
            figures.refused_why[why] = figures.refused_why.get(why, 0) + 1
            if why.startswith("no answer"):
                figures.unanswered += 1
            else:
                figures.refused += 1
        server_up.wait(180)  # a client that was turned away waits for the server before its next job

    with ThreadPoolExecutor(min(8, max(2, submissions // 4))) as pool:
        futures = [pool.submit(send, index) for index in range(submissions)]
        while len(accepted) < kill_after and not all(future.done() for future in futures):
            time.sleep(0.02)
        wait_running = time.monotonic() + 10  # kill while a job runs, so one is interrupted mid-way
        while time.monotonic() < wait_running and server.counts()["running"] == 0:
            time.sleep(0.05)
        server_up.clear()
        server.kill_hard()
        killed.set()
        figures.kills = 1
        server.stop()
        restart = time.monotonic()
        server = Server(outputs, log_path, port=port).wait_ready()
        figures.restart_seconds = time.monotonic() - restart
        server_up.set()
        for future in futures:
            future.result()

    try:
        figures.accepted = len(accepted)
        finished = server.wait_finished(accepted, timeout)
        in_store = {job["id"] for job in server.all_jobs()}
        extra = sorted(in_store - set(accepted))  # created, but the answer died with the server
        figures.created_unanswered = len(extra)
        server.wait_finished(extra, timeout)
    finally:
        server.stop()
    for job_id, job in finished.items():
        runs = done_count(outputs, job_id)
        if job["status"] == "done":
            figures.done += 1
        elif job["status"] == "failed":
            figures.failed += 1
        if job["status"] not in FINISHED:
            figures.lost += 1
        if runs > 1:
            figures.duplicated += 1
        if job.get("attempts", 0) > 1:
            figures.rerun_after_kill += 1
        if job["status"] == "done":
            figures.results_checked += 1
            figures.results_good += result_is_good(outputs / job_id / "result.mp4", speech_seconds)
    figures.seconds = time.monotonic() - started
    traceback_lines = server.log_text().count("Traceback")
    rows = [
        Row(f"{submissions} concurrent REST submissions, SIGKILL after {max(1, submissions // 3)} accepted, restart",
            "every accepted job done exactly once; none lost; none duplicated",
            f"{figures.accepted} accepted, {figures.done} done, {figures.failed} failed, {figures.lost} lost, "
            f"{figures.duplicated} duplicated; {figures.rerun_after_kill} interrupted and run again",
            figures.accepted > 0 and figures.done == figures.accepted and figures.lost == 0
            and figures.duplicated == 0),
        Row("results of the load run", "every result.mp4 decodes, as long as the speech",
            f"{figures.results_good} of {figures.results_checked} decode with the right length",
            figures.results_checked == figures.done and figures.results_good == figures.results_checked),
        Row("server log during the load run", "no traceback",
            f"{traceback_lines} tracebacks" if traceback_lines else "none", traceback_lines == 0),
    ]
    return rows, figures


# ---------------------------------------------------------------------- 2. ffmpeg killed mid-encode


def ffmpeg_children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every ffmpeg below process ``pid``, read from /proc."""
    parents = {child: parent for child, (parent, _) in process_table().items()}
    found = []
    for child, parent in parents.items():
        ancestor = parent
        while ancestor not in (0, 1, pid) and ancestor in parents:
            ancestor = parents[ancestor]
        if ancestor != pid:
            continue
        with contextlib.suppress(OSError):
            command = (Path("/proc") / str(child) / "cmdline").read_bytes().split(b"\0")
            if command and Path(command[0].decode(errors="replace")).name.startswith("ffmpeg"):
                found.append((child, " ".join(part.decode(errors="replace") for part in command)))
    return found


def ffmpeg_part(work: Path, inputs: Inputs, timeout: float) -> list[Row]:
    outputs = work / "ffmpeg-outputs"
    server = Server(outputs, work / "ffmpeg-server.log").wait_ready()
    try:
        response = submit(server.client, inputs.face, inputs.long_speech)
        long_job = response.json()["id"]
        killed = None
        deadline = time.monotonic() + timeout
        while killed is None and time.monotonic() < deadline:
            job = server.job(long_job)
            if job["status"] in FINISHED:
                break
            encoders = [(pid, command) for pid, command in ffmpeg_children(server.process.pid)
                        if ".partial.mp4" in command or "segment" in command]
            if encoders and job["status"] == "running" and job["progress"] > 0.15:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(encoders[0][0], signal.SIGKILL)
                    killed = encoders[0][0]
            time.sleep(0.05)
        failed = server.wait_finished([long_job], timeout)[long_job]
        next_job = submit(server.client, inputs.face, inputs.short_speech).json()["id"]
        after = server.wait_finished([next_job], timeout)[next_job]
        traceback_in_log = "Traceback" in server.log_text()
    finally:
        server.stop()
    error = failed.get("error") or ""
    leftovers = sorted(path.name for path in (outputs / long_job).glob("*partial*"))
    readable = bool(error) and "\n" not in error and "Traceback" not in error
    return [
        Row("the x264 ffmpeg of a running job gets SIGKILL",
            "that job fails with a one-line message; no result or partial file is kept",
            f"ffmpeg {killed or 'not found'} killed; job {failed['status']}: {error or '(no message)'}"
            + (f"; left {leftovers}" if leftovers else ""),
            killed is not None and failed["status"] == "failed" and readable and not leftovers
            and not (outputs / long_job / "result.mp4").exists()),
        Row("the next job after the killed encode", "done (the worker goes on)", f"job {after['status']}",
            after["status"] == "done"),
        Row("server log after the ffmpeg kill", "no traceback (the failure is the job's, not a bug)",
            "a traceback" if traceback_in_log else "none", not traceback_in_log),
    ]


# ---------------------------------------------------------------------- 3. a full disk


def fill(folder: Path, leave_bytes: int) -> Path:
    """A file that takes the folder's filesystem down to ``leave_bytes`` free (or less)."""
    filler = folder / "filler.bin"
    free = shutil.disk_usage(folder).free
    with open(filler, "wb") as output:
        with contextlib.suppress(OSError):
            remaining = max(free - leave_bytes, 0)
            block = b"\0" * (1 << 20)
            while remaining > 0:
                remaining -= output.write(block[:min(len(block), remaining)])
    return filler


def disk_part(work: Path, inputs: Inputs, timeout: float, method: str = "auto") -> tuple[list[Row], str]:
    outputs = work / "disk-outputs"
    outputs.mkdir()
    mounted = False
    if method == "tmpfs" or (method == "auto" and os.getuid() == 0):
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(outputs)],
                                 capture_output=True, check=False).returncode == 0
    if mounted:
        described, speech, options = "a 24 MB tmpfs mounted on the outputs folder", inputs.long_speech, OPTIONS
    else:  # every file the server writes is capped instead: small inputs, a result larger than the cap
        described = ("RLIMIT_FSIZE of 300 kB on the server process, SIGXFSZ ignored (no tmpfs: "
                     + ("mount failed)" if method != "rlimit" else "asked for)"))
        speech = work / "long speech.m4a"
        run_ffmpeg("-i", str(inputs.long_speech), "-c:a", "aac", "-b:a", "48k", str(speech))
        options = {**OPTIONS, "media.output_height": 720}
    server = Server(outputs, work / "disk-server.log", extra_args=("--min-free-mb", "4"),
                    file_size_limit=None if mounted else 300 * 1024).wait_ready()
    rows: list[Row] = []
    try:
        response = submit(server.client, inputs.face, speech, options)
        job_id = response.json()["id"]
        filler = fill(outputs, 64 * 1024) if mounted else None
        job = server.wait_finished([job_id], timeout)[job_id]
        error = job.get("error") or ""
        # ffmpeg gets SIGXFSZ back at its default (Python's subprocess restores it), so under the file size limit
        # it is stopped by that signal (25) rather than told "File too large"
        mentions_disk = any(word in error.lower() for word in (
            ("disk", "space") if mounted else ("too large", "file size", "signal 25")))
        leftovers = sorted(path.name for path in (outputs / job_id).glob("*partial*"))
        rows.append(Row("the result cannot be written (disk full)" if mounted else
                        "the result cannot be written (over the file size limit)",
                        "job failed, the message says the disk is full; no result, no partial file" if mounted else
                        "job failed (ffmpeg stopped by SIGXFSZ or told the file is too large); no result or partial",
                        f"job {job['status']}: {error or '(no message)'}"
                        + (f"; left {leftovers}" if leftovers else ""),
                        job["status"] == "failed" and mentions_disk and "\n" not in error
                        and not (outputs / job_id / "result.mp4").exists() and not leftovers))
        if mounted:
            refused = submit(server.client, inputs.face, inputs.short_speech)
            body = refused.json() if refused.headers.get("content-type", "").startswith("application/json") else {}
            rows.append(Row("a job submitted while the disk is full (--min-free-mb 4)", "507 with a one-line error",
                            f"HTTP {refused.status_code}: {body.get('error', refused.text[:120])}",
                            refused.status_code == 507 and "\n" not in body.get("error", "\n")))
            # the same with the check off (a second server, no workers): the upload itself meets the full disk
            unchecked = Server(outputs, work / "disk-server-unchecked.log",
                               extra_args=("--min-free-mb", "0", "--workers", "0")).wait_ready()
            try:
                before = unchecked.counts()
                try:
                    refused = submit(unchecked.client, inputs.face, inputs.long_speech)
                except httpx.TransportError as problem:  # the server dropped the connection
                    refused = httpx.Response(599, text=f"no answer: {problem}")
                body = refused.json() if refused.headers.get("content-type", "").startswith("application/json") else {}
                stored = unchecked.counts() != before
                unchecked_traceback = "Traceback" in unchecked.log_text()
            finally:
                unchecked.stop()
            rows.append(Row("an upload that does not fit on the full disk (--min-free-mb 0)",
                            "507 with a one-line error, nothing queued, no traceback",
                            f"HTTP {refused.status_code}: {body.get('error', refused.text[:120])}"
                            + ("; a job was queued" if stored else "")
                            + ("; a traceback" if unchecked_traceback else ""),
                            refused.status_code == 507 and "\n" not in body.get("error", "\n") and not stored
                            and not unchecked_traceback))
            filler.unlink()
        answering = server.client.get("/api/jobs").status_code == 200
        after_id = submit(server.client, inputs.face, inputs.short_speech).json().get("id")
        after = server.wait_finished([after_id], timeout)[after_id] if after_id else {"status": "refused"}
        rows.append(Row("the server after the full disk", "keeps answering; the next job is done",
                        f"GET /api/jobs {'200' if answering else 'failed'}; next job {after['status']}",
                        answering and after["status"] == "done"))
        traceback_in_log = "Traceback" in server.log_text()
        rows.append(Row("server log during the full disk", "no traceback",
                        "a traceback" if traceback_in_log else "none", not traceback_in_log))
    finally:
        server.stop()
        if mounted:
            subprocess.run(["umount", str(outputs)], check=False)
    return rows, described


# ---------------------------------------------------------------------- 4. bad uploads


def uploads_part(work: Path, inputs: Inputs) -> list[Row]:
    outputs = work / "uploads-outputs"
    log_path = work / "uploads-server.log"
    server = Server(outputs, log_path).wait_ready()
    clip = inputs.clip.read_bytes()
    face = inputs.face.read_bytes()
    cases = [
        ("truncated MP4 (first 40 %, index at the front)", b"clip.mp4", clip[: len(clip) * 2 // 5]),
        ("truncated MP4 (first 200 bytes)", b"clip.mp4", clip[:200]),
        ("zero-byte file", b"face.mp4", b""),
        ("wrong extension: random bytes named .exe", b"setup.exe", os.urandom(4096)),
        ("wrong extension: a photo named .exe", b"face.exe", face),
        ("a text file named .mp4", b"notes.mp4", b"just some words, not a video\n" * 40),
        ("hostile name ../../etc/passwd.mp4", b"../../etc/passwd.mp4", clip),
        ("hostile name with a NUL byte", b"face\0.jpg", face),
        ("hostile name with a newline", b"face\n.jpg", face),
        ("hostile name with a terminal escape", b"face\x1b[2J.jpg", face),
        ("very long name (1000 characters)", b"a" * 996 + b".jpg", face),
        ("name that is only dots", b"..", face),
    ]
    outside_before = set(os.listdir(work))
    rows = []
    try:
        before = server.counts()
        log_start = len(server.log_text())
        for label, name, content in cases:
            response = submit(server.client, inputs.face, inputs.short_speech, face_name=name, face_bytes=content)
            try:
                error = response.json().get("error", "")
            except ValueError:
                error = None
            one_line = isinstance(error, str) and bool(error) and "\n" not in error and "Traceback" not in error
            rows.append(Row(label, "400, one-line JSON error",
                            f"HTTP {response.status_code}: {error if error is not None else response.text[:100]!r}",
                            response.status_code == 400 and one_line))
        after = server.counts()
        new_log = server.log_text()[log_start:]
    finally:
        server.stop()
    job_folders = [path.name for path in outputs.iterdir() if path.is_dir()]
    outside_after = set(os.listdir(work)) - outside_before - {log_path.name}
    stray = [str(path) for path in (Path("/etc/passwd.mp4"), work / "passwd.mp4", outputs.parent / "etc")
             if path.exists()]
    rows.append(Row("after the bad uploads", "nothing queued, no job folder, nothing written outside outputs/",
                    f"{sum(after.values()) - sum(before.values())} new jobs, {len(job_folders)} job folders, "
                    f"{len(outside_after) + len(stray)} stray files",
                    after == before and not job_folders and not outside_after and not stray))
    rows.append(Row("server log during the bad uploads", "no traceback",
                    f"{new_log.count('Traceback')} tracebacks" if "Traceback" in new_log else "none",
                    "Traceback" not in new_log))
    return rows


# ---------------------------------------------------------------------- report


def markdown_tables(report: dict) -> str:
    lines = []
    figures = report.get("load")
    if figures:
        why = ", ".join(f"{count} {reason}" for reason, count in sorted(figures["refused_why"].items())) or "none"
        lines += ["| submitted | accepted | refused | no answer | done | failed | lost | duplicated | "
                  "interrupted and rerun | results decoded OK | restart (s) | run (s) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {figures['submitted']} | {figures['accepted']} | {figures['refused']} | {figures['unanswered']} "
                  f"| {figures['done']} | {figures['failed']} | {figures['lost']} | {figures['duplicated']} "
                  f"| {figures['rerun_after_kill']} | {figures['results_good']}/{figures['results_checked']} "
                  f"| {figures['restart_seconds']:.1f} | {figures['seconds']:.1f} |", "",
                  f"Refused or unanswered, and why: {why}. Jobs created whose answer never reached the client: "
                  f"{figures['created_unanswered']} (they ran like the others).", ""]
    lines += ["| fault | expected | outcome | pass |", "|---|---|---|---|"]
    for row in report["rows"]:
        outcome = row["outcome"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {row['fault']} | {row['expected']} | {outcome} | {'pass' if row['passed'] else 'FAIL'} |")
    if report.get("disk_method"):
        lines += ["", f"Full disk: {report['disk_method']}."]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- faults:begin -->", "<!-- faults:end -->"


def write_markdown(path: Path, report: dict) -> None:
    """Put the tables between the markers in ``path`` (at its end when it has none)."""
    block = (f"{BEGIN}\n_Run {report['date']} on {report['machine']}: `{report['command']}`._\n\n"
             f"{markdown_tables(report)}{END}")
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        text = head + block + rest.partition(END)[2]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    path.write_text(text, encoding="utf-8")


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 submissions and shorter waits (the CI run)")
    parser.add_argument("--submissions", type=int, default=None, help="REST submissions of the load part "
                        "(default 50, 8 with --quick)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which faults to run")
    parser.add_argument("--disk", choices=["auto", "tmpfs", "rlimit"], default="auto",
                        help="how to make the disk full: a tmpfs (needs root; auto uses it as root) or a file size "
                             "limit on the server process")
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables into this file "
                        "(between faults markers), e.g. docs/reliability.md")
    parser.add_argument("--json", type=Path, default=None, help="write the figures and rows as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    submissions = args.submissions or (8 if args.quick else 50)
    timeout = 120 if args.quick else 600
    work = Path(tempfile.mkdtemp(prefix="heygem-faults-"))
    report: dict = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU used",
                    "command": "python bench/faults.py" + (" --quick" if args.quick else ""), "rows": []}
    try:
        inputs = make_inputs(work, args.quick)
        if "load" in args.parts:
            rows, figures = load_part(work, inputs, submissions, timeout)
            report["rows"] += [asdict(row) for row in rows]
            report["load"] = asdict(figures)
        if "ffmpeg" in args.parts:
            report["rows"] += [asdict(row) for row in ffmpeg_part(work, inputs, timeout)]
        if "disk" in args.parts:
            rows, report["disk_method"] = disk_part(work, inputs, timeout, args.disk)
            report["rows"] += [asdict(row) for row in rows]
        if "uploads" in args.parts:
            report["rows"] += [asdict(row) for row in uploads_part(work, inputs)]
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(markdown_tables(report))
    if args.markdown:
        write_markdown(args.markdown, report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if all(row["passed"] for row in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
