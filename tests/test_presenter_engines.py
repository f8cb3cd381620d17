"""What an installed engine prepares once for a presenter: MuseTalk's crop latents, encoded when the
presenter is prepared, so a job made from it never runs the VAE encoder (reduced random-init files on
the CPU, the 2 s face video)."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from conftest import ASSETS, decode_frames, run_ffmpeg

from heygem.engines.musetalk import MUSETALK_ENGINE, MuseTalkKind
from heygem.presenters.prepare import job_options, prepare, presenter_config, use_for_job
from heygem.presenters.records import READY, PresenterStore
from heygem.runtime.kept import KEPT


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    path = tmp_path_factory.mktemp("speech") / "speech.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-ss", "0.4", "-t", "1.2", str(path))
    return path


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty avatar cache, and no engine kept from another test (a job loads its own)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(cache))
    KEPT.release()
    yield cache
    KEPT.release()


def latent_files(cache) -> list:
    return sorted((cache / "latents").rglob("*.npy")) if (cache / "latents").is_dir() else []


def counting_encoder(monkeypatch) -> list[int]:
    """Every call of MuseTalk's VAE encoder, counted (the faces of each call)."""
    import heygem.engines.musetalk.engine as engine_module

    calls: list[int] = []
    encode_faces = engine_module.encode_faces

    def counted(vae, faces_rgb, *args, **kwargs):
        calls.append(len(faces_rgb))
        return encode_faces(vae, faces_rgb, *args, **kwargs)

    monkeypatch.setattr(engine_module, "encode_faces", counted)
    return calls


def presenter_job(presenter, speech, output):
    from heygem.config import apply_overrides, load_config
    from heygem.pipeline import generate

    options = {"engine.name": "musetalk"}
    config = presenter_config(presenter.face_index, apply_overrides(load_config(), options))
    summary = generate(use_for_job(presenter, config), speech, output, overrides=job_options(presenter, options))
    assert summary.engine == "musetalk" and summary.avatar_cache == "hit"
    return decode_frames(output).astype(np.int16)


def test_a_job_from_a_prepared_presenter_encodes_no_crop_and_makes_the_same_video(
        musetalk_weights, speech, face_video, fresh, tmp_path, monkeypatch):
    monkeypatch.setenv("HEYGEM_WEIGHTS", str(musetalk_weights))
    store = PresenterStore(tmp_path / "outputs")
    reported: list[float] = []
    presenter = prepare(store, store.create(face_video, "muse"), progress=reported.append)
    assert presenter.status == READY and presenter.prepared == ["track", "musetalk latents"]
    assert presenter.to_dict()["prepared"] == ["track", "musetalk latents"]
    assert reported == sorted(reported) and reported[-1] > 0.9 and any(0.6 < value < 0.95 for value in reported)
    prepared_latents = latent_files(fresh)
    assert 0 < len(prepared_latents) <= 60  # one per distinct crop of the clip's 60 frames

    KEPT.release()  # the job loads an engine of its own: nothing comes from the preparation's memory
    calls = counting_encoder(monkeypatch)
    prepared_frames = presenter_job(presenter, speech, tmp_path / "prepared.mp4")
    assert calls == [] and latent_files(fresh) == prepared_latents

    KEPT.release()
    shutil.rmtree(fresh / "latents")  # the same job, encoding the crops' latents itself
    encoded_frames = presenter_job(presenter, speech, tmp_path / "encoded.mp4")
    assert sum(calls) > 0 and 0 < len(latent_files(fresh)) <= len(prepared_latents)
    assert prepared_frames.shape == encoded_frames.shape and len(prepared_frames) == 36  # 1.2 s at 29.97 fps
    difference = np.abs(prepared_frames - encoded_frames)
    assert difference.mean() < 0.2 and difference.max() <= 8, (difference.mean(), difference.max())


def test_without_musetalk_files_nothing_is_loaded_and_a_failed_engine_step_leaves_the_presenter_usable(
        musetalk_weights, face_video, fresh, tmp_path, monkeypatch, caplog):
    def no_load(*args, **kwargs):
        raise AssertionError("no engine is loaded without its files")

    with monkeypatch.context() as patch:
        patch.setattr(MuseTalkKind, "load", no_load)
        store = PresenterStore(tmp_path / "outputs")
        plain = prepare(store, store.create(face_video, "plain"))  # the test's weights folder is empty
    assert plain.status == READY and plain.prepared == ["track"] and latent_files(fresh) == []
    assert KEPT.kept(MUSETALK_ENGINE) == []

    def broken(self, engine, batches):
        raise RuntimeError("out of memory")

    monkeypatch.setenv("HEYGEM_WEIGHTS", str(musetalk_weights))
    monkeypatch.setattr(MuseTalkKind, "prepare_presenter", broken)
    with caplog.at_level(logging.WARNING, logger="heygem"):
        usable = prepare(store, store.create(face_video, "usable"))
    assert usable.status == READY and usable.prepared == ["track"] and latent_files(fresh) == []
    assert any("musetalk latents" in record.getMessage() and "out of memory" in record.getMessage()
               for record in caplog.records), caplog.text


def test_a_presenters_table_of_an_earlier_version_gets_the_prepared_column(tmp_path):
    import re
    import sqlite3

    from heygem.presenters import records

    outputs = tmp_path / "outputs"
    outputs.mkdir()
    earlier = re.sub(r",( +--[^\n]*\n) +prepared [^\n]*\n", r"\1", records._SCHEMA)  # the column left out
    assert "prepared" not in earlier.split("CREATE INDEX")[0]
    with sqlite3.connect(outputs / records.DATABASE_NAME) as db:
        db.executescript(earlier)
        db.execute("INSERT INTO presenters (id, name, status, created, clip_name, kind, seconds, width, height, "
                   "bytes) VALUES ('p-20240501-120000-3fa2c1', 'old', 'ready', 0, 'c.mp4', 'video', 2, 320, 240, 1)")
    (old,) = PresenterStore(outputs).list()
    assert old.prepared == [] and old.to_dict()["prepared"] == []
