"""``parallelize``: the one place that fixes the order pipeline split -> tensor parallel -> data parallel.

The model comes from its ``ModelSpec`` (``hybridpar.models``): built on the meta device, cut into
this rank's units and sharded there, then only this rank's shard is materialised. Each parameter
is initialised by the spec from a generator keyed by (seed, unsharded name), generated at full
size and sliced, so every layout starts from the very same weights as a single process. Nothing
here names a model's modules: units, tensor-parallel plan, tied parameters and loss are the
spec's data.
"""
from __future__ import annotations

import contextlib
import zlib
from fnmatch import fnmatchcase
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .batchnorm import recomputing, reset_buffers, sync_batchnorm
from ..config import Config, bucket_bytes, precision_of
from .context_parallel import SequenceShard, apply_context_parallel
from .data_parallel import GradSync
from .memory import record_saved
from .mesh import ParallelMesh
from ..models import CROSS_ENTROPY, ModelSpec, spec_for
from .tensor_parallel.apply import ShardSpec, apply_tp, check_plan, owner, style_of
from .tensor_parallel.layers import cross_entropy


_CAST = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""Modules whose weight autocast casts to the compute dtype (a matmul or convolution input)."""


class Stage:
    """One virtual stage on this rank: its units of the model, called in order. A unit gets
    the previous unit's output (a tuple is unpacked into its arguments), the first one the
    stage's inputs; the stage returns the last unit's output (a tensor or a tuple).

    Under bf16/fp16 autocast, ``cast_weights`` makes the *working weights* of a step: each
    Linear and convolution weight cast to the compute dtype once, used by every micro-batch
    (``functional_call``). Left to autocast, every micro-batch casts them again (its cache
    lives only inside one autocast region) and keeps its own copy for backward: one copy of the
    stage's weights per micro-batch in flight, up to pp of them under 1F1B. The cast is the same
    rounding autocast does and its gradient flows back to the fp32 weight through the cast, so
    the numbers are unchanged; biases stay with autocast (a row-parallel bias is added in fp32)."""

    def __init__(self, model: nn.Module, units: list[str], *, device_type: str = "cpu",
                 autocast_dtype: torch.dtype | None = None):
        self.units = units
        self.modules = [model.get_submodule(u) for u in units]
        self.device_type, self.autocast_dtype = device_type, autocast_dtype
        self.working: list[dict[str, torch.Tensor]] | None = None

    def cast_weights(self) -> list[torch.Tensor]:
        """Make this step's working weights (nothing in fp32); returns them."""
        dtype = self.autocast_dtype
        if dtype is None:
            return []
        self.working = [{(f"{n}." if n else "") + "weight": m.weight.to(dtype)
                         for n, m in unit.named_modules()
                         if isinstance(m, _CAST) and m.weight is not None and m.weight.dtype != dtype}
                        for unit in self.modules]
        return [w for ws in self.working for w in ws.values()]

    def drop_weights(self) -> None:
        self.working = None

    def __call__(self, *xs):
        ctx = (contextlib.nullcontext() if self.autocast_dtype is None
               else torch.autocast(self.device_type, dtype=self.autocast_dtype))
        out = xs if len(xs) > 1 else xs[0]
        with ctx:
            for i, m in enumerate(self.modules):
                args = out if isinstance(out, tuple) else (out,)
                if self.working and self.working[i]:
                    out = torch.func.functional_call(m, self.working[i], args, tie_weights=False)
                else:
                    out = m(*args)
        return out


@dataclass
class ParallelModel:
    """This rank's piece of the model and what is needed to train and save it."""

    module: nn.Module
    mesh: ParallelMesh
    spec: ModelSpec
    specs: dict[str, ShardSpec]  # local parameter name -> place in the unsharded tensor
    grad_sync: GradSync
    chunks: list[Stage] = field(default_factory=list)  # virtual stages, in schedule chunk order
    sequence_parallel: bool = False
    vocab_parallel_loss: bool = False  # the head is split by vocabulary rows over tp
    stage_units: list[list[str]] = field(default_factory=list)  # every virtual stage's units
    sequence_shard: SequenceShard | None = None  # cp > 1: this rank's tokens of each sequence
    split_note: str = ""  # how the blocks were split into pipeline stages

    @property
    def is_first(self) -> bool:
        return self.mesh.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.mesh.pp_rank == self.mesh.layout.pp - 1

    @property
    def units(self) -> list[str]:
        return [u for stage in self.chunks for u in stage.units]

    def loss(self, output, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The spec's loss of one micro-batch (a mean); the library's token cross-entropy is
        vocab-parallel when the head is split over tp, and can be a sum (masked targets)."""
        if self.spec.loss != CROSS_ENTROPY:
            return self.spec.loss(output, targets)
        if not self.vocab_parallel_loss:
            return cross_entropy(output, targets, reduction=reduction)
        return cross_entropy(output, targets, group=self.mesh.group("tp"),
                             vocab_start=self.mesh.tp_rank * output.size(-1), reduction=reduction)

    def named_parameters(self):
        return self.module.named_parameters()

    def counted_parameters(self):
        """Parameters whose gradients this rank counts in the global norm: tp-replicated ones
        on tp rank 0 only, the pipeline copy of a tied embedding never."""
        for name, p in self.module.named_parameters():
            spec = self.specs[name]
            if spec.init_key != name:  # the pipeline copy of a tied parameter
                continue
            if spec.dim is None and self.mesh.tp_rank != 0:
                continue
            yield p

    def grad_sumsq(self) -> tuple[float, int]:
        """This rank's share of the squared global gradient norm, and how many dp x cp replicas
        count it (the world all-reduce of the shares is divided by that)."""
        counted = {id(p) for p in self.counted_parameters()}
        if self.grad_sync.zero1:
            grads = [g for p, _, g in self.grad_sync.segments() if id(p) in counted]
        else:
            grads = [p.grad for _, p in self.named_parameters() if id(p) in counted]
        # one multi-tensor kernel and one host sync for all the norms (not one per parameter);
        # the squares are summed in the same order as ever, in float64
        total = sum(n * n for n in _norms64(grads))
        return total, 1 if self.grad_sync.zero1 else self.mesh.layout.replicas

    def finish_grads(self) -> None:
        """After the schedule: dp all-reduce, then sum the tied embedding's two pipeline copies."""
        self.grad_sync.finish()
        if self.sequence_parallel and self.mesh.group("tp") is not None:
            # each tp rank saw only its part of the sequence in norms: sum their weight grads
            for name, p in self.module.named_parameters():
                if self.specs[name].dim is None:
                    dist.all_reduce(self.grad_sync.owned_grad(p), group=self.mesh.group("tp"))
        for p in self.shared_across_stages():
            # the two stages' copies sit alone in equal buckets: same owned slice on both
            dist.all_reduce(self.grad_sync.owned_grad(p), group=self.mesh.embed_group)

    def shared_across_stages(self) -> list[nn.Parameter]:
        """This stage's tied parameters whose other copy lives on another pipeline stage (their
        gradients are summed over ``embed_group``), in the spec's order on both stages."""
        return _shared_across_stages(self.module, self.spec, self.mesh)


def _norms64(tensors: list[torch.Tensor]) -> list[float]:
    """The float64 2-norm of each tensor, fetched to the host together."""
    if not tensors:
        return []
    try:
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
    except TypeError:  # torch without the dtype argument
        norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]
    return torch.stack(norms).tolist()


def _shared_across_stages(model: nn.Module, spec: ModelSpec, mesh: ParallelMesh) -> list[nn.Parameter]:
    if mesh.embed_group is None:
        return []
    params = dict(model.named_parameters())
    out = []
    for src, copy in spec.tied:
        if (src in params) != (copy in params):  # one side here, the other on another stage
            out.append(params[src] if src in params else params[copy])
    return out


def check_buffers(model: nn.Module, spec: ModelSpec) -> None:
    """BatchNorm running statistics are the buffers the engine knows (initialised, synchronised
    over dp, sharded with their channels, saved in checkpoints). Any other buffer would be left
    uninitialised by the meta-device build and unsaved: refused in one line rather than
    trained silently wrong. Compute such tables in forward (as the Llama's rotary cache does)."""
    from .batchnorm import is_batchnorm
    owners = {f"{m}.{b}" if m else b for m, mod in model.named_modules() if not is_batchnorm(mod)
              for b, _ in mod.named_buffers(recurse=False)}
    names = sorted(owners)
    if names:
        from ..config import ConfigError
        raise ConfigError(f"model {spec.name!r} has buffers ({', '.join(names[:3])}"
                          f"{', ...' if len(names) > 3 else ''}) outside BatchNorm layers, which "
                          f"hybridpar cannot initialise or save; compute such tables in forward, "
                          f"or make them parameters")


def split_pipeline(model: nn.Module, spec: ModelSpec, pp_rank: int, pp: int,
                   split: list[int]) -> list[list[str]]:
    """Keep only this rank's units; returns the unit names of each of its chunks.

    ``split`` gives blocks per virtual stage (pp * chunks of them); virtual stage c*pp + r lives
    on rank r as its chunk c (Megatron's interleaving). The first virtual stage also runs the
    stem, the last the head. A unit not kept is set to None in its parent (names of the kept
    ones never change)."""
    n_chunks = len(split) // pp
    per_stage = spec.stage_units(split)
    chunks = [per_stage[c * pp + pp_rank] for c in range(n_chunks)]
    keep = {u for units in chunks for u in units}
    for unit in spec.units:
        if unit not in keep:
            parent, leaf = owner(model, unit)
            parent._modules[leaf] = None
    return chunks


def apply_recompute(model: nn.Module, spec: ModelSpec, mode: str, *, compile: bool = False) -> None:
    """Recompute activations in backward instead of storing them: ``full`` keeps only each
    block's input, ``selective`` drops what the spec names (for a transformer, the attention
    core softmax(QK^T)V: the largest and cheapest-to-recompute activations). Instance-level
    overrides keep parameter names. ``compile``: a recomputed region runs eagerly inside a
    compiled unit (the unit's graph breaks around it): torch.compile cannot trace a checkpoint
    with our context function, and a compiled function under a non-reentrant checkpoint may
    save its tensors in another order when it is recomputed."""
    from torch.utils.checkpoint import checkpoint

    def wrap(module: nn.Module, fn_name: str) -> None:
        fn = getattr(module, fn_name)

        def run(*args):
            record_saved(*args)  # the checkpoint keeps its inputs, outside autograd's hooks
            # the recompute pass leaves BatchNorm running statistics alone (counted once)
            return checkpoint(fn, *args, use_reentrant=False,
                              context_fn=lambda: (contextlib.nullcontext(), recomputing()))
        setattr(module, fn_name, torch.compiler.disable(run) if compile else run)

    modules = dict(model.named_modules())
    if mode == "full":
        for unit in spec.blocks:
            if unit in modules:
                wrap(modules[unit], "forward")
    elif mode == "selective":
        for entry in spec.selective_recompute:
            pattern, _, method = entry.partition(":")
            for name, module in modules.items():
                if name and fnmatchcase(name, pattern):
                    wrap(module, method or "forward")


def apply_compile(model: nn.Module, units: list[str]) -> None:
    """``torch.compile`` each of this rank's units in place (``nn.Module.compile``: parameter
    names, hooks and checkpoints are unchanged). Per unit, not per stage: the graph breaks at a
    unit's tensor-parallel collectives stay inside it, the blocks of a transformer share one
    compiled graph (same code, same shapes), and the pipeline runtime still calls units one by
    one. Shapes are static (dynamic=False): every micro-batch of a run has the same shape.

    Dynamo counts compiled variants per code object, and units of one class share their forward:
    a ResNet's blocks are one ``Block.forward`` at several widths and strides, each compiled for
    training and for evaluation. At its default of 8 the later blocks fell back to eager with a
    warning (6 blocks at dp = 2); the limit is raised to 4 variants a unit."""
    import torch._dynamo

    need = 4 * len(units)
    if torch._dynamo.config.recompile_limit < need:
        torch._dynamo.config.recompile_limit = need
    for unit in units:
        model.get_submodule(unit).compile(dynamic=False)


def init_full(spec: ModelSpec, key: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The unsharded initial value of parameter ``key``; independent of layout and device."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    if spec.init is None:
        raise ValueError(f"model spec {spec.name!r} has no init; give ModelSpec.init or init_state")
    return spec.init(key, shape, g)


def full_value(spec: ModelSpec, shard: ShardSpec, *, seed: int, init_state=None,
               source: str = "init_state") -> torch.Tensor:
    """The unsharded starting value of ``shard.init_key``: from ``init_state`` (a mapping of
    full tensors under the model's names, e.g. a Hugging Face import) when given, else the
    spec's seeded init."""
    if init_state is None:
        return init_full(spec, shard.init_key, shard.full_shape, seed)
    from ..config import ConfigError
    if shard.init_key not in init_state:
        raise ConfigError(f"model.init_from={source} has no tensor {shard.init_key}")
    full = init_state[shard.init_key]
    if tuple(full.shape) != shard.full_shape:
        raise ConfigError(f"model.init_from={source}: {shard.init_key} has shape "
                          f"{tuple(full.shape)}, the model config needs {shard.full_shape}; "
                          f"set the model fields to match")
    return full


def parallelize(cfg: Config, mesh: ParallelMesh, *, spec: ModelSpec | None = None,
                init_state=None, example=None) -> ParallelModel:
    """This rank's shard of the model ``spec`` describes (default: the config's model),
    initialised from ``init_state`` (full tensors, e.g. ``interop.hf.open_state(model.init_from)``;
    each rank keeps ``ShardSpec.take`` of them) or from the spec's seeded init. The pipeline
    split is ``planner.spec_model.pipeline_split``'s (``example(b)``: a micro-batch of b
    samples, to profile the blocks when they are split by cost)."""
    m, p = cfg.model, cfg.parallel
    spec = spec or spec_for(m)
    if init_state is None and m.init_from:
        raise ValueError(f"model.init_from={m.init_from!r}: pass its tensors as init_state "
                         f"(hybridpar.interop.hf.open_state); parallelize reads no files")
    with torch.device("meta"):
        model = spec.build()
    check_plan(model, spec.tp_plan, mesh.layout.tp, where=spec.name,
               sequence_parallel=p.sequence_parallel)
    check_buffers(model, spec)
    full_shapes = {n: tuple(q.shape) for n, q in model.named_parameters(remove_duplicate=False)}
    full_shapes.update((n, tuple(b.shape)) for n, b in model.named_buffers())
    from ..planner.spec_model import pipeline_split
    from .collectives import computed_once
    split, split_note = computed_once(lambda: pipeline_split(cfg, spec, mesh.device.type, example),
                                      mesh.layout.world_size)
    chunk_units = split_pipeline(model, spec, mesh.pp_rank, mesh.layout.pp, split)
    tp_dims = apply_tp(model, mesh, dict(spec.tp_plan), sequence_parallel=p.sequence_parallel)
    sync_batchnorm(model, mesh.group("dp"))
    # before recompute, so that a recomputed attention core is the context-parallel one
    seq_shard = apply_context_parallel(model, spec, mesh, seq_len=m.seq_len, method=p.cp_attention)
    apply_recompute(model, spec, p.recompute, compile=cfg.train.compile)

    model.to_empty(device=mesh.device)  # allocates each parameter anew: re-tie below
    reset_buffers(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    for src, copy in spec.tied:
        if src in params and copy in params:
            setattr(*owner(model, copy), params[src])
    specs = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            dim = tp_dims.get(name)
            shard = ShardSpec(full_shapes[name], dim, mesh.tp_rank if dim is not None else 0,
                              mesh.layout.tp if dim is not None else 1, spec.tied_source(name))
            param.copy_(shard.take(full_value(spec, shard, seed=cfg.train.seed,
                                              init_state=init_state,
                                              source=m.init_from or "init_state")))
            specs[name] = shard
        for name, buf in model.named_buffers():  # BatchNorm statistics: sharded with their channels
            dim = tp_dims.get(name)
            shard = ShardSpec(full_shapes[name], dim, mesh.tp_rank if dim is not None else 0,
                              mesh.layout.tp if dim is not None else 1, name)
            if init_state is not None and name in init_state:  # e.g. an exported checkpoint
                buf.copy_(shard.take(full_value(spec, shard, seed=cfg.train.seed,
                                                init_state=init_state, source=m.init_from or "init_state")))
            specs[name] = shard
    params = dict(model.named_parameters())
    # cp ranks hold the same parameters and see different tokens: gradients are averaged (and
    # ZeRO-1 state sharded) over the dp x cp replicas of this (tp, pp) shard
    sync = GradSync.build(list(params.values()), group=mesh.group("dcp"), n_accum=p.microbatches,
                          bucket_bytes=bucket_bytes(sum(q.numel() * q.element_size()
                                                        for q in params.values()), p.bucket_mb,
                                                    mesh.layout.replicas),
                          zero1=p.zero1, own_bucket=tuple(_shared_across_stages(model, spec, mesh)),
                          reduce_dtype=torch.bfloat16 if p.grad_reduce_dtype == "bf16" else None)
    amp = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision_of(cfg.train, mesh.device)]
    if cfg.train.compile:
        apply_compile(model, [u for units in chunk_units for u in units])
    chunks = [Stage(model, units, device_type=mesh.device.type, autocast_dtype=amp)
              for units in chunk_units]
    vocab_parallel = mesh.layout.tp > 1 and any(
        "vocab_head" in style_of(dict(spec.tp_plan), u) for u in spec.head)
    return ParallelModel(model, mesh, spec, specs, sync, chunks, p.sequence_parallel,
                         vocab_parallel, spec.stage_units(split), seq_shard, split_note)


def build_optimizer(pm: ParallelModel, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; decay on matrices (dim >= 2) only. Elementwise, so sharding it changes nothing:
    under ZeRO-1 it runs on this dp rank's flat slices of the parameters (views into them)."""
    decay, no_decay = [], []
    if pm.grad_sync.zero1:
        for p, pslice, gslice in pm.grad_sync.segments():
            t = pslice.detach()
            t.grad = gslice
            (decay if p.dim() >= 2 else no_decay).append(t)
    else:
        for _, p in pm.named_parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
    t = cfg.train
    # one implementation choice per device, the same math: CUDA's fused kernel (one launch for
    # every tensor), elsewhere the multi-tensor path (no Python loop over the parameters)
    fused = pm.mesh.device.type == "cuda"
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                             fused=fused or None, foreach=None if fused else True)


def local_state(pm: ParallelModel, *, grads: bool = False) -> dict[str, tuple[ShardSpec, torch.Tensor]]:
    """{name: (spec, local tensor)} of parameters (or their gradients), detached on CPU. Under
    ZeRO-1 a rank's gradients are final only on the slices it owns: the others are NaN here,
    so that no check can compare them by mistake."""
    out = {}
    for name, p in pm.named_parameters():
        t = (p.grad if grads else p).detach().cpu().clone()
        if grads:
            a, e = pm.grad_sync.owned_range(p)
            if (a, e) != (0, p.numel()):
                flat = torch.full((p.numel(),), float("nan"), dtype=t.dtype)
                flat[a:e] = t.view(-1)[a:e]
                t = flat.view_as(t)
        out[name] = (pm.specs[name], t)
    return out


def local_buffers(pm: ParallelModel) -> dict[str, tuple[ShardSpec, torch.Tensor]]:
    """{name: (spec, local tensor)} of the buffers (BatchNorm running statistics), on CPU."""
    return {name: (pm.specs[name], b.detach().cpu().clone()) for name, b in pm.module.named_buffers()}


def assemble(pieces: list[dict[str, tuple[ShardSpec, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Unsharded tensors from every rank's ``local_state`` (any layout). Elements start as NaN
    and each piece fills what it holds (its non-NaN elements: a ZeRO-1 rank's owned gradient
    slices), so an element no rank holds stays NaN; dp replicas and tp-replicated parameters
    overwrite each other. The pipeline copy of a tied output head is left out, as a single
    process has none."""
    full: dict[str, torch.Tensor] = {}
    for piece in pieces:
        for name, (spec, t) in piece.items():
            if spec.init_key != name:  # the pipeline copy of a tied embedding
                continue
            if not t.is_floating_point():  # a counter (num_batches_tracked): replicated
                full[name] = t.clone()
                continue
            if name not in full:
                full[name] = torch.full(spec.full_shape, float("nan"), dtype=t.dtype)
            dst, have = spec.take(full[name]), ~t.isnan()
            if have.all():
                dst.copy_(t)
            else:
                dst[have] = t[have]
    return full
