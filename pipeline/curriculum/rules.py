"""The curriculum's pure rules: lesson statistics, statuses, events and sampling weights.

Deterministic functions of their arguments (no I/O, no clocks, no global RNG); the semantics are stated in the
`pipeline.curriculum` package docstring.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from pipeline.config import CurriculumConfig, LessonConfig
from pipeline.store import layout
from schemas.curriculum import (
    CurriculumEvent,
    CurriculumStateRecord,
    LessonRecord,
    PromptRecord,
)

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
SATURATION_WINDOW = 16
"""Training groups (rows of one (group_key, policy_step) in a folded rollout file) over which saturation is judged."""
SATURATION_FRACTION = 0.9
"""A lesson is saturated when at least this fraction of its last `SATURATION_WINDOW` groups had all rewards equal:
with zero-variance filtering the BatchMaker drops (almost) every row sampled from it (with 8 samples per group a
binary reward gets there at a success rate of about 0.99 or 0.01)."""
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


def is_saturated(recent_groups: Sequence[int], window: int = SATURATION_WINDOW,
                 fraction: float = SATURATION_FRACTION) -> bool:  # fmt: skip
    """Whether a lesson is saturated: its last `window` groups are known (the window is full) and at least
    `fraction` of them had all rewards equal (`recent_groups`: 1 per such group, 0 per group with signal)."""
    if len(recent_groups) < window:
        return False
    return sum(recent_groups[-window:]) >= fraction * window - EPS


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

    Sampling params, environments, eval frequencies and `retest_rate` are left out: changing them does not change
    the state. `skip_after` and `max_tracked_prompts` are in only when `skip_after` > 0 (they decide the per-prompt
    records then; a curriculum without them keeps the fingerprint it had before they existed).
    """
    doc: dict[str, object] = {
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
    if cfg.skip_after > 0:
        doc["prompt_skip"] = {"skip_after": cfg.skip_after, "max_tracked_prompts": cfg.max_tracked_prompts}
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

    def saturated(self, lesson_id: str) -> bool:
        """Whether the lesson's recent training groups were (almost) all without signal (`is_saturated`)."""
        return is_saturated(self._lesson(lesson_id).recent_groups)

    def skipped_prompts(self, lesson_id: str) -> frozenset[str]:
        """The example ids training draws of this lesson pass over (`curriculum.skip_after` > 0): prompts whose
        newest `skip_after` draws in a row had no reward spread, with the same reward each time. Empty when off."""
        k = self.config.skip_after
        if k <= 0:
            return frozenset()
        return frozenset(p for p, r in self._lesson(lesson_id).prompts.items() if r.streak >= k)

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


def fold_groups(state: CurriculumState, lesson_id: str, zero_variance: Sequence[bool]) -> CurriculumState:
    """Fold one rollout file's training groups of one lesson, in order: `zero_variance[i]` says whether group i's
    rewards were all equal. recent_groups keeps the last `SATURATION_WINDOW` (1: all equal, 0: signal). No status
    changes: saturation only moves sampling weight (`sampling_weights`)."""
    rec = state._lesson(lesson_id)
    if len(zero_variance) == 0:
        return state
    recent = (rec.recent_groups + tuple(int(bool(z)) for z in zero_variance))[-SATURATION_WINDOW:]
    return dataclasses.replace(
        state, lessons={**state.lessons, lesson_id: dataclasses.replace(rec, recent_groups=recent)}
    )


def fold_prompts(
    state: CurriculumState, lesson_id: str, outcomes: Sequence[tuple[str, float | None]], step: int
) -> CurriculumState:
    """Fold one rollout file's training groups of one lesson into its per-prompt records, in order (difficulty-aware
    sampling; a no-op unless `curriculum.skip_after` > 0).

    `outcomes[i]` is group i's (example id, common reward), the reward None when the group's rewards differ. A group
    with spread removes its prompt's record; a group without spread sets streak ← min(streak + 1, skip_after) when
    its reward equals the recorded one (within EPS), else streak ← 1 and reward ← its reward; last_slot ← `step`.
    Then, beyond `max_tracked_prompts` records, those with the smallest (last_slot, streak, example id) are dropped.
    Deterministic: a function of the state and the outcomes only.
    """
    cfg = state.config
    if cfg.skip_after <= 0 or len(outcomes) == 0:
        return state
    rec = state._lesson(lesson_id)
    prompts = dict(rec.prompts)
    for example_id, reward in outcomes:
        if reward is None:
            prompts.pop(example_id, None)
            continue
        old = prompts.get(example_id)
        same = old is not None and abs(old.reward - reward) <= EPS
        streak = min(old.streak + 1, cfg.skip_after) if old is not None and same else 1
        prompts[example_id] = PromptRecord(streak=streak, reward=float(reward), last_slot=step)
    excess = len(prompts) - cfg.max_tracked_prompts
    if excess > 0:
        for example_id in sorted(prompts, key=lambda p: (prompts[p].last_slot, prompts[p].streak, p))[:excess]:
            del prompts[example_id]
    new = dataclasses.replace(rec, prompts=prompts)
    return dataclasses.replace(state, lessons={**state.lessons, lesson_id: new})


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
    with f = minimum_sample_probability and K = #active + #graduated. A saturated active lesson (`is_saturated`:
    its recent groups (almost) all scored alike, so its rows are dropped as zero-variance) is weighted like a
    graduated one (p = f) while some active lesson is not saturated; if every active lesson is saturated they share
    as usual (the BatchMaker then fills slots without signal, `pipeline.batch_maker.slot_metrics.fills_at_once`).
    No active lesson: graduated ones share uniformly. `cfg` defaults to the state's own config. Raises
    CurriculumError if no lesson can be sampled (impossible under a validated config: a lesson without dependencies
    and with start_threshold 0 is active from step 0 and statuses only move forward).
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
    learning = [k for k in active if not is_saturated(state.lessons[k].recent_groups)]
    if learning:  # saturated active lessons get the floor, like graduated ones
        graduated = sorted(graduated + [k for k in active if k not in learning])
        active = learning
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
