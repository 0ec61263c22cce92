"""Unit times measured on this machine, for planning a model on the machine that will train it.

The meta-device profile (``profile``) times a unit from its FLOPs and bytes at the calibrated
rates of microbenchmarks. That misses what a model's own small kernels cost: on a CPU, the
matmuls inside a ViT block run at about 2/3 of the benchmarked rate (cold caches, 3-D inputs
with a bias, skinny weight-gradient GEMMs) and its small elementwise ops take 5-25 us each
where the calibration says 3. When the plan is for this machine (a profile from ``hybridpar
calibrate``), the units can simply be run instead: every distinct unit is built as the engine
builds it (``apply_tp`` on a fake tp group, so that each shard has its real shape and the
collectives return at once; ``sync_batchnorm``; ``apply_recompute``) and its forward and
backward are timed on real tensors of one micro-batch, alone, with the rank's threads.

    compute(unit, pass, b) = median over ``repeats`` runs, after ``warmup`` runs

Only compute is measured: communication stays modelled (the calibrated collectives, which
know the group sizes and the sharing of the cores), and the planner multiplies the measured
compute by the same oversubscription slow-down as modelled compute.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from ..models.spec import ModelSpec
from ..parallel.pipeline.boundaries import as_tuple
from .profile import _fake_world, _FakeMesh, _loss, unit_key


@contextlib.contextmanager
def _threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously; a CPU has nothing queued)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def time_units(spec: ModelSpec, example, *, b: int, tp: int = 1, sequence_parallel: bool = False,
               recompute: str = "none", dp_sync: bool = False, threads: int = 1,
               device: str = "cpu", autocast_dtype: torch.dtype | None = None, warmup: int = 2,
               repeats: int = 5, ready=None) -> dict[str, tuple[float, float]]:
    """{unit: (forward s, backward s)} of one micro-batch of ``b`` samples on one tp rank
    (``example(b)``: its inputs and targets), under autocast to ``autocast_dtype`` if given; the
    backward includes the recomputation. The units run as a pipeline runs them: forward through
    all of them, each on its predecessor's output detached, then backward through them in
    reverse, each from its successor's input gradient; so each unit finds the caches as a
    training step leaves them (one unit timed over and over would find its weights in cache).
    ``ready()``, if given, is called once the model is built, before any timing."""
    from ..parallel.batchnorm import sync_batchnorm
    from ..parallel.parallelize import Stage, apply_recompute
    from ..parallel.tensor_parallel.apply import apply_tp, style_of

    dev = torch.device(device)
    with _fake_world(tp, dp_sync) as (tp_group, dp_group), _threads(threads):
        torch.manual_seed(0)
        with dev:
            model = spec.build()
        apply_tp(model, _FakeMesh(tp, tp_group), dict(spec.tp_plan), sequence_parallel=sequence_parallel)
        sync_batchnorm(model, dp_group)
        apply_recompute(model, spec, recompute)
        model.to(dev).train()
        vocab_parallel = any("vocab_head" in style_of(dict(spec.tp_plan), u) for u in spec.head)
        inputs, targets = example(b)
        batch = tuple(x.to(dev) for x in as_tuple(inputs))
        targets = targets.to(dev)
        stages = [Stage(model, [name], device_type=dev.type, autocast_dtype=autocast_dtype)
                  for name in spec.units]
        if ready is not None:
            ready()
        fwd: dict[str, list[float]] = {u: [] for u in spec.units}
        bwd: dict[str, list[float]] = {u: [] for u in spec.units}
        for r in range(warmup + repeats):
            xs, runs = batch, []
            for i, stage in enumerate(stages):
                leaves = tuple(x.detach().requires_grad_(i > 0 and x.is_floating_point()) for x in xs)
                _sync(dev)
                t0 = time.perf_counter()
                out = stage(*leaves)
                if i == len(stages) - 1:
                    out = _loss(spec, out, targets, tp_group, vocab_parallel)
                _sync(dev)
                if r >= warmup:
                    fwd[spec.units[i]].append(time.perf_counter() - t0)
                runs.append((leaves, as_tuple(out)))
                xs = as_tuple(out)
            grads = None
            for i in reversed(range(len(stages))):
                leaves, outs = runs[i]
                pairs = [(o, g) for o, g in zip(outs, grads or [None] * len(outs))
                         if o.requires_grad and (grads is None or g is not None)]
                _sync(dev)
                t0 = time.perf_counter()
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                _sync(dev)
                if r >= warmup:
                    bwd[spec.units[i]].append(time.perf_counter() - t0)
                grads = [x.grad for x in leaves]
            model.zero_grad(set_to_none=True)
    return {u: (statistics.median(fwd[u]), statistics.median(bwd[u])) for u in spec.units}

