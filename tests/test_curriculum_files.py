"""The curriculum writer on a real run root: rollout files and batch log entries written by hand (as the
BatchMaker does), evaluation summaries, published state files, restart and rebuild byte-identity."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from log_entries import log_entry, put_log_entry

import schemas
from pipeline.config import CurriculumConfig, LessonConfig, LessonDependency
from pipeline.curriculum import (
    CurriculumStateError,
    CurriculumSyncError,
    CurriculumWriter,
    fold_training,
    initial_state,
    latest_curriculum_slot,
    load_curriculum_state,
    load_latest_curriculum,
    sample_lesson,
    sampling_weights,
)
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import EvalSummaryRow, RolloutRow

WINDOW = 8


def config() -> CurriculumConfig:
    return CurriculumConfig(
        lessons={
            "addition_easy": LessonConfig(lesson_id="addition_easy", plateau_window=WINDOW),
            "addition_medium": LessonConfig(
                lesson_id="addition_medium",
                dependencies=[LessonDependency("addition_easy", reward_threshold=0.6)],
                start_threshold=0.1,
                plateau_window=WINDOW,
            ),
        },
        minimum_sample_probability=0.05,
    )


def rollout_rows(lesson: str, rewards: list[float], policy_step: int, tag: str) -> list[RolloutRow]:
    return [
        RolloutRow(
            rollout_id=f"{tag}-{i}",
            env_name="arith",
            example_id=f"ex{i // 2}",
            lesson_id=lesson,
            group_key=f"{tag}-g{i // 2}",
            prompt_tokens=[1, 2, 3],
            response_tokens=[4, 5],
            response_logprobs=[-0.1, -0.2],
            token_rewards=[0.0, r],
            response_loss_mask=[1, 1],
            episode_reward=r,
            truncated=False,
            finish_reason="stop",
            temperature=1.0,
            policy_step=policy_step,
            worker_id="w0",
            timestamp=0.0,
        )
        for i, r in enumerate(rewards)
    ]


def write_rollouts(store: RunStore, policy_step: int, seq: int, rows: list[RolloutRow]) -> str:
    path = layout.rollout_file(policy_step, "w0", seq)
    assert store.commit_data(path, schemas.ROLLOUT.to_table(rows), schemas.ROLLOUT)
    return path


def commit_slot(store: RunStore, slot: int, files: list[str]) -> None:
    assert put_log_entry(store, slot, ingested_files=files)


def write_eval(store: RunStore, policy_step: int, lesson: str, success: float, eval_type: str = "eval") -> None:
    row = EvalSummaryRow(
        policy_step=policy_step,
        lesson_id=lesson,
        eval_type=eval_type,
        n_examples=16,
        mean_reward=success,
        success_rate=success,
        mean_response_tokens=3.0,
        truncation_rate=0.0,
        temperature=0.0,
        source="test",
        timestamp=0.0,
    )
    store.write_parquet(
        layout.eval_summary_file(policy_step, lesson), schemas.EVAL_SUMMARY.to_table([row]), schemas.EVAL_SUMMARY
    )


def build_run(store: RunStore) -> None:
    """Slots 1-4 as a BatchMaker would commit them, plus evaluations of policies 0-2."""
    mixed = [0.0, 1.0] * 4
    f1 = write_rollouts(store, 0, 0, rollout_rows("addition_easy", mixed, 0, "a"))
    f2 = write_rollouts(store, 0, 1, rollout_rows("addition_easy", mixed, 0, "b"))
    commit_slot(store, 1, [f1, f2])  # easy at ~0.5: medium stays locked
    f3 = write_rollouts(store, 1, 0, rollout_rows("addition_easy", [1.0] * 8, 1, "c"))
    f4 = write_rollouts(store, 1, 1, rollout_rows("addition_easy", [1.0] * 8, 1, "d"))
    commit_slot(store, 2, [f3, f4])  # easy reaches ~0.6+ and plateaus: medium unlocks (start_threshold 0.1)
    f5 = write_rollouts(store, 2, 0, rollout_rows("addition_easy", [1.0] * 4, 2, "e"))
    commit_slot(store, 3, [f5])
    mixed_file = rollout_rows("addition_easy", [1.0] * 2, 3, "f") + rollout_rows("addition_medium", [0.0, 1.0], 3, "g")
    f6 = write_rollouts(store, 3, 0, mixed_file)
    commit_slot(store, 4, [f6])
    write_eval(store, 0, "addition_medium", 0.0)
    write_eval(store, 2, "addition_medium", 0.25)  # folded at slot 3 (policy 2 < 3): activates medium
    write_eval(store, 2, "addition_easy", 0.75, eval_type="micro_eval")  # logged only, never folded


def state_files(store: RunStore) -> dict[str, bytes]:
    return {p: store.get(p) for p in store.list(layout.CURRICULUM)}


def test_writer_unlocks_second_lesson_with_reason(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    cfg = config()
    assert load_latest_curriculum(store, cfg).status("addition_medium") == "locked"  # nothing published yet
    build_run(store)
    writer = CurriculumWriter(store, cfg)
    state = writer.sync(4)
    assert latest_curriculum_slot(store) == 4
    assert [p.rsplit("/", 1)[-1] for p in store.list(layout.CURRICULUM)] == [
        f"state-0000000{i}.json" for i in range(1, 5)
    ]
    s1 = load_curriculum_state(store, 1, cfg)
    assert s1.status("addition_medium") == "locked"
    s2 = load_curriculum_state(store, 2, cfg)
    assert s2.status("addition_medium") == "unlocked"
    unlock = [e for e in s2.events if e.lesson_id == "addition_medium"]
    assert len(unlock) == 1 and unlock[0].step == 2
    # it unlocked right after the first all-correct file of slot 2: the same fold, done by the pure functions
    pure = initial_state(cfg)
    for rewards, slot in (([0.0, 1.0] * 4, 1), ([0.0, 1.0] * 4, 1), ([1.0] * 8, 2)):
        pure = fold_training(pure, "addition_easy", rewards, slot)
    assert pure.status("addition_medium") == "unlocked"
    easy = pure.success("addition_easy")
    assert easy is not None and easy >= 0.6
    assert unlock[0].reason == (
        f"`addition_medium` unlocked at step 2: `addition_easy` reached {easy:.3g} ≥ 0.6 "
        f"and plateaued over {WINDOW} samples"
    )
    s3 = load_curriculum_state(store, 3, cfg)
    assert s3.status("addition_medium") == "active"
    assert s3.events[-1].reason == "`addition_medium` active at step 3: eval success 0.167 ≥ start_threshold 0.1"
    # the published file is the declared schema, with the weights readers sample from
    obj = json.loads(store.get(layout.curriculum_state(4)))
    assert obj["schema"] == "curriculum_state" and obj["schema_version"] == 2
    assert obj["weights"] == sampling_weights(state)
    assert obj["lessons"]["addition_medium"]["train_samples"] == 2
    assert obj["lessons"]["addition_medium"]["eval_count"] == 2  # micro_eval not folded
    assert obj["lessons"]["addition_easy"]["eval_count"] == 0
    # a rollout worker reads the newest state and samples from it
    latest = load_latest_curriculum(store, cfg)
    assert latest.step == 4 and latest == state
    assert sample_lesson(sampling_weights(latest), np.random.default_rng(0)) in cfg.lessons


def test_restart_and_rebuild_write_identical_bytes(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    cfg = config()
    build_run(store)
    CurriculumWriter(store, cfg).sync(2)  # a writer that dies after slot 2 ...
    restarted = CurriculumWriter(store, cfg)  # ... and a fresh process that continues from the files
    assert restarted.state.step == 2
    restarted.sync(3)
    restarted.sync(3)  # idempotent
    CurriculumWriter(store, cfg).sync(4)
    resumed = state_files(store)
    for p in resumed:
        store.delete(p)
    assert latest_curriculum_slot(store) is None
    CurriculumWriter(store, cfg).sync(4)  # rebuilt from nothing in one go
    assert state_files(store) == resumed
    # a second writer racing over the same slots publishes nothing different
    CurriculumWriter(store, cfg).sync(4)
    assert state_files(store) == resumed


def test_preloaded_tables_give_the_same_state(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    cfg = config()
    build_run(store)
    entry = store.get_json(layout.batch_log_entry(1))
    preloaded = {p: store.read_committed(p, schemas.ROLLOUT) for p in entry["ingested_files"]}
    CurriculumWriter(store, cfg).sync(1, preloaded={k: v for k, v in preloaded.items() if v is not None})
    other = RunStore(str(tmp_path / "other"))
    build_run(other)
    CurriculumWriter(other, cfg).sync(1)
    assert store.get(layout.curriculum_state(1)) == other.get(layout.curriculum_state(1))


def test_quarantined_rollout_file_is_skipped(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    cfg = config()
    good = write_rollouts(store, 0, 0, rollout_rows("addition_easy", [1.0] * 4, 0, "a"))
    bad = write_rollouts(store, 0, 1, rollout_rows("addition_easy", [0.0] * 4, 0, "b"))
    (tmp_path / bad).write_bytes(b"garbage")
    commit_slot(store, 1, [good, bad])
    state = CurriculumWriter(store, cfg).sync(1)
    assert state.lessons["addition_easy"].train_samples == 4
    assert store.is_quarantined(bad)


def test_missing_slot_and_bad_log_entry_are_loud(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    cfg = config()
    with pytest.raises(CurriculumSyncError, match=r"batches/log/step-00000001\.json"):
        CurriculumWriter(store, cfg).sync(1)
    malformed = log_entry(1).to_dict()
    del malformed["ingested_files"]
    store.put_json_if_absent(layout.batch_log_entry(1), malformed)
    with pytest.raises(CurriculumSyncError, match=r"step-00000001\.json: field 'ingested_files': missing"):
        CurriculumWriter(store, cfg).sync(1)


def test_readers_refuse_bad_or_foreign_state_files(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    cfg = config()
    build_run(store)
    CurriculumWriter(store, cfg).sync(1)
    other = CurriculumConfig(
        lessons={k: v for k, v in cfg.lessons.items() if k == "addition_easy"}, minimum_sample_probability=0.05
    )
    with pytest.raises(CurriculumStateError, match=r"state-00000001\.json: folded under curriculum config"):
        load_latest_curriculum(store, other)
    obj = json.loads(store.get(layout.curriculum_state(1)))
    store.put_unique(layout.curriculum_state(2), json.dumps({**obj, "schema_version": 9}).encode())
    with pytest.raises(CurriculumStateError, match=r"state-00000002\.json: expected schema curriculum_state@v2"):
        load_curriculum_state(store, 2, cfg)
    store.put_unique(layout.curriculum_state(3), b"{not json")
    with pytest.raises(CurriculumStateError, match=r"state-00000003\.json"):
        load_curriculum_state(store, 3, cfg)
    # a reader of the newest state sets the damaged ones aside with their reasons and uses the newest intact one
    assert load_latest_curriculum(store, cfg).step == 1
    assert store.quarantined() == {layout.curriculum_state(2), layout.curriculum_state(3)}
    assert "curriculum_state@v9" in store.get_json(layout.quarantine_record(layout.curriculum_state(2)))["reason"]


def test_rebuild_folds_recorded_eval_values_after_evaluate_force(tmp_path: Path) -> None:
    """Slots committed as the BatchMaker does (eval names and values in the entry, then a sync) rebuild to the same
    bytes after `evaluate --force` rewrote a folded summary; an entry without the values would not."""
    cfg = config()

    def run(root: Path, record_values: bool) -> RunStore:
        store = RunStore(str(root))
        build_run(store)
        writer = CurriculumWriter(store, cfg)
        for slot in range(1, 5):  # the maker's commit: names (and values) fixed when slot T is committed
            entry = store.get_json(layout.batch_log_entry(slot))
            store.delete(layout.batch_log_entry(slot))
            entry["curriculum_evals"] = writer.evals_to_fold(slot)
            if record_values:
                entry["curriculum_eval_values"] = writer.eval_values(entry["curriculum_evals"])
            assert store.put_json_if_absent(layout.batch_log_entry(slot), entry)
            writer.sync(slot)
        return store

    for record_values, rebuilds_same in ((True, True), (False, False)):
        store = run(tmp_path / f"values-{record_values}", record_values)
        live = state_files(store)
        assert load_curriculum_state(store, 3, cfg).status("addition_medium") == "active"
        store.delete(layout.eval_summary_file(2, "addition_medium"))
        write_eval(store, 2, "addition_medium", 0.0)  # `evaluate --force` scored policy 2 again, differently
        for p in live:
            store.delete(p)
        CurriculumWriter(store, cfg).sync(4)
        assert (state_files(store) == live) is rebuilds_same
