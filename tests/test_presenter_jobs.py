"""Saved presenters in batch mode (a manifest's presenter column) and on Ray (the track travels with the job)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ASSETS, REPO, assert_playable_mp4, decode_frames, run_ffmpeg

from heygem.jobs.store import JobStore


@pytest.fixture(scope="module")
def presenter_outputs(tmp_path_factory):
    """An outputs folder holding the presenter 'anna' (`presenters add` on a 2.4 s clip), its own avatar
    cache, and a speech file."""
    folder = tmp_path_factory.mktemp("presenter jobs")
    clip = folder / "anna.mp4"
    run_ffmpeg("-loop", "1", "-i", str(ASSETS / "astronaut.jpg"), "-i", str(ASSETS / "speech_en.wav"),
               "-vf", "scale=256:256,crop=256:192:x=0:y='20+8*sin(t*2)',format=yuv420p", "-r", "25", "-t", "2.4",
               "-c:v", "libx264", "-preset", "ultrafast", "-c:a", "aac", "-shortest", str(clip))
    outputs, cache = folder / "outputs", folder / "cache"
    env = dict(os.environ, HEYGEM_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    added = subprocess.run([sys.executable, "-m", "heygem", "presenters", "add", str(clip), "--name", "anna",
                            "--outputs", str(outputs)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert added.returncode == 0, added.stderr
    speech = folder / "speech.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "1.6", str(speech))
    return {"outputs": outputs, "cache": cache, "speech": speech, "clip": clip}


def test_a_batch_manifest_names_presenters_and_an_unknown_one_fails_its_row_only(tmp_path, presenter_outputs,
                                                                               monkeypatch):
    from heygem.jobs.batch import run_batch

    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(presenter_outputs["cache"]))
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "speech.wav").write_bytes(presenter_outputs["speech"].read_bytes())
    (inputs / "rows.csv").write_text("presenter,audio,name\nanna,speech.wav,hello\nnobody,speech.wav,ghost\n",
                                     encoding="utf-8")
    results = run_batch(inputs, tmp_path / "out", "rows.csv", {"engine.name": "landmark"},
                        jobs_dir=presenter_outputs["outputs"], show_progress=False)
    by_name = {result.item.name: result for result in results}
    assert by_name["hello"].status == "done", by_name["hello"].error
    assert by_name["ghost"].status == "failed"
    assert by_name["ghost"].error == ("there is no presenter 'nobody' (python -m heygem presenters list shows "
                                      "them)")
    with open(tmp_path / "out" / "summary.csv", newline="", encoding="utf-8") as handle:
        rows = {row["name"]: row for row in csv.DictReader(handle)}
    assert rows["hello"]["face"] == "presenter anna" and rows["ghost"]["status"] == "failed"
    assert_playable_mp4(tmp_path / "out" / "hello.mp4", 1.6)
    summary = json.loads((tmp_path / "out" / "hello.json").read_text())
    assert summary["avatar_cache"] == "hit" and summary["frames_without_face"] == 0
    frames = decode_frames(tmp_path / "out" / "hello.mp4")
    clip = decode_frames(presenter_outputs["clip"])
    assert frames.shape[1:] == clip.shape[1:] and len(frames) == 40
    # the presenter's clip, frame for frame above the mouth
    assert np.abs(frames[:len(clip), :80].astype(np.int16) - clip[:len(frames), :80]).mean() < 3


def test_batch_help_names_the_presenter_column():
    result = subprocess.run([sys.executable, "-m", "heygem", "batch", "--help"], cwd=REPO, capture_output=True,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert result.returncode == 0 and "presenter column" in result.stdout


def test_a_presenter_job_on_ray_brings_its_track_and_the_node_tracks_nothing(tmp_path, presenter_outputs,
                                                                           monkeypatch):
    """The Ray node's avatar cache is a folder of its own (as on another machine): the job's summary says
    hit only because the track came with the job."""
    ray = pytest.importorskip("ray")
    from heygem.jobs.ray_executor import start_ray_workers
    from heygem.presenters.prepare import presenter_job
    from heygem.presenters.records import PresenterStore

    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(presenter_outputs["cache"]))
    node_cache = tmp_path / "node cache"
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"HEYGEM_CACHE_DIR": str(node_cache), "PYTHONPATH": str(REPO)}})
    try:
        store = JobStore(presenter_outputs["outputs"])
        presenter = PresenterStore(store.outputs_dir).find("anna")
        face, options = presenter_job(presenter, {"engine.name": "landmark"}, store.resolve_options)
        job_id = store.create_job(face, presenter_outputs["speech"], options)
        workers = start_ray_workers(store)
        try:
            deadline = time.monotonic() + 240
            while not store.get(job_id).is_finished and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            for worker in workers:
                worker.stop(wait=30)
    finally:
        ray.shutdown()
    job = store.get(job_id)
    assert job.status == "done", job.error
    summary = json.loads(job.summary_path.read_text())
    assert summary["avatar_cache"] == "hit"
    assert any(node_cache.glob("*/entry.json"))  # the node's own cache got the track
    assert_playable_mp4(job.result_path, 1.6)
    assert len(decode_frames(job.result_path)) == 40
