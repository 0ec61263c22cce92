"""Hugging Face Llama interop: a randomly initialised ``transformers.LlamaForCausalLM`` (no
download) imported into our model gives the same logits in one process and in (dp, tp, pp)
layouts; HF -> ours -> HF is bitwise; training from it starts at HF's own loss.

Tolerances (float32, unit roundoff u = 6e-8). One process runs the same operations as
transformers in the same order (same RoPE tables, same RMSNorm, same repeat_kv head order), so
its logits are expected bitwise equal; we allow 1e-6 relative to max |logit| so a future
transformers that fuses an op differently still passes while any mapping mistake (errors O(1))
fails. Tensor parallelism reorders the reductions of o_proj (K = 64) and down_proj (K = 128)
into tp partial sums plus one all-reduce: each reordered sum moves by at most ~K u ~ 8e-6 of its
terms' magnitude, and RMSNorm renormalises between layers, so 1e-5 relative to max |logit| is
the bound (the same basis as tests/test_parity.py). Pipeline parallelism alone changes no
arithmetic and must be bitwise.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("safetensors")

from hybridpar.interop import hf  # noqa: E402
from hybridpar.config import Config, ConfigError, ParallelConfig, TrainConfig, validate  # noqa: E402

SEQ, BATCH = 32, 2
SINGLE_RTOL, TP_RTOL = 1e-6, 1e-5
# (dp, tp, pp) layouts on 4 ranks; the tied model exercises the pipeline copy of the embedding
LAYOUTS = [("untied", (2, 2, 1)), ("untied", (1, 2, 2)), ("untied", (1, 4, 1)), ("untied", (1, 1, 4)),
           ("tied", (1, 2, 2))]
TRAIN_LAYOUT, TRAIN_STEPS, TRAIN_BATCH = (2, 2, 1), 3, 8


def _hf_model(tied: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7 if tied else 3)
    c = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
        rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(c).eval()
    with torch.no_grad():  # every weight random and O(1)-ish, norms included (no weight of ones
        for name, p in model.named_parameters():  # could hide a swapped norm)
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def _tokens():
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{kind: (folder, HF logits of _tokens())}, saved with save_pretrained (safetensors)."""
    out = {}
    for kind in ("untied", "tied"):
        model = _hf_model(kind == "tied")
        folder = tmp_path_factory.mktemp(f"hf-{kind}")
        model.save_pretrained(folder)
        with torch.no_grad():
            out[kind] = (str(folder), model(_tokens()).logits)
    return out


def _train_cfg(folder: str, layout=(1, 1, 1)) -> Config:
    m = replace(hf.read_hf_config(folder), init_from=folder)
    dp, tp, pp = layout
    return Config(model=m, parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, microbatches=2),
                  train=TrainConfig(steps=TRAIN_STEPS, global_batch=TRAIN_BATCH, lr=1e-3, warmup_steps=1,
                                    eval_every=0, progress=False, threads_per_rank=1, seed=5))


# ---- one spawned group of 4 ranks runs every layout -------------------------------------------

def _stage_logits(pm, x: torch.Tensor):
    """Forward through this rank's pipeline: logits (vocab gathered over tp) on the last stage."""
    import torch.distributed as dist

    mesh = pm.mesh
    h = x
    if not pm.is_first:
        h = torch.empty(x.shape[0], x.shape[1], pm.module.cfg.d_model)
        dist.recv(h, src=mesh.stage_rank(mesh.pp_rank - 1))
    out = pm.module(h)
    if not pm.is_last:
        dist.send(out.contiguous(), dst=mesh.stage_rank(mesh.pp_rank + 1))
        return None
    if mesh.group("tp") is not None:
        parts = [torch.empty_like(out) for _ in range(mesh.layout.tp)]
        dist.all_gather(parts, out.contiguous(), group=mesh.group("tp"))
        out = torch.cat(parts, dim=-1)
    return out


def _worker(dirs: dict[str, str], out_dir: str) -> None:
    import torch.distributed as dist

    from hybridpar.parallel.mesh import Layout, build_mesh
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.testing import run_case, tiny_dataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        x = _tokens()
        for kind, (dp, tp, pp) in LAYOUTS:
            cfg = replace(_train_cfg(dirs[kind]), parallel=ParallelConfig(dp=dp, tp=tp, pp=pp))
            mesh = build_mesh(Layout(dp, tp, pp), torch.device("cpu"), embed_group=cfg.model.tie_embeddings)
            pm = parallelize(cfg, mesh, init_state=hf.open_state(cfg.model.init_from))
            with torch.no_grad():
                logits = _stage_logits(pm, x)
            if logits is not None:
                torch.save(logits, f"{out_dir}/logits-{kind}-{dp}x{tp}x{pp}-rank{rank}.pt")
        result = run_case(_train_cfg(dirs["untied"], TRAIN_LAYOUT), dataset=tiny_dataset())
        if rank == 0:
            torch.save(result["losses"], f"{out_dir}/train-losses.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def layout_results(hf_dirs, tmp_path_factory):
    from hybridpar.engine.launch import spawn

    out = tmp_path_factory.mktemp("hf-layouts")
    spawn(_worker, 4, {k: v[0] for k, v in hf_dirs.items()}, str(out))
    return out


# ---- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_single_process_logits_equal_transformers(hf_dirs, kind):
    from hybridpar.interop.generate import load_model
    from hybridpar.parallel.mesh import single_mesh
    from hybridpar.parallel.parallelize import parallelize

    folder, want = hf_dirs[kind]
    got = load_model(folder)(_tokens())
    err = _rel(got.detach(), want)
    print(f"{kind} single process: max |logit diff| / max |logit| = {err:.2e}")
    assert err <= SINGLE_RTOL
    # the training path (parallelize + model.init_from) builds the very same model
    pm = parallelize(_train_cfg(folder), single_mesh(), init_state=hf.open_state(folder))
    with torch.no_grad():
        assert _rel(pm.module(_tokens()), want) <= SINGLE_RTOL


@pytest.mark.parametrize("kind,layout", LAYOUTS, ids=[f"{k}-{d}x{t}x{p}" for k, (d, t, p) in LAYOUTS])
def test_layout_logits_equal_transformers(hf_dirs, layout_results, kind, layout):
    dp, tp, pp = layout
    files = sorted(layout_results.glob(f"logits-{kind}-{dp}x{tp}x{pp}-rank*.pt"))
    assert len(files) == dp * tp, files  # every last-stage rank gathered the full logits
    want = hf_dirs[kind][1]
    for f in files:
        got = torch.load(f)
        err = _rel(got, want)
        print(f"{kind} {dp}x{tp}x{pp} {f.stem}: rel err {err:.2e}")
        if tp == 1 and dp == 1:
            assert torch.equal(got, want), f"pure pipeline is not bitwise: {err:.2e}"
        assert err <= TP_RTOL


def test_training_from_import_starts_at_transformers_loss(hf_dirs, layout_results):
    """Step-1 loss of a (2,2,1) run initialised from the HF folder = HF's own loss on that batch,
    and its losses follow the single-process run from the same folder."""
    from hybridpar.engine import data
    from hybridpar.testing import reference, tiny_dataset

    folder = hf_dirs["untied"][0]
    model = _hf_model(False)  # the very same weights (same seed)
    ds = tiny_dataset()
    cfg = _train_cfg(folder)
    x, y = data.global_batch(ds.train, 0, seed=cfg.train.seed, global_batch_size=TRAIN_BATCH, seq_len=SEQ)
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()
    got = torch.load(layout_results / "train-losses.pt")
    ref = reference(cfg, ds)["losses"]
    print(f"HF loss {hf_loss:.6f}, (2,2,1) step-1 {got[0]:.6f}, single {ref[0]:.6f}")
    assert len(got) == TRAIN_STEPS
    assert abs(ref[0] - hf_loss) / hf_loss <= TP_RTOL
    assert abs(got[0] - hf_loss) / hf_loss <= TP_RTOL
    for a, b in zip(got, ref):
        assert abs(a - b) / b <= 1e-4  # later steps: see tests/test_parity.py on AdamW
    assert math.isfinite(got[-1]) and got[-1] < got[0]


def test_round_trip_is_bitwise(hf_dirs, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    for kind in ("untied", "tied"):
        folder, want = hf_dirs[kind]
        m, state = hf.read_hf(folder)
        ours = tmp_path / f"ours-{kind}"
        hf.write_ours(ours, m, state)
        back = tmp_path / f"back-{kind}"
        hf.write_hf(back, hf.read_ours_config(ours), hf.open_state(ours))
        a, b = load_file(f"{folder}/model.safetensors"), load_file(back / "model.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        original = json.loads(open(f"{folder}/config.json").read())
        exported = json.loads((back / "config.json").read_text())
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                    "rms_norm_eps", "tie_word_embeddings"):
            assert exported[key] == original[key], key
        reloaded = LlamaForCausalLM.from_pretrained(back).eval()
        with torch.no_grad():
            assert torch.equal(reloaded(_tokens()).logits, want)


def test_sharded_hf_folder_reads_the_same_tensors(hf_dirs, tmp_path):
    folder = hf_dirs["untied"][0]
    _hf_model(False).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    _, sharded = hf.read_hf(tmp_path)
    _, single = hf.read_hf(folder)
    assert sharded.keys() == single.keys()
    for k in single:
        assert torch.equal(sharded[k], single[k]), k


def test_rope_layout_matters(hf_dirs):
    """Permuting q/k rows into the interleaved RoPE layout (Meta's original checkpoints) must
    break the logits: the parity above really checks that no permutation is needed."""
    from hybridpar.interop.generate import load_model

    folder, want = hf_dirs["untied"]
    model = load_model(folder)
    hd = model.cfg.head_dim
    # rotate-half pair (i, i + hd/2) -> interleaved pair (2i, 2i + 1), per head
    perm = torch.arange(hd).view(2, hd // 2).t().reshape(-1)
    with torch.no_grad():
        for block in model.layers.values():
            for lin in (block.attn.wq, block.attn.wk):
                w = lin.weight.view(-1, hd, lin.weight.size(1))
                lin.weight.copy_(w[:, perm].reshape_as(lin.weight))
        err = _rel(model(_tokens()), want)
    print(f"interleaved-RoPE q/k: rel err {err:.2e}")
    assert err > 1e-2


def test_mismatched_model_fields_fail_before_any_process(hf_dirs):
    folder = hf_dirs["untied"][0]
    from hybridpar.cli.main import check_model

    cfg = _train_cfg(folder)
    validate(cfg)
    check_model(cfg)
    bad = replace(cfg, model=replace(cfg.model, n_kv_heads=8))
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=8 but model.init_from=.* has n_kv_heads=4"):
        check_model(bad)
    with pytest.raises(ConfigError, match="model.init_from: .* does not exist"):
        check_model(replace(cfg, model=replace(cfg.model, init_from=folder + "-missing")))


def test_cli_import_export_generate(hf_dirs, tmp_path, capsys):
    from hybridpar.cli.main import main
    from hybridpar.interop.generate import encode, generate, load_model

    folder, _ = hf_dirs["untied"]
    out = tmp_path / "imported"
    assert main(["import-hf", folder, "--out", str(out)]) == 0
    assert main(["export", str(out), "--format", "hf", "--out", str(tmp_path / "exported")]) == 0
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "def f(", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    # greedy generation = a greedy loop over transformers' own logits
    model = _hf_model(False)
    ids = encode("def f(")
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids[-SEQ:]])).logits[0, -1].argmax()))
    ours = generate(load_model(out), encode("def f("), max_new_tokens=12)
    assert ours == ids[len(encode("def f(")):]
    assert printed.startswith("def f(")
    assert main(["export", str(out), "--format", "hf", "--out", str(tmp_path / "x"),
                 "--train.lr=1"]) == 2  # only model fields make sense here: one line, exit 2
