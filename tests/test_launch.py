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
