"""Labelled images: the embedded digits set (scikit-learn's bundled 8x8 handwritten digits, no
download) and a synthetic high-resolution set, behind the same ``batch`` as the token data.

The batch of a step is a pure function of (data, seed, step), never of the layout: row i of the
global batch of step k is sample ``perm_e[(k * B + i) mod N]`` of a permutation seeded by
(seed, epoch e). Validation batches take the held-out samples in order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .data import DataError

__all__ = ["ImageDataset", "digits", "synthetic"]


@dataclass(frozen=True)
class ImageDataset:
    train: tuple[np.ndarray, np.ndarray]  # images (N, C, H, W) float32, labels (N,) int64
    val: tuple[np.ndarray, np.ndarray]
    source: str

    def batch(self, split: str, step: int, *, seed: int, global_batch_size: int,
              seq_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = getattr(self, split)
        n = len(labels)
        pos = step * global_batch_size + np.arange(global_batch_size)
        if split == "train":
            rows = np.empty(global_batch_size, dtype=np.int64)
            for epoch in np.unique(pos // n):
                at = pos // n == epoch
                rows[at] = np.random.default_rng([seed, int(epoch)]).permutation(n)[pos[at] % n]
        else:
            rows = pos % n
        return torch.from_numpy(images[rows]), torch.from_numpy(labels[rows])

    def describe(self) -> str:
        (xt, _), (xv, _) = self.train, self.val
        return (f"{self.source}: {len(xt) + len(xv):,} images {tuple(xt.shape[1:])} "
                f"({len(xt):,} train / {len(xv):,} val)")


def _split(images: np.ndarray, labels: np.ndarray, val_fraction: float, source: str) -> ImageDataset:
    order = np.random.default_rng(0).permutation(len(labels))  # fixed: the same split always
    n_val = max(1, int(round(len(labels) * val_fraction)))
    if n_val >= len(labels):
        raise DataError(f"{source}: val_fraction={val_fraction} leaves no training images")
    val, train = order[:n_val], order[n_val:]
    return ImageDataset((images[train], labels[train]), (images[val], labels[val]), source)


def digits(*, val_fraction: float = 0.2) -> ImageDataset:
    """1,797 8x8 grey images of the digits 0-9 (UCI), scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("the digits images come with scikit-learn: pip install 'hybridpar[vision]'") from None
    d = load_digits()
    images = (d.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    return _split(images, d.target.astype(np.int64), val_fraction, "digits (scikit-learn)")


def synthetic(*, n: int, image_size: int, channels: int, n_classes: int, seed: int = 0,
              val_fraction: float = 0.1) -> ImageDataset:
    """Random high-resolution images whose class is the brightest of ``n_classes`` horizontal
    bands: learnable, any size, no download (for memory and speed measurements)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_classes, size=n).astype(np.int64)
    images = rng.random((n, channels, image_size, image_size), dtype=np.float32) * 0.5
    band = image_size // n_classes or 1
    for c in range(n_classes):
        sel = labels == c
        images[sel, :, c * band:(c + 1) * band, :] += 0.5
    return _split(images, labels, val_fraction, f"synthetic {image_size}x{image_size}")
