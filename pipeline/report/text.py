"""The report's text sections: sample completions of the latest policy and of recent ones, and the folded
run config (last on the page)."""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from typing import Any

from pipeline.report.data import RunData, num
from pipeline.report.plots import Section, fmt
from pipeline.store import layout

_RECENT_POLICIES = 5
"""How many of the newest policies' `samples` metrics records the page shows."""


def _text_table(header: list[str], rows: Iterable[tuple[Any, ...]], text_cols: set[int]) -> str:
    """A table whose `text_cols` keep their line breaks and spaces (completions are shown as sampled)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="text">{html.escape(str(c))}</td>' if i in text_cols else f"<td>{html.escape(fmt(c))}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f'<table class="samples"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def samples_section(data: RunData) -> Section:
    """Completions of the latest policy (the newest rollout file, decoded) and the `samples` records that
    rollout workers logged for recent policies."""
    sec = Section("Sample completions")
    if data.samples:
        step = data.samples[0].policy_step
        sec.body.append(f"<p>Latest policy: step {step}, from <code>{html.escape(str(data.samples_file))}</code>.</p>")
        latest = [(s.lesson_id, s.prompt, s.completion, s.reward) for s in data.samples]
        sec.body.append(_text_table(["lesson", "prompt", "completion", "reward"], latest, {1, 2}))
    elif data.samples_file is not None:
        sec.no_data(f"decoded completions of {data.samples_file}: {data.samples_note or 'unreadable'}")
    else:
        sec.no_data(f"committed rollout files under {layout.ROLLOUTS}/")
    by_step: dict[int, dict[str, Any]] = {}
    for rec in data.sample_records:
        p = num(rec, "policy_step")
        if p is not None and isinstance(rec.get("samples"), list):
            by_step[int(p)] = rec
    recent = sorted(by_step.items())[-_RECENT_POLICIES:]
    if recent:
        rows = [
            (step, rec.get("lesson_id"), s.get("prompt"), s.get("completion"), s.get("reward"))
            for step, rec in reversed(recent)
            for s in rec["samples"]
            if isinstance(s, dict)
        ]
        sec.body.append("<h3>Recent policies (rollout metrics records)</h3>")
        sec.body.append(_text_table(["policy step", "lesson", "prompt", "completion", "reward"], rows, {2, 3}))
    return sec


def _none(text: str | None) -> str:
    return "(none found)" if text is None else text


def answers_section(data: RunData) -> Section:
    """Right and wrong samples per lesson (`pipeline.report.answers`): prompt, response, extracted answer and
    ground truth, from the newest eval rows and the newest rollout rows."""
    sec = Section("Right and wrong answers")
    if not data.answers:
        return sec.no_data("rollout or eval rows with response text (schema version 3)")
    header = ["source", "example", "prompt", "response", "extracted answer", "ground truth", "reward"]
    for lesson in sorted({a.lesson_id for a in data.answers}):
        for right in (True, False):
            picked = [a for a in data.answers if a.lesson_id == lesson and a.right == right]
            if not picked:
                continue
            rows = [
                (a.source, a.example_id, a.prompt, a.response, _none(a.extracted_answer), a.ground_truth, a.reward)
                for a in picked
            ]
            sec.body.append(f"<h3>{html.escape(lesson)}: {'right' if right else 'wrong'}</h3>")
            sec.body.append(_text_table(header, rows, {2, 3, 4, 5}))
    return sec


def _flatten(obj: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """Dotted (key, scalar) pairs of a JSON value; lists of scalars are shown inline."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, json.dumps(obj) if isinstance(obj, list) else obj


def config_section(data: RunData) -> Section:
    """Every field of the run's config (run.json), folded."""
    sec = Section("Run config")
    if data.run_config is None:
        return sec.no_data(f"{layout.RUN_CONFIG} (run config)")
    pairs = list(_flatten(data.run_config))
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(fmt(v))}</td></tr>" for k, v in pairs)
    table = f"<table><thead><tr><th>config field</th><th>value</th></tr></thead><tbody>{rows}</tbody></table>"
    sec.body.append(f"<details><summary>{len(pairs)} fields of {layout.RUN_CONFIG}</summary>{table}</details>")
    return sec
