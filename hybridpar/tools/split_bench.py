"""Benchmark (not a test): the automatic pipeline split against the split by count.

    python -m hybridpar.tools.split_bench [--profile PROFILE.json] [--pps 2 4] [--measure-units]
        [--save RUNS.json]  then, after changing the model: --replay RUNS.json

Trains the ResNet (whose blocks differ in cost: full-resolution blocks move more bytes per
FLOP than the later, narrower-in-space ones, and a transition block adds a projection) at
dp=1, pp=2 and pp=4, 1F1B, once with ``pp_split`` by count and once with the split the planner
chooses, alternating the two over ``--rounds`` (each going first in every other round).
Prints per layout: the blocks per stage, the predicted forward+backward of one micro-batch on
each stage, the measured one (the stage's forward and backward actions summed over the step,
over the micro-batches; median of the steps after the warm-up), the error of the slowest stage's prediction, the slowest stage's
range over the rounds (the machine's noise, against which to read the error), and the measured
step time with its ratio to the split by count measured in the same run. A second table parts
the error in two: each stage's compute alone as modelled against the thread CPU time its
actions measured (the cost model), and the wall over that CPU time, measured against the
prediction over the modelled compute alone (the sharing of the cores by the ranks and their
messages, which the simulator plays out).

The machine's speed drifts (on the 2-core machine here, the ResNet's compute alone read 9.5 to
14.2 ms within ten seconds, while the reference block moved 7%), so each run also times every
unit alone on rank 0 (``unit_timer``, the other ranks waiting in a barrier), before and after
its steps; the ``at run speed`` column is the slowest stage's error of the prediction made
from those timings (the cost model's level taken out: what is left is the schedule, the
sharing of the cores and the messages), next to the raw error of the profile's prediction.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace

from ..config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig, pp_split


def _time_units(cfg: Config, mesh) -> dict[str, tuple[float, float]] | None:
    """Rank 0: every unit's forward and backward alone, now (the others wait in a barrier)."""
    import torch.distributed as dist

    from ..planner.spec_model import SpecModel
    from ..planner.unit_timer import time_units

    times = None
    if mesh.rank == 0:
        sm = SpecModel(cfg.model)
        times = time_units(sm.spec, sm.example, b=cfg.train.global_batch // cfg.parallel.microbatches,
                           repeats=15)
    if dist.is_initialized():
        dist.barrier()
    return times


def _worker(cfg: Config, steps: int) -> dict | None:
    import torch.distributed as dist

    from ..engine.launch import setup, teardown
    from ..engine.train import Trainer
    from ..parallel.pipeline.schedules import Op

    mesh = setup(cfg)
    trainer = Trainer(cfg, mesh)
    before = _time_units(cfg, mesh)
    busy = [0.0, 0.0]  # wall, this thread's CPU

    def on_action(a, t0, t1):
        if a.op in (Op.FWD, Op.BWD):
            busy[0] += t1 - t0
            busy[1] += trainer.runner.action_cpu

    trainer.runner.on_action = on_action
    per_step, cpu, steps_s = [], [], []
    M = cfg.parallel.microbatches
    for _ in range(steps):
        busy[:] = [0.0, 0.0]
        h = trainer.train_step()
        per_step.append(busy[0] / M)
        cpu.append(busy[1] / M)
        steps_s.append(h["step_time_s"])
    after = _time_units(cfg, mesh)
    mine = (mesh.pp_rank, per_step, cpu)
    out = [mine] * mesh.layout.world_size
    if dist.is_initialized():
        dist.all_gather_object(out, mine)
    del trainer
    teardown(mesh)
    if mesh.rank:
        return None
    stages, cpus = {}, {}
    for stage, times, c in out:
        stages.setdefault(stage, times)
        cpus.setdefault(stage, c)
    units = {u: tuple((x + y) / 2 for x, y in zip(before[u], after[u])) for u in before}
    return {"stages": stages, "cpu": cpus, "step_times": steps_s, "units": units}


def main(argv=None) -> int:
    from ..engine.launch import spawn
    from ..planner.cluster import load_cluster
    from ..planner.costs import Plan
    from ..planner.spec_model import SpecModel, split_for
    from ..planner.timing import costing, stage_times
    from .calibrate import speed_drift

    ap = argparse.ArgumentParser(prog="python -m hybridpar.tools.split_bench")
    ap.add_argument("--profile", default="cpu", help="calibrated profile JSON (or the cpu preset)")
    ap.add_argument("--pps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=16, help="synthetic images of this size")
    ap.add_argument("--n-layers", type=int, default=8, help="ResNet blocks")
    ap.add_argument("--measure-units", action="store_true",
                    help="predict from each unit timed on this machine (as `plan --measure-units`), "
                         "not from the profile's FLOP and byte model")
    ap.add_argument("--verbose", action="store_true", help="print each run's error at its speed")
    ap.add_argument("--save", help="write the measurements to this JSON file")
    ap.add_argument("--replay", help="predict again for the measurements of a --save file "
                                     "(after a change to the cost model); runs nothing")
    a = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    saved = None
    if a.replay:
        with open(a.replay) as f:
            saved = json.load(f)
        for k in ("pps", "steps", "warmup", "rounds", "microbatches", "global_batch", "image_size",
                  "n_layers"):
            setattr(a, k, saved["args"][k])
    model = ModelConfig(name="resnet", n_layers=a.n_layers, image_size=a.image_size, channels=3)
    base = load_cluster(a.profile)
    print(f"resnet {a.n_layers} blocks on synthetic {a.image_size}x{a.image_size}x3 images, global "
          f"batch {a.global_batch}, {a.microbatches} micro-batches, 1F1B; profile {a.profile}; "
          f"{os.cpu_count()} cores; medians of steps {a.warmup + 1}..{a.steps} over {a.rounds} rounds"
          + (f"; replaying {a.replay}" if saved else f"\nbefore: {speed_drift(base)}\n"), flush=True)
    runs = {} if saved is None else saved["runs"]
    for pp in a.pps if saved is None else []:
        c = replace(base, nodes=1, devices_per_node=pp)
        plan = Plan(1, 1, pp, a.microbatches, a.global_batch // a.microbatches)
        splits = {"count": tuple(pp_split(a.n_layers, pp)),
                  "auto": split_for(SpecModel(model, measure=a.measure_units), plan, c, "auto")}
        got: dict[str, list] = {k: [] for k in splits}
        for i in range(a.rounds):
            # the order alternates: the split run second read slower in each of 5 runs here
            for name, split in list(splits.items())[::-1 if i % 2 else 1]:
                cfg = Config(model=model, data=DataConfig(images="synthetic"),
                             parallel=ParallelConfig(dp=1, pp=pp, microbatches=a.microbatches,
                                                     pp_split=",".join(map(str, split))),
                             train=TrainConfig(steps=a.steps, global_batch=a.global_batch,
                                               eval_every=0, progress=False))
                got[name].append(spawn(_worker, pp, cfg, a.steps)[0])
                print(f"measured pp={pp} {name} {split}", flush=True)
        runs[str(pp)] = {"splits": splits, "got": got}
    if a.save:
        with open(a.save, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f)
    head = (f"{'pp':>2} {'split':>8} {'blocks':>10} {'pred stage ms':>28} {'meas stage ms':>28} "
            f"{'slowest err':>11} {'at run speed':>12} {'rounds ms':>11} {'step s':>7} {'vs count':>8}")
    rows, parts = [], []
    for pp in a.pps:
        c = replace(base, nodes=1, devices_per_node=pp)
        plan = Plan(1, 1, pp, a.microbatches, a.global_batch // a.microbatches)
        spec_model = SpecModel(model, measure=a.measure_units)
        for name, split in runs[str(pp)]["splits"].items():
            got = [{**r, "stages": {int(k): v for k, v in r["stages"].items()},
                    "cpu": {int(k): v for k, v in r["cpu"].items()},
                    "units": {u: tuple(t) for u, t in r["units"].items()}}
                   for r in runs[str(pp)]["got"][name]]
            spec_model.pp_split = ",".join(map(str, split))  # the profile is kept
            pred = stage_times(spec_model, plan, c)
            alone = [f + b for f, b, *_ in costing(spec_model, plan, c).chunks(1.0, float(pp))]

            def steady(key: str, rs=got) -> list[float]:
                """Each stage's median over the runs' steps after the warm-up."""
                return [statistics.median(t for r in rs for t in r[key][s][a.warmup:])
                        for s in range(pp)]

            meas, cpu = steady("stages"), steady("cpu")
            # each run against the prediction from its own units' timings
            at_speed = []
            for r in got:
                timed = SpecModel(model, measure=True, pp_split=spec_model.pp_split)
                timed._profiles = spec_model._profiles  # the profile is the same
                timed.measured = lambda c, units=r["units"], **kw: units  # this run's timings
                at_speed.append(max(stage_times(timed, plan, c)) / max(steady("stages", [r])) - 1)
            parts.append((pp, name, alone, cpu, [p / x for p, x in zip(pred, alone)],
                          [m / x for m, x in zip(meas, cpu)]))
            step = statistics.median(t for r in got for t in r["step_times"][a.warmup:])
            rounds = [max(statistics.median(r["stages"][s][a.warmup:]) for s in range(pp)) for r in got]
            rows.append((pp, name, split, pred, meas, step, rounds, statistics.median(at_speed)))
            if a.verbose:
                print(f"pp={pp} {name}: each run at its speed " + " ".join(f"{x:+.1%}" for x in at_speed))
    print(("" if saved else f"after: {speed_drift(base)}\n") + head + "\n" + "-" * len(head))
    count_step = {pp: step for pp, name, _, _, _, step, _, _ in rows if name == "count"}
    for pp, name, split, pred, meas, step, rounds, at_speed in rows:
        err = (max(pred) - max(meas)) / max(meas)
        print(f"{pp:2d} {name:>8} {','.join(map(str, split)):>10} "
              f"{' '.join(f'{1e3 * x:6.2f}' for x in pred):>28} {' '.join(f'{1e3 * x:6.2f}' for x in meas):>28} "
              f"{err:+11.1%} {at_speed:+12.1%} {1e3 * min(rounds):5.1f}-{1e3 * max(rounds):<5.1f} {step:7.3f} "
              f"{count_step[pp] / step:7.2f}x")
    head = (f"\n{'pp':>2} {'split':>8} {'model alone ms':>28} {'thread CPU ms':>28} {'alone err':>9} "
            f"{'pred/alone':>20} {'wall/CPU':>20}")
    print(head + "\n" + "-" * len(head.strip()))
    for pp, name, alone, cpu, pred_x, meas_x in parts:
        print(f"{pp:2d} {name:>8} {' '.join(f'{1e3 * x:6.2f}' for x in alone):>28} "
              f"{' '.join(f'{1e3 * x:6.2f}' for x in cpu):>28} "
              f"{(max(alone) - max(cpu)) / max(cpu):+9.1%} {' '.join(f'{x:4.2f}' for x in pred_x):>20} "
              f"{' '.join(f'{x:4.2f}' for x in meas_x):>20}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
