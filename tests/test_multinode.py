"""A 2-node job on two network hosts made on this machine: two network namespaces joined by a
veth pair (10.231.7.1 <-> 10.231.7.2, addresses that exist only inside these namespaces), one
``torchrun`` per host with 2 ranks each and c10d rendezvous on host A, dp=2 x tp=2 with the
default rank order tp-dp-pp (torchrun gives each node consecutive ranks, so both tp groups stay
inside a host and only dp gradient all-reduces cross the veth). The losses must equal the
single-process run, and the veth counters show what crossed between the hosts.

Skips with the reason where network namespaces cannot be made (no ``ip``, not root, no
CAP_SYS_ADMIN); always deletes the namespaces (and with them the veth pair).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

TAG = f"hp{os.getpid() % 100000}"
HOSTS = {"a": ("10.231.7.1", f"{TAG}a", f"{TAG}va"), "b": ("10.231.7.2", f"{TAG}b", f"{TAG}vb")}
PORT = 29531
STEPS = 4
MODEL = ["--model.n_layers=2", "--model.d_model=32", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.d_ff=64", "--model.seq_len=64"]
TRAIN = ["--global-batch=8", "--microbatches=2", f"--steps={STEPS}", "--train.threads_per_rank=1",
         "--train.eval_every=0", "--train.progress=false", "--train.lr=3e-3", "--train.warmup_steps=1"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _why_not() -> str | None:
    """None where namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{TAG}probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add is not permitted here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _delete_hosts() -> None:
    for _, ns, _ in HOSTS.values():
        _ip("netns", "del", ns, check=False)  # removes the veth end inside it, and so the pair


@pytest.fixture(scope="module")
def two_hosts():
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    try:
        for _, ns, _ in HOSTS.values():
            _ip("netns", "add", ns)
        (addr_a, ns_a, dev_a), (addr_b, ns_b, dev_b) = HOSTS["a"], HOSTS["b"]
        _ip("link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        for addr, ns, dev in HOSTS.values():
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield HOSTS
    finally:
        _delete_hosts()


def _tx_bytes(ns: str, dev: str) -> int:
    stats = json.loads(_ip("-n", ns, "-s", "-j", "link", "show", "dev", dev).stdout)
    return int(stats[0]["stats64"]["tx"]["bytes"])


def _launch(hosts, data: str, metrics: str, tmp_path) -> None:
    """Both hosts' torchrun at once; each host's ranks talk over its own veth (GLOO_SOCKET_IFNAME)."""
    addr_a = hosts["a"][0]
    procs = {}
    for name, (addr, ns, dev) in hosts.items():
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{addr_a}:{PORT}", "--rdzv-id", TAG,
               "--rdzv-conf", f"is_host={int(name == 'a')}", "--local-addr", addr,
               "-m", "hybridpar", "train", "--dp", "2", "--tp", "2", *MODEL, *TRAIN,
               f"--data.path={data}", "--metrics", metrics]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "PYTHONUNBUFFERED": "1"}
        log = open(tmp_path / f"host-{name}.log", "w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True), log)
    try:
        for name, (p, _) in procs.items():
            p.wait(timeout=150)
    finally:
        for p, log in procs.values():
            if p.poll() is None:  # end only what this test started: its own process groups
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    for name, (p, _) in procs.items():
        text = (tmp_path / f"host-{name}.log").read_text()
        assert p.returncode == 0, f"host {name} failed:\n{text[-4000:]}"


def test_two_hosts_dp2_tp2_equal_single_process(two_hosts, tmp_path):
    import hybridpar
    from hybridpar.cli.main import parse_train_args

    data = tmp_path / "corpus.txt"
    data.write_text("".join(f"def f{i}(dp, tp, pp):\n    return dp * tp * pp + {i}\n" for i in range(400)))
    metrics = tmp_path / "m.jsonl"
    before = {n: _tx_bytes(ns, dev) for n, (_, ns, dev) in two_hosts.items()}
    _launch(two_hosts, str(data), str(metrics), tmp_path)
    sent = {n: _tx_bytes(ns, dev) - before[n] for n, (_, ns, dev) in two_hosts.items()}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["layout"]["dp"] for r in rows] == [2] * STEPS and rows[0]["layout"]["tp"] == 2

    # the same run in this process: dp = tp = 1
    cfg = parse_train_args([*MODEL, *TRAIN, f"--data.path={data}", "--metrics", str(tmp_path / "one.jsonl")])
    hybridpar.train(replace(cfg, parallel=replace(cfg.parallel, dp=1, tp=1)))
    ref = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    got_l, ref_l = [r["loss"] for r in rows], [r["loss"] for r in ref]
    print(f"two hosts: {got_l}\none process: {ref_l}\nveth tx bytes: {sent}")
    # tolerances as in tests/test_parity.py: step 1 only reorders sums (1e-5), later steps
    # pass through AdamW (1e-4)
    assert abs(got_l[0] - ref_l[0]) / ref_l[0] <= 1e-5
    assert all(abs(a - b) / b <= 1e-4 for a, b in zip(got_l, ref_l))

    # what crossed the veth. At least the dp all-reduce of each host's gradients every step: a host
    # must receive the other's sum over its 2 tp shards, i.e. one full gradient (float32). At
    # most a few times that: with tp inside the hosts nothing else big crosses (measured 1.07x:
    # TCP headers, rendezvous), while a tp group split across hosts would add the activation
    # all-reduces (measured 5.3x for this model with --parallel.order=dp-tp-pp).
    from hybridpar.models.transformer import count_params

    grad_bytes = STEPS * 4 * count_params(cfg.model)
    for host, n in sent.items():
        assert grad_bytes <= n < 2.5 * grad_bytes, (host, n, grad_bytes)
