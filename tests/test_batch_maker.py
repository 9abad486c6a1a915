"""Unit and property tests of the in-memory BatchMaker (pipeline/batch_maker/)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.batch_maker import BatchMaker, BatchResult
from pipeline.batch_maker.maker import recency_weights, selection_keys
from pipeline.config import ConfigError, TrainParams, validate_train
from pipeline.store import staleness
from schemas import BATCH, ROLLOUT, RolloutRow
from schemas.dropped import DROP_REASONS, DROPPED


def make_rows(
    policy: int,
    rewards: list[list[float]],
    *,
    tag: str = "f",
    prompt_len: int | tuple[int, int] = 3,
    resp_len: int | tuple[int, int] = 4,
    seed: int = 0,
    example_prefix: str | None = None,
) -> list[RolloutRow]:
    """One rollout group per entry of `rewards` (its members' episode rewards)."""
    rng = np.random.default_rng(seed)

    def length(spec: int | tuple[int, int]) -> int:
        return spec if isinstance(spec, int) else int(rng.integers(spec[0], spec[1] + 1))

    out = []
    for g, group in enumerate(rewards):
        prompt = rng.integers(1, 50, length(prompt_len)).tolist()
        ex = f"{example_prefix or tag}-ex{g}"
        for k, r in enumerate(group):
            n = length(resp_len)
            resp = rng.integers(50, 100, n).tolist()
            out.append(
                RolloutRow(
                    rollout_id=f"{tag}-{g}-{k}",
                    env_name="env",
                    example_id=ex,
                    lesson_id="lesson",
                    group_key=f"{tag}-g{g}",
                    prompt_tokens=prompt,
                    response_tokens=resp,
                    response_logprobs=(-(np.arange(n) + 1) / 100.0).tolist(),
                    token_rewards=[0.0] * n,
                    response_loss_mask=[1] * n,
                    episode_reward=float(r),
                    truncated=False,
                    finish_reason="stop",
                    temperature=1.0,
                    policy_step=policy,
                    worker_id="w",
                    timestamp=0.0,
                )
            )
    return out


def table(rows: list[RolloutRow], validate: bool = True) -> pa.Table:
    return ROLLOUT.to_table(rows, validate=validate)


def params(**kw: object) -> TrainParams:
    base: dict[str, object] = dict(batch_size=4, seq_len=32, max_lag=1, replay_buffer_capacity=256)
    base.update(kw)
    return TrainParams(**base)  # type: ignore[arg-type]


def feed(bm: BatchMaker, rows: list[RolloutRow], path: str, *, slot: int, latest: int, policy: int) -> None:
    bm.add_rollouts(table(rows), path, slot=slot, latest_policy=latest, dir_policy_step=policy)


def uses_of(results: list[BatchResult]) -> Counter[str]:
    return Counter(rid for b in results for rid in b.rollout_ids)


# ----------------------------------------------------------------------------- staleness
@given(max_lag=st.integers(0, 6), policy=st.integers(0, 50), slot=st.integers(1, 60))
def test_lag_rule(max_lag: int, policy: int, slot: int) -> None:
    lag = (slot - 1) - policy
    assert staleness.allowed(slot, policy, max_lag) == (0 <= lag <= max_lag)


@pytest.mark.parametrize("max_lag", [0, 1, 3])
def test_staleness_accepts_lag_0_to_max_lag_and_refuses_older_and_future(max_lag: int) -> None:
    slot = 10
    bm = BatchMaker(params(batch_size=2, max_lag=max_lag))
    latest = slot - 1
    for p in range(slot - 1 - max_lag - 1, slot + 1):  # lag max_lag+1 … -1
        feed(bm, make_rows(p, [[0.0, 1.0]], tag=f"p{p}"), f"rollouts/p{p}", slot=slot, latest=latest, policy=p)
    dropped = bm.take_dropped(slot).to_pylist()
    by_reason: dict[str, set[int]] = {}
    for d in dropped:
        by_reason.setdefault(d["reason"], set()).add(d["policy_step"])
    assert by_reason == {"stale": {slot - 2 - max_lag}, "future_policy": {slot}}
    used: set[int] = set()
    while (b := bm.make_batch(slot)) is not None:
        used |= {int(p) for row in b.table.column("policy_steps").to_pylist() for p in row}
    assert used == set(range(slot - 1 - max_lag, slot))


def test_live_rows_become_stale_when_the_window_moves() -> None:
    bm = BatchMaker(params(batch_size=2, max_lag=1))
    feed(bm, make_rows(0, [[0.0, 1.0], [0.0, 1.0]]), "rollouts/a", slot=1, latest=0, policy=0)
    assert bm.make_batch(1) is not None
    assert bm.make_batch(3) is None  # slot 3 allows policies 1..2 only
    d = bm.take_dropped(3).to_pylist()
    assert [x["reason"] for x in d] == ["stale", "stale"] and bm.n_live == 0


def test_oldest_policy_first() -> None:
    bm = BatchMaker(params(batch_size=2, max_lag=2))
    feed(bm, make_rows(2, [[0.0, 1.0]], tag="new"), "rollouts/new", slot=3, latest=2, policy=2)
    feed(bm, make_rows(0, [[0.0, 1.0]], tag="old"), "rollouts/old", slot=3, latest=2, policy=0)
    b = bm.make_batch(3)
    assert b is not None and set(b.source_files) == {"rollouts/old"}


# ----------------------------------------------------------------------------- recency weighting
def test_recency_weights_are_the_documented_formula_and_alpha_0_is_uniform() -> None:
    """`train.replay_buffer_alpha`: sampling weight ∝ (1 + rank_from_oldest/n)^alpha; 0 is uniform."""
    n = 8
    rank = np.arange(n)
    for alpha in (0.0, 0.5, 3.0):
        np.testing.assert_allclose(recency_weights(n, alpha), (1 + rank / n) ** alpha, rtol=1e-12)
    assert (recency_weights(n, 0.0) == 1.0).all()
    assert (np.diff(recency_weights(n, 3.0)) > 0).all()  # newer arrivals weigh more


@pytest.mark.parametrize("alpha", [0.0, 1.0, 3.0])
def test_first_draw_frequencies_follow_the_recency_weights(alpha: float) -> None:
    """Over many batch slots (the RNG is seeded by (seed, slot)), the candidate drawn first is rank i with frequency
    weight_i / sum(weights): with seed 0 over 4,000 slots the total variation distance to the weights is 0.021-0.031
    (deterministic; bound 0.04), where it is 0.47 to reversed weights and 0.24 to uniform at alpha 3, 0.10 to
    uniform at alpha 1."""
    n, slots = 16, 4000
    firsts = np.bincount([int(np.argmax(selection_keys(n, alpha, 0, s))) for s in range(1, slots + 1)], minlength=n)
    freq = firsts / slots
    w = (1 + np.arange(n) / n) ** alpha
    expected = w / w.sum()
    tv = 0.5 * np.abs(freq - expected).sum()
    assert tv < 0.04, (alpha, tv, freq.round(3).tolist(), expected.round(3).tolist())
    if alpha > 0:  # and not the uniform draw, nor the reversed weights
        assert 0.5 * np.abs(freq - 1 / n).sum() > 2 * tv
        assert 0.5 * np.abs(freq - expected[::-1]).sum() > 2 * tv


def test_batch_maker_takes_rows_by_recency_weighted_keys_and_alpha_changes_the_selection() -> None:
    """The BatchMaker takes the eligible rows of one policy step larger `selection_keys` first, ranked by arrival
    (across files), so its draws have the frequencies above; a change of alpha changes which rows are taken."""

    def batches(alpha: float) -> list[list[str]]:
        bm = BatchMaker(
            params(batch_size=4, max_lag=10**6, max_samples_per_rollout=10**6, replay_buffer_alpha=alpha, seed=5)
        )
        ids: list[str] = []
        for f in range(4):
            rows = make_rows(0, [[0.0, 1.0], [1.0, 0.0]], tag=f"f{f}", seed=f)
            feed(bm, rows, f"rollouts/f{f}", slot=1, latest=0, policy=0)
            ids += [r.rollout_id for r in rows]
        out = []
        for slot in range(1, 31):
            b = bm.make_batch(slot)
            assert b is not None
            order = np.argsort(-selection_keys(len(ids), alpha, 5, slot), kind="stable")
            assert b.rollout_ids == [ids[i] for i in order[:4]], (alpha, slot)
            out.append(b.rollout_ids)
        return out

    uniform, recent = batches(0.0), batches(3.0)
    assert uniform != recent
    rank = {f"f{f}-{g}-{k}": 4 * f + 2 * g + k for f in range(4) for g in range(2) for k in range(2)}
    mean_rank = [np.mean([rank[r] for b in run for r in b]) for run in (uniform, recent)]
    assert mean_rank[1] > mean_rank[0], mean_rank


# ----------------------------------------------------------------------------- filters and fates
def test_zero_variance_filtered_with_reason_and_kept_when_off() -> None:
    rows = make_rows(0, [[1.0, 1.0], [0.0, 1.0], [5.0]])
    bm = BatchMaker(params(batch_size=2))
    rep = bm.add_rollouts(table(rows), "f", slot=1, latest_policy=0)
    assert rep.dropped == {"zero_variance": 3} and rep.admitted == 2
    d = bm.take_dropped(1)
    assert set(d.column("reason").to_pylist()) == {"zero_variance"}
    bm2 = BatchMaker(params(batch_size=2, filter_zero_variance=False))
    assert bm2.add_rollouts(table(rows), "f", slot=1, latest_policy=0).admitted == 5


def test_admit_no_signal_admits_zero_variance_groups_with_advantage_zero_and_restores() -> None:
    rows = make_rows(0, [[1.0, 1.0], [0.0, 0.0]])  # a solved and a hopeless group: no signal anywhere
    p = params(batch_size=4)
    bm = BatchMaker(p)
    assert bm.add_rollouts(table(rows), "a", slot=1, latest_policy=0).admitted == 0
    rep = bm.add_rollouts(table(rows), "b", slot=1, latest_policy=0, admit_no_signal=True)
    assert rep.admitted == 4 and rep.admitted_no_signal == 4 and rep.dropped == {}
    snap = bm.snapshot()
    b = bm.make_batch(1)
    assert b is not None and sorted(b.source_files) == ["b"] * 4
    assert np.all(np.asarray(b.table.column("advantages").to_pylist()) == 0.0)
    again = BatchMaker(p)  # a restarted maker keeps the filled rows from the cursor
    for f in snap["files"]:
        again.restore_file(table(rows), f["path"], seq=f["seq"], policy_step=f["policy_step"], rows=f["rows"],
                           uses=f["uses"])  # fmt: skip
    b2 = again.make_batch(1)
    assert b2 is not None and b2.rollout_ids == b.rollout_ids


def test_a_zero_spread_group_that_is_also_stale_is_dropped_zero_variance() -> None:
    """A group without reward spread is `zero_variance` whatever its age; only its rows with signal are `stale`."""
    slot, max_lag = 5, 1  # slot 5 takes policies 3..4: policy 1 is too old
    rows = make_rows(1, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.5, 1.0]])  # solved, hopeless, spread (one row at advantage 0)
    bm = BatchMaker(params(batch_size=2, max_lag=max_lag))
    rep = bm.add_rollouts(table(rows), "rollouts/old", slot=slot, latest_policy=4, dir_policy_step=1)
    assert rep.dropped == {"zero_variance": 4, "zero_advantage": 1, "stale": 2} and rep.admitted == 0
    assert rep.filtered_groups == {"zero_variance": 2} and rep.fresh_zero_variance_groups == 0
    d = bm.take_dropped(slot).to_pylist()
    assert Counter(x["reason"] for x in d) == {"zero_variance": 4, "stale": 2, "zero_advantage": 1}
    assert {x["rollout_id"] for x in d if x["reason"] == "zero_variance"} == {"f-0-0", "f-0-1", "f-1-0", "f-1-1"}
    fresh = BatchMaker(params(batch_size=2, max_lag=max_lag))  # the same groups in the window: counted as fresh
    rep2 = fresh.add_rollouts(table(make_rows(4, [[1.0, 1.0]])), "rollouts/new", slot=slot, latest_policy=4)
    assert rep2.dropped == {"zero_variance": 2} and rep2.fresh_zero_variance_groups == 1
    # read while the slot fills without signal (the no-signal fill), an old row without signal keeps its reason
    fill = BatchMaker(params(batch_size=2, max_lag=max_lag))
    rep3 = fill.add_rollouts(table(rows), "rollouts/old", slot=slot, latest_policy=4, admit_no_signal=True)
    assert rep3.dropped == {"zero_variance": 4, "zero_advantage": 1, "stale": 2}
    assert rep3.fresh_zero_variance_groups == 0 and not rep3.without_signal
    details = {x["reason"]: x["detail"] for x in fill.take_dropped(slot).to_pylist()}
    assert "too old for the no-signal fill" in details["zero_variance"] and "lag > max_lag 1" in details["stale"]
    # without zero-variance filtering such rows are trained like any other, so the lag alone cost them: `stale`
    plain = BatchMaker(params(batch_size=2, max_lag=max_lag, filter_zero_variance=False))
    rep4 = plain.add_rollouts(table(rows), "rollouts/old", slot=slot, latest_policy=4, dir_policy_step=1)
    assert rep4.dropped == {"stale": 7}


def test_rows_the_no_signal_fill_admitted_leave_the_reservoir_as_zero_variance_not_stale() -> None:
    """Rows admitted without signal (the no-signal fill) that age out of the reservoir before a batch takes them
    are dropped for want of signal, not for the lag; their neighbours with signal are `stale`."""
    bm = BatchMaker(params(batch_size=64, max_lag=1))
    rows = make_rows(1, [[1.0, 1.0], [0.0, 0.5, 1.0]])  # solved; spread with one row at advantage 0
    rep = bm.add_rollouts(table(rows), "rollouts/p1", slot=2, latest_policy=1, admit_no_signal=True)
    assert rep.admitted == 5 and rep.admitted_no_signal == 3
    bm.take_dropped(2)
    assert bm.make_batch(4) is None  # slot 4 takes policies 2..3: every live row is too old
    d = bm.take_dropped(4).to_pylist()
    assert Counter(x["reason"] for x in d) == {"zero_variance": 2, "zero_advantage": 1, "stale": 2}
    assert {x["rollout_id"] for x in d if x["reason"] == "zero_variance"} == {"f-0-0", "f-0-1"}
    assert all("admitted by the no-signal fill" in x["detail"] for x in d if x["reason"] != "stale")
    assert bm.n_live == 0


def test_rows_admitted_without_signal_only_top_a_batch_up() -> None:
    """Rows the no-signal fill admitted (advantage 0) go into a batch after every row with signal, although they
    are of an older policy: a slot that fills without signal trains all the signal it has."""
    bm = BatchMaker(params(batch_size=4, max_lag=1))
    old = make_rows(1, [[1.0, 1.0], [0.0, 0.0]], tag="a")  # solved and hopeless: four rows without signal
    assert bm.add_rollouts(table(old), "rollouts/a", slot=2, latest_policy=1, admit_no_signal=True).admitted == 4
    new = make_rows(2, [[0.0, 1.0]], tag="b")  # spread: two rows with signal, of a newer policy
    assert bm.add_rollouts(table(new), "rollouts/b", slot=3, latest_policy=2).admitted == 2
    batch = bm.make_batch(3)
    assert batch is not None
    assert {"b-0-0", "b-0-1"} <= set(batch.rollout_ids) and len(batch.rollout_ids) == 4


def test_zero_advantage_member_dropped() -> None:
    bm = BatchMaker(params(batch_size=2))
    rep = bm.add_rollouts(table(make_rows(0, [[0.0, 0.5, 1.0]])), "f", slot=1, latest_policy=0)
    assert rep.dropped == {"zero_advantage": 1}


def test_malformed_rows_dropped_with_reason() -> None:
    rows = make_rows(0, [[0.0, 1.0, 0.0, 1.0]])
    rows[0] = dataclasses.replace(rows[0], response_logprobs=rows[0].response_logprobs[:-1])
    rows[1] = dataclasses.replace(rows[1], episode_reward=math.nan)
    rows[2] = dataclasses.replace(rows[2], response_logprobs=[math.inf] * len(rows[2].response_tokens))
    bm = BatchMaker(params(batch_size=1))
    rep = bm.add_rollouts(table(rows, validate=False), "f", slot=1, latest_policy=0)
    assert rep.dropped == {"malformed": 3, "zero_variance": 1}  # the good row is left alone in its group
    d = {r["rollout_id"]: r["detail"] for r in bm.take_dropped(1).to_pylist()}
    assert "lengths disagree" in d["f-0-0"] and "response_logprobs=3" in d["f-0-0"]
    assert "episode_reward" in d["f-0-1"]
    assert "response_logprobs" in d["f-0-2"]


def test_policy_step_must_match_folder() -> None:
    bm = BatchMaker(params(batch_size=1))
    rep = bm.add_rollouts(table(make_rows(1, [[0.0, 1.0]])), "f", slot=2, latest_policy=1, dir_policy_step=0)
    assert rep.dropped == {"malformed": 2}


@pytest.mark.parametrize("rule", ["truncate", "drop"])
def test_overlong_rule(rule: str) -> None:
    bm = BatchMaker(params(batch_size=2, seq_len=8, overlong=rule))
    rows = make_rows(0, [[0.0, 1.0]], prompt_len=3, resp_len=10) + make_rows(0, [[0.0, 1.0]], prompt_len=8, tag="p")
    rep = bm.add_rollouts(table(rows), "f", slot=1, latest_policy=0)
    d = bm.take_dropped(1).to_pylist()
    assert {x["rollout_id"] for x in d if x["reason"] == "too_long"} >= {"p-0-0", "p-0-1"}
    if rule == "drop":
        assert rep.admitted == 0
        return
    b = bm.make_batch(1)
    assert b is not None and b.stats["n_cut_overlong"] == 2
    for row in BATCH.from_table(b.table):
        assert len(row.tokens) == 8 and row.truncated == [True]
        assert row.loss_mask == [0, 0, 0, 1, 1, 1, 1, 1]


def test_retention_keeps_newest_policy_per_problem() -> None:
    bm = BatchMaker(params(batch_size=2, max_lag=3))
    feed(bm, make_rows(0, [[0.0, 1.0]], tag="a", example_prefix="x"), "a", slot=2, latest=1, policy=0)
    feed(bm, make_rows(1, [[0.0, 1.0]], tag="b", example_prefix="x"), "b", slot=2, latest=1, policy=1)
    feed(bm, make_rows(0, [[0.0, 1.0]], tag="c", example_prefix="x"), "c", slot=2, latest=1, policy=0)
    d = bm.take_dropped(2).to_pylist()
    assert sorted((x["source_file"], x["reason"]) for x in d) == [("a", "superseded")] * 2 + [("c", "superseded")] * 2
    assert bm.live_files() == ["b"]


def test_capacity_evicts_oldest() -> None:
    bm = BatchMaker(params(batch_size=2, replay_buffer_capacity=4))
    feed(bm, make_rows(0, [[0.0, 1.0], [0.0, 1.0]], tag="a"), "a", slot=1, latest=0, policy=0)
    feed(bm, make_rows(0, [[0.0, 1.0]], tag="b"), "b", slot=1, latest=0, policy=0)
    d = bm.take_dropped(1).to_pylist()
    assert [(x["rollout_id"], x["reason"]) for x in d] == [("a-0-0", "evicted"), ("a-0-1", "evicted")]
    assert bm.n_live == 4


def test_pad_multiple_must_divide_seq_len() -> None:
    with pytest.raises(ConfigError, match=r"train\.pad_multiple"):
        validate_train(params(seq_len=30, pad_multiple=8))  # at program start and job build, not in BatchMaker


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ConfigError, match=r"train\.max_lag"):
        TrainParams(max_lag=-1)
    with pytest.raises(ConfigError, match=r"train\.batch_size"):
        TrainParams(batch_size=0)
    with pytest.raises(ConfigError, match=r"train\.no_signal_fill_after.*-1"):
        TrainParams(no_signal_fill_after=-1)


# ----------------------------------------------------------------------------- row layout
def test_row_layout_and_logprob_alignment() -> None:
    bm = BatchMaker(params(batch_size=2, seq_len=8, pad_multiple=4))
    rows = make_rows(0, [[0.0, 1.0]], prompt_len=3, resp_len=4)
    rows[1] = dataclasses.replace(rows[1], response_loss_mask=[1, 0, 1, 1])
    bm.add_rollouts(table(rows), "f", slot=1, latest_policy=0)
    b = bm.make_batch(1)
    assert b is not None and b.stats["row_len"] == 8  # 7 tokens padded to seq_len
    by_id = {r.rollout_id: r for r in rows}
    for out in BATCH.from_table(b.table):
        src = by_id[out.rollout_ids[0]]
        assert out.tokens[:7] == src.prompt_tokens + src.response_tokens and out.tokens[7] == 0
        assert out.loss_mask == [0, 0, 0, *src.response_loss_mask, 0]
        assert out.segment_ids == [0] * 7 + [-1]
        assert out.position_ids == [*range(7), 0]
        np.testing.assert_allclose(out.generator_logprobs[3:7], src.response_logprobs, rtol=1e-6)
        assert out.generator_logprobs[:3] == [0.0] * 3
        adv = out.advantages[3]
        assert adv in (-1.0, 1.0) and out.advantages[3:7] == [adv] * 4 and out.advantages[:3] == [0.0] * 3
        assert out.reference_logprobs is None and out.policy_steps == [0] and out.source_files == ["f"]


def check_batch_rows(b: BatchResult, p: TrainParams, sources: dict[str, RolloutRow]) -> None:
    """Packing invariants: contiguous distinct segments, positions restart, loss only on responses."""
    assert b.table.num_rows == p.batch_size
    for out in BATCH.from_table(b.table):
        BATCH.validate_row(out)
        assert len(out.tokens) == p.seq_len
        seg = np.array(out.segment_ids)
        n_seg = len(out.rollout_ids)
        assert n_seg >= 1
        real = seg[seg >= 0]
        # segments appear as contiguous blocks 0, 1, …, n_seg-1 followed by padding only
        assert (np.diff(real) >= 0).all() and (np.diff(real) <= 1).all() and real[0] == 0 and real[-1] == n_seg - 1
        assert (seg[len(real) :] == -1).all()
        for s in range(n_seg):
            pos = np.flatnonzero(seg == s)
            src = sources[out.rollout_ids[s]]
            p_len = len(src.prompt_tokens)
            assert out.position_ids[pos[0] : pos[-1] + 1] == list(range(len(pos)))
            assert [out.loss_mask[i] for i in pos[:p_len]] == [0] * p_len
            assert [out.tokens[i] for i in pos[:p_len]] == src.prompt_tokens
            resp = [out.tokens[i] for i in pos[p_len:]]
            assert resp == src.response_tokens[: len(resp)]
        assert all(out.loss_mask[i] == 0 for i in np.flatnonzero(seg < 0))


@given(
    seed=st.integers(0, 10_000),
    pack=st.booleans(),
    batch_size=st.integers(1, 6),
    seq_len=st.sampled_from([8, 12, 16, 24, 40]),
    pad_multiple=st.sampled_from([1, 4, 8]),
    max_uses=st.integers(1, 3),
    n_files=st.integers(1, 6),
)
@settings(max_examples=40, deadline=None)
def test_packing_and_reuse_properties(
    seed: int, pack: bool, batch_size: int, seq_len: int, pad_multiple: int, max_uses: int, n_files: int
) -> None:
    p = params(
        batch_size=batch_size,
        seq_len=seq_len,
        pad_multiple=pad_multiple if seq_len % pad_multiple == 0 else 4,
        pack=pack,
        max_samples_per_rollout=max_uses,
        replay_buffer_capacity=max(batch_size, 64),
        seed=seed,
        max_lag=2,
    )
    rng = np.random.default_rng(seed)
    bm = BatchMaker(p)
    sources: dict[str, RolloutRow] = {}
    file_ids: dict[str, list[str]] = {}
    results: list[BatchResult] = []
    all_ids: set[str] = set()
    dropped: Counter[str] = Counter()
    slot = 1
    for f in range(n_files):
        groups = [rng.integers(0, 3, rng.integers(1, 5)).astype(float).tolist() for _ in range(rng.integers(1, 5))]
        rows = make_rows(slot - 1, groups, tag=f"f{f}", prompt_len=(1, 6), resp_len=(0, 12), seed=seed + f)
        sources.update({r.rollout_id: r for r in rows})
        file_ids[f"f{f}"] = [r.rollout_id for r in rows]
        all_ids |= {r.rollout_id for r in rows}
        bm.add_rollouts(table(rows), f"f{f}", slot=slot, latest_policy=slot - 1)
        while (b := bm.make_batch(slot)) is not None:
            check_batch_rows(b, p, sources)
            assert len(set(b.rollout_ids)) == len(b.rollout_ids)  # at most once per batch
            results.append(b)
            dropped.update(bm.take_dropped(slot).column("rollout_id").to_pylist())
            slot += 1
            if rng.random() < 0.5:
                break
    dropped.update(bm.take_dropped(slot).column("rollout_id").to_pylist())
    uses = uses_of(results)
    assert all(n <= max_uses for n in uses.values())
    live_ids = {file_ids[f["path"]][r] for f in bm.snapshot()["files"] for r in f["rows"]}
    # every rollout: used up, dropped exactly once, or still live
    for rid in all_ids:
        assert dropped[rid] <= 1
        if dropped[rid]:
            continue
        assert uses[rid] == max_uses or rid in live_ids


def test_packed_rows_never_empty_when_enough_rollouts() -> None:
    p = params(batch_size=4, seq_len=64, pack=True)
    bm = BatchMaker(p)
    bm.add_rollouts(table(make_rows(0, [[0.0, 1.0]] * 2, resp_len=2)), "f", slot=1, latest_policy=0)
    b = bm.make_batch(1)
    assert b is not None
    assert all(len(r) == 1 for r in b.table.column("rollout_ids").to_pylist())


# ----------------------------------------------------------------------------- restore and determinism
def test_snapshot_restore_gives_the_same_next_batches() -> None:
    p = params(batch_size=3, max_samples_per_rollout=2, pack=True, seq_len=24)
    files = {
        f"f{i}": table(make_rows(0, [[0.0, 1.0, 2.0], [1.0, 0.0]], tag=f"f{i}", seed=i, resp_len=(1, 9)))
        for i in range(3)
    }

    def run(restart_after: int | None) -> list[list[str]]:
        bm = BatchMaker(p)
        out = []
        for name, t in files.items():
            bm.add_rollouts(t, name, slot=1, latest_policy=0)
        for slot in range(1, 7):
            if restart_after is not None and slot == restart_after:
                snap = bm.snapshot()
                bm = BatchMaker(p)
                for f in snap["files"]:
                    bm.restore_file(files[f["path"]], f["path"], seq=f["seq"], policy_step=f["policy_step"],
                                    rows=f["rows"], uses=f["uses"])  # fmt: skip
                bm.set_next_seq(snap["next_seq"])
            b = bm.make_batch(slot)
            out.append([] if b is None else b.rollout_ids)
        return out

    assert run(None) == run(3) == run(2)


def test_dropped_table_schema() -> None:
    bm = BatchMaker(params())
    bm.add_rollouts(table(make_rows(0, [[1.0, 1.0]])), "f", slot=1, latest_policy=0)
    t = bm.take_dropped(7)
    DROPPED.check_metadata(t.schema.metadata, "<t>")
    assert t.column("slot").to_pylist() == [7, 7]
    assert set(t.column("reason").to_pylist()) <= set(DROP_REASONS)
    assert bm.take_dropped(8).num_rows == 0
