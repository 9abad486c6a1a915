"""The curriculum: lesson statistics, statuses and sampling weights, folded from committed files by one writer.

`pipeline.curriculum.rules`: pure, deterministic functions (no I/O, no clocks, no global RNG).
`pipeline.curriculum.files`: `CurriculumWriter` (the one writer, called by the BatchMaker) and
`load_latest_curriculum` (the readers: rollout workers, reports). Import either through this package.

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
  uniformly. A saturated active lesson (at least SATURATION_FRACTION of its last SATURATION_WINDOW training groups
  had all rewards equal: zero-variance filtering drops nearly every row of it) gets p = f like a graduated one
  while some active lesson is not saturated. Marin's weight was base·(1 + bonus), zero for lessons at 0% or 100%
  whatever the bonus, and its floor was applied before renormalising, so the floor did not hold.

- Difficulty-aware prompt sampling (`curriculum.skip_after` = k > 0): per lesson and prompt (example id), the
  streak of its newest training draws (groups) in a row without reward spread and with the same reward each time
  (solved by every sample, or by none), capped at k, with that reward and the slot of its newest draw. A draw with
  spread removes the record, so only prompts on such a streak are kept, at most `max_tracked_prompts` per lesson
  (the least recently drawn go first). Rollout workers pass over a prompt whose streak reached k, keeping it with
  probability `retest_rate` (a re-test: a draw with spread brings it back). The records are folded from the same
  committed files in the same order as every other statistic (`fold_prompts`), so they survive a restart and a
  rebuild byte for byte.

Every status change appends a `CurriculumEvent` with a human reason, e.g.
"`addition_medium` unlocked at step 40: `addition_easy` reached 0.82 ≥ 0.8 and plateaued over 50 samples".

Files (see `pipeline.store.layout`): the writer folds, for each batch slot T in order, the evaluation summaries of
policies S < T not yet folded (in (S, lesson) order) and then the rollout files the BatchMaker first read while
building slot T (batch log order), and publishes `curriculum/state-T.json` (schema `schemas.curriculum`) with
create-if-absent. The content is a function of those committed files only, so a writer restarted from its newest
published state, or rebuilt from nothing, writes the same bytes. A damaged state file (cut, of another schema or
version, a field missing) is quarantined by the reader that finds it, which uses the newest older intact state; the
writer folds the slots after it again and goes on (the damaged file, which cannot be replaced, stays set aside).
"""

from pipeline.curriculum.files import (
    CurriculumWriter,
    DamagedCurriculumStateError,
    latest_curriculum_slot,
    load_curriculum_state,
    load_latest_curriculum,
)
from pipeline.curriculum.rules import (
    EVAL_EMA_ALPHA,
    EVAL_WEIGHT,
    EXPLORATION_BONUS,
    EXPLORATION_SCALE,
    PLATEAU_MIN_T,
    RULES,
    SATURATION_FRACTION,
    SATURATION_WINDOW,
    TRAIN_EMA_ALPHA,
    CurriculumError,
    CurriculumState,
    CurriculumStateError,
    CurriculumSyncError,
    Trend,
    bell_weight,
    clip_reward,
    config_fingerprint,
    ema_update,
    exploration_bonus,
    fit_trend,
    fold_eval,
    fold_groups,
    fold_prompts,
    fold_training,
    initial_state,
    is_plateaued,
    is_saturated,
    sample_lesson,
    sampling_weights,
    success_rate,
)
from schemas.curriculum import LESSON_STATUSES, CurriculumEvent, LessonRecord, PromptRecord

__all__ = [
    "EVAL_EMA_ALPHA",
    "EVAL_WEIGHT",
    "EXPLORATION_BONUS",
    "EXPLORATION_SCALE",
    "LESSON_STATUSES",
    "PLATEAU_MIN_T",
    "RULES",
    "SATURATION_FRACTION",
    "SATURATION_WINDOW",
    "TRAIN_EMA_ALPHA",
    "CurriculumError",
    "CurriculumEvent",
    "CurriculumState",
    "CurriculumStateError",
    "CurriculumSyncError",
    "CurriculumWriter",
    "DamagedCurriculumStateError",
    "LessonRecord",
    "PromptRecord",
    "Trend",
    "bell_weight",
    "clip_reward",
    "config_fingerprint",
    "ema_update",
    "exploration_bonus",
    "fit_trend",
    "fold_eval",
    "fold_groups",
    "fold_prompts",
    "fold_training",
    "initial_state",
    "is_plateaued",
    "is_saturated",
    "latest_curriculum_slot",
    "load_curriculum_state",
    "load_latest_curriculum",
    "sample_lesson",
    "sampling_weights",
    "success_rate",
]
