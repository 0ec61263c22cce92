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
from hybridpar.pipeline.boundaries import TensorMeta, check_boundary, infer_boundaries
from hybridpar.tensor_parallel.apply import check_plan

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
    with pytest.raises(ValueError, match="patch_embed.proj is a Conv2d, style 'colwise' needs an nn.Linear"):
        check_plan(model, {"patch_embed.proj": "colwise"}, 2, where="vit")
    with pytest.raises(ValueError, match="parallel.tp=3 must divide the 64 output features of "
                                         "blocks.0.mlp.fc1 \\(colwise\\); valid tp: 1, 2, 4, 8, 16, 32, 64"):
        check_plan(model, {"blocks.*.mlp.fc1": "colwise"}, 3, where="vit")
    with pytest.raises(ValueError, match="style 'diagonal' for 'head' is unknown"):
        check_plan(model, {"head": "diagonal"}, 2, where="vit")


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


def test_a_model_with_buffers_is_refused_in_one_line():
    from hybridpar.config import Config
    from hybridpar.cli import check_model

    def bn_spec(cfg):
        return ModelSpec(name="bn-net", build=lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)),
                         stem=(), blocks=("0", "1"), head=())
    with pytest.raises(ConfigError, match=r"model 'bn-net' has buffers \(1.running_mean, 1.running_var, "
                                          r"1.num_batches_tracked\), which hybridpar does not support yet"):
        check_model(Config(), bn_spec)
