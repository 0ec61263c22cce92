"""Autograd collectives of the tensor-parallel region, named after the math (Megatron's mappings).

Each takes its process group explicitly; a None group (tp=1) makes it the identity.

Under bf16/fp16 autocast the fp32 tensors a tp region exchanges (the gradient of a
column-parallel input, summed in backward; a sequence-parallel region's fp32 norm output,
gathered for its Linears, and its gradient, reduce-scattered) travel in the autocast dtype,
as Megatron's do: half the bytes. The forward gather feeds Linears that autocast would round
to that dtype anyway (the same rounding); the backward sums gain one rounding of the sum.

  copy_to_tp      forward: identity      backward: all-reduce   (input of column-parallel)
  reduce_from_tp  forward: all-reduce    backward: identity     (output of row-parallel)
  gather_from_tp  forward: all-gather    backward: take shard   (along ``dim``)
  scatter_to_tp   forward: take shard    backward: all-gather
  reduce_scatter_to_tp  forward: reduce-scatter  backward: all-gather  (sequence parallel)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import reduce_scatter_flat
from ...reliability.watchdog import activity


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def wire_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``x``'s device and ``x`` is a wider floating
    tensor (what a forward records for its backward, which runs outside autocast), else None."""
    dev = x.device.type
    if x.is_floating_point() and torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        if x.dtype.itemsize > dtype.itemsize:
            return dtype
    return None


def all_reduce(x: torch.Tensor, group, wire: torch.dtype | None = None) -> torch.Tensor:
    """Sum over the group into a new tensor (inputs may be saved by autograd elsewhere),
    in ``wire`` dtype if given."""
    out = x.to(wire or x.dtype, memory_format=torch.contiguous_format, copy=True)
    outer = activity.enter("tp all-reduce")  # for the watchdog: an attribute write, no I/O
    dist.all_reduce(out, group=group)
    activity.leave(outer)
    return out.to(x.dtype)


def all_gather(x: torch.Tensor, group, dim: int, wire: torch.dtype | None = None) -> torch.Tensor:
    src = (x.to(wire) if wire is not None else x).contiguous()
    parts = [torch.empty_like(src) for _ in range(_size(group))]
    outer = activity.enter("tp all-gather")
    dist.all_gather(parts, src, group=group)
    activity.leave(outer)
    return torch.cat(parts, dim=dim).to(x.dtype)


def shard(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n, r = _size(group), dist.get_rank(group)
    return x.chunk(n, dim=dim)[r].contiguous()


def reduce_scatter(x: torch.Tensor, group, dim: int, wire: torch.dtype | None = None) -> torch.Tensor:
    """Sum over the group, keep this rank's 1/n of ``dim``: the ranks' chunks along ``dim``
    laid end to end, one flat reduce-scatter (in ``wire`` dtype if given)."""
    n = _size(group)
    parts = x.chunk(n, dim=dim)
    out = torch.empty_like(parts[0], memory_format=torch.contiguous_format, dtype=wire or x.dtype)
    outer = activity.enter("tp reduce-scatter")
    reduce_scatter_flat(out.view(-1), torch.cat([p.reshape(-1) for p in parts]).to(out.dtype), group)
    activity.leave(outer)
    return out.to(x.dtype)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.wire = group, wire_dtype(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group, ctx.wire), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace=False):
        if inplace and x.is_contiguous():  # a fresh product nobody keeps: no copy
            ctx.mark_dirty(x)  # autograd bumps its version: a backward that kept it would raise
            outer = activity.enter("tp all-reduce")
            dist.all_reduce(x, group=group)
            activity.leave(outer)
            return x
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return shard(g, ctx.group, ctx.dim), None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return shard(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim), None, None


class _ReduceScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim), None, None


class _GatherFromSeq(torch.autograd.Function):
    """all-gather forward, reduce-scatter backward: the entry of a sequence-parallel region."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.wire = group, dim, wire_dtype(x)
        return all_gather(x, group, dim, ctx.wire)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.group, ctx.dim, ctx.wire), None, None


def copy_to_tp(x, group):
    return x if _size(group) == 1 else _CopyTo.apply(x, group)


def reduce_from_tp(x, group, inplace: bool = False):
    """``inplace``: ``x`` is a fresh partial product (a row-parallel matmul's output) that no
    one else holds: summed in its own memory instead of a copy (+35% time at 16 MiB on Gloo)."""
    return x if _size(group) == 1 else _ReduceFrom.apply(x, group, inplace)


def gather_from_tp(x, group, dim: int = -1):
    return x if _size(group) == 1 else _GatherFrom.apply(x, group, dim)


def scatter_to_tp(x, group, dim: int = -1):
    return x if _size(group) == 1 else _ScatterTo.apply(x, group, dim)


def reduce_scatter_to_tp(x, group, dim: int = 1):
    return x if _size(group) == 1 else _ReduceScatterTo.apply(x, group, dim)


def gather_from_sp(x, group, dim: int = 1):
    return x if _size(group) == 1 else _GatherFromSeq.apply(x, group, dim)
