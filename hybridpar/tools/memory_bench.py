"""Benchmark (not a test): per-rank memory of each memory feature against its analytic expectation.

    python -m hybridpar.tools.memory_bench [--dp 2 --tp 2 --pp 2 --steps 2]
    python -m hybridpar.tools.memory_bench --model resnet --image-size 256 \
        --layouts 1x1x1 1x1x2 1x1x4 1x2x1 1x4x1 1x2x2

Runs the default model at one layout with each feature off and on, in one spawn, and prints the
tracked bytes of rank 0 (parameters, gradients, optimizer state, peak saved activations) next to
what the math says, plus the pipeline bubble of 1F1B vs interleaved (simulated on the real
schedules, and measured from the runtime's compute time).

With ``--cps``: the Llama at a long sequence (``--seq-len``, default 4096) at each context-
parallel degree, one step each: every rank's peak saved activations against the planner's
prediction and the 1/cp expectation, and which degrees fit an activation budget (``--budget-mib``).

With ``--layouts``: one model (e.g. the ResNet on synthetic high-resolution images) at each
layout, one training step, and every rank's peak saved activations and parameters: how the
per-rank memory falls with tp (channels split) and pp (layers split; under 1F1B the first
stage still holds pp micro-batches in flight, so its activations fall only with the layers it
does not hold).
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
    del tr
    teardown(mesh)
    return out


def _layout_worker(cfg: Config) -> dict:
    from ..engine.launch import setup, teardown
    from ..engine.train import Trainer

    mesh = setup(cfg)
    tr = Trainer(cfg, mesh)
    m = tr.train_step()
    out = {"activations": m["mem"]["activations"], "params": m["mem"]["params"],
           "pp_rank": mesh.pp_rank, "step_time_s": m["step_time_s"]}
    del tr
    teardown(mesh)
    return out


def layouts_table(base: Config, layouts: list[tuple[int, int, int]]) -> None:
    """Every rank's peak saved activations and parameters at each layout (one step each)."""
    mib, first = 2 ** 20, None
    m = base.model
    print(f"model {m.name}, {m.image_size}x{m.image_size}x{m.channels} images, global batch "
          f"{base.train.global_batch}, {base.parallel.microbatches} micro-batches, 1F1B; MiB per rank")
    print(f"{'layout':8s} {'activations max':>16s} {'min':>8s} {'vs 1 rank':>10s} {'params max':>11s}"
          f"  per pipeline stage (activations)")
    for dp, tp, pp in layouts:
        cfg = replace(base, parallel=replace(base.parallel, dp=dp, tp=tp, pp=pp,
                                             pp_split=base.parallel.pp_split if pp > 1 else ""))
        res = spawn(_layout_worker, dp * tp * pp, cfg)
        acts = [r["activations"] for r in res.values()]
        first = first or max(acts)
        stages = {}
        for r in res.values():
            stages[r["pp_rank"]] = max(stages.get(r["pp_rank"], 0), r["activations"])
        print(f"{dp}x{tp}x{pp:<4d} {max(acts) / mib:16.1f} {min(acts) / mib:8.1f} "
              f"{max(acts) / first:10.2f} {max(r['params'] for r in res.values()) / mib:11.2f}  "
              + " ".join(f"{stages[k] / mib:.1f}" for k in sorted(stages)))


def _cp_worker(cfg: Config) -> dict:
    from ..engine.launch import setup, teardown
    from ..engine.train import Trainer

    mesh = setup(cfg)
    tr = Trainer(cfg, mesh)
    m = tr.train_step()
    out = {"activations": m["mem"]["activations"], "loss": m["loss"], "step_time_s": m["step_time_s"]}
    del tr
    teardown(mesh)
    return out


def cp_table(base: Config, cps: list[int], budget_mib: float) -> None:
    """Peak saved activations per rank at each cp degree: measured, the planner's prediction
    (``planner.costs.memory``, plus the rotary tables it leaves out), and 1/cp of cp=1."""
    from ..planner.cluster import load_cluster
    from ..planner.costs import Plan, memory

    mib, first = 2 ** 20, None
    m, p = base.model, base.parallel
    print(f"llama {m.n_layers} layers, d_model {m.d_model}, heads {m.n_heads}/{m.n_kv_heads} kv, "
          f"seq_len {m.seq_len}, {base.train.global_batch} sequence(s) per step, "
          f"{p.cp_attention} attention; MiB per rank; budget {budget_mib:g} MiB")
    print(f"{'cp':>3} {'measured max':>13} {'min':>8} {'planner':>8} {'error':>7} {'vs cp=1':>8} "
          f"{'1/cp':>6} {'fits':>5} {'loss':>8} {'step s':>7}")
    for cp in cps:
        cfg = replace(base, parallel=replace(p, cp=cp))
        res = spawn(_cp_worker, cp * p.dp, cfg)
        acts = [r["activations"] for r in res.values()]
        plan = Plan(p.dp, 1, 1, p.microbatches, base.train.global_batch // (p.dp * p.microbatches), cp=cp)
        pred = memory(m, plan, load_cluster("cpu"))["activations"] + 2 * m.seq_len // cp * m.head_dim * 4
        first = first or max(acts)
        r0 = res[0]
        print(f"{cp:3d} {max(acts) / mib:13.2f} {min(acts) / mib:8.2f} {pred / mib:8.2f} "
              f"{(max(acts) - pred) / pred:+7.1%} {max(acts) / first:8.3f} {1 / cp:6.3f} "
              f"{'yes' if max(acts) <= budget_mib * mib else 'NO':>5} {r0['loss']:8.4f} "
              f"{r0['step_time_s']:7.2f}")


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
    ap.add_argument("--model", default="llama", help="built-in model (layouts mode: e.g. resnet)")
    ap.add_argument("--image-size", type=int, default=256, help="layouts mode: synthetic image size")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--layouts", nargs="*", help="e.g. 1x1x1 1x1x2 1x2x1: the per-rank table instead")
    ap.add_argument("--cps", nargs="*", type=int, help="e.g. 1 2 4: the context-parallel table")
    ap.add_argument("--seq-len", type=int, default=4096, help="cps mode: tokens per sequence")
    ap.add_argument("--budget-mib", type=float, default=0.0,
                    help="cps mode: activation budget per rank (default: half of cp=1's need)")
    ap.add_argument("--pp-split", default="", help="layouts mode: blocks per stage, e.g. 2,6 (all pp>1 layouts)")
    a = ap.parse_args(argv)
    if a.cps:
        base = Config()
        base = replace(base, model=replace(base.model, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                                           d_ff=128, seq_len=a.seq_len),
                       parallel=replace(base.parallel, dp=1, microbatches=1),
                       train=replace(base.train, steps=1, eval_every=0, progress=False, global_batch=1,
                                     threads_per_rank=1, summary=False))
        if not a.budget_mib:
            from ..planner.cluster import load_cluster
            from ..planner.costs import Plan, memory
            need = memory(base.model, Plan(1, 1, 1, 1, 1), load_cluster("cpu"))["activations"]
            a.budget_mib = need / 2 / 2 ** 20
        cp_table(base, a.cps, a.budget_mib)
        return
    if a.layouts:
        base = Config()
        base = replace(base, model=replace(base.model, name=a.model, image_size=a.image_size,
                                           n_layers=8),
                       data=replace(base.data, images="synthetic", n_images=4 * a.global_batch,
                                    val_fraction=0.2),
                       parallel=replace(base.parallel, microbatches=a.microbatches, pp_split=a.pp_split),
                       train=replace(base.train, steps=1, eval_every=0, progress=False,
                                     global_batch=a.global_batch, threads_per_rank=1))
        layouts_table(base, [tuple(int(x) for x in s.split("x")) for s in a.layouts])
        return
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
