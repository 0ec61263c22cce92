"""``hybridpar`` command line: ``hybridpar train [--config F] [--dp N ...] [--section.field=value ...]``."""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

from ..config import Config, ConfigError, describe_fields, load_config, validate
from ..reliability.errors import EXIT_FAILED, EXIT_USER, HybridparError, UserError

# shortcut flag -> (section, field)
SHORTCUTS = {
    "dp": ("parallel", "dp"), "cp": ("parallel", "cp"), "tp": ("parallel", "tp"),
    "pp": ("parallel", "pp"),
    "microbatches": ("parallel", "microbatches"), "schedule": ("parallel", "schedule"),
    "steps": ("train", "steps"), "seed": ("train", "seed"),
    "global_batch": ("train", "global_batch"), "metrics": ("train", "metrics"),
    "trace": ("train", "trace"),
}


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybridpar train",
        description="Train a model with dp x cp x tp x pp parallelism.",
        epilog="Any config field can be set as --section.field=value:\n" + describe_fields(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML file with [model], [parallel], [train], [data] tables")
    for flag in SHORTCUTS:
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, default=None,
                       help=f"= --{'.'.join(SHORTCUTS[flag])}")
    p.add_argument("--resume", nargs="?", const="true", choices=("true", "auto"),
                   help="= --checkpoint.resume=true: continue from checkpoint.dir's latest "
                        "checkpoint (an error if there is none); --resume=auto: continue if there "
                        "is one, else say so and start a new run (for job scripts that always pass it)")
    return p


def parse_train_args(argv: list[str]) -> Config:
    parser = _train_parser()
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for item in rest:
        if item.startswith("--") and "." in item.split("=")[0]:
            overrides.append(item)
            continue
        known = ["--" + f.replace("_", "-") for f in SHORTCUTS] + ["--config", "--resume"]
        close = difflib.get_close_matches(item.split("=")[0], known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else \
            " (config fields are set as --section.field=value; see hybridpar train --help)"
        raise ConfigError(f"unknown argument '{item}'{hint}")
    for flag, (section, name) in SHORTCUTS.items():
        value = getattr(args, flag)
        if value is not None:
            # one rule, no silent winner: a field is set once on the command line
            if any(o.split("=", 1)[0] == f"--{section}.{name}" for o in overrides):
                raise ConfigError(f"--{flag.replace('_', '-')} and --{section}.{name} both set "
                                  f"{section}.{name}; give one of them")
            overrides.append(f"--{section}.{name}={value}")
    if args.resume:
        overrides.append("--checkpoint.resume=true")
    if args.resume == "auto":
        overrides.append("--checkpoint.fresh_if_none=true")
    return load_config(args.config, overrides)


def check_inputs(cfg: Config):
    """User errors a worker would otherwise hit (data, output folders, device, injected-fault
    spec), as ConfigError/DataError before any process starts; returns the dataset."""
    from ..engine.data import Dataset, check_token_range, load_data
    from ..reliability.errors import FAULT_ENV, parse_faults

    t = cfg.train
    for name, path in (("train.metrics", t.metrics), ("train.trace", t.trace)):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and not os.path.isdir(folder):
            raise ConfigError(f"{name}={path!r}: folder {folder!r} does not exist; create it or "
                              f"choose another path")
    from ..engine.launch import check_device
    check_device(cfg)
    try:
        faults = parse_faults(os.environ.get(FAULT_ENV, ""))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    world = cfg.parallel.world_size
    for f in faults:
        if not 0 <= f.rank < world:
            raise ConfigError(f"{FAULT_ENV} names rank {f.rank}, outside this job's ranks "
                              f"0..{world - 1}; it would never fire")
    check_outputs(cfg)
    spec = check_model(cfg)
    c = cfg.checkpoint
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if c.resume and not c.fresh_if_none and not restarted:
        from ..checkpoint import store
        from ..checkpoint.core import resume_problem
        if not (os.path.isdir(c.dir) and store.latest(Path(c.dir))):
            raise ConfigError(resume_problem(c.dir))
    dataset = load_data(cfg, spec)
    if isinstance(dataset, Dataset):
        check_token_range(dataset, cfg.model.vocab_size)
    return dataset


def check_outputs(cfg: Config) -> None:
    """Every output path is usable now, not after training: a file where a folder must be, a
    folder where a file must be, or a place this user cannot write."""
    t, c = cfg.train, cfg.checkpoint
    for name, path in (("train.metrics", t.metrics), ("train.trace", t.trace)):
        if path and os.path.isdir(path):
            raise ConfigError(f"{name}={path!r} is a folder; give a file path, e.g. "
                              f"{os.path.join(path, 'metrics.jsonl')!r}")
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and os.path.isdir(folder) and not os.access(folder, os.W_OK):
            raise ConfigError(f"{name}={path!r}: folder {folder!r} is not writable")
    for name, path in (("checkpoint.dir", c.dir), ("train.tensorboard", t.tensorboard)):
        if not path:
            continue
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"{name}={path!r} is a file, not a folder; choose a folder path")
        existing = os.path.abspath(path)
        while not os.path.exists(existing):  # the nearest part that exists ("/" always does)
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
            raise ConfigError(f"{name}={path!r} cannot be created: {existing!r} is "
                              f"{'not a folder' if not os.path.isdir(existing) else 'not writable'}")


def check_model(cfg: Config, model=None):
    """The model spec loads, its tensor-parallel plan names real modules whose split tp
    divides, every pipeline stage gets a block, and ``model.init_from`` matches the model
    fields: before any process starts (a meta build)."""
    import torch

    from ..models import resolve, spec_for
    from ..parallel.tensor_parallel.apply import check_plan

    if cfg.model.init_from:  # reads only config files: a mismatch fails before any process
        from ..interop.hf import check_matches
        check_matches(cfg.model, cfg.model.init_from)
    spec = resolve(model, cfg.model) if model is not None else spec_for(cfg.model)
    p = cfg.parallel
    if p.pp * p.virtual_stages > len(spec.blocks):
        raise ConfigError(f"pp*virtual_stages = {p.pp}*{p.virtual_stages} exceeds the "
                          f"{len(spec.blocks)} blocks of model {spec.name!r}")
    if spec.check is not None:
        spec.check(p.tp)
    with torch.device("meta"):
        module = spec.build()
    try:
        check_plan(module, dict(spec.tp_plan), p.tp, where=spec.name,
                   sequence_parallel=p.sequence_parallel)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from ..parallel.parallelize import check_buffers
    check_buffers(module, spec)
    return spec


class RunResult(dict):
    """Rank 0's last-step metrics (a dict, as before), with ``history`` (every step's metrics)
    and ``checkpoint`` (the checkpoint folder, or None) for notebook users."""

    history: list
    checkpoint: str | None


def _train_worker(cfg: Config, dataset=None, model=None) -> RunResult | None:
    from ..engine.env import under_launcher
    from ..engine.launch import quit_on_interrupt, setup, teardown
    from ..models import resolve
    from ..engine.train import train

    if under_launcher():
        quit_on_interrupt()
    try:
        spec = resolve(model, cfg.model) if model is not None else None
        mesh = setup(cfg, spec=spec)
        history = train(cfg, mesh, dataset=dataset, spec=spec)
        teardown(mesh)  # not on failure: closing our connections first would make the healthy ranks
        # fail with "connection closed" before the launcher has seen this rank's error
    except Exception as e:
        # the watchdog printed what failed inside train(); user errors become one line upstream
        if not (getattr(e, "hybridpar_reported", None) or isinstance(e, (ConfigError, HybridparError))
                or type(e).__name__ == "DataError"):
            import traceback
            print(f"hybridpar: rank {os.environ.get('RANK', '0')} failed:\n{traceback.format_exc()}",
                  file=sys.stderr, end="", flush=True)
            e.hybridpar_reported = "printed"
        raise
    if not history or mesh.rank != 0:
        return None
    result = RunResult(history[-1])
    result.history, result.checkpoint = history, cfg.checkpoint.dir or None
    return result


def run_train(cfg: Config, dataset=None, model=None) -> RunResult | None:
    """Join the torchrun job we are in, or spawn dp*tp*pp local ranks (a failed rank becomes
    JobFailed naming it; its own traceback or watchdog report is printed above)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..engine.env import under_launcher
    from ..engine.launch import describe_failure, spawn

    if under_launcher() or cfg.parallel.world_size == 1:
        return _train_worker(cfg, dataset, model)
    import signal

    from ..engine.launch import Signals

    validate(cfg)  # the spawned ranks load the data themselves: ``dataset`` is not pickled over
    signals = Signals()
    try:
        return spawn(_train_worker, cfg.parallel.world_size, cfg, None, model, signals=signals).get(0)
    except ChildFailedError as e:
        from ..reliability.errors import JobFailed
        from ..engine.launch import USER_ERRORS
        if signals.received:
            raise stopped_by(signal.SIGINT if signal.SIGINT in signals.received else signal.SIGTERM,
                             cfg) from None
        line, typ = describe_failure(e)
        raise (ConfigError(line) if typ in USER_ERRORS else JobFailed(line)) from None


def stopped_by(signum: int, cfg: Config) -> Exception:
    """The one line for a run a signal ended before it could save: what was kept."""
    import signal

    from ..reliability.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, Stopped

    kept = "nothing was saved (no checkpoint.dir)"
    if cfg.checkpoint.dir:
        from ..checkpoint.store import latest, remove_leftovers
        if Path(cfg.checkpoint.dir).is_dir():  # a save the signal cut short: the ranks are gone
            remove_leftovers(Path(cfg.checkpoint.dir))
        found = latest(Path(cfg.checkpoint.dir))
        kept = (f"the last checkpoint, {found}, is intact; continue with --resume" if found
                else f"no checkpoint was saved in {cfg.checkpoint.dir} yet")
    if signum == signal.SIGINT:
        return Stopped(f"interrupted (Ctrl-C); {kept}", EXIT_INTERRUPTED)
    return Stopped(f"stopped by SIGTERM before the ranks could save; {kept}", EXIT_TERMINATED)


def _launcher_world() -> int | None:
    from ..engine.env import under_launcher

    return int(os.environ["WORLD_SIZE"]) if under_launcher() and "WORLD_SIZE" in os.environ else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .weights import COMMANDS as WEIGHT_COMMANDS  # import-hf, export, generate

    commands = {"train": "train a model (default: the embedded stdlib corpus)"}
    commands.update({name: desc for name, (_, desc) in WEIGHT_COMMANDS.items()})
    commands["bench"] = "time hybridpar against PyTorch-native parallelism (hybridpar bench --help)"
    commands["plot"] = "draw loss, tokens/s and memory curves of a metrics file: plot METRICS.jsonl"
    commands["plan"] = "rank dp x tp x pp layouts by predicted step time and memory (plan --help)"
    commands["calibrate"] = "measure this machine for the planner: calibrate --out PROFILE.json"
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hybridpar COMMAND [options]\n\ncommands:")
        for name, desc in commands.items():
            print(f"  {name:10s} {desc}")
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "train":
            cfg = parse_train_args(rest)
            validate(cfg, world_size=_launcher_world())
            dataset = check_inputs(cfg)
            try:
                last = run_train(cfg, dataset)
            except KeyboardInterrupt:  # one process: Ctrl-C reaches us directly
                import signal
                raise stopped_by(signal.SIGINT, cfg) from None
            return end_line(last)
        if cmd in WEIGHT_COMMANDS:
            return WEIGHT_COMMANDS[cmd][0](rest)
        if cmd == "bench":
            from ..tools.bench.run import main as bench_main
            return bench_main(rest)
        if cmd == "plot":
            from ..tools.plot import main as plot_main
            return plot_main(rest)
        if cmd == "plan":
            from .plan import plan_main
            return plan_main(rest, run_train=main)  # --apply trains through this same entry
        if cmd == "calibrate":
            from ..tools.calibrate import main as calibrate_main
            return calibrate_main(rest)
        close = difflib.get_close_matches(cmd, list(commands), n=1)
        raise ConfigError(f"unknown command '{cmd}'" + (f"; did you mean '{close[0]}'?" if close else
                                                         f"; commands: {', '.join(commands)}"))
    except Exception as e:
        code = _report(e)
        if code is None:
            raise
        return code


def end_line(last: dict | None) -> int:
    """Print how the run ended (rank 0's last metrics) and return the exit code."""
    from ..reliability.errors import EXIT_TERMINATED

    if not last:
        return 0
    where = f"step {last['step']} loss {last['loss']:.4f}" \
        + (f" val_loss {last['val_loss']:.4f}" if "val_loss" in last else "") \
        + (f" val_accuracy {last['val_accuracy']:.4f}" if "val_accuracy" in last else "")
    saved = last.get("checkpoint")
    if last.get("stopped_by"):
        if saved:
            print(f"stopped by {last['stopped_by']} after {where}; saved {saved}; "
                  f"continue with --resume")
            return 0
        print(f"stopped by {last['stopped_by']} after {where}; nothing was saved (set "
              f"checkpoint.dir to save on preemption)")
        return EXIT_TERMINATED
    print(f"done: {where}" + (f"; saved {saved}" if saved else ""))
    return 0


def _first_to_say() -> bool:
    """Whether this process is the first of its node's workers to report a user error. Every
    worker finds the same bad input; the first to exit prints, since the launcher stops the
    others as soon as one exits (a fixed "local rank 0 prints" loses the line whenever another
    rank gets there first). The workers of one torchrun attempt share the folder of their error
    files, so an exclusively created file there elects the speaker."""
    err_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not err_file:
        return os.environ.get("LOCAL_RANK", "0") == "0"
    try:
        os.close(os.open(os.path.join(os.path.dirname(os.path.dirname(err_file)), "hybridpar-said"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return os.environ.get("LOCAL_RANK", "0") == "0"


def _report(e: Exception) -> int | None:
    """Print a failure as one line and return the exit code; None: let it show its traceback."""
    if isinstance(e, UserError) and not e.collective:
        if _first_to_say():  # under torchrun: once per node, not once per rank
            print(f"hybridpar: error: {e}", file=sys.stderr)
        return EXIT_USER
    if isinstance(e, HybridparError):
        if not e.collective or os.environ.get("RANK", "0") == "0":  # collective: on every rank
            print(f"hybridpar: error: {e}", file=sys.stderr)
        return e.exit_code
    reported = getattr(e, "hybridpar_reported", None)  # already printed (torchrun worker)
    if reported == "first":
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(e)  # torchrun's summary names it as the root cause
    return EXIT_FAILED if reported else None


if __name__ == "__main__":
    sys.exit(main())
