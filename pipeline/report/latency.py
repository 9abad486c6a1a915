"""The report's "Per-step latency" section: where each learner step's wall time went, hop by hop.

Reads the `hops` dict and `step_s` of the learner's metrics records (`pipeline.telemetry.hops` defines the hops and
how they add up to the step's wall time). Shows a stacked bar per learner step and a table of the median
seconds per hop over the steps after the first (whose time is mostly compilation).
"""

from __future__ import annotations

import statistics
from typing import Any

from pipeline.process.step_kind import StepKind
from pipeline.report.data import RunData, last_per, num
from pipeline.report.plots import Plot, Section, add_legend, html_table, new_figure, to_png
from pipeline.telemetry.hops import HOP_HELP, HOPS

TITLE = "Per-step latency"


def step_hops(data: RunData) -> dict[int, dict[str, float]]:
    """Learner step -> its hops (seconds), for the records that carry them."""
    out: dict[int, dict[str, float]] = {}
    for step, rec in sorted(last_per(data.metrics.get(StepKind.LEARNER, []), "step").items()):
        hops = rec.get("hops")
        if isinstance(hops, dict):
            out[step] = {h: float(v) for h in HOPS if isinstance(v := hops.get(h, 0.0), int | float)}
    return out


def latency_summary(data: RunData) -> dict[str, Any]:
    """Median seconds per hop and of `step_s` over the learner steps after the first one carrying hops."""
    learner = last_per(data.metrics.get(StepKind.LEARNER, []), "step")
    hops = step_hops(data)
    steady = sorted(hops)[1:] or sorted(hops)
    med = {h: statistics.median(hops[s][h] for s in steady) for h in HOPS} if steady else {}
    step_s = [v for s in steady if (v := num(learner[s], "step_s")) is not None]
    return {"steps": len(steady), "hops": med, "step_s": statistics.median(step_s) if step_s else None}


def latency_section(data: RunData) -> Section:
    """A stacked bar of the hops of every learner step, and the median per hop at steady state."""
    sec = Section(TITLE)
    hops = step_hops(data)
    if not hops:
        return sec.no_data("`hops` in metrics/learner/*.jsonl (written by the learner since per-hop timing)")
    steps = sorted(hops)
    fig, (ax,) = new_figure(1, height=4.2)
    bottom = [0.0] * len(steps)
    cmap = fig.colormaps["tab20"] if hasattr(fig, "colormaps") else None
    for i, h in enumerate(HOPS):
        vals = [hops[s].get(h, 0.0) for s in steps]
        if not any(vals):
            continue
        color = cmap(i) if cmap is not None else None
        ax.bar(steps, vals, bottom=bottom, label=h, color=color, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xlabel("learner step")
    ax.set_ylabel("wall seconds")
    ax.set_title("where each learner step's wall time went")
    if len(steps) > 1:  # the first step is mostly compilation: keep the others readable
        ax.set_ylim(0, max(bottom[1:]) * 1.15 or 1.0)
    add_legend(ax)
    sec.plots.append(
        Plot("latency_hops", to_png(fig), "Per-step hops, stacked (the first step, mostly compilation, is clipped)")
    )
    summary = latency_summary(data)
    rows = [(h, summary["hops"].get(h), HOP_HELP[h]) for h in HOPS]
    rows.append(("step (wall)", summary["step_s"], "median wall seconds per learner step"))
    sec.body.append(f"<p>Median over {summary['steps']} learner steps (the first excluded).</p>")
    sec.body.append(html_table(("hop", "median s", "what it is"), rows))
    return sec
