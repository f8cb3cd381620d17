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
  requests what an outside probe of the server tried (each row names its case of
          docs/reliability.md): NaN, infinity, deep nesting, bad types and ranges,
          bitrates, devices and files in options (REST, gradio_client, the Batch
          tab's manifest), process counts over the server's cap, 20 parallel
          submissions against --max-queued 3, a chunked upload over --max-upload-mb,
          the server's files outside --outputs, gradio_client without audio, the
          messages for a text file, a huge picture, too-short speech and no face;
          and the page's rough edges (case 12) as its GET /config and the server log
          show them, each row naming the browser test that checks the drawn page.
  users   case 9: a server with --users (two users and an admin): no user, 401;
          another's job answers 404 as a missing one (REST and gradio_client);
          each lists their own jobs, the admin all; no server path for a user;
          the job folders refused on the page; DELETE and `jobs delete` remove a
          finished job; a users file in the wrong format ends the server (exit 2);
          a secret under 12 characters (file or --auth) too; a POST from another
          site's page is refused (403); a user removed from the file loses access
          within seconds; repeated wrong passwords are refused for a while (429).
  probe2  what a second probe found (rows B4 to B22, as in docs/reliability.md's
          second table): a retry past --max-queued, ?limit=abc, a Unicode line break in a
          name, wav2lip without its checkpoint, forged page requests, a deleted
          job's upload, the network at start, links out of a --batch-root, and the
          command line's -o, --text-file and non-file inputs.

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
PARTS = ("load", "ffmpeg", "disk", "uploads", "requests", "users", "probe2")


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
                 file_size_limit: int | None = None, env: dict | None = None, drop_env: tuple[str, ...] = (),
                 auth: tuple[str, str] | None = None, cwd: Path | None = None):
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
                 *extra_args], cwd=cwd or REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                preexec_fn=limit_file_size if file_size_limit else None)
        self.client = httpx.Client(base_url=self.url, timeout=60, auth=auth)  # auth: a user of --users

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
    private_tmp = work / "load-tmp"  # the system temp folder as the server sees it: nothing of a job may stay there
    private_tmp.mkdir()
    server = Server(outputs, log_path, env={"TMPDIR": str(private_tmp)}).wait_ready()
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
        server = Server(outputs, log_path, port=port, env={"TMPDIR": str(private_tmp)}).wait_ready()
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
    # the restart sweeps those of the killed server
    work_folders = list((outputs / "tmp").glob("heygem-*")) + list(private_tmp.glob("heygem-*"))
    partials = list(outputs.glob("*/.*.partial*"))  # the rerun of the interrupted job removes its own
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
        Row("B10. work folders and unfinished encodes after the kill and the rerun", "none left",
            f"{len(work_folders)} work folders (--outputs/tmp, the temp folder), {len(partials)} partial files in "
            "job folders",
            not work_folders and not partials),
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
    job_folders = [path.name for path in outputs.iterdir()  # the server's own folders are no jobs
                   if path.is_dir() and path.name not in ("avatar-cache", "gradio-temp", "voice-cache", "tmp")]
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


# ---------------------------------------------------------------------- 5. hostile and careless requests


def error_row(label: str, response: httpx.Response, status: int = 400, words: str = "") -> Row:
    """A row for a request that must be refused with ``status`` and a one-line JSON error (holding ``words``)."""
    try:
        error = response.json().get("error", "")
    except ValueError:
        error = None
    one_line = isinstance(error, str) and bool(error) and "\n" not in error and "Traceback" not in error
    shown = error if error is not None else response.text[:100]
    return Row(label, f"{status}, one-line JSON error", f"HTTP {response.status_code}: {shown!r}",
               response.status_code == status and one_line and words in (error or ""))


def post_options(server: Server, inputs: Inputs, options_text: str, face: Path | None = None,
                 face_name: bytes | None = None) -> httpx.Response:
    face = face or inputs.face
    body, content_type = multipart([("face", face_name or face.name.encode(), face.read_bytes()),
                                    ("audio", inputs.short_speech.name.encode(), inputs.short_speech.read_bytes()),
                                    ("options", None, options_text.encode())])
    return server.client.post("/api/jobs", content=body, headers={"content-type": content_type})


def chunked_upload(port: int, megabytes: int) -> tuple[bytes, int]:
    """POST a face of ``megabytes`` MB as a chunked body; (the answer's first bytes, bytes sent before it came)."""
    import select

    head = (b'--b\r\nContent-Disposition: form-data; name="face"; filename="big.mp4"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n")
    chunk, sent, answer = b"\0" * 65536, 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(b"POST /api/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                           b"Content-Type: multipart/form-data; boundary=b\r\n\r\n"
                           + f"{len(head):x}\r\n".encode() + head + b"\r\n")
        with contextlib.suppress(OSError):
            while sent < megabytes << 20 and not select.select([connection], [], [], 0)[0]:
                connection.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent += len(chunk)
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in answer and (data := connection.recv(65536)):
                answer += data
    return answer[:200], sent


def png_of_size(path: Path, width: int, height: int) -> Path:
    """An all-black 1-bit PNG of that size (small on disk however large it is)."""
    import struct
    import zlib

    row = b"\0" * (1 + (width + 7) // 8)
    compressor = zlib.compressobj(9)
    data = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", data) + chunk(b"IEND", b""))
    return path


def requests_part(work: Path, inputs: Inputs, timeout: float) -> list[Row]:
    """The cases an outside probe of the server found (numbered as in docs/reliability.md)."""
    from gradio_client import Client, handle_file

    weights = work / "requests-weights"
    weights.mkdir()
    (weights / "notes.pth").write_text("not weights\n" * 20, encoding="utf-8")
    (weights / "passwd.pth").symlink_to("/etc/passwd")
    private_tmp = work / "requests-tmp"
    private_tmp.mkdir()
    env = {"HEYGEM_WEIGHTS": str(weights), "TMPDIR": str(private_tmp)}
    drop = ("HEYGEM_CACHE_DIR", "GRADIO_TEMP_DIR")
    rows: list[Row] = []
    # a server that runs no jobs: what is queued stays queued, so the queue limit can be counted
    batch_root = work / "requests-batch-root"
    batch_root.mkdir()
    idle = Server(work / "requests-idle-outputs", work / "requests-idle.log", env=env, drop_env=drop,
                  extra_args=("--workers", "0", "--max-queued", "3", "--max-upload-mb", "2",
                              "--max-job-processes", "4", "--batch-root", str(batch_root))).wait_ready()
    try:
        rooted_config = idle.client.get("/config").json()  # the page of a server with --batch-root
        before = idle.counts()
        refused = [
            ("1. NaN in options (engine.mouth_strength)", '{"engine.mouth_strength": NaN}', "finite"),
            ("5. Infinity in face.pads", '{"face.pads": [0, Infinity, 0, 0]}', "finite"),
            ("5. Infinity in face.box", '{"face.box": [0, 0, Infinity, 10]}', "finite"),
            ("5. 100 kB of nested [[[...]]] as options", "[" * 51_200 + "]" * 51_200, "options"),
            ("5. nesting inside a valid object", '{"face": {"pads": ' + "[" * 3000 + "]" * 3000 + "}}", "nest"),
            ("3. run.face_workers 32 (cap 4)", '{"run.face_workers": 32}', "at most 4"),
            ("3. run.decoders 40 (cap 4)", '{"run.decoders": 40}', "at most 4"),
            ("3. run.encoders 40 (cap 4)", '{"run.encoders": 40}', "at most 4"),
            ("6. media.audio_bitrate '-f null /tmp/x'", '{"media.audio_bitrate": "-f null /tmp/x"}', "bitrate"),
            ("6. engine.device '/dev/sda'", '{"engine.device": "/dev/sda"}', "device"),
            ("6. engine.device cuda:64", '{"engine.device": "cuda:64"}', "cuda:64"),
            ("6. negative blend.feather", '{"blend.feather": -0.5}', "--feather"),
            ("6. negative face.pads", '{"face.pads": [0, -10, 0, 0]}', "--pads"),
            ("6. a text file in weights/ as engine.checkpoint",
             '{"engine.name": "wav2lip", "engine.checkpoint": "notes.pth"}', "not a checkpoint"),
            ("6. a link in weights/ to /etc/passwd as engine.checkpoint",
             '{"engine.name": "wav2lip", "engine.checkpoint": "passwd.pth"}', "outside"),
            ("6. engine.checkpoint /etc/passwd", '{"engine.name": "wav2lip", "engine.checkpoint": "/etc/passwd"}',
             "not a path"),
            ("types: a list for engine.device", '{"engine.device": [1]}', "engine.device"),
        ]
        for label, options_text, words in refused:
            rows.append(error_row(label, post_options(idle, inputs, options_text), 400, words))
        after = idle.counts()
        rows.append(Row("after the refused requests", "nothing queued", f"{sum(after.values()) - sum(before.values())} "
                        "new jobs", after == before))
        listed = idle.client.get("/api/jobs")
        rows.append(Row("1. GET /api/jobs after the NaN request", "200", f"HTTP {listed.status_code}",
                        listed.status_code == 200))
        body, content_type = multipart([("face", inputs.face.name.encode(), inputs.face.read_bytes()),
                                        ("audio", inputs.short_speech.name.encode(), inputs.short_speech.read_bytes()),
                                        ("options", None, b"{}")])

        def send(_):
            with httpx.Client(base_url=idle.url, timeout=120) as client:
                return client.post("/api/jobs", content=body, headers={"content-type": content_type}).status_code

        with ThreadPoolExecutor(20) as pool:
            codes = list(pool.map(send, range(20)))
        rows.append(Row("4. 20 parallel submissions against --max-queued 3 (no worker running)",
                        "exactly 3 accepted, 17 refused with 429",
                        f"{codes.count(201)} accepted, {codes.count(429)} refused with 429",
                        codes.count(201) == 3 and codes.count(429) == 17))
        answer, sent = chunked_upload(idle.port, 400)
        status_line = answer.split(b"\r\n", 1)[0].decode(errors="replace")
        rows.append(Row("7. a 400 MB chunked upload against --max-upload-mb 2", "413 before the body is all sent",
                        f"{status_line or 'no answer'} after {sent / 2**20:.1f} MB sent",
                        answer.startswith(b"HTTP/1.1 413") and sent < 64 << 20))
        idle_log = idle.log_text()
    finally:
        idle.stop()
    rows.append(Row("server log during the refused requests", "no traceback",
                    f"{idle_log.count('Traceback')} tracebacks" if "Traceback" in idle_log else "none",
                    "Traceback" not in idle_log))
    rows += batch_manifest_rows(work, inputs, weights)

    outputs = work / "requests-outputs"
    server = Server(outputs, work / "requests.log", env=env, drop_env=drop).wait_ready()
    try:
        client = Client(server.url, verbose=False)
        plain_config = server.client.get("/config").json()  # the page of a server without --batch-root
        log_start = len(server.log_text())
        problem = ""
        try:
            video, job_id = client.predict(face=handle_file(str(inputs.face)), text="Hello there.",
                                           options='{"media.output_height": 256}', api_name="/generate")
            followed = client.predict(job_id=job_id, api_name="/job_status")
        except Exception as error:  # noqa: BLE001 - the row says what went wrong
            video, followed, problem = None, {}, str(error)[:120]
        rows.append(Row("10. gradio_client predict(face=..., text=...) without audio; /job_status follows the job",
                        "an MP4 and the job's id; /job_status says done",
                        problem or f"{Path(video).name}, job {followed.get('id')} {followed.get('status')}",
                        not problem and followed.get("status") == "done" and result_is_good(Path(video),
                                                                                           probe(Path(video)).duration)))
        video_name = Path(video).name if video else ""
        generate_start, generate_errors = len(server.log_text()), []
        text = work / "notes.png"
        text.write_text("just some words\n" * 40, encoding="utf-8")
        for label, face, options, words in (
                ("5. gradio_client /generate with NaN", inputs.face, '{"engine.mouth_strength": NaN}', "finite"),
                ("5. gradio_client /generate with Infinity in face.pads", inputs.face,
                 '{"face.pads": [0, Infinity, 0, 0]}', "finite"),
                ("", text, "{}", "not an image or video")):  # an ordinary mistake, for the server log's row
            try:
                client.predict(face=handle_file(str(face)), audio=handle_file(str(inputs.short_speech)),
                               options=options, api_name="/generate")
                message = "accepted"
            except Exception as error:  # noqa: BLE001 - the message is what the row checks
                message = str(error)
            generate_errors.append(message)
            if label:
                rows.append(Row(label, "refused with one line", message[:140],
                                words in message and "\n" not in message))
        generate_log = server.log_text()[generate_start:]
        clip = work / "requests-clip.mp4"
        shutil.copyfile(inputs.clip, clip)
        wall = png_of_size(work / "wall.png", 128, 128)
        video_job = post_options(server, inputs, '{"engine.name": "landmark"}', face=clip).json().get("id")
        wall_job = post_options(server, inputs, '{"engine.name": "landmark"}', face=wall).json().get("id")
        finished = server.wait_finished([video_job, wall_job], timeout)
        cache_entries = list((outputs / "avatar-cache").glob("*/entry.json"))
        rows.append(Row("8. a face video's avatar cache", "under --outputs", f"{len(cache_entries)} entries under "
                        "--outputs/avatar-cache", finished[video_job]["status"] == "done" and bool(cache_entries)))
        leftovers = [path for path in private_tmp.rglob("*") if path.is_file() and
                     ("gradio" in path.parts or not path.stat().st_size)]
        empty = [path for path in (outputs / "gradio-temp").rglob("*") if path.is_file() and not path.stat().st_size]
        rows.append(Row("8. Gradio's files after gradio_client calls", "under --outputs, no empty files",
                        f"{len(leftovers)} in the temp folder, {len(empty)} empty under --outputs/gradio-temp",
                        not leftovers and not empty and (outputs / "gradio-temp").is_dir()))
        error = finished[wall_job].get("error") or ""
        rows.append(Row("11. no face in the picture (the page shows the job's error)",
                        "says what to do, no command-line flag", error, "no face" in error and "--" not in error))
        blip = work / "blip.wav"
        run_ffmpeg("-f", "lavfi", "-i", "sine=frequency=300:duration=0.01", str(blip))
        cases = (("11. a text file in the photo slot", text, inputs.short_speech, "not an image or video"),
                 ("11. a 20000x20000 PNG", png_of_size(work / "huge.png", 20000, 20000), inputs.short_speech,
                  "too large"),
                 ("11. a 16000x1000 PNG (wider than the server makes)", png_of_size(work / "wide.png", 16000, 1000),
                  inputs.short_speech, "wide"),
                 ("11. 0.01 s of speech", inputs.face, blip, "too short"))
        for label, face, audio, words in cases:
            try:
                client.predict(face=handle_file(str(face)), audio=handle_file(str(audio)), api_name="/submit_job")
                message = "accepted"
            except Exception as error:  # noqa: BLE001 - the message is what the row checks
                message = str(error)
            rows.append(Row(label, "refused with a line that says what is wrong", message[:140], words in message))
        new_log = server.log_text()[log_start:]
    finally:
        server.stop()
    rows.append(Row("8. server log during the gradio_client errors", "one line each, no traceback",
                    f"{new_log.count('Traceback')} tracebacks" if "Traceback" in new_log else "none",
                    "Traceback" not in new_log))
    return rows + page_rows(plain_config, rooted_config, video_name, generate_errors, generate_log)


def page_components(config: dict) -> dict[str, dict]:
    """The page's components as GET /config describes them, by elem_id (and the Batch tab's unnamed
    inputs radio as "batch-source")."""
    found = {}
    for component in config.get("components", []):
        props = component.get("props", {})
        if props.get("elem_id"):
            found[props["elem_id"]] = component
        elif component.get("type") == "radio" and "folder" in [value for _, value in props.get("choices") or []]:
            found["batch-source"] = component
    return found


def page_events(config: dict) -> list[tuple[list[tuple[str | None, str]], list, dict]]:
    """The page's events: (triggers as (elem_id, event), outputs as elem_ids (else ids), the dependency)."""
    names = {component["id"]: component.get("props", {}).get("elem_id") for component in config.get("components", [])}
    return [([(names.get(target), event) for target, event in dependency["targets"]],
             [names.get(output) or output for output in dependency["outputs"]], dependency)
            for dependency in config.get("dependencies", [])]


BROWSER = "tests/test_browser.py::"


def page_rows(plain: dict, rooted: dict, video_name: str, generate_errors: list[str], generate_log: str) -> list[Row]:
    """12. The page's rough edges, as far as the page's own description (GET /config) and the server show
    them; how the page draws them is checked in a browser by the test each row names."""
    import torch

    components, events = page_components(plain), page_events(plain)
    props = {name: component.get("props", {}) for name, component in components.items()}
    rows = []
    dropdowns = [name for name in ("engine", "restorer", "output-height", "detector") if name in props]
    autos = {name: label for name in dropdowns for label, value in props[name].get("choices") or [] if value == "auto"}
    longest = max((label for name in dropdowns for label, _ in props[name].get("choices") or []), key=len, default="")
    rows.append(Row("12. dropdown text cut off under the arrow ('auto (Wav2Lip when its weigh')",
                    "each 'auto' choice says only auto, its detail in the info line below; drawn: "
                    f"{BROWSER}test_table_headers_stay_whole_and_dropdowns_show_their_text",
                    f"{len(dropdowns)} dropdowns; auto labels {sorted(set(autos.values()))}; longest choice "
                    f"{longest!r}; engine's info {props.get('engine', {}).get('info')!r}",
                    len(dropdowns) == 4 and set(autos.values()) == {"auto"} and len(autos) >= 2
                    and all(props[name].get("info") for name in autos)))
    tables = ("jobs-table", "batch-table", "system-weights")
    css = plain.get("css") or ""
    header_rule = css.partition(".heygem-table th .header")[2].partition("}")[0]
    whole = "white-space: nowrap" in header_rule and "word-break: normal" in header_rule
    classed = [name for name in tables if "heygem-table" in (props.get(name, {}).get("elem_classes") or [])]
    rows.append(Row("12. table headers breaking mid-word ('progr ess', 'fi le')",
                    "every table's headers set nowrap, no word-break; drawn: "
                    f"{BROWSER}test_table_headers_stay_whole_and_dropdowns_show_their_text",
                    f"nowrap rule {'in' if whole else 'not in'} the page's CSS; {len(classed)} of {len(tables)} "
                    "tables carry it", whole and len(classed) == len(tables)))
    weights = props.get("system-weights", {})
    widths = [float(str(width).rstrip("%")) for width in weights.get("column_widths") or []]
    rows.append(Row("12. the System tab's weights table cut off on the right",
                    "column widths that add up to the table's width, long cells wrapped; drawn: "
                    f"{BROWSER}test_table_headers_stay_whole_and_dropdowns_show_their_text",
                    f"{len(widths)} columns, {sum(widths):g} % in all, wrap {weights.get('wrap')}",
                    len(widths) == 5 and sum(widths) <= 100 and weights.get("wrap") is True
                    and "overflow-wrap: anywhere" in css))
    files = props.get("batch-files", {})
    previews = [outputs for triggers, outputs, _ in events if ("batch-files", "change") in triggers]
    rows.append(Row("12. the Batch file list showing 2 of 4 files; no preview of the pairing before Start",
                    "the file list has no fixed height; a change of the files fills the items table at once; drawn: "
                    f"{BROWSER}test_the_batch_tab_lists_every_file_and_previews_the_pairing_before_start",
                    f"file list height {files.get('height')}, {files.get('file_count')} files; "
                    f"{sum('batch-table' in outputs for outputs in previews)} preview event on a change of the files",
                    bool(files) and files.get("height") is None and files.get("file_count") == "multiple"
                    and any("batch-table" in outputs for outputs in previews)))
    shown = {"without": props.get("batch-source", {}).get("visible"),
             "with": page_components(rooted).get("batch-source", {}).get("props", {}).get("visible")}
    rows.append(Row("12. 'A folder on the server' offered when --batch-root is not given",
                    "hidden without --batch-root, offered with it; drawn: "
                    f"{BROWSER}test_the_batch_tab_lists_every_file_and_previews_the_pairing_before_start",
                    f"without --batch-root visible={shown['without']}, with --batch-root visible={shown['with']}",
                    shown == {"without": False, "with": True}))
    gpu = torch.cuda.is_available()
    button, note = props.get("benchmark-button", {}), str(props.get("benchmark-note", {}).get("value", ""))
    rows.append(Row("12. the GPU benchmark button on a machine without a GPU",
                    "the button only where torch sees a CUDA GPU, else a note; drawn: "
                    f"{BROWSER}test_the_system_tab_shows_the_doctor_report_and_offers_the_benchmark_only_with_a_gpu",
                    f"{'a' if gpu else 'no'} CUDA GPU here; button visible={button.get('visible')}; note {note!r}",
                    bool(button) and button.get("visible") is gpu and (gpu or "No CUDA GPU" in note)))
    asking = [outputs for triggers, outputs, _ in events if ("delete-job", "click") in triggers]
    deleting = [outputs for triggers, outputs, _ in events if ("confirm-delete-button", "click") in triggers]
    rows.append(Row("12. Delete without confirmation",
                    "Delete only shows a confirmation (hidden at first); the job goes on 'Delete for good'; drawn: "
                    f"{BROWSER}test_a_user_sees_only_their_jobs_and_files_and_deletes_after_confirming",
                    f"Delete shows {[name for name in asking[0] if isinstance(name, str)] if asking else 'nothing'}"
                    "; 'Delete for good' updates the jobs table: "
                    f"{bool(deleting) and 'jobs-table' in deleting[0]}; confirmation visible at first: "
                    f"{props.get('confirm-delete', {}).get('visible')}",
                    len(asking) == 1 and "confirm-delete" in asking[0] and "jobs-table" not in asking[0]
                    and len(deleting) == 1 and "jobs-table" in deleting[0]
                    and props.get("confirm-delete", {}).get("visible") is False))
    rows.append(Row("12. every download named result.mp4",
                    "named after the inputs (astronaut-....mp4 for the astronaut photo); drawn: "
                    f"{BROWSER}test_upload_generate_watch_and_download",
                    f"gradio_client's /generate handed out {video_name!r}",
                    video_name.startswith("astronaut") and video_name.endswith(".mp4")))
    on_generate = [dependency for triggers, _, dependency in events if ("generate-button", "click") in triggers]
    followers = [dependency for _, _, dependency in events
                 if on_generate and dependency.get("trigger_after") == on_generate[0]["id"]]
    cancelling = [dependency["id"] for _, _, dependency in events if dependency.get("cancels")]
    modes = sorted({str(dependency.get("trigger_mode")) for dependency in followers}) or ["missing"]
    rows.append(Row("12. two 422s (/gradio_api/cancel and /reset with a null event id) on every Generate",
                    "Generate starts one event, then its watch and its live stream (the newest replaces the last), "
                    "no event cancels another; drawn, no failed request: "
                    f"{BROWSER}test_upload_generate_watch_and_download",
                    f"{len(on_generate)} event on Generate, {len(followers)} after it ({', '.join(modes)})"
                    f"; {len(cancelling)} events with cancels",
                    len(on_generate) == 1 and bool(followers) and modes == ["always_last"] and not cancelling))
    logged = [message for message in generate_errors if f"refused: {message}" in generate_log]
    tracebacks = generate_log.count("Traceback")
    rows.append(Row("12. a traceback in the server log for every ordinary user error on /generate",
                    "one log line each, no traceback (also tests/test_hardening.py::"
                    "test_gradio_client_text_only_job_id_and_quiet_errors)",
                    f"{len(logged)} of {len(generate_errors)} errors logged on one line; "
                    + (f"{tracebacks} tracebacks" if tracebacks else "no traceback"),
                    bool(generate_errors) and len(logged) == len(generate_errors) and not tracebacks))
    return rows


def batch_manifest_rows(work: Path, inputs: Inputs, weights: Path) -> list[Row]:
    """2. The Batch tab's CSV manifest, planned and queued as the tab does it (its events are the page's own)."""
    from heygem.jobs.batch import plan_items
    from heygem.jobs.store import JobStore
    from heygem.ui.batch import queue_batch

    folder = work / "requests-batch"
    folder.mkdir()
    face, speech = folder / "anna.jpg", folder / "anna.wav"
    shutil.copyfile(inputs.face, face)
    shutil.copyfile(inputs.short_speech, speech)
    manifest = folder / "manifest.csv"
    manifest.write_text('face,audio,name,options\n'
                        'anna.jpg,anna.wav,passwd,"{""engine.name"": ""wav2lip"", '
                        '""engine.checkpoint"": ""/etc/passwd""}"\n'
                        'anna.jpg,anna.wav,nan,"{""engine.mouth_strength"": NaN}"\n'
                        'anna.jpg,anna.wav,workers,"{""run.face_workers"": 500}"\n', encoding="utf-8")
    previous = os.environ.get("HEYGEM_WEIGHTS")
    os.environ["HEYGEM_WEIGHTS"] = str(weights)
    try:
        store = JobStore(folder / "outputs")
        _, outcome = queue_batch(store, plan_items([face, speech], str(manifest)), {})
        queued = store.list()
    finally:
        if previous is None:
            os.environ.pop("HEYGEM_WEIGHTS", None)
        else:
            os.environ["HEYGEM_WEIGHTS"] = previous
    errors = {name: str(result) for name, result in outcome.items()}
    return [Row(f"2. Batch tab manifest row: {name}", "refused like REST, no file sizes shown", message[:140],
                isinstance(outcome[name], Exception) and "1294" not in message and "bytes" not in message)
            for name, message in errors.items()] + [
        Row("2. after the manifest", "nothing queued", f"{len(queued)} jobs", not queued)]


# ---------------------------------------------------------------------- 6. a server shared by users

USERS = {"alice": "alice-long-secret", "bob": "bob-long-secret", "carol": "carol-long-secret"}  # alice: the admin


def error_text(response: httpx.Response) -> str:
    """The one-line JSON error of an answer ('' when it has none)."""
    try:
        return str(response.json().get("error", ""))
    except ValueError:
        return ""


def server_paths_in(value, folders: tuple[Path, ...]) -> list[str]:
    """The strings in a JSON value that are absolute paths or name one of ``folders`` (URLs under /api/ are not)."""
    if isinstance(value, dict):
        return [found for item in value.values() for found in server_paths_in(item, folders)]
    if isinstance(value, list):
        return [found for item in value for found in server_paths_in(item, folders)]
    if isinstance(value, str) and ((value.startswith("/") and not value.startswith("/api/"))
                                   or any(str(folder) in value for folder in folders)):
        return [value]
    return []


def bad_users_file_row(work: Path) -> Row:
    """A users file in the wrong format: the server exits 2 with one line naming the line, and makes no folder."""
    users_file, outputs = work / "users-bad.txt", work / "users-bad-outputs"
    users_file.write_text("admin alice:alice-long-secret\nbob alice\n", encoding="utf-8")  # line 2 has no colon
    finished = subprocess.run([sys.executable, "app.py", "--host", "127.0.0.1", "--port", str(free_port()),
                               "--users", str(users_file), "--outputs", str(outputs)], cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False)
    said = (finished.stdout + finished.stderr).strip().replace(str(work), "<tmp>")
    return Row("9. python app.py --users FILE with a line that is not NAME:SECRET",
               "exit status 2, one line naming the line, nothing started or made",
               f"exit {finished.returncode}: {said[:160]}",
               finished.returncode == 2 and "\n" not in said and "line 2" in said and "Traceback" not in said
               and not outputs.exists())


def short_secret_rows(work: Path) -> list[Row]:
    """A secret under 12 characters (in the users file or --auth) or --auth without a password: the server
    exits 2 with one line, and makes no folder."""
    users_file = work / "users-short.txt"
    users_file.write_text("admin alice:alice-long-secret\nbob:short\n", encoding="utf-8")
    cases = (("--users FILE with a secret of 5 characters", ["--users", str(users_file)]),
             ("--auth anna:short", ["--auth", "anna:short"]), ("--auth anna (no password)", ["--auth", "anna"]))
    rows = []
    for number, (label, flags) in enumerate(cases):
        outputs = work / f"short-secret-outputs-{number}"
        finished = subprocess.run([sys.executable, "app.py", "--host", "127.0.0.1", "--port", str(free_port()),
                                   *flags, "--outputs", str(outputs)], cwd=REPO, capture_output=True, text=True,
                                  timeout=60, check=False)
        said = (finished.stdout + finished.stderr).strip().replace(str(work), "<tmp>")
        rows.append(Row(f"9. python app.py {label}", "exit status 2, one line, nothing started or made",
                        f"exit {finished.returncode}: {said[:160]}",
                        finished.returncode == 2 and "\n" not in said and "Traceback" not in said
                        and not outputs.exists()))
    return rows


def defended_sign_in_rows(server: Server, users_file: Path, inputs: Inputs) -> list[Row]:
    """The shared server's sign-in defences: a POST from another site's page refused, a user removed from
    the users file refused within seconds, repeated wrong passwords refused for a while (last: that
    refuses this address for a minute)."""
    rows = []
    before = server.counts()
    with httpx.Client(base_url=server.url, timeout=60, auth=("bob", USERS["bob"]),
                      headers={"Origin": "http://evil.example"}) as foreign:
        answer = submit(foreign, inputs.face, inputs.short_speech)
    rows.append(Row("9. bob's POST /api/jobs from another site's page (Origin: http://evil.example)",
                    "403 with a one-line error; nothing queued",
                    f"HTTP {answer.status_code}: {error_text(answer)}",
                    answer.status_code == 403 and bool(error_text(answer)) and server.counts() == before))
    text = users_file.read_text(encoding="utf-8")
    users_file.write_text(text.replace(f"carol:{USERS['carol']}\n", ""), encoding="utf-8")
    time.sleep(1.5)  # the server looks at the file once a second
    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        removed = [anonymous.get("/api/jobs", auth=("carol", USERS["carol"])),
                   anonymous.get("/api/jobs", headers={"Authorization": f"Bearer carol:{USERS['carol']}"})]
        kept = anonymous.get("/api/jobs", auth=("bob", USERS["bob"]))
    rows.append(Row("9. carol removed from the users file while the server runs",
                    "her basic auth and API key 401 within seconds; bob still 200",
                    ", ".join(f"HTTP {answer.status_code}" for answer in removed) + f"; bob HTTP {kept.status_code}",
                    all(answer.status_code == 401 for answer in removed) and kept.status_code == 200))
    users_file.write_text(text, encoding="utf-8")
    with httpx.Client(base_url=server.url, timeout=60) as guesser:
        answers = [guesser.get("/api/jobs", auth=("bob", f"guess-{number}")) for number in range(30)]
    codes = [answer.status_code for answer in answers]
    refused = [answer for answer in answers if answer.status_code == 429]
    log_lines = [line for line in server.log_text().splitlines() if "sign-in refused" in line]
    rows.append(Row("9. 30 wrong passwords for bob, one after another",
                    "401 until 10 failures within a minute (the earlier rows' among them), then 429 with "
                    "Retry-After; one line in the server log",
                    f"{codes.count(401)} x 401, {len(refused)} x 429 (Retry-After "
                    f"{refused[0].headers.get('retry-after') if refused else '-'}); {len(log_lines)} log lines",
                    0 < codes.count(401) <= 10 and codes == [401] * codes.count(401) + [429] * len(refused)
                    and all(answer.headers.get("retry-after", "").isdigit() for answer in refused)
                    and len(log_lines) == 1))
    return rows


def users_part(work: Path, inputs: Inputs, timeout: float) -> list[Row]:
    """9. ``python app.py --users FILE``: each user sees, fetches and deletes only their own jobs (another's
    answers as a job that does not exist), an admin every job, over REST and on the page alike."""
    from gradio_client import Client

    rows = [bad_users_file_row(work), *short_secret_rows(work)]
    users_file, outputs = work / "users.txt", work / "users-outputs"
    users_file.write_text("# two users and an admin\n" + "".join(
        f"{'admin ' if name == 'alice' else ''}{name}:{secret}\n" for name, secret in USERS.items()), encoding="utf-8")
    server = Server(outputs, work / "users.log", extra_args=("--users", str(users_file)),
                    auth=("alice", USERS["alice"])).wait_ready()
    clients = {name: httpx.Client(base_url=server.url, timeout=60, auth=(name, secret))
               for name, secret in USERS.items()}
    try:
        before = server.counts()
        with httpx.Client(base_url=server.url, timeout=60) as anonymous:
            answers = [anonymous.get("/api/jobs"), submit(anonymous, inputs.face, inputs.short_speech),
                       anonymous.get("/api/jobs", auth=("bob", "not-bobs-secret")),
                       anonymous.get("/api/jobs", headers={"Authorization": "Bearer not-a-key"})]
        rows.append(Row("9. GET and POST /api/jobs without credentials, with a wrong secret, with a wrong key",
                        "401 each, with a one-line error; nothing queued",
                        ", ".join(f"HTTP {answer.status_code}" for answer in answers) + f": {error_text(answers[0])}",
                        all(answer.status_code == 401 and error_text(answer) for answer in answers)
                        and server.counts() == before))
        bob_job = submit(clients["bob"], inputs.face, inputs.short_speech).json().get("id")
        carol_job = submit(clients["carol"], inputs.face, inputs.short_speech).json().get("id")
        finished = server.wait_finished([bob_job, carol_job], timeout)
        owners = {job_id: server.job(job_id).get("submitter") for job_id in (bob_job, carol_job)}
        rows.append(Row("9. bob and carol each submit a job (basic auth NAME:SECRET)",
                        "201; both done; each job records its submitter",
                        f"bob's {finished[bob_job]['status']} ({owners[bob_job]}), "
                        f"carol's {finished[carol_job]['status']} ({owners[carol_job]})",
                        finished[bob_job]["status"] == finished[carol_job]["status"] == "done"
                        and owners == {bob_job: "bob", carol_job: "carol"}))
        missing = bob_job[:-6] + "zzzzzz"  # job ids end in hex digits: no job has this one
        for method, route in (("GET", ""), ("GET", "/result"), ("GET", "/log"), ("DELETE", ""), ("POST", "/retry")):
            theirs = clients["carol"].request(method, f"/api/jobs/{bob_job}{route}")
            none = clients["carol"].request(method, f"/api/jobs/{missing}{route}")
            rows.append(Row(f"9. carol's {method} /api/jobs/<bob's job>{route}",
                            "404 with the same words as for a job that does not exist",
                            f"HTTP {theirs.status_code}: {error_text(theirs).replace(bob_job, 'ID')!r}; a missing "
                            f"job: HTTP {none.status_code}: {error_text(none).replace(missing, 'ID')!r}",
                            theirs.status_code == none.status_code == 404 and bool(error_text(none))
                            and error_text(theirs).replace(bob_job, "ID") == error_text(none).replace(missing, "ID")))
        kept, result_there = server.job(bob_job), (outputs / bob_job / "result.mp4").is_file()
        rows.append(Row("9. bob's job after carol's requests", "still done, its folder and result in place",
                        f"{kept['status']}, result.mp4 {'there' if result_there else 'gone'}",
                        kept["status"] == "done" and result_there))
        carol_sees = clients["carol"].get("/api/jobs").json()
        listed = [job["id"] for job in carol_sees["jobs"]]
        rows.append(Row("9. carol's GET /api/jobs", "her own job only; the counts are hers",
                        f"jobs listed: {len(listed)} ({'hers' if listed == [carol_job] else listed}), "
                        f"counts {sum(carol_sees['counts'].values())}",
                        listed == [carol_job] and sum(carol_sees["counts"].values()) == 1))
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {USERS['bob']}"}) as keyed:
            bob_sees = [job["id"] for job in keyed.get("/api/jobs").json()["jobs"]]
        rows.append(Row("9. bob's GET /api/jobs with his API key (Authorization: Bearer SECRET)", "his own job only",
                        f"jobs listed: {len(bob_sees)} ({'his' if bob_sees == [bob_job] else bob_sees})",
                        bob_sees == [bob_job]))
        admin_sees = {job["id"]: job["submitter"] for job in server.all_jobs()}
        rows.append(Row("9. the admin's GET /api/jobs", "every job, with its submitter",
                        ", ".join(f"{owner}'s" for owner in sorted(admin_sees.values())) or "none",
                        admin_sees == {bob_job: "bob", carol_job: "carol"}))
        carol_client = Client(server.url, auth=("carol", USERS["carol"]), verbose=False)
        said = {}
        for job_id in (bob_job, missing):
            try:
                said[job_id] = f"answered {carol_client.predict(job_id=job_id, api_name='/job_status')}"
            except Exception as error:  # noqa: BLE001 - the message is what the row checks
                said[job_id] = str(error).replace(job_id, "ID")
        rows.append(Row("9. carol's gradio_client /job_status of bob's job", "as a job that does not exist",
                        f"{said[bob_job][:100]!r}; a missing job: {said[missing][:100]!r}",
                        said[bob_job] == said[missing] and "ID" in said[bob_job]))
        bob_job_json = clients["bob"].get(f"/api/jobs/{bob_job}").json()
        with open(outputs / bob_job / "job.log", "a", encoding="utf-8") as log:  # as a worker's failure names them
            log.write(f"wrote {outputs / bob_job / 'result.mp4'} from {REPO / 'assets'}\n")
        bob_log = clients["bob"].get(f"/api/jobs/{bob_job}/log").text
        admin_log = server.client.get(f"/api/jobs/{bob_job}/log").text
        folders = (outputs, REPO)
        shown = server_paths_in(bob_job_json, folders) + [str(folder) for folder in folders if str(folder) in bob_log]
        rows.append(Row("9. bob's job JSON and job log (he is no admin), the log given a line naming server folders",
                        "no server path: the log names folders by short names (the admin's names them)",
                        f"{len(shown)} server paths" + (f": {shown[:2]}" if shown else "")
                        + f"; bob's line: {bob_log.strip().splitlines()[-1]!r}",
                        not shown and "wrote <job folder>/result.mp4" in bob_log
                        and str(outputs / bob_job) in admin_log))
        with httpx.Client(base_url=server.url, timeout=60) as page:
            signed_in = page.post("/login", data={"username": "bob", "password": USERS["bob"]}).status_code == 200
            signed_in = signed_in and "components" in page.get("/config").json()
            fetched = {name: page.get(f"/gradio_api/file={outputs / bob_job / name}").status_code
                       for name in ("result.json", "job.log", inputs.face.name, "result.mp4")}
        rows.append(Row("9. /gradio_api/file=<outputs>/<bob's job>/... on the page, signed in as bob",
                        "refused (403 or 404) even for the job's owner: the page hands out copies",
                        ("signed in; " if signed_in else "not signed in; ")
                        + ", ".join(f"{name} {code}" for name, code in fetched.items()),
                        signed_in and all(code in (403, 404) for code in fetched.values())))
        deleted = clients["bob"].delete(f"/api/jobs/{bob_job}")
        after = clients["bob"].get(f"/api/jobs/{bob_job}").status_code
        rows.append(Row("9. bob's DELETE /api/jobs/<his finished job>", "deleted: its folder gone, then 404",
                        f"HTTP {deleted.status_code} {deleted.json().get('status')}; folder "
                        f"{'gone' if not (outputs / bob_job).exists() else 'still there'}; GET then {after}",
                        deleted.status_code == 200 and deleted.json().get("status") == "deleted"
                        and not (outputs / bob_job).exists() and after == 404))
        command = [sys.executable, "-m", "heygem", "jobs", "delete", carol_job, "--outputs", str(outputs)]
        cli = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
        left = {job["id"] for job in server.all_jobs()}
        rows.append(Row("9. python -m heygem jobs delete <carol's job> --outputs DIR (the server running)",
                        "exit 0; the job and its folder gone",
                        f"exit {cli.returncode}: {(cli.stdout + cli.stderr).strip()[:100]}; "
                        f"{len(left)} jobs left, folder {'gone' if not (outputs / carol_job).exists() else 'there'}",
                        cli.returncode == 0 and carol_job not in left and not (outputs / carol_job).exists()))
        rows += defended_sign_in_rows(server, users_file, inputs)
        log_text = server.log_text()
    finally:
        for client in clients.values():
            client.close()
        server.stop()
    rows.append(Row("9. server log of the shared server", "no traceback",
                    f"{log_text.count('Traceback')} tracebacks" if "Traceback" in log_text else "none",
                    "Traceback" not in log_text))
    return rows


# ---------------------------------------------------------------------- report


# ---------------------------------------------------------------------- 7. what a second probe found

NETWORK_RECORDER = """
import os, socket

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "", None}


def _note(host):
    host = host.decode() if isinstance(host, bytes) else host
    if host not in _LOOPBACK and not str(host).startswith("127."):
        with open(os.environ["HEYGEM_FAULTS_HOSTS"], "a") as record:
            record.write(f"{host}\\n")
        raise OSError("no network for this server")


_getaddrinfo, _connect = socket.getaddrinfo, socket.socket.connect
socket.getaddrinfo = lambda host, *args, **kwargs: (_note(host), _getaddrinfo(host, *args, **kwargs))[1]
socket.socket.connect = lambda self, address: (_note(address[0]) if isinstance(address, tuple) else None,
                                               _connect(self, address))[1]
"""


def heygem_command(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heygem", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)


def one_line_exit_2_row(label: str, finished: subprocess.CompletedProcess, words: str, work: Path) -> Row:
    """A command that must end with exit status 2 and one ``error:`` line (progress bars aside) holding ``words``."""
    lines = [line for line in finished.stderr.strip().splitlines() if "%|" not in line]
    said = " ".join(lines).replace(str(work), "<tmp>")
    return Row(label, "exit 2, one line", f"exit {finished.returncode}: {said[:140]}",
               finished.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and words in said)


def second_probe_part(work: Path, inputs: Inputs) -> list[Row]:
    """What a second outside probe of the server and the command line found (the numbers of its report)."""
    from gradio_client import Client, handle_file

    from heygem.jobs.batch import collect_files, plan_items

    site, hosts = work / "probe2-site", work / "probe2-hosts.txt"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NETWORK_RECORDER, encoding="utf-8")
    hosts.write_text("", encoding="utf-8")
    weights = work / "probe2-weights"  # no checkpoint at all
    weights.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "HEYGEM_FAULTS_HOSTS": str(hosts),
           "GRADIO_ANALYTICS_ENABLED": "True", "HEYGEM_WEIGHTS": str(weights)}  # as Gradio is when left alone
    outputs = work / "probe2-outputs"
    rows: list[Row] = []
    server = Server(outputs, work / "probe2.log", env=env, extra_args=("--workers", "0", "--max-queued", "3"),
                    drop_env=("HEYGEM_CACHE_DIR", "GRADIO_TEMP_DIR", "HEYGEM_VOICE_CACHE", "HEYGEM_WORK_DIR",
                              "HF_HUB_DISABLE_TELEMETRY")).wait_ready()
    try:
        client = server.client
        first = [post_options(server, inputs, "{}").json()["id"] for _ in range(3)]
        for job_id in first:
            client.delete(f"/api/jobs/{job_id}")
        more = [post_options(server, inputs, "{}") for _ in range(3)]
        others = [answer.status_code for answer in more]
        answers = [client.post(f"/api/jobs/{job_id}/retry") for job_id in first]
        codes = [answer.status_code for answer in answers]
        queued = server.counts()["queued"]
        rows.append(Row("B4. --max-queued 3: three jobs cancelled, three more queued, then each cancelled one retried",
                        "each retry 429 with Retry-After; 3 queued", f"new jobs {others}; retries {codes}; "
                        f"Retry-After {answers[0].headers.get('retry-after')}; {queued} queued",
                        others == [201] * 3 and codes == [429] * 3 and queued == 3
                        and answers[0].headers.get("retry-after") == "60"))
        for job_id in first + [answer.json().get("id") for answer in more if answer.status_code == 201]:
            client.delete(f"/api/jobs/{job_id}")  # cancelled (queued) or deleted (cancelled): the queue is empty
        rows.append(error_row("B22. GET /api/jobs?limit=abc", client.get("/api/jobs", params={"limit": "abc"}), 400,
                              "limit"))
        rows.append(error_row("B22. an upload named face\\u2028x.jpg (a Unicode line separator)",
                              post_options(server, inputs, "{}", face_name="face\u2028x.jpg".encode()), 400,
                              "control characters"))
        wav2lip = post_options(server, inputs, '{"engine.name": "wav2lip"}')
        rows.append(error_row("B13. engine.name wav2lip on a server without its checkpoint", wav2lip, 400,
                              "this server does not have"))
        rows.append(Row("B12. that answer", "no server path, no command-line advice", error_text(wav2lip)[:140],
                        wav2lip.status_code == 400 and str(weights) not in error_text(wav2lip)
                        and "--" not in error_text(wav2lip)))
        dependencies = client.get("/config").json()["dependencies"]
        submit = next(index for index, event in enumerate(dependencies) if event.get("api_name") == "submit_job")
        log_start = len(server.log_text().splitlines())
        joined = client.post("/gradio_api/queue/join", json={"data": ["not a file", 5], "fn_index": submit,
                                                            "session_hash": "forged"})
        with client.stream("GET", "/gradio_api/queue/data", params={"session_hash": "forged"}, timeout=60) as events:
            completed = any("process_completed" in line for line in events.iter_lines())
        unknown = httpx.post(f"{server.url}/gradio_api/queue/join", timeout=60,
                             json={"data": [], "fn_index": 9999, "session_hash": "forged-2"})
        forged_answers = (f"HTTP {joined.status_code} then {'completed' if completed else 'no answer'}, "
                          f"HTTP {unknown.status_code}", completed and unknown.status_code >= 400)
        face = work / "probe2 face.jpg"
        face.write_bytes(inputs.face.read_bytes() + b"this upload only")
        job_id = Client(server.url, verbose=False).predict(face=handle_file(str(face)),
                                                           audio=handle_file(str(inputs.short_speech)),
                                                           api_name="/submit_job")
        before = list((outputs / "gradio-temp").rglob(face.name))
        client.delete(f"/api/jobs/{job_id}")
        deleted = client.delete(f"/api/jobs/{job_id}").json().get("status")
        after = list((outputs / "gradio-temp").rglob(face.name))
        rows.append(Row("B16. a job made from a page upload, then deleted over REST",
                        "the page's copy of the upload goes with the job",
                        f"{len(before)} copies before, job {deleted}, {len(after)} after",
                        len(before) == 1 and deleted == "deleted" and not after))
    finally:
        server.stop()
    log_text = server.log_text()
    forged_log = log_text.splitlines()[log_start:]
    said = [line for line in forged_log if "input values" in line or "KeyError: 9999" in line]
    rows.append(Row("B19. forged page requests (too few inputs; an unknown event number)",
                    "refused; one line each in the server log", f"{forged_answers[0]}; {len(said)} lines: "
                    + " / ".join(line.partition(" WARNING ")[2] or line for line in said)[:160],
                    forged_answers[1] and len(said) == 2 and not any(line.startswith((" ", "Traceback"))
                                                                     for line in forged_log)))
    looked_up = sorted(set(hosts.read_text(encoding="utf-8").split()))
    rows.append(Row("B6. python app.py from its start to its stop (every lookup and connection recorded)",
                    "no host but this machine", ", ".join(looked_up) or "none", not looked_up))
    rows.append(Row("server log during these requests", "no traceback",
                    f"{log_text.count('Traceback')} tracebacks" if "Traceback" in log_text else "none",
                    "Traceback" not in log_text))

    root, elsewhere = work / "probe2-batch-root", work / "probe2-another-users-job"
    root.mkdir()
    elsewhere.mkdir()
    shutil.copyfile(inputs.face, root / "mine.jpg")
    shutil.copyfile(inputs.short_speech, root / "mine.wav")
    shutil.copyfile(inputs.face, elsewhere / "face.jpg")
    (root / "theirs.jpg").symlink_to(elsewhere / "face.jpg")
    for pairing in ("stem", "cross"):
        items = plan_items(collect_files(root), pairing, base_dir=root)
        used = sorted({path.name for item in items if not item.problem
                       for path in (item.face_path, item.audio_path) if path is not None})
        said = [item.problem for item in items if "theirs" in (item.problem or "")]
        rows.append(Row(f"B5. a --batch-root folder with a link to another user's file ({pairing} pairing)",
                        "the link skipped with a line saying so", f"paired {used}; {'; '.join(said)[:100]}",
                        used == ["mine.jpg", "mine.wav"] and len(said) == 1 and "outside" in said[0]))

    face_copy, folder, fifo = work / "probe2 f.jpg", work / "probe2 videos", work / "probe2 pipe.wav"
    shutil.copyfile(inputs.face, face_copy)
    folder.mkdir()
    os.mkfifo(fifo)
    kept = face_copy.read_bytes()
    overwrite = heygem_command("generate", "-o", face_copy, "--face", face_copy, "--audio", inputs.short_speech)
    rows.append(one_line_exit_2_row("B8. python -m heygem generate -o f.jpg --face f.jpg", overwrite, "input", work))
    rows.append(Row("B8. f.jpg after it", "unchanged", "unchanged" if face_copy.read_bytes() == kept else "overwritten",
                    face_copy.read_bytes() == kept))
    rows.append(one_line_exit_2_row("B20. generate -o naming a folder", heygem_command(
        "generate", "-o", folder, "--face", inputs.face, "--audio", inputs.short_speech), "folder", work))
    rows.append(one_line_exit_2_row("B21. generate --text-file /dev/zero --max-text-chars 100", heygem_command(
        "generate", "-o", folder / "out.mp4", "--face", inputs.face, "--text-file", "/dev/zero",
        "--max-text-chars", "100"), "more than 100", work))
    for label, path, words in (("B22. a folder as --audio", folder, "is a folder"),
                               ("B22. a FIFO as --audio", fifo, "not a regular file"),
                               ("B22. /dev/zero as --audio", Path("/dev/zero"), "not a regular file")):
        rows.append(one_line_exit_2_row(label, heygem_command(
            "generate", "-o", folder / "out.mp4", "--face", inputs.face, "--audio", path), words, work))
    rows.append(one_line_exit_2_row("B14. generate --face-index 3 on a photo of one face", heygem_command(
        "generate", "-o", folder / "out.mp4", "--face", inputs.face, "--audio", inputs.short_speech,
        "--face-index", "3"), "only 1 face", work))
    return rows


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
        if "requests" in args.parts:
            report["rows"] += [asdict(row) for row in requests_part(work, inputs, timeout)]
        if "users" in args.parts:
            report["rows"] += [asdict(row) for row in users_part(work, inputs, timeout)]
        if "probe2" in args.parts:
            report["rows"] += [asdict(row) for row in second_probe_part(work, inputs)]
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
