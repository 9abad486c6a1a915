"""Several optimizer updates per batch slot (`train.ppo_epochs` × `train.minibatches_per_slot`): the learner step
stays the slot (one policy, one metrics record per slot), clipping acts once the policy moves within a slot
(also with TIS, where the ratio is to the learner's own pre-update logprobs), replay from a checkpoint is
bitwise, the learning rate is counted in slots, and misfitting sizes are refused naming the field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_learner import BATCH, SEQ_LEN, VOCAB, make_rows, params, tiny_config, write_batch

from pipeline.config import (
    ConfigError,
    LearnerStepConfig,
    MeshConfig,
    OptimizerSpec,
    RLOOLossConfig,
    StoreConfig,
    TrainParams,
    validate_learner,
)
from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import read_metrics

jax = pytest.importorskip("jax")

from policy import learner  # noqa: E402
from policy import model as M  # noqa: E402
from policy import policy_format as pf  # noqa: E402
from steps import learn  # noqa: E402

STEPS = 3


def on_policy_rows(cfg: LearnerStepConfig, slot: int) -> list:
    """Slot `slot`'s rows with generator logprobs equal to the initial model's: the first update's ratio is 1."""
    model0 = M.build_model(cfg.model, VOCAB)
    rows = make_rows(slot)
    a = learner.batch_arrays(rows, cfg.train, VOCAB, "x")
    lp0 = np.asarray(
        M.teacher_forced_logprobs(model0, a.tokens, segment_ids=a.segment_ids, position_ids=a.position_ids)
    )
    for r, row in enumerate(rows):
        row.generator_logprobs = lp0[r].tolist()
    return rows


def epochs_config(root: str, epochs: int, minibatches: int, **kw: object) -> LearnerStepConfig:
    train = TrainParams(
        num_train_steps=STEPS,
        batch_size=BATCH,
        seq_len=SEQ_LEN,
        replay_buffer_capacity=BATCH,
        ppo_epochs=epochs,
        minibatches_per_slot=minibatches,
        microbatch_size=kw.pop("microbatch_size", None),  # type: ignore[arg-type]
    )
    return tiny_config(root, steps=STEPS, train=train, **kw)


def first_record(root: str) -> dict:
    return next(r for r in read_metrics(RunStore(root), "learner") if "loss" in r)


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_clipping_acts_only_with_several_updates_per_slot(tmp_path: Path, tis_cap: float | None) -> None:
    loss = RLOOLossConfig(tis_cap=tis_cap)
    one = epochs_config(str(tmp_path / "one"), 1, 1, loss=loss, max_steps=1)
    two = epochs_config(str(tmp_path / "two"), 2, 2, loss=loss, max_steps=1)
    rows = on_policy_rows(one, 1)
    for cfg in (one, two):
        write_batch(RunStore(cfg.store.run_root), 1, rows)
        learn.main(cfg)
    r1, r2 = first_record(one.store.run_root), first_record(two.store.run_root)
    assert r1["clip_fraction"] == 0.0 and "optimizer_updates" not in r1
    assert r2["clip_fraction"] > 0.0, r2
    assert r2["optimizer_updates"] == 4.0
    assert r2["loss_tokens"] == r1["loss_tokens"]  # counts are per pass over the slot
    # the learner step is the slot: one policy after slot 1's four updates
    assert run_state.latest_policy_step(RunStore(two.store.run_root)) == 1


def test_epochs_replay_bitwise(tmp_path: Path) -> None:
    """epochs 2 × minibatches 2 × microbatches of 1 row: resumed from checkpoint 2 (by the learner, and by
    `steps.replay`), slot 3 gives policy 3 bit for bit."""
    root = str(tmp_path / "run")
    store = RunStore(root)
    cfg = epochs_config(root, 2, 2, microbatch_size=1, loss=RLOOLossConfig(tis_cap=2.0, kl_coef=0.05))
    for t in range(1, STEPS + 1):
        write_batch(store, t, make_rows(t))
    learn.main(cfg)
    recs = [r for r in read_metrics(store, "learner") if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["optimizer_updates"] == 4.0 for r in recs)
    p3 = params(pf.read_policy(store, 3, cfg.model, VOCAB))

    root2 = str(tmp_path / "again")
    store2 = RunStore(root2)
    for t in range(1, STEPS + 1):
        write_batch(store2, t, make_rows(t))
    for folder in (layout.checkpoint_dir(2), layout.policy_dir(0)):
        for rel in store.list(folder):
            store2.put_unique(rel, store.get(rel))
    learn.main(cfg.__class__(**{**cfg.__dict__, "store": StoreConfig(run_root=root2)}))
    q3 = params(pf.read_policy(store2, 3, cfg.model, VOCAB))
    assert all(np.array_equal(a, b) for a, b in zip(p3, q3, strict=True))

    replayed = learner.replay_slots(store, cfg, 2, 3)
    r3 = params(jax.device_get(replayed.model))
    assert all(np.array_equal(a, b) for a, b in zip(p3, r3, strict=True))


def test_learning_rate_is_counted_in_slots() -> None:
    spec = OptimizerSpec(learning_rate=1.0, warmup_steps=3, min_lr_ratio=0.1)
    per_slot = learner.learning_rate_schedule(spec, 10)
    per_update = learner.learning_rate_schedule(spec, 10, updates_per_slot=4)
    for u in range(40):
        assert float(per_update(u)) == float(per_slot(u // 4))


def test_bad_epoch_and_minibatch_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"train\.ppo_epochs"):
        TrainParams(ppo_epochs=0)
    with pytest.raises(ConfigError, match=r"train.minibatches_per_slot=3.*divide train.batch_size=32"):
        validate_learner(LearnerStepConfig(train=TrainParams(batch_size=32, minibatches_per_slot=3)))
    with pytest.raises(ConfigError, match=r"train.microbatch_size=16.*minibatch of 8 rows"):
        validate_learner(
            LearnerStepConfig(train=TrainParams(batch_size=32, minibatches_per_slot=4, microbatch_size=16))
        )
    with pytest.raises(ConfigError, match=r"train.minibatches_per_slot=8.*minibatches of 4 rows.*= 8"):
        validate_learner(
            LearnerStepConfig(train=TrainParams(batch_size=32, minibatches_per_slot=8), mesh=MeshConfig(data=8, fsdp=1))
        )
