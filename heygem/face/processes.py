"""Face tracking in spawned processes, each with its own face finder, so that tracking runs beside
the main process's other stages instead of taking turns with them for its interpreter lock.

Protocol, one pipe per process (heygem.runtime.processes), one run of frames at a time:
``("track", (face_config, shape))`` followed by the run's I420 planes as raw bytes ((N, H * 3/2, W)
uint8 of ``shape``); the process tracks them from a fresh start (faces.FaceFinder.reset, then
track) and answers ``("landmarks", [(468, 2) float32 frame pixels or None per frame])``. The same
run gives the same landmarks in any process or thread: a run depends on its frames alone.
"""

from __future__ import annotations

import queue

import numpy as np

from heygem.config import FaceConfig
from heygem.face import finder as finder_module
from heygem.face.finder import FaceFinder
from heygem.media.frames import I420Frames
from heygem.runtime import allocator
from heygem.runtime.processes import ProcessPool, serve


def _tracking_process(connection, config: FaceConfig, still_images: bool) -> None:
    """A tracking process: builds its finder, then runs the protocol above until told to stop."""
    import cv2

    allocator.tune()  # before mediapipe starts its threads: each frame batch goes back to the kernel when freed
    cv2.setNumThreads(1)  # the processes are the parallelism
    finder = FaceFinder(config, still_images=still_images)

    def handle(kind: str, payload) -> None:
        if kind != "track":
            raise ValueError(f"unknown message {kind!r}")
        run_config, shape = payload
        planes = np.frombuffer(connection.recv_bytes(), dtype=np.uint8).reshape(shape)
        finder.config = run_config
        finder.reset()
        connection.send(("landmarks", finder.track(I420Frames(planes))))

    try:
        serve(connection, handle)
    finally:
        finder.close()


class TrackingProcesses:
    """faces.FinderPool's interface with its finders in ``size`` spawned processes: runs are tracked
    from several threads at once, one run per process, and only the frames and the landmarks cross."""

    def __init__(self, config: FaceConfig, size: int, still_images: bool = False):
        self.key = pool_key(config, size, still_images)
        self.config = config
        size = max(1, size)
        self._processes = ProcessPool(_tracking_process, size, "faces", "face tracking process",
                                      args=(config, still_images))
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        for index in range(size):
            self._idle.put(index)

    def track_run(self, frames: I420Frames) -> list[np.ndarray | None]:
        """Landmarks (or None) for each frame of a run, tracked from a fresh start in one process."""
        planes = np.ascontiguousarray(frames.planes)
        index = self._idle.get()
        try:
            self._processes.send(index, ("track", (self.config, planes.shape)), data=planes)
            return self._processes.receive(index, "landmarks")
        finally:
            self._idle.put(index)

    def use_options(self, config: FaceConfig) -> None:
        """Track with ``config`` from now on (options that the graphs were built with are in :attr:`key`)."""
        self.config = config

    def alive(self) -> bool:
        return self._processes.alive()

    def close(self) -> None:
        self._processes.close()


def pool_key(config: FaceConfig, size: int, still_images: bool) -> tuple:
    """What a pool of tracking processes was built with (faces.pool_key, for processes)."""
    return ("processes", *finder_module.pool_key(config, size, still_images, None))
