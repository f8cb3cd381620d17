"""Encoding the output: one x264, or several on consecutive segments joined without re-encoding."""

import os
import subprocess
from fractions import Fraction
from pathlib import Path

import av
import cv2
import numpy as np
import pytest
from conftest import decode_frames, run_ffmpeg

from heygem.errors import HeygemError
from heygem.media import encode
from heygem.media.ffmpeg import ffmpeg_binary
from heygem.media.frames import bgr_to_yuv420
from heygem.media.probing import probe
from heygem.types import FrameGeometry, MediaInfo

WIDTH, HEIGHT = 160, 120
GEOMETRY = FrameGeometry(width=WIDTH, height=HEIGHT)


def moving_pattern(frame_count: int) -> np.ndarray:
    """(N, H, W, 3) uint8 BGR: a smooth gradient, a bright square moving right, a dark disc moving down."""
    ys, xs = np.mgrid[0:HEIGHT, 0:WIDTH]
    frames = np.empty((frame_count, HEIGHT, WIDTH, 3), dtype=np.uint8)
    for index in range(frame_count):
        frames[index, :, :, 0] = (xs + 2 * index) % 256
        frames[index, :, :, 1] = 60 + ys
        frames[index, :, :, 2] = (128 + 64 * np.sin((xs + ys + 3 * index) / 17.0)).astype(np.uint8)
        left = (3 * index) % (WIDTH - 24)
        frames[index, 20:44, left:left + 24] = (250, 250, 250)
        cv2.circle(frames[index], (110, 10 + (2 * index) % 100), 9, (15, 30, 20), -1)
    return frames


def to_i420(frames_bgr: np.ndarray) -> np.ndarray:
    return np.stack([bgr_to_yuv420(frame) for frame in frames_bgr])  # (N, H * 3/2, W)


def psnr(decoded: np.ndarray, expected: np.ndarray) -> float:
    error = np.mean((decoded.astype(np.float64) - expected.astype(np.float64)) ** 2)
    return 10 * np.log10(255.0 ** 2 / max(error, 1e-9))


def video_timing(path: Path) -> tuple[int, Fraction, list[Fraction]]:
    """(frames in the index, stream duration in seconds, every decoded frame's time in seconds)."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        times = [Fraction(frame.pts) * stream.time_base for frame in container.decode(stream)]
        return int(stream.frames), Fraction(stream.duration) * stream.time_base, times


def audio_packets(path: Path, count: int = 20) -> list[bytes]:
    with av.open(str(path)) as container:
        packets = (bytes(packet) for packet in container.demux(container.streams.audio[0]) if packet.size)
        return [next(packets) for _ in range(count)]


def top_level_boxes(path: Path) -> list[str]:
    names, data = [], path.read_bytes()
    offset = 0
    while offset + 8 <= len(data):
        size = int.from_bytes(data[offset: offset + 4], "big")
        names.append(data[offset + 4: offset + 8].decode("latin-1"))
        if size == 1:
            size = int.from_bytes(data[offset + 8: offset + 16], "big")
        if size < 8:
            break
        offset += size
    return names


def ffmpeg_children() -> list[int]:
    """Process ids of ffmpeg processes (zombies included) whose parent is this test process."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        if parent == os.getpid() and "ffmpeg" in name:
            children.append(int(entry.name))
    return children


def assert_clean_decode(path: Path) -> None:
    result = subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "warning", "-i", str(path), "-f", "null", "-"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def speech_like(path: Path, seconds: float) -> Path:
    run_ffmpeg("-f", "lavfi", "-i", f"sine=frequency=220:sample_rate=44100:duration={seconds:.6f}",
               *(["-c:a", "aac", "-b:a", "96k"] if path.suffix == ".m4a" else []), str(path))
    return path


def encode_all(encoder, frames_bgr: np.ndarray, batch: int, as_i420: bool) -> Path:
    for start in range(0, len(frames_bgr), batch):
        chunk = frames_bgr[start: start + batch]
        if as_i420:
            encoder.write_i420(to_i420(chunk))
        else:
            encoder.write(chunk.copy())
    return encoder.close()


# ---------------------------------------------------------------------------- pure functions


def test_encode_args_read_i420_and_keep_aac():
    aac = MediaInfo(path=Path("a.m4a"), kind="audio", has_audio=True, audio_codec="aac")
    args = encode.encode_args(FrameGeometry(640, 360), "30000/1001", Path("a.m4a"), aac, Path("out.mp4"))
    joined = " ".join(args)
    assert "-f rawvideo" in joined and "-pix_fmt yuv420p -s 640x360 -i pipe:" in joined
    assert "-c:v libx264" in joined and "-movflags +faststart" in joined and "-framerate 30000/1001" in joined
    assert "-c:a copy" in joined and args[-1] == "out.mp4"
    mp3 = MediaInfo(path=Path("a.mp3"), kind="audio", has_audio=True, audio_codec="mp3")
    reencode = " ".join(encode.encode_args(FrameGeometry(640, 360), "25/1", Path("a.mp3"), mp3, Path("o.mp4")))
    assert "-c:a aac" in reencode and "-b:a 192k" in reencode


def test_segment_and_join_args():
    args = encode.segment_args(FrameGeometry(64, 48), "30000/1001", Path("parts dir/segment-0003.mp4"),
                               crf=20, preset="ultrafast")
    assert args[:3] == ["-nostdin", "-v", "error"]
    assert args[args.index("-i") - 6: args.index("-i") + 2] == [
        "-framerate", "30000/1001", "-pix_fmt", "yuv420p", "-s", "64x48", "-i", "pipe:"]
    assert args[args.index("-f", args.index("-i")) + 1] == "mp4"
    joined = " ".join(args)
    assert "-an" in args and "-c:v libx264" in joined and "-crf 20" in joined and "-preset ultrafast" in joined
    assert "faststart" not in joined and args[-1] == "parts dir/segment-0003.mp4"  # one argument, no quoting

    aac = MediaInfo(path=Path("speech.m4a"), kind="audio", has_audio=True, audio_codec="aac")
    join = encode.join_args(Path("parts/segments.txt"), Path("speech.m4a"), aac, Path("parts/joined.mp4"))
    assert join[join.index("-i") - 4: join.index("-i") + 2] == ["-f", "concat", "-safe", "0", "-i",
                                                                 "parts/segments.txt"]
    assert join[join.index("-map"): join.index("-map") + 4] == ["-map", "0:v:0", "-map", "1:a:0"]
    joined = " ".join(join)
    assert "-c:v copy" in joined and "-c:a copy" in joined and "-movflags +faststart" in joined
    assert "libx264" not in joined and join[-1] == "parts/joined.mp4"
    wav = MediaInfo(path=Path("speech.wav"), kind="audio", has_audio=True, audio_codec="pcm_s16le")
    joined = " ".join(encode.join_args(Path("l.txt"), Path("speech.wav"), wav, Path("o.mp4"), audio_bitrate="96k"))
    assert "-c:a aac" in joined and "-b:a 96k" in joined

    assert encode.concat_list(["segment-0000.mp4", "it's.mp4"]) == (
        "ffconcat version 1.0\nfile 'segment-0000.mp4'\nfile 'it'\\''s.mp4'\n")


def test_encoder_count_and_segment_lengths():
    minute = 25 * 60
    assert encode.encoder_count(0, minute, 25, cpu_count=2) == 1
    assert encode.encoder_count(0, minute, 25, cpu_count=4) == 1
    assert encode.encoder_count(0, minute, 25, cpu_count=16) == 3
    assert encode.encoder_count(0, minute, 25, cpu_count=128) == 8
    assert encode.encoder_count(3, minute, 25, cpu_count=2) == 3  # asked for explicitly
    assert encode.encoder_count(8, 125, 25) == 2  # 5 s: two segments of at least 2 s
    assert encode.encoder_count(4, 60, 25) == 1

    assert encode.segment_lengths(187, 1, 29.97, 100) == [187]
    lengths = encode.segment_lengths(187, 3, 30000 / 1001, 160 * 120 * 3 // 2)
    assert lengths == [63, 62, 62]
    long = encode.segment_lengths(30 * 60 * 25, 2, 25, 1920 * 1080 * 3 // 2)
    assert sum(long) == 30 * 60 * 25 and max(long) - min(long) <= 1
    assert 50 <= max(long) <= 250  # 2 to 10 s each
    assert 2 * max(long) * 1920 * 1080 * 3 // 2 <= encode.BUFFER_BYTES  # the buffer bound holds
    crowded = encode.segment_lengths(30 * 60 * 25, 4, 25, 1920 * 1080 * 3 // 2)
    assert min(crowded) >= 50  # never shorter than 2 s, even where that passes the buffer bound
    small = encode.segment_lengths(30 * 60 * 25, 2, 25, 320 * 240 * 3 // 2)
    assert max(small) == 250  # capped at 10 s when memory allows longer


# ---------------------------------------------------------------------------- encoding


@pytest.fixture(scope="module")
def wav_speech(tmp_path_factory) -> Path:
    return speech_like(tmp_path_factory.mktemp("speech") / "speech.wav", 187 * 1001 / 30000)


@pytest.fixture(scope="module")
def aac_speech(tmp_path_factory) -> Path:
    return speech_like(tmp_path_factory.mktemp("speech") / "speech.m4a", 160 / 25)


@pytest.fixture(scope="module")
def single_output(tmp_path_factory, wav_speech) -> tuple[Path, np.ndarray]:
    """187 frames at 30000/1001 fps from one encoder (veryfast: B-frames), and the frames written."""
    frames = moving_pattern(187)
    output = tmp_path_factory.mktemp("single") / "single.mp4"
    encoder = encode.open_encoder(GEOMETRY, "30000/1001", wav_speech, probe(wav_speech), output,
                                  crf=18, preset="veryfast", audio_bitrate="128k", frame_count=187)
    assert isinstance(encoder, encode.VideoEncoder)
    return encode_all(encoder, frames, batch=16, as_i420=True), frames


@pytest.mark.parametrize("encoders, as_i420", [(3, True), (3, False)])
def test_segments_match_one_encoder_at_29_97(tmp_path, wav_speech, single_output, encoders, as_i420):
    single_path, frames = single_output
    encoder = encode.open_encoder(GEOMETRY, "30000/1001", wav_speech, probe(wav_speech),
                                  tmp_path / "out.mp4", crf=18, preset="veryfast", audio_bitrate="128k",
                                  frame_count=187, encoders=encoders)
    assert isinstance(encoder, encode.SegmentedEncoder) and len(encoder.processes) == 0
    output = encode_all(encoder, frames, batch=16, as_i420=as_i420)  # 16 does not divide 63 or 62
    assert output == tmp_path / "out.mp4" and len(encoder.processes) == 3 + 1  # 3 segments, then the join
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.mp4"]  # segments removed

    count, duration, times = video_timing(output)
    single_count, single_duration, single_times = video_timing(single_path)
    assert count == single_count == len(times) == 187
    assert duration == single_duration == Fraction(187 * 1001, 30000)
    assert times == single_times == [Fraction(index * 1001, 30000) for index in range(187)]

    decoded, single_decoded = decode_frames(output), decode_frames(single_path)
    assert psnr(decoded, frames) > 35 and psnr(single_decoded, frames) > 35
    assert psnr(decoded, single_decoded) > 38
    for index in (0, 62, 63, 124, 125, 186):  # either side of each segment boundary
        assert np.abs(decoded[index].astype(int) - frames[index]).mean() < 3, index
    assert_clean_decode(output)

    info = probe(output)
    assert info.has_audio and info.audio_codec == "aac" and info.fps_fraction == "30000/1001"
    assert abs(info.audio_duration - float(duration)) <= 1001 / 30000
    with av.open(str(output)) as container:
        assert container.streams.video[0].codec_context.name == "h264"
        assert container.streams.video[0].codec_context.pix_fmt == "yuv420p"
        assert container.streams.video[0].codec_context.has_b_frames  # veryfast reorders frames
    boxes = top_level_boxes(output)
    assert boxes.index("moov") < boxes.index("mdat")  # +faststart


def test_more_segments_than_encoders_with_aac_copied(tmp_path, aac_speech):
    frames = moving_pattern(160)
    audio_info = probe(aac_speech)
    encoder = encode.SegmentedEncoder(GEOMETRY, "25/1", aac_speech, audio_info, tmp_path / "out.mp4",
                                      [40, 40, 40, 40], encoders=2, crf=18, preset="veryfast",
                                      audio_bitrate="128k")
    for start in range(0, 160, 24):
        encoder.write_i420(to_i420(frames[start: start + 24]))
        running = [process for process in encoder.processes if process.poll() is None]
        assert len(running) <= 2
    output = encoder.close()
    assert len(encoder.processes) == 4 + 1
    count, duration, times = video_timing(output)
    assert count == 160 and duration == Fraction(160, 25)
    assert times == [Fraction(index, 25) for index in range(160)]
    assert psnr(decode_frames(output), frames) > 35
    assert_clean_decode(output)
    info = probe(output)
    assert abs(info.audio_duration - 160 / 25) <= 1 / 25
    assert audio_packets(output) == audio_packets(aac_speech)  # copied, not encoded again
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.mp4"]


def test_single_encoder_writes_an_mp4_with_audio(tmp_path, short_speech):
    geometry = FrameGeometry(width=64, height=48)
    audio_info = probe(short_speech)
    encoder = encode.open_encoder(geometry, "25/1", short_speech, audio_info, tmp_path / "out.mp4",
                                  crf=18, preset="ultrafast", audio_bitrate="128k", frame_count=60)
    frames = np.zeros((10, 48, 64, 3), dtype=np.uint8)
    for value in range(6):
        frames[:] = value * 40
        encoder.write(frames.copy())
    encoder.close()
    info = probe(tmp_path / "out.mp4")
    assert info.kind == "video" and info.has_audio and info.audio_codec == "aac"
    assert info.frame_count == 60 and (info.width, info.height) == (64, 48)
    decoded = decode_frames(tmp_path / "out.mp4")
    assert abs(int(decoded[0].mean()) - 0) <= 2 and abs(int(decoded[-1].mean()) - 200) <= 3
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.mp4"]  # the partial file was moved


# ---------------------------------------------------------------------------- failures


@pytest.mark.parametrize("encoders", [1, 3])
def test_killed_ffmpeg_fails_close_and_leaves_nothing(tmp_path, wav_speech, encoders):
    frames = moving_pattern(187)
    out_dir = tmp_path / "out"
    encoder = encode.open_encoder(GEOMETRY, "30000/1001", wav_speech, probe(wav_speech), out_dir / "o.mp4",
                                  crf=18, preset="veryfast", audio_bitrate="128k", frame_count=187,
                                  encoders=encoders)
    encoder.write_i420(to_i420(frames[:70]))  # with 3 encoders: segment 0 is full, segment 1 has begun
    victim = encoder.processes[-1]
    assert victim.poll() is None
    victim.kill()
    victim.wait()
    try:
        for start in range(70, 187, 10):
            encoder.write_i420(to_i420(frames[start: start + 10]))
    except HeygemError as error:  # the failure may already show while writing
        assert "encoding the output failed" in str(error)
    with pytest.raises(HeygemError, match=r"encoding the output failed: \S+"):
        encoder.close()
    assert all(process.poll() is not None for process in encoder.processes)
    assert ffmpeg_children() == []
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("encoders", [1, 3])
def test_abort_leaves_nothing(tmp_path, wav_speech, encoders):
    frames = moving_pattern(100)
    encoder = encode.open_encoder(GEOMETRY, "30000/1001", wav_speech, probe(wav_speech), tmp_path / "o.mp4",
                                  crf=18, preset="veryfast", audio_bitrate="128k", frame_count=187,
                                  encoders=encoders)
    encoder.write(frames[:70])
    encoder.write_i420(to_i420(frames[70:]))
    assert any(process.poll() is None for process in encoder.processes)
    encoder.abort()
    assert all(process.poll() is not None for process in encoder.processes)
    assert ffmpeg_children() == []
    assert list(tmp_path.iterdir()) == []


def test_close_without_frames_is_an_error(tmp_path, wav_speech):
    encoder = encode.open_encoder(GEOMETRY, "30000/1001", wav_speech, probe(wav_speech), tmp_path / "o.mp4",
                                  crf=18, preset="veryfast", audio_bitrate="128k", frame_count=187, encoders=3)
    with pytest.raises(HeygemError, match="no frames were written"):
        encoder.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("encoders", [1, 3])
def test_ffmpeg_message_reaches_the_error(tmp_path, wav_speech, encoders):
    encoder = encode.open_encoder(GEOMETRY, "30000/1001", wav_speech, probe(wav_speech), tmp_path / "o.mp4",
                                  crf=18, preset="no-such-preset", audio_bitrate="128k", frame_count=187,
                                  encoders=encoders)
    with pytest.raises(HeygemError, match="encoding the output failed: ") as raised:
        try:
            for _ in range(0, 187, 10):
                encoder.write(moving_pattern(10))
        except HeygemError:
            encoder.abort()  # as the pipeline does when a write fails
            raise
        encoder.close()
    assert "signal" not in str(raised.value) and len(str(raised.value)) > 40  # ffmpeg's own words
    assert ffmpeg_children() == [] and list(tmp_path.iterdir()) == []


def test_a_full_disk_is_named_in_the_encoder_message():
    import tempfile

    from heygem.media.ffmpeg import ffmpeg_message

    with tempfile.TemporaryFile() as stderr_file:
        stderr_file.write(b"frame=  10\n[out#0/mp4 @ 0x1234] Error closing file: No space left on device\n")
        message = ffmpeg_message(stderr_file, 1)
    assert message.startswith("the disk holding the output is full") and "\n" not in message
    with tempfile.TemporaryFile() as stderr_file:
        stderr_file.write(b"some other failure\n")
        assert ffmpeg_message(stderr_file, 1) == "some other failure"


def test_each_of_several_encoders_gets_its_share_of_the_threads():
    assert encode.encoder_threads(5, cpu_count=16) == 5
    assert encode.encoder_threads(3, cpu_count=16) == 8
    assert encode.encoder_threads(8, cpu_count=2) == 2  # never fewer than 2
    geometry = FrameGeometry(64, 48)
    args = encode.segment_args(geometry, "25/1", Path("s.mp4"), threads=5)
    assert args[args.index("-threads") + 1] == "5"
    assert "-threads" not in encode.segment_args(geometry, "25/1", Path("s.mp4"))
