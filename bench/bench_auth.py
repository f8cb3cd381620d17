"""A signed-in user's REST latency while anonymous clients send random API keys, on loopback.

    python bench/bench_auth.py [--attack bare|named] [--requests 40] [--pause 0.05] [--seconds 30] [--no-limit]
                                [--code DIR]

Serves the REST API alone (``create_router`` in uvicorn, on 127.0.0.1, a free port) with a users file
of three users whose secrets are hashed as ``python -m heygem users hash`` hashes them (600,000
PBKDF2 iterations). Then measures ``GET /api/jobs`` of one signed-in user (basic auth, from the source
address 127.0.0.2), ``--requests`` times ``--pause`` seconds apart, first alone and then while two loops (from
127.0.0.1) send ``Authorization: Bearer`` keys nobody has: random strings (``--attack bare``) or
``bob:RANDOM`` (``named``, each a hash to check). Each phase stops after ``--requests`` requests or
``--seconds``, whichever comes first. ``--no-limit`` lifts the failure limit, where the code has one,
to show the cost of the checks alone; ``--code DIR`` imports heygem from DIR instead (an older tree,
for a before-and-after).

Prints the user's median, 90th percentile and slowest request, the anonymous requests sent and how
they were answered.
"""

from __future__ import annotations

import argparse
import secrets
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
USERS = {"alice": "alice-long-secret", "bob": "bob-long-secret", "carol": "carol-long-secret"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(folder: Path, no_limit: bool):
    """uvicorn serving the REST API over a fresh store in ``folder``; (server, its thread, its URL)."""
    import uvicorn
    from fastapi import FastAPI

    from heygem.jobs.api import create_router
    from heygem.jobs.store import JobStore
    from heygem.jobs.users import Users, hash_secret

    users_file = folder / "users.txt"
    users_file.write_text("".join(f"{name}:{hash_secret(secret)}\n" for name, secret in USERS.items()),
                          encoding="utf-8")
    options = {}
    if no_limit:
        try:
            from heygem.jobs.users import FailedSignIns
        except ImportError:  # code without a failure limit
            pass
        else:
            options["sign_ins"] = FailedSignIns(allowed=10**9)
    router = create_router(JobStore(folder / "outputs"), users=Users.load(users_file), **options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(FastAPI(routes=router.routes), host="127.0.0.1", port=port,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def user_latencies(url: str, count: int, pause: float, seconds: float) -> list[float]:
    """Seconds each of the signed-in user's requests took (``pause`` seconds apart, from 127.0.0.2)."""
    import httpx

    times = []
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(base_url=url, auth=("bob", USERS["bob"]), transport=transport, timeout=120) as client:
        client.get("/api/jobs").raise_for_status()  # the first check of a right secret: not timed
        deadline = time.monotonic() + seconds
        while len(times) < count and time.monotonic() < deadline:
            start = time.perf_counter()
            client.get("/api/jobs").raise_for_status()
            times.append(time.perf_counter() - start)
            time.sleep(pause)
    return times


def anonymous_loop(url: str, attack: str, stop: threading.Event, answers: Counter) -> None:
    import httpx

    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            key = secrets.token_urlsafe(16)
            key = f"bob:{key}" if attack == "named" else key
            try:
                answers[client.get("/api/jobs", headers={"Authorization": f"Bearer {key}"}).status_code] += 1
            except httpx.HTTPError as error:
                answers[type(error).__name__] += 1


def summary(times: list[float]) -> str:
    if not times:
        return "no request finished"
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return (f"{len(times)} requests: median {statistics.median(ordered) * 1000:.1f} ms, "
            f"p90 {p90 * 1000:.1f} ms, slowest {ordered[-1] * 1000:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attack", choices=("bare", "named"), default="bare")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds between the user's requests")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--no-limit", action="store_true")
    parser.add_argument("--code", type=Path, default=REPO, help="where heygem is imported from (default: this tree)")
    args = parser.parse_args()
    sys.path.insert(0, str(args.code.resolve()))
    import heygem

    print(f"heygem from {Path(heygem.__file__).parent}; attack: {args.attack}; limit: {not args.no_limit}")
    with tempfile.TemporaryDirectory(prefix="heygem-bench-auth-") as folder:
        server, thread, url = serve(Path(folder), args.no_limit)
        try:
            print("alone:          ", summary(user_latencies(url, args.requests, args.pause, args.seconds)))
            stop, answers = threading.Event(), Counter()
            loops = [threading.Thread(target=anonymous_loop, args=(url, args.attack, stop, answers), daemon=True)
                     for _ in range(2)]
            for loop in loops:
                loop.start()
            time.sleep(0.5)
            try:
                print("two key loops:  ", summary(user_latencies(url, args.requests, args.pause, args.seconds)))
            finally:
                stop.set()
                for loop in loops:
                    loop.join(timeout=120)
            print("anonymous answers:", dict(answers))
        finally:
            server.should_exit = True
            thread.join(timeout=30)


if __name__ == "__main__":
    main()
