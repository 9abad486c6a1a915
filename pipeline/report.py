"""One self-contained HTML report of a run, built from the run root alone (no tracker needed).

Reads (all relative to the run root, any fsspec URL: local path, file://, gs://, memory://):
    run.json                               run config excerpt for the summary table
    metrics/{learner,batchmaker,rollout}/*.jsonl   metrics records (pipeline.metrics)
    evals/*/<lesson>.summary.parquet       evaluation summaries (schemas.EVAL_SUMMARY): per checkpoint
                                           (step-S) and of external baselines (external-<name>)
    batches/log/step-T.json                committed batch slots; the data and dropped files they name
    batches/data/*.parquet                 only the `rollout_ids` lineage column of committed batches
    batches/dropped/*.parquet              rollouts dropped by the BatchMaker (schemas.dropped.DROPPED)
    curriculum/state-T.json                the newest readable state's "events" (every change so far)
    quarantine/*.json                      how many files were set aside

Writes `<out>/index.html` with every plot embedded as a base64 PNG (the page alone is the whole
report), and the same PNGs as `<out>/plots/<name>.png` for use elsewhere. The default `<out>` is
`<run_root>/report` for a local run root and `./report-<run name>` for a remote one (a reader of a
gs:// run needs no write access to it).

Sections: summary, reward per lesson, evaluation, staleness, throughput, learner idle time,
rollout fates, curriculum events. A section without data says "no data"; a section whose data is
malformed says so with the error and the rest of the report is still written.

Run it:
    python -m pipeline.report RUN_ROOT [--out DIR]      (or `make report RUN=...`)
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import io
import json
import logging
import math
import os
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import AutoLocator, MaxNLocator

from pipeline import layout
from pipeline.metrics import read_metrics
from pipeline.storage import CorruptFileError, RunStore, SchemaMismatchError
from schemas import BATCH, EVAL_SUMMARY
from schemas.dropped import DROPPED
from schemas.records import BatchLogEntry, RecordError

logger = logging.getLogger(__name__)

METRIC_KINDS = ("learner", "batchmaker", "rollout")
"""The metrics step kinds the report reads (evaluations come from their summary files, the authority)."""

SECTION_TITLES = (
    "Summary",
    "Reward per lesson",
    "Evaluation",
    "Staleness",
    "Throughput",
    "Learner idle time",
    "Rollout fates",
    "Curriculum events",
)
"""Every section of the report, in page order (each appears as an <h2>)."""

_READ_THREADS = 16
_MAX_CONFIG_ROWS = 60
_MAX_EVENT_ROWS = 500
_GROUPS_FILTERED_PREFIX = "groups_filtered_"
_LESSON_REWARD_PREFIX = "reward/"
_BATCHMAKER_ALIASES = (
    ("staleness_min", "lag_min"),
    ("staleness_mean", "lag_mean"),
    ("staleness_max", "lag_max"),
    ("mean_reward", "reward_mean"),
)
_EXTERNAL_PREFIX = "external-"


# ---------------------------------------------------------------------------------------
# reading the run root
# ---------------------------------------------------------------------------------------


def _get_many(store: RunStore, rels: Sequence[str]) -> list[bytes | None]:
    """Fetch objects concurrently; a missing or unreadable object gives None (logged)."""

    def one(rel: str) -> bytes | None:
        try:
            return store.get(rel)
        except (OSError, ValueError) as e:
            logger.warning("report: cannot read %s: %s", rel, e)
            return None

    if len(rels) <= 1:
        return [one(r) for r in rels]
    with ThreadPoolExecutor(max_workers=min(_READ_THREADS, len(rels))) as pool:
        return list(pool.map(one, rels))


def _parse_json(rel: str, data: bytes | None, notes: list[str]) -> Any:
    """Parsed JSON, or None when the object is missing or not JSON (then noted in `notes`)."""
    if data is None:
        return None
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        logger.warning("report: %s is not valid JSON: %s", rel, e)
        notes.append(f"{rel} is not valid JSON ({e})")
        return None


@dataclasses.dataclass
class RunData:
    """Everything the report shows, as read from one run root."""

    run_root: str
    run_config: dict[str, Any] | None = None
    metrics: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    eval_summaries: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    batch_slots: list[int] = dataclasses.field(default_factory=list)
    rollout_uses: int | None = None
    """Rollout uses summed over committed batches (None: no lineage found)."""
    rollouts_used: int | None = None
    """Distinct rollouts in committed batches (None: no lineage found)."""
    dropped_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    """Distinct dropped rollouts per reason."""
    curriculum_events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    quarantined: int = 0
    """Files set aside by any step (quarantine records)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Problems met while reading (unreadable files), shown in the summary."""


def _read_run_config(store: RunStore, data: RunData) -> None:
    obj = _parse_json(layout.RUN_CONFIG, _get_many(store, [layout.RUN_CONFIG])[0], data.notes)
    if isinstance(obj, dict):
        data.run_config = obj
    elif obj is not None:
        data.notes.append(f"{layout.RUN_CONFIG} is not a JSON object")


def _read_eval_summaries(store: RunStore, data: RunData, bad: set[str]) -> None:
    """Every evaluation summary `evals/step-S/<lesson>.summary.parquet` (its presence commits it)."""
    rels = [
        rel
        for eval_dir in store.list(layout.EVALS)
        for rel in store.list(eval_dir)
        if rel.endswith(".summary.parquet") and rel not in bad
    ]
    for rel, blob in zip(rels, _get_many(store, rels), strict=True):
        if blob is None:
            continue
        try:
            table = RunStore.parse_parquet(blob, EVAL_SUMMARY, rel)
        except (CorruptFileError, SchemaMismatchError) as e:
            data.notes.append(f"skipped evaluation summary {rel}: {e}")
            continue
        folder = rel.split("/")[-2]
        external = folder[len(_EXTERNAL_PREFIX) :] if folder.startswith(_EXTERNAL_PREFIX) else None
        for row in table.to_pylist():
            row["external"] = external
            data.eval_summaries.append(row)


def _find_strings(obj: Any) -> Iterable[str]:
    """Every string value inside a JSON value."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _find_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _find_strings(v)


def _read_batch_log(store: RunStore, data: RunData) -> tuple[list[str], list[str], dict[int, str]]:
    """Committed batch slots; returns the batch data files and dropped files their log entries name,
    and each slot's attempt id."""
    log_rels = [r for r in store.list(layout.BATCH_LOG) if r.endswith(".json")]
    data_files: set[str] = set()
    dropped_files: set[str] = set()
    attempts: dict[int, str] = {}
    for rel, blob in zip(log_rels, _get_many(store, log_rels), strict=True):
        try:
            slot = layout.parse_step(rel)
        except ValueError:
            continue
        data.batch_slots.append(slot)
        entry = _parse_json(rel, blob, data.notes)
        try:
            record = BatchLogEntry.from_json(entry, path=rel) if isinstance(entry, dict) else None
        except RecordError as e:  # not a valid record: still show what it names, and say so
            data.notes.append(str(e))
            record = None
        if record is not None:
            data_files.add(record.data_file)
            if record.dropped_file is not None:
                dropped_files.add(record.dropped_file)
            attempts[slot] = record.attempt_id
            continue
        for s in _find_strings(entry):
            for folder, found in ((layout.BATCH_DATA, data_files), (layout.BATCH_DROPPED, dropped_files)):
                if s.endswith(".parquet") and folder + "/" in s:
                    found.add(s[s.index(folder) :])
        if isinstance(entry, dict) and isinstance(entry.get("attempt_id"), str):
            attempts[slot] = entry["attempt_id"]
    data.batch_slots.sort()
    return sorted(data_files), sorted(dropped_files), attempts


def _read_lineage(store: RunStore, data: RunData, data_files: Sequence[str]) -> None:
    """Count rollout uses from the `rollout_ids` lineage column of committed batch files."""
    if not data_files:
        return
    ids: list[str] = []
    unreadable = 0
    for rel, blob in zip(data_files, _get_many(store, data_files), strict=True):
        if blob is None:
            unreadable += 1
            continue
        try:
            pf = pq.ParquetFile(pa.BufferReader(blob))
            BATCH.check_metadata(pf.schema_arrow.metadata, rel)
            table = pf.read(columns=["rollout_ids"])
        except (pa.ArrowException, OSError, ValueError) as e:  # SchemaMismatchError is a ValueError
            logger.warning("report: skipping batch file %s: %s", rel, e)
            unreadable += 1
            continue
        for seg_ids in table.column("rollout_ids").to_pylist():
            ids.extend(seg_ids or [])
    if unreadable:
        data.notes.append(f"{unreadable} committed batch data file(s) unreadable: rollout counts are partial")
    data.rollout_uses = len(ids)
    data.rollouts_used = len(set(ids))


def _read_dropped(store: RunStore, data: RunData, named: Sequence[str], attempts: dict[int, str]) -> None:
    """Distinct dropped rollouts per reason, read through `schemas.dropped.DROPPED`.

    Only the files that committed batch log entries name count (others are leftovers of attempts that
    lost a slot race). Without such names (older logs), every file in `batches/dropped/` counts except
    those of another attempt than the one a slot's log entry records.
    """
    rels = list(named)
    if not rels:

        def committed(rel: str) -> bool:
            try:
                slot = layout.parse_step(rel)
            except ValueError:
                return True
            attempt = attempts.get(slot)
            return attempt is None or rel.endswith(f"{layout.step_name(slot)}-{attempt}.parquet")

        rels = [r for r in store.list(layout.BATCH_DROPPED) if r.endswith(".parquet") and committed(r)]
    reason_of: dict[str, str] = {}
    for rel, blob in zip(rels, _get_many(store, rels), strict=True):
        if blob is None:
            data.notes.append(f"dropped-rollout file {rel} is missing")
            continue
        try:
            table = RunStore.parse_parquet(blob, DROPPED, rel)
        except (CorruptFileError, SchemaMismatchError) as e:
            data.notes.append(f"skipped dropped-rollout file {rel}: {e}")
            continue
        for rid, reason in zip(table.column("rollout_id").to_pylist(), table.column("reason").to_pylist(), strict=True):
            reason_of[str(rid)] = str(reason)
    counts: dict[str, int] = defaultdict(int)
    for reason in reason_of.values():
        counts[reason] += 1
    data.dropped_by_reason = dict(sorted(counts.items()))


def _read_curriculum(store: RunStore, data: RunData) -> None:
    """The events of the newest readable curriculum state (each state lists every event so far)."""
    rels = [r for r in store.list(layout.CURRICULUM) if r.endswith(".json")]
    for rel in reversed(rels):
        state = _parse_json(rel, _get_many(store, [rel])[0], data.notes)
        events = state.get("events") if isinstance(state, dict) else None
        if not isinstance(events, list):
            if state is not None:
                data.notes.append(f"{rel} has no 'events' list")
            continue
        data.curriculum_events = [ev for ev in events if isinstance(ev, dict)]
        data.curriculum_events.sort(key=lambda e: _num(e, "step") or 0.0)  # stable: keeps the writer's order
        return


def _normalise_metrics(metrics: dict[str, list[dict[str, Any]]]) -> None:
    """Fill canonical field names from known aliases and keep only rollout-write records.

    BatchMaker stats may name staleness `lag_min/lag_mean/lag_max` and the batch reward `reward_mean`;
    rollout workers also log non-write events (weights, empty, micro_eval, stop) that are no training data.
    """
    for rec in metrics.get("batchmaker", []):
        for canonical, alias in _BATCHMAKER_ALIASES:
            if canonical not in rec and alias in rec:
                rec[canonical] = rec[alias]
    if "rollout" in metrics:
        metrics["rollout"] = [r for r in metrics["rollout"] if r.get("event", "write") == "write"]


def load_run(run_root: str, storage_options: dict[str, Any] | None = None) -> RunData:
    """Read everything the report shows from `run_root` (missing parts stay empty, never raise)."""
    store = RunStore(run_root, storage_options)  # read only: the report never writes into the run root
    data = RunData(run_root=run_root)
    bad = store.quarantined()
    data.quarantined = len(bad)
    _read_run_config(store, data)
    for kind in METRIC_KINDS:
        data.metrics[kind] = read_metrics(store, kind)
    _normalise_metrics(data.metrics)
    _read_eval_summaries(store, data, bad)
    data_files, dropped_files, attempts = _read_batch_log(store, data)
    _read_lineage(store, data, [f for f in data_files if f not in bad])
    _read_dropped(store, data, [f for f in dropped_files if f not in bad], attempts)
    _read_curriculum(store, data)
    return data


# ---------------------------------------------------------------------------------------
# record helpers
# ---------------------------------------------------------------------------------------


def _num(rec: dict[str, Any], key: str) -> float | None:
    """`rec[key]` as a finite float, or None when missing, non-numeric or not finite."""
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _last_per(records: Iterable[dict[str, Any]], key: str) -> dict[int, dict[str, Any]]:
    """The last record (by time) for each integer value of `key` (a rerun step overrides)."""
    out: dict[int, dict[str, Any]] = {}
    for rec in records:
        k = _num(rec, key)
        if k is not None:
            out[int(k)] = rec
    return dict(sorted(out.items()))


def _series(by_x: dict[int, dict[str, Any]], field: str) -> tuple[list[int], list[float]]:
    """(x, y) of the records that carry a numeric `field`."""
    xs, ys = [], []
    for x, rec in by_x.items():
        y = _num(rec, field)
        if y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def fmt(value: Any) -> str:
    """How the report prints a value: floats with 4 significant digits, others as text."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _t0(data: RunData) -> float | None:
    times = [t for recs in data.metrics.values() for r in recs if (t := _num(r, "time")) is not None]
    return min(times) if times else None


# ---------------------------------------------------------------------------------------
# HTML and figure helpers
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plot:
    """One PNG figure of a section."""

    name: str
    png: bytes
    caption: str


@dataclasses.dataclass
class Section:
    """One titled part of the page: HTML fragments and plots."""

    title: str
    body: list[str] = dataclasses.field(default_factory=list)
    plots: list[Plot] = dataclasses.field(default_factory=list)

    def no_data(self, what: str) -> Section:
        """Add a 'no data' note naming what was looked for."""
        self.body.append(f'<p class="nodata">no data: {html.escape(what)}</p>')
        return self


def _figure(n_axes: int, width: float = 11.0, height: float = 3.6) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, n_axes, i + 1) for i in range(n_axes)]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # most x axes are steps
    return fig, axes


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def _legend(ax: Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ---------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------


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


def summary_section(data: RunData) -> Section:
    """Headline numbers: steps, first/last reward, drops, idle fraction, latest evals, config excerpt."""
    sec = Section("Summary")
    learner = _last_per(data.metrics.get("learner", []), "step")
    bm = _last_per(data.metrics.get("batchmaker", []), "slot")
    rows: list[tuple[str, Any]] = [("run root", data.run_root)]
    rows.append(("learner steps", f"{len(learner)} (last step {max(learner)})" if learner else None))
    rows.append(("committed batch slots", f"{len(data.batch_slots)}" if data.batch_slots else None))
    _, rewards = _series(bm, "mean_reward")
    source = "BatchMaker"
    if not rewards:
        rewards = [r for rec in data.metrics.get("rollout", []) if (r := _num(rec, "mean_reward")) is not None]
        source = "rollout workers"
    rows.append((f"first mean reward ({source})", rewards[0] if rewards else None))
    rows.append((f"last mean reward ({source})", rewards[-1] if rewards else None))
    wait = sum(v for r in learner.values() if (v := _num(r, "wait_s")) is not None)
    train = sum(v for r in learner.values() if (v := _num(r, "train_s")) is not None)
    rows.append(("learner idle fraction (wait / (wait + train))", wait / (wait + train) if wait + train > 0 else None))
    _, st = _series(bm, "staleness_mean")
    rows.append(("mean staleness (policy steps of lag)", sum(st) / len(st) if st else None))
    rows.append(("rollouts used (distinct)", data.rollouts_used))
    dropped = sum(data.dropped_by_reason.values())
    rows.append(("rollouts dropped", dropped if data.dropped_by_reason else None))
    rows.append(("quarantined files", data.quarantined))
    t0 = _t0(data)
    t1 = max((t for recs in data.metrics.values() for r in recs if (t := _num(r, "time")) is not None), default=None)
    if t0 is not None and t1 is not None:
        span = t1 - t0
        rows.append(("wall time covered by metrics", f"{fmt(span / 60.0)} min" if span >= 120 else f"{fmt(span)} s"))
    latest: dict[str, dict[str, Any]] = {}
    for row in sorted(data.eval_summaries, key=lambda r: _num(r, "policy_step") or 0.0):
        if not row.get("external"):
            latest[_eval_name(row)] = row
    for name, row in latest.items():
        rows.append(
            (
                f"latest eval {name} @ policy step {row.get('policy_step')}",
                f"mean reward {fmt(row.get('mean_reward'))}, success rate {fmt(row.get('success_rate'))}",
            )
        )
    sec.body.append(_table(["quantity", "value"], rows))
    if data.notes:
        items = "".join(f"<li>{html.escape(n)}</li>" for n in data.notes)
        sec.body.append(f'<p class="warn">Problems met while reading the run root:</p><ul>{items}</ul>')
    if data.run_config is None:
        sec.no_data(f"{layout.RUN_CONFIG} (run config)")
    else:
        pairs = list(_flatten(data.run_config))
        more = len(pairs) - _MAX_CONFIG_ROWS
        table = _table(["config field", "value"], pairs[:_MAX_CONFIG_ROWS])
        tail = f"<p>… {more} more fields in {layout.RUN_CONFIG}</p>" if more > 0 else ""
        sec.body.append(f"<details open><summary>Run config ({layout.RUN_CONFIG})</summary>{table}{tail}</details>")
    return sec


def reward_section(data: RunData) -> Section:
    """Reward per lesson vs batch slot (BatchMaker) and vs policy step (rollout workers)."""
    sec = Section("Reward per lesson")
    bm = _last_per(data.metrics.get("batchmaker", []), "slot")
    lessons = sorted({k for rec in bm.values() for k in rec if k.startswith(_LESSON_REWARD_PREFIX)})
    has_bm = bool(_series(bm, "mean_reward")[0]) or bool(lessons)
    by_lesson: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rec in data.metrics.get("rollout", []):
        step, reward = _num(rec, "policy_step"), _num(rec, "mean_reward")
        if step is not None and reward is not None:
            by_lesson[str(rec.get("lesson_id", "all"))][int(step)].append(reward)
    if not has_bm and not by_lesson:
        return sec.no_data("mean_reward in batchmaker or rollout metrics")
    fig, axes = _figure(int(has_bm) + int(bool(by_lesson)))
    i = 0
    if has_bm:
        ax = axes[i]
        i += 1
        xs, ys = _series(bm, "mean_reward")
        if xs:
            ax.plot(xs, ys, color="black", lw=2, label="all lessons")
        for key in lessons:
            xs, ys = _series(bm, key)
            ax.plot(xs, ys, marker=".", label=key[len(_LESSON_REWARD_PREFIX) :])
        ax.set(title="Batch mean reward (BatchMaker)", xlabel="batch slot (learner step)", ylabel="mean reward")
        _legend(ax)
    if by_lesson:
        ax = axes[i]
        for lesson, per_step in sorted(by_lesson.items()):
            steps = sorted(per_step)
            ax.plot(steps, [sum(per_step[s]) / len(per_step[s]) for s in steps], marker=".", label=lesson)
        ax.set(title="Rollout mean reward (rollout workers)", xlabel="policy step", ylabel="mean reward")
        _legend(ax)
    sec.plots.append(Plot("reward", _png(fig), "Mean episode reward per lesson."))
    return sec


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
        elif _num(row, "policy_step") is not None:
            curves[_eval_name(row)][int(row["policy_step"])] = row
    if not curves and not baselines:
        return sec.no_data("evals/*/<lesson>.summary.parquet")
    fig, axes = _figure(2)
    fields = ("mean_reward", "success_rate")
    for name, per_step in sorted(curves.items()):
        steps = sorted(per_step)
        for ax, field in zip(axes, fields, strict=True):
            pts = [(s, v) for s in steps if (v := _num(per_step[s], field)) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for name, row in sorted(baselines.items()):
        for ax, field in zip(axes, fields, strict=True):
            if (v := _num(row, field)) is not None:
                ax.axhline(v, ls="--", lw=1, color="gray", label=f"baseline {name}")
    axes[0].set(title="Eval mean reward per checkpoint", xlabel="policy step", ylabel="mean reward")
    axes[1].set(title="Eval success rate per checkpoint", xlabel="policy step", ylabel="success rate")
    for ax in axes:
        _legend(ax)
    sec.plots.append(Plot("eval", _png(fig), "Evaluation of each committed checkpoint, per lesson."))
    newest: list[tuple[str, int | str, dict[str, Any]]]
    newest = [(name, max(per_step), per_step[max(per_step)]) for name, per_step in sorted(curves.items())]
    newest += [(f"baseline {name}", "external", row) for name, row in sorted(baselines.items())]
    rows = [
        (name, step, r.get("n_examples"), r.get("mean_reward"), r.get("success_rate"),
         r.get("mean_response_tokens"), r.get("truncation_rate"))
        for name, step, r in newest
    ]  # fmt: skip
    header = ["lesson", "policy step", "examples", "mean reward", "success rate", "response tokens", "truncation"]
    sec.body.append(_table(header, rows))
    return sec


def staleness_section(data: RunData) -> Section:
    """Staleness (lag in policy steps) of the rollouts in each batch: min, mean, max."""
    sec = Section("Staleness")
    bm = _last_per(data.metrics.get("batchmaker", []), "slot")
    xs, mean = _series(bm, "staleness_mean")
    xlo, lo = _series(bm, "staleness_min")
    xhi, hi = _series(bm, "staleness_max")
    if not (xs or xlo or xhi):
        return sec.no_data("staleness_min/mean/max in batchmaker metrics")
    fig, (ax,) = _figure(1, width=8.0)
    if xlo and xhi and xlo == xhi:
        ax.fill_between(xlo, lo, hi, alpha=0.25, label="min to max")
    else:
        ax.plot(xlo, lo, ls="--", label="min")
        ax.plot(xhi, hi, ls="--", label="max")
    ax.plot(xs, mean, marker=".", label="mean")
    ax.set(title="Rollout lag per batch: (T-1) - policy step", xlabel="batch slot T", ylabel="lag (policy steps)")
    _legend(ax)
    sec.plots.append(Plot("staleness", _png(fig), "Lag of the rollouts used in each batch (DESIGN §4)."))
    return sec


def throughput_section(data: RunData) -> Section:
    """Rollouts/s and tokens/s per rollout worker over time; learner tokens/s per step."""
    sec = Section("Throughput")
    t0 = _t0(data) or 0.0
    t_end = max((t for r in data.metrics.get("rollout", []) if (t := _num(r, "time")) is not None), default=t0)
    unit, scale = ("minutes", 60.0) if t_end - t0 >= 120.0 else ("seconds", 1.0)
    per_worker: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in data.metrics.get("rollout", []):
        per_worker[str(rec.get("worker", "?"))].append(rec)
    learner = _last_per(data.metrics.get("learner", []), "step")
    panels: list[tuple[str, str, Callable[[Axes], bool]]] = []

    def worker_panel(field: str) -> Callable[[Axes], bool]:
        def draw(ax: Axes) -> bool:
            drawn = False
            for worker, recs in sorted(per_worker.items()):
                pts = [
                    ((t - t0) / scale, v)
                    for r in recs
                    if (t := _num(r, "time")) is not None and (v := _num(r, field)) is not None
                ]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=worker)
                    drawn = True
            ax.set(xlabel=f"{unit} since run start")
            ax.xaxis.set_major_locator(AutoLocator())
            return drawn

        return draw

    def learner_panel(ax: Axes) -> bool:
        xs, ys = _series(learner, "tokens_per_s")
        ax.plot(xs, ys, marker=".", color="tab:red")
        ax.set(xlabel="learner step")
        return bool(xs)

    panels = [
        ("Rollouts/s per worker", "rollouts_per_s", worker_panel("rollouts_per_s")),
        ("Rollout tokens/s per worker", "tokens_per_s", worker_panel("tokens_per_s")),
        ("Learner tokens/s", "tokens_per_s", learner_panel),
    ]
    fig, axes = _figure(3, width=13.0)
    drawn = [draw(ax) for ax, (_, _, draw) in zip(axes, panels, strict=True)]
    if not any(drawn):
        return sec.no_data("rollouts_per_s / tokens_per_s in rollout and learner metrics")
    for ax, (title, ylabel, _), ok in zip(axes, panels, drawn, strict=True):
        ax.set(title=title if ok else f"{title}: no data", ylabel=ylabel)
        _legend(ax)
    sec.plots.append(Plot("throughput", _png(fig), "Sampling and training throughput."))
    return sec


def idle_section(data: RunData) -> Section:
    """Learner time per step split into waiting for a batch and training, and the idle fraction."""
    sec = Section("Learner idle time")
    learner = _last_per(data.metrics.get("learner", []), "step")
    steps = [s for s, r in learner.items() if _num(r, "wait_s") is not None or _num(r, "train_s") is not None]
    if not steps:
        return sec.no_data("wait_s / train_s in learner metrics")
    wait = [_num(learner[s], "wait_s") or 0.0 for s in steps]
    train = [_num(learner[s], "train_s") or 0.0 for s in steps]
    fig, (ax1, ax2) = _figure(2)
    ax1.bar(steps, wait, color="tab:orange", label="waiting for batch")
    ax1.bar(steps, train, bottom=wait, color="tab:blue", label="training")
    ax1.set(title="Learner time per step", xlabel="learner step", ylabel="seconds")
    _legend(ax1)
    frac = [w / (w + t) if w + t > 0 else 0.0 for w, t in zip(wait, train, strict=True)]
    cum_w, cum_t, cum = 0.0, 0.0, []
    for w, t in zip(wait, train, strict=True):
        cum_w, cum_t = cum_w + w, cum_t + t
        cum.append(cum_w / (cum_w + cum_t) if cum_w + cum_t > 0 else 0.0)
    ax2.plot(steps, frac, marker=".", label="per step")
    ax2.plot(steps, cum, color="black", label="cumulative")
    ax2.set(title="Idle fraction wait / (wait + train)", xlabel="learner step", ylabel="fraction", ylim=(0.0, 1.05))
    _legend(ax2)
    total = sum(wait) + sum(train)
    overall = sum(wait) / total if total > 0 else 0.0
    sec.body.append(
        f"<p>The learner waited {fmt(sum(wait))} s and trained {fmt(sum(train))} s: idle fraction {fmt(overall)}.</p>"
    )
    sec.plots.append(Plot("learner_idle", _png(fig), "Where the learner's wall time went."))
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
    for rec in _last_per(data.metrics.get("batchmaker", []), "slot").values():
        for k in rec:
            if k.startswith(_GROUPS_FILTERED_PREFIX) and (v := _num(rec, k)) is not None:
                filtered[k[len(_GROUPS_FILTERED_PREFIX) :]] += v
        if (v := _num(rec, "groups_used")) is not None:
            filtered.setdefault("(used)", 0.0)
            filtered["(used)"] += v
    if not bars and not filtered:
        return sec.no_data("batch lineage, batches/dropped/*.parquet, groups_* in batchmaker metrics")
    fig, axes = _figure(
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
        sec.body.append(_table(["fate", "rollouts"], rows))
    sec.plots.append(Plot("rollout_fates", _png(fig), "Every rollout is used or dropped with a recorded reason."))
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
    sec.body.append(_table(["step", "lesson", "event", "reason"], rows))
    if len(data.curriculum_events) > len(events):
        sec.body.append(f"<p>… {len(data.curriculum_events) - len(events)} more events not shown.</p>")
    return sec


SECTIONS: tuple[Callable[[RunData], Section], ...] = (
    summary_section,
    reward_section,
    eval_section,
    staleness_section,
    throughput_section,
    idle_section,
    fates_section,
    curriculum_section,
)
"""Section builders in page order (titles: SECTION_TITLES)."""


# ---------------------------------------------------------------------------------------
# page
# ---------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1300px; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } .nodata { color: #888; font-style: italic; } .warn { color: #a40; }
img { max-width: 100%; } figcaption { color: #555; font-size: 0.85em; } nav a { margin-right: 1em; }
"""


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _build_sections(data: RunData) -> list[Section]:
    sections = []
    for build, title in zip(SECTIONS, SECTION_TITLES, strict=True):
        try:
            sections.append(build(data))
        except Exception as e:  # a malformed record must not cost the rest of the report
            logger.exception("report: section %r failed", title)
            sec = Section(title)
            sec.body.append(
                f'<p class="warn">section failed: {html.escape(type(e).__name__)}: {html.escape(str(e))}</p>'
            )
            sections.append(sec)
    return sections


def render_html(data: RunData, sections: Sequence[Section]) -> str:
    """The whole page, every plot embedded as a base64 PNG."""
    nav = "".join(f'<a href="#{_anchor(s.title)}">{html.escape(s.title)}</a>' for s in sections)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>rlpipe report: {html.escape(data.run_root)}</title><style>{_CSS}</style></head><body>",
        f"<h1>rlpipe run report</h1><p><code>{html.escape(data.run_root)}</code> — generated "
        f"{html.escape(time.strftime('%Y-%m-%d %H:%M:%S %Z'))}</p><nav>{nav}</nav>",
    ]
    for sec in sections:
        parts.append(f'<section id="{_anchor(sec.title)}"><h2>{html.escape(sec.title)}</h2>')
        parts.extend(sec.body)
        for plot in sec.plots:
            b64 = base64.b64encode(plot.png).decode()
            parts.append(
                f'<figure><img alt="{html.escape(plot.name)}" src="data:image/png;base64,{b64}">'
                f"<figcaption>{html.escape(plot.caption)}</figcaption></figure>"
            )
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def default_out_dir(run_root: str) -> str:
    """`<run_root>/report` for a local run root; `./report-<run name>` for a remote one."""
    protocol, path = fsspec.core.split_protocol(run_root)
    if protocol in (None, "file", "local"):
        return os.path.join(os.path.abspath(os.path.expanduser(path)), "report")
    name = run_root.rstrip("/").rsplit("/", 1)[-1] or "run"
    return os.path.join(os.getcwd(), f"report-{name}")


def build_report(run_root: str, out_dir: str | None = None, storage_options: dict[str, Any] | None = None) -> str:
    """Write the report of `run_root` to `out_dir` and return the path of its `index.html`.

    Reads only the run root (local path or fsspec URL, with `storage_options` for its file
    system). `out_dir` may be local or an fsspec URL (opened with default options); its default is
    `default_out_dir(run_root)`. Sections without data say so; this never raises for missing data.
    """
    data = load_run(run_root, storage_options)
    sections = _build_sections(data)
    page = render_html(data, sections)
    out = out_dir or default_out_dir(run_root)
    out_store = RunStore(out)  # atomic writes, local or remote
    for sec in sections:
        for plot in sec.plots:
            out_store.put_unique(f"plots/{plot.name}.png", plot.png)
    out_store.put_unique("index.html", page.encode())
    path = out_store.full_path("index.html") if out_store.is_local else f"{out.rstrip('/')}/index.html"
    logger.info("report of %s written to %s", run_root, path)
    return str(path)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: `python -m pipeline.report RUN_ROOT [--out DIR]`; prints the path of index.html."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_root", help="run root: local folder or fsspec URL (gs://bucket/run)")
    parser.add_argument("--out", default=None, help="output folder (default: <run_root>/report if local)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(build_report(args.run_root, args.out))


if __name__ == "__main__":
    main()
