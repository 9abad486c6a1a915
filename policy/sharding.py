"""The learner's train step on a device mesh, with gradient accumulation over microbatches.

One batch slot of B rows is split into n = B / microbatch_size microbatches; microbatch i holds rows
i, i+n, i+2n, … (strided, so that each device's contiguous share of rows splits evenly and no row moves
between devices). The gradient of the slot's loss is the sum over microbatches of the gradient of

    loss_i · w_i / Σ_j w_j,

where loss_i is the loss module's objective on microbatch i and w_i its aggregation weight: the number of
loss tokens for token-level aggregation, the number of sequences with loss tokens for sequence-level (and
GSPO). Each aggregated term is a mean with that denominator, so the weighted sum equals the objective of the
whole slot (up to floating-point summation order). Metrics are combined the same way, counts summed.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import optax

from policy import lora
from policy.losses import Batch, RLLossModule
from policy.losses.modules import GSPOLoss
from policy.mesh import LearnerMesh
from policy.update_guard import guarded_update

SUMMED_METRICS = ("loss_tokens", "clamped_count")
"""Metrics that are counts over the slot (summed over microbatches, not averaged)."""


def aggregation_weight(module: RLLossModule, batch: Batch) -> jax.Array:
    """The denominator of `module`'s aggregation on `batch`: loss tokens, or sequences with loss tokens."""
    mask = batch["loss_mask"].astype(jnp.float32)
    if getattr(module, "overlong_filter", False):
        mask = mask * (1.0 - batch["truncated"].astype(jnp.float32))
    if isinstance(module, GSPOLoss) or module.config.aggregation == "sequence":
        seq = batch["seq_index"].reshape(-1)
        counts = jax.ops.segment_sum(mask.reshape(-1), seq, num_segments=seq.size + 1)
        return jnp.sum((counts[:-1] > 0).astype(jnp.float32))
    return jnp.sum(mask)


def microbatch(batch: Batch, i: jax.Array | int, n: int) -> Batch:
    """Rows i, i+n, i+2n, … of `batch`, with `seq_index` renumbered for the smaller shape (padding = mb·S)."""
    B, S = batch["tokens"].shape
    mb = B // n
    out = {k: v.reshape(mb, n, *v.shape[1:])[:, i] for k, v in batch.items()}
    seg = out["segment_ids"]
    rows = jnp.arange(mb, dtype=jnp.int32)[:, None]
    out["seq_index"] = jnp.where(seg >= 0, rows * S + seg, mb * S).astype(jnp.int32)
    return out


def make_mesh_train_step(
    loss_module: RLLossModule,
    optimizer: optax.GradientTransformation,
    logprob_fn: Any,
    lm: LearnerMesh,
    num_microbatches: int,
) -> Any:
    """A jitted `(model, opt_state, reference, batch) -> (model, opt_state, metrics)` on mesh `lm`.

    Parameters and optimizer state keep the parameter mapping (FSDP / tensor parallel) in and out; a loraized
    model has only its adapters differentiated and updated (`policy.lora.split_trainable`); with
    `num_microbatches` > 1 gradients are accumulated as the module docstring states. A non-finite loss or
    gradient norm skips the update (`policy.update_guard`)."""
    loss_fn = loss_module.create_loss_fn(None, logprob_fn)
    grad_fn = eqx.filter_value_and_grad(lora.on_trainable(loss_fn), has_aux=True)  # a LoRA base gets no gradient
    n = num_microbatches

    def accumulate(model: Any, frozen: Any, reference: Any, batch: Batch) -> tuple[jax.Array, Any, dict[str, Any]]:
        if n == 1:
            (loss, metrics), grads = grad_fn(model, frozen, reference, batch)
            return loss, grads, metrics
        pieces = [microbatch(batch, i, n) for i in range(n)]
        weights = jnp.stack([aggregation_weight(loss_module, p) for p in pieces])
        shares = weights / jnp.maximum(jnp.sum(weights), 1.0)
        params = eqx.filter(model, eqx.is_array)
        grads = jax.tree.map(jnp.zeros_like, params)
        loss, metrics = jnp.zeros((), jnp.float32), {}
        for i, piece in enumerate(pieces):  # unrolled: n is small and static; scan would add a stacked copy
            (loss_i, m_i), g_i = grad_fn(model, frozen, reference, piece)
            grads = jax.tree.map(lambda a, g, s=shares[i]: a + g * s, grads, g_i)
            loss = loss + loss_i * shares[i]
            for k, v in m_i.items():
                metrics[k] = metrics.get(k, 0.0) + (v if k in SUMMED_METRICS else v * shares[i])
        return loss, grads, metrics

    def train_step(model: Any, opt_state: Any, reference: Any, batch: Batch) -> tuple[Any, Any, dict[str, Any]]:
        with hax.axis_mapping(lm.compute_mapping):
            trainable, frozen = lora.split_trainable(model)
            loss, grads, metrics = accumulate(trainable, frozen, reference, batch)
            grads = hax.shard(grads, lm.param_mapping)
            trainable, opt_state, guard_metrics = guarded_update(optimizer, trainable, opt_state, grads, loss)
            model = lora.join_trainable(trainable, frozen)
        metrics["loss"] = loss
        return model, opt_state, {**metrics, **guard_metrics}

    jitted = hax.named_jit(train_step, axis_resources=lm.param_mapping, out_axis_resources=lm.param_mapping)

    def step_on_mesh(model: Any, opt_state: Any, reference: Any, batch: Batch) -> tuple[Any, Any, dict[str, Any]]:
        with lm.active():
            return jitted(model, opt_state, reference, batch)  # type: ignore[no-any-return]

    return step_on_mesh
