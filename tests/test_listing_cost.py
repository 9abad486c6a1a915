"""What a poll lists: start-offset listings (`RunStore.list_after`) and the readers built on them stay exact.

- `list_after` returns exactly the children after a name (local disk: filtered; GCS emulator: the server's
  `startOffset`), never temp files;
- `run_state.latest_policy_step` is the newest committed policy whatever the `policies/LATEST` hint says: absent
  (a run root of older code), stale, naming an uncommitted step or garbage; and a store object that remembered a
  newer policy than the root now holds still answers the truth;
- `run_state.newest_slot_after` and `run_state.rollout_folders(store, low)` match the full listings they replace.
"""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore

BACKENDS = ["local", "gs"]


def _policy(store: RunStore, step: int, committed: bool = True) -> None:
    store.put_unique(layout.join(layout.policy_dir(step), "weights.safetensors"), b"w")
    if committed:
        store.put_if_absent(layout.policy_marker(step), b"{}")


def _latest_hint(store: RunStore, step: int | str) -> None:
    store.put_unique(layout.POLICY_LATEST, f'{{"step": {step}}}'.encode() if isinstance(step, int) else step.encode())


@pytest.mark.parametrize("backend", BACKENDS)
def test_list_after_returns_only_later_children(store_factory: Any, backend: str) -> None:
    store = store_factory(backend)
    for s in (1, 2, 3, 10):
        _policy(store, s)
    store.put_unique(layout.POLICY_LATEST, b'{"step": 10}')
    full = store.list(layout.POLICIES)
    for after in ("step-", layout.step_name(2), layout.step_name(3), layout.step_name(10), "A"):
        assert store.list_after(layout.POLICIES, after) == [p for p in full if p.rsplit("/", 1)[1] > after]
    assert store.list_after(layout.policy_dir(2), "") == store.list(layout.policy_dir(2))
    assert store.list_after("no/such/folder", "a") == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_latest_policy_step_is_the_truth_whatever_the_hint(store_factory: Any, backend: str) -> None:
    store = store_factory(backend)
    assert run_state.latest_policy_step(store) is None
    for s in range(4):
        _policy(store, s)
    # a root written before the hint existed: no LATEST at all
    assert run_state.latest_policy_step(RunStore(store.url, store.storage_options)) == 3
    _latest_hint(store, 1)  # stale (a learner died between its marker and the hint)
    assert run_state.latest_policy_step(RunStore(store.url, store.storage_options)) == 3
    _policy(store, 7, committed=False)  # a policy being written: not committed
    _latest_hint(store, 7)  # a hint naming an uncommitted step
    assert run_state.latest_policy_step(RunStore(store.url, store.storage_options)) == 3
    _latest_hint(store, "not json")
    assert run_state.latest_policy_step(RunStore(store.url, store.storage_options)) == 3
    # one store object polling: each newer policy is found (from its remembered floor), committed ones only
    poller = RunStore(store.url, store.storage_options)
    assert run_state.latest_policy_step(poller) == 3
    _policy(store, 5)
    assert run_state.latest_policy_step(poller) == 5
    store.put_if_absent(layout.policy_marker(7), b"{}")
    assert run_state.latest_policy_step(poller) == 7
    # the root lost what the poller remembered (a test wiping it, an operator deleting a bad policy)
    for rel in store.list(layout.policy_dir(7)):
        store.delete(rel)
    assert run_state.latest_policy_step(poller) == 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_newest_slot_and_rollout_folders_match_full_listings(store_factory: Any, backend: str) -> None:
    store = store_factory(backend)
    for slot in range(1, 13):
        store.put_if_absent(layout.batch_log_entry(slot), b"{}")
    assert run_state.newest_slot_after(store, 0) == run_state.last_committed_slot(store) == 12
    for floor in (1, 5, 11, 12):
        assert run_state.newest_slot_after(store, floor) == 12
    for p in (0, 3, 4, 9, 15):
        store.put_unique(layout.rollout_file(p, "w", 0), b"x")
    full = run_state.rollout_folders(store)
    assert full == [0, 3, 4, 9, 15]
    for low in (0, 1, 4, 5, 15, 16):
        assert run_state.rollout_folders(store, low) == [p for p in full if p >= low]
