"""``spawn`` starts the ranks from a fork server created at the first spawn of a process: each
rank must still see the launcher's environment as it is at *its* spawn (not the server's, fixed
at the first), the launcher's own rank variables, and the default SIGTERM disposition (the
server ignores SIGTERM)."""
from __future__ import annotations

import os
import signal


def _report() -> dict:
    return {"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
            "set_later": os.environ.get("HYBRIDPAR_TEST_SET_LATER"),
            "removed": os.environ.get("HYBRIDPAR_TEST_REMOVED"),
            "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}


def test_ranks_see_the_environment_of_their_own_spawn(monkeypatch):
    from hybridpar.engine.launch import spawn

    monkeypatch.setenv("HYBRIDPAR_TEST_REMOVED", "1")
    first = spawn(_report, 2)  # starts the fork server (if no earlier test did) with this variable
    assert first[1]["removed"] == "1" and first[1]["set_later"] is None
    monkeypatch.delenv("HYBRIDPAR_TEST_REMOVED")
    monkeypatch.setenv("HYBRIDPAR_TEST_SET_LATER", "yes")
    second = spawn(_report, 2)
    for rank, got in second.items():
        assert got == {"rank": str(rank), "world": "2", "set_later": "yes", "removed": None,
                       "sigterm_default": True}, (rank, got)


def _computed_once() -> dict:
    import torch.distributed as dist

    from hybridpar.config import ConfigError
    from hybridpar.parallel.collectives import computed_once

    dist.init_process_group("gloo")
    try:
        calls = []
        value = computed_once(lambda: calls.append(1) or f"from rank {dist.get_rank()}", 2)

        def fails():
            raise ConfigError("cannot profile")
        try:
            computed_once(fails, 2)
            error = None
        except ConfigError as e:
            error = str(e)
        return {"value": value, "calls": len(calls), "error": error}
    finally:
        dist.destroy_process_group()


def test_computed_once_runs_on_rank_0_and_its_error_reaches_every_rank():
    """The pipeline split's profile is computed by rank 0 alone and broadcast: every rank gets
    rank 0's value, only rank 0 computes it, and an error there is raised on every rank (no
    rank is left waiting for a result)."""
    from hybridpar.engine.launch import spawn

    got = spawn(_computed_once, 2)
    assert got[0] == {"value": "from rank 0", "calls": 1, "error": "cannot profile"}
    assert got[1] == {"value": "from rank 0", "calls": 0, "error": "cannot profile"}


def test_core_share_gives_each_local_rank_its_own_cores():
    from hybridpar.engine.launch import core_share

    assert [core_share(r, 2, [0, 1]) for r in range(2)] == [[0], [1]]
    assert [core_share(r, 2, [4, 5, 6, 7, 8]) for r in range(2)] == [[4, 5], [6, 7]]  # 8 free
    assert [core_share(r, 8, [0, 1]) for r in range(8)] == [[0], [1]] * 4  # in turn
    assert core_share(0, 1, [2, 3]) == [2, 3]


def _bindings(cores: list[int]) -> dict:
    import torch

    from hybridpar.config import Config, TrainConfig
    from hybridpar.engine.launch import set_threads

    cpu, out = torch.device("cpu"), {}
    for name, train in (("off", TrainConfig(bind_cores=False)),
                        ("too many threads", TrainConfig(threads_per_rank=len(cores) + 1)),
                        ("on", TrainConfig())):
        bound = set_threads(Config(train=train), cpu)
        out[name] = (bound, sorted(os.sched_getaffinity(0)), torch.get_num_threads())
    return out


def test_a_cpu_rank_is_bound_to_its_share_of_the_cores():
    """``train.bind_cores``: each local rank runs on its own cores (the share of the process's
    affinity mask), with that many torch threads; off, or with more threads asked for than the
    share has, the rank keeps the mask it was started with."""
    import pytest

    from hybridpar.engine.env import usable_cores
    from hybridpar.engine.launch import core_share, spawn

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    cores = usable_cores()
    got = spawn(_bindings, 2, cores)
    for rank, out in got.items():
        share = core_share(rank, 2, cores)
        assert out["off"] == (None, cores, len(share)), (rank, out)
        assert out["too many threads"] == (None, cores, len(cores) + 1), (rank, out)
        assert out["on"] == (share, share, len(share)), (rank, out)
