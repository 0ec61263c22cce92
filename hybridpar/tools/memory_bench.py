"""Benchmark (not a test): per-rank memory of each memory feature against its analytic expectation.

    python -m hybridpar.tools.memory_bench [--dp 2 --tp 2 --pp 2 --steps 2]

Runs the default model at one layout with each feature off and on, in one spawn, and prints the
tracked bytes of rank 0 (parameters, gradients, optimizer state, peak saved activations) next to
what the math says, plus the pipeline bubble of 1F1B vs interleaved (simulated on the real
schedules, and measured from the runtime's compute time).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

from ..config import Config
from ..engine.launch import spawn
from ..parallel.pipeline.schedules import build
from ..parallel.pipeline.simulate import simulate

FEATURES = {
    "baseline": {},
    "zero1": {"zero1": True},
    "recompute=selective": {"recompute": "selective"},
    "recompute=full": {"recompute": "full"},
    "sequence_parallel": {"sequence_parallel": True},
    "interleaved v=2": {"schedule": "interleaved", "virtual_stages": 2},
    "all on": {"zero1": True, "recompute": "full", "sequence_parallel": True,
               "schedule": "interleaved", "virtual_stages": 2},
}


def _worker(cfgs: dict[str, Config]) -> dict:
    from ..engine.launch import setup, teardown
    from ..engine.train import Trainer

    out = {}
    mesh = setup(next(iter(cfgs.values())))  # one layout: the groups serve every feature set
    for name, cfg in cfgs.items():
        tr = Trainer(cfg, mesh)
        busy = [0.0]

        def on_action(a, t0, t1, busy=busy):
            if a.op.value in ("F", "B"):
                busy[0] += t1 - t0
        tr.runner.on_action = on_action
        m = None
        for _ in range(cfg.train.steps):
            busy[0] = 0.0
            t = time.perf_counter()
            m = tr.train_step()
            m["busy_frac"] = busy[0] / (time.perf_counter() - t)
        out[name] = {"mem": m["mem"], "busy_frac": m["busy_frac"], "step_time_s": m["step_time_s"],
                     "params": sum(p.numel() for p in tr.pm.module.parameters()),
                     "layers": sum(u in tr.pm.spec.blocks for u in tr.pm.units), "in_flight": m["max_in_flight"]}
    teardown()
    return out


def expected(cfg: Config, r: dict) -> dict[str, str]:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    rows = t.global_batch // (p.dp * p.microbatches)
    seq = m.seq_len // (p.tp if p.sequence_parallel else 1)
    exp = {"optimizer": f"{8 * r['params'] / (p.dp if p.zero1 else 1) / 2**20:.2f}"}
    if p.recompute == "full":
        # in_flight counts (chunk, micro-batch) pairs; a chunk holds layers / virtual_stages
        act = r["layers"] / p.virtual_stages * rows * seq * m.d_model * 4 * r["in_flight"]
        exp["activations"] = f">= {act / 2**20:.2f} (layer inputs)"
    return exp


def bubble_theory(P: int, M: int, v: int) -> float:
    sched = build("interleaved" if v > 1 else "1f1b", P, M, v)
    return simulate(sched, P, v, duration=lambda r, a: (1.0 if a.op.value == "F" else 2.0) / v).bubble_fraction


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hybridpar.tools.memory_bench")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args(argv)
    base = Config()
    base = replace(base, parallel=replace(base.parallel, dp=a.dp, tp=a.tp, pp=a.pp,
                                          microbatches=a.microbatches),
                   train=replace(base.train, steps=a.steps, eval_every=0, progress=False,
                                 threads_per_rank=1))
    cfgs = {n: replace(base, parallel=replace(base.parallel, **f)) for n, f in FEATURES.items()}
    t0 = time.time()
    res = spawn(_worker, a.dp * a.tp * a.pp, cfgs)[0]
    mib = 2 ** 20
    print(f"default model, layout dp={a.dp} tp={a.tp} pp={a.pp}, microbatches={a.microbatches}; "
          f"rank 0, MiB (tracked); {time.time() - t0:.0f} s")
    print(f"{'feature':22s} {'params':>8s} {'grads':>8s} {'optim':>8s} {'expect':>8s} "
          f"{'activ':>8s} {'vs base':>8s}  expectation")
    b = res["baseline"]["mem"]
    for name, r in res.items():
        mem = r["mem"]
        exp = expected(cfgs[name], r)
        print(f"{name:22s} {mem['params'] / mib:8.2f} {mem['grads'] / mib:8.2f} "
              f"{mem['optimizer'] / mib:8.2f} {exp['optimizer']:>8s} {mem['activations'] / mib:8.2f} "
              f"{mem['activations'] / b['activations']:8.2f}  {exp.get('activations', '')}")
    P, M = a.pp, a.microbatches
    print(f"\npipeline bubble (pp={P}, microbatches={M}):")
    for v, name in ((1, "baseline"), (2, "interleaved v=2")):
        th = bubble_theory(P, M, v)
        print(f"  v={v}: simulated on the real schedule {th:.3f}; closed form "
              f"{(P - 1) / (v * M + P - 1) if v > 1 else (P - 1) / (M + P - 1):.3f}; "
              f"measured idle fraction of rank 0 {1 - res[name]['busy_frac']:.3f}")


if __name__ == "__main__":
    main()
