"""No batch can poison or stall the learner: a batch whose loss is not finite is skipped (parameters and optimizer
state unchanged, `skipped_nonfinite: 1` in the metrics) and training goes on with the next slot; a sampler/learner
log-ratio past float32's exp range is clamped and counted instead of producing a NaN."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore

jax = pytest.importorskip("jax")

from test_learner import VOCAB, make_rows, params, tiny_config, write_batch  # noqa: E402

from pipeline.telemetry.metrics import read_metrics  # noqa: E402
from policy import policy_format as pf  # noqa: E402
from steps import learn  # noqa: E402


def test_non_finite_batch_is_skipped_and_training_goes_on(tmp_path):
    root = str(tmp_path / "run")
    store = RunStore(root)
    poisoned = make_rows(1)
    for row in poisoned:  # an infinite advantage makes the loss and every gradient non-finite
        row.advantages = [float("inf") if m else 0.0 for m in row.loss_mask]
    write_batch(store, 1, poisoned)
    extreme = make_rows(2)
    extreme[0].generator_logprobs[4] = -300.0  # log-ratio ≈ +295 on one loss token: exp overflows without the clamp
    write_batch(store, 2, extreme)
    write_batch(store, 3, make_rows(3))
    cfg = tiny_config(root, steps=3)
    learn.main(cfg)

    assert store.exists(layout.LEARNER_DONE) and run_state.latest_policy_step(store) == 3
    recs = {r["step"]: r for r in read_metrics(store, "learner") if "loss" in r}
    assert sorted(recs) == [1, 2, 3]
    assert recs[1]["skipped_nonfinite"] == 1.0 and not np.isfinite(recs[1]["loss"])
    assert recs[2]["skipped_nonfinite"] == 0.0 and recs[3]["skipped_nonfinite"] == 0.0
    assert np.isfinite(recs[2]["loss"]) and np.isfinite(recs[2]["grad_norm"]) and recs[2]["clamped_count"] == 1.0
    p0, p1, p2 = (pf.read_policy(store, s, cfg.model, VOCAB) for s in (0, 1, 2))
    assert all(np.array_equal(a, b) for a, b in zip(params(p0), params(p1), strict=True))  # slot 1 left no trace
    assert any(not np.array_equal(a, b) for a, b in zip(params(p1), params(p2), strict=True))
    assert all(np.isfinite(a).all() for a in params(p2))
