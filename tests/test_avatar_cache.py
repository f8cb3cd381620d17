"""The avatar cache: keys, round trips, partial and whole-video entries, broken entries, concurrency, failures."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from heygem.config import REPO_ROOT, FaceConfig
from heygem.face import avatar_cache
from heygem.face import track as track_module
from heygem.face.track import FaceTrack, finalize_track, new_track
from heygem.types import FrameGeometry

GEOMETRY = FrameGeometry(width=320, height=240)
RATE = "30000/1001"


def make_track(frame_count: int, seed: int = 0, missing: tuple[int, ...] = ()) -> FaceTrack:
    """A raw track of random landmarks inside a 320x240 frame, with no face on the ``missing`` frames."""
    rng = np.random.default_rng(seed)
    track = new_track(frame_count)
    for index in range(frame_count):
        landmarks = None if index in missing else rng.uniform([20, 10], [300, 230], size=(468, 2)).astype(np.float32)
        track_module.record(track, index, landmarks)
    return track


def assert_same_track(loaded: FaceTrack, stored: FaceTrack) -> None:
    assert loaded.boxes is None
    assert loaded.found.dtype == bool and loaded.raw_boxes.dtype == np.float32 and loaded.landmarks.dtype == np.float32
    np.testing.assert_array_equal(loaded.found, stored.found)
    np.testing.assert_array_equal(loaded.raw_boxes, stored.raw_boxes)  # NaN rows compare equal
    np.testing.assert_array_equal(loaded.landmarks, stored.landmarks)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def presenter(tmp_path) -> Path:
    """A stand-in for a face video: the key only reads its bytes."""
    path = tmp_path / "presenter.mp4"
    path.write_bytes(np.random.default_rng(7).integers(0, 256, 50_000, dtype=np.uint8).tobytes())
    return path


def key_of(path: Path, face_config: FaceConfig | None = None, geometry: FrameGeometry = GEOMETRY,
           rate: str = RATE) -> str:
    return avatar_cache.avatar_key(path, face_config or FaceConfig(), geometry, rate)


def test_cache_folder_comes_from_the_environment_or_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert avatar_cache.cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("HEYGEM_CACHE_DIR")
    assert avatar_cache.cache_dir() == REPO_ROOT / "outputs" / "avatar-cache"


def test_the_test_session_never_caches_into_the_repository(avatar_cache_dir):
    assert Path(os.environ["HEYGEM_CACHE_DIR"]) == avatar_cache_dir
    assert REPO_ROOT not in avatar_cache_dir.resolve().parents


def test_a_stored_track_loads_back_equal_and_described(cache, presenter):
    key = key_of(presenter)
    track = make_track(40, missing=(3, 17, 18))
    avatar_cache.store_track(key, track, whole_video=True)

    cached = avatar_cache.load_track(key, frames_needed=40)
    assert cached is not None and cached.whole_video
    assert_same_track(cached.track, track)
    assert cached.track.frame_count == 40 and cached.track.frames_without_face == 3
    assert not cached.track.landmarks.flags.writeable  # a read-only memory map, shared safely by threads

    # the loaded track finalizes exactly like the fresh one, with a fixed box too (which writes `found`)
    fresh = finalize_track(make_track(40, missing=(3, 17, 18)), FaceConfig(), 320, 240)
    np.testing.assert_array_equal(finalize_track(cached.track, FaceConfig(), 320, 240).boxes, fresh.boxes)
    boxed = avatar_cache.load_track(key, frames_needed=40).track
    assert finalize_track(boxed, FaceConfig(box=[10, 10, 90, 90]), 320, 240).found.all()
    assert avatar_cache.load_track(key, 40).track.frames_without_face == 3  # the entry itself is untouched

    meta = json.loads((cache / key / "entry.json").read_text())
    assert meta["file"] == {"name": "presenter.mp4", "bytes": 50_000,
                            "sha256": hashlib.sha256(presenter.read_bytes()).hexdigest()}
    assert meta["face"] == dataclasses.asdict(FaceConfig())
    assert meta["geometry"] == {"width": 320, "height": 240} and meta["fps"] == RATE
    assert meta["frames"] == 40 and meta["whole_video"] is True and meta["format"] == avatar_cache.FORMAT_VERSION
    assert abs(meta["created"] - time.time()) < 60 and len(meta["checksum"]) == 64


def test_a_missing_entry_is_a_miss(cache, presenter):
    assert avatar_cache.load_track(key_of(presenter), frames_needed=1) is None


def test_a_copy_of_the_video_elsewhere_shares_the_key(tmp_path, presenter):
    copy = tmp_path / "copies" / "another name.mp4"
    copy.parent.mkdir()
    shutil.copyfile(presenter, copy)
    assert key_of(copy) == key_of(presenter)


@pytest.mark.parametrize("change", [
    {"pads": [0, 20, 0, 0]}, {"redetect_every": 5}, {"box": [10, 10, 100, 100]}, {"face_index": 1},
    {"smooth_window": 3}, {"min_confidence": 0.7},
])
def test_every_face_option_changes_the_key(presenter, change):
    assert key_of(presenter, dataclasses.replace(FaceConfig(), **change)) != key_of(presenter)


def test_geometry_and_rate_change_the_key(presenter):
    assert key_of(presenter, geometry=FrameGeometry(width=160, height=120)) != key_of(presenter)
    assert key_of(presenter, rate="25/1") != key_of(presenter)


def test_one_changed_byte_changes_the_key(tmp_path, presenter):
    original = key_of(presenter)
    changed_bytes = bytearray(presenter.read_bytes())
    changed_bytes[25_000] ^= 0x01

    elsewhere = tmp_path / "other" / presenter.name  # same name, same size, one byte different
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(bytes(changed_bytes))
    assert key_of(elsewhere) != original

    stat = presenter.stat()
    presenter.write_bytes(bytes(changed_bytes))  # edited in place
    os.utime(presenter, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert key_of(presenter) == key_of(elsewhere) != original


def test_the_content_digest_is_remembered_until_the_file_changes(presenter, monkeypatch):
    first = key_of(presenter)

    def no_reading(*args, **kwargs):
        raise AssertionError("the face video was read again")

    monkeypatch.setattr(avatar_cache, "open", no_reading, raising=False)
    assert key_of(presenter) == first  # the second call does not read the file
    assert key_of(presenter, FaceConfig(pads=[1, 2, 3, 4])) != first  # nor for other options
    stat = presenter.stat()
    os.utime(presenter, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(AssertionError, match="read again"):
        key_of(presenter)


def test_a_partial_entry_serves_only_the_frames_it_covers(cache, presenter):
    key = key_of(presenter)
    avatar_cache.store_track(key, make_track(20, seed=1), whole_video=False)
    assert avatar_cache.load_track(key, frames_needed=21) is None
    assert (cache / key).is_dir()  # too short is not broken: the entry stays
    for frames_needed in (20, 5):
        cached = avatar_cache.load_track(key, frames_needed)
        assert cached is not None and not cached.whole_video and cached.track.frame_count == 20


def test_a_whole_video_entry_serves_any_length(cache, presenter):
    key = key_of(presenter)
    avatar_cache.store_track(key, make_track(20, seed=1), whole_video=True)
    for frames_needed in (1, 20, 21, 100_000):
        cached = avatar_cache.load_track(key, frames_needed)
        assert cached is not None and cached.whole_video and cached.track.frame_count == 20


def test_an_entry_is_replaced_only_by_one_that_covers_more(cache, presenter):
    key = key_of(presenter)
    longer, shorter, whole = make_track(30, seed=1), make_track(10, seed=2), make_track(25, seed=3)
    avatar_cache.store_track(key, longer, whole_video=False)
    avatar_cache.store_track(key, shorter, whole_video=False)
    assert_same_track(avatar_cache.load_track(key, 1).track, longer)
    avatar_cache.store_track(key, whole, whole_video=True)
    assert_same_track(avatar_cache.load_track(key, 1).track, whole)
    avatar_cache.store_track(key, longer, whole_video=False)
    assert_same_track(avatar_cache.load_track(key, 1).track, whole)
    assert sorted(path.name for path in cache.iterdir()) == [key]  # nothing left beside it


def flip_landmark_bytes(entry: Path) -> None:
    path = entry / "landmarks.npy"
    data = bytearray(path.read_bytes())
    data[-5000] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate_landmarks(entry: Path) -> None:
    path = entry / "landmarks.npy"
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 468 * 2 * 4)


def flip_found(entry: Path) -> None:
    path = entry / "found.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def break_json(entry: Path) -> None:
    path = entry / "entry.json"
    path.write_text(path.read_text()[:-20])


def claim_more_frames(entry: Path) -> None:
    meta = json.loads((entry / "entry.json").read_text())
    meta["frames"] += 1
    (entry / "entry.json").write_text(json.dumps(meta))


def lose_raw_boxes(entry: Path) -> None:
    (entry / "raw_boxes.npy").unlink()


def nan_landmarks_with_a_matching_checksum(entry: Path) -> None:
    """A face frame whose landmarks are NaN, with the checksum recomputed: the finiteness check must catch it."""
    landmarks = np.load(entry / "landmarks.npy")
    landmarks[0, 100] = np.nan
    np.save(entry / "landmarks.npy", landmarks)
    digest = hashlib.sha256()
    for name in ("found.npy", "raw_boxes.npy", "landmarks.npy"):
        digest.update(np.load(entry / name).tobytes())
    meta = json.loads((entry / "entry.json").read_text())
    meta["checksum"] = digest.hexdigest()
    (entry / "entry.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", [flip_landmark_bytes, truncate_landmarks, flip_found, break_json,
                                    claim_more_frames, lose_raw_boxes, nan_landmarks_with_a_matching_checksum])
def test_a_broken_entry_is_dropped_and_rebuilt(cache, presenter, caplog, damage):
    key = key_of(presenter)
    track = make_track(12, seed=4, missing=(5,))
    avatar_cache.store_track(key, track, whole_video=True)
    damage(cache / key)

    with caplog.at_level(logging.WARNING, logger="heygem"):
        assert avatar_cache.load_track(key, frames_needed=1) is None
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "broken entry" in warnings[0].getMessage()
    assert list(cache.iterdir()) == []  # the entry is gone, and nothing beside it

    avatar_cache.store_track(key, track, whole_video=True)
    assert_same_track(avatar_cache.load_track(key, frames_needed=12).track, track)


def test_a_finalized_track_with_a_fixed_box_is_not_stored(cache, presenter, caplog):
    key = key_of(presenter)
    boxed = finalize_track(make_track(6, missing=(2,)), FaceConfig(box=[0, 0, 50, 50]), 320, 240)
    with caplog.at_level(logging.WARNING, logger="heygem"):
        avatar_cache.store_track(key, boxed, whole_video=True)  # every frame "found", one without landmarks
    assert "not storing" in caplog.text
    assert avatar_cache.load_track(key, 1) is None and not (cache / key).exists()


def test_concurrent_stores_of_one_key_leave_one_valid_entry(cache, presenter):
    key = key_of(presenter)
    tracks = [make_track(400, seed=seed) for seed in (10, 11)]  # ~1.5 MB each, so the writes overlap
    for _ in range(3):
        start = threading.Barrier(2)
        errors = []

        def store(track, start=start, errors=errors):
            try:
                start.wait()
                avatar_cache.store_track(key, track, whole_video=True)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=store, args=(track,)) for track in tracks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        cached = avatar_cache.load_track(key, frames_needed=400)
        assert cached is not None
        winner = next(track for track in tracks if np.array_equal(track.landmarks, cached.track.landmarks))
        assert_same_track(cached.track, winner)
        assert [path.name for path in cache.iterdir()] == [key]  # no unfinished folders left
        shutil.rmtree(cache / key)


def test_loads_while_another_thread_replaces_the_entry_never_see_a_mix(cache, presenter, caplog):
    key = key_of(presenter)
    short, whole = make_track(200, seed=20), make_track(300, seed=21)
    avatar_cache.store_track(key, short, whole_video=False)
    results = []
    done = threading.Event()

    def keep_loading():
        while not done.is_set():
            results.append(avatar_cache.load_track(key, frames_needed=1))

    reader = threading.Thread(target=keep_loading)
    with caplog.at_level(logging.WARNING, logger="heygem"):
        reader.start()
        avatar_cache.store_track(key, whole, whole_video=True)
        time.sleep(0.05)
        done.set()
        reader.join()
    assert "broken" not in caplog.text
    for cached in results:
        if cached is not None:  # a miss is allowed while the folders swap, a mixture is not
            assert_same_track(cached.track, whole if cached.whole_video else short)
    assert_same_track(avatar_cache.load_track(key, 1).track, whole)


def unwritable_as_a_file(cache: Path, monkeypatch) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("not a folder")  # mkdir and every write below it fail, even for root


def disk_full(cache: Path, monkeypatch) -> None:
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(avatar_cache.os, "fsync", no_space)


def read_only_folder(cache: Path, monkeypatch) -> None:
    cache.mkdir(parents=True)
    cache.chmod(0o555)
    probe = cache / "probe"
    try:
        probe.mkdir()
    except PermissionError:
        return
    probe.rmdir()
    cache.chmod(0o755)
    pytest.skip("this user can write into read-only folders (root)")


@pytest.mark.parametrize("make_unwritable", [unwritable_as_a_file, disk_full, read_only_folder])
def test_a_cache_that_cannot_be_written_warns_and_returns(cache, presenter, caplog, monkeypatch, make_unwritable):
    make_unwritable(cache, monkeypatch)
    key = key_of(presenter)
    try:
        with caplog.at_level(logging.WARNING, logger="heygem"):
            avatar_cache.store_track(key, make_track(8), whole_video=True)
        assert "could not store" in caplog.text
        monkeypatch.undo()
        monkeypatch.setenv("HEYGEM_CACHE_DIR", str(cache))
        assert avatar_cache.load_track(key, 1) is None
        if cache.is_dir():
            assert list(cache.iterdir()) == []  # no unfinished folder left behind
    finally:
        if cache.is_dir():
            cache.chmod(0o755)


def test_clear_cache_removes_old_entries_or_all(cache, tmp_path):
    keys = []
    for index in range(3):
        video = tmp_path / f"video{index}.mp4"
        video.write_bytes(bytes([index]) * 100)
        keys.append(key_of(video))
        avatar_cache.store_track(keys[-1], make_track(4, seed=index), whole_video=True)
    meta_path = cache / keys[0] / "entry.json"
    meta = json.loads(meta_path.read_text())
    meta["created"] -= 7200  # stored two hours ago
    meta_path.write_text(json.dumps(meta))
    leftover = cache / f".{keys[1]}.0123.partial"  # a crash while writing, long ago
    leftover.mkdir()
    os.utime(leftover, (time.time() - 7200, time.time() - 7200))

    assert avatar_cache.clear_cache(older_than_seconds=3600) == 1
    assert sorted(path.name for path in cache.iterdir()) == sorted(keys[1:])
    assert avatar_cache.load_track(keys[1], 1) is not None
    assert avatar_cache.clear_cache() == 2
    assert list(cache.iterdir()) == []
    assert avatar_cache.clear_cache() == 0


def test_only_keys_made_by_avatar_key_name_folders(cache):
    for bad in ("../outside", "", "A" * 64, "0" * 63):
        with pytest.raises(ValueError, match="not an avatar cache key"):
            avatar_cache.load_track(bad, 1)
        with pytest.raises(ValueError, match="not an avatar cache key"):
            avatar_cache.store_track(bad, make_track(2), whole_video=True)
