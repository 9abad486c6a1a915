"""What a run root says about the run's progress, in one place: the newest committed policy, the newest
committed batch slot, and the policy folders that hold rollouts (whether a root is on local disk:
`pipeline.store.urls.is_local`); and `read_run_record`, the one reader of `run.json`, verified on read.

Listing plus marker existence is the truth; pointers such as `policies/LATEST` are only hints.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from pipeline.process.exits import DamagedInputError
from pipeline.store import layout

RUN_SCHEMA_VERSION = 1
"""The version of run.json this code writes (`run_schema_version`) and the newest it reads."""


def read_run_record(store: Any) -> dict[str, Any]:
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


def step_folders(store: Any, root: str) -> list[int]:
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


def committed_steps(store: Any, root: str) -> list[int]:
    """Steps under `root` (`policies` or `checkpoints`) whose COMMITTED marker exists, ascending."""
    return [
        s
        for s in step_folders(store, root)
        if store.exists(layout.join(root, layout.step_name(s), layout.COMMIT_MARKER))
    ]


def latest_policy_step(store: Any) -> int | None:
    """The newest committed policy step, or None before policy 0 is published."""
    for s in reversed(step_folders(store, layout.POLICIES)):
        if store.exists(layout.policy_marker(s)):
            return s
    return None


_GAPS_LOGGED: set[tuple[str, tuple[int, ...]]] = set()
"""(run root, missing slots) already reported: pacing polls this several times a second."""
_GAPS_LOCK = threading.Lock()


def last_committed_slot(store: Any) -> int:
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


def rollout_folders(store: Any, low: int = 0) -> list[int]:
    """Policy steps P >= `low` that have a `rollouts/step-P` folder, ascending."""
    return [s for s in step_folders(store, layout.ROLLOUTS) if s >= low]
