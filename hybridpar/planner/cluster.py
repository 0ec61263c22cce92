"""Cluster descriptions: ready-made GPU profiles, and calibrated profiles of this machine (JSON).

A profile holds what the cost model needs and nothing about a layout:

  compute   achieved matmul FLOP/s as a function of the matmul's FLOPs (a table interpolated in
            log(flops)); per threads-per-rank on a CPU, one entry on a GPU
  memory    elementwise bandwidth (norms, activations, residuals, the optimizer: memory-bound)
  links     alpha (latency, s) and bandwidth (bytes/s) inside a node and between nodes; a
            calibrated profile also has measured alpha/beta per collective and group size
  overhead  fixed seconds the framework spends per compute action, per layer (and its forward's
            share), per communication batch and per step (Python dispatch: what dominates a
            tiny model on a CPU)

GPU numbers are public peak figures with efficiencies typical of large cuBLAS GEMMs and of
NCCL's achievable bus bandwidth (``busbw``); they are assumptions, not measurements.
"""
from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

from ..config import ConfigError
from ..engine.env import usable_cores


@dataclass(frozen=True)
class Link:
    alpha: float
    """Latency of one message, s."""
    bw: float
    """Achievable bus bandwidth per device, bytes/s."""


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int = 1
    devices_per_node: int = 8
    mem_bytes: float = 80e9
    """Memory of one device (a CPU: the machine's RAM)."""
    peak_flops: float = 312e12
    """Peak dense FLOP/s of one device in the compute dtype (a CPU: of one core)."""
    matmul: dict = field(default_factory=dict)
    """{threads per rank: [(matmul flops, achieved FLOP/s), ...]} sorted by flops."""
    mem_bw: dict = field(default_factory=dict)
    """{threads per rank: elementwise bytes/s}."""
    conv: dict = field(default_factory=dict)
    """{threads per rank: [(convolution flops, achieved FLOP/s, channels, stride), ...]}; empty:
    the matmul table. The channels (per group, the geometric mean of input and output) tell
    shapes of equal FLOPs apart, and the stride (1, or 2: a downsampling C -> 2C) a strided
    convolution, which runs slower per FLOP (its backward at half the rate here). A profile from
    before the strides has no fourth field (stride 1 for all), one from before the channels
    (flops, FLOP/s) pairs, one table for every width."""
    conv_bwd: dict = field(default_factory=dict)
    """The same for a convolution's backward (input and weight gradients, 2x the FLOPs)."""
    weight_bw: dict = field(default_factory=dict)
    """Calibrated on a CPU: {threads per rank: bytes/s} at which a matmul streams a weight that
    is not in the core's cache, over the matmul table's rate (measured hot); empty: free."""
    intra: Link = Link(10e-6, 230e9)
    inter: Link = Link(20e-6, 23e9)
    collectives: dict = field(default_factory=dict)
    """Calibrated: {op: {n: [alpha_s, s_per_byte]}}, time = alpha + bytes * beta (full tensor),
    measured with the group alone on the machine."""
    collectives_shared: dict = field(default_factory=dict)
    """Calibrated on a CPU: {op: {k: {n: [alpha_s, s_per_byte]}}}, measured in k/n concurrent
    groups of n when k ranks share the cores (a tp group of a dp x tp layout)."""
    overhead: dict = field(default_factory=lambda: {"action": 20e-6, "layer": 0.0, "comm": 0.0,
                                                    "step": 5e-3, "param": 0.0})
    cores: int = 0
    """CPU cores shared by the ranks (0: a GPU, one device per rank, no sharing)."""
    oversubscription: dict = field(default_factory=dict)
    """Calibrated: {k: slow-down of a 1-thread rank when k of them compute at once}."""
    oversubscription_mem: dict = field(default_factory=dict)
    """Calibrated: {k: the same for the optimizer's update (norms, AdamW, zeroing), which
    streams parameters, gradients and moments, so the ranks share the memory bandwidth as well
    as the cores (here 1.33x, 2.46x, 4.93x at 2, 4, 8 ranks against 1.11x, 2.54x, 4.56x for a
    block's compute)}; empty: as compute."""
    p2p_cpu: dict = field(default_factory=dict)
    """Calibrated on a CPU: {k: core seconds per point-to-point op (a send or a receive) beyond
    its bytes' copy, with k ranks sharing the cores}: posting, waking Gloo's transport thread
    and its socket handling, taken from the cores the ranks compute on. Measured between
    matmuls in pairs of a world of k (here, 2 cores, two calibrations: 0.35-0.52 ms at 2
    ranks, 0.86-1.02 ms at 4, 0.66-0.74 ms at 8, against 0.06 ms back to back; with the ranks
    bound to cores, two more: 0.42-0.58 ms at 2, 0.31-0.34 at 4, 0.28-0.31 at 8); empty: free."""
    probe_s: float = 0.0
    """Calibrated on a CPU: seconds of a reference work (a default-model block's forward and
    backward on 1 thread) while the profile was made. This machine's speed drifts by tens of
    percent between minutes; re-timing it beside a measurement (``calibrate.speed_drift``)
    tells that drift from the cost model's error. 0: not recorded."""
    backend: str = "nccl"
    """gloo: p2p sends complete one by one (``sends``), and a profile calibrated before the
    runtime's all-to-all reduce-scatter has no reduce-scatter fit (``costs.collective_time``)."""
    dtype_bytes: int = 2
    """Bytes of an activation element in the compute dtype (2: bf16 autocast, 4: fp32)."""

    @property
    def sends(self) -> str:
        """How pipeline sends complete (``simulate``'s ``sends``): Gloo returns one handle per
        op, so the runtime defers each send; NCCL completes a coalesced batch as one."""
        return "deferred" if self.backend == "gloo" else "blocking"

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def device_mem(self) -> float:
        """Memory one rank may use: a CPU's RAM is shared by its ranks."""
        return self.mem_bytes / self.devices_per_node if self.cores else self.mem_bytes

    def peak_total(self, world: int) -> float:
        """Peak FLOP/s of ``world`` ranks (MFU's denominator); a CPU's peak is per core."""
        return self.peak_flops * (min(world, self.cores) if self.cores else world)

    def threads_per_rank(self, ranks_per_node: int) -> int:
        """What ``launch.set_threads`` picks: cores // local ranks, at least 1."""
        return max(1, self.cores // ranks_per_node) if self.cores else 1

    def contention(self, busy_ranks: float, *, memory: bool = False) -> float:
        """Slow-down of compute when more threads want to run than there are cores (``memory``:
        of the optimizer's memory-bound update, when calibrated). The ranks of a CPU share its
        cores: the rate per rank is the calibrated rate * min(1, cores/busy)."""
        if not self.cores:
            return 1.0
        t = self.threads_per_rank(self.devices_per_node)
        table = sorted(((memory and self.oversubscription_mem) or self.oversubscription).items())
        if t > 1 or len(table) < 2:
            return max(1.0, busy_ranks * t / self.cores)
        # measured: beyond cores/ranks, context switches and shared caches cost extra
        slow = _lerp(table, busy_ranks)
        if busy_ranks > table[-1][0]:
            slow *= busy_ranks / table[-1][0]
        return max(1.0, slow)

    def p2p_core_seconds(self, busy_ranks: float) -> float:
        """``p2p_cpu`` at ``busy_ranks`` ranks sharing the cores: linear between the calibrated
        world sizes, clamped at the ends (0 where not calibrated)."""
        table = sorted(self.p2p_cpu.items())
        return _lerp(table, busy_ranks) if table else 0.0

    def flop_rate(self, flops: float, threads: int = 1) -> float:
        """Achieved FLOP/s of one matmul of ``flops``, interpolated in log(flops)."""
        return _rate(self.matmul, flops, threads)

    def conv_rate(self, flops: float, threads: int = 1, *, backward: bool = False,
                  channels: float | None = None, stride: int = 1) -> float:
        """Achieved FLOP/s of one convolution of ``flops`` with ``channels`` per group (input
        and output, geometric mean; ``backward``: its input and weight gradients, one call): the
        calibrated convolution tables, interpolated in log(flops) at each calibrated width and
        between the two widths around ``channels`` in log(channels) (clamped at the ends), from
        the rows of its ``stride`` (1, or strided: the downsampling rows) where calibrated, else
        the matmul table (a GPU's implicit-GEMM convolutions run near the GEMM rate; a CPU's
        small ones do not)."""
        tables = self.conv_bwd if backward else self.conv
        if not tables:
            return _rate(self.matmul, flops, threads)
        rows = _nearest(tables, threads)

        def stride_of(row) -> int:  # rows from before strides were calibrated are stride 1
            return row[3] if len(row) > 3 else 1

        rows = ([r for r in rows if stride_of(r) == min(stride, 2)]
                or [r for r in rows if stride_of(r) == 1])
        widths: dict = {}
        for row in rows:
            widths.setdefault(row[2] if len(row) > 2 and channels else None, []).append(row[:2])
        if len(widths) == 1:
            return _interp(sorted(next(iter(widths.values()))), flops)
        cs = sorted(widths)
        i = min(max(bisect.bisect_left(cs, channels), 1), len(cs) - 1)
        lo, hi = cs[i - 1], cs[i]
        w = min(max(math.log(channels / lo) / math.log(hi / lo), 0.0), 1.0)
        return (_interp(sorted(widths[lo]), flops, linear=True) * (1 - w)
                + _interp(sorted(widths[hi]), flops, linear=True) * w)

    def elementwise_bw(self, threads: int = 1) -> float:
        return _nearest(self.mem_bw, threads)

    def layer_overhead(self) -> tuple[float, float]:
        """(forward, backward) seconds of framework overhead of one transformer block, apart
        from its FLOPs and bytes. A calibrated CPU measures the forward's share: a forward op
        costs more than a backward one (5.7 us against 3.6 here), for the forward runs in
        Python, module by module, recording the graph, the backward in autograd's C++ engine.
        Otherwise the forward takes a third (the backward dispatches about twice the ops)."""
        layer = self.overhead.get("layer", 0.0)
        fwd = self.overhead.get("layer_fwd", layer / 3)
        return fwd, layer - fwd

    def weight_time(self, nbytes: float, threads: int = 1) -> float:
        """Seconds matmuls spend, beyond their FLOPs, reading ``nbytes`` of weights from beyond
        the core's cache: in training a layer's weights are evicted between their uses, and at
        a few rows per micro-batch that read is a fifth of a GEMM's time (a 68 x 256 x 768
        product ran at 96 GFLOP/s with its weight hot and 79 with it cold here)."""
        if not self.weight_bw or nbytes <= 0:
            return 0.0
        return nbytes / _nearest(self.weight_bw, threads)


def _nearest(by_threads: dict, threads: int):
    """The entry of a {threads per rank: value} calibration measured nearest ``threads``."""
    return by_threads[min(by_threads, key=lambda t: abs(int(t) - threads))]


def _rate(tables: dict, flops: float, threads: int) -> float:
    """A {threads: [(flops, FLOP/s)]} table at ``flops`` (``_interp``)."""
    return _interp(_nearest(tables, threads), flops)


def _interp(table: list, flops: float, *, linear: bool = False) -> float:
    """A [(flops, FLOP/s)] table sorted by flops, at ``flops``, interpolated in log(flops);
    below the smallest entry the time stays that entry's (a fixed launch cost), or with
    ``linear`` (one convolution width at fewer pixels: the same kernel on fewer rows) follows
    the line through the two smallest entries' times, never at a higher rate than the smallest's."""
    xs = [math.log(f) for f, _ in table]
    x = math.log(max(flops, 1.0))
    i = bisect.bisect_left(xs, x)
    if i == 0 and flops < table[0][0] and linear and len(table) > 1:
        (f0, r0), (f1, r1) = table[0], table[1]
        t0, t1 = f0 / r0, f1 / r1
        t = max(t0 + (t1 - t0) * (flops - f0) / (f1 - f0), flops / r0)
        return flops / t
    if i == 0:
        return table[0][1] * flops / table[0][0] if flops < table[0][0] else table[0][1]
    if i == len(xs):
        return table[-1][1]
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return table[i - 1][1] * (1 - w) + table[i][1] * w


def _gpu(name: str, *, peak: float, mem: float, hbm: float, nvlink: float, nic: float) -> Cluster:
    # cuBLAS efficiency by GEMM size: small GEMMs are latency/launch bound, large ones ~85% of peak
    eff = [(1e6, 0.02), (1e8, 0.25), (1e9, 0.5), (1e10, 0.7), (1e11, 0.8), (1e12, 0.85)]
    return Cluster(name=name, mem_bytes=mem, peak_flops=peak, matmul={1: [(f, e * peak) for f, e in eff]},
                   mem_bw={1: 0.8 * hbm}, intra=Link(10e-6, nvlink), inter=Link(25e-6, nic))


PRESETS = {
    # A100 SXM4 80GB: 312 TFLOP/s bf16, 2.0 TB/s HBM, NVLink3 600 GB/s both ways (~230 GB/s busbw),
    # one 200 Gb/s HDR InfiniBand NIC per GPU (~23 GB/s achievable)
    "a100-80g": _gpu("a100-80g", peak=312e12, mem=80e9, hbm=2.0e12, nvlink=230e9, nic=23e9),
    # H100 SXM5 80GB: 989 TFLOP/s bf16 dense, 3.35 TB/s, NVLink4 900 GB/s (~360 busbw), 400 Gb/s NDR
    "h100-80g": _gpu("h100-80g", peak=989e12, mem=80e9, hbm=3.35e12, nvlink=360e9, nic=46e9),
    # H200: the H100 compute with 141 GB at 4.8 TB/s
    "h200": _gpu("h200", peak=989e12, mem=141e9, hbm=4.8e12, nvlink=360e9, nic=46e9),
    # an uncalibrated CPU guess (one rank per core, fp32); `hybridpar calibrate` replaces it
    "cpu": Cluster(name="cpu", nodes=1, devices_per_node=len(usable_cores()), mem_bytes=16e9,
                   peak_flops=50e9, matmul={1: [(1e5, 5e9), (1e7, 30e9), (1e9, 50e9)]},
                   mem_bw={1: 5e9}, intra=Link(100e-6, 1e9), inter=Link(100e-6, 1e9),
                   overhead={"action": 1e-3, "layer": 5e-4, "comm": 2e-4, "step": 5e-3,
                             "param": 2e-9},
                   cores=len(usable_cores()), backend="gloo", dtype_bytes=4),
}


def _lerp(table: list[tuple[float, float]], k: float) -> float:
    """The value of a sorted (k, value) table at ``k``: linear between its points, clamped at
    its ends."""
    if len(table) == 1:
        return table[0][1]
    k = min(max(k, table[0][0]), table[-1][0])
    i = max(1, bisect.bisect_left([x for x, _ in table], k))
    (k0, v0), (k1, v1) = table[i - 1], table[i]
    return v0 + (v1 - v0) * (k - k0) / (k1 - k0)


def load_cluster(spec: str, *, nodes: int | None = None, devices_per_node: int | None = None) -> Cluster:
    """A preset name or a calibrated profile JSON, with the node count/size overridden."""
    if spec in PRESETS:
        c = PRESETS[spec]
    elif spec.endswith(".json") or os.path.exists(spec):
        c = load_profile(spec)
    else:
        raise ConfigError(f"--cluster={spec!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                          f"profile JSON written by `hybridpar calibrate`")
    for name, v in (("nodes", nodes), ("devices_per_node", devices_per_node)):
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={v} must be at least 1")
    return replace(c, nodes=nodes or c.nodes, devices_per_node=devices_per_node or c.devices_per_node)


def save_profile(c: Cluster, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(asdict(c), fh, indent=1)


def load_profile(path: str) -> Cluster:
    try:
        with open(path) as fh:
            d = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"cluster profile {path} does not exist; write one with "
                          f"`hybridpar calibrate --out {path}`") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cluster profile {path} cannot be read: {e}") from None
    d["intra"], d["inter"] = Link(**d["intra"]), Link(**d["inter"])
    d["matmul"] = {int(t): [tuple(x) for x in rows] for t, rows in d["matmul"].items()}
    d["mem_bw"] = {int(t): v for t, v in d["mem_bw"].items()}
    d["weight_bw"] = {int(t): v for t, v in d.get("weight_bw", {}).items()}
    for key in ("conv", "conv_bwd"):
        d[key] = {int(t): [tuple(x) for x in rows] for t, rows in d.get(key, {}).items()}
    d["collectives"] = {op: {int(n): ab for n, ab in by_n.items()} for op, by_n in d["collectives"].items()}
    d["collectives_shared"] = {op: {int(k): {int(n): ab for n, ab in by_n.items()} for k, by_n in by_k.items()}
                               for op, by_k in d.get("collectives_shared", {}).items()}
    for key in ("oversubscription", "oversubscription_mem", "p2p_cpu"):
        d[key] = {int(k): v for k, v in d.get(key, {}).items()}
    return Cluster(**d)
