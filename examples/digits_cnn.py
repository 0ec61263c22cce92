"""Your own model under hybridpar: a small residual CNN on the digits, trained at dp=2 x pp=2.
The model is plain PyTorch; ``spec`` tells the engine where the pipeline may cut (stem, blocks,
head), how to initialise each parameter and what to evaluate. Its stages exchange a tuple: the
feature map and a long skip from the stem to the head. Run: python examples/digits_cnn.py
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

import hybridpar
from hybridpar.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from hybridpar.models import ModelSpec


class Stem(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(1, ch, 3, padding=1)

    def forward(self, images):  # (B, 1, 8, 8) -> feature map and skip, both (B, ch, 8, 8)
        x = F.relu(self.conv(images))
        return x, x


class Block(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(ch, ch, 3, padding=1), nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x, skip):  # a residual block; the skip passes through untouched
        return x + self.conv2(F.relu(self.conv1(x))), skip


class Head(nn.Module):
    def __init__(self, ch: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(ch, classes)

    def forward(self, x, skip):
        return self.fc(F.relu(x + skip).mean(dim=(2, 3)))


class DigitsCNN(nn.Module):
    def __init__(self, ch: int, depth: int, classes: int):
        super().__init__()
        self.stem, self.head = Stem(ch), Head(ch, classes)
        self.blocks = nn.ModuleList(Block(ch) for _ in range(depth))

    def forward(self, images):  # single-device use; the engine calls the units itself
        x = self.stem(images)
        for block in self.blocks:
            x = block(*x)
        return self.head(*x)


def init(name: str, shape: tuple, g: torch.Generator) -> torch.Tensor:  # He init, zero biases
    if name.endswith("bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=g) * math.sqrt(2.0 / math.prod(shape[1:]))


def accuracy(logits, labels):  # (correct, count), summed over the validation set
    correct = (logits.argmax(-1) == labels).sum()
    return torch.stack([correct, torch.full_like(correct, labels.numel())]).double()


def spec(cfg: ModelConfig) -> ModelSpec:
    return ModelSpec(name="digits-cnn", build=lambda: DigitsCNN(cfg.d_model, cfg.n_layers, cfg.n_classes),
                     stem=("stem",), blocks=tuple(f"blocks.{i}" for i in range(cfg.n_layers)),
                     head=("head",), init=init, data="digits", eval_metric=accuracy)


if __name__ == "__main__":  # spawned ranks import this file: keep the run under the guard
    cfg = Config(model=ModelConfig(d_model=16, n_layers=4),
                 parallel=ParallelConfig(dp=2, pp=2, microbatches=2),
                 train=TrainConfig(steps=150, global_batch=64, lr=3e-3, eval_every=50),
                 data=DataConfig(val_fraction=0.2))
    result = hybridpar.train(cfg, model=spec)
    print(f"val accuracy {result['val_accuracy']:.3f} after {len(result.history)} steps")
