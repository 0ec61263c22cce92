"""Hugging Face Llama interop: our full (unsharded) state dict <-> ``LlamaForCausalLM``'s.

Only names change, never values: our model computes exactly HF Llama's function (RMSNorm,
SwiGLU, grouped-query attention with HF's ``repeat_kv`` head order, and RoPE in HF's
rotate-half layout: q/k features i and i + head_dim/2 form a rotation pair), so the q/k
weights need no permutation (the permutation Meta's original checkpoints need is applied by
HF's own converter before they become HF checkpoints). ``tests/test_hf.py`` checks logits.

Also here: reading the weights that ``model.init_from`` names, lazily, one tensor at a time:
  * a Hugging Face folder: ``config.json`` + ``model.safetensors`` (or a sharded
    ``model.safetensors.index.json``);
  * a folder written by ``hybridpar import-hf``: ``hybridpar.toml`` + ``model.safetensors``
    with our names;
  * a single ``.safetensors`` or ``.pt`` file of full tensors under our names.
Needs ``safetensors`` for safetensors files (``pip install 'hybridpar[hf]'``); ``transformers``
is never needed here.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import fields, replace
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig

# ours -> HF, per layer (prefix layers.{i}. <-> model.layers.{i}.)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}
_HF_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_HF_TOP = {v: k for k, v in _TOP_NAMES.items()}
# fields of ModelConfig that decide the weights' shapes and the function they compute
ARCH_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
               "tie_embeddings", "rope_theta", "norm_eps")
MAX_IMPORTED_SEQ_LEN = 2048  # seq_len is a training choice: HF's 128k context is not a default
OUR_CONFIG = "hybridpar.toml"
OUR_WEIGHTS = "model.safetensors"


def hf_name(name: str) -> str:
    """``layers.3.attn.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{_LAYER_NAMES[rest]}"


def our_name(name: str) -> str:
    if name in _HF_TOP:
        return _HF_TOP[name]
    if not name.startswith("model.layers."):
        raise KeyError(f"{name} is not a Llama weight this model has")
    _, _, i, rest = name.split(".", 3)
    if rest not in _HF_LAYER:
        raise KeyError(f"{name} is not a Llama weight this model has (biases are not supported)")
    return f"layers.{i}.{_HF_LAYER[rest]}"


def to_hf(state: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full state dict -> HF's. Tied models have no ``lm_head.weight`` (as HF saves them)."""
    return {hf_name(k): v for k, v in state.items() if not (m.tie_embeddings and k == "lm_head.weight")}


def from_hf(state: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """HF's state dict -> ours (the same tensors); ``rotary_emb.inv_freq`` buffers are dropped."""
    out = {}
    for k, v in state.items():
        if k.endswith("rotary_emb.inv_freq") or (m.tie_embeddings and k == "lm_head.weight"):
            continue
        out[our_name(k)] = v
    return out


def config_to_hf(m: ModelConfig) -> dict:
    """config.json of the equivalent ``LlamaForCausalLM`` (readable by transformers 4.x and 5.x)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim,
        "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "pretraining_tp": 1, "use_cache": True, "torch_dtype": "float32",
    }


def config_from_hf(d: dict, *, where: str = "config.json", base: ModelConfig | None = None) -> ModelConfig:
    """The ModelConfig computing the same function as HF config ``d``; one-line error otherwise."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ConfigError(f"{where}: {what}; hybridpar imports plain Llama models only")

    need(d.get("model_type", "llama") == "llama", f"model_type={d.get('model_type')!r} is not 'llama'")
    need(d.get("hidden_act", "silu") == "silu", f"hidden_act={d.get('hidden_act')!r} is not 'silu'")
    need(not d.get("attention_bias") and not d.get("mlp_bias"), "attention_bias/mlp_bias are set")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    need(kind == "default", f"rope type {kind!r} (RoPE scaling) is not supported")
    heads = d["num_attention_heads"]
    hd = d.get("head_dim") or d["hidden_size"] // heads
    need(hd * heads == d["hidden_size"], f"head_dim={hd} * num_attention_heads={heads} != hidden_size")
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    return replace(
        base or ModelConfig(), n_layers=d["num_hidden_layers"], d_model=d["hidden_size"],
        n_heads=heads, n_kv_heads=d.get("num_key_value_heads") or heads, d_ff=d["intermediate_size"],
        vocab_size=d["vocab_size"], seq_len=min(d.get("max_position_embeddings", 2048), MAX_IMPORTED_SEQ_LEN),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)), rope_theta=float(theta),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)), init_std=float(d.get("initializer_range", 0.02)))


class LazyState(Mapping):
    """Name -> tensor, read from safetensors files only when asked (one full tensor at a time)."""

    def __init__(self, where: dict[str, tuple[Path, str]]):
        self._where = where  # our name -> (file, name in that file)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        path, key = self._where[name]
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)

    def __contains__(self, name: object) -> bool:  # without reading the tensor
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _need_safetensors(path: Path) -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ConfigError(f"reading or writing {path} needs the safetensors package: "
                          f"pip install 'hybridpar[hf]'") from None


def _names_in(path: Path) -> dict[str, Path]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return {k: path for k in f.keys()}


def _hf_files(folder: Path) -> dict[str, Path]:
    """{tensor name: file} of a HF folder, single-file or sharded."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: folder / v for k, v in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise ConfigError(f"{folder} has no model.safetensors or model.safetensors.index.json; "
                          f"save the model with save_pretrained(..., safe_serialization=True)")
    return _names_in(single)


def read_hf_config(folder: str | os.PathLike, base: ModelConfig | None = None) -> ModelConfig:
    path = Path(folder, "config.json")
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return config_from_hf(d, where=str(path), base=base)


def read_hf(folder: str | os.PathLike, base: ModelConfig | None = None) -> tuple[ModelConfig, LazyState]:
    """A HF Llama folder as (our ModelConfig, lazy full state dict under our names)."""
    folder = Path(folder)
    m = read_hf_config(folder, base)
    _need_safetensors(folder)
    where = {}
    for key, path in _hf_files(folder).items():
        if key.endswith("rotary_emb.inv_freq") or (m.tie_embeddings and key == "lm_head.weight"):
            continue
        try:
            where[our_name(key)] = (path, key)
        except KeyError as e:
            raise ConfigError(f"{folder}: {e.args[0]}") from None
    return m, LazyState(where)


def write_hf(folder: str | os.PathLike, m: ModelConfig, state: Mapping[str, torch.Tensor]) -> None:
    """Write config.json + model.safetensors that ``LlamaForCausalLM.from_pretrained`` loads."""
    _need_safetensors(Path(folder))
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in to_hf(state, m).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_to_hf(m), indent=2) + "\n")


def model_toml(m: ModelConfig) -> str:
    """A ``[model]`` TOML table with every field of ``m`` (init_from included)."""
    lines = ["[model]"]
    for f in fields(m):
        v = getattr(m, f.name)
        lines.append(f"{f.name} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}")
    return "\n".join(lines) + "\n"


def write_ours(folder: str | os.PathLike, m: ModelConfig, state: Mapping[str, torch.Tensor]) -> Path:
    """A folder that ``--config FOLDER/hybridpar.toml`` trains from: the [model] table (with
    init_from pointing at the folder) and model.safetensors under our names."""
    folder = Path(folder).resolve()
    _need_safetensors(folder)
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, str(folder / OUR_WEIGHTS), metadata={"format": "pt"})
    (folder / OUR_CONFIG).write_text(model_toml(replace(m, init_from=str(folder))))
    return folder / OUR_CONFIG


def read_ours_config(folder: str | os.PathLike) -> ModelConfig:
    from ..config import load_config
    return load_config(str(Path(folder, OUR_CONFIG))).model


def source_kind(path: str | os.PathLike) -> str:
    """'hf', 'ours' (an import-hf folder), 'safetensors' or 'pt'; ConfigError otherwise."""
    p = Path(path)
    if p.is_dir():
        if (p / "config.json").exists():
            return "hf"
        if (p / OUR_CONFIG).exists():
            return "ours"
        raise ConfigError(f"{p} has neither config.json (Hugging Face) nor {OUR_CONFIG} (hybridpar import-hf)")
    if p.suffix == ".safetensors" and p.exists():
        return "safetensors"
    if p.suffix in (".pt", ".pth") and p.exists():
        return "pt"
    if not p.exists():
        raise ConfigError(f"{p} does not exist")
    raise ConfigError(f"{p}: expected a folder, a .safetensors or a .pt file")


def source_config(path: str | os.PathLike, base: ModelConfig | None = None) -> ModelConfig | None:
    """The ModelConfig a weights source declares (None for bare files, which declare none)."""
    kind = source_kind(path)
    if kind == "hf":
        return read_hf_config(path, base)
    if kind == "ours":
        return replace(read_ours_config(path), init_from=(base or ModelConfig()).init_from)
    return None


def check_matches(m: ModelConfig, path: str | os.PathLike) -> None:
    """ConfigError naming the first architecture field where ``m`` and the source differ."""
    try:
        declared = source_config(path)
    except ConfigError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    if declared is None:
        return
    fix = (f"train with --config {Path(path, OUR_CONFIG)}" if source_kind(path) == "ours" else
           f"hybridpar import-hf {path} --out DIR writes DIR/{OUR_CONFIG} to train with --config")
    for name in ARCH_FIELDS:
        if getattr(m, name) != getattr(declared, name):
            raise ConfigError(f"model.{name}={getattr(m, name)!r} but model.init_from={path} has "
                              f"{name}={getattr(declared, name)!r}; set the model fields to match ({fix})")


def open_state(path: str | os.PathLike) -> Mapping[str, torch.Tensor]:
    """The full tensors under our names, from any source ``source_kind`` accepts."""
    kind, p = source_kind(path), Path(path)
    if kind == "hf":
        return read_hf(p)[1]
    if kind == "pt":
        return torch.load(p, map_location="cpu", mmap=True, weights_only=True)
    file = p / OUR_WEIGHTS if kind == "ours" else p
    _need_safetensors(file)
    return LazyState({k: (f, k) for k, f in _names_in(file).items()})


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A single-process model's full state dict under our names (tied: no lm_head.weight)."""
    return {k: v.detach() for k, v in model.named_parameters()}
