"""``hybridpar bench collectives``: our communication layer against raw torch.distributed calls.

    hybridpar bench collectives [--ranks 2 4] [--sizes-kib 16 256 4096 16384] [--iters 20]

Pairs, each timed A B A B on the same tensors (fp32, world group):

  all-reduce      ours: ``reduce_from_tp`` (autograd fn: clone + all_reduce)  raw: ``dist.all_reduce``
  reduce-scatter  ours: ``reduce_scatter_to_tp`` (Gloo: all-to-all, then the local sum)
                  raw: ``dist.reduce_scatter_single`` (or ``reduce_scatter_tensor`` on older torch)
  all-gather      ours: ``gather_from_sp`` (flat shards: one all_gather_single)  raw: the same call
  send/recv       ours: the pipeline runtime's ``batch_isend_irecv`` of P2POps, ring to rank+1
                  raw: ``dist.isend``/``dist.irecv`` ring to rank+1, waited

Bandwidth as nccl-tests define it, with S the bytes of the full tensor and t the slowest rank's
time: algbw = S/t; busbw = algbw * 2(n-1)/n (all-reduce), * (n-1)/n (reduce-scatter, all-gather),
= algbw (send/recv), so numbers compare to the link speed whatever n is.
"""
from __future__ import annotations

import argparse
import os
import time

MIB = 2 ** 20


def _single(name: str):
    """Newer torch names the flat-tensor collectives ``*_single`` (the old names warn)."""
    import torch.distributed as dist

    new = {"reduce_scatter": "reduce_scatter_single", "all_gather": "all_gather_single"}[name]
    old = {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_into_tensor"}[name]
    return getattr(dist, new, None) or getattr(dist, old)


def _raw_reduce_scatter(x, group, n):
    import torch

    out = torch.empty(x.numel() // n, dtype=x.dtype)
    _single("reduce_scatter")(out, x, group=group)
    return out


def _raw_all_gather(x, group, n):
    import torch

    out = torch.empty(x.numel() * n, dtype=x.dtype)
    _single("all_gather")(out, x, group=group)
    return out


def _ring(x, group, batched: bool):
    import torch
    import torch.distributed as dist

    n, r = dist.get_world_size(group), dist.get_rank(group)
    nxt, prev = (dist.get_global_rank(group, (r + k) % n) for k in (1, -1))  # peers are global ranks
    buf = torch.empty_like(x)
    if batched:
        ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, buf, prev, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    else:
        works = [dist.isend(x, nxt, group), dist.irecv(buf, prev, group)]
        for w in works:
            w.wait()
    return buf


def cases(n: int):
    """name -> (bus factor, full-size tensor numel for elements e, ours(x, g), raw(x, g))."""
    from ...parallel.tensor_parallel.mappings import gather_from_sp, reduce_from_tp, reduce_scatter_to_tp

    return {
        "all-reduce": (2 * (n - 1) / n, lambda e: e,
                       lambda x, g: reduce_from_tp(x, g), lambda x, g: _inplace_all_reduce(x, g)),
        "reduce-scatter": ((n - 1) / n, lambda e: e,
                           lambda x, g: reduce_scatter_to_tp(x, g, 0),
                           lambda x, g: _raw_reduce_scatter(x, g, n)),
        "all-gather": ((n - 1) / n, lambda e: e // n,  # input is one shard; S counts the output
                       lambda x, g: gather_from_sp(x, g, 0), lambda x, g: _raw_all_gather(x, g, n)),
        "send/recv": (1.0, lambda e: e,
                      lambda x, g: _ring(x, g, True), lambda x, g: _ring(x, g, False)),
    }


def _inplace_all_reduce(x, g):
    import torch.distributed as dist

    dist.all_reduce(x, group=g)
    return x


def _time(fn, x, group, iters: int) -> float:
    import torch.distributed as dist

    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x, group)
    return (time.perf_counter() - t0) / iters


def _worker(sizes: list[int], iters: int, threads: int) -> list[dict] | None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    try:
        group, n = dist.group.WORLD, dist.get_world_size()
        rows = []
        for name, (bus, numel, ours, raw) in cases(n).items():
            for size in sizes:
                elems = size // 4
                x = torch.randn(numel(elems))
                for fn in (ours, raw):  # warm-up (and Gloo's lazy pair set-up)
                    _time(fn, x, group, 2)
                t = {"ours": [], "raw": []}
                for _ in range(3):  # A B A B A B
                    t["ours"].append(_time(ours, x, group, iters))
                    t["raw"].append(_time(raw, x, group, iters))
                best = {k: min(v) for k, v in t.items()}
                slowest = torch.tensor([best["ours"], best["raw"]], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                rows.append({"op": name, "bytes": elems * 4, "n": n, "ours_s": slowest[0].item(),
                             "raw_s": slowest[1].item(), "bus_factor": bus})
        return rows if dist.get_rank() == 0 else None
    finally:
        from ...engine.launch import teardown
        teardown()


def format_rows(rows: list[dict]) -> str:
    head = (f"{'op':15s} {'n':>2s} {'size':>9s} {'raw us':>9s} {'ours us':>9s} {'overhead':>8s} "
            f"{'raw algbw':>10s} {'raw busbw':>10s} {'ours busbw':>10s}  (GB/s)")
    lines = [head, "-" * len(head)]
    for r in rows:
        s = r["bytes"]
        alg = {k: s / r[f"{k}_s"] / 1e9 for k in ("raw", "ours")}
        size = f"{s // 1024} KiB" if s < MIB else f"{s // MIB} MiB"
        lines.append(f"{r['op']:15s} {r['n']:2d} {size:>9s} {r['raw_s'] * 1e6:9.0f} {r['ours_s'] * 1e6:9.0f} "
                     f"{r['ours_s'] / r['raw_s'] - 1:+8.0%} {alg['raw']:10.2f} "
                     f"{alg['raw'] * r['bus_factor']:10.2f} {alg['ours'] * r['bus_factor']:10.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from ...engine.launch import spawn

    ap = argparse.ArgumentParser(prog="hybridpar bench collectives", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[16, 256, 4096, 16384],
                    help="full tensor sizes in KiB (fp32)")
    ap.add_argument("--iters", type=int, default=20, help="calls per timed block")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    sizes = [k * 1024 for k in a.sizes_kib]
    for n in a.ranks:
        rows = spawn(_worker, n, sizes, a.iters, a.threads)[0]
        print(f"\n{n} ranks, Gloo on {os.cpu_count()} cores; best of 3 A/B blocks of {a.iters} calls, "
              f"slowest rank")
        print(format_rows(rows), flush=True)
    return 0
