"""MuseTalk's model step (heygem.engines.musetalk.model_step) against the plain diffusers calls, on the CPU, with
reduced configs of the same diffusers classes (random weights): fast and plain steps agree, the last short batch
is padded and dropped, decoding only the pasted rows keeps the pasted pixels, and encoding takes the mean."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from heygem.engines.musetalk.model_step import (
    MouthModelStep,
    encode_faces,
    first_decoded_latent_row,
)


def tiny_unet():
    """MuseTalk's UNet layout (8 in, 4 out, cross-attention on 384-wide audio features), much narrower."""
    torch.manual_seed(1)
    return diffusers.UNet2DConditionModel(
        sample_size=32, in_channels=8, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=384, attention_head_dim=8, norm_num_groups=8)


def tiny_vae():
    """sd-vae-ft-mse's layout (four blocks: 8x upsampling, 4 latent channels), much narrower."""
    torch.manual_seed(2)
    blocks = 4
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * blocks, up_block_types=("UpDecoderBlock2D",) * blocks,
        norm_num_groups=4, sample_size=256, scaling_factor=0.18215)


def plain_step(unet, vae, latents, audio):
    """The public code's calls: UNet at t = 0, / scaling factor, decode, to [0, 1]."""
    with torch.inference_mode():
        predicted = unet(latents, torch.tensor([0]), encoder_hidden_states=audio).sample
        faces = vae.decode(predicted / vae.config.scaling_factor).sample
        return (faces / 2 + 0.5).clamp(0, 1)


def inputs(count, seed):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(count, 8, 32, 32, generator=generator)  # (N, 8, 32, 32)
    audio = torch.randn(count, 50, 384, generator=generator)  # (N, 50, 384)
    return latents, audio


@pytest.fixture(scope="module")
def networks():
    return tiny_unet().eval(), tiny_vae().eval()


def test_fast_step_equals_plain_calls_with_a_padded_last_batch(networks):
    unet, vae = networks
    latents, audio = inputs(5, seed=3)
    expected = plain_step(unet, vae, latents, audio)  # (5, 3, 256, 256)
    assert expected.std() > 1e-3  # the random network's output is not flat
    fast = MouthModelStep(unet, vae, "cpu", torch.float32, batch_size=3, fast=True, pad_last_batch=True)
    got = fast(latents, audio)  # batches of 3: the second holds 2 faces and 1 padding row
    assert got.shape == (5, 3, 256, 256) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max() < 1e-4
    # each face depends on its own inputs only: the padding row did not leak into the result
    alone = fast(latents[4:], audio[4:])
    assert (alone[0] - expected[4]).abs().max() < 1e-4
    plain = MouthModelStep(unet, vae, "cpu", torch.float32, batch_size=2, fast=False)
    assert (plain(latents, audio) - expected).abs().max() < 1e-4  # other batch sizes: other rounding
    assert fast.batch_size == 3


def test_transposed_upsampling_is_the_same_function(networks):
    unet, vae = networks
    latents, audio = inputs(2, seed=8)
    expected = plain_step(unet, vae, latents, audio)
    step = MouthModelStep(copy.deepcopy(unet), copy.deepcopy(vae), "cpu", torch.float32, batch_size=2,
                          transposed_upsampling=True)
    replaced = [module for module in step.network.modules() if type(module).__name__ == "NearestUpsampleConv"]
    assert len(replaced) == 3 + 1  # the VAE decoder's three upsamplers and the reduced UNet's one
    assert (step(latents, audio) - expected).abs().max() < 1e-4


@pytest.mark.parametrize("fast", [True, False])
def test_out_of_memory_halves_the_batch(networks, fast):
    unet, vae = networks
    latents, audio = inputs(3, seed=9)
    expected = plain_step(unet, vae, latents, audio)
    step = MouthModelStep(unet, vae, "cpu", torch.float32, batch_size=4, fast=fast)
    forward = step.network.forward
    seen = []

    def forward_that_fits_two(unet_input_latents, audio_features):
        seen.append(len(unet_input_latents))
        if len(unet_input_latents) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(unet_input_latents, audio_features)

    step.network.forward = forward_that_fits_two
    got = step(latents, audio)
    assert step.batch_size == 2 and seen[0] == 3 and max(seen[1:]) <= 2  # 3 at once did not fit, then 2 + 1
    assert (got - expected).abs().max() < 1e-4


def test_the_step_leaves_the_backend_flags_alone(networks):
    unet, vae = networks
    before = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
              torch.are_deterministic_algorithms_enabled())
    MouthModelStep(unet, vae, "cpu", torch.float32, batch_size=2)(*inputs(1, seed=4))
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
            torch.are_deterministic_algorithms_enabled()) == before


def test_decoding_only_the_pasted_rows_keeps_the_pasted_pixels(networks):
    unet, vae = networks
    latents, audio = inputs(2, seed=5)
    full = plain_step(unet, vae, latents, audio)  # (2, 3, 256, 256)
    paste_top_row = 112  # the paste mask's first row in the 256x256 face
    halo = 4
    first_row = first_decoded_latent_row(paste_top_row, halo)
    assert first_row == 112 // 8 - halo
    cropped = MouthModelStep(unet, vae, "cpu", torch.float32, batch_size=2, paste_top_row=paste_top_row,
                             halo_latent_rows=halo)(latents, audio)
    assert cropped.shape == full.shape
    assert (cropped[:, :, :first_row * 8] == 0).all()  # not decoded
    pasted_difference = (cropped[:, :, paste_top_row:] - full[:, :, paste_top_row:]).abs()
    # the decoder's group norms see the decoded rows only: close, not equal (bench_musetalk.py measures the
    # full-size VAE); with no halo at all the rows next to the cut differ more
    assert pasted_difference.mean() < 0.02
    no_halo = MouthModelStep(unet, vae, "cpu", torch.float32, batch_size=2, paste_top_row=paste_top_row,
                             halo_latent_rows=0)(latents, audio)
    edge = slice(paste_top_row, paste_top_row + 8)
    assert ((no_halo[:, :, edge] - full[:, :, edge]).abs().mean()
            > (cropped[:, :, edge] - full[:, :, edge]).abs().mean())
    with pytest.raises(ValueError):
        first_decoded_latent_row(256, halo)


def test_encode_faces_takes_the_scaled_mean(networks):
    _, vae = networks
    faces = torch.rand(2, 3, 256, 256, generator=torch.Generator().manual_seed(6)) * 2 - 1  # (2, 3, 256, 256)
    latents = encode_faces(vae, faces)
    assert latents.shape == (2, 4, 32, 32)
    with torch.inference_mode():
        mean = vae.encode(faces).latent_dist.mean * 0.18215
    assert (latents - mean).abs().max() < 1e-6
    drawn = encode_faces(vae, faces, sample=True, generator=torch.Generator().manual_seed(7))
    assert 0 < (drawn - latents).abs().max()


def test_a_compiled_step_that_cannot_compile_runs_op_by_op_with_one_warning(networks, monkeypatch, caplog):
    # torch.compile fails where the machine lacks what the compiler needs (a C compiler, triton): the step says
    # so once and runs op by op, the same faces as a step never compiled; the job does not fail
    class CannotCompile(torch.nn.Module):
        def forward(self, *inputs):
            raise RuntimeError("compiler not found")  # as torch._inductor raises it, wrapped

    monkeypatch.setattr(torch, "compile", lambda module, *args, **kwargs: CannotCompile())
    unet, vae = networks
    latents, audio = inputs(3, seed=5)
    eager = MouthModelStep(copy.deepcopy(unet), copy.deepcopy(vae), "cpu", torch.float32, 2, fast=True)
    compiled = MouthModelStep(copy.deepcopy(unet), copy.deepcopy(vae), "cpu", torch.float32, 2, fast=True,
                              compile_network=True)
    with caplog.at_level("WARNING", logger="heygem"):
        faces = compiled(latents, audio)
        again = compiled(latents, audio)
    assert torch.equal(faces, eager(latents, audio)) and torch.equal(again, faces)
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "compiler not found" in warnings[0] and "op by op" in warnings[0]
