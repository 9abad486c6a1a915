"""Run-root layout: names sort in step order, steps parse back, unsafe names are refused."""

from __future__ import annotations

import random

import pytest

from pipeline.store import layout


def test_step_names_sort_in_step_order() -> None:
    steps = [*random.Random(0).sample(range(0, 99_999_999), 200), 0, 1, 9, 10, 99, 100]
    names = [layout.step_name(s) for s in steps]
    assert sorted(names) == [layout.step_name(s) for s in sorted(steps)]
    files = [layout.rollout_file(s, "w0", 1) for s in steps]
    assert sorted(files) == [layout.rollout_file(s, "w0", 1) for s in sorted(steps)]
    logs = [layout.batch_log_entry(s) for s in steps]
    assert sorted(logs) == [layout.batch_log_entry(s) for s in sorted(steps)]
    states = [layout.curriculum_state(s) for s in steps]
    assert sorted(states) == [layout.curriculum_state(s) for s in sorted(steps)]
    seqs = [layout.rollout_file(5, "w0", q) for q in (10, 2, 100, 1)]
    assert sorted(seqs) == [layout.rollout_file(5, "w0", q) for q in (1, 2, 10, 100)]


@pytest.mark.parametrize("step", [0, 1, 120, 99_999_999])
def test_parse_step_inverts_step_name(step: int) -> None:
    assert layout.parse_step(layout.step_name(step)) == step
    assert layout.parse_step(layout.policy_marker(step)) == step
    assert layout.parse_step(layout.batch_data_file(step, "abc")) == step
    assert layout.parse_step(layout.rollout_file(step, "w-1", 7)) == step


def test_parse_step_and_step_name_errors() -> None:
    with pytest.raises(ValueError, match="no step number"):
        layout.parse_step("policies/LATEST")
    with pytest.raises(ValueError, match="must be >= 0"):
        layout.step_name(-1)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        ".",
        "..",
        "a/b",
        "a b",
        "../x",
        "é",
        "w\n",
    ],
)
def test_unsafe_names_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a safe name"):
        layout.rollout_file(1, bad, 0)
    with pytest.raises(ValueError, match="not a safe name"):
        layout.lease_dir(bad)
    with pytest.raises(ValueError, match="not a safe name"):
        layout.batch_data_file(1, bad)


def test_ready_marker_and_data_of_marker_are_inverse() -> None:
    data = layout.rollout_file(120, "worker-3", 42)
    assert data == "rollouts/step-00000120/worker-3-00000042.parquet"
    marker = layout.ready_marker(data)
    assert marker == "rollouts/step-00000120/worker-3-00000042.ready.json"
    assert layout.data_of_marker(marker) == data
    assert layout.ready_marker(layout.data_of_marker(marker)) == marker
    with pytest.raises(ValueError):
        layout.ready_marker("x.json")
    with pytest.raises(ValueError):
        layout.data_of_marker("x.parquet")


def test_paths_are_relative_and_distinct() -> None:
    paths = [
        layout.policy_marker(1),
        layout.checkpoint_marker(1),
        layout.rollout_file(1, "w", 1),
        layout.batch_log_entry(1),
        layout.batch_data_file(1, "a"),
        layout.dropped_file(1, "a"),
        layout.curriculum_state(1),
        layout.eval_rollouts_file(1, "l"),
        layout.eval_summary_file(1, "l"),
        layout.metrics_file("rollout", "w", 1),
        layout.quarantine_record("rollouts/step-00000001/w-00000001.parquet"),
        layout.lease_dir("bm"),
        layout.STOP_FILE,
        layout.RUN_CONFIG,
    ]
    assert len(set(paths)) == len(paths)
    assert all(not p.startswith("/") and ".." not in p.split("/") for p in paths)
    assert layout.quarantine_record("a/b.parquet") == "quarantine/a__b.parquet.json"
