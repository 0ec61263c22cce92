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

from .config import Config, validate
from .mesh import Layout, ParallelMesh, build_mesh, single_mesh


def under_launcher() -> bool:
    """True inside a torchrun / elastic-launch worker (the launcher sets these)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from .config import ConfigError
            raise ConfigError("train.device=cuda but no CUDA device is available; use --train.device=cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_threads(cfg: Config) -> None:
    n = cfg.train.threads_per_rank
    if n <= 0:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        n = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(n)


def setup(cfg: Config, *, timeout_s: float = 600.0) -> ParallelMesh:
    """Validate on every rank, then create the process group and the mesh."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if under_launcher() else 1
    validate(cfg, world_size=world)
    set_threads(cfg)
    device = pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    p = cfg.parallel
    layout = Layout(p.dp, p.tp, p.pp, tuple(p.order.split("-")))
    if world == 1:
        return single_mesh(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=timeout_s))
    return build_mesh(layout, device, embed_group=cfg.model.tie_embeddings)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, max_restarts: int = 0) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks; returns {rank: return value}.

    A failing rank makes the agent stop the others and raise ``ChildFailedError`` carrying
    that rank's traceback."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs,
                          run_id=f"hybridpar-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
                          monitor_interval=0.1, start_method="spawn")
    return elastic_launch(config, fn)(*args)
