"""Live mode from a client's side: aiortc clients send a WAV as their microphone in real time and measure what
comes back.

    python bench/bench_live.py [--speech assets/speech_en.wav] [--seconds 8] [--sessions 1] [--height 360]
                               [--engine auto|landmark|wav2lip|musetalk] [--random-wav2lip]
                               [--random-musetalk full|reduced]

Serves the REST API's routes (live included) with uvicorn in this process, then runs ``--sessions`` clients at
once on the bundled portrait; for each:

- first frame: seconds from the POST /api/live to the first video frame received;
- fps: frames received per second (the session sends 25);
- mouth delay: glass-to-glass, the lag at which the received mouth's opening (how far its box is from the
  mouth at rest) best follows the sent speech's loudness (cross-correlated, 10 ms steps), and that correlation;
- sound delay: the same for the sound received against the sound sent; mouth - sound is how far the mouth
  is from its sound (what the viewer sees; positive: the mouth is late);
- frames a call: the frames the sessions' shared engine drew per engine call, mid-run (nan for the landmark
  engine, which draws in each session's thread).

Prints a Markdown table. The server allows ``--sessions`` sessions (as app.py's --max-live N), so the sessions
on one engine share it with a batch of N faces a call (heygem.live.batching; at most 8). On a GPU machine
``--sessions N`` counts how many sessions hold 25 fps each (read "fps" and "lowest fps of any session"), and
``--engine wav2lip`` runs the sessions on the Wav2Lip checkpoint found in the weights folder (weights/, or
$HEYGEM_WEIGHTS), on the GPU: a random-init checkpoint in the public layout
(``--random-wav2lip``) costs the same time per frame as a trained one. ``--engine musetalk`` runs them on the
MuseTalk files in the weights folder's musetalk/, or with ``--random-musetalk full`` on random-init files of
the published sizes (the same cost per frame as the official ones; ``reduced``: small layers, for a CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from live_client import mouth_delay, portrait_mouth_box, serving, smoothed, talk  # noqa: E402


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


async def frames_a_call(seconds: float) -> float:
    """Frames the shared engines drew per call over ``seconds`` (heygem.live.batching), from a second in."""
    from heygem.live.batching import engines_in_use

    await asyncio.sleep(1.0 + seconds / 4)  # the sessions started and their rates ramped up
    before = {name: (calls, frames) for name, _, calls, frames in engines_in_use()}
    await asyncio.sleep(seconds / 2)
    calls = frames = 0
    for name, _, now_calls, now_frames in engines_in_use():
        first_calls, first_frames = before.get(name, (0, 0))
        calls, frames = calls + now_calls - first_calls, frames + now_frames - first_frames
    return frames / calls if calls else float("nan")  # nan: an engine that draws in each session's thread


async def run(url: str, speech: np.ndarray, seconds: float, sessions: int, box) -> list[dict]:
    *results, per_call = await asyncio.gather(*(talk(url, speech, seconds, mouth_box=box) for _ in range(sessions)),
                                              frames_a_call(seconds))
    rows = []
    for result in results:
        times = [when for when, _ in result.frames]
        settled = [when for when in times if when > times[0] + 1.0]
        lag, correlation = mouth_delay(result)
        sound = sound_delay(result)
        rows.append({"first frame s": times[0] - result.connected,
                     "fps": (len(settled) - 1) / (settled[-1] - settled[0]),
                     "mouth delay s": lag, "correlation": correlation, "sound delay s": sound,
                     "mouth - sound s": lag - sound, "server delay s": result.answer["delay_seconds"],
                     "frames a call": per_call,
                     "engine": result.answer["engine"], "reason": result.answer["engine_reason"]})
    return rows


def write_random_wav2lip() -> None:
    """A random-init Wav2Lip checkpoint in a temporary weights folder, which $HEYGEM_WEIGHTS then names."""
    import os

    import torch

    from heygem.models.wav2lip import Wav2Lip

    folder = Path(tempfile.mkdtemp(prefix="bench-live-weights-"))
    torch.save({"state_dict": Wav2Lip().state_dict()}, folder / "wav2lip.pth")
    os.environ["HEYGEM_WEIGHTS"] = str(folder)


def write_random_musetalk(size: str) -> None:
    """Random-init MuseTalk files (``size`` full or reduced) in a temporary weights folder's musetalk/, which
    $HEYGEM_WEIGHTS then names."""
    import os

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
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from heygem.live.sessions import LiveSettings
    from heygem.speech.audio import load_audio_16k

    if args.random_wav2lip:
        write_random_wav2lip()
    if args.random_musetalk:
        write_random_musetalk(args.random_musetalk)
    speech = load_audio_16k(args.speech)
    box = portrait_mouth_box(args.height)
    rows = []
    with serving(Path(tempfile.mkdtemp(prefix="bench-live-")),
                 live=LiveSettings(max_sessions=args.sessions, output_height=args.height, engine=args.engine)) as url:
        for number in range(args.runs):
            found = asyncio.run(run(url, speech, args.seconds, args.sessions, box))
            if number > 0 or args.runs == 1:
                rows += found
    columns = ["first frame s", "fps", "mouth delay s", "correlation", "sound delay s", "mouth - sound s",
               "server delay s", "frames a call"]
    print(f"{args.sessions} session(s), {args.height}p, engine {rows[0]['engine']} ({rows[0]['reason']}), "
          f"median of {len(rows)}:")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    print("| " + " | ".join(f"{statistics.median(row[column] for row in rows):.3f}" for column in columns) + " |")
    print(f"lowest fps of any session: {min(row['fps'] for row in rows):.2f}")


if __name__ == "__main__":
    main()
