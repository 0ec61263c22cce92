"""The flat collectives the engine needs beyond all-reduce, one function each, the same calls on
Gloo (CPU) and NCCL (GPU): no caller branches on the backend.

Gloo has had ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` since torch 2.3 (it
computes the reduce-scatter as an all-reduce and keeps its slice: the same sums, twice the
bytes; NCCL moves (n-1)/n of them). torch >= 2.13 renames them ``reduce_scatter_single`` and
``all_gather_single``; the newer name is used where it exists. That name lookup is the only
version- or backend-dependent line of the engine's math.
"""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter_flat", "all_gather_flat", "computed_once"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group, *, async_op: bool = False):
    """``out = sum over ranks of inp``, slice ``rank`` of n equal slices along dim 0
    (``inp.numel() == n * out.numel()``)."""
    return _reduce_scatter(out, inp, group=group, async_op=async_op)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group, *, async_op: bool = False):
    """``out`` = the ranks' ``inp`` concatenated along dim 0, in group-rank order."""
    return _all_gather(out, inp, group=group, async_op=async_op)


def computed_once(fn, world: int):
    """``fn()``, computed on global rank 0 and broadcast to the other ranks of a ``world``-rank
    job (``world`` = 1, or no process group: computed here).

    For a deterministic result every rank would compute alike from the same inputs, such as the
    meta-device profile behind an automatic pipeline split: N ranks sharing a machine's CPU
    cores would each pay for it (here, 8 ranks on 2 cores: 3 s of a 5 s start-up). An exception
    on rank 0 is raised on every rank, so all of them stop with the same message."""
    if world == 1 or not dist.is_initialized() or dist.get_world_size() != world:
        return fn()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("value", fn())
        except Exception as e:  # the others must not wait for a result that never comes
            try:
                pickle.dumps(e)
            except Exception:  # an exception that cannot travel: its type and message do
                e = RuntimeError(f"{type(e).__name__}: {e}")
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
