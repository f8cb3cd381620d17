"""The landmark engine's rendering processes: the per-pixel work of its frames, away from the
process that decodes, tracks and encodes.

Protocol, one pipe per process, one batch at a time (LandmarkEngine._generate_in_processes), or two
overlapping in a stream (4.):

1. engine -> process ``("warp", (blend, items))``, items ``(key, window, origin, frame_size,
   landmarks, openness, width, speaking)``: ``window`` is the part of the frame the warp reads, either
   I420 bytes of an even-aligned box, packed as a (h * 3/2, w) image (converted to BGR here),
   or a (h, w, 3) BGR region; ``origin`` is its top-left (x, y) in a frame of ``frame_size``
   (width, height). The process warps each (warp_window) and keeps the result.
   process -> engine ``("observed", [(key, status, seen_teeth)])``, status "interior" (with the
   teeth this frame shows, or None), "warp only", "no patch" or "region too small" (the warp
   reads outside the window: the engine warps that frame itself).
2. The engine advances the remembered teeth colour over the reports, in frame order (the only
   state carried from frame to frame), and sends ``("finish", [(key, teeth_bgr)])``.
3. The process draws each interior (finish_mouth). With a ``blend`` (BlendConfig) it also
   blends the patch into the window and answers ``("windows", [(key, even_box, planes_i420)])``,
   the finished I420 bytes of the patch box widened to even coordinates (blend_window);
   without one it answers ``("patches", [(key, box, image_bgr, mask)])``.
4. In a stream of batches (LandmarkEngine.generate_i420_stream) step 3 of one batch and step 1 of
   the next come as one message, ``("finish+warp", (teeth, blend, items))``: the process answers
   the finished windows, then warps the next batch's items and answers ``("observed", ...)``, so
   it warps the next batch while the engine hands the finished one on. Every message is small but
   a warp's windows, and a process sends its large answers only while the engine reads them.

For the batched torch drawing (heygem.engines.landmark.device, --render torch) a process plans faces
instead: ``("plan", (frame_size, items))``, items ``(key, region, face)`` (a face's I420 region and its
RegionFace), answered ``("plans", [(key, FacePlan or None)])`` (heygem.engines.landmark.device.plan_face). The
engine gathers the plans in face order (the remembered teeth colour) and draws them on the device.

Any exception goes back as ``("error", text)``; None stops the process.
"""

from __future__ import annotations

import cv2
import numpy as np

from heygem.engines.landmark.device import FacePlan, RegionFace, plan_face
from heygem.engines.landmark.drawing import RegionTooSmall, WarpedWindow, blend_window, finish_mouth, warp_window
from heygem.runtime.processes import ProcessPool, WorkerProcessError, serve


class LandmarkWorkerError(WorkerProcessError):
    """A rendering process failed or died; the message carries its exception and traceback."""


def _warp_all(items: list, warped: dict[int, WarpedWindow]) -> list:
    """Step 1 of the protocol: warp every item into ``warped``; the reports for the engine."""
    observed = []
    for key, window, origin, frame_size, landmarks, openness, width, speaking in items:
        try:
            result = warp_window(window, origin, frame_size, landmarks, openness, width, speaking)
        except RegionTooSmall:
            observed.append((key, "region too small", None))
            continue
        if result is None:
            observed.append((key, "no patch", None))
            continue
        warped[key] = result
        interior = result.warped.interior
        if interior is None:
            observed.append((key, "warp only", None))
        else:
            observed.append((key, "interior", interior.colours.seen_teeth))
    return observed


def _finish_all(items: list, warped: dict[int, WarpedWindow], blend) -> tuple[str, list]:
    """Step 3 of the protocol: the reply for the frames warped in step 1."""
    if blend is None:
        patches = []
        for key, teeth_bgr in items:
            result = warped.pop(key).warped
            image, mask = finish_mouth(result, teeth_bgr)
            patches.append((key, result.box, image, mask))
        return "patches", patches
    windows = []
    for key, teeth_bgr in items:
        finished = blend_window(warped.pop(key), teeth_bgr, blend)
        windows.append((key, finished.box, finished.planes))
    return "windows", windows


def _render_process(connection) -> None:
    """A rendering process: runs the protocol above until told to stop."""
    cv2.setNumThreads(1)  # the processes are the parallelism
    warped: dict[int, WarpedWindow] = {}
    blend = None

    def handle(kind: str, payload) -> None:
        nonlocal blend
        if kind == "warp":
            warped.clear()
            blend, items = payload
            connection.send(("observed", _warp_all(items, warped)))
        elif kind == "finish":
            connection.send(_finish_all(payload, warped, blend))
        elif kind == "finish+warp":  # the next batch's warp, sent with this one's finishing (a stream)
            teeth_colours, next_blend, items = payload
            connection.send(_finish_all(teeth_colours, warped, blend))
            warped.clear()
            blend = next_blend
            connection.send(("observed", _warp_all(items, warped)))
        elif kind == "plan":
            frame_size, items = payload
            connection.send(("plans", [(key, plan_face(face, region, frame_size)) for key, region, face in items]))
        else:
            raise ValueError(f"unknown message {kind!r}")

    serve(connection, handle, on_error=warped.clear)


class RenderPool(ProcessPool):
    """Spawned processes that run the protocol above, one pipe each; each imports only the landmark
    engine's dependencies (numpy, cv2)."""

    def __init__(self, size: int):
        super().__init__(_render_process, size, "landmark", "landmark rendering process", LandmarkWorkerError)

    def plan_faces(self, faces: list[RegionFace], regions, frame_size: tuple[int, int]) -> list[FacePlan | None]:
        """heygem.engines.landmark.device.plan_face of every face on its region ((F, Hc * 3/2, Wc) uint8), one run of
        consecutive faces per process, in the faces' order."""
        runs = [run for run in np.array_split(np.arange(len(faces)), self.size) if len(run)]
        for worker, run in enumerate(runs):
            self.send(worker, ("plan", (frame_size, [(int(key), regions[key], faces[key]) for key in run])))
        plans: list[FacePlan | None] = [None] * len(faces)
        for worker in range(len(runs)):
            for key, plan in self.receive(worker, "plans"):
                plans[key] = plan
        return plans
