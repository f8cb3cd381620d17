"""The built-in lip-sync engine: no weights, no downloads.

It animates the mouth from the audio with the face's own mediapipe landmarks:

1. the audio gives each frame a mouth shape (openness, spread/rounding; see mouth_shapes.py);
2. the lower face is warped so that the lips part along their own curve: the upper lip
   lifts a little, the lower lip, the jaw and the chin move down, the corners spread or
   round. A mouth that is already open in the source is closed or opened toward the target;
3. the mouth interior is rendered inside the new inner-lip contour: a shaded cavity,
   darker toward the throat, the upper teeth under the upper lip, a hint of the tongue
   and of the lower teeth, with colours taken from the face's own lips and skin.

The warp is one dense backward map per face, applied with a single cv2.remap, so the
skin keeps its real texture. It is built in a "mouth frame" aligned with the line
between the mouth corners: within each column across the mouth, seven levels (under
the nose, the outer and inner edges of both lips, the jaw line, the neck) move
vertically and the map between them is piecewise linear, which lets the lips part
(a gap opens) or close (a gap collapses) without folding the skin around them.

A frame whose source mouth is closed and whose target is closed comes back unchanged,
with an all-zero mask. In the speech's pauses the face keeps its own mouth: those frames get
no patch at all (see MouthShapeTracker's ``speaking``), and the frames around a pause go
from the speech's mouth to the face's own over a few frames.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from heygem.config import BlendConfig, EngineConfig
from heygem.engines.landmark.drawing import (
    RegionTooSmall,
    TeethColour,
    WarpedWindow,
    animate_mouth,
    blend_window,
    cut_window,
    finish_mouth,
    frame_size_of,
    remembered_teeth,
    warp_window,
)
from heygem.engines.landmark.geometry import REGION_MARGIN, window_box
from heygem.engines.landmark.mouth_shapes import MouthShapeTracker
from heygem.types import EngineBatch, Face, FacePatch, I420Window

logger = logging.getLogger("heygem")


@dataclass
class _InFlight:
    """A batch handed to the rendering processes: its inputs and each process's warp items."""

    frames: np.ndarray  # (N, H * 3/2, W) I420 or (N, H, W, 3) BGR
    faces: list
    jobs: list  # (frame index, landmarks, openness, width, speaking), see LandmarkEngine.mouth_jobs
    blend: BlendConfig | None  # None: patches back (generate), else finished I420 windows
    items_by_worker: list  # per process, its ("warp") items


POOL_MIN_FRAMES = 2  # a batch with fewer faces than this is drawn in the calling process


class LandmarkEngine:
    """Lip sync from landmarks and audio alone: a warp of the lower face plus a rendered mouth interior.

    generate() gives BGR patches for BGR frames (the blend stage pastes them); generate_i420()
    gives finished I420 windows for I420 frames, blended here with the blend options, so that
    the caller only pastes bytes. ``workers`` rendering processes (heygem.engines.landmark.processes)
    draw the frames of a batch in parallel (0: all in the calling thread); the main process
    then only cuts windows out of the frames and, for generate_i420, pastes the finished ones
    back. The result is the same, byte for byte, for every worker count: the only state carried
    from frame to frame (the mouth shapes and the remembered teeth colour) is computed here, in
    frame order, between the warp and the drawing of the interior.
    """

    name = "landmark"

    def __init__(self, config: EngineConfig, fps: float, workers: int = 0, pool=None):
        """``pool``: rendering processes already running and idle (kept from an earlier job, see
        detach_pool), used instead of starting ``workers`` new ones."""
        self.mouth_strength = float(config.mouth_strength)
        self.fps = float(fps)
        self.workers = int(workers)
        self.region_margin = REGION_MARGIN
        self.shapes = MouthShapeTracker(fps)
        self.teeth = TeethColour()
        # a heygem.engines.landmark.processes.RenderPool, else started with the first batch that needs it
        self._pool = pool
        logger.debug("landmark engine at %.3f fps, mouth strength %.2f, %d rendering processes",
                     self.fps, self.mouth_strength, self.workers)

    def mouth_jobs(self, faces: list[Face | None], mel_windows: np.ndarray) -> list[tuple]:
        """(frame index, landmarks, openness, width, speaking) of the frames to draw, in frame order:
        those with landmarks, but for the frames in the speech's pauses (``speaking`` 0), which keep
        the face's own mouth, untouched."""
        shapes = self.shapes.update(mel_windows)  # advances with every frame, face or not
        return [(index, face.landmarks, float(openness) * self.mouth_strength, float(width), float(speaking))
                for index, (face, openness, width, speaking)
                in enumerate(zip(faces, shapes.openness, shapes.width, shapes.speaking))
                if face is not None and face.landmarks is not None and speaking > 0.0]

    def draws_in_processes(self, jobs: list) -> bool:
        return self.workers > 0 and len(jobs) >= POOL_MIN_FRAMES

    def generate(self, batch: EngineBatch) -> list[FacePatch | None]:
        """One patch per frame; None where the frame has no face or no landmarks."""
        jobs = self.mouth_jobs(batch.faces, batch.mel_windows)
        if self.draws_in_processes(jobs):
            return self._generate_in_processes(batch.frames_bgr, batch.faces, jobs, blend=None)
        patches: list[FacePatch | None] = [None] * len(batch.faces)
        for index, landmarks, openness, width, speaking in jobs:
            patches[index] = animate_mouth(batch.frames_bgr[index], landmarks, openness, width,
                                           face=batch.faces[index], teeth_memory=self.teeth, speaking=speaking)
        return patches

    def generate_i420(self, frames_i420: np.ndarray, faces: list[Face | None], mel_windows: np.ndarray,
                      blend: BlendConfig) -> list[I420Window | None]:
        """The frames' finished pixels: one I420Window per frame, None where the frame has no face,
        no landmarks or no patch. ``frames_i420`` (N, H * 3/2, W) uint8 are not changed; pasting
        the windows into them (media.paste_i420_window) gives the frames with generate()'s patches
        mixed into their own I420 bytes (drawing.blend_window): bytes under a zero mask stay as
        decoded."""
        jobs = self.mouth_jobs(faces, mel_windows)
        if self.draws_in_processes(jobs):
            return self._generate_in_processes(frames_i420, faces, jobs, blend)
        return self._generate_i420_here(frames_i420, faces, jobs, blend)

    def generate_i420_stream(self, batches: Iterator[tuple[np.ndarray, list[Face | None], np.ndarray]],
                             blend: BlendConfig) -> Iterator[list[I420Window | None]]:
        """generate_i420 over a stream of ``(frames_i420, faces, mel_windows)`` batches: one list of
        windows per batch, in order, the same bytes as calling generate_i420 batch after batch.

        With rendering processes the batches overlap: one message per process carries the
        finishing of batch b and the warp of batch b + 1, so the processes warp b + 1 while this
        thread hands b on and waits for the next batch (the teeth colour still advances over the
        frames in order: b's reports are read before b + 1's). A batch too small for the
        processes first lands the one in flight.
        """
        in_flight: _InFlight | None = None
        try:
            for frames, faces, mel_windows in batches:
                if self.workers <= 0:
                    yield self.generate_i420(frames, faces, mel_windows, blend)
                    continue
                jobs = self.mouth_jobs(faces, mel_windows)
                if not self.draws_in_processes(jobs):
                    if in_flight is not None:
                        yield self._land(in_flight)
                        in_flight = None
                    yield self._generate_i420_here(frames, faces, jobs, blend)
                    continue
                arriving = self._plan(frames, faces, jobs, blend)
                if in_flight is None:
                    self._take_off(arriving)
                else:
                    yield self._land(in_flight, then=arriving)
                in_flight = arriving
            if in_flight is not None:
                yield self._land(in_flight)
        except BaseException:  # an error, or the caller stopped early: the processes are out of step
            self.close()
            raise

    def _generate_i420_here(self, frames_i420: np.ndarray, faces: list[Face | None], jobs: list,
                            blend: BlendConfig) -> list[I420Window | None]:
        """generate_i420's work in this thread, for jobs already made (mouth_jobs)."""
        windows: list[I420Window | None] = [None] * len(faces)
        frame_size = frame_size_of(frames_i420)
        for index, landmarks, openness, width, speaking in jobs:
            box = window_box(landmarks, *frame_size, self.region_margin)
            if box is None:
                continue
            window, origin = cut_window(frames_i420[index], box)
            shape = (openness, width, speaking)
            try:
                warped = warp_window(window, origin, frame_size, landmarks, *shape)
            except RegionTooSmall:  # rare: the whole frame is the window
                warped = warp_window(frames_i420[index], (0, 0), frame_size, landmarks, *shape)
            if warped is not None:
                windows[index] = blend_window(warped, remembered_teeth(warped.warped, self.teeth), blend)
        return windows

    def _generate_in_processes(self, frames: np.ndarray, faces: list[Face | None], jobs: list,
                               blend: BlendConfig | None) -> list:
        """generate() (``blend`` None: BGR ``frames``, FacePatch results) or generate_i420() (I420
        ``frames``, I420Window results) with the frames split into one run of consecutive frames
        per process, following the protocol in heygem.engines.landmark.processes:
        1. each process warps its frames' windows and reports which draw an interior, with the teeth they show;
        2. here, in frame order, the remembered teeth colour advances over those reports;
        3. each process draws its frames' interiors with the colours sent back (and blends them into
           the windows), and returns the patches (or the finished windows)."""
        flight = self._plan(frames, faces, jobs, blend)
        try:
            self._take_off(flight)
            return self._land(flight)
        except BaseException:
            self.close()  # the processes' state is out of step with ours: start afresh next time
            raise

    def rendering_processes(self):
        """The rendering processes (heygem.engines.landmark.processes.RenderPool), started if need be;
        only with ``workers`` above 0."""
        from heygem.engines.landmark.processes import RenderPool

        if self._pool is not None and self._pool.size != self.workers:
            self.close()
        if self._pool is None:
            self._pool = RenderPool(self.workers)
        return self._pool

    def _plan(self, frames: np.ndarray, faces: list[Face | None], jobs: list, blend: BlendConfig | None) -> _InFlight:
        """The batch's warp items for each rendering process (started here if need be): consecutive runs
        of its frames, one per process (some empty when there are fewer frames than processes)."""
        pool = self.rendering_processes()
        frame_size = frame_size_of(frames)
        items_by_worker = []
        for run in np.array_split(np.arange(len(jobs)), pool.size):
            items = []
            for job in run:
                index, landmarks, openness, width, speaking = jobs[job]
                box = window_box(landmarks, *frame_size, self.region_margin)
                if box is not None:
                    window, origin = cut_window(frames[index], box)
                    items.append((index, window, origin, frame_size, landmarks, openness, width, speaking))
            items_by_worker.append(items)
        return _InFlight(frames=frames, faces=faces, jobs=jobs, blend=blend, items_by_worker=items_by_worker)

    def _take_off(self, flight: _InFlight) -> None:
        """Step 1 for ``flight``: every process starts warping its items."""
        for worker, items in enumerate(flight.items_by_worker):
            self._pool.send(worker, ("warp", (flight.blend, items)))

    def _land(self, flight: _InFlight, then: _InFlight | None = None) -> list:
        """Steps 2 and 3 for ``flight`` (whose warp was sent): the teeth colours in frame order, the
        finished results back. With ``then``, each process's finishing message also starts
        ``then``'s warp (its reports are read by the next _land)."""
        pool = self._pool
        frame_size = frame_size_of(flight.frames)
        results: list = [None] * len(flight.faces)
        warped_here: list[tuple[int, WarpedWindow, np.ndarray | None]] = []
        for worker in range(len(flight.items_by_worker)):
            teeth_colours = []
            for index, status, seen_teeth in pool.receive(worker, "observed"):
                if status == "region too small":  # rare: warp with the whole frame as the window, here
                    _, landmarks, *shape = next(job for job in flight.jobs if job[0] == index)
                    warped = warp_window(flight.frames[index], (0, 0), frame_size, landmarks, *shape)
                    if warped is not None:
                        warped_here.append((index, warped, remembered_teeth(warped.warped, self.teeth)))
                elif status == "interior":
                    teeth_colours.append((index, self.teeth.update(seen_teeth)))
                elif status == "warp only":
                    teeth_colours.append((index, None))
            if then is None:
                pool.send(worker, ("finish", teeth_colours))
            else:
                pool.send(worker, ("finish+warp", (teeth_colours, then.blend, then.items_by_worker[worker])))
        for worker in range(len(flight.items_by_worker)):
            if flight.blend is None:
                for index, box, image, mask in pool.receive(worker, "patches"):
                    results[index] = FacePatch(box=box, image_bgr=image, mask=mask, face=flight.faces[index])
            else:
                for index, box, planes in pool.receive(worker, "windows"):
                    results[index] = I420Window(box=box, planes=planes)
        for index, warped, teeth_bgr in warped_here:
            if flight.blend is None:
                image, mask = finish_mouth(warped.warped, teeth_bgr)
                results[index] = FacePatch(box=warped.warped.box, image_bgr=image, mask=mask, face=flight.faces[index])
            else:
                results[index] = blend_window(warped, teeth_bgr, flight.blend)
        return results

    def detach_pool(self):
        """The rendering processes (None if none run), handed to the caller instead of being stopped
        by close(): for the next job's engine, once this one's last batch is back (every answer read)."""
        pool, self._pool = self._pool, None
        return pool

    def close(self) -> None:
        """Stop the rendering processes, if any; safe to call more than once."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.close()

    def __del__(self):
        self.close()
