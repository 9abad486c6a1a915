"""Hand-computed float32 cases for every loss term and module: zero advantage, clipping per token (CISPO) and per
sequence (GSPO), gradient sign, gradients equal to the published formulas (ties at ε = 0 included), extreme
log-ratios (±100) and fully masked rows, and the guarded optimizer update."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from pipeline.config import (  # noqa: E402
    CISPOLossConfig,
    ConfigError,
    GSPOLossConfig,
    LossConfig,
    PPOClipLossConfig,
    RLOOLossConfig,
)
from policy import losses as L  # noqa: E402
from policy.update_guard import guarded_update  # noqa: E402

S = 8
ALL_CONFIGS: list[LossConfig] = [
    RLOOLossConfig(),
    RLOOLossConfig(tis_cap=2.0),
    RLOOLossConfig(aggregation="sequence"),
    PPOClipLossConfig(),
    GSPOLossConfig(),
    CISPOLossConfig(),
    CISPOLossConfig(aggregation="sequence"),
]


def batch_of(delta: list[list[float]], adv: list[list[float]], mask: list[list[float]] | None = None) -> L.Batch:
    """One sequence per row, tokens 0..len-1 of row b are loss tokens (or `mask`), logp_gen = −1 − δ so that the
    learner/sampler log-ratio at logp ≡ −1 is δ."""
    B = len(delta)
    m = np.zeros((B, S), np.float32)
    d = np.zeros((B, S), np.float32)
    a = np.zeros((B, S), np.float32)
    for b in range(B):
        n = len(delta[b])
        d[b, :n], a[b, :n] = delta[b], adv[b]
        m[b, :n] = 1.0 if mask is None else mask[b]
    return L.Batch(
        tokens=jnp.zeros((B, S), jnp.int32),
        segment_ids=jnp.zeros((B, S), jnp.int32),
        position_ids=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)),
        loss_mask=jnp.asarray(m),
        advantages=jnp.asarray(a),
        generator_logprobs=jnp.asarray(-1.0 - d),
        temperature=jnp.ones((B, S), jnp.float32),
        truncated=jnp.zeros((B, S), bool),
        seq_index=jnp.asarray(np.repeat(np.arange(B)[:, None] * S, S, axis=1).astype(np.int32)),
    )


def loss_and_grad(cfg: LossConfig, batch: L.Batch, logp: jax.Array | None = None) -> tuple[float, np.ndarray, dict]:
    """(loss, ∂loss/∂logp [B, S], metrics) of the module for `cfg` at logp (default −1 everywhere)."""
    module = L.loss_module_from_config(cfg)
    logp = jnp.full(batch.loss_mask.shape, -1.0, jnp.float32) if logp is None else logp
    (loss, metrics), grad = jax.value_and_grad(lambda lp: module.objective(lp, batch, None), has_aux=True)(logp)
    return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------------------------------
# every module
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: f"{c.get_choice_name(type(c))}-{c.aggregation}")
def test_zero_advantage_zero_loss_and_gradient(cfg: LossConfig) -> None:
    batch = batch_of([[0.3, -0.2, 0.5], [1.0, -1.0]], [[0.0] * 3, [0.0] * 2])
    loss, grad, _ = loss_and_grad(cfg, batch)
    assert loss == 0.0
    assert not grad.any()


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: f"{c.get_choice_name(type(c))}-{c.aggregation}")
def test_gradient_sign_follows_advantage(cfg: LossConfig) -> None:
    """Descent (−∂loss/∂logp) raises the logprob of positive-advantage tokens, lowers negative ones (on policy)."""
    batch = batch_of([[0.0] * 3, [0.0] * 2], [[1.0] * 3, [-1.0] * 2])
    _, grad, _ = loss_and_grad(cfg, batch)
    assert (grad[0, :3] < 0).all() and (grad[1, :2] > 0).all()
    assert not grad[:, 3:].any() and not grad[1, 2:].any()  # nothing flows to non-loss tokens


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: f"{c.get_choice_name(type(c))}-{c.aggregation}")
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_log_ratios_and_masked_rows_stay_finite(cfg: LossConfig, sign: float) -> None:
    """Log-ratios of ±100 (exp overflows float32 at ~88) and a fully masked row give a finite loss, finite
    gradients, and `clamped_count` counts exactly the clamped loss tokens (GSPO: sequences)."""
    batch = batch_of(
        [[100.0, -100.0, 0.1], [100.0, 100.0], [-100.0, 100.0, 100.0], [0.0, 0.0]],
        [[sign] * 3, [sign] * 2, [-sign] * 3, [sign] * 2],
        mask=[[1, 1, 1], [1, 1], [0, 0, 0], [1, 1]],  # row 2 fully masked
    )
    loss, grad, metrics = loss_and_grad(cfg, batch)
    assert math.isfinite(loss) and np.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    if isinstance(cfg, GSPOLossConfig):
        # sequence means of δ: 0.1/3 (not clamped), 100 (clamped), masked row excluded, 0
        assert metrics["clamped_count"] == 1 and metrics["clamped_fraction"] == pytest.approx(1 / 3)
    else:
        assert metrics["clamped_count"] == 4 and metrics["clamped_fraction"] == pytest.approx(4 / 7)
    assert not grad[2].any()  # the masked row has no gradient


def test_clamp_log_ratio_value_gradient_and_count() -> None:
    delta = jnp.asarray([-100.0, -20.0, -3.0, 0.0, 20.0, 20.5, 100.0], jnp.float32)
    clamped_value, clamped = L.clamp_log_ratio(delta, 20.0)
    np.testing.assert_array_equal(np.asarray(clamped_value), [-20, -20, -3, 0, 20, 20, 20])
    np.testing.assert_array_equal(np.asarray(clamped), [1, 0, 0, 0, 0, 1, 1])
    grad = jax.grad(lambda d: jnp.sum(L.clamp_log_ratio(d, 20.0)[0]))(delta)
    np.testing.assert_array_equal(np.asarray(grad), [0, 1, 1, 1, 1, 0, 0])  # exactly 1 on the bound, no split
    ratio, _ = L.importance_ratio(jnp.float32(0.0), jnp.float32(-100.0), 20.0)
    assert float(ratio) == pytest.approx(math.exp(20.0), rel=1e-6)


def test_max_log_ratio_is_validated_and_parsed() -> None:
    with pytest.raises(ConfigError, match=r"loss\.max_log_ratio"):
        RLOOLossConfig(max_log_ratio=0.0)
    with pytest.raises(ConfigError, match=r"loss\.aggregation"):
        GSPOLossConfig(aggregation="token")
    with pytest.raises(ConfigError, match=r"loss\.clip_low"):
        CISPOLossConfig(clip_low=1.5)
    import draccus

    from pipeline.config import LearnerStepConfig

    for name, cls in (("gspo", GSPOLossConfig), ("cispo", CISPOLossConfig)):
        cfg = draccus.parse(LearnerStepConfig, args=["--loss.type", name, "--loss.max_log_ratio", "5"]).loss
        assert type(cfg) is cls and cfg.max_log_ratio == 5.0


# ---------------------------------------------------------------------------------------------
# token-level PPO clip (RLOO / PPO): ties at ε = 0 and TIS
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_eps_zero_gradient_is_the_published_one(tis_cap: float | None) -> None:
    """On policy (r = 1) with ε_low = 0 (A < 0 sits on the lower bound) or ε_high = 0 (A > 0 on the upper),
    ∂loss/∂logp_t = −w_t·A_t/n exactly (n loss tokens, w the TIS weight, 1 without TIS): not 0.75 of it."""
    batch = batch_of([[0.0, 0.0], [0.0, 0.0]], [[1.0, 2.0], [-1.0, -0.5]])
    for cfg in (
        RLOOLossConfig(clip_low=0.0, clip_high=0.0, tis_cap=tis_cap),
        RLOOLossConfig(clip_low=0.0, clip_high=0.28, tis_cap=tis_cap),
        RLOOLossConfig(clip_low=0.2, clip_high=0.0, tis_cap=tis_cap),
    ):
        loss, grad, metrics = loss_and_grad(cfg, batch)
        np.testing.assert_allclose(grad[:, :2], -np.asarray([[1.0, 2.0], [-1.0, -0.5]]) / 4, rtol=1e-6)
        assert loss == pytest.approx(-(1 + 2 - 1 - 0.5) / 4)
        assert metrics["clip_fraction"] == 0.0


def test_tis_mode_ratio_is_to_the_learner_and_weight_to_the_sampler() -> None:
    """With tis_cap the clipped ratio is π_θ/sg(π_θ) ≡ 1 (clip never acts, documented), and the sampler
    mismatch enters only through the capped weight min(exp(δ), C)."""
    batch = batch_of([[1.0, -1.0, 0.0]], [[1.0, 1.0, 1.0]])
    loss, grad, metrics = loss_and_grad(RLOOLossConfig(tis_cap=2.0), batch)
    w = np.array([2.0, math.exp(-1.0), 1.0])  # min(e^1, 2), e^-1, 1
    np.testing.assert_allclose(grad[0, :3], -w / 3, rtol=1e-6)
    assert loss == pytest.approx(-w.sum() / 3, rel=1e-6)
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0
    assert metrics["tis_weight_mean"] == pytest.approx(w.mean(), rel=1e-6)


def test_ppo_clip_hand_computed() -> None:
    """r = e^0.5 (A = +1: clipped to 1.28, no gradient), r = e^-0.5 (A = +1: unclipped, gradient −r/n),
    r = e^-0.5 (A = −1: clipped to 0.8), r = e^0.1 (A = −1: unclipped, pessimistic r·A)."""
    batch = batch_of([[0.5, -0.5, -0.5, 0.1]], [[1.0, 1.0, -1.0, -1.0]])
    loss, grad, metrics = loss_and_grad(RLOOLossConfig(clip_low=0.2, clip_high=0.28), batch)
    r = np.exp([0.5, -0.5, -0.5, 0.1])
    terms = [1.28, r[1], -0.8, -r[3]]
    assert loss == pytest.approx(-sum(terms) / 4, abs=1e-6)  # float32 cancellation: absolute tolerance
    np.testing.assert_allclose(grad[0, :4], [0.0, -r[1] / 4, 0.0, r[3] / 4], rtol=1e-6)
    assert metrics["clip_fraction"] == 0.5


@pytest.mark.parametrize("cfg", [RLOOLossConfig(dual_clip=3.0), PPOClipLossConfig(dual_clip=3.0)], ids=["rloo", "ppo"])
def test_dual_clip_bounds_negative_advantages_far_above_the_ratio(cfg: LossConfig) -> None:
    """r = e^2 (A = −1: dual-clipped to −3, no gradient), r = e^0.5 (A = −1: under c, unclipped r·A), r = e^2
    (A = +1: the usual upper clip), r = e^-0.5 (A = −1: the usual lower clip, 0.8·A for ε_low = 0.2)."""
    batch = batch_of([[2.0, 0.5, 2.0, -0.5]], [[-1.0, -1.0, 1.0, -1.0]])
    loss, grad, metrics = loss_and_grad(cfg, batch)
    r = np.exp([2.0, 0.5, 2.0, -0.5])
    high = 1.28 if isinstance(cfg, RLOOLossConfig) else 1.2
    terms = [-3.0, -r[1], high, -0.8]
    assert loss == pytest.approx(-sum(terms) / 4, abs=1e-5)
    np.testing.assert_allclose(grad[0, :4], [0.0, r[1] / 4, 0.0, 0.0], rtol=1e-6, atol=1e-7)
    assert metrics["dual_clip_fraction"] == 0.25 and metrics["clip_fraction"] == 0.5
    plain = loss_and_grad(dataclasses.replace(cfg, dual_clip=None), batch)
    assert plain[0] == pytest.approx(loss + (r[0] - 3.0) / 4, abs=1e-5)  # without it: the unbounded −r·A
    assert plain[1][0, 0] == pytest.approx(r[0] / 4, rel=1e-6) and "dual_clip_fraction" not in plain[2]


def test_dual_clip_must_exceed_one() -> None:
    with pytest.raises(ConfigError, match=r"loss\.dual_clip"):
        RLOOLossConfig(dual_clip=1.0)


# ---------------------------------------------------------------------------------------------
# GSPO
# ---------------------------------------------------------------------------------------------


def test_gspo_clips_per_sequence() -> None:
    """s_0 = exp(mean(0.1, 0.3)) = e^0.2, A_0 = +1; s_1 = exp(mean(−0.2 ×3)) = e^−0.2, A_1 = −1;
    a third sequence with per-token δ = ±1 (ratios e^±1, far outside the range) has s_2 = 1 and is not clipped."""
    batch = batch_of([[0.1, 0.3], [-0.2, -0.2, -0.2], [1.0, -1.0]], [[1.0] * 2, [-1.0] * 3, [1.0] * 2])
    s0, s1 = math.exp(0.2), math.exp(-0.2)
    # both outside a ±0.1 range: J = (1.1 − 0.9 + 1)/3, no gradient for the clipped sequences
    loss, grad, metrics = loss_and_grad(GSPOLossConfig(clip_low=0.1, clip_high=0.1), batch)
    assert loss == pytest.approx(-(1.1 - 0.9 + 1.0) / 3, rel=1e-6)
    assert not grad[:2].any()
    np.testing.assert_allclose(grad[2, :2], [-1 / 3 / 2] * 2, rtol=1e-6)  # −(1/N)·A·s/|y|
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)
    assert metrics["ratio_mean"] == pytest.approx((s0 + s1 + 1) / 3, rel=1e-6)
    # ε_low = 0.3 keeps s_1 inside: only sequence 0 is clipped; ∂loss/∂logp_t = −(1/N)·A_1·s_1/|y_1|
    loss, grad, metrics = loss_and_grad(GSPOLossConfig(clip_low=0.3, clip_high=0.1), batch)
    assert loss == pytest.approx(-(1.1 - s1 + 1.0) / 3, rel=1e-6)
    assert not grad[0].any()
    np.testing.assert_allclose(grad[1, :3], [s1 / 3 / 3] * 3, rtol=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)


def test_gspo_eps_zero_gradient_is_the_published_one() -> None:
    """At s_i = 1 with ε_low = ε_high = 0 (every sequence on a bound): ∂loss/∂logp_t = −A_i/(N·|y_i|)."""
    batch = batch_of([[0.0] * 2, [0.0] * 3], [[2.0] * 2, [-1.0] * 3])
    loss, grad, metrics = loss_and_grad(GSPOLossConfig(clip_low=0.0, clip_high=0.0), batch)
    assert loss == pytest.approx(-(2.0 - 1.0) / 2)
    np.testing.assert_allclose(grad[0, :2], [-2.0 / (2 * 2)] * 2, rtol=1e-6)
    np.testing.assert_allclose(grad[1, :3], [1.0 / (2 * 3)] * 3, rtol=1e-6)
    assert metrics["clip_fraction"] == 0.0


def test_gspo_gradient_matches_closed_form_off_policy() -> None:
    """Unclipped, random logp: ∂loss/∂logp_t = −(1/N)·A_i·s_i/|y_i| for t in sequence i (jax.grad vs formula)."""
    rng = np.random.default_rng(0)
    delta = [rng.normal(0, 0.05, 3).tolist(), rng.normal(0, 0.05, 5).tolist()]
    batch = batch_of(delta, [[0.7] * 3, [-1.3] * 5])
    _, grad, _ = loss_and_grad(GSPOLossConfig(clip_low=0.9, clip_high=10.0), batch)
    for i, (d, a) in enumerate(zip(delta, (0.7, -1.3), strict=True)):
        s = math.exp(float(np.mean(np.float32(d))))
        np.testing.assert_allclose(grad[i, : len(d)], -a * s / len(d) / 2, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# CISPO
# ---------------------------------------------------------------------------------------------


def test_cispo_clips_the_weight_per_token_and_keeps_every_gradient() -> None:
    """δ = (0.5, −0.5, 0, 0.1), A = (1, 1, −1, 0.5), logp = (−1, −2, −0.5, −1), ε_low = 0.2, ε_high = 0.28:
    w = (1.28, 0.8, 1, e^0.1); loss = −Σ w·A·logp / 4; ∂loss/∂logp_t = −w_t·A_t/4 (clipped tokens included)."""
    logp_vals = np.array([-1.0, -2.0, -0.5, -1.0], np.float32)
    delta = [0.5, -0.5, 0.0, 0.1]
    batch = batch_of([delta], [[1.0, 1.0, -1.0, 0.5]])
    batch = dataclasses.replace(
        batch, generator_logprobs=batch.generator_logprobs.at[0, :4].set(jnp.asarray(logp_vals - delta))
    )
    logp = jnp.zeros((1, S), jnp.float32).at[0, :4].set(jnp.asarray(logp_vals))
    loss, grad, metrics = loss_and_grad(CISPOLossConfig(clip_low=0.2, clip_high=0.28), batch, logp)
    w = np.array([1.28, 0.8, 1.0, math.exp(0.1)])
    a = np.array([1.0, 1.0, -1.0, 0.5])
    assert loss == pytest.approx(-(w * a * logp_vals).sum() / 4, rel=1e-6)
    np.testing.assert_allclose(grad[0, :4], -w * a / 4, rtol=1e-6)
    assert metrics["clip_fraction"] == 0.5 and metrics["is_weight_mean"] == pytest.approx(w.mean(), rel=1e-6)


def test_cispo_eps_zero_is_reinforce() -> None:
    """ε_low = ε_high = 0: every weight is 1 whatever the ratio, so ∂loss/∂logp_t = −A_t/n (plain REINFORCE)."""
    batch = batch_of([[0.7, -0.4, 0.0]], [[1.0, -2.0, 0.5]])
    _, grad, _ = loss_and_grad(CISPOLossConfig(clip_low=0.0, clip_high=0.0), batch)
    np.testing.assert_allclose(grad[0, :3], -np.array([1.0, -2.0, 0.5]) / 3, rtol=1e-6)


def test_cispo_default_has_no_lower_bound() -> None:
    ratio = jnp.asarray([1e-6, 0.5, 1.0, 1.5], jnp.float32)
    w = CISPOLossConfig()
    np.testing.assert_allclose(
        np.asarray(L.cispo_weight(ratio, w.clip_low, w.clip_high)), [1e-6, 0.5, 1.0, 1.28], rtol=1e-6
    )


# ---------------------------------------------------------------------------------------------
# the guarded optimizer update
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_guarded_update_skips_non_finite_steps(bad: float) -> None:
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1))
    model = {"w": jnp.asarray([1.0, -2.0, 3.0]), "b": jnp.asarray(0.5)}
    opt_state = optimizer.init(model)
    step = jax.jit(lambda m, o, g, loss: guarded_update(optimizer, m, o, g, loss))
    good = {"w": jnp.asarray([0.1, 0.2, 0.3]), "b": jnp.asarray(1.0)}

    m1, o1, met = step(model, opt_state, good, jnp.float32(1.0))
    assert float(met["skipped_nonfinite"]) == 0.0 and float(met["grad_norm"]) > 0
    assert not np.array_equal(np.asarray(m1["w"]), np.asarray(model["w"]))

    for grads, loss in (({"w": good["w"].at[1].set(bad), "b": good["b"]}, 1.0), (good, bad)):
        m2, o2, met = step(m1, o1, grads, jnp.float32(loss))
        assert float(met["skipped_nonfinite"]) == 1.0
        for new, old in zip(jax.tree.leaves((m2, o2)), jax.tree.leaves((m1, o1)), strict=True):
            np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


def test_reverse_kl_distillation_advantage_by_hand() -> None:
    """A_t = c·(log π_teacher − log π_student) (+ the RL advantage), 0 off the mask, no gradient: teacher
    [−0.5, −2.0, −1.0], student [−1.0, −1.5, −3.0], mask [1, 1, 0], RLOO advantage 0.4 on the response."""
    teacher = jnp.asarray([[-0.5, -2.0, -1.0]], jnp.float32)
    student = jnp.asarray([[-1.0, -1.5, -3.0]], jnp.float32)
    mask = jnp.asarray([[1.0, 1.0, 0.0]], jnp.float32)
    np.testing.assert_allclose(np.asarray(L.reverse_kl_advantage(teacher, student, mask)), [[0.5, -0.5, 0.0]])
    mixed = L.reverse_kl_advantage(teacher, student, mask, jnp.full((1, 3), 0.4, jnp.float32), coef=0.5)
    np.testing.assert_allclose(np.asarray(mixed), [[0.4 + 0.25, 0.4 - 0.25, 0.0]], rtol=1e-6)
    grad = jax.grad(lambda s: jnp.sum(L.reverse_kl_advantage(teacher, s, mask)))(student)
    assert not np.asarray(grad).any()
