"""Unit and property tests of the advantage estimators (pipeline/batch_maker/advantages.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.batch_maker.advantages import (
    ADVANTAGE_ESTIMATORS,
    GRPO_EPS,
    dr_grpo_advantages,
    estimator_for,
    grpo_advantages,
    rloo_advantages,
)
from pipeline.config import ADVANTAGE_ESTIMATORS as CONFIG_NAMES

rewards_st = st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=1, max_size=12)
grouped_st = st.lists(
    st.tuples(st.integers(0, 4), st.floats(-10, 10, allow_nan=False, width=32)), min_size=1, max_size=40
)


def test_rloo_reference_values() -> None:
    np.testing.assert_allclose(rloo_advantages([0.0, 1.0, 0.0]), [-0.5, 1.0, -0.5])
    np.testing.assert_allclose(rloo_advantages([1.0, 3.0]), [-2.0, 2.0])


def test_grpo_and_dr_grpo_reference_values() -> None:
    np.testing.assert_allclose(grpo_advantages([0.0, 1.0]), [-0.5 / (0.5 + GRPO_EPS), 0.5 / (0.5 + GRPO_EPS)])
    np.testing.assert_allclose(dr_grpo_advantages([0.0, 1.0, 2.0]), [-1.0, 0.0, 1.0])


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_group_of_one_and_constant_groups_are_zero(name: str) -> None:
    fn = estimator_for(name)
    assert fn([3.5], None).tolist() == [0.0]
    assert fn([0.1, 0.1, 0.1], None).tolist() == [0.0, 0.0, 0.0]
    assert fn([], None).shape == (0,)


def test_registry_matches_config_names() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == set(CONFIG_NAMES)
    with pytest.raises(KeyError, match="ppo"):
        estimator_for("ppo")


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@given(rewards=rewards_st)
@settings(max_examples=60, deadline=None)
def test_sums_to_zero_per_group_and_deterministic(name: str, rewards: list[float]) -> None:
    fn = estimator_for(name)
    a = fn(rewards, None)
    scale = max(1.0, float(np.max(np.abs(a))))
    assert abs(float(a.sum())) <= 1e-6 * scale * len(rewards)
    np.testing.assert_array_equal(a, fn(rewards, None))  # no random noise
    if len(rewards) == 1:
        assert a.tolist() == [0.0]


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@given(pairs=grouped_st)
@settings(max_examples=60, deadline=None)
def test_grouped_equals_each_group_alone(name: str, pairs: list[tuple[int, float]]) -> None:
    fn = estimator_for(name)
    groups = np.array([g for g, _ in pairs])
    rewards = np.array([r for _, r in pairs], dtype=np.float64)
    a = fn(rewards, groups)
    for g in np.unique(groups):
        sel = groups == g
        np.testing.assert_allclose(a[sel], fn(rewards[sel], None), rtol=1e-9, atol=1e-9)
        assert abs(a[sel].sum()) <= 1e-5 * max(1.0, np.abs(a[sel]).max()) * sel.sum()


@given(rewards=st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=2, max_size=10))
@settings(max_examples=60, deadline=None)
def test_rloo_is_leave_one_out_baseline(rewards: list[float]) -> None:
    r = np.array(rewards, dtype=np.float64)
    expected = np.array([r[i] - np.delete(r, i).mean() for i in range(len(r))])
    if np.ptp(r) == 0:
        expected[:] = 0.0
    np.testing.assert_allclose(rloo_advantages(r), expected, atol=1e-9)
