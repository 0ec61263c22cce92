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
