"""The curriculum: lesson statistics, statuses and sampling weights, folded from committed files by one writer.

First half: pure, deterministic functions (no I/O, no clocks, no global RNG).
Second half: `CurriculumWriter` (the one writer, called by the BatchMaker) and `load_latest_curriculum`
(the readers: rollout workers, reports).

Semantics (Marin's curriculum, with its weak spots fixed; the constants are in `RULES`):

- Rewards are clipped to [0, 1] before anything else: r̃ = min(1, max(0, r)).
- Training success  s_train: bias-corrected EMA of r̃ over training rollouts, α = TRAIN_EMA_ALPHA (0.05, a memory
  of about 1/α = 20 samples). Bias correction (Adam's) replaces Marin's 0.5 prior, so the first samples are not
  pulled towards 0.5.
- Eval success      s_eval: bias-corrected EMA of full-evaluation summaries' `success_rate`, α = EVAL_EMA_ALPHA
  (0.5: the newest evaluation counts half). Only `eval_type == "eval"` summaries count; micro-evals are logs.
- Success rate      s = w·s_eval + (1 − w)·s_train with w = EVAL_WEIGHT (2/3) when both exist, else whichever
  exists, else unknown. Evaluation is weighted more: it is a deliberate, greedy measurement of one known policy,
  while training rewards mix lagged policies and sampling temperature. (Marin used training rewards only.)
- Plateau: least-squares line through the last `plateau_window` clipped training rewards; plateaued iff the window
  is full and (|slope|·window < plateau_threshold, or the slope is statistically indistinguishable from zero:
  |slope| < PLATEAU_MIN_T·SE(slope)). The second clause is our fix: per-episode rewards are 0/1 noise, whose
  fitted |slope|·window over 50 samples is ~0.25 on flat data, so the threshold alone (and Marin's extra CV < 0.1
  test) never fires on a noisy but flat lesson. A clean trend (SE ≈ 0) is never a plateau.
- Statuses move forward only: locked → unlocked → active → graduated.
  locked → unlocked: every dependency d has s_d ≥ reward_threshold and has plateaued (lessons without
  dependencies are unlocked at step 0). unlocked → active: start_threshold is 0, or s_eval ≥ start_threshold
  (Marin documents this and never used it). active → graduated: s_eval ≥ stop_threshold and plateaued (Marin
  compared training success; graduation now needs an evaluation).
- Sampling weights (active and graduated lessons only; locked and unlocked-not-active lessons get 0):
  raw_i = 4·s_i·(1 − s_i) + EXPLORATION_BONUS·exp(−n_i / EXPLORATION_SCALE)   (s unknown: 0.5; n_i training samples)
  p_i = f + (1 − K·f)·raw_i / Σ_active raw   (active),   p_g = f   (graduated),
  with f = minimum_sample_probability and K = #active + #graduated; if none is active, graduated lessons share
  uniformly. Marin's weight was base·(1 + bonus), zero for lessons at 0% or 100% whatever the bonus, and its
  floor was applied before renormalising, so the floor did not hold.

Every status change appends a `CurriculumEvent` with a human reason, e.g.
"`addition_medium` unlocked at step 40: `addition_easy` reached 0.82 ≥ 0.8 and plateaued over 50 samples".

Files (see `pipeline.layout`): the writer folds, for each batch slot T in order, the evaluation summaries of
policies S < T not yet folded (in (S, lesson) order) and then the rollout files the BatchMaker first read while
building slot T (batch log order), and publishes `curriculum/state-T.json` (schema `schemas.curriculum`) with
create-if-absent. The content is a function of those committed files only, so a writer restarted from its newest
published state, or rebuilt from nothing, writes the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

import schemas
from pipeline import layout
from pipeline.config import CurriculumConfig, LessonConfig
from pipeline.storage import CorruptFileError, RunStore
from schemas.base import SchemaMismatchError, ValidationError
from schemas.curriculum import (
    CURRICULUM_STATE,
    LESSON_STATUSES,
    CurriculumEvent,
    CurriculumStateRecord,
    LessonRecord,
)

__all__ = [
    "EVAL_EMA_ALPHA",
    "EVAL_WEIGHT",
    "EXPLORATION_BONUS",
    "EXPLORATION_SCALE",
    "LESSON_STATUSES",
    "PLATEAU_MIN_T",
    "RULES",
    "TRAIN_EMA_ALPHA",
    "CurriculumError",
    "CurriculumEvent",
    "CurriculumState",
    "CurriculumStateError",
    "CurriculumSyncError",
    "CurriculumWriter",
    "LessonRecord",
    "Trend",
    "bell_weight",
    "clip_reward",
    "config_fingerprint",
    "ema_update",
    "exploration_bonus",
    "fit_trend",
    "fold_eval",
    "fold_training",
    "initial_state",
    "is_plateaued",
    "latest_curriculum_slot",
    "load_curriculum_state",
    "load_latest_curriculum",
    "sample_lesson",
    "sampling_weights",
    "success_rate",
]

logger = logging.getLogger(__name__)

TRAIN_EMA_ALPHA = 0.05
"""EMA smoothing of training rewards (memory ≈ 1/α samples)."""
EVAL_EMA_ALPHA = 0.5
"""EMA smoothing of evaluation success rates (one per evaluated policy)."""
EVAL_WEIGHT = 2.0 / 3.0
"""Weight of eval success in the combined success rate when both eval and training data exist."""
EXPLORATION_BONUS = 0.5
"""Extra raw weight of a never-sampled lesson; decays with training samples."""
EXPLORATION_SCALE = 100.0
"""Training samples over which the exploration bonus decays by a factor e."""
PLATEAU_MIN_T = 2.0
"""A fitted slope within this many standard errors of zero counts as flat (≈95% two-sided)."""
UNKNOWN_SUCCESS = 0.5
"""Success rate assumed for weighting a lesson with no data yet (the peak: explore it)."""
EPS = 1e-9
"""Tolerance of threshold comparisons (a bias-corrected EMA of all-ones is 1 up to rounding)."""

RULES: dict[str, float] = {
    "train_ema_alpha": TRAIN_EMA_ALPHA,
    "eval_ema_alpha": EVAL_EMA_ALPHA,
    "eval_weight": EVAL_WEIGHT,
    "exploration_bonus": EXPLORATION_BONUS,
    "exploration_scale": EXPLORATION_SCALE,
    "plateau_min_t": PLATEAU_MIN_T,
    "unknown_success": UNKNOWN_SUCCESS,
}
"""The folding constants, recorded in every published state (and in its config fingerprint)."""


class CurriculumError(ValueError):
    """A curriculum operation was asked something impossible (unknown lesson, nothing to sample)."""


class CurriculumStateError(CurriculumError):
    """A published state file cannot be used (invalid, other schema, built from another config)."""


class CurriculumSyncError(CurriculumError):
    """The writer's inputs are not what the BatchMaker contract promises (missing slot, bad log entry)."""


# ---------------------------------------------------------------------------------------
# pure math
# ---------------------------------------------------------------------------------------


def clip_reward(r: float) -> float:
    """r̃ = min(1, max(0, r)): rewards as success in [0, 1]."""
    return min(1.0, max(0.0, float(r)))


def ema_update(prev: float | None, n_prev: int, x: float, alpha: float) -> float:
    """Bias-corrected exponential moving average after one more observation.

    ĉ_n = ĉ_{n−1} + (α / (1 − (1 − α)^n))·(x − ĉ_{n−1}),  n = n_prev + 1,  so ĉ_1 = x.
    Equals m_n / (1 − (1 − α)^n) for the plain EMA m_n = (1 − α)·m_{n−1} + α·x, m_0 = 0.
    """
    n = n_prev + 1
    if prev is None or n_prev == 0:
        return float(x)
    gain = alpha / (1.0 - (1.0 - alpha) ** n)
    return prev + gain * (x - prev)


@dataclasses.dataclass(frozen=True)
class Trend:
    """Least-squares line y ≈ a + slope·x over x = 0..n−1: its slope, the slope's standard error, and n."""

    slope: float
    se: float
    n: int

    @property
    def change(self) -> float:
        """|slope|·n: the fitted change over the window."""
        return abs(self.slope) * self.n

    @property
    def t(self) -> float:
        """|slope| / SE(slope); 0 for an exactly flat line, inf when SE is 0 (or undefined) and slope is not."""
        if self.slope == 0.0:
            return 0.0
        if self.se <= 0.0 or not math.isfinite(self.se):
            return math.inf
        return abs(self.slope) / self.se


def fit_trend(values: Sequence[float]) -> Trend:
    """Ordinary least squares of y_i on x_i = i.

    slope = Σ(x − x̄)(y − ȳ) / Σ(x − x̄)²,  SE = sqrt(Σ residual² / (n − 2) / Σ(x − x̄)²)  (inf when n ≤ 2).
    Fewer than two values: slope 0, SE inf.
    """
    n = len(values)
    if n < 2:
        return Trend(slope=0.0, se=math.inf, n=n)
    y = np.asarray(values, dtype=np.float64)
    x = np.arange(n, dtype=np.float64)
    xc = x - x.mean()
    sxx = float(np.dot(xc, xc))
    slope = float(np.dot(xc, y - y.mean())) / sxx
    if n <= 2:
        return Trend(slope=slope, se=math.inf, n=n)
    resid = y - (y.mean() + slope * xc)
    rss = float(np.dot(resid, resid))
    if rss < 1e-24:
        rss = 0.0
    se = math.sqrt(rss / (n - 2) / sxx)
    return Trend(slope=slope, se=se, n=n)


def is_plateaued(rewards: Sequence[float], window: int, threshold: float, min_t: float = PLATEAU_MIN_T) -> bool:
    """Whether the last `window` rewards are flat.

    Plateaued iff len(rewards) ≥ window and, for the least-squares fit over the last `window` values,
    |slope|·window < threshold  or  |slope| < min_t·SE(slope)  (min_t = 0 disables the second clause).
    """
    if len(rewards) < window:
        return False
    trend = fit_trend(list(rewards)[-window:])
    return trend.change < threshold or trend.t < min_t


def bell_weight(s: float) -> float:
    """4·s·(1 − s): 1 at s = 0.5, 0 at s ∈ {0, 1} (most RLOO signal from groups that sometimes succeed)."""
    return max(0.0, 4.0 * s * (1.0 - s))


def exploration_bonus(n_samples: int) -> float:
    """EXPLORATION_BONUS·exp(−n / EXPLORATION_SCALE): extra weight for rarely sampled lessons."""
    return EXPLORATION_BONUS * math.exp(-n_samples / EXPLORATION_SCALE)


def success_rate(lesson: LessonRecord) -> float | None:
    """s = EVAL_WEIGHT·s_eval + (1 − EVAL_WEIGHT)·s_train when both exist, else the one that exists, else None."""
    if lesson.eval_success is not None and lesson.train_success is not None:
        return EVAL_WEIGHT * lesson.eval_success + (1.0 - EVAL_WEIGHT) * lesson.train_success
    if lesson.eval_success is not None:
        return lesson.eval_success
    return lesson.train_success


def config_fingerprint(cfg: CurriculumConfig) -> str:
    """sha256 (16 hex) of what the folding depends on: lessons, dependencies, thresholds, windows, floor, RULES.

    Sampling params, environments and eval frequencies are left out: changing them does not change the state.
    """
    doc = {
        "minimum_sample_probability": cfg.minimum_sample_probability,
        "rules": RULES,
        "lessons": {
            k: {
                "dependencies": [[d.dependency_id, d.reward_threshold] for d in v.dependencies],
                "start_threshold": v.start_threshold,
                "stop_threshold": v.stop_threshold,
                "plateau_window": v.plateau_window,
                "plateau_threshold": v.plateau_threshold,
            }
            for k, v in sorted(cfg.lessons.items())
        },
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# the state and its transitions
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CurriculumState:
    """Per-lesson statistics and statuses after batch slot `step` (0: before any), plus every status change.

    Immutable: the fold functions return a new state. `config` is the curriculum the statistics are folded
    under; it is not serialised (the published file carries its fingerprint instead).
    """

    config: CurriculumConfig = dataclasses.field(repr=False)
    step: int
    lessons: Mapping[str, LessonRecord]
    events: tuple[CurriculumEvent, ...] = ()

    def status(self, lesson_id: str) -> str:
        """locked, unlocked, active or graduated."""
        return self._lesson(lesson_id).status

    def success(self, lesson_id: str) -> float | None:
        """The combined success rate `success_rate` of a lesson (None without data)."""
        return success_rate(self._lesson(lesson_id))

    def plateaued(self, lesson_id: str) -> bool:
        """Whether the lesson's training rewards have plateaued (`is_plateaued` with its window and threshold)."""
        lc = self.config.lessons[lesson_id]
        return is_plateaued(self._lesson(lesson_id).recent_rewards, lc.plateau_window, lc.plateau_threshold)

    def _lesson(self, lesson_id: str) -> LessonRecord:
        try:
            return self.lessons[lesson_id]
        except KeyError:
            raise CurriculumError(f"unknown lesson {lesson_id!r}; the curriculum has {sorted(self.lessons)}") from None

    def with_step(self, step: int) -> CurriculumState:
        """The same state labelled as after batch slot `step`."""
        return dataclasses.replace(self, step=step)

    def to_record(self) -> CurriculumStateRecord:
        """The published form: statistics, weights, events, config fingerprint and folding rules."""
        return CurriculumStateRecord(
            slot=self.step,
            config_fingerprint=config_fingerprint(self.config),
            rules=dict(RULES),
            lessons={k: self.lessons[k] for k in sorted(self.lessons)},
            weights=sampling_weights(self),
            events=self.events,
        )

    @staticmethod
    def from_record(rec: CurriculumStateRecord, cfg: CurriculumConfig, path: str = "<record>") -> CurriculumState:
        """Rebuild a state from its published form; CurriculumStateError if it was folded under another config."""
        expected = config_fingerprint(cfg)
        if rec.config_fingerprint != expected:
            raise CurriculumStateError(
                f"{path}: folded under curriculum config {rec.config_fingerprint}, this config is {expected} "
                f"(lessons, dependencies, thresholds, windows, floor or folding rules changed); restore the config, "
                f"or delete {layout.CURRICULUM}/ to rebuild the state from the committed files"
            )
        if set(rec.lessons) != set(cfg.lessons):
            raise CurriculumStateError(f"{path}: lessons {sorted(rec.lessons)} != config lessons {sorted(cfg.lessons)}")
        return CurriculumState(config=cfg, step=rec.slot, lessons=dict(rec.lessons), events=tuple(rec.events))


def _event(step: int, lesson_id: str, old: str, new: str, reason: str) -> CurriculumEvent:
    return CurriculumEvent(step=step, lesson_id=lesson_id, from_status=old, to_status=new, reason=reason)


def _dependency_block(state: CurriculumState, lesson: LessonConfig) -> list[str] | None:
    """None if some dependency is unmet; else one clause per dependency saying why it is met."""
    clauses = []
    for dep in lesson.dependencies:
        s = state.success(dep.dependency_id)
        if s is None or s < dep.reward_threshold - EPS or not state.plateaued(dep.dependency_id):
            return None
        window = state.config.lessons[dep.dependency_id].plateau_window
        clauses.append(
            f"`{dep.dependency_id}` reached {s:.3g} ≥ {dep.reward_threshold:.3g} and plateaued over {window} samples"
        )
    return clauses


def advance(state: CurriculumState, step: int) -> CurriculumState:
    """Apply every status transition the statistics now allow, in lesson-id order, recording each with its reason.

    locked → unlocked: every dependency's success ≥ its reward_threshold and plateaued.
    unlocked → active: start_threshold == 0, or eval success ≥ start_threshold.
    active → graduated: eval success ≥ stop_threshold and plateaued.
    One pass suffices: unlocking reads only statistics, never other lessons' statuses.
    """
    lessons = dict(state.lessons)
    events = list(state.events)
    for lid in sorted(lessons):
        lc = state.config.lessons[lid]
        rec = lessons[lid]
        status = rec.status
        if status == "locked":
            clauses = _dependency_block(state, lc)
            if clauses is not None:
                reason = "; ".join(clauses) if clauses else "no dependencies"
                events.append(_event(step, lid, status, "unlocked", f"`{lid}` unlocked at step {step}: {reason}"))
                status = "unlocked"
        if status == "unlocked":
            if lc.start_threshold <= 0.0:
                events.append(
                    _event(step, lid, status, "active", f"`{lid}` active at step {step}: start_threshold is 0")
                )
                status = "active"
            elif rec.eval_success is not None and rec.eval_success >= lc.start_threshold - EPS:
                events.append(
                    _event(
                        step,
                        lid,
                        status,
                        "active",
                        f"`{lid}` active at step {step}: eval success {rec.eval_success:.3g} ≥ "
                        f"start_threshold {lc.start_threshold:.3g}",
                    )
                )
                status = "active"
        if (
            status == "active"
            and rec.eval_success is not None
            and rec.eval_success >= lc.stop_threshold - EPS
            and state.plateaued(lid)
        ):
            events.append(
                _event(
                    step,
                    lid,
                    status,
                    "graduated",
                    f"`{lid}` graduated at step {step}: eval success {rec.eval_success:.3g} ≥ stop_threshold "
                    f"{lc.stop_threshold:.3g} and plateaued over {lc.plateau_window} samples",
                )
            )
            status = "graduated"
        if status != rec.status:
            lessons[lid] = dataclasses.replace(rec, status=status)
    if len(events) == len(state.events):
        return state
    return dataclasses.replace(state, lessons=lessons, events=tuple(events))


def initial_state(cfg: CurriculumConfig) -> CurriculumState:
    """Before any data: lessons without dependencies unlocked (and active if start_threshold is 0), others locked."""
    state = CurriculumState(config=cfg, step=0, lessons={k: LessonRecord(status="locked") for k in sorted(cfg.lessons)})
    return advance(state, 0)


def fold_training(state: CurriculumState, lesson_id: str, rewards: Sequence[float], step: int) -> CurriculumState:
    """Fold training episode rewards of one lesson, in order, then apply the transitions they allow.

    For each r: r̃ = clip_reward(r); s_train ← ema_update(s_train, n, r̃, TRAIN_EMA_ALPHA); n ← n + 1;
    recent_rewards keeps the last plateau_window r̃. `step` is the batch slot being folded (events carry it).
    """
    rec = state._lesson(lesson_id)
    if len(rewards) == 0:
        return state
    window = state.config.lessons[lesson_id].plateau_window
    s, n = rec.train_success, rec.train_samples
    clipped = [clip_reward(r) for r in rewards]
    for r in clipped:
        s = ema_update(s, n, r, TRAIN_EMA_ALPHA)
        n += 1
    recent = (rec.recent_rewards + tuple(clipped))[-window:]
    new = dataclasses.replace(rec, train_success=s, train_samples=n, recent_rewards=recent, last_train_slot=step)
    return advance(dataclasses.replace(state, lessons={**state.lessons, lesson_id: new}), step)


def fold_eval(
    state: CurriculumState, lesson_id: str, success: float, step: int, *, policy_step: int | None = None
) -> CurriculumState:
    """Fold one full-evaluation success rate of one lesson, then apply the transitions it allows.

    s_eval ← ema_update(s_eval, eval_count, clip(success), EVAL_EMA_ALPHA); eval_count ← eval_count + 1;
    last_eval_policy_step ← policy_step (if given). `step` is the batch slot being folded.
    """
    rec = state._lesson(lesson_id)
    if not math.isfinite(success):
        raise CurriculumError(f"lesson {lesson_id!r}: eval success rate must be finite, got {success!r}")
    x = clip_reward(success)
    new = dataclasses.replace(
        rec,
        eval_success=ema_update(rec.eval_success, rec.eval_count, x, EVAL_EMA_ALPHA),
        eval_count=rec.eval_count + 1,
        last_eval_policy_step=rec.last_eval_policy_step if policy_step is None else policy_step,
    )
    return advance(dataclasses.replace(state, lessons={**state.lessons, lesson_id: new}), step)


def sampling_weights(state: CurriculumState, cfg: CurriculumConfig | None = None) -> dict[str, float]:
    """Sampling probability of every lesson (sorted by id; sums to 1).

    raw_i = bell_weight(s_i) + exploration_bonus(n_i)   (s_i unknown: UNKNOWN_SUCCESS)
    p_i = f + (1 − K·f)·raw_i / Σ_active raw   for active lessons,   p = f for graduated ones,   0 otherwise,
    with f = minimum_sample_probability and K = #active + #graduated. No active lesson: graduated ones share
    uniformly. `cfg` defaults to the state's own config. Raises CurriculumError if no lesson can be sampled
    (impossible under a validated config: a lesson without dependencies and with start_threshold 0 is active
    from step 0 and statuses only move forward).
    """
    cfg = cfg or state.config
    floor = cfg.minimum_sample_probability
    ids = sorted(state.lessons)
    active = [k for k in ids if state.lessons[k].status == "active"]
    graduated = [k for k in ids if state.lessons[k].status == "graduated"]
    out = dict.fromkeys(ids, 0.0)
    k_total = len(active) + len(graduated)
    if k_total == 0:
        raise CurriculumError(
            "no lesson is active or graduated: " + ", ".join(f"{k}={state.lessons[k].status}" for k in ids)
        )
    if not active:
        for k in graduated:
            out[k] = 1.0 / len(graduated)
        return out
    raw = {}
    for k in active:
        s = success_rate(state.lessons[k])
        raw[k] = bell_weight(UNKNOWN_SUCCESS if s is None else s) + exploration_bonus(state.lessons[k].train_samples)
    total = sum(raw.values())
    free = 1.0 - k_total * floor
    for k in active:
        share = raw[k] / total if total > 0 else 1.0 / len(active)
        out[k] = floor + free * share
    for k in graduated:
        out[k] = floor
    return out


def sample_lesson(weights: Mapping[str, float], rng: np.random.Generator) -> str:
    """Draw one lesson id with probability ∝ weight (zero-weight lessons never), in sorted-id order for determinism."""
    ids = sorted(k for k, w in weights.items() if w > 0)
    if not ids:
        raise CurriculumError(f"no lesson has a positive sampling weight: {dict(weights)}")
    p = np.array([weights[k] for k in ids], dtype=np.float64)
    p = p / p.sum()
    return ids[int(rng.choice(len(ids), p=p))]


# ---------------------------------------------------------------------------------------
# files: the one writer, and the readers
# ---------------------------------------------------------------------------------------

_STATE_RE = re.compile(r"^state-(\d{8})\.json$")
_EVAL_DIR_RE = re.compile(r"^step-(\d{8})$")
_SUMMARY_SUFFIX = ".summary.parquet"


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _state_document(state: CurriculumState) -> dict[str, Any]:
    """The JSON object of a state; its `attempt_id` is the content hash, so equal content means equal bytes."""
    obj = CURRICULUM_STATE.to_json(state.to_record())
    obj["attempt_id"] = "sha256:" + hashlib.sha256(_canonical(obj)).hexdigest()[:32]
    return obj


def latest_curriculum_slot(store: RunStore) -> int | None:
    """The newest slot with a published state file (listing is the truth), or None."""
    slots = []
    for p in store.list(layout.CURRICULUM):
        m = _STATE_RE.match(p.rsplit("/", 1)[-1])
        if m:
            slots.append(int(m.group(1)))
    return max(slots) if slots else None


def load_curriculum_state(store: RunStore, slot: int, cfg: CurriculumConfig) -> CurriculumState:
    """Read and validate `curriculum/state-<slot>.json`.

    Raises FileNotFoundError if absent, CurriculumStateError (naming the path) if it is not valid JSON, not the
    declared schema/version, malformed, or folded under another curriculum config.
    """
    path = layout.curriculum_state(slot)
    try:
        obj = store.get_json(path)
        rec = CURRICULUM_STATE.from_json(obj, path)
    except FileNotFoundError:
        raise
    except (SchemaMismatchError, ValidationError, CorruptFileError) as e:
        raise CurriculumStateError(str(e)) from None
    if rec.slot != slot:
        raise CurriculumStateError(f"{path}: holds slot {rec.slot}, expected {slot}")
    return CurriculumState.from_record(rec, cfg, path)


def load_latest_curriculum(store: RunStore, cfg: CurriculumConfig) -> CurriculumState:
    """The newest published curriculum state, or `initial_state(cfg)` when none is published yet.

    For rollout workers: `sample_lesson(sampling_weights(state), rng)`. Raises CurriculumStateError if the newest
    file is unusable (see `load_curriculum_state`).
    """
    slot = latest_curriculum_slot(store)
    if slot is None:
        return initial_state(cfg)
    return load_curriculum_state(store, slot, cfg)


class CurriculumWriter:
    """The one writer of curriculum state. The BatchMaker calls `sync(T)` after committing batch slot T.

    Restart-safe: on its first sync it continues from the newest published state (or the initial state), and
    every state it publishes is a function of committed files only. Not thread-safe; one per process.
    """

    def __init__(self, store: RunStore, cfg: CurriculumConfig) -> None:
        self.store = store
        self.cfg = cfg
        self._state: CurriculumState | None = None

    @property
    def state(self) -> CurriculumState:
        """The newest state this writer folded or loaded (resumes from the files on first use)."""
        if self._state is None:
            self._state = load_latest_curriculum(self.store, self.cfg)
            logger.info("curriculum writer resumes after slot %d", self._state.step)
        return self._state

    def sync(self, up_to_slot: int, preloaded: Mapping[str, pa.Table] | None = None) -> CurriculumState:
        """Fold every committed batch slot ≤ up_to_slot not folded yet, publishing one state file per slot.

        Per slot T, in order: the evaluation summaries the slot's log entry names in `curriculum_evals` (the
        BatchMaker records `evals_to_fold(T)` there when it commits T, and their values, `eval_values`, in
        `curriculum_eval_values`, so a rebuild folds exactly what the live run folded, even after
        `evaluate --force`; entries without the values read the files; entries without the names fall back to
        the summaries listed now: policies S < T, eval_type
        "eval", lessons of this curriculum, S newer than the lesson's last folded one), in (S, lesson) order;
        then the rollout files of the entry's `ingested_files`, in that order, rows grouped per lesson (sorted
        ids, row order kept). `preloaded` maps rollout paths to tables the caller already read (avoids a second
        read). Returns the newest state. Raises CurriculumSyncError if a slot's log entry is missing or malformed.
        """
        state = self.state
        if up_to_slot <= state.step:
            return state
        listed: dict[int, list[str]] | None = None
        for slot in range(state.step + 1, up_to_slot + 1):
            entry = self._entry(slot)
            if "curriculum_evals" in entry:
                evals = self._evals_named(entry, slot)
            else:
                if listed is None:
                    listed = self._eval_summaries(state, up_to_slot)
                evals = listed
            state = self._fold_slot(state.with_step(slot), slot, evals, entry, preloaded or {})
            state = self._publish(state)
            self._state = state
        return state

    def evals_to_fold(self, slot: int) -> list[str]:
        """The eval summary paths that folding slot `slot` next would use, for its batch log entry.

        Call after `sync(slot - 1)`: committed summaries of policies S < slot newer than each lesson's last
        folded eval, sorted by (S, path).
        """
        state = self.state
        if state.step != slot - 1:
            raise CurriculumSyncError(f"evals_to_fold({slot}) needs the state of slot {slot - 1}, have {state.step}")
        found = self._eval_summaries(state, slot)
        return [p for s in sorted(found) for p in found[s]]

    def eval_values(self, paths: Sequence[str]) -> dict[str, list[float] | None]:
        """What folding each eval summary in `paths` would read: the success rates of its `eval` rows for its
        lesson (None: unreadable, quarantined). Recorded in the batch log entry next to `curriculum_evals`, so a
        rebuild folds the same values even if `evaluate --force` rewrote a summary since."""
        out: dict[str, list[float] | None] = {}
        for path in paths:
            lesson_id = path.rsplit("/", 1)[-1][: -len(_SUMMARY_SUFFIX)]
            table = self._read_eval_summary(path)
            out[path] = (
                None
                if table is None
                else [
                    row.success_rate
                    for row in schemas.EVAL_SUMMARY.from_table(table)
                    if row.eval_type == "eval" and row.lesson_id == lesson_id
                ]
            )
        return out

    def _evals_named(self, entry: Mapping[str, Any], slot: int) -> dict[int, list[str]]:
        names = entry["curriculum_evals"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CurriculumSyncError(
                f"{layout.batch_log_entry(slot)}: 'curriculum_evals' must be a list of paths; got {names!r}"
            )
        out: dict[int, list[str]] = {}
        for path in names:
            m = _EVAL_DIR_RE.match(path.rsplit("/", 2)[-2]) if path.count("/") >= 2 else None
            if m is None or not path.endswith(_SUMMARY_SUFFIX):
                raise CurriculumSyncError(f"{layout.batch_log_entry(slot)}: {path!r} is not an eval summary path")
            out.setdefault(int(m.group(1)), []).append(path)
        return out

    # -- one slot ------------------------------------------------------------------------
    def _fold_slot(
        self,
        state: CurriculumState,
        slot: int,
        evals: Mapping[int, Sequence[str]],
        entry: Mapping[str, Any],
        preloaded: Mapping[str, pa.Table],
    ) -> CurriculumState:
        recorded = entry.get("curriculum_eval_values")
        if recorded is not None and not isinstance(recorded, dict):
            raise CurriculumSyncError(
                f"{layout.batch_log_entry(slot)}: 'curriculum_eval_values' must map paths to values; got {recorded!r}"
            )
        for policy_step in sorted(s for s in evals if s < slot):
            for path in evals[policy_step]:
                lesson_id = path.rsplit("/", 1)[-1][: -len(_SUMMARY_SUFFIX)]
                if state.lessons[lesson_id].last_eval_policy_step >= policy_step:
                    continue
                if recorded is not None and path in recorded:  # the values the live fold read (see eval_values)
                    for success in recorded[path] or []:
                        state = fold_eval(state, lesson_id, float(success), slot, policy_step=policy_step)
                    continue
                state = self._fold_eval_file(state, slot, path, lesson_id, policy_step)
        for path in self._ingested_files(entry, slot):
            table = preloaded.get(path)
            if table is None:
                table = self.store.read_committed(path, schemas.ROLLOUT)
            if table is None:
                logger.warning("curriculum: %s (slot %d) is quarantined; its rewards are not folded", path, slot)
                continue
            state = self._fold_rollouts(state, slot, path, table)
        return state

    def _entry(self, slot: int) -> dict[str, Any]:
        path = layout.batch_log_entry(slot)
        try:
            entry = self.store.get_json(path)
        except FileNotFoundError:
            raise CurriculumSyncError(
                f"{path}: batch slot {slot} is not committed; sync(up_to_slot) may only name committed slots"
            ) from None
        if not isinstance(entry, dict):
            raise CurriculumSyncError(f"{path}: a batch log entry must be a JSON object; got {type(entry).__name__}")
        return entry

    def _ingested_files(self, entry: Mapping[str, Any], slot: int) -> list[str]:
        files = entry.get("ingested_files")
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise CurriculumSyncError(
                f"{layout.batch_log_entry(slot)}: needs 'ingested_files', a list of rollout paths; got {files!r}"
            )
        return files

    def _fold_rollouts(self, state: CurriculumState, slot: int, path: str, table: pa.Table) -> CurriculumState:
        lessons = table.column("lesson_id").to_pylist()
        rewards = table.column("episode_reward").to_pylist()
        by_lesson: dict[str, list[float]] = {}
        for lid, r in zip(lessons, rewards, strict=True):
            by_lesson.setdefault(lid, []).append(r)
        for lid in sorted(by_lesson):
            if lid not in state.lessons:
                logger.warning(
                    "curriculum: %s has %d rows of unknown lesson %r; skipped", path, len(by_lesson[lid]), lid
                )
                continue
            state = fold_training(state, lid, by_lesson[lid], slot)
        return state

    def _fold_eval_file(
        self, state: CurriculumState, slot: int, path: str, lesson_id: str, policy_step: int
    ) -> CurriculumState:
        table = self._read_eval_summary(path)
        if table is None:
            return state
        for row in schemas.EVAL_SUMMARY.from_table(table):
            if row.eval_type != "eval" or row.lesson_id != lesson_id:
                continue
            state = fold_eval(state, lesson_id, row.success_rate, slot, policy_step=policy_step)
        return state

    def _read_eval_summary(self, path: str) -> pa.Table | None:
        """The summary table, or None (quarantined before, vanished, or unreadable: quarantined now)."""
        if self.store.is_quarantined(path):
            return None
        try:
            return self.store.read_parquet(path, schemas.EVAL_SUMMARY)
        except FileNotFoundError:
            logger.warning("curriculum: eval summary %s vanished; skipped", path)
            return None
        except (SchemaMismatchError, CorruptFileError) as e:
            self.store.quarantine(path, f"unreadable eval summary: {e}")
            return None

    def _eval_summaries(self, state: CurriculumState, up_to_slot: int) -> dict[int, list[str]]:
        """Snapshot: {policy step S: sorted summary paths of this curriculum's lessons} for S in the unfolded range."""
        oldest = min(r.last_eval_policy_step for r in state.lessons.values())
        out: dict[int, list[str]] = {}
        for d in self.store.list(layout.EVALS):
            m = _EVAL_DIR_RE.match(d.rsplit("/", 1)[-1])
            if not m:
                continue  # external baselines and other folders do not steer the curriculum
            s = int(m.group(1))
            if s <= oldest or s >= up_to_slot:
                continue
            paths = [
                p
                for p in self.store.list(d)
                if p.endswith(_SUMMARY_SUFFIX) and p.rsplit("/", 1)[-1][: -len(_SUMMARY_SUFFIX)] in state.lessons
            ]
            if paths:
                out[s] = sorted(paths)
        return out

    # -- publish -------------------------------------------------------------------------
    def _publish(self, state: CurriculumState) -> CurriculumState:
        path = layout.curriculum_state(state.step)
        doc = _state_document(state)
        if self.store.put_json_if_absent(path, doc):
            for e in state.events:
                if e.step == state.step:
                    logger.info("curriculum: %s", e.reason)
            return state
        existing = self.store.get_json(path)
        if existing == doc:
            return state
        logger.warning(
            "curriculum: %s was already published with other content (another writer, or other inputs); "
            "adopting the published state",
            path,
        )
        return load_curriculum_state(self.store, state.step, self.cfg)
