"""The report's sections: one builder per section, each turning `RunData` into a `Section` (text, tables, plots).

A builder whose data is missing returns a section that says "no data" and names what it looked for.
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from matplotlib.axes import Axes
from matplotlib.ticker import AutoLocator

from pipeline.batch_maker.slot_metrics import WASTE_REASONS, waste_ratio
from pipeline.process.step_kind import StepKind
from pipeline.report.data import RunData, last_per, num, series, start_time
from pipeline.report.latency import latency_section
from pipeline.report.learner import learner_section
from pipeline.report.plots import Plot, Section, add_legend, fmt, html_table, new_figure, to_png
from pipeline.report.scorers import TITLE as SCORERS_TITLE
from pipeline.report.scorers import scorers_section
from pipeline.report.text import answers_section, config_section, samples_section
from pipeline.report.tools import TITLE as TOOL_USE_TITLE
from pipeline.report.tools import tool_use_section

SECTION_TITLES = (
    "Reward per lesson",
    SCORERS_TITLE,
    TOOL_USE_TITLE,
    "Evaluation",
    "Learner",
    "Staleness",
    "Throughput",
    "Learner idle time",
    "Per-step latency",
    "Sample completions",
    "Right and wrong answers",
    "Summary",
    "Rollout fates",
    "Curriculum events",
    "Run config",
)
"""Every section of the report, in page order (each appears as an <h2>)."""

WASTE_LABEL = f"waste: rows dropped ({', '.join(WASTE_REASONS)}) per row trained"
"""The summary row of the waste metric (`pipeline.batch_maker.slot_metrics.waste_ratio`)."""
_MAX_EVENT_ROWS = 500
_GROUPS_FILTERED_PREFIX = "groups_filtered_"
_LESSON_REWARD_PREFIX = "reward/"
_FUNCTION_REWARD_PREFIX = "env/reward/"
_SKIPPED = "env/n_skipped_prompts"
_RETESTED = "env/n_retested_prompts"
GENERATED_TRAINED_LABEL = "generated rows trained (distinct rows used / rows generated)"
"""The summary row of the fraction of generated rollout rows that went into a batch."""
GENERATED_SIGNAL_LABEL = "generated rows trained with signal (distinct rows used with an advantage ≠ 0 / generated)"
"""The summary row of the fraction of generated rollout rows that went into a batch with learning signal (rows a
slot filled without signal, at advantage 0, are trained on but teach nothing)."""
SKIP_RATE_LABEL = "prompt draws skipped as solved or hopeless (curriculum.skip_after)"
"""The summary row of the skip rate: skipped draws / (skipped + kept draws), from the rollout records."""


def summary_section(data: RunData) -> Section:
    """Headline numbers: steps, first/last reward, drops, idle fraction, latest evals."""
    sec = Section("Summary")
    learner = last_per(data.metrics.get(StepKind.LEARNER, []), "step")
    bm = last_per(data.metrics.get(StepKind.BATCHMAKER, []), "slot")
    rows: list[tuple[str, Any]] = [("run root", data.run_root)]
    rows.append(("learner steps", f"{len(learner)} (last step {max(learner)})" if learner else None))
    rows.append(("committed batch slots", f"{len(data.batch_slots)}" if data.batch_slots else None))
    _, rewards = series(bm, "mean_reward")
    source = "BatchMaker"
    if not rewards:
        rewards = [r for rec in data.metrics.get(StepKind.ROLLOUT, []) if (r := num(rec, "mean_reward")) is not None]
        source = "rollout workers"
    rows.append((f"first mean reward ({source})", rewards[0] if rewards else None))
    rows.append((f"last mean reward ({source})", rewards[-1] if rewards else None))
    wait = sum(v for r in learner.values() if (v := num(r, "wait_s")) is not None)
    train = sum(v for r in learner.values() if (v := num(r, "train_s")) is not None)
    rows.append(("learner idle fraction (wait / (wait + train))", wait / (wait + train) if wait + train > 0 else None))
    _, st = series(bm, "staleness_mean")
    rows.append(("mean staleness (policy steps of lag)", sum(st) / len(st) if st else None))
    rows.append(("rollouts used (distinct)", data.rollouts_used))
    dropped = sum(data.dropped_by_reason.values())
    rows.append(("rollouts dropped", dropped if data.dropped_by_reason else None))
    rows.append((WASTE_LABEL, waste_ratio(data.dropped_by_reason, data.rollouts_used or 0)))
    rows += generation_rows(data)
    if data.pool:  # the elastic rollout pool: its size at the start and after each change (`pipeline.jobs.pool`)
        t_pool = float(data.pool[0].get("time", 0.0))
        sizes = [f"{r.get('workers')} ({fmt(float(r.get('time', 0.0)) - t_pool)} s)" for r in data.pool
                 if r.get("event") in ("start", "up", "down")]  # fmt: skip
        rows.append(("rollout workers over time (elastic pool; time since start)", " -> ".join(sizes)))
    rows.append(("quarantined files", data.quarantined))
    kinds: dict[str, int] = defaultdict(int)
    for rec in data.quarantine:
        kinds[rec["kind"]] += 1
    for kind, n in sorted(kinds.items()):
        rows.append((f"quarantined: {kind}", n))
    t0 = start_time(data)
    t1 = max((t for recs in data.metrics.values() for r in recs if (t := num(r, "time")) is not None), default=None)
    if t0 is not None and t1 is not None:
        span = t1 - t0
        rows.append(("wall time covered by metrics", f"{fmt(span / 60.0)} min" if span >= 120 else f"{fmt(span)} s"))
    latest: dict[str, dict[str, Any]] = {}
    for row in sorted(data.eval_summaries, key=lambda r: num(r, "policy_step") or 0.0):
        if not row.get("external"):
            latest[_eval_name(row)] = row
    for name, row in latest.items():
        rows.append(
            (
                f"latest eval {name} @ policy step {row.get('policy_step')}",
                f"mean reward {fmt(row.get('mean_reward'))}, success rate {fmt(row.get('success_rate'))}",
            )
        )
    sec.body.append(html_table(["quantity", "value"], rows))
    if data.quarantine:
        sec.body.append(quarantine_table(data))
    if data.notes:
        items = "".join(f"<li>{html.escape(n)}</li>" for n in data.notes)
        sec.body.append(f'<p class="warn">Problems met while reading the run root:</p><ul>{items}</ul>')
    return sec


def generation_rows(data: RunData) -> list[tuple[str, Any]]:
    """Summary rows of what was generated and how much of it trained, and (`curriculum.skip_after`) the prompt
    draws difficulty-aware sampling passed over, from the rollout workers' records (`rows`; `env/n_examples`,
    `env/n_skipped_prompts`, `env/n_retested_prompts`); none without rollout records."""
    recs = [r for r in data.metrics.get(StepKind.ROLLOUT, []) if r.get("event") in ("write", "empty")]
    if not recs:
        return []

    def total(key: str) -> float:
        return sum(v for r in recs if (v := num(r, key)) is not None)

    generated = total("rows")
    out: list[tuple[str, Any]] = [("rollout rows generated", int(generated))]
    if data.rollouts_used is not None and generated > 0:
        out.append((GENERATED_TRAINED_LABEL, data.rollouts_used / generated))
    if data.rollouts_used_with_signal is not None and generated > 0:
        out.append((GENERATED_SIGNAL_LABEL, data.rollouts_used_with_signal / generated))
    if any(num(r, _SKIPPED) is not None for r in recs):
        skipped, drawn = total(_SKIPPED), total("env/n_examples")
        out.append((SKIP_RATE_LABEL, skipped / (skipped + drawn) if skipped + drawn > 0 else None))
        retested = int(total(_RETESTED))
        out.append(("draws of skipped prompts: passed over / kept as re-tests", f"{int(skipped)} / {retested}"))
    return out


def quarantine_table(data: RunData) -> str:
    """The objects set aside (quarantined) or skipped, each with its kind and reason, folded under a count."""
    table = html_table(["kind", "path", "reason"], [(r["kind"], r["path"], r["reason"]) for r in data.quarantine])
    n = len(data.quarantine)
    return f"<details><summary>{n} quarantined or skipped object{'s' if n != 1 else ''}</summary>{table}</details>"


def reward_section(data: RunData) -> Section:
    """Reward per lesson vs batch slot (BatchMaker) and vs policy step (rollout workers)."""
    sec = Section("Reward per lesson")
    bm = last_per(data.metrics.get(StepKind.BATCHMAKER, []), "slot")
    lessons = sorted({k for rec in bm.values() for k in rec if k.startswith(_LESSON_REWARD_PREFIX)})
    has_bm = bool(series(bm, "mean_reward")[0]) or bool(lessons)
    by_lesson: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    # each reward function's mean per episode (`env/reward/<name>`, e.g. a verifiers rubric's functions)
    by_function: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rec in data.metrics.get(StepKind.ROLLOUT, []):
        step, reward = num(rec, "policy_step"), num(rec, "mean_reward")
        if step is not None and reward is not None:
            by_lesson[str(rec.get("lesson_id", "all"))][int(step)].append(reward)
        for key in rec:
            value = num(rec, key) if key.startswith(_FUNCTION_REWARD_PREFIX) else None
            if step is not None and value is not None:
                name = f"{rec.get('lesson_id', 'all')}: {key[len(_FUNCTION_REWARD_PREFIX) :]}"
                by_function[name][int(step)].append(value)
    if not has_bm and not by_lesson:
        return sec.no_data("mean_reward in batchmaker or rollout metrics")
    fig, axes = new_figure(int(has_bm) + int(bool(by_lesson)) + int(bool(by_function)))
    i = 0
    if has_bm:
        ax = axes[i]
        i += 1
        xs, ys = series(bm, "mean_reward")
        if xs:
            ax.plot(xs, ys, color="black", lw=2, label="all lessons")
        for key in lessons:
            xs, ys = series(bm, key)
            ax.plot(xs, ys, marker=".", label=key[len(_LESSON_REWARD_PREFIX) :])
        ax.set(title="Batch mean reward (BatchMaker)", xlabel="batch slot (learner step)", ylabel="mean reward")
        add_legend(ax)
    if by_lesson:
        _plot_step_means(axes[i], by_lesson, "Rollout mean reward (rollout workers)", "mean reward")
        i += 1
    if by_function:
        _plot_step_means(axes[i], by_function, "Reward per function (rollout workers)", "mean weighted value")
    caption = "Mean episode reward per lesson" + ("; each reward function's mean value." if by_function else ".")
    sec.plots.append(Plot("reward", to_png(fig), caption))
    return sec


def _plot_step_means(ax: Any, curves: dict[str, dict[int, list[float]]], title: str, ylabel: str) -> None:
    """One curve per name (sorted) on `ax`: the mean of its values at each policy step."""
    for name, per_step in sorted(curves.items()):
        steps = sorted(per_step)
        ax.plot(steps, [sum(per_step[s]) / len(per_step[s]) for s in steps], marker=".", label=name)
    ax.set(title=title, xlabel="policy step", ylabel=ylabel)
    add_legend(ax)


def _eval_name(row: dict[str, Any]) -> str:
    """Curve name of an evaluation summary row: the lesson, plus a non-default eval type."""
    name = str(row.get("lesson_id"))
    if row.get("eval_type", "eval") != "eval":
        name += f" ({row.get('eval_type')})"
    return name


def eval_section(data: RunData) -> Section:
    """Evaluation curves per lesson over checkpoints (external baselines as dashed lines) and a table of
    the newest evaluation per lesson."""
    sec = Section("Evaluation")
    curves: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    baselines: dict[str, dict[str, Any]] = {}
    for row in data.eval_summaries:
        if row.get("external"):
            baselines[f"{_eval_name(row)} [{row['external']}]"] = row
        elif num(row, "policy_step") is not None:
            curves[_eval_name(row)][int(row["policy_step"])] = row
    if not curves and not baselines:
        return sec.no_data("evals/*/<lesson>.summary.parquet")
    fig, axes = new_figure(2)
    fields = ("mean_reward", "success_rate")
    for name, per_step in sorted(curves.items()):
        steps = sorted(per_step)
        for ax, field in zip(axes, fields, strict=True):
            pts = [(s, v) for s in steps if (v := num(per_step[s], field)) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for name, row in sorted(baselines.items()):
        for ax, field in zip(axes, fields, strict=True):
            if (v := num(row, field)) is not None:
                ax.axhline(v, ls="--", lw=1, color="gray", label=f"baseline {name}")
    axes[0].set(title="Eval mean reward per checkpoint", xlabel="policy step", ylabel="mean reward")
    axes[1].set(title="Eval success rate per checkpoint", xlabel="policy step", ylabel="success rate")
    for ax in axes:
        add_legend(ax)
    sec.plots.append(Plot("eval", to_png(fig), "Evaluation of each committed checkpoint, per lesson."))
    passk = _pass_at_k_plot(curves)
    if passk is not None:
        sec.plots.append(passk)
    newest: list[tuple[str, int | str, dict[str, Any]]]
    newest = [(name, max(per_step), per_step[max(per_step)]) for name, per_step in sorted(curves.items())]
    newest += [(f"baseline {name}", "external", row) for name, row in sorted(baselines.items())]
    rows = [
        (name, step, r.get("n_examples"), r.get("mean_reward"), r.get("success_rate"),
         _pass_label(r), r.get("mean_at_k"), r.get("mean_response_tokens"), r.get("truncation_rate"))
        for name, step, r in newest
    ]  # fmt: skip
    header = [
        "lesson", "policy step", "examples", "mean reward", "success rate", "pass@k (k/n)", "mean@k",
        "response tokens", "truncation",
    ]  # fmt: skip
    sec.body.append(html_table(header, rows))
    return sec


def _pass_label(row: dict[str, Any]) -> str:
    """`pass@k value (k/n)` of a summary row, or "-" when it records none (a version-1 summary)."""
    v = num(row, "pass_at_k")
    return "-" if v is None else f"{fmt(v)} ({row.get('pass_k')}/{row.get('samples_per_problem')})"


def _pass_at_k_plot(curves: dict[str, dict[int, dict[str, Any]]]) -> Plot | None:
    """pass@k and mean@k per checkpoint and lesson (summaries of schema version 2), or None when none has them."""
    have = {
        name: per_step
        for name, per_step in curves.items()
        if any(num(r, "pass_at_k") is not None for r in per_step.values())
    }
    if not have:
        return None
    fig, axes = new_figure(2)
    for name, per_step in sorted(have.items()):
        ks = sorted({int(r["pass_k"]) for r in per_step.values() if num(r, "pass_at_k") is not None})
        label = f"{name} (k={','.join(map(str, ks))})"
        for ax, field in zip(axes, ("pass_at_k", "mean_at_k"), strict=True):
            pts = [(s, v) for s in sorted(per_step) if (v := num(per_step[s], field)) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    axes[0].set(title="Eval pass@k per checkpoint", xlabel="policy step", ylabel="pass@k")
    axes[1].set(title="Eval mean@k per checkpoint", xlabel="policy step", ylabel="mean reward over k samples")
    for ax in axes:
        add_legend(ax)
    caption = (
        "pass@k (Chen et al. 2021's unbiased estimator from n samples per problem) and mean@k (mean reward of a "
        "problem's samples) of each committed checkpoint, per lesson."
    )
    return Plot("eval_pass_at_k", to_png(fig), caption)


def staleness_section(data: RunData) -> Section:
    """Staleness (lag in policy steps) of the rollouts in each batch: min, mean, max."""
    sec = Section("Staleness")
    bm = last_per(data.metrics.get(StepKind.BATCHMAKER, []), "slot")
    xs, mean = series(bm, "staleness_mean")
    xlo, lo = series(bm, "staleness_min")
    xhi, hi = series(bm, "staleness_max")
    if not (xs or xlo or xhi):
        return sec.no_data("staleness_min/mean/max in batchmaker metrics")
    fig, (ax,) = new_figure(1, width=8.0)
    if xlo and xhi and xlo == xhi:
        ax.fill_between(xlo, lo, hi, alpha=0.25, label="min to max")
    else:
        ax.plot(xlo, lo, ls="--", label="min")
        ax.plot(xhi, hi, ls="--", label="max")
    ax.plot(xs, mean, marker=".", label="mean")
    ax.set(title="Rollout lag per batch: (T-1) - policy step", xlabel="batch slot T", ylabel="lag (policy steps)")
    add_legend(ax)
    caption = (
        "Lag of the rollouts used in each batch: a rollout sampled from policy P and used in batch T "
        "(which the learner trains starting from policy T-1) has lag (T-1) - P policy steps."
    )
    sec.plots.append(Plot("staleness", to_png(fig), caption))
    return sec


def throughput_section(data: RunData) -> Section:
    """Rollouts/s and tokens/s per rollout worker over time; learner tokens/s per step."""
    sec = Section("Throughput")
    t0 = start_time(data) or 0.0
    t_end = max((t for r in data.metrics.get(StepKind.ROLLOUT, []) if (t := num(r, "time")) is not None), default=t0)
    unit, scale = ("minutes", 60.0) if t_end - t0 >= 120.0 else ("seconds", 1.0)
    per_worker: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in data.metrics.get(StepKind.ROLLOUT, []):
        per_worker[str(rec.get("worker", "?"))].append(rec)
    learner = last_per(data.metrics.get(StepKind.LEARNER, []), "step")
    panels: list[tuple[str, str, Callable[[Axes], bool]]] = []

    def worker_panel(field: str) -> Callable[[Axes], bool]:
        def draw(ax: Axes) -> bool:
            drawn = False
            for worker, recs in sorted(per_worker.items()):
                pts = [
                    ((t - t0) / scale, v)
                    for r in recs
                    if (t := num(r, "time")) is not None and (v := num(r, field)) is not None
                ]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=worker)
                    drawn = True
            ax.set(xlabel=f"{unit} since run start")
            ax.xaxis.set_major_locator(AutoLocator())
            return drawn

        return draw

    def learner_panel(ax: Axes) -> bool:
        xs, ys = series(learner, "tokens_per_s")
        ax.plot(xs, ys, marker=".", color="tab:red")
        ax.set(xlabel="learner step")
        return bool(xs)

    panels = [
        ("Rollout rows/s per worker", "rollouts_per_s", worker_panel("rollouts_per_s")),
        ("Rollout tokens/s per worker", "tokens_per_s", worker_panel("tokens_per_s")),
        ("Learner tokens/s", "tokens_per_s", learner_panel),
    ]
    fig, axes = new_figure(3, width=13.0)
    drawn = [draw(ax) for ax, (_, _, draw) in zip(axes, panels, strict=True)]
    if not any(drawn):
        return sec.no_data("rollouts_per_s / tokens_per_s in rollout and learner metrics")
    for ax, (title, ylabel, _), ok in zip(axes, panels, drawn, strict=True):
        ax.set(title=title if ok else f"{title}: no data", ylabel=ylabel)
        add_legend(ax)
    sec.plots.append(Plot("throughput", to_png(fig), "Sampling and training throughput."))
    return sec


def idle_section(data: RunData) -> Section:
    """Learner time per step split into waiting for a batch and training, and the idle fraction."""
    sec = Section("Learner idle time")
    learner = last_per(data.metrics.get(StepKind.LEARNER, []), "step")
    steps = [s for s, r in learner.items() if num(r, "wait_s") is not None or num(r, "train_s") is not None]
    if not steps:
        return sec.no_data("wait_s / train_s in learner metrics")
    wait = [num(learner[s], "wait_s") or 0.0 for s in steps]
    train = [num(learner[s], "train_s") or 0.0 for s in steps]
    fig, (ax1, ax2) = new_figure(2)
    ax1.bar(steps, wait, color="tab:orange", label="waiting for batch")
    ax1.bar(steps, train, bottom=wait, color="tab:blue", label="training")
    ax1.set(title="Learner time per step", xlabel="learner step", ylabel="seconds")
    add_legend(ax1)
    frac = [w / (w + t) if w + t > 0 else 0.0 for w, t in zip(wait, train, strict=True)]
    cum_w, cum_t, cum = 0.0, 0.0, []
    for w, t in zip(wait, train, strict=True):
        cum_w, cum_t = cum_w + w, cum_t + t
        cum.append(cum_w / (cum_w + cum_t) if cum_w + cum_t > 0 else 0.0)
    ax2.plot(steps, frac, marker=".", label="per step")
    ax2.plot(steps, cum, color="black", label="cumulative")
    ax2.set(title="Idle fraction wait / (wait + train)", xlabel="learner step", ylabel="fraction", ylim=(0.0, 1.05))
    add_legend(ax2)
    total = sum(wait) + sum(train)
    overall = sum(wait) / total if total > 0 else 0.0
    sec.body.append(
        f"<p>The learner waited {fmt(sum(wait))} s and trained {fmt(sum(train))} s: idle fraction {fmt(overall)}.</p>"
    )
    sec.plots.append(Plot("learner_idle", to_png(fig), "Where the learner's wall time went."))
    return sec


def fates_section(data: RunData) -> Section:
    """What happened to rollouts: used in batches, or dropped by reason; groups filtered by reason."""
    sec = Section("Rollout fates")
    bars: list[tuple[str, int, str]] = []
    if data.rollouts_used is not None:
        bars.append(("used in batches", data.rollouts_used, "tab:green"))
    for reason, n in data.dropped_by_reason.items():
        bars.append((f"dropped: {reason}", n, "tab:red"))
    filtered: dict[str, float] = defaultdict(float)
    for rec in last_per(data.metrics.get(StepKind.BATCHMAKER, []), "slot").values():
        for k in rec:
            if k.startswith(_GROUPS_FILTERED_PREFIX) and (v := num(rec, k)) is not None:
                filtered[k[len(_GROUPS_FILTERED_PREFIX) :]] += v
        if (v := num(rec, "groups_used")) is not None or (v := num(rec, "n_groups")) is not None:
            filtered.setdefault("(used)", 0.0)
            filtered["(used)"] += v
    if not bars and not filtered:
        return sec.no_data("batch lineage, batches/dropped/*.parquet, groups_* in batchmaker metrics")
    fig, axes = new_figure(
        int(bool(bars)) + int(bool(filtered)), height=max(2.5, 0.45 * max(len(bars), len(filtered)) + 1.5)
    )
    i = 0
    if bars:
        ax = axes[i]
        i += 1
        ax.barh([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
        for y, b in enumerate(bars):
            ax.annotate(str(b[1]), (b[1], y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set(title="Rollouts by fate (distinct rollouts)", xlabel="rollouts")
    if filtered:
        ax = axes[i]
        keys = sorted(filtered, key=lambda k: (k != "(used)", k))
        colors = ["tab:green" if k == "(used)" else "tab:gray" for k in keys]
        ax.barh([k.replace("(used)", "used") for k in keys], [filtered[k] for k in keys], color=colors)
        for pos, key in enumerate(keys):
            ax.annotate(
                fmt(filtered[key]), (filtered[key], pos), xytext=(3, 0), textcoords="offset points", va="center"
            )
        ax.invert_yaxis()
        ax.set(title="Groups used / filtered by reason (BatchMaker)", xlabel="groups")
    rows = [(b[0], b[1]) for b in bars]
    if data.rollout_uses is not None and data.rollouts_used is not None and data.rollout_uses != data.rollouts_used:
        rows.append(("uses in batches (with reuse)", data.rollout_uses))
    if rows:
        sec.body.append(html_table(["fate", "rollouts"], rows))
    sec.plots.append(Plot("rollout_fates", to_png(fig), "Every rollout is used or dropped with a recorded reason."))
    return sec


def _event_name(event: dict[str, Any]) -> str:
    """`event`, or `from_status -> to_status` for status-change events."""
    if event.get("event") is not None:
        return str(event["event"])
    if event.get("from_status") is not None or event.get("to_status") is not None:
        return f"{event.get('from_status')} -> {event.get('to_status')}"
    return "-"


def curriculum_section(data: RunData) -> Section:
    """Table of curriculum events (unlocks, graduations, ...) with their reasons."""
    sec = Section("Curriculum events")
    if not data.curriculum_events:
        return sec.no_data("events in the newest curriculum/state-*.json")
    events = data.curriculum_events[:_MAX_EVENT_ROWS]
    rows = [(e.get("step"), e.get("lesson_id"), _event_name(e), e.get("reason")) for e in events]
    sec.body.append(html_table(["step", "lesson", "event", "reason"], rows))
    if len(data.curriculum_events) > len(events):
        sec.body.append(f"<p>… {len(data.curriculum_events) - len(events)} more events not shown.</p>")
    return sec


SECTIONS: tuple[Callable[[RunData], Section], ...] = (
    reward_section,
    scorers_section,
    tool_use_section,
    eval_section,
    learner_section,
    staleness_section,
    throughput_section,
    idle_section,
    latency_section,
    samples_section,
    answers_section,
    summary_section,
    fates_section,
    curriculum_section,
    config_section,
)
"""Section builders in page order (titles: SECTION_TITLES): the curves first, then the sample completions,
then the rest; the run config (folded) last."""
