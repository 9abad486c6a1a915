"""Rollout correction (`loss.tis_level: sequence`, `loss.mis_level`), the clamped k3 KL, and the per-sequence
mismatch metrics, against hand-computed float64 references.

Each case fixes logp ≡ −1 and logp_gen = −1 − δ, so the learner/sampler log-ratio of every token is the δ written
in the test; with one update per slot the learner's pre-update policy is logp itself. The reference functions
below recompute each formula in numpy float64 from δ, independently of `policy.losses`."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_loss_terms import batch_of, loss_and_grad

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from pipeline.config import (  # noqa: E402
    CISPOLossConfig,
    ConfigError,
    GSPOLossConfig,
    LearnerStepConfig,
    LossConfig,
    PPOClipLossConfig,
    RLOOLossConfig,
)
from policy import losses as L  # noqa: E402

TOL = 1e-6


def clipped64(r: float, a: float, lo: float = 0.2, hi: float = 0.28) -> tuple[float, float]:
    """(min(r·A, clip(r)·A), ∂/∂ log r) in float64: the PPO surrogate and its gradient through r = exp(log r)."""
    unclipped, clipped = r * a, min(max(r, 1 - lo), 1 + hi) * a
    return (unclipped, r * a) if unclipped <= clipped else (clipped, 0.0)


def test_sequence_tis_weighs_each_response_by_its_capped_sequence_ratio() -> None:
    """w_i = min(exp(Σ_t δ_t), C): row 0 exp(0.7) ≈ 2.01 → capped at 2; row 1 exp(−0.2) ≈ 0.82. With one update
    the clipped ratio is to the learner itself (r' = 1), so loss = −Σ w_i·A_t / N and ∂/∂logp_t = −w_i·A_t / N."""
    deltas, advs = [[0.3, -0.1, 0.5], [-0.4, 0.2]], [1.0, -0.5]
    batch = batch_of(deltas, [[a] * len(d) for a, d in zip(advs, deltas, strict=True)])
    loss, grad, metrics = loss_and_grad(RLOOLossConfig(tis_cap=2.0, tis_level="sequence"), batch)
    w = [min(math.exp(sum(d)), 2.0) for d in deltas]
    n = sum(len(d) for d in deltas)
    assert w[0] == 2.0 and w[1] < 1.0
    assert loss == pytest.approx(-sum(w[i] * advs[i] * len(deltas[i]) for i in range(2)) / n, abs=TOL)
    for i, d in enumerate(deltas):
        np.testing.assert_allclose(grad[i, : len(d)], -w[i] * advs[i] / n, atol=TOL)
    assert metrics["tis_weight_mean"] == pytest.approx((3 * w[0] + 2 * w[1]) / n, abs=TOL)


def test_sequence_tis_of_one_token_responses_is_token_tis() -> None:
    batch = batch_of([[0.4], [-1.3], [2.0]], [[1.0], [-1.0], [0.5]])
    token = loss_and_grad(RLOOLossConfig(tis_cap=2.0), batch)
    seq = loss_and_grad(RLOOLossConfig(tis_cap=2.0, tis_level="sequence"), batch)
    assert seq[0] == pytest.approx(token[0], abs=TOL)
    np.testing.assert_allclose(seq[1], token[1], atol=TOL)


def test_token_masked_is_drops_tokens_outside_the_bounds_from_the_loss_and_its_denominator() -> None:
    """Bounds [0.5, 2] ↔ δ ∈ [−0.693, 0.693]: row 0 keeps its first token only, row 1 keeps both. The surrogate is
    the clip-higher PPO term to the sampler, averaged over the 3 kept tokens."""
    deltas, advs = [[0.3, -1.0, 0.9], [0.1, 0.2]], [[1.0, 1.0, 1.0], [-1.0, -1.0]]
    batch = batch_of(deltas, advs)
    loss, grad, metrics = loss_and_grad(RLOOLossConfig(mis_level="token", mis_low=0.5, mis_high=2.0), batch)
    keep = [[abs(x) <= math.log(2.0) for x in d] for d in deltas]
    kept = sum(sum(k) for k in keep)
    assert kept == 3
    ref_loss, ref_grad = 0.0, np.zeros(grad.shape)
    for i, d in enumerate(deltas):
        for t, x in enumerate(d):
            if keep[i][t]:
                s, g = clipped64(math.exp(x), advs[i][t])
                ref_loss -= s / kept
                ref_grad[i, t] = -g / kept
    assert loss == pytest.approx(ref_loss, abs=TOL)
    np.testing.assert_allclose(grad, ref_grad, atol=TOL)
    assert metrics["kept_tokens"] == 3 and metrics["loss_tokens"] == 5
    assert metrics["mis_masked_fraction"] == pytest.approx(2 / 5)
    assert metrics["mis_masked_seq_fraction"] == pytest.approx(1 / 2)


def test_wide_bounds_reject_nothing_and_leave_the_loss_unchanged() -> None:
    batch = batch_of([[0.3, -1.0, 0.9], [0.1, 0.2]], [[1.0] * 3, [-1.0] * 2])
    plain = loss_and_grad(RLOOLossConfig(aggregation="sequence"), batch)
    for level in ("token", "sequence"):
        wide = loss_and_grad(RLOOLossConfig(aggregation="sequence", mis_level=level, mis_low=0.0, mis_high=1e6), batch)
        assert wide[0] == plain[0]
        np.testing.assert_array_equal(wide[1], plain[1])
        assert wide[2]["mis_masked_fraction"] == 0.0


def test_sequence_masked_is_drops_whole_responses_and_reports_per_sequence_mismatch() -> None:
    """Sequence ratios exp(Σδ): row 0 exp(0.2) kept, row 1 exp(0.9) ≈ 2.46 > 2 rejected, row 2 exp(−0.2) kept.
    Sequence aggregation: the mean over the 2 kept responses of each one's token-mean surrogate."""
    deltas = [[0.3, -1.0, 0.9], [0.5, 0.4], [-0.2]]
    advs = [[1.0] * 3, [1.0] * 2, [-1.0]]
    batch = batch_of(deltas, advs)
    cfg = RLOOLossConfig(aggregation="sequence", mis_level="sequence", mis_low=0.5, mis_high=2.0)
    loss, grad, metrics = loss_and_grad(cfg, batch)
    kept = [i for i, d in enumerate(deltas) if 0.5 <= math.exp(sum(d)) <= 2.0]
    assert kept == [0, 2]
    ref_loss, ref_grad = 0.0, np.zeros(grad.shape)
    for i in kept:
        for t, x in enumerate(deltas[i]):
            s, g = clipped64(math.exp(x), advs[i][t])
            ref_loss -= s / len(deltas[i]) / len(kept)
            ref_grad[i, t] = -g / len(deltas[i]) / len(kept)
    assert loss == pytest.approx(ref_loss, abs=TOL)
    np.testing.assert_allclose(grad, ref_grad, atol=TOL)
    assert metrics["kept_sequences"] == 2 and metrics["loss_sequences"] == 3
    assert metrics["mis_masked_seq_fraction"] == pytest.approx(1 / 3)
    assert metrics["mis_masked_fraction"] == pytest.approx(2 / 6)
    # per-sequence mismatch over all loss tokens (rejected ones included): δ = logp − logp_gen
    mean_abs = [np.mean(np.abs(d)) for d in deltas]
    max_abs = [np.max(np.abs(d)) for d in deltas]
    assert metrics["mismatch_seq_abs_logp_mean"] == pytest.approx(np.mean(mean_abs), abs=TOL)
    assert metrics["mismatch_seq_abs_logp_max"] == pytest.approx(np.mean(max_abs), abs=TOL)
    assert metrics["mismatch_seq_abs_log_ratio"] == pytest.approx(np.mean([abs(sum(d)) for d in deltas]), abs=TOL)
    assert metrics["mismatch_abs_logp_max"] == pytest.approx(1.0, abs=TOL)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_k3_kl_of_a_log_ratio_of_100_is_finite_and_equals_the_clamped_formula(sign: float) -> None:
    """k3 = exp(δ̂) − 1 − δ̂, δ̂ = clip(logp_ref − logp, ±20): token 0 has δ = ±100 (clamped: constant, no gradient),
    token 1 δ = 0.5 (gradient β·(1 − e^0.5)/N). Zero advantages: the loss is the KL term alone."""
    beta, M = 0.1, 20.0
    batch = batch_of([[0.0, 0.0]], [[0.0, 0.0]])
    logp = jnp.full(batch.loss_mask.shape, -1.0, jnp.float32)
    logp_ref = logp.at[0, 0].add(sign * 100.0).at[0, 1].add(0.5)
    module = L.loss_module_from_config(RLOOLossConfig(kl_coef=beta, kl_estimator="k3"))
    (loss, metrics), grad = jax.value_and_grad(lambda lp: module.objective(lp, batch, logp_ref), has_aux=True)(logp)
    grad = np.asarray(grad)

    def k3_64(d: float) -> float:
        d = min(max(d, -M), M)
        return math.expm1(d) - d

    assert math.isfinite(float(loss)) and np.isfinite(grad).all()
    assert float(metrics["kl"]) == pytest.approx(float(loss) / beta, rel=1e-6)
    assert float(loss) == pytest.approx(beta * (k3_64(sign * 100.0) + k3_64(0.5)) / 2, rel=1e-6)
    assert grad[0, 0] == 0.0
    assert grad[0, 1] == pytest.approx(beta * (1 - math.exp(0.5)) / 2, rel=1e-5)
    raw = float(L.kl_k3(jnp.float32(0.0), jnp.float32(100.0)))
    assert raw == pytest.approx(k3_64(100.0), rel=1e-6)


def test_correction_options_are_validated_and_parsed() -> None:
    with pytest.raises(ConfigError, match=r"loss\.tis_level"):
        RLOOLossConfig(tis_level="sequence")  # needs tis_cap
    with pytest.raises(ConfigError, match=r"loss\.tis_level"):
        RLOOLossConfig(tis_cap=2.0, tis_level="segment")
    with pytest.raises(ConfigError, match=r"loss\.mis_level"):
        RLOOLossConfig(mis_level="geometric")
    with pytest.raises(ConfigError, match=r"loss\.mis_low"):
        RLOOLossConfig(mis_level="token", mis_low=1.5)
    with pytest.raises(ConfigError, match=r"loss\.mis_high"):
        RLOOLossConfig(mis_level="token", mis_high=0.9)
    import draccus

    args = ["--loss.type", "rloo", "--loss.mis_level", "sequence", "--loss.mis_high", "3", "--loss.tis_cap", "2"]
    cfg = draccus.parse(LearnerStepConfig, args=[*args, "--loss.tis_level", "sequence"]).loss
    assert isinstance(cfg, RLOOLossConfig)
    assert (cfg.mis_level, cfg.mis_high, cfg.tis_level) == ("sequence", 3.0, "sequence")
    assert RLOOLossConfig().mis_level is None and RLOOLossConfig().tis_level == "token"


# ---------------------------------------------------------------------------------------------
# rollout correction on ppo, gspo and cispo: the same options, each loss's own semantics
# ---------------------------------------------------------------------------------------------


def test_ppo_token_tis_weighs_each_token_by_its_capped_ratio() -> None:
    """PPO with `tis_cap`: the clip is to the learner itself (r' = 1, one update), so ∂/∂logp_t = −min(e^δ_t, C)·A_t/n
    and the loss is its negative sum (exp(0.9) ≈ 2.46 is capped at 2)."""
    deltas, advs = [[0.3, -1.0, 0.9], [0.1, 0.2]], [[1.0, -1.0, 1.0], [-0.5, 0.5]]
    batch = batch_of(deltas, advs)
    loss, grad, metrics = loss_and_grad(PPOClipLossConfig(tis_cap=2.0), batch)
    n = 5
    w = [[min(math.exp(x), 2.0) for x in d] for d in deltas]
    assert loss == pytest.approx(-sum(w[i][t] * advs[i][t] for i in range(2) for t in range(len(deltas[i]))) / n)
    for i, d in enumerate(deltas):
        np.testing.assert_allclose(grad[i, : len(d)], [-w[i][t] * advs[i][t] / n for t in range(len(d))], atol=TOL)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["tis_weight_mean"] == pytest.approx(sum(map(sum, w)) / n, abs=TOL)


def test_ppo_sequence_masked_is_drops_whole_responses() -> None:
    """Symmetric ε = 0.2 PPO clip to the sampler over the responses whose exp(Σδ) ∈ [0.5, 2]: row 1 (exp(0.9)) out."""
    deltas, advs = [[0.3, -1.0, 0.9], [0.5, 0.4], [-0.2]], [[1.0] * 3, [1.0] * 2, [-1.0]]
    loss, grad, metrics = loss_and_grad(PPOClipLossConfig(mis_level="sequence"), batch_of(deltas, advs))
    kept = [i for i, d in enumerate(deltas) if 0.5 <= math.exp(sum(d)) <= 2.0]
    assert kept == [0, 2]
    n = sum(len(deltas[i]) for i in kept)
    ref_loss, ref_grad = 0.0, np.zeros(grad.shape)
    for i in kept:
        for t, x in enumerate(deltas[i]):
            s, g = clipped64(math.exp(x), advs[i][t], 0.2, 0.2)
            ref_loss -= s / n
            ref_grad[i, t] = -g / n
    assert loss == pytest.approx(ref_loss, abs=TOL)
    np.testing.assert_allclose(grad, ref_grad, atol=TOL)
    assert metrics["kept_sequences"] == 2 and metrics["kept_tokens"] == n


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gspo_tis_weighs_each_response_by_its_capped_ratio(level: str) -> None:
    """GSPO with `tis_cap`: s_i = (π_θ/π_old)^{1/|y_i|} = 1 (one update, unclipped), weight ρ_i capped at C with
    ρ_i = exp(mean δ) ('token': GSPO's length-normalised ratio) or exp(Σ δ) ('sequence'). L = −(1/N) Σ w_i·A_i,
    ∂L/∂logp_t = −w_i·A_i/(N·|y_i|) (∂s_i/∂logp_t = s_i/|y_i|)."""
    deltas, advs = [[0.3, 0.2, 0.9], [-0.4, 0.2], [0.05]], [1.0, -0.5, 2.0]
    batch = batch_of(deltas, [[a] * len(d) for a, d in zip(advs, deltas, strict=True)])
    loss, grad, metrics = loss_and_grad(GSPOLossConfig(tis_cap=1.5, tis_level=level), batch)
    agg = np.mean if level == "token" else np.sum
    w = [min(math.exp(float(agg(np.asarray(d, np.float64)))), 1.5) for d in deltas]
    N = len(deltas)
    assert w[0] == 1.5 and w[1] < 1.0  # the cap acts on row 0 at both levels
    assert loss == pytest.approx(-sum(w[i] * advs[i] for i in range(N)) / N, abs=TOL)
    for i, d in enumerate(deltas):
        np.testing.assert_allclose(grad[i, : len(d)], -w[i] * advs[i] / (N * len(d)), atol=TOL)
    assert metrics["tis_weight_mean"] == pytest.approx(sum(w) / N, abs=TOL)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=TOL)


def test_gspo_token_masked_is_takes_the_sequence_ratio_over_the_kept_tokens() -> None:
    """Token rejection [0.5, 2] keeps row 0's first token only (δ = 0.3) and both of row 1's; s_i = exp(mean of the
    kept δ), clipped per sequence (ε = 3e-4, 4e-4), mean over the 2 responses; ∂/∂logp_t = −g_i/(k_i·N)."""
    deltas, advs = [[0.3, -1.0, 0.9], [0.1, 0.2]], [-1.0, 1.0]
    batch = batch_of(deltas, [[a] * len(d) for a, d in zip(advs, deltas, strict=True)])
    loss, grad, metrics = loss_and_grad(GSPOLossConfig(mis_level="token"), batch)
    keep = [[abs(x) <= math.log(2.0) for x in d] for d in deltas]
    ref_loss, ref_grad = 0.0, np.zeros(grad.shape)
    for i, d in enumerate(deltas):
        kept = [x for x, k in zip(d, keep[i], strict=True) if k]
        s, g = clipped64(math.exp(sum(kept) / len(kept)), advs[i], 3e-4, 4e-4)
        ref_loss -= s / 2
        for t, k in enumerate(keep[i]):
            ref_grad[i, t] = -g / len(kept) / 2 if k else 0.0
    assert ref_grad[0, 0] != 0.0 and ref_grad[1, 0] == 0.0  # row 0 unclipped (A < 0), row 1 clipped (A > 0)
    assert loss == pytest.approx(ref_loss, abs=TOL)
    np.testing.assert_allclose(grad, ref_grad, atol=TOL)
    assert metrics["kept_tokens"] == 3 and metrics["kept_sequences"] == 2


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_tis_multiplies_the_clipped_weight_by_the_capped_ratio(level: str) -> None:
    """CISPO with `tis_cap`: the clipped weight's ratio is to the learner itself (1, one update), times the TIS
    weight min(e^δ_t, C) ('token') or min(e^{Σδ}, C) ('sequence'): L = −Σ w_t·A_t·logp_t / n, ∂/∂logp_t = −w_t·A_t/n."""
    deltas, advs = [[0.3, -1.0, 0.9], [0.1, 0.2]], [[1.0, -1.0, 1.0], [-0.5, 0.5]]
    loss, grad, metrics = loss_and_grad(CISPOLossConfig(tis_cap=2.0, tis_level=level), batch_of(deltas, advs))
    n = 5
    if level == "token":
        w = [[min(math.exp(x), 2.0) for x in d] for d in deltas]
    else:
        w = [[min(math.exp(sum(d)), 2.0)] * len(d) for d in deltas]
    assert loss == pytest.approx(sum(w[i][t] * advs[i][t] for i in range(2) for t in range(len(deltas[i]))) / n)
    for i, d in enumerate(deltas):
        np.testing.assert_allclose(grad[i, : len(d)], [-w[i][t] * advs[i][t] / n for t in range(len(d))], atol=TOL)
    assert metrics["is_weight_mean"] == pytest.approx(sum(map(sum, w)) / n, abs=TOL)


def test_cispo_sequence_masked_is_drops_whole_responses() -> None:
    """CISPO's weight min(e^δ, 1 + 0.28) (no lower bound) on the responses with exp(Σδ) ∈ [0.5, 2]; row 1 out."""
    deltas, advs = [[0.3, -1.0, 0.9], [0.5, 0.4], [-0.2]], [[1.0, 1.0, -1.0], [1.0] * 2, [-1.0]]
    loss, grad, metrics = loss_and_grad(CISPOLossConfig(mis_level="sequence"), batch_of(deltas, advs))
    kept = [0, 2]
    n = sum(len(deltas[i]) for i in kept)
    ref_loss, ref_grad = 0.0, np.zeros(grad.shape)
    for i in kept:
        for t, x in enumerate(deltas[i]):
            w = min(math.exp(x), 1.28)
            ref_loss -= w * advs[i][t] * -1.0 / n
            ref_grad[i, t] = -w * advs[i][t] / n
    assert loss == pytest.approx(ref_loss, abs=TOL)
    np.testing.assert_allclose(grad, ref_grad, atol=TOL)
    assert metrics["kept_sequences"] == 2 and metrics["mis_masked_seq_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("cls", [PPOClipLossConfig, GSPOLossConfig, CISPOLossConfig])
def test_correction_options_of_every_loss_type_are_validated_and_parsed(cls: type) -> None:
    with pytest.raises(ConfigError, match=r"loss\.tis_level"):
        cls(tis_level="sequence")  # needs tis_cap
    with pytest.raises(ConfigError, match=r"loss\.mis_high"):
        cls(mis_level="token", mis_high=0.9)
    import draccus

    name = LossConfig.get_choice_name(cls)
    args = ["--loss.type", name, "--loss.tis_cap", "3", "--loss.tis_level", "sequence", "--loss.mis_level", "token"]
    cfg = draccus.parse(LearnerStepConfig, args=args).loss
    assert isinstance(cfg, cls)
    module = L.loss_module_from_config(cfg)
    assert (module.tis_cap, module.tis_level, module.mis_level) == (3.0, "sequence", "token")  # type: ignore[attr-defined]
