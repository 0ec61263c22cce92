"""The flat collectives the engine needs beyond all-reduce, one function each, the same calls on
Gloo (CPU) and NCCL (GPU): no caller branches on the backend.

Gloo has had ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` since torch 2.3 (it
computes the reduce-scatter as an all-reduce and keeps its slice: the same sums, twice the
bytes; NCCL moves (n-1)/n of them). torch >= 2.13 renames them ``reduce_scatter_single`` and
``all_gather_single``; the newer name is used where it exists. That name lookup is the only
version- or backend-dependent line of the engine's math.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter_flat", "all_gather_flat"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group, *, async_op: bool = False):
    """``out = sum over ranks of inp``, slice ``rank`` of n equal slices along dim 0
    (``inp.numel() == n * out.numel()``)."""
    return _reduce_scatter(out, inp, group=group, async_op=async_op)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group, *, async_op: bool = False):
    """``out`` = the ranks' ``inp`` concatenated along dim 0, in group-rank order."""
    return _all_gather(out, inp, group=group, async_op=async_op)
