"""Pure tests of the pipeline schedules and of the simulator that validates and times them."""
import pytest

from hybridpar.parallel.pipeline.schedules import (
    Action, Op, build, forward_only, gpipe, in_flight, interleaved_1f1b, one_f_one_b, steps,
)
from hybridpar.parallel.pipeline.simulate import ScheduleError, check, simulate

A = Action
F, B = Op.FWD, Op.BWD
SF, RF, SB, RB = Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B

FLAT = [(name, p, m) for name in ("gpipe", "1f1b") for p in range(1, 9) for m in range(1, 13)]
INTERLEAVED = [(p, c, m) for p in (2, 3, 4) for c in (2, 3) for m in range(p, 13, p)]


def _compute(schedule, n_stages):
    """(op, mb, virtual stage) -> count, over every rank."""
    counts = {}
    for r, acts in enumerate(schedule):
        for a in acts:
            if not a.op.is_comm:
                key = (a.op, a.mb, a.chunk * n_stages + r)
                counts[key] = counts.get(key, 0) + 1
    return counts


def _check_dataflow(result, n_stages, n_chunks):
    """Each F starts after the previous virtual stage's F ended, each B after the next one's B."""
    last = n_stages * n_chunks - 1
    t = {(e.action.op, e.action.mb, e.action.chunk * n_stages + e.rank): e
         for e in result.events if not e.action.op.is_comm}
    for (op, mb, v), e in t.items():
        before = (F, mb, v - 1) if op is F else ((F, mb, v) if v == last else (B, mb, v + 1))
        if op is F and v == 0:
            continue
        assert e.start >= t[before].end - 1e-9, (op, mb, v)


@pytest.mark.parametrize("name,p,m", FLAT)
def test_flat_schedules_run_and_match_closed_form(name, p, m):
    schedule = build(name, p, m)
    result = simulate(schedule, p)
    assert _compute(schedule, p) == {(op, mb, v): 1 for op in (F, B) for mb in range(m)
                                     for v in range(p)}
    _check_dataflow(result, p, 1)
    assert result.makespan == pytest.approx((m + p - 1) * 3)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.busy == pytest.approx([3.0 * m] * p)
    if name == "gpipe":
        assert result.max_in_flight == (m,) * p
    else:
        assert all(k <= min(p - s, m) for s, k in enumerate(result.max_in_flight))
        assert result.max_in_flight[0] <= p


@pytest.mark.parametrize("p,c,m", INTERLEAVED)
def test_interleaved_runs_and_matches_megatron_bubble(p, c, m):
    schedule = interleaved_1f1b(p, m, c)
    result = simulate(schedule, p, c)
    assert _compute(schedule, p) == {(op, mb, v): 1 for op in (F, B) for mb in range(m)
                                     for v in range(p * c)}
    _check_dataflow(result, p, c)
    # Chunks are 1/c of a stage: time each at F = 1/c, B = 2/c so the ideal time is 3 * M.
    timed = simulate(schedule, p, c, duration=lambda r, a: (2.0 if a.op is B else 1.0) / c)
    ideal = 3.0 * m
    # Megatron's closed form: bubble / ideal = (p - 1) / (v * M); the executor reproduces it.
    assert (timed.makespan - ideal) / ideal == pytest.approx((p - 1) / (c * m))
    assert timed.bubble_fraction == pytest.approx(result.bubble_fraction)
    assert result.bubble_fraction < simulate(one_f_one_b(p, m), p).bubble_fraction
    # Megatron's activation bound: the warmup forwards plus the one of the 1F1B step.
    for s, k in enumerate(result.max_in_flight):
        assert k == min((p - s - 1) * 2 + (c - 1) * p + 1, m * c)


def test_interleaved_with_one_chunk_is_1f1b():
    assert interleaved_1f1b(4, 6, 1) == one_f_one_b(4, 6)
    assert build("interleaved", 4, 8, 1) == build("1f1b", 4, 8)


def test_comm_time_delays_each_hop():
    result = simulate(gpipe(2, 1), 2, comm_time=lambda r, a: 0.5)
    assert result.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    by_action = {(e.rank, str(e.action)): e for e in result.events}
    assert by_action[1, "RECV_F0"].end == pytest.approx(1.5)
    assert by_action[0, "B0"].start == pytest.approx(5.0)


def test_action_str_steps_and_in_flight():
    names = [str(a) for a in (A(F, 3), A(B, 1), A(SF, 3), A(F, 3, 1))]
    assert names == ["F3", "B1", "SEND_F3", "F3c1"]
    acts = one_f_one_b(3, 4)[1]
    assert [len(s) for s in steps([A(RF, 0), A(F, 0), A(SF, 0), A(RF, 1), A(F, 1)])] == [1, 1, 2, 1]
    assert in_flight(acts) == 2
    assert in_flight(gpipe(3, 4)[0]) == 4


def test_1f1b_pairs_send_forward_with_recv_backward():
    batches = [tuple(map(str, s)) for s in steps(one_f_one_b(3, 4)[1]) if s[0].op.is_comm]
    assert ("SEND_F1", "RECV_B0") in batches and ("SEND_B0", "RECV_F2") in batches


@pytest.mark.parametrize("call,words", [
    (lambda: gpipe(0, 4), "n_stages=0"),
    (lambda: one_f_one_b(2, -1), "n_microbatches=-1"),
    (lambda: interleaved_1f1b(4, 6, 2), "multiple of n_stages=4"),
    (lambda: interleaved_1f1b(1, 4, 2), "n_stages >= 2"),
    (lambda: build("zero-bubble", 2, 4), "gpipe, 1f1b, interleaved"),
    (lambda: build("1f1b", 2, 4, n_chunks=2), "n_chunks=2"),
])
def test_bad_arguments_are_named(call, words):
    with pytest.raises(ValueError, match=words):
        call()


# Hand-made two-stage schedules, one micro-batch unless stated; each breaks one rule.
GOOD0 = [A(F, 0), A(SF, 0), A(RB, 0), A(B, 0)]
GOOD1 = [A(RF, 0), A(F, 0), A(B, 0), A(SB, 0)]


@pytest.mark.parametrize("schedule,words", [
    ([GOOD0[:-1], GOOD1], "missing B0 on rank 0"),
    ([[A(F, 0), A(SF, 0), A(F, 1), A(SF, 1), A(RB, 0), A(B, 0), A(RB, 1), A(B, 1)],
      [A(RF, 1), A(RF, 0), A(F, 0), A(F, 1), A(B, 0), A(SB, 0), A(B, 1), A(SB, 1)]],
     "FIFO order violation on link rank 0 -> rank 1"),
    ([[A(F, 0), A(RB, 0), A(B, 0), A(SF, 0)], GOOD1], "deadlock: rank 0 blocked in batch "
     r"\[RECV_B0\] waiting for rank 1 to reach SEND_B0; rank 1 blocked in batch \[RECV_F0\]"),
    ([GOOD0, [A(RF, 0), A(F, 0), A(B, 0)]], "unmatched RECV_B0 on rank 0"),
    ([GOOD0 + [A(SF, 0)], GOOD1], "SEND_F0 on rank 0 is duplicated"),
    ([[A(B, 0), A(F, 0), A(SF, 0), A(RB, 0)], GOOD1], "B before its F"),
    ([GOOD0, [A(F, 0), A(RF, 0), A(B, 0), A(SB, 0)]], "F0 on rank 1 comes before RECV_F0"),
    ([[A(RF, 0)] + GOOD0, GOOD1], "virtual stage 0 of 0..1 has no RECV_F"),
    ([GOOD0], "schedule has 1 ranks but n_stages=2"),
])
def test_validator_rejects(schedule, words):
    with pytest.raises(ScheduleError, match=words):
        simulate(schedule, 2)


def test_valid_hand_made_schedule_passes():
    assert simulate([GOOD0, GOOD1], 2).makespan == pytest.approx(6.0)


def test_interleaved_needs_megatron_comm_placement():
    """Receiving right before each compute (fine for 1F1B) deadlocks the interleaved ring: the
    executor sees it, which is why the generator prefetches receives as Megatron does."""
    p, c = 4, 2
    naive = []
    for r, acts in enumerate(interleaved_1f1b(p, 8, c)):
        out = []
        for a in (a for a in acts if not a.op.is_comm):
            v, fwd = a.chunk * p + r, a.op is F
            recv, send = (RF, SF) if fwd else (RB, SB)
            has_recv, has_send = (v > 0, v < p * c - 1) if fwd else (v < p * c - 1, v > 0)
            out += [A(recv, a.mb, a.chunk)] * has_recv + [a] + [A(send, a.mb, a.chunk)] * has_send
        naive.append(out)
    with pytest.raises(ScheduleError, match="deadlock: rank 0 blocked"):
        simulate(naive, p, c, sends="blocking")
    # with sends left to complete in the background (Gloo) the cycle of waits is gone, but a
    # transport that completes a batch as one (NCCL's group) would hang: check proves both
    simulate(naive, p, c, sends="deferred")
    with pytest.raises(ScheduleError, match="deadlock: rank 0 blocked"):
        check(naive, p, c)


# Every (pp, v, M) the config accepts for evaluation: flat schedules any M, interleaved M % pp == 0.
FORWARD_ONLY = ([(p, 1, m) for p in range(1, 9) for m in range(1, 17)]
                + [(p, c, m) for p in range(2, 9) for c in (2, 3, 4) for m in range(p, 4 * p + 1, p)])


@pytest.mark.parametrize("p,c,m", FORWARD_ONLY)
def test_forward_only_runs_every_forward_once(p, c, m):
    schedule = forward_only(p, m, c)
    result = simulate(schedule, p, c, backward=False)  # raises on deadlock or bad order
    assert _compute(schedule, p) == {(F, mb, v): 1 for mb in range(m) for v in range(p * c)}
    _check_dataflow(result, p, c)
    assert result.busy == pytest.approx([1.0 * m * c] * p)


def _chunk_by_chunk(p, m, c):
    """The evaluation order hybridpar shipped before: chunk 0 over all micro-batches, then 1."""
    sched = []
    for s in range(p):
        acts = []
        for ch in range(c):
            v = ch * p + s
            for mb in range(m):
                acts += [A(RF, mb, ch)] * (v > 0) + [A(F, mb, ch)] + [A(SF, mb, ch)] * (v < p * c - 1)
        sched.append(acts)
    return sched


@pytest.mark.parametrize("p,c,m", [(2, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_chunk_by_chunk_evaluation_deadlocks_and_is_caught(p, c, m):
    """The bug this replaces: with M > pp the interleaved evaluation hung at the first eval.
    The start-up check reports it instead."""
    with pytest.raises(ScheduleError, match="evaluation schedule .* would not run: deadlock"):
        check(_chunk_by_chunk(p, m, c), p, c, backward=False, what="evaluation schedule")
    check(_chunk_by_chunk(p, p, c), p, c, backward=False)  # M == pp was fine


def test_forward_only_rejects_backward_actions():
    with pytest.raises(ScheduleError, match="in a forward-only schedule"):
        simulate(gpipe(2, 1), 2, backward=False)
    with pytest.raises(ScheduleError, match="missing B0"):
        simulate(forward_only(2, 1), 2)  # a training check wants the backwards


def test_forward_only_follows_the_training_order_of_its_schedule():
    p, m, c = 2, 4, 2
    fwd = [a for a in interleaved_1f1b(p, m, c)[0] if a.op is F]
    assert [a for a in forward_only(p, m, c)[0] if a.op is F] == fwd
    with pytest.raises(ValueError, match="multiple of n_stages=2"):
        forward_only(2, 3, 2)


def test_deferred_sends_let_a_stage_go_on():
    """A fast stage 0 does not wait for a slow stage 1 to post its receive: under "deferred"
    F2 starts as soon as F1 ends; under "blocking" it waits for rank 1's RECV_F1 (t = 4). The
    send itself still completes at the rendezvous, and the step ends when it has."""
    r0 = [A(F, 0), A(SF, 0), A(F, 1), A(SF, 1), A(F, 2), A(SF, 2)]
    r1 = [A(RF, 0), A(F, 0), A(RF, 1), A(F, 1), A(RF, 2), A(F, 2)]

    def dur(rank, a):
        return 3.0 if rank == 1 else 1.0

    def start(res, rank, action):
        return next(e.start for e in res.events if e.rank == rank and e.action == action)

    def end(res, rank, action):
        return next(e.end for e in res.events if e.rank == rank and e.action == action)

    blocking = simulate([r0, r1], 2, duration=dur, backward=False, sends="blocking")
    deferred = simulate([r0, r1], 2, duration=dur, backward=False, sends="deferred")
    assert start(blocking, 0, A(F, 2)) == 4.0 and start(deferred, 0, A(F, 2)) == 2.0
    assert end(deferred, 0, A(SF, 1)) == 4.0  # completes when rank 1 posts RECV_F1
    assert blocking.makespan == deferred.makespan == 10.0
    with pytest.raises(ValueError, match="sends="):
        simulate([r0, r1], 2, backward=False, sends="eager")


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 6, 1), ("1f1b", 2, 1, 1),
                                         ("interleaved", 2, 4, 2)])
def test_ranks_sharing_cores_share_the_work(name, p, m, v):
    """Processor sharing: with one core (each of n computing ranks at speed 1/n) and free
    messages some rank always computes, so the run takes exactly the total work, the messages'
    core time (``post_cpu``) included; with a core per rank it is the run on separate devices."""
    sched = build(name, p, m, v)

    def dur(rank, a):
        return (1.0 + 0.5 * rank + 0.25 * a.chunk) * (2.0 if a.op is B else 1.0)

    total = sum(dur(r, a) for r, acts in enumerate(sched) for a in acts if not a.op.is_comm)
    one_core = simulate(sched, p, v, duration=dur, share=lambda n: 1.0 / n)
    assert one_core.makespan == pytest.approx(total)
    _check_dataflow(one_core, p, v)
    # a message's core time (posting it, the transport's handling) is work on the same core
    comms = sum(a.op.is_comm for acts in sched for a in acts)
    posting = simulate(sched, p, v, duration=dur, share=lambda n: 1.0 / n, post_cpu=lambda r, a: 0.125)
    assert posting.makespan == pytest.approx(total + 0.125 * comms)
    _check_dataflow(posting, p, v)
    free = simulate(sched, p, v, duration=dur, share=lambda n: 1.0 / n, post_cpu=lambda r, a: 0.0)
    assert free.events == one_core.events
    own = simulate(sched, p, v, duration=dur)
    enough = simulate(sched, p, v, duration=dur, share=lambda n: min(1.0, p / n))
    assert enough.makespan == pytest.approx(own.makespan)
    times = sorted((e.rank, str(e.action), e.start, e.end) for e in enough.events)
    assert times == sorted((e.rank, str(e.action), e.start, e.end) for e in own.events)


def test_sharing_slows_the_actions_that_overlap_and_waits_use_no_core():
    """1F1B, 2 stages, 2 micro-batches on one core: F0 on rank 0 runs alone [0, 1]; rank 0's
    F1 and rank 1's F0 then share the core and both end at 3. A collective after the work
    (``wait``) holds its rank but leaves the core to the other: with a wait of 1 after each
    forward, F0 ends at 2, and F1 (rank 0) and F0 (rank 1) share the core from 2 to 4."""
    sched = build("1f1b", 2, 2)

    def end(res, rank, action):
        return next(e.end for e in res.events if e.rank == rank and e.action == action)

    res = simulate(sched, 2, duration=lambda r, a: 1.0, share=lambda n: 1.0 / n)
    assert end(res, 0, A(F, 0)) == pytest.approx(1.0)
    assert end(res, 0, A(F, 1)) == pytest.approx(3.0) and end(res, 1, A(F, 0)) == pytest.approx(3.0)
    waits = simulate(sched, 2, duration=lambda r, a: 1.0, share=lambda n: 1.0 / n,
                     wait=lambda r, a: 1.0 if a.op is F else 0.0)
    assert end(waits, 0, A(F, 0)) == pytest.approx(2.0)
    assert end(waits, 0, A(F, 1)) == pytest.approx(5.0) and end(waits, 1, A(F, 0)) == pytest.approx(5.0)
    assert res.makespan == pytest.approx(8.0)  # the total work: the core never idles
    assert waits.makespan == pytest.approx(11.0)  # 8 + the core idle in [1, 2], [4, 5], [8, 9]


def test_speeds_give_each_working_rank_its_own_rate():
    """``speeds`` generalises ``share``: one rate for every working rank reproduces it, and a
    rank always at half speed runs as if its work were twice as long."""
    sched = build("1f1b", 2, 4)

    def dur(rank, a):
        return (1.0 + 0.5 * rank) * (2.0 if a.op is B else 1.0)

    def times(res):
        return sorted((e.rank, str(e.action), round(e.start, 9), round(e.end, 9)) for e in res.events)

    shared = simulate(sched, 2, duration=dur, share=lambda n: 1.0 / n)
    same = simulate(sched, 2, duration=dur, speeds=lambda w: (1.0 / len(w),) * len(w))
    assert times(same) == times(shared)
    half = simulate(sched, 2, duration=dur, speeds=lambda w: tuple(0.5 if r == 0 else 1.0 for r in w))
    longer = simulate(sched, 2, duration=lambda r, a: dur(r, a) * (2.0 if r == 0 else 1.0))
    assert times(half) == times(longer)
    assert half.makespan > shared.makespan / 2


def test_runner_waits_for_receives_now_and_sends_at_the_end(monkeypatch):
    """The runtime's half of "deferred": in a batch of one handle per op, receives are waited on
    before the batch returns and sends only when the step's list is done; one handle for the
    whole batch (a coalescing transport) is waited on at once."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from hybridpar.parallel.pipeline.boundaries import TensorMeta
    from hybridpar.parallel.pipeline.runtime import PipelineRunner, StepState

    log = []

    class Work:
        def __init__(self, name):
            self.name = name

        def wait(self):
            log.append(("wait", self.name))

        def is_completed(self):
            return False

    coalesce = [False]

    def batch(ops):
        names = [o.op.__name__ for o in ops]
        return [Work("+".join(names))] if coalesce[0] else [Work(n) for n in names]

    monkeypatch.setattr(dist, "P2POp", lambda fn, t, peer, group: SimpleNamespace(op=fn, tensor=t))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    mesh = SimpleNamespace(group=lambda axis: None, device=torch.device("cpu"), pp_rank=0,
                           layout=SimpleNamespace(pp=2), stage_rank=lambda r: r)
    meta = (TensorMeta((2, 4), torch.float32),)
    runner = PipelineRunner([], mesh, 1, [meta], loss_fn=None)
    for coalesced, waits, left in ((False, [("wait", "irecv")], 1), (True, [("wait", "isend+irecv")], 0)):
        coalesce[0], st = coalesced, StepState()
        log.clear()
        st.outputs[(0, 0)] = torch.randn(2, 4)
        runner._comm((A(SF, 0), A(RB, 0)), st)
        assert log == waits and len(st.sending) == left
        assert runner.sends == ("blocking" if coalesced else "deferred")
        runner._drain(st)
        assert log == waits + [("wait", "isend")] * left and not st.sending
