"""The concurrent pipeline against the sequential one, and what a failing stage leaves behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from bench_pipeline import child_pids
from conftest import decode_frames

from heygem.errors import HeygemError
from heygem.face.finder import FinderPool
from heygem.media.decode import iter_video_i420
from heygem.media.frames import paste_i420_window
from heygem.models.wav2lip import Wav2Lip
from heygem.pipeline import generate
from heygem.runtime.kept import FACE_TRACKERS, KEPT


@pytest.fixture(scope="module")
def wav2lip_weights(tmp_path_factory) -> Path:
    """A random-init generator saved in the official checkpoint layout."""
    directory = tmp_path_factory.mktemp("wav2lip weights")
    torch.manual_seed(1)
    torch.save({"state_dict": Wav2Lip().state_dict()}, directory / "wav2lip.pth")
    return directory


def run(face, speech, output, **options):
    overrides = {"run.avatar_cache": False, **options}
    return generate(face, speech, output, overrides=overrides)


@pytest.mark.parametrize(("engine", "render"), [("landmark", "auto"), ("landmark", "torch"), ("wav2lip", "auto"),
                                                ("wav2lip", "torch")])
def test_concurrent_output_equals_sequential_frame_for_frame(tmp_path, face_video, short_speech, engine, render,
                                                             wav2lip_weights, monkeypatch):
    # the 2 s video plays forward then backward under the 3.4 s speech: the frame file path too; "torch"
    # is the GPU's render path (regions cut out, rendered, copied back and pasted in a second stage), on the CPU
    if engine == "wav2lip":
        monkeypatch.setenv("HEYGEM_WEIGHTS", str(wav2lip_weights))
    options = {"engine.name": engine, "media.batch_frames": 8, "run.render": render}
    sequential = run(face_video, short_speech, tmp_path / "sequential.mp4", **options, **{"run.concurrent": False})
    concurrent = run(face_video, short_speech, tmp_path / "concurrent.mp4", **options,
                     **{"run.concurrent": True, "run.face_workers": 3, "run.decoders": 2})
    assert sequential.engine == concurrent.engine == engine
    first, second = decode_frames(tmp_path / "sequential.mp4"), decode_frames(tmp_path / "concurrent.mp4")
    assert len(first) == len(second) == sequential.frames == 102
    np.testing.assert_array_equal(first, second)
    assert concurrent.frames_without_face == sequential.frames_without_face == 0
    # the engine really changed the mouth: not a pass-through that is trivially equal
    source = decode_frames(face_video)
    assert np.abs(first[:59].astype(int) - source[:59]).max() > 20


def children_of_this_process() -> list[int]:
    """Living child processes, but for multiprocessing's resource tracker: started with the first
    spawned process (the landmark engine's), it stays for the whole test session by design."""
    def is_resource_tracker(pid: int) -> bool:
        try:
            return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    return [pid for pid in child_pids(os.getpid(), living=True) if not is_resource_tracker(pid)]


def fail_in(stage: str, monkeypatch) -> None:
    """Make ``stage`` raise on its third batch (its first two go through)."""
    calls = {"count": 0}

    def failing(original):
        def wrapper(*args, **kwargs):
            calls["count"] += 1
            if calls["count"] == 3:
                raise HeygemError(f"broken in {stage}")
            return original(*args, **kwargs)
        return wrapper

    if stage == "faces":
        from heygem.face.processes import TrackingProcesses
        monkeypatch.setattr(FinderPool, "track_run", failing(FinderPool.track_run))
        monkeypatch.setattr(TrackingProcesses, "track_run", failing(TrackingProcesses.track_run))
    elif stage == "generate":
        from heygem.engines.landmark.engine import LandmarkEngine
        monkeypatch.setattr(LandmarkEngine, "generate", failing(LandmarkEngine.generate))
        monkeypatch.setattr(LandmarkEngine, "generate_i420", failing(LandmarkEngine.generate_i420))
    elif stage == "blend":
        from heygem.render import cpu
        monkeypatch.setattr(cpu, "blend_patch", failing(cpu.blend_patch))
        monkeypatch.setattr(cpu, "paste_i420_window", failing(paste_i420_window))
    elif stage == "decode":
        monkeypatch.setattr("heygem.media.source.iter_video_i420", _failing_decoder(iter_video_i420))


def _failing_decoder(original):
    def decode(*args, **kwargs):
        for index, batch in enumerate(original(*args, **kwargs)):
            if index == 2:
                raise HeygemError("broken in decode")
            yield batch
    return decode


@pytest.mark.parametrize("concurrent", [True, False])
@pytest.mark.parametrize("stage", ["decode", "faces", "generate", "blend"])
def test_an_error_in_any_stage_fails_the_job_with_its_message_and_leaves_nothing(
        tmp_path, face_video, short_speech, monkeypatch, stage, concurrent):
    private_temp = tmp_path / "temp"
    private_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_temp))
    KEPT.release()  # trackers an earlier test kept (tracking processes are children too)
    fail_in(stage, monkeypatch)
    output_dir = tmp_path / "out"
    with pytest.raises(HeygemError, match=f"broken in {stage}"):
        run(face_video, short_speech, output_dir / "result.mp4",
            **{"run.concurrent": concurrent, "run.face_workers": 2, "media.batch_frames": 8})
    assert children_of_this_process() == []  # no ffmpeg left running
    assert list(private_temp.iterdir()) == []  # no work folder or temporary file left
    assert not output_dir.exists() or list(output_dir.iterdir()) == []  # no partial output
    assert KEPT.kept(FACE_TRACKERS) == []  # the failed job's face finders were closed, not kept for the next job


@pytest.mark.parametrize("processes", [True, False])
def test_the_next_job_tracks_with_the_finders_the_last_one_left_and_gets_the_same_frames(
        tmp_path, face_video, short_speech, monkeypatch, processes):
    from heygem.face.processes import TrackingProcesses

    KEPT.release()
    built = []
    pool_class = TrackingProcesses if processes else FinderPool
    original_init = pool_class.__init__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(pool_class, "__init__", counting_init)
    options = {"run.concurrent": True, "run.face_workers": 2, "media.batch_frames": 8,
               "run.face_processes": processes}
    try:
        run(face_video, short_speech, tmp_path / "first.mp4", **options)
        assert len(built) == 1 and KEPT.kept(FACE_TRACKERS) == [built[0]]
        run(face_video, short_speech, tmp_path / "second.mp4", **options)
        assert len(built) == 1 and KEPT.kept(FACE_TRACKERS) == [built[0]]  # taken, used and kept again
        np.testing.assert_array_equal(decode_frames(tmp_path / "first.mp4"), decode_frames(tmp_path / "second.mp4"))
        run(face_video, short_speech, tmp_path / "third.mp4", **options, **{"face.min_confidence": 0.6})
        assert len(built) == 2 and KEPT.kept(FACE_TRACKERS) == [built[1]]  # other detector options: other graphs
    finally:
        KEPT.release()
    assert KEPT.kept(FACE_TRACKERS) == [] and children_of_this_process() == []  # released: no tracker left running


def test_a_tracking_process_that_dies_fails_the_job_and_the_next_job_starts_new_ones(
        tmp_path, face_video, short_speech, monkeypatch):
    from heygem.face.processes import TrackingProcesses
    from heygem.runtime.processes import WorkerProcessError

    KEPT.release()
    options = {"run.concurrent": True, "run.face_workers": 2, "media.batch_frames": 8}
    original_track_run = TrackingProcesses.track_run
    runs = {"count": 0}

    def killing_track_run(self, frames):
        runs["count"] += 1
        if runs["count"] == 3:  # as if the system had killed one for memory
            for process in self._processes.processes:
                process.kill()
                process.join()
        return original_track_run(self, frames)

    monkeypatch.setattr(TrackingProcesses, "track_run", killing_track_run)
    try:
        with pytest.raises(WorkerProcessError, match="face tracking process . (exited unexpectedly|is gone)"):
            run(face_video, short_speech, tmp_path / "failed.mp4", **options)
        assert KEPT.kept(FACE_TRACKERS) == [] and children_of_this_process() == []
        assert not (tmp_path / "failed.mp4").exists()
        monkeypatch.undo()
        run(face_video, short_speech, tmp_path / "next.mp4", **options)
        run(face_video, short_speech, tmp_path / "threads.mp4", **options, **{"run.face_processes": False})
        np.testing.assert_array_equal(decode_frames(tmp_path / "next.mp4"), decode_frames(tmp_path / "threads.mp4"))
    finally:
        KEPT.release()


def rendering_processes() -> set[int]:
    import multiprocessing

    return {process.pid for process in multiprocessing.active_children()}


def test_a_finished_landmark_job_keeps_its_rendering_processes_for_the_next_one(
        tmp_path, face_video, short_speech, monkeypatch):
    monkeypatch.setattr("heygem.engines.landmark.landmark_worker_count", lambda config: 2)
    options = {"engine.name": "landmark", "media.batch_frames": 8}
    before = rendering_processes()
    try:
        run(face_video, short_speech, tmp_path / "first.mp4", **options)
        kept = rendering_processes() - before
        assert len(kept) == 2  # still running after the job
        run(face_video, short_speech, tmp_path / "second.mp4", **options)
        assert rendering_processes() - before == kept  # the same two drew the second job
        # the same frames as a job drawn in this process
        monkeypatch.setattr("heygem.engines.landmark.landmark_worker_count", lambda config: 0)
        run(face_video, short_speech, tmp_path / "inline.mp4", **options)
        np.testing.assert_array_equal(decode_frames(tmp_path / "second.mp4"), decode_frames(tmp_path / "inline.mp4"))
        assert not rendering_processes() & kept  # a job with another process count stops them

        # a job that fails stops them: they may be out of step with the engine
        monkeypatch.setattr("heygem.engines.landmark.landmark_worker_count", lambda config: 2)
        run(face_video, short_speech, tmp_path / "third.mp4", **options)
        kept = rendering_processes() - before
        assert len(kept) == 2
        fail_in("blend", monkeypatch)
        with pytest.raises(HeygemError, match="broken in blend"):
            run(face_video, short_speech, tmp_path / "failed.mp4", **options)
        assert rendering_processes() - before == set()  # those kept drew the failed job, then stopped
        monkeypatch.undo()
        monkeypatch.setattr("heygem.engines.landmark.landmark_worker_count", lambda config: 2)
        run(face_video, short_speech, tmp_path / "fourth.mp4", **options)
        assert len(rendering_processes() - before) == 2
    finally:
        KEPT.release()
    assert rendering_processes() - before == set()


def test_the_avatar_cache_reuses_tracking_for_other_audio_and_misses_on_changed_options(
        tmp_path, face_video, short_speech, media_dir, monkeypatch):
    from conftest import ASSETS, run_ffmpeg

    # shorter than the 2 s video: with its track cached, a longer speech would turn the video where the
    # head is still (heygem.face.turns) and the frames would differ from the uncached job's by design
    other_speech = media_dir / "other speech.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_zh.wav"), "-t", "1.8", str(other_speech))
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path / "cache"))
    first = generate(face_video, short_speech, tmp_path / "first.mp4")
    assert first.avatar_cache == "miss"
    second = generate(face_video, other_speech, tmp_path / "second.mp4")
    assert second.avatar_cache == "hit"
    assert ("faces" not in second.seconds_per_stage
            or second.seconds_per_stage["faces"] < first.seconds_per_stage["faces"])
    uncached = generate(face_video, other_speech, tmp_path / "uncached.mp4", overrides={"run.avatar_cache": False})
    assert uncached.avatar_cache == "off"
    np.testing.assert_array_equal(decode_frames(tmp_path / "second.mp4"), decode_frames(tmp_path / "uncached.mp4"))
    changed = generate(face_video, other_speech, tmp_path / "changed.mp4", overrides={"face.pads": [0, 20, 0, 0]})
    assert changed.avatar_cache == "miss"


def test_a_thread_keeps_its_wav2lip_engine_for_the_next_job_unless_something_changed(wav2lip_weights, tmp_path):
    import shutil
    import threading

    from heygem.config import Config, EngineConfig
    from heygem.engines import ENGINES

    checkpoint = tmp_path / "wav2lip.pth"
    shutil.copy(wav2lip_weights / "wav2lip.pth", checkpoint)
    wav2lip = ENGINES["wav2lip"]

    def load(engine_config: EngineConfig):  # for the thread that asks
        return wav2lip.load(checkpoint, Config(engine=engine_config), 25.0, threading.get_ident())

    config = EngineConfig(device="cpu")
    first = load(config)
    assert load(config) is first
    assert load(EngineConfig(device="cpu", batch_size=8)) is not first
    other_thread = []
    thread = threading.Thread(target=lambda: other_thread.append(load(config)))
    thread.start()
    thread.join()
    assert other_thread[0] is not first  # engines are not shared between threads
    checkpoint.write_bytes(checkpoint.read_bytes())  # the same bytes, a new modification time
    os.utime(checkpoint, ns=(1, 1))
    assert load(config) is not first


def test_the_torch_render_path_runs_on_the_cpu_and_changes_only_the_face(tmp_path, face_video, wav2lip_weights,
                                                                        media_dir, monkeypatch):
    from conftest import run_ffmpeg

    speech = media_dir / "one second of speech.wav"
    run_ffmpeg("-i", str(face_video), "-t", "1", "-vn", str(speech))
    monkeypatch.setenv("HEYGEM_WEIGHTS", str(wav2lip_weights))
    options = {"engine.name": "wav2lip", "engine.device": "cpu"}
    on_torch = run(face_video, speech, tmp_path / "torch.mp4", **options, **{"run.render": "torch"})
    on_numpy = run(face_video, speech, tmp_path / "numpy.mp4", **options, **{"run.render": "numpy"})
    assert "render" in on_torch.seconds_per_stage and "blend" in on_numpy.seconds_per_stage
    torch_frames = decode_frames(tmp_path / "torch.mp4").astype(int)
    numpy_frames = decode_frames(tmp_path / "numpy.mp4").astype(int)
    source = decode_frames(face_video)[: len(torch_frames)].astype(int)
    assert len(torch_frames) == len(numpy_frames) == on_torch.frames == 30
    top = (slice(None), slice(0, 45))  # above every face box: never pasted into, the same decoded bytes in both
    assert np.abs(torch_frames[top] - numpy_frames[top]).mean() < 1.0
    changed = np.abs(torch_frames - source).mean(axis=(0, 3)) > 20  # (H, W) pixels the generator replaced
    assert changed.any() and not changed[:45].any()
    # both paths paste the same random generator's face into the same place, so they agree closely
    assert np.abs(torch_frames - numpy_frames).mean() < 3.0
