"""The PyTorch-native equivalent of a hybridpar layout, on the same model, init, data and math.

  dp: ``DistributedDataParallel`` (``no_sync`` over the first micro-batches, gradients as bucket
      views, the same bucket size, no buffer broadcast: the rotary tables are constants).
  tp: ``torch.distributed.tensor.parallel`` over a DeviceMesh: ColwiseParallel for wq/wk/wv/w1/w3,
      RowwiseParallel for wo/w2, RowwiseParallel for the embedding (vocab rows), ColwiseParallel
      for the output head with vocab-sharded logits and ``loss_parallel`` (torchtitan's plan,
      without sequence parallelism since hybridpar's default has none). PrepareModuleInput makes
      each attention/MLP input one Replicate DTensor, so its gradient is all-reduced once per
      region as in Megatron; without it every column-parallel linear's input gradient is
      all-reduced on its own (7 instead of 4 all-reduces per block, ``region_inputs=False``).
  pp: ``torch.distributed.pipelining``: a PipelineStage per rank and ScheduleGPipe/Schedule1F1B.
  2D/3D: TP on the stage module, then DDP over the dp sub-mesh (``DDP(device_mesh=...)`` turns the
      DTensor parameters into local ones), then pipelining on top, as the torch docs compose them.

The training step is hybridpar's: same micro-batches (this dp rank's rows of the same global
batch), mean loss over micro-batches and dp replicas, global gradient-norm clipping, AdamW with
decay on matrices only, and the LR of ``train.lr_at``. The mesh has hybridpar's rank placement
(``Layout.grid``), so both sides talk over the same pairs of ranks.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...engine import data as data_mod
from ...config import Config, bucket_bytes, pp_split, precision_of
from ...parallel.mesh import Layout
from ...models.transformer import Transformer
from ...models import spec_for
from ...parallel.parallelize import init_full
from ...engine.train import lr_at


def build_model(cfg: Config, pp_rank: int, pp: int) -> Transformer:
    """This stage's layers of the single-device model, with hybridpar's seeded initial values."""
    if cfg.model.tie_embeddings:
        raise ValueError("the native benchmark does not tie embeddings; use --model.tie_embeddings=false")
    model, spec = Transformer(cfg.model), spec_for(cfg.model)
    for m in model.modules():  # DTensor's tp plans hook each Linear's own call: unfused
        if hasattr(m, "fused"):
            m.fused = False
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_full(spec, name, tuple(p.shape), cfg.train.seed))
    split = pp_split(cfg.model.n_layers, pp, cfg.parallel.pp_split)
    start = sum(split[:pp_rank])
    for key in list(model.layers.keys()):
        if not start <= int(key) < start + split[pp_rank]:
            del model.layers[key]
    if pp_rank != 0:
        model.tok_emb = None
    if pp_rank != pp - 1:
        model.norm, model.lm_head = None, None
    return model


def _grad_bytes(model: nn.Module) -> int:
    """This rank's gradient bytes (DTensor parameters: the local shard), for the same bucket
    size rule as hybridpar's (``config.bucket_bytes``)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
               for p in model.parameters())


def apply_native_tp(model: Transformer, tp_mesh, *, region_inputs: bool = True) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    plan = {}
    for lid in model.layers:
        if region_inputs:  # one Replicate DTensor per region: one backward all-reduce, not one per linear
            plan[f"layers.{lid}.attn"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
            plan[f"layers.{lid}.mlp"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
            plan[f"layers.{lid}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.w2"):
            plan[f"layers.{lid}.{name}"] = RowwiseParallel()
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, plan)


def _item(loss: torch.Tensor) -> float:
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


@dataclass
class NativeRun:
    """One rank's native model, optimizer and (with pp) schedule; ``train_step`` mirrors
    ``hybridpar.engine.train.Trainer.train_step`` and returns the same loss."""

    cfg: Config
    layout: Layout
    rank: int
    model: nn.Module
    opt: torch.optim.Optimizer
    groups: dict
    schedule: object | None
    step: int = 0

    @property
    def coords(self) -> dict:
        return self.layout.coords(self.rank)

    def params(self) -> list:
        """The trained tensors, from the optimizer: with DDP over a tp mesh, ``model.parameters()``
        stops listing the tp weights after the first forward (DDP's DTensor hooks re-attach them
        as plain DTensor attributes), while the optimizer keeps the local tensors DDP reduces."""
        return [p for g in self.opt.param_groups for p in g["params"]]

    def _loss_ctx(self):
        if self.layout.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            return loss_parallel()
        return contextlib.nullcontext()

    def _rows(self, tokens):
        t = self.cfg.train
        batch = data_mod.global_batch(tokens, self.step, seed=t.seed, global_batch_size=t.global_batch,
                                      seq_len=self.cfg.model.seq_len)
        return data_mod.shard_rows(batch, self.coords["dp"], self.layout.dp)

    def _forward_backward(self, x, y) -> float:
        """Loss summed over this rank's micro-batches / M (0 where this rank has no loss)."""
        M = self.cfg.parallel.microbatches
        if self.schedule is not None:
            P, s = self.layout.pp, self.coords["pp"]
            losses: list = []
            with self._loss_ctx():
                if s == 0:
                    self.schedule.step(x)
                elif s == P - 1:
                    self.schedule.step(target=y, losses=losses)
                else:
                    self.schedule.step()
            return sum(_item(v) for v in losses) / M if losses else 0.0
        total = 0.0
        mbs = data_mod.microbatches((x, y), M)
        for i, (xm, ym) in enumerate(mbs):
            sync = i == M - 1 or not hasattr(self.model, "no_sync")
            with (contextlib.nullcontext() if sync else self.model.no_sync()), self._loss_ctx():
                loss = _ce(self.model(xm), ym) / M
                loss.backward()
            total += _item(loss)
        return total

    def train_step(self, tokens) -> dict:
        x, y = self._rows(tokens)
        self.opt.zero_grad(set_to_none=False)
        loss = self._forward_backward(x, y)
        norm = clip_grad_norm(self.params(), self.cfg.train.grad_clip,
                              tp_group=self.groups.get("tp"), pp_group=self.groups.get("pp"))
        c = self.coords
        counted = c["tp"] == 0 and c["pp"] == self.layout.pp - 1
        t = torch.tensor([loss if counted else 0.0], dtype=torch.float64)
        if self.layout.world_size > 1:
            dist.all_reduce(t)
        lr = lr_at(self.step, self.cfg.train)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.step += 1
        return {"loss": t.item() / self.layout.dp, "grad_norm": norm}


def _is_sharded(p: torch.Tensor) -> bool:
    """Whether this rank's gradient of ``p`` is a shard (else a full replica). Judged by the
    gradient: DTensor's embedding backward yields a Replicate gradient of a Shard(0) weight."""
    from torch.distributed.tensor import DTensor

    g = p.grad
    spec = g._spec if isinstance(g, DTensor) else getattr(p, "_st_info", None)  # DDP-localized DTensor
    return spec is not None and any(pl.is_shard() for pl in spec.placements)


def clip_grad_norm(params: list, max_norm: float, *, tp_group, pp_group) -> float:
    """Global gradient-norm clipping over tp shards (sharded params summed over tp, replicated
    ones counted once) and pipeline stages, as torchtitan's ``clip_grad_norm_`` does; dp replicas
    hold equal gradients after DDP."""
    from torch.distributed.tensor import DTensor

    def local(g):
        return g.to_local() if isinstance(g, DTensor) else g

    shard = [local(p.grad) for p in params if p.grad is not None and _is_sharded(p)]
    repl = [local(p.grad) for p in params if p.grad is not None and not _is_sharded(p)]
    sq = torch.zeros(2, dtype=torch.float64)
    for i, gs in enumerate((shard, repl)):
        if gs:
            sq[i] = torch.nn.utils.get_total_norm(gs).double() ** 2
    if tp_group is not None:
        sq_shard = sq[:1].clone()
        dist.all_reduce(sq_shard, group=tp_group)
        sq[0] = sq_shard[0]
    total = sq.sum().reshape(1)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = math.sqrt(total.item())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def _optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    t = cfg.train
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def build_native(cfg: Config, layout: Layout, rank: int, device: torch.device) -> NativeRun:
    """Collective: every rank builds its piece (new process groups, separate from hybridpar's)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    p = cfg.parallel
    if p.virtual_stages > 1 or p.zero1 or p.sequence_parallel or p.recompute != "none" \
            or precision_of(cfg.train, device) != "fp32":
        raise ValueError("the native benchmark covers plain dp/tp/pp in fp32 (gpipe or 1f1b)")
    dm = DeviceMesh(device.type, layout.grid().squeeze(2), mesh_dim_names=("pp", "dp", "tp"))
    c = layout.coords(rank)
    groups = {a: dm.get_group(a) for a in ("pp", "dp", "tp") if layout.size(a) > 1}
    model = build_model(cfg, c["pp"], layout.pp)
    if layout.tp > 1:
        apply_native_tp(model, dm["tp"])
    if layout.dp > 1:
        kw = {"device_mesh": dm["dp"]} if layout.tp > 1 else {"process_group": groups["dp"]}
        with warnings.catch_warnings():  # broadcast_buffers=False is still the way to skip init sync
            warnings.simplefilter("ignore", FutureWarning)
            model = DDP(model, broadcast_buffers=False, gradient_as_bucket_view=True,
                        bucket_cap_mb=bucket_bytes(_grad_bytes(model), p.bucket_mb) / 2**20, **kw)
    schedule = None
    if layout.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(model, c["pp"], layout.pp, device, group=groups["pp"])
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[p.schedule]
        schedule = cls(stage, p.microbatches, loss_fn=_ce, scale_grads=True)
    return NativeRun(cfg, layout, rank, model, _optimizer(model, cfg), groups, schedule)
