"""``hybridpar bench`` runs end to end: both sides of every kind of layout train the same losses.

A smoke test of the benchmark's plumbing (the native side is torch's DDP, DTensor tensor
parallelism and torch.distributed.pipelining, whose APIs move between torch versions); it
reads no times: benchmarks are not timed tests.
"""
import json
import os
import subprocess
import sys


def test_bench_runs_every_kind_of_layout_with_equal_losses(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "hybridpar", "bench", "--ranks", "2", "--layouts", "dp2,tp2,pp2",
           "--schedules", "1f1b", "--repeats", "1", "--steps", "1", "--warmup", "0",
           "--no-baseline", "--model.n_layers=2", "--model.d_model=32", "--model.n_heads=4",
           "--model.n_kv_heads=2", "--model.d_ff=64", "--model.seq_len=16",
           "--train.global_batch=4", "--out", str(out)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["runs"]["2"]
    got = sorted((row["layout"]["dp"], row["layout"]["tp"], row["layout"]["pp"]) for row in rows)
    assert got == [(1, 1, 2), (1, 2, 1), (2, 1, 1)]
    for row in rows:
        assert row["loss_ok"], row["layout"]
        assert row["ratio"] > 0, row["layout"]
