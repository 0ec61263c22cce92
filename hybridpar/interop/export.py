"""``hybridpar export CKPT --out DIR``: the consolidated model of a checkpoint, from any layout.

``hf`` (the default for the built-in Llama): a Hugging Face Llama folder (``config.json`` +
``model.safetensors``), readable with ``safetensors`` or ``transformers`` alone.
``safetensors`` (the default for every other model): ``model.safetensors`` holding the plain
model's state dict under its own module names, BatchNorm statistics included, so that
``model.load_state_dict(safetensors.torch.load_file(...))`` restores it, plus a
``hybridpar.toml`` whose [model] table trains on from it (``--config DIR/hybridpar.toml``)."""
from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

from ..checkpoint import read_full
from ..config import ModelConfig


def model_config(record: dict) -> ModelConfig:
    saved = record["config"]["model"]
    return ModelConfig(**{f.name: saved[f.name] for f in fields(ModelConfig) if f.name in saved})


def export(ckpt: str | os.PathLike, out: str | os.PathLike, fmt: str = "auto") -> tuple[ModelConfig, int]:
    """Write the model of ``ckpt`` into ``out`` as ``fmt`` (hf, safetensors, or auto: hf for
    the built-in Llama, safetensors otherwise); returns (model config, step)."""
    from . import hf
    from ..config import ConfigError

    record, state = read_full(ckpt)
    m = model_config(record)
    llama = m.name == "llama" and not m.spec
    if fmt == "auto":
        fmt = "hf" if llama else "safetensors"
    if fmt == "hf" and not llama:
        raise ConfigError(f"export --format hf writes Hugging Face Llama folders; this checkpoint "
                          f"is of model {m.spec or m.name!r}: use --format safetensors")
    if fmt == "hf":
        hf.write_hf(Path(out), m, state)
    else:
        hf.write_ours(Path(out), m, state)
    from ..engine.tokenizer import BYTE, copy_tokenizer, tokenizer_path
    data = record.get("config", {}).get("data", {})
    tok = tokenizer_path(data.get("tokenizer", ""), m.init_from)
    if tok != BYTE and Path(tok).exists():  # the tokenizer the run trained with goes along
        copy_tokenizer(tok, out)
    return m, int(record["step"])
