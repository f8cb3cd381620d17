"""The live sessions of one server: each a WebRTC peer connection (aiortc) with its sound, its face, its engine
step and its two outgoing tracks; how many may run at once; when one ends.

A session ends when it is ended (DELETE), when its peer goes away (the connection fails or closes), or after
``idle_seconds`` in which nobody spoke into it (the microphone, a WebSocket or typed text).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from heygem.config import Config, apply_overrides, load_config
from heygem.errors import HeygemError
from heygem.live.audio_in import SAMPLE_RATE, AudioTimeline, Resampler, mel_window, samples_to_16k, sound_window
from heygem.live.engine_step import LiveEngineStep, choose_live_engine, live_batch_size, start_step
from heygem.live.face import BUNDLED_PORTRAIT, LiveFace, load_face
from heygem.live.tickets import LiveTickets
from heygem.live.tracks import ARRIVAL_MARGIN, delayed_audio_track, presenter_video_track

logger = logging.getLogger("heygem")

LIVE_HEIGHT = 360  # the frames a session sends are this tall (a presenter's clip is scaled to it), by default
LIVE_HEIGHTS = (144, 1080)  # the least and the most --live-height takes
LIVE_FPS = 25.0
WATCH_SECONDS = 1.0  # how often idle sessions are looked for
FACES_KEPT = 4  # faces (frames and tracks) kept for the next session on the same presenter


class LiveFull(HeygemError):
    """Every live session this server allows runs already (HTTP 429)."""


@dataclass(frozen=True)
class LiveSettings:
    """What a server allows its live sessions (app.py's --max-live, --live-idle-seconds, --ice-server,
    --live-engine), and
    the one registry of tickets and session keys its page and its routes share (app.py hands the same
    settings to both)."""

    max_sessions: int = 2  # sessions at once; more are refused (0: no limit)
    idle_seconds: float = 120.0  # a session in which nobody spoke this long ends
    ice_servers: tuple[str, ...] = ()  # STUN/TURN URLs (turn:NAME:SECRET@host:3478) for peers beyond the LAN
    output_height: int = LIVE_HEIGHT
    fps: float = LIVE_FPS
    engine: str = "auto"  # --live-engine: auto (the jobs' engine where it runs live in real time) or a name
    tickets: LiveTickets = field(default_factory=LiveTickets, compare=False, repr=False)  # heygem.live.tickets

    def __post_init__(self):
        low, high = LIVE_HEIGHTS
        if not isinstance(self.output_height, int) or self.output_height % 2 or not low <= self.output_height <= high:
            raise HeygemError(f"--live-height must be an even number of pixels from {low} to {high}, "
                              f"not {self.output_height}")

    def ice_server_list(self) -> list[dict]:
        """The ICE servers as a browser's RTCPeerConnection takes them: {"urls", "username"?, "credential"?}."""
        servers = []
        for url in self.ice_servers:
            scheme, _, rest = url.partition(":")
            if "@" in rest:
                secret, _, host = rest.rpartition("@")
                name, _, credential = secret.partition(":")
                servers.append({"urls": f"{scheme}:{host}", "username": name, "credential": credential})
            else:
                servers.append({"urls": url})
        return servers


@dataclass
class LiveSession:
    """One browser (or client) talking to one presenter."""

    id: str
    submitter: str | None
    face: LiveFace
    engine: str
    engine_reason: str
    step: LiveEngineStep
    delay: float  # seconds the output (sound and mouth) is behind what came in
    key: str = ""  # signs in as the session's user on its own routes (heygem.live.tickets)
    timeline: AudioTimeline = field(default_factory=AudioTimeline)
    peer: object = None  # aiortc.RTCPeerConnection
    video: object = None  # the outgoing tracks (heygem.live.tracks)
    audio: object = None
    ended: bool = False
    started: float = field(default_factory=time.monotonic)
    tasks: list = field(default_factory=list)

    def __post_init__(self):
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"heygem-live-{self.id[:6]}")
        self.speech_lock = threading.Lock()  # typed sentences are spoken one text after another

    def render(self, wall_time: float, shown_seconds: float) -> np.ndarray:
        """The frame due at ``wall_time``: the face ``shown_seconds`` into its clip, the mouth of the sound
        ``delay`` seconds before."""
        heard = wall_time - self.timeline.origin - self.delay
        index = self.face.frame_at(shown_seconds)
        step = self.step
        if step.mel_columns:
            sound = mel_window(self.timeline, heard, step.mel_columns)  # (80, columns)
        else:  # the step computes its own features from the samples
            sound = sound_window(self.timeline, heard, step.sound_before, step.lookahead)
        return step.render(self.face.frames_i420[index], self.face.faces[index], sound)

    @property
    def sound_delay(self) -> float:
        """Seconds the outgoing sound is behind what came in: the mouth's delay less the step's mouth lead (a
        mouth that shows each sound a little before its time meets its sound when the sound goes out sooner)."""
        return self.delay - self.step.mouth_lead

    def read_output(self, wall_time: float, count: int) -> np.ndarray:
        """The sound due at ``wall_time``: what came in ``sound_delay`` seconds before."""
        start = int(round((wall_time - self.timeline.origin - self.sound_delay) * SAMPLE_RATE))
        return self.timeline.read(start, count)

    def say(self, text: str) -> int:
        """Speak ``text`` into the session with the voice a job would choose for it (the bundled Piper voice
        for English), sentence by sentence from now on. Blocks while it is spoken; the number of sentences."""
        from heygem.speech.tts import choose_voice, stream_sentences

        with self.speech_lock:
            spoken = 0
            choice = choose_voice(text)
            for sentence in stream_sentences(text, choice):
                if self.ended:
                    break
                self.timeline.queue("speech", samples_to_16k(sentence.samples, choice.voice.sample_rate))
                spoken += 1
            return spoken

    def answer(self) -> dict:
        return {"session": self.id, "key": self.key, "engine": self.engine, "engine_reason": self.engine_reason,
                "face": self.face.description, "delay_seconds": round(self.delay, 3),
                "sound_delay_seconds": round(self.sound_delay, 3),
                "width": self.face.geometry.width, "height": self.face.geometry.height}


@functools.lru_cache(maxsize=FACES_KEPT)
def _kept_face(path: str, stamp: tuple, description: str, track_dir: str | None, face_index: int | None,
               output_height: int) -> LiveFace:
    """The face of a session, kept for the next session on the same file (its frames are only read)."""
    config = apply_overrides(load_config(), {"face.face_index": face_index, "media.output_height": output_height})
    return load_face(Path(path), config, description, Path(track_dir) if track_dir else None)


class LiveSessions:
    """The sessions of a server, at most ``settings.max_sessions`` at once."""

    def __init__(self, settings: LiveSettings | None = None, presenters=None, config: Config | None = None):
        self.settings = settings or LiveSettings()
        self.presenters = presenters  # heygem.presenters.records.PresenterStore, or None
        self.config = config or load_config()
        self.sessions: dict[str, LiveSession] = {}
        self.opening = 0  # sessions being set up (counted against the cap)
        self._watch: asyncio.Task | None = None

    def count(self) -> int:
        return len(self.sessions) + self.opening

    def find(self, session_id: str) -> LiveSession | None:
        return self.sessions.get(session_id)

    def _face_source(self, presenter_id: str | None, user) -> tuple[Path, str, Path | None, Config]:
        """(face path, description, prepared track folder or None, config) of a session's face."""
        config = apply_overrides(self.config, {"media.output_height": self.settings.output_height})
        if not presenter_id:
            return BUNDLED_PORTRAIT, "the bundled portrait", None, config
        from heygem.jobs.users import may_see
        from heygem.presenters.prepare import presenter_config
        from heygem.presenters.records import FAILED, READY

        presenter = self.presenters.get(str(presenter_id).strip()) if self.presenters is not None else None
        if presenter is None or not may_see(user, presenter.submitter):
            raise HeygemError(f"there is no presenter {presenter_id!r}")
        if presenter.status == FAILED:
            raise HeygemError(f"presenter {presenter.name!r} failed to prepare: {presenter.error}")
        ready = presenter.status == READY and presenter.kind == "video"
        return (presenter.clip_path, f"presenter {presenter.name!r}", presenter.track_dir if ready else None,
                presenter_config(presenter.face_index, config))

    async def open(self, offer: dict, presenter_id: str | None, user) -> LiveSession:
        """A new session answering the browser's ``offer`` ({"sdp", "type": "offer"}); LiveFull beyond the
        cap, HeygemError for an unusable offer or presenter."""
        from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription

        if offer.get("type") != "offer" or not isinstance(offer.get("sdp"), str) or not offer["sdp"].strip():
            raise HeygemError('send the browser\'s offer as JSON {"sdp": ..., "type": "offer"}')
        cap = self.settings.max_sessions
        if cap and self.count() >= cap:
            raise LiveFull(f"this server runs {cap} live session{'s' if cap > 1 else ''} at most, all busy now: "
                           "try again later")
        self.opening += 1
        try:
            face_path, description, track_dir, config = self._face_source(presenter_id, user)
            stamp = (face_path.stat().st_mtime_ns, face_path.stat().st_size)
            face = await asyncio.to_thread(_kept_face, str(face_path), stamp, description,
                                           str(track_dir) if track_dir else None, config.face.face_index,
                                           self.settings.output_height)
            choice = choose_live_engine(config, self.settings.engine)
            step = await asyncio.to_thread(start_step, choice, config, self.settings.fps,
                                           live_batch_size(self.settings.max_sessions))
            session = LiveSession(id=secrets.token_hex(8), submitter=getattr(user, "name", None), face=face,
                                  engine=choice.name, engine_reason=choice.reason, step=step,
                                  delay=step.lookahead + ARRIVAL_MARGIN)
            session.key = self.settings.tickets.issue_key(session.id, session.submitter)
            servers = [RTCIceServer(**server) for server in self.settings.ice_server_list()]
            peer = RTCPeerConnection(RTCConfiguration(iceServers=servers or None))
            session.peer = peer
            self._connect(session)
            try:
                await peer.setRemoteDescription(RTCSessionDescription(sdp=offer["sdp"], type="offer"))
                await peer.setLocalDescription(await peer.createAnswer())
            except (ValueError, AttributeError) as problem:
                await self._end(session, "the offer was refused")
                raise HeygemError(f"the offer is not a WebRTC offer this server can answer: {problem}") from None
            self.sessions[session.id] = session
        finally:
            self.opening -= 1
        self._start_watch()
        logger.info("live session %s started: %s, engine %s (%s), output %.3f s behind", session.id, face.description,
                    session.engine, session.engine_reason, session.delay)
        return session

    def _connect(self, session: LiveSession) -> None:
        """The session's tracks on its peer, and what it does with the peer's."""
        loop = asyncio.get_running_loop()
        peer = session.peer

        async def in_session_thread(function, *args):
            return await loop.run_in_executor(session.thread, function, *args)

        session.video = presenter_video_track(session.render, self.settings.fps, in_session_thread)
        session.audio = delayed_audio_track(session.read_output, SAMPLE_RATE)
        peer.addTrack(session.audio)
        peer.addTrack(session.video)

        @peer.on("track")
        def on_track(track):
            if track.kind == "audio":
                session.tasks.append(asyncio.ensure_future(self._listen(session, track)))

        @peer.on("connectionstatechange")
        async def on_state():
            if peer.connectionState in ("failed", "closed"):
                await self.end(session.id, f"the peer's connection {peer.connectionState}")

    async def _listen(self, session: LiveSession, track) -> None:
        """The peer's microphone into the session's timeline, until its track ends."""
        from aiortc.mediastreams import MediaStreamError

        resampler = Resampler()
        while not session.ended:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            session.timeline.write_live("microphone", resampler.to_16k(frame))

    async def end(self, session_id: str, why: str) -> bool:
        """End a session (False when there is none by that id)."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        await self._end(session, why)
        return True

    async def _end(self, session: LiveSession, why: str) -> None:
        if session.ended:
            return
        session.ended = True
        self.settings.tickets.forget_key(session.id)
        for task in session.tasks:
            task.cancel()
        if session.peer is not None:
            await session.peer.close()
        session.thread.shutdown(wait=False, cancel_futures=True)
        session.step.close()
        logger.info("live session %s ended after %.1f s: %s", session.id, time.monotonic() - session.started, why)

    def _start_watch(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(self._watch_idle())

    async def _watch_idle(self) -> None:
        """End the sessions nobody spoke into for ``idle_seconds``; stops when no session is left."""
        while self.sessions:
            await asyncio.sleep(WATCH_SECONDS)
            for session in list(self.sessions.values()):
                if session.timeline.idle_seconds() > self.settings.idle_seconds:
                    await self.end(session.id, f"nobody spoke for {self.settings.idle_seconds:g} s")

    async def close(self) -> None:
        for session_id in list(self.sessions):
            await self.end(session_id, "the server stops")

