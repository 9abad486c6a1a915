"""Curriculum semantics on hand-built reward sequences: EMA, plateau, weights, unlock, activation, graduation,
config validation and the state schema. Pure functions only (no files)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from pipeline.config import ConfigError, CurriculumConfig, LessonConfig, LessonDependency
from pipeline.curriculum import (
    EVAL_EMA_ALPHA,
    EXPLORATION_BONUS,
    TRAIN_EMA_ALPHA,
    CurriculumError,
    CurriculumState,
    LessonRecord,
    clip_reward,
    ema_update,
    fit_trend,
    fold_eval,
    fold_training,
    initial_state,
    is_plateaued,
    sample_lesson,
    sampling_weights,
    success_rate,
)
from schemas.base import SchemaMismatchError, ValidationError
from schemas.curriculum import CURRICULUM_STATE

FLOOR = 0.02


def two_lessons(
    *, reward_threshold: float = 0.8, start: float = 0.0, stop: float = 1.0, window: int = 10, easy_stop: float = 1.0
) -> CurriculumConfig:
    return CurriculumConfig(
        lessons={
            "easy": LessonConfig(lesson_id="easy", stop_threshold=easy_stop, plateau_window=window),
            "medium": LessonConfig(
                lesson_id="medium",
                dependencies=[LessonDependency("easy", reward_threshold=reward_threshold)],
                start_threshold=start,
                stop_threshold=stop,
                plateau_window=window,
            ),
        },
        minimum_sample_probability=FLOOR,
    )


def with_lessons(cfg: CurriculumConfig, **records: LessonRecord) -> CurriculumState:
    state = initial_state(cfg)
    return dataclasses.replace(state, lessons={**state.lessons, **records})


def active(success: float | None, n: int = 10_000, status: str = "active") -> LessonRecord:
    return LessonRecord(status=status, train_success=success, train_samples=n if success is not None else 0)


# ---------------------------------------------------------------------------------------
# smoothing
# ---------------------------------------------------------------------------------------


def test_ema_is_bias_corrected_plain_ema() -> None:
    xs = [0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 1.0]
    c, m = None, 0.0
    for n, x in enumerate(xs):
        c = ema_update(c, n, x, TRAIN_EMA_ALPHA)
        m = (1 - TRAIN_EMA_ALPHA) * m + TRAIN_EMA_ALPHA * x
        assert c == pytest.approx(m / (1 - (1 - TRAIN_EMA_ALPHA) ** (n + 1)))
    assert ema_update(None, 0, 0.3, 0.05) == 0.3  # first observation is taken as is: no 0.5 prior


def test_constant_rewards_give_exactly_that_success() -> None:
    cfg = two_lessons()
    state = fold_training(initial_state(cfg), "easy", [0.9] * 37, step=1)
    assert state.lessons["easy"].train_success == 0.9
    assert state.lessons["easy"].train_samples == 37
    assert len(state.lessons["easy"].recent_rewards) == 10


def test_rewards_are_clipped_to_unit_interval() -> None:
    assert clip_reward(-2.0) == 0.0 and clip_reward(3.0) == 1.0 and clip_reward(0.25) == 0.25
    state = fold_training(initial_state(two_lessons()), "easy", [5.0, -1.0], step=1)
    assert state.lessons["easy"].recent_rewards == (1.0, 0.0)


def test_success_rate_weights_eval_two_thirds() -> None:
    rec = LessonRecord(status="active", train_success=0.3, train_samples=5, eval_success=0.9, eval_count=1)
    assert success_rate(rec) == pytest.approx(2 / 3 * 0.9 + 1 / 3 * 0.3)
    assert success_rate(dataclasses.replace(rec, eval_success=None, eval_count=0)) == 0.3
    assert success_rate(LessonRecord(status="active")) is None


def test_eval_ema_moves_half_way() -> None:
    state = fold_eval(initial_state(two_lessons()), "easy", 0.2, step=1, policy_step=0)
    state = fold_eval(state, "easy", 0.6, step=2, policy_step=1)
    first = 0.2
    gain = EVAL_EMA_ALPHA / (1 - (1 - EVAL_EMA_ALPHA) ** 2)
    assert state.lessons["easy"].eval_success == pytest.approx(first + gain * 0.4)
    assert state.lessons["easy"].eval_count == 2
    assert state.lessons["easy"].last_eval_policy_step == 1


# ---------------------------------------------------------------------------------------
# plateau detection
# ---------------------------------------------------------------------------------------

FLAT = [0.8] * 50
RISING = list(np.linspace(0.0, 1.0, 50))
NOISY_FLAT = [float(i % 2) for i in range(50)]  # 0/1 alternating: mean 0.5, no trend
NOISY_RISING = [0.0] * 20 + [0.0, 1.0] * 5 + [1.0] * 20  # 0/1 noise with a clear trend
SLIGHTLY_NOISY_FLAT = [0.8 + 0.005 * (-1) ** i for i in range(50)]


def test_plateau_flat() -> None:
    assert is_plateaued(FLAT, 50, 0.01)
    assert fit_trend(FLAT).slope == pytest.approx(0.0, abs=1e-12)


def test_plateau_rising_is_not() -> None:
    assert not is_plateaued(RISING, 50, 0.01)
    assert fit_trend(RISING).change == pytest.approx(50 / 49)


def test_plateau_noisy_flat_is_by_significance_not_by_threshold() -> None:
    trend = fit_trend(NOISY_FLAT)
    assert trend.change > 0.01  # the threshold alone would never call 0/1 noise flat
    assert trend.t < 2
    assert is_plateaued(NOISY_FLAT, 50, 0.01)
    assert not is_plateaued(NOISY_FLAT, 50, 0.01, min_t=0.0)


def test_plateau_small_noise_flat_by_threshold() -> None:
    assert is_plateaued(SLIGHTLY_NOISY_FLAT, 50, 0.01, min_t=0.0)


def test_plateau_noisy_rising_is_not() -> None:
    assert fit_trend(NOISY_RISING).t > 2
    assert not is_plateaued(NOISY_RISING, 50, 0.01)


def test_plateau_needs_a_full_window_and_looks_only_at_it() -> None:
    assert not is_plateaued(FLAT[:49], 50, 0.01)
    assert is_plateaued(RISING + FLAT[:10], 10, 0.01)  # only the last 10 count
    assert not is_plateaued(FLAT + RISING[:10], 10, 0.01)


def test_fit_trend_matches_numpy_polyfit() -> None:
    ys = [0.1, 0.4, 0.35, 0.8, 0.7, 0.9]
    assert fit_trend(ys).slope == pytest.approx(np.polyfit(np.arange(6), ys, 1)[0])
    assert math.isinf(fit_trend([1.0, 2.0]).se)


# ---------------------------------------------------------------------------------------
# sampling weights
# ---------------------------------------------------------------------------------------


def three_roots() -> CurriculumConfig:
    return CurriculumConfig(
        lessons={k: LessonConfig(lesson_id=k) for k in ("a", "b", "c", "d")}, minimum_sample_probability=FLOOR
    )


def test_weights_peak_near_half_and_sum_to_one() -> None:
    state = with_lessons(three_roots(), a=active(0.5), b=active(0.9), c=active(0.1), d=active(0.6))
    w = sampling_weights(state)
    assert sum(w.values()) == pytest.approx(1.0)
    assert w["a"] > w["d"] > w["b"]
    assert w["a"] > w["c"]
    assert w["b"] == pytest.approx(w["c"])  # symmetric bell
    assert min(w.values()) >= FLOOR


def test_weights_floor_for_solved_and_hopeless_lessons() -> None:
    state = with_lessons(three_roots(), a=active(0.5), b=active(1.0), c=active(0.0), d=active(0.5))
    w = sampling_weights(state)
    assert w["b"] == pytest.approx(FLOOR, abs=1e-6)
    assert w["c"] == pytest.approx(FLOOR, abs=1e-6)
    assert sum(w.values()) == pytest.approx(1.0)


def test_graduated_lessons_keep_exactly_the_floor_others_zero() -> None:
    state = with_lessons(
        three_roots(),
        a=active(0.5),
        b=active(0.5, status="graduated"),
        c=active(0.5, status="locked"),
        d=active(None, status="unlocked"),
    )
    w = sampling_weights(state)
    assert w["b"] == FLOOR
    assert w["c"] == 0.0 and w["d"] == 0.0
    assert w["a"] == pytest.approx(1 - FLOOR)


def test_all_graduated_share_uniformly() -> None:
    state = with_lessons(three_roots(), **{k: active(0.9, status="graduated") for k in "abcd"})
    assert sampling_weights(state) == {k: 0.25 for k in "abcd"}


def test_exploration_bonus_favours_rarely_sampled_lessons() -> None:
    state = with_lessons(three_roots(), a=active(0.0, n=0), b=active(0.0, n=5000), c=active(0.5), d=active(0.5))
    w = sampling_weights(state)
    assert w["a"] > w["b"]
    assert w["b"] == pytest.approx(FLOOR, abs=1e-6)
    fresh = sampling_weights(initial_state(three_roots()))  # unknown success: the bell peak plus full bonus
    assert all(v == pytest.approx(0.25) for v in fresh.values())
    assert EXPLORATION_BONUS > 0


def test_no_sampleable_lesson_is_an_error() -> None:
    state = with_lessons(three_roots(), **{k: LessonRecord(status="locked") for k in "abcd"})
    with pytest.raises(CurriculumError, match="no lesson is active"):
        sampling_weights(state)


def test_sample_lesson_follows_weights_deterministically() -> None:
    weights = {"a": 0.7, "b": 0.3, "c": 0.0}
    draws = [sample_lesson(weights, np.random.default_rng(7)) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same lesson
    rng = np.random.default_rng(0)
    counts = {"a": 0, "b": 0, "c": 0}
    for _ in range(4000):
        counts[sample_lesson(weights, rng)] += 1
    assert counts["c"] == 0
    assert counts["a"] / 4000 == pytest.approx(0.7, abs=0.03)
    with pytest.raises(CurriculumError):
        sample_lesson({"a": 0.0}, rng)


# ---------------------------------------------------------------------------------------
# unlock, activation, graduation
# ---------------------------------------------------------------------------------------


def test_initial_state_unlocks_and_activates_roots() -> None:
    state = initial_state(two_lessons())
    assert state.status("easy") == "active"
    assert state.status("medium") == "locked"
    assert [e.reason for e in state.events] == [
        "`easy` unlocked at step 0: no dependencies",
        "`easy` active at step 0: start_threshold is 0",
    ]


def test_dependency_below_threshold_stays_locked() -> None:
    state = fold_training(initial_state(two_lessons()), "easy", [0.7] * 30, step=3)
    assert state.plateaued("easy")
    assert state.status("medium") == "locked"


def test_dependency_above_threshold_but_rising_stays_locked() -> None:
    state = fold_training(initial_state(two_lessons()), "easy", [1.0] * 30 + list(np.linspace(0.8, 1.0, 10)), 3)
    assert state.success("easy") >= 0.8  # type: ignore[operator]
    assert not state.plateaued("easy")
    assert state.status("medium") == "locked"


def test_dependency_above_threshold_and_plateaued_unlocks_with_reason() -> None:
    state = fold_training(initial_state(two_lessons()), "easy", [0.5] * 10, step=1)
    assert state.status("medium") == "locked"
    state = fold_training(state, "easy", [0.9] * 200, step=40)
    assert state.status("medium") == "active"
    new = [e for e in state.events if e.lesson_id == "medium"]
    assert [(e.from_status, e.to_status, e.step) for e in new] == [
        ("locked", "unlocked", 40),
        ("unlocked", "active", 40),
    ]
    s = state.success("easy")
    assert new[0].reason == f"`medium` unlocked at step 40: `easy` reached {s:.3g} ≥ 0.8 and plateaued over 10 samples"
    assert s is not None and 0.8 < s < 0.9


def test_unlock_stays_unlocked_when_dependency_drops() -> None:
    state = fold_training(initial_state(two_lessons()), "easy", [1.0] * 20, step=1)
    assert state.status("medium") == "active"
    state = fold_training(state, "easy", [0.0] * 200, step=2)
    assert state.status("medium") == "active"


def test_activation_waits_for_eval_above_start_threshold() -> None:
    state = fold_training(initial_state(two_lessons(start=0.3)), "easy", [1.0] * 20, step=5)
    assert state.status("medium") == "unlocked"
    assert sampling_weights(state)["medium"] == 0.0
    state = fold_eval(state, "medium", 0.2, step=6, policy_step=5)
    assert state.status("medium") == "unlocked"
    state = fold_eval(state, "medium", 0.6, step=7, policy_step=6)
    assert state.status("medium") == "active"
    e = state.events[-1]
    assert e.reason == "`medium` active at step 7: eval success 0.467 ≥ start_threshold 0.3"
    assert sampling_weights(state)["medium"] > FLOOR


def test_eval_before_unlock_activates_on_unlock() -> None:
    state = fold_eval(initial_state(two_lessons(start=0.3)), "medium", 0.5, step=1, policy_step=0)
    assert state.status("medium") == "locked"
    state = fold_training(state, "easy", [1.0] * 20, step=2)
    assert state.status("medium") == "active"


def test_graduation_needs_eval_and_plateau() -> None:
    state = fold_training(initial_state(two_lessons(easy_stop=0.9)), "easy", [1.0] * 20, step=1)
    assert state.status("easy") == "active"  # no evaluation yet
    state = fold_eval(state, "easy", 0.85, step=2, policy_step=1)
    assert state.status("easy") == "active"  # below stop_threshold
    state = fold_eval(state, "easy", 1.0, step=3, policy_step=2)
    assert state.status("easy") == "graduated"
    assert state.events[-1].reason == (
        "`easy` graduated at step 3: eval success 0.95 ≥ stop_threshold 0.9 and plateaued over 10 samples"
    )
    w = sampling_weights(state)
    assert w["easy"] == FLOOR and w["medium"] == pytest.approx(1 - FLOOR)


def test_no_graduation_while_still_improving() -> None:
    rising = list(np.linspace(0.5, 1.0, 10))
    state = fold_training(initial_state(two_lessons(easy_stop=0.9)), "easy", rising, step=1)
    state = fold_eval(state, "easy", 1.0, step=2, policy_step=1)
    assert state.status("easy") == "active"
    state = fold_training(state, "easy", [1.0] * 10, step=3)
    assert state.status("easy") == "graduated"


def test_fold_is_pure() -> None:
    s0 = initial_state(two_lessons())
    s1 = fold_training(s0, "easy", [1.0] * 20, step=1)
    assert s0.status("medium") == "locked" and s0.lessons["easy"].train_samples == 0
    assert s1 == fold_training(s0, "easy", [1.0] * 20, step=1)


def test_unknown_lesson_is_named() -> None:
    with pytest.raises(CurriculumError, match="'nope'"):
        fold_training(initial_state(two_lessons()), "nope", [1.0], step=1)
    with pytest.raises(CurriculumError, match="'nope'"):
        fold_eval(initial_state(two_lessons()), "nope", 1.0, step=1)


# ---------------------------------------------------------------------------------------
# config validation names the lesson
# ---------------------------------------------------------------------------------------


def test_cycle_is_printed() -> None:
    with pytest.raises(ConfigError, match=r"dependency cycle: a -> b -> c -> a"):
        CurriculumConfig(
            lessons={
                "root": LessonConfig(lesson_id="root"),
                "a": LessonConfig(lesson_id="a", dependencies=[LessonDependency("b")]),
                "b": LessonConfig(lesson_id="b", dependencies=[LessonDependency("c")]),
                "c": LessonConfig(lesson_id="c", dependencies=[LessonDependency("a")]),
            }
        )


def test_unknown_dependency_names_the_lesson() -> None:
    with pytest.raises(ConfigError, match=r"lessons\.b\.dependencies='ghost'.*unknown lesson"):
        CurriculumConfig(
            lessons={
                "a": LessonConfig(lesson_id="a"),
                "b": LessonConfig(lesson_id="b", dependencies=[LessonDependency("ghost")]),
            }
        )


@pytest.mark.parametrize("name", ["start_threshold", "stop_threshold"])
@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_thresholds_outside_unit_interval_name_the_lesson(name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"lessons\.hard\.{name}"):
        kwargs: dict[str, Any] = {name: value}
        LessonConfig(lesson_id="hard", **kwargs)


def test_reward_threshold_outside_unit_interval_names_the_dependency() -> None:
    with pytest.raises(ConfigError, match=r"dependencies\.easy\.reward_threshold=1\.2"):
        LessonDependency("easy", reward_threshold=1.2)


def test_empty_curriculum() -> None:
    with pytest.raises(ConfigError, match="at least one lesson"):
        CurriculumConfig(lessons={})


def test_unsafe_lesson_id_and_negative_plateau_threshold() -> None:
    with pytest.raises(ConfigError, match="lesson_id"):
        LessonConfig(lesson_id="a/b")
    with pytest.raises(ConfigError, match=r"lessons\.x\.plateau_threshold"):
        LessonConfig(lesson_id="x", plateau_threshold=-1.0)


def test_some_root_must_start_at_zero() -> None:
    with pytest.raises(ConfigError, match="start_threshold 0"):
        CurriculumConfig(lessons={"a": LessonConfig(lesson_id="a", start_threshold=0.5)})


# ---------------------------------------------------------------------------------------
# the state schema
# ---------------------------------------------------------------------------------------


def busy_state() -> CurriculumState:
    state = fold_training(initial_state(two_lessons(start=0.3)), "easy", [1.0, 0.0, 0.5] * 10 + [1.0] * 10, 1)
    return fold_eval(state, "medium", 0.4, step=2, policy_step=1)


def test_state_record_round_trip() -> None:
    state = busy_state()
    obj = CURRICULUM_STATE.to_json(state.to_record())
    back = CurriculumState.from_record(CURRICULUM_STATE.from_json(obj, "x.json"), state.config)
    assert back == state
    assert obj["schema"] == "curriculum_state" and obj["schema_version"] == 2


def test_state_schema_version_and_fields_checked() -> None:
    obj = CURRICULUM_STATE.to_json(busy_state().to_record())
    with pytest.raises(SchemaMismatchError, match=r"s\.json: expected schema curriculum_state@v2, found .*@v3"):
        CURRICULUM_STATE.from_json({**obj, "schema_version": 3}, "s.json")
    bad = {**obj, "lessons": {**obj["lessons"], "easy": {**obj["lessons"]["easy"], "status": "asleep"}}}
    with pytest.raises(ValidationError, match=r"lessons\.easy\.status"):
        CURRICULUM_STATE.from_json(bad, "s.json")
    with pytest.raises(ValidationError, match="field slot: missing"):
        CURRICULUM_STATE.from_json({k: v for k, v in obj.items() if k != "slot"}, "s.json")
    with pytest.raises(ValidationError, match="sum to 1"):
        CURRICULUM_STATE.from_json({**obj, "weights": {"easy": 0.5, "medium": 0.0}}, "s.json")


def test_state_from_another_config_is_refused() -> None:
    rec = busy_state().to_record()
    with pytest.raises(CurriculumError, match="folded under curriculum config"):
        CurriculumState.from_record(rec, two_lessons(start=0.4))
