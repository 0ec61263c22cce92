"""Autograd collectives of the tensor-parallel region, named after the math (Megatron's mappings).

Each takes its process group explicitly; a None group (tp=1) makes it the identity.

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


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group into a new tensor (inputs may be saved by autograd elsewhere)."""
    out = x.clone(memory_format=torch.contiguous_format)
    outer = activity.enter("tp all-reduce")  # for the watchdog: an attribute write, no I/O
    dist.all_reduce(out, group=group)
    activity.leave(outer)
    return out


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(_size(group))]
    outer = activity.enter("tp all-gather")
    dist.all_gather(parts, x.contiguous(), group=group)
    activity.leave(outer)
    return torch.cat(parts, dim=dim)


def shard(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n, r = _size(group), dist.get_rank(group)
    return x.chunk(n, dim=dim)[r].contiguous()


def reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum over the group, keep this rank's 1/n of ``dim``: the ranks' chunks along ``dim``
    laid end to end, one flat reduce-scatter."""
    n = _size(group)
    parts = x.chunk(n, dim=dim)
    out = torch.empty_like(parts[0], memory_format=torch.contiguous_format)
    outer = activity.enter("tp reduce-scatter")
    reduce_scatter_flat(out.view(-1), torch.cat([p.reshape(-1) for p in parts]), group)
    activity.leave(outer)
    return out


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


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
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.group, ctx.dim), None, None


def copy_to_tp(x, group):
    return x if _size(group) == 1 else _CopyTo.apply(x, group)


def reduce_from_tp(x, group):
    return x if _size(group) == 1 else _ReduceFrom.apply(x, group)


def gather_from_tp(x, group, dim: int = -1):
    return x if _size(group) == 1 else _GatherFrom.apply(x, group, dim)


def scatter_to_tp(x, group, dim: int = -1):
    return x if _size(group) == 1 else _ScatterTo.apply(x, group, dim)


def reduce_scatter_to_tp(x, group, dim: int = 1):
    return x if _size(group) == 1 else _ReduceScatterTo.apply(x, group, dim)


def gather_from_sp(x, group, dim: int = 1):
    return x if _size(group) == 1 else _GatherFromSeq.apply(x, group, dim)
