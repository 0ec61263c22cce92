"""Models described to the engine by a ``ModelSpec`` (``spec.py``); ``spec_for`` picks the one
a config names."""
from __future__ import annotations

from ..config import ModelConfig
from .spec import CROSS_ENTROPY, ModelSpec

__all__ = ["ModelSpec", "CROSS_ENTROPY", "spec_for"]


def spec_for(m: ModelConfig) -> ModelSpec:
    from .llama import llama_spec

    return llama_spec(m)
