"""``hybridpar plan``: rank the layouts of a cluster for a model, and print or run the best.

    hybridpar plan --model gpt3-175b --cluster a100-80g --nodes 128 --devices-per-node 8 \\
        --global-batch 1536 --top 10
    hybridpar plan --cluster PROFILE.json --devices-per-node 4 --print-command   # this machine
    hybridpar plan --config run.toml --model.n_layers=12 --apply
    hybridpar plan --model.name=resnet --cluster a100-80g --nodes 2 --global-batch 256
    hybridpar plan --model.spec=mypkg.models:my_spec --cluster h100-80g

The built-in Llama is costed by closed forms; any other model (``--model.name=vit|resnet|unet``,
``--model.spec=...``) from a profile of its units on the meta device (``planner.spec_model``).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

from ..config import Config, ConfigError, ModelConfig, apply_updates, load_toml, parse_overrides
from ..planner.cluster import PRESETS, Cluster, load_cluster
from ..planner.costs import Plan
from ..planner.search import MODELS, Row, rank


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridpar plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Model sizes can be overridden as --model.field=value.")
    p.add_argument("--model", default="default",
                   help=f"Llama preset: {', '.join(MODELS)} (other models: --model.name=, --model.spec=)")
    p.add_argument("--config", help="TOML config: its [model] and train.global_batch")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: the config's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--cluster", default="cpu",
                   help=f"preset ({', '.join(PRESETS)}) or a profile JSON from `hybridpar calibrate`")
    p.add_argument("--nodes", type=int, help="nodes (default: the profile's)")
    p.add_argument("--devices-per-node", type=int,
                   help="devices (GPU) or ranks (CPU) per node (default: the profile's)")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--microbatches", type=int, help="only layouts with this many micro-batches")
    for axis in ("dp", "tp", "pp"):
        p.add_argument(f"--{axis}", type=int, help=f"only layouts with this {axis} degree")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), help="only this schedule")
    p.add_argument("--max-mb", type=int, default=None,
                   help="largest micro-batch size tried (default: 8 sequences for the Llama; for "
                        "other models every size, memory deciding: a vision model's samples are "
                        "small, and it trains best on large micro-batches without accumulation)")
    p.add_argument("--measure-units", action="store_true",
                   help="time each unit's forward and backward on this machine instead of modelling "
                        "its compute from FLOPs and bytes (a model other than the Llama, planned for "
                        "this machine: its CPU with a calibrated profile, or its GPU)")
    p.add_argument("--print-command", action="store_true", help="print `hybridpar train` for the best plan")
    p.add_argument("--apply", action="store_true", help="run the best plan now (this machine's ranks)")
    return p


def resolve(args, overrides: list[str]) -> tuple[Config, int]:
    """The config and global batch a plan is for."""
    if args.model not in MODELS:
        raise ConfigError(f"--model={args.model!r} is unknown; presets: {', '.join(MODELS)}")
    cfg = Config(model=MODELS[args.model])
    if args.config:
        cfg = apply_updates(cfg, load_toml(args.config), from_text=False)
    if args.seq_len:
        overrides = overrides + [f"--model.seq_len={args.seq_len}"]
    cfg = apply_updates(cfg, parse_overrides(overrides), from_text=True)
    gb = args.global_batch or cfg.train.global_batch
    return cfg, gb


def model_for(cfg: Config, measure: bool = False):
    """What the planner costs: the Llama's ModelConfig (closed forms), or a ``SpecModel``
    (``measure``: its units' compute timed on this machine)."""
    m = cfg.model
    if m.name == "llama" and not m.spec:
        return m
    from ..planner.spec_model import SpecModel
    return SpecModel(m, cfg=cfg, pp_split=cfg.parallel.pp_split, measure=measure)


def check_measurable(m, c: Cluster) -> None:
    """``--measure-units`` needs a spec model and this machine's device of the cluster's kind."""
    if isinstance(m, ModelConfig):
        raise ConfigError("--measure-units times the units of a spec model (--model.name=vit|resnet|"
                          "unet or --model.spec=...); the Llama's closed forms are calibrated by "
                          "`hybridpar calibrate`: drop --measure-units")
    if not c.cores:
        import torch
        if not torch.cuda.is_available():
            raise ConfigError(f"--measure-units times the units on this machine, which has no GPU, "
                              f"but cluster {c.name!r} is a GPU cluster: plan without "
                              f"--measure-units, or on a machine with that GPU")


def command(cfg: Config, plan: Plan, args, split=None) -> list[str]:
    """The ``hybridpar train`` arguments that run ``plan`` as is (``split``: the blocks per
    stage the prediction assumed, given explicitly so that the run uses them)."""
    argv = ["--dp", str(plan.dp), *(["--cp", str(plan.cp)] if plan.cp > 1 else []),
            "--tp", str(plan.tp), "--pp", str(plan.pp),
            "--microbatches", str(plan.microbatches), "--schedule", plan.schedule,
            "--global-batch", str(plan.global_batch)]
    if args.config:
        argv = ["--config", args.config] + argv
    extra = {"virtual_stages": (plan.virtual_stages, 1), "recompute": (plan.recompute, "none"),
             "zero1": (plan.zero1, False), "sequence_parallel": (plan.sequence_parallel, False)}
    argv += [f"--parallel.{k}={str(v).lower() if isinstance(v, bool) else v}"
             for k, (v, default) in extra.items() if v != default]
    if split is not None and plan.virtual_stages == 1:
        argv.append(f"--parallel.pp_split={','.join(map(str, split))}")
    defaults = ModelConfig()
    argv += [f"--model.{f.name}={getattr(cfg.model, f.name)}" for f in fields(ModelConfig)
             if getattr(cfg.model, f.name) != getattr(defaults, f.name)]
    return argv


def _mem(x: float, big: bool) -> str:
    return f"{x / 2 ** 30:.1f}" if big else f"{x / 2 ** 20:.1f}"


def format_table(rows: list[Row], c: Cluster, per: str = "tok/s") -> str:
    big = max(r.mem["total"] for r in rows) > 4 * 2 ** 30
    unit = "GiB" if big else "MiB"
    cp = any(r.plan.cp > 1 for r in rows)  # a cp column (its ring time counts in "tp s") if used
    head = (f"{'#':>2} {'dp':>4} " + (f"{'cp':>3} " if cp else "") + f"{'tp':>2} {'pp':>3} {'mb x M':>9} {'schedule':>13} {'recomp':>9} "
            f"{'zero1':>5} {'sp':>3} {'step s':>8} {per:>9} {'MFU':>5} {'bubble':>6} "
            f"{'tp s':>7} {'pp s':>7} {'dp s':>7} | {'params':>7} {'grads':>7} {'optim':>7} "
            f"{'activ':>7} {'work':>7} {'total':>7} {unit:>3} fits")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        p, q, mem = r.plan, r.pred, r.mem
        lines.append(
            f"{i:2d} {p.dp:4d} " + (f"{p.cp:3d} " if cp else "") + f"{p.tp:2d} {p.pp:3d} {f'{p.mb_size}x{p.microbatches}':>9} {p.schedule_label:>13} "
            f"{p.recompute:>9} {'y' if p.zero1 else '-':>5} {'y' if p.sequence_parallel else '-':>3} "
            f"{q.step_time:8.3f} {r.tokens_per_s:9.0f} {r.mfu:5.1%} {q.bubble:6.1%} "
            f"{q.comm['tp']:7.3f} {q.comm['pp']:7.3f} {q.comm['dp']:7.3f} | "
            + " ".join(f"{_mem(mem.get(k, 0.0), big):>7}"
                       for k in ("params", "grads", "optimizer", "activations", "working", "total"))
            + f"     {'yes' if r.fits else 'NO'}")
    return "\n".join(lines)


def plan_main(argv: list[str], run_train=None) -> int:
    args, rest = _parser().parse_known_args(argv)
    bad = [x for x in rest if not (x.startswith(("--model.", "--parallel.pp_split=")) and "=" in x)]
    if bad:
        raise ConfigError(f"unknown argument '{bad[0]}'; see hybridpar plan --help")
    cfg, gb = resolve(args, rest)
    m = model_for(cfg, measure=args.measure_units)
    c = load_cluster(args.cluster, nodes=args.nodes, devices_per_node=args.devices_per_node)
    if args.measure_units:
        check_measurable(m, c)
    if args.top < 1:
        raise ConfigError(f"--top={args.top} must be at least 1")
    fixed = {k: v for k, v in (("microbatches", args.microbatches), ("schedule", args.schedule),
                               ("dp", args.dp), ("tp", args.tp), ("pp", args.pp)) if v}
    max_mb = args.max_mb if args.max_mb is not None else (8 if isinstance(m, ModelConfig) else gb)
    if max_mb < 1:
        raise ConfigError(f"--max-mb={max_mb} must be at least 1")
    rows, n = rank(m, c, gb, top=args.top, fixed=fixed, max_mb=max_mb)
    if isinstance(m, ModelConfig):
        what = (f"model: {m.n_layers} layers, d_model {m.d_model}, heads {m.n_heads}/{m.n_kv_heads} kv, "
                f"d_ff {m.d_ff}, vocab {m.vocab_size}, seq {m.seq_len}")
    else:
        what = f"model {m.describe()} (profiled on the meta device" + (
            "; compute timed on this machine)" if m.measure else ")")
    print(f"{what}; global batch {gb}; cluster "
          f"{c.name}: {c.nodes} x {c.devices_per_node} devices, {c.device_mem / 2 ** 30:.1f} GiB each; "
          f"{n} valid layouts (tp inside a node, rank order tp-cp-dp-pp)")
    print(format_table(rows, c, per=("tok/s" if isinstance(m, ModelConfig) or m.per_sample > 1
                                     else "img/s")))
    best = rows[0]
    if not best.fits:
        print("no layout fits in device memory: the rows above are the closest")
    split = None
    if best.plan.pp > 1:
        from ..planner.timing import costing, stage_times
        times = stage_times(m, best.plan, c)
        split = getattr(costing(m, best.plan, c), "split", None)
        p = best.plan
        blocks = [sum(split[ch * p.pp + s] for ch in range(p.virtual_stages)) for s in range(p.pp)]
        print("best layout's pipeline stages: " + " | ".join(
            f"{x} blocks {1e3 * t:.3g} ms" for x, t in zip(blocks, times))
              + " (forward+backward of one micro-batch)")
    argv_train = command(cfg, best.plan, args, split=split if not isinstance(m, ModelConfig) else None)
    if args.print_command or args.apply:
        launcher = "hybridpar train" if c.nodes == 1 else \
            f"torchrun --nnodes {c.nodes} --nproc-per-node {c.devices_per_node} -m hybridpar train"
        print(f"{launcher} {' '.join(argv_train)}")
    if args.apply:
        if c.nodes > 1 or c.world > 4 * (os.cpu_count() or 1):
            raise ConfigError(f"--apply runs on this machine; a {c.nodes}-node plan needs the "
                              f"torchrun command above on every node")
        if not best.fits:
            raise ConfigError("--apply: the best plan does not fit in memory")
        return run_train(["train", *argv_train])
    return 0
