"""Curriculum files on the run root: the one writer (`CurriculumWriter`, called by the BatchMaker) and the
readers (`load_latest_curriculum`: rollout workers, reports). See the `pipeline.curriculum` package docstring.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

import schemas
from pipeline.config import CurriculumConfig
from pipeline.curriculum.rules import (
    CurriculumState,
    CurriculumStateError,
    CurriculumSyncError,
    fold_eval,
    fold_groups,
    fold_prompts,
    fold_training,
    initial_state,
)
from pipeline.process.exits import DamagedInputError
from pipeline.store import layout
from pipeline.store.storage import CorruptFileError, RunStore
from schemas.base import SchemaMismatchError, ValidationError
from schemas.curriculum import CURRICULUM_STATE
from schemas.records import BatchLogEntry, RecordError

logger = logging.getLogger("pipeline.curriculum")


# ---------------------------------------------------------------------------------------
# files: the one writer, and the readers
# ---------------------------------------------------------------------------------------

_STATE_RE = re.compile(r"^state-(\d{8})\.json$")
_EVAL_DIR_RE = re.compile(r"^step-(\d{8})$")
_SUMMARY_SUFFIX = ".summary.parquet"


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _state_document(state: CurriculumState) -> dict[str, Any]:
    """The JSON object of a state; its `attempt_id` is the content hash, so equal content means equal bytes."""
    obj = CURRICULUM_STATE.to_json(state.to_record())
    obj["attempt_id"] = "sha256:" + hashlib.sha256(_canonical(obj)).hexdigest()[:32]
    return obj


def _published_slots(store: RunStore) -> list[int]:
    slots = []
    for p in store.list(layout.CURRICULUM):
        m = _STATE_RE.match(p.rsplit("/", 1)[-1])
        if m:
            slots.append(int(m.group(1)))
    return slots


def latest_curriculum_slot(store: RunStore) -> int | None:
    """The newest slot with a published state file (listing is the truth), or None."""
    slots = _published_slots(store)
    return max(slots) if slots else None


class DamagedCurriculumStateError(CurriculumStateError, DamagedInputError):
    """A published state file is damaged: cut mid-JSON, of another schema or a newer version, a field missing or
    malformed, or holding another slot. (A state folded under another curriculum config is a plain
    CurriculumStateError: a config change, not damage.)"""

    def __init__(self, path: str, reason: str) -> None:
        DamagedInputError.__init__(self, path, reason)


def load_curriculum_state(store: RunStore, slot: int, cfg: CurriculumConfig) -> CurriculumState:
    """Read and validate `curriculum/state-<slot>.json`.

    Raises FileNotFoundError if absent, DamagedCurriculumStateError (a CurriculumStateError naming the path and
    the field) if it is not valid JSON, not the declared schema/version, malformed or of another slot, and
    CurriculumStateError if it was folded under another curriculum config.
    """
    path = layout.curriculum_state(slot)
    try:
        obj = store.get_json(path)
        rec = CURRICULUM_STATE.from_json(obj, path)
    except FileNotFoundError:
        raise
    except (SchemaMismatchError, ValidationError, CorruptFileError) as e:
        reason = str(e)
        why = reason[len(path) + 2 :] if reason.startswith(f"{path}: ") else reason
        raise DamagedCurriculumStateError(path, why) from None
    if rec.slot != slot:
        raise DamagedCurriculumStateError(path, f"field 'slot': holds slot {rec.slot}, expected {slot}")
    return CurriculumState.from_record(rec, cfg, path)


def load_latest_curriculum(store: RunStore, cfg: CurriculumConfig) -> CurriculumState:
    """The newest intact published curriculum state, or `initial_state(cfg)` when none is published yet.

    For rollout workers: `sample_lesson(sampling_weights(state), rng)`. A damaged state file (see
    `load_curriculum_state`) is quarantined with its reason and the next older one is used (one warning line): every
    state is a function of committed files, and the writer folds the slots after it again. Raises
    CurriculumStateError if the newest intact state was folded under another curriculum config.
    """
    slots = sorted(_published_slots(store), reverse=True)
    if not slots:
        return initial_state(cfg)
    bad = store.quarantined()
    for slot in slots:
        path = layout.curriculum_state(slot)
        if path in bad:
            continue
        try:
            return load_curriculum_state(store, slot, cfg)
        except FileNotFoundError:  # deleted since the listing (retention): an older one
            continue
        except DamagedCurriculumStateError as e:
            store.quarantine(path, e.reason)
            logger.warning("curriculum: %s is damaged (%s); set aside, using the newest older intact state", path,
                           e.reason)  # fmt: skip
    return initial_state(cfg)


class CurriculumWriter:
    """The one writer of curriculum state. The BatchMaker calls `sync(T)` after committing batch slot T.

    Restart-safe: on its first sync it continues from the newest published state (or the initial state), and
    every state it publishes is a function of committed files only. Not thread-safe; one per process.
    """

    def __init__(self, store: RunStore, cfg: CurriculumConfig) -> None:
        self.store = store
        self.cfg = cfg
        self._state: CurriculumState | None = None

    @property
    def state(self) -> CurriculumState:
        """The newest state this writer folded or loaded (resumes from the files on first use)."""
        if self._state is None:
            self._state = load_latest_curriculum(self.store, self.cfg)
            logger.info("curriculum writer resumes after slot %d", self._state.step)
        return self._state

    def sync(self, up_to_slot: int, preloaded: Mapping[str, pa.Table] | None = None) -> CurriculumState:
        """Fold every committed batch slot ≤ up_to_slot not folded yet, publishing one state file per slot.

        Per slot T, in order: the evaluation summaries the slot's log entry names in `curriculum_evals` (the
        BatchMaker records `evals_to_fold(T)` there when it commits T, and their values, `eval_values`, in
        `curriculum_eval_values`, so a rebuild folds exactly what the live run folded, even after
        `evaluate --force`; entries without the values read the files; entries without the names fall back to
        the summaries listed now: policies S < T, eval_type
        "eval", lessons of this curriculum, S newer than the lesson's last folded one), in (S, lesson) order;
        then the rollout files of the entry's `ingested_files`, in that order, rows grouped per lesson (sorted
        ids, row order kept). `preloaded` maps rollout paths to tables the caller already read (avoids a second
        read). Returns the newest state. Raises CurriculumSyncError if a slot's log entry is missing or malformed.
        """
        state = self.state
        if up_to_slot <= state.step:
            return state
        listed: dict[int, list[str]] | None = None
        for slot in range(state.step + 1, up_to_slot + 1):
            entry = self._entry(slot)
            if entry.curriculum_evals is not None:
                evals = self._evals_named(entry.curriculum_evals, slot)
            else:
                if listed is None:
                    listed = self._eval_summaries(state, up_to_slot)
                evals = listed
            state = self._fold_slot(state.with_step(slot), slot, evals, entry, preloaded or {})
            state = self._publish(state)
            self._state = state
        return state

    def evals_to_fold(self, slot: int) -> list[str]:
        """The eval summary paths that folding slot `slot` next would use, for its batch log entry.

        Call after `sync(slot - 1)`: committed summaries of policies S < slot newer than each lesson's last
        folded eval, sorted by (S, path).
        """
        state = self.state
        if state.step != slot - 1:
            raise CurriculumSyncError(f"evals_to_fold({slot}) needs the state of slot {slot - 1}, have {state.step}")
        found = self._eval_summaries(state, slot)
        return [p for s in sorted(found) for p in found[s]]

    def eval_values(self, paths: Sequence[str]) -> dict[str, list[float] | None]:
        """What folding each eval summary in `paths` would read: the success rates of its `eval` rows for its
        lesson (None: unreadable, quarantined). Recorded in the batch log entry next to `curriculum_evals`, so a
        rebuild folds the same values even if `evaluate --force` rewrote a summary since."""
        out: dict[str, list[float] | None] = {}
        for path in paths:
            lesson_id = path.rsplit("/", 1)[-1][: -len(_SUMMARY_SUFFIX)]
            table = self._read_eval_summary(path)
            out[path] = (
                None
                if table is None
                else [
                    row.success_rate
                    for row in schemas.EVAL_SUMMARY.from_table(table)
                    if row.eval_type == "eval" and row.lesson_id == lesson_id
                ]
            )
        return out

    def _evals_named(self, names: Sequence[str], slot: int) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for path in names:
            m = _EVAL_DIR_RE.match(path.rsplit("/", 2)[-2]) if path.count("/") >= 2 else None
            if m is None or not path.endswith(_SUMMARY_SUFFIX):
                raise CurriculumSyncError(f"{layout.batch_log_entry(slot)}: {path!r} is not an eval summary path")
            out.setdefault(int(m.group(1)), []).append(path)
        return out

    # -- one slot ------------------------------------------------------------------------
    def _fold_slot(
        self,
        state: CurriculumState,
        slot: int,
        evals: Mapping[int, Sequence[str]],
        entry: BatchLogEntry,
        preloaded: Mapping[str, pa.Table],
    ) -> CurriculumState:
        recorded = entry.curriculum_eval_values
        for policy_step in sorted(s for s in evals if s < slot):
            for path in evals[policy_step]:
                lesson_id = path.rsplit("/", 1)[-1][: -len(_SUMMARY_SUFFIX)]
                if state.lessons[lesson_id].last_eval_policy_step >= policy_step:
                    continue
                if recorded is not None and path in recorded:  # the values the live fold read (see eval_values)
                    for success in recorded[path] or []:
                        state = fold_eval(state, lesson_id, float(success), slot, policy_step=policy_step)
                    continue
                state = self._fold_eval_file(state, slot, path, lesson_id, policy_step)
        for path in entry.ingested_files:
            table = preloaded.get(path)
            if table is None:
                table = self.store.read_committed(path, schemas.ROLLOUT)
            if table is None:
                logger.warning("curriculum: %s (slot %d) is quarantined; its rewards are not folded", path, slot)
                continue
            state = self._fold_rollouts(state, slot, path, table)
        return state

    def _entry(self, slot: int) -> BatchLogEntry:
        """The committed log entry of `slot`; CurriculumSyncError (naming the file and field) if missing or invalid."""
        path = layout.batch_log_entry(slot)
        try:
            return self.store.read_log_entry(slot)
        except FileNotFoundError:
            raise CurriculumSyncError(
                f"{path}: batch slot {slot} is not committed; sync(up_to_slot) may only name committed slots"
            ) from None
        except (RecordError, CorruptFileError) as e:
            raise CurriculumSyncError(f"not a valid batch log entry: {e}") from None

    def _fold_rollouts(self, state: CurriculumState, slot: int, path: str, table: pa.Table) -> CurriculumState:
        lessons = table.column("lesson_id").to_pylist()
        rewards = table.column("episode_reward").to_pylist()
        groups = zip(table.column("group_key").to_pylist(), table.column("policy_step").to_pylist(), strict=True)
        examples = table.column("example_id").to_pylist()
        by_lesson: dict[str, list[float]] = {}
        by_group: dict[str, dict[tuple[str, int], list[float]]] = {}  # per lesson, groups in order of first row
        example_of: dict[tuple[str, int], str] = {}  # a group is one draw of one prompt: its first row's example id
        for lid, r, g, ex in zip(lessons, rewards, groups, examples, strict=True):
            by_lesson.setdefault(lid, []).append(r)
            by_group.setdefault(lid, {}).setdefault(g, []).append(r)
            example_of.setdefault(g, ex)
        for lid in sorted(by_lesson):
            if lid not in state.lessons:
                logger.warning(
                    "curriculum: %s has %d rows of unknown lesson %r; skipped", path, len(by_lesson[lid]), lid
                )
                continue
            state = fold_training(state, lid, by_lesson[lid], slot)
            state = fold_groups(state, lid, [max(v) == min(v) for v in by_group[lid].values()])
            outcomes = [
                (example_of[g], v[0] if max(v) == min(v) and math.isfinite(v[0]) else None)
                for g, v in by_group[lid].items()
            ]
            state = fold_prompts(state, lid, outcomes, slot)
        return state

    def _fold_eval_file(
        self, state: CurriculumState, slot: int, path: str, lesson_id: str, policy_step: int
    ) -> CurriculumState:
        table = self._read_eval_summary(path)
        if table is None:
            return state
        for row in schemas.EVAL_SUMMARY.from_table(table):
            if row.eval_type != "eval" or row.lesson_id != lesson_id:
                continue
            state = fold_eval(state, lesson_id, row.success_rate, slot, policy_step=policy_step)
        return state

    def _read_eval_summary(self, path: str) -> pa.Table | None:
        """The summary table, or None (quarantined before, vanished, or unreadable: quarantined now)."""
        if self.store.is_quarantined(path):
            return None
        try:
            return self.store.read_parquet(path, schemas.EVAL_SUMMARY)
        except FileNotFoundError:
            logger.warning("curriculum: eval summary %s vanished; skipped", path)
            return None
        except (SchemaMismatchError, CorruptFileError) as e:
            self.store.quarantine(path, f"unreadable eval summary: {e}")
            return None

    def _eval_summaries(self, state: CurriculumState, up_to_slot: int) -> dict[int, list[str]]:
        """Snapshot: {policy step S: sorted summary paths of this curriculum's lessons} for S in the unfolded range."""
        oldest = min(r.last_eval_policy_step for r in state.lessons.values())
        out: dict[int, list[str]] = {}
        for d in self.store.list(layout.EVALS):
            m = _EVAL_DIR_RE.match(d.rsplit("/", 1)[-1])
            if not m:
                continue  # external baselines and other folders do not steer the curriculum
            s = int(m.group(1))
            if s <= oldest or s >= up_to_slot:
                continue
            paths = [
                p
                for p in self.store.list(d)
                if p.endswith(_SUMMARY_SUFFIX) and p.rsplit("/", 1)[-1][: -len(_SUMMARY_SUFFIX)] in state.lessons
            ]
            if paths:
                out[s] = sorted(paths)
        return out

    # -- publish -------------------------------------------------------------------------
    def _publish(self, state: CurriculumState) -> CurriculumState:
        path = layout.curriculum_state(state.step)
        doc = _state_document(state)
        # One key per line and a final newline, so that `grep reason curriculum/state-*.json` prints each reason
        # alone; the bytes are a function of the state, so a rebuild writes the same file.
        if self.store.put_if_absent(path, json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"):
            for e in state.events:
                if e.step == state.step:
                    logger.info("curriculum: %s", e.reason)
            return state
        try:
            existing = self.store.get_json(path)
        except CorruptFileError:
            existing = None
        if existing == doc:
            return state
        if existing is not None and not self.store.is_quarantined(path):
            logger.warning(
                "curriculum: %s was already published with other content (another writer, or other inputs); "
                "adopting the published state",
                path,
            )
            try:
                return load_curriculum_state(self.store, state.step, self.cfg)
            except DamagedCurriculumStateError as e:
                self.store.quarantine(path, e.reason)
        elif existing is None:
            self.store.quarantine(path, "field '<json>': not valid JSON")
        # a damaged file cannot be replaced (create-if-absent): it stays set aside, and this state, folded from the
        # committed files, goes on (readers use the newest intact state; the next slot's file is published as usual)
        logger.warning("curriculum: %s is damaged and set aside; going on with the state folded from committed files",
                       path)  # fmt: skip
        return state
