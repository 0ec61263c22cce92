"""Bucketed gradient reduction over the dp group, overlapped with the last backward pass,
and the ZeRO-1 partitioning of the optimizer (Megatron's distributed optimizer).

Gradients live in flat per-bucket buffers (``p.grad`` is a view), so a bucket is reduced
without a copy. Each parameter's gradient is accumulated once per micro-batch; a parameter is
final when it has been accumulated ``n_accum`` times in this step. A bucket whose parameters are
all final is launched asynchronously right away, in bucket order (the same order on every dp
rank, as Gloo and NCCL require), while backward continues on the remaining layers. The pipeline
schedule knows nothing of this: ``finish()`` is the explicit synchronisation step after it.

Result: grad = (1/dp) * sum over dp ranks of the local sum over micro-batches.

ZeRO-1: bucket buffers are padded to a multiple of dp x ``ALIGN_BYTES`` and rank r owns the
contiguous slice r of each (so every shard starts 128-byte aligned, as NCCL's fast paths want); gradients are reduce-scattered (so a rank's *unowned* slices hold its local, unreduced
sums: nothing may read them), AdamW runs only on the owned slices (its state is 1/dp), and the
updated slices are all-gathered into flat parameter buffers (parameters are views into them).

A parameter that is also summed with a copy on another pipeline stage (the tied embedding and
output head) gets a bucket of its own on both stages, as in Megatron: the two buckets then have
the same size and the same owned slices, so the cross-stage sum of a reduced slice meets the
reduced slice of the same elements, on one code path for Gloo and NCCL.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_gather_flat, reduce_scatter_flat
from ..reliability.watchdog import activity


ALIGN_BYTES = 128
"""Every bucket's shards start on this boundary (NCCL's vectorised kernels need 16 B, its
reduce-scatter and all-gather are fastest on 128 B); padding is < dp x 128 B per bucket."""


@dataclass
class Bucket:
    params: list[nn.Parameter]
    grad: torch.Tensor                      # flat gradients (views: p.grad)
    param_buf: torch.Tensor | None = None   # ZeRO-1: flat parameters (views: p.data)
    pending: int = 0
    handle: object | None = None
    comm: torch.Tensor | None = None        # what is being reduced (a cast copy, or grad)
    launched: bool = False


def _offsets(params: list[nn.Parameter]) -> list[int]:
    out, off = [], 0
    for p in params:
        out.append(off)
        off += p.numel()
    return out


def _weak_hook(method):
    """``method`` as a parameter hook that does not keep its object alive. The hook is held by
    the parameter's autograd metadata, where the garbage collector cannot see it: a strong
    reference makes parameter -> hook -> GradSync -> bucket -> parameter a cycle that is never
    freed, leaking every run's gradient buckets and the process group they reduce over."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)
    return hook


@dataclass
class GradSync:
    buckets: list[Bucket]
    group: object | None
    n_accum: int
    zero1: bool = False
    reduce_dtype: torch.dtype | None = None
    counts: dict[int, int] = field(default_factory=dict)
    bucket_of: dict[int, int] = field(default_factory=dict)
    next_launch: int = 0

    @classmethod
    def build(cls, params: list[nn.Parameter], *, group, n_accum: int, bucket_bytes: int,
              zero1: bool = False, reduce_dtype: torch.dtype | None = None,
              own_bucket: tuple[nn.Parameter, ...] = ()) -> "GradSync":
        """``own_bucket``: parameters that get a bucket to themselves (shared across stages)."""
        # reverse registration order ~ the order gradients become ready in backward
        order = [p for p in reversed(params) if p.requires_grad]
        alone = {id(p) for p in own_bucket}
        groups: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in order:
            nbytes = p.numel() * p.element_size()
            if groups[-1] and (size + nbytes > bucket_bytes or id(p) in alone
                               or id(groups[-1][-1]) in alone):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        dp = dist.get_world_size(group) if group is not None else 1
        buckets = []
        for ps in [g for g in groups if g]:
            n = sum(p.numel() for p in ps)
            dtype, device = ps[0].dtype, ps[0].device
            unit = dp * max(1, ALIGN_BYTES // ps[0].element_size())  # aligned shards
            padded = -(-n // unit) * unit
            b = Bucket(ps, torch.zeros(padded, dtype=dtype, device=device))
            if zero1:
                b.param_buf = torch.zeros(padded, dtype=dtype, device=device)
            for p, off in zip(ps, _offsets(ps)):
                p.grad = b.grad[off:off + p.numel()].view_as(p)
                if zero1:
                    b.param_buf[off:off + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = b.param_buf[off:off + p.numel()].view_as(p)
            buckets.append(b)
        sync = cls(buckets, group, n_accum, zero1=zero1, reduce_dtype=reduce_dtype)
        for i, b in enumerate(buckets):
            for p in b.params:
                sync.bucket_of[id(p)] = i
                if sync.active:
                    p.register_post_accumulate_grad_hook(_weak_hook(sync._on_grad))
        sync.zero_grad()
        return sync

    @property
    def active(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1

    @property
    def dp(self) -> int:
        return dist.get_world_size(self.group) if self.active else 1

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()
            b.pending, b.handle, b.comm, b.launched = len(b.params), None, None, False
        self.counts.clear()
        self.next_launch = 0

    def _on_grad(self, p: torch.Tensor) -> None:
        n = self.counts.get(id(p), 0) + 1
        self.counts[id(p)] = n
        if n == self.n_accum:
            self.buckets[self.bucket_of[id(p)]].pending -= 1
            self._launch_ready()

    def _launch(self, b: Bucket) -> None:
        b.comm = b.grad if self.reduce_dtype is None else b.grad.to(self.reduce_dtype)
        if self.zero1:
            out = torch.empty_like(b.comm.chunk(self.dp)[0])
            b.handle = reduce_scatter_flat(out, b.comm, self.group, async_op=True)
            b.comm = out
        else:
            b.handle = dist.all_reduce(b.comm, group=self.group, async_op=True)
        b.launched = True

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].pending == 0:
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1

    def shard_range(self, b: Bucket) -> tuple[int, int]:
        """The slice of a bucket this dp rank owns under ZeRO-1 (everything otherwise)."""
        if not (self.zero1 and self.active):
            return 0, b.grad.numel()
        size = b.grad.numel() // self.dp
        r = dist.get_rank(self.group)
        return r * size, (r + 1) * size

    def owned_range(self, p: nn.Parameter) -> tuple[int, int]:
        """The flat elements [a, e) of ``p.grad`` this rank owns after ``finish`` (all of them
        without ZeRO-1): the only ones that hold the dp mean."""
        b = self.buckets[self.bucket_of[id(p)]]
        off = next(o for q, o in zip(b.params, _offsets(b.params)) if q is p)
        lo, hi = self.shard_range(b)
        a = min(max(lo - off, 0), p.numel())
        return a, max(a, min(hi - off, p.numel()))

    def owned_grad(self, p: nn.Parameter) -> torch.Tensor:
        a, e = self.owned_range(p)
        return p.grad.view(-1)[a:e]

    def finish(self) -> None:
        """Wait for every bucket (launching those never completed, e.g. unused parameters)
        and turn the sums into means."""
        if not self.active:
            return
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        n = len(self.buckets)
        for i, b in enumerate(self.buckets):
            outer = activity.enter("dp all-reduce", f"bucket {i + 1}/{n}")  # watchdog: no I/O
            b.handle.wait()
            activity.leave(outer)
            lo, hi = self.shard_range(b)
            if b.comm is not b.grad:
                b.grad[lo:hi].copy_(b.comm)
            b.grad[lo:hi].div_(self.dp)

    def segments(self):
        """ZeRO-1: (param, flat param slice, flat grad slice) for each owned piece of a param."""
        for b in self.buckets:
            lo, hi = self.shard_range(b)
            for p, off in zip(b.params, _offsets(b.params)):
                a, e = max(lo, off), min(hi, off + p.numel())
                if a < e:
                    yield p, b.param_buf[a:e], b.grad[a:e]

    def gather_params(self) -> None:
        """ZeRO-1, after the optimizer step: every rank gets every updated slice."""
        if not (self.zero1 and self.active):
            return
        for i, b in enumerate(self.buckets):
            lo, hi = self.shard_range(b)
            outer = activity.enter("dp all-gather (ZeRO-1)", f"bucket {i + 1}/{len(self.buckets)}")
            all_gather_flat(b.param_buf, b.param_buf[lo:hi].clone(), self.group)
            activity.leave(outer)
