"""Checkpoints that know nothing of the layout that wrote them.

Tensors are keyed by unsharded names (``model/<param>``, ``optim/<param>/exp_avg``, ...) with
shard metadata (``torch.distributed.checkpoint``), each rank writing its own shards; any
layout loads any checkpoint. See ``store`` for the on-disk layout and the atomic commit,
``state`` for the DTensor view of the shards, ``saver`` for periodic saves and SIGTERM.
"""
from .core import load, lock_folder, read_full, resume, save, verified
from .saver import Saver
from .store import KILL_ENV, CheckpointError, latest, resolve

__all__ = ["CheckpointError", "KILL_ENV", "Saver", "latest", "load", "lock_folder", "read_full", "resolve",
           "resume", "save", "verified"]
