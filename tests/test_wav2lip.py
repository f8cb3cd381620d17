"""The Wav2Lip generator, its checkpoint loading, the engine and the device helpers.

Checkpoints are random-init models saved in the layouts the public files use.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heygem.config import EngineConfig
from heygem.engines.wav2lip.engine import Wav2LipEngine, prepare_faces
from heygem.errors import HeygemError
from heygem.models.wav2lip import Wav2Lip
from heygem.runtime.device import inference_context, is_out_of_memory, pick_device, run_in_batches
from heygem.types import EngineBatch, Face
from heygem.weights import find_wav2lip_checkpoint, load_state_dict_strict

# The public generator: 50 conv units of 7 entries each (conv weight and bias; batch-norm
# weight, bias, running mean, running variance, batches tracked) plus the final 1x1 conv.
# Units: face encoder 1+3+4+3+3+2+2 = 18, audio encoder 13, decoder 1+2+3+3+3+3+3 = 18, output 1.
PUBLIC_KEY_COUNT = 50 * 7 + 2
PUBLIC_KEYS_PER_PART = {"face_encoder_blocks": 18 * 7, "audio_encoder": 13 * 7,
                        "face_decoder_blocks": 18 * 7, "output_block": 7 + 2}
PUBLIC_PARAMETER_COUNT = 36_298_035
PUBLIC_SHAPES = {
    "face_encoder_blocks.0.0.conv_block.0.weight": (16, 6, 7, 7),
    "face_encoder_blocks.0.0.conv_block.1.running_mean": (16,),
    "face_encoder_blocks.2.3.conv_block.0.weight": (64, 64, 3, 3),
    "face_encoder_blocks.6.1.conv_block.0.weight": (512, 512, 1, 1),
    "audio_encoder.0.conv_block.0.weight": (32, 1, 3, 3),
    "audio_encoder.3.conv_block.0.weight": (64, 32, 3, 3),
    "audio_encoder.12.conv_block.0.weight": (512, 512, 1, 1),
    "face_decoder_blocks.0.0.conv_block.0.weight": (512, 512, 1, 1),
    "face_decoder_blocks.1.0.conv_block.0.weight": (1024, 512, 3, 3),  # ConvTranspose2d: (in, out, k, k)
    "face_decoder_blocks.3.0.conv_block.0.weight": (768, 384, 3, 3),
    "face_decoder_blocks.6.2.conv_block.1.num_batches_tracked": (),
    "output_block.0.conv_block.0.weight": (32, 80, 3, 3),
    "output_block.1.weight": (3, 32, 1, 1),
    "output_block.1.bias": (3,),
}


def empty_model() -> Wav2Lip:
    """A Wav2Lip with uninitialised weights: cheap to build, and every value must come from the file."""
    with torch.device("meta"):
        model = Wav2Lip()
    return model.to_empty(device="cpu")


@pytest.fixture(scope="module")
def trained_like_state_dict() -> dict:
    """A random-init state dict with non-default batch-norm statistics, so loading is observable."""
    torch.manual_seed(0)
    model = Wav2Lip()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.normal_(0.0, 0.1)
            module.running_var.uniform_(0.5, 2.0)
    return model.state_dict()


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, trained_like_state_dict):
    """The same weights saved in the three layouts found in the wild."""
    directory = tmp_path_factory.mktemp("checkpoints")
    official = {"optimizer": {}, "global_step": 1234, "global_epoch": 7}
    torch.save({"state_dict": trained_like_state_dict, **official}, directory / "official.pth")
    prefixed = {f"module.{key}": value for key, value in trained_like_state_dict.items()}
    torch.save({"state_dict": prefixed, **official}, directory / "official_module_prefix.pth")
    torch.save(trained_like_state_dict, directory / "bare.pth")
    return directory


def test_state_dict_matches_the_public_layout():
    model = empty_model()
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert len(shapes) == PUBLIC_KEY_COUNT == 352
    for part, count in PUBLIC_KEYS_PER_PART.items():
        assert sum(key.startswith(part + ".") for key in shapes) == count, part
    for key, shape in PUBLIC_SHAPES.items():
        assert shapes[key] == shape, key
    assert sum(parameter.numel() for parameter in model.parameters()) == PUBLIC_PARAMETER_COUNT
    assert isinstance(model.face_decoder_blocks[1][0].conv_block[0], torch.nn.ConvTranspose2d)
    assert isinstance(model.output_block[1], torch.nn.Conv2d)


@pytest.mark.parametrize("file_name", ["official.pth", "official_module_prefix.pth", "bare.pth"])
def test_checkpoint_layouts_load_strictly_and_run(checkpoint_dir, trained_like_state_dict, file_name):
    model = empty_model()
    load_state_dict_strict(model, checkpoint_dir / file_name)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in trained_like_state_dict.items())

    model.eval()
    faces = torch.rand(2, 6, 96, 96)
    mel_windows = torch.randn(2, 1, 80, 16)
    with torch.inference_mode():
        generated = model(mel_windows, faces)
    assert generated.shape == (2, 3, 96, 96)
    assert generated.dtype == torch.float32
    assert 0.0 <= generated.min().item() and generated.max().item() <= 1.0


def test_renamed_key_is_refused_naming_both_keys(tmp_path, trained_like_state_dict):
    state_dict = dict(trained_like_state_dict)
    state_dict["output_block.1.kernel"] = state_dict.pop("output_block.1.weight")
    path = tmp_path / "renamed.pth"
    torch.save({"state_dict": state_dict, "optimizer": {}, "global_step": 1, "global_epoch": 1}, path)
    with pytest.raises(HeygemError) as caught:
        load_state_dict_strict(empty_model(), path)
    message = str(caught.value)
    assert "renamed.pth" in message
    assert "1 missing keys (output_block.1.weight)" in message
    assert "1 unexpected keys (output_block.1.kernel)" in message
    assert "wav2lip_gan.pth" in message
    assert "\n" not in message


def test_wrong_shape_is_refused_naming_the_key_and_shapes(tmp_path, trained_like_state_dict):
    state_dict = dict(trained_like_state_dict)
    state_dict["audio_encoder.0.conv_block.0.weight"] = torch.zeros(32, 1, 5, 5)
    path = tmp_path / "wrong_shape.pth"
    torch.save(state_dict, path)
    with pytest.raises(HeygemError, match=r"audio_encoder\.0\.conv_block\.0\.weight has shape "
                                          r"\(32, 1, 5, 5\) in the file but \(32, 1, 3, 3\)"):
        load_state_dict_strict(empty_model(), path)


def test_files_that_are_not_checkpoints_are_refused(tmp_path):
    text_file = tmp_path / "wav2lip.pth"
    text_file.write_text("these are not the weights you are looking for\n")
    with pytest.raises(HeygemError, match="not a readable Wav2Lip checkpoint"):
        load_state_dict_strict(empty_model(), text_file)

    web_page = tmp_path / "wav2lip_gan.pth"
    web_page.write_text("<!DOCTYPE html><html><body>Sign in</body></html>")
    with pytest.raises(HeygemError, match="web page"):
        load_state_dict_strict(empty_model(), web_page)

    not_weights = tmp_path / "list.pth"
    torch.save([1, 2, 3], not_weights)
    with pytest.raises(HeygemError, match="holds no Wav2Lip weights"):
        load_state_dict_strict(empty_model(), not_weights)

    with pytest.raises(HeygemError, match="not found"):
        load_state_dict_strict(empty_model(), tmp_path / "missing.pth")


def test_find_checkpoint_prefers_the_gan_weights(tmp_path):
    assert find_wav2lip_checkpoint(tmp_path / "no such folder") is None
    assert find_wav2lip_checkpoint(tmp_path) is None
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "Wav2Lip.PTH").write_bytes(b"")
    assert find_wav2lip_checkpoint(tmp_path) == tmp_path / "Wav2Lip.PTH"
    (tmp_path / "wav2lip_gan.pth").write_bytes(b"")
    assert find_wav2lip_checkpoint(tmp_path) == tmp_path / "wav2lip_gan.pth"


def test_prepare_faces_masks_the_lower_half_of_the_target_only():
    crops = torch.randint(0, 256, (2, 96, 96, 3), dtype=torch.uint8)
    faces = prepare_faces(crops)
    expected = crops.permute(0, 3, 1, 2).float() / 255
    assert faces.shape == (2, 6, 96, 96)
    assert torch.equal(faces[:, :3, :48], expected[:, :, :48])
    assert torch.count_nonzero(faces[:, :3, 48:]) == 0
    assert torch.equal(faces[:, 3:], expected)


def test_engine_returns_box_sized_patches_and_none_without_a_face(checkpoint_dir):
    engine = Wav2LipEngine(checkpoint_dir / "bare.pth", EngineConfig(device="cpu", batch_size=1))
    assert engine.name == "wav2lip"
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (3, 180, 200, 3), dtype=np.uint8)  # (N, H, W, 3)
    faces = [Face(box=(20, 30, 120, 150)), None, Face(box=(150, 100, 230, 200))]  # last box leaves the frame
    batch = EngineBatch(
        frame_indices=np.arange(10, 13, dtype=np.int64),
        frames_bgr=frames,
        faces=faces,
        mel_windows=rng.standard_normal((3, 80, 16)).astype(np.float32),
        fps=25.0,
    )
    patches = engine.generate(batch)
    assert len(patches) == 3
    assert patches[1] is None
    assert patches[0].box == (20, 30, 120, 150)
    assert patches[0].image_bgr.shape == (120, 100, 3)
    assert patches[2].box == (150, 100, 200, 180)  # clipped to the 200x180 frame
    assert patches[2].image_bgr.shape == (80, 50, 3)
    for patch, face in ((patches[0], faces[0]), (patches[2], faces[2])):
        assert patch.image_bgr.dtype == np.uint8
        assert patch.mask is None
        assert patch.face is face
    assert engine.generate(EngineBatch(batch.frame_indices[:1], frames[:1], [None], batch.mel_windows[:1], 25.0)) \
        == [None]


def test_generate_faces_equals_the_per_batch_forward_on_the_cpu(checkpoint_dir):
    from heygem.models.wav2lip import fold_batchnorm

    engine = Wav2LipEngine(checkpoint_dir / "official.pth", EngineConfig(device="cpu", batch_size=2))
    assert engine.batch_size == 2
    generator = torch.Generator().manual_seed(1)
    faces = prepare_faces(torch.randint(0, 256, (3, 96, 96, 3), dtype=torch.uint8, generator=generator))
    mel_windows = torch.randn(3, 1, 80, 16, generator=generator)

    reference_model = empty_model()
    load_state_dict_strict(reference_model, checkpoint_dir / "official.pth")
    fold_batchnorm(reference_model)
    with torch.inference_mode():  # the path before the runner: slices of 2, the last one short
        expected = torch.cat([reference_model(mel_windows[start:start + 2], faces[start:start + 2])
                              for start in range(0, 3, 2)])

    generated = engine.generate_faces(faces, mel_windows)  # two passes of 2, the second padded
    assert generated.shape == (3, 3, 96, 96)
    assert generated.dtype == torch.float32 and generated.device == engine.device
    torch.testing.assert_close(generated, expected, atol=1e-5, rtol=1e-4)
    assert engine.generate_faces(faces[:0], mel_windows[:0]).shape == (0, 3, 96, 96)
    with pytest.raises(ValueError, match=r"got \(3, 6, 96, 96\) and \(2, 1, 80, 16\)"):
        engine.generate_faces(faces, mel_windows[:2])


def test_mouths_from_crops_are_the_mouths_generate_draws(checkpoint_dir):
    """``mouths`` (uint8 crops in, uint8 mouths out, the conversions inside the runner) gives what the
    job's path gives before scaling to the box, byte for byte, in any batch split; bad shapes are refused."""
    from heygem.engines.wav2lip.engine import crop_face, prepare_mel_windows, to_uint8_images

    engine = Wav2LipEngine(checkpoint_dir / "official.pth", EngineConfig(device="cpu", batch_size=2))
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (3, 180, 200, 3), dtype=np.uint8)
    crops = np.stack([crop_face(frame, (20, 30, 140, 170)) for frame in frames])  # (3, 96, 96, 3)
    mels = rng.standard_normal((3, 80, 16)).astype(np.float32)
    expected = to_uint8_images(engine.generate_faces(prepare_faces(torch.from_numpy(crops)),
                                                     prepare_mel_windows(mels))).numpy()
    mouths = engine.mouths(crops, mels)  # a batch of 2, then a short one
    assert mouths.shape == (3, 96, 96, 3) and mouths.dtype == np.uint8
    np.testing.assert_array_equal(mouths, expected)
    np.testing.assert_array_equal(engine.mouths(crops[2:], mels[2:]), expected[2:])
    assert engine.mouths(crops[:0], mels[:0]).shape == (0, 96, 96, 3)
    with pytest.raises(ValueError, match="uint8 crops"):
        engine.mouths(crops.astype(np.float32), mels)
    with pytest.raises(ValueError, match="mel windows"):
        engine.mouths(crops, mels[:2])


def test_out_of_memory_errors_are_recognised():
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA error"))
    assert not is_out_of_memory(RuntimeError("Given groups=1, weight of size [16, 6, 7, 7]"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_run_in_batches_halves_on_out_of_memory_and_keeps_order():
    tried_sizes = []

    def doubled(chunk):
        tried_sizes.append(len(chunk))
        if len(chunk) > 2:
            raise RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")
        return [2 * item for item in chunk]

    outputs, working_size = run_in_batches(doubled, list(range(11)), batch_size=8)
    assert [item for output in outputs for item in output] == [2 * item for item in range(11)]
    assert working_size == 2
    assert tried_sizes == [8, 4, 2, 2, 2, 2, 2, 1]

    tensor_outputs, _ = run_in_batches(lambda chunk: chunk * 10, torch.arange(5), batch_size=3)
    assert torch.equal(torch.cat(tensor_outputs), torch.arange(5) * 10)


def test_run_in_batches_gives_up_at_one_and_passes_other_errors_through():
    def always_out_of_memory(chunk):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(HeygemError, match="batch of 1"):
        run_in_batches(always_out_of_memory, list(range(4)), batch_size=4)

    def broken(chunk):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_in_batches(broken, list(range(4)), batch_size=4)


def test_pick_device(monkeypatch):
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(HeygemError, match="--device cpu"):
            pick_device(name)
    for name in ("gpu", "cuda:x"):
        with pytest.raises(HeygemError, match="not valid"):
            pick_device(name)


def test_inference_context_precision_on_cpu():
    cpu = torch.device("cpu")
    matrix = torch.ones(4, 4)
    with inference_context(cpu, "auto"):
        assert torch.is_inference_mode_enabled()
        assert (matrix @ matrix).dtype == torch.float32
    with inference_context(cpu, "bf16"):
        assert (matrix @ matrix).dtype == torch.bfloat16
    with pytest.raises(HeygemError, match="precision"):
        with inference_context(cpu, "fp8"):
            pass


def test_folding_batchnorm_keeps_the_outputs():
    import copy

    from heygem.models.wav2lip import fold_batchnorm

    torch.manual_seed(3)
    model = Wav2Lip().eval()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):  # non-trivial statistics, as trained weights have
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 1.5)
            module.weight.data.uniform_(0.5, 1.5)
    folded = fold_batchnorm(copy.deepcopy(model))
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
    mel, faces = torch.randn(2, 1, 80, 16), torch.rand(2, 6, 96, 96)
    with torch.inference_mode():
        torch.testing.assert_close(folded(mel, faces), model(mel, faces), atol=1e-5, rtol=1e-4)
