"""Every bad input gives one clear line, a non-zero exit and no Python traceback.

The table runs through the real CLI entry (``hybridpar.cli.main.main``) in this process, where no
rank is ever started: ``spawn`` and the worker are replaced by a function that fails the test,
so a check that let a bad input through cannot start a training run. A few cases run as real
subprocesses (``python -m hybridpar``, and under torchrun) to check the whole path, stderr included.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybridpar.cli import main as cli

# (case id, argv after "train" with {d} = a folder of prepared files, expected text in the error)
CASES = [
    ("tp-not-dividing-heads", ["--tp", "3"], "parallel.tp=3 must divide model.n_heads=8; valid tp: 1, 2, 4"),
    ("dp-zero", ["--dp", "0"], "parallel.dp=0 must be at least 1"),
    ("pp-negative", ["--pp", "-1"], "parallel.pp=-1 must not be negative"),
    ("steps-zero", ["--steps", "0"], "train.steps=0 must be at least 1"),
    ("seq-len-zero", ["--model.seq_len=0"], "model.seq_len=0 must be at least 1"),
    ("heads-not-dividing-d-model", ["--model.n_heads=6"], "model.n_heads=6 must divide model.d_model=256"),
    ("kv-heads-not-dividing", ["--model.n_kv_heads=3"], "model.n_kv_heads=3 must divide model.n_heads=8"),
    ("pp-more-than-layers", ["--pp", "7", "--dp", "1"], "parallel.pp=7 exceeds model.n_layers=6"),
    ("batch-not-divisible", ["--dp", "4", "--global-batch", "30"],
     "train.global_batch=30 must be divisible by dp*microbatches=4*1=4"),
    ("bad-rank-order", ["--parallel.order=tp-dp"], "parallel.order='tp-dp' must name dp, tp and pp"),
    ("bad-pp-split", ["--pp", "2", "--parallel.pp_split=3,x"], "parallel.pp_split='3,x' must be comma-separated"),
    ("unknown-key", ["--model.n_layrs=4"], "unknown config key 'model.n_layrs'; did you mean 'n_layers'?"),
    ("unknown-section", ["--modle.n_layers=4"], "unknown config section 'modle'; did you mean 'model'?"),
    ("unknown-flag", ["--stesp", "10"], "unknown argument '--stesp'; did you mean '--steps'?"),
    ("not-a-number", ["--train.lr=fast"], "train.lr='fast' is not a number"),
    ("negative-lr", ["--train.lr=-1"], "train.lr=-1.0 must be positive"),
    ("bad-choice", ["--schedule", "zigzag"], "parallel.schedule='zigzag' is not valid; choose one of gpipe, 1f1b"),
    ("bad-bool", ["--model.tie_embeddings=maybe"], "model.tie_embeddings='maybe' is not a boolean"),
    ("val-fraction", ["--data.val_fraction=1.5"], "data.val_fraction=1.5 must be between 0 and 1"),
    ("nan-policy", ["--reliability.nan_policy=ignore"], "reliability.nan_policy='ignore' is not valid; choose one of stop, skip"),
    ("negative-deadline", ["--reliability.deadline_s=-5"], "reliability.deadline_s=-5.0 must be >= 0"),
    ("toml-wrong-type-str", ["--config", "{d}/lr_str.toml"], "train.lr must be float, got str 'fast'"),
    ("toml-wrong-type-float", ["--config", "{d}/dp_float.toml"], "parallel.dp must be int, got float 2.5"),
    ("toml-wrong-type-bool", ["--config", "{d}/tie_int.toml"], "model.tie_embeddings must be bool, got int 1"),
    ("toml-unknown-key", ["--config", "{d}/typo.toml"], "unknown config key 'train.stpes'; did you mean 'steps'?"),
    ("toml-syntax", ["--config", "{d}/syntax.toml"], "is not valid TOML"),
    ("toml-missing", ["--config", "{d}/nope.toml"], "nope.toml does not exist"),
    ("toml-is-folder", ["--config", "{d}"], "is a folder; pass a .toml file"),
    ("toml-not-utf8", ["--config", "{d}/latin1.toml"], "is not UTF-8 text"),
    ("data-missing", ["--data.path={d}/missing.txt"], "missing.txt' does not exist"),
    ("data-empty-file", ["--data.path={d}/empty.txt"], "empty.txt' is empty; add text"),
    ("data-empty-folder", ["--data.path={d}/emptydir"], "has no (non-hidden) files"),
    ("data-shorter-than-a-sequence", ["--data.path={d}/short.txt"],
     "has 10 tokens (bytes) but seq_len=128 needs at least 258"),
    ("data-binary", ["--data.path={d}/binary.dat"], "looks binary (contains NUL bytes)"),
    ("token-file-ids-outside-vocab", ["--data.path={d}/binary.bin"],
     "holds id 65534 >= model.vocab_size=256; wrong data.token_dtype"),
    ("data-not-utf8", ["--data.path={d}/latin1.txt"], "is not valid UTF-8 text (byte 1)"),
    ("metrics-folder-missing", ["--metrics", "{d}/no/such/m.jsonl"], "train.metrics="),
    ("device-cuda-missing", ["--train.device=cuda"], "train.device=cuda but no CUDA device"),
    ("weights-of-another-model", ["--model.init_from={d}/hf_other"],
     "model.n_layers=6 but model.init_from="),
    ("weights-file-of-another-model", ["--dp", "1", "--model.init_from={d}/other.pt"],
     "tok_emb.weight has shape (256, 64), the model config needs (256, 256)"),
    ("world-size-mismatch-in-launcher", ["--dp", "4"],
     "the launcher started 2 processes but dp*tp*pp = 4*1*1 = 4"),  # env: under a launcher
    ("unknown-command", None, "unknown command 'trian'; did you mean 'train'?"),
    # silent wrong results or lost work before (issue: reliability): now one line, exit 2
    ("vocab-smaller-than-data", ["--model.vocab_size=128"], "is outside model.vocab_size=128 (ids 0..127)"),
    ("vocab-smaller-than-data-tp2", ["--tp", "2", "--model.vocab_size=128"], "is outside model.vocab_size=128"),
    ("resume-folder-missing", ["--checkpoint.dir={d}/no_such_ckpt", "--resume"],
     "--resume: checkpoint.dir={d}/no_such_ckpt does not exist; check the folder name"),
    ("resume-nothing-to-resume", ["--checkpoint.dir={d}/emptydir", "--resume"],
     "--resume: checkpoint.dir={d}/emptydir holds no complete checkpoint"),
    ("negative-min-lr", ["--train.min_lr_ratio=-5"], "train.min_lr_ratio=-5.0 must be in [0, 1]"),
    ("nan-lr", ["--train.lr=nan"], "train.lr=nan must be a finite number, positive"),
    ("inf-lr", ["--train.lr=inf"], "train.lr=inf must be a finite number, positive"),
    ("zero-rope-theta", ["--model.rope_theta=0"], "model.rope_theta=0.0 must be positive"),
    ("negative-init-std", ["--model.init_std=-0.1"], "model.init_std=-0.1 must be positive"),
    ("beta1-one", ["--train.beta1=1"], "train.beta1=1.0 must be in [0, 1)"),
    ("eval-batches-zero", ["--train.eval_batches=0"],
     "train.eval_batches=0 must be at least 1 when train.eval_every=50"),
    ("config-fifo", ["--config", "{d}/fifo"], "is not a regular file (a pipe or device?)"),
    ("data-fifo", ["--data.path={d}/fifo"], "is not a regular file (a pipe or device?)"),
    ("toml-bom", ["--config", "{d}/bom.toml"], "starts with a UTF-8 byte-order mark"),
    ("data-only-newlines", ["--data.path={d}/newlines.txt"], "holds only whitespace; add text"),
    ("metrics-is-a-folder", ["--metrics", "{d}"], "train.metrics='{d}' is a folder; give a file path"),
    ("checkpoint-dir-is-a-file", ["--checkpoint.dir={d}/lr_str.toml"], "is a file, not a folder"),
    ("checkpoint-dir-under-a-file", ["--checkpoint.dir={d}/lr_str.toml/ck"], "cannot be created"),
    ("fault-rank-outside-world", ["--dp", "2"], "HYBRIDPAR_FAULT names rank 7, outside this job's ranks 0..1"),
    ("steps-twice", ["--steps", "5", "--train.steps=7"], "--steps and --train.steps both set train.steps; give one"),
    ("export-out-is-a-file", ["@export", "{d}/other.pt", "--out", "{d}/lr_str.toml"],
     "export --out {d}/lr_str.toml is an existing file; give a folder path"),
    ("generate-temperature-nan", ["@generate", "{d}/other.pt", "--prompt", "x", "--temperature", "nan"],
     "--temperature nan must be a finite number >= 0"),
    ("generate-negative-tokens", ["@generate", "{d}/other.pt", "--prompt", "x", "--max-new-tokens", "-5"],
     "--max-new-tokens -5 must be at least 1"),
]
ENV = {"world-size-mismatch-in-launcher": {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
       "fault-rank-outside-world": {"HYBRIDPAR_FAULT": "raise:7:2"}}
NEEDS_CUDA_ABSENT = {"device-cuda-missing"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "lr_str.toml").write_text('[train]\nlr = "fast"\n')
    os.mkfifo(d / "fifo")  # reading it would block forever: must be refused, not opened
    (d / "bom.toml").write_bytes(b"\xef\xbb\xbf[train]\nsteps = 5\n")
    (d / "newlines.txt").write_text("\n" * 5000)
    (d / "dp_float.toml").write_text("[parallel]\ndp = 2.5\n")
    (d / "tie_int.toml").write_text("[model]\ntie_embeddings = 1\n")
    (d / "typo.toml").write_text("[train]\nstpes = 5\n")
    (d / "syntax.toml").write_text("[train\nsteps = 5\n")
    (d / "latin1.toml").write_bytes("[train]\n# caf\u00e9\n".encode("latin-1"))
    (d / "empty.txt").write_text("")
    (d / "emptydir").mkdir()
    (d / "short.txt").write_text("0123456789")
    (d / "binary.dat").write_bytes(bytes(range(256)) * 8)
    (d / "binary.bin").write_bytes(bytes(range(256)) * 8)  # read as uint16 token ids
    (d / "latin1.txt").write_bytes(("h\u00e9llo w\u00f6rld " * 40).encode("latin-1"))
    hf = d / "hf_other"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    import torch

    from hybridpar.config import ModelConfig
    from hybridpar.models.transformer import Transformer

    other = Transformer(ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128))
    torch.save({k: v.detach() for k, v in other.state_dict().items()}, d / "other.pt")
    return d


@pytest.fixture
def no_training(monkeypatch):
    """A bad input must be rejected before any rank starts: reaching one fails the test."""
    def started(*a, **k):
        raise AssertionError("a training process was started for a bad input")

    monkeypatch.setattr("hybridpar.engine.launch.spawn", started)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "HYBRIDPAR_FAULT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name,argv,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(name, argv, expected, files, no_training, capsys):
    import torch

    if name in NEEDS_CUDA_ABSENT and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    for k, v in ENV.get(name, {}).items():
        no_training.setenv(k, v)
    if argv is None:
        args = ["trian"]
    elif argv[0].startswith("@"):  # another command than train
        args = [argv[0][1:], *[a.replace("{d}", str(files)) for a in argv[1:]]]
    else:
        args = ["train", *[a.replace("{d}", str(files)) for a in argv]]
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridpar: error: "), err
    assert expected.replace("{d}", str(files)) in lines[0], lines[0]
    assert "Traceback" not in err


def test_resume_with_nothing_left_to_train_says_so(tmp_path):
    """--resume=auto on an empty folder says it starts fresh; --resume whose checkpoint is already
    at train.steps: one line, exit 0, checkpoint kept."""
    tiny = ["--dp", "1", "--model.n_layers=1", "--model.d_model=32", "--model.n_heads=4",
            "--model.n_kv_heads=2", "--model.d_ff=64", "--model.seq_len=16", "--train.progress=false",
            "--train.eval_every=0", f"--checkpoint.dir={tmp_path}/ck"]
    first = _run(["-m", "hybridpar", "train", *tiny, "--steps", "2", "--resume=auto"])
    assert first.returncode == 0, first.stderr
    assert "--resume=auto: checkpoint.dir=" in first.stderr and "starting a new run" in first.stderr
    again = _run(["-m", "hybridpar", "train", *tiny, "--steps", "2", "--resume"])
    assert again.returncode == 0, again.stderr
    assert "hybridpar: nothing to train:" in again.stderr and "is at step 2 and train.steps=2" in again.stderr
    assert (tmp_path / "ck" / "step_000002").is_dir()


def _run(args, env=None, timeout=120):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("HYBRIDPAR_FAULT", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_real_entry_point_prints_one_line_without_traceback(files):
    """The same path as a user: the module entry point, stderr and exit code of the process."""
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "hybridpar", "train", *[a.replace("{d}", str(files)) for a in argv]],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, **ENV.get(name, {})})
        for name, argv, _ in CASES if name in ("data-binary", "toml-wrong-type-str",
                                                "world-size-mismatch-in-launcher", "unknown-key")}
    expected = {name: exp for name, _, exp in CASES}
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, (name, err)
        assert err.strip() == f"hybridpar: error: {expected[name]}" or (
            len(err.strip().splitlines()) == 1 and expected[name] in err), (name, err)
        assert "Traceback" not in err and out == ""


def test_error_found_inside_the_ranks_is_still_one_line(files):
    """Weights of another model in a bare .pt file declare no config, so the mismatch shows only
    when the ranks load them: the launcher's report of that rank becomes the same one line."""
    r = _run(["-m", "hybridpar", "train", "--dp", "2", "--train.progress=false",
              f"--model.init_from={files}/other.pt"])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"hybridpar: error: model.init_from={files}/other.pt: tok_emb.weight has shape (256, 64), "
        "the model config needs (256, 256); set the model fields to match"], r.stderr


def test_world_size_mismatch_under_torchrun():
    """torchrun with 2 processes for a 4-rank layout: our line is printed once, before any rank
    creates a process group. torchrun itself then reports the failed workers with a traceback of
    its own launcher (torch/distributed/run.py), which we cannot change: none of it is ours."""
    r = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "hybridpar", "train", "--dp", "4"])
    assert r.returncode != 0
    ours = [line for line in r.stderr.splitlines() if line.startswith("hybridpar:")]
    assert ours == ["hybridpar: error: the launcher started 2 processes but dp*tp*pp = 4*1*1 = 4; "
                    "start 4 processes (torchrun --nproc-per-node) or change --dp/--tp/--pp so "
                    "their product is 2"], r.stderr
    frames = [line for line in r.stderr.splitlines() if line.strip().startswith("File ")]
    assert not [f for f in frames if "hybridpar" in f], frames  # no frame of our code
