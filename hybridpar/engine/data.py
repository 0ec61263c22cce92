"""Byte-level data: corpus loading, a data-only train/val split, and layout-independent batches.

A token is a byte (vocab 256). The batch of step k is a pure function of
(data, seed, step, global_batch_size, seq_len), so every dp x tp x pp layout sees the same
global batch; a dp rank gathers only its own rows of it.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import sysconfig
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..reliability.errors import UserError

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), each (rows, seq_len) int64

_SEPARATOR = b"\n"
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_CACHE_FORMAT = "v1"  # bump when the walk rules change, so old caches are not reused


class DataError(UserError, ValueError):
    """Unusable data; the message names the path and what to do about it."""


@dataclass(frozen=True)
class Dataset:
    """Train and validation token streams (uint8 arrays, possibly memory-mapped)."""

    train: np.ndarray
    val: np.ndarray
    source: str
    """Where the tokens came from: the user path, or the stdlib folder."""
    n_files: int

    def batch(self, split: str, step: int, *, seed: int, global_batch_size: int,
              seq_len: int) -> "Batch":
        """The whole batch of ``step`` of ``split`` ("train" or "val"): (inputs, targets)."""
        return global_batch(getattr(self, split), step, seed=seed,
                            global_batch_size=global_batch_size, seq_len=seq_len)

    def describe(self) -> str:
        n = len(self.train) + len(self.val)
        return (f"{self.source}: {self.n_files:,} files, {n:,} tokens "
                f"({len(self.train):,} train / {len(self.val):,} val)")


def _sorted_files(root: Path, *, skip_dir, keep_file) -> list[Path]:
    """Regular files under root, sorted by relative path components (independent of walk order)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip_dir(d)]
        found += [Path(dirpath, f) for f in filenames if keep_file(f) and Path(dirpath, f).is_file()]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def _concat(blobs: list[bytes]) -> np.ndarray:
    return np.frombuffer(_SEPARATOR.join(blobs), dtype=np.uint8)


def cache_dir() -> Path:
    """`$HYBRIDPAR_CACHE`, else `~/.cache/hybridpar`; read at call time, not import time."""
    env = os.environ.get("HYBRIDPAR_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "hybridpar"


def _stdlib_cache_stem() -> str:
    """Keyed by interpreter identity, not by a walk, so a cache hit never walks the stdlib."""
    stdlib = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha256(f"{_CACHE_FORMAT}|{sys.version}|{stdlib}".encode()).hexdigest()[:16]
    v = sys.version_info
    return f"stdlib-py{v.major}.{v.minor}.{v.micro}-{key}"


def _read_stdlib() -> tuple[np.ndarray, int]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _sorted_files(root, skip_dir=lambda d: d in _STDLIB_SKIP_DIRS,
                          keep_file=lambda f: f.endswith(".py"))
    return _concat([f.read_bytes() for f in files]), len(files)


def _find_cached(folder: Path, stem: str) -> tuple[np.ndarray, int] | None:
    # The file count lives in the name so the cache stays one flat uint8 file.
    try:
        hits = sorted(folder.glob(f"{stem}-*files.u8"))
    except OSError:
        return None
    for hit in hits:
        try:
            n_files = int(hit.name[len(stem) + 1:-len("files.u8")])
            if hit.stat().st_size > 0:
                return np.memmap(hit, dtype=np.uint8, mode="r"), n_files
        except (OSError, ValueError):
            continue
    return None


def _write_atomic(path: Path, data: np.ndarray) -> None:
    """Write to a unique temp name, then rename: readers never see a half-written file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        data.tofile(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def default_corpus() -> tuple[np.ndarray, int]:
    """The running interpreter's stdlib `.py` files as bytes, and how many files; cached on disk.

    An unwritable cache folder (read-only home) only costs a re-read on the next call.
    """
    folder, stem = cache_dir(), _stdlib_cache_stem()
    cached = _find_cached(folder, stem)
    if cached is not None:
        return cached
    tokens, n_files = _read_stdlib()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / f"{stem}-{n_files}files.u8", tokens)
    except OSError:
        pass
    return tokens, n_files


def _read_text_file(path: Path) -> bytes:
    import stat
    if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block forever
        raise DataError(f"data file {str(path)!r} is not a regular file (a pipe or device?); "
                        "pass UTF-8 text files only")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"data file {str(path)!r} cannot be read ({e.strerror}); check its "
                        "permissions") from None
    if b"\0" in data:
        raise DataError(f"data file {str(path)!r} looks binary (contains NUL bytes); "
                        "pass UTF-8 text files only")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {str(path)!r} is not valid UTF-8 text (byte {e.start}); "
                        "convert it to UTF-8 or remove it") from None
    return data


def read_user_data(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """Bytes of a UTF-8 text file, or of every non-hidden file under a folder in sorted order."""
    root = Path(path)
    if not root.exists():
        raise DataError(f"data path {str(root)!r} does not exist; pass a text file or folder, "
                        "or no path for the built-in stdlib corpus")
    if root.is_dir():
        files = _sorted_files(root, skip_dir=lambda d: d.startswith("."),
                              keep_file=lambda f: not f.startswith("."))
        if not files:
            raise DataError(f"data folder {str(root)!r} has no (non-hidden) files; add text files")
    else:
        files = [root]
    blobs = [b for b in map(_read_text_file, files) if b]  # empty files inside a folder add nothing
    if not blobs:
        raise DataError(f"data path {str(root)!r} is empty; add text")
    if not any(b.strip() for b in blobs):
        raise DataError(f"data path {str(root)!r} holds only whitespace; add text")
    return _concat(blobs), len(files)


def split_tokens(tokens: np.ndarray, *, seq_len: int,
                 val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Last `val_fraction` of the stream (at least seq_len + 1 tokens) is val, the rest train.

    Fixed by the data alone, so every seed and layout validates on the same tokens.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    n_val = max(math.ceil(len(tokens) * val_fraction), seq_len + 1)
    n_train = len(tokens) - n_val
    if n_train < seq_len + 1:
        raise DataError(f"{len(tokens):,} tokens leave {n_train:,} for training after "
                        f"val_fraction={val_fraction}; need {seq_len + 1:,} (seq_len + 1)")
    return tokens[:n_train], tokens[n_train:]


def load_dataset(path: str | None, *, seq_len: int, val_fraction: float = 0.05, tokenizer=None,
                 text_field: str = "text", token_dtype: str = "uint16", vocab_size: int = 256,
                 fmt: str = "auto"):
    """Load the data at `path` (or the stdlib corpus when None) and split it into train/val:
    bytes by default, else tokenised by ``tokenizer`` (see ``corpus``); token files as they
    are; instruction JSONL as an ``InstructionDataset``."""
    from . import corpus

    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    byte = tokenizer is None or tokenizer.name == "byte"
    files = corpus.data_files(path) if path is not None else None
    kinds = {f.suffix in corpus.TOKEN_FILES for f in files} if files else {False}
    if len(kinds) > 1:
        token = next(f for f in files if f.suffix in corpus.TOKEN_FILES)
        text = next(f for f in files if f.suffix not in corpus.TOKEN_FILES)
        raise DataError(f"data folder {path!r} mixes text ({str(text)!r}) with {str(token)!r}, a "
                        f"token file (.npy/.bin) or binary; keep one kind per folder")
    sft = bool(files) and fmt != "text" and any(corpus.is_instruction_file(f) for f in files)
    if fmt == "sft" and not sft:
        raise DataError(f"data.format=sft: {path!r} has no JSONL with prompt/response or messages")
    if sft:
        return corpus.load_instructions(files, tokenizer or _byte(), seq_len=seq_len,
                                        val_fraction=val_fraction)
    if files and True in kinds:
        parts = [corpus.read_token_file(f, token_dtype, vocab_size) for f in files]
        tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
        n_files, source = len(files), str(path)
    elif byte and not any(f.suffix in (".jsonl", ".parquet", ".arrow") for f in files or ()):
        if path is None:
            tokens, n_files = default_corpus()
            source = f"stdlib corpus {sysconfig.get_paths()['stdlib']}"
        else:
            tokens, n_files = read_user_data(path)
            source = str(path)
    else:
        if files is None:
            root = Path(sysconfig.get_paths()["stdlib"])
            files = _sorted_files(root, skip_dir=lambda d: d in _STDLIB_SKIP_DIRS,
                                  keep_file=lambda f: f.endswith(".py"))
        tokens, n_files = corpus.tokenize_files(files, tokenizer or _byte(), text_field)
        source = f"{path or 'stdlib corpus'} ({(tokenizer or _byte()).name} tokens)"
    need = 2 * (seq_len + 1)  # one window each for train and val
    if len(tokens) < need:
        raise DataError(f"data {source!r} has {len(tokens):,} tokens (bytes) but seq_len={seq_len} "
                        f"needs at least {need:,} (seq_len + 1 each for train and val); "
                        "add data or lower seq_len")
    try:
        train, val = split_tokens(tokens, seq_len=seq_len, val_fraction=val_fraction)
    except DataError as e:
        raise DataError(f"data {source!r}: {e}; lower val_fraction or add data") from None
    return Dataset(train=train, val=val, source=source, n_files=n_files)


def sample_rows(n: int, split: str, step: int, *, seed: int, global_batch_size: int) -> np.ndarray:
    """Rows of a global batch over ``n`` samples, a pure function of (seed, step): row i of step
    k is ``perm_e[(k B + i) mod n]`` with a permutation seeded by (seed, epoch e) for training,
    the samples in order for validation."""
    pos = step * global_batch_size + np.arange(global_batch_size)
    if split != "train":
        return pos % n
    rows = np.empty(global_batch_size, dtype=np.int64)
    for epoch in np.unique(pos // n):
        at = pos // n == epoch
        rows[at] = np.random.default_rng([seed, int(epoch)]).permutation(n)[pos[at] % n]
    return rows


def _byte():
    from .tokenizer import ByteTokenizer
    return ByteTokenizer()


def _row_range(n_rows: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp={dp_size})")
    if n_rows % dp_size:
        raise ValueError(f"batch of {n_rows} rows is not divisible by dp={dp_size}")
    per = n_rows // dp_size
    return dp_rank * per, (dp_rank + 1) * per


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> Batch:
    """Gather (seq_len + 1)-token windows; targets are inputs shifted left by one."""
    idx = offsets[:, None] + np.arange(seq_len + 1)
    win = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def batch_offsets(n_tokens: int, step: int, *, seed: int, global_batch_size: int,
                  seq_len: int) -> np.ndarray:
    """Start offsets of the global batch of `step`, keyed statelessly by (seed, step)."""
    if n_tokens < seq_len + 1:
        raise DataError(f"{n_tokens:,} tokens are fewer than seq_len + 1 = {seq_len + 1:,}")
    if global_batch_size < 1 or seed < 0 or step < 0:
        raise ValueError(f"need global_batch_size >= 1, seed >= 0, step >= 0; got "
                         f"{global_batch_size}, {seed}, {step}")
    rng = np.random.Generator(np.random.PCG64([seed, step]))
    return rng.integers(0, n_tokens - seq_len, size=global_batch_size, dtype=np.int64)


def local_batch(tokens: np.ndarray, step: int, *, seed: int, global_batch_size: int,
                seq_len: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
    """Rows [dp_rank*B/dp, (dp_rank+1)*B/dp) of the global batch, gathering only those rows."""
    offsets = batch_offsets(len(tokens), step, seed=seed,
                            global_batch_size=global_batch_size, seq_len=seq_len)
    lo, hi = _row_range(global_batch_size, dp_rank, dp_size)
    return _windows(tokens, offsets[lo:hi], seq_len)


def global_batch(tokens: np.ndarray, step: int, *, seed: int, global_batch_size: int,
                 seq_len: int) -> Batch:
    """The whole batch of `step`: (inputs, targets), each (global_batch_size, seq_len) int64."""
    return local_batch(tokens, step, seed=seed, global_batch_size=global_batch_size,
                       seq_len=seq_len)


def shard_rows(batch: Batch, dp_rank: int, dp_size: int) -> Batch:
    """This dp rank's contiguous block of rows of every tensor in `batch`."""
    lo, hi = _row_range(batch[0].shape[0], dp_rank, dp_size)
    return tuple(t[lo:hi] for t in batch)


def microbatches(batch: Batch, n: int) -> list[Batch]:
    """Split rows into `n` equal consecutive micro-batches."""
    rows = batch[0].shape[0]
    if n < 1 or rows % n:
        raise ValueError(f"batch of {rows} rows cannot be split into {n} equal micro-batches; "
                         f"n must divide {rows}")
    return [shard_rows(batch, i, n) for i in range(n)]


def local_microbatches(batch: Batch, dp_rank: int, dp_size: int, n: int) -> list[Batch]:
    """This dp rank's ``n`` micro-batches of the global ``batch``, micro-batch first: the
    global batch is cut into ``n`` micro-batches and dp rank r takes block r of each. Micro-batch
    k then holds the same rows of the global batch on every layout (spread over the dp ranks),
    which is what per-micro-batch statistics (BatchNorm) need to be layout-free."""
    return [shard_rows(mb, dp_rank, dp_size) for mb in microbatches(batch, n)]


def val_batches(dataset: Dataset, *, n_batches: int, batch_size: int, seq_len: int) -> list[Batch]:
    """`n_batches` validation batches at fixed, evenly spaced offsets over the val stream."""
    n_windows = n_batches * batch_size
    if n_windows < 1:
        raise ValueError(f"need n_batches >= 1 and batch_size >= 1; got {n_batches}, {batch_size}")
    last = len(dataset.val) - seq_len - 1
    if last < 0:
        raise DataError(f"val split of {dataset.source!r} has {len(dataset.val):,} tokens; "
                        f"seq_len={seq_len} needs {seq_len + 1:,}")
    offsets = np.linspace(0, last, num=n_windows).round().astype(np.int64)
    return [_windows(dataset.val, chunk, seq_len) for chunk in np.split(offsets, n_batches)]


def check_token_range(dataset: Dataset, vocab_size: int) -> None:
    """Every token id of the data indexes the model's vocabulary: checked once, before training,
    on every path (a vocab-parallel embedding would otherwise zero out-of-range ids silently)."""
    top = max(int(t.max()) for t in (dataset.train, dataset.val) if len(t))
    if top >= vocab_size:
        raise DataError(f"{dataset.source}: token id {top} is outside model.vocab_size={vocab_size} "
                        f"(ids 0..{vocab_size - 1}); byte-level text needs model.vocab_size >= 256")


def load_data(cfg, spec):
    """The data ``spec`` trains on: token streams from ``data.path`` (or the stdlib corpus) for
    text models, the embedded digits for image classifiers."""
    if callable(spec.data):  # the user's own data: a function of the config
        return spec.data(cfg)
    if spec.data in ("digits", "denoising") and cfg.data.path:
        raise DataError(f"data.path={cfg.data.path!r}: model {spec.name!r} trains on "
                        f"images (data.images); data.path is for text models")
    if spec.data == "denoising":  # (noisy image, clean image) pairs
        from .image_data import denoising_digits
        return denoising_digits(cfg)
    if spec.data == "digits":
        from .image_data import images_for
        return images_for(cfg)
    if spec.data != "text":
        raise DataError(f"model {spec.name!r}: ModelSpec.data={spec.data!r} is unknown; use "
                        f"'text', 'digits', 'denoising' or a function (Config) -> dataset")
    from .tokenizer import load_tokenizer
    d = cfg.data
    tok = load_tokenizer(d.tokenizer, cfg.model.init_from, vocab_size=cfg.model.vocab_size)
    return load_dataset(d.path or None, seq_len=cfg.model.seq_len, val_fraction=d.val_fraction,
                        tokenizer=tok, text_field=d.text_field, token_dtype=d.token_dtype,
                        vocab_size=cfg.model.vocab_size, fmt=d.format)
