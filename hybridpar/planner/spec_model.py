"""The cost model of any model described by a ``ModelSpec``, from its meta-device profile.

The Llama has closed forms (``costs``); every other model (the ViT, the ResNet, the U-Net, the
user's own spec) is costed from ``profile.profile_spec``: per unit, its matmul FLOPs, the bytes
its other ops move, its tensor-parallel collectives, the bytes autograd keeps for backward
under each recompute setting, its parameters and the bytes of its output. A chunk of units on
one rank, for a micro-batch of b samples, then costs

    time    sum over its units and passes of  sum_op mm(F_op b) + weights / bw_w
            + bytes(b) k / bw + ops * o_op, times the CPU slow-down, + the tp collectives' times
    memory  sum of the units' kept bytes, minus a tensor two adjacent units both keep
    message the bytes of its last unit's output

with mm(F) = F / (the calibrated rate for a matmul of F FLOPs), ``weights`` the parameter bytes
its matmuls read (``Pass.weights``) at the calibrated cold-weight bandwidth bw_w. ``k`` and ``o_op`` carry the
calibration over from the model it was fitted on: the cluster's elementwise bandwidth was fitted
to the Llama's ``elementwise_bytes`` and its per-layer overhead to a Llama block's
forward+backward, so ``k`` is the ratio of those bytes to the profiled bytes of the reference
Llama block, and ``o_op`` the per-layer overhead over that block's dispatched ops.

Under bf16 (``c.dtype_bytes = 2``) the profile, made in fp32 (autocast does not run on meta
tensors), is scaled: kept floating bytes, messages, collectives and traffic by a / 4. This is
an approximation (norms and softmax statistics stay fp32 at run time).

Context parallelism is not costed for spec models (the planner proposes cp for the Llama).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..config import ConfigError, ModelConfig, pp_split
from ..models.spec import ModelSpec
from .cluster import Cluster
from .profile import RECOMPUTE, ModelProfile, UnitProfile, profile_spec


def example_batch(spec: ModelSpec, m: ModelConfig, cfg=None):
    """``b -> (inputs, targets)`` of a micro-batch of b samples, shapes as training gives them."""
    if callable(spec.data):
        from ..config import Config
        dataset = spec.data(cfg or Config(model=m))
        return lambda b: dataset.batch("train", 0, seed=0, global_batch_size=b, seq_len=m.seq_len)
    if spec.data == "text":
        return lambda b: (torch.zeros(b, m.seq_len, dtype=torch.long),
                          torch.zeros(b, m.seq_len, dtype=torch.long))
    image = (m.channels, m.image_size, m.image_size)
    if spec.data == "denoising":
        return lambda b: (torch.zeros(b, *image), torch.zeros(b, *image))
    return lambda b: (torch.zeros(b, *image), torch.zeros(b, dtype=torch.long))


class SpecModel:
    """A model the planner costs from its profile; ``per_sample``: tokens per sample (text) or
    1 (an image), for the throughput column."""

    def __init__(self, config: ModelConfig, spec: ModelSpec | None = None, cfg=None, *,
                 pp_split: str = "", settings: tuple[str, ...] = RECOMPUTE, example=None,
                 measure: bool = False):
        from ..models import spec_for
        self.config, self.pp_split, self.settings = config, pp_split, settings
        self.measure = measure  # compute timed on this machine (unit_timer), not modelled
        self.spec = spec or spec_for(config)
        # a training rank passes its own data's batches: the user's dataset is not loaded again
        self.example = example or example_batch(self.spec, config, cfg)
        self.per_sample = config.seq_len if self.spec.data == "text" else 1
        self._profiles: dict = {}
        self._checked: dict = {}
        self._splits: dict = {}
        self._times: dict = {}

    # the ModelConfig fields the search reads
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def n_layers(self) -> int:
        return len(self.spec.blocks)

    def profile(self, tp: int, sp: bool = False, dp_sync: bool = True) -> ModelProfile:
        """The units at this tp degree, as run with data-parallel replicas (``dp_sync``) or
        without: they differ only for a model that synchronises across them (SyncBatchNorm)."""
        key = (tp, sp and tp > 1, dp_sync)
        if key not in self._profiles:
            synced = key[:2] + (True,)
            if not dp_sync and synced in self._profiles and not any(
                    u.fwd[r].dp_comm or u.bwd[r].dp_comm for u in self._profiles[synced].units
                    for r in self.settings):
                self._profiles[key] = self._profiles[synced]
            else:
                self._profiles[key] = profile_spec(self.spec, self.example, tp=tp, sequence_parallel=key[1],
                                                   settings=self.settings, dp_sync=dp_sync)
        return self._profiles[key]

    def measured(self, c: Cluster, *, tp: int, sp: bool, dp_sync: bool, recompute: str, b: int,
                 threads: int) -> dict[str, tuple[float, float]]:
        """{unit: (forward s, backward s)} of a micro-batch of b, timed on this machine's device
        (the CPU for a CPU profile, else the GPU) in the cluster's compute dtype."""
        key = (tp, sp and tp > 1, dp_sync, recompute, b, threads, c.dtype_bytes, bool(c.cores))
        if key not in self._times:
            from .unit_timer import time_units
            self._times[key] = time_units(
                self.spec, self.example, b=b, tp=tp, sequence_parallel=key[1], recompute=recompute,
                dp_sync=dp_sync, threads=threads, device="cpu" if c.cores else "cuda",
                autocast_dtype=torch.bfloat16 if c.dtype_bytes == 2 else None)
        return self._times[key]

    def check_tp(self, tp: int, sp: bool) -> str | None:
        """Why the spec cannot run at this tp degree (one line), or None."""
        key = (tp, sp)
        if key not in self._checked:
            from ..parallel.tensor_parallel.apply import check_plan
            from ..config import Config, ParallelConfig, validate
            why = None
            try:
                if not self.config.spec:  # a built-in model: the config's own checks
                    validate(Config(model=self.config,
                                    parallel=ParallelConfig(dp=1, tp=tp, sequence_parallel=sp)))
                if self.spec.check is not None:
                    self.spec.check(tp)
                with torch.device("meta"):
                    model = self.spec.build()
                check_plan(model, dict(self.spec.tp_plan), tp, where=self.spec.name, sequence_parallel=sp)
            except (ConfigError, ValueError) as e:
                why = str(e)
            if why is None and tp > 1 and not self.spec.tp_plan:
                why = f"model {self.spec.name!r} has no tp_plan: tensor parallelism would split nothing"
            self._checked[key] = why
        return self._checked[key]

    def describe(self) -> str:
        p = self.profile(1)
        return (f"{self.spec.name}: {len(self.spec.units)} units ({len(self.spec.blocks)} blocks), "
                f"{sum(u.params for u in p.units) / 1e6:.2f} M parameters, "
                f"{3 * self.sample_flops() / 1e9:.3g} GFLOP per sample (fwd+bwd)")

    def sample_flops(self) -> float:
        """Forward FLOPs of one sample: the spec's (flops_per_sample / 3) or the profile's."""
        if self.spec.flops_per_sample:
            return self.spec.flops_per_sample / 3
        return sum(sum(u.fwd[self.settings[0]].matmuls) for u in self.profile(1).units)

    def step_flops(self, global_batch: int) -> float:
        return 3.0 * self.sample_flops() * global_batch


# ---- calibration carried over from the Llama block -------------------------------------------

@lru_cache(maxsize=None)
def _reference() -> tuple[float, int, int]:
    """(profiled traffic bytes of the default Llama block's forward at one sequence,
    dispatched ops of the calibration's tiny Llama block's forward, of its backward)."""
    from ..models import spec_for
    m = ModelConfig()
    spec = spec_for(m)
    prof = profile_spec(spec, example_batch(spec, m), settings=("none",), dp_sync=False)
    block = prof.unit(spec.blocks[0])
    tiny = ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, seq_len=8)
    tspec = spec_for(tiny)
    tb = profile_spec(tspec, example_batch(tspec, tiny), settings=("none",),
                      dp_sync=False).unit(tspec.blocks[0])
    return block.fwd["none"].traffic.at(1), tb.fwd["none"].ops, tb.bwd["none"].ops


def traffic_scale() -> float:
    """Bytes of the calibrated elementwise model per profiled byte (the Llama block's ratio, as
    a CPU runs it: its GEMMs unfused)."""
    from .timing import elementwise_bytes
    m = ModelConfig()
    return elementwise_bytes(m, m.seq_len, 1, False, 4, fused=False) / _reference()[0]


def op_overhead(c: Cluster, kind: str = "fwd") -> float:
    """Seconds of framework dispatch per op of a forward or a backward pass: the calibrated
    block's overhead in that pass (``Cluster.layer_overhead``) over its ops there."""
    _, ops_f, ops_b = _reference()
    fwd, bwd = c.layer_overhead()
    return fwd / ops_f if kind == "fwd" else bwd / ops_b


# ---- time -----------------------------------------------------------------------------------

def pass_time(u: UnitProfile, kind: str, recompute: str, c: Cluster, b: int, *, threads: int,
              slow: float, tp: int, world: float, replicas: int = 1,
              inter: bool = False, measured: float | None = None) -> tuple[float, float]:
    """(seconds, of which communication) of one forward or backward of unit ``u``: its tp
    collectives over tp ranks, its data-parallel ones (SyncBatchNorm) over the ``replicas``,
    each after an equal share of the unit's compute; its compute modelled from the profile,
    or ``measured`` (seconds, alone on the device)."""
    from .costs import collective_time
    ps = (u.fwd if kind == "fwd" else u.bwd)[recompute]
    scale = c.dtype_bytes / 4
    if measured is None:
        mm = (sum(b * f / c.flop_rate(b * f, threads) for f in ps.timed if f > 0)
              + sum(b * f / c.conv_rate(b * f, threads, channels=ch, stride=st)
                    for f, ch, st in ps.convs if f > 0)
              + sum(b * f / c.conv_rate(b * f, threads, backward=True, channels=ch, stride=st)
                    for f, ch, st in ps.conv_grads if f > 0))
        ew = max(ps.traffic.at(b), 0.0) * scale * traffic_scale() / c.elementwise_bw(threads)
        cold = c.weight_time(ps.weights * scale, threads)
        measured = mm + cold + ew + ps.ops * op_overhead(c, kind)
    compute = measured * slow
    # the unit's compute falls between its collectives: its share per call is the gap whose
    # latency each pays (``collective_time``)
    gap = compute / max(1, len(ps.comm) + len(ps.dp_comm))
    comm = sum(collective_time(c, op, tp, nbytes.at(b) * scale, world=world, gap=gap)
               for op, nbytes in ps.comm)
    comm += sum(collective_time(c, op, replicas, nbytes.at(b), inter=inter, world=world, gap=gap)
                for op, nbytes in ps.dp_comm)  # statistics: fp32 under any precision
    return compute + comm, comm


def unit_times(model: SpecModel, plan, c: Cluster, *, threads: int = 1, slow: float = 1.0,
               busy_ranks: float = 0.0, tp: int | None = None) -> dict[str, tuple[float, float, float, float]]:
    """Per unit: (forward s, backward s, of which communication in each) of one micro-batch."""
    from .costs import spans_nodes
    tp = plan.tp if tp is None else tp
    prof = model.profile(tp, plan.sequence_parallel, plan.replicas > 1)
    kw = dict(threads=threads, slow=slow, tp=tp, world=busy_ranks, replicas=plan.replicas,
              inter=spans_nodes(c, plan, "dp"))
    timed = (model.measured(c, tp=tp, sp=plan.sequence_parallel, dp_sync=plan.replicas > 1,
                            recompute=plan.recompute, b=plan.mb_size, threads=threads)
             if model.measure else None)
    out, done = {}, {}
    for u in prof.units:
        key = id(u.fwd[plan.recompute])  # units profiled as one (identical blocks) share it
        if timed is not None:
            key = (key, timed[u.name])
        if key not in done:
            f, cf = pass_time(u, "fwd", plan.recompute, c, plan.mb_size, **kw,
                              measured=timed[u.name][0] if timed else None)
            bk, cb = pass_time(u, "bwd", plan.recompute, c, plan.mb_size, **kw,
                               measured=timed[u.name][1] if timed else None)
            done[key] = (f, bk, cf, cb)
        out[u.name] = done[key]
    return out


# ---- the pipeline split ---------------------------------------------------------------------

def balanced_split(costs: list[float], parts: int, *, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Blocks per stage: the contiguous partition of the blocks' ``costs`` into ``parts``
    non-empty runs minimising the largest stage cost, the first stage also paying ``first``
    (the stem) and the last ``last`` (the head). Dynamic programming over (blocks, stages),
    O(parts n^2); ties go to the split that puts fewer blocks on the earlier stages."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} blocks into {parts} stages")
    prefix = [0.0]
    for x in costs:
        prefix.append(prefix[-1] + x)
    # best[k][i]: (the largest stage cost, split) of the first i blocks in k stages
    best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{0: (0.0, ())}]
    for k in range(1, parts + 1):
        row = {}
        for i in range(k, n - (parts - k) + 1):
            cand = None
            for j in range(k - 1, i):
                if j not in best[k - 1]:
                    continue
                stage = prefix[i] - prefix[j] + (first if k == 1 else 0.0) + (last if k == parts else 0.0)
                worst = max(best[k - 1][j][0], stage)
                split = best[k - 1][j][1] + (i - j,)
                if cand is None or worst < cand[0] * (1 - 1e-9):
                    cand = (worst, split)
            row[i] = cand
        best.append(row)
    return list(best[parts][n][1])


def is_uneven(costs: list[float], tolerance: float = 0.05) -> bool:
    """Blocks whose costs differ by more than ``tolerance`` of the largest."""
    return bool(costs) and (max(costs) - min(costs)) > tolerance * max(costs)


def auto_split(model: SpecModel, plan, c: Cluster) -> tuple[list[int], dict[str, float]]:
    """(blocks per stage minimising the slowest stage's forward+backward, each unit's
    seconds), costed at tp = 1 on ``c`` (a stage's tp shards divide every unit alike)."""
    times = {k: f + b for k, (f, b, *_) in unit_times(model, plan, c, tp=1).items()}
    spec = model.spec
    split = balanced_split([times[u] for u in spec.blocks], plan.pp,
                           first=sum(times[u] for u in spec.stem), last=sum(times[u] for u in spec.head))
    return split, times


def split_for(model: SpecModel, plan, c: Cluster, requested: str = "") -> tuple[int, ...]:
    """Blocks per virtual stage, as the runtime splits them for this plan: the requested
    ``pp_split`` ("a,b,..." or "auto"), else balanced by count when the blocks cost the same
    and by predicted time when they do not (interleaved chunks always by count)."""
    parts = plan.pp * plan.virtual_stages
    if requested and requested != "auto":
        return tuple(pp_split(model.n_layers, parts, requested))
    if plan.virtual_stages > 1 or plan.pp == 1:
        return tuple(pp_split(model.n_layers, parts))
    key = (plan.pp, plan.mb_size, plan.recompute, requested, c.name)
    if key not in model._splits:
        model._splits[key] = _split_by_cost(model, plan, c, requested)
    return model._splits[key]


def _split_by_cost(model: SpecModel, plan, c: Cluster, requested: str) -> tuple[int, ...]:
    parts = plan.pp * plan.virtual_stages
    split, times = auto_split(model, plan, c)
    if requested == "auto" or is_uneven([times[u] for u in model.spec.blocks]):
        return tuple(split)
    return tuple(pp_split(model.n_layers, parts))


# ---- memory ---------------------------------------------------------------------------------

def chunk_activations(model: SpecModel, plan, c: Cluster, units: list[str]) -> float:
    """Bytes one micro-batch's forward of these units keeps for backward (the runtime meter's
    count: a storage once per chunk)."""
    prof = model.profile(plan.tp, plan.sequence_parallel, plan.replicas > 1)
    b, rc, scale = plan.mb_size, plan.recompute, c.dtype_bytes / 4
    total, prev, consts = 0.0, None, {}
    for name in units:
        u = prof.unit(name)
        consts.update(u.consts[rc])
        fl, integer = u.saved[rc]
        total += fl.at(b) * scale + integer.at(b)
        if prev is not None:  # the tensor between two units, kept by both: once
            for kept_out, kept_in in zip(prev.shared_out[rc], u.shared_in[rc]):
                if kept_out.at(b) > 0 and kept_in.at(b) > 0:
                    total -= min(kept_out.at(b), kept_in.at(b)) * scale
        prev = u
    return total + sum(consts.values()) * scale


def chunk_params(model: SpecModel, tp: int, sp: bool, units: list[str]) -> tuple[int, int]:
    prof = model.profile(tp, sp)
    return (sum(prof.unit(u).params for u in units), sum(prof.unit(u).tensors for u in units))


def message_bytes(model: SpecModel, plan, c: Cluster, unit: str) -> float:
    """Bytes of the pipeline message after ``unit`` (its output; fp32 profile scaled)."""
    u = model.profile(plan.tp, plan.sequence_parallel).unit(unit)
    return u.out_bytes.at(plan.mb_size) * c.dtype_bytes / 4


def memory(model: SpecModel, plan, c: Cluster, stage: int, split: tuple[int, ...]) -> dict[str, float]:
    """Bytes on one rank of ``stage`` (``costs.memory``'s terms, from the profile)."""
    from .costs import in_flight
    units = model.spec.stage_units(list(split))
    vs = [ch * plan.pp + stage for ch in range(plan.virtual_stages)]
    n = tensors = cast = 0
    prof = model.profile(plan.tp, plan.sequence_parallel)
    for v in vs:
        dn, dt = chunk_params(model, plan.tp, plan.sequence_parallel, units[v])
        n, tensors = n + dn, tensors + dt
        cast += sum(prof.unit(u).cast_params for u in units[v])
    shard = plan.replicas if plan.zero1 else 1
    per_chunk = [chunk_activations(model, plan, c, units[v]) for v in vs]
    act = in_flight(plan, stage) * sum(per_chunk) / len(per_chunk)
    out = {"params": 4.0 * n, "grads": 4.0 * n,
           "optimizer": 8.0 * n / shard + 4.0 * math.ceil(tensors / shard), "activations": act,
           "working": float(c.dtype_bytes * cast) if c.dtype_bytes < 4 else 0.0}
    out["total"] = sum(out.values())
    return out


def pipeline_split(cfg, spec: ModelSpec, device_type: str = "cpu", example=None) -> tuple[list[int], str]:
    """(blocks per virtual stage, a note saying how they were chosen) for a training run:
    ``parallel.pp_split`` as given, else by count (pp = 1, interleaving, or blocks that cost
    the same), else (``auto``, or uneven blocks) the split minimising the slowest stage's
    predicted forward+backward on the device's preset (``cpu``, or ``h100-80g`` on CUDA: only
    the units' relative costs matter; every rank computes the same split from the same
    profile). ``example(b)``: a micro-batch of b samples (default: shaped like ``spec.data``)."""
    from .cluster import PRESETS
    from .costs import Plan
    p, t = cfg.parallel, cfg.train
    parts, n = p.pp * p.virtual_stages, len(spec.blocks)
    if p.pp_split and p.pp_split != "auto":
        return pp_split(n, parts, p.pp_split), "as given"
    even = pp_split(n, parts)
    if p.pp == 1 or p.virtual_stages > 1:
        return even, "by count"
    model = SpecModel(cfg.model, spec, cfg, settings=(p.recompute,), example=example)
    c = PRESETS["h100-80g" if device_type == "cuda" else "cpu"]
    mb = max(1, t.global_batch // (p.dp * p.cp * p.microbatches))
    plan = Plan(1, 1, p.pp, p.microbatches, mb, recompute=p.recompute)
    try:
        split, times = auto_split(model, plan, c)
    except Exception as e:  # a model the meta device cannot run: say so, never guess silently
        if p.pp_split == "auto":
            raise ConfigError(f"parallel.pp_split=auto: model {spec.name!r} could not be profiled on "
                              f"the meta device ({type(e).__name__}: {e}); give the split as "
                              f"parallel.pp_split='a,b,...'") from None
        return even, f"by count (the blocks could not be profiled: {type(e).__name__})"
    if p.pp_split != "auto" and not is_uneven([times[u] for u in spec.blocks]):
        return even, "by count (the blocks cost the same)"
    stages = [sum(times[u] for u in units) for units in spec.stage_units(split)]
    return split, ("auto: predicted forward+backward per stage "
                   + " | ".join(f"{1e3 * s:.3g}" for s in stages) + f" ms on the {c.name} preset")
