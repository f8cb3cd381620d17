"""A job watched while it renders: its HLS stream over HTTP, beside the other job routes.

    GET /api/jobs/{id}/stream.m3u8      -> the playlist: an EVENT playlist while the job runs, closed
                                           with #EXT-X-ENDLIST once the stream is complete or the job
                                           ended; 404 until the first segment is out
    GET /api/jobs/{id}/stream/{name}    -> one listed MPEG-TS segment (H.264 + AAC); any other name 404

The playlist is made from the encoder's segment lists at each request (heygem.media.stream), so it
never names a segment that is still being written; a segment is served only while the playlist
lists it, and only by a name of the one form segments have, so no request reaches another file.
Every route fetches its job with the same function as the other job routes (``find_job``), so the
same authentication and access rules apply.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse

from heygem.media.stream import playlist, segment_path, stream_folder

PLAYLIST_TYPE = "application/vnd.apple.mpegurl"
SEGMENT_TYPE = "video/mp2t"
NO_CACHE = {"Cache-Control": "no-cache"}  # the playlist grows while the job runs


def stream_url(job_id: str) -> str:
    """Where a job's playlist is served."""
    return f"/api/jobs/{job_id}/stream.m3u8"


def add_stream_routes(router: APIRouter, find_job: Callable) -> None:
    """Add the stream routes to ``router``; ``find_job(job_id, request)`` returns the job the requester
    may see (or ends the request with the error the other routes give)."""

    @router.get("/jobs/{job_id}/stream.m3u8")
    def get_stream_playlist(job_id: str, request: Request):
        job = find_job(job_id, request)
        text = playlist(stream_folder(job.result_path), ended=job.is_finished, prefix="stream/")
        if text is None:
            state = "it ended without one" if job.is_finished else f"it is {job.status}"
            return JSONResponse({"error": f"job {job_id} has no stream yet: {state}"}, status_code=404,
                                headers=NO_CACHE)
        return PlainTextResponse(text, media_type=PLAYLIST_TYPE, headers=NO_CACHE)

    @router.get("/jobs/{job_id}/stream/{name}")
    def get_stream_segment(job_id: str, name: str, request: Request):
        job = find_job(job_id, request)
        path = segment_path(stream_folder(job.result_path), name)
        if path is None:
            return JSONResponse({"error": f"job {job_id} has no stream segment {name!r}"}, status_code=404)
        return FileResponse(path, media_type=SEGMENT_TYPE)
