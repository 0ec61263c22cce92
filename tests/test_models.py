"""Models other than the built-in Llama, through the same engine, against one process (one
8-rank spawn and one 4-rank spawn for all cases, evaluation on): the ViT on every factorisation
of 8 ranks its 8 heads admit, both flat schedules and interleaved; the ResNet (BatchNorm,
channel-parallel convolutions) at (2,1,2), (1,2,2), (1,1,4), (4,1,2) and (2,2,2); the UNet
(stages exchange tuples of skip tensors; GroupNorm) at pp 2 and 4 and with tp; the README's
user model (a CNN whose stages exchange a tuple) at pp 2, 4 and 8; injected bugs that the
checks must catch.

BatchNorm layers normalise each micro-batch by its statistics (synchronised over dp): the
single process runs the same micro-batches, so running statistics must match the reference
like parameters (1e-5 relative after 5 steps) and ``num_batches_tracked`` must be exactly
steps x micro-batches.

Tolerances are the engine's (tests/test_parity.py states why): step-1 loss and gradients
1e-5 relative, later and validation losses 1e-4, pure pipeline layouts bitwise. The ViT adds
biases (a row-parallel bias is added once, after the tp sum), LayerNorm and a classifier that
reads the class token; its pipeline boundaries are (rows, 17, d_model) activations.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hybridpar.testing import (max_rel_tensor_err, run_cases, cached_reference, rel_err,
                               tiny_resnet_config, tiny_unet_config, tiny_vit_config)

LAYOUTS = [(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 2, 2), (2, 4, 1), (2, 1, 4), (1, 2, 4), (1, 4, 2),
           (1, 8, 1), (1, 1, 8)]
GPIPE = {(2, 2, 2), (2, 1, 4), (1, 1, 8)}
STEP1_RTOL, LATER_RTOL, GRAD_RTOL = 1e-5, 1e-4, 1e-5


ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)  # examples/ is importable here and, through spawn, on every rank


def example_config(dp, tp, pp, schedule):
    """The README's user model (examples/digits_cnn.py): a residual CNN whose stages exchange a
    tuple (feature map, long skip), loaded by import path as ``--model.spec`` does."""
    c = tiny_vit_config(dp=dp, tp=tp, pp=pp, schedule=schedule)
    return replace(c, model=replace(c.model, name="llama", spec="examples.digits_cnn:spec",
                                    d_model=8, n_layers=8))


def _cases():
    cases = {}
    for dp, tp, pp in LAYOUTS:  # 1F1B everywhere, GPipe where it differs most (all three axes; pure pp)
        for sched in (["gpipe", "1f1b"] if (dp, tp, pp) in GPIPE else ["1f1b"]):
            cases[f"vit-{dp}x{tp}x{pp}-{sched}"] = (tiny_vit_config(dp=dp, tp=tp, pp=pp, schedule=sched), None)
    for dp, tp, pp in [(2, 1, 4), (1, 2, 4)]:
        c = tiny_vit_config(dp=dp, tp=tp, pp=pp, schedule="interleaved", microbatches=8)
        cases[f"vit-{dp}x{tp}x{pp}-interleaved"] = (
            replace(c, parallel=replace(c.parallel, virtual_stages=2)), None)
    for dp, tp, pp, sched in [(4, 1, 2, "1f1b"), (2, 1, 4, "gpipe"), (2, 1, 4, "1f1b"), (1, 1, 8, "1f1b")]:
        cases[f"cnn-{dp}x{tp}x{pp}-{sched}"] = (example_config(dp, tp, pp, sched), None)
    for dp, tp, pp in [(4, 1, 2), (2, 2, 2)]:
        cases[f"resnet-{dp}x{tp}x{pp}-1f1b"] = (tiny_resnet_config(dp=dp, tp=tp, pp=pp), None)
    cases["bug-resnet-unsynced_batchnorm"] = (tiny_resnet_config(dp=4, tp=1, pp=2), "unsynced_batchnorm")
    cases["bug-resnet-drop_tp_allreduce"] = (tiny_resnet_config(dp=2, tp=2, pp=2), "drop_tp_allreduce")
    cases["bug-cnn-swap_boundary_tuple"] = (example_config(2, 1, 4, "1f1b"), "swap_boundary_tuple")
    cases["bug-vit-bias_added_tp_times"] = (tiny_vit_config(dp=2, tp=2, pp=2), "bias_added_tp_times")
    cases["bug-vit-drop_tp_allreduce"] = (tiny_vit_config(dp=1, tp=4, pp=2), "drop_tp_allreduce")
    return cases


CASES = _cases()

# four ranks: the layouts the issue names for the CNNs (one spawn)
CASES4 = {
    **{f"resnet-{dp}x{tp}x{pp}-1f1b": (tiny_resnet_config(dp=dp, tp=tp, pp=pp), None)
       for dp, tp, pp in [(2, 1, 2), (1, 2, 2), (1, 1, 4)]},
    "unet-2x1x2-1f1b": (tiny_unet_config(dp=2, pp=2), None),
    "unet-1x2x2-gpipe": (tiny_unet_config(tp=2, pp=2, schedule="gpipe"), None),
    "unet-1x1x4-1f1b": (tiny_unet_config(pp=4), None),
    "bug-unet-bias_added_tp_times": (tiny_unet_config(tp=2, pp=2), "bias_added_tp_times"),
}
ALL = {**CASES, **CASES4}


def checkpoint_cases(root: str) -> dict:
    """A ViT and a ResNet (BatchNorm statistics: buffers sharded over tp) saved at (2,2,2)
    after step 3, then loaded at (4,1,2), in the same spawn (and in one process, later)."""
    def cfg(make, dp, tp, pp, **ck):
        c = make(dp=dp, tp=tp, pp=pp)
        return replace(c, checkpoint=replace(c.checkpoint, **ck))
    out = {}
    for model, make in (("vit", tiny_vit_config), ("resnet", tiny_resnet_config)):
        ck = f"{root}/ck-{model}"
        out.update({f"ckpt-{model}-save-2x2x2": (cfg(make, 2, 2, 2, dir=ck, every=3), None),
                    f"ckpt-{model}-load-4x1x2": (cfg(make, 4, 1, 2, load=f"{ck}/step_000003"), None),
                    f"ckpt-{model}-load-1x1x1": (cfg(make, 1, 1, 1, load=f"{ck}/step_000003"), None)})
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("models"))
    ckpt = checkpoint_cases(root)
    got = run_cases({**CASES, **{k: v for k, v in ckpt.items() if "1x1x1" not in k}}, f"{root}/out")
    got.update((k.replace("load", "config"), v[0]) for k, v in ckpt.items() if "1x1x1" in k)
    got["root"] = root
    got.update(run_cases(CASES4, f"{root}/out4", world=4))
    return got


ref_for = cached_reference


def errors(got, ref):
    loss = [rel_err(a, b) for a, b in zip(got["losses"], ref["losses"])]
    val = [rel_err(a, b) for a, b in zip(got["val_losses"], ref["val_losses"])]
    grad, where = max_rel_tensor_err(got["grads"], ref["grads"])
    return loss, val, grad, where


def assert_parity(got, ref):
    loss, val, grad, where = errors(got, ref)
    assert len(loss) == 5 and len(val) == 2
    assert loss[0] <= STEP1_RTOL, f"step 1 loss rel err {loss[0]:.2e}"
    assert max(loss) <= LATER_RTOL, f"loss rel errs {loss}"
    assert max(val) <= LATER_RTOL, f"validation loss rel errs {val}"
    assert grad <= GRAD_RTOL, f"step-1 grad rel err {grad:.2e} in {where}"
    return max(loss), max(val), grad


@pytest.mark.parametrize("name", [n for n, (_, bug) in CASES.items() if bug is None and n.startswith("vit")])
def test_vit_layout_matches_single_process(results, name):
    cfg, _ = CASES[name]
    got, ref = results[name], ref_for(cfg)
    loss, val, grad = assert_parity(got, ref)
    print(f"{name}: loss {loss:.2e} val {val:.2e} grad {grad:.2e}")
    if cfg.parallel.dp == cfg.parallel.tp == 1:
        assert got["losses"] == ref["losses"] and got["val_losses"] == ref["val_losses"]
        for k, v in ref["params"].items():
            assert got["params"][k].equal(v), f"{k} differs after training"


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("cnn-")])
def test_user_model_with_tuple_boundaries_matches_single_process(results, name):
    test_vit_layout_matches_single_process(results, name)


def assert_buffers(got, ref):
    """BatchNorm running statistics like parameters; the batch counters exactly."""
    floats = {k for k, v in ref["buffers"].items() if v.is_floating_point()}
    counters = ref["buffers"].keys() - floats
    err, where = max_rel_tensor_err({k: got["buffers"][k] for k in floats},
                                    {k: ref["buffers"][k] for k in floats})
    assert err <= GRAD_RTOL, f"running statistics rel err {err:.2e} in {where}"
    for k in counters:
        assert got["buffers"][k].item() == ref["buffers"][k].item(), k
    return err


@pytest.mark.parametrize("name", [n for n in ALL if n.startswith(("resnet-", "unet-"))])
def test_cnn_layout_matches_single_process(results, name):
    """ResNet (BatchNorm, channel-parallel convs) and UNet (tuple boundaries) against one process."""
    cfg, _ = ALL[name]
    got, ref = results[name], ref_for(cfg)
    loss, val, grad = assert_parity(got, ref)
    err, where = max_rel_tensor_err(got["params"], ref["params"])
    assert err <= LATER_RTOL, f"parameters after training rel err {err:.2e} in {where}"
    if cfg.model.name == "resnet":
        bn = assert_buffers(got, ref)
        steps = ref["buffers"]["stem.bn.num_batches_tracked"].item()
        assert steps == cfg.train.steps * cfg.parallel.microbatches  # evaluation counts nothing
        print(f"{name}: loss {loss:.2e} val {val:.2e} grad {grad:.2e} bn {bn:.2e}")
    else:
        print(f"{name}: loss {loss:.2e} val {val:.2e} grad {grad:.2e}")
    if cfg.parallel.dp == cfg.parallel.tp == 1:
        assert got["losses"] == ref["losses"] and got["val_losses"] == ref["val_losses"]


@pytest.mark.parametrize("name", [n for n, (_, bug) in ALL.items() if bug])
def test_parity_check_catches_injected_bug(results, name):
    got, ref = results[name], ref_for(ALL[name][0])
    with pytest.raises(AssertionError):
        assert_parity(got, ref)
        if "batchnorm" in name:
            assert_buffers(got, ref)


def test_example_trains_at_dp2_pp2_through_the_python_api():
    """The README's example as a user runs it: hybridpar.train(cfg, model=spec) spawns 4 ranks
    (dp=2 x pp=2) and returns the metrics history; the CNN learns the digits."""
    import hybridpar
    from examples.digits_cnn import spec
    from hybridpar.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig

    cfg = Config(model=ModelConfig(d_model=16, n_layers=4),
                 parallel=ParallelConfig(dp=2, pp=2, microbatches=2),
                 train=TrainConfig(steps=60, global_batch=64, lr=3e-3, eval_every=30,
                                   progress=False, threads_per_rank=1),
                 data=DataConfig(val_fraction=0.2))
    result = hybridpar.train(cfg, model=spec)
    assert len(result.history) == 60 and result["step"] == 60
    assert result["val_accuracy"] > 0.7, result["val_accuracy"]  # 10 classes: chance is 0.1


@pytest.mark.parametrize("model", ["vit", "resnet"])
def test_checkpoint_saved_at_2x2x2_resumes_at_other_layouts(results, model):
    """Layout-free checkpoints for models other than Llama: saved at (2,2,2) after step 3, a
    ViT and a ResNet (whose BatchNorm statistics are sharded over tp) continue at (4,1,2) and in
    one process with the losses of the uninterrupted run."""
    from hybridpar.testing import run_case, test_data

    one_cfg = results[f"ckpt-{model}-config-1x1x1"]
    one = run_case(one_cfg, dataset=test_data(one_cfg))
    full = results[f"ckpt-{model}-save-2x2x2"]["losses"]
    for name, resumed in (("4x1x2", results[f"ckpt-{model}-load-4x1x2"]["losses"]),
                          ("1x1x1", one["losses"])):
        assert len(resumed) == 2, (name, resumed)  # steps 4 and 5
        errs = [rel_err(a, b) for a, b in zip(resumed, full[3:])]
        assert max(errs) <= LATER_RTOL, (name, errs)
    if model == "resnet":  # the counters went on from the checkpoint's 3 steps x 2 micro-batches
        assert one["buffers"]["stem.bn.num_batches_tracked"][1].item() == 5 * 2


def test_resnet_checkpoint_exports_the_plain_state_dict(results, tmp_path):
    """``export`` of a ResNet checkpoint (saved at (2,2,2)): safetensors of the plain model's
    state dict, BatchNorm statistics included, that ``load_state_dict`` takes strictly."""
    from safetensors.torch import load_file

    from hybridpar.interop.export import export
    from hybridpar.models import spec_for

    cfg = results["ckpt-resnet-config-1x1x1"]
    m, step = export(f"{results['root']}/ck-resnet/step_000003", tmp_path / "out")
    assert step == 3 and m.name == "resnet"
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    model = spec_for(cfg.model).build()
    model.load_state_dict(state, strict=True)
    assert model.stem.bn.num_batches_tracked.item() == 3 * cfg.parallel.microbatches
    assert not torch.equal(model.stem.bn.running_var, torch.ones_like(model.stem.bn.running_var))
