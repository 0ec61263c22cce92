"""Pipeline schedules as data: for each pipeline rank, the ordered actions of one optimizer step.

A schedule is a ``list[list[Action]]`` indexed by pipeline rank. Rank ``s`` holds ``n_chunks``
model chunks; chunk ``c`` of rank ``s`` is virtual stage ``v = c * n_stages + s`` (Megatron
interleaving), and the model runs through virtual stages ``0 .. V-1``, ``V = n_stages * n_chunks``.

SEND_F/RECV_F carry activations from virtual stage v to v+1, SEND_B/RECV_B input-gradients from
v to v-1. A runtime issues every maximal run of consecutive communication actions as one batch
(``batch_isend_irecv``) and waits for all of it, so *where* a generator puts its sends and receives
decides whether the pipeline deadlocks; ``hybridpar.parallel.pipeline.simulate`` checks that. Generators are
pure functions: the interpreter that runs them on ranks and the simulator read the same lists.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Op", "Action", "Schedule", "SCHEDULES", "virtual_stage", "peer_rank", "steps", "in_flight",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "forward_only", "build",
]


class Op(str, enum.Enum):
    FWD = "F"
    BWD = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_comm(self) -> bool:
        return self not in (Op.FWD, Op.BWD)

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_F, Op.SEND_B)


@dataclass(frozen=True)
class Action:
    """One step of a rank: compute or communicate micro-batch ``mb`` of local chunk ``chunk``."""

    op: Op
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op.value}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")

    __repr__ = __str__


Schedule = list[list[Action]]


def virtual_stage(rank: int, chunk: int, n_stages: int) -> int:
    return chunk * n_stages + rank


def peer_rank(rank: int, action: Action, n_stages: int) -> int:
    """The rank at the other end of a communication action (activations flow to rank+1)."""
    downstream = action.op in (Op.SEND_F, Op.RECV_B)
    return (rank + (1 if downstream else -1)) % n_stages


def steps(actions: list[Action]) -> list[tuple[Action, ...]]:
    """Split a rank's list into what a runtime issues at once: one compute action, or a maximal
    run of consecutive communication actions (one batch)."""
    out: list[tuple[Action, ...]] = []
    for a in actions:
        if a.op.is_comm and out and out[-1][0].op.is_comm:
            out[-1] += (a,)
        else:
            out.append((a,))
    return out


def in_flight(actions: list[Action]) -> int:
    """Peak number of (mb, chunk) forwarded but not yet backwarded: the activation memory bound."""
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        if a.op is Op.FWD:
            live.add((a.mb, a.chunk))
            peak = max(peak, len(live))
        elif a.op is Op.BWD:
            live.discard((a.mb, a.chunk))
    return peak


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")


def _with_comms(order: list[Action], rank: int, n_stages: int, n_chunks: int) -> list[Action]:
    """Put each compute action's receive right before it and its send right after it.

    Adjacent sends and receives then merge into one batch, e.g. ``SEND_F(i), RECV_B(j)`` between
    a forward and a backward: Megatron's ``send_forward_recv_backward``.
    """
    last = n_stages * n_chunks - 1
    out: list[Action] = []
    for a in order:
        v = virtual_stage(rank, a.chunk, n_stages)
        if a.op is Op.FWD:
            if v > 0:
                out.append(Action(Op.RECV_F, a.mb, a.chunk))
            out.append(a)
            if v < last:
                out.append(Action(Op.SEND_F, a.mb, a.chunk))
        else:
            if v < last:
                out.append(Action(Op.RECV_B, a.mb, a.chunk))
            out.append(a)
            if v > 0:
                out.append(Action(Op.SEND_B, a.mb, a.chunk))
    return out


def gpipe(n_stages: int, n_microbatches: int) -> Schedule:
    """All forwards, then all backwards: every rank holds all M activations (in-flight == M)."""
    _check_positive(n_stages=n_stages, n_microbatches=n_microbatches)
    order = [Action(Op.FWD, m) for m in range(n_microbatches)]
    order += [Action(Op.BWD, m) for m in range(n_microbatches)]
    return [_with_comms(order, s, n_stages, 1) for s in range(n_stages)]


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """Megatron's non-interleaved 1F1B: ``min(p - s - 1, M)`` warmup forwards, then forward
    ``w + i`` / backward ``i`` alternating, then cooldown backwards. Rank s holds at most
    ``p - s`` activations; the bubble is the same as GPipe's, (p - 1) / (M + p - 1)."""
    _check_positive(n_stages=n_stages, n_microbatches=n_microbatches)
    schedule = []
    for s in range(n_stages):
        warmup = min(n_stages - s - 1, n_microbatches)
        order = [Action(Op.FWD, m) for m in range(warmup)]
        for i in range(n_microbatches - warmup):
            order += [Action(Op.FWD, warmup + i), Action(Op.BWD, i)]
        order += [Action(Op.BWD, m) for m in range(n_microbatches - warmup, n_microbatches)]
        schedule.append(_with_comms(order, s, n_stages, 1))
    return schedule


def interleaved_1f1b(n_stages: int, n_microbatches: int, n_chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B (virtual pipeline): the bubble shrinks by ``n_chunks``, to
    (p - 1) / (v * M) of the ideal time, at the price of ``n_chunks`` times more messages.

    Work runs in groups of ``n_stages`` micro-batches per chunk (chunk 0 for mbs 0..p-1, chunk 1
    for the same mbs, ..., then the next group). Communication follows Megatron-Core's
    ``forward_backward_pipelining_with_interleaving`` without overlap: after every step one batch
    sends what was just computed and receives ahead what a later step needs.
    ``n_chunks == 1`` is plain ``one_f_one_b``.
    """
    _check_positive(n_stages=n_stages, n_microbatches=n_microbatches, n_chunks=n_chunks)
    if n_chunks == 1:
        return one_f_one_b(n_stages, n_microbatches)
    if n_stages < 2:
        raise ValueError(f"n_stages={n_stages}: interleaving n_chunks={n_chunks} "
                         "needs n_stages >= 2")
    if n_microbatches % n_stages:
        valid = ", ".join(str(n_stages * k) for k in range(1, 4))
        raise ValueError(f"n_microbatches={n_microbatches} must be a multiple of "
                         f"n_stages={n_stages} for the interleaved schedule; valid: {valid}, ...")
    plans = [_megatron_interleaved_rank(s, n_stages, n_microbatches, n_chunks)
             for s in range(n_stages)]
    return _fill_receives(plans, n_stages)


# A rank's plan before receives are named: an Action, or the placeholders "rf" / "rb" for "receive
# the next activation from rank s-1" / "the next gradient from rank s+1".
_Plan = list["Action | str"]


def _megatron_interleaved_rank(s: int, p: int, m: int, n_chunks: int) -> _Plan:
    """Rank s's steps k = 0 .. M*v - 1 in Megatron's order; step k is mb (k // pv) * p + k % p
    of chunk (k % pv) // p (reversed for backwards). Receive flags mirror Megatron's
    ``recv_prev`` / ``recv_next``."""
    total = m * n_chunks
    warmup = min((p - s - 1) * 2 + (n_chunks - 1) * p, total)
    remaining = total - warmup

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * n_chunks)) // p
        return c if forward else n_chunks - 1 - c

    def act(op: Op, k: int) -> Action:
        mb = (k // (p * n_chunks)) * p + k % p
        return Action(op, mb, chunk(k, op is Op.FWD))

    def fwd(k: int) -> list:  # forward k and its send (none from the last virtual stage)
        a = act(Op.FWD, k)
        last = (s, a.chunk) == (p - 1, n_chunks - 1)
        return [a] if last else [a, Action(Op.SEND_F, a.mb, a.chunk)]

    def bwd(k: int) -> list:  # backward k and its send (none from virtual stage 0)
        a = act(Op.BWD, k)
        return [a] if (s, a.chunk) == (0, 0) else [a, Action(Op.SEND_B, a.mb, a.chunk)]

    plan: _Plan = [] if s == 0 else ["rf"]
    for k in range(warmup):
        b = fwd(k)
        if k < total - 1 and not (s == 0 and chunk(k + 1, True) == 0):
            b.append("rf")
        if k == warmup - 1 and remaining and s < p - 1:
            b.append("rb")
        plan += b
    for i in range(remaining):
        fk = i + warmup
        f, b = fwd(fk), bwd(i)
        # Compute first (F then B), then one batch: sends of both, receives for later steps.
        plan += [f[0], b[0]] + f[1:] + b[1:]
        # Rank 0 runs p - 1 steps ahead of rank p-1, whose output feeds rank 0's next chunk.
        if i < remaining - 1 and not (s == 0 and chunk(fk - (p - 1), True) == n_chunks - 1):
            plan.append("rf")
        if not (s == p - 1 and chunk(i - (p - 1), False) == 0):
            plan.append("rb")
    if not remaining and s < p - 1:
        plan.append("rb")
    for k in range(remaining, total):
        plan += bwd(k)
        if k < total - 1 and not (s == p - 1 and chunk(k + 1, False) == n_chunks - 1):
            plan.append("rb")
    return plan


def _fill_receives(plans: list[_Plan], p: int) -> Schedule:
    """Name each placeholder receive after the message it gets: links are FIFO, so the n-th
    receive from a neighbour is the n-th message that neighbour sends here."""
    sent = {"rf": [[] for _ in range(p)], "rb": [[] for _ in range(p)]}
    for s, plan in enumerate(plans):
        for a in plan:
            if isinstance(a, Action) and a.op is Op.SEND_F:  # to rank s+1, chunk +1 on wrap-around
                sent["rf"][(s + 1) % p].append(Action(Op.RECV_F, a.mb, a.chunk + (s == p - 1)))
            elif isinstance(a, Action) and a.op is Op.SEND_B:  # to rank s-1, chunk -1 on wrap
                sent["rb"][(s - 1) % p].append(Action(Op.RECV_B, a.mb, a.chunk - (s == 0)))
    schedule: Schedule = []
    for s, plan in enumerate(plans):
        queues = {kind: iter(sent[kind][s]) for kind in sent}
        try:
            schedule.append([next(queues[a]) if isinstance(a, str) else a for a in plan])
        except StopIteration:  # a generator bug, not a user error
            raise AssertionError(f"rank {s} plans more receives than its neighbours send") from None
    return schedule


SCHEDULES = ("gpipe", "1f1b", "interleaved")


def forward_only(n_stages: int, n_microbatches: int, n_chunks: int = 1) -> Schedule:
    """Evaluation: the forwards of the training schedule of the same shape, in its order, each
    with its receive right before and its send right after (no backward, nothing to keep).

    The order matters as much as in training: chunk by chunk over *all* micro-batches (the
    obvious order) deadlocks once M > n_stages with interleaving, because rank 0 posts its
    first receive for chunk 1 only after sending every chunk-0 micro-batch, while rank p-1,
    which must deliver that message, waits for rank 0's later sends. Megatron's order (groups of
    ``n_stages`` micro-batches per chunk) keeps every link's sends and receives in step; the
    simulator proves it for every (pp, v, M) the config accepts (tests/test_schedules.py)."""
    _check_positive(n_stages=n_stages, n_microbatches=n_microbatches, n_chunks=n_chunks)
    if n_chunks == 1:
        order = [Action(Op.FWD, m) for m in range(n_microbatches)]
    else:
        if n_microbatches % n_stages:
            raise ValueError(f"n_microbatches={n_microbatches} must be a multiple of "
                             f"n_stages={n_stages} for the interleaved schedule")
        group = n_stages * n_chunks
        order = [Action(Op.FWD, (k // group) * n_stages + k % n_stages, (k % group) // n_stages)
                 for k in range(n_microbatches * n_chunks)]
    return [_with_comms(order, s, n_stages, n_chunks) for s in range(n_stages)]


def build(name: str, n_stages: int, n_microbatches: int, n_chunks: int = 1) -> Schedule:
    """The named schedule; only ``"interleaved"`` takes ``n_chunks > 1``."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is unknown; valid: {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_1f1b(n_stages, n_microbatches, n_chunks)
    if n_chunks != 1:
        raise ValueError(f"n_chunks={n_chunks} needs schedule='interleaved'; {name!r} uses 1 chunk")
    generate = gpipe if name == "gpipe" else one_f_one_b
    return generate(n_stages, n_microbatches)
