"""Token data beyond bytes: text tokenised once into a cached memory-mapped token file,
pre-tokenised token files, and instruction (prompt/response) data with the loss masked on
prompts.

Formats of ``data.path`` (a file, or a folder whose non-hidden files are read in sorted order):

=====================  =========================================================================
``*.txt``, any text    one document per file
``*.jsonl``            one document per line, its ``data.text_field`` (default ``text``); lines
                       with ``prompt`` + ``response`` (or ``messages``) are instruction data
``*.npy``              a 1-D integer array of token ids (``np.save``), memory-mapped
``*.bin``              raw token ids of ``data.token_dtype`` (uint16, nanoGPT's; or uint32)
``*.parquet/*.arrow``  one document per row, its ``data.text_field`` column
HF ``datasets`` folder ``save_to_disk`` of a Dataset (or a DatasetDict's ``train``): its arrow
                       shards, column ``data.text_field``; read with pyarrow, no ``datasets``
=====================  =========================================================================

Documents are tokenised with the run's tokenizer (``tokenizer.py``; ``encode_batch`` is
multi-threaded in Rust), joined with the end-of-document token, and written once to
``cache_dir()/tokens-<key>.u16`` (uint32 beyond 65,536 ids); ``key`` hashes the tokenizer file,
the data files' paths, sizes and mtimes and the text field, so a changed file or tokenizer
re-tokenises. Every later run (and every rank) memory-maps that file: ranks never each hold
the corpus in RAM. The batch of step k stays a pure function of (data, seed, step).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .data import DataError, _read_text_file, _sorted_files, cache_dir, sample_rows

IGNORE = -100  # target id the loss skips (prompt and padding positions)
TOKEN_FILES = (".npy", ".bin")


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 2 ** 16 else np.uint32


def hf_dataset_files(root: Path) -> list[Path] | None:
    """The arrow files of a Hugging Face ``datasets`` folder (``save_to_disk``): a Dataset's
    ``state.json`` lists them; a DatasetDict's ``dataset_dict.json`` names splits, of which
    ``train`` is read (the validation split is held out from it, as for any data)."""
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise DataError(f"Hugging Face dataset {str(root)!r} has splits {splits}, no 'train'")
        root = root / "train"
    state = root / "state.json"
    if not state.is_file():
        return None
    names = [d["filename"] for d in json.loads(state.read_text()).get("_data_files", [])]
    return [root / n for n in names]


def data_files(path: str | os.PathLike) -> list[Path]:
    root = Path(path)
    if not root.exists():
        raise DataError(f"data path {str(root)!r} does not exist; pass a text/JSONL/token file "
                        f"or folder, or no path for the built-in stdlib corpus")
    if not root.is_dir():
        return [root]
    hf = hf_dataset_files(root)
    if hf is not None:
        return hf
    files = _sorted_files(root, skip_dir=lambda d: d.startswith("."),
                          keep_file=lambda f: not f.startswith("."))
    if not files:
        raise DataError(f"data folder {str(root)!r} has no (non-hidden) files; add data")
    return files


def read_token_file(path: Path, dtype: str, vocab_size: int) -> np.ndarray:
    """A pre-tokenised file, memory-mapped; its ids must index the vocabulary."""
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DataError(f"token file {str(path)!r} cannot be read as .npy: {e}") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise DataError(f"token file {str(path)!r} holds a {tokens.dtype} array of shape "
                            f"{tokens.shape}; need a 1-D integer array of token ids")
    else:
        size = path.stat().st_size
        width = np.dtype(dtype).itemsize
        if size % width:
            raise DataError(f"token file {str(path)!r} has {size} bytes, not a multiple of "
                            f"{width} (data.token_dtype={dtype}); is it another dtype?")
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise DataError(f"token file {str(path)!r} holds id {int(tokens.max())} >= model.vocab_size="
                        f"{vocab_size}; wrong data.token_dtype, or tokens of another tokenizer?")
    return tokens


def _jsonl(path: Path):
    """(line number, record) of a JSON-lines file; a bad line is one clear error."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{i} is not valid JSON ({e.msg}); one object per line") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{i} is a {type(rec).__name__}, not a JSON object")
            yield i, rec


def is_instruction_file(path: Path) -> bool:
    if path.suffix != ".jsonl":
        return False
    for _, rec in _jsonl(path):
        return ("prompt" in rec and "response" in rec) or "messages" in rec
    return False


def _table_column(path: Path, field: str):
    """One string column of a parquet or arrow file (a Hugging Face dataset's shards)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{str(path)!r}: parquet/arrow data needs pyarrow: pip install pyarrow") from None
    try:
        if path.suffix == ".parquet":
            table = pq.read_table(path)
        else:
            with pa.memory_map(str(path)) as src:
                try:
                    table = pa.ipc.open_stream(src).read_all()
                except pa.ArrowInvalid:
                    table = pa.ipc.open_file(src).read_all()
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{str(path)!r} cannot be read as {path.suffix[1:]}: {e}") from None
    if field not in table.column_names:
        raise DataError(f"{str(path)!r} has no column {field!r} (columns: "
                        f"{', '.join(table.column_names[:6])}); set data.text_field")
    for batch in table.column(field).chunks:
        yield from (t for t in batch.to_pylist() if isinstance(t, str))


def documents(files: list[Path], text_field: str):
    """Texts of the documents, in order: a text file is one, a JSONL line or a row of a
    parquet/arrow table is one."""
    for path in files:
        if path.suffix in (".parquet", ".arrow"):
            yield from _table_column(path, text_field)
        elif path.suffix == ".jsonl":
            for i, rec in _jsonl(path):
                if text_field not in rec:
                    raise DataError(f"{path}:{i} has no field {text_field!r} (fields: "
                                    f"{', '.join(list(rec)[:6])}); set data.text_field")
                if not isinstance(rec[text_field], str):
                    raise DataError(f"{path}:{i}: field {text_field!r} is not a string")
                yield rec[text_field]
        else:
            yield _read_text_file(path).decode("utf-8")


def _cache_key(files: list[Path], tokenizer, text_field: str) -> str:
    h = hashlib.sha256(f"v1|{tokenizer.fingerprint()}|{text_field}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def tokenize_files(files: list[Path], tokenizer, text_field: str = "text", *,
                   batch_docs: int = 1024, progress: bool = True) -> tuple[np.ndarray, int]:
    """The token stream of ``files`` (documents joined by the tokenizer's EOS), memory-mapped
    from the cache; tokenised and written there on the first call. Returns (tokens, documents)."""
    dtype = token_dtype(tokenizer.vocab_size)
    suffix = "u16" if dtype == np.uint16 else "u32"
    folder = cache_dir()
    stem = f"tokens-{_cache_key(files, tokenizer, text_field)}"
    for hit in sorted(folder.glob(f"{stem}-*docs.{suffix}")) if folder.is_dir() else []:
        try:
            n_docs = int(hit.name[len(stem) + 1:-len(f"docs.{suffix}")])
            return np.memmap(hit, dtype=dtype, mode="r"), n_docs
        except (OSError, ValueError):
            continue
    import tempfile
    import uuid

    from tqdm import tqdm

    try:  # streamed to a temporary file beside the cache: memory stays O(one batch of documents)
        folder.mkdir(parents=True, exist_ok=True)
        out = open(folder / f"{stem}.{os.getpid()}.{uuid.uuid4().hex}.tmp", "wb")
    except OSError:  # an unwritable cache only costs tokenising again next time
        out = tempfile.TemporaryFile()
    n_docs, batch = 0, []
    bar = tqdm(desc="tokenizing", unit="doc", disable=None if progress else True)

    def flush():
        nonlocal batch, n_docs
        for ids in tokenizer.encode_batch(batch):
            arr = np.asarray(ids + [tokenizer.eos_id], dtype=dtype)
            arr.tofile(out)
        n_docs += len(batch)
        bar.update(len(batch))
        batch = []
    try:
        for text in documents(files, text_field):
            if text.strip():
                batch.append(text)
            if len(batch) >= batch_docs:
                flush()
        if batch:
            flush()
        bar.close()
        if not n_docs:
            raise DataError(f"data {str(files[0].parent if len(files) > 1 else files[0])!r} holds "
                            f"no text (empty after reading); add documents")
        out.flush()
        if not getattr(out, "name", None) or not isinstance(out.name, str):  # anonymous temp file
            out.seek(0)
            return np.fromfile(out, dtype=dtype), n_docs
        path = folder / f"{stem}-{n_docs}docs.{suffix}"
        os.replace(out.name, path)  # readers never see a half-written cache
        return np.memmap(path, dtype=dtype, mode="r"), n_docs
    finally:
        out.close()
        name = getattr(out, "name", None)
        if isinstance(name, str) and os.path.exists(name) and name.endswith(".tmp"):
            os.unlink(name)


# ---------------------------------------------------------------- instruction fine-tuning


def _render(rec: dict, where: str, tokenizer) -> tuple[str, str]:
    """(prompt, response) text of one record: prompt/response fields, or chat ``messages``
    whose last one is the assistant's, rendered with the tokenizer's chat template."""
    if "messages" in rec:
        msgs = rec["messages"]
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m
                                                          and "content" in m for m in msgs)):
            raise DataError(f"{where}: messages must be a list of {{role, content}} objects")
        if msgs[-1]["role"] != "assistant":
            raise DataError(f"{where}: the last message must be the assistant's (the response)")
        if not tokenizer.chat_template:
            raise DataError(f"{where}: chat messages need a chat template, and tokenizer "
                            f"{tokenizer.name!r} has none; use prompt/response fields")
        try:
            import jinja2
        except ImportError:
            raise DataError("chat templates need jinja2: pip install jinja2") from None
        template = jinja2.Environment().from_string(tokenizer.chat_template)
        prompt = template.render(messages=msgs[:-1], add_generation_prompt=True,
                                 bos_token="", eos_token="")
        return prompt, msgs[-1]["content"]
    p, r = rec.get("prompt"), rec.get("response")
    if not isinstance(p, str) or not isinstance(r, str):
        raise DataError(f"{where}: needs string fields prompt and response (or messages)")
    return p, r


@dataclass(frozen=True)
class InstructionDataset:
    """Examples (prompt + response + EOS), one per row, truncated to ``seq_len + 1`` tokens and
    padded; targets are ``IGNORE`` on prompt and padding positions, so the loss is over the
    response tokens only. Rows of step k: ``perm_e[(k B + i) mod N]`` (seeded per epoch)."""

    inputs: tuple[np.ndarray, np.ndarray]   # train, val: (N, seq_len) int32
    targets: tuple[np.ndarray, np.ndarray]
    source: str
    masked = True

    def batch(self, split: str, step: int, *, seed: int, global_batch_size: int,
              seq_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        i = 0 if split == "train" else 1
        x, y = self.inputs[i], self.targets[i]
        rows = sample_rows(len(x), split, step, seed=seed, global_batch_size=global_batch_size)
        return (torch.from_numpy(x[rows].astype(np.int64)), torch.from_numpy(y[rows].astype(np.int64)))

    def max_batches(self, split: str, global_batch_size: int) -> int:
        """Whole global batches in ``split`` without repeating an example."""
        return len(self.inputs[0 if split == "train" else 1]) // global_batch_size

    def describe(self) -> str:
        return (f"{self.source}: {len(self.inputs[0]) + len(self.inputs[1]):,} instruction examples "
                f"({len(self.inputs[0]):,} train / {len(self.inputs[1]):,} val), loss on responses only")


def load_instructions(files: list[Path], tokenizer, *, seq_len: int,
                      val_fraction: float) -> InstructionDataset:
    xs, ys = [], []
    pad = tokenizer.eos_id
    for path in files:
        for i, rec in _jsonl(path):
            prompt, response = _render(rec, f"{path}:{i}", tokenizer)
            p = tokenizer.encode(prompt)
            r = tokenizer.encode(response) + [tokenizer.eos_id]
            ids = (p + r)[:seq_len + 1]
            row_x = np.full(seq_len, pad, dtype=np.int32)
            row_y = np.full(seq_len, IGNORE, dtype=np.int32)
            row_x[:len(ids) - 1] = ids[:-1]
            row_y[:len(ids) - 1] = ids[1:]
            row_y[:max(len(p) - 1, 0)] = IGNORE  # predicting prompt tokens is not trained
            xs.append(row_x)
            ys.append(row_y)
    if not xs:
        raise DataError(f"instruction data {str(files[0])!r} holds no examples")
    x, y = np.stack(xs), np.stack(ys)
    if not (y != IGNORE).any():
        raise DataError(f"instruction data {str(files[0])!r}: every response is cut off by "
                        f"model.seq_len={seq_len}; raise seq_len or shorten the prompts")
    n_val = max(1, int(round(len(x) * val_fraction)))
    if n_val >= len(x):
        raise DataError(f"instruction data {str(files[0])!r} has {len(x)} examples: too few to "
                        f"hold out val_fraction={val_fraction}; add examples")
    return InstructionDataset((x[:-n_val], x[-n_val:]), (y[:-n_val], y[-n_val:]), str(files[0]))
