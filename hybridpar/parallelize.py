"""``parallelize``: the one place that fixes the order pipeline split -> tensor parallel -> data parallel.

The model is built on the meta device, cut and sharded there, then only this rank's shard is
materialised. Each parameter is initialised from a generator keyed by (seed, unsharded name),
generated at full size and sliced, so every layout starts from the very same weights as a
single process.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .config import Config, ModelConfig, bucket_bytes, pp_split
from .data_parallel import GradSync
from .memory import record_saved
from .mesh import ParallelMesh
from .model import Transformer, init_std
from .tensor_parallel.apply import ShardSpec, apply_tp
from .tensor_parallel.layers import cross_entropy


@dataclass
class Chunk:
    """One contiguous run of layers executed as a pipeline virtual stage on this rank."""

    model: Transformer
    layer_keys: list[str]
    embed: bool
    head: bool
    autocast_dtype: torch.dtype | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is None:
            return self.model.forward_chunk(x, self.layer_keys, embed=self.embed, head=self.head)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype):
            return self.model.forward_chunk(x, self.layer_keys, embed=self.embed, head=self.head)


@dataclass
class ParallelModel:
    """This rank's piece of the model and what is needed to train and save it."""

    module: Transformer
    mesh: ParallelMesh
    specs: dict[str, ShardSpec]  # local parameter name -> place in the unsharded tensor
    layer_ids: list[int]
    grad_sync: GradSync
    chunks: list[Chunk] = field(default_factory=list)  # virtual stages, in schedule chunk order
    sequence_parallel: bool = False

    @property
    def is_first(self) -> bool:
        return self.mesh.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.mesh.pp_rank == self.mesh.layout.pp - 1

    @property
    def tied_copy(self) -> bool:
        """lm_head.weight is a pp-separated copy of tok_emb.weight, kept equal by summing grads."""
        return self.mesh.embed_group is not None and self.is_last

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        tp_rows = logits.size(-1)
        return cross_entropy(logits, targets, group=self.mesh.group("tp"),
                             vocab_start=self.mesh.tp_rank * tp_rows)

    def named_parameters(self):
        return self.module.named_parameters()

    def counted_parameters(self):
        """Parameters whose gradients this rank counts in the global norm: tp-replicated ones
        on tp rank 0 only, the pipeline copy of a tied embedding never."""
        for name, p in self.module.named_parameters():
            spec = self.specs[name]
            if self.tied_copy and name == "lm_head.weight":
                continue
            if spec.dim is None and self.mesh.tp_rank != 0:
                continue
            yield p

    def grad_sumsq(self) -> tuple[float, int]:
        """This rank's share of the squared global gradient norm, and how many dp replicas
        count it (the world all-reduce of the shares is divided by that)."""
        counted = {id(p) for p in self.counted_parameters()}
        if self.grad_sync.zero1:
            total = sum(torch.linalg.vector_norm(g, dtype=torch.float64).item() ** 2
                        for p, _, g in self.grad_sync.segments() if id(p) in counted)
            return total, 1
        total = sum(torch.linalg.vector_norm(p.grad, dtype=torch.float64).item() ** 2
                    for _, p in self.named_parameters() if id(p) in counted)
        return total, self.mesh.layout.dp

    def finish_grads(self) -> None:
        """After the schedule: dp all-reduce, then sum the tied embedding's two pipeline copies."""
        self.grad_sync.finish()
        if self.sequence_parallel and self.mesh.group("tp") is not None:
            # each tp rank saw only its part of the sequence in norms: sum their weight grads
            for name, p in self.module.named_parameters():
                if self.specs[name].dim is None:
                    dist.all_reduce(self.grad_sync.owned_grad(p), group=self.mesh.group("tp"))
        tied = self.tied_param()
        if tied is not None:
            # the two stages' copies sit alone in equal buckets: same owned slice on both
            dist.all_reduce(self.grad_sync.owned_grad(tied), group=self.mesh.embed_group)

    def tied_param(self):
        """This stage's copy of the embedding shared with another pipeline stage, if any."""
        name = _tied_name(self.mesh)
        return None if name is None else dict(self.module.named_parameters())[name]


def _tied_name(mesh: ParallelMesh) -> str | None:
    """The parameter a pipeline stage shares with another stage (summed over embed_group)."""
    if mesh.embed_group is None:
        return None
    return "tok_emb.weight" if mesh.pp_rank == 0 else "lm_head.weight"


def split_pipeline(model: Transformer, pp_rank: int, pp: int, split: list[int]) -> list[list[int]]:
    """Keep only this rank's layers; returns the layer ids of each of its chunks.

    ``split`` gives layers per virtual stage (pp * chunks of them); virtual stage c*pp + r lives
    on rank r as its chunk c (Megatron's interleaving). The first virtual stage embeds, the last
    norms and projects."""
    n_chunks = len(split) // pp
    starts = [sum(split[:v]) for v in range(len(split))]
    chunks = [list(range(starts[c * pp + pp_rank], starts[c * pp + pp_rank] + split[c * pp + pp_rank]))
              for c in range(n_chunks)]
    keep = {i for ids in chunks for i in ids}
    for key in list(model.layers.keys()):
        if int(key) not in keep:
            del model.layers[key]
    if pp_rank != 0:
        model.tok_emb = None
    if pp_rank != pp - 1:
        model.norm = None
        model.lm_head = None
    return chunks


def apply_recompute(model: Transformer, mode: str) -> None:
    """Recompute activations in backward instead of storing them: ``full`` keeps only each
    block's input, ``selective`` drops the attention core (softmax(QK^T)V, the largest and
    cheapest-to-recompute activations). Instance-level forward override keeps parameter names."""
    from torch.utils.checkpoint import checkpoint

    def wrap(module: nn.Module, fn_name: str) -> None:
        fn = getattr(module, fn_name)

        def run(*args):
            record_saved(*args)  # the checkpoint keeps its inputs, outside autograd's hooks
            return checkpoint(fn, *args, use_reentrant=False)
        setattr(module, fn_name, run)

    for block in model.layers.values():
        if mode == "full":
            wrap(block, "forward")
        elif mode == "selective":
            wrap(block.attn, "core")


def _init_key(cfg: ModelConfig, name: str) -> str:
    return "tok_emb.weight" if cfg.tie_embeddings and name == "lm_head.weight" else name


def init_full(cfg: ModelConfig, key: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The unsharded initial value of parameter ``key``; independent of layout and device."""
    std = init_std(cfg, key)
    if std is None:
        return torch.ones(shape)
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    return torch.empty(shape).normal_(0.0, std, generator=g)


def full_value(cfg: Config, spec: ShardSpec, init_state=None) -> torch.Tensor:
    """The unsharded starting value of ``spec.init_key``: from ``init_state`` (a mapping of full
    tensors under our names, e.g. a Hugging Face import) when given, else the seeded init."""
    if init_state is None:
        return init_full(cfg.model, spec.init_key, spec.full_shape, cfg.train.seed)
    from .config import ConfigError
    src = cfg.model.init_from or "init_state"
    if spec.init_key not in init_state:
        raise ConfigError(f"model.init_from={src} has no tensor {spec.init_key}")
    full = init_state[spec.init_key]
    if tuple(full.shape) != spec.full_shape:
        raise ConfigError(f"model.init_from={src}: {spec.init_key} has shape {tuple(full.shape)}, "
                          f"the model config needs {spec.full_shape}; set the model fields to match")
    return full


def parallelize(cfg: Config, mesh: ParallelMesh, *, init_state=None) -> ParallelModel:
    """This rank's shard of the model, initialised from ``init_state`` / ``cfg.model.init_from``
    (full tensors, each rank keeps ``ShardSpec.take`` of them) or from the seeded init."""
    m = cfg.model
    if init_state is None and m.init_from:
        from .hf import open_state
        init_state = open_state(m.init_from)
    with torch.device("meta"):
        model = Transformer(m)
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    full_shapes["lm_head.weight"] = (m.vocab_size, m.d_model)
    p = cfg.parallel
    split = pp_split(m.n_layers, mesh.layout.pp * p.virtual_stages, p.pp_split)
    chunk_ids = split_pipeline(model, mesh.pp_rank, mesh.layout.pp, split)
    tp_dims = apply_tp(model, mesh, sequence_parallel=p.sequence_parallel)
    apply_recompute(model, p.recompute)

    model.to_empty(device=mesh.device)  # allocates each parameter anew: re-tie below
    if m.tie_embeddings and model.tok_emb is not None and model.lm_head is not None:
        model.lm_head.weight = model.tok_emb.weight
    model.init_rope(mesh.device)
    specs = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            dim = tp_dims.get(name)
            spec = ShardSpec(full_shapes[name], dim, mesh.tp_rank if dim is not None else 0,
                             mesh.layout.tp if dim is not None else 1, _init_key(m, name))
            param.copy_(spec.take(full_value(cfg, spec, init_state)))
            specs[name] = spec
    params = dict(model.named_parameters())
    tied = params.get(_tied_name(mesh)) if _tied_name(mesh) else None
    sync = GradSync.build(list(params.values()), group=mesh.group("dp"), n_accum=p.microbatches,
                          bucket_bytes=bucket_bytes(sum(q.numel() * q.element_size()
                                                        for q in params.values()), p.bucket_mb),
                          zero1=p.zero1, own_bucket=(tied,) if tied is not None else (),
                          reduce_dtype=torch.bfloat16 if p.grad_reduce_dtype == "bf16" else None)
    amp = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.precision]
    last = len(chunk_ids) - 1
    chunks = [Chunk(model, [str(i) for i in ids], embed=mesh.pp_rank == 0 and c == 0,
                    head=mesh.pp_rank == mesh.layout.pp - 1 and c == last, autocast_dtype=amp)
              for c, ids in enumerate(chunk_ids)]
    return ParallelModel(model, mesh, specs, sorted(i for ids in chunk_ids for i in ids), sync,
                         chunks, p.sequence_parallel)


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
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


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
            if name not in full:
                full[name] = torch.full(spec.full_shape, float("nan"), dtype=t.dtype)
            dst, have = spec.take(full[name]), ~t.isnan()
            if have.all():
                dst.copy_(t)
            else:
                dst[have] = t[have]
    return full
