"""The single-process engine run (the parity reference) equals a plain PyTorch training loop.

The loop below is written without any hybridpar machinery except the model class and the data
sampler: one forward over the whole global batch, F.cross_entropy, loss.backward(),
clip_grad_norm_, AdamW. The engine instead accumulates 4 micro-batches through the pipeline
interpreter and its gradient buffers; only the order of additions differs, so the same
tolerances as the parity tests apply.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridpar.engine import data
from hybridpar.models.transformer import Transformer
from hybridpar.models import spec_for
from hybridpar.parallel.parallelize import init_full
from hybridpar.testing import reference, rel_err, tiny_config, tiny_dataset
from hybridpar.engine.train import lr_at


def plain_loop(cfg, dataset):
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_full(spec_for(cfg.model), name, tuple(p.shape), cfg.train.seed))
    t = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    losses = []
    for step in range(t.steps):
        x, y = data.global_batch(dataset.train, step, seed=t.seed, global_batch_size=t.global_batch,
                                 seq_len=cfg.model.seq_len)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        opt.step()
        losses.append(loss.item())
    return losses


def test_engine_single_process_equals_plain_pytorch():
    cfg = tiny_config(n_layers=2, steps=5)
    ds = tiny_dataset()
    plain = plain_loop(cfg, ds)
    engine = reference(cfg, ds)["losses"]
    errs = [rel_err(a, b) for a, b in zip(engine, plain)]
    assert errs[0] <= 1e-5 and max(errs) <= 1e-4, errs
    assert plain[-1] < plain[0]  # it trains


def test_engine_tied_embeddings_equal_plain_pytorch():
    cfg = tiny_config(n_layers=2, steps=3, tie_embeddings=True)
    ds = tiny_dataset()
    errs = [rel_err(a, b) for a, b in zip(reference(cfg, ds)["losses"], plain_loop(cfg, ds))]
    assert errs[0] <= 1e-5 and max(errs) <= 1e-4, errs
