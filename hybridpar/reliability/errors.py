"""Run failures users see, exit codes, and injected faults that test the failure paths.

Two kinds of failure reach a user:

- a *user error* (bad config, bad data, bad path): ``ConfigError`` / ``DataError``, caught by the
  CLI before any process starts and printed as one line (exit code ``EXIT_USER``);
- a *run failure* on some rank: an exception, a non-finite step (``NonFiniteError``), a hang
  (the watchdog, ``watchdog.py``). The failing rank speaks first; the others stop promptly.

``HYBRIDPAR_FAULT`` injects faults into a real run, so the failure paths can be tested (and a
cluster set-up checked) end to end: ``kind:rank:step[:seconds]``, several separated by commas,
``step`` 1-based as in the metrics or ``*`` for every step. Kinds: ``raise`` (an exception),
``exit`` (the process dies without a traceback, like an OOM kill), ``hang`` (sleeps forever),
``nan`` (one local gradient becomes NaN), ``slow`` (sleeps ``seconds`` in the step).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

EXIT_FAILED = 1      # a rank raised, or a run failure (NonFiniteError, JobFailed)
EXIT_USER = 2        # bad config / input, reported before any rank starts
EXIT_WATCHDOG = 3    # this rank's operation exceeded the watchdog deadline
EXIT_ABORTED = 4     # this rank stopped because another rank failed or timed out
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it
EXIT_TERMINATED = 143   # SIGTERM with no checkpoint.dir to save to (128 + SIGTERM)


class HybridparError(RuntimeError):
    """A failure whose message is complete: printed as one line, never as a traceback."""

    #: raised identically on every rank (a decision on all-reduced values): no rank to blame
    collective = False
    exit_code = EXIT_FAILED


class UserError(HybridparError):
    """Bad input (configuration, data, a path, a checkpoint that cannot be used): one line
    naming what is wrong and how to fix it, exit code ``EXIT_USER``. Subclasses:
    ``config.ConfigError``, ``engine.data.DataError``, ``checkpoint.store.CheckpointError``."""

    exit_code = EXIT_USER


class NonFiniteError(HybridparError):
    """Loss or gradient norm is NaN/Inf and ``reliability.nan_policy`` says stop."""

    collective = True


class Stopped(HybridparError):
    """The run was stopped by a signal (Ctrl-C, or SIGTERM before anything could be saved)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class JobFailed(HybridparError):
    """A rank of a job we launched failed; the message names it (its own output is above)."""


_CONNECTION_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
                    "connection refused")


def is_connection_lost(message: str) -> bool:
    """A collective failed because a peer process went away (the peer is the real failure)."""
    low = message.lower()
    return any(s in low for s in _CONNECTION_LOST)


FAULT_KINDS = ("raise", "exit", "hang", "nan", "slow")
FAULT_ENV = "HYBRIDPAR_FAULT"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int | None  # 1-based step; None = every step
    seconds: float = 0.0

    def due(self, rank: int, step: int) -> bool:
        return rank == self.rank and (self.step is None or self.step == step)


def parse_faults(spec: str) -> list[Fault]:
    """``"raise:3:2,slow:6:*:0.5"`` -> faults; a ValueError names the bad item."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        try:
            kind, rank, step = parts[0], int(parts[1]), parts[2]
            seconds = float(parts[3]) if len(parts) > 3 else 0.0
            step_n = None if step == "*" else int(step)
        except (IndexError, ValueError):
            raise ValueError(f"{FAULT_ENV} item {item!r} is not kind:rank:step[:seconds], "
                             f"e.g. raise:3:2 or slow:1:*:0.5") from None
        if kind not in FAULT_KINDS:
            raise ValueError(f"{FAULT_ENV} kind {kind!r} is not one of {', '.join(FAULT_KINDS)}")
        faults.append(Fault(kind, rank, step_n, seconds))
    return faults


def faults_for(rank: int) -> list[Fault]:
    return [f for f in parse_faults(os.environ.get(FAULT_ENV, "")) if f.rank == rank]


def inject(faults: list[Fault], *, rank: int, step: int, pm, activity) -> None:
    """Apply the faults due now (after backward, before the step's checks and update)."""
    for f in faults:
        if not f.due(rank, step):
            continue
        activity.mark(f"injected {f.kind} ({FAULT_ENV})")
        if f.kind == "raise":
            raise RuntimeError(f"injected fault ({FAULT_ENV}) on rank {rank} at step {step}, "
                               f"t={time.time():.3f}")
        if f.kind == "exit":
            os._exit(13)
        if f.kind == "hang":
            while True:
                time.sleep(3600)
        if f.kind == "slow":
            time.sleep(f.seconds)
        if f.kind == "nan":
            # a parameter the gradient norm counts (tp replicas and tied copies are not counted)
            p = next(iter(pm.counted_parameters()))
            p.grad.view(-1)[0] = math.nan
