"""Bucketed gradient all-reduce over the dp group, overlapped with the last backward pass.

Gradients live in flat per-bucket buffers (``p.grad`` is a view), so a bucket is all-reduced
without a copy. Each parameter's gradient is accumulated once per micro-batch; a parameter is
final when it has been accumulated ``n_accum`` times in this step. A bucket whose parameters are
all final is launched asynchronously right away, in bucket order (the same order on every dp
rank, as Gloo and NCCL require), while backward continues on the remaining layers. The pipeline
schedule knows nothing of this: ``finish()`` is the explicit synchronisation step after it.

Result: grad = (1/dp) * sum over dp ranks of the local sum over micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    pending: int = 0
    handle: object | None = None
    launched: bool = False


@dataclass
class GradSync:
    buckets: list[Bucket]
    group: object | None
    n_accum: int
    counts: dict[int, int] = field(default_factory=dict)
    bucket_of: dict[int, int] = field(default_factory=dict)
    next_launch: int = 0
    overlap: bool = True

    @classmethod
    def build(cls, params: list[nn.Parameter], *, group, n_accum: int,
              bucket_bytes: int, overlap: bool = True) -> "GradSync":
        # reverse registration order ~ the order gradients become ready in backward
        order = [p for p in reversed(params) if p.requires_grad]
        groups: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in order:
            nbytes = p.numel() * p.element_size()
            if groups[-1] and size + nbytes > bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        buckets = []
        for ps in groups:
            if not ps:
                continue
            dtype, device = ps[0].dtype, ps[0].device
            buf = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=device)
            offset = 0
            for p in ps:
                p.grad = buf[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            buckets.append(Bucket(ps, buf))
        sync = cls(buckets, group, n_accum, overlap=overlap)
        for i, b in enumerate(buckets):
            for p in b.params:
                sync.bucket_of[id(p)] = i
                if sync.active and overlap:
                    p.register_post_accumulate_grad_hook(sync._on_grad)
        sync.zero_grad()
        return sync

    @property
    def active(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
            b.pending, b.handle, b.launched = len(b.params), None, False
        self.counts.clear()
        self.next_launch = 0

    def _on_grad(self, p: torch.Tensor) -> None:
        n = self.counts.get(id(p), 0) + 1
        self.counts[id(p)] = n
        if n == self.n_accum:
            self.buckets[self.bucket_of[id(p)]].pending -= 1
            self._launch_ready()

    def _launch(self, b: Bucket) -> None:
        b.handle = dist.all_reduce(b.buffer, group=self.group, async_op=True)
        b.launched = True

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].pending == 0:
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1

    def finish(self) -> None:
        """Wait for every bucket (launching those never completed, e.g. unused parameters)
        and turn the sums into means."""
        if not self.active:
            return
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        world = dist.get_world_size(self.group)
        for b in self.buckets:
            b.handle.wait()
            b.buffer.div_(world)
