"""Property tests of the RL loss terms and modules (pure functions on arrays; no model)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pipeline.config import CISPOLossConfig, GSPOLossConfig, PPOClipLossConfig, RLOOLossConfig  # noqa: E402
from policy import losses as L  # noqa: E402

floats = st.floats(-5, 5, allow_nan=False, width=32)


def make_batch(lengths: list[int], S: int = 8, adv: float = 1.0, gen: float = -1.0) -> L.Batch:
    """One sequence per row; row b has `lengths[b]` loss tokens starting at position 1."""
    B = len(lengths)
    mask = np.zeros((B, S), np.float32)
    for b, n in enumerate(lengths):
        mask[b, 1 : 1 + n] = 1
    seq_index = np.where(np.arange(S)[None] >= 0, np.arange(B)[:, None] * S, B * S).astype(np.int32)
    return L.Batch(
        tokens=jnp.zeros((B, S), jnp.int32),
        segment_ids=jnp.zeros((B, S), jnp.int32),
        position_ids=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)),
        loss_mask=jnp.asarray(mask),
        advantages=jnp.full((B, S), adv, jnp.float32),
        generator_logprobs=jnp.full((B, S), gen, jnp.float32),
        temperature=jnp.ones((B, S), jnp.float32),
        truncated=jnp.zeros((B, S), bool),
        seq_index=jnp.asarray(seq_index),
    )


def test_ratio_one_zero_advantage_zero_loss():
    for cfg in (
        RLOOLossConfig(),
        PPOClipLossConfig(),
        RLOOLossConfig(tis_cap=2.0),
        RLOOLossConfig(aggregation="sequence"),
        GSPOLossConfig(),
        CISPOLossConfig(),
    ):
        module = L.loss_module_from_config(cfg)
        batch = make_batch([3, 5], adv=0.0)
        loss, metrics = module.objective(batch.generator_logprobs, batch, None)
        assert float(loss) == 0.0
        assert float(metrics["ratio_mean"]) == pytest.approx(1.0)
        assert float(metrics["clip_fraction"]) == 0.0


@given(floats, floats)
@settings(max_examples=200, deadline=None)
def test_clip_bounds_both_directions(log_r: float, adv: float):
    eps_low, eps_high = 0.2, 0.28
    r = jnp.exp(jnp.float32(log_r))
    a = jnp.float32(adv)
    s = float(L.clipped_surrogate(r, a, eps_low, eps_high))
    # never more optimistic than the unclipped or the clipped objective
    assert s <= float(r * a) + 1e-5
    if adv > 0:
        assert s <= (1 + eps_high) * adv + 1e-4  # gain capped above
    if adv < 0:
        assert s <= (1 - eps_low) * adv + 1e-4  # cannot look better than the lower clip
    # gradient vanishes exactly when the clip indicator is on
    g = float(jax.grad(lambda x: L.clipped_surrogate(jnp.exp(x), a, eps_low, eps_high))(jnp.float32(log_r)))
    clipped = bool(L.clip_indicator(r, a, eps_low, eps_high))
    if abs(adv) > 1e-3:
        assert (g == 0.0) == clipped


def test_clip_higher_asymmetry():
    a_pos, a_neg = jnp.float32(1.0), jnp.float32(-1.0)
    assert float(L.clipped_surrogate(jnp.float32(2.0), a_pos, 0.2, 0.28)) == pytest.approx(1.28)
    assert float(L.clipped_surrogate(jnp.float32(0.1), a_neg, 0.2, 0.28)) == pytest.approx(-0.8)
    assert float(L.clipped_surrogate(jnp.float32(0.1), a_pos, 0.2, 0.28)) == pytest.approx(0.1)  # no floor for A>0


@given(floats, floats)
@settings(max_examples=200, deadline=None)
def test_k3_nonnegative_and_zero_at_equality(lp: float, lr: float):
    assert float(L.kl_k3(jnp.float32(lp), jnp.float32(lr))) >= 0.0
    assert float(L.kl_k2(jnp.float32(lp), jnp.float32(lr))) >= 0.0
    assert float(L.kl_k3(jnp.float32(lp), jnp.float32(lp))) == 0.0


def test_token_vs_sequence_aggregation():
    x = jnp.asarray(np.arange(16, dtype=np.float32).reshape(2, 8))
    equal = make_batch([4, 4])
    t = L.token_mean(x, equal.loss_mask)
    s = L.sequence_mean(x, equal.loss_mask, equal.seq_index, 17)
    assert float(t) == pytest.approx(float(s))
    unequal = make_batch([1, 6])
    t = float(L.token_mean(x, unequal.loss_mask))
    s = float(L.sequence_mean(x, unequal.loss_mask, unequal.seq_index, 17))
    # token: (1 + 9+10+...+14)/7 ; sequence: (1 + mean(9..14))/2 -- the short sequence weighs more
    assert t == pytest.approx((1 + sum(range(9, 15))) / 7)
    assert s == pytest.approx((1 + np.mean(range(9, 15))) / 2)
    assert t != pytest.approx(s)


def test_overlong_filter_zeroes_truncated():
    module = L.loss_module_from_config(RLOOLossConfig(overlong_filter=True))
    batch = make_batch([3, 3])
    batch = dataclasses.replace(batch, truncated=jnp.ones_like(batch.truncated))
    loss, metrics = module.objective(batch.generator_logprobs + 0.5, batch, None)
    assert float(loss) == 0.0 and float(metrics["loss_tokens"]) == 0.0


def test_tis_weight_capped():
    w = L.truncated_is_weight(jnp.float32(0.0), jnp.float32(-5.0), 2.0)
    assert float(w) == 2.0
    assert float(L.truncated_is_weight(jnp.float32(-1.0), jnp.float32(-0.5), 2.0)) == pytest.approx(np.exp(-0.5))


def test_kl_term_and_reference_requirement():
    module = L.loss_module_from_config(RLOOLossConfig(kl_coef=0.5, kl_estimator="k1"))
    assert module.needs_reference
    batch = make_batch([2, 2], adv=0.0)
    logp = batch.generator_logprobs
    loss, metrics = module.objective(logp, batch, logp - 1.0)
    assert float(metrics["kl"]) == pytest.approx(1.0) and float(loss) == pytest.approx(0.5)
    off = L.loss_module_from_config(RLOOLossConfig(kl_coef=0.0))
    assert not off.needs_reference and off.build(object()) is None


def test_rloo_advantages():
    """Advantages have one owner, the BatchMaker's estimator (the loss modules read them from the batch)."""
    from pipeline.batch_maker.advantages import rloo_advantages

    a = rloo_advantages(np.array([1.0, 0.0, 0.0, 1.0]))
    np.testing.assert_allclose(a, [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    assert abs(a.sum()) < 1e-6
    assert not hasattr(L, "rloo_advantages") and not hasattr(L, "mismatch_kl")


def test_registry_chooses_module():
    assert isinstance(L.loss_module_from_config(RLOOLossConfig()), L.RLOOLoss)
    ppo = L.loss_module_from_config(PPOClipLossConfig(clip_epsilon=0.1))
    assert isinstance(ppo, L.PPOClipLoss) and ppo.eps_low == ppo.eps_high == 0.1
    assert isinstance(L.loss_module_from_config(GSPOLossConfig()), L.GSPOLoss)
    cispo = L.loss_module_from_config(CISPOLossConfig(clip_low=0.5, clip_high=0.1))
    assert isinstance(cispo, L.CISPOLoss) and (cispo.eps_low, cispo.eps_high) == (0.5, 0.1)
