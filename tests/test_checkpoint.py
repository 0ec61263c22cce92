"""Checkpoints: bit-exact resume, loading into other layouts, atomic commit, damage detection.

One spawn of 8 Gloo ranks runs, with tied embeddings (so the pipeline copy of the embedding is
exercised): an uninterrupted 10-step run at (dp, tp, pp) = (2, 2, 2); the same run stopped by a
SIGTERM sent to one rank (3) after step 5, which makes every rank save step 5 and return; then
step 5 loaded into (2, 2, 2) through ``train`` with ``checkpoint.resume`` and into (1, 4, 2),
(4, 1, 2) under ZeRO-1, and (8, 1, 1) through ``Trainer`` + ``checkpoint.load``, each running
steps 6-10. The single-process load, the kill/corruption cases and export run in this process.

Tolerances: same layout -> bitwise (same operations in the same order). Another layout loads
the bitwise-same state, then only the order of additions changes (see tests/test_parity.py):
the first step after loading is the parity test's "step 1" case (1e-5 relative), later steps
its "later" case (1e-4 relative, AdamW amplifies tiny differences of near-zero gradients).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridpar import checkpoint
from hybridpar.interop.export import export
from hybridpar.checkpoint import CheckpointError
from hybridpar.checkpoint.state import Moments
from hybridpar.parallel.mesh import Layout, build_mesh, single_mesh
from hybridpar.parallel.parallelize import assemble, local_state
from hybridpar.testing import rel_err, tiny_config, tiny_dataset

STEPS, SAVE_AT = 10, 5
FIRST_RTOL, LATER_RTOL = 1e-5, 1e-4
# (dp, tp, pp, zero1, cp): cp ranks hold the same parameters, so a cp layout saves and loads
# exactly what its cp=1 counterpart does
LOADS = {"2x2x2": (2, 2, 2, False, 1), "1x4x2": (1, 4, 2, False, 1), "4x1x2-zero1": (4, 1, 2, True, 1),
         "8x1x1": (8, 1, 1, False, 1), "cp2-1x2x2-zero1": (1, 2, 2, True, 2)}


def _cfg(dp, tp, pp, *, zero1=False, steps=STEPS, cp=1, **ck):
    cfg = tiny_config(dp=dp, cp=cp, tp=tp, pp=pp, steps=steps, tie_embeddings=True)
    return replace(cfg, parallel=replace(cfg.parallel, zero1=zero1),
                   checkpoint=replace(cfg.checkpoint, **ck))


def _snapshot(trainer) -> dict:
    """This rank's parameters and AdamW moments as {name: (spec, tensor)} (for ``assemble``)."""
    moments = Moments.read(trainer.pm, trainer.opt)
    out = {"params": local_state(trainer.pm), "step": trainer.step, "opt_step": moments.step.item()}
    for k in ("exp_avg", "exp_avg_sq"):
        out[k] = {n: (trainer.pm.specs[n], m[k].detach().clone()) for n, m in moments.by_name.items()}
    return out


def _mesh(cfg):
    p = cfg.parallel
    return build_mesh(Layout.of(p), torch.device("cpu"), embed_group=True)


def _layouts_worker(root: str, out: str) -> None:
    from hybridpar.engine.train import Callbacks, Trainer, train

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ds = dist.get_rank(), tiny_dataset()
    results = {}
    try:
        ref = Trainer(_cfg(2, 2, 2), _mesh(_cfg(2, 2, 2)), ds)
        losses = []
        while ref.step < STEPS:
            losses.append(ref.train_step()["loss"])
            if ref.step == SAVE_AT:
                results["ref5"] = _snapshot(ref)
        results["ref"] = {"losses": losses}

        def preempt(m):  # one rank gets SIGTERM after step 5; all must save and stop
            if m["step"] == SAVE_AT and rank == 3:
                os.kill(os.getpid(), signal.SIGTERM)
        cfg = _cfg(2, 2, 2, dir=root, every=100)
        hist = train(cfg, _mesh(cfg), dataset=ds, callbacks=Callbacks(on_metrics=preempt))
        results["stopped"] = {"losses": [m["loss"] for m in hist]}

        loaded = {}
        cfg = _cfg(2, 2, 2, dir=root, resume=True)
        def grab(step, pm):  # grads final, update not yet applied: the loaded parameters
            if step == SAVE_AT:
                loaded["params"] = local_state(pm)
            loaded["pm"] = pm
        hist = train(cfg, _mesh(cfg), dataset=ds, callbacks=Callbacks(after_backward=grab))
        results["2x2x2"] = {"losses": [m["loss"] for m in hist], "params": loaded["params"],
                            "final": local_state(loaded["pm"])}
        for name, (dp, tp, pp, zero1, cp) in LOADS.items():
            if name == "2x2x2":
                continue
            cfg = _cfg(dp, tp, pp, zero1=zero1, cp=cp, load=f"{root}/step_{SAVE_AT:06d}")
            t = Trainer(cfg, _mesh(cfg), ds)
            results[name] = _snapshot(t)
            if zero1:  # save again from the ZeRO-1 layout: must equal what was loaded
                checkpoint.save(t, f"{root}-again-{name}", keep=0)
            results[name]["losses"] = [t.train_step()["loss"] for _ in range(STEPS - SAVE_AT)]
        torch.save(results, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    from hybridpar.engine.launch import spawn

    tmp = tmp_path_factory.mktemp("ckpt-layouts")
    spawn(_layouts_worker, 8, str(tmp / "ck"), str(tmp))
    parts = [torch.load(tmp / f"{r}.pt", weights_only=False) for r in range(8)]
    return tmp / "ck", parts


def _full(parts, case, what="params"):
    return assemble([p[case][what] for p in parts])


def _saved(root, step=SAVE_AT):
    """The checkpoint's consolidated tensors, as {params|exp_avg|exp_avg_sq: {name: tensor}}."""
    record, flat = checkpoint.read_full(root / f"step_{step:06d}", prefix="")
    out = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for key, v in flat.items():
        kind, name = key.split("/", 1)
        if kind == "model":
            out["params"][name] = v
        elif name != "step":
            name, moment = name.rsplit("/", 1)
            out[moment][name] = v
    return record, flat["optim/step"].item(), out


def _assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    bad = [k for k in want if not got[k].equal(want[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[0]}"


def test_checkpoint_holds_exactly_the_state_at_the_save(layouts):
    root, parts = layouts
    record, opt_step, saved = _saved(root)
    assert record["step"] == SAVE_AT and opt_step == SAVE_AT
    assert "lm_head.weight" not in saved["params"]  # tied: the pipeline copy is not saved
    for what in ("params", "exp_avg", "exp_avg_sq"):
        _assert_bitwise(saved[what], _full(parts, "ref5", what), f"checkpoint {what}")


def test_sigterm_on_one_rank_saves_on_all_and_stops(layouts):
    root, parts = layouts
    ref = parts[0]["ref"]["losses"]
    assert parts[0]["stopped"]["losses"] == ref[:SAVE_AT]  # stopped after step 5, not later
    assert (root / "latest").read_text().strip() == f"step_{STEPS:06d}"  # the resumed run's last save
    assert (root / f"step_{SAVE_AT:06d}" / "manifest.json").is_file()


def test_resume_same_layout_is_bitwise(layouts):
    root, parts = layouts
    ref = parts[0]["ref"]["losses"]
    assert parts[0]["2x2x2"]["losses"] == ref[SAVE_AT:], "steps 6-10 after resume differ"
    _assert_bitwise(_full(parts, "2x2x2"), _saved(root)[2]["params"], "parameters after resume")
    _, _, final = _saved(root, STEPS)  # the resumed run saved at its last step
    _assert_bitwise(_full(parts, "2x2x2", "final"), final["params"], "final parameters")


@pytest.mark.parametrize("case", [n for n in LOADS if n != "2x2x2"])
def test_other_layout_loads_bitwise_and_continues(layouts, case):
    root, parts = layouts
    _, _, saved = _saved(root)
    for what in ("params", "exp_avg", "exp_avg_sq"):
        _assert_bitwise(_full(parts, case, what), saved[what], f"{case} {what}")
    assert {p[case]["step"] for p in parts} == {SAVE_AT}
    assert {p[case]["opt_step"] for p in parts} == {SAVE_AT}
    _assert_continues(parts[0][case]["losses"], parts[0]["ref"]["losses"], case)


def _assert_continues(got, ref, case):
    errs = [rel_err(a, b) for a, b in zip(got, ref[SAVE_AT:])]
    assert len(got) == STEPS - SAVE_AT
    print(f"{case}: loss rel errs after loading {['%.1e' % e for e in errs]}")
    assert errs[0] <= FIRST_RTOL and max(errs) <= LATER_RTOL, (case, errs)


@pytest.mark.parametrize("case", [n for n, c in LOADS.items() if c[3]])
def test_zero1_saves_what_it_loaded(layouts, case):
    root, _ = layouts
    _, step_a, a = _saved(root)
    _, step_b, b = _saved(Path(f"{root}-again-{case}"))
    assert step_a == step_b
    for what in a:
        _assert_bitwise(b[what], a[what], f"ZeRO-1 re-save {what}")


def test_single_process_loads_and_continues(layouts):
    from hybridpar.engine.train import Trainer

    root, parts = layouts
    torch.set_num_threads(1)
    t = Trainer(_cfg(1, 1, 1, load=str(root / f"step_{SAVE_AT:06d}")), single_mesh(), tiny_dataset())
    snap = _snapshot(t)
    _, _, saved = _saved(root)
    for what in ("params", "exp_avg", "exp_avg_sq"):
        _assert_bitwise(assemble([snap[what]]), saved[what], f"1x1x1 {what}")
    assert t.step == SAVE_AT
    _assert_continues([t.train_step()["loss"] for _ in range(STEPS - SAVE_AT)], parts[0]["ref"]["losses"],
                      "1x1x1")


# ---- one process: atomic commit, damage, another model, export --------------------------------

def _small(root, **model):
    from hybridpar.engine.train import Trainer

    torch.set_num_threads(1)
    cfg = tiny_config(steps=6, microbatches=1, **{"n_layers": 2, **model})
    resume = checkpoint.latest(Path(root)) is not None  # --resume with nothing is an error
    return Trainer(replace(cfg, checkpoint=replace(cfg.checkpoint, dir=str(root), resume=resume)),
                   single_mesh(), tiny_dataset())


@pytest.fixture
def saved2(tmp_path):
    """A one-process checkpoint at step 2 (keep=1) and its consolidated content."""
    root = tmp_path / "ck"
    t = _small(root)
    t.train_step()
    t.train_step()
    checkpoint.save(t, root, keep=1)
    return t, root, checkpoint.read_full(root, prefix="")[1]


# what a save of step 3 killed at each point leaves (before the next save cleans it up)
KILL_LEFTOVER = {"shards": "step_000003.tmp-", "manifest": "step_000003.tmp-", "rename": "step_000003",
                 "latest": "latest.tmp-", "prune": "step_000002.tmp-del"}


@pytest.mark.parametrize("point", list(KILL_LEFTOVER))
def test_save_killed_at_any_point_leaves_a_loadable_latest(saved2, point):
    t, root, want = saved2
    pid = os.fork()
    if pid == 0:  # the saving process, SIGKILLed at ``point`` of the save of step 3
        try:
            os.environ[checkpoint.KILL_ENV] = f"0:{point}"
            t.step += 1
            checkpoint.save(t, root, keep=1)
        finally:
            os._exit(7)  # reached only if the kill did not happen
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"not killed at {point}"
    # before `latest` is replaced the previous checkpoint stays current; after it, the new one
    expect = 3 if point == "prune" else 2
    assert checkpoint.latest(root).name == f"step_{expect:06d}"
    left = [p for p in root.iterdir() if p.name.startswith(KILL_LEFTOVER[point])]
    assert left, f"a kill at {point} should leave {KILL_LEFTOVER[point]}*"
    if point in ("shards", "manifest"):  # a complete-looking but uncommitted folder
        with pytest.raises(CheckpointError, match="is no complete checkpoint"):
            checkpoint.resolve(left[0])
    fresh = _small(root)  # resumes from `latest`, every file verified
    assert fresh.step == expect
    got = checkpoint.read_full(root, prefix="")[1]
    _assert_bitwise(got, want, f"checkpoint after a kill at {point}")
    fresh.train_step()
    checkpoint.save(fresh, root, keep=1)  # the next save cleans up the killed one's leftovers
    assert sorted(p.name for p in root.iterdir()) == ["latest", f"step_{expect + 1:06d}"]


def _damaged(root, tmp_path, how):
    copy = tmp_path / f"damaged-{how}"
    shutil.copytree(checkpoint.resolve(root), copy)
    shard = copy / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if how == "truncated":
        data = data[:len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return copy


@pytest.mark.parametrize("how,word", [("truncated", "truncated"), ("flipped", "corrupt")])
def test_damaged_shard_is_named(saved2, tmp_path, how, word):
    t, root, _ = saved2
    copy = _damaged(root, tmp_path, how)
    with pytest.raises(CheckpointError, match=rf"__0_0\.distcp is {word}"):
        checkpoint.load(t, copy)
    with pytest.raises(CheckpointError, match=rf"{copy}.*__0_0\.distcp"):
        export(copy, tmp_path / "out")


def test_other_model_is_refused_naming_shapes(saved2, tmp_path):
    _, root, _ = saved2
    other = _small(tmp_path / "empty", d_model=64)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(other, root)
    msg = str(e.value)
    assert "layers.0.attn.wq.weight (32, 32) in the checkpoint vs (64, 64) here" in msg, msg
    assert "model.d_model=32 there, 64 here" in msg, msg
    deeper = _small(tmp_path / "empty2", n_layers=3)
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wk\.weight absent in the checkpoint"):
        checkpoint.load(deeper, root)


def test_existing_checkpoints_are_not_overwritten_without_resume(saved2):
    from hybridpar.engine.train import Trainer

    _, root, _ = saved2
    cfg = tiny_config(steps=6, n_layers=2, microbatches=1)
    with pytest.raises(CheckpointError, match="already holds checkpoints.*--resume"):
        Trainer(replace(cfg, checkpoint=replace(cfg.checkpoint, dir=str(root))), single_mesh(), tiny_dataset())


def test_export_is_plain_safetensors_and_config(saved2, tmp_path):
    from safetensors.torch import load_file

    from hybridpar.cli.main import main
    from hybridpar.interop.hf import hf_name

    _, root, want = saved2
    assert main(["export", str(root), "--out", str(tmp_path / "hf")]) == 0
    got = load_file(tmp_path / "hf" / "model.safetensors")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 2
    model = {k[len("model/"):]: v for k, v in want.items() if k.startswith("model/")}
    _assert_bitwise(got, {hf_name(k): v for k, v in model.items()}, "exported weights")


def test_generate_reads_a_training_checkpoint(saved2, tmp_path, capsys):
    from hybridpar.cli.main import main
    from hybridpar.interop.generate import complete

    _, root, _ = saved2
    assert main(["export", str(root), "--out", str(tmp_path / "hf")]) == 0
    want = complete(str(tmp_path / "hf"), "def f(", max_new_tokens=7, temperature=0.0)
    capsys.readouterr()
    assert main(["generate", str(root), "--prompt", "def f(", "--max-new-tokens", "7",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "def f(" + want + "\n"
