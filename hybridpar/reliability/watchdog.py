"""Watchdog: no silent hangs, and a failing rank stops the others.

The main thread of every rank marks what it is doing (``activity.mark``: one tuple assignment,
no I/O): "forward mb 3", "pp SEND_F mb 3 -> rank 5", "dp all-reduce bucket 2/4 in grad sync",
"tp all-reduce in forward mb 3", "step all-reduce". Two daemon threads per rank:

- the *heartbeat* publishes that state (step, operation, since when, coordinates) into the job's
  TCPStore every ``period`` seconds and watches a shared abort counter: when another rank timed
  out or raised, this rank dumps its stacks and exits (``EXIT_ABORTED``) within one period;
- the *monitor* fires when this rank's current operation has lasted longer than the deadline: it
  reads every rank's heartbeat, names the rank(s) that stopped participating (no heartbeat, a
  stale heartbeat, or stuck outside any communication) with their (dp, tp, pp) coordinates,
  step, micro-batch and operation, lists where the others wait, writes the report and one
  faulthandler stack dump per rank, and exits (``EXIT_WATCHDOG``).

Every rank thus exits within deadline + period + a few seconds, with or without a launcher to
kill it, whatever Gloo's own timeout.

On a GPU, NCCL collectives return as soon as they are queued: a rank waiting for a hung peer
then blocks in the next host sync (the gradient norm's), outside any marked communication.
So each marked collective also records a CUDA event after it is queued (``DeviceProgress``),
and the heartbeat publishes the oldest one the device has not passed: a rank whose device is
still inside a collective is waiting for its peers, not stuck. When the deadline fires on NCCL,
each rank also dumps NCCL's flight recorder (its last collectives, with their sequence numbers
and states) next to its stack dump. On a CPU the work is done when the call returns: nothing is
recorded, the same code runs.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

from .errors import EXIT_ABORTED, EXIT_WATCHDOG, HybridparError, is_connection_lost


class DeviceProgress:
    """How far an asynchronous device (a GPU) has got through the collectives the host queued:
    ``record`` (main thread) appends an event recorded on the current stream after a marked
    collective was queued; ``pending`` (heartbeat thread) drops the events the device has passed
    and returns (what, wall time queued) of the oldest it has not, or None. Queries never block
    and make no synchronising call. Disabled (a CPU, the default): records nothing."""

    def __init__(self, event_factory=None, keep: int = 4096) -> None:
        import collections
        self.event_factory = event_factory  # () -> an event with record() and query()
        self.queue: collections.deque = collections.deque(maxlen=keep)

    @property
    def enabled(self) -> bool:
        return self.event_factory is not None

    def enable_cuda(self) -> None:
        import torch
        self.event_factory = lambda: torch.cuda.Event(enable_timing=False)
        self.queue.clear()

    def disable(self) -> None:
        self.event_factory = None
        self.queue.clear()

    def record(self, what: str) -> None:
        if self.event_factory is None:
            return
        event = self.event_factory()
        event.record()
        self.queue.append((what, event, time.time()))  # deque appends/pops are atomic

    def pending(self) -> tuple[str, float] | None:
        q = self.queue
        while q:
            what, event, t = q[0]
            if not event.query():
                return what, t
            q.popleft()
        return None


class Activity:
    """What this process's main thread is doing now: ``op = (label, mb, comm, t0, detail, outer)``
    or None when idle. Written by the main thread, read by the watchdog threads; one per
    process, like faulthandler. ``wait_s`` sums the time spent in communication this step;
    ``device`` follows the collectives on an asynchronous device (recorded when one is left)."""

    __slots__ = ("step", "op", "wait_s", "step_t0", "device")

    def __init__(self) -> None:
        self.step, self.op, self.wait_s, self.step_t0 = 0, None, 0.0, time.monotonic()
        self.device = DeviceProgress()

    def mark(self, label: str, mb: int = -1, *, comm: bool = False, detail=None, outer=None) -> None:
        now = time.monotonic()
        op = self.op
        if op is not None and op[2]:
            self.wait_s += now - op[3]
            if self.device.event_factory is not None:  # the collective is queued: follow it
                self.device.record(describe(op))
        self.op = (label, mb, comm, now, detail, outer)

    def enter(self, label: str, detail=None):
        """A collective inside the current operation; pass the result to ``leave``."""
        outer = self.op
        self.mark(label, -1 if outer is None else outer[1], comm=True, detail=detail, outer=outer)
        return outer

    def leave(self, outer) -> None:
        if outer is None:
            self.idle()
        else:
            self.mark(outer[0], outer[1], comm=outer[2], detail=outer[4], outer=outer[5])

    def idle(self) -> None:
        self.mark("idle")
        self.op = None

    def begin_step(self, step: int) -> None:
        self.step, self.wait_s, self.step_t0 = step, 0.0, time.monotonic()

    def busy_s(self) -> float:
        """Seconds of this step so far not spent waiting in communication."""
        return time.monotonic() - self.step_t0 - self.wait_s


activity = Activity()


def describe(op) -> str:
    if op is None:
        return "idle"
    label, mb, _, _, detail, outer = op
    s = label
    if isinstance(detail, list):  # pipeline p2p batch: [(op name, mb, peer rank)]
        s += " " + ", ".join(f"{n} mb {m} {'->' if n.startswith('SEND') else '<-'} rank {peer}"
                             for n, m, peer in detail)
    elif detail is not None:
        s += f" {detail}"
    if outer is not None:
        s += f" in {outer[0]}"
    if mb >= 0 and not isinstance(detail, list):
        s += f" mb {mb}"
    return s


# ---------------------------------------------------------------- diagnosis (pure functions)

@dataclass(frozen=True)
class Verdict:
    suspects: list[tuple[int, str]]      # (rank, why it is not participating)
    waiting: list[tuple[str, list[int]]]  # (where, ranks waiting there)


def _coords(layout, rank: int) -> str:
    return layout.describe_rank(rank)


def diagnose(beats: dict[int, dict | None], *, layout, now: float, deadline_s: float,
             stale_s: float) -> Verdict:
    """Classify ranks from their last heartbeats (``now`` and beat times are wall-clock)."""
    suspects, waiting = [], {}
    for r in range(layout.world_size):
        b = beats.get(r)
        if b is None:
            suspects.append((r, "no heartbeat in the store (never started its watchdog, died at "
                                "start-up, or the store is unreachable)"))
            continue
        age = now - b["since"] if b.get("since") else 0.0
        where = f"step {b['step']}: {b['op']}"
        if b.get("state") == "finished":
            suspects.append((r, f"finished or left training ({where})"))
        elif now - b["t"] > stale_s:
            suspects.append((r, f"heartbeat stopped {now - b['t']:.1f} s ago, last at {where} "
                                f"(process dead, frozen, or holding the GIL)"))
        elif b.get("device_op") and now - b["device_since"] > deadline_s / 2:
            # the host waits on its device, which is inside a collective: waiting for peers
            waiting.setdefault(f"step {b['step']}: {b['device_op']} (device waiting "
                               f"{now - b['device_since']:.1f} s; host at {b['op']})", []).append(r)
        elif not b["comm"] and b["op"] != "idle" and age > deadline_s / 2:
            suspects.append((r, f"stuck for {age:.1f} s outside any communication, at {where}"))
        else:
            waiting.setdefault(f"{where} ({'waiting' if b['comm'] else 'running'} "
                               f"{age:.1f} s)", []).append(r)
    # a heartbeat is published at most every ~0.1 s: with shorter steps, a frozen rank's true
    # position is where its healthy peers wait for it (a collective needs every rank)
    peer_steps = [b["step"] for r, b in beats.items() if b and (b.get("comm") or b.get("device_op"))
                  and r not in {s for s, _ in suspects}]
    if peer_steps:
        at = max(peer_steps)
        suspects = [(r, why + (f"; its peers wait for it at step {at}"
                               if why.startswith("heartbeat stopped") and beats[r]["step"] < at else ""))
                    for r, why in suspects]
    return Verdict(suspects, sorted(waiting.items(), key=lambda kv: kv[1][0]))


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def format_report(v: Verdict, *, layout, me: int, my_op: str, step: int, deadline_s: float,
                  dump_dir: str) -> str:
    """First line: the summary; then one line per suspect and per waiting place."""
    if v.suspects:
        names = "; ".join(f"rank {r} ({_coords(layout, r)})" for r, _ in v.suspects)
        head = f"{names} stopped participating"
    else:
        head = ("no rank is outside communication: the ranks wait in operations that do not "
                "match (a mismatched collective or send/recv); see where each waits")
    lines = [f"hybridpar: watchdog: {head}. Rank {me} ({_coords(layout, me)}) waited more than "
             f"the deadline of {deadline_s:g} s in '{my_op}' at step {step}."]
    lines += [f"  rank {r} ({_coords(layout, r)}): {why}" for r, why in v.suspects]
    lines += [f"  {_ranks(rs)} at {where}" for where, rs in v.waiting]
    lines.append(f"  report and per-rank stack dumps: {dump_dir}")
    return "\n".join(lines)


def find_straggler(busy: list[float], layout, threshold: float, *, floor_s: float = 0.01):
    """The rank whose busy time most exceeds the median of its peers (same pipeline stage: same
    work; all ranks when its stage has one rank), if by more than ``threshold`` times and
    ``floor_s`` seconds; else None. Returns (rank, ratio)."""
    if threshold <= 0 or len(busy) < 2:
        return None
    stage = {}
    for r in range(len(busy)):
        stage.setdefault(layout.coords(r)["pp"], []).append(r)
    best = None
    for r, t in enumerate(busy):
        peers = stage[layout.coords(r)["pp"]]
        med = statistics.median(busy[q] for q in (peers if len(peers) > 1 else range(len(busy))))
        ratio = t / med if med > 0 else float("inf")
        if ratio > threshold and t - med > floor_s and (best is None or ratio > best[1]):
            best = (r, ratio)
    return best


# ---------------------------------------------------------------- the threads

def _store_client(timeout_s: float):
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    store = None
    if addr and port:
        try:
            store = dist.TCPStore(addr, int(port), is_master=False,
                                  timeout=timedelta(seconds=timeout_s))
        except Exception:  # e.g. a launcher whose store is elsewhere: use the default one
            store = None
    if store is None:
        store = dist.distributed_c10d._get_default_store().clone()
        store.set_timeout(timedelta(seconds=timeout_s))
    return store


_HOST = socket.gethostname()
LAUNCH_DIR_ENV = "HYBRIDPAR_LAUNCH_DIR"  # set by our launcher (engine.launch.spawn)
WATCHDOG_MARK = "watchdog-fired"
_generation = [0]  # train() calls in this process: keys of one run never meet the next's


class Watchdog:
    def __init__(self, *, rank: int, layout, deadline_s: float, dump_dir: str, store,
                 prefix: str, period_s: float | None = None, act: Activity = activity):
        self.rank, self.layout, self.deadline_s = rank, layout, deadline_s
        self.dump_dir, self.store, self.prefix, self.act = dump_dir, store, prefix, act
        self.period_s = period_s or min(2.0, max(0.2, deadline_s / 5))
        self.stale_s = max(3 * self.period_s, 2.0)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ending = False  # firing, aborting or failing: the threads stand down
        self._threads = [threading.Thread(target=f, name=f"hybridpar-{n}", daemon=True)
                         for n, f in (("heartbeat", self._beat_loop), ("monitor", self._monitor_loop))]

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def start(self) -> "Watchdog":
        self._publish("running")
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2 * self.period_s)
        self.act.device.disable()
        self._publish("finished")

    # ---- heartbeat
    def _beat(self, state: str) -> dict:
        a, op = self.act, self.act.op
        now, mono = time.time(), time.monotonic()
        device = a.device.pending() if a.device.enabled else None
        return {"rank": self.rank, "host": _HOST, "pid": os.getpid(), "step": a.step, "op": describe(op),
                "comm": bool(op and op[2]), "since": now - (mono - op[3]) if op else None,
                "t": now, "state": state,
                "device_op": device[0] if device else None, "device_since": device[1] if device else None}

    def _publish(self, state: str) -> None:
        try:
            self.store.set(self._key(f"hb/{self.rank}"), json.dumps(self._beat(state)))
        except Exception:
            pass  # the store is gone (job ending); the monitor still guards the deadline

    def _beat_loop(self) -> None:
        """Publish every period, and at once (within ``tick``) when a new step begins, so that
        a rank frozen mid-run (SIGSTOP, a debugger) is reported at its true last step even
        when steps are shorter than the period."""
        tick = min(0.1, self.period_s)
        last_t, last_step = time.monotonic(), self.act.step
        while not self._stop.wait(tick):
            now = time.monotonic()
            if self.act.step == last_step and now - last_t < self.period_s:
                continue
            beat_due = now - last_t >= self.period_s
            last_t, last_step = now, self.act.step
            self._publish("running")
            if not beat_due:
                continue
            try:
                aborted = self.store.add(self._key("abort"), 0) > 0
            except Exception:
                continue
            if aborted:
                self._abort()
                return

    def _abort(self) -> None:
        with self._lock:
            if self._ending:
                return
            self._ending = True
        self._dump_stacks()
        self._wait_for_dumps(until=time.monotonic() + 2 * self.period_s + 2.0)
        os._exit(EXIT_ABORTED)

    # ---- deadline
    def _monitor_loop(self) -> None:
        tick = min(0.5, self.deadline_s / 10)
        while not self._stop.wait(tick):
            op = self.act.op
            if op is not None and time.monotonic() - op[3] > self.deadline_s:
                self._fire(op)
                return

    def read_beats(self) -> dict[int, dict | None]:
        beats = {}
        for r in range(self.layout.world_size):
            key = self._key(f"hb/{r}")
            try:
                beats[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:
                beats[r] = None
        beats[self.rank] = self._beat("running")
        return beats

    def _fire(self, op) -> None:
        with self._lock:
            if self._ending:
                return
            self._ending = True
        grace = 2 * self.period_s + 3.0
        hard = threading.Timer(grace, os._exit, (EXIT_WATCHDOG,))  # whatever the store does
        hard.daemon = True
        hard.start()
        first = self._first_failure()
        frozen_here: dict[int, int] = {}
        if first:  # the others wait too: their report would repeat this one
            beats = self.read_beats()
            verdict = diagnose(beats, layout=self.layout, now=time.time(),
                               deadline_s=self.deadline_s, stale_s=self.stale_s)
            frozen = [r for r, why in verdict.suspects if why.startswith(("heartbeat stopped", "no heartbeat"))]
            frozen_here = _on_this_host(frozen, beats)
            report = format_report(verdict, layout=self.layout, me=self.rank, my_op=describe(op),
                                   step=self.act.step, deadline_s=self.deadline_s,
                                   dump_dir=self.dump_dir)
            if frozen_here:
                report += (f"\n  {_ranks(list(frozen_here))} on this host will be ended with SIGKILL: a "
                           f"frozen process reacts to no other signal")
            self._write("report.txt", report + "\n")
            print(report, file=sys.stderr, flush=True)
            launch_dir = os.environ.get(LAUNCH_DIR_ENV)
            if launch_dir:  # the launcher names the watchdog, whichever rank it sees end first
                with contextlib.suppress(OSError):
                    open(os.path.join(launch_dir, WATCHDOG_MARK), "w").close()
            try:  # a frozen or dead rank writes no stack dump: nobody waits for it
                self.store.set(self._key("expect_dumps"), str(self.layout.world_size - len(frozen)))
            except Exception:
                pass
        self._signal_abort()
        self._dump_flight_recorder()
        self._dump_stacks()
        self._wait_for_dumps(until=time.monotonic() + grace - 1.0)
        for pid in frozen_here.values():  # last, so the launcher sees our exit code with theirs
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        os._exit(EXIT_WATCHDOG)

    # ---- failures of the main thread
    def on_exception(self, e: BaseException) -> None:
        """Called on the failing rank before the exception propagates: the first failing rank
        prints its traceback (or a one-line message), then tells the others to stop."""
        if isinstance(e, HybridparError) and e.collective:
            return  # every rank raises it; whoever reports the job failure prints it once
        with self._lock:
            already, self._ending = self._ending, True
        if already:  # this rank's watchdog fired or aborted: the exception is a consequence
            _tag(e, "other")
            return
        lost = is_connection_lost(str(e))  # a consequence: a peer died without a word
        if lost:  # let the launcher see the peer's own failure before this consequence
            time.sleep(min(1.0, self.period_s))
        if lost and self._aborted():  # ... or was stopped after the failure already reported
            _tag(e, "other")
            self._signal_abort()
            return
        first = not lost and self._first_failure()
        where = (f"rank {self.rank} ({_coords(self.layout, self.rank)}) at step {self.act.step} "
                 f"in '{describe(self.act.op)}'")
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            msg = f"hybridpar: {where}: {type(e).__name__}"
        elif lost:
            msg = (f"hybridpar: {where} lost its connection to a peer, which probably died "
                   f"(killed, out of memory, or a native crash): {str(e).splitlines()[0][:200]}")
        elif not first:
            msg = f"hybridpar: {where} stopped after another rank failed ({type(e).__name__})"
        elif isinstance(e, HybridparError):
            msg = f"hybridpar: {where}: {e}"
        else:
            msg = f"hybridpar: {where} failed:\n" + "".join(traceback.format_exception(e)).rstrip()
        print(msg, file=sys.stderr, flush=True)
        _tag(e, "first" if first else "other")  # so the CLI does not print it again
        self._signal_abort()

    def _dump_flight_recorder(self) -> None:
        """NCCL's record of this rank's last collectives (``TORCH_NCCL_TRACE_BUFFER_SIZE``, set
        by ``launch.setup``), pickled next to the stack dumps: which collective, of which group
        and sequence number, each rank reached. Only where the device is asynchronous (NCCL)."""
        if not self.act.device.enabled:
            return
        try:
            import torch
            data = torch._C._distributed_c10d._dump_nccl_trace()
        except Exception as e:  # no NCCL build, or a recorder that is off: say so in the dump dir
            self._write(f"nccl_trace_rank{self.rank}.txt", f"no NCCL flight recorder: {e}\n")
            return
        with contextlib.suppress(OSError):
            os.makedirs(self.dump_dir, exist_ok=True)
            with open(os.path.join(self.dump_dir, f"nccl_trace_rank{self.rank}.pkl"), "wb") as fh:
                fh.write(data)

    def _first_failure(self) -> bool:
        """True on the first rank of the job to time out or raise (it reports; others are brief)."""
        try:
            return self.store.add(self._key("failed"), 1) == 1
        except Exception:
            return True  # no store: we cannot know, so say everything

    def _aborted(self) -> bool:
        try:
            return self.store.add(self._key("abort"), 0) > 0
        except Exception:
            return False

    def _signal_abort(self) -> None:
        try:
            self.store.add(self._key("abort"), 1)
        except Exception:
            pass

    # ---- files
    def _write(self, name: str, text: str) -> None:
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            with open(os.path.join(self.dump_dir, name), "w") as fh:
                fh.write(text)
        except OSError:
            pass

    def _dump_stacks(self) -> None:
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            with open(os.path.join(self.dump_dir, f"stacks-rank{self.rank}.txt"), "w") as fh:
                fh.write(f"rank {self.rank} ({_coords(self.layout, self.rank)}) step "
                         f"{self.act.step}: {describe(self.act.op)}\n")
                fh.flush()
                faulthandler.dump_traceback(file=fh, all_threads=True)
        except OSError:
            pass
        try:
            self.store.add(self._key("dumped"), 1)
        except Exception:
            pass

    def _wait_for_dumps(self, *, until: float) -> None:
        """Until every rank has dumped its stacks (bounded). Rank 0 then lingers a moment:
        without an elastic agent it hosts the store, and the others' last reads need it."""
        while time.monotonic() < until:
            try:
                key = self._key("expect_dumps")
                expect = int(self.store.get(key)) if self.store.check([key]) else self.layout.world_size
                if self.store.add(self._key("dumped"), 0) >= expect:
                    break
            except Exception:
                return
            time.sleep(0.1)
        if self.rank == 0:
            time.sleep(min(0.5, max(0.0, until - time.monotonic())))


def _on_this_host(ranks: list[int], beats: dict) -> dict[int, int]:
    """{rank: pid} of those ``ranks`` whose last heartbeat came from this host: a process whose
    heartbeat stopped while it lives on (SIGSTOPped, in a debugger, stuck holding the GIL) reacts
    to no signal but SIGKILL, so a launcher would wait its whole shutdown timeout (torch's: 30 s)."""
    out = {}
    for r in ranks:
        b = beats.get(r) or {}
        if b.get("host") == _HOST and b.get("pid") and b["pid"] != os.getpid():
            out[r] = b["pid"]
    return out


def _tag(e: BaseException, how: str) -> None:
    try:
        e.hybridpar_reported = how
    except AttributeError:
        pass


def default_dump_dir() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return os.path.join(tempfile.gettempdir(), "hybridpar-dumps",
                        f"{run}-{os.environ.get('MASTER_PORT', '0')}")


def start(cfg, mesh) -> Watchdog | None:
    """Start the watchdog of this rank for one ``train()``; None when not distributed or
    ``reliability.deadline_s`` is 0. Collective in the sense that every rank calls it."""
    import torch.distributed as dist

    rel = cfg.reliability
    if rel.deadline_s <= 0 or mesh.layout.world_size == 1 or not dist.is_initialized():
        return None
    _generation[0] += 1
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    prefix = (f"hybridpar/watchdog/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
              f"{_generation[0]}")
    store = _store_client(timeout_s=min(10.0, rel.deadline_s))
    if mesh.device.type == "cuda":  # NCCL queues collectives: follow them on the device
        activity.device.enable_cuda()
    else:
        activity.device.disable()
    dist.barrier()  # ranks finish building at different times: that wait is not a hang
    return Watchdog(rank=mesh.rank, layout=mesh.layout, deadline_s=rel.deadline_s,
                    dump_dir=rel.dump_dir or default_dump_dir(), store=store,
                    prefix=prefix).start()
