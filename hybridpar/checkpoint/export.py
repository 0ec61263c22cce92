"""``hybridpar export CKPT --out DIR``: the consolidated model of a checkpoint as a Hugging
Face Llama folder (``config.json`` + ``model.safetensors``), readable with ``safetensors`` or
``transformers`` alone."""
from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

from ..config import ModelConfig
from .core import read_full


def model_config(record: dict) -> ModelConfig:
    saved = record["config"]["model"]
    return ModelConfig(**{f.name: saved[f.name] for f in fields(ModelConfig) if f.name in saved})


def export(ckpt: str | os.PathLike, out: str | os.PathLike) -> tuple[ModelConfig, int]:
    """Write ``out/config.json`` and ``out/model.safetensors``; returns (model config, step)."""
    from .. import hf

    record, state = read_full(ckpt)
    m = model_config(record)
    hf.write_hf(Path(out), m, state)
    return m, int(record["step"])
