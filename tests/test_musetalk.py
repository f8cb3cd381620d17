"""The musetalk engine on random-init files in the official layout (a reduced config of the same
classes): end to end from the command line, strict loading, the audio features and the face box
against the stated facts, the avatar's latents kept for the next job."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import cv2
import torch
from conftest import ASSETS, REPO, assert_playable_mp4, decode_frames, run_ffmpeg

from heygem.config import EngineConfig
from heygem.engines import choose_engine
from heygem.engines.musetalk import audio_features as features
from heygem.engines.musetalk import crop
from heygem.engines.musetalk.files import find_musetalk_files, missing_files
from heygem.engines.musetalk.random_files import write_random_files
from heygem.engines.musetalk.render import MuseTalkRender
from heygem.errors import HeygemError
from heygem.types import Face


@pytest.fixture(scope="module")
def speech_clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("speech") / "clip.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-ss", "0.4", "-t", "0.8", str(path))
    return path


def heygem(*args, weights, cache):
    env = dict(os.environ, HEYGEM_WEIGHTS=str(weights), HEYGEM_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "heygem", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_generate_with_musetalk_end_to_end_changes_the_mouth_and_nothing_far_from_it(musetalk_weights, speech_clip,
                                                                                   tmp_path):
    output = tmp_path / "out.mp4"
    photo = ASSETS / "astronaut.jpg"
    result = heygem("generate", "--face", photo, "--audio", speech_clip, "--output", output, "--engine", "musetalk",
                    "--no-restore", weights=musetalk_weights, cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert "with the musetalk engine" in result.stdout
    assert_playable_mp4(output, 0.8)
    frames = decode_frames(output).astype(np.int16)  # (N, H, W, 3)
    assert len(frames) == 20  # 0.8 s at 25 fps
    source = cv2.imread(str(photo)).astype(np.int16)
    assert frames.shape[1:] == source.shape
    difference = np.abs(frames - source[None]).mean(axis=3)  # (N, H, W)
    # the portrait's mouth (its face box is PORTRAIT_FACE_BOX in conftest), its forehead, and the frame far from it
    mouth, forehead = difference[:, 140:170, 205:250].mean(), difference[:, 70:105, 190:260].mean()
    far = np.concatenate([difference[:, :50], difference[:, 300:]], axis=1)
    assert mouth > 12 > 4 > forehead and far.mean() < 3, (mouth, forehead, far.mean())  # x264 and 4:2:0 only
    # random audio features differ frame to frame, so the mouths do; what is far from the face stays still
    changes = np.abs(np.diff(frames, axis=0)).mean(axis=(0, 3))  # (H, W)
    assert changes[140:170, 205:250].mean() > 2 and changes[:50].max() < 3 and changes[300:].mean() < 0.2, (
        changes[140:170, 205:250].mean(), changes[:50].max(), changes[300:].mean())


def test_strict_loading_names_the_file_with_one_line_and_exit_2(musetalk_weights, speech_clip, tmp_path):
    broken = tmp_path / "weights"
    write_random_files(broken / "musetalk", size="reduced", seed=1)
    unet_path = broken / "musetalk" / "musetalkV15" / "unet.pth"
    state = torch.load(unet_path, weights_only=True)
    state.pop("conv_in.weight")
    torch.save(state, unet_path)
    result = heygem("generate", "--face", ASSETS / "astronaut.jpg", "--audio", speech_clip, "--output",
                    tmp_path / "o.mp4", "--engine", "musetalk", weights=broken, cache=tmp_path / "cache")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert str(unet_path) in last and "1 missing keys (conv_in.weight)" in last and "Traceback" not in result.stderr
    (broken / "musetalk" / "whisper" / "preprocessor_config.json").unlink()
    result = heygem("generate", "--face", ASSETS / "astronaut.jpg", "--audio", speech_clip, "--output",
                    tmp_path / "o.mp4", "--engine", "musetalk", weights=broken, cache=tmp_path / "cache")
    assert result.returncode == 2 and "whisper/preprocessor_config.json is missing" in result.stderr.splitlines()[-1]


def test_a_wrong_shape_or_a_foreign_file_is_refused_naming_it(tmp_path):
    from heygem.engines.musetalk import loading

    folder = write_random_files(tmp_path / "musetalk", size="reduced", seed=2)
    files = find_musetalk_files(folder)
    vae_state = torch.load(files.vae, weights_only=True)
    vae_state["decoder.conv_out.weight"] = vae_state["decoder.conv_out.weight"][:, :4]
    torch.save(vae_state, files.vae)
    with pytest.raises(HeygemError, match=r"diffusion_pytorch_model.bin does not fit the VAE: decoder.conv_out.weight "
                                          r"has shape \(3, 4, 3, 3\) in the file"):
        loading.load_vae(files)
    files.whisper.write_bytes(b"<!doctype html><html>not the weights</html>")
    with pytest.raises(HeygemError, match="whisper/pytorch_model.bin is not a readable Whisper checkpoint"):
        loading.load_whisper_encoder(files)
    files.unet_config.write_text("{not json", encoding="utf-8")
    with pytest.raises(HeygemError, match="musetalk.json is not a readable MuseTalk UNet config"):
        loading.load_unet(files)


def test_auto_prefers_musetalk_when_complete_and_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("HEYGEM_WEIGHTS", str(tmp_path))
    (tmp_path / "wav2lip_gan.pth").write_bytes(b"not read while choosing")
    folder = tmp_path / "musetalk"
    (folder / "musetalkV15").mkdir(parents=True)
    (folder / "musetalkV15" / "unet.pth").write_bytes(b"")
    assert missing_files(folder)[0] == "musetalkV15/musetalk.json"
    assert choose_engine(EngineConfig(name="auto")).name == "wav2lip"  # incomplete: the next engine
    with pytest.raises(HeygemError, match="needs MuseTalk's files in .*: musetalkV15/musetalk.json, sd-vae/config"):
        choose_engine(EngineConfig(name="musetalk"))
    for name in ("musetalkV15/musetalk.json", "sd-vae/config.json", "sd-vae/diffusion_pytorch_model.bin",
                 "whisper/config.json", "whisper/pytorch_model.bin", "whisper/preprocessor_config.json"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"")
    choice = choose_engine(EngineConfig(name="auto"))
    assert (choice.name, choice.reason) == ("musetalk", "auto: found musetalk (MuseTalk v15, preferred to Wav2Lip)")
    files = find_musetalk_files(folder)
    assert files.version == "v15" and files.parsing is None
    monkeypatch.setattr("heygem.engines.musetalk.files.missing_libraries", lambda: ["diffusers"])
    monkeypatch.setattr("heygem.engines.musetalk.missing_libraries", lambda: ["diffusers"])
    assert choose_engine(EngineConfig(name="auto")).name == "wav2lip"
    with pytest.raises(HeygemError, match=r"needs diffusers: pip install -e \.\[musetalk\]"):
        choose_engine(EngineConfig(name="musetalk"))


def reference_windows(states: np.ndarray, fps: float, frame_count: int) -> np.ndarray:
    """The stated facts, in numpy: 4 zero rows before, 12 after, frame f reads 10 rows from floor(f * 2),
    flattened (time, layer), plus sin/cos positional encoding of d_model 384."""
    step = 50 / int(fps)
    padded = np.concatenate([np.zeros((2 * math.ceil(step), *states.shape[1:])), states,
                             np.zeros((6 * math.ceil(step) + 20, *states.shape[1:]))])
    windows = np.stack([padded[int(math.floor(f * step)):int(math.floor(f * step)) + 10].reshape(-1, states.shape[2])
                        for f in range(frame_count)])
    position = np.arange(windows.shape[1])[:, None]
    channel = np.arange(states.shape[2])[None, :]
    angle = position / np.power(10000.0, (channel - channel % 2) / states.shape[2])
    encoding = np.where(channel % 2 == 0, np.sin(angle), np.cos(angle))
    return windows + encoding


def test_audio_features_are_every_encoder_state_windowed_per_frame_with_the_positional_encoding(musetalk_weights):
    from heygem.engines.musetalk import loading

    files = find_musetalk_files(musetalk_weights / "musetalk")
    encoder, extractor = loading.load_whisper_encoder(files), loading.load_feature_extractor(files)
    samples = (0.1 * np.sin(np.arange(int(1.3 * 16000)) * 0.05)).astype(np.float32)
    states = features.encoder_states(samples, extractor, encoder, torch.device("cpu"))
    assert states.shape == (65, 5, 384)  # floor(1.3 s * 50), the embedding and 4 layers
    mel = extractor(samples, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        last = encoder(mel).last_hidden_state[0, :65]
    assert torch.allclose(states[:, -1], last, atol=1e-5)
    frame_count = 34  # one frame more than the audio has, as the output's length may round up
    windows = features.audio_features(samples, 25.0, frame_count, extractor, encoder, torch.device("cpu"))
    assert windows.shape == (frame_count, 50, 384)
    expected = reference_windows(states.numpy().astype(np.float64), 25.0, frame_count)
    assert np.abs(windows.numpy() - expected).max() < 1e-5
    # frame 0's first two 20 ms rows (x 5 states) are the zeros before the audio: the encoding alone
    encoding = features.positional_encoding(50, 384)
    assert torch.allclose(windows[0, :20], encoding[:20]) and not torch.allclose(windows[0, 20:], encoding[20:])


def test_face_box_follows_musetalk_from_the_mesh_points():
    landmarks = np.zeros((468, 2), np.float32)
    jaw = [(100 + 10 * i, 200 + 12 * (8 - abs(i - 8))) for i in range(17)]  # 68-point jaw line: chin (180, 296)
    for index, point in zip(crop.JAW_FROM_MESH, jaw):
        landmarks[index] = point
    landmarks[crop.NOSE_BRIDGE_TOP] = (180, 180)
    landmarks[crop.NOSE_TIP] = (180, 240.9)  # point 29 at y 220.6, cast to 220
    landmarks[[10, 50]] = (150, 230)  # other mesh points do not move the box
    face = Face(box=(0, 0, 10, 10), landmarks=landmarks)
    assert crop.musetalk_box(face, 400, 400, extra_margin=10) == (100, 220 - 76, 260, 306)
    assert crop.musetalk_box(face, 300, 400, extra_margin=10) == (100, 144, 260, 300)  # the margin stops at the frame
    assert crop.musetalk_box(Face(box=(5, 6, 50, 60)), 400, 400, extra_margin=10) == (5, 6, 50, 70)


def test_the_avatars_crop_latents_are_encoded_once_and_kept_for_the_next_job(musetalk_weights, tmp_path, monkeypatch):
    from heygem.engines.musetalk.engine import MuseTalkEngine

    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path))
    files = find_musetalk_files(musetalk_weights / "musetalk")
    crops = np.random.default_rng(0).integers(0, 256, (3, 256, 256, 3), dtype=np.uint8)
    import heygem.engines.musetalk.engine as engine_module

    autotune = []
    configure = engine_module.configure_backends
    monkeypatch.setattr(engine_module, "configure_backends",
                        lambda **options: autotune.append(options["autotune"]) or configure(**options))
    first = MuseTalkEngine(files, EngineConfig(device="cpu"))
    latents = first.unet_input_latents(crops[[0, 1, 0]])
    assert latents.shape == (3, 8, 32, 32) and first.encoded == 2 and torch.equal(latents[0], latents[2])
    masked, whole = crop.vae_inputs(crops[:1])
    assert (masked[0, :, 128:] == -1).all() and torch.equal(masked[0, :, :128], whole[0, :, :128])
    # a new job, a new process: from the cache; --musetalk-compile always compiles on a GPU only
    second = MuseTalkEngine(files, EngineConfig(device="cpu", musetalk_compile="always"))
    again = second.unet_input_latents(crops)
    assert second.encoded == 1 and torch.equal(again[:2], latents[:2])
    assert not first.compiled and not second.compiled and second.step.runner.module is second.step.network
    assert autotune == [False, False]  # op by op: cuDNN's heuristics


def test_cudnn_times_its_kernels_for_the_compiled_step_or_when_asked_and_uses_its_heuristics_op_by_op():
    from heygem.engines.musetalk.engine import autotunes, compiles_step

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compiles_step(EngineConfig(musetalk_compile="always"), cuda)
    assert not compiles_step(EngineConfig(musetalk_compile="always"), cpu)
    assert not compiles_step(EngineConfig(musetalk_compile="auto"), cuda)  # a one-off run's
    assert autotunes(EngineConfig(musetalk_compile="always"), cuda)
    assert not autotunes(EngineConfig(musetalk_compile="auto"), cuda)
    assert autotunes(EngineConfig(cudnn_benchmark=True), cuda) and autotunes(EngineConfig(cudnn_benchmark=True), cpu)


def test_with_the_bisenet_files_the_patch_is_musetalks_jaw_mask_over_the_widened_square(tmp_path):
    from heygem.engines.musetalk.engine import MuseTalkEngine
    from heygem.engines.musetalk.parsing import jaw_kernel, paste_square
    from heygem.engines.musetalk.random_files import write_random_parsing_files

    folder = write_random_files(tmp_path / "musetalk", size="reduced", seed=3)
    write_random_parsing_files(folder)
    files = find_musetalk_files(folder)
    engine = MuseTalkEngine(files, EngineConfig(device="cpu"), use_cache=False)
    assert engine.parsing_mode == "jaw" and engine.parser is not None
    kernel = jaw_kernel()
    assert kernel.shape == (33, 33) and kernel[:10].sum() == 0 and kernel[20].sum() == 21 and kernel[32].sum() == 21
    frame = cv2.imread(str(ASSETS / "astronaut.jpg"))
    box = (180, 100, 280, 190)
    assert paste_square(box) == (230 - 75, 145 - 75, 230 + 75, 145 + 75)
    generated = np.full((90, 100, 3), 7, np.uint8)
    patch = engine.parser.patch(frame, generated, box, Face(box=box))
    assert patch.box == (155, 70, 305, 220) and patch.image_bgr.shape == (150, 150, 3)
    assert patch.mask.shape == (150, 150) and 0 <= patch.mask.min() and patch.mask.max() <= 1
    assert patch.mask[:70].max() == 0  # nothing above the square's middle row (75, less the blur's reach)
    outside = np.ones((150, 150), bool)
    outside[30:120, 25:125] = False  # the box in the square
    assert np.array_equal(patch.image_bgr[outside], frame[70:220, 155:305][outside])
    assert (patch.image_bgr[30:120, 25:125] == 7).all()
    broken = torch.load(files.parsing, weights_only=True)
    broken["ffm.conv1.weight"] = broken["ffm.conv1.weight"][:10]
    torch.save(broken, files.parsing)
    with pytest.raises(HeygemError, match=r"79999_iter.pth does not fit BiSeNet face parsing: ffm.conv1.weight"):
        MuseTalkEngine(files, EngineConfig(device="cpu"), use_cache=False)


@pytest.mark.skipif(not os.environ.get("MUSETALK_OFFICIAL"), reason="set MUSETALK_OFFICIAL to a checkout of the "
                    "official MuseTalk repository (never part of this one) to compare against it, and "
                    "MUSETALK_OFFICIAL_SITE to a folder with einops and torchvision if they are not installed")
def test_parity_with_the_official_code(tmp_path):
    """bench/musetalk_parity.py on the reduced config: every comparison within its tolerance."""
    site = ["--site", os.environ["MUSETALK_OFFICIAL_SITE"]] if os.environ.get("MUSETALK_OFFICIAL_SITE") else []
    result = subprocess.run([sys.executable, str(REPO / "bench" / "musetalk_parity.py"), "--official",
                             os.environ["MUSETALK_OFFICIAL"], "--parsing", "--json", str(tmp_path / "parity.json"),
                             *site], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    results = json.loads((tmp_path / "parity.json").read_text())["results"]
    assert len(results) == 7 and all(entry["within"] for entry in results.values())


def test_the_doctor_loads_each_file_and_weights_list_knows_the_layout(musetalk_weights, tmp_path):
    from heygem.doctor import check_musetalk
    from heygem.weights import check_weights, load_registry

    checks = {check.name: check for check in check_musetalk(musetalk_weights)}
    unet, parsing = checks["musetalkV15/unet.pth"], checks["face-parse-bisent"]
    assert unet.status == "ok" and "loads into the UNet" in unet.detail
    assert parsing.status == "ok" and "landmark lower-face mask" in parsing.detail
    assert checks["model step"].status == "warning" and "a face on the CPU" in checks["model step"].detail
    assert "GPU" in checks["model step"].fix
    load = checks["engine load"]  # timed phase by phase; the next start reads the network copy
    assert load.status == "ok" and " s from the " in load.detail and "whisper" in load.detail
    again = {check.name: check for check in check_musetalk(musetalk_weights)}["engine load"]
    assert "from the network copy" in again.detail and "read copy" in again.detail
    states = {entry.name: check_weights(entry, musetalk_weights, hash_contents=False) for entry in load_registry()}
    assert states["musetalk_v15_unet"].path == musetalk_weights / "musetalk" / "musetalkV15" / "unet.pth"
    assert states["musetalk_whisper_preprocessor"].state == "installed"
    assert states["musetalk_v1_unet"].state == "missing"
    broken = tmp_path / "weights"
    write_random_files(broken / "musetalk", size="reduced", seed=4)
    (broken / "musetalk" / "sd-vae" / "diffusion_pytorch_model.bin").write_bytes(b"PK\x03\x04 not a checkpoint")
    checks = {check.name: check for check in check_musetalk(broken)}
    assert checks["sd-vae/diffusion_pytorch_model.bin"].status == "problem"
    assert "is not a readable VAE checkpoint" in checks["sd-vae/diffusion_pytorch_model.bin"].detail


def test_a_job_asking_for_musetalk_without_its_files_is_refused_before_it_is_queued(tmp_path, musetalk_weights):
    from heygem.config import Config
    from heygem.jobs.request import check_options

    with pytest.raises(HeygemError, match=r"needs MuseTalk's files in .*musetalkV15/unet.pth"):
        check_options({"engine.name": "musetalk"}, Config(), folder=tmp_path)
    flat, config = check_options({"engine.name": "musetalk", "engine.musetalk_parsing": "landmarks"}, Config(),
                                 folder=musetalk_weights)
    assert config.engine.name == "musetalk" and config.engine.musetalk_parsing == "landmarks"


def test_the_1_0_files_are_used_without_the_1_5_ones_with_no_margin(tmp_path):
    from heygem.engines.musetalk.engine import MuseTalkEngine

    folder = write_random_files(tmp_path / "musetalk", size="reduced", seed=5, version="v1")
    files = find_musetalk_files(folder)
    assert files.version == "v1" and files.unet.name == "pytorch_model.bin"
    engine = MuseTalkEngine(files, EngineConfig(device="cpu"), use_cache=False)
    assert engine.extra_margin == 0 and engine.parsing_mode == "landmarks"


def test_the_device_render_path_matches_the_cpu_path_on_the_portrait(musetalk_weights, speech_wav, tmp_path,
                                                                     monkeypatch):
    """The GPU render path (run here by torch on the CPU) against the CPU path, one batch of the portrait: the
    same crops (so the same latents and faces) and masks, nothing outside the face box changed, the pasted
    mouth within a few levels (float matrices where cv2 resizes and converts in fixed point)."""
    from types import SimpleNamespace

    from heygem.config import Config, FaceConfig
    from heygem.engines.musetalk.engine import MuseTalkEngine
    from heygem.engines.musetalk.render import MuseTalkDeviceRender
    from heygem.face.finder import FaceFinder
    from heygem.media.frames import bgr_batch_to_i420, i420_batch_to_bgr
    from heygem.render.restore import Restoration
    from heygem.speech.audio import load_audio_16k
    from heygem.types import FrameBatch

    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path))
    photo = cv2.imread(str(ASSETS / "astronaut.jpg"))[:510, :510]  # even sides, as I420 needs
    with FaceFinder(FaceConfig(), still_images=True) as finder:
        landmarks = finder.find(photo)
    face = Face(box=tuple(int(v) for v in (*landmarks.min(axis=0), *landmarks.max(axis=0))), landmarks=landmarks)
    engine = MuseTalkEngine(find_musetalk_files(musetalk_weights / "musetalk"), EngineConfig(device="cpu"))
    samples = load_audio_16k(speech_wav)[:16000]
    prepared = SimpleNamespace(engine=engine, engine_audio=engine.audio_features(samples, 25.0, 25),
                               restoration=Restoration("none", 0.0), source_key=None)
    frames_i420 = bgr_batch_to_i420(np.repeat(photo[None], 3, axis=0))
    batch = FrameBatch(output_indices=np.array([3, 4, 5]), source_indices=np.zeros(3, np.int64),
                       frames_i420=frames_i420.copy(), faces=[face, None, face])
    config = Config()
    render = MuseTalkDeviceRender(prepared, config)
    (done,) = list(render.paste(render.render([batch])))
    ours = i420_batch_to_bgr(done.frames_i420).astype(np.int16)

    cpu = MuseTalkRender(prepared, config)  # the CPU path's three stages on the same batch
    reference_batch = FrameBatch(output_indices=batch.output_indices, source_indices=batch.source_indices,
                                 frames_i420=frames_i420.copy(), faces=batch.faces)
    (reference_batch,) = list(cpu.blend(cpu.restore(cpu.generate([reference_batch]))))
    reference = i420_batch_to_bgr(reference_batch.frames_i420).astype(np.int16)
    source = i420_batch_to_bgr(frames_i420).astype(np.int16)

    assert np.array_equal(ours[1], source[1]) and np.array_equal(reference[1], source[1])  # no face: untouched
    box = crop.musetalk_box(face, *photo.shape[:2], engine.extra_margin)
    x1, y1, x2, y2 = box
    outside = np.ones(photo.shape[:2], bool)
    outside[y1:y2, x1:x2] = False
    assert np.array_equal(ours[0][outside], source[0][outside])  # only the box's bytes change
    changed = np.abs(reference[0] - source[0]).max(axis=2) > 8  # what the CPU path pasted
    assert changed[y1:(y1 + y2) // 2].sum() == 0 and changed.sum() > 500
    difference = np.abs(ours - reference)[[0, 2]]  # (2, H, W, 3)
    assert np.abs(ours[0] - source[0])[changed].mean() > 8  # the device path pasted a mouth there too
    in_box = difference[:, y1:y2, x1:x2]  # measured: mean 0.17, 99.9th percentile 3, max 4 levels
    assert in_box.mean() < 0.4 and in_box.max() <= 6, (in_box.mean(), in_box.max())


@pytest.mark.parametrize("path", ["cpu", "device", "device, CPU steps"])
def test_small_batches_of_big_frames_are_gathered_into_full_model_batches(musetalk_weights, speech_wav, tmp_path,
                                                                          monkeypatch, path):
    """A batch of 1080p frames holds a few frames; the networks run a fixed batch. Both render paths
    hand the engine groups of consecutive batches that fill its batch, every frame still comes out once
    in order, and the frames are those of one batch at a time (the same crops, faces and pastes)."""
    from types import SimpleNamespace

    from heygem.config import Config, FaceConfig
    from heygem.engines.musetalk.engine import MuseTalkEngine
    from heygem.engines.musetalk.render import MuseTalkDeviceRender
    from heygem.face.finder import FaceFinder
    from heygem.media.frames import bgr_batch_to_i420, i420_batch_to_bgr
    from heygem.render.restore import Restoration
    from heygem.speech.audio import load_audio_16k
    from heygem.types import FrameBatch

    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path))
    photo = cv2.imread(str(ASSETS / "astronaut.jpg"))[:510, :510]
    with FaceFinder(FaceConfig(), still_images=True) as finder:
        landmarks = finder.find(photo)
    face = Face(box=tuple(int(v) for v in (*landmarks.min(axis=0), *landmarks.max(axis=0))), landmarks=landmarks)
    engine = MuseTalkEngine(find_musetalk_files(musetalk_weights / "musetalk"), EngineConfig(device="cpu"))
    assert engine.batch_size == 4  # CPU_BATCH_SIZE
    # "CPU steps": a restorer (or face parsing) makes the device path take the CPU path's steps
    restoration = Restoration("sharpen", 0.5) if path.endswith("CPU steps") else Restoration("none", 0.0)
    audio_windows = engine.audio_features(load_audio_16k(speech_wav)[:16000], 25.0, 25)
    prepared = SimpleNamespace(engine=engine, engine_audio=audio_windows, restoration=restoration, source_key=None)
    frames_i420 = bgr_batch_to_i420(np.repeat(photo[None], 2, axis=0))
    centre = landmarks.mean(axis=0)
    smaller = 0.8 * (landmarks - centre) + centre + np.array([-30.0, 20.0], np.float32)  # a face further away
    far = Face(box=tuple(int(v) for v in (*smaller.min(axis=0), *smaller.max(axis=0))), landmarks=smaller)
    # faces of two sizes in one group: the device path cuts all of a group's regions at its largest box's size
    faces_of = [[face, far], [face, None], [far, face], [face, face], [None, None], [far, far]]

    def batches():
        for number, faces in enumerate(faces_of):
            yield FrameBatch(output_indices=np.array([2 * number, 2 * number + 1]),
                             source_indices=np.zeros(2, np.int64), frames_i420=frames_i420.copy(), faces=faces)

    seen = []
    generate_faces = engine.generate_faces

    def counting(latents, audio):
        seen.append(len(latents))
        return generate_faces(latents, audio)

    monkeypatch.setattr(engine, "generate_faces", counting)
    config = Config()

    def run(stream):
        if path.startswith("device"):
            render = MuseTalkDeviceRender(prepared, config)
            return list(render.paste(render.render(stream)))
        render = MuseTalkRender(prepared, config)
        return list(render.blend(render.restore(render.generate(stream))))

    gathered = run(batches())
    assert seen == [3, 4, 2]  # faces 2+1 (the next 2 would overflow 4), 2+2, then the empty batch and 2
    assert [list(batch.output_indices) for batch in gathered] == [[2 * n, 2 * n + 1] for n in range(6)]
    seen.clear()
    one_at_a_time = [run(iter([batch]))[0] for batch in batches()]
    assert seen == [2, 1, 2, 2, 2]
    difference = np.stack([np.abs(i420_batch_to_bgr(ours.frames_i420).astype(np.int16)
                                  - i420_batch_to_bgr(alone.frames_i420))
                           for ours, alone in zip(gathered, one_at_a_time)])
    # other batch sizes round the networks' sums otherwise, which random weights amplify to a level or two
    assert difference.max() <= 3 and difference.mean() < 0.02, (difference.max(), difference.mean())
    source = i420_batch_to_bgr(frames_i420).astype(np.int16)
    assert np.array_equal(i420_batch_to_bgr(gathered[4].frames_i420), source)  # no face: untouched
    assert np.abs(i420_batch_to_bgr(gathered[0].frames_i420).astype(np.int16) - source).max() > 8


def test_a_musetalk_job_makes_no_mel_and_its_whisper_windows_in_the_background(musetalk_weights, speech_clip,
                                                                                 tmp_path, monkeypatch):
    """The Wav2Lip mel is for the engines that read it; MuseTalk's Whisper windows are made in a background
    thread as soon as the engine has loaded, not on the render thread when the first frames arrive."""
    import threading

    from heygem.engines.musetalk import MuseTalkKind
    from heygem.pipeline import generate
    from heygem.speech import audio

    monkeypatch.setenv("HEYGEM_WEIGHTS", str(musetalk_weights))
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path / "cache"))

    def no_mel(samples):
        raise AssertionError("the mel was computed for the musetalk engine")

    threads = []
    whisper_windows = MuseTalkKind.audio_features

    def recorded(self, engine, samples_16k, fps, frame_count):
        threads.append(threading.current_thread().name)
        return whisper_windows(self, engine, samples_16k, fps, frame_count)

    monkeypatch.setattr(audio, "melspectrogram", no_mel)
    monkeypatch.setattr(MuseTalkKind, "audio_features", recorded)
    summary = generate(ASSETS / "astronaut.jpg", speech_clip, tmp_path / "out.mp4",
                       overrides={"engine.name": "musetalk", "restore.enabled": False})
    assert summary.engine == "musetalk" and summary.frames == 20
    assert len(threads) == 1 and threads[0].startswith("heygem-background"), threads
    assert_playable_mp4(tmp_path / "out.mp4", 0.8)


def test_the_device_path_crops_each_source_frame_once_and_a_later_job_on_the_same_clip_not_at_all(
        musetalk_weights, speech_wav, tmp_path, monkeypatch):
    """The 256x256 crop of a face is a function of the clip's frame and the box: the device path remembers,
    per frame of the clip (the avatar cache's key, the source frame, the box), which crop's latents it used,
    so a clip that loops under longer speech crops each frame once, and the next job on the same clip (a
    worker's kept engine, a presenter's new script) crops none; the frames come out the same bytes."""
    from types import SimpleNamespace

    from heygem.config import Config, FaceConfig
    from heygem.engines.musetalk.engine import MuseTalkEngine
    from heygem.engines.musetalk.render import MuseTalkDeviceRender
    from heygem.face.finder import FaceFinder
    from heygem.media.frames import bgr_batch_to_i420
    from heygem.render.restore import Restoration
    from heygem.speech.audio import load_audio_16k
    from heygem.types import FrameBatch

    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path))
    photo = cv2.imread(str(ASSETS / "astronaut.jpg"))[:510, :510]
    with FaceFinder(FaceConfig(), still_images=True) as finder:
        landmarks = finder.find(photo)
    shifted = np.roll(photo, (6, -4), axis=(0, 1))  # a second frame of the clip: other pixels, other crop
    faces = [Face(box=tuple(int(v) for v in (*points.min(axis=0), *points.max(axis=0))), landmarks=points)
             for points in (landmarks, landmarks + np.array([-4.0, 6.0], np.float32))]
    engine = MuseTalkEngine(find_musetalk_files(musetalk_weights / "musetalk"), EngineConfig(device="cpu"))
    audio_windows = engine.audio_features(load_audio_16k(speech_wav)[:16000], 25.0, 25)
    clip_i420 = bgr_batch_to_i420(np.stack([photo, shifted]))
    sources = [0, 1, 1, 0, 0, 1]  # the clip played forwards, backwards, forwards

    def batches():
        for number in range(3):
            rows = sources[2 * number:2 * number + 2]
            yield FrameBatch(output_indices=np.array([2 * number, 2 * number + 1]), source_indices=np.array(rows),
                             frames_i420=clip_i420[rows].copy(), faces=[faces[row] for row in rows])

    cropped = []
    crop_256 = crop.crop_256
    monkeypatch.setattr(crop, "crop_256", lambda bgr, box: cropped.append(tuple(box)) or crop_256(bgr, box))

    def run(source_key):
        prepared = SimpleNamespace(engine=engine, engine_audio=audio_windows, restoration=Restoration("none", 0.0),
                                   source_key=source_key)
        render = MuseTalkDeviceRender(prepared, Config())
        return np.stack([batch.frames_i420 for batch in render.paste(render.render(batches()))])

    without = run(None)  # no key for the clip (no avatar cache): every face cropped
    assert len(cropped) == 6
    cropped.clear()
    first = run("clip-a")
    assert len(cropped) == 2  # each frame of the clip once
    cropped.clear()
    again = run("clip-a")
    assert cropped == []  # the next job on the same clip
    other = run("clip-b")
    assert len(cropped) == 2  # another clip's frames are its own
    for frames in (first, again, other):
        assert np.array_equal(frames, without)
    pasted = without.reshape(clip_i420[sources].shape).astype(np.int16) - clip_i420[sources].astype(np.int16)
    assert np.abs(pasted).max() > 8  # mouths pasted


def test_a_second_job_on_the_same_video_crops_no_face_on_the_device_path(musetalk_weights, face_video, speech_clip,
                                                                          tmp_path, monkeypatch):
    """Through the pipeline (the device path, run by torch on the CPU): the job's clip is known by its avatar
    cache key, so the engine kept for the next job takes the latents of every frame it met without cutting
    the crop again, and the video comes out the same."""
    from heygem.pipeline import generate

    monkeypatch.setenv("HEYGEM_WEIGHTS", str(musetalk_weights))
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path / "cache"))
    cropped = []
    crop_256 = crop.crop_256
    monkeypatch.setattr(crop, "crop_256", lambda bgr, box: cropped.append(1) or crop_256(bgr, box))
    overrides = {"engine.name": "musetalk", "restore.enabled": False, "run.render": "torch"}
    first = generate(face_video, speech_clip, tmp_path / "first.mp4", overrides=overrides)
    assert len(cropped) == first.frames - first.frames_without_face > 0
    cropped.clear()
    second = generate(face_video, speech_clip, tmp_path / "second.mp4", overrides=overrides)
    assert second.frames == first.frames and cropped == []
    assert decoded_frames(tmp_path / "first.mp4").tobytes() == decoded_frames(tmp_path / "second.mp4").tobytes()


def decoded_frames(path):
    """Every video frame of the MP4 at ``path``, (N, H, W, 3) uint8 RGB."""
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
