"""``hybridpar plot METRICS.jsonl [--out PNG]``: loss, tokens/s and memory curves of a run.

Reads the JSON lines that ``train.metrics`` writes (one per step, rank 0) and draws three
panels over the step: train loss (and val_loss where evaluated), tokens/s, and memory (the
rank's peak bytes, plus the tracked parameter/gradient/optimizer/activation bytes).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..config import ConfigError

MIB = 2 ** 20


def read_metrics(path: str) -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"metrics file {path} does not exist; write one with "
                          f"hybridpar train --metrics {path}") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ConfigError(f"{path}:{i} is not a JSON line; expected the output of "
                                  f"--train.metrics") from None
    if not rows or "step" not in rows[0]:
        raise ConfigError(f"{path} has no step metrics; expected the output of --train.metrics")
    return rows


def plot_metrics(rows: list[dict], out: str, *, title: str = "") -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("hybridpar plot needs matplotlib: pip install 'hybridpar[plot]'") from None
    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(13, 3.8), dpi=100)
    loss_ax, tok_ax, mem_ax = fig.subplots(1, 3)
    loss_ax.plot(steps, [r["loss"] for r in rows], label="train loss")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        loss_ax.plot(*zip(*val), "o-", label="val loss")
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    loss_ax.legend(fontsize=8)
    tok_ax.plot(steps, [r.get("tokens_per_s", float("nan")) for r in rows])
    tok_ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    if "max_mem_bytes" in rows[0]:
        mem_ax.plot(steps, [r["max_mem_bytes"] / MIB for r in rows], label="peak (rank 0)")
    for key in ("params", "grads", "optimizer", "activations"):
        if key in rows[0].get("mem", {}):
            mem_ax.plot(steps, [r["mem"][key] / MIB for r in rows], label=key)
    mem_ax.set(xlabel="step", ylabel="MiB", title="memory (rank 0)")
    mem_ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar plot", description=__doc__.splitlines()[0])
    ap.add_argument("metrics", help="JSON lines written by hybridpar train --metrics")
    ap.add_argument("--out", help="PNG to write (default: METRICS with .png)")
    a = ap.parse_args(argv)
    rows = read_metrics(a.metrics)
    out = a.out or str(Path(a.metrics).with_suffix(".png"))
    lay = rows[0].get("layout", {})
    title = (f"{a.metrics}: dp={lay.get('dp')} tp={lay.get('tp')} pp={lay.get('pp')}"
             if lay else a.metrics)
    plot_metrics(rows, out, title=title)
    print(f"wrote {out} ({len(rows)} steps)")
    return 0
