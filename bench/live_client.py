"""A live-mode client (aiortc) for the benchmark and the tests: it sends a WAV as its microphone in real time
and keeps, for every frame it receives, when it came and the mouth region's brightness.

    result = asyncio.run(talk(url, speech_16k, seconds=6.0))

Also: the server's routes served by uvicorn on a free port in this process (:func:`serving`), the mouth
region of the bundled portrait as a session shows it (:func:`portrait_mouth_box`), and the glass-to-glass
delay from what was sent and received (:func:`mouth_delay`, from the mouth's opening: :func:`mouth_opening`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
CHUNK = 320  # 20 ms at 16 kHz


def free_port() -> int:
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return probe_socket.getsockname()[1]


@contextlib.contextmanager
def serving(outputs: Path, **router_options):
    """The REST API's routes (heygem.jobs.api.create_router, live routes included) served by uvicorn on a free
    port in a thread; yields the base URL."""
    import uvicorn
    from fastapi import FastAPI

    from heygem.jobs.api import create_router
    from heygem.jobs.store import JobStore

    store = JobStore(outputs)
    app = FastAPI(routes=create_router(store, **router_options).routes)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def portrait_mouth_box(height: int = 360) -> tuple[int, int, int, int]:
    """(x1, y1, x2, y2) around the bundled portrait's lips (and the chin's room to open) in a session's frames."""
    from heygem.config import apply_overrides, load_config
    from heygem.live.face import BUNDLED_PORTRAIT, load_face
    from heygem.presenters.prepare import MOUTH_RING

    face = load_face(BUNDLED_PORTRAIT, apply_overrides(load_config(), {"media.output_height": height}), "portrait")
    lips = face.faces[0].landmarks[list(MOUTH_RING)]
    (x1, y1), (x2, y2) = lips.min(axis=0), lips.max(axis=0)
    pad = 0.3 * (x2 - x1)
    return int(x1 - pad), int(y1 - pad), int(x2 + pad), int(y2 + 1.2 * pad)


def microphone(speech_16k: np.ndarray, sent: list):
    """An aiortc audio track playing ``speech_16k`` in real time (then silence), noting (wall time, RMS) of
    every 20 ms chunk in ``sent``."""
    import av
    from aiortc import MediaStreamTrack

    class WavMicrophone(MediaStreamTrack):
        kind = "audio"

        def __init__(self):
            super().__init__()
            self.index, self.start = 0, None

        async def recv(self):
            if self.start is None:
                self.start = time.monotonic()
            due = self.start + self.index * CHUNK / SAMPLE_RATE
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            chunk = speech_16k[self.index * CHUNK: (self.index + 1) * CHUNK]
            chunk = np.pad(chunk, (0, CHUNK - len(chunk)))
            sent.append((due, float(np.sqrt(np.mean(chunk ** 2)))))
            frame = av.AudioFrame.from_ndarray((chunk * 32767).astype(np.int16)[None], format="s16", layout="mono")
            frame.sample_rate, frame.pts = SAMPLE_RATE, self.index * CHUNK
            frame.time_base = fractions.Fraction(1, SAMPLE_RATE)
            self.index += 1
            return frame

    return WavMicrophone()


@dataclass
class TalkResult:
    answer: dict
    connected: float  # wall time the POST was sent
    frames: list = field(default_factory=list)  # (wall time, (h, w) uint8 luma of the mouth box) per frame
    full_frames: list = field(default_factory=list)  # a few whole frames (H, W) luma, for looking at
    sent: list = field(default_factory=list)  # (wall time, RMS) per 20 ms of microphone
    audio_received: list = field(default_factory=list)  # (wall time, RMS) per audio frame received


async def talk(url: str, speech_16k: np.ndarray, seconds: float, mouth_box=None, presenter: str | None = None,
               headers: dict | None = None, during=None, at_least_frames: int = 0,
               waiting_at_most: float = 60.0) -> TalkResult:
    """One session: ``speech_16k`` as the microphone, frames received for ``seconds`` (and on, up to
    ``waiting_at_most`` seconds more, until ``at_least_frames`` came: a slow engine on a busy machine);
    ``during(session id, client)`` is awaited once connected (to /say, say); the session is ended (DELETE) at
    the end."""
    import httpx
    from aiortc import RTCPeerConnection, RTCSessionDescription

    peer = RTCPeerConnection()
    result = TalkResult(answer={}, connected=time.monotonic())
    peer.addTrack(microphone(speech_16k, result.sent))
    peer.addTransceiver("video", direction="recvonly")
    tasks = []

    @peer.on("track")
    def on_track(track):
        async def read():
            while True:
                try:
                    frame = await track.recv()
                except Exception:  # noqa: BLE001 - the track ended
                    return
                now = time.monotonic()
                if track.kind == "video":
                    luma = frame.to_ndarray(format="gray")
                    x1, y1, x2, y2 = mouth_box or (0, 0, luma.shape[1], luma.shape[0])
                    result.frames.append((now, luma[y1:y2, x1:x2].copy()))
                    if len(result.frames) % 25 == 1:
                        result.full_frames.append(luma)
                else:
                    samples = frame.to_ndarray().astype(np.float32) / 32768.0
                    result.audio_received.append((now, float(np.sqrt(np.mean(samples ** 2)))))

        tasks.append(asyncio.ensure_future(read()))

    await peer.setLocalDescription(await peer.createOffer())
    # a server that compiles its MuseTalk step answers its first sessions about a minute later
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:
        offer = {"sdp": peer.localDescription.sdp, "type": "offer"}
        if presenter:
            offer["presenter"] = presenter
        result.connected = time.monotonic()
        response = await client.post("/api/live", json=offer)
        response.raise_for_status()
        result.answer = response.json()
        await peer.setRemoteDescription(RTCSessionDescription(sdp=result.answer["sdp"], type="answer"))
        if during is not None:
            await during(result.answer["session"], client)
        await asyncio.sleep(seconds)
        deadline = time.monotonic() + waiting_at_most
        while len(result.frames) < at_least_frames and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await client.delete(f"/api/live/{result.answer['session']}")
    await peer.close()
    for task in tasks:
        task.cancel()
    return result


def envelope_on_grid(times: np.ndarray, values: np.ndarray, start: float, step: float, count: int) -> np.ndarray:
    """``values`` measured at ``times`` on a regular grid (linear interpolation, edges held)."""
    return np.interp(start + step * np.arange(count), times, values)


def mouth_motion(result: TalkResult) -> tuple[np.ndarray, np.ndarray]:
    """(times, motion): how much the mouth box changed from the frame before, mean grey levels per pixel. A
    photo's frames are still but for the mouth; the video codec's own changes are small and rare."""
    times = np.array([when for when, _ in result.frames])
    crops = np.stack([crop.astype(np.float32) for _, crop in result.frames])  # (N, h, w)
    return times, np.r_[0.0, np.abs(np.diff(crops, axis=0)).mean(axis=(1, 2))]


def smoothed(values: np.ndarray, width: int) -> np.ndarray:
    return np.convolve(values, np.ones(width) / width, mode="same")


def mouth_opening(result: TalkResult) -> tuple[np.ndarray, np.ndarray]:
    """(times, opening): how far each frame's mouth box is from the mouth at rest (the median box of the
    session, which is mostly silent), mean grey levels per pixel: a level that follows the loudness itself,
    where the motion (:func:`mouth_motion`) follows its changes."""
    times = np.array([when for when, _ in result.frames])
    crops = np.stack([crop.astype(np.float32) for _, crop in result.frames])  # (N, h, w)
    rest = np.median(crops, axis=0)  # (h, w)
    return times, np.abs(crops - rest).mean(axis=(1, 2))


def mouth_delay(result: TalkResult, step: float = 0.01, most: float = 1.0) -> tuple[float, float]:
    """(seconds, correlation): the lag at which the received mouth's opening best follows the sent loudness
    (smoothed over 0.12 s and 3 frames), searched up to ``most`` seconds.

    The opening, not the motion: the motion between two frames stands for the change half a frame before the
    later one, and its cross-correlation with a loudness has two near peaks 60 ms apart on the bundled speech
    (one run gives 0.29 s, the next 0.36 s, at correlations of ~0.5); the opening's peak is one (0.32 s in
    each run, at ~0.7)."""
    sent_times, sent_rms = np.array(result.sent).T
    sent_rms = smoothed(sent_rms, 6)
    times, opening = mouth_opening(result)
    opening = smoothed(opening, 3)
    start, stop = max(sent_times[0], times[0]), min(sent_times[-1], times[-1])
    count = int((stop - start) / step)
    loud = envelope_on_grid(sent_times, sent_rms, start, step, count)
    best = (0.0, -1.0)
    for lag_steps in range(int(most / step)):
        mouth = envelope_on_grid(times, opening, start + lag_steps * step, step, count)
        correlation = float(np.corrcoef(loud, mouth)[0, 1])
        if correlation > best[1]:
            best = (lag_steps * step, correlation)
    return best
