"""Periodic saves and preemption during ``train``.

SIGTERM only sets a flag (a signal handler must not touch collectives). At every step boundary
the ranks agree on it with one all-reduce (max), so a signal reaching any subset of ranks, at
any moment, makes all of them save the same step together and stop cleanly: exit code 0 with a
checkpoint to resume from, ``EXIT_TERMINATED`` (143) when no ``checkpoint.dir`` was set.
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ..reliability.watchdog import activity
from . import store
from .core import save


class Saver:
    """Saves ``trainer`` every ``checkpoint.every`` steps and at the last step (when
    ``checkpoint.dir`` is set), and catches SIGTERM in any case."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.cfg = trainer.cfg.checkpoint
        self.preempted = False  # this rank received SIGTERM
        self.last_saved: Path | None = None
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.preempted = True

    def _agree(self) -> bool:
        """Whether any rank received SIGTERM (all-reduce max of the flags)."""
        mesh = self.trainer.mesh
        if not (dist.is_initialized() and mesh.layout.world_size > 1):
            return self.preempted
        flag = torch.tensor([int(self.preempted)], device=mesh.device)
        activity.mark("checkpoint: SIGTERM agreement", comm=True)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def after_step(self, *, last: bool) -> bool:
        """At a step boundary (every rank): save if due; True when the run must stop now."""
        step = self.trainer.step
        store.kill_point(f"step={step}", self.trainer.mesh.rank)
        stop = self._agree()  # the ranks agree to stop for a SIGTERM
        every = self.cfg.every
        if self.cfg.dir and (last or stop or (every > 0 and step % every == 0)):
            self.last_saved = save(self.trainer, self.cfg.dir, keep=self.cfg.keep)
        return stop

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
