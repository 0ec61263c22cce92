"""Tokenizers: bytes (the default: vocab 256, no files) or a model's own tokenizer.

A model folder's ``tokenizer.json`` (Hugging Face ``tokenizers``, what every recent HF model
ships) is used directly, fast and offline. ``data.tokenizer`` names it (a folder or the file);
when empty, a ``model.init_from`` folder that holds one provides it, so an imported Hugging Face
model trains and generates with its own tokens, never silently with bytes.

Documents are separated by the end-of-document token: the tokenizer's EOS (``eos_token`` of
``tokenizer_config.json``, else a ``</s>``/``<|endoftext|>``-like special token), ``\\n`` for
bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .data import DataError

BYTE = "byte"
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


class ByteTokenizer:
    """A token is a byte of the UTF-8 text."""

    name = BYTE
    vocab_size = 256
    eos_id = ord("\n")
    chat_template = None

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return BYTE


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` package (offline)."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"data.tokenizer={str(path)!r}: no tokenizer.json there; give a model "
                            f"folder holding tokenizer.json, the file itself, or 'byte'")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("a tokenizer.json needs the tokenizers package: pip install tokenizers") from None
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the library's own parse errors
            raise DataError(f"data.tokenizer={str(file)!r} cannot be read: {e}") from None
        self.file = file
        self.name = str(file)
        config = _read_json(file.parent / "tokenizer_config.json")
        self.chat_template = config.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(config)

    def _find_eos(self, config: dict) -> int:
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        for name in ((eos,) if eos else ()) + _EOS_NAMES:
            i = self._tok.token_to_id(name)
            if i is not None:
                return i
        model_cfg = _read_json(self.file.parent / "config.json")
        if isinstance(model_cfg.get("eos_token_id"), int):
            return model_cfg["eos_token_id"]
        raise DataError(f"tokenizer {self.name!r} has no end-of-text token (eos_token in "
                        f"tokenizer_config.json); add one so documents can be separated")

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Ids of ``text``; ``special``: with the tokenizer's own additions (e.g. a BOS), as a
        prompt is encoded for generation."""
        return self._tok.encode(text, add_special_tokens=special).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.file.read_bytes()).hexdigest()[:16]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def tokenizer_path(data_tokenizer: str, init_from: str) -> str:
    """What ``data.tokenizer`` resolves to: itself if set, else the tokenizer.json of an
    ``init_from`` folder, else bytes."""
    if data_tokenizer:
        return data_tokenizer
    if init_from and Path(init_from).is_dir() and (Path(init_from) / "tokenizer.json").is_file():
        return str(Path(init_from))
    return BYTE


def load_tokenizer(data_tokenizer: str = "", init_from: str = "", *, vocab_size: int | None = None):
    """The tokenizer of a run; refuses one whose ids do not fit ``vocab_size`` (the model's)."""
    path = tokenizer_path(data_tokenizer, init_from)
    tok = ByteTokenizer() if path == BYTE else HFTokenizer(path)
    # bytes: the data's own ids are checked instead (ASCII text fits a vocabulary of 128)
    if vocab_size is not None and path != BYTE and tok.vocab_size > vocab_size:
        raise DataError(f"tokenizer {tok.name!r} has {tok.vocab_size:,} tokens but "
                        f"model.vocab_size={vocab_size:,}; a tokenizer of another model? Set "
                        f"model.vocab_size >= {tok.vocab_size} or use the model's own tokenizer")
    return tok


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def copy_tokenizer(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files of folder ``src`` (or of a tokenizer.json's folder) into ``dst``;
    returns the names copied."""
    import shutil
    src = Path(src)
    folder = src if src.is_dir() else src.parent
    copied = []
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            Path(dst).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / name, Path(dst) / name)
            copied.append(name)
    return copied
