"""The Wav2Lip generator, laid out so the public checkpoints load unchanged.

The state dict of :class:`Wav2Lip` has exactly the key names and shapes of the
released ``wav2lip.pth`` and ``wav2lip_gan.pth`` files (the GAN variant differs
only in its trained values). Inference only: no discriminator, no training code.

Data flow for a batch of B faces::

    faces       (B, 6, 96, 96)  BGR in [0, 1]; channels 0-2 the target crop with
                                rows 48: zeroed, channels 3-5 an unmasked reference crop
    mel_windows (B, 1, 80, 16)  Wav2Lip-normalised log-mel, 16 mel frames (0.2 s)
    output      (B, 3, 96, 96)  BGR in [0, 1], the whole crop with a new mouth

The face encoder halves the crop six times down to a 512-channel 1x1 code, the
audio encoder squeezes the mel window to the same 1x1 code, and the decoder
upsamples the audio code back to 96x96, concatenating the face encoder's output
of matching size before each step (U-Net skip connections).
"""

from __future__ import annotations

import torch
from torch import nn


class ConvUnit(nn.Module):
    """Conv2d, BatchNorm2d and ReLU; with ``residual`` the input is added before the ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride=1, padding=1,
                 residual: bool = False):
        super().__init__()
        if residual and (in_channels != out_channels or stride != 1):
            raise ValueError("a residual unit must keep the channel count and the spatial size")
        self.conv_block = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding),
            nn.BatchNorm2d(out_channels),
        )
        self.activation = nn.ReLU(inplace=True)
        self.residual = residual

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = self.conv_block(inputs)
        if self.residual:
            outputs = outputs + inputs
        return self.activation(outputs)


class TransposedConvUnit(nn.Module):
    """ConvTranspose2d, BatchNorm2d and ReLU: the decoder's upsampling step."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, padding: int, output_padding: int):
        super().__init__()
        self.conv_block = nn.Sequential(
            nn.ConvTranspose2d(in_channels, out_channels, 3, stride, padding, output_padding),
            nn.BatchNorm2d(out_channels),
        )
        self.activation = nn.ReLU(inplace=True)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.activation(self.conv_block(inputs))


def residual_units(channels: int, count: int) -> list[ConvUnit]:
    """``count`` 3x3 residual units that keep ``channels`` and the spatial size."""
    return [ConvUnit(channels, channels, 3, residual=True) for _ in range(count)]


def build_face_encoder() -> nn.ModuleList:
    """Seven blocks taking the 6-channel 96x96 crop down to 512x1x1.

    Each block's output is kept for the decoder's skip connections.
    """
    return nn.ModuleList([
        nn.Sequential(ConvUnit(6, 16, 7, padding=3)),  # -> (16, 96, 96)
        nn.Sequential(ConvUnit(16, 32, 3, stride=2), *residual_units(32, 2)),  # -> (32, 48, 48)
        nn.Sequential(ConvUnit(32, 64, 3, stride=2), *residual_units(64, 3)),  # -> (64, 24, 24)
        nn.Sequential(ConvUnit(64, 128, 3, stride=2), *residual_units(128, 2)),  # -> (128, 12, 12)
        nn.Sequential(ConvUnit(128, 256, 3, stride=2), *residual_units(256, 2)),  # -> (256, 6, 6)
        nn.Sequential(ConvUnit(256, 512, 3, stride=2), *residual_units(512, 1)),  # -> (512, 3, 3)
        nn.Sequential(ConvUnit(512, 512, 3, padding=0), ConvUnit(512, 512, 1, padding=0)),  # -> (512, 1, 1)
    ])


def build_audio_encoder() -> nn.Sequential:
    """One flat stack taking a (1, 80, 16) mel window down to 512x1x1."""
    return nn.Sequential(
        ConvUnit(1, 32, 3), *residual_units(32, 2),  # -> (32, 80, 16)
        ConvUnit(32, 64, 3, stride=(3, 1)), *residual_units(64, 2),  # -> (64, 27, 16)
        ConvUnit(64, 128, 3, stride=3), *residual_units(128, 2),  # -> (128, 9, 6)
        ConvUnit(128, 256, 3, stride=(3, 2)), *residual_units(256, 1),  # -> (256, 3, 3)
        ConvUnit(256, 512, 3, padding=0),  # -> (512, 1, 1)
        ConvUnit(512, 512, 1, padding=0),  # -> (512, 1, 1)
    )


def build_face_decoder() -> nn.ModuleList:
    """Seven blocks from the 512x1x1 audio code back to 96x96.

    A block's input channels are the previous block's output plus the face
    encoder features of the same size that were concatenated to it.
    """
    return nn.ModuleList([
        nn.Sequential(ConvUnit(512, 512, 1, padding=0)),  # -> (512, 1, 1), + 512 skip = 1024
        nn.Sequential(TransposedConvUnit(1024, 512, stride=1, padding=0, output_padding=0),
                      *residual_units(512, 1)),  # -> (512, 3, 3), + 512 skip = 1024
        nn.Sequential(TransposedConvUnit(1024, 512, stride=2, padding=1, output_padding=1),
                      *residual_units(512, 2)),  # -> (512, 6, 6), + 256 skip = 768
        nn.Sequential(TransposedConvUnit(768, 384, stride=2, padding=1, output_padding=1),
                      *residual_units(384, 2)),  # -> (384, 12, 12), + 128 skip = 512
        nn.Sequential(TransposedConvUnit(512, 256, stride=2, padding=1, output_padding=1),
                      *residual_units(256, 2)),  # -> (256, 24, 24), + 64 skip = 320
        nn.Sequential(TransposedConvUnit(320, 128, stride=2, padding=1, output_padding=1),
                      *residual_units(128, 2)),  # -> (128, 48, 48), + 32 skip = 160
        nn.Sequential(TransposedConvUnit(160, 64, stride=2, padding=1, output_padding=1),
                      *residual_units(64, 2)),  # -> (64, 96, 96), + 16 skip = 80
    ])


class Wav2Lip(nn.Module):
    """The Wav2Lip generator: a masked face crop plus a mel window in, a lip-synced crop out."""

    face_size = 96  # crops are square, this many pixels a side
    mel_window_frames = 16  # mel frames per window (0.2 s at 80 mel frames per second)

    def __init__(self):
        super().__init__()
        self.face_encoder_blocks = build_face_encoder()
        self.audio_encoder = build_audio_encoder()
        self.face_decoder_blocks = build_face_decoder()
        self.output_block = nn.Sequential(
            ConvUnit(80, 32, 3),  # (B, 32, 96, 96)
            nn.Conv2d(32, 3, kernel_size=1),  # (B, 3, 96, 96)
            nn.Sigmoid(),
        )

    def forward(self, mel_windows: torch.Tensor, faces: torch.Tensor) -> torch.Tensor:
        """Generate crops; the argument order is the public model's (audio first).

        mel_windows: (B, 1, 80, 16); faces: (B, 6, 96, 96) BGR in [0, 1], see the module docstring.
        Returns (B, 3, 96, 96) BGR in [0, 1].
        """
        if faces.dim() != 4 or faces.shape[1:] != (6, self.face_size, self.face_size):
            raise ValueError(f"faces must be (B, 6, 96, 96), got {tuple(faces.shape)}")
        if mel_windows.dim() != 4 or mel_windows.shape[1:] != (1, 80, self.mel_window_frames):
            raise ValueError(f"mel_windows must be (B, 1, 80, 16), got {tuple(mel_windows.shape)}")
        if mel_windows.shape[0] != faces.shape[0]:
            raise ValueError(f"{mel_windows.shape[0]} mel windows for {faces.shape[0]} faces")

        audio_code = self.audio_encoder(mel_windows)  # (B, 512, 1, 1)

        face_features = []  # sizes 96, 48, 24, 12, 6, 3, 1
        features = faces
        for block in self.face_encoder_blocks:
            features = block(features)
            face_features.append(features)

        features = audio_code
        for block, skip in zip(self.face_decoder_blocks, reversed(face_features)):
            features = torch.cat((block(features), skip), dim=1)  # sizes 1, 3, 6, ..., 96
        return self.output_block(features)  # (B, 3, 96, 96)


def fold_batchnorm(model: nn.Module) -> nn.Module:
    """Fold every BatchNorm into the convolution before it, in place, for inference.

    The outputs stay the same (to float rounding) while each unit runs one
    operation instead of two. Call it after the checkpoint is loaded: the folded
    model no longer has the checkpoint's BatchNorm keys.
    """
    from torch.nn.utils.fusion import fuse_conv_bn_weights

    model.eval()
    for unit in model.modules():
        if isinstance(unit, (ConvUnit, TransposedConvUnit)) and isinstance(unit.conv_block[1], nn.BatchNorm2d):
            convolution, norm = unit.conv_block[0], unit.conv_block[1]
            # the convolution itself takes the folded weights (no copy of the module first)
            convolution.weight, convolution.bias = fuse_conv_bn_weights(
                convolution.weight, convolution.bias, norm.running_mean, norm.running_var, norm.eps, norm.weight,
                norm.bias, transpose=isinstance(unit, TransposedConvUnit))
            unit.conv_block = nn.Sequential(convolution)
    return model
