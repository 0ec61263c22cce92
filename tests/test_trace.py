"""Tracing and plotting: a 2-rank pipeline run writes a Chrome trace with every micro-batch's
forward and backward on each stage, a PNG timeline, and metrics that ``hybridpar plot`` draws.

One spawn of 2 Gloo ranks runs three cases: a clean 1F1B run, the same run with the last
micro-batch dropped (``testing.injected("skip_microbatch")``), which the trace check must catch,
and a dp=2 run (tiny buckets: several dp all-reduces per step, each traced).
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybridpar.cli.main import main as cli_main
from hybridpar.engine.launch import spawn
from hybridpar.testing import cases_worker, tiny_config

PP, M, STEPS = 2, 4, 2
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cfg(tmp, name, **layout):
    cfg = tiny_config(**(layout or {"pp": PP}), microbatches=M, steps=STEPS)
    return replace(cfg, train=replace(cfg.train, trace=str(tmp / f"{name}.json"),
                                      metrics=str(tmp / f"{name}.jsonl")))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace")
    cases = [("ok", _cfg(tmp, "ok"), None), ("bug", _cfg(tmp, "bug"), "skip_microbatch"),
             ("dp", _cfg(tmp, "dp", dp=2), None)]
    spawn(cases_worker, PP, cases, str(tmp / "results"))
    return tmp


def _compute_names(trace: dict) -> dict[tuple[int, int], set[str]]:
    """(rank, step) -> names of forward/backward events."""
    out: dict[tuple[int, int], set[str]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] in ("forward", "backward"):
            out.setdefault((e["pid"], e["args"]["step"]), set()).add(e["name"])
    return out


def _missing(trace: dict) -> list[str]:
    want = {f"F{mb}" for mb in range(M)} | {f"B{mb}" for mb in range(M)}
    got = _compute_names(trace)
    return [f"rank {r} step {s}: {sorted(want - got.get((r, s), set()))}"
            for r in range(PP) for s in range(STEPS) if want - got.get((r, s), set())]


def test_trace_has_every_microbatch_on_every_stage(run):
    trace = json.loads((run / "ok.json").read_text())
    assert _missing(trace) == []
    bug = json.loads((run / "bug.json").read_text())
    assert _missing(bug) != []  # the check sees a dropped micro-batch


def test_trace_is_valid_chrome_json(run):
    trace = json.loads((run / "ok.json").read_text())
    events = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert isinstance(e["ts"], float) and isinstance(e["dur"], float) and e["dur"] >= 0, e
        assert e["tid"] in (0, 1) and e["pid"] in (0, 1), e
    cats = {e["cat"] for e in spans}
    assert {"forward", "backward", "p2p", "optimizer", "norm_allreduce"} <= cats
    # on one rank's main lane, events do not overlap (a rank does one thing at a time);
    # 1 us slack: ts/dur are float microseconds from perf_counter differences
    for r in range(PP):
        main = sorted((e for e in spans if e["pid"] == r and e["tid"] == 0), key=lambda e: e["ts"])
        for a, b in zip(main, main[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - 1.0, (a, b)
    bubble = trace["otherData"]["bubble"]
    assert 0.0 < bubble["measured_last"] < 1.0
    assert bubble["theory"] == pytest.approx((PP - 1) / (M + PP - 1))


def test_dp_buckets_traced(run):
    """Every gradient bucket's all-reduce appears once per step on each rank: in flight on the
    async lane, and its wait on the main lane."""
    trace = json.loads((run / "dp.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for cat, lane in (("dp_inflight", 1), ("dp_wait", 0)):
        got = {}
        for e in spans:
            if e["cat"] == cat:
                assert e["tid"] == lane, e
                got.setdefault((e["pid"], e["args"]["step"]), []).append(e["args"]["bucket"])
        assert set(got) == {(r, s) for r in range(2) for s in range(STEPS)}, got.keys()
        n_buckets = len(got[(0, 0)])
        assert n_buckets > 1  # tiny_config's 0.01 MiB buckets
        assert all(sorted(v) == list(range(n_buckets)) for v in got.values()), got


def test_timeline_png_written(run):
    data = (run / "ok.png").read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_plot_writes_png(run, tmp_path, capsys):
    out = tmp_path / "curves.png"
    assert cli_main(["plot", str(run / "ok.jsonl"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert cli_main(["plot", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridpar: error: metrics file") and "\n" not in err


def test_bubble_of_simulated_1f1b_is_the_theory():
    """Events of the simulator's run of 1F1B (forward 1, backward 2, free communication), fed
    through the tracer hook, must give exactly (p-1)/(m+p-1): the measurement is the theory's
    definition, not a per-rank or comm-inclusive variant."""
    from hybridpar.parallel.pipeline.schedules import build
    from hybridpar.parallel.pipeline.simulate import simulate
    from hybridpar.engine.trace import Tracer, bubble, theory

    p, m = 4, 8
    sim = simulate(build("1f1b", p, m, 1), p, 1)
    tracers = [Tracer(rank) for rank in range(p)]
    for e in sim.events:
        tracers[e.rank].on_action(e.action, e.start, e.end)
    events = [e for t in tracers for e in t.events]
    got = bubble(events, step=0)
    assert got["bubble"] == pytest.approx(theory(p, m), abs=1e-12)
    assert got["bubble"] == pytest.approx(sim.bubble_fraction, abs=1e-12)
    # the first stage waits (p-1) forward+backward slots in total, the last one too
    assert got["per_rank"][0] == pytest.approx(got["per_rank"][p - 1], abs=1e-12)


def _traced(sim, schedule, p, rank_offset=0, t_offset=0.0):
    """Tracer events of a simulated run, as the runtime's hook reports them: a comm batch's
    actions share (posted, done waiting), where a batch of deferred sends alone waits for
    nothing."""
    from hybridpar.engine.trace import Tracer
    from hybridpar.parallel.pipeline.schedules import steps

    when = {(e.rank, e.action): (e.start, e.end) for e in sim.events}
    tracers = [Tracer(rank_offset + r) for r in range(p)]
    for r in range(p):
        for batch in steps(schedule[r]):
            start = when[r, batch[0]][0]
            end = max((when[r, a][1] for a in batch if not a.op.is_send), default=start)
            for a in batch:
                tracers[r].on_action(a, start + t_offset, end + t_offset)
    return [e for t in tracers for e in t.events]


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_replay_reproduces_a_run_with_uneven_times_and_message_costs(schedule, v):
    """A run whose every action takes its own time and whose every message costs its own
    transfer (the simulator with random costs stands in for the machine), traced as the runtime
    reports it: the replay must recover each message's cost from the post times alone and give
    the run's bubble exactly (with messages taken as free it does not: checked by hand). Two
    replicas out of step with each other are two pipelines, each measured in its own window."""
    import random

    from hybridpar.engine.trace import pipeline_bubble, replay
    from hybridpar.parallel.pipeline.schedules import build
    from hybridpar.parallel.pipeline.simulate import simulate

    p, m = 4, 8
    sched = build(schedule, p, m, v)
    events, bubbles = [], []
    for k in range(2):
        rng = random.Random(k)
        cost = {}

        def duration(r, a):
            return cost.setdefault((r, a), rng.uniform(0.5, 1.5) * (2.0 if a.op.name == "BWD" else 1.0))

        def comm(r, a):  # one cost per message, the same at both ends
            from hybridpar.parallel.pipeline.simulate import message
            return cost.setdefault(message(r, a, p), rng.uniform(0.05, 0.4))

        sim = simulate(sched, p, v, duration=duration, comm_time=comm)
        bubbles.append(sim.bubble_fraction)
        events += _traced(sim, sched, p, rank_offset=k * p, t_offset=3.7 * k)
    stage_of = {r: r % p for r in range(2 * p)}
    pipelines = [list(range(p)), list(range(p, 2 * p))]
    assert pipeline_bubble(events, 0, pipelines)["bubble"] == pytest.approx(sum(bubbles) / 2, abs=1e-9)
    got = replay(events, stage_of=stage_of, pipelines=pipelines, schedule=schedule, pp=p,
                 microbatches=m, virtual_stages=v)
    for (measured, replayed), want in zip(got["pairs"], bubbles):
        assert measured == pytest.approx(want, abs=1e-9)
        assert replayed == pytest.approx(want, abs=1e-9)


def test_each_action_reports_its_thread_cpu_time():
    """``runner.action_cpu``, read in ``on_action``, is the thread CPU time of the action just
    done (``split_bench`` parts a stage's wall time into its compute and the waits for the
    cores): positive for every forward and backward, and never above the action's wall time,
    as one thread computes it."""
    import time

    from hybridpar.engine.train import Trainer
    from hybridpar.parallel.pipeline.schedules import Op
    from hybridpar.testing import single_mesh, tiny_dataset

    tr = Trainer(tiny_config(steps=1), single_mesh(), tiny_dataset())
    seen = []

    def on_action(a, t0, t1):
        if a.op in (Op.FWD, Op.BWD):
            seen.append((t1 - t0, tr.runner.action_cpu))
        end = time.thread_time() + 0.002  # CPU spent between actions: no action may count it
        while time.thread_time() < end:
            pass

    tr.runner.on_action = on_action
    tr.train_step()
    assert len(seen) == 2 * M
    assert all(0 < cpu <= wall + 1e-4 for wall, cpu in seen), seen
