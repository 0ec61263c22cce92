"""Tests for hybridpar.data: loading, errors, split, and layout-independent batches."""
import os

import numpy as np
import pytest
import torch

from hybridpar.engine import data
from hybridpar.engine.data import (DataError, global_batch, load_dataset, local_batch, microbatches,
                            read_user_data, shard_rows, split_tokens, val_batches)

SEQ = 16


@pytest.fixture
def tokens():
    return np.random.default_rng(0).integers(0, 256, size=5000, dtype=np.uint8)


def _batch(tokens, step, **kw):
    kw = {"seed": 7, "global_batch_size": 8, "seq_len": SEQ, **kw}
    return global_batch(tokens, step, **kw)


def _text_file(tmp_path, name="a.txt", n=1000):
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("hello world. " * (n // 13 + 1))
    return p


# ---------------------------------------------------------------- batches


def test_batch_shape_dtype_and_shift(tokens):
    x, y = _batch(tokens, 0)
    assert x.shape == y.shape == (8, SEQ) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Every row is a real window of the stream.
    windows = np.lib.stride_tricks.sliding_window_view(tokens, SEQ + 1)
    for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
        assert (windows == row).all(axis=1).any()


def test_batch_deterministic(tokens):
    a, b = _batch(tokens, 3), _batch(tokens, 3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(_batch(tokens, 3)[0], _batch(tokens, 4)[0])
    assert not torch.equal(_batch(tokens, 3)[0], _batch(tokens, 3, seed=8)[0])


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_shard_union_is_global_batch(tokens, dp):
    full = _batch(tokens, 5)
    local = [local_batch(tokens, 5, seed=7, global_batch_size=8, seq_len=SEQ, dp_rank=r, dp_size=dp)
             for r in range(dp)]
    sharded = [shard_rows(full, r, dp) for r in range(dp)]
    for i in range(2):
        assert torch.equal(torch.cat([b[i] for b in local]), full[i])
        assert torch.equal(torch.cat([b[i] for b in sharded]), full[i])
    assert all(b[0].shape == (8 // dp, SEQ) for b in local)


def test_shard_rows_errors(tokens):
    with pytest.raises(ValueError, match="dp=3"):
        shard_rows(_batch(tokens, 0), 0, 3)
    with pytest.raises(ValueError, match="dp_rank=2"):
        shard_rows(_batch(tokens, 0), 2, 2)


def test_microbatches(tokens):
    full = _batch(tokens, 1)
    mbs = microbatches(full, 4)
    assert len(mbs) == 4 and all(mb[0].shape == (2, SEQ) for mb in mbs)
    assert torch.equal(torch.cat([mb[0] for mb in mbs]), full[0])
    assert torch.equal(torch.cat([mb[1] for mb in mbs]), full[1])
    with pytest.raises(ValueError, match="3 equal micro-batches"):
        microbatches(full, 3)


def test_batch_too_short_tokens():
    with pytest.raises(DataError, match="seq_len"):
        global_batch(np.zeros(SEQ, np.uint8), 0, seed=0, global_batch_size=1, seq_len=SEQ)


# ---------------------------------------------------------------- split and val


def test_split_fixed_by_data(tokens):
    train, val = split_tokens(tokens, seq_len=SEQ)
    assert len(val) == 250 and np.array_equal(np.concatenate([train, val]), tokens)
    _, small_val = split_tokens(tokens[:200], seq_len=SEQ)
    assert len(small_val) == SEQ + 1  # at least one window even for tiny data


def test_val_batches_deterministic_and_shardable(tmp_path):
    ds = load_dataset(str(_text_file(tmp_path, n=20000)), seq_len=SEQ)
    a = val_batches(ds, n_batches=3, batch_size=4, seq_len=SEQ)
    b = val_batches(ds, n_batches=3, batch_size=4, seq_len=SEQ)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.shape == (4, SEQ) and torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
        halves = [shard_rows((xa, ya), r, 2)[0] for r in range(2)]
        assert torch.equal(torch.cat(halves), xa)
    # First window starts at the very beginning of the val stream.
    assert bytes(a[0][0][0].tolist()) == bytes(ds.val[:SEQ])


# ---------------------------------------------------------------- user data


def test_folder_loads_in_sorted_order_skipping_hidden(tmp_path):
    root = tmp_path / "corpus"
    for name, text in [("b.txt", "B"), ("a/z.txt", "AZ"), ("a/c.txt", "AC"), ("c.txt", "C"),
                       (".hidden.txt", "H"), (".git/x.txt", "G"), ("empty.txt", "")]:
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    toks, n_files = read_user_data(str(root))
    assert bytes(toks) == b"AC\nAZ\nB\nC"
    assert n_files == 5


def test_load_user_file_and_describe(tmp_path):
    p = _text_file(tmp_path, n=2000)
    ds = load_dataset(str(p), seq_len=SEQ)
    assert np.array_equal(np.concatenate([ds.train, ds.val]), np.frombuffer(p.read_bytes(), np.uint8))
    assert str(p) in ds.describe() and "1 files" in ds.describe()


def _error_for(path, seq_len=SEQ):
    with pytest.raises(DataError) as info:
        load_dataset(str(path), seq_len=seq_len)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_error_missing_path(tmp_path):
    msg = _error_for(tmp_path / "nope")
    assert str(tmp_path / "nope") in msg and "does not exist" in msg


def test_error_empty_folder_and_file(tmp_path):
    (tmp_path / "d").mkdir()
    assert str(tmp_path / "d") in _error_for(tmp_path / "d")
    (tmp_path / "e.txt").write_text("")
    assert str(tmp_path / "e.txt") in _error_for(tmp_path / "e.txt")


def test_error_too_short(tmp_path):
    p = tmp_path / "short.txt"
    p.write_text("x" * 20)
    msg = _error_for(p)
    assert str(p) in msg and "20 tokens" in msg and str(2 * (SEQ + 1)) in msg


def test_error_binary_and_non_utf8_name_the_file(tmp_path):
    root = tmp_path / "mixed"
    _text_file(root, "a.txt")
    (root / "b.bin").write_bytes(b"abc\0def")
    msg = _error_for(root)
    assert str(root / "b.bin") in msg and "binary" in msg
    (root / "b.bin").unlink()
    (root / "c.txt").write_bytes("caf\u00e9".encode("latin-1"))
    msg = _error_for(root)
    assert str(root / "c.txt") in msg and "UTF-8" in msg


# ---------------------------------------------------------------- default corpus


def test_default_corpus_loads_and_cache_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))
    first = load_dataset(None, seq_len=256)
    assert len(first.train) + len(first.val) > 1_000_000 and first.n_files > 100
    cached = os.listdir(tmp_path / "cache")
    assert len(cached) == 1 and cached[0].endswith(".u8")  # no temp file left behind

    def no_walk(*args, **kwargs):
        raise AssertionError("cache miss: stdlib walked again")

    monkeypatch.setattr(os, "walk", no_walk)
    second = load_dataset(None, seq_len=256)
    assert second.n_files == first.n_files
    assert np.array_equal(second.train[:100_000], first.train[:100_000])
    assert np.array_equal(second.val, first.val)


def test_default_corpus_without_writable_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(blocker / "sub"))  # mkdir under a file fails
    ds = load_dataset(None, seq_len=256)
    assert len(ds.train) > 1_000_000
    assert data.cache_dir() == blocker / "sub"


def test_error_val_fraction_leaves_no_train(tmp_path):
    p = _text_file(tmp_path, n=100)
    with pytest.raises(DataError, match="val_fraction") as info:
        load_dataset(str(p), seq_len=SEQ, val_fraction=0.9)
    assert str(p) in str(info.value)
