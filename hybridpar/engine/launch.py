"""Process start-up: join a torchrun job, or spawn the local ranks through torch's elastic launch.

We never write our own launcher or rendezvous: ``spawn`` is ``torch.distributed.launcher``'s
``elastic_launch`` (what torchrun runs) with a c10d rendezvous on 127.0.0.1.
"""
from __future__ import annotations

import os
import socket
import uuid
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import Config, validate
from ..parallel.mesh import Layout, ParallelMesh, build_mesh, single_mesh
from .env import under_launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_device(cfg: Config) -> None:
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        from ..config import ConfigError
        raise ConfigError("train.device=cuda but no CUDA device is available; use --train.device=cpu")


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    want = cfg.train.device
    check_device(cfg)
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_threads(cfg: Config) -> None:
    n = cfg.train.threads_per_rank
    if n <= 0:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        n = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(n)


def setup(cfg: Config, *, spec=None, timeout_s: float = 600.0) -> ParallelMesh:
    """Validate on every rank, then create the process group and the mesh (with the group that
    sums tied parameters across the first and last stage when the model ``spec`` ties any)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if under_launcher() else 1
    validate(cfg, world_size=world)
    set_threads(cfg)
    device = pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    p = cfg.parallel
    layout = Layout(p.dp, p.tp, p.pp, tuple(p.order.split("-")))
    if world == 1:
        return single_mesh(device)
    if not dist.is_initialized():
        backend, timeout = ("nccl" if device.type == "cuda" else "gloo"), timedelta(seconds=timeout_s)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(backend, timeout=timeout, **_attempt_store())
        else:
            dist.init_process_group(backend, timeout=timeout)
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


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, max_restarts: int = 0) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks; returns {rank: return value}.

    A failing rank makes the agent stop the others and raise ``ChildFailedError`` carrying
    that rank's traceback (``describe_failure`` makes it one line). The agent's own log lines,
    which repeat that traceback after the rank has printed it, are silenced."""
    import logging

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import shutil
    import tempfile

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    # the agent's per-run folder (error files, logs) is ours to remove: no torchelastic_* left
    # behind in the temp folder by every run (a failure's messages are read before removal)
    logs = tempfile.mkdtemp(prefix="hybridpar-launch-")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs,
                          run_id=f"hybridpar-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
                          monitor_interval=0.1, start_method="spawn",
                          logs_specs=DefaultLogsSpecs(log_dir=logs))
    try:
        return elastic_launch(config, fn)(*args)
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def user_error_names() -> tuple[str, ...]:
    """Names of every ``UserError`` class: a spawned rank's failure reaches the launcher only as
    a type name, and these are bad inputs (one line, exit code 2)."""
    from ..checkpoint.store import CheckpointError  # noqa: F401  (the modules defining them)
    from ..reliability.errors import UserError
    from .data import DataError  # noqa: F401

    out, todo = [], [UserError]
    while todo:
        cls = todo.pop()
        out.append(cls.__name__)
        todo.extend(cls.__subclasses__())
    return tuple(out)


USER_ERRORS = user_error_names()


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

    rank, f = min(err.failures.items(), key=lambda kv: (kind(kv[1]), kv[1].timestamp, kv[0]))
    k, m = kind(f), message(f)
    typ, _, text = m.partition(": ") if k in (0, 3) else ("", "", "")
    if typ in ("NonFiniteError", *USER_ERRORS):  # complete one-line messages
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
