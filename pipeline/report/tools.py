"""The report's "Tool use" section: per-turn metrics of multi-turn tool-using lessons, from the rollout workers'
metrics records.

Read from each rollout record (the environment's `summarize` metrics, prefixed `env/` by the rollout manager):
`env/turns_mean` (assistant turns per episode), `env/tool_calls_mean`, `env/tool_errors_mean`,
`env/parse_failure_mean` (no final answer), and for each turn k `env/ended_at_turn<k>_mean` (episodes that ended at
turn k) and `env/reward_at_turn<k>_mean` (their reward, 0 for the others), as `ChatCalculatorEnv` writes them. Each
record's means are those of its sampling call's last attempt (the rollout manager keeps the last attempt's means),
so the table averages per-record means over the records of each range of policy steps.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from pipeline.process.step_kind import StepKind
from pipeline.report.data import RunData, num
from pipeline.report.plots import Plot, Section, add_legend, html_table, new_figure, to_png

TITLE = "Tool use"
_P = "env/"
_EPISODE = (
    ("turns_mean", "turns / episode"),
    ("tool_calls_mean", "tool calls / episode"),
    ("tool_errors_mean", "tool errors / episode"),
    ("parse_failure_mean", "no final answer"),
)
_TURN = re.compile(r"^env/ended_at_turn(\d+)_mean$")
_RANGES = 4
"""Policy-step ranges the table splits the run into (quarters)."""


def _turns(records: list[dict[str, Any]]) -> list[int]:
    return sorted({int(m.group(1)) for rec in records for k in rec if (m := _TURN.match(k))})


def _by_step(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        step = num(rec, "policy_step")
        if step is not None:
            by_step[int(step)].append(rec)
    return by_step


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    vals = [v for rec in records if (v := num(rec, key)) is not None]
    return sum(vals) / len(vals) if vals else None


def _reward_at(records: list[dict[str, Any]], k: int) -> float | None:
    """Mean reward of the episodes that ended at turn k (None when none did)."""
    ended = _mean(records, f"{_P}ended_at_turn{k}_mean")
    reward = _mean(records, f"{_P}reward_at_turn{k}_mean")
    return reward / ended if ended and reward is not None else None


def tool_rows(records: list[dict[str, Any]], turns: list[int]) -> list[list[Any]]:
    """One row per range of policy steps (`_RANGES` equal ranges of the steps the records carry): steps, then the
    per-episode means of `_EPISODE`, then per turn k the share of episodes that ended at k and their mean reward."""
    by_step = _by_step(records)
    steps = sorted(by_step)
    if not steps:
        return []
    size = max(1, -(-len(steps) // _RANGES))
    rows = []
    for i in range(0, len(steps), size):
        chunk = steps[i : i + size]
        recs = [r for s in chunk for r in by_step[s]]
        row: list[Any] = [f"{chunk[0]}-{chunk[-1]}" if len(chunk) > 1 else str(chunk[0])]
        row += [_mean(recs, _P + key) for key, _ in _EPISODE]
        for k in turns:
            row += [_mean(recs, f"{_P}ended_at_turn{k}_mean"), _reward_at(recs, k)]
        rows.append(row)
    return rows


def tool_use_section(data: RunData) -> Section:
    """Turns and tool calls per episode, tool errors, and reward by the turn the episode ended at, per range of
    policy steps (a table) and per policy step (plots); "no data" without rollout records, a note when none of
    them carries these metrics."""
    sec = Section(TITLE)
    rollout = data.metrics.get(StepKind.ROLLOUT, [])
    records = [r for r in rollout if num(r, f"{_P}turns_mean") is not None]
    if not rollout:
        return sec.no_data("env/turns_mean, env/tool_calls_mean … in rollout metrics (a multi-turn tool lesson)")
    if not records:  # rollouts, but of no multi-turn tool lesson
        sec.body.append("<p>No tool use in this run: no rollout record carries env/turns_mean.</p>")
        return sec
    turns = _turns(records)
    header = ["policy steps", *(label for _, label in _EPISODE)]
    for k in turns:
        header += [f"ended at turn {k}", f"reward if ended at turn {k}"]
    sec.body.append(html_table(header, tool_rows(records, turns)))
    fig, (ax_e, ax_r) = new_figure(2)
    by_step = _by_step(records)
    steps = sorted(by_step)
    for key, label in _EPISODE[:3]:
        ys = [_mean(by_step[s], _P + key) for s in steps]
        ax_e.plot([s for s, y in zip(steps, ys, strict=True) if y is not None], [y for y in ys if y is not None],
                  marker=".", label=label)  # fmt: skip
    for k in turns:
        ys = [_reward_at(by_step[s], k) for s in steps]
        ax_r.plot([s for s, y in zip(steps, ys, strict=True) if y is not None], [y for y in ys if y is not None],
                  marker=".", label=f"ended at turn {k}")  # fmt: skip
    ax_e.set(title="Per episode (rollout workers)", xlabel="policy step", ylabel="mean per episode")
    ax_r.set(title="Mean reward by the turn the episode ended at", xlabel="policy step", ylabel="mean reward")
    add_legend(ax_e)
    add_legend(ax_r)
    sec.plots.append(Plot("tool_use", to_png(fig), "Turns, tool calls and tool errors per episode; reward by turn."))
    return sec
