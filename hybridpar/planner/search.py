"""Enumerate the layouts of a cluster, predict each, and rank them.

Constraints (the runtime's, plus one choice): tp stays inside a node (its 4 collectives per
block and micro-batch need the fastest links) and divides n_heads, n_kv_heads, d_ff and the
vocabulary; pp <= n_layers (interleaved: pp * v divides n_layers, M a multiple of pp); the
global batch is dp * M * micro-batch size. Memory is computed first (cheap) and only layouts
that fit are timed; identical schedule inputs are simulated once (cache).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ConfigError, ModelConfig
from .cluster import Cluster
from .costs import Plan, peak_memory, step_flops
from .timing import Prediction, predict_time

MODELS = {
    # the model `hybridpar train` trains by default
    "default": ModelConfig(),
    "llama-7b": ModelConfig(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, d_ff=11008,
                            vocab_size=32000, seq_len=4096),
    "llama-70b": ModelConfig(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                             vocab_size=32000, seq_len=4096),
    # GPT-3 (Brown et al. 2020) as in Narayanan et al. 2021: 96 layers, h=12288, 96 heads,
    # vocab padded to 51200. Its 4h GeLU MLP is written as SwiGLU with d_ff = 8h/3 = 32768:
    # the same parameters and FLOPs (3 * h * 32768 = 2 * h * 4h)
    "gpt3-175b": ModelConfig(n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96, d_ff=32768,
                             vocab_size=51200, seq_len=2048),
}
MODELS["ours"] = MODELS["default"]
CP_MIN_TOKENS = 4096


@dataclass(frozen=True)
class Row:
    plan: Plan
    mem: dict
    fits: bool
    pred: Prediction
    tokens_per_s: float
    mfu: float


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check(m, plan: Plan, c: Cluster) -> str | None:
    """Why ``plan`` cannot run on ``c`` (one line), or None."""
    if plan.world != c.world:
        return f"dp*cp*tp*pp = {plan.world} but the cluster has {c.world} devices"
    if plan.tp > c.devices_per_node:
        return f"tp={plan.tp} exceeds {c.devices_per_node} devices per node (tp stays inside a node)"
    if plan.pp * plan.virtual_stages > m.n_layers:
        return f"pp*v = {plan.pp * plan.virtual_stages} exceeds n_layers={m.n_layers}"
    if plan.virtual_stages > 1 and (plan.schedule != "interleaved" or plan.pp < 2
                                    or plan.microbatches % plan.pp):
        return "interleaving needs schedule=interleaved, pp >= 2 and microbatches a multiple of pp"
    if not isinstance(m, ModelConfig):  # a spec model: its own checks, cp not costed
        if plan.cp > 1:
            return "the planner costs cp for the Llama only"
        if m.pp_split not in ("", "auto") and len(m.pp_split.split(",")) != plan.pp * plan.virtual_stages:
            return f"parallel.pp_split={m.pp_split} has {len(m.pp_split.split(','))} stages, not pp*v"
        if m.pp_split == "auto" and plan.virtual_stages > 1:
            return "parallel.pp_split=auto is for one chunk per stage"
        return m.check_tp(plan.tp, plan.sequence_parallel and plan.tp > 1)
    for name in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        if getattr(m, name) % plan.tp:
            return f"tp={plan.tp} must divide {name}={getattr(m, name)}"
    if plan.cp > 1 and m.seq_len % (2 * plan.cp):
        return f"cp={plan.cp} needs seq_len={m.seq_len} to be a multiple of 2*cp"
    if plan.sequence_parallel and (m.seq_len // plan.cp) % plan.tp:
        return f"sequence parallel needs tp={plan.tp} to divide seq_len/cp={m.seq_len // plan.cp}"
    return None


def candidates(m: ModelConfig, c: Cluster, global_batch: int, *, max_mb: int = 8,
               fixed: dict | None = None) -> list[Plan]:
    """Every valid layout; ``fixed`` pins Plan fields (e.g. {"microbatches": 4})."""
    fixed = fixed or {}
    out = []
    for tp, pp, cp in _axes(m, c):
        dp = c.world // (tp * pp * cp)
        if global_batch % dp:
            continue
        for mb in [b for b in divisors(global_batch // dp) if b <= max_mb]:
            M = global_batch // (dp * mb)
            # interleaving only with equal chunks (Megatron requires it; unequal chunks
            # stall the interleaved pipeline beyond what its closed form predicts)
            scheds = [("1f1b", 1)] + ([("gpipe", 1)] + [("interleaved", v) for v in (2, 4)
                                                         if m.n_layers % (pp * v) == 0]
                                      if pp > 1 else [])
            for sched, v in scheds:
                for rc in ("none", "selective", "full"):
                    for z in ((False, True) if dp * cp > 1 else (False,)):
                        for sp in ((False, True) if tp > 1 else (False,)):
                            p = Plan(dp, tp, pp, M, mb, sched, v, rc, z, sp, cp)
                            if any(getattr(p, k) != val for k, val in fixed.items()):
                                continue
                            if check(m, p, c) is None:
                                out.append(p)
    return out


def _axes(m: ModelConfig, c: Cluster):
    """(tp, pp, cp) triples: tp inside a node; cp where the zigzag split fits the sequence
    (seq_len a multiple of 2*cp), and only for long sequences, a rank keeping at least
    ``CP_MIN_TOKENS`` of each: below that the ring's small blocks run the attention kernel and
    the links far from their peak, which this model does not capture (Megatron-Core's guidance
    likewise reserves cp for sequences of 8k tokens and more)."""
    for tp in divisors(min(c.world, c.devices_per_node)):
        for pp in divisors(c.world // tp):
            for cp in divisors(c.world // (tp * pp)):
                if cp == 1 or (isinstance(m, ModelConfig) and m.seq_len % (2 * cp) == 0 and m.seq_len // cp >= CP_MIN_TOKENS):
                    yield tp, pp, cp


def evaluate(m: ModelConfig, plan: Plan, c: Cluster, *, quick: bool = False) -> Row:
    mem = peak_memory(m, plan, c)
    pred = predict_time(m, plan, c, quick=quick)
    if isinstance(m, ModelConfig):
        tokens, flops = plan.global_batch * m.seq_len, step_flops(m, plan.global_batch)
    else:  # a spec model: samples (images) or tokens of its samples
        tokens, flops = plan.global_batch * m.per_sample, m.step_flops(plan.global_batch)
    mfu = flops / (pred.step_time * c.peak_total(c.world))
    return Row(plan, mem, mem["total"] <= c.device_mem, pred, tokens / pred.step_time, mfu)


def rank(m: ModelConfig, c: Cluster, global_batch: int, *, top: int = 10, fixed: dict | None = None,
         max_mb: int = 8) -> tuple[list[Row], int]:
    """(the best ``top`` layouts, fitting ones first by predicted step time, then the closest to
    fitting; how many valid layouts there were). Layouts are pruned by memory (cheap), by
    recomputation (the least that fits) and by the closed-form time before being simulated. Raises ConfigError when there is none."""
    if global_batch < 1:
        raise ConfigError(f"--global-batch={global_batch} must be at least 1")
    plans = candidates(m, c, global_batch, max_mb=max_mb, fixed=fixed)
    if not plans and not isinstance(m, ModelConfig):
        raise ConfigError(f"no valid layout of {c.world} devices for {m.name} and global batch "
                          f"{global_batch} (pp <= blocks={m.n_layers}; dp must divide the global "
                          f"batch; tp: {m.check_tp(2, False) or 'see the model tp_plan'})")
    if not plans:
        raise ConfigError(f"no valid layout of {c.world} devices for this model and global batch "
                          f"{global_batch} (tp must divide heads={m.n_heads}, kv heads={m.n_kv_heads}; "
                          f"pp <= layers={m.n_layers}; dp must divide the global batch)")
    sized = [(p, peak_memory(m, p, c)) for p in plans]
    fitting = _lightest_recompute([p for p, mem in sized if mem["total"] <= c.device_mem])
    # rank by the closed form, then simulate the leaders (and a margin) for the final order
    quick = sorted((evaluate(m, p, c, quick=True) for p in fitting), key=lambda r: r.pred.step_time)
    rows = sorted((evaluate(m, r.plan, c) for r in quick[:max(2 * top, 12)]),
                  key=lambda r: r.pred.step_time)[:top]
    if len(rows) < top:  # show why the rest do not fit: the smallest of them
        rest = sorted((x for x in sized if x[1]["total"] > c.device_mem), key=lambda x: x[1]["total"])
        rows += [evaluate(m, p, c) for p, _ in rest[:top - len(rows)]]
    return rows, len(plans)


def _lightest_recompute(plans: list[Plan]) -> list[Plan]:
    """Recomputation only adds compute: of the layouts that differ only in it, keep the one
    with the least recomputation that fits (none < selective < full)."""
    order = {"none": 0, "selective": 1, "full": 2}
    best: dict[Plan, Plan] = {}
    for p in plans:
        key = replace(p, recompute="none")
        if key not in best or order[p.recompute] < order[best[key].recompute]:
            best[key] = p
    return list(best.values())


def best_for(m: ModelConfig, c: Cluster, plan: Plan) -> Row:
    """Evaluate one given layout (e.g. a published one), failing with its reason if invalid."""
    why = check(m, plan, c)
    if why:
        raise ConfigError(why)
    return evaluate(m, plan, c)
