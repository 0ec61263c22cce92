"""The prepared GPU check: one command, one PASS / FAIL / INFO line per check, exit 1 on a FAIL.

    python -m hybridpar.tools.gpu_check                  # on a GPU machine (about 5 minutes)
    python -m hybridpar.tools.gpu_check --device cpu --quick --ranks 2   # its CPU part (a test)

Every check runs the library's own code path on ``--device`` (default: cuda when available):

  env          torch, CUDA, NCCL versions and the devices (INFO)
  fp32         5 steps of the tiny Llama (evaluation on) on the device against the same run on
               the CPU, TF32 off: the engine's parity tolerances (step-1 loss and gradients 1e-5,
               later losses 1e-4): only the order of additions differs between the kernels
               (the Llama's q/k/v and w1/w3 GEMMs are fused on the GPU, separate on the CPU:
               ``fused_linear``; so this also checks the fused path against the separate one)
  bf16         the same in bf16 autocast against the CPU in bf16: the bf16 bounds of
               tests/test_memory_features.py (3.9e-3 step 1, 3.2e-2 later and gradients)
  recompute    selective and full recomputation on the device: bitwise the run without
  checkpoint   a checkpoint written by a device run loads bitwise into a CPU process
  compile      train.compile=true on the device against the eager run there (fp32 tolerances:
               inductor reorders additions), with the time it took, compilation included
  throughput   a larger Llama (~1B parameters; --quick: the tiny one) in bf16: tokens/s, MFU
               against the device's preset peak, and the allocator's peak memory against the
               planner's prediction (PASS within 15%; the planner does not model the caching
               allocator's fragmentation)
  dist N       for each N of --ranks (that the devices allow: NCCL needs a GPU per rank), the
               layouts of N ranks, ZeRO-1 with tied embeddings and a cp layout included, against
               one CPU process (fp32 tolerances)
  watchdog     2 ranks, rank 1 hangs mid-run (HYBRIDPAR_FAULT): the job must end with exit 1 and
               name rank 1 in the watchdog's report (on NCCL the healthy rank's host waits in
               the norm's sync while its device is in the all-reduce: followed by CUDA events),
               and on a GPU each rank dumps NCCL's flight recorder
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch

from ..config import Config
from ..testing import max_rel_tensor_err, reference, rel_err, run_case, tiny_config, tiny_dataset

TOL = {"fp32": (1e-5, 1e-4, 1e-5), "bf16": (3.9e-3, 3.2e-2, 3.2e-2)}
"""(step-1 loss, later losses, step-1 gradients) relative bounds; see the module docstring."""


class Report:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, str]] = []

    def __call__(self, name: str, ok: bool | None, detail: str) -> None:
        tag = {True: "PASS", False: "FAIL", None: "INFO"}[ok]
        self.lines.append((tag, name, detail))
        print(f"[{tag}] {name}: {detail}", flush=True)

    def guarded(self, name: str, fn, *args) -> None:
        """A check that raises is one FAIL line, and the others still run."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            first = (str(e).strip().splitlines() or [""])[0][:300]
            self(name, False, f"{type(e).__name__}: {first}")

    @property
    def failed(self) -> bool:
        return any(tag == "FAIL" for tag, _, _ in self.lines)


def _on(cfg: Config, device: str, **train) -> Config:
    return replace(cfg, train=replace(cfg.train, device=device, summary=False, **train))


def _compare(got: dict, ref: dict, kind: str) -> tuple[bool, str]:
    step1, later, grad_tol = TOL[kind]
    errs = [rel_err(a, b) for a, b in zip(got["losses"], ref["losses"])]
    val = [rel_err(a, b) for a, b in zip(got["val_losses"], ref["val_losses"])]
    grad, where = max_rel_tensor_err(got["grads"], ref["grads"])
    ok = (len(errs) == len(ref["losses"]) and errs[0] <= step1 and max(errs + val) <= later
          and grad <= grad_tol)
    return ok, (f"loss rel errs step 1 {errs[0]:.1e} (<= {step1:g}), max {max(errs + val):.1e} "
                f"(<= {later:g}); step-1 grads {grad:.1e} (<= {grad_tol:g}, worst {where})")


def _single(cfg: Config, device: str) -> dict:
    from ..parallel.mesh import single_mesh
    from ..parallel.parallelize import assemble

    r = run_case(_on(cfg, device), dataset=tiny_dataset(), mesh=single_mesh(device))
    return {**r, "grads": assemble([r["grads"]]), "params": assemble([r["params"]])}


def check_env(say: Report, device: str) -> None:
    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if cuda else "-"
    say("env", None, f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
                     f"{torch.cuda.device_count() if cuda else 0} GPU(s): {names}; checking on {device}")


def check_precision(say: Report, device: str, kind: str) -> None:
    cfg = tiny_config(steps=5)
    if kind == "bf16":
        cfg = replace(cfg, train=replace(cfg.train, precision="bf16"))
    ok, detail = _compare(_single(cfg, device), reference(_on(cfg, "cpu")), kind)
    say(f"{kind} {device} vs cpu", ok, detail)


def check_recompute(say: Report, device: str) -> None:
    base = _single(tiny_config(steps=3), device)
    for mode in ("selective", "full"):
        c = tiny_config(steps=3)
        r = _single(replace(c, parallel=replace(c.parallel, recompute=mode)), device)
        same = r["losses"] == base["losses"] and all(r["params"][k].equal(v) for k, v in base["params"].items())
        say(f"recompute={mode} {device}", same, "bitwise the run without recomputation" if same
            else f"losses {r['losses']} vs {base['losses']}")


def check_compile(say: Report, device: str) -> None:
    cfg = tiny_config(steps=4, n_layers=2)
    eager = _single(cfg, device)
    t0 = time.perf_counter()
    compiled = _single(replace(cfg, train=replace(cfg.train, compile=True)), device)
    ok, detail = _compare(compiled, eager, "fp32")
    say(f"compile {device}", ok, f"{detail}; {time.perf_counter() - t0:.0f} s with compilation")


def check_checkpoint(say: Report, device: str) -> None:
    from .. import checkpoint
    from ..engine.train import Trainer
    from ..parallel.mesh import single_mesh
    from ..parallel.parallelize import assemble, local_state

    with tempfile.TemporaryDirectory() as tmp:
        cfg = _on(tiny_config(steps=2), device)
        t = Trainer(cfg, single_mesh(device), tiny_dataset())
        t.train_step()
        t.train_step()
        folder = checkpoint.save(t, tmp)
        saved = assemble([local_state(t.pm)])
        cpu = Trainer(replace(_on(cfg, "cpu"), checkpoint=replace(cfg.checkpoint, load=str(folder))),
                      single_mesh("cpu"), tiny_dataset())
        loaded = assemble([local_state(cpu.pm)])
        same = all(loaded[k].equal(v) for k, v in saved.items()) and cpu.step == 2
        say(f"checkpoint {device} -> cpu", same, f"{len(saved)} tensors, step {cpu.step}"
            + ("" if same else ": values differ"))


def _preset_for(device: str):
    from ..planner.cluster import PRESETS

    name = torch.cuda.get_device_name(0).lower() if device == "cuda" else "cpu"
    for key, preset in (("h200", "h200"), ("h100", "h100-80g"), ("a100", "a100-80g")):
        if key in name:
            return PRESETS[preset]
    return PRESETS["cpu"] if device == "cpu" else None


def check_throughput(say: Report, device: str, quick: bool) -> None:
    from ..engine.train import Trainer
    from ..parallel.mesh import single_mesh
    from ..planner.costs import Plan, memory, step_flops

    cfg = tiny_config(steps=8)
    if not quick:  # ~1B parameters: 16 layers of d 2048 (GQA 16/4 heads), vocab 32000
        cfg = replace(cfg, model=replace(cfg.model, n_layers=16, d_model=2048, n_heads=16, n_kv_heads=4,
                                         d_ff=5632, vocab_size=32000, seq_len=2048),
                      train=replace(cfg.train, global_batch=8, eval_every=0))
    cfg = replace(cfg, parallel=replace(cfg.parallel, microbatches=1),
                  train=replace(cfg.train, eval_every=0, precision="bf16" if device == "cuda" else "fp32"))
    ds = tiny_dataset(n_tokens=max(50_000, 4 * cfg.train.global_batch * (cfg.model.seq_len + 1)))
    t = Trainer(_on(cfg, device), single_mesh(device), ds)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [t.train_step()["step_time_s"] for _ in range(cfg.train.steps)][2:]  # 2 warm-up steps
    step = statistics.median(times)
    m = cfg.model
    tokens = cfg.train.global_batch * m.seq_len
    params = sum(p.numel() for p in t.pm.module.parameters())
    line = f"{params / 1e6:.0f}M parameters, {cfg.train.precision}: {tokens / step:,.0f} tokens/s"
    preset = _preset_for(device)
    if preset is not None and device == "cuda":
        line += f", MFU {step_flops(m, cfg.train.global_batch) / step / preset.peak_flops:.1%} of {preset.name}"
    say(f"throughput {device}", None, line)
    if device == "cuda" and preset is not None:
        plan = Plan(1, 1, 1, 1, cfg.train.global_batch)
        want = memory(m, plan, replace(preset, dtype_bytes=2))["total"]
        got = torch.cuda.max_memory_allocated()
        say(f"peak memory {device}", abs(got - want) <= 0.15 * want,
            f"allocator peak {got / 2**30:.2f} GiB, planner {want / 2**30:.2f} GiB "
            f"({(got - want) / want:+.1%})")


def _dist_worker(cases: list[tuple[str, Config]]) -> dict:
    from ..engine.launch import setup, teardown

    out = {}
    mesh = None
    try:
        for name, cfg in cases:
            mesh = setup(cfg)
            out[name] = run_case(cfg, dataset=tiny_dataset(), mesh=mesh)
    finally:
        teardown(mesh)
    return out


def dist_cases(n: int, device: str) -> list[tuple[str, Config]]:
    """Layouts of n ranks: pure dp, dp x tp (x pp), ZeRO-1 with tied embeddings, and cp."""
    lay = {2: [(2, 1, 1, 1), (1, 1, 1, 2)], 4: [(2, 2, 1, 1), (1, 2, 2, 1), (2, 1, 1, 2)],
           8: [(2, 2, 2, 1), (8, 1, 1, 1), (1, 2, 2, 2)]}[n]
    out = []
    for dp, tp, pp, cp in lay:
        c = tiny_config(dp=dp, tp=tp, pp=pp, cp=cp)
        out.append((f"{dp}x{tp}x{pp}" + (f" cp{cp}" if cp > 1 else ""), _on(c, device)))
    dp = n // 2
    c = tiny_config(dp=dp, pp=2, tie_embeddings=True)
    out.append((f"{dp}x1x2 zero1 tied", _on(replace(c, parallel=replace(c.parallel, zero1=True)), device)))
    return out


def check_dist(say: Report, device: str, n: int) -> None:
    from ..engine.launch import spawn
    from ..parallel.parallelize import assemble

    if device == "cuda" and torch.cuda.device_count() < n:
        say(f"dist {n}", None, f"skipped: {torch.cuda.device_count()} GPU(s), NCCL needs one per rank")
        return
    cases = dist_cases(n, device)
    results = spawn(_dist_worker, n, cases)
    for name, cfg in cases:
        parts = [results[r][name] for r in sorted(results)]
        got = {"losses": parts[0]["losses"], "val_losses": parts[0]["val_losses"],
               "grads": assemble([p["grads"] for p in parts])}
        ok, detail = _compare(got, reference(_on(cfg, "cpu")), "fp32")
        say(f"dist {n} {name} ({'nccl' if device == 'cuda' else 'gloo'})", ok, detail)


def check_watchdog(say: Report, device: str) -> None:
    if device == "cuda" and torch.cuda.device_count() < 2:
        say("watchdog", None, "skipped: needs 2 GPUs")
        return
    tiny = ["--model.n_layers=2", "--model.d_model=32", "--model.n_heads=4", "--model.n_kv_heads=2",
            "--model.d_ff=64", "--model.seq_len=32", "--global-batch=8", "--train.eval_every=0",
            "--train.progress=false", "--train.threads_per_rank=1", "--train.summary=false"]
    env = {**os.environ, "HYBRIDPAR_FAULT": "hang:1:3", "MASTER_ADDR": "127.0.0.1"}
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "d.txt")
        with open(data, "w") as fh:
            fh.write("def f(dp, tp, pp):\n    return dp * tp * pp\n" * 400)
        t0 = time.monotonic()
        dumps = os.path.join(tmp, "dumps")
        r = subprocess.run([sys.executable, "-m", "hybridpar", "train", "--dp", "2", "--steps", "50",
                            f"--data.path={data}", f"--train.device={device}",
                            "--reliability.deadline_s=5", f"--reliability.dump_dir={dumps}", *tiny],
                           capture_output=True, text=True, env=env, timeout=240)
        took = time.monotonic() - t0
        traces = sorted(f for f in os.listdir(dumps) if f.startswith("nccl_trace")) if os.path.isdir(dumps) else []
    if device == "cuda":  # the healthy rank dumps NCCL's record of its last collectives
        say("nccl flight recorder", bool(traces), f"dumped: {', '.join(traces) or 'none'}")
    line = next((x for x in r.stderr.splitlines() if x.startswith("hybridpar: watchdog: ")), "")
    ok = r.returncode == 1 and line.startswith("hybridpar: watchdog: rank 1 ")
    say("watchdog", ok, f"exit {r.returncode} after {took:.0f} s: {line or r.stderr.strip()[-300:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridpar.tools.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny model for throughput (the CPU test)")
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8], help="dist checks (2, 4, 8)")
    a = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if a.device == "cuda":  # IEEE fp32 for the parity checks (bf16 is checked on its own)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the references' kernels, as the parity tests run them
    say = Report()
    d = a.device
    try:
        check_env(say, d)
        say.guarded(f"fp32 {d} vs cpu", check_precision, say, d, "fp32")
        say.guarded(f"bf16 {d} vs cpu", check_precision, say, d, "bf16")
        say.guarded(f"recompute {d}", check_recompute, say, d)
        say.guarded(f"checkpoint {d} -> cpu", check_checkpoint, say, d)
        say.guarded(f"compile {d}", check_compile, say, d)
        say.guarded(f"throughput {d}", check_throughput, say, d, a.quick)
        for n in a.ranks:
            say.guarded(f"dist {n}", check_dist, say, d, n)
        say.guarded("watchdog", check_watchdog, say, d)
    finally:
        torch.set_num_threads(threads)
    fails = sum(tag == "FAIL" for tag, _, _ in say.lines)
    print(f"gpu_check: {len(say.lines)} lines, {fails} FAIL", flush=True)
    return 1 if say.failed else 0


if __name__ == "__main__":
    sys.exit(main())
