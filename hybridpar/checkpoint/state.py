"""The training state as layout-free tensors: what each rank contributes to a checkpoint.

Keys are unsharded names: ``model/<param or buffer>``, ``optim/<param>/exp_avg``,
``optim/<param>/exp_avg_sq`` and ``optim/step``. Each local shard is wrapped as a DTensor on
this pipeline stage's (dp, tp) device mesh with placements ``[Replicate(), Shard(d)]`` (a tp
split along d) or ``[Replicate(), Replicate()]``; ``torch.distributed.checkpoint`` then saves
each chunk once (dp replicas are deduplicated) with its offset in the unsharded tensor, and on
load reads into every rank exactly the overlap of its own chunk with the saved ones, whatever
layout wrote them. One process (no mesh) uses plain full tensors.

The pipeline copy of a tied embedding (``lm_head.weight`` on the last stage, whose
``ShardSpec.init_key`` is ``tok_emb.weight``) is not saved: it loads ``tok_emb.weight``'s
values and optimizer state, equal by construction (its gradient is summed with the first
stage's copy every step). Under ZeRO-1 the AdamW moments live in flat dp slices of gradient
buckets; they are all-gathered over dp into per-parameter tensors for a save, and each rank
keeps its slice of the loaded ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel.parallelize import ParallelModel

MOMENTS = ("exp_avg", "exp_avg_sq")


def _submesh(pm: ParallelModel):
    dm = pm.mesh.device_mesh
    if dm is None:
        return None
    return dm["dp", "cp", "tp"] if "cp" in dm.mesh_dim_names else dm["dp", "tp"]


def _wrap(t: torch.Tensor, spec, sub) -> torch.Tensor:
    if sub is None:
        return t
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor, Replicate, Shard

    inner = Replicate() if spec.dim is None else Shard(spec.dim)
    # replicated over dp (and cp: its ranks hold the same parameters), tp-sharded or not
    return DTensor.from_local(t, sub, [Replicate()] * (sub.ndim - 1) + [inner], run_check=False)


def _new_state(p: torch.Tensor) -> dict:
    """AdamW's state before its first step (what ``torch.optim.AdamW`` creates lazily)."""
    from torch.optim.optimizer import _get_scalar_dtype

    return {"step": torch.tensor(0.0, dtype=_get_scalar_dtype()),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


@dataclass
class Moments:
    """Per-parameter AdamW moments of this rank's (tp-local) parameters, and how to write
    loaded values back into the optimizer."""

    by_name: dict[str, dict[str, torch.Tensor]]
    step: torch.Tensor

    @classmethod
    def read(cls, pm: ParallelModel, opt: torch.optim.Optimizer) -> "Moments":
        if pm.grad_sync.zero1 and pm.grad_sync.active:
            return _read_zero1(pm, opt)
        by_name, step = {}, None
        for name, p in pm.named_parameters():
            st = opt.state.get(p) or _new_state(p)
            by_name[name] = {k: st[k] for k in MOMENTS}
            step = st["step"] if step is None else step
        return cls(by_name, step.clone())

    @classmethod
    def empty(cls, pm: ParallelModel) -> "Moments":
        by_name = {name: {k: torch.zeros_like(p) for k in MOMENTS} for name, p in pm.named_parameters()}
        return cls(by_name, _new_state(torch.zeros(()))["step"])

    def write(self, pm: ParallelModel, opt: torch.optim.Optimizer) -> None:
        """Copy these (loaded) moments into ``opt``, creating its state where it has none."""
        if pm.grad_sync.zero1 and pm.grad_sync.active:
            for name, p, a, e, t in _zero1_segments(pm, opt):
                st = opt.state[t] = opt.state.get(t) or _new_state(t)
                for k in MOMENTS:
                    st[k].copy_(self.by_name[name][k].reshape(-1)[a:e])
                st["step"].copy_(self.step)
            return
        for name, p in pm.named_parameters():
            st = opt.state[p] = opt.state.get(p) or _new_state(p)
            for k in MOMENTS:
                if st[k] is not self.by_name[name][k]:
                    st[k].copy_(self.by_name[name][k])
            st["step"].copy_(self.step)


def _zero1_segments(pm: ParallelModel, opt: torch.optim.Optimizer):
    """(name, param, start, end, optimizer tensor) of each flat slice this dp rank owns."""
    from ..parallel.data_parallel import _offsets

    names = {id(p): n for n, p in pm.named_parameters()}
    by_ptr = {t.data_ptr(): t for g in opt.param_groups for t in g["params"]}
    sync = pm.grad_sync
    for b in sync.buckets:
        lo, hi = sync.shard_range(b)
        for p, off in zip(b.params, _offsets(b.params)):
            a, e = max(lo, off), min(hi, off + p.numel())
            if a < e:
                yield names[id(p)], p, a - off, e - off, by_ptr[b.param_buf[a:e].data_ptr()]


def _read_zero1(pm: ParallelModel, opt: torch.optim.Optimizer) -> Moments:
    """All-gather the dp slices of the moments into per-parameter tensors (collective over dp)."""
    from ..parallel.data_parallel import _offsets

    sync = pm.grad_sync
    flats = [{k: torch.zeros_like(b.param_buf) for k in MOMENTS} for b in sync.buckets]
    bucket_of = {id(p): i for i, b in enumerate(sync.buckets) for p in b.params}
    offset_of = {id(p): off for b in sync.buckets for p, off in zip(b.params, _offsets(b.params))}
    step = _new_state(torch.zeros(()))["step"]
    for name, p, a, e, t in _zero1_segments(pm, opt):
        st = opt.state.get(t)
        if st:
            base = offset_of[id(p)]
            for k in MOMENTS:
                flats[bucket_of[id(p)]][k][base + a:base + e].copy_(st[k])
            step = st["step"]
    for b, flat in zip(sync.buckets, flats):
        lo, hi = sync.shard_range(b)
        for k in MOMENTS:
            dist.all_gather(list(flat[k].chunk(sync.dp)), flat[k][lo:hi].clone(), group=sync.group)
    by_name = {}
    for name, p in pm.named_parameters():
        i, off = bucket_of[id(p)], offset_of[id(p)]
        by_name[name] = {k: flats[i][k][off:off + p.numel()].view_as(p) for k in MOMENTS}
    return Moments(by_name, step.clone())


def checkpoint_key(pm: ParallelModel, name: str) -> str:
    """The unsharded name a local parameter is saved under (the tied copy: its source)."""
    return pm.specs[name].init_key or name


def state_dict(pm: ParallelModel, moments: Moments, *, for_load: bool) -> dict[str, torch.Tensor]:
    """The DCP state dict: views of this rank's tensors (a load writes into them in place).
    A save leaves out the tied pipeline copy; a load fills it from its source."""
    sub = _submesh(pm)
    out: dict[str, torch.Tensor] = {"optim/step": moments.step}
    for name, p in pm.named_parameters():
        key = checkpoint_key(pm, name)
        if key != name and not for_load:
            continue
        if f"model/{key}" in out:
            raise AssertionError(f"two local parameters load {key}")
        spec = pm.specs[name]
        out[f"model/{key}"] = _wrap(p.detach(), spec, sub)
        for k in MOMENTS:
            out[f"optim/{key}/{k}"] = _wrap(moments.by_name[name][k], spec, sub)
    for name, b in pm.module.named_buffers():  # BatchNorm statistics, equal over dp
        out[f"model/{name}"] = _wrap(b, pm.specs[name], sub)
    return out


def full_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Unsharded shape of every saved tensor of a model config (``model/`` keys)."""
    from ..models import spec_for

    with torch.device("meta"):
        model = spec_for(model_cfg).build()
    return {f"model/{n}": tuple(p.shape) for n, p in (*model.named_parameters(), *model.named_buffers())}
