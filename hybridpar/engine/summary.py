"""What a run tells its user, on rank 0: one start-up summary (what trains, where, on what data,
from which state) and, with ``hybridpar train``, one end line (``cli.main``)."""
from __future__ import annotations

import torch


def parameter_count(spec) -> int:
    """Parameters of the whole (unsharded) model, tied ones once: a meta-device build."""
    with torch.device("meta"):
        module = spec.build()
    return sum(p.numel() for p in module.parameters())


def _human(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def startup_lines(trainer) -> list[str]:
    """Model and parameters, layout and rank order, data and what one step consumes, and the
    state the run starts from."""
    cfg, mesh = trainer.cfg, trainer.mesh
    p, t, lay = cfg.parallel, cfg.train, mesh.layout
    spec = trainer.pm.spec
    schedule = (f", {p.schedule} schedule" if lay.pp > 1 else "") + \
        f", {p.microbatches} micro-batch{'es' if p.microbatches > 1 else ''}"
    extras = [x for x, on in (("ZeRO-1", p.zero1), ("sequence parallel", p.sequence_parallel),
                              (f"recompute={p.recompute}", p.recompute != "none"),
                              (trainer.precision, trainer.precision != "fp32"),
                              ("torch.compile (units; recomputed regions eager; activation meter off)",
                               t.compile),
                              (f"{p.cp_attention} context-parallel attention, "
                               + (f"{cfg.model.seq_len // lay.cp} tokens of each sequence per rank"
                                  if spec.cp_split_batch else f"each sample's tokens split {lay.cp} ways"),
                               lay.cp > 1)) if on]
    lines = [f"model {spec.name}: {_human(parameter_count(spec))} parameters; "
             f"{lay.world_size} rank{'s' if lay.world_size > 1 else ''}: dp={lay.dp} "
             + (f"cp={lay.cp} " if lay.cp > 1 else "")
             + f"tp={lay.tp} pp={lay.pp} (rank order {'-'.join(lay.order) if lay.cp > 1 else p.order})"
             f"{schedule}"
             + (f"; {', '.join(extras)}" if extras else "")]
    if lay.pp > 1:
        lines.append("pipeline stages: " + " | ".join(
            f"{len([u for u in units if u in spec.blocks])} blocks" for units in trainer.pm.stage_units)
            + f" ({trainer.pm.split_note})")
    describe = getattr(trainer.dataset, "describe", None)
    per_step = (f"{t.global_batch * cfg.model.seq_len:,} tokens per step "
                f"({t.global_batch} x {cfg.model.seq_len})" if _is_text(trainer.dataset)
                else f"{t.global_batch} samples per step")
    lines.append(f"data {describe() if describe else type(trainer.dataset).__name__}; {per_step}")
    if trainer.resumed_from:
        lines.append(f"resumed from {trainer.resumed_from} at step {trainer.step}; "
                     f"training to step {t.steps}")
    else:
        start = f"weights from {cfg.model.init_from}" if cfg.model.init_from else "new weights"
        lines.append(f"{start}; training steps 1..{t.steps}"
                     + (f"; checkpoints in {cfg.checkpoint.dir}" if cfg.checkpoint.dir else ""))
    return lines


def _is_text(dataset) -> bool:
    from . import data
    return isinstance(dataset, data.Dataset) or type(dataset).__name__ == "InstructionDataset"
