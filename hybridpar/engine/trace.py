"""Tracing: what every rank does in time, as a Chrome trace (Perfetto) and a PNG timeline.

Installed from outside the engine (``Tracer.install(trainer)``): the pipeline runner's
``on_action`` hook gives each forward/backward of a micro-batch and each batch of pipeline
sends/receives; the trainer's ``GradSync`` launches and waits give the dp all-reduce of each
gradient bucket (in flight on a second lane, blocking time on the main lane); the optimizer's
step hooks bracket the update, and the time between the gradient finalisation and the update is
the gradient norm, the step's scalar all-reduce and clipping. Gaps on the main lane are idle.

Clocks: ``time.perf_counter`` of each process, shifted so that 0 is the end of a barrier at
install time (exact on one machine, where the clock is shared; within the barrier's skew across
machines).

Bubble: for one step and one pipeline (the ranks of one dp x cp replica), the window runs from
its first pipeline action to its last; ``bubble = 1 - sum of forward/backward time over its
ranks / (ranks * window)``, the simulator's definition (``pipeline.simulate.SimResult.
bubble_fraction``), averaged over the replicas (two replicas out of step with each other are not
a bubble). Equal stages and free communication give ``(p-1)/(m+p-1)`` for GPipe and 1F1B alike.

Replay: the simulator run on the step's own measured durations, every forward and backward and
every message (the end of its batch minus the later of the batch's post and the partner's post,
both read on the shared clock). What the replay does not reproduce is what the simulator does
not model; on a shared machine the per-action times vary by tens of percent with what the other
ranks run, so a replay with mean stage times is also given, and it differs by that noise.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from ..parallel.mesh import Layout
from ..parallel.pipeline.schedules import Action, Op

MAIN, ASYNC = 0, 1  # lanes (Chrome "threads") of a rank
COLORS = {"forward": "#4C72B0", "backward": "#55A868", "p2p": "#B0B0B0", "dp_wait": "#C44E52",
          "dp_inflight": "#F2B8BA", "norm_allreduce": "#DD8452", "optimizer": "#8172B3",
          "eval": "#CCB974", "idle": "#FFFFFF"}


@dataclass
class Event:
    name: str
    cat: str  # a key of COLORS
    t0: float
    t1: float
    rank: int
    step: int
    lane: int = MAIN
    args: dict = field(default_factory=dict)


class Tracer:
    """Records one rank's events; ``gather`` merges every rank's on rank 0."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.events: list[Event] = []
        self.step = 0
        self.phase = "train"
        self.origin = 0.0
        self._t_grads_done: float | None = None
        self._runner = None

    @property
    def sends(self) -> str | None:
        """How the traced run's pipeline sends completed (``simulate``'s ``sends``)."""
        return getattr(self._runner, "sends", None)

    def sync_clock(self) -> None:
        if dist.is_initialized():
            dist.barrier()
        self.origin = time.perf_counter()

    def add(self, name: str, cat: str, t0: float, t1: float, lane: int = MAIN, **args) -> None:
        self.events.append(Event(name, cat, t0 - self.origin, t1 - self.origin, self.rank,
                                 self.step, lane, args))

    def on_action(self, action, t0: float, t1: float) -> None:
        """``PipelineRunner.on_action``: one call per action; a comm batch shares (t0, t1)."""
        if self.phase == "eval":
            if action.op in (Op.FWD, Op.BWD):
                self.add(f"eval {action}", "eval", t0, t1, mb=action.mb, chunk=action.chunk)
            return
        if action.op is Op.FWD or action.op is Op.BWD:
            cat = "forward" if action.op is Op.FWD else "backward"
            self.add(str(action), cat, t0, t1, mb=action.mb, chunk=action.chunk)
            return
        last = self.events[-1] if self.events else None
        if last is not None and last.cat == "p2p" and last.t0 == t0 - self.origin and last.step == self.step:
            last.name += f" {action}"
            last.args["actions"].append(str(action))
        else:
            self.add(str(action), "p2p", t0, t1, actions=[str(action)])

    # -- installation on a Trainer, from outside -------------------------------------------
    def install(self, trainer) -> "Tracer":
        trainer.runner.on_action = self.on_action
        self._runner = trainer.runner
        self._wrap_grad_sync(trainer.pm.grad_sync)
        self._wrap_step(trainer)
        self.sync_clock()
        return self

    def _wrap_grad_sync(self, sync) -> None:
        tracer, launch, finish = self, sync._launch, sync.finish

        class _Timed:  # wraps a Work: the wait is timed on the main lane
            def __init__(self, work, i, t_launch):
                self.work, self.i, self.t_launch = work, i, t_launch

            def wait(self):
                t0 = time.perf_counter()
                out = self.work.wait()
                t1 = time.perf_counter()
                tracer.add(f"dp wait b{self.i}", "dp_wait", t0, t1, bucket=self.i)
                tracer.add(f"dp all-reduce b{self.i}", "dp_inflight", self.t_launch, t1, lane=ASYNC,
                           bucket=self.i, bytes=sync.buckets[self.i].comm.numel()
                           * sync.buckets[self.i].comm.element_size())
                return out

        def timed_launch(b):
            t = time.perf_counter()
            launch(b)
            i = next(i for i, x in enumerate(sync.buckets) if x is b)  # Bucket == compares tensors
            b.handle = _Timed(b.handle, i, t)

        def timed_finish():
            finish()
            tracer._t_grads_done = time.perf_counter()

        sync._launch, sync.finish = timed_launch, timed_finish

    def _wrap_step(self, trainer) -> None:
        tracer, train_step, evaluate = self, trainer.train_step, trainer.evaluate
        state = {}

        def pre(opt, args, kwargs):
            state["opt0"] = time.perf_counter()
            g = tracer._t_grads_done
            if g is not None:
                tracer.add("grad norm + step all-reduce (waits for the slowest rank) + clip",
                           "norm_allreduce", g, state["opt0"])

        def post(opt, args, kwargs):
            tracer.add("optimizer", "optimizer", state["opt0"], time.perf_counter())

        trainer.opt.register_step_pre_hook(pre)
        trainer.opt.register_step_post_hook(post)

        def step(*a, **kw):
            tracer.step, tracer.phase, tracer._t_grads_done = trainer.step, "train", None
            return train_step(*a, **kw)

        def ev(*a, **kw):
            tracer.phase = "eval"
            try:
                return evaluate(*a, **kw)
            finally:
                tracer.phase = "train"

        trainer.train_step, trainer.evaluate = step, ev

    def gather(self) -> list[Event] | None:
        """Every rank's events on rank 0 (None elsewhere). Collective."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return list(self.events)
        out = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(self.events, out, dst=0)
        return [e for evs in out for e in evs] if out is not None else None


# -- analysis ------------------------------------------------------------------------------
def bubble(events: list[Event], step: int, ranks=None) -> dict:
    """Measured bubble of one step over ``ranks`` (default: every rank that ran pipeline
    actions), in one window from their first pipeline action to their last."""
    pipe = [e for e in events if e.step == step and e.cat in ("forward", "backward", "p2p")
            and (ranks is None or e.rank in ranks)]
    if not pipe:
        return {}
    ranks = sorted({e.rank for e in pipe})
    t0, t1 = min(e.t0 for e in pipe), max(e.t1 for e in pipe)
    busy = {r: sum(e.t1 - e.t0 for e in pipe if e.rank == r and e.cat != "p2p") for r in ranks}
    window = t1 - t0
    return {"step": step, "window_s": window, "bubble": 1 - sum(busy.values()) / (len(ranks) * window),
            "per_rank": {r: 1 - b / window for r, b in busy.items()}}


def theory(pp: int, m: int, v: int = 1) -> float:
    """(p-1)/(v*m+p-1): equal stages, free communication (v > 1: interleaved)."""
    return (pp - 1) / (v * m + pp - 1)


def simulated(events: list[Event], *, stage_of: dict[int, int], schedule: str, pp: int,
              microbatches: int, virtual_stages: int = 1, sends: str = "deferred") -> float:
    """Bubble of the same schedule in the simulator, with this run's mean forward and backward
    time of each (stage, chunk) and free communication: what is left once transfers, waits and
    run-to-run noise are removed, i.e. the bubble of the schedule plus the stages' imbalance."""
    from ..parallel.pipeline.schedules import build
    from ..parallel.pipeline.simulate import simulate

    warm = steps_of(events)[1:] or steps_of(events)
    sums: dict = {}
    for e in events:
        if e.step in warm and e.cat in ("forward", "backward"):
            key = (stage_of[e.rank], e.args["chunk"], e.cat)
            tot, n = sums.get(key, (0.0, 0))
            sums[key] = (tot + e.t1 - e.t0, n + 1)
    mean = {k: tot / n for k, (tot, n) in sums.items()}

    def duration(rank, action):
        return mean[(rank, action.chunk, "forward" if action.op is Op.FWD else "backward")]

    sched = build(schedule, pp, microbatches, virtual_stages)
    return simulate(sched, pp, virtual_stages, duration=duration, sends=sends).bubble_fraction


_ACTION = re.compile(r"^(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)(?:c(\d+))?$")


def parse_action(text: str) -> Action:
    """The inverse of ``str(Action)``: ``F3``, ``RECV_B2c1``."""
    m = _ACTION.match(text)
    if m is None:
        raise ValueError(f"not an action: {text!r}")
    return Action(Op(m[1]), int(m[2]), int(m[3] or 0))


def replay(events: list[Event], *, stage_of: dict[int, int], pipelines: list[list[int]],
           schedule: str, pp: int, microbatches: int, virtual_stages: int = 1,
           sends: str = "deferred") -> dict:
    """Each warm step of each pipeline replayed in the simulator with that step's measured
    times: every forward and backward as it ran (mean over a stage's tp ranks), and every
    message's transfer as it ran: ``end of the batch - max(batch posted, partner's batch
    posted)``, for the ops the rank waited on (under ``sends``). Returns the mean measured and
    replayed bubble over (step, pipeline) and the pairs."""
    from ..parallel.pipeline.schedules import build
    from ..parallel.pipeline.simulate import message, simulate

    deferred = sends == "deferred"
    sched = build(schedule, pp, microbatches, virtual_stages)
    warm = steps_of(events)[1:] or steps_of(events)
    pairs = []
    for step in warm:
        for ranks in pipelines:
            evs = [e for e in events if e.step == step and e.rank in ranks
                   and e.cat in ("forward", "backward", "p2p")]
            compute: dict = {}  # (stage, action) -> [seconds]
            batches = []  # (stage, t0, t1, actions)
            posted: dict = {}  # (is_send, message) -> [t0 of the batch holding it]
            for e in evs:
                st = stage_of[e.rank]
                if e.cat == "p2p":
                    acts = [parse_action(a) for a in e.args["actions"]]
                    batches.append((st, e.t0, e.t1, acts))
                    for a in acts:
                        posted.setdefault((a.op.is_send, message(st, a, pp)), []).append(e.t0)
                else:
                    compute.setdefault((st, parse_action(e.name)), []).append(e.t1 - e.t0)
            comm: dict = {}  # (stage, action) or message -> [seconds]
            for st, t0, t1, acts in batches:
                waited = [a for a in acts if not (deferred and a.op.is_send)]
                partners = [max(posted.get((not a.op.is_send, message(st, a, pp)), [t0]))
                            for a in waited]
                took = max(0.0, t1 - max([t0] + partners))
                for a in waited:
                    comm.setdefault((st, a), []).append(took)
                    if not a.op.is_send:
                        comm.setdefault(message(st, a, pp), []).append(took)

            def mean(xs):
                return sum(xs) / len(xs)

            def duration(st, a):
                return mean(compute[st, a])

            def comm_time(st, a):
                return mean(comm.get((st, a)) or comm.get(message(st, a, pp)) or [0.0])

            if any((st, a) not in compute for st in range(pp) for a in sched[st]
                   if not a.op.is_comm):
                continue  # an action is missing from the trace: nothing to replay
            sim = simulate(sched, pp, virtual_stages, duration=duration, comm_time=comm_time,
                           sends=sends)
            pairs.append((bubble(events, step, ranks)["bubble"], sim.bubble_fraction))
    if not pairs:
        return {}
    return {"measured": sum(m for m, _ in pairs) / len(pairs),
            "replayed": sum(r for _, r in pairs) / len(pairs), "pairs": pairs}


def pipeline_bubble(events: list[Event], step: int, pipelines: list[list[int]] | None) -> dict:
    """The step's bubble: the mean over pipelines (each in its own window) of ``bubble``."""
    each = [b for b in (bubble(events, step, ranks) for ranks in (pipelines or [None])) if b]
    if not each:
        return {}
    per_rank = {r: x for b in each for r, x in b["per_rank"].items()}
    return {"step": step, "window_s": max(b["window_s"] for b in each),
            "bubble": sum(b["bubble"] for b in each) / len(each), "per_rank": per_rank}


def steps_of(events: list[Event]) -> list[int]:
    return sorted({e.step for e in events if e.cat in ("forward", "backward")})


# -- output --------------------------------------------------------------------------------
def chrome_trace(events: list[Event], *, meta: dict | None = None) -> dict:
    """Chrome trace JSON: one process per rank, lane 0 = compute/blocking, lane 1 = async dp."""
    out = []
    for r in sorted({e.rank for e in events}):
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for lane, name in ((MAIN, "compute + blocking"), (ASYNC, "dp all-reduce in flight")):
            out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": lane, "args": {"name": name}})
    for e in sorted(events, key=lambda e: (e.rank, e.t0)):
        out.append({"name": e.name, "cat": e.cat, "ph": "X", "ts": e.t0 * 1e6,
                    "dur": max(0.0, e.t1 - e.t0) * 1e6, "pid": e.rank, "tid": e.lane,
                    "args": {"step": e.step, **e.args}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta or {}}


def timeline_png(events: list[Event], path: str, *, step: int, title: str = "") -> None:
    """One row per rank (top = rank 0), coloured by action, white = idle; the thin bar under a
    row is the dp all-reduce in flight. ``step`` selects the optimizer step drawn."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    evs = [e for e in events if e.step == step and e.cat != "eval"]
    ranks = sorted({e.rank for e in evs})
    t_start = min(e.t0 for e in evs)
    fig = Figure(figsize=(14, 1.0 + 0.7 * len(ranks)), dpi=110)
    ax = fig.add_subplot()
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row
        for e in (e for e in evs if e.rank == r):
            x0, w = (e.t0 - t_start) * 1e3, (e.t1 - e.t0) * 1e3
            lane_y, h = (y - 0.42, 0.12) if e.lane == ASYNC else (y - 0.25, 0.6)
            ax.broken_barh([(x0, w)], (lane_y, h), facecolors=COLORS[e.cat], edgecolor="white",
                           linewidth=0.3)
            if e.cat in ("forward", "backward") and w > 0:
                ax.text(x0 + w / 2, y + 0.05, str(e.args["mb"]), ha="center", va="center",
                        fontsize=6, color="white", clip_on=True)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(ranks)])
    ax.set_xlabel("ms since the step's first event")
    ax.set_ylim(-0.6, len(ranks) - 0.3)
    used = {e.cat for e in evs}
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items() if k in used],
               loc="lower center", ncol=len(used), fontsize=8, frameon=False)
    ax.set_title(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.3 / fig.get_figheight(), 1, 1))
    fig.savefig(path)


def write(events: list[Event], json_path: str, *, pp: int, microbatches: int, schedule: str,
          virtual_stages: int = 1, stage_of: dict[int, int] | None = None,
          pipelines: list[list[int]] | None = None, sends: str = "deferred") -> dict:
    """Write the Chrome trace and the PNG timeline (``<json_path minus .json>.png``) and return
    the bubble summary (the last step is drawn: the first one includes warm-up). ``pipelines``
    lists the ranks of each replica (default: all ranks form one)."""
    steps = steps_of(events)
    per_step = [pipeline_bubble(events, s, pipelines) for s in steps]
    th = theory(pp, microbatches, virtual_stages)
    measured = [b["bubble"] for b in per_step[1:] or per_step]
    summary = {"theory": th, "measured_mean": sum(measured) / len(measured),
               "measured_last": per_step[-1]["bubble"], "per_rank_last": per_step[-1]["per_rank"],
               "steps": per_step}
    if stage_of is not None and pp > 1:
        summary["simulated_measured_durations"] = simulated(
            events, stage_of=stage_of, schedule=schedule, pp=pp, microbatches=microbatches,
            virtual_stages=virtual_stages, sends=sends)
        rep = replay(events, stage_of=stage_of, pipelines=pipelines or [sorted(stage_of)],
                     schedule=schedule, pp=pp, microbatches=microbatches,
                     virtual_stages=virtual_stages, sends=sends)
        if rep:
            summary["replayed"] = rep["replayed"]
    with open(json_path, "w") as fh:
        json.dump(chrome_trace(with_idle(events), meta={"bubble": summary, "schedule": schedule, "pp": pp,
                                             "microbatches": microbatches}), fh)
    png = png_path(json_path)
    title = (f"{schedule} pp={pp} m={microbatches}, step {steps[-1] + 1}: measured bubble "
             f"{summary['measured_last']:.3f} (mean over steps {summary['measured_mean']:.3f}) vs "
             f"(p-1)/(m+p-1) = {th:.3f}")
    timeline_png(events, png, step=steps[-1], title=title)
    summary["png"] = png
    return summary


def png_path(json_path: str) -> str:
    return (json_path[:-5] if json_path.endswith(".json") else json_path) + ".png"


def with_idle(events: list[Event]) -> list[Event]:
    """``events`` plus an ``idle`` event for each gap on a rank's main lane inside a step."""
    out = list(events)
    for r in sorted({e.rank for e in events}):
        for s in sorted({e.step for e in events if e.rank == r}):
            main = sorted((e for e in events if e.rank == r and e.step == s and e.lane == MAIN
                           and e.cat != "eval"), key=lambda e: e.t0)
            for a, b in zip(main, main[1:]):
                if b.t0 > a.t1:
                    out.append(Event("idle", "idle", a.t1, b.t0, r, s))
    return out


def finish(tracer: Tracer, cfg, *, log=None) -> dict | None:
    """Collective: gather on rank 0, write ``cfg.train.trace`` (+ .png), log the bubble line."""
    events = tracer.gather()
    if events is None or not steps_of(events):
        return None
    p = cfg.parallel
    layout = Layout.of(p)
    stage_of = {r: layout.coords(r)["pp"] for r in range(layout.world_size)}
    replica: dict = {}
    for r in range(layout.world_size):
        c = layout.coords(r)
        replica.setdefault((c["dp"], c["cp"]), []).append(r)
    summary = write(events, cfg.train.trace, pp=p.pp, microbatches=p.microbatches,
                    schedule=p.schedule, virtual_stages=p.virtual_stages, stage_of=stage_of,
                    pipelines=list(replica.values()), sends=tracer.sends or "deferred")
    line = (f"trace: {cfg.train.trace} and {summary['png']}; pipeline bubble measured "
            f"{summary['measured_mean']:.3f} (mean over steps after the first; last step "
            f"{summary['measured_last']:.3f}) vs theory (p-1)/(v*m+p-1) = {summary['theory']:.3f}")
    if "replayed" in summary:
        line += (f"; the simulator replaying each step's measured F/B and message times "
                 f"{summary['replayed']:.3f}")
    if "simulated_measured_durations" in summary:
        line += (f"; with the mean F/B time per stage and free communication "
                 f"{summary['simulated_measured_durations']:.3f}")
    (log.info if log is not None else print)(line)
    return summary
