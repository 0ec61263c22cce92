"""The training loop: a plain function that reads top to bottom.

One step = the pipeline schedule over this rank's micro-batches (forward, backward, and with
pp=1 simply gradient accumulation), then the explicit gradient finalisation (dp all-reduce,
tied-embedding sum), then one all-reduce of the step's scalars (gradient norm, loss), clipping
and the AdamW update.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from . import data as data_mod
from .. import checkpoint
from . import summary, tb, trace
from ..parallel.amp import LossScaler
from ..config import Config, TrainConfig, precision_of
from ..reliability.errors import NonFiniteError, faults_for, inject
from ..parallel.memory import ActivationMeter, peak_memory_bytes, state_bytes
from ..parallel.mesh import ParallelMesh
from ..parallel.parallelize import ParallelModel, build_optimizer, parallelize
from ..models import ModelSpec, spec_for
from ..parallel.pipeline.boundaries import infer_boundaries
from ..parallel.pipeline.runtime import PipelineRunner
from ..parallel.pipeline.schedules import build as build_schedule, forward_only
from ..parallel.pipeline.simulate import check as check_schedule
from ..parallel.tensor_parallel.layers import IGNORE_INDEX
from ..reliability import watchdog
from ..reliability.watchdog import activity, find_straggler


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup to ``lr`` then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class Callbacks:
    """Hooks for tests and tools; each is optional."""

    after_backward: Callable[[int, ParallelModel], None] | None = None  # grads final, unclipped
    on_metrics: Callable[[dict], None] | None = None


def _all_reduce_scalars(values: list[float], mesh: ParallelMesh) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=mesh.device)
    if dist.is_initialized() and mesh.layout.world_size > 1:
        dist.all_reduce(t)
    return t.tolist()


def _per_rank(value: float, mesh: ParallelMesh, what: str) -> list[float]:
    """Every rank's ``value`` (an all-gather, as the all-reduce of a one-hot vector). Not run
    every step: on an oversubscribed CPU its latency grows with the world size."""
    t = torch.zeros(mesh.layout.world_size, dtype=torch.float64, device=mesh.device)
    t[mesh.rank] = value
    if dist.is_initialized() and mesh.layout.world_size > 1:
        activity.mark(f"all-gather ({what})", comm=True)
        dist.all_reduce(t)
    return t.tolist()


def _local_rows(step: int, cfg: Config, mesh: ParallelMesh, dataset, split: str = "train",
                shard=None, need: tuple[bool, bool] = (True, True)):
    """This dp rank's rows of the layout-independent global batch, as micro-batches (micro-batch
    k = the same rows of the global batch on every layout); under cp (``shard``), only this cp
    rank's tokens of each row, inputs and targets alike. ``need``: (inputs, targets) moved to
    the device, the others left None (the first pipeline stage reads only the inputs, the last
    only the targets)."""
    t = cfg.train
    batch = dataset.batch(split, step, seed=t.seed, global_batch_size=t.global_batch,
                          seq_len=cfg.model.seq_len)
    mbs = data_mod.local_microbatches(batch, mesh.dp_rank, mesh.layout.dp, cfg.parallel.microbatches)
    if shard is not None:
        mbs = [(shard.take(x), shard.take(y)) for x, y in mbs]
    return ([_to_device(x, mesh.device) if need[0] else None for x, _ in mbs],
            [_to_device(y, mesh.device) if need[1] else None for _, y in mbs])


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor onto the device: on a GPU from pinned memory and asynchronously (the
    copy overlaps the previous micro-batch's kernels instead of stalling the host)."""
    if device.type != "cuda":  # its own copy, as on a GPU (not a view of the whole batch)
        return t.to(device, copy=True)
    return t.pin_memory().to(device, non_blocking=True)


def _counted_targets(step: int, cfg: Config, dataset, split: str = "train") -> int:
    """Targets the loss counts in the whole global batch (masked data: not the prompts)."""
    batch = dataset.batch(split, step, seed=cfg.train.seed, global_batch_size=cfg.train.global_batch,
                          seq_len=cfg.model.seq_len)
    return int((batch[1] != IGNORE_INDEX).sum())


def _sharded_build(pm: ParallelModel):
    """The model builder for the boundaries' meta-device inference: under cp with the spec's
    hook installed, so that a model that makes and selects its tokens itself (the ViT) crosses
    its boundaries with this rank's share of them."""
    spec, shard = pm.spec, pm.sequence_shard
    if shard is None:
        return spec.build

    def build():
        model = spec.build()
        spec.context_parallel(model, shard)
        return model
    return build


class Trainer:
    """State of one run on one rank: model piece, optimizer, schedule, runner."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, dataset=None, *,
                 spec: ModelSpec | None = None):
        self.cfg, self.mesh = cfg, mesh
        spec = spec or spec_for(cfg.model)
        self.dataset = dataset if dataset is not None else data_mod.load_data(cfg, spec)
        if isinstance(self.dataset, data_mod.Dataset):
            data_mod.check_token_range(self.dataset, cfg.model.vocab_size)
        t = cfg.train
        if t.eval_every and hasattr(self.dataset, "max_batches") \
                and self.dataset.max_batches("val", t.global_batch) < 1:
            raise data_mod.DataError(
                f"{self.dataset.describe()}: the held-out split is smaller than one global batch "
                f"of {t.global_batch}; raise data.val_fraction, lower train.global_batch, or set "
                f"train.eval_every=0")
        init_state = None
        if cfg.model.init_from:  # a Hugging Face folder, an import-hf folder, or a tensor file
            from ..interop.hf import open_state
            init_state = open_state(cfg.model.init_from)
        dataset = self.dataset
        self.pm = parallelize(cfg, mesh, spec=spec, init_state=init_state,
                              example=lambda b: dataset.batch("train", 0, seed=cfg.train.seed,
                                                              global_batch_size=b,
                                                              seq_len=cfg.model.seq_len))
        self.opt = build_optimizer(self.pm, cfg)
        p = cfg.parallel
        P, v = mesh.layout.pp, p.virtual_stages
        # every list a rank executes is first proven by the simulator (milliseconds): a list
        # that would deadlock is a bug reported here, on every rank, never a hang mid-run
        train_lists, eval_lists = (build_schedule(p.schedule, P, p.microbatches, v),
                                   forward_only(P, p.microbatches, v))
        check_schedule(train_lists, P, v, what=f"{p.schedule} training schedule")
        check_schedule(eval_lists, P, v, backward=False, what="evaluation schedule")
        self.actions, self.eval_actions = train_lists[mesh.pp_rank], eval_lists[mesh.pp_rank]
        # what crosses each pipeline boundary, from a meta-device forward of one micro-batch
        # cp > 1: which tokens of each sequence are ours (unless the model selects them itself)
        self.shard = self.pm.sequence_shard if self.pm.spec.cp_split_batch else None
        self.need = (self.pm.is_first, self.pm.is_last)  # inputs to stage 0, targets to the last
        example = _local_rows(0, cfg, mesh, self.dataset, shard=self.shard)[0][0]
        boundaries = infer_boundaries(_sharded_build(self.pm), self.pm.stage_units, example,
                                      seq_shards=p.tp if p.sequence_parallel else 1)
        self.precision = precision_of(cfg.train, mesh.device)  # auto: bf16 on a GPU, fp32 on a CPU
        self.scaler = LossScaler() if self.precision == "fp16" else None
        self.runner = PipelineRunner(self.pm.chunks, mesh, p.microbatches, boundaries, self._loss,
                                     eval_fn=spec.eval_metric)
        self.meter = ActivationMeter(self.pm.module.parameters())
        # the meter's saved-tensor hooks would be traced by torch.compile, breaking every unit's
        # graph at each saved tensor: under train.compile activations are not metered
        self.runner.meter = None if cfg.train.compile else self.meter
        self.step = 0
        self.skips = 0  # consecutive steps skipped for a non-finite loss or gradient norm
        self.busy = [0.0, 0]  # busy seconds and steps since the last straggler check
        self.faults = faults_for(mesh.rank)  # HYBRIDPAR_FAULT, for testing failure handling
        self.masked = bool(getattr(self.dataset, "masked", False))  # loss on some targets only
        self.loss_norm = 1.0
        # --resume / checkpoint.load / a restarted torchrun worker: state of any layout's checkpoint
        self.resumed_from = checkpoint.resume(self)

    def _set_loss_norm(self, step: int, split: str = "train") -> None:
        """Masked data (instruction tuning): the loss of a step is the sum over the counted
        targets of the global batch / their number, identical on every layout. A micro-batch
        contributes sum_mb * (M * dp * cp / n); the runtime divides by M and the average over
        the dp x cp replicas by dp * cp (a cp rank sums over its share of the tokens)."""
        if self.masked:
            n = _counted_targets(step, self.cfg, self.dataset, split)
            p = self.cfg.parallel
            self.loss_norm = p.microbatches * p.dp * p.cp / max(n, 1)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.masked:
            loss = self.pm.loss(logits, targets, reduction="sum") * self.loss_norm
        else:
            loss = self.pm.loss(logits, targets)
        return loss * self.scaler.scale if self.scaler is not None and torch.is_grad_enabled() else loss

    def train_step(self, callbacks: Callbacks | None = None) -> dict:
        cfg, mesh, pm = self.cfg, self.mesh, self.pm
        t0 = time.perf_counter()
        activity.begin_step(self.step + 1)
        activity.mark("data")
        xs, ys = _local_rows(self.step, cfg, mesh, self.dataset, shard=self.shard, need=self.need)
        self._set_loss_norm(self.step)
        pm.grad_sync.zero_grad()
        self.meter.reset()
        st = self.runner.run(self.actions, xs, ys)
        activity.mark("grad sync", comm=True)
        pm.finish_grads()
        activity.mark("grad norm")
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if scale != 1.0:
            for b in pm.grad_sync.buckets:
                b.grad.div_(scale)
        if callbacks and callbacks.after_backward:
            callbacks.after_backward(self.step, pm)
        inject(self.faults, rank=mesh.rank, step=self.step + 1, pm=pm, activity=activity)
        activity.mark("grad norm")
        sumsq, replicas = pm.grad_sumsq()
        loss = 0.0
        if pm.is_last and mesh.tp_rank == 0:
            total = None
            for mb in sorted(st.losses):
                total = st.losses[mb] if total is None else total + st.losses[mb]
            loss = total.item()
        bad = 2 if not math.isfinite(loss) else (0 if math.isfinite(sumsq) else 1)
        self.busy = [self.busy[0] + activity.busy_s(), self.busy[1] + 1]
        activity.mark("step all-reduce", comm=True)
        sumsq, loss = _all_reduce_scalars([sumsq, loss], mesh)
        activity.mark("optimizer step")
        # every dp x cp replica's last stage added its loss (a cp rank's: the mean over its tokens,
        # the same count on every cp rank, or the masked share of the global mean times dp*cp)
        grad_norm, loss = math.sqrt(sumsq / replicas), loss / mesh.layout.replicas / scale
        # fp16: an overflowed step is skipped (same decision on every rank: the norm is global)
        update = self.scaler.update(math.isfinite(grad_norm)) if self.scaler is not None else True
        # fp32/bf16; under fp16 the loss scaler owns non-finite steps (overflow is expected there)
        if self.scaler is None and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            update = self._nonfinite(loss, grad_norm, _per_rank(bad, mesh, "non-finite flags"))
        else:
            self.skips = 0
        clip = cfg.train.grad_clip
        if clip > 0 and grad_norm > clip:
            coef = clip / (grad_norm + 1e-6)
            torch._foreach_mul_([p.grad for _, p in pm.named_parameters()], coef)
        lr = lr_at(self.step, cfg.train)
        for g in self.opt.param_groups:
            g["lr"] = lr
        if update:
            self.opt.step()
            pm.grad_sync.gather_params()
        dt = time.perf_counter() - t0
        self.step += 1
        p = cfg.parallel
        return {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                "step_time_s": dt, "skipped": not update, **self._rank_times(),
                "tokens_per_s": cfg.train.global_batch * cfg.model.seq_len / dt,
                "samples_per_s": cfg.train.global_batch / dt,
                "max_mem_bytes": peak_memory_bytes(mesh.device),
                "mem": {**state_bytes(list(pm.module.parameters()),
                                      [b.grad for b in pm.grad_sync.buckets], self.opt),
                        **({} if cfg.train.compile else {"activations": self.meter.peak}),
                        **({"working": st.working_bytes} if st.working_bytes else {})},
                "max_in_flight": st.max_in_flight,
                **({"loss_scale": self.scaler.scale} if self.scaler else {}),
                "layout": {"dp": p.dp, **({"cp": p.cp} if p.cp > 1 else {}), "tp": p.tp, "pp": p.pp,
                           "microbatches": p.microbatches,
                           "schedule": p.schedule}}

    def _rank_times(self) -> dict:
        """Every reliability.straggler_every steps: each rank's mean busy time per step (not
        waiting in communication) since the last check, and the straggler, if any."""
        every = self.cfg.reliability.straggler_every
        if not every or self.step % every:
            return {}
        busy = _per_rank(self.busy[0] / self.busy[1], self.mesh, "busy times")
        self.busy = [0.0, 0]
        out = {"rank_busy_s": {"max": max(busy), "min": min(busy), "slowest": busy.index(max(busy)),
                               "fastest": busy.index(min(busy))}}
        slow = find_straggler(busy, self.mesh.layout, self.cfg.reliability.straggler_threshold)
        if slow:
            out["straggler"] = {"rank": slow[0], "ratio": round(slow[1], 2),
                                "coords": self.mesh.layout.describe_rank(slow[0])}
        return out

    def _nonfinite(self, loss: float, grad_norm: float, bads: list[float]) -> bool:
        """reliability.nan_policy for a step whose all-reduced loss or gradient norm is NaN/Inf
        (so the same decision on every rank): raise NonFiniteError, or return False (skip the
        update) up to max_consecutive_skips times in a row. The rank named is the lowest with a
        non-finite local loss, else with non-finite local gradients; gradients are checked after
        the dp average, which spreads a NaN to every dp replica of its stage."""
        rel = self.cfg.reliability
        self.skips += 1
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        msg = f"non-finite {what} at step {self.step + 1} (loss={loss:.4g}, grad_norm={grad_norm:.4g})"
        flagged = [r for r, b in enumerate(bads) if b == 2] or [r for r, b in enumerate(bads) if b]
        if flagged:
            msg += (f", first on rank {flagged[0]} ({self.mesh.layout.describe_rank(flagged[0])})"
                    + (f" of {len(flagged)} ranks" if len(flagged) > 1 else ""))
        if rel.nan_policy == "stop":
            raise NonFiniteError(f"{msg}; lower train.lr, check the data, or skip such steps with "
                                 f"--reliability.nan_policy=skip")
        if self.skips > rel.max_consecutive_skips:
            raise NonFiniteError(f"{msg}: {self.skips} non-finite steps in a row exceed "
                                 f"reliability.max_consecutive_skips={rel.max_consecutive_skips}; "
                                 f"lower train.lr or check the data")
        if self.mesh.rank == 0:
            tb.rank_logger(self.mesh).warning(f"skipping the update of step {self.step + 1}: {msg}")
        return False

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss (and the spec's eval metric, e.g. accuracy) over ``eval_batches``
        global batches of the held-out split, by the forward-only schedule."""
        cfg, mesh = self.cfg, self.mesh
        total, metric = 0.0, [0.0, 0.0]
        n = cfg.train.eval_batches
        if hasattr(self.dataset, "max_batches"):  # a finite held-out set: each sample once
            n = min(n, self.dataset.max_batches("val", cfg.train.global_batch))
        self.pm.module.eval()  # BatchNorm normalises by its running statistics, updates nothing
        try:
            for i in range(n):
                xs, ys = _local_rows(i, cfg, mesh, self.dataset, "val", shard=self.shard, need=self.need)
                self._set_loss_norm(i, "val")
                st = self.runner.run(self.eval_actions, xs, ys)
                if self.pm.is_last and mesh.tp_rank == 0:
                    total += sum(v.item() for v in st.losses.values())
                    for m in st.metrics.values():
                        metric = [metric[0] + m[0].item(), metric[1] + m[1].item()]
        finally:
            self.pm.module.train()
        activity.mark("eval all-reduce", comm=True)
        total, correct, count = _all_reduce_scalars([total, *metric], mesh)
        out = {"val_loss": total / (n * mesh.layout.replicas)}
        if self.runner.eval_fn is not None and count:
            out["val_accuracy"] = correct / count
        return out


def train(cfg: Config, mesh: ParallelMesh, *, dataset=None, callbacks: Callbacks | None = None,
          spec: ModelSpec | None = None) -> list[dict]:
    """Train ``cfg.train.steps`` steps on this rank; returns the per-step metrics (every rank).
    ``spec`` describes the model (default: the one ``cfg.model`` names)."""
    lock = checkpoint.lock_folder(cfg)  # one job per checkpoint folder, held until we return
    try:
        return _train(cfg, mesh, dataset, callbacks, spec)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg, mesh, dataset, callbacks, spec) -> list[dict]:
    trainer = Trainer(cfg, mesh, dataset, spec=spec)
    t = cfg.train
    if mesh.rank == 0 and t.summary:
        for line in summary.startup_lines(trainer):  # stdout, like the end line
            print(f"hybridpar: {line}", flush=True)
    if trainer.step >= t.steps and mesh.rank == 0:
        print(f"hybridpar: nothing to train: {trainer.resumed_from} is at step {trainer.step} and "
              f"train.steps={t.steps}; raise --steps to continue", file=sys.stderr, flush=True)
    tracer = trace.Tracer(mesh.rank).install(trainer) if t.trace else None
    is_rank0 = mesh.rank == 0
    bar = None
    if is_rank0 and t.progress:
        from tqdm import tqdm
        bar = tqdm(total=t.steps, initial=trainer.step, desc="train", unit="step", dynamic_ncols=True)
    sink = open(t.metrics, "a" if trainer.step else "w") if (is_rank0 and t.metrics) else None
    board = tb.open_writer(cfg, mesh)  # rank 0 only, when train.tensorboard is set
    log = tb.rank_logger(mesh)
    history = []
    last_slow = None
    dog = watchdog.start(cfg, mesh)  # None on one rank or with reliability.deadline_s=0
    saver = checkpoint.Saver(trainer)  # saves (with checkpoint.dir); catches SIGTERM
    try:
        while trainer.step < t.steps:
            m = trainer.train_step(callbacks)
            activity.mark("metrics and logging")
            last = trainer.step == t.steps
            if t.eval_every and (trainer.step % t.eval_every == 0 or last):
                m.update(trainer.evaluate())
            m.update(tb.throughput(m, cfg, trainer.pm.spec.flops_per_sample))
            if not math.isfinite(m["loss"]) and is_rank0:
                log.warning(f"step {m['step']}: loss is {m['loss']}")
            slow = m.get("straggler", {}).get("rank")
            if is_rank0 and slow is not None and slow != last_slow:
                s = m["straggler"]
                log.warning(f"step {m['step']}: rank {slow} ({s['coords']}) is a straggler: "
                            f"{s['ratio']}x the median busy time of its peers")
            last_slow = slow
            history.append(m)
            if board:
                board.log(m)
            if callbacks and callbacks.on_metrics:
                callbacks.on_metrics(m)
            if sink:
                sink.write(json.dumps(m) + "\n")
                sink.flush()
            if bar is not None:
                bar.update(1)
                post = {"loss": f"{m['loss']:.4f}", "tok/s": f"{m['tokens_per_s']:.0f}"}
                if "val_loss" in m:
                    post["val"] = f"{m['val_loss']:.4f}"
                bar.set_postfix(post)
            if saver.after_step(last=last):
                # the end line (``hybridpar train``) says what was saved; the caller sees why
                m["stopped_by"] = "SIGTERM"
                break
    except BaseException as e:
        if dog is not None:
            dog.on_exception(e)  # the first failing rank speaks first; the others stop
        raise
    finally:
        saver.close()
        if dog is not None:
            dog.stop()
        activity.idle()
        if bar is not None:
            bar.close()
        if sink:
            sink.close()
        if board:
            board.close()
    if tracer is not None:
        trace.finish(tracer, cfg, log=log)
    if history and saver.last_saved:  # for the end line; not in the metrics file
        history[-1]["checkpoint"] = str(saver.last_saved)
    return history
