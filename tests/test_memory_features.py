"""ZeRO-1, activation recomputation, sequence parallelism, interleaved 1F1B and mixed precision
train the same run as one process (one 8-rank spawn for all cases).

fp32 cases use the parity tolerances of tests/test_parity.py (see its docstring). bf16 cases
compare against a single process also computing in bf16: a layout changes where bf16 roundings
happen (tp partial sums are rounded to bf16 before the all-reduce, a single process rounds the
full sum), so an intermediate can differ by one bf16 ulp (2^-8 relative = 3.9e-3). A loss is a
mean over 512 tokens of such values, where flips average out: within one ulp, 4e-3. A gradient
element is the product of several bf16-rounded factors, each possibly one ulp off: within 4 ulps
of the largest gradient of its tensor, 3.2e-2. Later losses inherit each step's gradient error
through AdamW (whose update m/sqrt(v) is ~1 whatever the gradient's size), so they are held to
the gradient tolerance. fp16 (11-bit mantissa, ulp 2^-11 = 4.9e-4, loss-scaled so nothing
underflows) gets the same rules with its own ulp: 4.9e-4 on step 1; gradients and later losses
within 4 ulps at the top of the binade, 4 x 2^-10 = 3.9e-3.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hybridpar.parallel.amp import LossScaler
from hybridpar.engine.launch import spawn
from hybridpar.parallel.mesh import single_mesh
from hybridpar.testing import (cases_worker, load_case, max_rel_tensor_err, reference, rel_err,
                               tiny_config, tiny_dataset)
from hybridpar.engine.train import Trainer


def mk(dp, tp, pp, *, precision="fp32", model=None, **par):
    c = tiny_config(dp=dp, tp=tp, pp=pp, **(model or {}))
    return replace(c, parallel=replace(c.parallel, **par), train=replace(c.train, precision=precision))


INTERLEAVED = dict(schedule="interleaved", virtual_stages=2)  # 4 micro-batches > pp: evaluation too
TIED = dict(tie_embeddings=True)
ALL_ON = dict(zero1=True, sequence_parallel=True, recompute="full", **INTERLEAVED)
CASES = {
    "zero1-dp2": (mk(2, 2, 2, zero1=True), "fp32"),
    "zero1-dp4": (mk(4, 1, 2, zero1=True), "fp32"),
    # the tied embedding's two pipeline copies are summed after the dp reduce-scatter; one
    # bucket per stage (bucket_mb=1) unless the engine gives the embedding its own
    "zero1-tied-2x1x4": (mk(2, 1, 4, zero1=True, bucket_mb=1, model=TIED), "fp32"),
    "zero1-tied-4x1x2": (mk(4, 1, 2, zero1=True, bucket_mb=1, model=TIED), "fp32"),
    "zero1-tied-2x2x2": (mk(2, 2, 2, zero1=True, bucket_mb=1, model=TIED), "fp32"),
    "plain-2x2x2": (mk(2, 2, 2), "fp32"),
    "plain-4x1x2": (mk(4, 1, 2), "fp32"),
    "recompute-selective": (mk(2, 2, 2, recompute="selective"), "fp32"),
    "recompute-full": (mk(2, 2, 2, recompute="full"), "fp32"),
    "sp-tp2": (mk(2, 2, 2, sequence_parallel=True), "fp32"),
    "sp-tp4": (mk(2, 4, 1, sequence_parallel=True), "fp32"),
    "interleaved-pp2-v2": (mk(2, 2, 2, **INTERLEAVED), "fp32"),
    "interleaved-pp4-v2": (mk(2, 1, 4, **INTERLEAVED), "fp32"),
    "all-on-2x2x2": (mk(2, 2, 2, **ALL_ON), "fp32"),
    "bf16-2x2x2": (mk(2, 2, 2, precision="bf16"), "bf16"),
    "bf16-all-on-2x2x2": (mk(2, 2, 2, precision="bf16", **ALL_ON), "bf16"),
    "fp16-2x2x2": (mk(2, 2, 2, precision="fp16"), "fp16"),
    # context parallelism under bf16 autocast: the ring's softmax and merges run in fp32 on
    # bf16 q, k, v (the single process: SDPA under autocast), so bf16 rules apply
    "bf16-cp2-2x2x1": (mk(2, 2, 1, cp=2, precision="bf16"), "bf16"),
    "bf16-cp2-all-on-1x2x2": (mk(1, 2, 2, cp=2, precision="bf16", **ALL_ON), "bf16"),
    # fp32 compute, gradients rounded to bf16 for the dp reduction: bf16 rules apply
    "bf16-grad-reduce-4x1x2": (mk(4, 1, 2, grad_reduce_dtype="bf16"), "bf16"),
}
TOL = {"fp32": (1e-5, 1e-4, 1e-5), "bf16": (3.9e-3, 3.2e-2, 3.2e-2), "fp16": (4.9e-4, 3.9e-3, 3.9e-3)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("features")
    spawn(cases_worker, 8, [(n, c, None) for n, (c, _) in CASES.items()], str(out))
    return {n: load_case(str(out), n) for n in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_feature_matches_single_process(results, name):
    cfg, kind = CASES[name]
    got, ref = results[name], reference(cfg)
    step1, later, grad_tol = TOL[kind]
    errs = [rel_err(a, b) for a, b in zip(got["losses"], ref["losses"])]
    grad_err, where = max_rel_tensor_err(got["grads"], ref["grads"])
    print(f"{name}: loss rel errs {max(errs):.2e}, grad rel err {grad_err:.2e} ({where})")
    assert len(errs) == 5
    assert errs[0] <= step1 and max(errs) <= later, errs
    assert grad_err <= grad_tol, (grad_err, where)
    val_errs = [rel_err(a, b) for a, b in zip(got["val_losses"], ref["val_losses"])]
    assert len(val_errs) == 2 and max(val_errs) <= later, val_errs


def test_zero1_is_bitwise_the_unsharded_update(results):
    """AdamW is elementwise: running it on 1/dp slices must not change a single bit (with dp=2
    a reduce-scatter adds the same two numbers as an all-reduce)."""
    got, plain = results["zero1-dp2"], results["plain-2x2x2"]
    assert got["losses"] == plain["losses"]
    for k, v in plain["params"].items():
        assert torch.equal(got["params"][k], v), k


def test_zero1_partitions_optimizer_state_over_dp(results):
    """Per rank AdamW state (2 fp32 moments) is 1/dp of the unsharded one, up to bucket padding
    (each bucket is padded so that every shard is ALIGN_BYTES aligned: a shard holds up to
    ALIGN_BYTES / 4 fp32 elements more or fewer real ones than 1/dp, per bucket; at most 64
    buckets here)."""
    from hybridpar.parallel.data_parallel import ALIGN_BYTES
    for rank, mem in results["zero1-dp4"]["mem"].items():
        full = results["plain-4x1x2"]["mem"][rank]["optimizer"]
        assert abs(mem["optimizer"] - full / 4) <= 2 * ALIGN_BYTES * 64, (rank, mem, full)


def _one_step(**par):
    cfg = tiny_config(steps=1)
    cfg = replace(cfg, parallel=replace(cfg.parallel, **par))
    tr = Trainer(cfg, single_mesh(), tiny_dataset())
    m = tr.train_step()
    return tr, m


def test_recompute_is_bitwise_and_saves_activations():
    (_, none), (_, sel), (_, full) = (_one_step(recompute=r) for r in ("none", "selective", "full"))
    assert none["loss"] == sel["loss"] == full["loss"]
    a_none, a_sel, a_full = (m["mem"]["activations"] for m in (none, sel, full))
    assert a_full < a_sel < a_none
    # the meter (what autograd keeps, the loss's fp32 softmax included) against the planner's
    # formula for the whole model, each setting; within 1%: the rotary tables and the loss's
    # few small tensors are not in the formula. Full recompute keeps one input per layer.
    from hybridpar.planner.costs import Plan, activations

    cfg = tiny_config()
    rows = cfg.train.global_batch // cfg.parallel.microbatches
    for got, mode in ((a_none, "none"), (a_sel, "selective"), (a_full, "full")):
        want = activations(cfg.model, Plan(1, 1, 1, cfg.parallel.microbatches, rows, recompute=mode), 4,
                           embed=True, head=True, layers=cfg.model.n_layers)
        assert abs(got - want) <= 0.01 * want, (mode, got, want)


def test_bf16_working_weights_are_cast_once_per_step_not_per_microbatch(monkeypatch):
    """Under bf16 every matrix weight is cast once per step and shared by the micro-batches:
    the losses are bitwise those of autocast's own per-micro-batch casts, the copies kept for
    backward leave the activations (one per micro-batch in flight) for one "working" entry,
    and the planner counts the same bytes, for the Llama and a spec model."""
    from dataclasses import replace as rep

    from hybridpar.parallel import parallelize as P
    from hybridpar.planner.cluster import load_cluster
    from hybridpar.planner.costs import Plan, memory
    from hybridpar.planner.spec_model import SpecModel
    from hybridpar.testing import test_data, tiny_vit_config

    def run(cfg, cast: bool):
        if not cast:
            monkeypatch.setattr(P.Stage, "cast_weights", lambda self: [])
        tr = Trainer(cfg, single_mesh(), test_data(cfg))
        out = [tr.train_step() for _ in range(2)]
        monkeypatch.undo()
        return out

    bf16 = rep(load_cluster("cpu"), dtype_bytes=2)
    for cfg in (tiny_config(steps=2), tiny_vit_config(steps=2)):
        cfg = rep(cfg, train=rep(cfg.train, precision="bf16", eval_every=0))
        per_mb, once = run(cfg, False), run(cfg, True)
        assert [m["loss"] for m in per_mb] == [m["loss"] for m in once]
        got = once[-1]["mem"]
        assert "working" not in per_mb[-1]["mem"]
        assert got["activations"] + got["working"] == per_mb[-1]["mem"]["activations"]
        rows = cfg.train.global_batch // cfg.parallel.microbatches
        model = cfg.model if cfg.model.name == "llama" else SpecModel(cfg.model)
        want = memory(model, Plan(1, 1, 1, cfg.parallel.microbatches, rows), bf16)["working"]
        assert got["working"] == want, (cfg.model.name, got, want)


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    cfg = tiny_config(steps=2)
    cfg = replace(cfg, train=replace(cfg.train, precision="fp16"))
    tr = Trainer(cfg, single_mesh(), tiny_dataset())
    tr.scaler = LossScaler(scale=2.0 ** 126)  # the scaled loss overflows fp32 grads
    tr.runner.loss_fn = tr._loss
    before = {n: p.detach().clone() for n, p in tr.pm.named_parameters()}
    m = tr.train_step()
    assert m["skipped"] and tr.scaler.scale == 2.0 ** 125
    for n, p in tr.pm.named_parameters():
        assert torch.equal(p, before[n]), n


def test_bf16_pipeline_messages_travel_in_bf16(monkeypatch):
    """Under bf16 a stage's fp32 output and the gradient sent back cross the wire in bf16 (half
    the bytes) and arrive as fp32 for the receiving stage's autograd; fp32 runs send fp32."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch import nn

    from hybridpar.parallel.parallelize import Stage
    from hybridpar.parallel.pipeline.boundaries import TensorMeta
    from hybridpar.parallel.pipeline.runtime import PipelineRunner, StepState
    from hybridpar.parallel.pipeline.schedules import Action, Op

    wire = []

    class _Done:
        def wait(self):
            pass

        def is_completed(self):
            return True

    def batch(ops):
        for fn, t in ((o.op, o.tensor) for o in ops):
            wire.append((fn.__name__, t.dtype))
            if fn is dist.irecv:
                t.fill_(1 / 3)  # what the peer sent, rounded to the wire dtype
        return [_Done() for _ in ops]

    monkeypatch.setattr(dist, "P2POp", lambda fn, t, peer, group: SimpleNamespace(op=fn, tensor=t))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    mesh = SimpleNamespace(group=lambda axis: None, device=torch.device("cpu"), pp_rank=0,
                           layout=SimpleNamespace(pp=2), stage_rank=lambda r: r)
    meta = (TensorMeta((2, 4), torch.float32),)
    for dtype, expect in ((torch.bfloat16, torch.bfloat16), (None, torch.float32)):
        wire.clear()
        stage = Stage(nn.Sequential(nn.Linear(4, 4)), ["0"], autocast_dtype=dtype)
        runner = PipelineRunner([stage], mesh, 1, [meta], loss_fn=None)
        st = StepState()
        st.outputs[(0, 0)] = torch.randn(2, 4, requires_grad=True)
        runner._comm((Action(Op.SEND_F, 0), Action(Op.RECV_B, 0)), st)
        assert wire == [("isend", expect), ("irecv", expect)]
        got = st.grads_in[(0, 0)][0]
        assert got.dtype == torch.float32 and got[0, 0].item() == torch.tensor(1 / 3, dtype=expect).item()
