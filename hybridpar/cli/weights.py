"""Subcommands around weights: ``import-hf``, ``export --format hf`` and ``generate``.

Each takes ``argv`` (after the subcommand name) and returns the exit code; ``cli.main``
dispatches to them and turns ``ConfigError`` into one line and exit 2.
"""
from __future__ import annotations

import argparse

from ..config import ConfigError, ModelConfig, load_config


def _base_model(config: str | None, overrides: list[str]) -> ModelConfig | None:
    """The model config given on the command line (needed only for bare weights files)."""
    if not config and not overrides:
        return None
    for item in overrides:
        if not item.startswith("--model."):
            raise ConfigError(f"unknown argument '{item}'; only --model.field=value overrides apply here")
    return load_config(config, overrides).model


def import_hf(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="hybridpar import-hf",
        description="Convert a Hugging Face Llama folder (config.json + safetensors) into a folder "
                    "hybridpar trains from: OUT/model.safetensors (our names) and OUT/hybridpar.toml "
                    "(the [model] table, init_from = OUT). Any layout can then load it.")
    p.add_argument("dir", help="Hugging Face folder (LlamaForCausalLM.save_pretrained)")
    p.add_argument("--out", required=True, help="output folder")
    args = p.parse_args(argv)
    from ..interop import hf

    from ..engine.tokenizer import copy_tokenizer

    m, state = hf.read_hf(args.dir)
    toml = hf.write_ours(args.out, m, state)
    copied = copy_tokenizer(args.dir, args.out)
    print(f"imported {len(state)} tensors"
          + (f" and its tokenizer ({', '.join(copied)}: training and generate use it)" if copied
             else " (no tokenizer files there: training uses bytes)")
          + f"; train with: hybridpar train --config {toml}")
    return 0


def export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="hybridpar export",
        description="Write weights in another format. SRC: a training checkpoint (a step_NNNNNN folder, "
                    "or a checkpoint.dir: its latest; consolidated from any layout), a hybridpar import-hf "
                    "folder, or a .safetensors/.pt file of full tensors (then give --config / --model.* fields).")
    p.add_argument("src")
    p.add_argument("--format", default="auto", choices=["auto", "hf", "safetensors"],
                   help="hf: a Hugging Face Llama folder (config.json + model.safetensors); safetensors: "
                        "the plain model's state dict (load_state_dict) + hybridpar.toml, any model; "
                        "auto (default): hf for the built-in llama, safetensors otherwise")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--config", help="TOML whose [model] table describes SRC (bare files only)")
    args, rest = p.parse_known_args(argv)
    import os

    from ..interop import hf
    from ..checkpoint import store

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"export --out {args.out} is an existing file; give a folder path")
    if store.looks_like_checkpoint(args.src):  # model section from the checkpoint's config
        from ..interop.export import export as export_checkpoint
        m, step = export_checkpoint(args.src, args.out, args.format)
        if args.format == "hf" or (args.format == "auto" and m.name == "llama" and not m.spec):
            print(f"wrote {args.out}/config.json and {args.out}/model.safetensors (step {step}; "
                  f"safetensors.torch.load_file or LlamaForCausalLM.from_pretrained('{args.out}'))")
        else:
            print(f"wrote {args.out}/model.safetensors and {args.out}/hybridpar.toml (step {step}; "
                  f"model.load_state_dict(safetensors.torch.load_file(...)))")
        return 0
    if args.format == "safetensors":
        raise ConfigError("export --format safetensors takes a training checkpoint; "
                          f"{args.src} is not one")
    base = _base_model(args.config, rest)
    m = hf.source_config(args.src, base) or base
    if m is None:
        raise ConfigError(f"{args.src} declares no model config; pass --config or --model.* fields")
    state = hf.open_state(args.src)
    hf.write_hf(args.out, m, {k: state[k] for k in state})
    from ..engine.tokenizer import copy_tokenizer
    if os.path.isdir(args.src):
        copy_tokenizer(args.src, args.out)
    print(f"wrote {args.out}/config.json and {args.out}/model.safetensors "
          f"(LlamaForCausalLM.from_pretrained('{args.out}'))")
    return 0


def generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="hybridpar generate",
        description="Continue a prompt with a model (its own tokenizer, else bytes; one process, CPU). SRC is "
                    "a training checkpoint (a step_NNNNNN folder or a checkpoint.dir: its latest) or "
                    "anything --model.init_from accepts (an import-hf folder, a Hugging Face folder, "
                    "or a weights file with --config).")
    p.add_argument("src")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely; 0 = all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="", help="'byte' or a tokenizer.json (or its folder); "
                                                   "default: SRC's own tokenizer, else bytes")
    p.add_argument("--config", help="TOML whose [model] table describes SRC (bare files only)")
    args, rest = p.parse_known_args(argv)
    import math
    import tempfile

    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature} must be a finite number >= 0 (0 = greedy)")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} must be at least 1")
    if args.top_k < 0:
        raise ConfigError(f"--top-k {args.top_k} must be >= 0 (0 = all)")
    if any(0xDC80 <= ord(ch) <= 0xDCFF for ch in args.prompt):  # undecodable bytes from argv
        raise ConfigError("--prompt is not valid UTF-8 text; pass UTF-8")
    from ..checkpoint import store
    from ..interop.export import export as export_checkpoint
    from ..interop.generate import complete

    with tempfile.TemporaryDirectory(prefix="hybridpar-generate-") as tmp:
        src = args.src
        if store.looks_like_checkpoint(src):  # consolidate the shards of any layout first
            export_checkpoint(src, tmp, "hf")
            src = tmp
        text = complete(src, args.prompt, base=_base_model(args.config, rest),
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, seed=args.seed, tokenizer=args.tokenizer)
    print(args.prompt + text)
    return 0


COMMANDS = {
    "import-hf": (import_hf, "convert a Hugging Face Llama folder into a folder hybridpar trains from"),
    "export": (export, "write a checkpoint's model: a Hugging Face Llama folder, or any model's "
                       "state dict as safetensors"),
    "generate": (generate, "continue a --prompt with a model (byte-level)"),
}
