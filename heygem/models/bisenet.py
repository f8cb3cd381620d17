"""BiSeNet face parsing (19 classes at the input's size), checkpoint-compatible with the public
79999_iter.pth that MuseTalk ships in face-parse-bisent/ (its ResNet-18 backbone included).

The network: a ResNet-18 backbone (its 1/8, 1/16 and 1/32 feature maps); the context path refines
the 1/32 and 1/16 maps with attention from their global average (attention refinement modules),
adds the global context, upsamples each to the next scale (nearest) and mixes it with a 3x3
convolution; the feature fusion module joins the backbone's 1/8 map with the context path's 1/8 map
and reweights the channels; a 3x3 + 1x1 head gives the class scores, upsampled bilinearly (corners
aligned) to the input's size. Only the main head's output is used for inference; the two auxiliary
heads exist so that the checkpoint's keys load strictly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 19  # background, skin, brows, eyes, glasses, ears, earring, nose, mouth, lips, neck, ...


class ConvNormReLU(nn.Module):
    """Convolution without bias, batch norm, ReLU (keys conv.*, bn.*)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with a shortcut (a strided 1x1 one where the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if in_channels != out_channels or stride != 1:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                            nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(shortcut + residual)


class ResNet18Features(nn.Module):
    """ResNet-18 without its classifier: the 1/8, 1/16 and 1/32 feature maps (128, 256, 512 channels)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(64, 64), BasicBlock(64, 64))
        self.layer2 = nn.Sequential(BasicBlock(64, 128, 2), BasicBlock(128, 128))
        self.layer3 = nn.Sequential(BasicBlock(128, 256, 2), BasicBlock(256, 256))
        self.layer4 = nn.Sequential(BasicBlock(256, 512, 2), BasicBlock(512, 512))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.layer1(self.maxpool(F.relu(self.bn1(self.conv1(x)))))
        eighth = self.layer2(x)
        sixteenth = self.layer3(eighth)
        return eighth, sixteenth, self.layer4(sixteenth)


class AttentionRefinement(nn.Module):
    """3x3 conv, then the channels scaled by a sigmoid of their global average (1x1 conv, batch norm)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = ConvNormReLU(in_channels, out_channels)
        self.conv_atten = nn.Conv2d(out_channels, out_channels, 1, bias=False)
        self.bn_atten = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.conv(x)
        attention = torch.sigmoid(self.bn_atten(self.conv_atten(features.mean(dim=(2, 3), keepdim=True))))
        return features * attention


class ContextPath(nn.Module):
    def __init__(self):
        super().__init__()
        self.resnet = ResNet18Features()
        self.arm16 = AttentionRefinement(256, 128)
        self.arm32 = AttentionRefinement(512, 128)
        self.conv_head32 = ConvNormReLU(128, 128)
        self.conv_head16 = ConvNormReLU(128, 128)
        self.conv_avg = ConvNormReLU(512, 128, kernel_size=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        eighth, sixteenth, thirtysecond = self.resnet(x)
        context = self.conv_avg(thirtysecond.mean(dim=(2, 3), keepdim=True))  # (B, 128, 1, 1), broadcast
        up32 = F.interpolate(self.arm32(thirtysecond) + context, sixteenth.shape[2:], mode="nearest")
        up32 = self.conv_head32(up32)
        up16 = F.interpolate(self.arm16(sixteenth) + up32, eighth.shape[2:], mode="nearest")
        return eighth, self.conv_head16(up16), up32


class FeatureFusion(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.convblk = ConvNormReLU(in_channels, out_channels, kernel_size=1)
        self.conv1 = nn.Conv2d(out_channels, out_channels // 4, 1, bias=False)
        self.conv2 = nn.Conv2d(out_channels // 4, out_channels, 1, bias=False)

    def forward(self, spatial: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        features = self.convblk(torch.cat((spatial, context), dim=1))
        attention = torch.sigmoid(self.conv2(F.relu(self.conv1(features.mean(dim=(2, 3), keepdim=True)))))
        return features * attention + features


class Head(nn.Module):
    def __init__(self, in_channels: int, mid_channels: int, classes: int):
        super().__init__()
        self.conv = ConvNormReLU(in_channels, mid_channels)
        self.conv_out = nn.Conv2d(mid_channels, classes, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_out(self.conv(x))


class BiSeNet(nn.Module):
    """(B, 3, H, W) RGB normalised with ImageNet's mean and std -> (B, 19, H, W) class scores."""

    def __init__(self, classes: int = CLASSES):
        super().__init__()
        self.cp = ContextPath()
        self.ffm = FeatureFusion(256, 256)
        self.conv_out = Head(256, 256, classes)
        self.conv_out16 = Head(128, 64, classes)  # auxiliary heads of training: loaded, not run
        self.conv_out32 = Head(128, 64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eighth, context8, _ = self.cp(x)
        scores = self.conv_out(self.ffm(eighth, context8))
        return F.interpolate(scores, x.shape[2:], mode="bilinear", align_corners=True)
