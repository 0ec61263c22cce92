"""A finished run lets go of everything: its process groups' threads are joined by
``teardown`` while the interpreter is alive, and nothing of the run (gradient buckets, the
groups they reduce over) outlives it.

Why it matters: a Gloo worker thread still alive at interpreter shutdown can need the GIL to free
a finished collective's tensor; taking it then ends the thread with ``pthread_exit``, which aborts
the process (SIGABRT, "terminate called without an active exception") after a run that
succeeded. It happened in CI to ``torchrun ... hybridpar train`` on a loaded machine."""
from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def _threads() -> list[str]:
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{t}/comm").read_text().strip())
        except FileNotFoundError:  # a thread that ended since the listing (a pool's helper)
            pass
    return sorted(names)


def _worker(rank: int, port: int, out: str) -> None:
    import torch

    from hybridpar.engine.launch import teardown
    from hybridpar.engine.train import train
    from hybridpar.parallel.data_parallel import GradSync
    from hybridpar.parallel.mesh import Layout, build_mesh
    from hybridpar.testing import join_world, tiny_config, tiny_dataset

    before = _threads()
    join_world(rank, 2, port, out)
    cfg = tiny_config(dp=2, steps=2)
    mesh = build_mesh(Layout.of(cfg.parallel), torch.device("cpu"))
    train(cfg, mesh, dataset=tiny_dataset())
    during = _threads()
    teardown(mesh)
    gc.collect()
    alive = sum(isinstance(o, GradSync) for o in gc.get_objects())
    Path(out, f"{rank}.json").write_text(json.dumps(
        {"before": before, "during": during, "after": _threads(), "grad_syncs": alive}))


def test_teardown_joins_the_group_threads_and_the_run_leaves_nothing(tmp_path):
    from hybridpar.engine.launch import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        if p.exitcode is None:
            p.kill()
    logs = "".join(f.read_text() for f in tmp_path.glob("stderr-rank*.txt"))
    assert [p.exitcode for p in procs] == [0, 0], logs[-3000:]
    for r in range(2):
        got = json.loads(Path(tmp_path, f"{r}.json").read_text())
        assert any("gloo" in n for n in got["during"])  # the check can see the threads at all
        assert got["after"] == got["before"], got
        assert got["grad_syncs"] == 0  # the hooks on the parameters do not keep it alive
