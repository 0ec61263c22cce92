"""Step time of a layout: cost-model durations run through the runtime's own schedule simulator.

Per virtual stage and micro-batch the cost model gives the forward and backward seconds (matmuls
at the calibrated rate for their size, memory-bound elementwise work, tp collectives, which
block the rank, recomputation, and the framework's fixed per-layer / per-action overhead);
``pipeline.simulate`` runs the very action lists ``hybridpar train`` executes with them, the p2p
transfer as each message's time. After the schedule, per stage: the dp gradient all-reduce
(ZeRO-1: reduce-scatter + parameter all-gather), of which all buckets but the last are assumed
hidden behind the last backward (they are launched as they become ready) unless the ranks fill
a CPU's cores (then the reduction competes with the backward for them: none is hidden), the optimizer, and
the per-step overhead. The step ends when the slowest stage is done (the runtime's step-end
all-reduce of loss and norm synchronises every rank).

On a CPU the ranks share the cores. The simulator shares them moment by moment (processor
sharing): while n of the pipeline's p stages compute, each computes at 1 / the calibrated
slow-down of n * world / p busy 1-thread processes (a stage stands for its tp peers and dp
replicas, which compute in lockstep with it), or, where two working stages are bound to one
core (``launch.core_share``) while another idles, at half of that core (``_bound_speeds``). So
a light stage runs slower while the heavy ones compute beside it, and a bubble or a p2p wait
frees a core for another rank; a stage's tp collectives hold it without computing. After the
schedule, and in the closed form used for pruning, compute is slowed by the average number of
busy ranks (the world times the non-idle share of the pipeline from a first simulation). The tp
collectives cost what was calibrated in concurrent groups of that many busy ranks
(``collectives_shared``: a peer that is descheduled when a collective starts must be woken
first); the dp sync after the schedule, which every rank joins, at the whole world. A pipeline
message, where the profile has its core time (``Cluster.p2p_cpu``), is that work on the shared
cores for each send and receive (Gloo's transport thread wakes and handles the socket on the
cores the stages compute on: 0.35-1.0 ms an op between matmuls on 2 cores, against 0.06 ms back
to back), then the pair's back-to-back latency; so the simulator plays out the wait for a
descheduled peer and the compute it slows, and counts that work as busy when it re-estimates
the busy ranks.
Without it, the message costs the in-situ time calibrated in concurrent groups, using no core.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..config import ModelConfig, bucket_bytes
from ..parallel.pipeline.schedules import Op, build
from ..parallel.pipeline.simulate import simulate
from .cluster import Cluster
from .costs import (OPT_BYTES, Plan, collective_time, head_flops, matmuls, spans_nodes, stage_layers,
                    stage_params)

SIM_LIMIT = 2048
"""Compute actions simulated exactly; beyond it, linear extrapolation in M from two smaller
simulations (the steady state of every schedule adds the same time per micro-batch), and
beyond that a closed form (both checked against the full simulation in the tests)."""


@dataclass(frozen=True)
class Prediction:
    step_time: float
    makespan: float
    """The pipeline schedule alone."""
    bubble: float
    comm: dict
    """Seconds per step of each axis's communication on the slowest stage (tp, pp, dp)."""
    method: str
    """'simulate', 'extrapolate' or 'closed form'."""


def elementwise_bytes(m: ModelConfig, n: int, tp: int, sp: bool, a: int, *, fused: bool) -> float:
    """Memory traffic of the non-matmul work of one block's forward on n tokens: RMSNorms in
    fp32 (~24 passes of n*d), RoPE, kv-head repeats and the attention kernel's own traffic
    (~14 passes per query head, 10 per kv head), SwiGLU (~8 passes of n*f), tp output clones,
    and, ``fused`` (``fuses``), ``fused_linear``'s concatenated q/k/v and w1/w3 weights (read and
    written once, whatever n: it weighs on small micro-batches). Only the proportions matter:
    ``calibrate`` fits the bandwidth that turns these bytes into the measured time of a real
    block, so they act as a per-shape weighting."""
    d, e, f = m.d_model, m.head_dim, m.d_ff // tp
    h, g = m.n_heads // tp, m.n_kv_heads // tp
    return (4 * n * d * 24 / (tp if sp else 1) + a * (n * e * (14 * h + 10 * g) + 8 * n * f)
            + (4 * a * n * d if tp > 1 else 0) + fused * 2 * a * d * ((h + 2 * g) * e + 2 * f))


def fuses(c: Cluster) -> bool:
    """Whether the Llama's q/k/v and w1/w3 GEMMs are fused on ``c``'s devices: on a GPU, and on
    a CPU computing in bf16/fp16 (``models.fused.fuses``); not on a CPU in fp32."""
    return not c.cores or c.dtype_bytes < 4


def _threads(c: Cluster, plan: Plan) -> int:
    """Threads of each rank: the node's cores shared by the ranks it runs."""
    return c.threads_per_rank(min(c.devices_per_node, plan.world))


def _chunk_costs(m: ModelConfig, plan: Plan, c: Cluster, *, layers: int, embed: bool, head: bool,
                 slow: float, busy_ranks: float = 0.0) -> tuple[float, float, float, float]:
    """(forward s, backward s, of which tp communication in each) of one micro-batch on one chunk;
    ``busy_ranks``: how many ranks share the CPU's cores meanwhile (0: the group alone)."""
    t, a, w = plan.tp, c.dtype_bytes, busy_ranks
    n, d = plan.mb_size * m.seq_len // plan.cp, m.d_model
    h, g, e, f = m.n_heads // t, m.n_kv_heads // t, m.head_dim, m.d_ff // t
    threads = _threads(c, plan)
    bw = c.elementwise_bw(threads)
    sp = plan.sequence_parallel and t > 1

    def mm(flops: float) -> float:
        return flops / c.flop_rate(flops, threads)

    fused = fuses(c)
    gemms = matmuls(m, n, t, fused=fused)
    core = next(x for name, _, x in gemms if name == "attention")
    mm_f = sum(mm(x) for _, _, x in gemms)
    # the weights read cold, once a pass, as ``Pass.weights`` counts: every weight, or with
    # ``fused_linear``'s GEMMs wo and w2 alone (it builds q/k/v's and w1/w3's in the pass, hot;
    # its backward builds them again)
    cold = c.weight_time(sum(x for name, x, _ in gemms if name != "attention"
                             and (not fused or name in ("wo", "w2"))) / (2 * n) * a, threads)
    ew_f = elementwise_bytes(m, n, t, sp, a, fused=fused) / bw
    ovh = c.overhead
    # the framework's dispatch is CPU work too: it slows down with the compute
    ovh_f, ovh_b = c.layer_overhead()
    layer_f = (mm_f + cold + ew_f + ovh_f) * slow
    layer_b = (2 * (mm_f + ew_f) + cold + ovh_b) * slow
    act = n * d * a

    def tp_region(layer: float) -> float:
        """One region's tp communication in a pass whose layer computes ``layer`` seconds
        between its collectives (2 regions a layer; each an all-reduce, or with sp an
        all-gather and a reduce-scatter): their latency grows with that gap."""
        if t == 1:
            return 0.0
        if sp:
            return (collective_time(c, "all-gather", t, act, world=w, gap=layer / 4)
                    + collective_time(c, "reduce-scatter", t, act, world=w, gap=layer / 4))
        return collective_time(c, "all-reduce", t, act, world=w, gap=layer / 2)

    tp1, tp1_b = tp_region(layer_f), tp_region(layer_b)
    comm_f, comm_b = 2 * tp1 * layers, 2 * tp1_b * layers
    if plan.cp > 1:  # ring attention: what of the K/V (forward) and K/V + fp32 dK/dV (backward)
        # transfers the attention blocks' compute does not hide, per layer
        hop = collective_time(c, "send/recv", 2, 2 * n * g * e * a, inter=spans_nodes(c, plan, "cp"),
                              world=w)
        hop_b = hop + collective_time(c, "send/recv", 2, 2 * n * g * e * 4,
                                      inter=spans_nodes(c, plan, "cp"), world=w)
        block = mm(core) * slow / plan.cp  # one block's share of the attention compute
        cp_f = (plan.cp - 1) * max(hop - block, 0.1 * hop)
        cp_b = plan.cp * max(hop_b - 2 * block, 0.1 * hop_b)
        comm_f, comm_b = comm_f + cp_f * layers, comm_b + cp_b * layers
    fwd, bwd = layers * layer_f + comm_f, layers * layer_b + comm_b
    if plan.recompute == "full":
        bwd += layers * layer_f + comm_f
        comm_b += comm_f
    elif plan.recompute == "selective":
        bwd += layers * mm(core) * slow
    if embed:
        fwd += 3 * act / bw * slow + tp1 / 2
        comm_f += tp1 / 2
    if head:
        hf = head_flops(m, n, t)
        ew = (4 * n * d * 12 + 4 * n * m.vocab_size / t * 6) / bw
        cold_h = c.weight_time(hf / (2 * n) * a, threads)
        fwd += (mm(hf) + cold_h + ew) * slow
        bwd += (2 * (mm(hf) + ew) + cold_h) * slow
        if t > 1:  # vocab-parallel CE: 2 all-reduces of n values; backward: copy_to_tp's
            ce = (collective_time(c, "all-reduce", t, 4 * n, world=w)
                  + collective_time(c, "all-reduce", t, 8 * n, world=w))
            fwd, bwd = fwd + ce, bwd + tp1_b / 2
            comm_f, comm_b = comm_f + ce, comm_b + tp1_b / 2
    return fwd + ovh["action"] * slow, bwd + ovh["action"] * slow, comm_f, comm_b


def _post_schedule(n: int, plan: Plan, c: Cluster, last_bwd: float,
                   slow: float) -> tuple[float, float]:
    """(seconds after the schedule on a stage of ``n`` parameters, of which dp communication)."""
    grads = 4.0 * n
    inter = spans_nodes(c, plan, "dp")
    r = plan.replicas  # cp ranks reduce their gradients with the dp replicas
    if plan.zero1:
        sync = collective_time(c, "reduce-scatter", r, grads, inter=inter, world=plan.world)
        gather = collective_time(c, "all-gather", r, grads, inter=inter, world=plan.world)
    else:
        sync = collective_time(c, "all-reduce", r, grads, inter=inter, world=plan.world)
        gather = 0.0
    buckets = max(1, -(-grads // bucket_bytes(int(grads), 0, r)))
    hidden = min(last_bwd, sync * (buckets - 1) / buckets)
    if c.cores and plan.world * _threads(c, plan) >= c.cores:
        hidden = 0.0  # a CPU with no idle core: the reduction runs on the cores backward uses
    exposed = sync - hidden
    shard = r if plan.zero1 else 1
    per_param = c.overhead.get("param") or OPT_BYTES / c.elementwise_bw(_threads(c, plan))
    # the moments on the shard, norm and zeroing on all; every rank steps at once, sharing
    # the memory bandwidth as well as the cores (where calibrated)
    share = c.contention(plan.world, memory=True) if c.oversubscription_mem else slow
    opt = (n / shard + n) / 2 * per_param * share
    scalars = collective_time(c, "all-reduce", plan.world, 16, inter=c.world > c.devices_per_node)
    return exposed + gather + opt + scalars + c.overhead["step"], exposed + gather


def _simulate(name: str, p: int, M: int, v: int, fwd: tuple, bwd: tuple, tc: float, sends: str,
              rates: tuple | None = None, waits: tuple | None = None, post: float = 0.0,
              bound: tuple | None = None):
    """The schedule run by the runtime's simulator with these per-virtual-stage durations and
    message time ``tc``. Ranks sharing a CPU: ``rates[n]`` is each one's compute speed while n
    of the p compute, ``fwd``/``bwd`` are then the times alone and ``waits`` the (forward,
    backward) collective seconds of each virtual stage, which use no core; ``bound`` where the
    ranks are bound to cores (``_bound_speeds``' arguments after ``rates``)."""
    def wait(rank, a):
        return waits[a.chunk * p + rank][a.op is Op.BWD]

    return simulate(build(name, p, M, v), p, v,
                    duration=lambda rank, a: (fwd if a.op is Op.FWD else bwd)[a.chunk * p + rank],
                    comm_time=lambda rank, a: tc, sends=sends,
                    share=(lambda n: rates[n]) if rates else None, wait=wait if waits else None,
                    post_cpu=(lambda rank, a: post) if post else None,
                    speeds=_bound_speeds(rates, *bound) if bound and rates else None)


def _bound_speeds(rates: tuple, per: int, cores: int, node_ranks: int, threads: int):
    """Each working stage's speed when ranks are bound to cores (``launch.core_share``): stage s
    is global ranks s*per .. s*per + per - 1 (``per`` = world / pp, in lockstep; the default
    rank order, pp outermost), local rank = rank % node_ranks, on core local % cores when the
    node has more ranks than cores (else each its own). A core's m working ranks take 1/m of it each, and every rank is slowed by
    the calibrated interference of that many working ranks (shared caches, memory: the
    slow-down of n ranks, ``1 / rates[n]``, over the share of the cores they would get); a
    stage goes at its slowest rank's speed. Balanced, this is ``rates``; two working stages on
    one core while the other idles each go at half speed."""
    @lru_cache(maxsize=None)
    def speeds(working: tuple[int, ...]) -> tuple[float, ...]:
        n = len(working) * per * threads
        inter = 1.0 / (rates[len(working)] * max(1.0, n / cores))
        if node_ranks < cores:
            return (1.0 / inter,) * len(working)
        load: dict[int, int] = {}
        ranks = {s: [(s * per + j) % node_ranks % cores for j in range(per)] for s in working}
        for s in working:
            for core in ranks[s]:
                load[core] = load.get(core, 0) + 1
        return tuple(1.0 / (inter * max(load[core] for core in ranks[s])) for s in working)
    return speeds


@lru_cache(maxsize=4096)
def _makespan(name: str, p: int, M: int, v: int, fwd: tuple, bwd: tuple, tc: float, quick: bool,
              sends: str = "blocking", rates: tuple | None = None, waits: tuple | None = None,
              post: float = 0.0, bound: tuple | None = None):
    """(makespan, per-rank end, bubble, method) of the schedule (``_simulate``); cached, as
    layouts differing only after the schedule (ZeRO-1, say) share it."""

    def sim(mbs: int):
        r = _simulate(name, p, mbs, v, fwd, bwd, tc, sends, rates, waits, post, bound)
        ends = [0.0] * p
        for ev in r.events:
            ends[ev.rank] = max(ends[ev.rank], ev.end)
        return r.makespan, ends, r.bubble_fraction

    # the forms below: with shared cores, every stage busy in the steady state, at the speed of p
    slow = 1.0 / rates[p] if rates else 1.0
    sf, sb = tuple(x * slow for x in fwd), tuple(x * slow for x in bwd)
    work = [sum(sf[ch * p + r] + sb[ch * p + r] for ch in range(v)) for r in range(p)]
    if quick:
        return _closed_form(p, M, v, sf, sb, tc, work)
    if 2 * p * v * M <= SIM_LIMIT:
        return (*sim(M), "simulate")
    cap = SIM_LIMIT // (2 * p * v)
    m2 = cap - cap % p if v > 1 else cap
    if m2 - p >= p:
        (t1, _, _), (t2, ends, b2) = sim(m2 - p), sim(m2)
        extra = (t2 - t1) / p * (M - m2)
        total = t2 + extra
        busy = (1 - b2) * p * t2 + sum(work) * (M - m2) if rates else sum(work) * M
        return total, [x + extra for x in ends], 1 - busy / (p * total), "extrapolate"
    return _closed_form(p, M, v, sf, sb, tc, work)


def _closed_form(p: int, M: int, v: int, fwd: tuple, bwd: tuple, tc: float, work: list[float]):
    """Uniform stages: (vM + p - 1) chunk steps of F + B (GPipe, 1F1B and interleaved alike);
    here M times the slowest rank's work plus p - 1 average chunk steps of fill and drain, plus
    the blocking messages on the critical path (about 2 per step without interleaving, 1.2 with:
    fitted to the simulator, checked in the tests)."""
    chunk = [fwd[i] + bwd[i] for i in range(p * v)]
    hops = 2 * (M + p - 1) if v == 1 else 1.2 * (v * M + p - 1)
    total = M * max(work) + (p - 1) * sum(chunk) / len(chunk) + hops * tc
    return total, [total] * p, 1 - sum(work) * M / (p * total), "closed form"


class _Llama:
    """The Llama's closed forms, per virtual stage."""

    def __init__(self, m: ModelConfig, plan: Plan, c: Cluster):
        self.m, self.plan, self.c = m, plan, c
        self.split = stage_layers(m, plan)

    def message(self) -> float:
        p = self.plan
        return (p.mb_size * self.m.seq_len // p.cp * self.m.d_model * self.c.dtype_bytes
                / (p.tp if p.sequence_parallel else 1))

    def boundaries(self) -> list[float]:
        """Bytes each virtual stage sends forward (the same at every cut; 0 after the last)."""
        return [self.message()] * (len(self.split) - 1) + [0.0]

    def chunks(self, slow: float, busy_ranks: float) -> list[tuple[float, float, float]]:
        V, split = len(self.split), self.split
        kinds = {(split[v], v == 0, v == V - 1) for v in range(V)}  # most chunks are alike
        cost = {k: _chunk_costs(self.m, self.plan, self.c, layers=k[0], embed=k[1], head=k[2],
                                slow=slow, busy_ranks=busy_ranks) for k in kinds}
        return [cost[split[v], v == 0, v == V - 1] for v in range(V)]

    def stage_params(self, stage: int) -> int:
        return stage_params(self.m, self.plan, stage)[0]


class _Spec:
    """A spec model's profile, per virtual stage (``spec_model``)."""

    def __init__(self, m, plan: Plan, c: Cluster):
        from . import spec_model as sm
        self.sm, self.m, self.plan, self.c = sm, m, plan, c
        self.split = sm.split_for(m, plan, c, m.pp_split)
        self.units = m.spec.stage_units(list(self.split))

    def message(self) -> float:
        return max(self.boundaries(), default=0.0)

    def boundaries(self) -> list[float]:
        """Bytes each virtual stage sends forward (its last unit's output; 0 after the last)."""
        return [self.sm.message_bytes(self.m, self.plan, self.c, u[-1]) for u in self.units[:-1]] + [0.0]

    def chunks(self, slow: float, busy_ranks: float) -> list[tuple[float, float, float]]:
        times = self.sm.unit_times(self.m, self.plan, self.c, threads=_threads(self.c, self.plan),
                                   slow=slow, busy_ranks=busy_ranks)
        action = self.c.overhead["action"] * slow
        return [(sum(times[u][0] for u in us) + action, sum(times[u][1] for u in us) + action,
                 sum(times[u][2] for u in us), sum(times[u][3] for u in us)) for us in self.units]

    def stage_params(self, stage: int) -> int:
        p = self.plan
        return sum(self.sm.chunk_params(self.m, p.tp, p.sequence_parallel, self.units[ch * p.pp + stage])[0]
                   for ch in range(p.virtual_stages))


def costing(m, plan: Plan, c: Cluster):
    """The per-chunk cost model of ``m``: closed forms for a Llama ``ModelConfig``, the
    profile for a ``SpecModel``."""
    return _Llama(m, plan, c) if isinstance(m, ModelConfig) else _Spec(m, plan, c)


def stage_times(m, plan: Plan, c: Cluster) -> list[float]:
    """Forward + backward seconds of one micro-batch on each pipeline stage (its chunks
    together), as the prediction uses them: the slowest sets the pipeline's pace. On a CPU, as
    the simulator shares the cores: a stage's actions take longer while more stages compute
    beside them."""
    model, p, M = costing(m, plan, c), plan.pp, plan.microbatches
    if not c.cores:
        chunks = model.chunks(c.contention(float(plan.world)), float(plan.world))
        return [sum(chunks[ch * p + s][0] + chunks[ch * p + s][1]
                    for ch in range(plan.virtual_stages)) for s in range(p)]
    busy_ranks = float(plan.world)
    for _ in range(2):  # as ``predict_time``: the busy ranks re-estimated from a first run
        fwd, bwd, tc, extra = _shared_inputs(model, plan, c, busy_ranks)
        run = _simulate(plan.schedule, p, M, plan.virtual_stages, fwd, bwd, tc, c.sends, **extra)
        busy_ranks = _busy_ranks(plan, run.bubble_fraction, extra["post"], run.makespan)
    return [busy / M for busy in run.busy]


def _shared_inputs(model, plan: Plan, c: Cluster, busy_ranks: float):
    """(alone forward and backward seconds per virtual stage, message seconds, the sharing
    arguments of ``_simulate``) for a CPU whose cores the ranks share."""
    costs = model.chunks(1.0, busy_ranks)
    copy = _message_cpu(model, plan, c)
    fwd, bwd = (tuple(x[i] - x[i + 2] + copy[v] for v, x in enumerate(costs)) for i in (0, 1))
    post = c.p2p_core_seconds(busy_ranks) if plan.pp > 1 else 0.0
    return fwd, bwd, _message_time(model, plan, c, busy_ranks, shared=bool(post)), dict(
        rates=_rates(c, plan), waits=tuple((x[2], x[3]) for x in costs), post=post,
        bound=(plan.world // plan.pp, c.cores, c.devices_per_node, _threads(c, plan)))


def _message_cpu(model, plan: Plan, c: Cluster) -> list[float]:
    """Core seconds each virtual stage spends, per forward and per backward of a micro-batch,
    copying its pipeline messages: on one machine Gloo's send/recv moves the bytes through the
    kernel's loopback socket, a copy on each end at the calibrated point-to-point rate
    (``c.intra.bw``), made on the cores the ranks compute on. A stage receives its input and
    sends its output in the forward, and the gradients of both in the backward: bytes / bw for
    each. Measured at pp=4 on 2 cores (ResNet, 32 x 32 images), the ranks' Gloo threads and
    message handling took 68 ms of core time a step, against 15 ms at pp=2; from the units
    timed on this machine, the slowest stage was under-predicted by 10-17% without the copies
    and by 5-6% with them (with the BatchNorm of that time, before its fused dp=1 kernel)."""
    sent = model.boundaries()  # bytes virtual stage v sends forward; 0 for the last
    if plan.pp == 1 or not c.cores or not c.intra.bw:
        return [0.0] * len(sent)
    return [((sent[v - 1] if v else 0.0) + sent[v]) / c.intra.bw for v in range(len(sent))]


def _message_time(model, plan: Plan, c: Cluster, busy_ranks: float, *, shared: bool = False) -> float:
    """Seconds of one p2p message between stages, with ``busy_ranks`` sharing the cores.
    ``shared``: the simulator charges each op's core time (``Cluster.p2p_cpu``) on the shared
    cores, so the wait for a descheduled peer is played out there; the message itself then
    costs its back-to-back time with both ends running: the pair's, calibrated alone."""
    if plan.pp == 1:
        return 0.0
    return collective_time(c, "send/recv", 2, model.message(), inter=spans_nodes(c, plan, "pp"),
                           world=2.0 if shared else busy_ranks,
                           gap=0.0 if shared else None) + c.overhead["comm"]


def _post_share(plan: Plan, post: float, makespan: float) -> float:
    """The share of the pipeline's rank-time spent on the messages' core work (``post``
    seconds per op), busy as compute is: each of the p*v - 1 cuts between virtual stages
    carries M activations and M gradients, each a send and a receive."""
    if not post or makespan <= 0:
        return 0.0
    ops = 4 * (plan.pp * plan.virtual_stages - 1) * plan.microbatches
    return post * ops / (plan.pp * makespan)


def _busy_ranks(plan: Plan, bubble: float, post: float, makespan: float) -> float:
    """Ranks wanting the cores on average over a simulated schedule: computing, or on the
    messages' core work (the estimate both the contention and the calibrated costs use)."""
    return plan.world * (1.0 - bubble + _post_share(plan, post, makespan))


def _rates(c: Cluster, plan: Plan) -> tuple[float, ...]:
    """Compute speed of each rank while n of a pipeline's p stages compute (n = 0..p): each
    stands for its tp peers and dp/cp replicas, which compute in lockstep with it, so
    n * world / p ranks want the cores; 1 / the calibrated slow-down of that many."""
    per = plan.world / plan.pp
    return tuple(1.0 / c.contention(max(n, 1) * per) for n in range(plan.pp + 1))


def predict_time(m, plan: Plan, c: Cluster, *, quick: bool = False) -> Prediction:
    """Predicted step; ``quick`` uses the closed form instead of the simulator (for pruning).

    On a CPU (``c.cores``) the simulator shares the cores between the stages computing at each
    moment (``_rates``): a light stage runs slower while the heavy ones compute beside it, and
    a bubble frees a core for another rank. Otherwise each stage's compute is slowed by the
    average number of busy ranks."""
    model, p = costing(m, plan, c), plan.pp
    busy_ranks = float(plan.world)
    slow = c.contention(busy_ranks)
    shared = bool(c.cores) and not quick
    for _ in range(2 if c.cores else 1):  # CPU: re-estimate the busy ranks once
        if shared:  # the work alone, shared by the simulator; the collectives wait beside it
            fwd, bwd, tc, extra = _shared_inputs(model, plan, c, busy_ranks)
            comm = [f + b for f, b in extra["waits"]]
        else:
            costs = model.chunks(slow, busy_ranks)
            fwd, bwd = tuple(x[0] for x in costs), tuple(x[1] for x in costs)
            tc, extra = _message_time(model, plan, c, busy_ranks), {}
            comm = [x[2] + x[3] for x in costs]
        makespan, ends, bubble, method = _makespan(plan.schedule, p, plan.microbatches,
                                                   plan.virtual_stages, fwd, bwd, tc, quick,
                                                   c.sends, **extra)
        busy_ranks = _busy_ranks(plan, bubble, extra.get("post", 0.0), makespan)
        slow = c.contention(busy_ranks)
    post = []
    for s in range(p):
        last_bwd = bwd[s]  # chunk 0 of stage s ends the schedule there
        post.append(_post_schedule(model.stage_params(s), plan, c, last_bwd, slow))
    ends_total = [ends[s] + post[s][0] for s in range(p)]
    worst = max(range(p), key=lambda s: ends_total[s])
    tp_comm = sum(comm[ch * p + worst] for ch in range(plan.virtual_stages)) * plan.microbatches
    n_msgs = 2 * plan.microbatches * plan.virtual_stages if p > 1 else 0
    return Prediction(step_time=max(ends_total), makespan=makespan, bubble=bubble,
                      comm={"tp": tp_comm, "pp": n_msgs * tc, "dp": post[worst][1]}, method=method)
