"""What a run root says about the run's progress, in one place: the newest committed policy, the newest
committed batch slot, and the policy folders that hold rollouts (whether a root is on local disk:
`pipeline.store.urls.is_local`).

Listing plus marker existence is the truth; pointers such as `policies/LATEST` are only hints.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pipeline.store import layout

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
