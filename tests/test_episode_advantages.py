"""Split episodes in the BatchMaker: an episode's segments are one sample of its group, and batches hold whole episodes.

An episode whose later prompt does not extend its transcript is written as several rollout rows sharing `episode_id`
(`segment_index` 0, 1, …; `pipeline.environments.episodes`). The advantages here are computed by hand from the
formulas of docs/design/algorithm.md, over episodes (not rows).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipeline.batch_maker import BatchMaker, BatchResult
from pipeline.config import TrainParams
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import BATCH, ROLLOUT, RolloutRow

REPO = Path(__file__).resolve().parents[1]


def seg_row(
    rid: str, group: str, reward: float, *, episode: str = "", segment: int = 0, policy: int = 0, resp: int = 3,
    prompt: int = 3, logprob: float = -0.5, example: str | None = None,
) -> RolloutRow:  # fmt: skip
    """One rollout row (a whole episode when `episode` is empty, else segment `segment` of `episode`)."""
    return RolloutRow(
        rollout_id=rid,
        env_name="env",
        example_id=example or group,
        lesson_id="lesson",
        group_key=group,
        prompt_tokens=list(range(1, prompt + 1)),
        response_tokens=list(range(50, 50 + resp)),
        response_logprobs=[logprob] * resp,
        token_rewards=[0.0] * resp,
        response_loss_mask=[1] * resp,
        episode_reward=reward,
        truncated=False,
        finish_reason="stop",
        temperature=1.0,
        policy_step=policy,
        worker_id="w",
        timestamp=0.0,
        episode_id=episode,
        segment_index=segment,
    )


def split_group(group: str, policy: int = 0) -> list[RolloutRow]:
    """Episodes A (reward 1, 2 segments), B (reward 0, whole row), C (reward 0, 3 segments) of one prompt."""
    return [
        seg_row(f"{group}-a0", group, 1.0, episode=f"{group}-A", segment=0, policy=policy),
        seg_row(f"{group}-a1", group, 1.0, episode=f"{group}-A", segment=1, policy=policy),
        seg_row(f"{group}-b", group, 0.0, policy=policy),
        seg_row(f"{group}-c0", group, 0.0, episode=f"{group}-C", segment=0, policy=policy),
        seg_row(f"{group}-c1", group, 0.0, episode=f"{group}-C", segment=1, policy=policy),
        seg_row(f"{group}-c2", group, 0.0, episode=f"{group}-C", segment=2, policy=policy),
    ]


def params(**kw: object) -> TrainParams:
    base: dict[str, object] = dict(batch_size=6, seq_len=16, max_lag=1, replay_buffer_capacity=256)
    base.update(kw)
    return TrainParams(**base)  # type: ignore[arg-type]


def advantages_by_id(table: pa.Table) -> dict[str, float]:
    """Each batch segment's advantage (read at its first loss token), by rollout id."""
    out: dict[str, float] = {}
    for row in table.to_pylist():
        seg = np.asarray(row["segment_ids"])
        mask = np.asarray(row["loss_mask"])
        adv = np.asarray(row["advantages"])
        for k, rid in enumerate(row["rollout_ids"]):
            pos = np.flatnonzero((seg == k) & (mask == 1))
            assert pos.size, f"segment {rid} has no loss token"
            assert np.all(adv[pos] == adv[pos[0]])
            out[rid] = float(adv[pos[0]])
    return out


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        # rewards per episode [1, 0, 0], G = 3 episodes: RLOO A_i = r_i - mean of the others
        ("rloo", {"A": 1.0, "B": -0.5, "C": -0.5}),
        # mean 1/3, population std sqrt(2)/3: (r - mean)/std = sqrt(2), -1/sqrt(2)
        ("grpo", {"A": math.sqrt(2.0), "B": -1 / math.sqrt(2.0), "C": -1 / math.sqrt(2.0)}),
        ("dr_grpo", {"A": 2 / 3, "B": -1 / 3, "C": -1 / 3}),
    ],
)
def test_split_episode_is_one_sample_of_its_group(estimator: str, expected: dict[str, float]) -> None:
    bm = BatchMaker(params(advantage_estimator=estimator))
    rep = bm.add_rollouts(ROLLOUT.to_table(split_group("g")), "f", slot=1, latest_policy=0, dir_policy_step=0)
    assert rep.admitted == 6 and rep.dropped == {} and rep.n_groups == 1
    b = bm.make_batch(1)
    assert b is not None
    got = advantages_by_id(b.table)
    want = {"g-a0": expected["A"], "g-a1": expected["A"], "g-b": expected["B"]}
    want |= {f"g-c{i}": expected["C"] for i in range(3)}
    assert got.keys() == want.keys()
    for rid, a in want.items():
        assert got[rid] == pytest.approx(a, abs=1e-5), rid
    # the segments' count must not enter the baseline: per row, RLOO would give 0.8 to A's segments
    assert got["g-a0"] != pytest.approx(0.8, abs=1e-3)


def test_zero_variance_is_decided_by_episodes() -> None:
    """Two episodes of equal reward (one split in two) are one zero-variance group of 2; one split episode alone
    is a group of one (advantage 0): both dropped whole, never a segment kept."""
    rows = [
        seg_row("z-a0", "z", 1.0, episode="z-A", segment=0),
        seg_row("z-a1", "z", 1.0, episode="z-A", segment=1),
        seg_row("z-b", "z", 1.0),
        seg_row("s-a0", "s", 0.0, episode="s-A", segment=0),
        seg_row("s-a1", "s", 0.0, episode="s-A", segment=1),
    ]
    bm = BatchMaker(params())
    rep = bm.add_rollouts(ROLLOUT.to_table(rows), "f", slot=1, latest_policy=0, dir_policy_step=0)
    assert rep.admitted == 0 and rep.dropped == {"zero_variance": 5} and rep.filtered_groups == {"zero_variance": 2}


def test_a_bad_segment_drops_its_whole_episode_with_the_reason() -> None:
    rows = split_group("g")
    rows[4] = seg_row("g-c1", "g", 0.0, episode="g-C", segment=1, logprob=float("nan"))  # C's middle segment
    rows[1] = seg_row("g-a1", "g", 1.0, episode="g-A", segment=1, resp=40)  # A's second segment: over seq_len 16
    bm = BatchMaker(params(overlong="drop"))
    rep = bm.add_rollouts(ROLLOUT.to_table(rows, validate=False), "f", slot=1, latest_policy=0, dir_policy_step=0)
    assert rep.dropped == {"malformed": 3, "too_long": 2} and rep.admitted == 1
    dropped = bm.take_dropped(1).to_pylist()
    by_id = {d["rollout_id"]: d for d in dropped}
    assert {by_id[f"g-c{i}"]["reason"] for i in range(3)} == {"malformed"}
    assert "another segment (row 4) of its episode" in by_id["g-c0"]["detail"]
    assert by_id["g-c1"]["detail"] == "response_logprobs holds a non-finite value"
    assert by_id["g-a0"]["reason"] == "too_long" and "another segment (row 1)" in by_id["g-a0"]["detail"]


def test_disagreeing_segments_are_malformed() -> None:
    rows = split_group("g")
    rows[1] = seg_row("g-a1", "g", 0.5, episode="g-A", segment=1)  # A's segments disagree on the episode reward
    bm = BatchMaker(params())
    rep = bm.add_rollouts(ROLLOUT.to_table(rows), "f", slot=1, latest_policy=0, dir_policy_step=0)
    assert rep.dropped.get("malformed") == 2
    details = {d["rollout_id"]: d["detail"] for d in bm.take_dropped(1).to_pylist()}
    assert details["g-a1"] == "segments of its episode disagree on episode_reward"


def test_the_oldest_segment_decides_staleness() -> None:
    """Slot 3 with max_lag 0 takes policy 2 only: an episode with one segment of policy 1 is stale, whole (its group,
    of policy 1, has reward spread: a group without it would be `zero_variance` whatever its age)."""
    rows = [
        seg_row("old0", "g", 1.0, episode="E", segment=0, policy=1),
        seg_row("old1", "g", 1.0, episode="E", segment=1, policy=2),
        seg_row("old2", "g", 0.0, policy=1),
        seg_row("new", "g", 0.0, policy=2),
        seg_row("new2", "g", 1.0, policy=2),
    ]
    bm = BatchMaker(params(max_lag=0, batch_size=2))
    rep = bm.add_rollouts(ROLLOUT.to_table(rows), "f", slot=3, latest_policy=2)
    assert rep.dropped == {"stale": 3} and rep.admitted == 2
    details = {d["rollout_id"]: (d["reason"], d["detail"]) for d in bm.take_dropped(3).to_pylist()}
    assert details["old0"] == details["old1"] == ("stale", "lag > max_lag 0 for batch 3")


def random_file(rng: np.random.Generator, tag: str, n_groups: int) -> list[RolloutRow]:
    """Groups of 2-4 episodes with distinct rewards, each episode 1-3 segments of random lengths."""
    rows: list[RolloutRow] = []
    for g in range(n_groups):
        group = f"{tag}-g{g}"
        for e in range(int(rng.integers(2, 5))):
            n_seg = int(rng.integers(1, 4))
            ep = f"{group}-e{e}" if n_seg > 1 or rng.random() < 0.5 else ""
            for s in range(n_seg):
                resp, prompt = int(rng.integers(1, 8)), int(rng.integers(1, 6))
                rows.append(seg_row(f"{group}-e{e}-s{s}", group, float(e), episode=ep, segment=s, resp=resp,
                                    prompt=prompt))  # fmt: skip
    return rows


def episode_of(rid: str) -> str:
    return rid.rsplit("-s", 1)[0]


@pytest.mark.parametrize("pack", [False, True])
def test_batches_hold_whole_episodes(pack: bool) -> None:
    """Over many files and slots (eviction on): every episode's segments are used together or not at all."""
    rng = np.random.default_rng(7)
    bm = BatchMaker(params(batch_size=4, pack=pack, max_lag=100, replay_buffer_capacity=40))
    segments: dict[str, set[str]] = defaultdict(set)
    used_in: dict[str, set[int]] = defaultdict(set)
    uses: dict[str, int] = defaultdict(int)
    evicted: set[str] = set()
    built = 0
    for slot in range(1, 40):
        rows = random_file(rng, f"f{slot}", 3)
        for r in rows:
            segments[episode_of(r.rollout_id)].add(r.rollout_id)
        bm.add_rollouts(ROLLOUT.to_table(rows), f"f{slot}", slot=slot, latest_policy=0, dir_policy_step=0)
        b: BatchResult | None = bm.make_batch(slot)
        for d in bm.take_dropped(slot).to_pylist():
            if d["reason"] == "evicted":
                evicted.add(d["rollout_id"])
        if b is None:
            continue
        built += 1
        in_batch = set(b.rollout_ids)
        for ep in {episode_of(r) for r in in_batch}:
            assert segments[ep] <= in_batch, f"slot {slot} holds part of episode {ep}"
            used_in[ep].add(slot)
        for rid in in_batch:
            uses[rid] += 1
    assert built >= 20
    assert max(uses.values()) == 1
    assert any(len(s) > 1 for ep, s in segments.items() if ep in used_in)  # split episodes were used
    for ep, s in segments.items():
        dead = s & evicted
        assert not dead or dead == s, f"episode {ep} evicted in part"


def test_make_batches_step_on_split_episodes(tmp_path: Path) -> None:
    """The real `python -m steps.make_batches` on committed rollout files holding split episodes."""
    root = tmp_path / "run"
    store = RunStore(str(root))
    store.put_json_if_absent(layout.policy_marker(0), {"step": 0})
    for i in range(2):
        store.commit_data(layout.rollout_file(0, "w", i), ROLLOUT.to_table(split_group(f"f{i}")), ROLLOUT)
    args = [sys.executable, "-m", "steps.make_batches", "--store.run_root", str(root), "--max_batches", "2"]
    for k, v in {"train.batch_size": 6, "train.seq_len": 16, "train.max_lag": 1, "train.max_batches_ahead": 2,
                 "train.max_batch_latency_s": 5, "polling.interval_s": 0.05}.items():  # fmt: skip
        args += [f"--{k}", str(v)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    entries = [store.get_json(p) for p in store.list(layout.BATCH_LOG)]
    assert [e["slot"] for e in entries] == [1, 2]
    got: dict[str, float] = {}
    per_slot: list[set[str]] = []
    for e in entries:
        t = store.read_parquet(e["data_file"], BATCH)
        adv = advantages_by_id(t)
        per_slot.append(set(adv))
        got |= adv
    assert len(got) == 12  # all 12 segments, each used once
    for f in ("f0", "f1"):
        assert [got[f"{f}-a0"], got[f"{f}-a1"]] == pytest.approx([1.0, 1.0])
        assert got[f"{f}-b"] == pytest.approx(-0.5)
        assert [got[f"{f}-c{i}"] for i in range(3)] == pytest.approx([-0.5] * 3)
    for ids in per_slot:  # every slot holds whole episodes
        for ep in ("a", "c"):
            for f in ("f0", "f1"):
                segs = {rid for rid in got if rid.startswith(f"{f}-{ep}")}
                assert not (segs & ids) or segs <= ids
