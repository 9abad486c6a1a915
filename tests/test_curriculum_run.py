"""A real run with a two-lesson curriculum (configs/arithmetic_curriculum.yaml): `addition_medium` unlocks from
`addition_easy`, the curriculum files say when and why, the rollout files agree, and re-folding the committed
files reproduces the published states.

The shipped config is sized for CPU: one-token answers (with `max_tokens: 6` the random tiny model never answers
with a plain integer, every reward is 0 and no group has variance); a digit (10 of 512 tokens) earns partial credit
often enough for RLOO to learn to answer with digits within ~10 steps; the dependency threshold is low (0.03: the
combined success is 2/3 greedy exact-answer eval + 1/3 training reward, and greedy exact answers stay rare at
this size).

Measured (2 CPU cores, evaluator on, two jobs side by side as under CI's two test workers): the job takes ~2.4 min.
At learning_rate 0.003 the unlock happened at slots 6, 7, 9, 13 (alone) and 16, 6 (paired) of 20: too close to the end
for the medium lesson to be sampled reliably; at 0.005 at 13, 10, 8, 5; at the shipped 0.01 at 9, 8, 8, 5, 7, 5.
The job's evaluator stays on, so evaluation summaries steer the curriculum as in a real run; the batch log
entry of each slot names the summaries folded at that slot, so a rebuild folds the same ones and writes the same
bytes.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import draccus
import pytest
from jobs import ROOT, run_job

from pipeline.config import RLJobConfig
from pipeline.curriculum import (
    CurriculumEvent,
    CurriculumState,
    CurriculumWriter,
    latest_curriculum_slot,
    load_curriculum_state,
    load_latest_curriculum,
)
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import ROLLOUT

ARITHMETIC_CONFIG = ROOT / "configs/arithmetic_curriculum.yaml"
EASY, MEDIUM = "addition_easy", "addition_medium"
NUM_STEPS = 20
DEPENDENCY_THRESHOLD = 0.03
"""reward_threshold of addition_medium's dependency on addition_easy, as shipped."""


def arithmetic_job_config(tmp_path: Path, run_root: Path) -> tuple[Path, RLJobConfig]:
    """The shipped arithmetic curriculum job on `run_root`; returns (config file, parsed config)."""
    cfg = draccus.parse(RLJobConfig, config_path=str(ARITHMETIC_CONFIG), args=[])
    (dep,) = cfg.curriculum.lessons[MEDIUM].dependencies
    assert dep.dependency_id == EASY and dep.reward_threshold == DEPENDENCY_THRESHOLD
    assert cfg.train.num_train_steps == NUM_STEPS
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, run_root=str(run_root)))
    path = tmp_path / "job.yaml"
    path.write_text(draccus.dump(cfg))
    return path, cfg


def committed_slots(store: RunStore) -> list[int]:
    return sorted(layout.parse_step(p) for p in store.list(layout.BATCH_LOG) if p.endswith(".json"))


def state_slots(store: RunStore) -> list[int]:
    return sorted(int(p.rsplit("-", 1)[1].split(".")[0]) for p in store.list(layout.CURRICULUM))


def rollout_rows(store: RunStore) -> dict[str, list[tuple[int, str]]]:
    """{committed rollout file: [(policy_step, lesson_id) per row]} over every policy folder."""
    out = {}
    for folder in store.list(layout.ROLLOUTS):
        for path in store.list_committed(folder):
            table = store.read_committed(path, ROLLOUT)
            assert table is not None, f"{path} was quarantined"
            out[path] = list(
                zip(table.column("policy_step").to_pylist(), table.column("lesson_id").to_pylist(), strict=True)
            )
    return out


def refold(src: Path, dest: Path, cfg: RLJobConfig, keep_up_to: int | None) -> RunStore:
    """A copy of the run root whose curriculum states after `keep_up_to` (all: None) are deleted, then folded again
    by a new CurriculumWriter (which resumes from the newest state left) up to the last committed slot."""
    shutil.copytree(src, dest)
    store = RunStore(str(dest))
    for slot in state_slots(store):
        if keep_up_to is None or slot > keep_up_to:
            store.delete(layout.curriculum_state(slot))
    writer = CurriculumWriter(store, cfg.curriculum)
    assert writer.state.step == (keep_up_to or 0)
    writer.sync(committed_slots(store)[-1])
    return store


@dataclasses.dataclass(frozen=True)
class FinishedRun:
    run_root: Path
    cfg: RLJobConfig
    store: RunStore


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    base = tmp_path_factory.mktemp("curriculum-job")
    run_root = base / "run"
    config_path, cfg = arithmetic_job_config(base, run_root)
    proc = run_job(config_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    store = RunStore(str(run_root))
    assert committed_slots(store) == list(range(1, NUM_STEPS + 1))
    return FinishedRun(run_root=run_root, cfg=cfg, store=store)


def published_states(run: FinishedRun) -> dict[int, CurriculumState]:
    """Every published state, one per committed batch slot (the BatchMaker is the one curriculum writer)."""
    slots = committed_slots(run.store)
    assert state_slots(run.store) == slots, (
        f"curriculum/ holds states {state_slots(run.store)} for batch slots {slots}: is the curriculum folded by "
        "the BatchMaker (pipeline.curriculum.CurriculumWriter.sync after each committed slot)?"
    )
    assert latest_curriculum_slot(run.store) == slots[-1]
    return {s: load_curriculum_state(run.store, s, run.cfg.curriculum) for s in slots}


def unlock_event(state: CurriculumState) -> CurriculumEvent:
    unlocks = [e for e in state.events if e.lesson_id == MEDIUM and e.to_status == "unlocked"]
    assert len(unlocks) == 1, state.events
    return unlocks[0]


@pytest.mark.slow
def test_second_lesson_unlocks_with_recorded_reason(finished_run: FinishedRun) -> None:
    states = published_states(finished_run)
    final = load_latest_curriculum(finished_run.store, finished_run.cfg.curriculum)
    assert final.step == NUM_STEPS

    # addition_medium: locked at the start, unlocked once with a reason naming its dependency and the threshold
    unlock = unlock_event(final)
    u = unlock.step
    assert unlock.from_status == "locked"
    assert 1 <= u <= NUM_STEPS
    assert unlock.reason.startswith(f"`{MEDIUM}` unlocked at step {u}: `{EASY}` reached "), unlock.reason
    m = re.search(r"reached ([0-9.eE+-]+) ≥ ([0-9.eE+-]+) and plateaued over (\d+) samples$", unlock.reason)
    assert m, unlock.reason
    assert float(m.group(2)) == pytest.approx(DEPENDENCY_THRESHOLD)
    assert float(m.group(1)) >= DEPENDENCY_THRESHOLD
    assert int(m.group(3)) == finished_run.cfg.curriculum.lessons[EASY].plateau_window
    # every published state agrees with the event: locked (weight 0) before slot u, not locked from u on
    for s, st in states.items():
        assert (st.status(MEDIUM) == "locked") == (s < u), (s, st.status(MEDIUM), u)
        if s < u:
            assert st.to_record().weights[MEDIUM] == 0.0
            assert st.success(EASY) is None or st.success(EASY) < DEPENDENCY_THRESHOLD or not st.plateaued(EASY)
    assert [e.to_status for e in final.events if e.lesson_id == MEDIUM][:2] == ["unlocked", "active"]
    assert final.status(MEDIUM) in ("active", "graduated")

    # rollouts: addition_medium only after the unlock. Every file the BatchMaker ingested into slots <= u was
    # committed before state u was published, so none may hold a medium row; medium rows exist (the unlock took
    # effect) and come from policies no older than u - max_batches_ahead (the newest policy when state u appeared:
    # the learner trains policy u from slot u only after slot u is committed)
    store = finished_run.store
    rows = rollout_rows(store)
    ingested_up_to_u = {f for s in range(1, u + 1) for f in store.get_json(layout.batch_log_entry(s))["ingested_files"]}
    assert ingested_up_to_u
    early_medium = sorted(f for f in ingested_up_to_u if any(lesson == MEDIUM for _, lesson in rows[f]))
    assert not early_medium, f"medium rollouts ingested into slots <= {u}: {early_medium[:5]}"
    medium_policies = sorted({p for f in rows for p, lesson in rows[f] if lesson == MEDIUM})
    assert medium_policies, "addition_medium was unlocked but never sampled"
    assert min(medium_policies) >= u - finished_run.cfg.train.max_batches_ahead, (u, medium_policies)
    easy_policies = sorted({p for f in rows for p, lesson in rows[f] if lesson == EASY})
    assert easy_policies[0] == 0 < min(medium_policies)


RESTARTS = ("resumed_before_unlock", "rebuilt_from_nothing")


def refolded(run: FinishedRun, dest: Path, restart: str) -> tuple[dict[int, CurriculumState], RunStore]:
    """(published states, a copy of the run root whose states were folded again by a restarted writer)."""
    states = published_states(run)
    keep = unlock_event(states[NUM_STEPS]).step - 1 if restart == "resumed_before_unlock" else None
    return states, refold(run.run_root, dest, run.cfg, keep)


@pytest.mark.slow
@pytest.mark.parametrize("restart", RESTARTS)
def test_refolding_the_committed_files_gives_the_same_events(
    finished_run: FinishedRun, tmp_path: Path, restart: str
) -> None:
    """Restarting the curriculum writer changes nothing: resumed from the state before the unlock, or rebuilding
    with no state at all, it records the same status changes (slots, lessons, reasons) from the committed files."""
    states, again = refolded(finished_run, tmp_path / "run", restart)
    assert state_slots(again) == sorted(states)
    refolded_events = load_latest_curriculum(again, finished_run.cfg.curriculum).events
    assert refolded_events == states[NUM_STEPS].events


@pytest.mark.slow
@pytest.mark.parametrize("restart", RESTARTS)
def test_refolding_the_committed_files_gives_byte_identical_states(
    finished_run: FinishedRun, tmp_path: Path, restart: str
) -> None:
    """What pipeline.curriculum promises: "a writer restarted from its newest published state, or rebuilt from
    nothing, writes the same bytes" (statistics, weights and events of every slot)."""
    states, again = refolded(finished_run, tmp_path / "run", restart)
    differing = {}
    for s in states:
        path = layout.curriculum_state(s)
        mine, theirs = again.get_json(path), finished_run.store.get_json(path)
        if mine != theirs:
            differing[s] = state_diff(mine, theirs)
    assert not differing, f"re-folded vs published state, per slot: {differing}"


def state_diff(mine: dict, theirs: dict) -> dict[str, object]:
    """The differing top-level keys of two state documents, and per lesson the differing fields (mine, theirs)."""
    out: dict[str, object] = {k: "differs" for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)}
    for lesson, rec in mine.get("lessons", {}).items():
        other = theirs.get("lessons", {}).get(lesson, {})
        fields = {k: (v, other.get(k)) for k, v in rec.items() if v != other.get(k) and k != "recent_rewards"}
        if fields:
            out[lesson] = fields
    return out
