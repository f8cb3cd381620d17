"""Live sessions on one engine share it (heygem.live.batching): their due frames are drawn in one engine call,
each the frame it would get alone; a session that ends leaves the others running; an error reaches only the
frames concerned. A random-init Wav2Lip checkpoint on the CPU, the bundled portrait, two mel windows of speech."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import ASSETS

from heygem.config import apply_overrides, load_config
from heygem.live import batching
from heygem.live.engine_step import Wav2LipStep
from heygem.live.face import BUNDLED_PORTRAIT, load_face
from heygem.speech.audio import load_audio_16k, melspectrogram


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch

    from heygem.models.wav2lip import Wav2Lip

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / "wav2lip.pth"
    torch.save({"state_dict": Wav2Lip().state_dict()}, path)  # random weights, the public layout
    return path


@pytest.fixture(scope="module")
def portrait():
    """(frame (H * 3/2, W) uint8 I420, its face) of the bundled portrait at 360p, as a session shows it."""
    face = load_face(BUNDLED_PORTRAIT, apply_overrides(load_config(), {"media.output_height": 360}), "portrait")
    return face.frames_i420[0], face.faces[0]


@pytest.fixture(scope="module")
def requests(portrait):
    """Two sessions' (frame, face, mel window): the portrait, and the portrait a little brighter (so that their
    mouths differ even where a random generator draws the same mouth for any sound), hearing the words 1 s and
    1.5 s into the speech."""
    mel = melspectrogram(load_audio_16k(ASSETS / "speech_en.wav")[: 16000 * 2])  # (80, 160)
    frame_i420, face = portrait
    brighter = frame_i420.copy()
    luma_rows = frame_i420.shape[0] * 2 // 3
    brighter[:luma_rows] = np.clip(brighter[:luma_rows].astype(int) + 30, 0, 255)
    return [(frame_i420, face, mel[:, 80:96]), (brighter, face, mel[:, 120:136])]


@pytest.fixture
def patient(monkeypatch):
    """A call waits for every seated session's request however long it takes (not a few ms): which frames
    share a call does not hang on the machine's load."""
    monkeypatch.setattr(batching, "GATHER_SECONDS", 600.0)


def counting_faces(engine, monkeypatch, fail_first: bool = False) -> list[int]:
    """The faces of each generator call on ``engine`` from now on; with ``fail_first`` its first call raises."""
    calls: list[int] = []
    mouths = engine.mouths

    def counted(crops, mel_windows):
        calls.append(len(crops))
        if fail_first and len(calls) == 1:
            raise RuntimeError("the generator failed")
        return mouths(crops, mel_windows)

    monkeypatch.setattr(engine, "mouths", counted)
    return calls


def test_a_live_frame_is_the_frame_a_job_draws(checkpoint, requests):
    """A session's frame is the one a job's path makes of the same frame, face and mel window (the engine's
    ``generate``: crop, generator, mouth scaled to the box; then the same blend), byte for byte."""
    from heygem.engines.wav2lip.engine import Wav2LipEngine
    from heygem.live.engine_step import mouth_into_frame
    from heygem.types import EngineBatch

    config = load_config()
    engine = Wav2LipEngine(checkpoint, config.engine)
    drawn = alone(checkpoint, requests)
    for (frame_i420, face, mel), frame in zip(requests, drawn, strict=True):
        def job_patch(frame_bgr, face=face, mel=mel):
            return engine.generate(EngineBatch(np.zeros(1, np.int64), [frame_bgr], [face], mel[None], 25.0))[0]

        expected = mouth_into_frame(frame_i420, face, config.blend, job_patch)
        assert np.abs(expected.astype(int) - frame_i420).max() > 20, "a mouth was drawn"
        np.testing.assert_array_equal(frame, expected)


def alone(checkpoint, requests) -> list[np.ndarray]:
    """The frame of each request drawn by a session that is the only one on its engine."""
    step = Wav2LipStep(load_config(), 25.0, checkpoint, batch_size=2)
    try:
        return [step.render(*request) for request in requests]
    finally:
        step.close()


def at_once(steps, requests) -> list:
    """Each step renders its request, all at the same time; each one's frame or error."""
    def render(step, request):
        try:
            return step.render(*request)
        except Exception as error:  # noqa: BLE001 - the test looks at which frames failed
            return error

    with ThreadPoolExecutor(len(steps)) as pool:
        return list(pool.map(render, steps, requests))


def same(frames, expected) -> bool:
    """Each frame is its expected one within a level (a batch of two rounds a little otherwise than one)."""
    return all(frame.shape == wanted.shape and np.abs(frame.astype(int) - wanted).max() <= 1
               for frame, wanted in zip(frames, expected, strict=True))


def test_two_sessions_share_one_generator_call_and_get_the_frames_they_would_get_alone(
        checkpoint, requests, patient, monkeypatch):
    expected = alone(checkpoint, requests)
    assert all(np.abs(frame.astype(int) - request[0]).max() > 20 for frame, request in zip(expected, requests)), \
        "a mouth was drawn"

    steps = [Wav2LipStep(load_config(), 25.0, checkpoint, batch_size=2) for _ in range(2)]
    try:
        assert steps[0].engine is steps[1].engine, "one generator for the sessions on one checkpoint"
        calls = counting_faces(steps[0].engine, monkeypatch)
        together = at_once(steps, requests)
        assert calls == [2], "one generator call on both sessions' faces"
        assert same(together, expected)
        assert not same(together[::-1], expected), "each session has its own frame back"
    finally:
        for step in steps:
            step.close()


def test_sessions_of_presenters_of_two_sizes_share_one_call(checkpoint, requests, patient, monkeypatch):
    """Sessions of two presenters whose frames differ in size (another aspect ratio) are drawn in one generator
    call too, each the frame it would get alone."""
    (frame_i420, face, mel), _ = requests
    luma_rows, width = frame_i420.shape[0] * 2 // 3, frame_i420.shape[1]
    narrower = width - 64  # the frame's right 64 columns cut off: another presenter's size, the face still inside
    planes = (frame_i420[:luma_rows, :narrower], frame_i420[luma_rows:luma_rows + luma_rows // 4].reshape(
        luma_rows // 2, width // 2)[:, :narrower // 2], frame_i420[luma_rows + luma_rows // 4:].reshape(
        luma_rows // 2, width // 2)[:, :narrower // 2])
    cut = np.concatenate([planes[0], planes[1].reshape(-1, narrower), planes[2].reshape(-1, narrower)])
    assert face.box[2] < narrower
    two_sizes = [requests[0], (cut, face, requests[1][2])]
    expected = alone(checkpoint, two_sizes)
    assert expected[0].shape != expected[1].shape

    steps = [Wav2LipStep(load_config(), 25.0, checkpoint, batch_size=2) for _ in range(2)]
    try:
        calls = counting_faces(steps[0].engine, monkeypatch)
        together = at_once(steps, two_sizes)
        assert calls == [2], "one generator call on both presenters' faces"
        assert same(together, expected)
    finally:
        for step in steps:
            step.close()


def test_a_session_that_ends_leaves_the_other_drawing(checkpoint, requests, patient, monkeypatch):
    expected = alone(checkpoint, requests)
    first, second = (Wav2LipStep(load_config(), 25.0, checkpoint, batch_size=2) for _ in range(2))
    try:
        calls = counting_faces(first.engine, monkeypatch)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(second.render, *requests[1])  # its call waits for the first's frame
            while not first.seat.shared._waiting and not waiting.done():
                time.sleep(0.01)
            first.close()  # the first session ends instead
            frame = waiting.result(timeout=120)
        again = second.render(*requests[0])
        assert same([frame, again], expected[::-1])
        assert calls == [1, 1], "the second session alone, frame after frame"
        third = Wav2LipStep(load_config(), 25.0, checkpoint, batch_size=2)
        try:
            assert third.engine is second.engine, "a session that starts sits at the running engine"
            together = at_once([second, third], requests)
            assert calls[2:] == [2] and same(together, expected)
        finally:
            third.close()
    finally:
        first.close()
        second.close()


def test_an_error_fails_only_the_frames_it_concerns(checkpoint, requests, patient, monkeypatch):
    expected = alone(checkpoint, requests)
    steps = [Wav2LipStep(load_config(), 25.0, checkpoint, batch_size=2) for _ in range(2)]
    try:
        calls = counting_faces(steps[0].engine, monkeypatch, fail_first=True)
        failed = at_once(steps, requests)
        assert calls == [2] and all(isinstance(error, RuntimeError) for error in failed), \
            "the generator's error reaches both sessions of its call"
        wrong_window = (*requests[0][:2], np.zeros((80, 5), np.float32))
        mixed = at_once(steps, [wrong_window, requests[1]])
        assert isinstance(mixed[0], ValueError) and "mel window" in str(mixed[0])
        assert same(mixed[1:], expected[1:]), "the other session's frame is drawn"
        assert calls == [2, 1]
        assert same(at_once(steps, requests), expected), "the engine's thread goes on after the errors"
    finally:
        for step in steps:
            step.close()


def test_the_video_frames_of_all_sessions_fall_due_together():
    import asyncio

    from heygem.live.tracks import _Pacer

    async def two_tracks():
        first = _Pacer(0.04, on_grid=True)
        due_first = [await first.next_due() for _ in range(2)]
        await asyncio.sleep(0.013)  # a session that starts a little later
        second = _Pacer(0.04, on_grid=True)
        return due_first, [await second.next_due() for _ in range(2)]

    due_first, due_second = asyncio.run(two_tracks())
    for _, due in due_first + due_second:
        periods = (due - due_first[0][1]) / 0.04
        assert abs(periods - round(periods)) < 1e-6, "every frame on the one grid of frame times"
    assert [index for index, _ in due_second] == [0, 1]


def test_a_shared_engine_counts_its_calls_frames_and_the_time_they_took():
    def slow_batch(items):  # each call takes at least 0.05 s
        time.sleep(0.05)
        return [item * 2 for item in items]

    seat = batching.take_seat(("slow", "counted"), object, lambda engine: slow_batch)
    try:
        assert [seat.draw(number) for number in (1, 2, 3)] == [2, 4, 6]
        use = next(use for use in batching.engines_in_use() if use.name == "slow")
    finally:
        seat.leave()
    assert (use.sessions, use.calls, use.frames) == (1, 3, 3)
    assert use.busy_seconds >= 3 * 0.05
