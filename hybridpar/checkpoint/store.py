"""The checkpoint folder on disk: names, the manifest, the atomic commit, ``latest``, pruning.

Layout of ``checkpoint.dir``::

    step_000010/           one complete checkpoint (visible only once complete)
        .metadata          torch.distributed.checkpoint's index: every tensor's unsharded name,
        __<rank>_0.distcp  shape and which byte range of which rank's file holds which chunk
        trainer.json       step, config, loss-scaler state (rank 0)
        rng.json           every rank's torch/numpy/python RNG state (rank 0)
        manifest.json      size and sha256 of every file above: written last
    step_000010.tmp-<id>/  a save in progress (or killed): never loaded, removed by the next save
    latest                 "step_000010": the newest committed checkpoint
    .lock                  held (flock) by the running job's rank 0: one job per folder

Commit protocol (rank 0, after every rank's files are fsynced): write manifest.json, fsync it
and the folder, rename the temporary folder to ``step_N``, fsync ``dir``, then replace ``latest``
atomically (temporary file + fsync + ``os.replace``). A kill at any point leaves either the old
``latest`` pointing at a complete checkpoint, or the new one; a folder without a manifest is
never taken for a checkpoint, and a damaged file is named by ``verify``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import time
from pathlib import Path

from ..reliability.errors import HybridparError, UserError

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "hybridpar-dcp/1"
_STEP_RE = re.compile(r"^step_(\d{6,})$")
# test hook: "RANK:POINT" SIGKILLs that rank at POINT (a save phase, or step=N at the end of
# step N), on the first attempt only (torchrun restarts set TORCHELASTIC_RESTART_COUNT > 0)
KILL_ENV = "HYBRIDPAR_CKPT_KILL"
KILL_POINTS = ("shards", "manifest", "rename", "latest", "prune")


class CheckpointError(UserError):
    """A checkpoint that cannot be used; raised identically on every rank."""

    collective = True


class SaveFailed(HybridparError):
    """A save that could not complete (no space left): the partial folder is removed and the
    previous checkpoint stays ``latest``; raised identically on every rank."""

    collective = True


def step_name(step: int) -> str:
    return f"step_{step:06d}"


LOCK = ".lock"


class FolderLock:
    """One job per checkpoint folder: an exclusive ``flock`` on ``root/.lock``, held by rank 0
    for the whole run and released by the kernel when that process ends, however it ends (a
    lock left by a dead job is never an obstacle: it is not held). The file names the holder,
    for the message the second job prints."""

    def __init__(self, root: Path):
        self.root, self._fd = Path(root), None

    def acquire(self) -> None:
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise CheckpointError(f"checkpoint.dir={self.root} is in use by another run "
                                      f"({holder}); wait for it to end, or choose another folder") from None
            try:  # the holder may have released and removed the file between open and flock
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            (self.root / LOCK).unlink(missing_ok=True)  # while still held: no one else's file
            os.close(self._fd)
            self._fd = None


def kill_point(point: str, rank: int) -> None:
    """SIGKILL this process at ``point`` when ``HYBRIDPAR_CKPT_KILL`` asks for it (tests)."""
    spec = os.environ.get(KILL_ENV, "")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    want_rank, _, want_point = spec.partition(":")
    if int(want_rank) == rank and want_point == point:
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder: so a rename or new entry in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def no_space(e: BaseException) -> bool:
    """Whether a failed write ran out of disk (or quota), however deep DCP wrapped the OSError."""
    import errno

    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # DCP's CheckpointException: {rank: (exc, trace)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return "No space left on device" in str(e) or "Disk quota exceeded" in str(e)


def checkpoint_bytes(folder: Path) -> int:
    """Bytes of a committed checkpoint, from its manifest."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        return sum(f["bytes"] for f in files.values())
    except (OSError, ValueError, KeyError):
        return 0


def space_problem(root: Path, step: int, need: int) -> str | None:
    """A one-line refusal when the filesystem of ``root`` has less than ``need`` bytes free."""
    existing = root
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free >= need:
        return None
    return (f"no space left on device to save step {step} in {root} (needs ~{need / 2**20:,.1f} MiB, "
            f"{free / 2**20:,.1f} MiB free); {kept(root)}")


def kept(root: Path) -> str:
    found = latest(root)
    return (f"the previous checkpoint {found.name} is intact" if found is not None
            else "no checkpoint had been saved yet")


def describe_files(folder: Path, names: list[str]) -> dict[str, dict]:
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": sha256_file(folder / n)} for n in names}


def is_complete(folder: Path) -> bool:
    return _STEP_RE.match(folder.name) is not None and (folder / MANIFEST).is_file()


def committed(root: Path) -> list[Path]:
    """Complete checkpoints in ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_RE.match(p.name).group(1)))


def latest(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names; if that pointer is missing or names no complete
    checkpoint (deleted by hand), the newest complete one; None when there is none."""
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if is_complete(target):
            return target
    found = committed(root)
    return found[-1] if found else None


def looks_like_checkpoint(path: str | os.PathLike) -> bool:
    """A step folder, or a folder holding a ``latest`` pointer or step folders."""
    p = Path(path)
    return (p / MANIFEST).is_file() or (p / LATEST).is_file() or bool(committed(p))


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint folder from a step folder or a ``checkpoint.dir`` (its latest)."""
    p = Path(path)
    if ".tmp-" in p.name:  # a save in progress or killed, even if its manifest got written
        raise CheckpointError(f"{p} is no complete checkpoint: an unfinished save (killed before its "
                              f"commit); load {p.parent} (its latest) instead")
    if (p / MANIFEST).is_file():
        return p
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    found = latest(p) if p.is_dir() else None
    if found is None:
        raise CheckpointError(f"{p} holds no complete checkpoint (no {MANIFEST}); pass a step_NNNNNN "
                              f"folder or a checkpoint.dir holding one")
    return found


def verify(folder: Path, *, rank: int = 0, world: int = 1) -> str | None:
    """Check this rank's share (every world-th file) of the manifest; the first problem as one
    line naming the file, or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"checkpoint {folder}: {MANIFEST} is unreadable ({e}); the checkpoint is damaged"
    for i, (name, want) in enumerate(sorted(files.items())):
        if i % world != rank:
            continue
        path = folder / name
        if not path.is_file():
            return f"checkpoint {folder}: file {name} is missing (listed in {MANIFEST})"
        size = path.stat().st_size
        if size != want["bytes"]:
            what = "truncated" if size < want["bytes"] else "longer than saved"
            return f"checkpoint {folder}: file {name} is {what}: {size} bytes, {MANIFEST} says {want['bytes']}"
        if sha256_file(path) != want["sha256"]:
            return f"checkpoint {folder}: file {name} is corrupt: its sha256 differs from {MANIFEST}"
    return None


def commit(tmp: Path, root: Path, files: dict[str, dict], *, step: int, keep: int, rank: int = 0) -> Path:
    """Rank 0, once every rank's files are written and fsynced: manifest, rename, ``latest``,
    pruning. Returns the committed folder."""
    write_durable(tmp / MANIFEST, json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
    fsync_path(tmp)
    kill_point("manifest", rank)
    final = root / step_name(step)
    if final.exists():  # the same step saved again (a restarted run): replace it
        _discard(final, tmp.name.split(".tmp-")[-1])
    os.rename(tmp, final)
    fsync_path(root)
    kill_point("rename", rank)
    pointer_tmp = root / f"{LATEST}.tmp-{tmp.name.split('.tmp-')[-1]}"
    write_durable(pointer_tmp, final.name + "\n")
    kill_point("latest", rank)
    os.replace(pointer_tmp, root / LATEST)
    fsync_path(root)
    prune(root, keep=keep, rank=rank)
    return final


def _discard(folder: Path, tag: str) -> None:
    """Remove a folder so that no kill leaves it looking complete: rename first, then delete."""
    gone = folder.with_name(f"{folder.name}.tmp-del-{tag}")
    os.rename(folder, gone)
    shutil.rmtree(gone, ignore_errors=True)


def prune(root: Path, *, keep: int, rank: int = 0) -> None:
    """Keep the newest ``keep`` checkpoints (0: all) and the one ``latest`` names; delete
    leftovers of killed saves (``*.tmp-*``)."""
    current = latest(root)
    done = committed(root)
    victims = done[:-keep] if keep > 0 else []
    for folder in victims:
        if folder != current:
            gone = folder.with_name(f"{folder.name}.tmp-del-prune")
            os.rename(folder, gone)  # no longer a checkpoint before any file goes
            kill_point("prune", rank)
            shutil.rmtree(gone, ignore_errors=True)
    remove_leftovers(root)


def remove_leftovers(root: Path) -> None:
    """Delete what killed or interrupted saves left (``*.tmp-*``): never loaded, only space.
    Only while no job writes to ``root`` (a save in progress looks the same)."""
    for leftover in root.glob("*.tmp-*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
