"""Several Linears of one input as one GEMM, the parameters kept apart.

``Y = X [W_1; ...; W_k]^T (+ [b_1; ...; b_k])``, split back into the k outputs. One larger GEMM
instead of k smaller ones (Megatron's fused q/k/v and w1/w3), in forward and in both backward
products. The parameters stay separate Linears, so their names, checkpoints, Hugging Face
interop and tensor-parallel shards are those of the unfused model: under tp each rank
concatenates its own column shards, which is the fused weight's strided shard.

The concatenated weight is not saved for backward: it is rebuilt there, a weight-sized copy for
the length of one GEMM, so a pipeline stage with many micro-batches in flight keeps no copy per
micro-batch (the engine's bf16 working weights are already cast; other fp32 weights under
autocast are cast and kept as F.linear keeps them). Under autocast the input is cast once (the
unfused Linears each keep their own cast of it) and the GEMMs run in the autocast dtype, as
F.linear's would; gradients return to each parameter's dtype.

Where it runs: on a GPU, where one launch and one larger GEMM beat several, and under bf16/fp16
autocast on any device, where it is the more accurate: each input-gradient element is one GEMM
rounded once to the compute dtype, where k separate Linears round k partial products and add
them in that dtype (an fp16 run of 5 steps at dp=tp=pp=2 drifted from one process by 4.9e-3 in
its last loss unfused, 8.8e-4 fused). In fp32 on a CPU the Linears run one by one (the same
products, so the same values to rounding): there the GEMMs run near the core's peak at any of
these sizes, and the fused path's copies (the weights concatenated in each pass, the output
gradients concatenated by the split's backward, the silu and product read from strided
halves) cost more than the larger GEMM saves. Measured here, default model, fused against
separate steps alternating: one process 1.740 / 1.699 s of CPU a step (+2.4%); a step's time
at dp=2 1.019 / 0.993 s (+2.6%), at pp=2 1F1B 1.482 / 1.375 and 1.344 / 1.243 s (+8%).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _autocasting(dev: str) -> bool:
    """Whether autocast is on for device type ``dev`` (its GEMMs then run in its lower dtype)."""
    return torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)


class _FusedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, *params):
        weights, biases = params[:n], params[n:]
        dev, dtype = x.device.type, x.dtype
        if x.is_floating_point() and _autocasting(dev):
            dtype = torch.get_autocast_dtype(dev)
        xc, wc = x.to(dtype), [w.to(dtype) for w in weights]  # no copy when already in dtype
        b = torch.cat([b.to(dtype) for b in biases]) if biases else None
        y = F.linear(xc, torch.cat(wc), b)  # operands in the autocast dtype: autocast leaves them
        ctx.n, ctx.has_bias = n, bool(biases)
        ctx.save_for_backward(xc, *wc)  # what F.linear under autocast would keep
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, *weights = ctx.saved_tensors
        dy = dy.to(xc.dtype)
        sizes = [w.shape[0] for w in weights]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy @ torch.cat(weights)
        dy2 = dy.reshape(-1, dy.shape[-1])  # tokens x outputs
        if any(ctx.needs_input_grad[2:2 + ctx.n]):
            dw = (dy2.t() @ xc.reshape(-1, xc.shape[-1])).split(sizes)
        if ctx.has_bias:
            db = dy2.sum(0).split(sizes)
        return dx, None, *(dw or [None] * ctx.n), *(db or [None] * ctx.n * ctx.has_bias)


FUSE_ON = ("cuda",)
"""Device types whose GEMMs are fused in every precision (module docstring: where it runs)."""


def fuses(x: torch.Tensor) -> bool:
    """Whether ``fused_linear`` fuses for this input: its device is in ``FUSE_ON``, or autocast
    computes in a lower precision there."""
    return x.device.type in FUSE_ON or _autocasting(x.device.type)


def fused_linear(x: torch.Tensor, linears: tuple[nn.Linear, ...], *,
                 fuse: bool | None = None) -> tuple[torch.Tensor, ...]:
    """``tuple(lin(x) for lin in linears)``, computed as one GEMM where ``fuses(x)`` (or
    ``fuse`` says so; module docstring). The Linears must all have a bias or none."""
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("fused_linear: either every Linear has a bias or none does")
    if not (fuses(x) if fuse is None else fuse):
        return tuple(lin(x) for lin in linears)
    params = [lin.weight for lin in linears] + ([lin.bias for lin in linears] if all(has_bias) else [])
    y = _FusedLinear.apply(x, len(linears), *params)
    return y.split([lin.weight.shape[0] for lin in linears], dim=-1)
