"""``hybridpar`` command line: ``hybridpar train [--config F] [--dp N ...] [--section.field=value ...]``."""
from __future__ import annotations

import argparse
import difflib
import sys

from .config import Config, ConfigError, describe_fields, load_config, validate

# shortcut flag -> (section, field)
SHORTCUTS = {
    "dp": ("parallel", "dp"), "tp": ("parallel", "tp"), "pp": ("parallel", "pp"),
    "microbatches": ("parallel", "microbatches"), "schedule": ("parallel", "schedule"),
    "steps": ("train", "steps"), "seed": ("train", "seed"),
    "global_batch": ("train", "global_batch"), "metrics": ("train", "metrics"),
}


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybridpar train",
        description="Train the Llama-style LM with dp x tp x pp parallelism.",
        epilog="Any config field can be set as --section.field=value:\n" + describe_fields(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML file with [model], [parallel], [train], [data] tables")
    for flag in SHORTCUTS:
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, default=None,
                       help=f"= --{'.'.join(SHORTCUTS[flag])}")
    return p


def parse_train_args(argv: list[str]) -> Config:
    parser = _train_parser()
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for item in rest:
        if item.startswith("--") and "." in item.split("=")[0]:
            overrides.append(item)
            continue
        known = ["--" + f.replace("_", "-") for f in SHORTCUTS] + ["--config"]
        close = difflib.get_close_matches(item.split("=")[0], known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else \
            " (config fields are set as --section.field=value; see hybridpar train --help)"
        raise ConfigError(f"unknown argument '{item}'{hint}")
    for flag, (section, name) in SHORTCUTS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"--{section}.{name}={value}")
    return load_config(args.config, overrides)


def _train_worker(cfg: Config) -> dict | None:
    from .launch import setup, teardown
    from .train import train

    mesh = setup(cfg)
    try:
        history = train(cfg, mesh)
    finally:
        teardown()
    return history[-1] if history and mesh.rank == 0 else None


def run_train(cfg: Config) -> dict | None:
    """Join the torchrun job we are in, or spawn dp*tp*pp local ranks."""
    from .launch import spawn, under_launcher

    if under_launcher() or cfg.parallel.world_size == 1:
        return _train_worker(cfg)
    validate(cfg)
    return spawn(_train_worker, cfg.parallel.world_size, cfg).get(0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": "train a model (default: the embedded stdlib corpus)"}
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hybridpar COMMAND [options]\n\ncommands:")
        for name, desc in commands.items():
            print(f"  {name:10s} {desc}")
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "train":
            cfg = parse_train_args(rest)
            validate(cfg)
            last = run_train(cfg)
            if last:
                print(f"done: step {last['step']} loss {last['loss']:.4f}"
                      + (f" val_loss {last['val_loss']:.4f}" if "val_loss" in last else ""))
            return 0
        close = difflib.get_close_matches(cmd, list(commands), n=1)
        raise ConfigError(f"unknown command '{cmd}'" + (f"; did you mean '{close[0]}'?" if close else
                                                         f"; commands: {', '.join(commands)}"))
    except ConfigError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
