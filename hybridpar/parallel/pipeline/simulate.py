"""Run a pipeline schedule as a discrete-event simulation: the validator and the timing model.

The simulator executes the very lists the runtime interpreter runs, with the runtime's semantics:
each maximal run of consecutive communication actions is one batch (``batch_isend_irecv``); an op
completes only once its matching op is posted by the peer (rendezvous), at ``max(post time of the
two ops) + comm time``. What the rank waits for depends on the transport, named by ``sends``:

- ``"deferred"`` (a transport that completes each op on its own, as Gloo does): the rank waits
  for the batch's receives only; a send completes in the background and the rank waits for all
  of its sends at the end of the step (``PipelineRunner`` drains them there). A stage that has
  finished a forward goes on without waiting for its neighbour to post the receive.
- ``"blocking"`` (a transport that completes a batch as one, as NCCL's coalesced group does on
  its stream): the batch ends when every op in it, sends included, has completed.

A list that runs under ``"blocking"`` also runs under ``"deferred"`` (deferral only removes
waits), so ``check`` proves both. Messages between two ranks are matched in order (FIFO, no
tags), per ordered pair of ranks, activations and gradients alike, as a tagless runtime would.

Ranks that share processors (a CPU's cores, for the planner) can be timed with processor
sharing: the compute of the n ranks computing at a moment progresses at ``share(n)`` each, so
the run is played in time order rather than by data flow alone.

Before timing, static checks catch malformed schedules (missing, duplicated or misordered
compute, unmatched or out-of-order messages); the run itself catches deadlocks. Every failure is
a ``ScheduleError`` naming the rank and action.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, NamedTuple

from hybridpar.parallel.pipeline.schedules import Action, Op, Schedule, in_flight, peer_rank, steps

__all__ = ["ScheduleError", "Event", "SimResult", "simulate", "check", "default_duration", "message"]

CostFn = Callable[[int, Action], float]
SENDS = ("deferred", "blocking")


class ScheduleError(ValueError):
    """The schedule is malformed or would deadlock."""


class Event(NamedTuple):
    """One compute action, or one op of a communication batch (start = batch posted, end = done)."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    makespan: float
    """Time at which the last rank finishes."""
    events: tuple[Event, ...]
    """Compute and communication events in simulation order."""
    busy: tuple[float, ...]
    """Per rank, total compute (F + B) time."""
    bubble_fraction: float
    """1 - sum(busy) / (n_stages * makespan): the idle share of the pipeline."""
    max_in_flight: tuple[int, ...]
    """Per rank, peak number of micro-batch chunks forwarded but not yet backwarded."""


def default_duration(rank: int, action: Action) -> float:
    """Forward 1, backward 2: the usual 1:2 compute ratio."""
    return 2.0 if action.op is Op.BWD else 1.0


def _no_comm_time(rank: int, action: Action) -> float:
    return 0.0


# A message is (kind, mb, sending virtual stage): SEND_F(mb) of v and RECV_F(mb) of v+1 share one.
Message = tuple[str, int, int]


def message(rank: int, a: Action, n_stages: int) -> Message:
    """The message a communication action sends or receives: both ends name the same one."""
    v = a.chunk * n_stages + rank
    return {Op.SEND_F: ("F", a.mb, v), Op.RECV_F: ("F", a.mb, v - 1),
            Op.SEND_B: ("B", a.mb, v), Op.RECV_B: ("B", a.mb, v + 1)}[a.op]


def _fail(msg: str) -> None:
    raise ScheduleError(msg)


def _check_rank(rank: int, actions: list[Action], n_stages: int, n_chunks: int) -> None:
    """Per-rank order: each action finds what it needs earlier on the same rank."""
    last = n_stages * n_chunks - 1
    needs = {Op.FWD: Op.RECV_F, Op.SEND_F: Op.FWD, Op.BWD: Op.RECV_B, Op.SEND_B: Op.BWD}
    done: set[tuple[Op, int, int]] = set()
    for a in actions:
        where = f"{a} on rank {rank}"
        if not isinstance(a, Action) or not isinstance(a.op, Op):
            _fail(f"rank {rank}: {a!r} is not an Action")
        if not 0 <= a.chunk < n_chunks or a.mb < 0:
            _fail(f"{where}: chunk must be in 0..{n_chunks - 1} and mb >= 0")
        v = a.chunk * n_stages + rank
        if (a.op, a.mb, a.chunk) in done:
            _fail(f"{where} is duplicated")
        if (v == 0 and a.op in (Op.RECV_F, Op.SEND_B)
                or v == last and a.op in (Op.SEND_F, Op.RECV_B)):
            _fail(f"{where}: virtual stage {v} of 0..{last} has no {a.op.value}")
        if a.op is Op.BWD and (Op.FWD, a.mb, a.chunk) not in done:
            _fail(f"{where}: B before its F {Action(Op.FWD, a.mb, a.chunk)}")
        need = needs.get(a.op)
        if a.op is Op.FWD and v == 0 or a.op is Op.BWD and v == last:
            need = None
        if need and (need, a.mb, a.chunk) not in done:
            _fail(f"{where} comes before {Action(need, a.mb, a.chunk)} on that rank")
        done.add((a.op, a.mb, a.chunk))


def _check_coverage(schedule: Schedule, n_stages: int, n_chunks: int, backward: bool) -> None:
    """Every micro-batch seen anywhere is forwarded (and, when training, backwarded) once on
    every virtual stage; a forward-only (evaluation) list has no backward actions at all."""
    have = {(a.op, a.mb, a.chunk * n_stages + r) for r, acts in enumerate(schedule) for a in acts}
    if not backward:
        for r, acts in enumerate(schedule):
            for a in acts:
                if a.op in (Op.BWD, Op.SEND_B, Op.RECV_B):
                    _fail(f"{a} on rank {r} in a forward-only schedule")
    ops = (Op.FWD, Op.BWD) if backward else (Op.FWD,)
    for mb in sorted({mb for _, mb, _ in have}):
        for v in range(n_stages * n_chunks):
            for op in ops:
                if (op, mb, v) not in have:
                    rank, chunk = v % n_stages, v // n_stages
                    _fail(f"missing {Action(op, mb, chunk)} on rank {rank} "
                          f"(mb {mb}, virtual stage {v})")


def _check_messages(schedule: Schedule, n_stages: int) -> dict:
    """Every send has its receive and links deliver in order.

    Returns (is_send, message) -> (rank, step index, action): where each op of a message sits."""
    sends, recvs = defaultdict(list), defaultdict(list)  # (src, dst) -> [(message, action)]
    where: dict[tuple[bool, Message], tuple[int, int, Action]] = {}
    for r, acts in enumerate(schedule):
        for i, step in enumerate(steps(acts)):
            for a in step:
                if not a.op.is_comm:
                    continue
                is_send, other = a.op.is_send, peer_rank(r, a, n_stages)
                msg = message(r, a, n_stages)
                (sends[r, other] if is_send else recvs[other, r]).append((msg, a))
                where[is_send, msg] = (r, i, a)
    for src, dst in sorted(set(sends) | set(recvs)):
        s, v = sends[src, dst], recvs[src, dst]
        missing = Counter(m for m, _ in s) - Counter(m for m, _ in v)
        extra = Counter(m for m, _ in v) - Counter(m for m, _ in s)
        for m, a in s:
            if m in missing:
                _fail(f"unmatched {a} on rank {src}: rank {dst} never receives it")
        for m, a in v:
            if m in extra:
                _fail(f"unmatched {a} on rank {dst}: rank {src} never sends it")
        for (ms, sa), (mr, ra) in zip(s, v):
            if ms != mr:
                _fail(f"FIFO order violation on link rank {src} -> rank {dst}: rank {src} sends "
                      f"{sa} next but rank {dst} receives {ra} next")
    return where


def simulate(schedule: Schedule, n_stages: int, n_chunks: int = 1,
             duration: CostFn | None = None, comm_time: CostFn | None = None, *,
             backward: bool = True, sends: str = "deferred",
             share: Callable[[int], float] | None = None, wait: CostFn | None = None,
             post_cpu: CostFn | None = None,
             speeds: Callable[[tuple[int, ...]], tuple[float, ...]] | None = None) -> SimResult:
    """Validate ``schedule`` and time it; ``duration`` / ``comm_time`` map (rank, action) to
    seconds (defaults: F = 1, B = 2, messages free). ``backward=False`` checks a forward-only
    (evaluation) list; ``sends`` is ``"deferred"`` or ``"blocking"`` (module docstring). Raises
    ``ScheduleError`` if it is invalid.

    Ranks that share processors (a CPU's cores): ``share(n)`` is the speed of each rank's
    compute while n of the ranks compute at once (processor sharing: about min(1, cores / n));
    an action's ``duration`` is then its time alone, and ``wait(rank, action)`` the seconds it
    spends in its own collectives after that work, computing nothing; ``post_cpu(rank, action)``
    the core seconds the rank spends on each message of a batch before it is posted (posting,
    and the transport's handling of the bytes, which take the same cores as the compute).
    ``speeds(working)``, in place of ``share``, gives each rank's speed from the set of ranks
    working (sorted): for ranks bound to cores, where two on one core share it while another
    core idles."""
    if sends not in SENDS:
        raise ValueError(f"sends={sends!r} must be one of {SENDS}")
    if len(schedule) != n_stages:
        _fail(f"schedule has {len(schedule)} ranks but n_stages={n_stages}")
    if n_chunks < 1:
        _fail(f"n_chunks={n_chunks} must be >= 1")
    for r, acts in enumerate(schedule):
        _check_rank(r, acts, n_stages, n_chunks)
    _check_coverage(schedule, n_stages, n_chunks, backward)
    where = _check_messages(schedule, n_stages)
    events, clock = _run(schedule, n_stages, where, duration or default_duration,
                         comm_time or _no_comm_time, sends == "deferred", share, wait, post_cpu,
                         speeds)
    busy = tuple(sum((e.end - e.start for e in events
                      if e.rank == r and not e.action.op.is_comm), 0.0) for r in range(n_stages))
    makespan = max(clock, default=0.0)
    return SimResult(
        makespan=makespan,
        events=tuple(events),
        busy=busy,
        bubble_fraction=1.0 - sum(busy) / (n_stages * makespan) if makespan > 0 else 0.0,
        max_in_flight=tuple(in_flight(acts) for acts in schedule),
    )


def _run(schedule: Schedule, n_stages: int, where: dict, duration: CostFn,
         comm_time: CostFn, deferred: bool, share: Callable[[int], float] | None = None,
         wait: CostFn | None = None, post_cpu: CostFn | None = None,
         speeds: Callable[[tuple[int, ...]], tuple[float, ...]] | None = None,
         ) -> tuple[list[Event], list[float]]:
    """Event-driven run in time order. A compute action is ``duration`` seconds of work then
    ``wait`` seconds in which the rank computes nothing (its own collectives); the work
    progresses at ``share(n)`` seconds per second while n ranks do work at once (1 without
    ``share``: each rank has its own device, and times follow from data flow alone). A comm
    batch is first ``post_cpu`` seconds of such work (summed over its ops), then posted."""
    plan = [steps(acts) for acts in schedule]
    pos, clock = [0] * n_stages, [0.0] * n_stages
    posted: dict[tuple[int, int], float] = {}  # (rank, step index) -> time the batch was posted
    events: list[Event] = []
    in_background: list[tuple[int, Action, float]] = []  # deferred sends: (rank, action, posted)
    # per rank: None (takes its next step, or waits for a peer to post), ("work", left, since)
    # or ("until", t)
    state: list = [None] * n_stages
    handled: set[tuple[int, int]] = set()  # comm steps whose post_cpu work is done
    started = [0.0] * n_stages
    t = 0.0

    def partner(r: int, a: Action) -> tuple[int, int, Action]:
        return where[a.op in (Op.RECV_F, Op.RECV_B), message(r, a, n_stages)]

    def finish(r: int, end: float) -> None:
        step = plan[r][pos[r]]
        if step[0].op.is_comm:
            events.extend(Event(r, a, started[r], end) for a in step
                          if not (deferred and a.op.is_send))
        else:
            events.append(Event(r, step[0], started[r], end))
        clock[r], pos[r], state[r] = end, pos[r] + 1, None

    def work_done(r: int) -> bool:
        """The compute action's work is done at ``t``: it waits in its collectives, if any, or
        ends now (True). A comm batch's posting work is done: it is posted next."""
        if plan[r][pos[r]][0].op.is_comm:
            handled.add((r, pos[r]))
            state[r] = None
            return True
        after = wait(r, plan[r][pos[r]][0]) if wait else 0.0
        if after > 0:
            state[r] = ("until", t + after)
            return False
        finish(r, t)
        return True

    def settle() -> None:
        """Take every step that needs no time to pass."""
        moved = True
        while moved:
            moved = False
            for r in range(n_stages):
                while pos[r] < len(plan[r]):
                    st = state[r]
                    if st is not None and st[0] == "work":
                        break
                    if st is not None and st[0] == "until":
                        if st[1] > t:
                            break
                        finish(r, st[1])
                        moved = True
                        continue
                    step = plan[r][pos[r]]
                    if not step[0].op.is_comm:
                        started[r] = t
                        state[r] = ("work", duration(r, step[0]), t)
                        if state[r][1] > 0 or not work_done(r):
                            break
                        moved = True
                        continue
                    if (r, pos[r]) not in posted:
                        if (r, pos[r]) not in handled:  # the batch starts: its core work first
                            started[r] = t
                            cpu = sum(post_cpu(r, a) for a in step) if post_cpu else 0.0
                            if cpu > 0:
                                state[r] = ("work", cpu, t)
                                break
                        posted[r, pos[r]] = t
                        in_background.extend((r, a, t) for a in step if deferred and a.op.is_send)
                        moved = True
                    waited = [a for a in step if not (deferred and a.op.is_send)]
                    peers = [partner(r, a)[:2] for a in waited]
                    if any(q not in posted for q in peers):
                        break
                    end = max([started[r]] + [posted[q] for q in peers]) + max(
                        (comm_time(r, a) for a in waited), default=0.0)
                    if end > t:
                        state[r] = ("until", end)
                        break
                    finish(r, end)
                    moved = True

    settle()
    while True:
        working = [r for r in range(n_stages) if state[r] is not None and state[r][0] == "work"]
        if speeds and working:
            rate = dict(zip(working, speeds(tuple(working))))
        else:
            rate = dict.fromkeys(working, share(len(working)) if share and working else 1.0)
        nxt = [(state[r][2] + state[r][1] / rate[r], r) for r in working]
        nxt += [(st[1], r) for r, st in enumerate(state) if st is not None and st[0] == "until"]
        if not nxt:
            break
        t = min(nxt)[0]
        for when, r in nxt:
            if state[r][0] != "work":
                continue
            if when <= t:
                work_done(r)
            elif share or speeds:  # the work done so far at this rate; the next may differ
                _, left, since = state[r]
                state[r] = ("work", left - (t - since) * rate[r], t)
        settle()
    blocked = []
    for r in range(n_stages):
        if pos[r] < len(plan[r]):
            step = plan[r][pos[r]]
            waits = [f"rank {pr} to reach {b}" for pr, i, b in
                     (partner(r, a) for a in step if not (deferred and a.op.is_send))
                     if (pr, i) not in posted]
            blocked.append(f"rank {r} blocked in batch [{', '.join(map(str, step))}] "
                           f"waiting for {', '.join(waits)}")
    if blocked:
        _fail("deadlock: " + "; ".join(blocked))
    for r, a, t0 in in_background:  # every receive was posted: each send completes, and the
        pr, i, _ = partner(r, a)  # rank waits for the last of them at the end of the step
        end = max(t0, posted[pr, i]) + comm_time(r, a)
        events.append(Event(r, a, t0, end))
        clock[r] = max(clock[r], end)
    return events, clock


def check(schedule: Schedule, n_stages: int, n_chunks: int = 1, *, backward: bool = True,
          what: str = "schedule") -> None:
    """Validate the lists a runtime is about to execute (milliseconds, before the first step),
    under both send semantics, so they run on either kind of transport.
    A failure is a bug in a generator, never a user error: it is raised at start-up, naming the
    schedule, instead of a hang in the middle of a run."""
    try:
        for sends in SENDS:
            simulate(schedule, n_stages, n_chunks, backward=backward, sends=sends)
    except ScheduleError as e:
        raise ScheduleError(f"the {what} ({n_stages} stages, {n_chunks} chunks) would not run: "
                            f"{e}") from None
