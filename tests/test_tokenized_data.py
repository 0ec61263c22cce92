"""Real data: a Hugging Face model folder with its own BPE tokenizer (trained offline with the
``tokenizers`` package) imported, trained on a text folder and on instruction data at several
layouts, generating and exporting with its tokenizer; every data format yields the same token
stream; bad data is one line.

Tolerances are the engine's (tests/test_parity.py): step-1 loss 1e-5 relative against
transformers' loss on the same token batch (float32; the same ops in the same order up to
tensor-parallel partial sums), later losses 1e-4 between layouts.
"""
from __future__ import annotations

import json
import sysconfig
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from hybridpar.cli.main import main  # noqa: E402
from hybridpar.config import Config, DataConfig, ParallelConfig, TrainConfig  # noqa: E402
from hybridpar.engine.corpus import IGNORE  # noqa: E402
from hybridpar.engine.data import DataError, load_data, load_dataset  # noqa: E402
from hybridpar.engine.tokenizer import HFTokenizer, load_tokenizer  # noqa: E402
from hybridpar.interop import hf  # noqa: E402
from hybridpar.models import spec_for  # noqa: E402
from hybridpar.testing import rel_err, run_case, run_cases  # noqa: E402

VOCAB, SEQ, BATCH = 320, 32, 8
STEP1_RTOL, LATER_RTOL = 1e-5, 1e-4


def _texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8")[:6000]
            for name in ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py", "glob.py")]


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """An HF folder (tiny random Llama + BPE tokenizer), its import, a text folder and a JSONL
    of instructions."""
    root = tmp_path_factory.mktemp("tok")
    hfdir = root / "hf"
    hfdir.mkdir()
    _tokenizer(hfdir)
    eos = HFTokenizer(hfdir).eos_id
    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                 max_position_embeddings=SEQ, rms_norm_eps=1e-5, rope_theta=500.0,
                                 eos_token_id=eos, bos_token_id=eos)
    model = transformers.LlamaForCausalLM(c).eval()
    model.save_pretrained(hfdir)
    assert main(["import-hf", str(hfdir), "--out", str(root / "imported")]) == 0
    text = root / "text"
    text.mkdir()
    for i, t in enumerate(_texts()):
        (text / f"doc{i}.txt").write_text(t)
    rows = [{"prompt": f"Q: what is {a} plus {b}?\nA: ", "response": f"{a + b}"}
            for a in range(8) for b in range(8)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "hf": hfdir, "imported": root / "imported", "text": text,
            "sft": root / "sft.jsonl", "model": model}


def _cfg(world, path, dp=1, tp=1, pp=1, **data) -> Config:
    m = replace(hf.read_hf_config(world["hf"]),
                init_from=str(world["imported"]), seq_len=SEQ)
    return Config(model=m, parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, microbatches=2),
                  train=TrainConfig(steps=3, global_batch=BATCH, lr=1e-3, warmup_steps=1,
                                    eval_every=3, eval_batches=1, progress=False,
                                    threads_per_rank=1, seed=5),
                  data=DataConfig(path=str(path), val_fraction=0.25, **data))


def test_import_copies_the_tokenizer_and_training_uses_it(world):
    assert (world["imported"] / "tokenizer.json").is_file()
    cfg = _cfg(world, world["text"])
    tok = load_tokenizer(cfg.data.tokenizer, cfg.model.init_from, vocab_size=cfg.model.vocab_size)
    assert tok.name.endswith("tokenizer.json")  # taken from the imported folder, not bytes
    ds = load_data(cfg, spec_for(cfg.model))
    stream = np.concatenate([ds.train, ds.val])
    assert stream.dtype == np.uint16 and int(stream.max()) < VOCAB
    first = tok.encode(_texts()[0])
    assert stream[:len(first)].tolist() == first and stream[len(first)] == tok.eos_id


def _hf_loss(world, cfg, dataset, step=0) -> float:
    x, y = dataset.batch("train", step, seed=cfg.train.seed, global_batch_size=BATCH, seq_len=SEQ)
    with torch.no_grad():
        logits = world["model"](x).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE).item()


@pytest.fixture(scope="module")
def layouts(world):
    """One 8-rank spawn: text at (2,2,2) and (4,1,2), instructions at (2,2,2)."""
    cases = {"text-2x2x2": (_cfg(world, world["text"], 2, 2, 2), None),
             "text-4x1x2": (_cfg(world, world["text"], 4, 1, 2), None),
             "sft-2x2x2": (_cfg(world, world["sft"], 2, 2, 2), None)}
    return run_cases(cases, str(world["root"] / "cases"))


@pytest.mark.parametrize("kind", ["text", "sft"])
def test_step1_loss_is_transformers_loss_and_every_layout_agrees(world, layouts, kind):
    """One process's step-1 loss is transformers' on the same batch (instructions: the mean
    over response tokens of the global batch, a hand computation), and the layouts give one
    process's losses."""
    cfg = _cfg(world, world[kind])
    ds = load_data(cfg, spec_for(cfg.model))
    one = run_case(cfg, dataset=ds)
    assert rel_err(one["losses"][0], _hf_loss(world, cfg, ds)) <= STEP1_RTOL
    for name, got in layouts.items():
        if name.startswith(kind):
            errs = [rel_err(a, b) for a, b in zip(got["losses"], one["losses"])]
            assert errs[0] <= STEP1_RTOL and max(errs) <= LATER_RTOL, (name, errs)
            assert rel_err(got["val_losses"][0], one["val_losses"][0]) <= LATER_RTOL, name


def test_instruction_loss_masks_prompts_by_hand():
    """A toy example: the loss counts response tokens only, normalised over the global batch."""
    from hybridpar.engine.corpus import load_instructions
    from hybridpar.engine.tokenizer import ByteTokenizer

    import tempfile
    with tempfile.TemporaryDirectory() as d:
        f = Path(d, "x.jsonl")
        f.write_text('{"prompt": "ab", "response": "c"}\n{"prompt": "a", "response": "bcd"}\n'
                     '{"prompt": "z", "response": "y"}\n')
        ds = load_instructions([f], ByteTokenizer(), seq_len=6, val_fraction=0.3)
    x, y = ds.inputs[0], ds.targets[0]
    a, b, c, d, nl = (ord(ch) for ch in "abcd\n")
    assert x[0].tolist() == [a, b, c, nl, nl, nl]  # padded with EOS
    assert y[0].tolist() == [IGNORE, c, nl, IGNORE, IGNORE, IGNORE]  # predicts "c" then EOS
    assert y[1].tolist() == [b, c, d, nl, IGNORE, IGNORE]
    logits = torch.randn(2, 6, 256, generator=torch.Generator().manual_seed(0))
    targets = torch.from_numpy(y.astype(np.int64))
    by_hand = sum(-logits[i, t].log_softmax(-1)[targets[i, t]] for i in range(2) for t in range(6)
                  if targets[i, t] != IGNORE) / 6
    from hybridpar.parallel.tensor_parallel.layers import cross_entropy
    assert torch.allclose(cross_entropy(logits, targets), by_hand)
    assert torch.allclose(cross_entropy(logits, targets, reduction="sum") / 6, by_hand)


def test_generate_and_export_keep_the_tokenizer(world, tmp_path, capsys):
    from hybridpar.interop.generate import complete

    prompt = "def main("
    tok = HFTokenizer(world["imported"])
    ours = complete(world["imported"], prompt, temperature=0.0, max_new_tokens=10)
    ids = tok.encode(prompt, special=True)
    out = world["model"].generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                                  eos_token_id=tok.eos_id, pad_token_id=tok.eos_id)
    new = out[0, len(ids):].tolist()
    new = new[:new.index(tok.eos_id)] if tok.eos_id in new else new
    assert ours == tok.decode(new)
    assert main(["export", str(world["imported"]), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert back(prompt, add_special_tokens=False)["input_ids"] == tok.encode(prompt)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert torch.equal(reloaded(torch.tensor([ids])).logits, world["model"](torch.tensor([ids])).logits)


def test_every_format_gives_the_same_token_stream(world, tmp_path):
    """A text folder, JSON lines of the same texts, the token ids as .npy and .bin files, and a
    Hugging Face dataset saved on disk (Dataset and DatasetDict) and as parquet."""
    tok = HFTokenizer(world["imported"])
    kw = dict(seq_len=SEQ, val_fraction=0.25, tokenizer=tok, vocab_size=VOCAB)
    text = load_dataset(str(world["text"]), **kw)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in _texts()))
    jsonl = load_dataset(str(tmp_path / "docs.jsonl"), text_field="body", **kw)
    stream = np.concatenate([text.train, text.val])
    np.save(tmp_path / "tokens.npy", stream.astype(np.int32))
    stream.astype(np.uint16).tofile(tmp_path / "tokens.bin")
    npy = load_dataset(str(tmp_path / "tokens.npy"), **kw)
    binary = load_dataset(str(tmp_path / "tokens.bin"), token_dtype="uint16", **kw)
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"body": _texts()})
    ds.save_to_disk(str(tmp_path / "hfds"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "hfdict"))
    ds.to_parquet(str(tmp_path / "docs.parquet"))
    saved = [load_dataset(str(tmp_path / p), text_field="body", **kw)
             for p in ("hfds", "hfdict", "docs.parquet")]
    for other in (jsonl, npy, binary, *saved):
        assert np.array_equal(np.concatenate([other.train, other.val]), stream), other.source


def test_bad_token_data_is_one_line(world, tmp_path):
    tok = HFTokenizer(world["imported"])
    kw = dict(seq_len=SEQ, val_fraction=0.25, tokenizer=tok, vocab_size=VOCAB)
    with pytest.raises(DataError, match="has 3\\d\\d tokens but model.vocab_size=256; a tokenizer of another model"):
        load_tokenizer(str(world["imported"]), vocab_size=256)
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("  \n\n")
    with pytest.raises(DataError, match="holds no text"):
        load_dataset(str(tmp_path / "blank"), **kw)
    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="d.jsonl:1 has no field 'text' \\(fields: body\\); set data.text_field"):
        load_dataset(str(tmp_path / "d.jsonl"), **kw)
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(DataError, match="holds id .* >= model.vocab_size=320; wrong data.token_dtype"):
        load_dataset(str(tmp_path / "t.bin"), token_dtype="uint32", **kw)
    pytest.importorskip("datasets").Dataset.from_dict({"body": ["x"]}).to_parquet(str(tmp_path / "p.parquet"))
    with pytest.raises(DataError, match="p.parquet' has no column 'text' \\(columns: body\\); set data.text_field"):
        load_dataset(str(tmp_path / "p.parquet"), **kw)
    with pytest.raises(DataError, match="no tokenizer.json there"):
        load_tokenizer(str(tmp_path))
