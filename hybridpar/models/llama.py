"""The built-in Llama as a ``ModelSpec``: the only place that names its modules for the engine."""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from .transformer import Transformer, shard_sequence
from .spec import CROSS_ENTROPY, ModelSpec

# Megatron's plan per block: q, k, v, w1, w3 split by output features (heads / hidden units),
# wo and w2 by input features with one all-reduce each; attn and mlp are the regions whose
# input is copied to the tp group. Embedding and head are split by vocabulary rows.
TP_PLAN = {
    "tok_emb": "vocab_embedding",
    "layers.*.attn": "region", "layers.*.mlp": "region",
    "layers.*.attn.w[qkv]": "colwise", "layers.*.attn.wo": "rowwise",
    "layers.*.mlp.w[13]": "colwise", "layers.*.mlp.w2": "rowwise",
    "lm_head": "vocab_head",
}


def init_std(cfg: ModelConfig, name: str) -> float | None:
    """Initialisation of a parameter by name: None = ones (norms), else normal(0, std).

    Output projections of each residual branch are scaled by 1/sqrt(2 n_layers) (GPT-2)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("attn.wo.weight", "mlp.w2.weight")):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def matmul_params(m: ModelConfig) -> int:
    """Weights that multiply activations: every linear including the output head, not the
    embedding lookup."""
    hd = m.head_dim
    per_layer = m.d_model * hd * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.d_ff
    return m.n_layers * per_layer + m.vocab_size * m.d_model


def flops_per_token(m: ModelConfig) -> float:
    """Model FLOPs per token (PaLM appendix B; forward + backward, recomputation not counted,
    as MFU is defined): 6 N_matmul + 12 n_layers d_attn seq_len, d_attn = n_heads head_dim."""
    return 6.0 * matmul_params(m) + 12.0 * m.n_layers * m.n_heads * m.head_dim * m.seq_len


def llama_spec(cfg: ModelConfig) -> ModelSpec:
    def init(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        std = init_std(cfg, name)
        return torch.ones(shape) if std is None else torch.empty(shape).normal_(0.0, std, generator=g)

    return ModelSpec(
        name="llama",
        build=lambda: Transformer(cfg),
        stem=("tok_emb",),
        blocks=tuple(f"layers.{i}" for i in range(cfg.n_layers)),
        head=("norm", "lm_head"),
        loss=CROSS_ENTROPY,
        tp_plan=TP_PLAN,
        tied=(("tok_emb.weight", "lm_head.weight"),) if cfg.tie_embeddings else (),
        init=init,
        selective_recompute=("layers.*.attn:core",),
        check=None,  # tp vs heads/d_ff/vocab: config.validate, before any process starts
        flops_per_sample=flops_per_token(cfg) * cfg.seq_len,
        context_parallel=shard_sequence,
    )
