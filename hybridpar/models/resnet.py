"""A residual CNN (ResNet with basic blocks and BatchNorm) as plain single-device PyTorch, and
its ``ModelSpec``.

images (B, C, H, W) -> stem (3x3 conv, BatchNorm, ReLU) -> ``n_layers`` basic blocks in three
groups of widths w, 2w, 4w (w = ``model.base_channels``; the first block of groups 2 and 3
halves the resolution) -> global average pool -> linear classifier. A block computes
relu(body(x) + shortcut(x)) with body = conv3x3, BN, ReLU, conv3x3, BN and shortcut = identity
or (1x1 strided conv, BN) where the shape changes. The pipeline cuts between blocks, so the
boundaries are feature maps whose channels and resolution change from stage to stage.

Tensor parallelism splits each body's channels (Megatron's MLP on channels): the body is a
region, its first conv column-parallel (output channels), the BN between channelwise (local
statistics of the rank's channels), the second conv row-parallel (input channels; one
all-reduce, bias-free). Stem, shortcut, second BN and head stay replicated.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .spec import CROSS_ENTROPY, ModelSpec
from .vit import accuracy


def _conv(cin: int, cout: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)


class Stem(nn.Module):
    def __init__(self, channels: int, width: int):
        super().__init__()
        self.conv, self.bn = _conv(channels, width, 3), nn.BatchNorm2d(width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(images)))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(_conv(cin, cout, 3, stride), nn.BatchNorm2d(cout), nn.ReLU(),
                                  _conv(cout, cout, 3), nn.BatchNorm2d(cout))
        self.shortcut = (nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class Head(nn.Module):
    def __init__(self, width: int, n_classes: int):
        super().__init__()
        self.fc = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def block_shapes(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """(in channels, out channels, stride) of each block: three groups, widths w, 2w, 4w."""
    w, L, out = cfg.base_channels, cfg.n_layers, []
    cin = w
    for i in range(L):
        group = min(2, i * 3 // L)
        cout = w * 2 ** group
        stride = 2 if cout != cin else 1
        out.append((cin, cout, stride))
        cin = cout
    return out


class ResNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        shapes = block_shapes(cfg)
        self.stem = Stem(cfg.channels, cfg.base_channels)
        self.blocks = nn.ModuleDict({str(i): BasicBlock(*s) for i, s in enumerate(shapes)})
        self.head = Head(shapes[-1][1], cfg.n_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)


TP_PLAN = {"blocks.*.body": "region", "blocks.*.body.0": "colwise",
           "blocks.*.body.1": "channelwise", "blocks.*.body.3": "rowwise"}


def init_resnet(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """He normal for convolutions (fan_in = C_in k k), BatchNorm scale 1 and shift 0, the
    classifier normal(0, 1/sqrt(fan_in)) with zero bias."""
    if len(shape) == 1:  # BatchNorm weight / bias, classifier bias
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    fan_in = math.prod(shape[1:])
    std = math.sqrt(2.0 / fan_in) if len(shape) > 2 else 1.0 / math.sqrt(fan_in)
    return torch.empty(shape).normal_(0.0, std, generator=g)


def flops_per_sample(cfg: ModelConfig) -> float:
    """Forward + backward (3x forward) multiply-adds x 2 of the convolutions and classifier."""
    size, total = cfg.image_size, 9 * cfg.channels * cfg.base_channels * cfg.image_size ** 2
    for cin, cout, stride in block_shapes(cfg):
        size = math.ceil(size / stride)
        total += (9 * cin * cout + 9 * cout * cout) * size * size
        if stride != 1 or cin != cout:
            total += cin * cout * size * size
    total += block_shapes(cfg)[-1][1] * cfg.n_classes
    return 3 * 2 * total


def resnet_spec(cfg: ModelConfig) -> ModelSpec:
    L = cfg.n_layers
    return ModelSpec(
        name="resnet",
        build=lambda: ResNet(cfg),
        stem=("stem",),
        blocks=tuple(f"blocks.{i}" for i in range(L)),
        head=("head",),
        loss=CROSS_ENTROPY,
        tp_plan=TP_PLAN,
        init=init_resnet,
        flops_per_sample=flops_per_sample(cfg),
        data="digits",
        eval_metric=accuracy,
    )
