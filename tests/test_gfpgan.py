"""The GFPGAN v1.4 restorer network: its checkpoint layout, strict loading and the two modulated-conv forms.

Checkpoints are random-init models saved in the released layout ({"params_ema": state dict}).
Only one test runs the whole network at 512x512 (about 15 s on two cores); the others run
single layers or the first sizes of the decoder.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import cv2
import pytest
import torch

from heygem.errors import HeygemError
from heygem.models.gfpgan import DECODER_CHANNELS, GFPGANClean, ModulatedConv2d, StyleConv, StyleDecoder
from heygem.render.gfpgan import load_gfpgan

REPO = Path(__file__).resolve().parent.parent

# The layout of params_ema in the released GFPGANv1.4.pth: [key, shape, dtype] of its 285
# tensors in file order, as compact JSON, hashed with SHA-256; 87,143,276 values in all.
PUBLIC_LAYOUT_SHA256 = "c582e074c215d9bb2facdd3bbc9fa8fe04b06a8bd00957f547bd67fb6785f9c2"
PUBLIC_KEY_COUNT = 285
PUBLIC_VALUE_COUNT = 87_143_276
PUBLIC_SHAPES = {
    "conv_body_first.weight": (32, 3, 1, 1),
    "conv_body_down.0.conv2.weight": (64, 32, 3, 3),
    "conv_body_down.6.skip.weight": (256, 256, 1, 1),
    "conv_body_up.6.conv2.weight": (32, 64, 3, 3),
    "toRGB.6.weight": (3, 32, 1, 1),
    "final_linear.weight": (8192, 4096),
    "stylegan_decoder.style_mlp.15.weight": (512, 512),
    "stylegan_decoder.constant_input.weight": (1, 512, 4, 4),
    "stylegan_decoder.style_conv1.modulated_conv.weight": (1, 512, 512, 3, 3),
    "stylegan_decoder.to_rgb1.modulated_conv.weight": (1, 3, 512, 1, 1),
    "stylegan_decoder.style_convs.9.modulated_conv.modulation.weight": (256, 512),
    "stylegan_decoder.style_convs.13.bias": (1, 64, 1, 1),
    "stylegan_decoder.to_rgbs.6.modulated_conv.weight": (1, 3, 64, 1, 1),
    "stylegan_decoder.noises.noise14": (1, 1, 512, 512),
    "condition_scale.6.2.weight": (32, 32, 3, 3),
    "condition_shift.0.0.bias": (256,),
}


def meta_model() -> GFPGANClean:
    with torch.device("meta"):
        return GFPGANClean()


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return ((result - reference).abs().max() / reference.abs().max()).item()


@pytest.fixture(scope="module")
def random_model() -> GFPGANClean:
    """Random init with non-zero noise strengths and biases, so every tensor changes the output."""
    torch.manual_seed(0)
    model = GFPGANClean().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, StyleConv):
                module.weight.fill_(0.1)
                module.bias.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def released_checkpoint(random_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gfpgan") / "GFPGANv1.4.pth"
    torch.save({"params_ema": random_model.state_dict()}, path)
    return path


def cheap_state_dict() -> dict[str, torch.Tensor]:
    """Every key at its public shape, tensor i filled with the value i; stride-0 views keep the file tiny."""
    return {key: torch.full((), float(index)).expand(tensor.shape)
            for index, (key, tensor) in enumerate(meta_model().state_dict().items())}


def test_state_dict_matches_the_released_file_key_for_key():
    state_dict = meta_model().state_dict()
    assert len(state_dict) == PUBLIC_KEY_COUNT
    assert sum(tensor.numel() for tensor in state_dict.values()) == PUBLIC_VALUE_COUNT
    for key, shape in PUBLIC_SHAPES.items():
        assert tuple(state_dict[key].shape) == shape, key
    layout = [[key, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")] for key, tensor in state_dict.items()]
    assert hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest() == PUBLIC_LAYOUT_SHA256


def test_released_layout_loads_strictly_and_restores_the_sample_face(random_model, released_checkpoint):
    model = load_gfpgan(released_checkpoint, "cpu")
    assert isinstance(model, GFPGANClean) and not model.training
    loaded = model.state_dict()
    for key, tensor in random_model.state_dict().items():
        assert torch.equal(loaded[key], tensor), key

    photo_bgr = cv2.imread(str(REPO / "assets" / "astronaut.jpg"), cv2.IMREAD_COLOR)
    face_rgb = cv2.cvtColor(cv2.resize(photo_bgr, (512, 512), interpolation=cv2.INTER_AREA), cv2.COLOR_BGR2RGB)
    faces = torch.from_numpy(face_rgb).permute(2, 0, 1)[None].float() / 127.5 - 1.0  # (1, 3, 512, 512) in [-1, 1]
    with torch.inference_mode():
        restored = model(faces)
    assert restored.shape == (1, 3, 512, 512) and restored.dtype == torch.float32
    assert torch.isfinite(restored).all()
    assert restored.std().item() > 1e-3  # an image, not a constant


@pytest.mark.parametrize("layout", ["params_ema", "params", "bare", "module_prefix"])
def test_every_checkpoint_layout_loads_every_value(tmp_path, layout):
    state_dict = cheap_state_dict()
    payload = {
        "params_ema": {"params_ema": state_dict},
        "params": {"params": state_dict},
        "bare": state_dict,
        "module_prefix": {f"module.{key}": value for key, value in state_dict.items()},
    }[layout]
    path = tmp_path / "GFPGANv1.4.pth"
    torch.save(payload, path)
    assert path.stat().st_size < 1_000_000
    model = load_gfpgan(path)
    for index, (key, tensor) in enumerate(model.state_dict().items()):
        assert tensor.shape == state_dict[key].shape and bool((tensor == index).all()), key


@pytest.mark.parametrize("change, named_key, reason", [
    ("missing", "stylegan_decoder.style_convs.3.modulated_conv.weight", "1 missing keys"),
    ("extra", "stylegan_decoder.style_convs.14.weight", "1 unexpected keys"),
    ("shape", "condition_scale.6.2.weight", "has shape (64, 32, 3, 3) in the file but (32, 32, 3, 3)"),
])
def test_mismatched_checkpoints_are_refused_naming_the_key(tmp_path, change, named_key, reason):
    state_dict = cheap_state_dict()
    if change == "missing":
        del state_dict[named_key]
    elif change == "extra":
        state_dict[named_key] = torch.zeros(1)
    else:
        state_dict[named_key] = torch.zeros(64, 32, 3, 3)
    path = tmp_path / "GFPGANv1.4.pth"
    torch.save({"params_ema": state_dict}, path)
    with pytest.raises(HeygemError) as error:
        load_gfpgan(path)
    message = str(error.value)
    assert str(path) in message and named_key in message and reason in message
    assert "GFPGANv1.4.pth" in message.split("expected")[-1]


def test_unusable_files_are_refused_saying_why(tmp_path):
    with pytest.raises(HeygemError, match="checkpoint not found"):
        load_gfpgan(tmp_path / "absent.pth")
    web_page = tmp_path / "page.pth"
    web_page.write_text("<!DOCTYPE html><html>sign in</html>")
    with pytest.raises(HeygemError, match="web page"):
        load_gfpgan(web_page)
    empty = tmp_path / "empty.pth"
    torch.save({"params_ema": {}}, empty)
    with pytest.raises(HeygemError, match="holds no GFPGAN weights"):
        load_gfpgan(empty)


@pytest.mark.parametrize("in_channels, out_channels, kernel_size, demodulate, upsample", [
    (512, 512, 3, True, True),    # first conv of the 8x8 ... 64x64 sizes
    (256, 128, 3, True, True),    # first conv of 256x256, narrowing
    (64, 64, 3, True, False),     # second conv of 512x512
    (128, 3, 1, False, False),    # ToRGB
])
def test_shared_weight_modulated_conv_equals_the_grouped_form(in_channels, out_channels, kernel_size, demodulate,
                                                              upsample):
    torch.manual_seed(1)
    conv = ModulatedConv2d(in_channels, out_channels, kernel_size, demodulate, upsample)
    with torch.no_grad():
        conv.modulation.bias.normal_(0.0, 1.0)  # styles of both signs, some near zero
    features = torch.randn(3, in_channels, 8, 8)  # (B, C_in, H, W)
    style_codes = torch.randn(3, 512)
    with torch.no_grad():
        conv.fused = False
        grouped = conv(features, style_codes)
        conv.fused = True
        fused = conv(features, style_codes)
    size = 16 if upsample else 8
    assert grouped.shape == fused.shape == (3, out_channels, size, size)
    assert relative_error(fused, grouped) < 1e-4
    # Each sample uses its own style: the first sample alone gives the same result.
    with torch.no_grad():
        alone = conv(features[:1], style_codes[:1])
    assert relative_error(alone, grouped[:1]) < 1e-4
    assert relative_error(grouped[1:2], grouped[:1]) > 1e-2


@pytest.mark.parametrize("demodulate", [True, False])
def test_shared_weight_form_stays_finite_in_fp16_with_large_styles(demodulate):
    """Styles of 300: their squares (90,000) are past fp16's largest number, so the demodulation would
    come out as zero and the output blank without the shared-weight form's scaling by the peak style."""
    torch.manual_seed(5)
    conv = ModulatedConv2d(64, 32, 3, demodulate=demodulate)
    with torch.no_grad():
        conv.modulation.bias.fill_(300.0)
    features, codes = torch.randn(2, 64, 8, 8) * 30, torch.randn(2, 512)
    with torch.no_grad():
        conv.fused = False
        reference = conv(features, codes)  # fp32, one weight per sample
        conv.fused = True
        half = conv.half()(features.half(), codes.half()).float()
    assert torch.isfinite(half).all()
    assert relative_error(half, reference) < 1e-2


def test_decoder_forms_agree_through_the_first_sizes():
    torch.manual_seed(2)
    decoder = StyleDecoder().eval()
    with torch.no_grad():
        for module in decoder.modules():
            if isinstance(module, StyleConv):
                module.weight.fill_(0.2)
    style_codes = torch.randn(2, 16, 512)
    conditions = [(torch.randn(2, DECODER_CHANNELS[size] // 2, size, size),
                   torch.randn(2, DECODER_CHANNELS[size] // 2, size, size)) for size in (8, 16, 32)]
    modulated_convs = [module for module in decoder.modules() if isinstance(module, ModulatedConv2d)]
    with torch.no_grad():
        for conv in modulated_convs:
            conv.fused = False
        grouped = decoder(style_codes, conditions, randomize_noise=False)
        for conv in modulated_convs:
            conv.fused = True
        fused = decoder(style_codes, conditions, randomize_noise=False)
        fused_again = decoder(style_codes, conditions, randomize_noise=False)
        noisy = decoder(style_codes, conditions, randomize_noise=True)
        without_conditions = decoder(style_codes, [(torch.ones_like(s), torch.zeros_like(t)) for s, t in conditions],
                                     randomize_noise=False)
    assert grouped.shape == (2, 3, 32, 32)
    assert relative_error(fused, grouped) < 1e-4
    assert torch.equal(fused, fused_again)  # the stored noise: deterministic
    assert relative_error(noisy, fused) > 1e-3
    assert relative_error(without_conditions, fused) > 1e-2  # the scale and shift reach the image


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_style_conv_equals_its_written_out_formula_with_and_without_autograd(fused, channels_last):
    """Without autograd StyleConv folds gain, noise and bias into one in-place pass; with it, the plain
    form runs: both equal leaky_relu(modulated_conv * sqrt(2) + noise strength * noise + bias)."""
    torch.manual_seed(3)
    style_conv = StyleConv(16, 8, upsample=True)
    with torch.no_grad():
        style_conv.weight.fill_(0.7)
        style_conv.bias.normal_()
    style_conv.modulated_conv.fused = fused
    features, codes, noise = torch.randn(3, 16, 8, 8), torch.randn(3, 512), torch.randn(1, 1, 16, 16)
    if channels_last:
        features = features.to(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = torch.nn.functional.leaky_relu(
            style_conv.modulated_conv(features, codes) * 2 ** 0.5 + 0.7 * noise + style_conv.bias, 0.2)
        in_place = style_conv(features, codes, noise)
    with_autograd = style_conv(features, codes, noise)
    assert with_autograd.requires_grad
    torch.testing.assert_close(in_place, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_autograd.detach(), expected, rtol=1e-5, atol=1e-5)


def test_decoder_gives_the_same_image_with_and_without_autograd():
    """The spatial scale and shift go into the features in place only without autograd."""
    torch.manual_seed(4)
    decoder = StyleDecoder().eval()
    style_codes = torch.randn(1, 16, 512)
    conditions = [(torch.randn(1, DECODER_CHANNELS[size] // 2, size, size),
                   torch.randn(1, DECODER_CHANNELS[size] // 2, size, size)) for size in (8, 16)]
    with torch.no_grad():
        in_place = decoder(style_codes, conditions, randomize_noise=False)
    with_autograd = decoder(style_codes, conditions, randomize_noise=False)
    torch.testing.assert_close(in_place, with_autograd.detach(), rtol=1e-5, atol=1e-5)


def test_encoder_gives_sixteen_style_codes_and_the_skip_maps(random_model):
    torch.manual_seed(3)
    faces = torch.rand(2, 3, 512, 512) * 2 - 1  # (B, 3, 512, 512) RGB in [-1, 1]
    with torch.inference_mode():
        bottleneck, skips, style_codes = random_model.encode(faces)
    assert bottleneck.shape == (2, 256, 4, 4)
    assert [tuple(skip.shape[1:]) for skip in skips] == [
        (256, 4, 4), (256, 8, 8), (256, 16, 16), (256, 32, 32), (256, 64, 64), (128, 128, 128), (64, 256, 256)]
    assert style_codes.shape == (2, 16, 512) and torch.isfinite(style_codes).all()
    assert relative_error(style_codes[1], style_codes[0]) > 1e-3  # each face its own codes


def test_one_switch_sets_the_form_of_every_modulated_conv():
    model = meta_model()
    modulated_convs = [module for module in model.modules() if isinstance(module, ModulatedConv2d)]
    assert len(modulated_convs) == 23  # 4x4 conv and ToRGB, then two convs and a ToRGB per size 8 ... 512
    assert all(conv.fused for conv in modulated_convs)  # the shared-weight form by default
    assert model.set_fused_modulation(False) is model
    assert not any(conv.fused for conv in modulated_convs)
    model.set_fused_modulation(True)
    assert all(conv.fused for conv in modulated_convs)


def test_wrong_input_size_is_refused():
    with pytest.raises(ValueError, match=r"\(B, 3, 512, 512\)"):
        meta_model()(torch.zeros(1, 3, 256, 256, device="meta"))


@pytest.mark.parametrize("shape", [(2, 3, 8, 8), (1, 16, 7, 9), (2, 32, 1, 3), (1, 16, 1, 1)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_bilinear_resizes_equal_torch_interpolation(shape, channels_last):
    from heygem.models.gfpgan import double_size, resize_bilinear

    features = torch.randn(shape, dtype=torch.float64)
    if channels_last:
        features = features.to(memory_format=torch.channels_last)
    factors = (2, 0.5) if shape[2] % 2 == 0 and shape[3] % 2 == 0 else (2,)
    for factor in factors:
        expected = torch.nn.functional.interpolate(features, scale_factor=factor, mode="bilinear",
                                                   align_corners=False)
        resized = resize_bilinear(features, factor)
        assert resized.shape == expected.shape
        torch.testing.assert_close(resized, expected, rtol=0, atol=1e-12)
    doubled = double_size(features)
    torch.testing.assert_close(doubled, torch.nn.functional.interpolate(
        features, scale_factor=2, mode="bilinear", align_corners=False), rtol=0, atol=1e-12)
    if channels_last:
        assert doubled.is_contiguous(memory_format=torch.channels_last)
