"""The model seam: what the engine needs to know about a model, and nothing more.

The model itself stays plain single-device PyTorch; its own ``forward`` is never called by the
engine. A ``ModelSpec`` describes it as data:

* ``build()`` makes the full model (the engine calls it under ``torch.device("meta")`` and
  materialises only this rank's shard);
* ``stem``, ``blocks``, ``head``: module names (FQNs) of the ordered *units*. A pipeline stage
  is a contiguous run of blocks; the first stage also runs the stem, the last the head. A unit
  is called with the previous unit's output (a tuple is unpacked into arguments), the first
  with the batch's inputs, so a boundary may carry a tensor or a tuple of tensors of any shape;
* ``loss(output, targets)`` on the last stage: the mean loss of one micro-batch, or
  ``"cross_entropy"`` for the library's token cross-entropy over the last dim (vocab-parallel
  when the head is sharded by ``vocab_head``);
* ``tp_plan``: module-name patterns (``fnmatch``) -> a tensor-parallel style (see
  ``hybridpar.parallel.tensor_parallel.apply``); modules not named stay replicated;
* ``tied``: (source, copy) parameter names that are one tensor (embedding and output head);
  both must sit in the stem or head, so that a split puts them on the first and last stage;
* ``init(name, shape, generator)``: the unsharded initial value of a parameter (the engine
  seeds ``generator`` from the run seed and the name, so every layout starts identically);
* ``selective_recompute``: ``"pattern:method"`` entries whose method's activations are
  recomputed in backward under ``recompute=selective`` (``full`` recomputes whole blocks);
* ``check(tp)``: model-specific validation of a tensor-parallel degree (e.g. "tp must divide
  n_heads"); ``flops_per_sample``: forward+backward FLOPs of one sample (MFU);
* ``data``: the embedded data it trains on by default (``"text"``: byte tokens,
  ``"digits"``: labelled images, scikit-learn's 8x8 digits or ``data.images=synthetic``, or
  ``"denoising"``: (noisy image, clean image) pairs of those), or a module-level function
  ``(Config) -> dataset`` with a ``batch(split, step, *, seed, global_batch_size, seq_len)``
  method returning one global batch (inputs, targets) as a pure function of the step;
* ``eval_metric(output, targets)``: a tensor of (correct, count) per micro-batch, summed over
  the validation set into ``val_accuracy``;
* ``context_parallel(model, shard)``: makes the model run on a shard of each sequence (cp > 1):
  attend with ``shard.attend(q, k, v, causal=...)`` and use ``shard.positions`` (the global
  positions of the local tokens) wherever positions matter. Inputs and targets are then split
  along dim 1 by the engine (``shard.take``), unless ``cp_split_batch`` is False: then the
  model makes its tokens itself (a ViT's patch embedding) and selects its share with the
  shard (``padded``, ``take``, ``first_token``). None: the model does not support cp.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import nn

__all__ = ["ModelSpec", "CROSS_ENTROPY"]

CROSS_ENTROPY = "cross_entropy"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    stem: tuple[str, ...]
    blocks: tuple[str, ...]
    head: tuple[str, ...]
    loss: Callable[[object, torch.Tensor], torch.Tensor] | str = CROSS_ENTROPY
    tp_plan: Mapping[str, str] = field(default_factory=dict)
    tied: tuple[tuple[str, str], ...] = ()
    init: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor] | None = None
    selective_recompute: tuple[str, ...] = ()
    check: Callable[[int], None] | None = None
    flops_per_sample: float | None = None
    data: str | Callable = "text"
    eval_metric: Callable[[object, torch.Tensor], torch.Tensor] | None = None
    context_parallel: Callable[[nn.Module, object], None] | None = None
    cp_split_batch: bool = True

    def __post_init__(self):
        if not self.blocks:
            raise ValueError(f"model spec {self.name!r} has no blocks: the pipeline cuts between "
                             f"blocks, so a model needs at least one")

    @property
    def units(self) -> tuple[str, ...]:
        return self.stem + self.blocks + self.head

    def stage_units(self, split: list[int]) -> list[list[str]]:
        """Units of each virtual stage for ``split`` = blocks per virtual stage."""
        if sum(split) != len(self.blocks) or min(split) < 1:
            raise ValueError(f"split {split} must give every stage >= 1 of the "
                             f"{len(self.blocks)} blocks of {self.name!r}")
        out, start = [], 0
        for v, n in enumerate(split):
            units = list(self.blocks[start:start + n])
            start += n
            if v == 0:
                units = list(self.stem) + units
            if v == len(split) - 1:
                units += list(self.head)
            out.append(units)
        return out

    def tied_source(self, name: str) -> str:
        """The parameter whose value ``name`` shares (itself if not a tied copy)."""
        return next((src for src, copy in self.tied if copy == name), name)
