"""Probing and decoding through ffmpeg."""

import os
import shutil
import subprocess
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import ASSETS, run_ffmpeg

from heygem.errors import HeygemError
from heygem.media.decode import (
    DecoderShare,
    _Decoder,
    decoder_count,
    iter_video_batches,
    iter_video_i420,
    load_image,
    video_decode_args,
)
from heygem.media.ffmpeg import ffmpeg_binary
from heygem.media.frames import (
    BgrImage,
    I420Frames,
    bgr_to_yuv420,
    i420_batch_to_bgr,
    i420_planes,
    resample_region,
    write_region_i420,
    yuv420_to_bgr,
)
from heygem.media.probing import fps_to_fraction, probe, working_geometry
from heygem.types import MediaInfo


def test_decode_arguments_are_plain_lists():
    info = MediaInfo(path=Path("in put.mp4"), kind="video", width=641, height=361, fps=29.97, fps_fraction="30000/1001")
    geometry = working_geometry(info, None)
    assert (geometry.width, geometry.height) == (640, 360)
    args = video_decode_args(info.path, info.fps_fraction, geometry, info)
    assert args[args.index("-i") + 1] == "in put.mp4"  # one argument, no shell quoting needed
    assert "fps=fps=30000/1001" in args[args.index("-filter_complex") + 1]
    assert "crop=640:360:0:0" in args[args.index("-filter_complex") + 1]
    assert args[-5:] == ["-f", "rawvideo", "-pix_fmt", "yuv420p", "pipe:"]

    scaled = working_geometry(info, 241)
    assert (scaled.width, scaled.height) == (426, 240)
    scaled_args = video_decode_args(info.path, info.fps_fraction, scaled, info)
    assert "scale=426:240:flags=area:out_range=tv" in scaled_args[scaled_args.index("-filter_complex") + 1]


def test_fps_fractions():
    assert fps_to_fraction(25) == "25/1"
    assert fps_to_fraction(29.97002997) == "30000/1001"
    assert fps_to_fraction(60) == "60/1"


def test_probe_applies_rotation_and_decoding_matches(media_dir):
    source = media_dir / "plain.mp4"
    rotated = media_dir / "rotated.mp4"
    run_ffmpeg("-f", "lavfi", "-i", "testsrc=size=160x90:rate=30", "-t", "1", "-pix_fmt", "yuv420p", str(source))
    try:  # ffmpeg 6 and newer set the display matrix with an input option
        run_ffmpeg("-display_rotation", "90", "-i", str(source), "-c", "copy", str(rotated))
    except subprocess.CalledProcessError:  # older ones with the rotate tag
        run_ffmpeg("-i", str(source), "-c", "copy", "-metadata:s:v", "rotate=90", str(rotated))
    info = probe(rotated)
    assert info.kind == "video" and (info.width, info.height) == (90, 160)
    assert info.fps_fraction == "30/1" and info.frame_count == 30 and not info.has_audio
    geometry = working_geometry(info, None)
    batches = list(iter_video_batches(info, geometry, batch_frames=8))
    assert [len(b) for b in batches] == [8, 8, 8, 6]
    assert batches[0].shape[1:] == (160, 90, 3)


def test_images_grey_alpha_and_odd_sizes(tmp_path):
    grey = np.tile(np.arange(101, dtype=np.uint8), (77, 1))  # 101x77: odd both ways
    cv2.imwrite(str(tmp_path / "grey.png"), grey)
    info = probe(tmp_path / "grey.png")
    assert info.kind == "image" and (info.width, info.height) == (101, 77)
    image = load_image(info, working_geometry(info, None))
    assert image.shape == (76, 100, 3)
    np.testing.assert_array_equal(image[:, :, 0], grey[:76, :100])

    rgba = np.zeros((40, 60, 4), dtype=np.uint8)
    rgba[:, :30] = (0, 0, 255, 255)  # opaque red on the left, transparent on the right
    cv2.imwrite(str(tmp_path / "alpha.png"), rgba)
    info = probe(tmp_path / "alpha.png")
    image = load_image(info, working_geometry(info, None))
    assert tuple(image[5, 5]) == (0, 0, 255) and tuple(image[5, 50]) == (255, 255, 255)

    cv2.imwrite(str(tmp_path / "photo.webp"), np.full((50, 64, 3), 90, np.uint8))
    assert probe(tmp_path / "photo.webp").kind == "image"


def test_user_errors_are_clear(tmp_path):
    with pytest.raises(HeygemError, match="file not found"):
        probe(tmp_path / "missing.mp4")
    junk = tmp_path / "notes.mp4"
    junk.write_text("this is not a video")
    with pytest.raises(HeygemError, match="not a media file"):
        probe(junk)
    with pytest.raises(HeygemError, match="notes.mp4 could not be decoded: it is named as a video"):
        probe(junk, "face")  # a text file named .mp4: not "the face must be a video"


def test_ffmpeg_binary_is_found():
    assert Path(ffmpeg_binary()).exists()


def test_a_failed_look_up_of_the_bundled_ffmpeg_is_tried_again(monkeypatch):
    """imageio-ffmpeg caches a failed check for good; one passing failure must not leave every later job
    with "ffmpeg was not found" (seen once in a server restarted under load)."""
    import functools

    _utils = pytest.importorskip("imageio_ffmpeg._utils")
    real_lookup = _utils._get_ffmpeg_exe
    real_lookup.cache_clear()
    calls = []

    @functools.lru_cache
    def flaky_lookup():
        calls.append(1)
        return None if len(calls) == 1 else real_lookup()

    monkeypatch.setattr(_utils, "_get_ffmpeg_exe", flaky_lookup)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    for variable in ("HEYGEM_FFMPEG", "IMAGEIO_FFMPEG_EXE"):
        monkeypatch.delenv(variable, raising=False)
    ffmpeg_binary.cache_clear()
    try:
        found = ffmpeg_binary()
    finally:
        ffmpeg_binary.cache_clear()
    assert len(calls) == 2
    version = subprocess.run([found, "-version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("ffmpeg version")


def test_writing_a_region_back_gives_the_bytes_a_whole_frame_conversion_gives():
    portrait = cv2.resize(cv2.imread(str(ASSETS / "astronaut.jpg")), (160, 120), interpolation=cv2.INTER_AREA)
    frame_i420 = bgr_to_yuv420(portrait)
    frame_bgr = yuv420_to_bgr(frame_i420, 160, 120)
    rng = np.random.default_rng(5)
    frame_bgr[31:77, 45:101] = rng.integers(0, 256, (46, 56, 3), dtype=np.uint8)  # odd edges on purpose
    whole = bgr_to_yuv420(frame_bgr)
    in_place = frame_i420.copy()
    write_region_i420(in_place, frame_bgr, (45, 31, 101, 77))
    changed = np.zeros((120, 160), bool)
    changed[30:78, 44:102] = True  # the region widened to even coordinates
    for ours, theirs, before, scale in zip(i420_planes(in_place), i420_planes(whole),
                                           i420_planes(frame_i420), (1, 2, 2)):
        inside = changed[::scale, ::scale]
        np.testing.assert_array_equal(ours[inside], theirs[inside])  # as a whole-frame conversion gives
        np.testing.assert_array_equal(ours[~inside], before[~inside])  # and every other byte as it was
    y, u, v = i420_planes(in_place)
    assert y.shape == (120, 160) and u.shape == v.shape == (60, 80) and np.shares_memory(y, in_place)


def _decoded(info, geometry, batch_frames: int, decoders: int) -> list[np.ndarray]:
    return list(iter_video_i420(info, geometry, batch_frames, decoders))


@pytest.mark.parametrize("fps_fraction, height", [(None, None), ("25/1", None), ("25/1", 120)])
def test_several_decoders_give_the_frames_and_batches_one_decoder_gives(face_video, fps_fraction, height):
    import dataclasses

    info = probe(face_video)  # 2 s at 29.97 fps, 320x240
    if fps_fraction:  # the rate conversion happens before the frames are dealt out
        info = dataclasses.replace(info, fps=25.0, fps_fraction=fps_fraction)
    geometry = working_geometry(info, height)
    alone = _decoded(info, geometry, 7, 1)
    assert sum(len(batch) for batch in alone) > 40
    for decoders in (2, 3):
        shared = _decoded(info, geometry, 7, decoders)
        assert [len(batch) for batch in shared] == [len(batch) for batch in alone]
        np.testing.assert_array_equal(np.concatenate(shared), np.concatenate(alone))


def test_a_shared_decode_stopped_early_leaves_no_ffmpeg_running(face_video):
    from bench_pipeline import child_pids

    info = probe(face_video)
    geometry = working_geometry(info, None)
    before = set(child_pids(os.getpid()))
    batches = iter_video_i420(info, geometry, 4, decoders=3)
    first = next(batches)
    assert len(first) == 4 and len(set(child_pids(os.getpid(), living=True)) - before) == 3
    batches.close()
    assert not set(child_pids(os.getpid())) - before  # killed and reaped


@pytest.mark.parametrize("held", [1, 2])
def test_shared_decoders_read_no_further_ahead_than_allowed(long_video, monkeypatch, held):
    """Each decoder holds at most DECODER_BATCHES batches (the one it reads included): a reader
    that takes batches slowly does not make them pile up."""
    import threading
    import time

    monkeypatch.setattr("heygem.media.decode.DECODER_BATCHES", held)
    reads = []
    lock = threading.Lock()
    read_batch = _Decoder.read_batch

    def counted(self, batch_frames, geometry):
        batch = read_batch(self, batch_frames, geometry)
        with lock:
            reads.append(len(batch))
        return batch

    monkeypatch.setattr(_Decoder, "read_batch", counted)
    info = probe(long_video)
    batches = iter_video_i420(info, working_geometry(info, None), 4, decoders=3)
    taken = [next(batches) for _ in range(2)]
    time.sleep(1.0)  # the decoders have long had time to read whatever they may
    with lock:
        read = len(reads)
    batches.close()
    # three decoders, each holding `held` batches, plus one more for each of the two taken
    assert read == 3 * held + 2 and all(len(batch) == 4 for batch in taken)


@pytest.mark.parametrize("decoders", [1, 3])
def test_a_video_gone_after_probing_is_one_clear_error(tmp_path, face_video, decoders):
    moved = tmp_path / "face.mp4"
    moved.write_bytes(face_video.read_bytes())
    info = probe(moved)
    moved.unlink()
    with pytest.raises(HeygemError, match="could not decode face.mp4: .*No such file"):
        _decoded(info, working_geometry(info, None), 4, decoders)


def test_decoder_count():
    from heygem.types import FrameGeometry

    full_hd, small = FrameGeometry(1920, 1080), FrameGeometry(640, 360)
    assert decoder_count(2, small, cpu_count=2) == 2  # asked for
    assert decoder_count(0, full_hd, cpu_count=2) == 1
    assert decoder_count(0, full_hd, cpu_count=16) == 3
    assert decoder_count(0, full_hd, cpu_count=10) == 2
    assert decoder_count(0, small, cpu_count=32) == 1  # one pipe carries small frames fast enough
    decode_args = video_decode_args(Path("v.mp4"), "25/1", full_hd,
                                          MediaInfo(path=Path("v.mp4"), kind="video", width=1920, height=1080, fps=25.0,
                                                    fps_fraction="25/1"),
                                          DecoderShare(index=1, count=3, chunk_frames=32))
    graph = decode_args[decode_args.index("-filter_complex") + 1]
    assert (graph.index("fps=") < graph.index("select=eq(mod(floor(n/32)\\,3)\\,1)")
            < graph.index("setpts=N/FRAME_RATE/TB"))


def test_i420_frames_convert_each_frame_or_region_as_the_whole_batch_conversion_does(face_video):
    info = probe(face_video)
    planes = next(iter_video_i420(info, working_geometry(info, None), 5))
    frames = I420Frames(planes)
    whole = i420_batch_to_bgr(planes)
    assert len(frames) == 5
    np.testing.assert_array_equal(np.stack([frame.bgr() for frame in frames]), whole)
    frame = frames[3]
    assert (frame.height, frame.width) == whole.shape[1:3]
    np.testing.assert_array_equal(frame.bgr(), whole[3])
    height, width = whole.shape[1:3]
    # odd and even corners, the frame's edges, a single pixel: widened to whole chroma blocks and cut back
    for x1, y1, x2, y2 in [(31, 17, 200, 151), (30, 16, 200, 150), (0, 0, width, height), (1, 1, width - 1, height - 1),
                           (width - 3, height - 5, width, height), (7, 9, 8, 10)]:
        region = frame.region(x1, y1, x2, y2)
        np.testing.assert_array_equal(region, whole[3, y1:y2, x1:x2])
        np.testing.assert_array_equal(frame.region(x1, y1, x2, y2, rgb=True), region[..., ::-1])
    # resampled: the same from I420 as from the BGR frame, unless the region shrinks to half or less and
    # is halved in I420 first (then the same picture within a few levels)
    image = BgrImage(whole[3])
    for box, size in [((31, 17, 201, 151), (120, 90)), ((31, 17, 51, 31), (60, 42)),
                      ((0, 0, width, height), (400, 300))]:
        np.testing.assert_array_equal(frame.region(*box, rgb=True, size=size), image.region(*box, rgb=True, size=size))
    halved = frame.region(31, 17, 287, 223, rgb=True, size=(96, 78)).astype(int)
    expected = image.region(31, 17, 287, 223, rgb=True, size=(96, 78))
    assert halved.shape == (78, 96, 3) and np.abs(halved - expected).mean() < 4 and np.abs(halved - expected).max() < 64
    image_bgr = whole[3]
    image = BgrImage(image_bgr)
    np.testing.assert_array_equal(image.region(31, 17, 200, 151, rgb=True), image_bgr[17:151, 31:200, ::-1])
    assert image.bgr() is image_bgr


@pytest.mark.parametrize("size", [(40, 30), (13, 11), (200, 150), (97, 71)])
def test_a_resampled_region_puts_the_box_edges_on_the_result_edges(size):
    # a ramp whose value is the frame x (or y) coordinate: each result pixel must hold the frame coordinate
    # of its centre, whether the region is enlarged, shrunk a little or halved twice first
    height, width = 300, 400
    ramp_x = np.broadcast_to(np.arange(width, dtype=np.float32), (height, width))
    ramp_y = np.broadcast_to(np.arange(height, dtype=np.float32)[:, None], (height, width))
    image = np.ascontiguousarray(np.stack([ramp_x, ramp_y], axis=2)[40:260, 60:380])  # origin (60, 40)
    box = (71, 53, 351, 243)
    result = resample_region(image, (60, 40), 1, box, size)
    step_x, step_y = (box[2] - box[0]) / size[0], (box[3] - box[1]) / size[1]
    centre_x = box[0] + (np.arange(size[0]) + 0.5) * step_x - 0.5  # pixel centres as integers, as the ramp counts
    centre_y = box[1] + (np.arange(size[1]) + 0.5) * step_y - 0.5
    pixel_size = 1  # frame pixels per pixel of the image the last warp reads: it places samples to 1/32 of those
    while step_x >= 2 * pixel_size and step_y >= 2 * pixel_size:
        pixel_size *= 2
    tolerance = pixel_size / 32 + 0.01
    np.testing.assert_allclose(result[..., 0], np.broadcast_to(centre_x, (size[1], size[0])), atol=tolerance)
    np.testing.assert_allclose(result[..., 1], np.broadcast_to(centre_y[:, None], (size[1], size[0])), atol=tolerance)


@pytest.fixture(scope="module")
def long_video(tmp_path_factory) -> Path:
    """20 s of 320x240 test pattern (600 frames, 69 MB decoded): more than the pipes and queues hold."""
    path = tmp_path_factory.mktemp("long") / "long video.mp4"
    run_ffmpeg("-f", "lavfi", "-i", "testsrc=size=320x240:rate=30", "-t", "20", "-c:v", "libx264",
               "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(path))
    return path


@pytest.mark.parametrize("decoders", [1, 3])
def test_a_decoder_killed_mid_video_is_an_error_not_the_end_of_the_video(long_video, decoders):
    import signal

    from bench_pipeline import child_pids

    info = probe(long_video)
    before = set(child_pids(os.getpid()))
    batches = iter_video_i420(info, working_geometry(info, None), 4, decoders=decoders)
    next(batches)
    started = set(child_pids(os.getpid(), living=True)) - before
    assert len(started) == decoders
    for pid in started:
        os.kill(pid, signal.SIGKILL)  # as the out-of-memory killer would
    with pytest.raises(HeygemError, match="could not decode long video.mp4: ffmpeg was stopped by signal 9"):
        for _ in batches:
            pass
