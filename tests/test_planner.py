"""The planner: cost model against hand-computed values, the simulator against the schedules'
closed forms, memory against the runtime's activation meter, and the plan for a published run."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hybridpar.models.llama import flops_per_token
from hybridpar.cli.main import main
from hybridpar.config import ModelConfig
from hybridpar.parallel.pipeline.schedules import build, in_flight
from hybridpar.planner import timing
from hybridpar.planner.cluster import PRESETS, Cluster, Link, load_cluster, load_profile, save_profile
from hybridpar.planner.costs import (Plan, activations, collective_time, layer_flops, memory,
                                     peak_memory, ring_bytes, spans_nodes, step_flops)
from hybridpar.planner.costs import in_flight as in_flight_formula
from hybridpar.planner.search import MODELS, best_for, candidates, check, rank

SMALL = ModelConfig(n_layers=8, d_model=64, n_heads=4, n_kv_heads=2, d_ff=192, vocab_size=128, seq_len=16)
CPU = replace(PRESETS["cpu"], nodes=1, devices_per_node=8, cores=8)


def test_layer_flops_by_hand():
    # per token: q 2*64*64, k and v 2*64*32 each (2 kv heads of 16), o 2*64*64,
    # SwiGLU 3 * 2*64*192, attention scores and values 4*16*64
    per_token = 8192 + 4096 + 4096 + 8192 + 73728 + 4096
    assert layer_flops(SMALL, 10) == 10 * per_token
    assert layer_flops(SMALL, 10, tp=2) == 10 * per_token / 2
    n = 3 * SMALL.seq_len
    assert step_flops(SMALL, 3) == pytest.approx(flops_per_token(SMALL) * n)


def test_ring_bytes_and_alpha_beta():
    assert ring_bytes("all-reduce", 4, 1000) == 1500  # 2(n-1)/n
    assert ring_bytes("all-gather", 4, 1000) == 750
    assert ring_bytes("all-reduce", 1, 1000) == 0
    c = Cluster(name="t", intra=Link(1e-5, 1e9), inter=Link(1e-4, 1e8))
    assert collective_time(c, "all-reduce", 4, 1e6) == pytest.approx(6e-5 + 1.5e-3)  # ring
    assert collective_time(c, "all-reduce", 4, 1e3) == pytest.approx(4e-5 + 2e-6)  # tree wins
    assert collective_time(c, "reduce-scatter", 4, 1e6, inter=True) == pytest.approx(3e-4 + 7.5e-3)
    assert collective_time(c, "send/recv", 2, 1e6) == pytest.approx(1e-5 + 1e-3)


def test_axis_spans_nodes_in_rank_order():
    c = replace(PRESETS["a100-80g"], nodes=4, devices_per_node=8)
    p = Plan(dp=2, tp=4, pp=4, microbatches=4, mb_size=1)
    assert not spans_nodes(c, p, "tp") and not spans_nodes(c, p, "dp") and spans_nodes(c, p, "pp")
    assert spans_nodes(c, replace(p, dp=4, pp=2), "dp")


def _uniform(plan: Plan) -> tuple[float, float]:
    """The cost model's forward/backward seconds of a chunk of layers only."""
    layers = SMALL.n_layers // (plan.pp * plan.virtual_stages)
    f, b, *_ = timing._chunk_costs(SMALL, plan, CPU, layers=layers, embed=False, head=False, slow=1.0)
    return f, b


@pytest.mark.parametrize("name,p,M,v", [("1f1b", 4, 8, 1), ("1f1b", 2, 5, 1), ("gpipe", 4, 8, 1),
                                        ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 4)])
def test_simulated_bubble_matches_closed_form(name, p, M, v):
    plan = Plan(1, 1, p, M, 1, name, v)
    f, b = _uniform(plan)
    span, _, bubble, how = timing._makespan(name, p, M, v, (f,) * p * v, (b,) * p * v, 0.0, False)
    assert how == "simulate"
    assert bubble == pytest.approx((p - 1) / (v * M + p - 1))
    assert span == pytest.approx((v * M + p - 1) * (f + b))


@pytest.mark.parametrize("name,p,M,v", [("1f1b", 4, 16, 1), ("1f1b", 8, 32, 1), ("gpipe", 8, 16, 1),
                                        ("interleaved", 4, 16, 2), ("interleaved", 8, 32, 2)])
def test_closed_form_close_to_simulation_with_messages(name, p, M, v):
    f, b = 1.0, 2.0
    tc = 0.05 * (f + b)
    args = (name, p, M, v, (f / v,) * p * v, (b / v,) * p * v, tc)
    exact, quick = timing._makespan(*args, False)[0], timing._makespan(*args, True)[0]
    assert quick == pytest.approx(exact, rel=0.05)


def test_extrapolation_equals_full_simulation():
    p, M = 4, 300  # 2400 compute actions: beyond SIM_LIMIT
    fwd, bwd = (1.0, 1.1, 1.0, 1.3), (2.0, 2.2, 2.0, 2.6)
    span, _, _, how = timing._makespan("1f1b", p, M, 1, fwd, bwd, 0.1, False)
    assert how == "extrapolate"
    from hybridpar.parallel.pipeline.simulate import simulate
    full = simulate(build("1f1b", p, M), p, 1, duration=lambda r, a: (fwd if a.op.value == "F" else bwd)[r],
                    comm_time=lambda r, a: 0.1)
    assert span == pytest.approx(full.makespan, rel=1e-9)


@pytest.mark.parametrize("name,p,M,v", [("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1), ("interleaved", 4, 8, 2),
                                        ("interleaved", 2, 6, 3)])
def test_in_flight_formula_matches_schedule(name, p, M, v):
    sched = build(name, p, M, v)
    for s in range(p):
        assert in_flight_formula(Plan(1, 1, p, M, 1, name, v), s) == in_flight(sched[s])


def test_zero1_shards_optimizer_over_dp():
    plan = Plan(dp=4, tp=1, pp=1, microbatches=1, mb_size=1)
    full, sharded = memory(SMALL, plan, CPU), memory(SMALL, replace(plan, zero1=True), CPU)
    assert sharded["optimizer"] == pytest.approx(full["optimizer"] / 4, rel=0.01)
    assert sharded["params"] == full["params"] and sharded["grads"] == full["grads"]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_bytes_match_the_runtime_meter(recompute):
    from hybridpar.parallel.memory import ActivationMeter
    from hybridpar.models.transformer import Transformer
    from hybridpar.models import spec_for
    from hybridpar.parallel.parallelize import apply_recompute

    torch.manual_seed(0)
    model = Transformer(SMALL)
    apply_recompute(model, spec_for(SMALL), recompute)
    meter = ActivationMeter(model.parameters())
    x = torch.randn(4, SMALL.seq_len, SMALL.d_model, requires_grad=True)
    with meter.forward((0, 0)):
        model.layers["0"](x)
    # the cos/sin tables, saved once per chunk by RoPE's products; full recompute keeps none
    rope = 0 if recompute == "full" else 2 * SMALL.seq_len * SMALL.head_dim * 4
    want = activations(SMALL, Plan(1, 1, 1, 1, 4, recompute=recompute), 4, embed=False, head=False, layers=1)
    assert meter.peak - rope == pytest.approx(want, rel=0.01)


def test_invalid_layouts_are_rejected():
    c = replace(CPU, devices_per_node=8)
    assert "must divide n_kv_heads" in check(SMALL, Plan(2, 4, 1, 1, 1), c)
    assert "exceeds n_layers" in check(SMALL, Plan(1, 1, 8, 8, 1, "interleaved", 2), c)
    assert "inside a node" in check(SMALL, Plan(2, 4, 1, 1, 1), replace(c, nodes=4, devices_per_node=2))
    assert all(p.tp <= 2 and 32 % (p.dp * p.microbatches) == 0 for p in candidates(SMALL, c, 32))


def test_gpt3_175b_on_1024_a100s_matches_the_literature():
    """Narayanan et al. 2021 (Megatron-LM, SC21) ran GPT-3 175B on 1024 A100-80GB as tp=8
    (inside the node), pp=8, dp=16, batch 1536, full recomputation: 140 TFLOP/s per GPU, in
    their count of FLOPs 96 B s l h^2 (1 + s/6h + V/16lh), which includes the recomputed
    forward."""
    m, c = MODELS["gpt3-175b"], load_cluster("a100-80g", nodes=128, devices_per_node=8)
    rows, _ = rank(m, c, 1536, top=5)
    best = rows[0]
    assert best.fits and best.plan.tp in (4, 8) and best.plan.pp in (8, 16) and best.plan.dp > 1
    assert any((r.plan.tp, r.plan.pp, r.plan.dp) == (8, 8, 16) for r in rows[:3])
    pure_dp = Plan(dp=1024, tp=1, pp=1, microbatches=1, mb_size=1, recompute="full", zero1=True)
    assert peak_memory(m, pure_dp, c)["total"] > c.device_mem  # 175e9 * 8 B of params + grads
    published = best_for(m, c, Plan(16, 8, 8, 96, 1, "1f1b", recompute="full"))
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    flops = 96 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (16 * L * h))
    per_gpu = flops / published.pred.step_time / 1024
    assert published.fits
    assert per_gpu == pytest.approx(140e12, rel=0.10)
    assert 0.3 < best.mfu < 0.6


def test_profile_round_trip(tmp_path):
    path = str(tmp_path / "p.json")
    c = replace(CPU, collectives={"all-reduce": {2: [1e-4, 1e-9]}}, matmul={1: [(1e6, 1e10)], 2: [(1e6, 2e10)]})
    save_profile(c, path)
    assert load_profile(path) == c
    assert collective_time(c, "all-reduce", 2, 1e6) == pytest.approx(1e-4 + 1e-3)
    # a Gloo profile without a reduce-scatter fit (calibrated before the runtime's all-to-all
    # reduce-scatter): an all-reduce's latency on half its bytes
    assert collective_time(c, "reduce-scatter", 2, 1e6) == pytest.approx(1e-4 + 0.5e-3)
    fitted = replace(c, collectives={**c.collectives, "reduce-scatter": {2: [2e-4, 0.4e-9]}})
    assert collective_time(fitted, "reduce-scatter", 2, 1e6) == pytest.approx(2e-4 + 0.4e-3)


def test_shared_collectives_apply_when_the_world_is_larger_than_the_group(tmp_path):
    """A pair's all-reduce costs what was measured for pairs among k ranks sharing the cores,
    and the lone pair's fit when the pair is the world."""
    c = replace(CPU, collectives={"all-reduce": {2: [1e-4, 1e-9], 4: [3e-4, 2e-9]}},
                collectives_shared={"all-reduce": {4: {2: [5e-4, 1e-9]}, 8: {2: [2e-3, 3e-9], 4: [4e-3, 4e-9]}}})
    path = str(tmp_path / "p.json")
    save_profile(c, path)
    assert load_profile(path) == c
    assert collective_time(c, "all-reduce", 2, 1e6, world=2) == pytest.approx(1e-4 + 1e-3)
    assert collective_time(c, "all-reduce", 2, 1e6, world=4) == pytest.approx(5e-4 + 1e-3)
    assert collective_time(c, "all-reduce", 2, 1e6, world=8) == pytest.approx(2e-3 + 3e-3)
    assert collective_time(c, "all-reduce", 4, 1e6, world=8) == pytest.approx(4e-3 + 4e-3)
    assert collective_time(c, "all-reduce", 4, 1e6, world=4) == pytest.approx(3e-4 + 2e-3)
    assert collective_time(c, "all-reduce", 2, 1e6, world=16) == pytest.approx(2e-3 + 3e-3)  # the largest k
    # between measured world sizes (a pipeline keeps only part of the world busy): linear in k
    assert collective_time(c, "all-reduce", 2, 1e6, world=3) == pytest.approx(3e-4 + 1e-3)
    assert collective_time(c, "all-reduce", 2, 1e6, world=6) == pytest.approx(1.25e-3 + 2e-3)
    gpu = replace(c, cores=0)  # one device per rank: nothing is shared
    assert collective_time(gpu, "all-reduce", 2, 1e6, world=8) == pytest.approx(1e-4 + 1e-3)


def test_collective_latency_grows_with_the_compute_between_calls(tmp_path):
    """A fit [alpha, beta, alpha0, gap]: back to back (gap 0) a call pays alpha0, after the
    calibrated gap or more alpha, linearly between; beta does not change. Among more busy ranks
    all four are interpolated in the world size. A profile without alpha0 ([alpha, beta]) costs
    alpha at any gap."""
    c = replace(CPU, collectives={"all-reduce": {2: [3e-3, 1e-9, 1e-3, 4e-3]}},
                collectives_shared={"all-reduce": {4: {2: [5e-3, 1e-9, 3e-3, 8e-3]}}})
    path = str(tmp_path / "p.json")
    save_profile(c, path)
    assert load_profile(path) == c
    t = lambda gap, world=0: collective_time(c, "all-reduce", 2, 1e6, world=world, gap=gap)  # noqa: E731
    assert t(None) == pytest.approx(3e-3 + 1e-3)  # no gap given: as calibrated
    assert t(0.0) == pytest.approx(1e-3 + 1e-3)
    assert t(2e-3) == pytest.approx(2e-3 + 1e-3)
    assert t(4e-3) == t(1.0) == pytest.approx(3e-3 + 1e-3)
    assert t(4e-3, world=4) == pytest.approx(4e-3 + 1e-3)  # half of the 8 ms gap among 4 ranks
    assert t(4e-3, world=3) == pytest.approx(2e-3 + 2e-3 * 4 / 6 + 1e-3)  # alpha 4, alpha0 2, gap 6 ms
    old = replace(c, collectives={"all-reduce": {2: [3e-3, 1e-9]}}, collectives_shared={})
    assert collective_time(old, "all-reduce", 2, 1e6, gap=0.0) == pytest.approx(3e-3 + 1e-3)


def test_cli_plan_prints_a_table(capsys):
    rc = main(["plan", "--model", "gpt3-175b", "--cluster", "a100-80g", "--nodes", "128",
               "--devices-per-node", "8", "--global-batch", "1536", "--top", "3", "--print-command"])
    out = capsys.readouterr().out
    assert rc == 0 and "MFU" in out and "fits" in out
    assert "hybridpar train --dp" in out and "--model.n_layers=96" in out


def test_cli_plan_impossible_request_is_one_line(capsys):
    rc = main(["plan", "--devices-per-node", "7"])  # dp=7 divides no batch of 32, pp=7 > 6 layers
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("hybridpar: error: no valid layout") and "\n" not in err
    assert main(["plan", "--cluster", "nowhere"]) == 2


def test_apply_refuses_a_multi_node_plan(capsys):
    rc = main(["plan", "--model", "llama-7b", "--cluster", "h100-80g", "--nodes", "2",
               "--global-batch", "64", "--top", "2", "--apply"])
    out, err = capsys.readouterr()
    assert rc == 2 and "torchrun --nnodes 2" in out and "every node" in err


def test_alpha_beta_fit_recovers_a_line():
    from hybridpar.tools.calibrate import _fit

    alpha, beta = _fit([(b, 2e-4 + b * 1e-9) for b in (4e3, 6.4e4, 5e5, 2e6, 8e6)])
    assert alpha == pytest.approx(2e-4, rel=1e-6) and beta == pytest.approx(1e-9, rel=1e-6)


def test_calibration_takes_the_timings_it_compares_in_turns():
    """A difference of two timings (cold - hot weights, backward - forward) or a ratio (k ranks
    against one) must not carry the machine's drift between them: their repetitions alternate."""
    from hybridpar.tools.calibrate import _timeit_many

    calls = []
    a, b = _timeit_many([lambda: calls.append("a"), lambda: calls.append("b")], min_s=0.0, reps=3)
    assert calls == ["a", "b"] * 4 and a > 0 and b > 0  # a warm-up call each, then in turns


def test_the_convolution_table_has_a_row_per_width():
    """Each (channels, size, stride) of the grid gives one forward and one backward entry, tagged
    with its width (the planner interpolates between widths) and stride, the backward at twice
    the FLOPs; a strided shape is the downsampling C -> 2C to half the size."""
    from hybridpar.tools.calibrate import CONV_SHAPES, conv_table

    assert {c for c, _, _ in CONV_SHAPES} == {4, 8, 16, 32, 64, 128, 256}
    assert {s for _, _, s in CONV_SHAPES} == {1, 2}
    fwd, bwd = conv_table(1, draws=2, shapes=((4, 4, 1), (8, 4, 1), (4, 8, 2)))
    assert sorted((f, c, s) for f, _, c, s in fwd) == sorted(
        [(2.0 * 8 * 4 * 4 * 9 * 16, 4, 1), (2.0 * 8 * 8 * 8 * 9 * 16, 8, 1), (2.0 * 8 * 4 * 8 * 9 * 16, 32 ** 0.5, 2)])
    assert sorted((f, c, s) for f, _, c, s in bwd) == sorted((2 * f, c, s) for f, _, c, s in fwd)
    assert all(r > 0 for _, r, _, _ in fwd + bwd)


def test_a_profile_keeps_the_speed_it_was_measured_at(tmp_path):
    """The benches print the machine's speed against the profile's, so that a prediction's
    error can be read against the drift of the machine it was measured on."""
    from hybridpar.tools.calibrate import speed_drift

    path = str(tmp_path / "p.json")
    save_profile(replace(PRESETS["cpu"], probe_s=0.040), path)
    c = load_profile(path)
    assert c.probe_s == 0.040
    assert "50.0 ms now, 40.0 ms at calibration (+25%)" in speed_drift(c, probe=0.050)
    assert "no reference timing" in speed_drift(PRESETS["cpu"], probe=0.050)


def test_oversubscription_runs_one_pool_of_processes_in_turns():
    from hybridpar.tools.calibrate import _optimizer_work, oversubscription

    slow = oversubscription((1, 2), seconds=0.05, rounds=2, work=_optimizer_work)
    assert slow[1] == 1.0 and 0.3 < slow[2] < 10


def test_pipeline_messages_cost_core_time_on_a_shared_cpu():
    """On one machine Gloo's send/recv copies each message through the loopback socket on both
    ends, on the cores the ranks compute on: a stage pays bytes / the p2p bandwidth for each
    message it receives or sends, in the forward (activations) and the backward (their
    gradients). A GPU's stages do not share cores, and pp=1 has no messages."""
    m = ModelConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=32)
    cpu = replace(PRESETS["cpu"], devices_per_node=4, cores=2, intra=Link(1e-4, 1e9))
    plan = Plan(dp=1, tp=1, pp=4, mb_size=2, microbatches=4)
    model = timing.costing(m, plan, cpu)
    one = 2 * 32 * 64 * cpu.dtype_bytes / 1e9  # seconds to copy one message
    assert model.boundaries() == [model.message()] * 3 + [0.0]
    assert timing._message_cpu(model, plan, cpu) == pytest.approx([one, 2 * one, 2 * one, one])
    gpu = PRESETS["h100-80g"]
    assert timing._message_cpu(timing.costing(m, plan, gpu), plan, gpu) == [0.0] * 4
    flat = Plan(dp=4, tp=1, pp=1, mb_size=2, microbatches=1)
    assert timing._message_cpu(timing.costing(m, flat, cpu), flat, cpu) == [0.0]


def test_pipeline_messages_take_calibrated_core_time_from_the_stages(tmp_path):
    """With ``p2p_cpu`` calibrated, each send and receive is core work in the simulator (on
    the cores the stages compute on) and the message itself costs its back-to-back latency:
    at pp=4 on 2 cores the step grows. The calibrated
    table is read at the busy ranks (linear between its points) and survives a save and load."""
    c = replace(PRESETS["cpu"], nodes=1, devices_per_node=4, cores=2,
                oversubscription={1: 1.0, 2: 1.0, 4: 2.0})
    with_cpu = replace(c, p2p_cpu={2: 1e-4, 4: 5e-4})
    assert with_cpu.p2p_core_seconds(3.0) == pytest.approx(3e-4)
    assert with_cpu.p2p_core_seconds(1.0) == pytest.approx(1e-4)
    assert with_cpu.p2p_core_seconds(8.0) == pytest.approx(5e-4)
    assert c.p2p_core_seconds(4.0) == 0.0
    save_profile(with_cpu, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").p2p_cpu == {2: 1e-4, 4: 5e-4}
    plan = Plan(1, 1, 4, 8, 2)
    model = timing.costing(SMALL, plan, with_cpu)
    msg = model.message()
    assert timing._message_time(model, plan, with_cpu, 4.0, shared=True) == pytest.approx(
        collective_time(with_cpu, "send/recv", 2, msg, world=2.0, gap=0.0) + c.overhead["comm"])
    assert timing._shared_inputs(model, plan, with_cpu, 4.0)[3]["post"] == pytest.approx(5e-4)
    assert timing._shared_inputs(model, plan, c, 4.0)[3]["post"] == 0.0
    assert timing.predict_time(SMALL, plan, with_cpu).makespan > timing.predict_time(SMALL, plan, c).makespan
    for name, pp, v, M in (("gpipe", 2, 1, 4), ("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8)):
        # the busy ranks count the ops' core time: one send and one receive per message
        p_ = Plan(1, 1, pp, M, 2, schedule=name, virtual_stages=v)
        ops = sum(a.op.is_comm for acts in build(name, pp, M, v) for a in acts)
        assert timing._post_share(p_, 1.0, 1.0) * pp == ops
    flat = Plan(4, 1, 1, 1, 2)  # no pipeline, no messages
    assert timing.predict_time(SMALL, flat, with_cpu).step_time == timing.predict_time(SMALL, flat, c).step_time


def test_dp_overlap_needs_an_idle_core():
    """The dp buckets launched during the last backward hide behind it on a GPU (its NCCL
    kernels run beside the compute); on a CPU whose cores the ranks fill, the reduction runs on
    the cores the backward uses, and the whole all-reduce is exposed."""
    from hybridpar.planner.costs import Plan, collective_time

    n, plan = 20_000_000, Plan(2, 1, 1, 4, 4)
    gpu = replace(PRESETS["h100-80g"], nodes=1, devices_per_node=2)
    cpu = replace(PRESETS["cpu"], nodes=1, devices_per_node=2, cores=2)
    for c, hidden in ((gpu, True), (cpu, False)):
        sync = collective_time(c, "all-reduce", 2, 4.0 * n, world=plan.world)
        _, exposed = timing._post_schedule(n, plan, c, last_bwd=10.0, slow=1.0)
        assert (exposed < 0.5 * sync) if hidden else exposed == pytest.approx(sync), (c.name, exposed, sync)


def test_a_cpu_pipeline_shares_the_cores_between_its_stages():
    """On one core (two ranks at half speed each) the pipeline's compute is conserved: the
    schedule takes at least the stages' total work alone, and at most that plus the messages on
    the critical path (the core idles only while a message is in flight). A stage's slow-down
    follows how many stages compute beside it, not one average for the run."""
    from hybridpar.planner.costs import Plan, collective_time

    c = replace(PRESETS["cpu"], nodes=1, devices_per_node=2, cores=1,
                oversubscription={1: 1.0, 2: 2.0})
    assert timing._rates(c, Plan(1, 1, 2, 4, 2)) == pytest.approx((1.0, 1.0, 0.5))
    assert timing._rates(c, Plan(2, 1, 2, 4, 2)) == pytest.approx((0.5, 0.5, 0.25))
    for split_layers, M in ((8, 4), (8, 8)):
        m = replace(SMALL, n_layers=split_layers)
        plan = Plan(1, 1, 2, M, 2)
        pred = timing.predict_time(m, plan, c)
        chunks = timing.costing(m, plan, c).chunks(1.0, 2.0)
        work = M * sum(f + b for f, b, *_ in chunks)
        tc = collective_time(c, "send/recv", 2, timing.costing(m, plan, c).message(), world=2.0)
        assert work * (1 - 1e-9) <= pred.makespan <= work + 2 * (M + 1) * (tc + c.overhead["comm"])
    gpu = replace(PRESETS["h100-80g"], nodes=1, devices_per_node=2)  # a device per rank: no sharing
    plan = Plan(1, 1, 2, 4, 2)
    chunks = timing.costing(SMALL, plan, gpu).chunks(1.0, 2.0)
    assert timing.predict_time(SMALL, plan, gpu).makespan < 4 * sum(f + b for f, b, *_ in chunks)


def test_ranks_bound_to_one_core_share_it_while_another_idles():
    """Ranks bound to cores (``launch.core_share``: local rank i on core i % cores): 4 stages on
    2 cores put stages 0 and 2 on core 0. Two working stages on one core go at half speed while
    the other core idles; on a core each, or all four balanced, they go at the calibrated rate of
    that many working ranks (``_rates``); with more cores than ranks nobody shares."""
    rates = (1.0, 1.0, 1.0, 1.0 / 1.5, 1.0 / 2.2)  # slow-down 1, 1, 1.5, 2.2 at 1..4 ranks
    four = timing._bound_speeds(rates, 1, 2, 4, 1)
    assert four((0, 1)) == pytest.approx((1.0, 1.0))
    assert four((0, 2)) == pytest.approx((0.5, 0.5))
    assert four((0, 1, 2)) == pytest.approx((0.5, 1.0, 0.5))  # core 1 has stage 1 alone
    assert four((0, 1, 2, 3)) == pytest.approx((rates[4],) * 4)
    # 2 stages of 2 lockstep ranks (dp=2) on 2 cores: each stage spans both cores
    assert timing._bound_speeds(rates, 2, 2, 4, 1)((0, 1)) == pytest.approx((rates[2],) * 2)
    assert timing._bound_speeds(rates, 1, 4, 2, 2)((0, 1)) == pytest.approx((1.0, 1.0))


def test_the_optimizer_shares_the_machine_by_its_own_calibrated_slow_down():
    """Every rank steps its optimizer at once. A CPU profile that measured k concurrent updates
    (``oversubscription_mem``) slows the update by that figure for the world's ranks, not by
    the compute's; a profile without it keeps the compute's (what it always did)."""
    m = ModelConfig()
    c = replace(PRESETS["cpu"], devices_per_node=4, cores=2, oversubscription={1: 1.0, 2: 1.0, 4: 2.0, 8: 4.0})
    plan = Plan(4, 1, 1, 1, 4)
    n = timing.stage_params(m, plan, 0)[0]
    base = timing.predict_time(m, plan, c).step_time
    shared = timing.predict_time(m, plan, replace(c, oversubscription_mem={1: 1.0, 2: 1.5, 4: 3.0, 8: 6.0})).step_time
    assert shared - base == pytest.approx(n * c.overhead["param"] * (3.0 - 2.0), rel=1e-6)


def test_calibrate_measures_the_core_time_of_point_to_point_ops():
    """The collectives' calibration, on 2 real Gloo ranks: besides each op's fit it reports the
    core seconds a send or receive costs beyond the wall time (process CPU of the loop with the
    op minus without), positive and below the op's own in-situ time budget."""
    import os

    from hybridpar.engine.launch import spawn
    from hybridpar.tools.calibrate import _collectives_worker

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    fits = spawn(_collectives_worker, 2, [4 << 10, 64 << 10], 2, 2)[0]
    cpu = fits.pop("p2p_cpu")
    assert set(fits) == {"all-reduce", "reduce-scatter", "all-gather", "send/recv"}
    assert all(len(f) == 4 for f in fits.values())
    assert 0.0 < cpu < 0.05, cpu
