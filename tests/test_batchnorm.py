"""BatchNorm synchronised over data parallelism (``parallel/batchnorm.py``) against torch's
BatchNorm on the whole batch in one process, computed in float64: every rank holds a slice of
the rows, and the layer must give each rank its slice of the single-process output and input
gradient, parameter gradients that sum over the ranks to the single-process ones, and the
same running statistics. The closed-form backward is what is under test: a wrong sum (a
missing all-reduce, local counts, one term of dx dropped) moves dx by O(1)."""
from __future__ import annotations

CASES = {  # name: (shape of the whole batch, affine, momentum, offset of the inputs)
    "2d": ((6, 5, 4, 3), True, 0.1, 0.0),
    "1d-no-affine": ((6, 4, 7), False, None, 0.0),
    "offset": ((6, 3, 5, 5), True, 0.1, 100.0),  # |mean| = 100 std: no cancellation in the sums
}


def _cases() -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    from hybridpar.parallel.batchnorm import sync_batchnorm

    dist.init_process_group("gloo")
    out = {}
    try:
        n, r = dist.get_world_size(), dist.get_rank()
        for name, (shape, affine, momentum, offset) in CASES.items():
            g = torch.Generator().manual_seed(len(name))
            X = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + offset
            G = torch.randn(shape, generator=g, dtype=torch.float64)
            C = shape[1]
            cls = nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d
            ref = cls(C, affine=affine, momentum=momentum).double()
            if affine:
                with torch.no_grad():
                    ref.weight.copy_(torch.randn(C, generator=g, dtype=torch.float64))
                    ref.bias.copy_(torch.randn(C, generator=g, dtype=torch.float64))
            ours = cls(C, affine=affine, momentum=momentum)
            ours.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
            sync_batchnorm(ours, dist.group.WORLD)
            Xr = X.clone().requires_grad_(True)
            (ref(Xr) * G).sum().backward()
            x = X.chunk(n)[r].float().requires_grad_(True)
            y = ours(x)
            (y * G.chunk(n)[r].float()).sum().backward()
            with torch.no_grad():
                # the training output of the reference, recomputed from its batch statistics
                var, mean = torch.var_mean(X, dim=[0, *range(2, X.dim())], unbiased=False)
                view = (1, -1) + (1,) * (X.dim() - 2)
                Y = (X - mean.view(view)) / torch.sqrt(var.view(view) + ref.eps)
                if affine:
                    Y = Y * ref.weight.view(view) + ref.bias.view(view)
            grads = [ours.weight.grad, ours.bias.grad] if affine else []
            for t in grads:
                dist.all_reduce(t)
            scale = lambda t: float(t.abs().max())  # noqa: E731
            err = {
                "y": float((y.detach().double() - Y.chunk(n)[r]).abs().max()) / scale(Y),
                "dx": float((x.grad.double() - Xr.grad.chunk(n)[r]).abs().max()) / scale(Xr.grad),
                "running_mean": float((ours.running_mean.double() - ref.running_mean).abs().max())
                / scale(ref.running_mean),
                "running_var": float((ours.running_var.double() - ref.running_var).abs().max())
                / scale(ref.running_var),
                "batches": int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 1,
            }
            if affine:
                err["dw"] = float((grads[0].double() - ref.weight.grad).abs().max()) / scale(ref.weight.grad)
                err["db"] = float((grads[1].double() - ref.bias.grad).abs().max()) / scale(ref.bias.grad)
            out[name] = err
        return out
    finally:
        dist.destroy_process_group()


def test_sync_batchnorm_matches_one_process_on_the_whole_batch():
    from hybridpar.engine.launch import spawn

    got = spawn(_cases, 3)
    for rank, res in got.items():
        for name, err in res.items():
            assert err.pop("batches"), (rank, name)
            # float32 against float64: each value is a few fp32 roundings of O(1) terms
            # (relative 1e-7 each) after normalising; the offset case normalises x ~ 100 with
            # std 3, so x - mean loses log2(100/3) ~ 5 bits: up to ~4e-6 relative there
            bound = 3e-5 if CASES[name][3] else 2e-6
            assert max(err.values()) < bound, (rank, name, err)
