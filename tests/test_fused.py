"""``fused_linear``: several Linears of one input as one GEMM (forced here with ``fuse=True``: it
fuses on a GPU and under autocast), with the unfused Linears' values and gradients, and without
keeping the concatenated weight for backward; on a CPU in fp32, by default, the Linears one by one."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridpar.models.fused import fused_linear


def _linears(bias: bool, dtype=torch.float64):
    torch.manual_seed(0)
    return tuple(nn.Linear(12, n, bias=bias, dtype=dtype) for n in (8, 4, 4))


def _run(linears, x, fused: bool):
    for lin in linears:
        lin.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    ys = fused_linear(x, linears, fuse=True) if fused else tuple(lin(x) for lin in linears)
    sum((y * torch.arange(y.numel(), dtype=y.dtype).view_as(y).sin()).sum() for y in ys).backward()
    return ys, x.grad, [p.grad for lin in linears for p in lin.parameters()]


@pytest.mark.parametrize("bias", [False, True])
def test_fused_equals_the_separate_linears(bias):
    """Float64: the same values and gradients as k separate Linears, to rounding."""
    linears = _linears(bias)
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    ys, dx, grads = _run(linears, x, True)
    ys0, dx0, grads0 = _run(linears, x, False)
    for a, b in zip((*ys, dx, *grads), (*ys0, dx0, *grads0)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_frozen_weights_get_no_gradient():
    linears = _linears(False)
    linears[1].weight.requires_grad_(False)
    _, dx, _ = _run(linears, torch.randn(2, 12, dtype=torch.float64), True)
    assert dx is not None and linears[1].weight.grad is None and linears[0].weight.grad is not None


def test_mixed_biases_are_refused():
    a, b = nn.Linear(4, 2), nn.Linear(4, 2, bias=False)
    with pytest.raises(ValueError, match="every Linear has a bias or none"):
        fused_linear(torch.randn(1, 4), (a, b))


def _saved(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    return saved


def test_no_weight_copy_is_kept_and_the_input_cast_once():
    """fp32: the saved tensors are the input and the parameters themselves (no concatenated
    weight of 16 rows). bf16 autocast: one bf16 cast of the input is saved, where the three
    unfused Linears keep one each; outputs are bf16 and gradients return in fp32."""
    linears = _linears(False, torch.float32)
    x = torch.randn(6, 12, requires_grad=True)
    saved = _saved(lambda: fused_linear(x, linears, fuse=True))
    params = {p.data_ptr() for lin in linears for p in lin.parameters()}
    assert all(t.data_ptr() in params or t is x for t in saved)
    assert not any(t.shape[0] == 16 for t in saved)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _saved(lambda: fused_linear(x, linears, fuse=True))
        separate = _saved(lambda: [lin(x) for lin in linears])
    casts = lambda ts: [t for t in ts if t.shape == x.shape and t.dtype == torch.bfloat16]  # noqa: E731
    assert len(casts(fused)) == 1 and len(casts(separate)) == 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys, dx, grads = _run(linears, x, True)
        ys0, dx0, grads0 = _run(linears, x, False)
    assert all(y.dtype == torch.bfloat16 for y in ys) and dx.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in grads)
    for a, b in zip(grads, grads0):  # the same bf16 GEMM per weight: the same rounding
        torch.testing.assert_close(a, b)
    # dx: the unfused sum adds three bf16-rounded partial products (half an ulp, 2^-9, each),
    # the fused GEMM rounds the sum once; partial products are of the order of max |dx|
    assert (dx - dx0).abs().max() <= 4 * 2 ** -9 * dx0.abs().max()


def test_meta_device():
    """The planner counts units on the meta device: shapes only, no data."""
    with torch.device("meta"):
        linears = _linears(False, torch.float32)
        ys = fused_linear(torch.empty(2, 3, 12, requires_grad=True), linears, fuse=True)
    assert [tuple(y.shape) for y in ys] == [(2, 3, 8), (2, 3, 4), (2, 3, 4)]


def test_a_cpu_in_fp32_runs_the_linears_one_by_one():
    """Off ``FUSE_ON`` (a CPU) in fp32 each Linear is called as a module: its own GEMM, bit for
    bit the separate Linears, and its hooks run. Under bf16 autocast there it fuses (one cast
    of the input saved, no module call): one rounding of each input-gradient element."""
    from hybridpar.models.fused import FUSE_ON

    assert FUSE_ON == ("cuda",)
    linears = _linears(False, torch.float32)
    calls = []
    for lin in linears:
        lin.register_forward_hook(lambda mod, args, out: calls.append(mod))
    x = torch.randn(2, 3, 12)
    ys = fused_linear(x, linears)
    assert calls == list(linears)
    for y, lin in zip(ys, linears):
        assert torch.equal(y, torch.nn.functional.linear(x, lin.weight))
    calls.clear()
    x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = _saved(lambda: fused_linear(x, linears))
    assert calls == []
    assert len([t for t in saved if t.shape == x.shape and t.dtype == torch.bfloat16]) == 1


def test_training_with_the_fused_path_matches_one_process(monkeypatch, tmp_path):
    """What a GPU runs in fp32, on Gloo: the fused projections through whole training steps
    (tp=2 concatenates each rank's column shards, pp=2, evaluation on), against one process
    also fusing, at the fp32 parity tolerances of tests/test_parity.py (a layout changes only
    the order of additions). The one process is checked to take the fused path."""
    from hybridpar.engine.launch import spawn
    from hybridpar.models import fused
    from hybridpar.testing import (fused_cases_worker, load_case, max_rel_tensor_err, reference,
                                   rel_err, tiny_config)

    cfg = tiny_config(tp=2, pp=2)
    spawn(fused_cases_worker, 4, [("fused", cfg, None)], str(tmp_path))
    got = load_case(str(tmp_path), "fused")
    monkeypatch.setattr(fused, "FUSE_ON", ("cuda", "cpu"))
    calls = []
    apply = fused._FusedLinear.apply
    monkeypatch.setattr(fused._FusedLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    ref = reference(cfg)
    assert calls
    errs = [rel_err(a, b) for a, b in zip(got["losses"], ref["losses"])]
    assert len(errs) == 5 and errs[0] <= 1e-5 and max(errs) <= 1e-4, errs
    assert max_rel_tensor_err(got["grads"], ref["grads"])[0] <= 1e-5
    val = [rel_err(a, b) for a, b in zip(got["val_losses"], ref["val_losses"])]
    assert len(val) == 2 and max(val) <= 1e-4, val
