"""The model seam without processes: spec helpers, plan checks, boundary inference and the
one-line errors a user gets for a bad spec, plan or boundary."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridpar.config import ConfigError, ModelConfig
from hybridpar.models import ModelSpec, resolve, spec_for
from hybridpar.parallel.pipeline.boundaries import TensorMeta, check_boundary, infer_boundaries
from hybridpar.parallel.tensor_parallel.apply import check_plan

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def test_stage_units_put_stem_and_head_on_the_ends():
    spec = spec_for(ModelConfig(n_layers=4))
    assert spec.stage_units([1, 3]) == [["tok_emb", "layers.0"],
                                         ["layers.1", "layers.2", "layers.3", "norm", "lm_head"]]
    with pytest.raises(ValueError, match="every stage >= 1 of the 4 blocks"):
        spec.stage_units([4, 0])
    with pytest.raises(ValueError, match="has no blocks"):
        ModelSpec(name="empty", build=nn.Linear, stem=(), blocks=(), head=())


def test_plan_errors_name_the_pattern_or_module():
    with torch.device("meta"):
        model = spec_for(ModelConfig(name="vit", n_layers=2, d_model=32, n_heads=8, d_ff=64)).build()
    with pytest.raises(ValueError, match="'blocks.\\*.atn' names no module"):
        check_plan(model, {"blocks.*.atn": "region"}, 2, where="vit")
    with pytest.raises(ValueError, match="blocks.0.norm1 is a LayerNorm; style 'colwise' needs an "
                                         "nn.Linear or nn.Conv"):
        check_plan(model, {"blocks.0.norm1": "colwise"}, 2, where="vit")
    with pytest.raises(ValueError, match="parallel.tp=3 must divide the 64 output features of "
                                         "blocks.0.mlp.fc1 \\(colwise\\); valid tp: 1, 2, 4, 8, 16, 32, 64"):
        check_plan(model, {"blocks.*.mlp.fc1": "colwise"}, 3, where="vit")
    with pytest.raises(ValueError, match="style 'diagonal' for 'head' is unknown"):
        check_plan(model, {"head": "diagonal"}, 2, where="vit")


def test_conv_plan_errors_before_any_process():
    """Channels not divisible by tp, a grouped conv split like a dense one, a channelwise style
    on a module that is not per-channel, sequence parallelism on a CNN: one line each."""
    with torch.device("meta"):
        resnet = spec_for(ModelConfig(name="resnet", n_layers=4, base_channels=6)).build()
    with pytest.raises(ValueError, match=r"parallel.tp=4 must divide the 6 output channels of "
                                         r"blocks.0.body.0 \(colwise\); valid tp: 1, 2, 3, 6"):
        check_plan(resnet, {"blocks.*.body.0": "colwise"}, 4, where="resnet")
    with pytest.raises(ValueError, match=r"blocks.0.body.1 \(channelwise\)"):
        check_plan(resnet, {"blocks.*.body.1": "channelwise"}, 4, where="resnet")
    with pytest.raises(ValueError, match="head.fc is a Linear; 'channelwise' needs a BatchNorm"):
        check_plan(resnet, {"head.fc": "channelwise"}, 2, where="resnet")
    with pytest.raises(ValueError, match="sequence_parallel splits activations along dim 1"):
        check_plan(resnet, {"blocks.*.body.0": "colwise"}, 2, where="resnet", sequence_parallel=True)
    # a transformer whose stream is not split where it enters (no vocab-parallel embedding) or
    # gathered where it leaves (no vocab-parallel head): refused, not run whole on every rank
    from hybridpar.models.vit import TP_PLAN as VIT_PLAN
    with torch.device("meta"):
        vit = spec_for(ModelConfig(name="vit", n_layers=2, d_model=32, n_heads=4, d_ff=64,
                                   image_size=8, patch_size=2, channels=1)).build()
    check_plan(vit, VIT_PLAN, 2, where="vit")
    with pytest.raises(ValueError, match="has no 'vocab_embedding' and no 'vocab_head' style"):
        check_plan(vit, VIT_PLAN, 2, where="vit", sequence_parallel=True)
    with torch.device("meta"):
        llama = spec_for(ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)).build()
    from hybridpar.models.llama import TP_PLAN as LLAMA_PLAN
    check_plan(llama, LLAMA_PLAN, 2, where="llama", sequence_parallel=True)
    no_head = {k: v for k, v in LLAMA_PLAN.items() if v != "vocab_head"}
    with pytest.raises(ValueError, match="has no 'vocab_head' style"):
        check_plan(llama, no_head, 2, where="llama", sequence_parallel=True)
    grouped = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(4, 4, 3, groups=4))
    with pytest.raises(ValueError, match=r"0 is a grouped Conv \(groups=2\)"):
        check_plan(grouped, {"0": "rowwise"}, 2)
    check_plan(grouped, {"1": "channelwise"}, 2)  # depthwise: per channel
    from hybridpar.config import Config, ParallelConfig, validate
    with pytest.raises(ConfigError, match="parallel.tp=3 must divide model.base_channels=16"):
        validate(Config(model=ModelConfig(name="resnet"), parallel=ParallelConfig(dp=1, tp=3)))


def test_synced_batchnorm_is_torch_batchnorm_in_one_process():
    """Our BatchNorm forward (dp group None) against torch's: outputs, input and parameter
    gradients, running statistics in training and evaluation, BatchNorm1d/2d/3d, momentum None."""
    from hybridpar.parallel.batchnorm import recomputing, sync_batchnorm

    g = torch.Generator().manual_seed(0)
    for cls, shape, momentum in ((nn.BatchNorm1d, (8, 3), 0.1), (nn.BatchNorm2d, (6, 4, 5, 5), 0.1),
                                 (nn.BatchNorm3d, (4, 2, 3, 3, 3), None)):
        ref, ours = cls(shape[1], momentum=momentum), cls(shape[1], momentum=momentum)
        with torch.no_grad():
            ref.weight.normal_(generator=g), ref.bias.normal_(generator=g)
        ours.load_state_dict(ref.state_dict())
        sync_batchnorm(ours, None)
        for _ in range(2):  # two updates of the running statistics
            x = torch.randn(shape, generator=g) * 3 + 5
            xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
            dy = torch.randn(shape, generator=g)
            ref(xr).backward(dy)
            ours(xo).backward(dy)
            torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-5, atol=1e-6)
        for name in ("weight", "bias"):
            torch.testing.assert_close(getattr(ours, name).grad, getattr(ref, name).grad, rtol=1e-5, atol=1e-5)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(ours, name), getattr(ref, name), rtol=1e-6, atol=1e-7)
        with recomputing():  # a recomputation pass normalises the same and counts nothing
            ours(x)
        assert ours.num_batches_tracked.item() == 2
        ref.eval(), ours.eval()
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-6, atol=1e-6)


def test_batchnorm_fused_at_dp1_equals_the_combination_the_dp_ranks_run(monkeypatch):
    """At dp = 1 the layer runs torch's fused kernel; with dp replicas, the combination of the
    ranks' statistics. In one process both must give the same outputs, gradients and running
    statistics, recomputation included (so a layout's dp degree does not change the math)."""
    from hybridpar.parallel import batchnorm
    from hybridpar.parallel.batchnorm import recomputing, sync_batchnorm

    g = torch.Generator().manual_seed(1)
    fused, combined = nn.BatchNorm2d(4, momentum=None), nn.BatchNorm2d(4, momentum=None)
    with torch.no_grad():
        fused.weight.normal_(generator=g), fused.bias.normal_(generator=g)
    combined.load_state_dict(fused.state_dict())
    sync_batchnorm(fused, None), sync_batchnorm(combined, None)
    for step in range(3):
        x = torch.randn(6, 4, 5, 5, generator=g) * 2 + 3
        dy = torch.randn(6, 4, 5, 5, generator=g)
        xf, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        fused(xf).backward(dy)
        with monkeypatch.context() as mp:
            mp.setattr(batchnorm, "_fusable", lambda *a: False)
            combined(xc).backward(dy)
            if step == 2:
                with recomputing():
                    combined(x)
        if step == 2:
            with recomputing():
                fused(x)
        torch.testing.assert_close(xf.grad, xc.grad, rtol=1e-5, atol=1e-6)
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(fused, name).grad, getattr(combined, name).grad, rtol=1e-5, atol=1e-5)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(fused, name), getattr(combined, name), rtol=1e-6, atol=1e-7)
    assert fused.num_batches_tracked.item() == 3


def test_boundaries_are_inferred_on_meta_with_tuples_and_dtypes():
    from examples.digits_cnn import spec as cnn_spec

    spec = cnn_spec(ModelConfig(d_model=8, n_layers=4))
    images = torch.zeros(5, 1, 8, 8)
    got = infer_boundaries(spec.build, spec.stage_units([2, 2]), images)
    assert got == [(TensorMeta((5, 8, 8, 8), torch.float32),) * 2]
    llama = spec_for(ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64))
    tokens = torch.zeros(3, 16, dtype=torch.long)
    assert infer_boundaries(llama.build, llama.stage_units([1, 1]), tokens) == [
        (TensorMeta((3, 16, 32), torch.float32),)]
    sp = infer_boundaries(llama.build, llama.stage_units([1, 1]), tokens, seq_shards=2)
    assert sp == [(TensorMeta((3, 8, 32), torch.float32),)]


def test_a_boundary_that_differs_from_the_inferred_one_is_one_clear_error():
    want = (TensorMeta((4, 8), torch.float32),)
    check_boundary(0, (torch.zeros(4, 8),), want)
    with pytest.raises(ValueError, match=r"after virtual stage 2: the stage returned \[\(4, 9\) float32\] "
                                         r"but the meta-device forward inferred \[\(4, 8\) float32\]"):
        check_boundary(2, (torch.zeros(4, 9),), want)


def test_spec_paths_are_resolved_or_named():
    m = ModelConfig()
    assert resolve("examples.digits_cnn:spec", m).name == "digits-cnn"
    with pytest.raises(ConfigError, match="must be 'package.module:attr'"):
        resolve("examples.digits_cnn", m)
    with pytest.raises(ConfigError, match="cannot be loaded"):
        resolve("examples.nothing_here:spec", m)
    with pytest.raises(ConfigError, match="not a hybridpar ModelSpec"):
        resolve(lambda cfg: 42, m)


@pytest.mark.parametrize("args,line", [
    (["--model.spec=examples.nothing_here:spec"], "hybridpar: error: model.spec='examples.nothing_here:spec' cannot be loaded"),
    (["--model.name=vit", "--tp", "3"], "hybridpar: error: parallel.tp=3 must divide model.n_heads=8"),
    (["--model.name=vit", "--data.path=README.md"], "hybridpar: error: data.path='README.md': model 'vit' trains on"),
])
def test_cli_refuses_a_bad_model_in_one_line_before_any_process(args, line):
    r = subprocess.run([sys.executable, "-m", "hybridpar", "train", *args, "--train.progress=false"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), r.stderr


def test_a_model_with_buffers_outside_batchnorm_is_refused_in_one_line():
    """BatchNorm statistics are buffers the engine knows; any other buffer (a table the
    meta-device build cannot fill, a checkpoint would not save) is refused before any process."""
    from hybridpar.config import Config
    from hybridpar.cli.main import check_model

    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x):
            return self.lin(x) * self.scale

    def buffer_spec(cfg):
        return ModelSpec(name="table-net", build=lambda: nn.Sequential(nn.BatchNorm1d(4), Table()),
                         stem=(), blocks=("0", "1"), head=())
    with pytest.raises(ConfigError, match=r"model 'table-net' has buffers \(1.scale\) outside "
                                          r"BatchNorm layers"):
        check_model(Config(), buffer_spec)

def test_train_at_the_top_level_of_a_script_is_one_error_before_any_process(tmp_path):
    """Spawned ranks import the launching script: an unguarded hybridpar.train() is named with
    its line, before any rank starts (not multiprocessing's bootstrapping error per rank)."""
    script = tmp_path / "noguard.py"
    script.write_text("import hybridpar\nfrom hybridpar.config import Config, ParallelConfig\n"
                      "hybridpar.train(Config(parallel=ParallelConfig(dp=2)))\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert f"{script}:3 calls hybridpar.train() at the top level" in r.stderr, r.stderr[-2000:]
    assert "bootstrapping" not in r.stderr
