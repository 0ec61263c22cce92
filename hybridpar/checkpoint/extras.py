"""The small, non-tensor part of a checkpoint: step, config, loss scaler, RNG states, and the
check that a checkpoint belongs to this model.

The step is the whole data and LR position (the batch of step k is a function of (data, seed,
k, global batch); the LR is a function of k), so it carries over to any dp degree.
"""
from __future__ import annotations

import base64
import json
import random
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from ..config import Config, ModelConfig
from .store import CheckpointError

TRAINER = "trainer.json"
RNG = "rng.json"
# model fields that change the function computed even when every shape agrees
_FUNCTION_FIELDS = ("tie_embeddings", "rope_theta", "norm_eps", "n_heads", "n_kv_heads")


def trainer_record(trainer) -> dict:
    p = trainer.cfg.parallel
    scaler = trainer.scaler
    return {"step": trainer.step, "skips": trainer.skips,
            "scaler": None if scaler is None else {"scale": scaler.scale, "clean_steps": scaler.clean_steps},
            "layout": {"dp": p.dp, "tp": p.tp, "pp": p.pp, "order": p.order},
            "torch": torch.__version__, "config": trainer.cfg.to_dict()}


def apply_record(trainer, record: dict) -> None:
    trainer.step = int(record["step"])
    trainer.skips = int(record.get("skips", 0))
    if trainer.scaler is not None and record.get("scaler"):
        trainer.scaler.scale = float(record["scaler"]["scale"])
        trainer.scaler.clean_steps = int(record["scaler"]["clean_steps"])


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def rng_state() -> dict:
    """This process's torch, numpy and python RNG states as JSON-able values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    out = {"torch": _b64(torch.get_rng_state().numpy().tobytes()),
           "numpy": [kind, _b64(keys.astype(np.uint32).tobytes()), int(pos), int(has_gauss), float(cached)],
           "python": [version, list(internal), gauss_next]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = _b64(torch.cuda.get_rng_state().numpy().tobytes())
    return out


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(s["torch"])), dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = s["numpy"]
    np.random.set_state((kind, np.frombuffer(base64.b64decode(keys), dtype=np.uint32).copy(),
                         pos, has_gauss, cached))
    version, internal, gauss_next = s["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(s["cuda"])), dtype=torch.uint8))


def pick_rng(states: list[dict], record: dict, cfg: Config, rank: int) -> dict:
    """Each rank's own state when the layout is unchanged; otherwise rank 0's on every rank
    (per-rank streams of another layout have no counterpart; training draws no random
    numbers after initialisation, so only user code would notice)."""
    p = cfg.parallel
    same = record.get("layout") == {"dp": p.dp, "tp": p.tp, "pp": p.pp, "order": p.order}
    return states[rank] if same and rank < len(states) else states[0]


def read_json(folder: Path, name: str) -> dict | list:
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder}: {name} is unreadable ({e})") from None


def _shape(s) -> str:
    return "(" + ", ".join(map(str, s)) + ")"


def check_model(folder: Path, m: ModelConfig, saved_shapes: dict[str, tuple], record: dict) -> None:
    """Refuse a checkpoint of another model, naming the tensors whose shapes differ and the
    model fields that differ."""
    from .state import full_shapes

    want = full_shapes(m)
    have = {k: tuple(v) for k, v in saved_shapes.items() if k.startswith("model/")}
    problems = []
    for key in sorted(want.keys() | have.keys()):
        a, b = have.get(key), want.get(key)
        if a != b:
            name = key[len("model/"):]
            problems.append(f"{name} {_shape(a) if a else 'absent'} in the checkpoint vs "
                            f"{_shape(b) if b else 'absent'} here")
    saved = record.get("config", {}).get("model", {})
    differ = [f"model.{f.name}={saved[f.name]!r} there, {getattr(m, f.name)!r} here"
              for f in fields(m) if f.name in saved and saved[f.name] != getattr(m, f.name)
              and (f.name in _FUNCTION_FIELDS or problems)
              and f.name not in ("init_from", "init_std", "seq_len")]
    if not problems and not differ:
        return
    shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
    what = f"shapes differ: {shown}" if problems else "the model differs"
    raise CheckpointError(f"checkpoint {folder} is of another model"
                          + (f" ({', '.join(differ)})" if differ else "")
                          + f": {what}; set the [model] fields to the checkpoint's (its trainer.json)")
