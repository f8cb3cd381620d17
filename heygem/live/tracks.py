"""The tracks a session sends (aiortc MediaStreamTracks whose ``recv()`` returns the next frame when it is due).

Both follow the wall clock from their first ``recv()`` and show the session's sound ``delay`` seconds
late: the video frame due at wall time w shows the mouth of the sound at w - delay, and the audio chunk
due at w plays that same sound. ``delay`` is the engine's look-ahead (the sound it reads reaches that
far past the frame's time: heygem.live.engine_step's ``lookahead``) plus ARRIVAL_MARGIN for the sound's
packets to arrive. Frames are rendered in the session's own thread, so the event loop never waits on an
engine; a frame that could not be rendered in time is skipped, never queued. Every video track's frames fall
due on one grid of frame times (multiples of the frame period on the monotonic clock), so the frames of
sessions sharing an engine are due together and drawn in one call (heygem.live.batching).
"""

from __future__ import annotations

import asyncio
import fractions
import math
import time
from collections.abc import Callable

import numpy as np

AUDIO_CHUNK_SECONDS = 0.02  # 20 ms of sound per audio frame, as WebRTC sends it
VIDEO_CLOCK = 90_000  # RTP's video clock
# seconds a chunk of sound may reach the timeline after its place and still be read: the network's jitter is
# absorbed before (aiortc's receiver hands an audio packet over once four later ones came, 80 ms), so what is
# left is the event loop's lateness in handing the chunks over: at most 13 ms (99 % within 6 ms) over 786 chunks
# of a session on a busy 2-core machine; 40 ms is three times that
ARRIVAL_MARGIN = 0.04


def _media_track_base():
    from aiortc import MediaStreamTrack

    return MediaStreamTrack


class _Pacer:
    """Frame n of a track is due ``n * period`` after its first: sleeps until then; a track that fell more than
    a frame behind skips to the frame due now. ``on_grid``: the first frame is due at the next multiple of
    ``period`` on the monotonic clock (within one period), so every such track's frames are due together."""

    def __init__(self, period: float, on_grid: bool = False):
        self.period = period
        self.on_grid = on_grid
        self.start: float | None = None
        self.index = 0

    async def next_due(self) -> tuple[int, float]:
        """(frame number, wall time it is due), after waiting for it."""
        now = time.monotonic()
        if self.start is None:
            self.start = math.ceil(now / self.period) * self.period if self.on_grid else now
        due = self.start + self.index * self.period
        if now > due + self.period:  # late: skip to now
            self.index = int((now - self.start) / self.period)
            due = self.start + self.index * self.period
        elif due > now:
            await asyncio.sleep(due - now)
        index = self.index
        self.index += 1
        return index, due


def presenter_video_track(render: Callable[[float, float], np.ndarray], fps: float, run_in_thread):
    """A video track of ``fps`` frames a second; frame due at wall time w is ``render(w, seconds since the
    first frame)`` ((H * 3/2, W) uint8 I420), called through ``run_in_thread`` (an awaitable runner)."""
    import av

    base = _media_track_base()

    class PresenterVideoTrack(base):
        kind = "video"

        def __init__(self):
            super().__init__()
            self.pacer = _Pacer(1.0 / fps, on_grid=True)
            self.frames_sent = 0

        async def recv(self):
            index, due = await self.pacer.next_due()
            frame_i420 = await run_in_thread(render, due, due - self.pacer.start)
            frame = av.VideoFrame.from_ndarray(frame_i420, format="yuv420p")
            frame.pts = int(round(index * VIDEO_CLOCK / fps))
            frame.time_base = fractions.Fraction(1, VIDEO_CLOCK)
            self.frames_sent += 1
            return frame

    return PresenterVideoTrack()


def delayed_audio_track(read: Callable[[float, int], np.ndarray], sample_rate: int):
    """An audio track of 20 ms chunks at ``sample_rate``; the chunk due at wall time w is ``read(w, samples)``
    ((samples,) float32 in [-1, 1])."""
    import av

    base = _media_track_base()
    samples = int(round(AUDIO_CHUNK_SECONDS * sample_rate))

    class DelayedAudioTrack(base):
        kind = "audio"

        def __init__(self):
            super().__init__()
            self.pacer = _Pacer(AUDIO_CHUNK_SECONDS)

        async def recv(self):
            index, due = await self.pacer.next_due()
            chunk = read(due, samples)  # (samples,) float32
            pcm = np.clip(np.round(chunk * 32767.0), -32768, 32767).astype(np.int16)[None]  # (1, samples) s16
            frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
            frame.sample_rate = sample_rate
            frame.pts = index * samples
            frame.time_base = fractions.Fraction(1, sample_rate)
            return frame

    return DelayedAudioTrack()
