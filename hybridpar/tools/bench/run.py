"""``hybridpar bench``: hybridpar against the PyTorch-native equivalent, side by side, in one run.

    hybridpar bench --ranks 2 4 [--repeats 3 --steps 2 --warmup 1 --threads 1] [--model.n_layers=4 ...]
    hybridpar bench collectives --ranks 2 4      (microbenchmarks: see bench/collectives.py)

For each rank count one group of processes is spawned and runs every layout of that many ranks
(dp, tp, pp and their 2D products; pp layouts with each ``--schedules``). For a layout, each
rank builds both sides from the same config (model, seeded init, data, global batch, micro-
batches, fp32, ``--threads`` per rank), then:

  warm-up   ``--warmup`` steps of A (hybridpar), then of B (native)
  memory    one step of each under the memory profiler: peak bytes of tensors = parameters +
            gradients + optimizer state (enumerated) + the step's peak of allocations minus frees
  timing    ``--repeats`` rounds of A B (``--steps`` steps each; ``--order ba`` or ``abba`` to
            check that the order does not decide the result), a barrier before every step;
            a step's time is the slowest rank's; ``cpu s`` is the CPU time of a step summed
            over ranks (all threads: compute, Gloo, waits), what an oversubscribed machine pays

Both sides run the same steps from the same weights, so their losses must agree step by step:
only the order of floating-point additions differs (tp partial sums, dp reductions), which moves
a float32 loss by ~1e-6 relative; AdamW can amplify that for near-zero gradients, hence 1e-4
(``LOSS_RTOL``, the parity tests' bound over 5 steps). A single process (skip: ``--no-baseline``)
gives the speedup and parallel efficiency = speedup / ranks. Not a test: nothing asserts a time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace

from ...config import Config, ConfigError, load_config, validate

LOSS_RTOL = 1e-4
MIB = 2 ** 20


def layouts_for(n: int, schedules: list[str]) -> list[tuple[int, int, int, str]]:
    """Every (dp, tp, pp, schedule) with dp*tp*pp = n: 1D layouts first, then 2D, then 3D."""
    out = []
    for dp in (d for d in range(n, 0, -1) if n % d == 0):
        for tp in (t for t in range(n // dp, 0, -1) if (n // dp) % t == 0):
            pp = n // (dp * tp)
            for s in (schedules if pp > 1 else ["1f1b"]):
                if not native_unsupported(dp, pp, s):
                    out.append((dp, tp, pp, s))
    order = lambda lay: (sum(x > 1 for x in lay[:3]), -lay[0], -lay[1], lay[3] != "1f1b")  # noqa: E731
    return sorted(out, key=order)


def native_unsupported(dp: int, pp: int, schedule: str) -> str:
    """Why torch cannot run this layout natively ('' if it can)."""
    if dp > 1 and pp > 1 and schedule == "gpipe":
        return ("DDP inside ScheduleGPipe fails in torch 2.13 on the second step (reducer.cpp "
                "assert: rebuilt parameter indices counted twice); Schedule1F1B works")
    return ""


def cp_layouts_for(n: int) -> list[tuple[int, int, int, str, int]]:
    """(dp, tp, pp, schedule, cp) context-parallel layouts of n ranks: cp = n, then cp x dp."""
    return [(n // cp, 1, 1, "1f1b", cp) for cp in range(n, 1, -1) if n % cp == 0]


def layout_config(base: Config, dp: int, tp: int, pp: int, schedule: str, microbatches: int,
                  cp: int = 1) -> Config:
    m = microbatches or (2 * pp if pp > 1 else 1)
    return replace(base, parallel=replace(base.parallel, dp=dp, tp=tp, pp=pp, schedule=schedule,
                                          microbatches=m, cp=cp))


# -- per-rank measurement --------------------------------------------------------------------
def _tensor_bytes(ts) -> int:
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in ts:
        t = t.to_local() if isinstance(t, DTensor) else t
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def state_tensors(params, opt) -> list:
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for st in opt.state.values() for v in st.values() if hasattr(v, "untyped_storage")]
    return list(params) + grads + states


def profiled_peak(fn) -> tuple[int, object]:
    """Run ``fn`` under the CPU memory profiler; returns (peak bytes allocated above the start,
    fn's result)."""
    import torch.profiler as tp

    with tp.profile(activities=[tp.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    evs = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                 key=lambda e: e.start_ns())
    live = peak = 0
    for e in evs:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, out


def _bench_layout(cfg: Config, dataset, a: dict) -> dict:
    import torch
    import torch.distributed as dist

    from ...parallel.mesh import Layout, build_mesh
    from ...engine.train import Trainer
    from .native import build_native

    p = cfg.parallel
    layout = Layout.of(p)
    device, rank = torch.device("cpu"), dist.get_rank()
    mesh = build_mesh(layout, device)
    hyb = Trainer(cfg, mesh, dataset)
    # no native side for cp: torch's context parallelism does not run on CPU/Gloo
    nat = build_native(cfg, layout, rank, device) if p.cp == 1 else None
    sides = {"hybridpar": lambda: hyb.train_step()["loss"]}
    params = {"hybridpar": lambda: state_tensors(list(hyb.pm.module.parameters()), hyb.opt)}
    if nat is not None:
        sides["native"] = lambda: nat.train_step(dataset.train)["loss"]
        params["native"] = lambda: state_tensors(nat.params(), nat.opt)
    losses = {k: [] for k in sides}
    times = {k: [] for k in sides}
    cpu = {k: [] for k in sides}

    def run(side, n, timed):
        for _ in range(n):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = sides[side]()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            losses[side].append(loss)
            if timed:
                times[side].append(dt)
                cpu[side].append(dc)

    for side in sides:
        run(side, a["warmup"], False)
    mem = {}
    for side in sides:
        peak, _ = profiled_peak(lambda: run(side, 1, False))
        mem[side] = _tensor_bytes(params[side]()) + peak
    first = list(sides) if a["order"] != "ba" else list(sides)[::-1]
    for r in range(a["repeats"]):
        for side in (first[::-1] if a["order"] == "abba" and r % 2 else first):
            run(side, a["steps"], True)
    mine = {"times": times, "cpu": cpu, "mem": mem, "losses": losses}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    del hyb, nat
    if rank != 0:
        return {}
    out = {"layout": {"dp": p.dp, "tp": p.tp, "pp": p.pp, "schedule": p.schedule,
                      "microbatches": p.microbatches, "cp": p.cp}}
    for side in sides:
        step_t = [max(r["times"][side][i] for r in every) for i in range(len(times[side]))]
        cpu_t = [sum(r["cpu"][side][i] for r in every) for i in range(len(times[side]))]
        out[side] = {"step_s": step_t, "cpu_s": cpu_t, "mem_bytes": [r["mem"][side] for r in every],
                     "losses": every[0]["losses"][side]}
    return out


def _worker(cfgs: list[Config], a: dict) -> list[dict]:
    import torch
    import torch.distributed as dist

    from ...engine.data import load_dataset

    torch.set_num_threads(a["threads"])
    dist.init_process_group("gloo")
    try:
        first = cfgs[0]
        dataset = load_dataset(first.data.path or None, seq_len=first.model.seq_len,
                               val_fraction=first.data.val_fraction)
        results = []
        for cfg in cfgs:
            t = time.time()
            results.append(_bench_layout(cfg, dataset, a))
            if dist.get_rank() == 0:
                lay = cfg.parallel
                print(f"  dp={lay.dp} " + (f"cp={lay.cp} " if lay.cp > 1 else "")
                      + f"tp={lay.tp} pp={lay.pp} {lay.schedule}: {time.time() - t:.0f} s", flush=True)
        return results
    finally:
        from ...engine.launch import teardown
        teardown()


# -- report ----------------------------------------------------------------------------------
def summarize(res: dict, cfg: Config, base_tps: float | None, base_losses: list | None = None) -> dict:
    """One layout's row. Without a native side (cp), the losses are compared with the single
    process's (``base_losses``): the same steps from the same weights."""
    tokens = cfg.train.global_batch * cfg.model.seq_len
    row = {"layout": res["layout"]}
    sides = [x for x in ("hybridpar", "native") if x in res]
    for side in sides:
        st = res[side]["step_s"]
        med = statistics.median(st)
        row[side] = {"tokens_per_s": tokens / med, "median_s": med, "min_s": min(st), "max_s": max(st),
                     "cpu_s": statistics.median(res[side]["cpu_s"]),
                     "mem_mib": [b / MIB for b in res[side]["mem_bytes"]]}
    h = res["hybridpar"]["losses"]
    n = res["native"]["losses"] if "native" in res else base_losses
    if n:
        row["loss_max_rel_diff"] = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(h, n))
        row["loss_ok"] = row["loss_max_rel_diff"] <= LOSS_RTOL
    row["losses"] = {"hybridpar": h, "native": n}
    row["ratio"] = (row["hybridpar"]["tokens_per_s"] / row["native"]["tokens_per_s"]
                    if "native" in row else None)
    lay = res["layout"]
    world = lay["dp"] * lay.get("cp", 1) * lay["tp"] * lay["pp"]
    if base_tps:
        for side in sides:
            sp = row[side]["tokens_per_s"] / base_tps
            row[side]["speedup"], row[side]["efficiency"] = sp, sp / world
    return row


def format_table(rows: list[dict], *, title: str) -> str:
    head = (f"{'layout':18s} {'side':9s} {'tok/s':>7s} {'med s':>6s} {'min s':>6s} {'max s':>6s} "
            f"{'cpu s':>6s} {'speedup':>7s} {'eff':>5s} {'peak MiB per rank':>24s} {'hyb/nat':>7s} losses")
    lines = [title, head, "-" * len(head)]
    for r in rows:
        lay = r["layout"]
        name = _name((lay["dp"], lay["tp"], lay["pp"], lay["schedule"], lay.get("cp", 1)))
        name += f" {lay['schedule']} m{lay['microbatches']}" if lay["pp"] > 1 else ""
        for side in [x for x in ("hybridpar", "native") if x in r]:
            s = r[side]
            sp = f"{s['speedup']:7.2f} {s['efficiency']:5.2f}" if "speedup" in s else f"{'':7s} {'':5s}"
            mem = "/".join(f"{m:.0f}" for m in s["mem_mib"])
            ratio = f"{r['ratio']:7.2f}" if r["ratio"] is not None else f"{'(1 pr)':>7s}"
            same = ("" if "loss_ok" not in r else f" {'same' if r['loss_ok'] else 'DIFFER'} "
                    f"(max rel {r['loss_max_rel_diff']:.1e})")
            tail = f" {ratio}{same}" if side == "hybridpar" else ""
            lines.append(f"{name if side == 'hybridpar' else '':18s} {side:9s} "
                         f"{s['tokens_per_s']:7.0f} {s['median_s']:6.3f} {s['min_s']:6.3f} "
                         f"{s['max_s']:6.3f} {s['cpu_s']:6.2f} {sp} {mem:>24s}{tail}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybridpar bench", description=__doc__.split("\n\n")[0],
                                 epilog="Other arguments --section.field=value set the model/train "
                                        "config of both sides (as for hybridpar train).")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts to benchmark")
    ap.add_argument("--layouts", default="", help="only these, e.g. 'dp2,tp2,dp2xpp2' (default: all)")
    ap.add_argument("--schedules", default="1f1b,gpipe", help="pipeline schedules for pp layouts")
    ap.add_argument("--microbatches", type=int, default=0, help="per step; 0 = 2*pp with pp, else 1")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of A B")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per side per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (both sides)")
    ap.add_argument("--order", default="ab", choices=("ab", "ba", "abba"),
                    help="per round: hybridpar then native (ab), the reverse (ba), or alternating (abba)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the single-process run")
    ap.add_argument("--cp", action="store_true",
                    help="also the context-parallel layouts of each rank count (cp = n, cp x dp): "
                         "hybridpar against the single process only (torch's context parallelism "
                         "does not run on CPU/Gloo)")
    ap.add_argument("--config", help="TOML file for the model/train sections")
    ap.add_argument("--out", default="", help="write all numbers (and losses) to this JSON file")
    return ap


def _name(lay) -> str:
    dp, tp, pp, _, *cp = lay
    axes = (("dp", dp), ("cp", cp[0] if cp else 1), ("tp", tp), ("pp", pp))
    return "x".join(f"{a}{n}" for a, n in axes if n > 1) or "single"


def main(argv: list[str]) -> int:
    from ...engine.launch import spawn

    if argv and argv[0] == "collectives":
        from .collectives import main as collectives_main
        return collectives_main(argv[1:])
    a, rest = _parser().parse_known_args(argv)
    bad = [x for x in rest if not (x.startswith("--") and "." in x.split("=")[0])]
    if bad:
        raise ConfigError(f"unknown argument '{bad[0]}' (see hybridpar bench --help)")
    base = load_config(a.config, rest)
    base = replace(base, train=replace(base.train, eval_every=0, progress=False, metrics="",
                                       threads_per_rank=a.threads, tensorboard="", trace=""))
    knobs = {"repeats": a.repeats, "steps": a.steps, "warmup": a.warmup, "threads": a.threads,
             "order": a.order}
    total_steps = a.warmup + 1 + a.repeats * a.steps
    base = replace(base, train=replace(base.train, steps=max(base.train.steps, total_steps)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # above USDT (5): the profiler's start/stop lines
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # "freed block allocated before profiling"
    m = base.model
    print(f"model: {m.n_layers} layers, d_model {m.d_model}, seq {m.seq_len}, global batch "
          f"{base.train.global_batch}; fp32; {a.threads} thread(s) per rank; {os.cpu_count()} cores; "
          f"{a.warmup} warm-up + 1 memory + {a.repeats}x{a.steps} timed steps per side", flush=True)
    base_tps, base_losses, report = None, None, {"config": base.to_dict(), "runs": {}}
    if not a.no_baseline:
        cfg = layout_config(base, 1, 1, 1, "1f1b", a.microbatches)
        print("single process:", flush=True)
        res = spawn(_worker, 1, [cfg], knobs)[0][0]
        row = summarize(res, cfg, None)
        base_tps, base_losses = row["hybridpar"]["tokens_per_s"], row["losses"]["hybridpar"]
        report["runs"]["1"] = [row]
        print(format_table([row], title="single-process baseline (speedup = tok/s / hybridpar's here)"))
    want = {x.strip() for x in a.layouts.split(",") if x.strip()}
    for n in a.ranks:
        lays = [lay for lay in layouts_for(n, a.schedules.split(",")) if not want or _name(lay) in want]
        if a.cp:
            lays += [lay for lay in cp_layouts_for(n) if not want or _name(lay) in want]
        if "gpipe" in a.schedules and any(dp > 1 and pp > 1 for dp, _, pp, *_ in lays):
            print(f"skipped dp x pp with gpipe: {native_unsupported(2, 2, 'gpipe')}")
        cfgs = [layout_config(base, *lay[:4], a.microbatches, *lay[4:]) for lay in lays]
        for cfg in cfgs:
            validate(cfg)
        if not cfgs:
            continue
        print(f"{n} ranks: {', '.join(_name(x) + ('-' + x[3] if x[2] > 1 else '') for x in lays)}",
              flush=True)
        results = spawn(_worker, n, cfgs, knobs)[0]
        rows = [summarize(r, c, base_tps, base_losses) for r, c in zip(results, cfgs)]
        report["runs"][str(n)] = rows
        print(format_table(rows, title=f"\n{n} ranks (tok/s from the median step; hyb/nat = "
                                       f"hybridpar tok/s / native tok/s, > 1 = hybridpar faster)"),
              flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {a.out}")
    return 0
