"""Where `model.init_policy` points: a run root (its newest committed policy) or one of its `policies/step-S`
folders. Resolved without JAX, so a job refuses a missing policy before anything starts (`check_init_policy`);
the learner reads the weights (`policy.learner.resume_or_init`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pipeline.process.config_error import ConfigError
from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore

FIELD = "model.init_policy"
_POLICY_FOLDER = re.compile(r"^(?P<root>.*?)/?" + layout.POLICIES + r"/step-(?P<step>\d{8})/?$")


def split_init_policy(ref: str) -> tuple[str, int | None]:
    """(run root, policy step or None for the newest) of an `init_policy` reference (pure parsing)."""
    m = _POLICY_FOLDER.match(ref)
    if m is None:
        return ref.rstrip("/") or ref, None
    return m.group("root") or ".", int(m.group("step"))


def resolve_init_policy(
    ref: str, storage_options: Mapping[str, Any] | None = None, field: str = FIELD
) -> tuple[RunStore, int]:
    """(the run root's store, the committed policy step) `ref` names; ConfigError naming `field` (default
    `model.init_policy`) when no committed policy is there."""
    root, step = split_init_policy(ref)
    store = RunStore(root, storage_options or None)
    if step is None:
        step = run_state.latest_policy_step(store)
        if step is None:
            raise ConfigError(field, ref, f"no committed policy under {store.full_path(layout.POLICIES)}")
    elif not store.exists(layout.policy_marker(step)):
        raise ConfigError(field, ref, f"policy {step} is not committed ({store.full_path(layout.policy_marker(step))})")
    return store, step


def check_init_policy(model: Any, storage_options: Mapping[str, Any] | None = None) -> None:
    """Refuse (ConfigError) a `model.init_policy` that names no committed policy, or one committed with another
    tokenizer; nothing when it is unset."""
    ref = getattr(model, "init_policy", None)
    if not ref:
        return
    store, step = resolve_init_policy(ref, storage_options)
    try:
        marker = store.get_json(layout.policy_marker(step))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(FIELD, ref, f"unreadable policy marker: {e}") from None
    tokenizer = marker.get("tokenizer") if isinstance(marker, dict) else None
    if tokenizer is not None and tokenizer != model.tokenizer:
        raise ConfigError(
            FIELD, ref, f"policy {step} was trained with tokenizer {tokenizer!r}, not {model.tokenizer!r}"
        )
