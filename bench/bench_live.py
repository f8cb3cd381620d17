"""Live mode from a client's side: aiortc clients send a WAV as their microphone in real time and measure what
comes back.

    python bench/bench_live.py [--speech assets/speech_en.wav] [--seconds 8] [--sessions 1] [--height 360]
                               [--engine auto|landmark|wav2lip|musetalk] [--random-wav2lip]
                               [--random-musetalk full|reduced] [--client-processes K] [--switch-interval MS]
                               [--profile-thread NAME]

Serves the REST API's routes (live included) with uvicorn in this process, then runs ``--sessions`` clients at
once on the bundled portrait. The clients run in ``--client-processes`` other processes (multiprocessing,
"spawn": this process may hold CUDA), by default one per session, as each browser is its own process: a
client decodes VP8, sends and receives sound and keeps its measurements in Python, and in this process it
would share the interpreter's lock with the server's sessions (their encoders, conversions, blends and
pacing), so the bench would measure its own clients' contention rather than what the server does for remote
peers. ``--client-processes 0`` runs the clients in this process's event loop, as earlier versions did (to
reproduce their numbers). With fewer processes than sessions, the sessions are split evenly between them.
Each client process imports its libraries, says it is ready, starts its sessions when every process is ready
and sends its rows back over a pipe. For each session:

- first frame: seconds from the POST /api/live to the first video frame received;
- fps: frames received per second (the session sends 25);
- mouth delay: glass-to-glass, the lag at which the received mouth's opening (how far its box is from the
  mouth at rest) best follows the sent speech's loudness (cross-correlated, 10 ms steps), and that correlation;
- sound delay: the same for the sound received against the sound sent; mouth - sound is how far the mouth
  is from its sound (what the viewer sees; positive: the mouth is late);
- frames a call: the frames the sessions' shared engine drew per engine call, mid-run (nan for the landmark
  engine, which draws in each session's thread).

Prints a Markdown table (medians over the sessions and counted rounds), the lowest fps of any session, and
what the server's process spent mid-run (the middle half of each round, the window "frames a call" reads):
its CPU seconds over the wall seconds (cores busy), the share of that time the shared engine's thread spent
in engine calls and the milliseconds a call (the engine is the wall when it is busy nearly all the time; when
it is not, yet draws few frames a call, the sessions hand their frames in out of step), the session frames
rendered (each from its due time, in its session's thread: the median and 95th percentile of a render, how
long after its due time the 95th percentile frame was done, and the frames the video tracks' pacers skipped
because their track fell more than a frame behind), and its threads' cores by kind (from
/proc/self/task/*/stat, named after Python's threads: "heygem-live-<engine>" a shared engine's thread,
"heygem-live-<session>_0" a session's render thread, "Thread-N (run)" uvicorn's event loop, where aiortc
packs and paces every session's media, "asyncio_N" the loop's executor, where aiortc encodes). A thread near
1.0 core is a wall for whatever waits on it; threads that together stay near 1.0 core while the GPU idles
point at the interpreter's lock. With ``--client-processes 0`` these include the clients.

The server allows ``--sessions`` sessions (as app.py's --max-live N), so the sessions on one engine share it
with a batch of N faces a call (heygem.live.batching; at most 8). On a GPU machine ``--sessions N`` counts how
many sessions hold 25 fps each (read "fps" and "lowest fps of any session"), and ``--engine wav2lip`` runs the
sessions on the Wav2Lip checkpoint found in the weights folder (weights/, or $HEYGEM_WEIGHTS), on the GPU: a
random-init checkpoint in the public layout (``--random-wav2lip``) costs the same time per frame as a trained
one. ``--engine musetalk`` runs them on the MuseTalk files in the weights folder's musetalk/, or with
``--random-musetalk full`` on random-init files of the published sizes (the same cost per frame as the
official ones; ``reduced``: small layers, for a CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from live_client import mouth_delay, portrait_mouth_box, serving, smoothed, talk  # noqa: E402
from sampling import ThreadSampler  # noqa: E402

READY_SECONDS = 300  # how long a client process may take to import its libraries (a cold disk, a busy machine)
KINDS_SHOWN = 6  # busiest kinds of server threads printed per round


def sound_delay(result, step: float = 0.01, most: float = 1.0) -> float:
    """The lag at which the received sound's loudness best follows the sent one's."""
    sent_times, sent_rms = np.array(result.sent).T
    got_times, got_rms = np.array(result.audio_received).T
    start, stop = max(sent_times[0], got_times[0]), min(sent_times[-1], got_times[-1])
    count = int((stop - start) / step)
    sent = np.interp(start + step * np.arange(count), sent_times, smoothed(sent_rms, 3))
    best = (0.0, -1.0)
    for lag in range(int(most / step)):
        got = np.interp(start + lag * step + step * np.arange(count), got_times, smoothed(got_rms, 3))
        correlation = float(np.corrcoef(sent, got)[0, 1])
        if correlation > best[1]:
            best = (lag * step, correlation)
    return best[0]


def measured(result) -> dict:
    """One session's row (all but "frames a call", which the server's process reads) from its TalkResult."""
    times = [when for when, _ in result.frames]
    settled = [when for when in times if when > times[0] + 1.0]
    lag, correlation = mouth_delay(result)
    sound = sound_delay(result)
    return {"first frame s": times[0] - result.connected,
            "fps": (len(settled) - 1) / (settled[-1] - settled[0]),
            "mouth delay s": lag, "correlation": correlation, "sound delay s": sound,
            "mouth - sound s": lag - sound, "server delay s": result.answer["delay_seconds"],
            "engine": result.answer["engine"], "reason": result.answer["engine_reason"]}


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) each thread of this process has run, by thread id (Linux /proc; empty
    elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    seconds = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime: fields 14 and 15
    return seconds


def thread_kind(name: str) -> str:
    """The kind of a server thread, from its name: a session's render thread, the event loop's executor, a
    thread Python did not start, or the name with the numbers after a - or _ as N."""
    if re.fullmatch(r"heygem-live-[0-9a-f]{6}_\d+", name):
        return "session render"
    if name.startswith("native "):
        return "outside Python"
    return re.sub(r"(?<=[-_])\d+", "N", name)  # Thread-3 (run): Thread-N (run); heygem-live-wav2lip as it is


def threads_by_kind(before: dict[int, float], after: dict[int, float], wall: float) -> list[tuple[str, int, float]]:
    """(kind, threads, cores) of the threads that ran between two :func:`thread_cpu_seconds`, busiest kind
    first; a thread Python did not start (a library's own) is "outside Python"."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    kinds: dict[str, list[float]] = {}
    for tid, seconds in after.items():
        kinds.setdefault(thread_kind(names.get(tid, f"native {tid}")), []).append(seconds - before.get(tid, 0.0))
    return sorted(((kind, len(spent), sum(spent) / wall) for kind, spent in kinds.items()), key=lambda row: -row[2])


RENDERED: list[tuple[float, float, float]] = []  # per session frame: (monotonic end, render s, s after its due time)
SKIPPED: list[tuple[float, int]] = []  # per skip of a video track's pacer: (monotonic time, frames skipped)


def watch_frames() -> None:
    """Time every session frame's render in this process (heygem.live.sessions.LiveSession.render, which a video
    track calls in the session's thread from the frame's due time) and count the frames the video tracks' pacers
    skip (a track more than a frame behind skips to the frame due now): what a session's frames cost and how
    late they were, beside what the clients received."""
    from heygem.live import sessions, tracks

    render = sessions.LiveSession.render
    next_due = tracks._Pacer.next_due

    def timed(self, wall_time: float, shown_seconds: float):
        started = time.monotonic()
        try:
            return render(self, wall_time, shown_seconds)
        finally:
            ended = time.monotonic()
            RENDERED.append((ended, ended - started, ended - wall_time))

    async def counted(self):
        expected = self.index
        index, due = await next_due(self)
        if self.on_grid and index > expected:  # the video tracks' pacers are on the grid, the audio tracks' not
            SKIPPED.append((time.monotonic(), index - expected))
        return index, due

    sessions.LiveSession.render = timed
    tracks._Pacer.next_due = counted


def frame_times(start: float, stop: float) -> dict:
    """The session frames rendered between two monotonic times: their render's median and 95th percentile ms, the
    95th percentile of how long after its due time a frame was done, and the video frames the pacers skipped."""
    renders = [(seconds, late) for ended, seconds, late in list(RENDERED) if start <= ended < stop]
    skipped = sum(count for when, count in list(SKIPPED) if start <= when < stop)
    if not renders:
        return {"frames rendered": 0, "render ms": float("nan"), "render ms p95": float("nan"),
                "late ms p95": float("nan"), "skipped": skipped}
    seconds, late = (np.array(values) * 1000 for values in zip(*renders))
    return {"frames rendered": len(renders), "render ms": float(np.median(seconds)),
            "render ms p95": float(np.percentile(seconds, 95)), "late ms p95": float(np.percentile(late, 95)),
            "skipped": skipped}


def server_window(seconds: float) -> dict:
    """What this process (the server) did over the middle half of a round of ``seconds``: the frames its shared
    engines drew per call (heygem.live.batching; nan for an engine that draws in each session's thread), the
    share of the wall time their threads spent in calls and the milliseconds a call, its CPU seconds and wall
    seconds, and its threads' cores."""
    from heygem.live.batching import engines_in_use

    time.sleep(1.0 + seconds / 4)  # the sessions started and their rates ramped up
    before = {use.name: use for use in engines_in_use()}
    cpu_before, wall_before, threads_before = time.process_time(), time.monotonic(), thread_cpu_seconds()
    time.sleep(seconds / 2)
    cpu, wall = time.process_time() - cpu_before, time.monotonic() - wall_before
    frame_times_seen = frame_times(wall_before, wall_before + wall)
    threads = threads_by_kind(threads_before, thread_cpu_seconds(), wall)
    calls = frames = 0
    busy = 0.0
    for use in engines_in_use():
        first = before.get(use.name)
        calls += use.calls - (first.calls if first else 0)
        frames += use.frames - (first.frames if first else 0)
        busy += use.busy_seconds - (first.busy_seconds if first else 0.0)
    return {"frames a call": frames / calls if calls else float("nan"), "cpu s": cpu, "wall s": wall,
            "threads": threads, "engine busy": busy / wall, "ms a call": 1000 * busy / calls if calls else float("nan"),
            "frame times": frame_times_seen}


async def talk_all(url: str, speech: np.ndarray, seconds: float, sessions: int, box) -> list:
    return await asyncio.gather(*(talk(url, speech, seconds, mouth_box=box) for _ in range(sessions)))


async def run_in_process(url: str, speech: np.ndarray, seconds: float, sessions: int, box) -> tuple[list, dict]:
    """A round with the clients in this process's event loop (``--client-processes 0``)."""
    results, server = await asyncio.gather(talk_all(url, speech, seconds, sessions, box),
                                           asyncio.to_thread(server_window, seconds))
    return [measured(result) for result in results], server


def client_process(connection, url: str, speech: np.ndarray, seconds: float, sessions: int, box) -> None:
    """A spawned process's clients: imports their libraries, sends "ready", waits for "go", runs ``sessions``
    clients at once and sends back their rows (a list of dicts), or a traceback's text if they failed."""
    try:
        import aiortc  # noqa: F401 - imported before "ready", so that every process starts its clients at once
        import av  # noqa: F401
        import httpx  # noqa: F401

        connection.send("ready")
        connection.recv()
        results = asyncio.run(talk_all(url, speech, seconds, sessions, box))
        connection.send([measured(result) for result in results])
    except Exception:  # noqa: BLE001 - the parent prints it
        connection.send(traceback.format_exc())
    finally:
        connection.close()


def clients_per_process(sessions: int, processes: int) -> list[int]:
    """``sessions`` split as evenly as they go over at most ``processes`` processes (none left empty)."""
    processes = max(1, min(processes, sessions))
    return [sessions // processes + (index < sessions % processes) for index in range(processes)]


def received(connection, worker, timeout: float):
    """The next message from a client process, or SystemExit if it died or took longer than ``timeout``."""
    if not connection.poll(timeout):
        raise SystemExit(f"a client process sent nothing for {timeout:g} s (alive: {worker.is_alive()})")
    try:
        message = connection.recv()
    except EOFError:
        raise SystemExit(f"a client process ended (exit code {worker.exitcode}) without its results") from None
    if isinstance(message, str) and message not in ("ready",):
        raise SystemExit(f"a client process failed:\n{message}")
    return message


def run_in_processes(url: str, speech: np.ndarray, seconds: float, counts: list[int], box) -> tuple[list, dict]:
    """A round with ``counts[i]`` clients in spawned process i; this process only serves (and measures)."""
    context = multiprocessing.get_context("spawn")  # a fork would copy this process's CUDA state and threads
    workers = []
    for count in counts:
        ours, theirs = context.Pipe()
        worker = context.Process(target=client_process, args=(theirs, url, speech, seconds, count, box),
                                 daemon=True)
        worker.start()
        theirs.close()  # ours then reads EOF if the process dies
        workers.append((ours, worker))
    try:
        for connection, worker in workers:
            received(connection, worker, READY_SECONDS)
        for connection, _ in workers:
            connection.send("go")
        server = server_window(seconds)
        rows = []
        for connection, worker in workers:
            rows += received(connection, worker, seconds + READY_SECONDS)
    finally:
        for connection, worker in workers:
            connection.close()
            worker.join(30)
            if worker.is_alive():
                worker.kill()
    return rows, server


def write_random_wav2lip() -> None:
    """A random-init Wav2Lip checkpoint in a temporary weights folder, which $HEYGEM_WEIGHTS then names."""
    import torch

    from heygem.models.wav2lip import Wav2Lip

    folder = Path(tempfile.mkdtemp(prefix="bench-live-weights-"))
    torch.save({"state_dict": Wav2Lip().state_dict()}, folder / "wav2lip.pth")
    os.environ["HEYGEM_WEIGHTS"] = str(folder)


def write_random_musetalk(size: str) -> None:
    """Random-init MuseTalk files (``size`` full or reduced) in a temporary weights folder's musetalk/, which
    $HEYGEM_WEIGHTS then names."""
    from heygem.engines.musetalk.random_files import write_random_files

    folder = Path(tempfile.mkdtemp(prefix="bench-live-weights-"))
    write_random_files(folder / "musetalk", size=size)
    os.environ["HEYGEM_WEIGHTS"] = str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speech", type=Path, default=REPO / "assets" / "speech_en.wav")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each client talks and watches")
    parser.add_argument("--sessions", type=int, default=1, help="clients at once")
    parser.add_argument("--height", type=int, default=360, help="the sessions' frame height")
    parser.add_argument("--runs", type=int, default=3, help="rounds (the first warms the server up, not counted)")
    parser.add_argument("--engine", default="auto",
                        help="the sessions' engine (as app.py's --live-engine): auto, landmark, wav2lip, musetalk")
    parser.add_argument("--random-wav2lip", action="store_true",
                        help="run on a random-init Wav2Lip checkpoint written to a temporary weights folder "
                             "(the same cost per frame as a trained one; the mouths are noise)")
    parser.add_argument("--random-musetalk", choices=("full", "reduced"),
                        help="run on random-init MuseTalk files written to a temporary weights folder: full (the "
                             "published sizes, the same cost per frame as the official files) or reduced (for a CPU)")
    parser.add_argument("--client-processes", type=int, default=None,
                        help="processes the clients run in (default: one per session; 0: in this process, with "
                             "the server, as earlier versions ran them)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="the server process's interpreter switch interval in ms (sys.setswitchinterval; "
                             "Python's default 5): a thread that waits for the interpreter's lock waits up to this "
                             "long each time, and an engine thread that takes it back after every GPU or OpenCV "
                             "call may wait that often")
    parser.add_argument("--profile-thread", default="", metavar="NAME",
                        help="print where the server's threads whose names start with NAME spent the counted rounds, "
                             "sampled (e.g. heygem-live-wav2lip: the shared engine's thread; heygem-live-: every "
                             "live thread)")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1000)
    processes = args.sessions if args.client_processes is None else args.client_processes
    logging.basicConfig(level=logging.WARNING)

    from heygem.live.sessions import LiveSettings
    from heygem.speech.audio import load_audio_16k

    if args.random_wav2lip:
        write_random_wav2lip()
    if args.random_musetalk:
        write_random_musetalk(args.random_musetalk)
    speech = load_audio_16k(args.speech)
    box = portrait_mouth_box(args.height)
    watch_frames()
    rows, servers = [], []
    with serving(Path(tempfile.mkdtemp(prefix="bench-live-")),
                 live=LiveSettings(max_sessions=args.sessions, output_height=args.height, engine=args.engine)) as url:
        sampler = ThreadSampler(args.profile_thread) if args.profile_thread else None
        for number in range(args.runs):
            if sampler is not None and (number == 1 or args.runs == 1):
                sampler.__enter__()  # the counted rounds only
            if processes > 0:
                found, server = run_in_processes(url, speech, args.seconds,
                                                 clients_per_process(args.sessions, processes), box)
            else:
                found, server = asyncio.run(run_in_process(url, speech, args.seconds, args.sessions, box))
            if number > 0 or args.runs == 1:
                rows += [dict(row, **{"frames a call": server["frames a call"]}) for row in found]
                servers.append(server)
        if sampler is not None:
            sampler.__exit__(None, None, None)
    columns = ["first frame s", "fps", "mouth delay s", "correlation", "sound delay s", "mouth - sound s",
               "server delay s", "frames a call"]
    where = (f"clients in {len(clients_per_process(args.sessions, processes))} other process(es)" if processes > 0
             else "clients in the server's process")
    switch = f"switch interval {sys.getswitchinterval() * 1000:g} ms"
    print(f"{args.sessions} session(s), {args.height}p, engine {rows[0]['engine']} ({rows[0]['reason']}), {where}, "
          f"{switch}, median of {len(rows)}:")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    print("| " + " | ".join(f"{statistics.median(row[column] for row in rows):.3f}" for column in columns) + " |")
    print(f"lowest fps of any session: {min(row['fps'] for row in rows):.2f}")
    for server in servers:
        kinds = ", ".join(f"{kind} x{count} {cores:.2f}" for kind, count, cores in server["threads"][:KINDS_SHOWN])
        engine = (f"shared engine busy {server['engine busy']:.2f} of the time, {server['ms a call']:.1f} ms a call"
                  if not math.isnan(server["ms a call"]) else "no shared engine")
        times = server["frame times"]
        print(f"server process mid-run: {server['cpu s']:.2f} CPU s in {server['wall s']:.2f} s "
              f"({server['cpu s'] / server['wall s']:.2f} cores); {engine}; session frames: {times['frames rendered']} "
              f"rendered, {times['render ms']:.1f} ms each (95th percentile {times['render ms p95']:.1f}), done "
              f"{times['late ms p95']:.1f} ms after their due time (95th percentile), {times['skipped']} skipped; "
              f"its threads by kind (cores): {kinds}")
    if sampler is not None:
        print(sampler.report())


if __name__ == "__main__":
    main()
