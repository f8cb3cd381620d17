"""A script longer than the presenter's clip: the clip turns back where the head is still and close to its first
pose, chosen from the track known before decoding (heygem.face.turns), so the turns are not seen."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ASSETS, decode_frames, run_ffmpeg

from heygem.config import apply_overrides, load_config
from heygem.face.track import FaceTrack
from heygem.face.turns import turn_frames
from heygem.media.source import looped_indices, pingpong_indices

FPS = 25


def synthetic_track(offsets_x: np.ndarray, found: np.ndarray | None = None) -> FaceTrack:
    """A face whose 468 points all move by ``offsets_x`` (F,) pixels sideways."""
    rng = np.random.default_rng(0)
    base = rng.uniform(100, 200, size=(468, 2)).astype(np.float32)
    landmarks = np.repeat(base[None], len(offsets_x), axis=0)  # (F, 468, 2)
    landmarks[:, :, 0] += offsets_x[:, None].astype(np.float32)
    found = np.ones(len(offsets_x), bool) if found is None else found
    landmarks[~found] = np.nan
    boxes = np.stack([landmarks[..., 0].min(1), landmarks[..., 1].min(1), landmarks[..., 0].max(1),
                      landmarks[..., 1].max(1)], axis=1)
    return FaceTrack(found=found, raw_boxes=boxes.astype(np.float32), landmarks=landmarks)


def test_looped_indices_never_jump_cover_any_length_and_turn_where_asked():
    output = np.arange(1000)
    for turns in ([89, 10], [50, 0], [99, 0], [5, 5]):
        sources = looped_indices(output, turns)
        assert np.abs(np.diff(sources)).max() <= 1
        assert sources.min() >= 0 and sources.max() <= turns[0]
        assert (sources[: turns[0] + 1] == np.arange(turns[0] + 1)).all()  # straight from the first frame
        if turns[0] > turns[1]:
            reversals = [i for i in range(1, 999) if sources[i - 1] == sources[i + 1] != sources[i]]
            assert {int(sources[i]) for i in reversals} == set(turns)
    assert (pingpong_indices(output, 7) == looped_indices(output, [6, 0])).all()


def test_the_turns_are_still_stretches_near_the_first_pose_not_moving_ones():
    t = np.arange(120) / FPS
    moving = 12 * np.sin(2 * np.pi * t / 1.1)  # the head sways all the time ...
    offsets = moving.copy()
    offsets[15:25] = 0.5  # ... but for 10 frames near the start it rests close to where it began
    offsets[92:104] = 1.0  # ... and for 12 frames near the end
    offsets[84:88] = 9.0  # a short rest far from the first pose, in the last third too
    late, early = turn_frames(synthetic_track(offsets))
    assert 92 <= late < 104 and 15 <= early < 25

    # still, but far from the first pose: a still stretch close to it wins
    offsets = moving.copy()
    offsets[85:95] = 30.0
    offsets[105:115] = 0.0
    late, _ = turn_frames(synthetic_track(offsets))
    assert 105 <= late < 115


def test_frames_without_a_face_are_never_turned_at_and_a_short_clip_turns_at_its_ends():
    t = np.arange(90) / FPS
    offsets = 10 * np.sin(2 * np.pi * t / 1.3)
    offsets[70:80] = 0.0
    found = np.ones(90, bool)
    found[70:80] = False  # the still stretch has no face: not chosen
    late, early = turn_frames(synthetic_track(offsets, found))
    assert not (70 <= late < 80) and found[late] and found[early]
    assert turn_frames(synthetic_track(np.zeros(4))) == [3, 0]


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def swaying_clip(tmp_path_factory):
    """4 s at 25 fps: the portrait swaying sideways, fastest at the clip's first and last frames (where it
    would turn without a known track), still at the ends of each sway (every 0.8 s); it sinks slowly too,
    so that no two frames look alike."""
    path = tmp_path_factory.mktemp("clips") / "swaying.mp4"
    run_ffmpeg("-loop", "1", "-i", str(ASSETS / "astronaut.jpg"), "-f", "lavfi", "-i", "sine=frequency=220:duration=4",
               "-vf", "scale=420:420,crop=384:288:x='18+12*sin(2*PI*t/1.6)':y='10+25*t',format=yuv420p",
               "-r", str(FPS), "-t", "4", "-c:v", "libx264", "-preset", "ultrafast", "-crf", "12",
               "-c:a", "aac", "-shortest", str(path))
    return path


def nearest_sources(output_frames: np.ndarray, source_frames: np.ndarray, rows: slice) -> np.ndarray:
    """(N,) the source frame each output frame looks most like, on ``rows`` (above the mouth)."""
    source = source_frames[:, rows, ::2].astype(np.float32)  # (S, h, w/2, 3)
    matched = []
    for frame in output_frames[:, rows, ::2].astype(np.float32):
        matched.append(int(np.argmin(np.abs(source - frame).mean(axis=(1, 2, 3)))))
    return np.array(matched)


def test_a_long_script_on_a_presenter_turns_at_the_chosen_still_frames(tmp_path, swaying_clip, monkeypatch):
    from heygem.pipeline import generate
    from heygem.presenters.prepare import job_options, kept_track, prepare, use_for_job
    from heygem.presenters.records import PresenterStore

    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path / "cache"))
    store = PresenterStore(tmp_path / "outputs")
    presenter = prepare(store, store.create(swaying_clip, "swaying"))
    options = job_options(presenter, {"engine.name": "landmark"})
    config = apply_overrides(load_config(), options)
    face = use_for_job(presenter, config)
    speech = tmp_path / "speech.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "7.4", str(speech))

    summary = generate(face, speech, tmp_path / "long.mp4", config)
    assert summary.avatar_cache == "hit"
    written = json.loads((tmp_path / "long.json").read_text())
    source_frames = decode_frames(swaying_clip)  # (100, 288, 384, 3)
    track = kept_track(presenter.track_dir, config_geometry(swaying_clip))
    chosen = turn_frames(track)
    assert written["turns"] == chosen
    late, early = chosen
    count = len(source_frames)
    assert late < count - 3 and early > 2  # not the clip's ends, where the head moves fastest

    output_frames = decode_frames(tmp_path / "long.mp4")
    assert len(output_frames) == summary.frames > count + (late - early)  # turned at least twice
    matched = nearest_sources(output_frames, source_frames, slice(0, 110))
    expected = looped_indices(np.arange(len(output_frames)), chosen)
    # each output frame is the source frame the chosen turns give (which never jump), or, through the
    # encoder's noise, a neighbour of it
    assert np.abs(matched - expected).max() <= 1, (matched, expected)

    # around each turn the picture changes no more than it usually does from one frame to the next
    change = np.abs(np.diff(output_frames[:, :110].astype(np.int16), axis=0)).mean(axis=(1, 2, 3))  # (N - 1,)
    turns_at = [i for i in range(1, len(expected) - 1) if expected[i - 1] == expected[i + 1] != expected[i]]
    assert len(turns_at) >= 2
    near = {j for i in turns_at for j in (i - 1, i)}
    elsewhere = np.median([value for j, value in enumerate(change) if j not in near])
    for i in turns_at:
        assert max(change[i - 1], change[i]) <= elsewhere, (i, change[i - 1], change[i], elsewhere)


def config_geometry(clip):
    from heygem.media.probing import probe, working_geometry

    return working_geometry(probe(clip), load_config().media.output_height)
