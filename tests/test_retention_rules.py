"""The retention rules as pure functions: which policies and checkpoints stay, how far data may go, how lineage
coverage is counted, and config errors naming the field."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, RetentionConfig
from pipeline.retention import covered_through, data_horizon, kept_checkpoints, kept_policies
from pipeline.retention.lineage import IndexFile


def test_kept_policies_newest_every_mth_window_pending_and_zero() -> None:
    r = RetentionConfig(keep_policies=2, keep_every=5)
    committed = list(range(0, 21))
    # last slot 20, max_lag 1: the next slot (21) may use policies 19 and 20
    assert kept_policies(committed, r, 20, 1, []) == {0, 5, 10, 15, 19, 20}
    assert kept_policies(committed, r, 20, 3, [7]) == {0, 5, 7, 10, 15, 17, 18, 19, 20}
    assert 0 in kept_policies([0, *range(3, 21)], RetentionConfig(keep_policies=1, keep_every=0), 20, 0, [])


def test_kept_checkpoints_and_data_horizon() -> None:
    r = RetentionConfig(keep_checkpoints=1, keep_checkpoint_every=4, data_window_slots=3)
    assert kept_checkpoints([2, 4, 6, 8, 10], r) == {4, 8, 10}
    assert data_horizon(20, r, None) == 0  # no checkpoint: a restarted learner reads slot 1 again
    assert data_horizon(20, r, 10) == 10  # not past the newest checkpoint's slot
    assert data_horizon(20, r, 19) == 17  # nor inside the window
    assert data_horizon(2, r, 2) == 0


def test_lineage_coverage_is_contiguous_from_slot_one() -> None:
    assert covered_through([]) == 0
    assert covered_through([IndexFile("a", 1, 4), IndexFile("b", 5, 9)]) == 9
    assert covered_through([IndexFile("b", 5, 9)]) == 0
    assert covered_through([IndexFile("a", 1, 4), IndexFile("c", 6, 9)]) == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [("keep_policies", 0), ("keep_checkpoints", 0), ("data_window_slots", 0), ("keep_every", -1)],
)
def test_bad_retention_value_names_the_field(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=f"retention.{field}={value}"):
        RetentionConfig(**{field: value})
