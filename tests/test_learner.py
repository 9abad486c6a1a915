"""Learner tests on a tiny model: parameters change, loss finite, a rewarded token's logprob rises,
policies/checkpoints are committed, bad batches are refused, exact replay from a checkpoint."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from log_entries import put_log_entry

import schemas
from pipeline.config import (
    LearnerCadence,
    LearnerStepConfig,
    ModelSpec,
    OptimizerSpec,
    PollingConfig,
    RLOOLossConfig,
    StoreConfig,
    TrainParams,
)
from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore
from schemas.records import CommitMarker

jax = pytest.importorskip("jax")

from pipeline.store.poll import WaitTimeout  # noqa: E402
from policy import learner  # noqa: E402
from policy import model as M  # noqa: E402
from policy import policy_format as pf  # noqa: E402
from steps import learn  # noqa: E402

SEQ_LEN = 16
BATCH = 4
VOCAB = 512  # builtin:tiny
TOKEN = 77


def tiny_config(root: str, *, steps: int = 3, batch_wait_timeout_s: float = 5.0, **kw: object) -> LearnerStepConfig:
    """A tiny learner config (2-layer 64-wide llama, batch 4 × 16 tokens) on run root `root`."""
    base = dict(
        store=StoreConfig(run_root=root),
        model=ModelSpec(max_seq_len=SEQ_LEN),
        train=TrainParams(num_train_steps=steps, batch_size=BATCH, seq_len=SEQ_LEN, replay_buffer_capacity=BATCH),
        optimizer=OptimizerSpec(learning_rate=1e-2),
        loss=RLOOLossConfig(),
        cadence=LearnerCadence(checkpoint_interval=1, policy_interval=1, batch_wait_timeout_s=batch_wait_timeout_s),
        polling=PollingConfig(interval_s=0.05),
    )
    base.update(kw)
    return LearnerStepConfig(**base)  # type: ignore[arg-type]


def make_rows(slot: int, *, packed: bool = True, token: int | None = None, seed: int = 0) -> list[schemas.BatchRow]:
    """Deterministic batch rows for slot `slot`: two packed segments per row (prompt 4 + response 4) + padding."""
    rng = np.random.default_rng(seed * 1000 + slot)
    rows = []
    for _ in range(BATCH):
        n_seg = 2 if packed else 1
        tokens, loss_mask, seg, pos, adv = [], [], [], [], []
        for s in range(n_seg):
            a = float(rng.choice([-1.0, 1.0]))
            prompt = rng.integers(4, VOCAB, 4).tolist()
            resp = [token] * 4 if token is not None else rng.integers(4, VOCAB, 4).tolist()
            tokens += prompt + resp
            loss_mask += [0] * 4 + [1] * 4
            seg += [s] * 8
            pos += list(range(8))
            adv += [0.0] * 4 + [1.0 if token is not None else a] * 4
        pad = SEQ_LEN - len(tokens)
        tokens += [0] * pad
        loss_mask += [0] * pad
        seg += [-1] * pad
        pos += [0] * pad
        adv += [0.0] * pad
        gen = [0.0] * 4 + (-rng.uniform(4, 8, 4)).tolist()
        gen = (gen * n_seg) + [0.0] * pad
        rows.append(
            schemas.BatchRow(
                tokens=tokens,
                loss_mask=loss_mask,
                segment_ids=seg,
                position_ids=pos,
                advantages=adv,
                generator_logprobs=gen,
                reference_logprobs=None,
                truncated=[False] * n_seg,
                temperatures=[1.0] * n_seg,
                policy_steps=[max(slot - 1, 0)] * n_seg,
                rollout_ids=[f"r{slot}-{i}" for i in range(n_seg)],
                source_files=["rollouts/x.parquet"] * n_seg,
            )
        )
    return rows


def write_batch(store: RunStore, slot: int, rows: list[schemas.BatchRow], **entry: Any) -> str:
    """Write a batch parquet and its commit object (`batches/log/step-T.json` naming `data_file`)."""
    path = layout.batch_data_file(slot, "test")
    info = store.write_parquet(path, schemas.BATCH.to_table(rows), schemas.BATCH)
    fields = {"seq_len": SEQ_LEN, "data_size": info.size, "data_sha256": info.sha256, "rows": info.rows, **entry}
    put_log_entry(store, slot, data_file=path, **fields)
    return path


def write_batches(store: RunStore, slots: range, seed: int = 0) -> None:
    for t in slots:
        write_batch(store, t, make_rows(t, seed=seed))


def params(model: object) -> list[np.ndarray]:
    return M.numpy_params(model)


def test_learner_trains_publishes_and_replays(tmp_path):
    root = str(tmp_path / "run")
    store = RunStore(root)
    write_batches(store, range(1, 4))
    cfg = tiny_config(root, steps=3)
    learn.main(cfg)

    assert run_state.latest_policy_step(store) == 3
    assert store.exists(layout.LEARNER_DONE)
    assert pf.committed_checkpoints(store) == [2, 3]  # keep_checkpoints=2; step 1 collected
    p0 = pf.read_policy(store, 0, cfg.model, VOCAB)
    p1 = pf.read_policy(store, 1, cfg.model, VOCAB)
    p3 = pf.read_policy(store, 3, cfg.model, VOCAB)
    assert any(not np.array_equal(a, b) for a, b in zip(params(p0), params(p1), strict=True))
    marker = pf.policy_metadata(store, 3)
    assert marker.batch_slot == 3 and marker.seq_len == SEQ_LEN and marker.tokenizer == "builtin:tiny"

    from pipeline.telemetry.metrics import read_metrics

    recs = [r for r in read_metrics(store, "learner") if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert np.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
        for k in ("ratio_mean", "clip_fraction", "mismatch_abs_logp", "mismatch_kl", "entropy", "wait_s"):
            assert k in r

    # exact replay: a second run root resumed from checkpoint 2's files replays slot 3 bitwise
    root2 = str(tmp_path / "replay")
    store2 = RunStore(root2)
    write_batches(store2, range(1, 4))
    for rel in store.list(layout.checkpoint_dir(2)):
        store2.put_unique(rel, store.get(rel))
    store2.put_unique(layout.policy_marker(0), store.get(layout.policy_marker(0)))
    for rel in store.list(layout.policy_dir(0)):
        store2.put_unique(rel, store.get(rel))
    learn.main(cfg.__class__(**{**cfg.__dict__, "store": StoreConfig(run_root=root2)}))
    q3 = pf.read_policy(store2, 3, cfg.model, VOCAB)
    assert all(np.array_equal(a, b) for a, b in zip(params(p3), params(q3), strict=True))
    # the replay's checkpoint 3 records that it came from checkpoint 2 and consumed only slot 3
    rec = CommitMarker.from_json(store2.get(layout.checkpoint_marker(3)), path=layout.checkpoint_marker(3))
    assert rec.parent == 2 and rec.slots == [3, 3]


def test_rewarded_token_logprob_rises(tmp_path):
    root = str(tmp_path / "run")
    store = RunStore(root)
    # one step of a 3-step schedule (a constant rate): the train step program of the test above, not another
    cfg = tiny_config(root, steps=3, max_steps=1)
    model0 = M.build_model(cfg.model, VOCAB)
    rows = make_rows(1, token=TOKEN)
    arrays = learner.batch_arrays(rows, cfg.train, VOCAB, "x")
    lp0 = np.asarray(
        M.teacher_forced_logprobs(
            model0, arrays.tokens, segment_ids=arrays.segment_ids, position_ids=arrays.position_ids
        )
    )
    for r, row in enumerate(rows):  # on-policy behaviour logprobs: ratio 1
        row.generator_logprobs = lp0[r].tolist()
    write_batch(store, 1, rows)
    learn.main(cfg)
    model1 = pf.read_policy(store, 1, cfg.model, VOCAB)
    lp1 = np.asarray(
        M.teacher_forced_logprobs(
            model1, arrays.tokens, segment_ids=arrays.segment_ids, position_ids=arrays.position_ids
        )
    )
    mask = np.asarray(arrays.loss_mask) > 0
    assert np.isfinite(lp1).all()
    assert (lp1[mask] - lp0[mask]).mean() > 0.5, (lp0[mask].mean(), lp1[mask].mean())


def test_packing_isolates_segments():
    spec = ModelSpec(max_seq_len=SEQ_LEN)
    model = M.build_model(spec, VOCAB)
    rows = make_rows(1)
    a = learner.batch_arrays(
        rows, TrainParams(batch_size=BATCH, seq_len=SEQ_LEN, replay_buffer_capacity=BATCH), VOCAB, "x"
    )
    lp = np.asarray(M.teacher_forced_logprobs(model, a.tokens, segment_ids=a.segment_ids, position_ids=a.position_ids))
    alone = np.asarray(M.teacher_forced_logprobs(model, np.asarray(a.tokens)[:, 8:16]))
    np.testing.assert_allclose(lp[:, 9:16], alone[:, 1:], atol=1e-5)
    assert (lp[:, 8] == 0).all() and (lp[:, 0] == 0).all()


def test_refuses_mismatched_batches(tmp_path):
    root = str(tmp_path / "run")
    store = RunStore(root)
    cfg = tiny_config(root, steps=2)
    write_batch(store, 1, make_rows(1), seq_len=SEQ_LEN * 2)
    with pytest.raises(learner.BatchMismatchError, match="seq_len"):
        learn.main(cfg)
    root2 = str(tmp_path / "run2")
    store2 = RunStore(root2)
    rows = make_rows(1)[:2]
    write_batch(store2, 1, rows)
    with pytest.raises(learner.BatchMismatchError, match="batch_size"):
        learn.main(tiny_config(root2, steps=2))
    root3 = str(tmp_path / "run3")
    store3 = RunStore(root3)
    # a batch built with another tokenizer: token ids outside this run's vocabulary are refused
    # (log entries do not record the tokenizer; the batch's token ids are what is checked)
    foreign = [dataclasses.replace(r, tokens=[VOCAB + 3 if t else t for t in r.tokens]) for r in make_rows(1)]
    write_batch(store3, 1, foreign)
    with pytest.raises(learner.BatchMismatchError, match="tokenizer"):
        learn.main(tiny_config(root3, steps=2))


def test_wait_timeout_names_the_file(tmp_path):
    root = str(tmp_path / "run")
    cfg = tiny_config(root, steps=2, batch_wait_timeout_s=0.3)
    with pytest.raises(WaitTimeout, match=r"batch_wait_timeout_s=0\.3\).*step-00000001\.json"):
        learn.main(cfg)
    # policy 0 was published before waiting
    assert run_state.latest_policy_step(RunStore(root)) == 0


def test_reference_model_absent_when_kl_off(tmp_path):
    from policy.losses import loss_module_from_config

    store = RunStore(str(tmp_path))
    cfg = tiny_config(str(tmp_path))
    module = loss_module_from_config(RLOOLossConfig(kl_coef=0.0))
    # no policy 0 exists: building a reference would fail, so None proves it is never built
    assert learner.load_reference(store, cfg, VOCAB, module) is None
    module_kl = loss_module_from_config(RLOOLossConfig(kl_coef=0.1))
    with pytest.raises(pf.PolicyNotFoundError):
        learner.load_reference(store, cfg, VOCAB, module_kl)


def test_kl_learner_step(tmp_path):
    root = str(tmp_path / "run")
    store = RunStore(root)
    write_batches(store, range(1, 3))
    cfg = tiny_config(root, steps=2, loss=RLOOLossConfig(kl_coef=0.1, tis_cap=2.0, aggregation="sequence"))
    learn.main(cfg)
    from pipeline.telemetry.metrics import read_metrics

    recs = [r for r in read_metrics(store, "learner") if "loss" in r]
    assert recs[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # first step: policy == reference
    assert recs[1]["kl"] > 0
