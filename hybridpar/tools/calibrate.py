"""``hybridpar calibrate --out PROFILE.json``: measure this machine for the planner.

  matmul      achieved FLOP/s of the default model's matmul shapes (forward, input-gradient and
              weight-gradient products of each), at 1 .. cores threads (threads per rank)
  weights     the bandwidth at which a matmul reads a weight not in cache (the table is hot)
  memory      the elementwise bandwidth that, with the matmul table and the overheads,
              reproduces the measured step of the default model trained in one process
  collectives Gloo all-reduce, all-gather and send/recv (the runtime's own wrappers, via
              ``bench.collectives``) in groups of 2/4/8 ranks, alone and as k/n concurrent
              groups of a world of k (a dp x tp layout's tp groups), each call between two
              matmuls as in training (its cost: the loop's time minus the matmuls'):
              alpha + beta * bytes fitted to 5 sizes; and the latency back to back (alpha0),
              which the planner interpolates to the compute a model has between its calls;
              and the core time of a send/recv op beyond the wall time's (process CPU, Gloo's
              thread included, less the matmuls'), which a pipeline's messages take from compute
  oversubscription  the slow-down of k concurrent 1-thread processes doing a block's work, and
              doing the trainer's optimizer update (which shares the memory bandwidth too)
  probe       a reference block's time at the start, around the compute tables and at the
              end: the matmul and convolution tables are scaled to the mean of the four (a
              table timed while the machine ran slow, here up to 22% between start and end,
              would cost every model on it that much high), and the mean is the speed the
              profile was measured at, to compare with the machine's later (``speed_drift``)
  overhead    the framework's fixed cost: a tiny block's forward+backward (per layer, pure
              dispatch), a tiny model's training step at 1 and 8 micro-batches (per F/B action
              and per step), and AdamW + gradient norm + zeroing per parameter

The ranks of a CPU share its cores; the profile records the core count and the planner slows
compute by the measured oversubscription (see ``Cluster.contention``), the collectives being
measured with all the world's ranks running.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from dataclasses import replace

from ..engine.env import usable_cores
from ..planner.cluster import Cluster, Link, save_profile


def _timeit(fn, min_s: float = 0.03, reps: int = 5) -> float:
    """Median over ``reps`` of the mean seconds per call over >= ``min_s``: the typical time,
    as a training step's median is (a best-of would predict the luckiest step)."""
    return _timeit_many([fn], min_s, reps)[0]


def _timeit_many(fns, min_s: float = 0.03, reps: int = 5) -> list[float]:
    """``_timeit`` of each of ``fns``, their repetitions interleaved: this machine's speed
    drifts by tens of percent from minute to minute, and a difference or ratio of two timings
    taken one after the other (cold - hot, backward - forward) carries the drift between them;
    taken in turns, both see the same machine."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            n, t0 = 0, time.perf_counter()
            while True:
                fn()
                n += 1
                dt = time.perf_counter() - t0
                if dt >= min_s:
                    break
            out.append(dt / n)
    return [statistics.median(t) for t in times]


def matmul_table(threads: int) -> list[tuple[float, float]]:
    """[(flops of one product, FLOP/s)] over the default model's shapes, tokens 128 .. 4096."""
    import torch

    from ..config import ModelConfig

    torch.set_num_threads(threads)
    m = ModelConfig()
    rows = {}
    for n in (128, 512, 2048, 4096):
        for tp in (1, 2, 4):
            for k, j in ((m.d_model, m.d_model // tp), (m.d_model, m.d_ff // tp), (m.d_ff // tp, m.d_model)):
                x, w, gy = torch.randn(n, k), torch.randn(k, j), torch.randn(n, j)
                t = (_timeit(lambda: x @ w) + _timeit(lambda: gy @ w.T) + _timeit(lambda: x.T @ gy)) / 3
                flops = 2.0 * n * k * j
                rows[flops] = max(rows.get(flops, 0.0), flops / t)
    return sorted(rows.items())


def weight_bw(threads: int, tokens: int = 64, rotate: int = 64 << 20) -> float:
    """Bytes/s at which a matmul reads a weight that is not in cache, beyond the table's (hot)
    time: the default model's weights at ``tokens`` rows, forward (x @ w) and input gradient
    (gy @ w.T), each timed on one weight again and again, then cycling through copies filling
    ``rotate`` bytes (past the caches, as a training step's weights are between their uses);
    the median of weight bytes / (cold - hot). A weight-gradient product reads activations,
    not weights: it costs the same either way (measured), and is not a point here."""
    import torch

    from ..config import ModelConfig

    torch.set_num_threads(threads)
    m, rates = ModelConfig(), []
    for k, j in ((m.d_model, m.d_model), (m.d_model, m.d_ff), (m.d_ff, m.d_model)):
        ws = [torch.randn(k, j) for _ in range(max(2, rotate // (4 * k * j)))]
        x, gy = torch.randn(tokens, k), torch.randn(tokens, j)
        for product in (lambda w: x @ w, lambda w: gy @ w.T):
            turn = iter(range(1 << 62))
            hot, cold = _timeit_many([lambda: product(ws[0]), lambda: product(ws[next(turn) % len(ws)])])
            rates.append(4 * k * j / max(cold - hot, 1e-9))
    return min(statistics.median(rates), 1e13)


CONV_SHAPES = tuple((c, h, 1) for c in (4, 8, 16, 32, 64, 128, 256) for h in (2, 4, 8, 16, 32)
                    if c <= 64 or h <= 16) + tuple((c, h, 2) for c in (4, 8, 16, 32, 64, 128)
                                                   for h in (4, 8, 16, 32) if c <= 32 or h <= 16)
"""(input channels, input size, stride) of the convolution table: every width at several sizes,
C -> C at stride 1 and the downsampling C -> 2C at stride 2."""


def conv_table(threads: int, draws: int = 6, shapes=CONV_SHAPES
               ) -> tuple[list[tuple[float, float, float, int]], list[tuple[float, float, float, int]]]:
    """([(flops, FLOP/s, channels, stride)] forward, the same backward) of 3x3 convolutions of a
    CNN's shapes (8 images, C -> C channels at H x H, each C at H = 2 .. 32, and the downsampling
    C -> 2C at stride 2, whose channels are the geometric mean sqrt(2) C); a backward computes
    the input and weight gradients, twice the FLOPs. The rate depends on the width as well as
    the FLOPs (here a 16-channel convolution runs at 70 GFLOP/s, a 64-channel one of the same
    FLOPs at 110), so each width has its own row, and on the stride: a strided backward ran at
    30 GFLOP/s where a stride-1 one of the same FLOPs and width ran at 60, and a ResNet's
    transition blocks were costed 35% under their time. A rate by FLOPs alone cannot tell
    kernel sizes apart either (a 1x1 convolution of the same FLOPs runs several times faster
    here): the table is of the 3x3 kernels CNNs spend their time in.

    Each shape is timed with its tensors at ``draws`` random offsets within a page, and its
    time is their mean: on this CPU a convolution ran at half speed with some placements of its
    tensors (50 against 100 GFLOP/s, 32 channels at 32 x 32; 4 KiB aliasing between the loads
    of one and the stores of another), and a training step's tensors land anywhere. The mean
    leaves out draws over 3x the median, the machine's stalls: one draw read 8x (a strided
    backward at 2.4 ms where its other draws and later timings read 0.3-0.6). The
    draws are taken in rounds over all the shapes, so that each shape's mean spans the whole
    table's time: timed one shape after another, the machine's drift between seconds went into
    the widths' ratios (32 channels at 8 x 8 read 62 GFLOP/s where the same shape read 72-80 in
    four later tables, 16 and 64 channels 75 and 83), and the planner costed the ResNet's
    32-channel blocks 42% above its 64-channel ones, which ran within 10% of them in a loop."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    pick = random.Random(0)

    def placed(*shape: int) -> torch.Tensor:
        """A normal tensor at a random 64-byte offset within a page (a fresh tensor of one size
        lands at the same offset every time)."""
        n = math.prod(shape)
        off = 16 * pick.randrange(64)
        return torch.empty(n + 1024)[off:off + n].view(shape).normal_()

    t_f: list[list[float]] = [[] for _ in shapes]
    t_b: list[list[float]] = [[] for _ in shapes]
    for _ in range(draws):
        for i, (c, h, s) in enumerate(shapes):
            x = placed(8, c, h, h).requires_grad_()
            w = placed(c * s, c, 3, 3).requires_grad_()
            g = placed(8, c * s, h // s, h // s)
            f, fb = _timeit_many([lambda: F.conv2d(x, w, stride=s, padding=1),
                                  lambda: torch.autograd.grad(F.conv2d(x, w, stride=s, padding=1), (x, w), g)],
                                 min_s=0.02, reps=2)
            t_f[i].append(f)
            t_b[i].append(fb - f)
    fwd, bwd = [], []
    for (c, h, s), tf, tb in zip(shapes, map(_mean_of_draws, t_f), map(_mean_of_draws, t_b)):
        flops = 2.0 * 8 * c * c * s * 9 * (h // s) ** 2
        for rows, f, t in ((fwd, flops, tf), (bwd, 2 * flops, tb)):
            if t > 0:
                rows.append((f, f / t, c * s ** 0.5, s))
    return sorted(fwd), sorted(bwd)


def _mean_of_draws(xs: list[float]) -> float:
    """The mean of ``xs`` without the draws over 3x their median: a placement's slow-down (up
    to 2x) is kept, a stall of the machine is not."""
    med = statistics.median(xs)
    kept = [x for x in xs if x <= 3 * med]
    return sum(kept) / len(kept)


def _median_step(model, *, mb: int, microbatches: int, threads: int, data, steps: int, warmup: int) -> float:
    """Median seconds of a training step after ``warmup`` of ``steps``, in one process, through
    the ``Trainer`` (dispatch, hooks, loss and optimizer as the runtime pays them)."""
    return _median_steps([(model, mb, microbatches)], threads=threads, data=data, steps=steps,
                         warmup=warmup)[0]


def _median_steps(runs, *, threads: int, data, steps: int, warmup: int) -> list[float]:
    """``_median_step`` of each (model, micro-batch size, micro-batches) of ``runs``, their steps
    taken in turns (one of each, then again) so that differences between them do not carry the
    machine's drift (``_timeit_many``)."""
    from ..config import Config, ParallelConfig, TrainConfig
    from ..parallel.mesh import single_mesh
    from ..engine.train import Trainer

    trainers = [Trainer(Config(model=model, parallel=ParallelConfig(dp=1, microbatches=microbatches),
                               train=TrainConfig(global_batch=mb * microbatches, steps=100, eval_every=0,
                                                 progress=False, threads_per_rank=threads)),
                        single_mesh(), dataset=data) for model, mb, microbatches in runs]
    times: list[list[float]] = [[] for _ in runs]
    for i in range(steps):
        for trainer, out in zip(trainers, times):
            t = trainer.train_step()["step_time_s"]
            if i >= warmup:
                out.append(t)
    return [statistics.median(t) for t in times]


def elementwise_bw(threads: int, table: list[tuple[float, float]], overhead: dict,
                   weights: float = 0.0) -> float:
    """The elementwise bandwidth with which the cost model reproduces real training steps of the
    default model in one process at ``threads`` threads (through the ``Trainer``: dispatch,
    hooks, loss and optimizer as the runtime pays them), at 2 and 8 sequences per micro-batch.
    The planner's compute is so anchored to what this machine does with a whole step, and the
    matmul table carries it to other shapes. (A plain add streams far faster than norms, RoPE,
    SDPA and SiLU with their autograd bookkeeping do; only the total matters.)"""
    import torch

    from ..config import ModelConfig
    from ..testing import tiny_dataset
    from ..planner.costs import Plan
    from ..planner.timing import predict_time

    torch.set_num_threads(threads)
    m, data, rates = ModelConfig(), tiny_dataset(), []
    for mb in (2, 8):
        measured = _median_step(m, mb=mb, microbatches=2, threads=threads, data=data, steps=8, warmup=2)
        plan = Plan(dp=1, tp=1, pp=1, mb_size=mb, microbatches=2, schedule="1f1b")

        def predicted(bw: float) -> float:
            probe = Cluster(name="probe", devices_per_node=1, cores=threads, matmul={threads: table},
                            mem_bw={threads: bw}, weight_bw={threads: weights} if weights else {},
                            overhead=overhead, backend="gloo", dtype_bytes=4)
            return predict_time(m, plan, probe).step_time

        # the step is t0 + bytes / bw: two predictions give both
        at_1, at_2 = predicted(1e10), predicted(2e10)
        nbytes, t0 = 2 * (at_1 - at_2) * 1e10, 2 * at_2 - at_1
        rates.append(nbytes / max(measured - t0, 0.1 * measured))
    return statistics.median(rates)


def overheads() -> dict[str, float]:
    """Fixed seconds per layer (forward + backward, and the forward's share as a tiny block's
    forward alone takes), per F/B action and per step, fitted to
    t(L, M) = step + M (2 action + L layer) over training steps of a tiny model (so dispatch,
    the activation meter's and the gradient hooks are counted as the runtime pays them), and
    AdamW + gradient norm + zeroing per parameter."""
    import torch

    from ..config import ModelConfig
    from ..models.transformer import Block, Rotary
    from ..testing import tiny_dataset

    torch.set_num_threads(1)
    tiny = ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, seq_len=8)
    block = Block(tiny, Rotary(tiny.head_dim, tiny.rope_theta))
    x = torch.randn(1, 8, 16, requires_grad=True)
    # the forward records the graph, as in training
    bare, forward = _timeit_many([lambda: block(x).sum().backward(), lambda: block(x).sum()], min_s=0.2)
    runs = [(L, M) for L in (1, 4) for M in (1, 8)]
    t = dict(zip(runs, _median_steps([(replace(tiny, n_layers=L), 1, M) for L, M in runs], threads=1,
                                     data=tiny_dataset(), steps=25, warmup=5)))
    per_mb = {L: (t[L, 8] - t[L, 1]) / 7 for L in (1, 4)}
    layer = max(bare, (per_mb[4] - per_mb[1]) / 3)
    update, n = _optimizer_update()
    per_param = _timeit(update, min_s=0.2) / n
    return {"layer": layer, "layer_fwd": layer * min(max(forward / bare, 0.1), 0.9),
            "action": max(0.0, (per_mb[1] - layer) / 2), "comm": 0.0,
            "step": max(0.0, t[1, 1] - per_mb[1]), "param": per_param}


def _optimizer_update():
    """One rank's update of the default model's parameters as the trainer runs it: the float64
    gradient norms, scaling (clipping), AdamW as ``build_optimizer`` makes it (multi-tensor,
    decay on matrices), zeroing. Memory-bound: it streams parameters, gradients and moments.
    Returns (the update, the parameter count)."""
    import torch

    from ..config import ModelConfig
    from ..models import spec_for
    from ..parallel.parallelize import _norms64

    params = [p for p in spec_for(ModelConfig()).build().parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-3, foreach=True)

    def update():
        sum(n * n for n in _norms64([p.grad for p in params]))
        torch._foreach_mul_([p.grad for p in params], 0.5)
        opt.step()
        for p in params:
            p.grad.zero_()
    return update, sum(p.numel() for p in params)


def _optimizer_work():
    """The optimizer's update alone, as ``oversubscription``'s work."""
    return _optimizer_update()[0]


def _block_work():
    """Train-like compute of one rank: a default-model block's forward+backward."""
    import torch

    from ..config import ModelConfig
    from ..models.transformer import Block, Rotary

    m = ModelConfig()
    block = Block(m, Rotary(m.head_dim, m.rope_theta))
    x = torch.randn(4, m.seq_len, m.d_model, requires_grad=True)
    return lambda: block(x).sum().backward()


def speed_probe() -> float:
    """Seconds of the reference work (``_block_work``) on 1 thread: ``Cluster.probe_s``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _timeit(_block_work(), min_s=0.2)
    finally:
        torch.set_num_threads(threads)


def speed_drift(c: Cluster, probe: float | None = None) -> str:
    """One line comparing this machine's speed now (``probe``, else timed) with the profile's:
    a prediction made from a profile is off by at least this much, whatever the model."""
    if not c.probe_s:
        return "machine speed: the profile has no reference timing (calibrate again to record one)"
    now = speed_probe() if probe is None else probe
    return (f"machine speed: reference block {1e3 * now:.1f} ms now, {1e3 * c.probe_s:.1f} ms at "
            f"calibration ({now / c.probe_s - 1:+.0%})")


def _loop(make, inbox, out) -> None:
    """One 1-thread process doing ``make()``'s work: for each (start, seconds) from ``inbox``,
    in a loop from ``start`` (``time.monotonic``, one clock for all processes) for ``seconds``,
    then the seconds per iteration to ``out``; None ends it."""
    import torch

    torch.set_num_threads(1)
    work = make()
    work()
    out.put(None)  # ready
    while (job := inbox.get()) is not None:
        start, seconds = job
        time.sleep(max(0.0, start - time.monotonic()))
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            work()
            n += 1
        out.put((time.perf_counter() - t0) / n)


def oversubscription(ks: tuple[int, ...] = (1, 2, 4, 8), seconds: float = 1.0, rounds: int = 3,
                     work=_block_work) -> dict[int, float]:
    """Slow-down of each of k concurrent 1-thread processes doing ``work`` (a block's compute,
    or the optimizer's memory-bound update), against one alone: what k ranks sharing the cores
    (and the memory bandwidth) really cost (ideal for compute: max(1, k / cores)). The k-process
    runs and the one alone are taken in turns, ``rounds`` times, by processes kept alive
    between them; the median of each round's ratio (as ``_timeit_many``, so the machine's
    drift cancels)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(max(ks))]
    procs = [ctx.Process(target=_loop, args=(work, q, out), daemon=True) for q in inboxes]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            out.get(timeout=600)  # every process has imported torch and warmed up
        ratios: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(rounds):
            per_iter = {}
            for k in ks:
                start = time.monotonic() + 0.05
                for q in inboxes[:k]:
                    q.put((start, seconds))
                per_iter[k] = statistics.mean(out.get(timeout=600) for _ in range(k))
            for k in ks:
                ratios[k].append(per_iter[k] / per_iter[ks[0]])
    finally:
        for q in inboxes:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
    return {k: statistics.median(r) for k, r in ratios.items()}


def _fit(points: list[tuple[float, float]]) -> list[float]:
    """alpha, beta of t = alpha + beta * bytes, least squares on relative error."""
    import numpy as np

    x = np.array([[1.0, b] for b, _ in points])
    t = np.array([s for _, s in points])
    w = 1.0 / t
    (alpha, beta), *_ = np.linalg.lstsq(x * w[:, None], t * w, rcond=None)
    return [max(float(alpha), 0.0), max(float(beta), 0.0)]


def _collectives_worker(sizes: list[int], iters: int, n: int) -> dict | None:
    """Fits of each op in groups of ``n`` consecutive ranks (as tp groups are), every group of
    the world measuring at once: with more ranks than cores, a peer that is not running when a
    collective starts must first be scheduled, which a group alone on the machine never pays.

    Each fit is [alpha, beta, alpha0, gap]: alpha + beta * bytes between two matmuls of
    ``gap`` seconds each (as measured here, under the world's contention), and alpha0, the
    latency of the same op issued back to back (no compute between calls, beta as fitted).
    The latency grows with the compute between calls (the ranks drift apart and a waiting
    peer sleeps; with ranks sharing cores, it must be scheduled again): on 2 cores a 2-rank
    all-reduce took 1.3 ms back to back and 2.9 ms between 4 ms matmuls."""
    import torch
    import torch.distributed as dist

    from ..engine.launch import bind_to_cores
    from .bench.collectives import _time, cases

    torch.set_num_threads(1)
    bind_to_cores(1)  # as a training rank is (``train.bind_cores``)
    dist.init_process_group("gloo")
    a, w = torch.randn(1024, 256), torch.randn(256, 768)  # ~5 ms: a tp layer's matmul
    try:
        k, rank = dist.get_world_size(), dist.get_rank()
        groups = [dist.new_group(list(range(i, i + n))) for i in range(0, k, n)]
        group, out = groups[rank // n], {}

        def across(t: float, op=dist.ReduceOp.MAX) -> float:
            """``t`` reduced over the world (default: the slowest rank's)."""
            v = torch.tensor([t], dtype=torch.float64)
            dist.all_reduce(v, op=op)
            return v.item()

        def timed(fn, x) -> tuple[float, float]:
            """(wall, process CPU: every thread, Gloo's included) seconds per call."""
            c0 = time.process_time()
            wall = _time(fn, x, group, iters)
            return wall, (time.process_time() - c0) / iters

        cpu_ops = []
        for name, (_, numel, ours, _raw) in cases(n).items():
            pts, near, gaps = [], [], []
            for i, size in enumerate(sizes):
                x = torch.randn(numel(size // 4))
                _time(ours, x, group, 2)
                # in situ: between two matmuls, as in training, where the ranks drift apart
                # and the transfer competes with compute for the cores; the collective's cost
                # is the loop's time minus the compute's
                dist.barrier()
                runs = []
                for _ in range(5):
                    both, cpu_both = timed(lambda v, g: (a @ w, ours(v, g)), x)
                    alone, cpu_alone = timed(lambda v, g: a @ w, x)
                    runs.append((both - alone, alone))
                    if name == "send/recv" and n == 2 and i < 2:  # one send + one receive a call
                        cpu_ops.append((cpu_both - cpu_alone) / 2)
                pts.append((size, across(max(statistics.median(t for t, _ in runs), 1e-6))))
                gaps.append(statistics.median(c for _, c in runs))
                if i < 2:  # the latency end: the same op back to back
                    dist.barrier()
                    near.append((size, across(max(statistics.median(
                        _time(ours, x, group, iters) for _ in range(5)), 1e-6))))
            alpha, beta = _fit(pts)
            alpha0 = statistics.median(max(t - beta * b, 0.0) for b, t in near)
            gap = across(statistics.median(gaps), dist.ReduceOp.SUM) / k  # the ranks' mean
            out[name] = [alpha, beta, min(alpha0, alpha), gap]
        if cpu_ops:  # the ranks' mean; the bytes' copy is costed apart (at most 64 KB here)
            out["p2p_cpu"] = max(across(statistics.median(cpu_ops), dist.ReduceOp.SUM) / k, 0.0)
        return out if rank == 0 else None
    finally:
        from ..engine.launch import teardown
        teardown()


def calibrate(ranks: tuple[int, ...] = (2, 4, 8), *, log=print) -> Cluster:
    from ..engine.launch import spawn

    cores = len(usable_cores())  # a container's cpuset, not the host's count
    thread_counts = sorted({1, cores})
    t0 = time.time()
    probes = [speed_probe()]
    matmul = {t: matmul_table(t) for t in thread_counts}
    for t in thread_counts:  # more threads are never slower: a lower figure is another
        matmul[t] = [(f, max(r, r1)) for (f, r), (_, r1) in zip(matmul[t], matmul[1])]  # job's noise
    log(f"matmul: best {max(r for _, r in matmul[1]) / 1e9:.1f} GFLOP/s on 1 thread ({time.time() - t0:.0f} s)")
    probes.append(speed_probe())
    tables = {t: conv_table(t) for t in thread_counts}
    probes.append(speed_probe())
    conv, conv_bwd = ({t: v[i] for t, v in tables.items()} for i in (0, 1))
    log(f"convolutions: {min(r for _, r, *_ in conv[1]) / 1e9:.1f} .. {max(r for _, r, *_ in conv[1]) / 1e9:.1f} "
        f"GFLOP/s on 1 thread")
    cold = {t: weight_bw(t) for t in thread_counts}
    log("weights read cold: " + ", ".join(f"{v / 1e9:.1f} GB/s on {t} threads" for t, v in cold.items()))
    ovh = overheads()
    mem_bw = {t: elementwise_bw(t, matmul[t], ovh, cold[t]) for t in thread_counts}
    log(f"elementwise: {', '.join(f'{v / 1e9:.1f} GB/s on {t} threads' for t, v in mem_bw.items())}")
    over = oversubscription(tuple(sorted({1, *ranks})))
    log("oversubscription: " + ", ".join(f"{k} ranks x{v:.2f}" for k, v in over.items()))
    over_mem = oversubscription(tuple(sorted({1, *ranks})), work=_optimizer_work)
    log("optimizer steps at once: " + ", ".join(f"{k} ranks x{v:.2f}" for k, v in over_mem.items()))
    log("overhead: " + ", ".join(f"{k} {v * 1e6:.2f} us" for k, v in ovh.items()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    sizes = [4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20]
    coll: dict = {}
    shared: dict = {}
    p2p_cpu: dict = {}
    for k in ranks:
        for n in (n for n in ranks if n <= k and k % n == 0):
            fits = spawn(_collectives_worker, k, sizes, 8, n)[0]
            if "p2p_cpu" in fits:
                p2p_cpu[k] = fits.pop("p2p_cpu")
                log(f"point-to-point ops between matmuls, {k} ranks: {p2p_cpu[k] * 1e6:.0f} us of "
                    f"core time each")
            for op, ab in fits.items():
                (coll.setdefault(op, {}) if n == k else shared.setdefault(op, {}).setdefault(k, {}))[n] = ab
            log(f"collectives in groups of {n} of {k} ranks: " + ", ".join(
                f"{op} {ab[0] * 1e6:.0f} us ({ab[2] * 1e6:.0f} back to back) + {1e-9 / max(ab[1], 1e-30):.2f} GB/s"
                for op, ab in fits.items()))
    probes.append(speed_probe())
    ref = statistics.mean(probes)
    # each compute table at the profile's reference speed: timed while the machine ran slower
    # (a longer reference block around it), its rates were lower by that much
    mm_at, conv_at = (probes[0] + probes[1]) / 2 / ref, (probes[1] + probes[2]) / 2 / ref
    matmul = {t: [(f, r * mm_at) for f, r in rows] for t, rows in matmul.items()}
    conv, conv_bwd = ({t: [(row[0], row[1] * conv_at, *row[2:]) for row in rows] for t, rows in tab.items()}
                      for tab in (conv, conv_bwd))
    log(f"reference block: {', '.join(f'{1e3 * p:.1f}' for p in probes)} ms (start, after the matmul "
        f"table, after the convolutions, end); the tables scaled to their mean: matmul x{mm_at:.3f}, "
        f"convolutions x{conv_at:.3f}")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    p2p = coll["send/recv"][min(coll["send/recv"])]
    link = Link(p2p[0], 1.0 / max(p2p[1], 1e-30))
    return Cluster(name="calibrated cpu", nodes=1, devices_per_node=cores, mem_bytes=float(ram),
                   peak_flops=max(r for _, r in matmul[1]), matmul=matmul, mem_bw=mem_bw, weight_bw=cold, conv=conv,
                   conv_bwd=conv_bwd,
                   intra=link, inter=link, collectives=coll, collectives_shared=shared, overhead=ovh,
                   cores=cores, oversubscription=over, oversubscription_mem=over_mem, p2p_cpu=p2p_cpu,
                   probe_s=ref, backend="gloo",
                   dtype_bytes=4)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="profile JSON to write (use: hybridpar plan --cluster OUT)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8],
                    help="group sizes to measure the collectives at")
    a = ap.parse_args(argv)
    folder = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(folder):
        from ..config import ConfigError
        raise ConfigError(f"--out={a.out!r}: folder {folder!r} does not exist")
    c = calibrate(tuple(a.ranks))
    save_profile(c, a.out)
    print(f"wrote {a.out}; use: hybridpar plan --cluster {a.out}")
    return 0

