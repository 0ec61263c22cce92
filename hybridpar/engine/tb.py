"""Run logging: TensorBoard events from rank 0, and log lines tagged with where they come from.

TensorBoard gets the same numbers as the JSON-lines metrics (``train.metrics``), under
``train/`` (loss, val_loss, lr, grad_norm), ``perf/`` (tokens/s, step time, model TFLOP/s per
device, MFU when ``train.peak_tflops`` is set) and ``mem/`` (rank 0's peak bytes, and its
parameter / gradient / optimizer / activation bytes when the metrics carry them).

Model FLOPs come from the model spec (``flops_per_sample``; the Llama's count is
``models.llama.flops_per_token``).
"""
from __future__ import annotations

import logging

from ..config import Config
from ..models.llama import flops_per_token
from ..parallel.mesh import ParallelMesh

SCALARS = {  # metrics key -> TensorBoard tag
    "loss": "train/loss", "val_loss": "train/val_loss", "lr": "train/lr",
    "grad_norm": "train/grad_norm", "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s", "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu", "max_mem_bytes": "mem/max_bytes",
}


def throughput(metrics: dict, cfg: Config, flops_per_sample: float | None = None) -> dict:
    """Model TFLOP/s per device and, when the device peak is known, MFU (a fraction), from the
    model spec's FLOPs per sample (default: the Llama's per token x seq_len)."""
    if flops_per_sample is None:
        flops_per_sample = flops_per_token(cfg.model) * cfg.model.seq_len
    samples_per_s = metrics["tokens_per_s"] / cfg.model.seq_len
    per_device = samples_per_s * flops_per_sample / cfg.parallel.world_size / 1e12
    out = {"tflops_per_device": per_device}
    if cfg.train.peak_tflops > 0:
        out["mfu"] = per_device / cfg.train.peak_tflops
    return out


class TensorBoardWriter:
    """Scalars of each step's metrics into ``logdir`` (``torch.utils.tensorboard``)."""

    def __init__(self, logdir: str, cfg: Config):
        from torch.utils.tensorboard import SummaryWriter

        self.cfg = cfg
        self.writer = SummaryWriter(log_dir=logdir)
        p = cfg.parallel
        self.writer.add_text("layout", f"dp={p.dp} tp={p.tp} pp={p.pp} microbatches={p.microbatches} "
                                       f"schedule={p.schedule}", 0)

    def log(self, metrics: dict) -> None:
        values = {**metrics, **throughput(metrics, self.cfg)}
        step = metrics["step"]
        for key, tag in SCALARS.items():
            if key in values:
                self.writer.add_scalar(tag, float(values[key]), step)
        for key, value in metrics.get("mem", {}).items():  # state / activation bytes by kind
            if isinstance(value, (int, float)):
                self.writer.add_scalar(f"mem/{key}_bytes", float(value), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_writer(cfg: Config, mesh: ParallelMesh) -> TensorBoardWriter | None:
    """A writer on rank 0 when ``train.tensorboard`` is set, else None (every other rank)."""
    if mesh.rank != 0 or not cfg.train.tensorboard:
        return None
    return TensorBoardWriter(cfg.train.tensorboard, cfg)


def rank_prefix(mesh: ParallelMesh) -> str:
    """'' on rank 0 (the rank users read), else '[rank 3 dp=1 tp=1 pp=0] '."""
    if mesh.rank == 0:
        return ""
    return f"[rank {mesh.rank} {mesh.layout.describe_rank(mesh.rank).replace(',', '')}] "


class _Tagged(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return self.extra["prefix"] + str(msg), kwargs


def rank_logger(mesh: ParallelMesh, name: str = "hybridpar") -> logging.LoggerAdapter:
    """The ``hybridpar`` logger with this rank's tag on every line; writes to stderr at INFO
    unless the application configured the logger itself."""
    logger = logging.getLogger(name)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return _Tagged(logger, {"prefix": rank_prefix(mesh)})
