"""The planner for any model: meta-device profiles against hand formulas and the runtime's own
activation meter, the profile-based cost model against the Llama's closed forms, the automatic
pipeline split, and ``hybridpar plan`` for the ViT, the ResNet and a user's spec."""
from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hybridpar.models import ModelSpec, spec_for
from hybridpar.planner import spec_model as sm
from hybridpar.planner.cluster import load_cluster
from hybridpar.planner.costs import Plan, activations, layer_flops, peak_memory
from hybridpar.planner.profile import profile_spec
from hybridpar.planner.timing import predict_time

B, C, H = 2, 3, 8  # images of the toy model


class _Toy(nn.Module):
    """conv -> flatten -> linear -> linear: units whose FLOPs have textbook formulas."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, 4, 3, padding=1)
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(4 * H * H, 32))
        self.out = nn.Linear(32, 10)


def _toy_spec() -> ModelSpec:
    return ModelSpec(name="toy", build=_Toy, stem=("conv",), blocks=("fc",), head=("out",),
                     loss=lambda out, y: F.cross_entropy(out, y), data="digits")


def _toy_example(b):
    return torch.zeros(b, C, H, H), torch.zeros(b, dtype=torch.long)


def test_linear_and_conv_flops_equal_the_hand_formulas():
    prof = profile_spec(_toy_spec(), _toy_example)
    conv, fc, out = prof.units
    # forward, per sample: a conv is 2 * C_out * H * W * C_in * k * k, a linear 2 * in * out
    assert sum(conv.fwd["none"].matmuls) == 2 * 4 * H * H * C * 3 * 3
    assert sum(fc.fwd["none"].matmuls) == 2 * 256 * 32
    assert sum(out.fwd["none"].matmuls) == 2 * 32 * 10
    # backward: the weight gradient and (past the first unit) the input gradient, each as many
    # FLOPs as the forward; the batch's images need no gradient
    assert sum(conv.bwd["none"].matmuls) == 1 * sum(conv.fwd["none"].matmuls)
    assert sum(fc.bwd["none"].matmuls) == 2 * sum(fc.fwd["none"].matmuls)
    # parameters and the message after each unit
    assert conv.params == 4 * C * 9 + 4 and fc.params == 256 * 32 + 32
    assert conv.out_bytes.at(B) == B * 4 * H * H * 4 and fc.out_bytes.at(B) == B * 32 * 4


def test_matmuls_read_the_weights_made_before_the_pass():
    """``Pass.weights``: what the matmuls read that is neither made in the pass nor grows with
    the batch. A linear's forward reads its weight and bias, its backward the weight once (the
    input gradient; the weight gradient reads activations); the Llama block's seven weights
    likewise, its projections unfused as on a CPU in fp32 (``fused_linear`` concatenates them in
    the pass, read hot, on a GPU or under autocast). The time is those bytes at the calibrated
    bandwidth, added to the FLOPs' time."""
    prof = profile_spec(_toy_spec(), _toy_example)
    _, fc, out = prof.units
    assert fc.fwd["none"].weights == (256 * 32 + 32) * 4 and fc.bwd["none"].weights == 256 * 32 * 4
    assert out.fwd["none"].weights == (32 * 10 + 10) * 4 and out.bwd["none"].weights == 32 * 10 * 4
    m = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=32)
    spec = spec_for(m)
    block = profile_spec(spec, sm.example_batch(spec, m)).unit("layers.0")
    every = (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64) * 4  # wq wk wv wo w1 w3 w2
    assert block.fwd["none"].weights == every and block.bwd["none"].weights == every
    c = load_cluster("cpu")
    cold = replace(c, weight_bw={1: 1e9})
    kw = dict(threads=1, slow=1.0, tp=1, world=0)
    base = sm.pass_time(fc, "fwd", "none", c, B, **kw)[0]
    assert sm.pass_time(fc, "fwd", "none", cold, B, **kw)[0] == pytest.approx(base + (256 * 32 + 32) * 4 / 1e9)


def test_attention_block_flops_equal_the_hand_formula():
    """The Llama block (GQA, SwiGLU) against ``costs.layer_flops`` (2nkm per matmul, 4 n s h e
    for the attention core), and its backward: 2x every matmul, 2.5x the attention kernel
    (flash backward recomputes q k^T)."""
    m = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=32)
    spec = spec_for(m)
    prof = profile_spec(spec, sm.example_batch(spec, m))
    block = prof.unit("layers.0")
    fwd = block.fwd["none"]
    assert sum(fwd.matmuls) == layer_flops(m, m.seq_len)
    core = 4 * m.seq_len * m.seq_len * m.n_heads * m.head_dim
    assert core in fwd.matmuls
    assert sum(fwd.timed) == sum(fwd.matmuls) - core / 2  # causal: the masked half skipped
    assert sum(block.bwd["none"].matmuls) == 2 * (sum(fwd.matmuls) - core) + 2.5 * core
    # full recomputation runs the forward again inside the backward, up to the last tensor the
    # backward needs (torch's checkpoint stops there): all but the last matmul, w2
    assert sum(block.bwd["full"].matmuls) == sum(block.bwd["none"].matmuls) + sum(fwd.matmuls[:-1])


def _measured_activations(spec: ModelSpec, example, recompute: str, b: int) -> int:
    """The runtime meter around a one-stage forward and loss, on real CPU tensors."""
    from hybridpar.parallel.batchnorm import sync_batchnorm
    from hybridpar.parallel.memory import ActivationMeter
    from hybridpar.parallel.parallelize import Stage, apply_recompute
    from hybridpar.parallel.tensor_parallel.layers import cross_entropy

    torch.manual_seed(0)
    model = spec.build()
    sync_batchnorm(model, None)
    apply_recompute(model, spec, recompute)
    stage = Stage(model, list(spec.units), device_type="cpu")
    inputs, targets = example(b)
    meter = ActivationMeter(model.parameters())
    with meter.forward(0):
        out = stage(inputs)
        loss = spec.loss(out, targets) if callable(spec.loss) else cross_entropy(out, targets)
    loss.backward()
    return meter.by_key[0]


@pytest.mark.parametrize("name", ["llama", "vit", "resnet", "user"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_profiled_activations_equal_the_runtime_meter(name, recompute):
    if name == "user":
        from examples.digits_cnn import spec as user_spec
        m = ModelConfig(d_model=8, n_layers=3)
        spec = user_spec(m)
    else:
        m = ModelConfig(name=name, n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64,
                        seq_len=16, base_channels=8)
        spec = spec_for(m)
    model = sm.SpecModel(m, spec)
    c = load_cluster("cpu")
    for b in (1, 3):  # the profile is fitted at b = 1, 2: b = 3 checks the fit
        plan = Plan(1, 1, 1, 1, b, recompute=recompute)
        predicted = sm.chunk_activations(model, plan, c, list(spec.units))
        assert predicted == _measured_activations(spec, model.example, recompute, b), (b, recompute)


def test_the_profile_agrees_with_the_llama_closed_forms():
    """Memory within 1% (the closed form leaves out RoPE's cos/sin tables, the profile counts
    them as the meter does); time within 10%: the closed form takes the backward's elementwise
    work as twice the forward's, the profile counts it (about 1.5x) - the two models differ
    only there, and the calibration absorbs such a constant factor on the Llama."""
    m = ModelConfig()
    model = sm.SpecModel(m)
    c = load_cluster("cpu", nodes=1, devices_per_node=4)
    for plan, cl in itertools.product(
            [Plan(4, 1, 1, 1, 4), Plan(2, 2, 1, 2, 4), Plan(1, 2, 2, 4, 2, sequence_parallel=True),
             Plan(1, 1, 4, 4, 4, recompute="full"), Plan(2, 1, 2, 4, 2, recompute="selective", zero1=True)],
            # and with weights read cold (a tenth of a step), and a forward that takes 60% of
            # the per-layer overhead (calibrated: its ops cost more than the backward's)
            [c, replace(c, weight_bw={1: 2e9}),
             replace(c, overhead={**c.overhead, "layer_fwd": 0.6 * c.overhead["layer"]})]):
        a, b = predict_time(m, plan, cl).step_time, predict_time(model, plan, cl).step_time
        assert abs(b / a - 1) < 0.10, (plan, a, b)
        ma, mb = peak_memory(m, plan, c)["total"], peak_memory(model, plan, c)["total"]
        assert abs(mb / ma - 1) < 0.01, (plan, ma, mb)
        # the activation terms alone, chunk by chunk: the meter's count, less the cos/sin tables
        act = activations(m, plan, c.dtype_bytes, embed=False, head=False, layers=1)
        block = sm.chunk_activations(model, plan, c, ["layers.0"])
        rope = 0 if plan.recompute == "full" else 2 * m.seq_len * m.head_dim * 4  # cos, sin
        assert block - rope == pytest.approx(act, rel=1e-9), plan


def _brute_force(costs, parts, first, last):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = (0, *cuts, len(costs))
        stages = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stages[0] += first
        stages[-1] += last
        if best is None or max(stages) < best:
            best = max(stages)
    return best


def test_balanced_split_minimises_the_slowest_stage():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [rng.uniform(0.1, 5) for _ in range(n)]
        first, last = rng.uniform(0, 3), rng.uniform(0, 3)
        split = sm.balanced_split(costs, parts, first=first, last=last)
        assert len(split) == parts and sum(split) == n and min(split) >= 1
        bounds = [0]
        for x in split:
            bounds.append(bounds[-1] + x)
        stages = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stages[0] += first
        stages[-1] += last
        assert max(stages) == pytest.approx(_brute_force(costs, parts, first, last))
    with pytest.raises(ValueError):
        sm.balanced_split([1.0, 2.0], 3)


def test_uneven_blocks_are_split_by_cost_even_ones_by_count():
    c = load_cluster("cpu")
    resnet = ModelConfig(name="resnet", n_layers=6)
    cfg = Config(model=resnet, parallel=ParallelConfig(dp=1, pp=2), train=TrainConfig(global_batch=8))
    split, note = sm.pipeline_split(cfg, spec_for(resnet))
    assert note.startswith("auto") and sum(split) == 6
    # the chosen split's slowest stage is no slower than the even split's, by the same costs
    model = sm.SpecModel(resnet)
    plan = Plan(1, 1, 2, 1, 8)
    times = {k: f + b for k, (f, b, *_) in sm.unit_times(model, plan, c, tp=1).items()}
    spec = model.spec

    def slowest(s):
        return max(sum(times[u] for u in units) for units in spec.stage_units(list(s)))

    assert slowest(split) <= slowest([3, 3])
    # equal blocks: by count, unless auto is asked for; an explicit split is used as given
    llama = Config(parallel=ParallelConfig(dp=1, pp=2))
    assert sm.pipeline_split(llama, spec_for(llama.model)) == ([3, 3], "by count (the blocks cost the same)")
    auto = Config(parallel=ParallelConfig(dp=1, pp=2, pp_split="auto"))
    split, note = sm.pipeline_split(auto, spec_for(auto.model))
    assert note.startswith("auto") and split[0] >= 3  # the head (vocabulary) weighs on the last stage
    given = Config(model=resnet, parallel=ParallelConfig(dp=1, pp=2, pp_split="1,5"))
    assert sm.pipeline_split(given, spec_for(resnet)) == ([1, 5], "as given")


def test_auto_split_on_a_model_the_meta_device_cannot_run_is_one_clear_error():
    from hybridpar.config import ConfigError

    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def boom(x):
        raise RuntimeError("data-dependent")

    def build():
        m = Bad()
        m.a.forward = boom
        return m

    spec = ModelSpec(name="bad", build=build, stem=(), blocks=("a", "b"), head=(),
                     loss=lambda o, y: o.sum(), data="digits")
    cfg = Config(parallel=ParallelConfig(dp=1, pp=2, pp_split="auto"))
    with pytest.raises(ConfigError, match="parallel.pp_split=auto: model 'bad' could not be profiled"):
        sm.pipeline_split(cfg, spec)
    cfg = Config(parallel=ParallelConfig(dp=1, pp=2))
    assert sm.pipeline_split(cfg, spec) == ([1, 1], "by count (the blocks could not be profiled: RuntimeError)")


@pytest.mark.parametrize("argv", [
    ["--model.name=resnet", "--cluster", "a100-80g", "--nodes", "1", "--global-batch", "64",
     "--model.n_layers=8", "--model.image_size=32", "--model.channels=3", "--max-mb", "4"],
    ["--model.name=vit", "--cluster", "h100-80g", "--nodes", "2", "--global-batch", "256",
     "--model.n_layers=12", "--model.d_model=768", "--model.n_heads=12", "--model.n_kv_heads=12",
     "--model.d_ff=3072", "--model.image_size=224", "--model.patch_size=16", "--model.channels=3",
     "--model.n_classes=1000"],
    ["--model.spec=examples.digits_cnn:spec", "--cluster", "cpu", "--devices-per-node", "4",
     "--global-batch", "16", "--model.d_model=8", "--model.n_layers=4"],
])
def test_plan_ranks_layouts_of_any_model(argv, capsys):
    from hybridpar.cli.plan import plan_main

    assert plan_main(argv + ["--top", "3", "--print-command"]) == 0
    out = capsys.readouterr().out
    assert "profiled on the meta device" in out and "valid layouts" in out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 3 and all(r.rstrip().endswith(("yes", "NO")) for r in rows)
    assert "img/s" in out
    command = out.strip().splitlines()[-1]
    assert "hybridpar train" in command and (argv[0] in command or argv[0].replace("=", " ") in command)


def test_a_vision_model_is_planned_as_it_is_trained_data_parallel_on_large_micro_batches(capsys):
    """ViT-B/16 (86 M parameters) on a node of 8 A100s, 1024 images a step: trained data
    parallel with the whole per-device batch in one micro-batch (ViT and DeiT were), not split
    into accumulation steps whose gradient all-reduce nothing hides. ``--max-mb`` is unlimited
    by default for models other than the Llama (whose samples are long sequences)."""
    from hybridpar.cli.plan import plan_main

    assert plan_main(["--model.name=vit", "--cluster", "a100-80g", "--nodes", "1", "--global-batch",
                      "1024", "--model.n_layers=12", "--model.d_model=768", "--model.n_heads=12",
                      "--model.n_kv_heads=12", "--model.d_ff=3072", "--model.image_size=224",
                      "--model.patch_size=16", "--model.channels=3", "--model.n_classes=1000",
                      "--top", "1"]) == 0
    best = next(line for line in capsys.readouterr().out.splitlines() if line[:3].strip() == "1")
    assert best.split()[1:6] == ["8", "1", "1", "128x1", "1f1b"], best


def test_plan_command_gives_the_split_it_predicted(capsys):
    """A pipelined best plan prints its stage times and passes its split to the run."""
    from hybridpar.cli.plan import plan_main

    assert plan_main(["--model.name=resnet", "--cluster", "cpu", "--devices-per-node", "2",
                      "--global-batch", "8", "--model.n_layers=6", "--pp", "2",
                      "--print-command", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "best layout's pipeline stages:" in out, out
    assert "--parallel.pp_split=" in out.splitlines()[-1]


def test_convolutions_are_timed_at_the_calibrated_convolution_rate(tmp_path):
    """A profile keeps convolution calls apart; a cluster with a convolution table times them
    by it (saved and loaded with the profile), one without by the matmul table."""
    from dataclasses import replace

    from hybridpar.planner.cluster import load_profile, save_profile

    prof = profile_spec(_toy_spec(), _toy_example)
    conv = prof.units[0]
    width = (4 * C) ** 0.5  # channels per group: the geometric mean of the weight's out and in
    assert conv.fwd["none"].convs == ((2 * 4 * H * H * C * 3 * 3, width, 1),) and conv.fwd["none"].timed == ()
    c = load_cluster("cpu")
    slow = replace(c, conv={1: [(1e3, 1e8), (1e9, 1e9)]})
    path = tmp_path / "p.json"
    save_profile(slow, str(path))
    loaded = load_profile(str(path))
    assert loaded.conv == {1: [(1e3, 1e8), (1e9, 1e9)]}
    assert loaded.conv_rate(1e6) < c.conv_rate(1e6) == c.flop_rate(1e6)
    assert loaded.conv_rate(1e6, channels=8.0) == loaded.conv_rate(1e6)  # no widths calibrated
    # widths calibrated: each width's row interpolated in log(flops), then between the widths
    # around the call's in log(channels), clamped at the narrowest and the widest
    wide = replace(c, conv={1: [(1e3, 1e8, 4), (1e9, 1e9, 4), (1e3, 4e8, 64), (1e9, 4e9, 64)]})
    save_profile(wide, str(path))
    wide = load_profile(str(path))
    assert wide.conv_rate(1e6, channels=4) == pytest.approx(5.5e8)
    assert wide.conv_rate(1e6, channels=64) == pytest.approx(2.2e9)
    assert wide.conv_rate(1e6, channels=16) == pytest.approx((5.5e8 + 2.2e9) / 2)
    assert wide.conv_rate(1e6, channels=2) == wide.conv_rate(1e6, channels=4)
    assert wide.conv_rate(1e6, channels=512) == wide.conv_rate(1e6, channels=64)
    # below a width's smallest entry: the same kernel on fewer pixels, its time on the line
    # through the two smallest entries (not the matmul table's constant launch cost)
    t0, t1 = 1e3 / 1e8, 1e9 / 1e9
    assert wide.conv_rate(500, channels=4) == pytest.approx(500 / (t0 + (t1 - t0) * (500 - 1e3) / (1e9 - 1e3)))
    assert loaded.conv_rate(500) == pytest.approx(1e8 * 500 / 1e3)  # no widths: the launch cost
    t = sm.pass_time(conv, "fwd", "none", loaded, 2, threads=1, slow=1.0, tp=1, world=0)[0]
    t0 = sm.pass_time(conv, "fwd", "none", c, 2, threads=1, slow=1.0, tp=1, world=0)[0]
    assert t > t0


def test_a_strided_convolution_is_timed_at_the_strided_rows():
    """The profile records a downsampling convolution's stride (the backward's too), and the rate
    comes from the table's rows of that stride; a patch embedding (stride = kernel), a 1x1
    strided shortcut and a transposed convolution count as stride 1. A profile with no strided
    rows (from before they were calibrated) times every convolution by the stride-1 rows."""
    from dataclasses import replace

    class Down(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, stride=2, padding=1)
            self.patch = nn.Conv2d(8, 8, 2, stride=2)
            self.short = nn.Conv2d(8, 8, 1, stride=2)
            self.up = nn.ConvTranspose2d(8, 4, 8, stride=8)

        def forward(self, x):
            return self.up(self.short(self.patch(self.conv(x))))

    spec = ModelSpec(name="down", build=Down, stem=(), blocks=("conv", "patch", "short", "up"), head=(),
                     loss=lambda out, y: F.mse_loss(out, y), data="denoising")
    prof = profile_spec(spec, lambda b: (torch.zeros(b, 4, 8, 8), torch.zeros(b, 4, 8, 8)))
    down = prof.unit("conv")
    assert down.fwd["none"].convs == ((2 * 8 * 4 * 4 * 4 * 3 * 3, 32 ** 0.5, 2),)
    assert [st for _, _, st in down.bwd["none"].conv_grads] == [2]
    for name in ("patch", "short", "up"):
        u = prof.unit(name)
        assert [st for _, _, st in u.fwd["none"].convs + u.bwd["none"].conv_grads] == [1, 1], name
    rows = [(1e3, 1e8, 8, 1), (1e9, 1e9, 8, 1), (1e3, 5e7, 8, 2), (1e9, 5e8, 8, 2)]
    c = replace(load_cluster("cpu"), conv={1: rows})
    assert c.conv_rate(1e6, channels=8, stride=2) == pytest.approx(c.conv_rate(1e6, channels=8) / 2)
    assert c.conv_rate(1e6, channels=8, stride=3) == c.conv_rate(1e6, channels=8, stride=2)
    old = replace(c, conv={1: [r[:3] for r in rows[:2]]})
    assert old.conv_rate(1e6, channels=8, stride=2) == old.conv_rate(1e6, channels=8) == c.conv_rate(1e6, channels=8)


def test_pp_split_auto_is_a_valid_setting_and_nonsense_is_not():
    from hybridpar.config import ConfigError, validate

    validate(Config(parallel=ParallelConfig(dp=1, pp=2, pp_split="auto")), world_size=2)
    with pytest.raises(ConfigError, match="pp_split='automatic' must be comma-separated integers"):
        validate(Config(parallel=ParallelConfig(dp=1, pp=2, pp_split="automatic")), world_size=2)
    with pytest.raises(ConfigError, match="not supported with virtual_stages > 1"):
        validate(Config(parallel=ParallelConfig(dp=1, pp=2, pp_split="auto", schedule="interleaved",
                                                virtual_stages=2, microbatches=2)), world_size=2)


def test_time_units_runs_every_unit_as_the_engine_builds_it():
    """Each unit is timed on real tensors, sharded at tp > 1 by the fake tp group (collectives
    return at once), with recomputation; the identical blocks are each timed."""
    from hybridpar.planner.unit_timer import time_units

    for name, tp, recompute in (("resnet", 2, "none"), ("vit", 2, "full"), ("llama", 1, "selective")):
        m = ModelConfig(name=name, n_layers=2) if name != "llama" else ModelConfig(
            n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=16)
        spec = spec_for(m)
        times = time_units(spec, sm.example_batch(spec, m), b=2, tp=tp, recompute=recompute,
                           dp_sync=name == "resnet", warmup=1, repeats=2)
        assert list(times) == list(spec.units)
        assert all(f > 0 and b > 0 for f, b in times.values()), times


def test_measured_unit_times_replace_the_modelled_compute(monkeypatch):
    """With ``measure``, a unit's compute is its measured time (at the plan's micro-batch size,
    tp degree and the rank's threads), times the same slow-down; communication stays modelled."""
    from hybridpar.planner import unit_timer

    m = ModelConfig(name="resnet", n_layers=4)
    calls = []

    def fake(spec, example, *, b, tp, threads, **kw):
        calls.append((b, tp, threads, kw["recompute"]))
        return {u: (1e-3 * (i + 1), 2e-3 * (i + 1)) for i, u in enumerate(spec.units)}

    monkeypatch.setattr(unit_timer, "time_units", fake)
    model = sm.SpecModel(m, measure=True)
    c = load_cluster("cpu")
    plan = Plan(1, 2, 1, 2, 3, recompute="selective")
    times = sm.unit_times(model, plan, c, threads=1, slow=1.5)
    modelled = sm.unit_times(sm.SpecModel(m), plan, c, threads=1, slow=1.5)
    assert calls == [(3, 2, 1, "selective")]
    for i, u in enumerate(model.spec.units):
        f, b, comm_f, comm_b = times[u]
        assert (comm_f, comm_b) == modelled[u][2:]  # the tp collectives, modelled either way
        assert f + b - comm_f - comm_b == pytest.approx(1.5 * 3e-3 * (i + 1))
    sm.unit_times(model, plan, c, threads=1, slow=1.0)
    assert len(calls) == 1  # measured once per (tp, micro-batch, threads, recompute, ...)


def test_plan_measure_units(capsys):
    from hybridpar.cli.plan import plan_main
    from hybridpar.config import ConfigError

    assert plan_main(["--model.name=resnet", "--model.n_layers=4", "--cluster", "cpu",
                      "--devices-per-node", "2", "--global-batch", "8", "--top", "2",
                      "--measure-units"]) == 0
    assert "compute timed on this machine" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="drop --measure-units"):
        plan_main(["--measure-units"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="this machine, which has no GPU"):
            plan_main(["--model.name=vit", "--cluster", "h100-80g", "--measure-units"])


def test_the_llama_model_fuses_the_projections_where_the_model_does():
    """``timing.fuses``: a GPU cluster, or a CPU computing in bf16/fp16, runs q/k/v and w1/w3 as
    one GEMM each (``models.fused.fuses``); a CPU in fp32 one per weight. The FLOPs are the
    same either way, split into 7 GEMMs instead of 4."""
    from hybridpar.planner.costs import matmuls
    from hybridpar.planner.timing import fuses

    cpu = load_cluster("cpu")
    assert not fuses(cpu) and fuses(replace(cpu, dtype_bytes=2)) and fuses(load_cluster("h100-80g"))
    m = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=32)
    for tp in (1, 2):
        one, sep = matmuls(m, 32, tp, fused=True), matmuls(m, 32, tp, fused=False)
        assert len(one) == 5 and len(sep) == 8  # + the attention core
        assert sum(x for _, x, _ in one) == sum(x for _, x, _ in sep)
