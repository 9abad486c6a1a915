"""The published curriculum state: a small, versioned JSON document, one per batch slot.

`curriculum/state-<slot>.json` is written once (create-if-absent) by the one curriculum writer and
read by rollout workers to sample lessons. Its envelope names the schema and version:

    {"schema": "curriculum_state", "schema_version": 2, "slot": 40, "config_fingerprint": "…",
     "rules": {...constants of the folding rules...},
     "lessons": {"<lesson_id>": {<LessonRecord fields>, "prompts": {"<example_id>": {<PromptRecord fields>}}}, ...},
     "weights": {"<lesson_id>": p, ...},              # sampling probabilities after this slot
     "events": [{<CurriculumEvent fields>}, ...],    # every status change so far, oldest first
     "attempt_id": "sha256:…"}                        # content hash (identical content, identical id)

`CURRICULUM_STATE.to_json(record)` and `CURRICULUM_STATE.from_json(obj, path)` are exact inverses;
`from_json` checks the schema name and version (SchemaMismatchError naming the path, the expected and
the found version) and every field (ValidationError naming the path and the field). Pure Python.

Versions: 2 added each lesson's `prompts` (the per-prompt outcome records of difficulty-aware sampling,
`curriculum.skip_after`); version 1 files (written before it) are still read, as lessons without prompt records.
Writers write version 2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from schemas.base import SchemaMismatchError, ValidationError

LESSON_STATUSES = ("locked", "unlocked", "active", "graduated")
"""locked: a dependency is not met; unlocked: dependencies met, eval below start_threshold (not trained on);
active: trained on with adaptive weight; graduated: eval ≥ stop_threshold and plateaued (floor weight only)."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """The recent outcomes of one prompt (example id) of a lesson: only prompts whose newest draws had no reward
    spread are recorded (`pipeline.curriculum.rules.fold_prompts`).

    streak: consecutive draws (groups), newest last, in which every sample got the same reward `reward` (capped at
        `curriculum.skip_after`); the prompt is skipped by training draws once it reaches `skip_after`.
    reward: that common episode reward (e.g. 1: solved by every sample, 0: solved by none).
    last_slot: the batch slot whose fold saw its newest draw.
    """

    streak: int
    reward: float
    last_slot: int


@dataclasses.dataclass(frozen=True)
class LessonRecord:
    """Statistics and status of one lesson.

    train_success: bias-corrected EMA of clipped training episode rewards (None before any).
    train_samples: training rewards folded so far.
    recent_rewards: the last `plateau_window` clipped training rewards, oldest first.
    eval_success: bias-corrected EMA of full-evaluation success rates (None before any).
    eval_count: evaluation summaries folded so far.
    last_eval_policy_step: policy step of the newest folded evaluation (-1: none).
    last_train_slot: batch slot of the newest folded training reward (-1: none).
    recent_groups: the last `SATURATION_WINDOW` (`pipeline.curriculum.rules`) training groups folded, oldest first:
        1 for a group whose rewards were all equal (no learning signal), 0 otherwise (absent in older files: ()).
    prompts: per example id, its `PromptRecord` (empty unless `curriculum.skip_after` > 0; absent in version 1
        files: {}); at most `curriculum.max_tracked_prompts` of them.
    """

    status: str
    train_success: float | None = None
    train_samples: int = 0
    recent_rewards: tuple[float, ...] = ()
    eval_success: float | None = None
    eval_count: int = 0
    last_eval_policy_step: int = -1
    last_train_slot: int = -1
    recent_groups: tuple[int, ...] = ()
    prompts: Mapping[str, PromptRecord] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CurriculumEvent:
    """One status change of one lesson, with the human reason."""

    step: int
    lesson_id: str
    from_status: str
    to_status: str
    reason: str


@dataclasses.dataclass(frozen=True)
class CurriculumStateRecord:
    """The whole published state after batch slot `slot` (0: before any batch)."""

    slot: int
    config_fingerprint: str
    rules: Mapping[str, float]
    lessons: Mapping[str, LessonRecord]
    weights: Mapping[str, float]
    events: tuple[CurriculumEvent, ...]


def _fail(path: str, field: str, why: str) -> ValidationError:
    return ValidationError(f"{path}: field {field}: {why}")


def _get(obj: Mapping[str, Any], key: str, path: str, where: str) -> Any:
    if key not in obj:
        raise _fail(path, f"{where}{key}", "missing")
    return obj[key]


def _int(v: Any, path: str, field: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise _fail(path, field, f"must be an integer, got {v!r}")
    return v


def _float(v: Any, path: str, field: str, *, unit: bool = False) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise _fail(path, field, f"must be a finite number, got {v!r}")
    if unit and not -1e-9 <= v <= 1.0 + 1e-9:
        raise _fail(path, field, f"must be in [0, 1], got {v!r}")
    return float(v)


def _opt_unit(v: Any, path: str, field: str) -> float | None:
    return None if v is None else _float(v, path, field, unit=True)


def _groups(v: Any, path: str, field: str) -> tuple[int, ...]:
    if not isinstance(v, list) or any(x not in (0, 1) or isinstance(x, bool) for x in v):
        raise _fail(path, field, f"must be a list of 0/1, got {v!r}")
    return tuple(int(x) for x in v)


def _prompts(v: Any, path: str, field: str) -> dict[str, PromptRecord]:
    if not isinstance(v, dict):
        raise _fail(path, field, f"must be an object, got {v!r}")
    out = {}
    for k, rec in v.items():
        where = f"{field}.{k}"
        if not isinstance(rec, dict):
            raise _fail(path, where, "must be an object")
        streak = _int(_get(rec, "streak", path, f"{where}."), path, f"{where}.streak")
        if streak < 1:
            raise _fail(path, f"{where}.streak", f"must be >= 1, got {streak}")
        out[str(k)] = PromptRecord(
            streak=streak,
            reward=_float(_get(rec, "reward", path, f"{where}."), path, f"{where}.reward"),
            last_slot=_int(_get(rec, "last_slot", path, f"{where}."), path, f"{where}.last_slot"),
        )
    return out


def _str(v: Any, path: str, field: str) -> str:
    if not isinstance(v, str) or not v:
        raise _fail(path, field, f"must be a non-empty string, got {v!r}")
    return v


def _status(v: Any, path: str, field: str) -> str:
    if v not in LESSON_STATUSES:
        raise _fail(path, field, f"must be one of {LESSON_STATUSES}, got {v!r}")
    return str(v)


@dataclasses.dataclass(frozen=True)
class JsonSpec:
    """A declared JSON document: name, version, and exact conversion both ways with validation."""

    name: str
    version: int
    readable: tuple[int, ...] = ()
    """Older versions `from_json` still accepts (besides `version`), each read as `version` with its missing fields
    at their defaults."""

    @property
    def tag(self) -> str:
        """`name@vN`, how files and errors name this schema."""
        return f"{self.name}@v{self.version}"

    def to_json(self, rec: CurriculumStateRecord) -> dict[str, Any]:
        """The JSON object of a state record (plain dicts, lists, numbers and strings)."""
        return {
            "schema": self.name,
            "schema_version": self.version,
            "slot": rec.slot,
            "config_fingerprint": rec.config_fingerprint,
            "rules": dict(rec.rules),
            "lessons": {
                k: {
                    **dataclasses.asdict(v),
                    "recent_rewards": list(v.recent_rewards),
                    "recent_groups": list(v.recent_groups),
                    "prompts": {p: dataclasses.asdict(r) for p, r in sorted(v.prompts.items())},
                }
                for k, v in rec.lessons.items()
            },
            "weights": dict(rec.weights),
            "events": [dataclasses.asdict(e) for e in rec.events],
        }

    def from_json(self, obj: Any, path: str) -> CurriculumStateRecord:
        """Parse and validate a state document read from `path`.

        Raises SchemaMismatchError (other schema or version) or ValidationError (naming the field).
        """
        if not isinstance(obj, dict):
            raise SchemaMismatchError(path, self.tag, f"a JSON {type(obj).__name__}, not an object")
        found = f"{obj.get('schema', '<none>')}@v{obj.get('schema_version', '<none>')}"
        if found != self.tag and found not in {f"{self.name}@v{v}" for v in self.readable}:
            raise SchemaMismatchError(path, self.tag, found)
        slot = _int(_get(obj, "slot", path, ""), path, "slot")
        if slot < 0:
            raise _fail(path, "slot", f"must be >= 0, got {slot}")
        fingerprint = _str(_get(obj, "config_fingerprint", path, ""), path, "config_fingerprint")
        rules_obj = _get(obj, "rules", path, "")
        if not isinstance(rules_obj, dict):
            raise _fail(path, "rules", "must be an object")
        rules = {str(k): _float(v, path, f"rules.{k}") for k, v in rules_obj.items()}
        lessons_obj = _get(obj, "lessons", path, "")
        if not isinstance(lessons_obj, dict) or not lessons_obj:
            raise _fail(path, "lessons", "must be a non-empty object")
        lessons = {str(k): self._lesson(v, path, f"lessons.{k}") for k, v in lessons_obj.items()}
        weights_obj = _get(obj, "weights", path, "")
        if not isinstance(weights_obj, dict):
            raise _fail(path, "weights", "must be an object")
        weights = {str(k): _float(v, path, f"weights.{k}", unit=True) for k, v in weights_obj.items()}
        unknown = sorted(set(weights) - set(lessons))
        if unknown:
            raise _fail(path, "weights", f"names lessons not in the state: {unknown}")
        if weights and abs(sum(weights.values()) - 1.0) > 1e-6:
            raise _fail(path, "weights", f"must sum to 1, sum is {sum(weights.values())!r}")
        events_obj = _get(obj, "events", path, "")
        if not isinstance(events_obj, list):
            raise _fail(path, "events", "must be a list")
        events = tuple(self._event(e, path, f"events[{i}]") for i, e in enumerate(events_obj))
        return CurriculumStateRecord(
            slot=slot, config_fingerprint=fingerprint, rules=rules, lessons=lessons, weights=weights, events=events
        )

    @staticmethod
    def _lesson(v: Any, path: str, where: str) -> LessonRecord:
        if not isinstance(v, dict):
            raise _fail(path, where, "must be an object")
        rr = _get(v, "recent_rewards", path, f"{where}.")
        if not isinstance(rr, list):
            raise _fail(path, f"{where}.recent_rewards", "must be a list")
        rec = LessonRecord(
            status=_status(_get(v, "status", path, f"{where}."), path, f"{where}.status"),
            train_success=_opt_unit(_get(v, "train_success", path, f"{where}."), path, f"{where}.train_success"),
            train_samples=_int(_get(v, "train_samples", path, f"{where}."), path, f"{where}.train_samples"),
            recent_rewards=tuple(_float(x, path, f"{where}.recent_rewards[{i}]", unit=True) for i, x in enumerate(rr)),
            eval_success=_opt_unit(_get(v, "eval_success", path, f"{where}."), path, f"{where}.eval_success"),
            eval_count=_int(_get(v, "eval_count", path, f"{where}."), path, f"{where}.eval_count"),
            last_eval_policy_step=_int(
                _get(v, "last_eval_policy_step", path, f"{where}."), path, f"{where}.last_eval_policy_step"
            ),
            last_train_slot=_int(_get(v, "last_train_slot", path, f"{where}."), path, f"{where}.last_train_slot"),
            recent_groups=_groups(v.get("recent_groups", []), path, f"{where}.recent_groups"),
            prompts=_prompts(v.get("prompts", {}), path, f"{where}.prompts"),
        )
        if rec.train_samples < 0 or rec.eval_count < 0:
            raise _fail(path, where, "sample counts must be >= 0")
        if (rec.train_success is None) != (rec.train_samples == 0):
            raise _fail(path, f"{where}.train_success", "must be null exactly when train_samples is 0")
        if (rec.eval_success is None) != (rec.eval_count == 0):
            raise _fail(path, f"{where}.eval_success", "must be null exactly when eval_count is 0")
        return rec

    @staticmethod
    def _event(v: Any, path: str, where: str) -> CurriculumEvent:
        if not isinstance(v, dict):
            raise _fail(path, where, "must be an object")
        return CurriculumEvent(
            step=_int(_get(v, "step", path, f"{where}."), path, f"{where}.step"),
            lesson_id=_str(_get(v, "lesson_id", path, f"{where}."), path, f"{where}.lesson_id"),
            from_status=_status(_get(v, "from_status", path, f"{where}."), path, f"{where}.from_status"),
            to_status=_status(_get(v, "to_status", path, f"{where}."), path, f"{where}.to_status"),
            reason=_str(_get(v, "reason", path, f"{where}."), path, f"{where}.reason"),
        )


CURRICULUM_STATE = JsonSpec(name="curriculum_state", version=2, readable=(1,))
"""The declared schema of `curriculum/state-<slot>.json`."""
