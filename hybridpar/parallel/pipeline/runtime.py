"""The interpreter of a pipeline schedule: runs one rank's action list on real tensors.

The list is cut into what is issued at once by ``schedules.steps`` and each message's peer is
``schedules.peer_rank``: the very rules the simulator uses when it checks the list, so the
runtime executes exactly what was proven deadlock-free. A batch of SEND/RECV actions is posted
with ``batch_isend_irecv``; its receives are waited on at once, its sends only when the step ends
(or earlier, once complete, to free their buffers), as the simulator's ``sends="deferred"``
models: a stage that finished a forward goes on instead of waiting for its neighbour to post the
receive. A transport that returns one handle for the whole batch (NCCL's coalesced group) gets
that handle waited on at once, the simulator's ``"blocking"``; ``check`` proves both. With pp=1
the list is just F0 B0 F1 B1 ...: plain gradient accumulation through the same code.
"""
from __future__ import annotations

import contextlib

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ...reliability.watchdog import activity
from .boundaries import Boundary, as_tuple, check_boundary
from .schedules import Action, Op, peer_rank, steps


@dataclass
class StepState:
    """Tensors in flight for one optimizer step, keyed by (chunk, micro-batch)."""

    inputs: dict = field(default_factory=dict)      # received activations: tuples of tensors
    outputs: dict = field(default_factory=dict)     # stage outputs, or the loss on the last stage
    grads_in: dict = field(default_factory=dict)    # received output gradients: tuples
    losses: dict = field(default_factory=dict)      # last stage: detached per-mb loss
    metrics: dict = field(default_factory=dict)     # last stage, evaluation: per-mb eval_fn
    max_in_flight: int = 0
    working_bytes: int = 0                          # the step's working weights (bf16/fp16)
    sending: list = field(default_factory=list)     # deferred sends: (work, tensor) in flight


@dataclass
class PipelineRunner:
    """Executes actions for one rank. ``chunks`` are this rank's model pieces (one unless
    interleaved); ``boundaries[v]`` is what virtual stage v sends to v+1 (a tuple of tensor
    shapes and dtypes); ``loss_fn(output, targets)`` is the mean loss of a micro-batch."""

    chunks: list
    mesh: object
    n_microbatches: int
    boundaries: list[Boundary]
    loss_fn: Callable
    eval_fn: Callable | None = None  # (output, targets) -> metric tensor, in evaluation only
    on_action: Callable | None = None  # (action, t_start, t_end) for tracing
    action_cpu: float = 0.0  # this thread's CPU seconds in the action just done (on_action reads it)
    meter: object | None = None  # memory.ActivationMeter
    sends: str | None = None  # the simulator's name for what the transport did: set by _comm

    def _vstage(self, chunk: int) -> int:
        return chunk * self.mesh.layout.pp + self.mesh.pp_rank

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype floating messages travel in: the autocast dtype under bf16/fp16 (half the
        bytes of the fp32 residual stream; one rounding per stage boundary, as a layout already
        moves bf16 roundings elsewhere), None (as they are) in fp32."""
        return getattr(self.chunks[0], "autocast_dtype", None) if self.chunks else None

    def _comm(self, batch: tuple[Action, ...], st: StepState) -> None:
        """One batch of p2p ops. A boundary's tensors travel in tuple order; gradients only for
        its floating tensors, in the same order on both sides; floating tensors wider than the
        wire dtype are cast to it for the trip and back on arrival."""
        group, ops, where, dev = self.mesh.group("pp"), [], [], self.mesh.device
        st.sending = [(w, ts) for w, ts in st.sending if not w.is_completed()]  # free buffers
        wire = self.wire_dtype

        def on_wire(dtype: torch.dtype) -> torch.dtype:
            return wire if (wire is not None and dtype.is_floating_point
                            and dtype.itemsize > wire.itemsize) else dtype

        arrivals = []  # (key, into, received, dtypes): cast back after the wait
        for a in batch:
            key, v = (a.chunk, a.mb), self._vstage(a.chunk)
            peer = self.mesh.stage_rank(peer_rank(self.mesh.pp_rank, a, self.mesh.layout.pp))
            where.append((a.op.name, a.mb, peer))
            if a.op is Op.SEND_F:
                out = as_tuple(st.outputs[key])
                check_boundary(v, out, self.boundaries[v])
                tensors = [t.detach().to(on_wire(t.dtype)).contiguous() for t in out]
            elif a.op is Op.SEND_B:
                ins = st.inputs.pop(key)
                tensors = [(t.grad if t.grad is not None else torch.zeros_like(t)).to(on_wire(t.dtype)).contiguous()
                           for t, m in zip(ins, self.boundaries[v - 1]) if m.has_grad]
            elif a.op is Op.RECV_F:
                metas = self.boundaries[v - 1]
                tensors = [torch.empty(m.shape, dtype=on_wire(m.dtype), device=dev) for m in metas]
                arrivals.append((st.inputs, key, tensors, [m.dtype for m in metas]))
            else:
                metas = [m for m in self.boundaries[v] if m.has_grad]
                tensors = [torch.empty(m.shape, dtype=on_wire(m.dtype), device=dev) for m in metas]
                arrivals.append((st.grads_in, key, tensors, [m.dtype for m in metas]))
            fn = dist.isend if a.op.is_send else dist.irecv
            ops += [dist.P2POp(fn, t, peer, group) for t in tensors]
        activity.mark("pp", comm=True, detail=where)  # for the watchdog: no I/O
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # one handle per op: each completes on its own
            self.sends = "deferred"
            for w, op in zip(works, ops):
                if op.op is dist.isend:
                    st.sending.append((w, op.tensor))  # the buffer lives until the send is done
                else:
                    w.wait()
        else:  # one handle for the batch (NCCL's coalesced group)
            self.sends = "blocking"
            for w in works:
                w.wait()
        for into, key, got, dtypes in arrivals:
            into[key] = tuple(t.to(d) for t, d in zip(got, dtypes))
            if into is st.inputs:
                for t in into[key]:
                    if t.dtype.is_floating_point:
                        t.requires_grad_(True)

    def _forward(self, a: Action, inputs, targets, st: StepState) -> None:
        key, chunk = (a.chunk, a.mb), self.chunks[a.chunk]
        x = as_tuple(inputs[a.mb] if key not in st.inputs else st.inputs[key])
        # the meter counts what the loss keeps too (its softmax: often the largest activation)
        with (self.meter.forward(key) if self.meter is not None else contextlib.nullcontext()):
            out = chunk(*x)
            if self._is_last(a.chunk):
                if self.eval_fn is not None and not torch.is_grad_enabled():
                    st.metrics[a.mb] = self.eval_fn(out, targets[a.mb])
                loss = self.loss_fn(out, targets[a.mb]) / self.n_microbatches
                st.losses[a.mb] = loss.detach()
                out = loss
        st.outputs[key] = out
        st.max_in_flight = max(st.max_in_flight, len(st.outputs))

    def _backward(self, a: Action, st: StepState) -> None:
        key = (a.chunk, a.mb)
        out = st.outputs.pop(key)
        if self.meter is not None:
            self.meter.release(key)
        if self._is_last(a.chunk):
            out.backward()
        else:
            v = self._vstage(a.chunk)
            outs = [t for t, m in zip(as_tuple(out), self.boundaries[v]) if m.has_grad]
            pairs = [(t, g) for t, g in zip(outs, st.grads_in.pop(key)) if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        # a received input stays in st.inputs until SEND_B takes its .grad

    def _is_last(self, chunk: int) -> bool:
        P = self.mesh.layout.pp
        return chunk == len(self.chunks) - 1 and self.mesh.pp_rank == P - 1

    def run(self, actions: list[Action], inputs: list, targets: list) -> StepState:
        st = StepState()
        # this step's working weights (bf16/fp16): cast once, shared by every micro-batch
        working = [w for ch in self.chunks for w in getattr(ch, "cast_weights", list)()]
        st.working_bytes = sum(w.numel() * w.element_size() for w in working)
        if self.meter is not None:  # state, counted once, not an activation per micro-batch
            self.meter.exclude(working)
        try:
            self._run(actions, inputs, targets, st)
        finally:
            for ch in self.chunks:
                if hasattr(ch, "drop_weights"):
                    ch.drop_weights()
        return st

    def _drain(self, st: StepState) -> None:
        """Wait for the step's deferred sends (the simulator's end-of-step wait)."""
        if st.sending:
            activity.mark("pp", comm=True, detail=f"{len(st.sending)} deferred sends")
            for w, _ in st.sending:
                w.wait()
            st.sending.clear()

    def _run(self, actions: list[Action], inputs: list, targets: list, st: StepState) -> None:
        for batch in steps(actions):
            t0, c0 = time.perf_counter(), time.thread_time()
            a = batch[0]
            if a.op.is_comm:
                self._comm(batch, st)
            elif a.op is Op.FWD:
                activity.mark("forward", a.mb)
                self._forward(a, inputs, targets, st)
            else:
                activity.mark("backward", a.mb)
                self._backward(a, st)
            if self.on_action is not None:
                t1, self.action_cpu = time.perf_counter(), time.thread_time() - c0
                for done in batch:
                    self.on_action(done, t0, t1)
        self._drain(st)
