"""Save and load a ``Trainer``'s whole state, in parallel, in any layout.

``save``: every rank writes its own shards with ``torch.distributed.checkpoint`` (fsynced),
hashes them, and rank 0 commits (``store.commit``). ``load``: the ranks verify the manifest
(each a share of the files), check the model, then DCP reads into each rank's tensors exactly
the chunks it needs, so any layout (dp, tp, pp, world size, ZeRO-1 or not, one process) loads
any checkpoint. Collective: every rank calls them together.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from ..reliability.watchdog import activity
from . import store
from .extras import RNG, TRAINER, apply_record, check_model, pick_rng, read_json, rng_state, \
    set_rng_state, trainer_record
from .state import Moments, state_dict
from .store import CheckpointError


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():  # DCP warns that one process means no process group
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed.checkpoint")
        yield


def _from_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 and give every rank its result, or raise its CheckpointError (or
    SaveFailed) on every rank."""
    rank, world = _rank_world()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = ("ok", fn())
        except (CheckpointError, store.SaveFailed) as e:
            box[0] = (type(e).__name__, str(e))
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind != "ok":
        raise (store.SaveFailed if kind == "SaveFailed" else CheckpointError)(value)
    return value


def _check_space(trainer, root: Path, step: int) -> None:
    """Rank 0, before a save: the folder's filesystem has room for one more checkpoint (the size
    of the previous one, else 3 fp32 tensors per parameter: weights and AdamW's two moments;
    plus 5%)."""
    problem = store.space_problem(root, step, _need_bytes(trainer, root))
    if problem:
        raise store.SaveFailed(problem)


def _need_bytes(trainer, root: Path) -> int:
    previous = store.latest(root) if root.is_dir() else None
    need = store.checkpoint_bytes(previous) if previous is not None else 0
    if not need:
        from ..engine.summary import parameter_count
        need = 12 * parameter_count(trainer.pm.spec)
    return int(need * 1.05) + (1 << 20)


def _gather(obj: Any) -> list[Any] | None:
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def save(trainer, root: str | os.PathLike, *, keep: int = 0) -> Path:
    """Write ``trainer``'s state as ``root/step_NNNNNN`` and point ``root/latest`` at it;
    returns that folder. Collective."""
    rank, world = _rank_world()
    root, step = Path(root), trainer.step
    tag = _from_rank0(lambda: (_check_space(trainer, root, step), uuid.uuid4().hex[:8])[1])
    tmp = root / f"{store.step_name(step)}.tmp-{tag}"
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)  # DCP may create it first on another rank
    activity.mark("checkpoint save", comm=True)
    moments = Moments.read(trainer.pm, trainer.opt)  # collective over dp under ZeRO-1
    writer = dcp.FileSystemWriter(tmp, sync_files=True)
    try:
        with _quiet():
            dcp.save(state_dict(trainer.pm, moments, for_load=False), storage_writer=writer,
                     no_dist=world == 1)
    except (Exception, CheckpointException) as e:  # every rank's write failure, on every rank
        if not store.no_space(e):
            raise
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; never loaded anyway
        if world > 1:
            dist.barrier()
        free = shutil.disk_usage(root).free
        raise store.SaveFailed(f"no space left on device while saving step {step} in {root} "
                               f"(needs ~{_need_bytes(trainer, root) / 2**20:,.1f} MiB, "
                               f"{free / 2**20:,.1f} MiB free after removing the partial save); "
                               f"{store.kept(root)}") from None
    store.kill_point("shards", rank)
    mine = sorted(p.name for p in tmp.glob(f"__{rank}_*"))
    parts = _gather((store.describe_files(tmp, mine), rng_state()))
    if rank == 0:
        files = {k: v for f, _ in parts for k, v in f.items()}
        store.write_durable(tmp / TRAINER, json.dumps(trainer_record(trainer), indent=1))
        store.write_durable(tmp / RNG, json.dumps([r for _, r in parts]))
        files.update(store.describe_files(tmp, [".metadata", TRAINER, RNG]))
        store.commit(tmp, root, files, step=step, keep=keep, rank=rank)
    if world > 1:
        activity.mark("checkpoint commit (barrier)", comm=True)
        dist.barrier()
    return root / store.step_name(step)


def verified(path: str | os.PathLike) -> Path:
    """The checkpoint ``path`` names (a step folder, or a dir's latest), every file checked
    against the manifest; each rank checks a share. Collective."""
    folder = Path(_from_rank0(lambda: str(store.resolve(path))))
    rank, world = _rank_world()
    activity.mark("checkpoint verify")
    errors = [store.verify(folder, rank=rank, world=world)]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, store.verify(folder, rank=rank, world=world))
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)
    return folder


def saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    meta = dcp.FileSystemReader(folder).read_metadata()
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")}


def load(trainer, path: str | os.PathLike) -> Path:
    """Restore ``trainer`` (model, AdamW state, step, loss scaler, RNG) from a checkpoint
    written by any layout; returns the folder read. Collective."""
    rank, world = _rank_world()
    folder = verified(path)
    record = read_json(folder, TRAINER)
    check_model(folder, trainer.cfg.model, saved_shapes(folder), record)
    moments = Moments.empty(trainer.pm)
    sd = state_dict(trainer.pm, moments, for_load=True)
    activity.mark("checkpoint load", comm=True)
    with _quiet(), torch.no_grad():
        dcp.load(sd, storage_reader=dcp.FileSystemReader(folder), no_dist=world == 1)
    moments.step = sd["optim/step"]
    moments.write(trainer.pm, trainer.opt)
    apply_record(trainer, record)
    set_rng_state(pick_rng(read_json(folder, RNG), record, trainer.cfg, rank))
    return folder


def read_full(path: str | os.PathLike, prefix: str = "model/") -> tuple[dict, dict[str, torch.Tensor]]:
    """One process: (trainer record, {key without prefix: unsharded tensor}) of the saved
    tensors whose key starts with ``prefix``, after verifying every file."""
    folder = store.resolve(path)
    problem = store.verify(folder)
    if problem:
        raise CheckpointError(problem)
    meta = dcp.FileSystemReader(folder).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
          if k.startswith(prefix) and hasattr(v, "size")}
    with _quiet():
        dcp.load(sd, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return read_json(folder, TRAINER), {k[len(prefix):]: v for k, v in sd.items()}


def lock_folder(cfg) -> store.FolderLock | None:
    """Rank 0 takes ``checkpoint.dir``'s lock for the run, so a second job on the same folder is
    refused at start-up instead of pruning the first one's saves. Collective: a held lock is the
    same CheckpointError on every rank. The caller releases it."""
    c = cfg.checkpoint
    if not c.dir or (c.resume and not c.fresh_if_none and not Path(c.dir).is_dir()):
        return None  # nothing to lock: ``resume`` names the missing folder
    rank, _ = _rank_world()
    lock = store.FolderLock(Path(c.dir)) if rank == 0 else None
    _from_rank0(lambda: lock.acquire())
    return lock


def resume_problem(folder: str) -> str:
    """Why ``--resume`` has nothing to continue from (never a silent fresh start that would
    then overwrite ``latest``)."""
    what = "does not exist" if not Path(folder).exists() else "holds no complete checkpoint"
    return (f"--resume: checkpoint.dir={folder} {what}; check the folder name, or drop --resume "
            f"to start a new run there")


def resume(trainer) -> Path | None:
    """At Trainer construction: load ``checkpoint.dir``'s latest when asked (``resume``, or a
    restarted torchrun worker), else ``checkpoint.load``; refuse to start over a folder that
    already holds checkpoints unless asked to resume. Returns the folder loaded, if any."""
    c = trainer.cfg.checkpoint
    found = None
    if c.dir:
        found = _from_rank0(lambda: (lambda p: str(p) if p else None)(store.latest(Path(c.dir))))
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if found and (c.resume or restarted):
        return load(trainer, found)
    if c.resume and not restarted:
        if not c.fresh_if_none:
            raise CheckpointError(resume_problem(c.dir))
        if trainer.mesh.rank == 0:
            print(f"hybridpar: --resume=auto: checkpoint.dir={c.dir} holds no checkpoint; "
                  f"starting a new run", file=sys.stderr, flush=True)
    if c.load:
        return load(trainer, c.load)
    if found:
        raise CheckpointError(f"checkpoint.dir={c.dir} already holds checkpoints (latest: "
                              f"{Path(found).name}); continue from it with --resume, or choose another folder")
    return None
