"""Megatron tensor parallelism applied from outside the model, by a plan.

Per block, with X the block input replicated on every tp rank:
  attention:  Q,K,V = X W_q, X W_k, X W_v with W split by columns (heads): each rank owns
              n_heads/tp query and n_kv_heads/tp kv heads; O = concat_r(A_r) W_o with W_o split
              by rows, so O = sum_r A_r W_o[r] -> one all-reduce.
  mlp:        H = silu(X W_1) * (X W_3) with W_1, W_3 by columns; Y = H W_2 with W_2 by rows.
One ``copy_to_tp`` at each region's input and one ``reduce_from_tp`` after each row-parallel
linear: 2 all-reduces forward and 2 backward per block. The embedding and the output head are
split by vocabulary rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..mesh import ParallelMesh
from .layers import VocabParallelEmbedding
from .mappings import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_tp

COL, ROW = "colwise", "rowwise"
# module path inside a block -> how its weight is split; the parent module is the region.
BLOCK_PLAN: dict[str, dict[str, str]] = {
    "attn": {"wq": COL, "wk": COL, "wv": COL, "wo": ROW},
    "mlp": {"w1": COL, "w3": COL, "w2": ROW},
}


@dataclass(frozen=True)
class ShardSpec:
    """Where a local tensor sits in the unsharded one: chunk ``index`` of ``parts`` along ``dim``
    (dim None = replicated). ``init_key`` names the tensor whose initialisation it shares."""

    full_shape: tuple[int, ...]
    dim: int | None = None
    index: int = 0
    parts: int = 1
    init_key: str = ""

    def take(self, full: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return full
        return full.chunk(self.parts, dim=self.dim)[self.index]

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        s = list(self.full_shape)
        s[self.dim] //= self.parts
        return tuple(s)


def _shard_weight(module: nn.Module, dim: int, tp: int) -> None:
    shape = list(module.weight.shape)
    shape[dim] //= tp
    module.weight = nn.Parameter(torch.empty(shape, device=module.weight.device,
                                             dtype=module.weight.dtype))
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = shape


def apply_tp(model: nn.Module, mesh: ParallelMesh, *, sequence_parallel: bool = False) -> dict[str, int]:
    """Shard ``model`` (a pipeline stage, usually on the meta device) over mesh's tp group.

    With ``sequence_parallel`` (Megatron-SP) the activations outside attention/MLP (norms,
    residual stream, pipeline sends) are split along the sequence (dim 1): each region starts
    with an all-gather of the sequence (backward: reduce-scatter) and each row-parallel output
    is reduce-scattered instead of all-reduced; same bytes, 1/tp of the norm activations.

    Returns {parameter name: split dim} for the sharded parameters."""
    tp, r, group = mesh.layout.tp, mesh.tp_rank, mesh.group("tp")
    if tp == 1:
        return {}
    if sequence_parallel:
        enter = lambda m, args: (gather_from_sp(args[0], group, 1), *args[1:])  # noqa: E731
        leave = lambda m, args, out: reduce_scatter_to_tp(out, group, 1)  # noqa: E731
    else:
        enter = lambda m, args: (copy_to_tp(args[0], group), *args[1:])  # noqa: E731
        leave = lambda m, args, out: reduce_from_tp(out, group)  # noqa: E731
    split: dict[str, int] = {}
    for lid, block in model.layers.items():
        for region_name, plan in BLOCK_PLAN.items():
            region = getattr(block, region_name)
            region.register_forward_pre_hook(enter)
            for lin_name, style in plan.items():
                lin = getattr(region, lin_name)
                dim = 0 if style == COL else 1
                _shard_weight(lin, dim, tp)
                split[f"layers.{lid}.{region_name}.{lin_name}.weight"] = dim
                if style == ROW:
                    lin.register_forward_hook(leave)
    tied = model.cfg.tie_embeddings
    rows = model.cfg.vocab_size // tp
    if model.tok_emb is not None:
        old = model.tok_emb.weight
        w = nn.Parameter(torch.empty(rows, old.size(1), device=old.device, dtype=old.dtype))
        model.tok_emb = VocabParallelEmbedding(w, r * rows, group, sequence_parallel=sequence_parallel)
        split["tok_emb.weight"] = 0
    if model.lm_head is not None:
        if tied and model.tok_emb is not None:
            model.lm_head.weight = model.tok_emb.weight
        else:
            _shard_weight(model.lm_head, 0, tp)
            split["lm_head.weight"] = 0
        model.lm_head.register_forward_pre_hook(enter)
    return split
