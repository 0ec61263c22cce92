"""Vocab-parallel embedding and cross-entropy: the full vocabulary never lives on one rank.

Rank r of tp holds rows [r*V/tp, (r+1)*V/tp) of the embedding and of the output head.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .mappings import reduce_from_tp, reduce_scatter_to_tp


class VocabParallelEmbedding(nn.Module):
    """E[tokens] with E split by rows: each rank looks up the tokens it owns, zeros the rest,
    and the sum over tp (one all-reduce) assembles the full embedding."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, group, *, sequence_parallel: bool = False):
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.size(0))
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:  # sum over tp and keep this rank's part of the sequence
            return reduce_scatter_to_tp(out, self.group, 1)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return f"rows={self.weight.size(0)}, vocab_start={self.vocab_start}, dim={self.weight.size(1)}"


class _VocabParallelCE(torch.autograd.Function):
    """loss_i = log sum_v exp(z_iv) - z_i,target with z split over tp along v.

    Three all-reduces of (N,) vectors (max, sum of exp, target logit) replace gathering the
    (N, V) logits. Backward is local: dz = softmax(z) - onehot(target)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        z = logits.float()
        zmax = z.max(dim=-1).values
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        z = z - zmax.unsqueeze(-1)
        local = targets - vocab_start
        outside = (local < 0) | (local >= z.size(-1))
        local = local.masked_fill(outside, 0)
        target_logit = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        packed = torch.stack([target_logit, sum_exp])
        dist.all_reduce(packed, group=group)
        target_logit, sum_exp = packed[0], packed[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        ctx.in_dtype = logits.dtype
        return torch.log(sum_exp) - target_logit

    @staticmethod
    def backward(ctx, g):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), (~outside).to(grad.dtype).neg().unsqueeze(-1))
        grad.mul_(g.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


IGNORE_INDEX = -100  # targets that count nothing (masked prompt or padding tokens)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, group=None,
                  vocab_start: int = 0, reduction: str = "mean") -> torch.Tensor:
    """Token cross-entropy of (..., V_local) logits, the mean (or sum) over targets other than
    ``IGNORE_INDEX``; vocab-parallel when ``group`` has >1 rank."""
    logits = logits.reshape(-1, logits.size(-1))
    targets = targets.reshape(-1)
    if group is None or dist.get_world_size(group) == 1:
        return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)
    per_token = _VocabParallelCE.apply(logits, targets, vocab_start, group)
    keep = targets != IGNORE_INDEX  # an ignored target is outside every shard: zero weight
    total = (per_token * keep).sum()
    return total if reduction == "sum" else total / keep.sum().clamp(min=1)
