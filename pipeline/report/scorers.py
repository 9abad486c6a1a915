"""The report's "Scorers" section: per reward function / scorer (LLM judge, reward model, rule) its values, latency
and failures, from the rollout workers' metrics records.

Read from each rollout record (`pipeline.scoring.scorer_metrics`, prefixed `env/` by the rollout manager):
`env/n_scored/<n>`, `env/n_scorer_failures/<n>`, `env/scorer_latency_s/<n>` (mean seconds per request),
`env/scorer_latency_max_s/<n>` and `env/reward_component/<n>` (mean value over scored responses). Both the records
of committed rollout files (`write`) and of sampling calls that committed nothing because every example failed
(`empty`, `RunData.empty_records`: a judge that is down fails every example) count, so a scorer that failed every
call still shows its failures, with the reasons those calls recorded (`failure_reasons`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from pipeline.process.step_kind import StepKind
from pipeline.report.data import RunData, num
from pipeline.report.plots import Plot, Section, add_legend, html_table, new_figure, to_png

TITLE = "Scorers"
_P = "env/"
_FIELDS = ("n_scored", "n_scorer_failures", "scorer_latency_s", "scorer_latency_max_s", "reward_component")
_MAX_REASONS = 20


def _names(records: list[dict[str, Any]]) -> list[str]:
    names = set()
    for rec in records:
        for key in rec:
            for field in _FIELDS:
                if key.startswith(f"{_P}{field}/"):
                    names.add(key[len(_P) + len(field) + 1 :])
    return sorted(names)


def scorer_rows(records: list[dict[str, Any]]) -> list[tuple[str, Any, Any, Any, Any, Any, Any]]:
    """Per scorer name: (name, responses scored, failures, failure rate, mean latency s, max latency s, mean
    value); latency weighted by requests (scored + failed) and the value by responses scored, over `records`."""
    rows = []
    for name in _names(records):
        scored = failed = lat_w = lat_sum = val_w = val_sum = 0.0
        lat_max: float | None = None
        for rec in records:
            n = num(rec, f"{_P}n_scored/{name}") or 0.0
            f = num(rec, f"{_P}n_scorer_failures/{name}") or 0.0
            scored, failed = scored + n, failed + f
            lat = num(rec, f"{_P}scorer_latency_s/{name}")
            if lat is not None:
                w = max(n + f, 1.0)
                lat_w, lat_sum = lat_w + w, lat_sum + w * lat
            top = num(rec, f"{_P}scorer_latency_max_s/{name}")
            if top is not None:
                lat_max = top if lat_max is None else max(lat_max, top)
            val = num(rec, f"{_P}reward_component/{name}")
            if val is not None:
                w = max(n, 1.0)
                val_w, val_sum = val_w + w, val_sum + w * val
        total = scored + failed
        rows.append(
            (
                name,
                int(scored),
                int(failed),
                failed / total if total else None,
                lat_sum / lat_w if lat_w else None,
                lat_max,
                val_sum / val_w if val_w else None,
            )
        )
    return rows


def scorers_section(data: RunData) -> Section:
    """Per scorer: a table of values, latency and failures; the value and the failures per policy step; the
    reasons of sampling calls in which every example failed."""
    sec = Section(TITLE)
    writes = data.metrics.get(StepKind.ROLLOUT, [])
    empty = data.empty_records
    records = [*writes, *empty]
    rows = scorer_rows(records)
    reasons: Counter[str] = Counter()
    for rec in empty:
        for reason in rec.get("failure_reasons") or []:
            reasons[" ".join(str(reason).split())] += 1
    if not records:
        return sec.no_data("env/n_scored/<name>, env/reward_component/<name> … in rollout metrics")
    if not rows and not empty:  # rollouts, but no lesson scored by a judge, reward model or reward function
        sec.body.append("<p>No scorer in this run: no rollout record carries env/n_scored/&lt;name&gt; metrics.</p>")
        return sec
    if rows:
        header = ["scorer", "responses scored", "failures", "failure rate", "mean latency (s)", "max latency (s)",
                  "mean value"]  # fmt: skip
        sec.body.append(html_table(header, rows))
    if empty:
        n_failed = sum(int(num(rec, "failures") or 0) for rec in empty)
        sec.body.append(
            f'<p class="warn">{len(empty)} sampling call(s) committed nothing: every example failed '
            f"({n_failed} failures).</p>"
        )
        if reasons:
            sec.body.append(html_table(["failure reason", "calls"], reasons.most_common(_MAX_REASONS)))
    names = [r[0] for r in rows]
    if names:
        fig, (ax_v, ax_f) = new_figure(2)
        for name in names:
            values: dict[int, list[float]] = defaultdict(list)
            failures: dict[int, float] = defaultdict(float)
            for rec in records:
                step = num(rec, "policy_step")
                if step is None:
                    continue
                v = num(rec, f"{_P}reward_component/{name}")
                if v is not None:
                    values[int(step)].append(v)
                failures[int(step)] += num(rec, f"{_P}n_scorer_failures/{name}") or 0.0
            if values:
                steps = sorted(values)
                ax_v.plot(steps, [sum(values[s]) / len(values[s]) for s in steps], marker=".", label=name)
            if failures:
                steps = sorted(failures)
                ax_f.plot(steps, [failures[s] for s in steps], marker=".", label=name)
        ax_v.set(title="Scorer value (mean over scored responses)", xlabel="policy step", ylabel="value")
        ax_f.set(title="Scorer failures", xlabel="policy step", ylabel="failed responses")
        add_legend(ax_v)
        add_legend(ax_f)
        sec.plots.append(Plot("scorers", to_png(fig), "Per scorer: mean value and failures per policy step."))
    return sec
