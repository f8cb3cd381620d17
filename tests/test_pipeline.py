"""End to end: real inputs in, an MP4 out, decoded and checked frame by frame."""

import json

import cv2
import numpy as np
import pytest
from conftest import decode_frames, run_ffmpeg, silent_frames

from heygem.config import FaceConfig
from heygem.face.finder import FaceFinder
from heygem.media.probing import probe
from heygem.media.source import looped_indices
from heygem.pipeline import generate
from heygem.speech.audio import load_audio_16k


@pytest.fixture(scope="module")
def photo_result(tmp_path_factory, face_photo, short_speech):
    output = tmp_path_factory.mktemp("photo") / "talking astronaut.mp4"
    stages = []
    summary = generate(face_photo, short_speech, output,
                       progress=lambda stage, fraction: stages.append((stage, fraction)))
    return summary, output, stages


def mouth_box(face_photo):
    image = cv2.imread(str(face_photo))
    with FaceFinder(FaceConfig(), still_images=True) as finder:
        landmarks = finder.find(image)
    lips = landmarks[[61, 291, 0, 17]]
    (x1, y1), (x2, y2) = lips.min(axis=0), lips.max(axis=0)
    return int(x1) - 4, int(y1) - 4, int(x2) + 4, int(y2) + 12, landmarks


def test_photo_and_speech_make_a_valid_mp4(photo_result, short_speech):
    summary, output, stages = photo_result
    info = probe(output)
    audio_in = probe(short_speech)
    assert info.kind == "video" and (info.width, info.height) == (512, 512)
    assert summary.warnings == []  # one face, real speech: nothing to say
    assert info.fps_fraction == "25/1" and info.audio_codec == "aac" and info.has_audio
    expected_frames = round(3.4 * 25)
    frames = decode_frames(output)
    assert len(frames) == expected_frames == summary.frames
    assert abs(info.audio_duration - expected_frames / 25) <= 1 / 25 + 0.03  # within a frame (+AAC priming)
    assert info.audio_sample_rate == audio_in.audio_sample_rate  # the user's audio, not the 16 kHz copy
    assert summary.engine == "landmark" and "or Wav2Lip checkpoint in" in summary.engine_reason
    saved = json.loads(output.with_suffix(".json").read_text())
    assert saved["frames"] == expected_frames and saved["frames_without_face"] == 0
    assert {"faces", "generate", "blend", "encode"} <= set(saved["seconds_per_stage"])
    spans = saved["stage_spans"]  # each stage on the run's time line: busy at most as long as its span
    assert set(spans) == set(saved["seconds_per_stage"])
    for stage, (start, end) in spans.items():
        assert 0 <= start <= end <= saved["total_seconds"] + 0.01, (stage, spans)
        assert saved["seconds_per_stage"][stage] <= end - start + 0.01, (stage, spans)
    assert spans["probe"][1] <= spans["decode"][0] and spans["faces"][0] < spans["encode"][1]
    fractions = [fraction for _, fraction in stages]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0


def test_mouth_moves_with_speech_and_rests_in_silence(photo_result, face_photo, short_speech):
    _, output, _ = photo_result
    frames = decode_frames(output)
    x1, y1, x2, y2, _ = mouth_box(face_photo)
    mouths = frames[:, y1:y2, x1:x2].astype(np.int16)
    speaking = range(5, 50)
    silent = [i for i in silent_frames(short_speech, 25) if 60 <= i < len(frames) - 1]
    assert len(silent) >= 8
    change_while_speaking = np.mean([np.abs(mouths[i] - mouths[i - 1]).mean() for i in speaking])
    change_in_silence = np.mean([np.abs(mouths[i] - mouths[i - 1]).mean() for i in silent[4:]])
    assert change_while_speaking > 2.0, change_while_speaking
    assert change_in_silence < 0.5, change_in_silence
    spread = mouths[list(speaking)].std(axis=0).mean()
    assert spread > 4.0  # the mouth takes on many shapes, not one


def test_pixels_far_from_the_mouth_equal_the_input(photo_result, face_photo):
    _, output, _ = photo_result
    frames = decode_frames(output)
    source = cv2.imread(str(face_photo))
    x1, y1, x2, y2, landmarks = mouth_box(face_photo)
    far = np.ones(source.shape[:2], dtype=bool)
    chin_y = int(landmarks[152, 1])
    far[max(0, y1 - 60): chin_y + 40, max(0, x1 - 70): x2 + 70] = False  # the mouth, jaw and cheeks may change
    for index in (0, 20, 40, 70):
        difference = np.abs(frames[index].astype(np.int16) - source.astype(np.int16))[far]
        assert difference.mean() < 2.5, (index, difference.mean())  # x264 at crf 18 and 4:2:0 chroma only


def test_video_input_keeps_its_rate_and_size(tmp_path, face_video, short_speech):
    output = tmp_path / "video.mp4"
    summary = generate(face_video, short_speech, output)
    info = probe(output)
    assert info.fps_fraction == "30000/1001" and (info.width, info.height) == (320, 240)
    assert summary.frames == round(3.4 * 30000 / 1001) == len(decode_frames(output))
    assert summary.frames_without_face == 0


def test_video_shorter_than_audio_plays_back_and_forth(tmp_path, face_video, short_speech):
    # the 2 s video is shorter than the 3.4 s speech: frames run forward to the last (or, with its track in
    # the avatar cache from an earlier test, to the frame heygem.face.turns chose), then back down
    output = tmp_path / "pingpong.mp4"
    summary = generate(face_video, short_speech, output, overrides={"restore.enabled": False})
    result = decode_frames(output).astype(np.int16)
    source = decode_frames(face_video).astype(np.int16)
    last = len(source) - 1  # 59 or 60 frames, as the ffmpeg at hand cuts 2 s at 29.97 fps
    assert len(result) == 102
    top = slice(0, 60)  # above the face box: untouched by the engine
    late, early = summary.turns or (last, 0)
    sources = looped_indices(np.arange(102), (late, early))
    assert sources[late + 1] == late - 1 and sources[late + 21] == late - 21
    expected = {index: int(sources[index]) for index in (10, late, late + 1, late + 21, 101)}
    for output_index, source_index in expected.items():
        own = np.abs(result[output_index, top] - source[source_index, top]).mean()
        other = np.abs(result[output_index, top] - source[(source_index + 15) % len(source), top]).mean()
        assert own < 3 and own < other, (output_index, own, other)


def test_video_longer_than_audio_is_cut_and_its_own_audio_can_be_used(tmp_path, face_video, media_dir):
    clip = media_dir / "one second.wav"
    run_ffmpeg("-i", str(face_video), "-t", "1", "-vn", str(clip))
    output = tmp_path / "cut.mp4"
    summary = generate(face_video, clip, output)
    assert summary.frames == 30 and len(decode_frames(output)) == 30
    own = tmp_path / "own audio.mp4"
    summary = generate(face_video, face_video, own)
    own_seconds = len(load_audio_16k(face_video)) / 16000  # 2 s of AAC, plus its padding
    assert summary.frames == round(own_seconds * 30000 / 1001) and probe(own).has_audio


def test_frames_without_a_face_pass_through_unchanged(tmp_path, face_video, short_speech):
    covered = tmp_path / "covered.mp4"
    run_ffmpeg("-i", str(face_video), "-vf", "drawbox=enable='between(n,20,34)':x=0:y=0:w=iw:h=ih:color=gray:t=fill",
               "-c:v", "libx264", "-preset", "ultrafast", "-crf", "10", "-c:a", "copy", str(covered))
    output = tmp_path / "some faceless.mp4"
    summary = generate(covered, short_speech, output)
    assert summary.frames_without_face >= 15
    result = decode_frames(output).astype(np.int16)
    source = decode_frames(covered).astype(np.int16)
    for index in range(22, 33):  # (full-range sources may round by one level on the way to limited range)
        assert np.abs(result[index] - source[index]).mean() <= 1.0


def test_no_face_anywhere_is_a_user_error(tmp_path, short_speech):
    from heygem.errors import HeygemError

    blank = tmp_path / "wall.png"
    cv2.imwrite(str(blank), np.full((120, 160, 3), 200, np.uint8))
    with pytest.raises(HeygemError, match="no face was found"):
        generate(blank, short_speech, tmp_path / "never.mp4")
    assert not (tmp_path / "never.mp4").exists()


def test_silent_speech_is_said_in_the_summary(tmp_path, face_photo):
    silence = tmp_path / "silence.wav"
    run_ffmpeg("-f", "lavfi", "-i", "anullsrc=r=16000:cl=mono", "-t", "0.6", str(silence))
    summary = generate(face_photo, silence, tmp_path / "quiet.mp4", overrides={"media.output_height": 128})
    assert summary.warnings == ["the speech is silent"]


def test_video_whose_own_track_outlasts_its_frames_still_plays_back_and_forth(tmp_path, face_photo, short_speech):
    # a container 4 s long holding only 1.5 s of pictures: probing cannot tell it is short
    padded = tmp_path / "long audio track.mp4"
    run_ffmpeg("-loop", "1", "-t", "1.5", "-i", str(face_photo), "-f", "lavfi", "-i", "sine=frequency=200:duration=4",
               "-vf", "scale=256:256,format=yuv420p", "-r", "20", "-c:v", "libx264", "-preset", "ultrafast",
               "-c:a", "aac", str(padded))
    assert probe(padded).duration > 3.9
    output = tmp_path / "out.mp4"
    summary = generate(padded, short_speech, output)
    assert summary.frames == 68 and len(decode_frames(output)) == 68  # 3.4 s at 20 fps from 30 source frames


@pytest.mark.parametrize("container, rate, rotation", [("webm", "60", None), ("mkv", "24000/1001", None),
                                                        ("mov", "30", 270), ("avi", "25", None)])
def test_containers_rates_and_phone_rotation(tmp_path, face_photo, container, rate, rotation):
    import subprocess
    from fractions import Fraction

    source = tmp_path / f"upright.{container}"
    codec = ["-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8"] if container == "webm" else \
        ["-c:v", "mpeg4", "-q:v", "3"] if container == "avi" else ["-c:v", "libx264", "-preset", "ultrafast"]
    # with a rotation flag, the pixels are stored turned a quarter counter-clockwise (landscape), as
    # phones store portrait video, and the flag turns them upright for display
    turn = ",transpose=2" if rotation else ""
    run_ffmpeg("-loop", "1", "-i", str(face_photo), "-vf", f"scale=240:240,pad=240:300:0:30{turn},format=yuv420p",
               "-r", rate, "-t", "1.5", *codec, str(source))
    face = source
    if rotation:
        face = tmp_path / f"phone.{container}"
        try:
            run_ffmpeg("-display_rotation", str(rotation), "-i", str(source), "-c", "copy", str(face))
        except subprocess.CalledProcessError:
            run_ffmpeg("-i", str(source), "-c", "copy", "-metadata:s:v", f"rotate={rotation}", str(face))
    speech = tmp_path / "speech.mp3"
    run_ffmpeg("-i", str(face_photo.parent / "speech_en.wav"), "-t", "1.2", "-ar", "44100", "-ac", "2", str(speech))
    output = tmp_path / "out.mp4"
    summary = generate(face, speech, output)
    info = probe(output)
    assert (info.width, info.height) == (240, 300)  # upright, whatever the file's storage
    top = decode_frames(output)[0, 30:90].astype(np.int16)  # the picture's top, under the black bar
    upright = cv2.resize(cv2.imread(str(face_photo)), (240, 240), interpolation=cv2.INTER_AREA).astype(np.int16)
    assert np.abs(top - upright[:60]).mean() < 12
    assert np.abs(top - upright[::-1][:60]).mean() > 30  # not upside down
    assert Fraction(info.fps_fraction) == Fraction(rate)
    assert summary.frames == len(decode_frames(output)) == round(summary.audio_seconds * float(Fraction(rate)))
    assert summary.frames_without_face == 0


@pytest.mark.parametrize("face_index, moving", [(None, "right"), (0, "left")])
def test_several_faces_the_largest_or_the_chosen_one_speaks(tmp_path, face_photo, short_speech, face_index, moving):
    portrait = cv2.imread(str(face_photo))
    canvas = np.full((512, 912, 3), 200, np.uint8)
    canvas[112:, :400] = cv2.resize(portrait, (400, 400), interpolation=cv2.INTER_AREA)  # smaller, on the left
    canvas[:, 400:] = portrait  # larger, on the right
    group = tmp_path / "two people.png"
    cv2.imwrite(str(group), canvas)
    overrides = {}
    if face_index is not None:
        overrides["face.face_index"] = face_index
    output = tmp_path / "group.mp4"
    summary = generate(group, short_speech, output, overrides=overrides)
    chosen = "1 (the largest)" if face_index is None else "0 (as chosen)"
    assert summary.warnings == [f"2 faces found; animated face {chosen}"]  # said, not only done
    assert json.loads(output.with_suffix(".json").read_text())["warnings"] == summary.warnings
    frames = decode_frames(output).astype(np.int16)
    motion = np.abs(np.diff(frames[5:50], axis=0)).mean(axis=(0, 3))  # (512, 912) how much each pixel moves
    left, right = motion[:, :400].max(), motion[:, 400:].max()
    speaking, still = (right, left) if moving == "right" else (left, right)
    assert speaking > 5 and still < 1.5, (left, right)


def test_landmark_engine_with_a_restorer_after_it_takes_the_patch_path(photo_result, tmp_path, face_photo,
                                                                       short_speech):
    """The landmark engine blends its own I420 windows only when nothing restores after it; with
    --restorer sharpen its patches go through the restore and blend stages, and the mouth still moves."""
    output = tmp_path / "sharpened.mp4"
    summary = generate(face_photo, short_speech, output,
                       overrides={"restore.method": "sharpen", "engine.name": "landmark"})
    assert summary.restorer == "sharpen" and summary.frames == photo_result[0].frames
    frames = decode_frames(output)
    plain = decode_frames(photo_result[1])
    x1, y1, x2, y2, _ = mouth_box(face_photo)
    speaking = [20, 30, 40]
    moved = [np.abs(frames[i, y1:y2, x1:x2].astype(np.int16) - frames[0, y1:y2, x1:x2]).mean() for i in speaking]
    assert min(moved) > 1.0, moved
    sharpened_differs = np.abs(frames[speaking].astype(np.int16) - plain[speaking]).max()
    assert sharpened_differs > 0  # the sharpening changed what the engine drew
