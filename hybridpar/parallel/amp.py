"""Dynamic loss scaling for fp16 compute (bf16 has fp32's range and needs none).

The loss is multiplied by ``scale`` so small fp16 gradients do not flush to zero; gradients are
divided by it before use (a power of two: exact). A step whose gradients overflowed is skipped
and the scale halved; after ``growth_interval`` clean steps it doubles again.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 2.0 ** 16
    growth_interval: int = 200
    min_scale: float = 1.0
    clean_steps: int = 0

    def update(self, grads_finite: bool) -> bool:
        """Record a step's outcome; returns whether the optimizer step may run."""
        if not grads_finite:
            self.scale = max(self.min_scale, self.scale / 2)
            self.clean_steps = 0
            return False
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2
        return True

