"""What a run root says about the run's progress, in one place: the newest committed policy, the newest
committed batch slot, and the policy folders that hold rollouts (whether a root is on local disk:
`pipeline.store.urls.is_local`); and `read_run_record`, the one reader of `run.json`, verified on read.

Listing plus marker existence is the truth; pointers such as `policies/LATEST` are only hints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from typing import TYPE_CHECKING, Any

from pipeline.process.exits import DamagedInputError
from pipeline.store import layout

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

RUN_SCHEMA_VERSION = 1
"""The version of run.json this code writes (`run_schema_version`) and the newest it reads."""


def read_run_record(store: RunStore) -> dict[str, Any]:
    """The run root's `run.json`, checked against its schema: a JSON object whose `config` is an object and whose
    `run_schema_version` (absent: 1) this reader knows. Raises FileNotFoundError when there is none, and
    DamagedInputError naming run.json and the field (exit code 7) when it is cut, of a newer version or missing
    `config`: never a JSONDecodeError traceback."""
    data = store.get(layout.RUN_CONFIG)
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedInputError(layout.RUN_CONFIG, f"field '<json>': not valid JSON ({e})") from None
    if not isinstance(record, dict):
        got = type(record).__name__
        raise DamagedInputError(layout.RUN_CONFIG, f"field '<record>': must be a JSON object, got {got}")
    version = record.get("run_schema_version", 1)
    if isinstance(version, bool) or not isinstance(version, int):
        raise DamagedInputError(layout.RUN_CONFIG, f"field 'run_schema_version': must be an integer, got {version!r}")
    if version > RUN_SCHEMA_VERSION:
        raise DamagedInputError(
            layout.RUN_CONFIG, f"field 'run_schema_version': version {version} is newer than this reader's "
            f"{RUN_SCHEMA_VERSION}"
        )  # fmt: skip
    if "config" not in record:
        raise DamagedInputError(layout.RUN_CONFIG, "field 'config': missing")
    if not isinstance(record["config"], dict):
        raise DamagedInputError(layout.RUN_CONFIG, f"field 'config': must be an object, got {record['config']!r:.60}")
    return record


logger = logging.getLogger(__name__)


def step_folders(store: RunStore, root: str) -> list[int]:
    """Steps S of the `root/step-S` folders that exist under `root` (committed or not), ascending."""
    steps: set[int] = set()
    for rel in store.list(root):
        for part in rel.rstrip("/").split("/"):
            if part.startswith("step-"):
                try:
                    steps.add(layout.parse_step(part))
                except ValueError:
                    pass
    return sorted(steps)


def committed_steps(store: RunStore, root: str) -> list[int]:
    """Steps under `root` (`policies` or `checkpoints`) whose COMMITTED marker exists, ascending."""
    return [
        s
        for s in step_folders(store, root)
        if store.exists(layout.join(root, layout.step_name(s), layout.COMMIT_MARKER))
    ]


def latest_policy_step(store: RunStore) -> int | None:
    """The newest committed policy step, or None before policy 0 is published.

    O(new policies) per call, however many the run kept: from a floor (the newest this store object found before,
    else the `policies/LATEST` hint once its marker is checked) it lists only `policies/` entries from the floor
    on (`RunStore.list_after`: one GCS listing with a start offset) and heads the markers of those, newest first.
    Without a usable floor (a fresh store and no LATEST, or the floor's folder is gone) the whole of `policies/`
    is listed and the markers are checked, as before: listing plus marker existence stays the truth.
    """
    floor = None
    if hasattr(store, "list_after"):  # a RunStore (another store type: the full listing)
        floor = getattr(store, "_policy_floor", None)
        if floor is None:
            floor = _latest_hint(store)
    if floor is not None:
        after = f"step-{floor - 1:0{layout.STEP_WIDTH}d}" if floor > 0 else "step-"
        for s in reversed(_steps_of(store.list_after(layout.POLICIES, after))):
            if s >= floor and store.exists(layout.policy_marker(s)):
                _remember_floor(store, s)
                return s
    for s in reversed(step_folders(store, layout.POLICIES)):
        if store.exists(layout.policy_marker(s)):
            _remember_floor(store, s)
            return s
    return None


def learner_done_step(store: RunStore) -> int | None:
    """The step recorded in `control/LEARNER_DONE` (written once the learner trained `train.num_train_steps`), or
    None while it is absent or unreadable."""
    try:
        record = store.get_json(layout.LEARNER_DONE)
    except Exception:  # absent, or cut: the caller then takes the full path, which rewrites it
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def _latest_hint(store: RunStore) -> int | None:
    """The step `policies/LATEST` names (None: absent or unreadable); a hint, never trusted without its marker."""
    try:
        step = json.loads(store.get(layout.POLICY_LATEST)).get("step")
    except (FileNotFoundError, ValueError, AttributeError, UnicodeDecodeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _remember_floor(store: RunStore, step: int) -> None:
    """Keep the newest committed policy found on the store object (committed policies are never uncommitted;
    retention keeps the newest), so the next call lists only what came after it."""
    with contextlib.suppress(AttributeError):
        store._policy_floor = step


def _steps_of(paths: list[str]) -> list[int]:
    """The step numbers of `.../step-S` entries among `paths`, ascending (temp and other names skipped)."""
    steps: set[int] = set()
    for rel in paths:
        name = rel.rstrip("/").rsplit("/", 1)[-1]
        if re.fullmatch(r"step-\d{8}", name):
            steps.add(layout.parse_step(name))
    return sorted(steps)


_GAPS_LOGGED: set[tuple[str, tuple[int, ...]]] = set()
"""(run root, missing slots) already reported: pacing polls this several times a second."""
_GAPS_LOCK = threading.Lock()


def last_committed_slot(store: RunStore) -> int:
    """The highest committed batch slot (0 if none). Logs an error, once per run root and set of missing
    slots, if the slots are not contiguous from 1."""
    slots = sorted(layout.parse_step(p) for p in store.list(layout.BATCH_LOG) if p.endswith(".json"))
    if slots and slots != list(range(1, len(slots) + 1)):
        missing = tuple(sorted(set(range(1, slots[-1] + 1)) - set(slots)))
        key = (str(getattr(store, "url", id(store))), missing)
        with _GAPS_LOCK:
            first = key not in _GAPS_LOGGED
            _GAPS_LOGGED.add(key)
        if first:
            logger.error(
                "batch log slots are not contiguous from 1: %d slot(s) missing (%s), newest %d",
                len(missing),
                ", ".join(map(str, missing[:20])) + (" …" if len(missing) > 20 else ""),
                slots[-1],
            )
    return slots[-1] if slots else 0


def newest_slot_after(store: RunStore, floor: int) -> int:
    """The highest committed batch slot, knowing slot `floor` (0: none) is committed: lists only `batches/log`
    entries after slot `floor`'s (`RunStore.list_after`), so a poll costs O(new slots), not O(slots of the run).
    Without `list_after` (another store type) it is `last_committed_slot`."""
    if floor <= 0 or not hasattr(store, "list_after"):
        return last_committed_slot(store)
    after = layout.batch_log_entry(floor).rsplit("/", 1)[-1]
    slots = [layout.parse_step(p) for p in store.list_after(layout.BATCH_LOG, after) if p.endswith(".json")]
    return max([floor, *slots])


def rollout_folders(store: RunStore, low: int = 0) -> list[int]:
    """Policy steps P >= `low` that have a `rollouts/step-P` folder, ascending. With `low` > 0 only the folder
    names from `low` on are listed (`RunStore.list_after`), so the cost does not grow with the folders below it."""
    if low > 0 and hasattr(store, "list_after"):
        return [s for s in _steps_of(store.list_after(layout.ROLLOUTS, layout.step_name(low - 1))) if s >= low]
    return [s for s in step_folders(store, layout.ROLLOUTS) if s >= low]
