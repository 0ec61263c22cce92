"""Process start-up: join a torchrun job, or spawn the local ranks through torch's elastic launch.

We never write our own launcher or rendezvous: ``spawn`` is ``torch.distributed.launcher``'s
``elastic_launch`` (what torchrun runs) with a c10d rendezvous on 127.0.0.1, its ranks forked
from multiprocessing's fork server, which imported torch and the engine once (``PRELOAD``).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import uuid
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import Config, validate
from ..parallel.mesh import Layout, ParallelMesh, build_mesh, single_mesh
from .env import under_launcher, usable_cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ranks(cfg: Config) -> int:
    """Ranks on this machine: the launcher's count, or all of them when we spawn."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.world_size))


def check_device(cfg: Config) -> None:
    """``train.device=cuda`` needs a GPU per local rank (NCCL refuses two ranks on one GPU:
    "Duplicate GPU detected"), said before any process starts."""
    from ..config import ConfigError

    if cfg.train.device != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; use --train.device=cpu")
    n, have = local_ranks(cfg), torch.cuda.device_count()
    if n > have:
        raise ConfigError(f"{n} ranks on this machine need {n} GPUs (one each), but {have} "
                          f"{'is' if have == 1 else 'are'} visible; use at most {have} ranks per machine "
                          f"(dp x tp x pp), or --train.device=cpu")


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    """The device of this rank: GPU ``local_rank`` when there is one per local rank; with
    ``device=auto`` and fewer GPUs than local ranks, the CPU (said once, by local rank 0)."""
    want = cfg.train.device
    check_device(cfg)
    if want == "auto" and torch.cuda.is_available() and local_ranks(cfg) > torch.cuda.device_count():
        if local_rank == 0:
            print(f"hybridpar: {local_ranks(cfg)} ranks on this machine but "
                  f"{torch.cuda.device_count()} GPU(s): training on the CPU (--train.device=cuda "
                  f"refuses this instead)", file=sys.stderr, flush=True)
        return torch.device("cpu")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def group_timeout_s(cfg: Config, floor_s: float = 600.0) -> float:
    """The process group's own timeout: above the watchdog's deadline (with room for its report
    and stack dumps), so that NCCL's abort never pre-empts the report that names the rank."""
    deadline = cfg.reliability.deadline_s
    return max(floor_s, 2 * deadline + 60) if deadline > 0 else floor_s


def core_share(local_rank: int, local_ranks: int, cores: list[int]) -> list[int]:
    """A local rank's cores: a contiguous block of len(cores) // local_ranks each (the few
    left over stay free); with at least as many ranks as cores, one core each, in turn."""
    if local_ranks >= len(cores):
        return [cores[local_rank % len(cores)]]
    t = len(cores) // local_ranks
    return cores[local_rank * t:(local_rank + 1) * t]


def set_threads(cfg: Config, device: torch.device | None = None) -> list[int] | None:
    """Torch threads of this rank: ``train.threads_per_rank``, or its share of the cores. On a
    CPU with ``train.bind_cores``, the rank is also bound to that share (and the threads it
    starts after, Gloo's and torch's, with it): the OS otherwise moves a rank that wakes from a
    receive to whichever core is free, away from the caches that hold its weights and
    activations. Measured on 2 cores (ResNet, 16 x 16 images, 1F1B, bound and free
    alternated): the step bound took 0.71-0.98x the free one's in all six pairs at pp=2 and
    pp=4. Returns the cores bound to, or None."""
    n = cfg.train.threads_per_rank if cfg.train.threads_per_rank > 0 else len(_share()[1])
    torch.set_num_threads(n)
    if device is None or device.type != "cpu" or not cfg.train.bind_cores:
        return None
    return bind_to_cores(n)


def _share() -> tuple[int, list[int]]:
    """(ranks on this machine, this one's ``core_share``), from the launcher's LOCAL_RANK of
    LOCAL_WORLD_SIZE."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return local, core_share(int(os.environ.get("LOCAL_RANK", "0")) % local, local, usable_cores())


def bind_to_cores(threads: int) -> list[int] | None:
    """Bind this local rank to its ``core_share``, unless it is alone or wants more
    ``threads`` than the share has; returns the cores bound to, or None. Also used by
    ``calibrate``, so that its ranks share the cores as training's do."""
    local, share = _share()
    if local == 1 or threads > len(share) or not hasattr(os, "sched_setaffinity"):
        return None
    os.sched_setaffinity(0, share)
    return share


def setup(cfg: Config, *, spec=None) -> ParallelMesh:
    """Validate on every rank, then create the process group and the mesh (with the group that
    sums tied parameters across the first and last stage when the model ``spec`` ties any)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if under_launcher() else 1
    validate(cfg, world_size=world)
    device = pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    set_threads(cfg, device)
    p = cfg.parallel
    layout = Layout.of(p)
    if world == 1:
        return single_mesh(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        opts = {"timeout": timedelta(seconds=group_timeout_s(cfg))}
        if device.type == "cuda":
            opts["device_id"] = device  # NCCL binds its communicators to this GPU eagerly
            # NCCL's flight recorder: the last collectives of every group, dumped by the
            # watchdog when its deadline fires (the user's own setting wins)
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            opts.update(_attempt_store())
        dist.init_process_group(backend, **opts)
    from ..models import spec_for
    tied = bool((spec or spec_for(cfg.model)).tied)
    return build_mesh(layout, device, embed_group=tied)


def _attempt_store() -> dict:
    """The torchrun agent's store, under a prefix of this restart attempt. torch's rendezvous
    keeps one TCPStore across restarts (rounds), so without the prefix a restarted worker
    (``--max-restarts``) reads the failed attempt's Gloo addresses and connects to dead peers
    (connection refused, or a hang)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store, rank, world = next(dist.rendezvous("env://"))
    return {"store": dist.PrefixStore(f"hybridpar/attempt_{attempt}", store), "rank": rank,
            "world_size": world}


def teardown(mesh: ParallelMesh | None = None) -> None:
    """Destroy every process group and join their threads while the interpreter is alive.

    ``destroy_process_group`` only unregisters a group we still hold: its Gloo threads run on
    until the object dies, which for a mesh alive at exit is during interpreter shutdown. A
    worker thread still holding a finished collective's tensor then needs the GIL to free it,
    and a thread taking the GIL during shutdown is ended by ``pthread_exit``, which aborts the
    process ("terminate called without an active exception", SIGABRT) after a run that
    succeeded. So the mesh lets go of its groups (``mesh.release()``) and the cycles that hold
    the rest (the model's layers, the optimizer) are collected here: the groups' destructors
    join their threads now, with the GIL released, while those threads can still take it."""
    import gc

    if dist.is_initialized():
        dist.destroy_process_group()
    if mesh is not None:
        mesh.release()
    gc.collect()


class Signals:
    """How the launching process treats SIGTERM and SIGINT while its ranks run.

    torch's agent turns both into an exception that kills the ranks and a traceback. We take them
    instead: SIGTERM (a scheduler's preemption, or ``kill`` of the launcher) is passed on to the
    ranks, which save together at the step boundary and exit 0; SIGINT (Ctrl-C; the terminal
    sends it to every process of the job) is passed on too, and each rank exits at once with
    ``EXIT_INTERRUPTED`` (``quit_on_interrupt``). ``received`` tells the caller which came."""

    HANDLED = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: set[int] = set()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.HANDLED:
                self._previous[sig] = signal.signal(sig, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        if self.received:  # the launcher ends after its ranks, never leaving one behind
            for child in multiprocessing.active_children():
                child.join(timeout=10)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _forward(self, signum, frame) -> None:
        self.received.add(signum)
        for child in multiprocessing.active_children():  # the ranks (spawned by the agent)
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(child.pid, signum)


def quit_on_interrupt() -> None:
    """In a rank the CLI launched: Ctrl-C ends it at once, silently, with ``EXIT_INTERRUPTED``
    (the launcher prints one line; a save in progress never commits, the previous one stays)."""
    from ..reliability.errors import EXIT_INTERRUPTED

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_INTERRUPTED))


def _launch_options(launch_config, own_signals: bool) -> dict:
    """Our own SIGTERM/SIGINT handling, where torch's LaunchConfig offers it (torch >= 2.5)."""
    if own_signals and "signals_to_handle" in launch_config.__dataclass_fields__:
        return {"signals_to_handle": "SIGHUP,SIGQUIT"}
    return {}


# What a rank imports before it runs anything: loaded once in the fork server, not per rank.
# (torch._dynamo and torch.onnx come in lazily with the first step: 4 s for 8 ranks here)
PRELOAD = ["hybridpar.engine.forkserver", "torch", "torch.distributed", "torch._dynamo", "torch.onnx",
           "torch.utils.flop_counter", "hybridpar.engine.launch", "hybridpar.engine.train",
           "hybridpar.planner.spec_model", "hybridpar.planner.timing"]
# This module's import-time environment: in a rank forked from the fork server, the server's
# environment, i.e. what the rank started with before the agent set its own variables.
_IMPORT_ENV, _IMPORT_PID = dict(os.environ), os.getpid()


def rank_context():
    """multiprocessing's fork-server context, its server preloading ``PRELOAD``: ranks fork from
    one process that imported torch and the engine once (8 ranks here: 4 s to start instead of
    18, each rank importing them on two cores). A rank started from it directly, not through
    ``spawn``, sets its own environment (``testing.join_world``)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _in_launcher_env(env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in the launching process's environment as of ``spawn``.

    A rank forked from the fork server inherits the server's environment, fixed when the server
    started (at the first spawn), not the launcher's now: a variable set or removed since (the
    watchdog's folder, a user's export in a notebook) would be wrong in the ranks. The agent's
    own variables (RANK, MASTER_PORT, ...) are those that differ from the server's: they win.
    SIGTERM, which the server ignores (``forkserver``), is the rank's to take again."""
    from .forkserver import as_rank

    as_rank()
    if _IMPORT_PID == os.getpid():  # not preloaded by the server: keep what the agent set
        agent = dict(os.environ)
    else:
        agent = {k: v for k, v in os.environ.items() if _IMPORT_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update({**env, **agent})
    return fn(*args)


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, max_restarts: int = 0,
          signals: Signals | None = None) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks; returns {rank: return value}.

    A failing rank makes the agent stop the others and raise ``ChildFailedError`` carrying
    that rank's traceback (``describe_failure`` makes it one line). The agent's own log lines,
    which repeat that traceback after the rank has printed it, are silenced. With ``signals``,
    SIGTERM and SIGINT are ours, not the agent's (see ``Signals``)."""
    import logging
    import shutil
    import tempfile

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ..reliability.watchdog import LAUNCH_DIR_ENV, WATCHDOG_MARK

    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    handled_env = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")  # the launcher sets it
    # the agent's per-run folder (error files, logs) is ours to remove: no torchelastic_* left
    # behind in the temp folder by every run (a failure's messages are read before removal)
    logs = tempfile.mkdtemp(prefix="hybridpar-launch-")
    rank_context()  # sets the server's preload; the agent asks for the same context by name
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs,
                          run_id=f"hybridpar-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
                          monitor_interval=0.1, start_method="forkserver",
                          logs_specs=DefaultLogsSpecs(log_dir=logs),
                          **_launch_options(LaunchConfig, signals is not None))
    os.environ[LAUNCH_DIR_ENV] = logs  # inherited by the ranks: the watchdog marks its firing here
    try:
        with signals or contextlib.nullcontext():
            return elastic_launch(config, _in_launcher_env)(dict(os.environ), fn, *args)
    except ChildFailedError as e:
        # the reporter SIGKILLs a frozen rank as it exits: the agent may see that death first
        e.watchdog_fired = os.path.exists(os.path.join(logs, WATCHDOG_MARK))
        raise
    finally:
        os.environ.pop(LAUNCH_DIR_ENV, None)
        shutil.rmtree(logs, ignore_errors=True)
        if handled_env is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = handled_env


def error_names(base: str = "UserError") -> tuple[str, ...]:
    """Names of ``reliability.errors.<base>`` and its subclasses: a spawned rank's failure
    reaches the launcher only as a type name. ``UserError``: bad inputs (one line, exit code 2);
    ``HybridparError``: every failure whose message is complete (one line, no traceback)."""
    from ..checkpoint.store import CheckpointError  # noqa: F401  (the modules defining them)
    from ..reliability import errors
    from .data import DataError  # noqa: F401

    out, todo = [], [getattr(errors, base)]
    while todo:
        cls = todo.pop()
        out.append(cls.__name__)
        todo.extend(cls.__subclasses__())
    return tuple(out)


USER_ERRORS = error_names()
COMPLETE_ERRORS = error_names("HybridparError")


def describe_failure(err) -> tuple[str, str]:
    """One line naming the rank that failed first, from elastic's ``ChildFailedError``, and the
    name of its exception type ("" when it raised none).

    Timestamps are whole seconds, so the root cause is chosen by kind: a rank that raised (not
    merely lost its connection to a dead peer), then the watchdog's reporter, then a rank that
    died on its own, then the ranks stopped because of it."""
    from ..reliability.errors import EXIT_ABORTED, EXIT_WATCHDOG, is_connection_lost

    def message(f) -> str:
        m = f.message.get("message", "") if isinstance(f.message, dict) else (f.message or "")
        return m.strip().splitlines()[0] if m.strip() and f.error_file != "<N/A>" else ""

    def kind(f) -> int:
        m = message(f)
        if m:
            return 3 if is_connection_lost(m) else 0
        if f.exitcode == EXIT_WATCHDOG:
            return 1
        return 4 if f.exitcode == EXIT_ABORTED or f.exitcode < 0 else 2

    if getattr(err, "watchdog_fired", False):
        return ("the watchdog stopped the job; its report above names the rank(s) that stopped "
                "participating"), ""
    rank, f = min(err.failures.items(), key=lambda kv: (kind(kv[1]), kv[1].timestamp, kv[0]))
    k, m = kind(f), message(f)
    typ, _, text = m.partition(": ") if k in (0, 3) else ("", "", "")
    if typ in COMPLETE_ERRORS:  # complete one-line messages
        return text, typ
    if k == 0:
        return f"rank {rank} failed first: {m} (its traceback is above)", typ
    if k == 3:
        return f"rank {rank} lost its connection to a peer that died without a Python error: {m}", typ
    if k == 1:
        return ("the watchdog stopped the job; its report above names the rank(s) that stopped "
                "participating"), ""
    if k == 2:
        return (f"rank {rank} died with exit code {f.exitcode} and no Python error "
                f"(killed, out of memory, or a crash in native code?)"), ""
    return f"rank {rank} was stopped ({f.message or f'exit code {f.exitcode}'})", ""
