"""The analytic cost model: FLOPs, bytes and seconds of one layout, no simulation.

Notation: n = b*s tokens of a micro-batch, d = d_model, h / g = query / kv heads, e = head_dim,
f = d_ff, V = vocabulary, t = tp. Forward FLOPs of one block on one tp rank (a matmul of
(n, k) x (k, m) is 2nkm):

    projections  2n*d*e*(2h + 2g)/t      (q, k, v, o; GQA: k and v have g heads)
    attention    4n*s*h*e/t              (q k^T and p v; counted in full, as MFU does, but
                                          timed at half: causal kernels skip the masked half)
    MLP          6n*d*f/t                (SwiGLU: w1, w3, w2)
    LM head      2n*d*V/t                (last stage)

Backward = 2x forward; recompute=full adds the forward again (with its tp all-reduces),
selective only the attention core. Collectives per micro-batch and block: tp 2 all-reduces of
n*d elements forward and 2 backward (sequence parallel: all-gather + reduce-scatter instead,
the same bytes; on Gloo the reduce-scatter is an all-to-all and a local sum); pp one n*d message
per stage boundary; dp one all-reduce of the stage's fp32 gradients per step (ZeRO-1:
reduce-scatter, then all-gather of the parameters).

Activation bytes are what the runtime's ``ActivationMeter`` tracks: storages autograd saves for
backward in *our* model code (fp32 RMSNorm internals, repeated kv heads for GQA, SDPA's
output), counted in the ``activations`` function below.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..config import ModelConfig, pp_split
from .cluster import Cluster

OPT_BYTES = 44
"""Memory traffic per parameter per step outside the schedule: AdamW reads p, g, m, v and writes
p, m, v (28 B fp32), plus the gradient norm, clipping and zeroing (16 B)."""


@dataclass(frozen=True)
class Plan:
    """One layout: what ``hybridpar train`` needs to run it."""

    dp: int
    tp: int
    pp: int
    microbatches: int
    mb_size: int
    """Sequences per micro-batch: global_batch = dp * microbatches * mb_size."""
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    zero1: bool = False
    sequence_parallel: bool = False
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks (ring attention), which hold the
    same parameters and reduce gradients (and shard ZeRO-1 state) with the dp replicas."""

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Ranks that hold the same parameters: the gradient all-reduce (ZeRO-1 shard) group."""
        return self.dp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatches * self.mb_size

    @property
    def schedule_label(self) -> str:
        return self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")

    def label(self) -> str:
        return (f"dp={self.dp} " + (f"cp={self.cp} " if self.cp > 1 else "")
                + f"tp={self.tp} pp={self.pp} mb={self.mb_size}x{self.microbatches} "
                f"{self.schedule_label}")


# ---- FLOPs ----------------------------------------------------------------------------------

def matmuls(m: ModelConfig, tokens: int, tp: int, *, fused: bool = True) -> list[tuple[str, float, float]]:
    """(name, forward FLOPs, FLOPs as timed) of the GEMMs of one block on one tp rank (``fused``:
    q/k/v and w1/w3 one GEMM each, as ``fused_linear`` runs them on a GPU or under autocast;
    else one per weight, as on a CPU in fp32); ``tokens`` are this rank's queries, each
    attending to a whole sequence of s keys (under cp the local share of every sequence: the
    zigzag split gives each rank half its keys unmasked, as without cp)."""
    d, e, f, s = m.d_model, m.head_dim, m.d_ff, m.seq_len
    h, g = m.n_heads // tp, m.n_kv_heads // tp
    if fused:
        proj = [("wq|wk|wv", 2 * tokens * d * (h + 2 * g) * e)]
        up = [("w1|w3", 2 * tokens * d * 2 * f / tp)]
    else:
        proj = [(n, 2 * tokens * d * k * e) for n, k in (("wq", h), ("wk", g), ("wv", g))]
        up = [(n, 2 * tokens * d * f / tp) for n in ("w1", "w3")]
    out = proj + [("wo", 2 * tokens * h * e * d)] + up + [("w2", 2 * tokens * f / tp * d)]
    core = 4.0 * tokens * s * h * e
    return [(n, x, x) for n, x in out] + [("attention", core, core / 2)]


def layer_flops(m: ModelConfig, tokens: int, tp: int = 1) -> float:
    """Forward FLOPs of one transformer block on one tp rank."""
    return sum(x for _, x, _ in matmuls(m, tokens, tp))


def head_flops(m: ModelConfig, tokens: int, tp: int = 1) -> float:
    return 2.0 * tokens * m.d_model * m.vocab_size / tp


def step_flops(m: ModelConfig, global_batch: int) -> float:
    """Model FLOPs of one optimizer step (forward + backward, no recompute): MFU's numerator;
    equals ``models.llama.flops_per_token`` * tokens."""
    n = global_batch * m.seq_len
    return 3.0 * (m.n_layers * layer_flops(m, n) + head_flops(m, n))


# ---- collectives ----------------------------------------------------------------------------

def ring_bytes(op: str, n: int, nbytes: float) -> float:
    """Bytes each rank sends in a ring collective over n ranks of an ``nbytes`` tensor:
    all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n, send/recv 1."""
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": (n - 1) / n,
            "all-gather": (n - 1) / n, "send/recv": 1.0}[op] * nbytes


def _steps(op: str, n: int) -> int:
    return {"all-reduce": 2 * (n - 1), "reduce-scatter": n - 1, "all-gather": n - 1, "send/recv": 1}[op]


def _scaled_fit(fit: dict, op: str, n: int) -> tuple[float, float, float, float]:
    """(alpha, beta, alpha0, gap) at group size n from fits by group size: the nearest n, scaled
    by the ring step and byte factors. A profile calibrated before the back-to-back latency was
    measured has [alpha, beta] only: alpha0 = alpha, and the latency does not vary."""
    n0 = min(fit, key=lambda k: abs(math.log(k / n)))
    alpha, beta, *rest = fit[n0]
    alpha0, gap = rest or (alpha, 0.0)
    steps = _steps(op, n) / _steps(op, n0)
    return alpha * steps, beta * ring_bytes(op, n, 1) / ring_bytes(op, n0, 1), alpha0 * steps, gap


def collective_time(c: Cluster, op: str, n: int, nbytes: float, *, inter: bool = False,
                    world: float = 0, gap: float | None = None) -> float:
    """Seconds of one collective on ``nbytes`` (the full tensor) over n ranks.

    Calibrated profile: measured alpha + beta*bytes for that op and n (the nearest n, scaled
    by the ring step and byte factors). On a CPU, with ``world`` (busy) ranks sharing the cores,
    alpha and beta are interpolated linearly in the world size between the group measured alone
    (world = n) and the fits measured in concurrent groups (``collectives_shared``), clamped at
    the largest. ``gap``: the caller's compute, in seconds, since its previous collective; the
    latency is interpolated linearly from the back-to-back one (gap 0) to the one calibrated
    between matmuls (gap >= the calibrated gap): alpha(g) = alpha0 + (alpha - alpha0) *
    min(g / gap_cal, 1); None: the calibrated gap. Otherwise alpha-beta: ring =
    steps*alpha + ring_bytes/bw; all-reduce takes the better of ring and (double binary) tree,
    2log2(n)*alpha + 2*bytes/bw, as NCCL does for small messages."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if op == "reduce-scatter" and c.backend == "gloo" and op not in c.collectives:
        # a profile calibrated before the runtime's all-to-all reduce-scatter on Gloo: half an
        # all-reduce's bytes ((n-1)/n of them, as measured: 2.5 ms against 5.2 ms, 4 MiB, 2 ranks)
        return collective_time(c, "all-reduce", n, nbytes / 2, inter=inter, world=world, gap=gap)
    fit = c.collectives.get(op)
    if fit and not inter:
        got = _scaled_fit(fit, op, n)
        shared = c.collectives_shared.get(op, {})
        if shared and c.cores and world > n:
            pts = [(float(n), *got)] + sorted((float(k), *_scaled_fit(f, op, n))
                                              for k, f in shared.items() if k > n)
            w = min(world, pts[-1][0])
            for p0, p1 in zip(pts, pts[1:]):
                if w <= p1[0]:
                    x = (w - p0[0]) / (p1[0] - p0[0])
                    got = tuple(v0 + (v1 - v0) * x for v0, v1 in zip(p0[1:], p1[1:]))
                    break
        alpha, beta, alpha0, cal_gap = got
        if gap is not None and cal_gap > 0:
            alpha = alpha0 + (alpha - alpha0) * min(max(gap, 0.0) / cal_gap, 1.0)
        return alpha + beta * nbytes
    link = c.inter if inter else c.intra
    ring = _steps(op, n) * link.alpha + ring_bytes(op, n, nbytes) / link.bw
    if op == "all-reduce":
        return min(ring, 2 * math.log2(n) * link.alpha + 2 * nbytes / link.bw)
    return ring


def spans_nodes(c: Cluster, plan: Plan, axis: str) -> bool:
    """Rank order tp innermost, then cp, dp, pp (``tp-cp-dp-pp``): a tp group is consecutive
    ranks, a cp group has stride tp, a dp group stride tp*cp, a pp neighbour is tp*cp*dp away."""
    per = c.devices_per_node
    if c.world <= per:
        return False
    tc = plan.tp * plan.cp  # the default order tp-cp-dp-pp
    return {"tp": plan.tp > per, "cp": tc > per, "dp": tc * plan.dp > per,
            "pp": tc * plan.dp >= per}[axis]


# ---- memory ---------------------------------------------------------------------------------

def stage_layers(m: ModelConfig, plan: Plan) -> tuple[int, ...]:
    """Layers per virtual stage, as the runtime splits them (``config.pp_split``)."""
    return _split(m.n_layers, plan.pp * plan.virtual_stages)


@lru_cache(maxsize=None)
def _split(n_layers: int, parts: int) -> tuple[int, ...]:
    return tuple(pp_split(n_layers, parts))


def layer_params(m: ModelConfig, tp: int) -> int:
    d, e = m.d_model, m.head_dim
    return 2 * d + (d * e * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * d * m.d_ff) // tp


def stage_params(m: ModelConfig, plan: Plan, stage: int) -> tuple[int, int]:
    """(parameters, parameter tensors) on one rank of pipeline stage ``stage``."""
    split, V = stage_layers(m, plan), plan.pp * plan.virtual_stages
    vs = [c * plan.pp + stage for c in range(plan.virtual_stages)]
    n = sum(split[v] for v in vs) * layer_params(m, plan.tp)
    tensors = 9 * sum(split[v] for v in vs)
    emb = m.vocab_size * m.d_model // plan.tp
    if 0 in vs:
        n, tensors = n + emb, tensors + 1
    if V - 1 in vs:
        n += m.d_model + (0 if (m.tie_embeddings and plan.pp == 1) else emb)
        tensors += 1 if (m.tie_embeddings and plan.pp == 1) else 2
    return n, tensors


def working_params(m: ModelConfig, plan: Plan, stage: int) -> int:
    """Matrix weights on one rank of ``stage`` (the Linear layers, LM head included; not the
    embedding or the norms): what a bf16/fp16 step casts once into working weights."""
    split, V = stage_layers(m, plan), plan.pp * plan.virtual_stages
    vs = [c * plan.pp + stage for c in range(plan.virtual_stages)]
    n = sum(split[v] for v in vs) * (layer_params(m, plan.tp) - 2 * m.d_model)
    return n + (m.vocab_size * m.d_model // plan.tp if V - 1 in vs else 0)


def activations(m: ModelConfig, plan: Plan, a: int, *, embed: bool, head: bool, layers: int) -> float:
    """Bytes one micro-batch's forward of a chunk keeps for backward (act. element = a bytes;
    RMSNorm computes in fp32). Per block (sizes in elements, GQA heads per tp rank):
      each of 2 norms: input, normalised, scaled (3nd) + the rsqrt (n) in fp32
      attention: what SDPA keeps, roped q, k and v of the kv heads (GQA inside the kernel, no
                 repeated copies), its output (which o_proj's input is a view of), and its
                 logsumexp: n*e*(2h + 2g) + n*h (RoPE keeps nothing: cos and sin need no
                 gradient); selective: the core's inputs and output, n*e*(2h + 2g)
      MLP: w1 x, silu(w1 x), w3 x, their product: 4n*f
    recompute=full keeps only each block's input (nd); sequence parallel shards the norm parts.
    Context parallelism: n is this rank's share of the tokens (s/cp per sequence), and the ring
    attention keeps roped q, k and v of the kv heads (no repeats), its output and an fp32
    log-sum-exp: n*e*(2h + 2g) + 4n*h."""
    t, n, d = plan.tp, plan.mb_size * m.seq_len // plan.cp, m.d_model
    h, g, e, f = m.n_heads // t, m.n_kv_heads // t, m.head_dim, m.d_ff // t
    sp = plan.sequence_parallel and t > 1
    # SP: the norm's output is not kept, the all-gathered input of the linears is
    norm = (2 * n * d * 4 + n * 4) / t + n * d * a if sp else 3 * n * d * 4 + n * 4
    if plan.recompute == "full":
        per_layer = n * d * a / (t if sp else 1)
    else:
        attn = n * e * (2 * h + 2 * g) * a
        lse = 0 if plan.recompute == "selective" else n * h * 4
        per_layer = 2 * norm + attn + lse + 4 * n * f * a
    total = layers * per_layer
    if embed:
        total += n * 8 + (n * 9 if t > 1 else 0)  # token ids; vocab-parallel: masked ids and mask
    if head:
        total += norm + n * m.vocab_size / t * 4 + n * 8  # final norm, fp32 softmax, targets
    return total


def in_flight(plan: Plan, stage: int) -> int:
    """Peak (micro-batch, chunk) forwards not yet backwarded on a rank: GPipe M, 1F1B
    min(p - s, M), interleaved Megatron's warmup + 1 = 2(p-s-1) + (v-1)p + 1 (capped at vM)."""
    p, M, v = plan.pp, plan.microbatches, plan.virtual_stages
    if plan.schedule == "gpipe":
        return M
    if v == 1:
        return min(p - stage, M)
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, v * M)


def memory(m: ModelConfig, plan: Plan, c: Cluster, stage: int = 0) -> dict[str, float]:
    """Bytes on one rank of ``stage``: fp32 params and grads (the runtime keeps fp32 master
    weights under any precision), AdamW's two fp32 moments (+ a 4 B step per tensor), 1/dp of
    them under ZeRO-1 (1/(dp cp)), the activation peak (in-flight micro-batches x bytes per
    chunk), and under bf16/fp16 the step's working weights (the matrices in the compute dtype,
    once: ``parallelize.Stage.cast_weights``).
    A ``SpecModel`` is costed from its profile (``spec_model.memory``)."""
    if not isinstance(m, ModelConfig):
        from .spec_model import memory as spec_memory, split_for
        return spec_memory(m, plan, c, stage, split_for(m, plan, c, m.pp_split))
    n, tensors = stage_params(m, plan, stage)
    shard = plan.replicas if plan.zero1 else 1
    split, V = stage_layers(m, plan), plan.pp * plan.virtual_stages
    vs = [ch * plan.pp + stage for ch in range(plan.virtual_stages)]
    per_chunk = [activations(m, plan, c.dtype_bytes, embed=v == 0, head=v == V - 1, layers=split[v])
                 for v in vs]
    act = in_flight(plan, stage) * sum(per_chunk) / len(per_chunk)
    out = {"params": 4.0 * n, "grads": 4.0 * n, "optimizer": 8.0 * n / shard + 4.0 * math.ceil(tensors / shard),
           "activations": act,
           "working": float(c.dtype_bytes * working_params(m, plan, stage)) if c.dtype_bytes < 4 else 0.0}
    out["total"] = sum(out.values())
    return out


def peak_memory(m: ModelConfig, plan: Plan, c: Cluster) -> dict[str, float]:
    """The stage with the largest total: what must fit on every device. Stages hold fewer
    in-flight micro-batches and no more layers the later they are, so the first two and the
    last (output head) are the candidates (every stage of a spec model, split unevenly)."""
    stages = (sorted({0, min(1, plan.pp - 1), plan.pp - 1}) if isinstance(m, ModelConfig)
              else range(plan.pp))
    return max((memory(m, plan, c, s) for s in stages), key=lambda x: x["total"])
