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
