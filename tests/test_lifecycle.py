"""A run's life as the user and the scheduler see it, through the real command line: what it
says at start and at the end, preemption (SIGTERM), Ctrl-C, a second job on the same checkpoint
folder, a frozen rank, and a full disk. Each case asserts the exact line, the exit code, that
the checkpoints the user had are intact, and that no process is left behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY = ["--model.n_layers=2", "--model.d_model=32", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.d_ff=64", "--model.seq_len=32", "--global-batch=8", "--train.threads_per_rank=1",
        "--train.eval_every=0", "--train.progress=false"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "data.txt"
    path.write_text("".join(f"def f{i}(dp, tp, pp):\n    return dp * tp * pp + {i * 7 % 13}\n"
                            for i in range(400)))
    return path


def _start(args, tmp_path, name="job"):
    """A ``hybridpar train`` in its own process group (as a scheduler runs a job)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
    out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")
    return subprocess.Popen([sys.executable, "-m", "hybridpar", "train", *args, *TINY],
                            stdout=out, stderr=err, env=env, start_new_session=True, text=True)


def _wait_steps(metrics: Path, n: int, proc, timeout=120.0) -> int:
    """Until ``metrics`` holds ``n`` steps; returns the last step seen."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"the job ended early with {proc.returncode}"
        if metrics.is_file():
            rows = metrics.read_text().splitlines()
            if len(rows) >= n:
                return json.loads(rows[-1])["step"]
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout} s")


def _finish(proc, timeout=60.0) -> tuple[int, float]:
    t0 = time.monotonic()
    rc = proc.wait(timeout=timeout)
    return rc, time.monotonic() - t0


def _text(tmp_path, name="job"):
    return (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()


def _no_processes_left(proc):
    """Nothing of the job's process group survives it (a zombie is gone in a moment)."""
    end = time.monotonic() + 5
    while time.monotonic() < end:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    left = subprocess.run(["ps", "-o", "pid,stat,cmd", "-g", str(proc.pid)], capture_output=True, text=True)
    raise AssertionError(f"processes left behind:\n{left.stdout}")


def _children(pid: int) -> list[int]:
    """Live children of ``pid``, read from /proc (``ps`` cuts its command column to $COLUMNS)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while we looked
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _ranks(job) -> list[int]:
    """The job's ranks: the children of the fork server the launcher started."""
    servers = [pid for pid in _children(job.pid) if b"multiprocessing.forkserver" in _cmdline(pid)]
    return [rank for server in servers for rank in _children(server)]


def _valid_latest(ck: Path) -> str:
    from hybridpar.checkpoint import store

    name = (ck / "latest").read_text().strip()
    assert store.verify(ck / name) is None
    assert not list(ck.glob("*.tmp-*")), list(ck.iterdir())
    return name


def test_summary_preemption_and_one_job_per_folder(data, tmp_path):
    """A second job on a folder in use is refused at start-up, naming the holder; SIGTERM to
    every process of the first job (a scheduler's preemption) saves once and exits 0; --resume
    says what it loaded."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = ["--dp", "2", "--steps", "100000", f"--data.path={data}", f"--checkpoint.dir={ck}",
            "--checkpoint.every=0", "--metrics", str(metrics)]
    job = _start(args, tmp_path)
    try:
        _wait_steps(metrics, 3, job)
        second = subprocess.run([sys.executable, "-m", "hybridpar", "train", *args[:-2], *TINY],
                                capture_output=True, text=True, timeout=120,
                                env={**os.environ, "MASTER_ADDR": "127.0.0.1"})
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().splitlines()[-1].startswith(
            f"hybridpar: error: checkpoint.dir={ck} is in use by another run (host "), second.stderr
        assert f"pid " in second.stderr and "wait for it to end, or choose another folder" in second.stderr
        assert "Traceback" not in second.stderr
        os.killpg(job.pid, signal.SIGTERM)
        rc, took = _finish(job)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out, err = _text(tmp_path)
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err, err
    saved = _valid_latest(ck)
    step = int(saved.split("_")[1])
    assert out.strip().splitlines()[-1] == (f"stopped by SIGTERM after step {step} loss "
                                            f"{json.loads(metrics.read_text().splitlines()[-1])['loss']:.4f}; "
                                            f"saved {ck / saved}; continue with --resume")
    assert out.startswith("hybridpar: model llama: 35.0k parameters; 2 ranks: dp=2 tp=1 pp=1 "
                          "(rank order tp-dp-pp), 1 micro-batch\nhybridpar: data "), out
    assert "256 tokens per step (8 x 32)" in out and f"checkpoints in {ck}" in out
    assert took < 30, f"{took:.1f} s from SIGTERM to exit"
    _no_processes_left(job)
    # the folder is free again; --resume names what it loaded
    r = subprocess.run([sys.executable, "-m", "hybridpar", "train", "--dp", "2", "--steps", str(step + 2),
                        f"--data.path={data}", f"--checkpoint.dir={ck}", "--resume", *TINY],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MASTER_ADDR": "127.0.0.1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"hybridpar: resumed from {ck / saved} at step {step}; training to step {step + 2}" in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith(f"done: step {step + 2} loss "), r.stdout
    assert r.stdout.strip().endswith(f"; saved {ck / f'step_{step + 2:06d}'}"), r.stdout
    assert not (ck / ".lock").exists()  # released and removed at the end


def test_ctrl_c_is_one_line_and_exit_130(data, tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    job = _start(["--dp", "2", "--steps", "100000", f"--data.path={data}", f"--checkpoint.dir={ck}",
                  "--checkpoint.every=2", "--checkpoint.keep=2", "--metrics", str(metrics)], tmp_path)
    try:
        _wait_steps(metrics, 5, job)
        os.killpg(job.pid, signal.SIGINT)  # what a terminal sends to the foreground job
        rc, took = _finish(job)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    _, err = _text(tmp_path)
    assert rc == 130, err[-3000:]
    saved = _valid_latest(ck)
    assert err.strip().splitlines()[-1] == (f"hybridpar: error: interrupted (Ctrl-C); the last checkpoint, "
                                            f"{ck / saved}, is intact; continue with --resume"), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert took < 15, f"{took:.1f} s from Ctrl-C to exit"
    _no_processes_left(job)


def test_sigterm_without_a_checkpoint_folder_says_nothing_was_saved(data, tmp_path):
    metrics = tmp_path / "m.jsonl"
    job = _start(["--dp", "1", "--steps", "100000", f"--data.path={data}", "--metrics", str(metrics)],
                 tmp_path)
    try:
        _wait_steps(metrics, 3, job)
        os.killpg(job.pid, signal.SIGTERM)
        rc, _ = _finish(job)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out, err = _text(tmp_path)
    assert rc == 143, err[-3000:]
    assert out.strip().splitlines()[-1].endswith(
        "nothing was saved (set checkpoint.dir to save on preemption)"), out
    assert out.strip().splitlines()[-1].startswith("stopped by SIGTERM after step "), out


def test_frozen_rank_is_named_at_its_position_and_the_job_ends_promptly(data, tmp_path):
    """SIGSTOP one rank mid-run: the report names it with the step its peers wait for it at,
    and every process is gone within deadline + 10 s (a stopped process reacts to SIGKILL only)."""
    metrics, deadline = tmp_path / "m.jsonl", 10
    job = _start(["--dp", "2", "--steps", "100000", f"--data.path={data}", "--metrics", str(metrics),
                  f"--reliability.deadline_s={deadline}"], tmp_path)
    try:
        _wait_steps(metrics, 5, job)
        # heartbeats are sampled by a thread (at each new step, else every 2 s): on a loaded
        # machine it may not have run yet in the few ms these tiny steps take; give it a period
        time.sleep(3)
        ranks = _ranks(job)
        assert len(ranks) == 2, ranks
        victim = sorted(ranks)[1]
        os.kill(victim, signal.SIGSTOP)
        frozen_at = time.monotonic()
        rc, _ = _finish(job, timeout=deadline + 60)
        took = time.monotonic() - frozen_at
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    _, err = _text(tmp_path)
    assert rc == 1, err[-3000:]
    lines = err.strip().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("hybridpar: watchdog: "))
    assert lines[head].startswith("hybridpar: watchdog: rank 1 (dp=1, tp=0, pp=0) stopped participating."), err
    waits_at = int(lines[head].rsplit(" at step ", 1)[1].rstrip("."))
    suspect = lines[head + 1]
    assert suspect.startswith("  rank 1 (dp=1, tp=0, pp=0): heartbeat stopped "), err
    last = int(suspect.split(", last at step ")[1].split(":")[0])
    assert 0 < last <= waits_at, suspect  # never "step 0: idle" for a rank frozen mid-run
    if last < waits_at:
        assert suspect.endswith(f"; its peers wait for it at step {waits_at}"), suspect
    assert "rank 1 on this host will be ended with SIGKILL" in err
    assert lines[-1] == ("hybridpar: error: the watchdog stopped the job; its report above names "
                         "the rank(s) that stopped participating"), err
    assert took < deadline + 10, f"{took:.1f} s from the freeze to the end of the job"
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)
    _no_processes_left(job)


# ---- a full disk: a small tmpfs (needs mount rights, as root in a container has)

@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_is_one_line_and_the_last_checkpoint_stays(data, tmp_path, small_disk):
    """Checkpoints of ~0.9 MiB every step on a 3 MiB disk: the save that does not fit is refused
    before it writes anything, in one line naming the sizes and the intact checkpoint."""
    ck = small_disk / "ck"
    r = subprocess.run([sys.executable, "-m", "hybridpar", "train", "--dp", "2", "--steps", "20",
                        f"--data.path={data}", f"--checkpoint.dir={ck}", "--checkpoint.every=1",
                        *TINY], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 1, r.stderr[-3000:]
    saved = _valid_latest(ck)
    step = int(saved.split("_")[1])
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"hybridpar: error: no space left on device to save step {step + 1} in {ck} "
                           f"(needs ~"), r.stderr
    assert line.endswith(f"MiB free); the previous checkpoint {saved} is intact"), line
    assert r.stderr.count("\n") <= 2 and "Traceback" not in r.stderr, r.stderr


def test_disk_full_during_the_write_removes_the_partial_save(tmp_path, small_disk, monkeypatch):
    """The disk fills while the shards are written (the free-space check passed): the partial
    folder is removed, ``latest`` still names the previous checkpoint, one line says so."""
    from dataclasses import replace

    import torch

    from hybridpar import checkpoint
    from hybridpar.checkpoint import store
    from hybridpar.engine.train import Trainer
    from hybridpar.parallel.mesh import single_mesh
    from hybridpar.testing import tiny_config, tiny_dataset

    torch.set_num_threads(1)
    ck = small_disk / "ck"
    cfg = tiny_config(steps=3, microbatches=1, n_layers=2)
    t = Trainer(replace(cfg, checkpoint=replace(cfg.checkpoint, dir=str(ck))), single_mesh(), tiny_dataset())
    t.train_step()
    checkpoint.save(t, ck)
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * (free - 200_000))  # room for the manifest, not for the shards
    monkeypatch.setattr(store, "space_problem", lambda *a: None)  # as if the disk filled later
    t.train_step()
    with pytest.raises(store.SaveFailed) as e:
        checkpoint.save(t, ck)
    assert str(e.value).startswith(f"no space left on device while saving step 2 in {ck} (needs ~")
    assert str(e.value).endswith("the previous checkpoint step_000001 is intact")
    assert _valid_latest(ck) == "step_000001"
