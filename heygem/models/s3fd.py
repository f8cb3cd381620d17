"""The S3FD face detector, laid out so the public ``s3fd.pth`` loads unchanged.

The state dict of :class:`S3FD` has exactly the 65 key names and shapes of the
released file. Inference only. Pre- and post-processing (mean subtraction,
anchors, box decoding, NMS) live in :mod:`heygem.face.s3fd`.

Data flow for a batch of B images of H x W pixels::

    images  (B, 3, H, W)  BGR, 0-255 minus the means (104, 117, 123), not divided by 255

A VGG16 trunk (conv1_1 .. conv5_3, a 2x2 max-pool after each block) continues
with fc6 (a 3x3 convolution to 1024 channels) and fc7 (1x1), then two extra
blocks (conv6_1/6_2 and conv7_1/7_2, each halving the size, rounding up). Six feature
maps, from stride 4 to stride 128, each get a 3x3 classification head (face /
background logits) and a 3x3 regression head (4 box offsets per cell, one
anchor per cell). The three VGG maps are L2-normalised across channels and
rescaled by learned per-channel factors first, since their magnitudes differ a
lot from the deeper maps.

The stride-4 classification head has four outputs: three background logits
and one face logit. The background logit used is their maximum ("max-out"),
which cuts false positives from the many small anchors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

# The names the public checkpoint gives the six detection maps' heads, finest (stride 4) first;
# the strides are 4, 8, 16, 32, 64 and 128 (heygem.face.s3fd.LEVEL_STRIDES).
LEVEL_NAMES = ("conv3_3_norm", "conv4_3_norm", "conv5_3_norm", "fc7", "conv6_2", "conv7_2")
LEVEL_CHANNELS = (256, 512, 512, 1024, 512, 256)

# (name, input channels, output channels) of the VGG16 trunk, a 2x2 max-pool after each group.
VGG_GROUPS = (
    (("conv1_1", 3, 64), ("conv1_2", 64, 64)),
    (("conv2_1", 64, 128), ("conv2_2", 128, 128)),
    (("conv3_1", 128, 256), ("conv3_2", 256, 256), ("conv3_3", 256, 256)),
    (("conv4_1", 256, 512), ("conv4_2", 512, 512), ("conv4_3", 512, 512)),
    (("conv5_1", 512, 512), ("conv5_2", 512, 512), ("conv5_3", 512, 512)),
)

# fc6 pads its 3x3 window by 3 pixels, not 1, without dilation: that is the layer the
# released weights were trained with (the published training definition had pad 3 there).
# The stride-32 map and the two after it are therefore 4 cells wider and taller than
# input / 32, and their outer anchors lie past the image; they rarely score.
FC6_PADDING = 3

MAXOUT_BACKGROUND_LOGITS = 3  # background logits of the stride-4 head, reduced by max


class ChannelL2Norm(nn.Module):
    """Scale each pixel's channel vector to unit length, then by a learned factor per channel."""

    def __init__(self, channels: int, initial_scale: float, eps: float = 1e-10):
        super().__init__()
        self.weight = nn.Parameter(torch.full((channels,), float(initial_scale)))
        self.eps = eps

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features (B, C, h, w); the sum of squares in fp32: 512 channels of activations in the
        # hundreds overflow fp16.
        norm = features.float().pow(2).sum(dim=1, keepdim=True).sqrt() + self.eps  # (B, 1, h, w)
        normalised = (features.float() / norm).to(features.dtype)
        return normalised * self.weight.view(1, -1, 1, 1).to(features.dtype)  # (B, C, h, w)


class S3FD(nn.Module):
    """S3FD: a BGR image in, per level a (face, background) logit pair and 4 box offsets per cell."""

    def __init__(self):
        super().__init__()
        for group in VGG_GROUPS:
            for name, in_channels, out_channels in group:
                self.add_module(name, nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1))
        self.fc6 = nn.Conv2d(512, 1024, kernel_size=3, padding=FC6_PADDING)
        self.fc7 = nn.Conv2d(1024, 1024, kernel_size=1)
        self.conv6_1 = nn.Conv2d(1024, 256, kernel_size=1)
        self.conv6_2 = nn.Conv2d(256, 512, kernel_size=3, stride=2, padding=1)
        self.conv7_1 = nn.Conv2d(512, 128, kernel_size=1)
        self.conv7_2 = nn.Conv2d(128, 256, kernel_size=3, stride=2, padding=1)

        # Initial scales as in the published model definition; the checkpoint overwrites them.
        self.conv3_3_norm = ChannelL2Norm(256, initial_scale=10)
        self.conv4_3_norm = ChannelL2Norm(512, initial_scale=8)
        self.conv5_3_norm = ChannelL2Norm(512, initial_scale=5)

        for index, (name, channels) in enumerate(zip(LEVEL_NAMES, LEVEL_CHANNELS)):
            class_count = 1 + MAXOUT_BACKGROUND_LOGITS if index == 0 else 2
            self.add_module(f"{name}_mbox_conf", nn.Conv2d(channels, class_count, kernel_size=3, padding=1))
            self.add_module(f"{name}_mbox_loc", nn.Conv2d(channels, 4, kernel_size=3, padding=1))

    def feature_maps(self, images: torch.Tensor) -> list[torch.Tensor]:
        """The six detection maps for ``images`` (B, 3, H, W), strides 4 .. 128, before the heads."""
        features = images
        vgg_outputs = []
        for group in VGG_GROUPS:
            for name, _, _ in group:
                features = functional.relu(getattr(self, name)(features))
            vgg_outputs.append(features)  # the group's last conv output, before pooling
            features = functional.max_pool2d(features, 2, 2)
        # features (B, 512, H/32, W/32), sizes rounded down
        fc7 = functional.relu(self.fc7(functional.relu(self.fc6(features))))  # (B, 1024, H/32 + 4, W/32 + 4)
        conv6_2 = functional.relu(self.conv6_2(functional.relu(self.conv6_1(fc7))))  # (B, 512, ~H/64 + 2, ...)
        conv7_2 = functional.relu(self.conv7_2(functional.relu(self.conv7_1(conv6_2))))  # (B, 256, ~H/128 + 1, ...)
        return [
            self.conv3_3_norm(vgg_outputs[2]),  # (B, 256, H/4, W/4)
            self.conv4_3_norm(vgg_outputs[3]),  # (B, 512, H/8, W/8)
            self.conv5_3_norm(vgg_outputs[4]),  # (B, 512, H/16, W/16)
            fc7, conv6_2, conv7_2,
        ]

    def forward(self, images: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per level, finest first: class logits (B, 2, h, w), [background, face], and offsets (B, 4, h, w).

        images: (B, 3, H, W) BGR minus the channel means, see the module docstring.
        """
        outputs = []
        for index, (name, features) in enumerate(zip(LEVEL_NAMES, self.feature_maps(images))):
            logits = getattr(self, f"{name}_mbox_conf")(features)  # (B, 4 or 2, h, w)
            if index == 0:
                background = logits[:, :MAXOUT_BACKGROUND_LOGITS].amax(dim=1, keepdim=True)  # (B, 1, h, w)
                logits = torch.cat([background, logits[:, MAXOUT_BACKGROUND_LOGITS:]], dim=1)  # (B, 2, h, w)
            offsets = getattr(self, f"{name}_mbox_loc")(features)  # (B, 4, h, w): dx, dy, dw, dh
            outputs.append((logits, offsets))
        return outputs
