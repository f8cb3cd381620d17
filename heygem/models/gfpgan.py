"""The GFPGAN v1.4 face restorer ("clean" layout), laid out so the public checkpoint loads unchanged.

The state dict of :class:`GFPGANClean` has exactly the 285 key names and shapes of
``params_ema`` in the released ``GFPGANv1.4.pth``. Inference only. No custom CUDA
ops: every resampling is bilinear interpolation.

Data flow for a batch of B aligned faces::

    faces          (B, 3, 512, 512)  RGB in [-1, 1]
    encoder        seven residual blocks halve 512 -> 4; the 4x4 map (256 ch) becomes
                   16 style codes of 512 (one per decoder layer) through one linear layer
    U-Net up path  seven residual blocks double 4 -> 512, adding the encoder map of the
                   same size first; at each size two small conv nets turn the map into
                   a per-pixel scale and shift (the spatial feature transform)
    decoder        a StyleGAN2 generator from a learned 4x4 constant up to 512x512; after
                   the first (upsampling) conv of each size, the second half of its
                   channels is multiplied by the scale and offset by the shift
    output         (B, 3, 512, 512)  RGB, nominally [-1, 1] (not clamped)

The modulated convolution runs in one of two equal forms, chosen by
``GFPGANClean.set_fused_modulation``: per-sample weights as one grouped convolution, or
(the default) input channels scaled by the style, one convolution shared by the whole
batch and output channels scaled by the demodulation factors.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

FACE_SIZE = 512
STYLE_SIZE = 512
LEAKY_SLOPE = 0.2
DEMODULATION_EPS = 1e-8

# Channels per feature-map size. The U-Net side runs at half the width of StyleGAN2's
# default widths (channel multiplier 2), which the decoder uses unchanged.
ENCODER_CHANNELS = {4: 256, 8: 256, 16: 256, 32: 256, 64: 256, 128: 128, 256: 64, 512: 32}
DECODER_CHANNELS = {4: 512, 8: 512, 16: 512, 32: 512, 64: 512, 128: 256, 256: 128, 512: 64}
SIZES = [2 ** level for level in range(3, 10)]  # 8 ... 512: the sizes reached by up-steps
STYLE_MLP_LAYERS = 8  # kept for checkpoint compatibility; the encoder's codes are used as-is


def resize_bilinear(features: torch.Tensor, factor: float) -> torch.Tensor:
    """Bilinear resize by 2 or 0.5 (half-pixel centres, no antialiasing), as F.interpolate does it.

    Halving with half-pixel centres averages each 2x2 block, which average pooling does faster.
    Doubling a channels_last map (the GPU path) is written out: the general interpolation kernel
    is slow on that layout (on the H200 in fp16 it took a third of GFPGAN's time); see double_size.
    """
    if factor == 0.5 and features.shape[-2] % 2 == 0 and features.shape[-1] % 2 == 0:
        return F.avg_pool2d(features, 2)
    if (factor == 2 and features.dim() == 4 and features.shape[1] >= 16
            and features.is_contiguous(memory_format=torch.channels_last)):
        return double_size(features)
    return F.interpolate(features, scale_factor=factor, mode="bilinear", align_corners=False)


def double_size(features: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, C, 2H, 2W), bilinear with half-pixel centres, in the input's memory format.

    Along each axis, output 2i takes 3/4 of input i and 1/4 of input i - 1, output 2i + 1 takes
    3/4 of input i and 1/4 of input i + 1; the first and last outputs repeat the edge. Each
    output is written once, straight into its place.
    """
    memory_format = torch.channels_last if features.is_contiguous(memory_format=torch.channels_last) \
        else torch.contiguous_format
    batch, channels, height, width = features.shape
    rows = torch.empty((batch, channels, 2 * height, width), dtype=features.dtype, device=features.device,
                       memory_format=memory_format)
    _double_into(features, rows, axis=2)
    out = torch.empty((batch, channels, 2 * height, 2 * width), dtype=features.dtype, device=features.device,
                      memory_format=memory_format)
    _double_into(rows, out, axis=3)
    return out


def _double_into(source: torch.Tensor, target: torch.Tensor, axis: int) -> None:
    size = source.shape[axis]
    target.narrow(axis, 0, 1).copy_(source.narrow(axis, 0, 1))
    target.narrow(axis, 2 * size - 1, 1).copy_(source.narrow(axis, size - 1, 1))
    if size > 1:
        head, tail = source.narrow(axis, 0, size - 1), source.narrow(axis, 1, size - 1)
        evens = target.narrow(axis, 2, 2 * size - 2).unfold(axis, 1, 2).squeeze(-1)  # outputs 2, 4, ...
        odds = target.narrow(axis, 1, 2 * size - 2).unfold(axis, 1, 2).squeeze(-1)  # outputs 1, 3, ...
        torch.lerp(tail, head, 0.25, out=evens)
        torch.lerp(head, tail, 0.25, out=odds)


class ResampleBlock(nn.Module):
    """Residual block that halves (``factor`` 0.5) or doubles (2) the map.

    Main path: 3x3 conv, leaky ReLU, resize, 3x3 conv to the new width, leaky ReLU.
    Skip path: resize, 1x1 conv without bias. The two are summed.
    """

    def __init__(self, in_channels: int, out_channels: int, factor: float):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, in_channels, 3, 1, 1)
        self.conv2 = nn.Conv2d(in_channels, out_channels, 3, 1, 1)
        self.skip = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.factor = factor

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # (B, C_in, H, W) -> (B, C_out, H * factor, W * factor)
        main = F.leaky_relu(self.conv1(features), LEAKY_SLOPE)
        main = F.leaky_relu(self.conv2(resize_bilinear(main, self.factor)), LEAKY_SLOPE)
        return main + self.skip(resize_bilinear(features, self.factor))


class ModulatedConv2d(nn.Module):
    """StyleGAN2's convolution whose input channels are scaled per sample by a style.

    ``weight`` is stored as (1, C_out, C_in, k, k) and already includes the 1/sqrt(fan_in)
    gain, so it is used as is. With ``demodulate`` each output channel's effective weight
    is rescaled to unit norm. With ``upsample`` the input is first doubled bilinearly.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, demodulate: bool,
                 upsample: bool = False):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.demodulate = demodulate
        self.upsample = upsample
        self.padding = kernel_size // 2
        self.fused = True
        self.modulation = nn.Linear(STYLE_SIZE, in_channels)
        fan_in = in_channels * kernel_size ** 2
        self.weight = nn.Parameter(
            torch.randn(1, out_channels, in_channels, kernel_size, kernel_size) / math.sqrt(fan_in))
        nn.init.kaiming_normal_(self.modulation.weight, a=0, mode="fan_in", nonlinearity="linear")
        nn.init.ones_(self.modulation.bias)  # styles start at 1: the plain convolution

    def forward(self, features: torch.Tensor, style_code: torch.Tensor) -> torch.Tensor:
        # features (B, C_in, H, W), style_code (B, 512) -> (B, C_out, H', W') with H' = 2H when upsampling
        out, factors = self.convolve(features, style_code)
        return out if factors is None else out * factors[:, :, None, None]

    def convolve(self, features: torch.Tensor, style_code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The convolution, and the per-sample output-channel factors (B, C_out) still to be applied to it
        (the demodulation of the shared-weight form; None when nothing is left to apply), so that a caller
        can fold them into its own next step."""
        styles = self.modulation(style_code)  # (B, C_in)
        if self.upsample:
            features = resize_bilinear(features, 2)
        if not self.fused:
            return self.forward_grouped(features, styles), None
        return self._shared_weight(features, styles)

    def _shared_weight(self, features: torch.Tensor, styles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared-weight convolution and its output factors, (B, C_out) or (B, 1).

        The styles are divided by their largest magnitude first and that peak goes into the factors
        (the demodulation does not change; without it the peak multiplies the output): the same
        function, but in fp16 neither the scaled input nor the sum of squared styles can overflow
        (a style of 300 squared is already past fp16's 65,504).
        """
        peak = styles.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(styles.dtype).tiny)  # (B, 1)
        unit_styles = styles / peak  # (B, C_in), each at most 1 in magnitude
        out = F.conv2d(features * unit_styles[:, :, None, None], self.weight[0], padding=self.padding)
        if not self.demodulate:
            return out, peak
        weight_energy = self.weight[0].pow(2).sum(dim=(2, 3))  # (C_out, C_in)
        # 1 / sqrt(sum_i s_i^2 |W_o,i|^2 + eps) * peak = 1 / sqrt(sum_i u_i^2 |W_o,i|^2 + eps / peak^2)
        eps = DEMODULATION_EPS / peak.float().square()  # in fp32: peak^2 may overflow fp16
        return out, torch.rsqrt((unit_styles.pow(2) @ weight_energy.t()).float() + eps).to(out.dtype)

    def forward_grouped(self, features: torch.Tensor, styles: torch.Tensor) -> torch.Tensor:
        """One weight per sample, run as a convolution with B groups."""
        batch, _, height, width = features.shape
        weight = self.weight * styles.view(batch, 1, self.in_channels, 1, 1)  # (B, C_out, C_in, k, k)
        if self.demodulate:
            norm = torch.rsqrt(weight.pow(2).sum(dim=(2, 3, 4)) + DEMODULATION_EPS)  # (B, C_out)
            weight = weight * norm.view(batch, self.out_channels, 1, 1, 1)
        weight = weight.reshape(batch * self.out_channels, self.in_channels, *weight.shape[3:])
        out = F.conv2d(features.reshape(1, batch * self.in_channels, height, width), weight,
                       padding=self.padding, groups=batch)  # (1, B * C_out, H, W)
        return out.view(batch, self.out_channels, height, width)

    def forward_fused(self, features: torch.Tensor, styles: torch.Tensor) -> torch.Tensor:
        """The same function with one weight for the whole batch.

        conv(x, W * s) = conv(x * s, W) because the style scales input channels, and the
        demodulation factor of output channel o is 1 / sqrt(sum_i s_i^2 * |W_o,i|^2 + eps).
        """
        out, factors = self._shared_weight(features, styles)  # (B, C_out, H, W), (B, C_out) or (B, 1)
        return out * factors[:, :, None, None]


class StyleConv(nn.Module):
    """Modulated 3x3 conv, gain sqrt(2), scaled noise, bias and leaky ReLU."""

    def __init__(self, in_channels: int, out_channels: int, upsample: bool):
        super().__init__()
        self.modulated_conv = ModulatedConv2d(in_channels, out_channels, 3, demodulate=True, upsample=upsample)
        self.weight = nn.Parameter(torch.zeros(1))  # strength of the added noise
        self.bias = nn.Parameter(torch.zeros(1, out_channels, 1, 1))

    def forward(self, features: torch.Tensor, style_code: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        # noise: (1 or B, 1, H', W'), or None for fresh Gaussian noise
        out, factors = self.modulated_conv.convolve(features, style_code)  # (B, C_out, H', W'), (B, C_out) or None
        gain = math.sqrt(2) if factors is None else (factors * math.sqrt(2))[:, :, None, None]
        if noise is None:
            noise = out.new_empty(out.shape[0], 1, *out.shape[2:]).normal_()
        offset = self.weight * noise + self.bias  # (1 or B, C_out, H', W'): the scaled noise plus the bias
        if out.requires_grad:
            return F.leaky_relu(torch.addcmul(offset, out, gain) if factors is not None else offset + gain * out,
                                LEAKY_SLOPE)
        # Without autograd: gain, noise and bias in one pass over the map, written in place (in the
        # map's own memory format), then the activation in place: the map is read and written twice
        # instead of six times, which is what a memory-bound network at 512x512 pays for.
        if factors is None:
            torch.add(offset, out, alpha=gain, out=out)
        else:
            torch.addcmul(offset, out, gain, out=out)
        return F.leaky_relu(out, LEAKY_SLOPE, inplace=True)


class ToRGB(nn.Module):
    """Modulated 1x1 conv to RGB (not demodulated) plus bias, added to the doubled previous RGB."""

    def __init__(self, in_channels: int, upsample_previous: bool):
        super().__init__()
        self.modulated_conv = ModulatedConv2d(in_channels, 3, 1, demodulate=False)
        self.bias = nn.Parameter(torch.zeros(1, 3, 1, 1))
        self.upsample_previous = upsample_previous

    def forward(self, features: torch.Tensor, style_code: torch.Tensor,
                previous_rgb: torch.Tensor | None = None) -> torch.Tensor:
        rgb = self.modulated_conv(features, style_code) + self.bias  # (B, 3, H, W)
        if previous_rgb is not None:
            if self.upsample_previous:
                previous_rgb = resize_bilinear(previous_rgb, 2)
            rgb = rgb + previous_rgb
        return rgb


class ConstantInput(nn.Module):
    """The decoder's learned 4x4 starting map, shared by every sample."""

    def __init__(self, channels: int, size: int = 4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, channels, size, size))

    def forward(self, batch: int) -> torch.Tensor:
        return self.weight.expand(batch, -1, -1, -1)  # (B, C, 4, 4)


class NormalizeStyle(nn.Module):
    """Scale each style code to unit root-mean-square (first step of the unused mapping network)."""

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return codes * torch.rsqrt(codes.pow(2).mean(dim=1, keepdim=True) + 1e-8)


class StyleDecoder(nn.Module):
    """StyleGAN2 generator 4 -> 512 whose first-of-size conv outputs take a spatial scale and shift."""

    def __init__(self):
        super().__init__()
        mapping = [NormalizeStyle()]
        for _ in range(STYLE_MLP_LAYERS):
            mapping += [nn.Linear(STYLE_SIZE, STYLE_SIZE), nn.LeakyReLU(LEAKY_SLOPE)]
        self.style_mlp = nn.Sequential(*mapping)
        self.constant_input = ConstantInput(DECODER_CHANNELS[4])
        self.style_conv1 = StyleConv(DECODER_CHANNELS[4], DECODER_CHANNELS[4], upsample=False)
        self.to_rgb1 = ToRGB(DECODER_CHANNELS[4], upsample_previous=False)
        self.style_convs = nn.ModuleList()
        self.to_rgbs = nn.ModuleList()
        in_channels = DECODER_CHANNELS[4]
        for size in SIZES:
            out_channels = DECODER_CHANNELS[size]
            self.style_convs.append(StyleConv(in_channels, out_channels, upsample=True))
            self.style_convs.append(StyleConv(out_channels, out_channels, upsample=False))
            self.to_rgbs.append(ToRGB(out_channels, upsample_previous=True))
            in_channels = out_channels
        # Fixed noise maps, one per StyleConv: noise0 at 4x4, then two per size 8 ... 512.
        self.noises = nn.Module()
        noise_sizes = [4] + [size for size in SIZES for _ in range(2)]
        for index, size in enumerate(noise_sizes):
            self.noises.register_buffer(f"noise{index}", torch.randn(1, 1, size, size))
        self.layer_count = len(noise_sizes)  # 15

    def forward(self, style_codes: torch.Tensor, conditions: list[tuple[torch.Tensor, torch.Tensor]],
                randomize_noise: bool) -> torch.Tensor:
        """RGB (B, 3, S, S) where S = 4 * 2 ** len(conditions): 512 with all seven levels.

        style_codes (B, 16, 512): code 0 drives the 4x4 conv; the ToRGB of one size shares a code
        with the upsampling conv of the next (1, 3, ..., 13), the second conv of each size takes
        the code after it (2, 4, ..., 14) and the last ToRGB takes 15.
        conditions: (scale, shift) for sizes 8, 16, ..., each (B, C_dec / 2, size, size).
        Fewer levels stop the decoder at a smaller size.
        """
        if randomize_noise:
            noises = [None] * self.layer_count
        else:
            noises = [getattr(self.noises, f"noise{index}") for index in range(self.layer_count)]
        features = self.constant_input(style_codes.shape[0])
        features = self.style_conv1(features, style_codes[:, 0], noises[0])
        rgb = self.to_rgb1(features, style_codes[:, 1])
        for level, (scale, shift) in enumerate(conditions):
            code_index = 2 * level + 1
            features = self.style_convs[2 * level](features, style_codes[:, code_index], noises[code_index])
            kept, modulated = features.chunk(2, dim=1)  # views: the second half takes the spatial scale and shift
            if features.requires_grad:
                features = torch.cat([kept, modulated * scale + shift], dim=1)
            else:
                torch.addcmul(shift, modulated, scale, out=modulated)  # in place, no copy of the first half
            features = self.style_convs[2 * level + 1](features, style_codes[:, code_index + 1],
                                                       noises[code_index + 1])
            rgb = self.to_rgbs[level](features, style_codes[:, code_index + 2], rgb)
        return rgb  # (B, 3, S, S)


def condition_net(channels: int) -> nn.Sequential:
    """Two 3x3 convs with a leaky ReLU between: U-Net features -> per-pixel scale or shift."""
    return nn.Sequential(nn.Conv2d(channels, channels, 3, 1, 1), nn.LeakyReLU(LEAKY_SLOPE),
                         nn.Conv2d(channels, channels, 3, 1, 1))


class GFPGANClean(nn.Module):
    """GFPGAN v1.4: (B, 3, 512, 512) RGB faces in [-1, 1] -> restored faces, same layout.

    Noise is the checkpoint's fixed noise unless ``randomize_noise`` is set, so the
    output is deterministic by default.
    """

    def __init__(self, randomize_noise: bool = False):
        super().__init__()
        self.randomize_noise = randomize_noise
        self.conv_body_first = nn.Conv2d(3, ENCODER_CHANNELS[512], 1)
        self.conv_body_down = nn.ModuleList(
            ResampleBlock(ENCODER_CHANNELS[size], ENCODER_CHANNELS[size // 2], 0.5) for size in reversed(SIZES))
        self.final_conv = nn.Conv2d(ENCODER_CHANNELS[4], ENCODER_CHANNELS[4], 3, 1, 1)
        self.conv_body_up = nn.ModuleList(
            ResampleBlock(ENCODER_CHANNELS[size // 2], ENCODER_CHANNELS[size], 2) for size in SIZES)
        # Low-resolution RGB previews used only in training; kept for checkpoint compatibility.
        self.toRGB = nn.ModuleList(nn.Conv2d(ENCODER_CHANNELS[size], 3, 1) for size in SIZES)
        self.style_code_count = 2 * int(math.log2(FACE_SIZE)) - 2  # 16
        self.final_linear = nn.Linear(ENCODER_CHANNELS[4] * 4 * 4, self.style_code_count * STYLE_SIZE)
        self.stylegan_decoder = StyleDecoder()
        self.condition_scale = nn.ModuleList(condition_net(ENCODER_CHANNELS[size]) for size in SIZES)
        self.condition_shift = nn.ModuleList(condition_net(ENCODER_CHANNELS[size]) for size in SIZES)

    def set_fused_modulation(self, enabled: bool) -> GFPGANClean:
        """Run every modulated conv in the shared-weight form (True) or the grouped form (False)."""
        for module in self.modules():
            if isinstance(module, ModulatedConv2d):
                module.fused = enabled
        return self

    def encode(self, faces: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The 4x4 bottleneck (B, 256, 4, 4), the encoder maps 4x4 ... 256x256 and the style codes (B, 16, 512)."""
        features = F.leaky_relu(self.conv_body_first(faces), LEAKY_SLOPE)  # (B, 32, 512, 512)
        skips = []
        for block in self.conv_body_down:
            features = block(features)
            skips.insert(0, features)  # smallest first
        features = F.leaky_relu(self.final_conv(features), LEAKY_SLOPE)  # (B, 256, 4, 4)
        style_codes = self.final_linear(features.flatten(1)).view(-1, self.style_code_count, STYLE_SIZE)
        return features, skips, style_codes

    def conditions(self, bottleneck: torch.Tensor,
                   skips: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The U-Net up path: (scale, shift) per size 8 ... 512, each (B, C_enc, size, size)."""
        features = bottleneck
        pairs = []
        for level, skip in enumerate(skips):
            features = self.conv_body_up[level](features + skip)
            pairs.append((self.condition_scale[level](features), self.condition_shift[level](features)))
        return pairs

    def forward(self, faces: torch.Tensor, randomize_noise: bool | None = None) -> torch.Tensor:
        # faces (B, 3, 512, 512) RGB in [-1, 1] -> (B, 3, 512, 512) RGB
        if faces.dim() != 4 or tuple(faces.shape[1:]) != (3, FACE_SIZE, FACE_SIZE):
            raise ValueError(f"GFPGAN takes (B, 3, {FACE_SIZE}, {FACE_SIZE}) faces, got {tuple(faces.shape)}")
        bottleneck, skips, style_codes = self.encode(faces)
        conditions = self.conditions(bottleneck, skips)
        if randomize_noise is None:
            randomize_noise = self.randomize_noise
        return self.stylegan_decoder(style_codes, conditions, randomize_noise)


