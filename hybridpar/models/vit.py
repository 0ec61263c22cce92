"""A vision transformer (ViT) as plain single-device PyTorch, and its ``ModelSpec``.

images (B, C, H, W) -> patch embedding (a stride-p convolution) + class token + learned
positions -> pre-norm transformer blocks (non-causal multi-head attention, GELU MLP, biases)
-> LayerNorm -> the class token's logits (B, n_classes). Units for the pipeline:
``patch_embed`` | ``blocks.0`` .. ``blocks.{L-1}`` | ``norm``, ``head``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .spec import CROSS_ENTROPY, ModelSpec


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = (cfg.image_size // cfg.patch_size) ** 2
        self.proj = nn.Conv2d(cfg.channels, cfg.d_model, cfg.patch_size, stride=cfg.patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.pos = nn.Parameter(torch.zeros(1, n + 1, cfg.d_model))
        self.shard = None  # context parallelism: keep only this rank's tokens (shard_tokens)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images).flatten(2).transpose(1, 2)  # (B, N, d)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1) + self.pos
        return x if self.shard is None else self.shard.take(self.shard.pad(x))


class Attention(nn.Module):
    """softmax(q k^T / sqrt(hd)) v over all tokens; the head count is read from the weight
    shapes, so a tensor-parallel shard runs n_heads/tp heads through the same code."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(3))
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd)) v over every token; (B, T, H, hd) in and out."""
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return y.transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, -1, self.head_dim) for f in (self.q, self.k, self.v))
        return self.proj(self.core(q, k, v).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(cfg.d_model, cfg.d_ff), nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps), Attention(cfg)
        self.norm2, self.mlp = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ClassToken(nn.Module):
    """The classifier reads the class token: (B, T, d) -> (B, n_classes)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.n_classes)
        self.shard = None  # context parallelism: the class token comes from cp rank 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x[:, 0] if self.shard is None else self.shard.first_token(x))


class ViT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = ClassToken(cfg)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x))


def shard_tokens(model: nn.Module, shard, n_tokens: int) -> None:
    """Context parallelism (``ModelSpec.context_parallel``): every cp rank embeds the whole image
    (cheap) and keeps its contiguous block of the tokens, padded to a multiple of cp; attention
    runs across the cp group with the pads masked (``SequenceShard.padded``); the classifier
    reads the class token from cp rank 0. Each cp rank then computes the same loss, and the
    average over the dp x cp replicas makes the gradient exact (the class token's owner receives
    the sum of every rank's gradient, cp times the true one, divided by cp in the average)."""
    tokens = shard.padded(n_tokens)
    for unit in (model.patch_embed, model.head):
        if unit is not None:  # a pipeline stage holds only some units
            unit.shard = tokens
    for m in model.modules():
        if isinstance(m, Attention):
            # "causal" by mask position: every real key visible, the pads hidden
            m.core = functools.partial(tokens.attend, causal=True)


TP_PLAN = {
    "blocks.*.attn": "region", "blocks.*.attn.[qkv]": "colwise", "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp": "region", "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise",
}


def init_vit(std: float):
    """Truncation-free ViT init: matrices and tokens normal(0, std), biases 0, norms 1."""
    def init(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        leaf = name.rsplit(".", 1)[-1]
        if ".norm" in f".{name}" and leaf == "weight":
            return torch.ones(shape)
        if leaf == "bias":
            return torch.zeros(shape)
        return torch.empty(shape).normal_(0.0, std, generator=g)
    return init


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(correct, count) of one micro-batch: summed over micro-batches and ranks."""
    correct = (logits.argmax(-1) == labels).sum()
    return torch.stack([correct, torch.full_like(correct, labels.numel())]).double()


def vit_spec(cfg: ModelConfig) -> ModelSpec:
    tokens = (cfg.image_size // cfg.patch_size) ** 2 + 1
    d, L = cfg.d_model, cfg.n_layers
    matmul = L * (4 * d * d + 2 * d * cfg.d_ff) * tokens + (tokens - 1) * d * cfg.channels * cfg.patch_size ** 2
    attn = L * 2 * 2 * tokens * tokens * d
    return ModelSpec(
        name="vit",
        build=lambda: ViT(cfg),
        stem=("patch_embed",),
        blocks=tuple(f"blocks.{i}" for i in range(L)),
        head=("norm", "head"),
        loss=CROSS_ENTROPY,
        tp_plan=TP_PLAN,
        init=init_vit(cfg.init_std),
        flops_per_sample=3 * (2 * matmul + attn) + 6 * d * cfg.n_classes,
        data="digits",
        eval_metric=accuracy,
        context_parallel=lambda model, shard: shard_tokens(model, shard, tokens),
        cp_split_batch=False,
    )
