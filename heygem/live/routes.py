"""Live mode's HTTP routes and WebSocket, on the REST API's router (heygem.jobs.api.create_router), so they
take the same users and keys as the rest of /api:

    GET    /api/live                     -> {"ice_servers", "sessions", "max_sessions", "idle_seconds"}
    POST   /api/live                     JSON {"sdp", "type": "offer", "presenter"?: id} (the client sends
                                         its microphone, receives video and sound) -> {"sdp", "type":
                                         "answer", "session", "key", "engine", "engine_reason", "face",
                                         "delay_seconds", "sound_delay_seconds", "width", "height"}; every
                                         session busy -> 429
    POST   /api/live/{session}/say       JSON {"text"} -> {"session", "sentences"}: the presenter says it
    DELETE /api/live/{session}           -> {"session", "status": "ended"}
    WS     /api/live/{session}/audio     binary messages of 16 kHz mono s16le PCM: a voice agent's speech

A session belongs to the user who started it (another gets 404, an admin any). The page's Live tab signs in
with a one-use ticket instead of the REST API's credentials, and then with its session's key
(heygem.live.tickets; checked with the rest of the sign-in in heygem.jobs.api).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import numpy as np
from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from heygem.errors import HeygemError
from heygem.jobs.users import foreign_origin, may_see
from heygem.live.sessions import LiveFull, LiveSession, LiveSessions, LiveSettings

logger = logging.getLogger("heygem")

MAX_OFFER_BYTES = 64 * 1024
MAX_SAY_CHARACTERS = 2000
POLICY_VIOLATION = 1008  # the WebSocket close code for a refused connection


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _json_body(request: Request) -> dict:
    body = await request.body()
    if len(body) > MAX_OFFER_BYTES:
        raise HeygemError(f"the request is larger than {MAX_OFFER_BYTES // 1024} KB")
    try:
        data = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise HeygemError("send the request as JSON") from None
    if not isinstance(data, dict):
        raise HeygemError("send the request as a JSON object")
    return data


def add_live_routes(router: APIRouter, presenters, signed_in: Callable, settings: LiveSettings | None = None,
                    config=None) -> LiveSessions:
    """The /live routes on ``router`` (whose route class signs the user in as request.state.user), the
    WebSocket signed in with ``signed_in(connection)``, the same check; returns the sessions they serve."""
    sessions = LiveSessions(settings, presenters, config)

    def visible(session_id: str, user) -> LiveSession | None:
        session = sessions.find(session_id)
        if session is None or not may_see(user, session.submitter):
            return None
        return session

    @router.get("/live")
    async def live_info(request: Request):
        return {"ice_servers": sessions.settings.ice_server_list(), "sessions": sessions.count(),
                "max_sessions": sessions.settings.max_sessions, "idle_seconds": sessions.settings.idle_seconds}

    @router.post("/live")
    async def start_live(request: Request):
        try:
            offer = await _json_body(request)
            session = await sessions.open(offer, offer.get("presenter"), request.state.user)
        except LiveFull as full:
            return JSONResponse({"error": str(full)}, status_code=429, headers={"Retry-After": "10"})
        except HeygemError as problem:
            return _error(400, str(problem))
        answer = session.peer.localDescription
        return {"sdp": answer.sdp, "type": answer.type, **session.answer()}

    @router.post("/live/{session_id}/say")
    async def say(session_id: str, request: Request):
        session = visible(session_id, request.state.user)
        if session is None:
            return _error(404, f"there is no live session {session_id!r}")
        try:
            text = (await _json_body(request)).get("text")
            if not isinstance(text, str) or not text.strip():
                raise HeygemError('send the text to say as JSON {"text": ...}')
            if len(text) > MAX_SAY_CHARACTERS:
                raise HeygemError(f"say at most {MAX_SAY_CHARACTERS} characters at a time")
            from heygem.speech.tts import choose_voice, split_sentences

            choose_voice(text)  # no voice for its language: 400 now, not in the background
            sentences = len(split_sentences(text))
            if not sentences:
                raise HeygemError("the text has no words to speak: give at least one letter or digit")
        except HeygemError as problem:
            return _error(400, str(problem))
        task = asyncio.ensure_future(asyncio.to_thread(session.say, text))  # spoken as each sentence is ready
        task.add_done_callback(lambda done: done.cancelled() or done.exception() is None or logger.warning(
            "live session %s: the text could not be spoken: %s", session.id, done.exception()))
        session.tasks.append(task)
        return {"session": session.id, "sentences": sentences}

    @router.delete("/live/{session_id}")
    async def end_live(session_id: str, request: Request):
        if visible(session_id, request.state.user) is None:
            return _error(404, f"there is no live session {session_id!r}")
        await sessions.end(session_id, "ended by its user")
        return {"session": session_id, "status": "ended"}

    async def pcm_in(websocket: WebSocket, session_id: str):
        headers = websocket.headers
        origin = foreign_origin("GET", headers.get("origin"), None, headers.get("host"))
        if origin is not None:
            await websocket.close(POLICY_VIOLATION, "this API takes no requests from other sites' pages")
            return
        try:
            user = await run_in_threadpool(signed_in, websocket)
        except Exception as refused:  # noqa: BLE001 - the REST API's refusal (401, 429), said as the close reason
            await websocket.close(POLICY_VIOLATION, str(getattr(refused, "message", refused))[:120])
            return
        session = visible(session_id, user)
        if session is None:
            await websocket.close(POLICY_VIOLATION, f"there is no live session {session_id!r}")
            return
        await websocket.accept()
        try:
            while not session.ended:
                chunk = await websocket.receive_bytes()
                pcm = np.frombuffer(chunk[: len(chunk) // 2 * 2], dtype="<i2")  # (n,) s16le, 16 kHz mono
                session.timeline.write_live("websocket", pcm.astype(np.float32) / 32768.0)
        except WebSocketDisconnect:
            return
        await websocket.close()

    router.add_api_websocket_route("/live/{session_id}/audio", pcm_in)
    return sessions
