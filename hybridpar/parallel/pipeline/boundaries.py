"""What crosses each pipeline boundary: shapes and dtypes inferred once, without side effects.

The spec's model is built on the meta device and each virtual stage's units are run in order on
meta tensors shaped like one micro-batch's inputs: no memory, no computation, no collective,
and no real module runs (a warm-up forward on real modules would, e.g., update BatchNorm
statistics). A boundary may carry a tensor or a tuple of tensors, of different shapes per
boundary (a CNN's feature maps shrink stage by stage; a tuple can carry a skip connection).
Under sequence parallelism every floating tensor crossing a boundary holds 1/tp of the tokens
(its dim 1 divided by tp; ``tensor_parallel.mappings``).
Only floating tensors carry gradients back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TensorMeta", "Boundary", "infer_boundaries", "as_tuple", "check_boundary"]


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def has_grad(self) -> bool:
        """Floating tensors get a gradient sent back across the boundary; others do not."""
        return self.dtype.is_floating_point

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


Boundary = tuple[TensorMeta, ...]


def as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _meta(x) -> tuple:
    return tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in as_tuple(x))


def infer_boundaries(build, stage_units: list[list[str]], example_inputs, *,
                     seq_shards: int = 1) -> list[Boundary]:
    """The output of every virtual stage but the last, for inputs shaped like
    ``example_inputs`` (a tensor or tuple: one micro-batch). ``build`` makes the full model
    (called under the meta device); ``seq_shards`` = tp under sequence parallelism."""
    from ..parallelize import Stage  # the very class that runs the units for real

    with torch.device("meta"):
        model = build()
    xs, out = _meta(example_inputs), []
    with torch.no_grad():
        for units in stage_units[:-1]:
            xs = as_tuple(Stage(model, units, device_type="meta")(*xs))
            metas = []
            for t in xs:
                shape = list(t.shape)
                if seq_shards > 1 and t.dtype.is_floating_point:
                    if len(shape) < 2 or shape[1] % seq_shards:
                        raise ValueError(f"sequence parallelism splits boundary tensors along "
                                         f"dim 1: {tuple(shape)} is not divisible by tp={seq_shards}")
                    shape[1] //= seq_shards
                metas.append(TensorMeta(tuple(shape), t.dtype))
            out.append(tuple(metas))
    return out


def check_boundary(v: int, got: tuple, want: Boundary) -> None:
    """The first real micro-batch against the inferred boundary: a clear error, not a hang or
    a silently mis-shaped receive."""
    have = tuple(TensorMeta(tuple(t.shape), t.dtype) for t in got)
    if have != want:
        raise ValueError(
            f"pipeline boundary after virtual stage {v}: the stage returned "
            f"[{', '.join(map(str, have))}] but the meta-device forward inferred "
            f"[{', '.join(map(str, want))}]; a stage's output must depend only on its input "
            f"shapes (the same every micro-batch) and the model must run on the meta device")
