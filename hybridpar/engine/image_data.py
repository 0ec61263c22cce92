"""Labelled images: the embedded digits set (scikit-learn's bundled 8x8 handwritten digits, no
download) and a synthetic high-resolution set, behind the same ``batch`` as the token data.

The batch of a step is a pure function of (data, seed, step), never of the layout: row i of the
global batch of step k is sample ``perm_e[(k * B + i) mod N]`` of a permutation seeded by
(seed, epoch e). Validation batches take the held-out samples in order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .data import DataError, sample_rows

__all__ = ["ImageDataset", "DenoisingDataset", "digits", "synthetic", "denoising_digits", "images_for"]


@dataclass(frozen=True)
class ImageDataset:
    train: tuple[np.ndarray, np.ndarray]  # images (N, C, H, W) float32, labels (N,) int64
    val: tuple[np.ndarray, np.ndarray]
    source: str

    def batch(self, split: str, step: int, *, seed: int, global_batch_size: int,
              seq_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = getattr(self, split)
        rows = sample_rows(len(labels), split, step, seed=seed, global_batch_size=global_batch_size)
        return torch.from_numpy(images[rows]), torch.from_numpy(labels[rows])

    def max_batches(self, split: str, global_batch_size: int) -> int:
        """Whole global batches in ``split`` without repeating an image (evaluation stops there)."""
        return len(getattr(self, split)[1]) // global_batch_size

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
    table = _digits_table()
    images = (table[:, :-1].reshape(-1, 8, 8) / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    return _split(images, table[:, -1].astype(np.int64), val_fraction, "digits (scikit-learn)")


def _digits_table() -> np.ndarray:
    """scikit-learn's digits file, (1797, 65): 64 pixels (0-16) and the label per row. Read
    straight from the installed package: importing scikit-learn costs a second or more per
    process, i.e. seconds for the ranks of a job sharing a few cores."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is None:
        raise DataError("the digits images come with scikit-learn: pip install 'hybridpar[vision]'")
    path = Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    if not path.is_file():  # another layout: ask scikit-learn itself
        from sklearn.datasets import load_digits
        d = load_digits()
        return np.concatenate([d.data, d.target[:, None]], axis=1)
    with gzip.open(path, "rt") as f:
        return np.loadtxt(f, delimiter=",")


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


@dataclass(frozen=True)
class DenoisingDataset:
    """(noisy image, clean image) pairs: the images of ``base`` plus Gaussian noise of std
    ``sigma`` drawn from a generator seeded by (seed, split, step), so that the batch of a step
    stays a pure function of (data, seed, step)."""

    base: ImageDataset
    sigma: float = 0.5

    def batch(self, split: str, step: int, *, seed: int, global_batch_size: int,
              seq_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        clean, _ = self.base.batch(split, step, seed=seed, global_batch_size=global_batch_size)
        g = torch.Generator().manual_seed(int(np.random.default_rng([seed, step, split == "val"]).integers(2 ** 62)))
        return clean + self.sigma * torch.randn(clean.shape, generator=g), clean

    def max_batches(self, split: str, global_batch_size: int) -> int:
        return self.base.max_batches(split, global_batch_size)

    def describe(self) -> str:
        return f"{self.base.describe()}, noise std {self.sigma}"


def images_for(cfg) -> ImageDataset:
    """The labelled images a classifier of ``cfg.model`` trains on: ``data.images`` = digits
    (8x8, 1 channel) or synthetic (model.image_size, model.channels, model.n_classes)."""
    m, d = cfg.model, cfg.data
    if d.images == "synthetic":
        return synthetic(n=d.n_images, image_size=m.image_size, channels=m.channels,
                         n_classes=m.n_classes, seed=0, val_fraction=d.val_fraction)
    if (m.image_size, m.channels) != (8, 1) or m.n_classes < 10:
        raise DataError(f"the digits are 8x8 grey images of 10 classes: set model.image_size=8, "
                        f"model.channels=1, model.n_classes>=10, or use data.images=synthetic "
                        f"(any size; got image_size={m.image_size}, channels={m.channels}, "
                        f"n_classes={m.n_classes})")
    return digits(val_fraction=d.val_fraction)


def denoising_digits(cfg) -> DenoisingDataset:
    """The images of ``images_for(cfg)`` with noise, for the denoising UNet."""
    return DenoisingDataset(images_for(cfg))
