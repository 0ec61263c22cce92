"""Text generation from a trained or imported model, in one process.

Text is encoded and decoded with the model's tokenizer (a folder's tokenizer.json, e.g. an
imported Hugging Face model's) or, by default, as UTF-8 bytes (invalid sequences replaced). Each new token re-runs the model on the last
``seq_len`` tokens (no KV cache: simple, and the model only knows positions < seq_len).
``temperature`` 0 is greedy; otherwise softmax(logits / temperature) restricted to the
``top_k`` most likely tokens (0 = all), sampled from a seeded generator.
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from ..config import ConfigError, ModelConfig
from ..models.transformer import Transformer
from ..parallel.tensor_parallel.apply import ShardSpec


def load_model(source: str | os.PathLike, *, base: ModelConfig | None = None,
               device: str | torch.device = "cpu") -> Transformer:
    """A single-device model with the weights of ``source`` (anything ``model.init_from``
    accepts). Folders declare their model config; a bare weights file needs ``base``."""
    from . import hf
    from ..models import spec_for
    from ..parallel.parallelize import full_value

    m = hf.source_config(source, base) or base
    if m is None:
        raise ConfigError(f"{source} is a bare weights file and declares no model; pass --config "
                          f"or --model.* fields matching it")
    m = replace(m, init_from=str(source))
    state = hf.open_state(source)
    with torch.device("meta"):
        model = Transformer(m)
    model.to_empty(device=device)
    if m.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    spec = spec_for(m)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full_value(spec, ShardSpec(tuple(p.shape), init_key=name), seed=0,
                               init_state=state, source=str(source)))
    return model.eval()


def encode(text: str, vocab_size: int = 256) -> list[int]:
    if vocab_size < 256:
        raise ConfigError(f"byte-level prompts need model.vocab_size >= 256, got {vocab_size}")
    return list(text.encode("utf-8")) or [ord("\n")]


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def pick(logits: torch.Tensor, *, temperature: float, top_k: int,
         generator: torch.Generator | None = None) -> int:
    """The next token from one position's logits (vocab,)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """Up to ``max_new_tokens`` tokens following ``prompt`` (token ids); stops before
    ``eos_id`` when the model emits it."""
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    window = model.cfg.seq_len
    for _ in range(max_new_tokens):
        x = torch.tensor([ids[-window:]], device=device)
        logits = model(x)[0, -1].cpu()
        nxt = pick(logits, temperature=temperature, top_k=top_k, generator=g)
        if nxt == eos_id:
            break
        ids.append(nxt)
    return ids[len(prompt):]


def complete(source: str | os.PathLike, prompt: str, *, base: ModelConfig | None = None,
             max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, seed: int = 0,
             tokenizer: str = "") -> str:
    """``prompt`` continued by the model at ``source``, as text: encoded and decoded with
    ``tokenizer`` (default: the tokenizer.json of a ``source`` folder, else bytes), stopping
    at its end-of-text token (bytes: never)."""
    from pathlib import Path

    from ..engine.tokenizer import load_tokenizer

    model = load_model(source, base=base)
    folder = str(source) if Path(source).is_dir() else ""
    tok = load_tokenizer(tokenizer, folder, vocab_size=model.cfg.vocab_size)
    if tok.name == "byte":
        ids, eos = encode(prompt, model.cfg.vocab_size), None
    else:
        ids, eos = tok.encode(prompt, special=True) or [tok.eos_id], tok.eos_id
    new = generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_k=top_k, seed=seed, eos_id=eos)
    return tok.decode(new)
