"""The prepared GPU check (hybridpar.tools.gpu_check) runs its CPU part here, so that the script
a GPU session will run once is known to work end to end; on a GPU the same checks compare the
device against the CPU."""
from __future__ import annotations

from hybridpar.tools import gpu_check


def test_cpu_part_runs_every_check_and_passes(capsys):
    rc = gpu_check.main(["--device", "cpu", "--quick", "--ranks", "2"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert rc == 0 and not [x for x in lines if x.startswith("[FAIL]")], out
    for name in ("env", "fp32 cpu vs cpu", "bf16 cpu vs cpu", "recompute=selective cpu",
                 "recompute=full cpu", "checkpoint cpu -> cpu", "compile cpu", "throughput cpu",
                 "dist 2 2x1x1 (gloo)", "dist 2 1x1x1 cp2 (gloo)", "dist 2 1x1x2 zero1 tied (gloo)",
                 "watchdog"):
        assert any(x.split("] ", 1)[1].startswith(name + ":") for x in lines), (name, out)


def test_comparison_fails_on_a_wrong_result():
    """The parity comparison the GPU check relies on rejects a run that differs."""
    import torch

    ref = {"losses": [1.0, 0.9], "val_losses": [0.95], "grads": {"w": torch.ones(3)}}
    assert gpu_check._compare(ref, ref, "fp32")[0]
    for bad in ({**ref, "losses": [1.001, 0.9]}, {**ref, "val_losses": [0.96]},
                {**ref, "grads": {"w": torch.tensor([1.0, 1.0, 1.01])}}):
        assert not gpu_check._compare(bad, ref, "fp32")[0]
    say = gpu_check.Report()
    say.guarded("boom", lambda: 1 / 0)
    assert say.failed and say.lines[-1][0] == "FAIL"
