"""Gradient accumulation over microbatches is exact: a 32-row batch slot in 4 microbatches of 8 rows gives the
loss and the gradient of the whole slot in one pass, for every loss module with the KL term on, token- and
sequence-level aggregation, TIS, and the overlong filter (some responses truncated).

Tolerance: relative, 1e-5 on the loss and on the gradient's global norm of the difference (‖g₄ₓ₈ − g₃₂‖ / ‖g₃₂‖),
float32 on CPU. Measured on the 2-core CI machine: loss ≤ 1.4e-7, gradient ≤ 8.8e-7 for every case; the wrong
normalisation (each microbatch's own mean, averaged) misses the loss by 6.6e-3, so the comparison can fail.

Every metric of the slot is the same too (relative 1e-5, absolute 1e-6 near zero), for every loss type and
aggregation mode and the rollout-correction options (sequence-level TIS, token- and sequence-level masked IS,
whose bounds here reject part of the tokens / sequences of the random models): token means weighted by loss
tokens, sequence means by sequences, counts summed, maxima maximised. Weighting token means by the loss's
per-sequence shares (the old combination) gives entropy 0.5 for a slot whose entropy is 0.75."""

from __future__ import annotations

import numpy as np
import pytest
from mesh_run_steps import VOCAB, B, S, synthetic_rows

jax = pytest.importorskip("jax")
import dataclasses  # noqa: E402

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pipeline.config import (  # noqa: E402
    CISPOLossConfig,
    GSPOLossConfig,
    LossConfig,
    ModelSpec,
    PPOClipLossConfig,
    RLOOLossConfig,
)
from policy import learner as L  # noqa: E402
from policy import model as M  # noqa: E402
from policy import sharding  # noqa: E402
from policy.losses import Batch, loss_module_from_config  # noqa: E402

RTOL = 1e-5
KL = 0.1
CONFIGS: dict[str, LossConfig] = {
    "rloo": RLOOLossConfig(kl_coef=KL),
    "rloo-sequence-tis": RLOOLossConfig(kl_coef=KL, aggregation="sequence", tis_cap=2.0, overlong_filter=True),
    "ppo": PPOClipLossConfig(kl_coef=KL, kl_estimator="k2"),
    "gspo": GSPOLossConfig(kl_coef=KL, overlong_filter=True),
    "cispo-sequence": CISPOLossConfig(kl_coef=KL, kl_estimator="k1", aggregation="sequence"),
    "cispo": CISPOLossConfig(kl_coef=KL),
    "ppo-sequence": PPOClipLossConfig(kl_coef=KL, aggregation="sequence"),
    # learner/sampler log-ratios of these random models: tokens in [-6.7, 1.4], sequences' sums in [-26, -0.1]
    "rloo-seq-tis-token-mis": RLOOLossConfig(
        kl_coef=KL, tis_cap=2.0, tis_level="sequence", mis_level="token", mis_low=0.05, mis_high=2.0
    ),
    "rloo-sequence-seq-mis": RLOOLossConfig(
        kl_coef=KL, aggregation="sequence", mis_level="sequence", mis_low=4.5e-5, overlong_filter=True
    ),
}
MTOL = 1e-6
SPEC = ModelSpec(hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=S)


@pytest.fixture(scope="module")
def models() -> tuple[object, object, Batch]:
    """(policy, reference, batch): two different tiny models, so the KL term is not zero, and a 32-row slot."""
    policy = M.build_model(SPEC, VOCAB, jax.random.PRNGKey(0))
    reference = M.build_model(SPEC, VOCAB, jax.random.PRNGKey(1))
    rows = synthetic_rows(1)
    rng = np.random.default_rng(7)
    rows["truncated"] = (rng.random((B, S)) < 0.3) & (rows["segment_ids"] >= 0)
    return policy, reference, Batch(**{k: jnp.asarray(v) for k, v in rows.items()})


_RESULTS: dict[tuple[LossConfig, int], tuple[float, list[np.ndarray], dict]] = {}
"""(config, n) -> its result on the module's models: each computed once in the module (the naive-mean test compares
against the `rloo` slot the parametrized test computed)."""

_GRAD_FNS: dict[LossConfig, tuple[object, object]] = {}
"""config -> (loss module, its jitted loss-and-gradient function): one program per config and batch shape (the
32-row slot, the 8-row microbatch), shared by every test of the module."""


def _grad_fn(cfg: LossConfig) -> tuple[object, object]:
    """(module, jitted (model, reference, batch) -> ((loss, metrics), grads)) of `cfg`, as the learner builds it."""
    if cfg not in _GRAD_FNS:
        module = loss_module_from_config(cfg)
        grad_fn = eqx.filter_value_and_grad(module.create_loss_fn(None, L.make_logprob_fn("float32")), has_aux=True)
        _GRAD_FNS[cfg] = (module, eqx.filter_jit(grad_fn))
    return _GRAD_FNS[cfg]


def _loss_and_grads(cfg: LossConfig, models: tuple, n: int) -> tuple[float, list[np.ndarray], dict]:
    """(loss, gradient leaves, metrics) of the slot in `n` microbatches through `sharding.accumulate`, each
    microbatch's loss and gradient by the config's jitted program (`sharding.accumulate` itself, the weighting and
    the metrics' combination, runs op by op; `test_accumulation_jitted_whole_is_the_same` checks it jitted whole,
    as the learner's step runs it)."""
    if (cfg, n) not in _RESULTS:
        policy, reference, batch = models
        module, grad_fn = _grad_fn(cfg)
        loss, grads, metrics = sharding.accumulate(grad_fn, module, policy, reference, batch, n)
        _RESULTS[cfg, n] = float(loss), M.numpy_params(grads), metrics
    return _RESULTS[cfg, n]


def _rel(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    diff = np.sqrt(sum(float(np.sum((x.astype(np.float64) - y) ** 2)) for x, y in zip(a, b, strict=True)))
    return diff / np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in a))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_four_microbatches_of_eight_equal_one_batch_of_32(name: str, models: tuple) -> None:
    cfg = CONFIGS[name]
    loss1, g1, m1 = _loss_and_grads(cfg, models, 1)
    loss4, g4, m4 = _loss_and_grads(cfg, models, 4)
    assert abs(float(m1["kl"])) > 1e-3, "the KL term must be on for this comparison"
    assert abs(loss4 - loss1) <= RTOL * abs(loss1), (loss1, loss4)
    rel = _rel(g1, g4)
    print(f"{name}: loss rel {abs(loss4 - loss1) / abs(loss1):.2e}, grad rel {rel:.2e}")
    assert rel <= RTOL, f"{name}: relative gradient difference {rel:.3g}"
    assert float(m4["loss_tokens"]) == float(m1["loss_tokens"])
    assert set(m4) == set(m1)
    for key in sorted(m1):
        a, b = float(m1[key]), float(m4[key])
        assert abs(a - b) <= RTOL * abs(a) + MTOL, f"{name}: metric {key}: slot {a} vs 4 microbatches {b}"
    if isinstance(cfg, RLOOLossConfig) and cfg.mis_level is not None:
        assert 0.0 < float(m1["mis_masked_fraction"]) < 1.0, "the bounds must reject part of the batch"


def test_accumulation_jitted_whole_is_the_same(models: tuple) -> None:
    """`sharding.accumulate` traced into one program with its 4 microbatches' loss-and-gradient (as the learner's
    step runs it) gives the loss, gradient and metrics of the op-by-op accumulation the test above compares."""
    cfg = CONFIGS["rloo"]
    module = loss_module_from_config(cfg)
    grad_fn = eqx.filter_value_and_grad(module.create_loss_fn(None, L.make_logprob_fn("float32")), has_aux=True)
    fn = eqx.filter_jit(lambda m, r, b: sharding.accumulate(grad_fn, module, m, r, b, 4))
    loss, grads, metrics = fn(*models)
    loss4, g4, m4 = _loss_and_grads(cfg, models, 4)
    assert abs(float(loss) - loss4) <= RTOL * abs(loss4), (float(loss), loss4)
    rel = _rel(g4, M.numpy_params(grads))
    assert rel <= RTOL, f"relative gradient difference jitted whole {rel:.3g}"
    assert set(metrics) == set(m4)
    for key in sorted(m4):
        a, b = float(m4[key]), float(metrics[key])
        assert abs(a - b) <= RTOL * abs(a) + MTOL, f"metric {key}: op by op {a} vs jitted whole {b}"


def test_per_microbatch_means_would_fail_the_tolerance(models: tuple) -> None:
    """The naive accumulation (each microbatch's own mean, averaged over microbatches) is far off: the test above
    separates the right normalisation from it."""
    cfg = CONFIGS["rloo"]
    policy, reference, batch = models
    _, grad_fn = _grad_fn(cfg)  # its loss is the loss function's: the microbatch program the test above compiled
    pieces = [sharding.microbatch(batch, i, 4) for i in range(4)]
    naive = sum(float(grad_fn(policy, reference, p)[0][0]) for p in pieces) / 4
    whole, _, _ = _loss_and_grads(cfg, models, 1)
    print(f"naive per-microbatch means: loss rel {abs(naive - whole) / abs(whole):.2e}")
    assert abs(naive - whole) > 100 * RTOL * abs(whole), (naive, whole)


def test_token_mean_metrics_are_weighted_by_tokens_not_by_the_loss_shares() -> None:
    """The issue's small case: sequence aggregation, microbatch 0 holds one 3-token response of entropy 1, microbatch
    1 one 1-token response of entropy 0. The slot's entropy is 3/4; the loss's per-sequence shares (½, ½) would give
    ½. Computed through the module's objective on the whole slot and on each row as its own microbatch."""
    from test_loss_terms import batch_of

    from policy.losses.microbatch_metrics import combine_microbatch_metrics

    module = loss_module_from_config(RLOOLossConfig(aggregation="sequence"))
    whole = batch_of([[0.0] * 3, [0.0]], [[1.0] * 3, [-1.0]])
    entropy = jnp.asarray(np.array([[1.0] * 8, [0.0] * 8], np.float32))
    logp = jnp.full(whole.loss_mask.shape, -1.0, jnp.float32)
    objective = jax.jit(lambda lp, b, e: module.objective(lp, b, None, e))  # one program per shape, not op by op
    _, slot = objective(logp, whole, entropy)
    pieces = [objective(logp[i::2], sharding.microbatch(whole, i, 2), entropy[i::2])[1] for i in range(2)]
    combined = combine_microbatch_metrics(module, pieces)
    assert float(slot["entropy"]) == pytest.approx(0.75)
    assert float(combined["entropy"]) == pytest.approx(0.75)
    assert float(combined["loss"]) == pytest.approx(float(slot["loss"]))


def _primitives(jaxpr: object) -> set[str]:
    """The names of every primitive of a (closed) jaxpr, sub-jaxprs (scan bodies, custom rules) included."""
    from jax.extend.core import jaxprs_in_params

    inner = getattr(jaxpr, "jaxpr", jaxpr)
    names: set[str] = set()
    for eqn in inner.eqns:  # type: ignore[attr-defined]
        names.add(eqn.primitive.name)
        for sub in jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def test_gradient_checkpointing_rematerialises_and_gives_the_same_loss_and_gradient(models: tuple) -> None:
    """`model.gradient_checkpointing: true`: the learner's model (the spec's levanter config, here through
    `model_template`, the structure checkpoints and policies are read into; `build_model` uses the same config)
    recomputes each block's activations in the backward pass: its loss-and-gradient program holds a remat
    (`jax.checkpoint`) the program without it does not, and the loss and gradient of the slot are the same
    (relative 1e-6; measured bitwise equal on CPU). A flag that did not reach levanter fails the first check."""
    cfg = CONFIGS["rloo"]
    policy, reference, batch = models
    remat_spec = dataclasses.replace(SPEC, gradient_checkpointing=True)
    assert M.levanter_config(remat_spec).gradient_checkpointing and not M.levanter_config(SPEC).gradient_checkpointing
    structure = jax.tree_util.tree_structure(M.model_template(remat_spec, VOCAB))
    remat_policy = jax.tree_util.tree_unflatten(structure, jax.tree_util.tree_leaves(policy))  # the same weights

    module = loss_module_from_config(cfg)
    grad_fn = eqx.filter_value_and_grad(module.create_loss_fn(None, L.make_logprob_fn("float32")), has_aux=True)

    def step(m: object, r: object, b: Batch) -> tuple:
        return sharding.accumulate(grad_fn, module, m, r, b, 1)

    def remat_ops(m: object) -> set[str]:
        names = _primitives(eqx.filter_make_jaxpr(step)(m, reference, batch)[0])
        return {n for n in names if n.startswith("remat") or n == "checkpoint"}

    assert remat_ops(policy) == set(), "the program without gradient checkpointing already rematerialises"
    assert remat_ops(remat_policy), "model.gradient_checkpointing: true gave a program without remat"

    loss, grads, _ = eqx.filter_jit(step)(remat_policy, reference, batch)
    loss1, g1, _ = _loss_and_grads(cfg, models, 1)
    g = M.numpy_params(grads)
    assert abs(float(loss) - loss1) <= 1e-6 * abs(loss1), (float(loss), loss1)
    rel = _rel(g1, g)
    print(f"remat: loss rel {abs(float(loss) - loss1) / abs(loss1):.2e}, grad rel {rel:.2e}")
    assert rel <= 1e-6, f"relative gradient difference with remat {rel:.3g}"
