"""What each unit of a model costs, counted by running it on the meta device.

The planner's inputs for a model it has no formula for (a ViT, a ResNet, the user's own spec):
each unit (stem part, block, head part) is built with the engine's own tensor-parallel plan,
batch-norm and recomputation wrappers applied (``apply_tp``, ``sync_batchnorm``,
``apply_recompute``), and run forward and backward on meta tensors shaped like one micro-batch
(no memory, no arithmetic). Counted per unit, for each recompute setting:

* matmul-class FLOPs, call by call (``torch.utils.flop_counter``'s formulas: mm, attention, and
  convolutions and their gradients apart; the planner times each at the calibrated rate for its
  size), forward and backward (recomputation included in backward); SDPA as the fused kernel a
  CPU or a GPU runs (``_Attention``);
* ops dispatched (each costs the framework's fixed dispatch time);
* the memory traffic of every other op (bytes of its tensor inputs and outputs; views move
  nothing): the elementwise work a CPU or a GPU is bound by bandwidth on;
* collectives (op and bytes), seen as c10d ops and told apart by process group: the tp
  mappings', and the data-parallel ones inside a pass (SyncBatchNorm's statistics);
* the storages autograd saves for backward, as the runtime's ``ActivationMeter`` counts them
  (each storage once per chunk, parameters excluded, a checkpoint's kept inputs included, the
  loss's on the last unit); a storage a unit saves from its input or its output is marked, so
  that one kept by two adjacent units of the same pipeline chunk is counted once, as at run time,
  and so is a table the model caches (RoPE's) that every block keeps;
* parameters on one tp rank, and the bytes of the unit's output (what crosses a cut after it).

Everything but the parameters is linear in the micro-batch size b (x = x0 + x1 b): two runs,
at b = 1 and b = 2, give the two coefficients exactly (weight gradients and similar
per-parameter work are the constant part). Units built alike and fed alike are profiled once.
The collectives need process groups: a fake world (``torch.distributed``'s "fake" backend:
collectives return at once) of two tp groups is created for the profile and destroyed after it.
A process with a process group of its own (a training rank choosing its pipeline split)
profiles tp = 1 only, without data-parallel collectives.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from ..models.spec import CROSS_ENTROPY, ModelSpec
from ..parallel.memory import ActivationMeter, _current
from ..parallel.pipeline.boundaries import as_tuple

RECOMPUTE = ("none", "selective", "full")
_COLLECTIVES = {"allreduce_": "all-reduce", "allgather_": "all-gather",
                "_allgather_base_": "all-gather", "_reduce_scatter_base_": "reduce-scatter",
                "reduce_scatter_": "reduce-scatter"}


@dataclass(frozen=True)
class Linear:
    """x0 + x1 * b for a micro-batch of b samples."""
    x0: float = 0.0
    x1: float = 0.0

    def at(self, b: float) -> float:
        return self.x0 + self.x1 * b

    @staticmethod
    def fit(at1: float, at2: float) -> "Linear":
        return Linear(2 * at1 - at2, at2 - at1)


@dataclass(frozen=True)
class Pass:
    """One forward or backward of a unit (micro-batch of b samples)."""
    matmuls: tuple[float, ...]
    """FLOPs of each matmul-class op call per sample (they scale with b exactly)."""
    timed: tuple[float, ...]
    """The matmuls as a kernel runs them (a causal attention skips its masked half), convolutions
    apart."""
    traffic: Linear
    """Bytes read and written by every other op."""
    comm: tuple[tuple[str, Linear], ...]
    """(collective, bytes) of each tp collective, in order."""
    ops: int = 0
    """Ops dispatched (each costs the framework's fixed dispatch time)."""
    dp_comm: tuple[tuple[str, Linear], ...] = ()
    """(collective, bytes) of each collective over the data-parallel replicas inside the pass
    (SyncBatchNorm's statistics), in order."""
    convs: tuple[tuple[float, float, int], ...] = ()
    """(FLOPs per sample, channels per group, stride) of each convolution call: timed at the
    convolution rate for its width and stride."""
    conv_grads: tuple[tuple[float, float, int], ...] = ()
    """The same of each convolution backward (input + weight gradients in one call): timed at
    the convolution backward rate."""
    weights: float = 0.0
    """Bytes the matmul-class calls read that neither the pass made nor scale with b: the
    parameters (a forward's weights, a backward's input-gradient products), streamed from
    beyond the core's cache at each use (``Cluster.weight_time``); a weight the pass builds
    itself (``fused_linear``'s concatenation, when it fuses) is read hot and not counted."""


@dataclass(frozen=True)
class UnitProfile:
    name: str
    params: int
    """Parameters on one tp rank."""
    tensors: int
    fwd: dict
    """recompute setting -> forward ``Pass``."""
    bwd: dict
    """recompute setting -> backward ``Pass`` (recomputation included)."""
    saved: dict
    """recompute setting -> Linear bytes autograd keeps for backward (floating, integer)."""
    shared_in: dict
    """recompute setting -> per input tensor, Linear bytes of it kept by this unit (0 if not)."""
    shared_out: dict
    """recompute setting -> per output tensor, Linear bytes of it kept by this unit."""
    out_bytes: Linear
    """Bytes of the unit's output: a pipeline message after it."""
    cast_params: int = 0
    """Weights of its Linear and convolution modules on one tp rank: cast once per step into
    working weights under bf16/fp16."""
    consts: dict = field(default_factory=dict)
    """recompute setting -> {storage id: bytes} of what the unit keeps that existed before it
    ran (a table the model caches, as RoPE's, shared by every block: a chunk keeps each once);
    not in ``saved``. Ids are meaningful within one profile."""


@dataclass(frozen=True)
class ModelProfile:
    units: tuple[UnitProfile, ...] = field(default_factory=tuple)
    tp: int = 1
    sequence_parallel: bool = False

    def unit(self, name: str) -> UnitProfile:
        return self._by_name[name]

    @cached_property
    def _by_name(self) -> dict:
        return {u.name: u for u in self.units}  # the search asks hundreds of thousands of times


class _Counter(torch.utils._python_dispatch.TorchDispatchMode):
    """One pass's matmul-class FLOPs call by call (``attend``: the fused attention kernels,
    which dispatch nothing the FLOP registry knows), the traffic of the other ops, ops
    dispatched, the c10d collectives by group, and the storages the pass created."""

    def __init__(self, dp_group=None):
        from torch.utils.flop_counter import flop_registry
        super().__init__()
        self.dp_group = dp_group
        self.dp_comm: list[tuple[str, float]] = []
        self.registry = flop_registry
        self.matmuls: list[float] = []
        self.timed: list[float] = []
        self.convs: list[tuple[float, float, int]] = []
        self.conv_grads: list[tuple[float, float, int]] = []
        self.read = 0.0  # bytes the matmul-class calls read from tensors made before the pass
        self.traffic = 0.0
        self.comm: list[tuple[str, float]] = []
        self.ops = 0
        self.created: set[int] = set()

    def summary(self) -> tuple:
        return (tuple(self.matmuls), tuple(self.timed), self.traffic, tuple(self.comm), self.ops,
                tuple(self.dp_comm), tuple(self.convs), tuple(self.conv_grads), self.read)

    @staticmethod
    def _group(args):
        """The process group a c10d op runs on (passed boxed, as a script object)."""
        import torch.distributed as dist
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    return dist.ProcessGroup.unbox(a)
                except (RuntimeError, TypeError):
                    continue
        return None

    def attend(self, flops: float, causal: bool) -> None:
        """A fused attention kernel's FLOPs (counted in full, as MFU counts them; a causal
        kernel skips the masked half: timed at half)."""
        self.matmuls.append(flops)
        self.timed.append(flops / 2 if causal else flops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = {t.untyped_storage()._cdata for t in _flat(out) if isinstance(t, torch.Tensor)}
        self.created |= made - {t.untyped_storage()._cdata for t in _flat((args, kwargs))
                                if isinstance(t, torch.Tensor)}  # a view or in-place op makes none
        ns, name = func.namespace, func._opname
        self.ops += ns != "c10d"
        if ns == "c10d":
            if name in _COLLECTIVES:
                tensors = [t for t in _flat(args) if isinstance(t, torch.Tensor)]
                nbytes = max(t.numel() * t.element_size() for t in tensors)
                if name in ("allgather_", "_allgather_base_"):  # the full (gathered) tensor
                    nbytes = max(nbytes, sum(t.numel() * t.element_size() for t in tensors[:-1]))
                (self.dp_comm if self._group(args) is self.dp_group else self.comm).append(
                    (_COLLECTIVES[name], float(nbytes)))
        elif func.overloadpacket in self.registry:  # one matmul-class call: its FLOPs
            flops = float(self.registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out))
            self.matmuls.append(flops)
            self.read += sum(t.numel() * t.element_size() for t in _flat((args, kwargs))
                             if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.created)
            if "conv" in name:  # convolutions and their gradients, each at its own rate
                (self.conv_grads if "backward" in name else self.convs).append(
                    (flops, *_conv_shape(name, args)))
            else:
                self.timed.append(flops)
        elif not func.is_view:
            self.traffic += sum(t.numel() * t.element_size() for t in _flat((args, kwargs, out))
                                if isinstance(t, torch.Tensor))
        return out


def _conv_shape(name: str, args) -> tuple[float, int]:
    """(channels per group, stride) of a convolution call. The channels are the geometric mean
    of its input's and output's (the width the calibrated rate depends on): the weight is (out,
    in / groups, k...) or, transposed, (in, out / groups, k...). The stride is its largest where
    the windows overlap (a stride below the kernel: the downsampling convolution the strided
    rows of the table time), else 1: a patch embedding (stride = kernel) is one GEMM, a 1x1
    strided shortcut and a transposed convolution (an upsampling) are not what those rows
    measured. ``convolution_backward`` takes the weight third, the stride fifth, transposed
    eighth."""
    backward = "backward" in name
    w, groups = args[2 if backward else 1], args[9 if backward else 8]
    stride, transposed = args[4 if backward else 3], args[7 if backward else 6]
    windows = [(s, k) for s, k in zip(stride, w.shape[2:]) if s > 1]
    strided = not transposed and windows and all(s < k for s, k in windows)
    return (w.shape[0] / groups * w.shape[1]) ** 0.5, int(max(stride)) if strided else 1


def _flat(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flat(y)
    else:
        yield x


_counter: list = []  # the _Counter of the pass being profiled (the profile is single-threaded)


class _Attention(torch.autograd.Function):
    """A fused attention kernel (flash / memory-efficient, as SDPA runs on a CPU or a GPU) on meta
    tensors. SDPA on meta decomposes into the math path, which saves the (s x s) probabilities
    that no real kernel keeps; the kernels keep q, k, v, the output and an fp32 log-sum-exp per
    query, and their FLOPs are ``torch.utils.flop_counter``'s (4 s_q s_k e per head forward,
    2.5x that backward; GQA broadcast inside the kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        from torch.utils.flop_counter import sdpa_flop_count
        ctx.causal = causal
        b, h, n, _ = q.shape  # the kernels' output layout: (b, n, h, e), seen as (b, h, n, e)
        out = q.new_empty((b, n, h, v.shape[-1])).transpose(1, 2)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        if _counter:
            _counter[-1].attend(float(sdpa_flop_count(q.shape, k.shape, v.shape)), causal)
        return out

    @staticmethod
    def backward(ctx, grad):
        from torch.utils.flop_counter import sdpa_backward_flop_count
        q, k, v, _, _ = ctx.saved_tensors
        if _counter:
            _counter[-1].attend(float(sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)),
                                ctx.causal)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


@contextlib.contextmanager
def _fused_attention():
    """``F.scaled_dot_product_attention`` on meta tensors runs as ``_Attention`` (patched on the
    module for the profile's duration: a torch-function mode is not active where a checkpoint
    recomputes in backward)."""
    F, sdpa = torch.nn.functional, torch.nn.functional.scaled_dot_product_attention

    def fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "meta" or attn_mask is not None:
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        return _Attention.apply(q, k, v, is_causal)

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


class _MetaMeter(ActivationMeter):
    """The runtime meter's rule on meta tensors: storages told apart by their identity."""

    def __init__(self, params):
        super().__init__([])
        self.param_ids = {p.untyped_storage()._cdata for p in params}
        self.kept: dict[int, tuple[int, bool]] = {}

    def record(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        s = t.untyped_storage()
        if s._cdata not in self.param_ids:
            self.kept[s._cdata] = (s.nbytes(), t.dtype.is_floating_point)


class _FakeMesh:
    """The few mesh fields ``apply_tp`` reads: tp degree, rank 0, the fake tp group."""

    def __init__(self, tp: int, group):
        self.layout = type("L", (), {"tp": tp})()
        self.tp_rank = 0
        self._group = group

    def group(self, axis: str):
        return self._group


@contextlib.contextmanager
def _fake_world(tp: int, dp_sync: bool = True):
    """(tp group, dp group) of a fake world of 2 tp groups (the collectives return at once):
    the tp collectives and the data-parallel ones the model makes in its forward and backward
    (SyncBatchNorm's statistics) are told apart by group. In a process that has a process
    group (a training rank choosing its pipeline split) only tp = 1 is profiled, without
    them: (None, None)."""
    import torch.distributed as dist
    if dist.is_initialized():
        if tp > 1:
            raise RuntimeError("profiling at tp > 1 needs a process without a process group "
                               "(it creates a fake one for the tp collectives)")
        yield None, None
        return
    if tp == 1 and not dp_sync:
        yield None, None
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2 * tp if dp_sync else tp)
    try:
        tp_group = dist.new_group(list(range(tp))) if tp > 1 else None
        yield tp_group, dist.new_group([0, tp]) if dp_sync else None
    finally:
        dist.destroy_process_group()


def unit_key(module, xs, last: bool) -> tuple:
    """What makes two units cost the same: built alike (modules and parameter shapes), fed
    alike (input shapes and dtypes), and neither computes the loss (a transformer's blocks)."""
    return (repr(module), tuple(tuple(q.shape) for q in module.parameters()),
            tuple((tuple(x.shape), x.dtype) for x in xs), last)


def _warm_up(model, spec: ModelSpec, xs: tuple) -> None:
    """Once through, without gradients: what the model caches on first use (RoPE's tables)
    exists before any unit is profiled. A unit like one already run (``unit_key``) passes on
    that one's output shapes without running: a deep model of identical blocks costs a few
    unit forwards here, not one per block (ViT-H/14's plan: 32 blocks, 7 tp x sp profiles of 6
    runs each)."""
    from ..parallel.parallelize import Stage

    outs: dict = {}
    with torch.no_grad():
        for i, name in enumerate(spec.units):
            key = unit_key(model.get_submodule(name), xs, i == len(spec.units) - 1)
            if key not in outs:
                outs[key] = _shapes(as_tuple(Stage(model, [name], device_type="meta")(*xs)))
            xs = _empties(outs[key])


def _shapes(tensors) -> list[tuple]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def _empties(shapes: list[tuple]) -> tuple:
    """Meta tensors of these (shape, dtype): a unit's output, passed on without running it."""
    return tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes)


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    """A unit's input: floating ones need a gradient, but not the batch's (the first unit's)."""
    x = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return x.requires_grad_(grad and t.dtype.is_floating_point)


def _loss(spec: ModelSpec, out, targets, tp_group, vocab_parallel: bool):
    from ..parallel.tensor_parallel.layers import cross_entropy
    if spec.loss != CROSS_ENTROPY:
        return spec.loss(out, targets)
    if vocab_parallel and tp_group is not None:
        return cross_entropy(out, targets, group=tp_group)
    return cross_entropy(out, targets)


def _run(spec: ModelSpec, inputs, targets, *, tp: int, sp: bool, recompute: str,
         groups=(None, None)) -> list[dict]:
    """Forward and backward of every unit in turn on meta tensors; one dict per unit."""
    from ..parallel.batchnorm import sync_batchnorm
    from ..parallel.parallelize import Stage, apply_recompute
    from ..parallel.tensor_parallel.apply import apply_tp, style_of

    with torch.device("meta"):
        model = spec.build()
    tp_group, dp_group = groups
    apply_tp(model, _FakeMesh(tp, tp_group), dict(spec.tp_plan), sequence_parallel=sp)
    sync_batchnorm(model, dp_group)
    apply_recompute(model, spec, recompute)
    vocab_parallel = any("vocab_head" in style_of(dict(spec.tp_plan), u) for u in spec.head)
    xs, results, seen = as_tuple(inputs), [], {}
    _warm_up(model, spec, xs)
    for i, name in enumerate(spec.units):
        module = model.get_submodule(name)
        params = list(module.parameters())
        last = i == len(spec.units) - 1
        key = unit_key(module, xs, last)
        if key in seen:
            same = results[seen[key]]
            results.append({**same, "name": name, "same_as": seen[key]})
            xs = _empties(same["outs"])
            continue
        seen[key] = i
        leaves = tuple(_leaf(x, i > 0) for x in xs)
        meter = _MetaMeter(model.parameters())
        counter = _Counter(dp_group)
        token = _current.set(meter)
        try:
            with _measure(counter):
                with torch.autograd.graph.saved_tensors_hooks(lambda t: meter.record(t) or t,
                                                              lambda t: t):
                    out = Stage(model, [name], device_type="meta")(*leaves)
                    loss = _loss(spec, out, targets, tp_group, vocab_parallel) if last else None
        finally:
            _current.reset(token)
        fwd, created = counter.summary(), counter.created
        outs = as_tuple(out)
        kept_in = [meter.kept.get(x.untyped_storage()._cdata, (0, True))[0] for x in leaves]
        kept_out = [meter.kept.get(o.untyped_storage()._cdata, (0, True))[0] for o in outs]
        counter = _Counter(dp_group)
        with _measure(counter):
            if loss is not None:
                loss.backward()
            else:
                pairs = [(o, torch.ones_like(o)) for o in outs if o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        bwd = counter.summary()
        # kept storages made before this unit ran, other than its inputs (a table cached by
        # the model, a buffer): shared by units, kept once per chunk
        inputs = {x.untyped_storage()._cdata for x in (*leaves, targets)}
        consts = {k: n for k, (n, _) in meter.kept.items() if k not in created and k not in inputs}
        kept = [v for k, v in meter.kept.items() if k not in consts]
        from ..parallel.parallelize import _CAST
        results.append({"name": name, "params": sum(p.numel() for p in params),
                        "cast": sum(m.weight.numel() for m in module.modules()
                                    if isinstance(m, _CAST) and m.weight is not None),
                        "tensors": len(params), "fwd": fwd, "bwd": bwd,
                        "saved": (sum(n for n, f in kept if f), sum(n for n, f in kept if not f)),
                        "consts": consts,
                        "in": kept_in, "out": kept_out,
                        "out_bytes": sum(o.numel() * o.element_size() for o in outs),
                        "outs": _shapes(outs)})
        xs = tuple(o.detach() for o in outs)
    return results


@contextlib.contextmanager
def _measure(counter):
    _counter.append(counter)
    try:
        with counter:
            yield
    finally:
        _counter.pop()


def profile_spec(spec: ModelSpec, example, *, tp: int = 1, sequence_parallel: bool = False,
                 settings: tuple[str, ...] = RECOMPUTE, dp_sync: bool = True) -> ModelProfile:
    """The units of ``spec`` on one tp rank, for the recompute ``settings``; ``example(b)``
    gives (inputs, targets) of a micro-batch of b samples (tensors, any device: only shapes
    and dtypes are used). ``dp_sync``: as a rank with data-parallel replicas (SyncBatchNorm
    all-reduces its statistics and keeps their table, of 2 replicas here), or as the only one."""
    runs = {}
    with _fake_world(tp, dp_sync) as groups, _fused_attention():
        for rc in settings:
            for b in (1, 2):
                inputs, targets = example(b)
                inputs = tuple(torch.empty(x.shape, dtype=x.dtype, device="meta") for x in as_tuple(inputs))
                targets = torch.empty(targets.shape, dtype=targets.dtype, device="meta")
                runs[rc, b] = _run(spec, inputs if len(inputs) > 1 else inputs[0], targets,
                                   tp=tp, sp=sequence_parallel, recompute=rc, groups=groups)
    units = []
    for i, name in enumerate(spec.units):
        def lin(key, rc=settings[0], j=None):
            a, b = runs[rc, 1][i][key], runs[rc, 2][i][key]
            if j is not None:
                a, b = a[j], b[j]
            return Linear.fit(a, b)

        def pass_(rc, key):
            mm, timed, _, _, ops, _, convs, grads, _ = one_ = runs[rc, 1][i][key]
            two = runs[rc, 2][i][key]
            t = Linear.fit(one_[2], two[2])
            weights = max(Linear.fit(one_[8], two[8]).x0, 0.0)  # what does not scale with b
            comm, dp = ((tuple((op, Linear.fit(x, y)) for (op, x), (_, y) in zip(one_[j], two[j])))
                        for j in (3, 5))
            return Pass(mm, timed, t, comm, ops, dp, convs, grads, weights)

        one = runs[settings[0], 1][i]
        if "same_as" in one and all(runs[k][i].get("same_as") == one["same_as"] for k in runs):
            units.append(replace(units[one["same_as"]], name=name))  # the same Pass objects
            continue
        units.append(UnitProfile(
            name=name, params=one["params"], tensors=one["tensors"],
            fwd={rc: pass_(rc, "fwd") for rc in settings},
            bwd={rc: pass_(rc, "bwd") for rc in settings},
            saved={rc: (lin("saved", rc, 0), lin("saved", rc, 1)) for rc in settings},
            shared_in={rc: tuple(lin("in", rc, j) for j in range(len(one["in"]))) for rc in settings},
            shared_out={rc: tuple(lin("out", rc, j) for j in range(len(one["out"]))) for rc in settings},
            out_bytes=lin("out_bytes"), cast_params=one["cast"],
            consts={rc: dict(runs[rc, 1][i]["consts"]) for rc in settings}))
    return ModelProfile(tuple(units), tp, sequence_parallel)
