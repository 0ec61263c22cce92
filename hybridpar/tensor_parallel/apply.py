"""Megatron tensor parallelism applied from outside the model, by a plan keyed by module names.

A plan maps ``fnmatch`` patterns of module names to a style:
  region           its input X is copied to the tp group (``copy_to_tp``: identity forward,
                   all-reduce of dX backward); with sequence parallelism, all-gathered along
                   the sequence (dim 1) instead
  colwise          Linear Y = X W^T with W (and the bias) split by output features: rank r
                   computes Y[..., r-th slice]; no communication
  rowwise          Linear Y = X W^T + b with W split by input features: rank r computes its
                   partial X_r W_r^T, one all-reduce sums them (SP: a reduce-scatter along the
                   sequence), and the bias is added once, after the sum
  vocab_embedding  Embedding split by vocabulary rows (each rank looks up what it owns)
  vocab_head       output Linear split by vocabulary rows; its input is a region; the loss is
                   then the vocab-parallel cross-entropy (the full logits never exist)
Everything not named stays replicated. For a transformer block (attention and MLP regions,
q/k/v and w1/w3 colwise, wo and w2 rowwise): 2 all-reduces forward and 2 backward per block.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh import ParallelMesh
from .layers import VocabParallelEmbedding
from .mappings import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_tp

STYLES = ("region", "colwise", "rowwise", "vocab_embedding", "vocab_head")


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


def _shard(module: nn.Module, name: str, dim: int, tp: int) -> None:
    t = getattr(module, name)
    shape = list(t.shape)
    shape[dim] //= tp
    setattr(module, name, nn.Parameter(torch.empty(shape, device=t.device, dtype=t.dtype)))


def owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding ``name`` (a dotted module or parameter name) and the last part."""
    parent, _, leaf = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), leaf


def style_of(plan: dict[str, str], name: str) -> list[str]:
    return [style for pattern, style in plan.items() if fnmatchcase(name, pattern)]


def check_plan(model: nn.Module, plan: dict[str, str], tp: int, *, where: str = "model") -> None:
    """Before anything is built: every pattern names a module of the right kind whose split
    dimension ``tp`` divides. Raises ValueError naming the pattern or module."""
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"tp_plan of {where}: style {style!r} for {pattern!r} is unknown; "
                             f"valid: {', '.join(STYLES)}")
        names = [n for n in modules if n and fnmatchcase(n, pattern)]
        if not names:
            raise ValueError(f"tp_plan of {where}: {pattern!r} names no module; "
                             f"modules are e.g. {', '.join(list(modules)[1:6])}")
        for n in names:
            m = modules[n]
            kind = nn.Embedding if style == "vocab_embedding" else nn.Linear
            if style != "region" and not isinstance(m, kind):
                raise ValueError(f"tp_plan of {where}: {n} is a {type(m).__name__}, "
                                 f"style {style!r} needs an nn.{kind.__name__}")
            if style in ("colwise", "vocab_head", "vocab_embedding"):
                size, what = m.weight.shape[0], "output features" if style == "colwise" else "rows"
            elif style == "rowwise":
                size, what = m.weight.shape[1], "input features"
            else:
                continue
            if size % tp:
                valid = ", ".join(str(d) for d in range(1, size + 1) if size % d == 0 and d <= 64)
                raise ValueError(f"parallel.tp={tp} must divide the {size} {what} of {n} "
                                 f"({style}); valid tp: {valid}")


def _row_forward(lin: nn.Linear, leave, x: torch.Tensor) -> torch.Tensor:
    y = leave(F.linear(x, lin.weight))
    return y if lin.bias is None else y + lin.bias


def apply_tp(model: nn.Module, mesh: ParallelMesh, plan: dict[str, str], *,
             sequence_parallel: bool = False) -> dict[str, int]:
    """Shard ``model`` (a pipeline stage, usually on the meta device) over mesh's tp group by
    ``plan``.

    With ``sequence_parallel`` (Megatron-SP) the activations outside the regions (norms,
    residual stream, pipeline sends) are split along the sequence (dim 1): each region starts
    with an all-gather of the sequence (backward: reduce-scatter) and each row-parallel output
    is reduce-scattered instead of all-reduced; same bytes, 1/tp of the norm activations.

    Returns {parameter name: split dim} for the sharded parameters."""
    tp, r, group = mesh.layout.tp, mesh.tp_rank, mesh.group("tp")
    if tp == 1:
        return {}
    if sequence_parallel:
        enter = lambda m, args: (gather_from_sp(args[0], group, 1), *args[1:])  # noqa: E731
        leave = functools.partial(reduce_scatter_to_tp, group=group, dim=1)
    else:
        enter = lambda m, args: (copy_to_tp(args[0], group), *args[1:])  # noqa: E731
        leave = functools.partial(reduce_from_tp, group=group)
    split: dict[str, int] = {}
    for name, module in list(model.named_modules()):
        for style in style_of(plan, name):
            if style in ("region", "vocab_head"):
                module.register_forward_pre_hook(enter)
            if style in ("colwise", "vocab_head"):
                for pname in ("weight", "bias"):
                    if getattr(module, pname, None) is not None:
                        _shard(module, pname, 0, tp)
                        split[f"{name}.{pname}"] = 0
                module.out_features = module.weight.shape[0]
            elif style == "rowwise":
                _shard(module, "weight", 1, tp)
                split[f"{name}.weight"] = 1
                module.in_features = module.weight.shape[1]
                module.forward = functools.partial(_row_forward, module, leave)
            elif style == "vocab_embedding":
                old = module.weight
                rows = old.shape[0] // tp
                w = nn.Parameter(torch.empty(rows, old.shape[1], device=old.device, dtype=old.dtype))
                setattr(*owner(model, name), VocabParallelEmbedding(
                    w, r * rows, group, sequence_parallel=sequence_parallel))
                split[f"{name}.weight"] = 0
    return split
