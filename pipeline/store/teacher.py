"""Where `loss.distill.teacher` points: a Hugging Face folder (one holding a config.json) or a committed policy of
a run (a run root: its newest policy; or one of its `policies/step-S` folders, as `model.init_policy`). Resolved
without JAX, so a job refuses a missing teacher before anything starts (`check_teacher`); the learner loads the
weights (`policy.teacher.load_teacher`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipeline.process.config_error import ConfigError
from pipeline.store import layout
from pipeline.store.init_policy import resolve_init_policy
from pipeline.store.storage import RunStore

FIELD = "loss.distill.teacher"
HF_CONFIG = "config.json"


@dataclasses.dataclass(frozen=True)
class TeacherSource:
    """A resolved teacher: `hf_folder` set for a Hugging Face folder, else `store` + `step` of a committed policy."""

    hf_folder: str | None = None
    store: RunStore | None = None
    step: int | None = None


def resolve_teacher(ref: str, storage_options: Mapping[str, Any] | None = None) -> TeacherSource:
    """The teacher `ref` names; ConfigError naming `loss.distill.teacher` when it is neither a folder with a
    config.json nor a run root / policy folder with a committed policy."""
    folder = RunStore(ref, storage_options or None)
    if folder.exists(HF_CONFIG):
        return TeacherSource(hf_folder=ref)
    store, step = resolve_init_policy(ref, storage_options, field=FIELD)
    return TeacherSource(store=store, step=step)


def check_teacher(loss: Any, tokenizer: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Refuse (ConfigError, one line naming `loss.distill.teacher`) a teacher that is not there, or a policy
    committed with another tokenizer than `tokenizer`; nothing when `loss.distill` is unset."""
    distill = getattr(loss, "distill", None)
    if distill is None:
        return
    source = resolve_teacher(distill.teacher, storage_options)
    if source.store is None or source.step is None:
        return
    try:
        marker = source.store.get_json(layout.policy_marker(source.step))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(FIELD, distill.teacher, f"unreadable policy marker: {e}") from None
    used = marker.get("tokenizer") if isinstance(marker, dict) else None
    if used is not None and used != tokenizer:
        raise ConfigError(
            FIELD, distill.teacher, f"policy {source.step} was trained with tokenizer {used!r}, not {tokenizer!r}"
        )
