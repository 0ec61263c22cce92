"""Benchmark (not a test): the planner's predictions against measured training steps.

    python -m hybridpar.tools.validate --profile PROFILE.json [--model vit] [--ranks 2 4 8]
        [--steps 6] [--repeat 2] [--save RUNS.json]  then, after changing the model: --replay RUNS.json

Runs every valid dp x tp x pp layout of 2, 4 and 8 ranks for a built-in model at its defaults
(``--model llama|vit|resnet|unet``: the Llama costed by its closed forms, the others by their
meta-device profile; a pipelined layout runs the split the planner costed) (fixed
micro-batches, 1F1B) for a few steps on this machine, and prints the predicted and measured
step time (median of the steps after the warm-up ones) and memory side by side with the relative
error, then the median |error| and the worst case. With ``--repeat R`` every layout is measured
R times in whole passes (so its repeats are minutes apart) and compared by the median; the
``spread`` column, (max - min) / median, says how far this machine lets one trust a single
measurement.

Memory compared: rank 0's tracked bytes (``metrics["mem"]``: parameters + gradients + optimizer
state + peak saved activations), the figure that means the same on a CPU and a GPU; the process
RSS (``max_mem_bytes``) is shown for reference only (it adds Python, torch and the data set).
``load`` is the machine's 1-minute load average after the run: above the run's own ranks, other
jobs shared the cores and the measured time is inflated by them, not by the layout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, replace

from ..config import Config, ModelConfig, ParallelConfig, TrainConfig
from ..planner.cluster import Cluster, load_cluster
from ..planner.costs import Plan, memory
from ..planner.search import MODELS, candidates
from ..planner.timing import predict_time
from .calibrate import speed_drift


def model_of(name: str, measure: bool = False):
    """What the planner costs for a built-in model at its defaults (``cli.plan.model_for``);
    ``measure``: a spec model's unit compute timed on this machine (``planner.unit_timer``)."""
    from ..cli.plan import model_for
    return model_for(Config(model=ModelConfig(name=name)), measure=measure)


def layouts(c: Cluster, world: int, global_batch: int, microbatches: int, m=None) -> list[Plan]:
    fixed = {"microbatches": microbatches, "schedule": "1f1b", "recompute": "none", "zero1": False,
             "sequence_parallel": False}
    cw = replace(c, nodes=1, devices_per_node=world)
    return candidates(m or MODELS["default"], cw, global_batch, fixed=fixed, max_mb=global_batch)


def _worker(cfg: Config, steps: int) -> list[dict] | None:
    from ..engine.launch import setup, teardown
    from ..testing import tiny_dataset
    from ..engine.train import Trainer

    mesh = setup(cfg)
    trainer = Trainer(cfg, mesh, dataset=tiny_dataset() if cfg.model.name == "llama" else None)
    history = [trainer.train_step() for _ in range(steps)]
    del trainer
    teardown(mesh)
    return history if mesh.rank == 0 else None


def measure(plan: Plan, *, steps: int, warmup: int, global_batch: int, model: str = "llama",
            split: tuple[int, ...] | None = None) -> dict:
    from ..engine.launch import spawn

    cfg = Config(model=ModelConfig(name=model),
                 parallel=ParallelConfig(dp=plan.dp, tp=plan.tp, pp=plan.pp,
                                         microbatches=plan.microbatches, schedule=plan.schedule,
                                         pp_split=",".join(map(str, split)) if split and plan.pp > 1 else ""),
                 train=TrainConfig(steps=steps, global_batch=global_batch, eval_every=0, progress=False))
    hist = spawn(_worker, plan.world, cfg, steps)[0]
    last = hist[-1]
    return {"step_time": statistics.median(h["step_time_s"] for h in hist[warmup:]),
            "mem": sum(last["mem"].values()), "rss": last["max_mem_bytes"], "parts": last["mem"],
            "load": os.getloadavg()[0]}


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def _split(m, plan: Plan, c: Cluster):
    """The blocks per stage the prediction assumes (a spec model's), None for the Llama."""
    if isinstance(m, ModelConfig):
        return None
    from ..planner.spec_model import split_for
    return split_for(m, plan, c, m.pp_split)


def report(runs: list[dict], base: Cluster, m=None) -> None:
    """Print predicted vs measured for ``runs`` (measurements, predicted now: so a model change
    can be checked against a saved run with --replay)."""
    m = m or MODELS["default"]
    head = (f"{'layout':28s} {'pred s':>7} {'meas s':>7} {'err':>6}   {'pred MiB':>8} {'meas MiB':>8} "
            f"{'err':>6}   {'rss MiB':>7} {'load':>5} {'spread':>6}  (pred/meas activ MiB)")
    print(head + "\n" + "-" * len(head))
    t_err, m_err, spreads = [], [], []
    for got in runs:
        plan = Plan(**got["plan"])
        c = replace(base, nodes=1, devices_per_node=plan.world)
        if not isinstance(m, ModelConfig):  # predicted with the split that ran (if saved)
            m.pp_split = ",".join(map(str, got.get("split") or [])) if plan.pp > 1 else ""
        pred_t, pred_m = predict_time(m, plan, c).step_time, memory(m, plan, c, stage=0)
        te, me = _err(pred_t, got["step_time"]), _err(pred_m["total"], got["mem"])
        t_err.append((abs(te), plan.label()))
        m_err.append((abs(me), plan.label()))
        times = got.get("step_times", [])
        spread = (max(times) - min(times)) / got["step_time"] if len(times) > 1 else None
        if spread is not None:
            spreads.append(spread)
        print(f"{plan.label():28s} {pred_t:7.3f} {got['step_time']:7.3f} {te:+6.1%}   "
              f"{pred_m['total'] / 2**20:8.1f} {got['mem'] / 2**20:8.1f} {me:+6.1%}   "
              f"{got['rss'] / 2**20:7.0f} {got['load']:5.1f} {'' if spread is None else f'{spread:.0%}':>6}  "
              f"({pred_m['activations'] / 2**20:.1f}/"
              f"{got['activations'] / 2**20:.1f})", flush=True)
    for name, errs in (("step time", t_err), ("memory", m_err)):
        worst = max(errs)
        print(f"{name}: median |err| {statistics.median(e for e, _ in errs):.1%}, worst {worst[0]:.1%} "
              f"({worst[1]})")
    if spreads:
        print(f"measurement repeatability, (max - min) / median over the passes: "
              f"median {statistics.median(spreads):.0%}, worst {max(spreads):.0%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridpar.tools.validate")
    ap.add_argument("--profile", default="cpu", help="calibrated profile JSON (or the cpu preset)")
    ap.add_argument("--model", default="llama", choices=("llama", "vit", "resnet", "unet"),
                    help="built-in model, at its defaults")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure every layout this many times, in whole passes (median; the spread "
                         "shows how repeatable a measurement is on this machine)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--measure-units", action="store_true",
                    help="time each unit's compute on this machine instead of modelling it from its "
                         "FLOPs and bytes (a spec model; communication stays modelled)")
    ap.add_argument("--save", help="write the measurements to this JSON")
    ap.add_argument("--replay", help="measure nothing: predict again for a --save'd JSON")
    a = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    base = load_cluster(a.profile)
    m = model_of(a.model, measure=a.measure_units)
    if a.replay:
        with open(a.replay) as fh:
            report(json.load(fh), base, m)
        return 0
    print(f"{a.model} at its defaults, global batch {a.global_batch}, {a.microbatches} micro-batches, 1F1B; "
          f"profile {a.profile}; {os.cpu_count()} cores; median of steps {a.warmup + 1}..{a.steps}",
          flush=True)
    print(f"before: {speed_drift(base)}", flush=True)
    plans = [p for world in a.ranks for p in layouts(base, world, a.global_batch, a.microbatches, m)]
    runs, t0 = [], time.time()
    for rep in range(a.repeat):  # whole passes: a layout's repeats are minutes apart
        for i, plan in enumerate(plans):
            cw = replace(base, nodes=1, devices_per_node=plan.world)
            split = _split(m, plan, cw)
            got = measure(plan, steps=a.steps, warmup=a.warmup, global_batch=a.global_batch,
                          model=a.model, split=split)
            if rep == 0:
                runs.append({"plan": asdict(plan), "split": split and list(split),
                             **{k: v for k, v in got.items() if k != "parts"},
                             "activations": got["parts"]["activations"], "step_times": []})
            run = runs[i]
            run["step_times"].append(got["step_time"])
            run["step_time"] = statistics.median(run["step_times"])
            run["load"] = max(run["load"], got["load"])
            print(f"measured {plan.label()}: {got['step_time']:.3f} s, load {got['load']:.1f}", flush=True)
            if a.save:
                with open(a.save, "w") as fh:
                    json.dump(runs, fh, indent=1)
    print(f"{len(runs)} layouts in {time.time() - t0:.0f} s; after: {speed_drift(base)}\n")
    report(runs, base, m)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
