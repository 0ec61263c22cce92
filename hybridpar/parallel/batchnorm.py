"""Batch normalisation synchronised over data parallelism: the same code on Gloo and NCCL.

torch's ``SyncBatchNorm`` refuses CPU tensors, so the engine patches every ``nn.BatchNorm*d``
of a stage with this forward (the module, its parameters and buffers keep their names). A
layer normalises each micro-batch by its own statistics, as in one process with gradient
accumulation; the engine gives micro-batch k the same rows of the global batch on every layout
(``data.local_microbatches``: spread over the dp ranks), so the statistics are those of the
union of the dp ranks' rows. Per channel, with rank r holding n_r values of mean m_r and
M2_r = sum (x - m_r)^2 (``torch.var_mean``, numerically stable), Chan et al.'s combination:

    n = sum_r n_r,   mean = sum_r n_r m_r / n,   var = (sum_r M2_r + sum_r n_r (m_r - mean)^2) / n
    y = (x - mean) / sqrt(var + eps) * weight + bias

Each rank writes (n_r, m_r, M2_r) into its row of a zero (dp, 1 + 2C) table and one all-reduce
sums it (an all-gather). The layer is one autograd function with the closed-form backward
(``_SyncBatchNorm``): one all-reduce of (sum dy, sum dy xhat) and a few fused passes over x, where
autograd through the formula took a dozen elementwise ops each way (the ResNet, 8 blocks on
32 x 32 images, dp = 2: 153 against 172 ms a step). With dp = 1 there is
nothing to combine and torch's fused kernel computes the same layer (``_local``): a dozen
elementwise autograd ops each way become one kernel, 1.3-1.6x on a ResNet step here. Running
statistics follow torch: ``running_mean <- (1 - m) running_mean + m mean``, ``running_var``
likewise with the unbiased ``var n / (n - 1)``, ``num_batches_tracked += 1`` (momentum None:
the cumulative average).

Activation recomputation re-runs forward in backward; under ``recomputing()`` a layer normalises
identically (same collective, same statistics) but leaves its running statistics alone, so each
micro-batch counts once (torch's checkpoint counts it twice: pytorch/pytorch#96136).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["sync_batchnorm", "reset_buffers", "recomputing", "is_batchnorm"]

_recomputing = contextvars.ContextVar("hybridpar_recomputing", default=False)


@contextlib.contextmanager
def recomputing():
    """Marks an activation-recomputation forward (``torch.utils.checkpoint``'s context_fn)."""
    token = _recomputing.set(True)
    try:
        yield
    finally:
        _recomputing.reset(token)


def is_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, _BatchNorm)


def batch_stats(x: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(mean, biased var, count) per channel (dim 1) over the dp group's micro-batch rows; no
    autograd (``_SyncBatchNorm`` differentiates the layer as a whole)."""
    dims = [0, *range(2, x.dim())]
    var_r, mean_r = torch.var_mean(x, dim=dims, unbiased=False)
    n_r = x.numel() / x.size(1)
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:
        return mean_r, var_r, n_r
    C, rank = x.size(1), dist.get_rank(group)
    table = x.new_zeros(size, 1 + 2 * C)
    table[rank, 0] = n_r
    table[rank, 1:1 + C] = mean_r
    torch.mul(var_r, n_r, out=table[rank, 1 + C:])
    dist.all_reduce(table, group=group)
    n_k, m_k, m2_k = table[:, :1], table[:, 1:1 + C], table[:, 1 + C:]
    n = n_k.sum()
    mean = (n_k * m_k).sum(0) / n
    var = (m2_k.sum(0) + (n_k * (m_k - mean) ** 2).sum(0)) / n
    # the count for the running variance's n/(n-1): every dp rank's micro-batch has the same
    # rows (the global batch divides by dp), so it is known without a host sync (float(n) would
    # wait for the all-reduce on a GPU, once per BatchNorm and micro-batch)
    return mean, var, n_r * size


class _SyncBatchNorm(torch.autograd.Function):
    """The training layer over the dp group, with its closed-form backward (Megatron's and
    torch's SyncBatchNorm): one all-reduce each way and a few fused passes over x, instead of
    autograd through a dozen elementwise ops and the statistics' table.

    Forward, per channel: y = x * a + (b - mean * a), a = w / sqrt(var + eps) (w = 1, b = 0
    without affine). Backward, with xhat = (x - mean) / sqrt(var + eps) and the sums over the
    group's rows (n of them): dL/db = sum dy, dL/dw = sum dy xhat (this rank's rows: the dp
    gradient sync adds the replicas'), and
        dL/dx = a * (dy - S_dy / n - xhat * S_dy_xhat / n),
    S the sums over every rank's rows (one all-reduce of 2C values): every rank's loss depends
    on this rank's x through the common mean and var."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, n, eps, group):
        invstd = torch.rsqrt(var + eps)
        a = invstd if weight is None else weight.float() * invstd
        shift = -mean * a if bias is None else bias.float() - mean * a
        shape = (1, -1) + (1,) * (x.dim() - 2)
        ctx.save_for_backward(x, a, mean, invstd)
        ctx.n, ctx.group = n, group
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (weight, bias))
        return torch.addcmul(shift.view(shape), x, a.view(shape))

    @staticmethod
    def backward(ctx, dy):
        x, a, mean, invstd = ctx.saved_tensors
        dims, shape = [0, *range(2, x.dim())], (1, -1) + (1,) * (x.dim() - 2)
        C = x.size(1)
        sums = torch.empty(2 * C, dtype=torch.float32, device=x.device)
        torch.sum(dy, dim=dims, out=sums[:C])
        # sum dy (x - mean), not sum dy x - mean sum dy: no cancellation when |mean| >> std
        torch.sum(dy * (x - mean.view(shape)), dim=dims, out=sums[C:])
        sums[C:].mul_(invstd)
        local = sums.clone()
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(sums, group=ctx.group)
        mean_dy, mean_dy_xhat = sums[:C] / ctx.n, sums[C:] / ctx.n
        # dx = a dy - a xhat mean_dy_xhat - a mean_dy = a dy + k x + c per channel
        k = -a * invstd * mean_dy_xhat
        c = -a * mean_dy - k * mean
        dx = torch.addcmul(torch.addcmul(c.view(shape), x, k.view(shape)), dy, a.view(shape))
        w_dtype, b_dtype = ctx.dtypes
        dw = None if w_dtype is None else local[C:].to(w_dtype)
        db = None if b_dtype is None else local[:C].to(b_dtype)
        return dx, dw, db, None, None, None, None, None


def _count_batch(bn: _BatchNorm) -> float:
    """Counts one more batch and returns the running statistics' weight for it: the momentum,
    or 1 / count when it is None (the cumulative average), as torch's BatchNorm."""
    bn.num_batches_tracked.add_(1)
    return (1.0 / float(bn.num_batches_tracked)) if bn.momentum is None else bn.momentum


def _fusable(bn: _BatchNorm, x: torch.Tensor, group) -> bool:
    """dp = 1, statistics kept in the input's dtype, and more than one value per channel (the
    kernel's n / (n - 1) needs two; the combination clamps it)."""
    return ((group is None or dist.get_world_size(group) == 1) and x.numel() > x.size(1)
            and all(t is None or t.dtype == x.dtype for t in (bn.running_mean, bn.weight)))


def _local(bn: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """The layer on one rank's rows (dp = 1): torch's fused kernel computes the same statistics
    and applies the same running-statistics rule as the combination below (lerp by the momentum,
    or by 1/count when it is None; the unbiased variance), in one pass forward and one backward
    instead of a dozen elementwise ops each way (the ResNet's units, forward and backward on 8
    16 x 16 images: 18.0-19.2 ms before, 11.0-11.9 ms after). Under ``recomputing()`` it leaves
    the running statistics alone, as the combination does (momentum 0)."""
    m = 0.0  # a recomputation's running statistics: (1 - 0) r + 0 s, unchanged; the kernel saves
    # the same tensors as in the first forward, as the checkpoint requires
    if bn.track_running_stats and not _recomputing.get():
        m = _count_batch(bn)
    return torch.batch_norm(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, m, bn.eps,
                            torch.backends.cudnn.enabled)


def _forward(bn: _BatchNorm, group, x: torch.Tensor) -> torch.Tensor:
    bn._check_input_dim(x)
    use_batch = bn.training or not bn.track_running_stats
    if not use_batch:
        return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    xf = x.float()
    if _fusable(bn, xf, group):
        return _local(bn, xf).to(x.dtype)
    with torch.no_grad():
        mean, var, n = batch_stats(xf, group)
        if bn.training and bn.track_running_stats and not _recomputing.get():
            m = _count_batch(bn)
            bn.running_mean.lerp_(mean.to(bn.running_mean.dtype), m)
            bn.running_var.lerp_((var * (n / max(n - 1.0, 1.0))).to(bn.running_var.dtype), m)
    return _SyncBatchNorm.apply(xf, bn.weight, bn.bias, mean, var, n, bn.eps, group).to(x.dtype)


def sync_batchnorm(model: nn.Module, group) -> list[str]:
    """Give every BatchNorm of ``model`` the forward above over ``group`` (this stage's dp
    group, None for dp = 1); returns their names."""
    names = []
    for name, module in model.named_modules():
        if is_batchnorm(module):
            module.forward = functools.partial(_forward, module, group)
            names.append(name)
    return names


def reset_buffers(model: nn.Module) -> None:
    """Initial running statistics (mean 0, var 1, count 0) after ``to_empty``."""
    for module in model.modules():
        if is_batchnorm(module) and module.track_running_stats:
            module.reset_running_stats()
