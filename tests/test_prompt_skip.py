"""Difficulty-aware prompt sampling (`curriculum.skip_after`): the per-prompt outcome records the curriculum folds
from committed rollout files, their schema, and the training draw that passes over solved or hopeless prompts.

Real parts: a real run root, rollout files and batch log entries committed as the BatchMaker commits them, the
one curriculum writer (also SIGKILLed as its own process), `CatsEnv` drawing through the shared draw."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from log_entries import put_log_entry

import schemas
from pipeline.config import ConfigError, CurriculumConfig, EnvConfig, LessonConfig
from pipeline.curriculum import (
    CurriculumState,
    CurriculumWriter,
    config_fingerprint,
    fold_prompts,
    initial_state,
    load_latest_curriculum,
)
from pipeline.environments.base import PromptSkip, SampleSpec, draw_skipping
from pipeline.environments.cats import TRAIN_PROMPTS, CatsEnv
from pipeline.environments.scripted import ScriptedContext
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import RolloutRow
from schemas.base import ValidationError
from schemas.curriculum import CURRICULUM_STATE

LESSON = "cats"


def config(skip_after: int = 2, retest_rate: float = 0.0, max_tracked_prompts: int = 1024) -> CurriculumConfig:
    return CurriculumConfig(
        lessons={LESSON: LessonConfig(lesson_id=LESSON, env=EnvConfig("pipeline.environments.cats.CatsEnv"))},
        skip_after=skip_after,
        retest_rate=retest_rate,
        max_tracked_prompts=max_tracked_prompts,
    )


def rows(groups: list[tuple[str, list[float]]], policy_step: int, tag: str) -> list[RolloutRow]:
    """One group (a draw of one prompt) per (example id, rewards of its samples)."""
    return [
        RolloutRow(
            rollout_id=f"{tag}-{g}-{k}",
            env_name="cats",
            example_id=example_id,
            lesson_id=LESSON,
            group_key=f"{tag}-g{g}",
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
        for g, (example_id, rewards) in enumerate(groups)
        for k, r in enumerate(rewards)
    ]


def commit_slot(store: RunStore, slot: int, groups: list[tuple[str, list[float]]]) -> None:
    """One rollout file of policy slot-1 holding `groups`, ingested by batch slot `slot`."""
    path = layout.rollout_file(slot - 1, "w0", 0)
    assert store.commit_data(path, schemas.ROLLOUT.to_table(rows(groups, slot - 1, f"s{slot}")), schemas.ROLLOUT)
    assert put_log_entry(store, slot, ingested_files=[path])


SOLVED, HOPELESS, SPREAD = [1.0] * 4, [0.0] * 4, [0.0, 1.0, 1.0, 0.0]


def streaks(state: CurriculumState) -> dict[str, tuple[int, float]]:
    return {p: (r.streak, r.reward) for p, r in state.lessons[LESSON].prompts.items()}


# ----------------------------------------------------------------------------- the fold (pure)
def test_fold_counts_streaks_without_spread_and_a_draw_with_spread_clears_the_record() -> None:
    s = initial_state(config(skip_after=3))
    s = fold_prompts(s, LESSON, [("a", 1.0), ("b", 0.0), ("c", None)], 1)
    assert streaks(s) == {"a": (1, 1.0), "b": (1, 0.0)}  # only prompts on a streak are recorded
    s = fold_prompts(s, LESSON, [("a", 1.0), ("b", 1.0), ("a", 1.0)], 2)  # b: another reward starts a new streak
    assert streaks(s) == {"a": (3, 1.0), "b": (1, 1.0)} and s.skipped_prompts(LESSON) == {"a"}
    s = fold_prompts(s, LESSON, [("a", 1.0)], 3)
    assert streaks(s)["a"] == (3, 1.0)  # capped at skip_after
    assert s.lessons[LESSON].prompts["a"].last_slot == 3
    s = fold_prompts(s, LESSON, [("a", None)], 4)  # a re-test with spread: the prompt comes back
    assert streaks(s) == {"b": (1, 1.0)} and s.skipped_prompts(LESSON) == frozenset()


def test_records_are_bounded_and_the_least_recently_drawn_go_first() -> None:
    s = initial_state(config(skip_after=2, max_tracked_prompts=3))
    s = fold_prompts(s, LESSON, [("a", 1.0), ("b", 1.0)], 1)
    s = fold_prompts(s, LESSON, [("a", 1.0), ("c", 0.0), ("d", 0.0)], 2)
    # slot 1's b is the least recently drawn; among slot 2's, c and d (streak 1) before a (streak 2), by id
    assert streaks(s) == {"a": (2, 1.0), "c": (1, 0.0), "d": (1, 0.0)}
    again = initial_state(config(skip_after=2, max_tracked_prompts=3))
    for outcomes, slot in (([("a", 1.0), ("b", 1.0)], 1), ([("a", 1.0), ("c", 0.0), ("d", 0.0)], 2)):
        again = fold_prompts(again, LESSON, outcomes, slot)
    assert again == s


def test_off_records_nothing_and_keeps_the_fingerprint() -> None:
    off = config(skip_after=0)
    s = fold_prompts(initial_state(off), LESSON, [("a", 1.0)] * 5, 1)
    assert s.lessons[LESSON].prompts == {} and s.skipped_prompts(LESSON) == frozenset()
    # off, the new fields leave the fingerprint alone (a run folded before they existed still loads) ...
    assert config_fingerprint(off) == config_fingerprint(config(skip_after=0, retest_rate=0.5, max_tracked_prompts=7))
    # ... on, what decides the records is in it; the re-test rate only steers draws
    assert config_fingerprint(config(skip_after=2)) != config_fingerprint(off)
    assert config_fingerprint(config(skip_after=2)) != config_fingerprint(config(skip_after=3))
    assert config_fingerprint(config(skip_after=2)) == config_fingerprint(config(skip_after=2, retest_rate=0.5))


def test_config_refuses_bad_values() -> None:
    for kw, field in (({"skip_after": -1}, "skip_after"), ({"retest_rate": 1.5}, "retest_rate"),
                      ({"max_tracked_prompts": 0}, "max_tracked_prompts")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"curriculum.{field}"):
            config(**kw)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the schema
def test_state_with_prompt_records_round_trips_and_version_1_files_still_read() -> None:
    s = fold_prompts(initial_state(config()), LESSON, [("train-0", 1.0), ("train-1", 0.0)], 1).with_step(1)
    obj = CURRICULUM_STATE.to_json(s.to_record())
    assert obj["schema_version"] == 2
    assert obj["lessons"][LESSON]["prompts"]["train-0"] == {"streak": 1, "reward": 1.0, "last_slot": 1}
    back = CurriculumState.from_record(CURRICULUM_STATE.from_json(json.loads(json.dumps(obj)), "s.json"), s.config)
    assert back == s
    # a file written before per-prompt records existed: version 1, no `prompts`
    v1 = {**obj, "schema_version": 1, "lessons": {LESSON: {k: v for k, v in obj["lessons"][LESSON].items()
                                                           if k != "prompts"}}}  # fmt: skip
    old = CURRICULUM_STATE.from_json(v1, "old.json")
    assert old.lessons[LESSON].prompts == {}
    assert old.lessons[LESSON] == dataclasses.replace(s.lessons[LESSON], prompts={})
    bad = json.loads(json.dumps(obj))
    bad["lessons"][LESSON]["prompts"]["train-0"]["streak"] = 0
    with pytest.raises(ValidationError, match=r"s\.json: field lessons\.cats\.prompts\.train-0\.streak"):
        CURRICULUM_STATE.from_json(bad, "s.json")
    bad["lessons"][LESSON]["prompts"]["train-0"]["streak"] = 1
    del bad["lessons"][LESSON]["prompts"]["train-0"]["reward"]
    with pytest.raises(ValidationError, match=r"prompts\.train-0\.reward: missing"):
        CURRICULUM_STATE.from_json(bad, "s.json")


# ----------------------------------------------------------------------------- the writer on real files
WRITER = textwrap.dedent(
    """
    import sys
    from pipeline.config import CurriculumConfig, EnvConfig, LessonConfig
    from pipeline.curriculum import CurriculumWriter
    from pipeline.store.storage import RunStore

    cfg = CurriculumConfig(
        lessons={"cats": LessonConfig(lesson_id="cats", env=EnvConfig("pipeline.environments.cats.CatsEnv"))},
        skip_after=2,
    )
    CurriculumWriter(RunStore(sys.argv[1]), cfg).sync(int(sys.argv[2]))
    print("synced", flush=True)
    sys.stdin.read()  # holds its state in memory until killed
    """
)

SLOTS = [
    [("train-0", SOLVED), ("train-1", HOPELESS), ("train-2", SPREAD)],
    [("train-0", SOLVED), ("train-1", HOPELESS), ("train-3", SOLVED)],
    [("train-0", SOLVED), ("train-1", SPREAD), ("train-3", HOPELESS)],
    [("train-2", SOLVED), ("train-0", SOLVED)],
]


def test_prompt_records_survive_a_sigkilled_writer_and_a_refold_is_byte_identical(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    cfg = config(skip_after=2)
    for slot, groups in enumerate(SLOTS, start=1):
        commit_slot(store, slot, groups)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    try:
        deadline = time.monotonic() + 120
        line = b""
        while not line.endswith(b"\n") and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line += os.read(proc.stdout.fileno(), 64)  # type: ignore[union-attr]
        assert line == b"synced\n", (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    s2 = load_latest_curriculum(store, cfg)
    assert s2.step == 2
    assert streaks(s2) == {"train-0": (2, 1.0), "train-1": (2, 0.0), "train-3": (1, 1.0)}
    assert s2.skipped_prompts(LESSON) == {"train-0", "train-1"}
    # a new writer resumes from the published state of the killed one
    s4 = CurriculumWriter(store, cfg).sync(4)
    assert streaks(s4) == {"train-0": (2, 1.0), "train-3": (1, 0.0), "train-2": (1, 1.0)}
    assert s4.skipped_prompts(LESSON) == {"train-0"}
    published = {p: store.get(p) for p in store.list(layout.CURRICULUM)}
    assert len(published) == 4
    # a replay: the same committed files folded from nothing give the same bytes, slot by slot
    for p in published:
        os.remove(tmp_path / p)
    CurriculumWriter(store, cfg).sync(4)
    assert {p: store.get(p) for p in store.list(layout.CURRICULUM)} == published


# ----------------------------------------------------------------------------- the draw
def test_draw_skipping_passes_over_skipped_prompts_and_fills_when_all_are_skipped() -> None:
    stream = [f"p{i % 4}" for i in range(1000)]
    pos = [0]

    def draw(k: int) -> list[str]:
        out = stream[pos[0] : pos[0] + k]
        pos[0] += k
        return out

    rng = np.random.default_rng(0)
    got, m = draw_skipping(draw, 6, rng, PromptSkip(frozenset({"p0", "p1"})), str)
    assert got == ["p2", "p3", "p2", "p3", "p2", "p3"] and m == {"n_skipped_prompts": 6.0, "n_retested_prompts": 0.0}
    pos[0] = 0
    everything = PromptSkip(frozenset({"p0", "p1", "p2", "p3"}))
    got, m = draw_skipping(draw, 3, rng, everything, str)
    assert len(got) == 3 and m["n_retested_prompts"] == 3.0  # never fewer than asked: the skipped ones fill in
    pos[0] = 0
    before = np.random.default_rng(5)
    got, m = draw_skipping(draw, 3, before, None, str)
    assert got == ["p0", "p1", "p2"] and m == {} and before.random() == np.random.default_rng(5).random()


def test_a_solved_prompt_is_skipped_and_later_retested_and_comes_back(tmp_path: Path) -> None:
    """Published state -> the worker's skip set -> CatsEnv's training draw; then a re-test with spread clears it."""
    store = RunStore(str(tmp_path))
    cfg = config(skip_after=2, retest_rate=0.25)
    commit_slot(store, 1, [("train-0", SOLVED), ("train-1", SPREAD)])
    commit_slot(store, 2, [("train-0", SOLVED)])
    CurriculumWriter(store, cfg).sync(2)
    state = load_latest_curriculum(store, cfg)  # what a rollout worker reads before each write
    skipped = state.skipped_prompts(LESSON)
    assert skipped == {"train-0"}
    tok = load_tokenizer("builtin:tiny")
    env = CatsEnv()
    n = 12 * len(TRAIN_PROMPTS)

    def sample(skip: PromptSkip | None) -> tuple[list[str], dict[str, float]]:
        res = env.sample(
            ScriptedContext(tok, ["cats"]),
            SampleSpec(n, 1, 1.0, 4, None, "train", skip=skip),
            np.random.default_rng(7),
        )
        return [g.rollouts[0].example_id for g in res.groups], res.metrics

    plain, m0 = sample(None)
    assert "n_skipped_prompts" not in m0
    never, m1 = sample(PromptSkip(skipped, 0.0))
    assert len(never) == n and "train-0" not in never and m1["n_skipped_prompts"] >= plain.count("train-0")
    retest, m2 = sample(PromptSkip(skipped, cfg.retest_rate))
    drawn0 = retest.count("train-0")
    assert drawn0 == m2["n_retested_prompts"] > 0
    # about retest_rate of the draws of train-0 are kept (seeded; some 12-15 draws of it at this n)
    assert 0.05 < drawn0 / (drawn0 + m2["n_skipped_prompts"]) < 0.6
    # the re-test's group had spread: folded at slot 3, train-0 is drawn again like any prompt
    commit_slot(store, 3, [("train-0", SPREAD)])
    CurriculumWriter(store, cfg).sync(3)
    assert load_latest_curriculum(store, cfg).skipped_prompts(LESSON) == frozenset()
    assert load_latest_curriculum(store, cfg).lessons[LESSON].prompts == {}
    eval_res = env.sample(
        ScriptedContext(tok, ["cats"]),
        SampleSpec(4, 1, 1.0, 4, None, "eval", skip=PromptSkip(frozenset({"probe-0"}))),
        np.random.default_rng(0),
    )
    assert eval_res.groups[0].rollouts[0].example_id == "probe-0"  # the eval stream is never skipped
