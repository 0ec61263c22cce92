"""Megatron tensor parallelism applied from outside the model, by a plan keyed by module names.

A plan maps ``fnmatch`` patterns of module names to a style:
  region           its input X is copied to the tp group (``copy_to_tp``: identity forward,
                   all-reduce of dX backward); with sequence parallelism, all-gathered along
                   the sequence (dim 1) instead
  colwise          Linear Y = X W^T with W (and the bias) split by output features: rank r
                   computes Y[..., r-th slice]; no communication. A Conv (groups = 1) split by
                   output channels likewise: rank r computes channels r-th slice
  rowwise          Linear Y = X W^T + b with W split by input features: rank r computes its
                   partial X_r W_r^T, one all-reduce sums them (SP: a reduce-scatter along the
                   sequence), and the bias is added once, after the sum. A Conv split by input
                   channels likewise (sum over channel shards of conv(X_r, W_r), then + b)
  channelwise      a per-channel op on a channel-sharded activation, computed locally on the
                   shard: BatchNorm (weight, bias and running statistics split; statistics are
                   per channel), GroupNorm (whole groups per rank: tp | num_groups), depthwise
                   Conv (groups = in = out channels)
  vocab_embedding  Embedding split by vocabulary rows (each rank looks up what it owns)
  vocab_head       output Linear split by vocabulary rows; its input is a region; the loss is
                   then the vocab-parallel cross-entropy (the full logits never exist)
Everything not named stays replicated. For a transformer block (attention and MLP regions,
q/k/v and w1/w3 colwise, wo and w2 rowwise): 2 all-reduces forward and 2 backward per block.
A conv block region -> conv colwise -> BatchNorm channelwise -> ReLU -> conv rowwise is the
same pattern (Megatron's MLP on channels): one all-reduce forward, one backward.
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

STYLES = ("region", "colwise", "rowwise", "channelwise", "vocab_embedding", "vocab_head")
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


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


def _split_size(m: nn.Module, style: str) -> tuple[int, str] | str:
    """(size tp must divide, what it is) for ``style`` on ``m``, or why ``m`` cannot take it."""
    conv = isinstance(m, _CONV)
    if style in ("colwise", "rowwise"):
        if conv and m.groups != 1:
            return (f"a grouped Conv (groups={m.groups}); use 'channelwise' for a depthwise "
                    f"conv, or leave it replicated")
        if conv:
            return ((m.out_channels, "output channels") if style == "colwise"
                    else (m.in_channels, "input channels"))
        if not isinstance(m, nn.Linear):
            return f"a {type(m).__name__}; style {style!r} needs an nn.Linear or nn.Conv"
        return ((m.weight.shape[0], "output features") if style == "colwise"
                else (m.weight.shape[1], "input features"))
    if style == "channelwise":
        from ..batchnorm import is_batchnorm
        if is_batchnorm(m):
            return m.num_features, "channels"
        if isinstance(m, nn.GroupNorm):
            return m.num_groups, "groups"
        if conv and m.groups == m.in_channels == m.out_channels:
            return m.out_channels, "channels"
        return (f"a {type(m).__name__}; 'channelwise' needs a BatchNorm, GroupNorm or depthwise "
                f"Conv (groups = in = out channels)")
    kind = nn.Embedding if style == "vocab_embedding" else nn.Linear
    if not isinstance(m, kind):
        return f"a {type(m).__name__}; style {style!r} needs an nn.{kind.__name__}"
    return m.weight.shape[0], "rows"


def check_plan(model: nn.Module, plan: dict[str, str], tp: int, *, where: str = "model",
               sequence_parallel: bool = False) -> None:
    """Before anything is built: every pattern names a module of the right kind whose split
    dimension ``tp`` divides. Raises ValueError naming the pattern or module.

    Sequence parallelism needs the token stream split where it enters and gathered where it
    leaves: a ``vocab_embedding`` (its sum over tp is reduce-scattered along the sequence) and a
    ``vocab_head`` (a region: it gathers the sequence back). Without them every rank would carry
    the whole stream into the regions, whose all-gather would then repeat it tp times, and the
    norms' gradients, summed over tp as if each rank had seen its part, would count it tp times."""
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"tp_plan of {where}: style {style!r} for {pattern!r} is unknown; "
                             f"valid: {', '.join(STYLES)}")
        names = [n for n in modules if n and fnmatchcase(n, pattern)]
        if not names:
            raise ValueError(f"tp_plan of {where}: {pattern!r} names no module; "
                             f"modules are e.g. {', '.join(list(modules)[1:6])}")
        if style == "region":
            continue
        for n in names:
            m = modules[n]
            got = _split_size(m, style)
            if isinstance(got, str):
                raise ValueError(f"tp_plan of {where}: {n} is {got}")
            if sequence_parallel and tp > 1 and (isinstance(m, _CONV) or style == "channelwise"):
                raise ValueError(f"parallel.sequence_parallel splits activations along dim 1, "
                                 f"which is the channels of {n} ({type(m).__name__}) in {where}; "
                                 f"turn sequence parallelism off for this model")
            size, what = got
            if size % tp:
                valid = ", ".join(str(d) for d in range(1, size + 1) if size % d == 0 and d <= 64)
                raise ValueError(f"parallel.tp={tp} must divide the {size} {what} of {n} "
                                 f"({style}); valid tp: {valid}")
    if sequence_parallel and tp > 1:
        missing = [s for s in ("vocab_embedding", "vocab_head") if s not in plan.values()]
        if missing:
            raise ValueError(f"parallel.sequence_parallel splits the token stream between a "
                             f"vocab-parallel embedding and a vocab-parallel head; the tp_plan of "
                             f"{where} has no {' and no '.join(repr(s) for s in missing)} style, so "
                             f"its stream would enter every rank whole; turn sequence "
                             f"parallelism off for this model")


def _row_forward(lin: nn.Module, leave, x: torch.Tensor) -> torch.Tensor:
    """Row-parallel Linear or Conv: the partial product without bias, summed over tp by
    ``leave``, then the bias once (broadcast over a conv's spatial dims)."""
    if isinstance(lin, _CONV):
        y = leave(lin._conv_forward(x, lin.weight, None))
        return y if lin.bias is None else y + lin.bias.view(1, -1, *([1] * (y.dim() - 2)))
    y = leave(F.linear(x, lin.weight))
    return y if lin.bias is None else y + lin.bias


def _shard_buffer(module: nn.Module, name: str, tp: int) -> None:
    b = module._buffers[name]
    module._buffers[name] = torch.empty(b.shape[0] // tp, *b.shape[1:], device=b.device, dtype=b.dtype)


def _channelwise(module: nn.Module, name: str, tp: int, split: dict[str, int]) -> None:
    """Split a per-channel module's channels (and a GroupNorm's groups) over tp."""
    from ..batchnorm import is_batchnorm
    for pname in ("weight", "bias"):
        if getattr(module, pname, None) is not None:
            _shard(module, pname, 0, tp)
            split[f"{name}.{pname}"] = 0
    if is_batchnorm(module):
        module.num_features //= tp
        for bname in ("running_mean", "running_var"):
            if module._buffers.get(bname) is not None:
                _shard_buffer(module, bname, tp)
                split[f"{name}.{bname}"] = 0
    elif isinstance(module, nn.GroupNorm):
        module.num_groups //= tp
        module.num_channels //= tp
    else:  # depthwise conv
        module.groups //= tp
        module.in_channels //= tp
        module.out_channels //= tp


def apply_tp(model: nn.Module, mesh: ParallelMesh, plan: dict[str, str], *,
             sequence_parallel: bool = False) -> dict[str, int]:
    """Shard ``model`` (a pipeline stage, usually on the meta device) over mesh's tp group by
    ``plan``.

    With ``sequence_parallel`` (Megatron-SP) the activations outside the regions (norms,
    residual stream, pipeline sends) hold 1/tp of the tokens, shaped (B, T/tp, d): a flat run of
    the batch's tokens (``mappings``), which token-wise layers may hold in any split. Each region
    starts with an all-gather of the tokens (backward: reduce-scatter) and each row-parallel
    output is reduce-scattered instead of all-reduced; same bytes, 1/tp of the norm activations.

    Returns {parameter or buffer name: split dim} for the sharded tensors."""
    tp, r, group = mesh.layout.tp, mesh.tp_rank, mesh.group("tp")
    if tp == 1:
        return {}
    if sequence_parallel:
        enter = lambda m, args: (gather_from_sp(args[0], group, 1), *args[1:])  # noqa: E731
        leave = functools.partial(reduce_scatter_to_tp, group=group, dim=1)
    else:
        enter = lambda m, args: (copy_to_tp(args[0], group), *args[1:])  # noqa: E731
        leave = functools.partial(reduce_from_tp, group=group, inplace=True)  # _row_forward's product
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
                if isinstance(module, _CONV):
                    module.out_channels = module.weight.shape[0]
                else:
                    module.out_features = module.weight.shape[0]
            elif style == "rowwise":
                _shard(module, "weight", 1, tp)
                split[f"{name}.weight"] = 1
                if isinstance(module, _CONV):
                    module.in_channels = module.weight.shape[1]
                else:
                    module.in_features = module.weight.shape[1]
                module.forward = functools.partial(_row_forward, module, leave)
            elif style == "channelwise":
                _channelwise(module, name, tp, split)
            elif style == "vocab_embedding":
                old = module.weight
                rows = old.shape[0] // tp
                w = nn.Parameter(torch.empty(rows, old.shape[1], device=old.device, dtype=old.dtype))
                setattr(*owner(model, name), VocabParallelEmbedding(
                    w, r * rows, group, sequence_parallel=sequence_parallel))
                split[f"{name}.weight"] = 0
    return split
