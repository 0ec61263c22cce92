"""The command line end to end: spawn by ourselves, and join a torchrun job."""
from __future__ import annotations

import json
import os
import subprocess
import sys

TINY = ["--model.n_layers=2", "--model.d_model=32", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.d_ff=64", "--model.seq_len=32", "--global-batch=8", "--train.threads_per_rank=1",
        "--train.eval_every=5", "--train.eval_batches=1", "--train.progress=false"]


def _run(args, timeout=180, env_extra=None, **kw):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, **kw)


def test_train_spawns_ranks_and_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    tmp = tmp_path / "tmp"  # the launcher's temporary files: none may be left behind
    tmp.mkdir()
    r = _run([sys.executable, "-m", "hybridpar", "train", "--dp", "1", "--tp", "1", "--pp", "2",
              "--microbatches", "2", "--steps", "10", "--metrics", str(metrics), *TINY],
             env_extra={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "hybridpar-launch-"))]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in rows] == list(range(1, 11))
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "max_mem_bytes", "layout"):
        assert key in rows[0]
    assert rows[0]["layout"] == {"dp": 1, "tp": 1, "pp": 2, "microbatches": 2, "schedule": "1f1b"}
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "val_loss" in rows[4] and "val_loss" in rows[9]
    assert "done: step 10" in r.stdout


def test_joins_torchrun_job(tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2", "-m", "hybridpar", "train",
              "--dp", "1", "--tp", "2", "--steps", "3", "--metrics", str(metrics), *TINY])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 3 and rows[0]["layout"]["tp"] == 2
    assert r.stdout.count("done: step 3") == 1  # rank 0 reports, once


def test_bad_layout_is_one_line_before_any_process(tmp_path):
    r = _run([sys.executable, "-m", "hybridpar", "train", "--tp", "3"])
    assert r.returncode == 2
    assert r.stderr.strip() == ("hybridpar: error: parallel.tp=3 must divide model.n_heads=8; "
                                "valid tp: 1, 2, 4")
