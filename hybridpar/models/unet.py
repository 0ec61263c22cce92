"""A small UNet that denoises images, as plain single-device PyTorch, and its ``ModelSpec``:
the built-in model whose pipeline stages exchange tuples.

noisy image (B, C, H, W) -> stem conv -> ``down.i`` (body, then 2x average pool; the
full-resolution output is pushed as a skip) -> ``mid`` (residual body) -> ``up.i`` (2x nearest
upsampling, concatenation with the matching skip, body) -> 1x1 conv head -> the clean image;
loss: mean squared error. A unit takes and returns ``(h, skip_0, ..., skip_k)``, so a pipeline
boundary carries a tuple whose length, channels and resolutions change from stage to stage
(e.g. ``(h (B,2w,2,2), s0 (B,w,8,8), s1 (B,2w,4,4))`` after the last down block).

A body is conv3x3 -> GroupNorm -> SiLU -> conv3x3, with biases. Tensor parallelism splits its
hidden channels: the body is a region, its first conv column-parallel, the GroupNorm
channelwise (whole groups per rank), the second conv row-parallel (its bias added once, after
the all-reduce).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .spec import ModelSpec

LEVELS = 2  # two halvings: 8x8 digits -> 4x4 -> 2x2


def _body(cin: int, hidden: int, cout: int, groups: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, hidden, 3, padding=1), nn.GroupNorm(groups, hidden), nn.SiLU(),
                         nn.Conv2d(hidden, cout, 3, padding=1))


class Stem(nn.Module):
    def __init__(self, channels: int, width: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, width, 3, padding=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.conv(images)


class Down(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.body = _body(cin, cout, cout, groups)

    def forward(self, h: torch.Tensor, *skips: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = F.silu(self.body(h))
        return (F.avg_pool2d(h, 2), *skips, h)


class Mid(nn.Module):
    def __init__(self, width: int, groups: int):
        super().__init__()
        self.body = _body(width, width, width, groups)

    def forward(self, h: torch.Tensor, *skips: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (h + self.body(h), *skips)


class Up(nn.Module):
    def __init__(self, cin: int, cskip: int, cout: int, groups: int):
        super().__init__()
        self.body = _body(cin + cskip, cout, cout, groups)

    def forward(self, h: torch.Tensor, *skips: torch.Tensor):
        h = F.interpolate(h, scale_factor=2, mode="nearest")
        h = F.silu(self.body(torch.cat([h, skips[-1]], dim=1)))
        return (h, *skips[:-1]) if len(skips) > 1 else h


class Head(nn.Module):
    def __init__(self, width: int, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(width, channels, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.conv(h)


def widths(cfg: ModelConfig) -> list[int]:
    """Channels at each resolution level: w, 2w, ..."""
    return [cfg.base_channels * 2 ** i for i in range(LEVELS)]


class UNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        w, g = widths(cfg), cfg.norm_groups
        self.stem = Stem(cfg.channels, w[0])
        self.down = nn.ModuleDict({str(i): Down(w[max(i - 1, 0)], w[i], g) for i in range(LEVELS)})
        self.mid = Mid(w[-1], g)
        self.up = nn.ModuleDict({str(i): Up(w[min(i + 1, LEVELS - 1)], w[i], w[i], g)
                                 for i in range(LEVELS)})
        self.head = Head(w[0], cfg.channels)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for i in range(LEVELS):
            x = self.down[str(i)](*(x if isinstance(x, tuple) else (x,)))
        x = self.mid(*x)
        for i in reversed(range(LEVELS)):
            x = self.up[str(i)](*x)
        return self.head(x)


TP_PLAN = {"*.body": "region", "*.body.0": "colwise", "*.body.1": "channelwise",
           "*.body.3": "rowwise"}


def init_unet(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """He normal for convolutions (fan_in = C_in k k), GroupNorm scale 1, biases 0."""
    if len(shape) == 1:
        return torch.ones(shape) if name.endswith(".1.weight") else torch.zeros(shape)
    return torch.empty(shape).normal_(0.0, math.sqrt(2.0 / math.prod(shape[1:])), generator=g)


def mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), targets)


def flops_per_sample(cfg: ModelConfig) -> float:
    """Forward + backward (3x forward) of the convolutions, 2 FLOPs per multiply-add."""
    w, s, c = widths(cfg), cfg.image_size, cfg.channels
    total = 9 * c * w[0] * s * s + w[0] * c * s * s
    for i in range(LEVELS):
        r = (s // 2 ** i) ** 2
        total += 9 * (w[max(i - 1, 0)] * w[i] + w[i] * w[i]) * r  # down
        cin = w[min(i + 1, LEVELS - 1)] + w[i]
        total += 9 * (cin * w[i] + w[i] * w[i]) * r  # up
    total += 9 * 2 * w[-1] ** 2 * (s // 2 ** LEVELS) ** 2  # mid
    return 3 * 2 * total


def unet_spec(cfg: ModelConfig) -> ModelSpec:
    return ModelSpec(
        name="unet",
        build=lambda: UNet(cfg),
        stem=("stem",),
        blocks=(*(f"down.{i}" for i in range(LEVELS)), "mid",
                *(f"up.{i}" for i in reversed(range(LEVELS)))),
        head=("head",),
        loss=mse,
        tp_plan=TP_PLAN,
        init=init_unet,
        flops_per_sample=flops_per_sample(cfg),
        data="denoising",
    )
