"""Logging: TensorBoard events from a real (2-rank) run read back with TensorBoard's own reader,
the Python API's return value, the FLOP count behind MFU, and rank-tagged log lines."""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from hybridpar.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from hybridpar.parallel.mesh import Layout, ParallelMesh
from hybridpar.engine.tb import rank_logger, rank_prefix
from hybridpar.models.llama import flops_per_token, matmul_params

STEPS = 4
TINY = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, seq_len=32)


def _cfg(tmp_path, **train) -> Config:
    data = tmp_path / "corpus.txt"
    data.write_text("".join(f"print('tensor', {i} * {i})\n" for i in range(2000)))
    return Config(model=TINY, parallel=ParallelConfig(dp=1, tp=2, pp=1, microbatches=2),
                  train=TrainConfig(steps=STEPS, global_batch=8, eval_every=2, eval_batches=1,
                                    progress=False, threads_per_rank=1, **train),
                  data=DataConfig(path=str(data)))


def test_python_api_writes_tensorboard_events_on_rank0_only(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import hybridpar
    import hybridpar.engine.train  # noqa: F401  the submodule of the same name must not hide the API

    assert callable(hybridpar.train)
    logdir, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    last = hybridpar.train(_cfg(tmp_path, tensorboard=str(logdir), metrics=str(metrics), peak_tflops=0.5))
    # the Python API returns rank 0's last metrics
    assert last["step"] == STEPS and math.isfinite(last["loss"]) and "val_loss" in last
    assert last["layout"]["tp"] == 2

    files = list(logdir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 only, though 2 ranks ran
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    tags = set(acc.Tags()["scalars"])
    for tag, key in [("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("perf/tokens_per_s", "tokens_per_s"), ("perf/tflops_per_device", "tflops_per_device"),
                     ("perf/mfu", "mfu"), ("mem/max_bytes", "max_mem_bytes")]:
        assert tag in tags, (tag, sorted(tags))
        events = acc.Scalars(tag)
        assert [e.step for e in events] == list(range(1, STEPS + 1)), tag
        for e, row in zip(events, rows):  # event files hold float32
            assert e.value == pytest.approx(row[key], rel=1e-6), tag
    assert [e.step for e in acc.Scalars("train/val_loss")] == [2, 4]
    row = rows[0]
    assert row["mfu"] == pytest.approx(row["tflops_per_device"] / 0.5)
    assert row["tflops_per_device"] == pytest.approx(
        row["tokens_per_s"] * flops_per_token(TINY) / 2 / 1e12)  # 2 devices


def test_flops_per_token_matches_torch_flop_counter():
    """6 * N_matmul is exactly what torch counts for forward + backward matmuls; the attention
    term 12 L d T (QK^T and AV, PaLM) is added by formula (the CPU counter skips SDPA)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hybridpar.models.transformer import Transformer

    model = Transformer(TINY)
    x = torch.randint(0, 256, (1, TINY.seq_len))
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    assert counter.get_total_flops() / TINY.seq_len == 6 * matmul_params(TINY)
    attn = 12 * TINY.n_layers * TINY.n_heads * TINY.head_dim * TINY.seq_len
    assert flops_per_token(TINY) == 6 * matmul_params(TINY) + attn


def test_log_lines_tagged_with_rank_and_coords(caplog):
    layout = Layout(2, 2, 2)
    assert rank_prefix(ParallelMesh(layout, 0, torch.device("cpu"))) == ""
    c = layout.coords(5)
    mesh5 = ParallelMesh(layout, 5, torch.device("cpu"))
    assert rank_prefix(mesh5) == f"[rank 5 dp={c['dp']} tp={c['tp']} pp={c['pp']}] "
    with caplog.at_level(logging.INFO, logger="hybridpar"):
        rank_logger(mesh5).warning("loss is nan")
        rank_logger(ParallelMesh(layout, 0, torch.device("cpu"))).info("started")
    assert [r.getMessage() for r in caplog.records] == [f"[rank 5 dp={c['dp']} tp={c['tp']} pp={c['pp']}] loss is nan",
                                                         "started"]
