"""Config loading/validation and the rank arithmetic of the mesh (pure, no process group)."""
from __future__ import annotations

import pytest

from hybridpar.config import Config, ConfigError, load_config, pp_split, validate
from hybridpar.parallel.mesh import Layout


def test_toml_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nn_layers = 6\n[parallel]\ndp = 2\ntp = 2\n[train]\nlr = 1e-3\n')
    cfg = load_config(str(f), ["--model.n_layers=8", "train.steps=7", "--parallel.schedule=gpipe"])
    assert cfg.model.n_layers == 8 and cfg.parallel.tp == 2 and cfg.train.lr == 1e-3
    assert cfg.train.steps == 7 and cfg.parallel.schedule == "gpipe"
    assert cfg.model.d_model == Config().model.d_model  # untouched fields keep defaults


@pytest.mark.parametrize("overrides, words", [
    (["--model.n_layer=6"], "did you mean 'n_layers'"),
    (["--modle.n_layers=6"], "did you mean 'model'"),
    (["--model.n_layers=six"], "model.n_layers='six' is not an integer"),
    (["--parallel.schedule=zb"], "choose one of gpipe, 1f1b"),
    (["--train.progress=maybe"], "not a boolean"),
    (["model.n_layers"], "--section.field=value"),
])
def test_bad_overrides_name_the_field(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_toml_wrong_type_is_refused(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nn_layers = "six"\n')
    with pytest.raises(ConfigError, match="model.n_layers must be int, got str"):
        load_config(str(f))


@pytest.mark.parametrize("overrides, words", [
    (["--parallel.tp=3"], "parallel.tp=3 must divide model.n_heads=8; valid tp: 1, 2, 4"),
    (["--model.n_kv_heads=3"], "model.n_kv_heads=3 must divide model.n_heads=8"),
    (["--parallel.pp=7"], "parallel.pp=7 exceeds model.n_layers=6"),
    (["--parallel.microbatches=3"], "train.global_batch=32 must be divisible by dp*microbatches=2*3=6"),
    (["--model.d_model=0"], "model.d_model=0 must be at least 1"),
    (["--train.steps=-1"], "train.steps=-1 must not be negative"),
    (["--parallel.order=tp-dp"], "parallel.order='tp-dp' must name dp, tp and pp once each"),
    (["--parallel.pp=2", "--parallel.pp_split=5,2"], "summing to n_layers=6"),
    (["--parallel.cp=3"], "parallel.cp=3 cuts each sequence into 2*cp = 6 equal chunks: "
                          "model.seq_len=128 must be a multiple of 6"),
    (["--parallel.cp=2", "--model.name=resnet"], "model.name=resnet has no context-parallel support, use cp=1"),
    (["--parallel.cp=2", "--parallel.tp=4", "--parallel.sequence_parallel=true", "--model.seq_len=12"],
     "parallel.sequence_parallel splits each cp rank's 6 tokens over tp=4, which must divide them"),
    (["--parallel.order=tp-cp-dp"], "must name dp, tp and pp once each (and cp, or cp goes right after tp)"),
    # the ViT's stream would enter every tp rank whole (measured before: grad norm exactly 2x)
    (["--model.name=vit", "--parallel.tp=2", "--parallel.sequence_parallel=true"],
     "parallel.sequence_parallel is not supported for model.name=vit"),
])
def test_validation_messages(overrides, words):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides))
    assert words in str(e.value)
    assert "\n" not in str(e.value)


def test_world_size_mismatch_message():
    with pytest.raises(ConfigError, match="launcher started 4 processes but dp\\*tp\\*pp = 2\\*1\\*1 = 2"):
        validate(Config(), world_size=4)


def test_world_size_mismatch_names_cp_when_used():
    c = load_config(None, ["--parallel.cp=2"])
    with pytest.raises(ConfigError, match=r"dp\*cp\*tp\*pp = 2\*2\*1\*1 = 4; .* change "
                                          r"--dp/--cp/--tp/--pp so their product is 2"):
        validate(c, world_size=2)


@pytest.mark.parametrize("order", [("tp", "cp", "dp", "pp"), ("dp", "tp", "pp"), ("cp", "pp", "dp", "tp")])
def test_layout_with_cp_roundtrip_and_groups(order):
    """Four axes: every rank has unique coordinates, each axis's groups partition the ranks,
    and the dcp groups (gradient reduction) are the dp x cp ranks of one (tp, pp) position."""
    lay = Layout(dp=2, tp=2, pp=2, order=order, cp=2)
    assert "cp" in lay.order and lay.world_size == 16
    assert len({tuple(sorted(lay.coords(r).items())) for r in range(16)}) == 16
    for r in range(16):
        assert lay.rank_of(**lay.coords(r)) == r
    for axis in ("dp", "cp", "tp", "pp", "dcp"):
        groups = lay.group_ranks(axis)
        assert sorted(sum(groups, [])) == list(range(16))
        keep = ("tp", "pp") if axis == "dcp" else tuple(a for a in ("dp", "cp", "tp", "pp") if a != axis)
        for g in groups:
            assert len({tuple(lay.coords(r)[a] for a in keep) for r in g}) == 1
            assert len(g) == (4 if axis == "dcp" else 2)
    if order == ("dp", "tp", "pp"):  # cp placed right after tp
        assert lay.order == ("dp", "tp", "cp", "pp")


def test_balanced_and_uneven_pipeline_split():
    assert pp_split(8, 4) == [2, 2, 2, 2]
    assert pp_split(6, 4) == [2, 2, 1, 1]
    assert pp_split(6, 2, "4,2") == [4, 2]


@pytest.mark.parametrize("order", [("tp", "dp", "pp"), ("dp", "tp", "pp"), ("pp", "tp", "dp")])
def test_layout_coords_roundtrip_and_groups(order):
    lay = Layout(dp=2, tp=2, pp=2, order=order)
    seen = set()
    for r in range(8):
        c = lay.coords(r)
        assert lay.rank_of(**c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == 8
    for axis in ("dp", "tp", "pp"):
        groups = lay.group_ranks(axis)
        assert sorted(sum(groups, [])) == list(range(8))  # a partition of the ranks
        for g in groups:  # members differ only along `axis`
            others = {tuple(v for k, v in lay.coords(r).items() if k != axis) for r in g}
            assert len(others) == 1 and len(g) == 2


def test_default_order_puts_tp_on_neighbouring_ranks():
    lay = Layout(dp=2, tp=4, pp=2)
    assert lay.group_ranks("tp")[0] == [0, 1, 2, 3]
    assert lay.group_ranks("dp")[0] == [0, 4]
    assert lay.group_ranks("pp")[0] == [0, 8]


def test_more_local_ranks_than_gpus_is_refused_or_falls_back_to_cpu(monkeypatch, capsys):
    """NCCL cannot put two ranks on one GPU ("Duplicate GPU detected"): device=cuda refuses before
    any process starts; device=auto trains on the CPU and says so. (CUDA faked: one GPU.)"""
    from dataclasses import replace

    import torch

    from hybridpar.config import ConfigError
    from hybridpar.engine.launch import check_device, pick_device
    from hybridpar.testing import tiny_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = tiny_config(dp=2)
    cuda = replace(cfg, train=replace(cfg.train, device="cuda"))
    with pytest.raises(ConfigError, match=r"^2 ranks on this machine need 2 GPUs \(one each\), but 1 is "
                                          r"visible; use at most 1 ranks per machine"):
        check_device(cuda)
    assert pick_device(cfg, 0) == torch.device("cpu")  # auto
    assert "2 ranks on this machine but 1 GPU(s): training on the CPU" in capsys.readouterr().err


def test_process_group_timeout_exceeds_the_watchdog_deadline():
    from dataclasses import replace

    from hybridpar.engine.launch import group_timeout_s
    from hybridpar.testing import tiny_config

    cfg = tiny_config()
    for deadline in (10.0, 300.0, 1800.0):
        c = replace(cfg, reliability=replace(cfg.reliability, deadline_s=deadline))
        assert group_timeout_s(c) >= 2 * deadline + 60


def test_auto_precision_is_bf16_on_gpus_and_fp32_on_cpus():
    """IEEE fp32 matmuls are an order of magnitude slower than bf16 on a GPU; on a CPU bf16 is
    emulated. An explicit choice is kept on either."""
    import torch
    from hybridpar.config import TrainConfig, precision_of

    auto = TrainConfig()
    assert auto.precision == "auto"
    assert precision_of(auto, torch.device("cuda", 0)) == "bf16"
    assert precision_of(auto, torch.device("cpu")) == "fp32"
    for p in ("fp32", "bf16", "fp16"):
        assert precision_of(TrainConfig(precision=p), torch.device("cuda", 0)) == p
        assert precision_of(TrainConfig(precision=p), "cpu") == p
