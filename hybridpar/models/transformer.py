"""A Llama-style decoder as plain single-device PyTorch: no parallel code in this file.

The engine sees it only through its spec (``hybridpar.models.llama``): units ``tok_emb``,
``layers.0`` .. ``layers.{L-1}``, ``norm``, ``lm_head``, each callable on the previous one's
output, so a pipeline stage is any contiguous run of them and ``forward`` is never needed by
the engine. Layers live in a ModuleDict keyed by their global index so parameter names
(``layers.3.attn.wq.weight``) never depend on the layout.
"""
from __future__ import annotations


import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .fused import fused_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim), in the rotate-half layout of Hugging Face Llama."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class Rotary:
    """The rotary tables, computed on first use per (length, device) and cached: not a buffer,
    so a model built on the meta device needs no re-initialisation and nothing is saved. With
    ``positions`` (context parallelism: the global positions of the local tokens) row i is the
    table of position ``positions[i]``."""

    def __init__(self, head_dim: int, theta: float, positions: torch.Tensor | None = None):
        self.head_dim, self.theta, self.positions = head_dim, theta, positions
        self._cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def at(self, positions: torch.Tensor) -> "Rotary":
        return Rotary(self.head_dim, self.theta, positions)

    def __call__(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (length, str(device))
        if key not in self._cache:
            if self.positions is None:
                self._cache[key] = rope_tables(length, self.head_dim, self.theta, device)
            else:
                if self.positions.numel() != length:
                    raise ValueError(f"{length} local tokens but {self.positions.numel()} positions")
                n = int(self.positions.max()) + 1  # where they live (a meta forward has no values)
                idx = self.positions.to(device)
                cos, sin = rope_tables(n, self.head_dim, self.theta, device)
                self._cache[key] = cos[idx], sin[idx]
        return self._cache[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, H, hd); cos/sin: (T, hd)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[None, :, None, :].to(x.dtype) + rotated * sin[None, :, None, :].to(x.dtype)


_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


class Attention(nn.Module):
    """Grouped-query causal attention. Head counts are read from the weight shapes (``view(-1)``),
    so the same code runs on a tensor-parallel shard holding n_heads/tp and n_kv_heads/tp heads.
    q, k and v are one GEMM on a GPU or under bf16/fp16 autocast (``fused_linear``: three on a
    CPU in fp32) unless ``fused`` is set False (DTensor's tp plans, which hook each Linear's own
    call)."""

    fused = True

    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim, self.rotary = hd, rotary
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd)) v with causal mask; (B, T, H, hd) in and out. kv head j
        serves query heads j*rep .. j*rep+rep-1 (as HF's repeat_kv), inside the kernel
        (``enable_gqa``): no repeated copies of k and v are made or kept for backward."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rep = q.size(1) // k.size(1)
        if rep > 1 and not _SDPA_GQA:  # torch < 2.5: repeat the kv heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        extra = {"enable_gqa": True} if rep > 1 and _SDPA_GQA else {}
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        if self.fused:  # v alone is kept for backward: its own copy frees the fused output
            q, k, v = fused_linear(x, (self.wq, self.wk, self.wv))
            v = v.contiguous()
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q, k, v = (t.reshape(B, T, -1, self.head_dim) for t in (q, k, v))
        cos, sin = self.rotary(T, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.wo(self.core(q, k, v).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 and w3 are one GEMM on a GPU or under bf16/fp16
    autocast (``fused_linear``) unless ``fused`` is False."""

    fused = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = fused_linear(x, (self.w1, self.w3)) if self.fused else (self.w1(x), self.w3(x))
        return self.w2(F.silu(a) * b)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rotary)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab). On a pipeline stage (torch's own pipelining, the
    native benchmark) any part may be None; the forward then takes or returns hidden states."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg, rotary) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(x) if self.tok_emb is not None else x
        for block in self.layers.values():
            if block is not None:
                h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def shard_sequence(model: nn.Module, shard) -> None:
    """Context parallelism (``ModelSpec.context_parallel``): every attention layer attends its
    local tokens to the whole sequence through ``shard.attend`` (causal by global position)
    and rotates q, k by the global positions of its tokens. One shared sharded table."""
    rotaries = {}
    for m in model.modules():
        if isinstance(m, Attention):
            if id(m.rotary) not in rotaries:
                rotaries[id(m.rotary)] = m.rotary.at(shard.positions)
            m.rotary = rotaries[id(m.rotary)]
            m.core = functools.partial(shard.attend, causal=True)


def count_params(cfg: ModelConfig) -> int:
    d, L, hd = cfg.d_model, cfg.n_layers, cfg.head_dim
    per_layer = 2 * d + d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2 + 3 * d * cfg.d_ff
    emb = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return L * per_layer + emb + d
