"""Helpers to check a layout against a single process: tiny configs, a multi-case worker, and
bug injections that prove the checks can fail. Used by the tests; importable by any user who
wants to verify their own build (``python -m pytest tests``)."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from .engine.data import Dataset
from .parallel.mesh import Layout, build_mesh, single_mesh
from .models import spec_for
from .parallel.parallelize import assemble, local_buffers, local_state
from .engine.train import Callbacks, train


def tiny_config(*, dp=1, tp=1, pp=1, schedule="1f1b", microbatches=4, steps=5, order="tp-dp-pp",
                cp=1, **model) -> Config:
    """8 small layers so every factorisation of 8 ranks fits; GQA (8 query, 4 kv heads)."""
    m = dict(n_layers=8, d_model=32, n_heads=8, n_kv_heads=4, d_ff=64, vocab_size=256, seq_len=16)
    m.update(model)
    return Config(
        model=ModelConfig(**m),
        parallel=ParallelConfig(dp=dp, cp=cp, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule,
                                order=order,
                                bucket_mb=0.03),  # small buckets: several per rank (12 at pp=1), overlap exercised
        # evaluation on, as users run it: mid-run (step 3) and at the last step
        train=TrainConfig(steps=steps, global_batch=32, lr=1e-2, warmup_steps=2, eval_every=3,
                          precision="fp32",  # exact comparisons on any device
                          eval_batches=2, progress=False, threads_per_rank=1, seed=1234,
                          grad_clip=1.0),
        data=DataConfig())


def tiny_vit_config(*, dp=1, tp=1, pp=1, schedule="1f1b", microbatches=4, steps=5,
                    **model) -> Config:
    """A ViT of 8 blocks on the digits (17 tokens: 16 patches of 2x2 pixels + the class
    token), 8 heads so that every factorisation of 8 ranks fits."""
    m = dict(name="vit", n_layers=8, d_model=32, n_heads=8, d_ff=64, image_size=8, patch_size=2,
             norm_eps=1e-5)
    m.update(model)
    c = tiny_config(dp=dp, tp=tp, pp=pp, schedule=schedule, microbatches=microbatches,
                    steps=steps)
    return replace(c, model=ModelConfig(**m), data=DataConfig(val_fraction=0.2))


def tiny_resnet_config(*, dp=1, tp=1, pp=1, schedule="1f1b", microbatches=2, steps=5,
                       **model) -> Config:
    """A ResNet of 4 basic blocks (widths 4/8/16, BatchNorm everywhere) on the digits: the
    pipeline boundaries shrink from (rows, 4, 8, 8) to (rows, 16, 2, 2). Two micro-batches of
    16 images: BatchNorm divides by the batch's std, so a micro-batch of a few images would
    amplify rounding differences between layouts beyond the engine's tolerances."""
    c = tiny_vit_config(dp=dp, tp=tp, pp=pp, schedule=schedule, microbatches=microbatches,
                        steps=steps)
    m = dict(name="resnet", n_layers=4, base_channels=4)
    m.update(model)
    return replace(c, model=replace(c.model, **m))


def tiny_unet_config(*, dp=1, tp=1, pp=1, schedule="1f1b", microbatches=2, steps=5,
                     **model) -> Config:
    """The denoising UNet (5 blocks; its stages exchange tuples of skip tensors) on noisy
    digits, widths 4/8, GroupNorm of 2 groups."""
    m = dict(name="unet", base_channels=4, norm_groups=2)
    m.update(model)
    return tiny_resnet_config(dp=dp, tp=tp, pp=pp, schedule=schedule, microbatches=microbatches,
                              steps=steps, **m)


def test_data(cfg: Config):
    """The data a test case trains on: the tiny token stream for text models without a data
    path, else what ``cfg`` names (its text or instruction data with its tokenizer, or the
    model's embedded images)."""
    spec = spec_for(cfg.model)
    if spec.data == "text" and not cfg.data.path:
        return tiny_dataset()
    from .engine.data import load_data
    return load_data(cfg, spec)


test_data.__test__ = False  # not a pytest test


def tiny_dataset(n_tokens: int = 50_000, seed: int = 0) -> Dataset:
    """Random bytes with some structure (a repeated phrase), so losses move but stay finite."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=n_tokens, dtype=np.uint8)
    phrase = np.frombuffer(b"def hybrid(dp, tp, pp): return dp * tp * pp\n", dtype=np.uint8)
    for start in range(0, n_tokens - len(phrase), 200):
        base[start:start + len(phrase)] = phrase
    cut = int(n_tokens * 0.9)
    return Dataset(train=base[:cut], val=base[cut:], source="tiny", n_files=1)


@contextlib.contextmanager
def injected(bug: str | None):
    """Temporarily break one piece of the engine (the parity tests must then fail)."""
    if bug is None:
        yield
        return
    from .parallel.data_parallel import GradSync
    from .parallel.pipeline.runtime import PipelineRunner
    from .parallel.tensor_parallel import apply as tp_apply

    if bug == "drop_tp_allreduce":  # row-parallel output not summed over tp
        target, name, new = tp_apply, "reduce_from_tp", lambda x, group, **kw: x
    elif bug == "bias_added_tp_times":  # row-parallel bias added on every tp rank, then summed
        import torch.nn.functional as F
        target, name = tp_apply, "_row_forward"

        def new(lin, leave, x):
            if isinstance(lin, tp_apply._CONV):
                return leave(lin._conv_forward(x, lin.weight, lin.bias))
            return leave(F.linear(x, lin.weight, lin.bias))
    elif bug == "unsynced_batchnorm":  # BatchNorm statistics of the local rows only
        from .parallel import batchnorm
        target, name = batchnorm, "batch_stats"
        orig_stats = batchnorm.batch_stats

        def new(x, group):
            return orig_stats(x, None)
    elif bug == "swap_boundary_tuple":  # a stage sends its tuple's elements in swapped order
        target, name = PipelineRunner, "_comm"
        orig_comm = PipelineRunner._comm

        def new(self, batch, st):
            for a in batch:
                out = st.outputs.get((a.chunk, a.mb)) if a.op.name == "SEND_F" else None
                if isinstance(out, tuple) and len(out) == 2:
                    st.outputs[(a.chunk, a.mb)] = out[::-1]
            return orig_comm(self, batch, st)
    elif bug == "sum_not_average_dp":  # dp gradients summed, not averaged
        target, name = GradSync, "finish"
        orig = GradSync.finish

        def new(self):
            orig(self)
            if self.active:
                for b in self.buckets:
                    b.grad.mul_(dist.get_world_size(self.group))
    elif bug == "cp_local_positions":  # cp: rotary by local token index, not global position
        from .models import llama, transformer
        target, name = llama, "shard_sequence"

        def new(model, shard):
            for m in model.modules():
                if isinstance(m, transformer.Attention):
                    m.core = functools.partial(shard.attend, causal=True)
    elif bug == "cp_grads_over_dp_only":  # cp: gradients not averaged over the cp ranks
        from .parallel.mesh import ParallelMesh
        target, name = ParallelMesh, "group"

        def new(self, axis):
            return self.groups.get("dp" if axis == "dcp" else axis)
    elif bug == "skip_microbatch":  # the last micro-batch never runs (on every stage)
        target, name = PipelineRunner, "run"
        orig_run = PipelineRunner.run

        def new(self, actions, inputs, targets):
            last = self.n_microbatches - 1
            return orig_run(self, [a for a in actions if a.mb != last], inputs, targets)
    else:
        raise ValueError(f"unknown bug {bug!r}")
    saved = getattr(target, name)
    setattr(target, name, new)
    try:
        yield
    finally:
        setattr(target, name, saved)


def run_case(cfg: Config, *, dataset: Dataset, bug: str | None = None, mesh=None) -> dict:
    """Train ``cfg`` on this rank (inside an initialised world, or alone); return this rank's
    losses, its gradients after step 1 and its parameters after training, as local shards (on
    the CPU). ``mesh``: where to train (default: this world's ranks on the CPU)."""
    if mesh is None:
        layout, device = Layout.of(cfg.parallel), torch.device("cpu")
        mesh = (build_mesh(layout, device, embed_group=bool(spec_for(cfg.model).tied))
                if layout.world_size > 1 else single_mesh(device))
    grads = {}
    pm_ref = {}

    def after_backward(step, pm):
        pm_ref["pm"] = pm
        if step == 0:
            grads.update(local_state(pm, grads=True))

    with injected(bug):
        history = train(cfg, mesh, dataset=dataset, callbacks=Callbacks(after_backward=after_backward))
    return {"losses": [m["loss"] for m in history], "grad_norms": [m["grad_norm"] for m in history],
            "val_losses": [m["val_loss"] for m in history if "val_loss" in m],
            "mem": history[-1]["mem"],
            "max_in_flight": history[-1]["max_in_flight"], "pp_rank": mesh.pp_rank,
            "grads": grads, "params": local_state(pm_ref["pm"]),
            "buffers": local_buffers(pm_ref["pm"])}


def cases_worker(cases: list[tuple[str, Config, str | None]], out_dir: str) -> None:
    """Run every case on the already-spawned ranks (one spawn, many layouts); each rank saves
    its result to ``out_dir/<case>/<rank>.pt``."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for name, cfg, bug in cases:
            result = run_case(cfg, dataset=test_data(cfg), bug=bug)
            folder = Path(out_dir, name)
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(result, folder / f"{rank}.pt")
    finally:
        from .engine.launch import teardown
        teardown()


def join_world(rank: int, world: int, port: int, out: str, *, timeout_s: float | None = None) -> None:
    """For a test rank started directly (a ``launch.rank_context()`` process, not ``spawn``): its
    stderr into ``out/stderr-rank{rank}.txt`` (read by the test when it fails), the env://
    variables, one thread, and the Gloo group (``timeout_s``: Gloo's own collective timeout)."""
    import os
    from datetime import timedelta

    from .engine.forkserver import as_rank
    from .reliability.watchdog import LAUNCH_DIR_ENV

    log = open(Path(out, f"stderr-rank{rank}.txt"), "w")
    os.dup2(log.fileno(), 2)
    # started from ``launch.rank_context()``'s fork server: its environment and its ignored
    # SIGTERM are the server's, not this test's; no launcher folder either
    as_rank()
    os.environ.pop(LAUNCH_DIR_ENV, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    opts = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", **opts)


def fused_cases_worker(cases: list[tuple[str, Config, str | None]], out_dir: str) -> None:
    """``cases_worker`` with ``fused_linear`` fusing on the CPU too: the projections' path a
    GPU runs in fp32, on Gloo ranks (each spawned rank is its own process)."""
    from .models import fused

    fused.FUSE_ON = (*fused.FUSE_ON, "cpu")
    cases_worker(cases, out_dir)


def run_cases(cases: dict[str, tuple[Config, str | None]], out_dir: str, *,
              world: int = 8) -> dict[str, dict]:
    """Spawn ``world`` ranks once, run every case ``name -> (config, injected bug)`` on them,
    and return the merged results by name."""
    from .engine.launch import spawn

    spawn(cases_worker, world, [(n, c, b) for n, (c, b) in cases.items()], out_dir)
    return {name: load_case(out_dir, name) for name in cases}


_references: dict = {}


def cached_reference(cfg: Config) -> dict:
    """``reference(cfg)``, computed once per (model, micro-batches, steps) in this process."""
    key = (cfg.model, cfg.parallel.microbatches, cfg.train)
    if key not in _references:
        _references[key] = reference(cfg)
    return _references[key]


def load_case(out_dir: str, name: str) -> dict:
    """Merge the per-rank results of a case: losses from rank 0, full grads and params."""
    files = sorted(Path(out_dir, name).glob("*.pt"), key=lambda f: int(f.stem))
    parts = [torch.load(f, weights_only=False) for f in files]
    return {"losses": parts[0]["losses"], "grad_norms": parts[0]["grad_norms"],
            "val_losses": parts[0]["val_losses"],
            "max_in_flight": {r: p["max_in_flight"] for r, p in enumerate(parts)},
            "pp_rank": {r: p["pp_rank"] for r, p in enumerate(parts)},
            "mem": {r: p["mem"] for r, p in enumerate(parts)},
            "grads": assemble([p["grads"] for p in parts]),
            "params": assemble([p["params"] for p in parts]),
            "buffers": assemble([p["buffers"] for p in parts])}


def reference(cfg: Config, dataset: Dataset | None = None) -> dict:
    """The single-process run of ``cfg`` with dp=cp=tp=pp=1 (same micro-batches, same everything)."""
    sched = "1f1b" if cfg.parallel.schedule == "interleaved" else cfg.parallel.schedule
    one = replace(cfg, parallel=replace(cfg.parallel, dp=1, cp=1, tp=1, pp=1, virtual_stages=1,
                                        schedule=sched))
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.train.threads_per_rank or threads)  # the ranks' kernels, bitwise
    try:
        r = run_case(one, dataset=dataset or test_data(cfg))
    finally:
        torch.set_num_threads(threads)
    return {**r, "grads": assemble([r["grads"]]), "params": assemble([r["params"]]),
            "buffers": assemble([r["buffers"]])}


def rel_err(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def max_rel_tensor_err(got: dict, ref: dict, *, floor: float = 1e-3) -> tuple[float, str]:
    """max over tensors of ||got - ref||_inf / max(||ref||_inf, floor * largest ||ref||_inf),
    and the worst tensor's name.

    The floor exists for gradients that are zero in exact arithmetic: a ViT's key bias (softmax
    is invariant to shifting every key by the same vector) gets only the rounding noise of its
    cancelling terms (~1e-11 here, against 0.18 for the largest gradient), and noise relative to
    noise is meaningless. Such a tensor is held to an absolute error of ``floor`` x the largest
    gradient x the tolerance; every tensor whose gradient exceeds that floor is compared
    relatively as before."""
    worst, where = 0.0, ""
    if got.keys() != ref.keys():
        raise AssertionError(f"parameter names differ: {sorted(got.keys() ^ ref.keys())}")
    scale = floor * max((r.abs().max().item() for r in ref.values()), default=0.0)
    for k, r in ref.items():
        if got[k].isnan().any() and not r.isnan().any():
            raise AssertionError(f"{k}: {int(got[k].isnan().sum())} elements held by no rank")
        e = (got[k] - r).abs().max().item() / max(r.abs().max().item(), scale, 1e-30)
        if e > worst:
            worst, where = e, k
    return worst, where
