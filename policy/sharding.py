"""The learner's train step on a device mesh, with gradient accumulation over microbatches.

One batch slot of B rows is split into n = B / microbatch_size microbatches; microbatch i holds rows
i, i+n, i+2n, … (strided, so that each device's contiguous share of rows splits evenly and no row moves
between devices). The gradient of the slot's loss is the sum over microbatches of the gradient of

    loss_i · w_i / Σ_j w_j,

where loss_i is the loss module's objective on microbatch i and w_i its aggregation weight: the number of
loss tokens for token-level aggregation, the number of sequences with loss tokens for sequence-level (and
GSPO); with masked IS (`loss.mis_level`) the tokens / sequences it kept. w_i is read from microbatch i's own
count metrics (`policy.losses.microbatch_metrics.loss_weight`), since a rejection depends on the learner's
logprobs. Each aggregated term is a mean with that denominator, so the weighted sum equals the objective of the
whole slot (up to floating-point summation order). Every metric is combined with its own denominator (token
means by loss tokens, sequence means by sequences, counts summed, maxima maximised:
`policy.losses.microbatch_metrics.combine_microbatch_metrics`), so the slot's metrics do not depend on the
microbatch size.

Several optimizer updates per slot (`train.minibatches_per_slot` = k, `train.ppo_epochs` = E): the slot's rows
are split into k minibatches the same strided way (minibatch j: rows j, j+k, …), and the slot step makes E
passes over them, one optimizer update per minibatch (each accumulated over its own microbatches). The
importance ratio stays to the pre-update policy of the slot: the sampler's logprobs, or with `loss.tis_cap` the
learner's logprobs computed once before the slot's first update (`old_logprobs`); critic PPO's V_old, returns
and advantages are likewise computed once before it (`CriticPPOLoss.slot_targets`). The slot's metrics are the
means over its E·k updates; counts (`SUMMED_METRICS`) are per pass over the slot; `skipped_nonfinite` counts
the updates skipped; `optimizer_updates` = E·k.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from haliax.jax_utils import Static
from haliax.partitioning import infer_resource_partitions
from haliax.tree_util import hashable_combine, hashable_partition
from jax.sharding import NamedSharding, PartitionSpec

from policy import lora
from policy.losses import Batch, RLLossModule
from policy.losses.microbatch_metrics import combine_microbatch_metrics, loss_weight
from policy.losses.modules import GSPOLoss
from policy.mesh import LearnerMesh
from policy.update_guard import guarded_update

SUMMED_METRICS = ("loss_tokens", "loss_sequences", "kept_tokens", "kept_sequences", "clamped_count")
"""Metrics that are counts over the slot (summed over microbatches, not averaged)."""


def aggregation_weight(module: RLLossModule, batch: Batch) -> jax.Array:
    """The denominator of `module`'s aggregation on `batch`: loss tokens, or sequences with loss tokens."""
    mask = batch.loss_mask.astype(jnp.float32)
    if getattr(module, "overlong_filter", False):
        mask = mask * (1.0 - batch.truncated.astype(jnp.float32))
    if isinstance(module, GSPOLoss) or module.config.aggregation == "sequence":
        seq = batch.seq_index.reshape(-1)
        counts = jax.ops.segment_sum(mask.reshape(-1), seq, num_segments=seq.size + 1)
        return jnp.sum((counts[:-1] > 0).astype(jnp.float32))
    return jnp.sum(mask)


def microbatch(batch: Batch, i: jax.Array | int, n: int) -> Batch:
    """Rows i, i+n, i+2n, … of `batch`, with `seq_index` renumbered for the smaller shape (padding = mb·S)."""
    B, S = batch.tokens.shape
    mb = B // n
    out: Batch = jax.tree.map(lambda v: v.reshape(mb, n, *v.shape[1:])[:, i], batch)
    rows = jnp.arange(mb, dtype=jnp.int32)[:, None]
    seq_index = jnp.where(out.segment_ids >= 0, rows * S + out.segment_ids, mb * S).astype(jnp.int32)
    return dataclasses.replace(out, seq_index=seq_index)


def accumulate(
    grad_fn: Any, loss_module: RLLossModule, model: Any, reference: Any, batch: Batch, n: int
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """(loss, grads, metrics) of `batch` through `grad_fn` in `n` strided microbatches, weighted as the module
    docstring states (exactly one pass when n == 1)."""
    if n == 1:
        (loss, metrics), grads = grad_fn(model, reference, batch)
        return loss, grads, metrics
    pieces = [microbatch(batch, i, n) for i in range(n)]
    params = eqx.filter(model, eqx.is_array)
    grads = jax.tree.map(jnp.zeros_like, params)
    loss, total, per_piece = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), []
    for piece in pieces:  # unrolled: n is small and static; scan would add a stacked copy
        (loss_i, m_i), g_i = grad_fn(model, reference, piece)
        w_i = jax.lax.stop_gradient(loss_weight(loss_module, m_i))
        grads = jax.tree.map(lambda a, g, w=w_i: a + g * w, grads, g_i)
        loss, total = loss + loss_i * w_i, total + w_i
        per_piece.append(m_i)
    scale = 1.0 / jnp.maximum(total, 1.0)
    grads = jax.tree.map(lambda g: g * scale, grads)
    return loss * scale, grads, combine_microbatch_metrics(loss_module, per_piece)


def pre_update_logprobs(logprob_fn: Any, model: Any, batch: Batch, n: int) -> jax.Array:
    """[B, S] logprobs of `batch` under `model`, no gradient, computed in `n` strided pieces (as microbatches)."""
    if n == 1:
        return jax.lax.stop_gradient(logprob_fn(model, batch)[0])
    B, S = batch.tokens.shape
    pieces = [jax.lax.stop_gradient(logprob_fn(model, microbatch(batch, i, n))[0]) for i in range(n)]
    return jnp.stack(pieces, axis=1).reshape(B, S)  # row r of piece i is slot row r·n + i


def pre_update_values(logprob_fn: Any, model: Any, batch: Batch, n: int) -> jax.Array:
    """[B, S] critic values of `batch` under `model` (a `PolicyWithValue`; `logprob_fn.values_fn`), no gradient,
    computed in `n` strided pieces (as `pre_update_logprobs`)."""
    return pre_update_logprobs(lambda m, b: logprob_fn.values_fn(m, b)[2:], model, batch, n)


def combine_update_metrics(per_update: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
    """The slot's metrics from its updates' (see the module docstring)."""
    if len(per_update) == 1:
        return per_update[0]
    out: dict[str, Any] = {}
    for k in per_update[0]:
        total = sum(m[k] for m in per_update)
        if k == "skipped_nonfinite":
            out[k] = total
        elif k in SUMMED_METRICS:
            out[k] = total / epochs
        else:
            out[k] = total / len(per_update)
    out["optimizer_updates"] = float(len(per_update))
    return out


def jit_on_mesh(fn: Any, lm: LearnerMesh, out_shardings: Any, donate_args: tuple[bool, ...] = ()) -> Any:
    """`fn` jitted on `lm`'s mesh under its parameter mapping, as `haliax.named_jit(fn, axis_resources=
    lm.param_mapping)` promises, with the output placed by `out_shardings(*args)` (a pytree prefix of the
    output). `fn` is traced once per signature: named_jit traces it a second time (`eval_shape`) to learn the
    output's shardings, a third of a learner's start-up CPU on the tiny models. Arguments and results may mix
    arrays with static leaves (equinox modules); `donate_args[i]` donates argument i's buffers."""
    programs: dict[Any, Any] = {}

    def run(donated: Any, kept: Any, static: Static) -> Any:
        out = fn(*hashable_combine(eqx.combine(donated, kept), static.value))
        out_dynamic, out_static = hashable_partition(out, eqx.is_array)
        return out_dynamic, Static(out_static)

    def call(*args: Any) -> Any:
        dynamic, static = hashable_partition(args, eqx.is_array)
        flags = tuple(donate_args) + (False,) * (len(args) - len(donate_args))
        donated, kept = eqx.partition(dynamic, flags)
        with hax.axis_mapping(lm.param_mapping):
            program = programs.get(static)
            if program is None:
                shardings = (out_shardings(*args), None)  # None: the output's static part
                program = programs[static] = jax.jit(run, donate_argnums=0, static_argnums=2, out_shardings=shardings)
            out_dynamic, out_static = program(donated, kept, Static(static))
        return hashable_combine(out_dynamic, out_static.value)

    return call


def param_shardings(tree: Any, lm: LearnerMesh) -> Any:
    """The shardings `lm`'s parameter mapping gives the arrays of `tree` (a model or an optimizer state)."""
    return infer_resource_partitions(tree, lm.param_mapping, preserve_existing_shardings=False, mesh=lm.mesh)


def make_mesh_train_step(
    loss_module: RLLossModule,
    optimizer: optax.GradientTransformation,
    logprob_fn: Any,
    lm: LearnerMesh,
    num_microbatches: int,
    minibatches: int = 1,
    epochs: int = 1,
) -> Any:
    """A `(model, opt_state, reference, batch) -> (model, opt_state, metrics)` on mesh `lm`: one batch slot.

    Parameters and optimizer state keep the parameter mapping (FSDP / tensor parallel) in and out; the slot
    makes `epochs` × `minibatches` optimizer updates, each over `num_microbatches` accumulated microbatches of
    its minibatch (module docstring); a loraized model has only its adapters differentiated and updated
    (`policy.lora.split_trainable`). A non-finite loss or gradient norm skips that update (`policy.update_guard`).
    The `opt_state` passed in is consumed (its buffers are donated to the result): use only the returned one."""
    loss_fn = loss_module.create_loss_fn(None, logprob_fn)
    grad_fn = eqx.filter_value_and_grad(lora.on_trainable(loss_fn), has_aux=True)  # a LoRA base gets no gradient
    n, k = num_microbatches, minibatches
    # the decoupled ratio of TIS needs the slot's pre-update learner logprobs once the policy moves within it
    needs_old = epochs * k > 1 and getattr(loss_module, "uses_old_logprobs", False)
    # critic PPO: V_old, and the GAE targets from it, fixed at the slot's first update (value clip to V_old)
    needs_old_values = epochs * k > 1 and getattr(loss_module, "needs_value_head", False)

    def update(model: Any, opt_state: Any, reference: Any, batch: Batch, j: jax.Array) -> tuple[Any, Any, Any]:
        with hax.axis_mapping(lm.compute_mapping):
            piece = batch if k == 1 else microbatch(batch, j, k)
            trainable, frozen = lora.split_trainable(model)

            def trainable_grad_fn(t: Any, r: Any, b: Batch) -> Any:
                return grad_fn(t, frozen, r, b)

            loss, grads, metrics = accumulate(trainable_grad_fn, loss_module, trainable, reference, piece, n)
            grads = hax.shard(grads, lm.param_mapping)
            trainable, opt_state, guard_metrics = guarded_update(optimizer, trainable, opt_state, grads, loss)
            model = lora.join_trainable(trainable, frozen)
        metrics["loss"] = loss
        return model, opt_state, {**metrics, **guard_metrics}

    def old_logprobs(model: Any, batch: Batch) -> jax.Array:
        with hax.axis_mapping(lm.compute_mapping):
            return pre_update_logprobs(logprob_fn, model, batch, n * k)

    # the optimizer state is donated: its buffers become the new state's (at 1.5B parameters, 12 GB of Adam
    # moments not held twice). The model is not: a policy publish may still be reading it on another thread.
    replicated = NamedSharding(lm.mesh, PartitionSpec())
    jitted = jit_on_mesh(
        update,
        lm,
        lambda model, opt_state, *_: (param_shardings(model, lm), param_shardings(opt_state, lm), replicated),
        donate_args=(False, True, False, False, False),
    )

    def slot_targets(model: Any, batch: Batch) -> dict[str, jax.Array]:
        with hax.axis_mapping(lm.compute_mapping):
            old_values = pre_update_values(logprob_fn, model, batch, n * k)
            return loss_module.slot_targets(batch, old_values)  # type: ignore[attr-defined]

    jitted_old = jit_on_mesh(old_logprobs, lm, lambda *_: replicated)
    jitted_targets = jit_on_mesh(slot_targets, lm, lambda *_: replicated)

    def step_on_mesh(model: Any, opt_state: Any, reference: Any, batch: Batch) -> tuple[Any, Any, dict[str, Any]]:
        with lm.active():
            if needs_old:
                batch = dataclasses.replace(batch, old_logprobs=jitted_old(model, batch))
            if needs_old_values:
                batch = dataclasses.replace(batch, **jitted_targets(model, batch))
            per_update = []
            for _ in range(epochs):
                for j in range(k):
                    model, opt_state, metrics = jitted(model, opt_state, reference, batch, np.int32(j))
                    per_update.append(metrics)
        return model, opt_state, combine_update_metrics(per_update, epochs)

    return step_on_mesh
