"""``train.compile``: torch.compile'd units train the same run as one eager process.

Inductor fuses elementwise ops and reorders the additions inside reductions (a norm's mean, a
softmax's sum), the same kind of change as a tp partial sum: a reordered sum of K terms moves a
result by at most ~K u relative (u = 6e-8, K <= 64 here), so the eager parity tolerances hold
unchanged (test_parity: step 1 within 1e-5, later steps and evaluation within 1e-4). The layout
compiles units that contain tensor-parallel collectives (graph breaks inside the unit) and runs
them through the 1F1B pipeline with recomputation; one spawn of 4 ranks.
"""
from __future__ import annotations

import dataclasses

import pytest

from hybridpar.config import ConfigError, validate
from hybridpar.testing import cached_reference, run_cases, tiny_config

from test_parity import assert_parity


def _compiled(cfg, **parallel):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=True),
                               parallel=dataclasses.replace(cfg.parallel, **parallel))


CASES = {"2x2x1-compiled": (_compiled(tiny_config(dp=2, tp=2, n_layers=4)), None),
         "1x2x2-compiled-recompute": (_compiled(tiny_config(tp=2, pp=2, n_layers=4),
                                                recompute="full"), None)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, str(tmp_path_factory.mktemp("compile")), world=4)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_layout_matches_the_eager_single_process(results, name):
    cfg, _ = CASES[name]
    eager = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))
    loss_errs, grad_err = assert_parity(results[name], cached_reference(eager))
    print(f"{name}: max loss rel err {max(loss_errs):.2e}, grad rel err {grad_err:.2e}")


def test_compile_without_a_cxx_compiler_is_one_clear_error(monkeypatch):
    import shutil
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="train.compile=true needs a C.. compiler"):
        validate(_compiled(tiny_config()))


def test_units_of_one_class_with_different_shapes_all_compile(monkeypatch):
    """Dynamo keeps a limited number of compiled variants per code object (8 by default), and
    units of one class share their forward (a CNN's blocks at several widths): ``apply_compile``
    raises the limit so that every unit compiles instead of the later ones falling back to eager.
    Ten blocks of one class, ten shapes: ten graphs (the eager backend: the count, not inductor,
    is under test)."""
    import torch
    import torch._dynamo
    import torch._dynamo.utils
    from torch import nn

    from hybridpar.parallel.parallelize import apply_compile

    class Block(nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.lin = nn.Linear(d_in, d_out)

        def forward(self, x):
            return torch.relu(self.lin(x))

    compile_ = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compile_(self, backend="eager", **kw))
    widths = list(range(4, 15))
    model = nn.Sequential(*[Block(a, b) for a, b in zip(widths, widths[1:])])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(recompile_limit=8):  # the default; restored after
        apply_compile(model, [str(i) for i in range(len(model))])
        model(torch.randn(3, 4)).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(model) == 10
    torch._dynamo.reset()
