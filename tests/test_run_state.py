"""run_state's reading of the run root: a gap in the batch log is reported once per distinct gap, not on every
pacing poll."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore


def test_a_gap_in_the_batch_log_is_logged_once_per_distinct_gap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = RunStore(str(tmp_path / "run"))
    for slot in (1, 2, 4):
        store.put_unique(layout.batch_log_entry(slot), b"{}")
    with caplog.at_level(logging.ERROR, logger="pipeline.store.run_state"):
        assert [run_state.last_committed_slot(store) for _ in range(50)] == [4] * 50
        store.put_unique(layout.batch_log_entry(6), b"{}")  # a new gap: slot 5 missing too
        assert [run_state.last_committed_slot(store) for _ in range(50)] == [6] * 50
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.store.run_state"]
    assert len(lines) == 2, lines
    assert "1 slot(s) missing (3), newest 4" in lines[0] and "2 slot(s) missing (3, 5), newest 6" in lines[1]
    caplog.clear()
    other = RunStore(str(tmp_path / "contiguous"))
    for slot in (1, 2):
        other.put_unique(layout.batch_log_entry(slot), b"{}")
    with caplog.at_level(logging.ERROR, logger="pipeline.store.run_state"):
        assert run_state.last_committed_slot(other) == 2
    assert not caplog.records
