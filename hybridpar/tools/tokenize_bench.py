"""Benchmark (not a test): tokenising a text corpus into hybridpar's cached token file, against
the ``tokenizers`` batch API called directly on the same documents.

    python -m hybridpar.tools.tokenize_bench [--mb 100] [--tokenizer PATH]

The corpus is the Python standard library's sources, repeated into 64 KB documents until it
holds ``--mb`` MB; the tokenizer is ``--tokenizer`` or a byte-level BPE of 8,192 ids trained
here on its first 4 MB (not timed). Each method runs in a fresh process, so each peak RSS is
its own: ``direct`` (encode_batch over batches of 1,024 documents, ids kept as uint16 arrays),
``hybridpar cold`` (``corpus.tokenize_files``: the same batches streamed to the cache file),
``hybridpar warm`` (the next run: the cache file memory-mapped).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sysconfig
import tempfile
import time
from pathlib import Path


def _corpus(folder: Path, mb: int, doc_kb: int = 64) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py")))
    files, size, i = [], 0, 0
    while size < mb * 2 ** 20:
        chunk = text[(i * doc_kb * 1024) % max(len(text) - doc_kb * 1024, 1):][:doc_kb * 1024]
        f = folder / f"doc{i:06d}.txt"
        f.write_text(chunk, encoding="utf-8")
        files.append(f)
        size += f.stat().st_size
        i += 1
    return files


def _train_tokenizer(files: list[Path], out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((f.read_text(encoding="utf-8") for f in files[:64]), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    return out


def _run(method: str, files: list[str], tokenizer: str, cache: str, q) -> None:
    import numpy as np

    os.environ["HYBRIDPAR_CACHE"] = cache
    from ..engine import corpus
    from ..engine.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer)
    paths = [Path(f) for f in files]
    t0 = time.perf_counter()
    if method == "direct":
        n, parts = 0, []
        for i in range(0, len(paths), 1024):
            texts = [p.read_text(encoding="utf-8") for p in paths[i:i + 1024]]
            for enc in tok._tok.encode_batch(texts, add_special_tokens=False):
                parts.append(np.asarray(enc.ids, dtype=np.uint16))
                n += len(enc.ids) + 1
    else:
        tokens, _ = corpus.tokenize_files(paths, tok, progress=False)
        n = len(tokens)
    dt = time.perf_counter() - t0
    q.put((dt, n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hybridpar.tools.tokenize_bench")
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--tokenizer", default="", help="a tokenizer.json or its folder (default: a BPE trained here)")
    a = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hybridpar-tokbench-") as tmp:
        tmp = Path(tmp)
        (tmp / "docs").mkdir()
        files = _corpus(tmp / "docs", a.mb)
        mb = sum(f.stat().st_size for f in files) / 2 ** 20
        tokenizer = a.tokenizer or str(_train_tokenizer(files, tmp))
        print(f"{mb:.0f} MB in {len(files):,} documents; tokenizer {tokenizer}; {os.cpu_count()} cores")
        print(f"{'method':16s} {'seconds':>8s} {'MB/s':>7s} {'tokens':>12s} {'peak RSS MiB':>13s} {'vs direct':>10s}")
        base = None
        for method in ("direct", "hybridpar cold", "hybridpar warm"):
            q = ctx.Queue()
            p = ctx.Process(target=_run, args=(method, [str(f) for f in files], tokenizer, str(tmp / "cache"), q))
            p.start()
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"{method} failed (exit code {p.exitcode}); its traceback is above")
            dt, n, rss = q.get()
            base = base or dt
            print(f"{method:16s} {dt:8.2f} {mb / dt:7.1f} {n:12,d} {rss:13.0f} {dt / base:10.2f}")


if __name__ == "__main__":
    main()
