"""The learner's library: optimizer and schedule, the jitted train step, batch arrays, checkpoints, reference.

The learner's loop (`policy/learner_loop.py`, run by `steps/learn.py`) strings these together. Contracts kept here:
  - a batch slot T is named by its commit object `batches/log/step-T.json` (`data_file` names the parquet,
    verified against the entry's size and sha256 and read through `schemas.BATCH`; a file that does not match is
    quarantined and the slot rebuilt from its recorded inputs: `pipeline.batch_maker.rebuild`); a batch whose row
    count, seq_len, tokenizer or token ids do not fit the run is refused with `BatchMismatchError` naming the file
    and the field;
  - a checkpoint `checkpoints/step-S/` holds model + optimizer state (sharded safetensors, one file per learner
    process) and a COMMITTED marker written last by process 0, recording the batch slot consumed, the
    checkpoint resumed from and the slots trained since (written and read by `policy.policy_format`);
  - the train step is a pure function of (model, optimizer state, reference, batch): no wall clock or host RNG
    reaches the math, so replaying batches S+1..S+k from checkpoint S gives bitwise-identical parameters on CPU.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

import schemas
from pipeline.batch_maker.rebuild import verified_batch
from pipeline.config import LearnerStepConfig, OptimizerSpec, TrainParams
from pipeline.store import layout
from pipeline.store.notify import waker_for
from pipeline.store.poll import poll_until
from pipeline.store.storage import RunStore
from policy import lora
from policy import mesh as mesh_lib
from policy import model as M
from policy import policy_format as pf
from policy import value_head as VH
from policy.attention import fused_attention
from policy.losses import Batch, RLLossModule, loss_module_from_config
from policy.losses.modules import frozen_models
from policy.policy_format import LearnerState
from policy.teacher import load_teacher
from policy.update_guard import guarded_update
from schemas.records import BatchLogEntry

logger = logging.getLogger("policy.learner")


class BatchMismatchError(ValueError):
    """A committed batch does not fit this run (schema, shape, tokenizer); the message names file and field."""


# ---------------------------------------------------------------------------------------------
# optimizer and the train step
# ---------------------------------------------------------------------------------------------


def learning_rate_schedule(spec: OptimizerSpec, num_train_steps: int, updates_per_slot: int = 1) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then cosine decay to `min_lr_ratio · lr` at num_train_steps.

    Counted in learner steps (batch slots): with `updates_per_slot` optimizer updates per slot, update u runs at
    the rate of step u // updates_per_slot, so every update of one slot has the same rate."""
    if updates_per_slot > 1:
        per_slot = learning_rate_schedule(spec, num_train_steps)
        return lambda count: per_slot(count // updates_per_slot)
    decay_steps = max(num_train_steps - spec.warmup_steps, 1)
    if not spec.warmup_steps:  # the same values; optax logs a note at every build of a zero-length warmup
        return optax.cosine_decay_schedule(spec.learning_rate, decay_steps, alpha=spec.min_lr_ratio)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if spec.warmup_steps else spec.learning_rate,
        peak_value=spec.learning_rate,
        warmup_steps=spec.warmup_steps,
        decay_steps=decay_steps + spec.warmup_steps,
        end_value=spec.learning_rate * spec.min_lr_ratio,
    )


@functools.lru_cache(maxsize=8)
def _jitted_schedule(spec: OptimizerSpec, num_train_steps: int) -> Callable[[int], jax.Array]:
    return jax.jit(learning_rate_schedule(spec, num_train_steps))


def learning_rate_at(spec: OptimizerSpec, num_train_steps: int, step: int) -> float:
    """The rate `learning_rate_schedule(spec, num_train_steps)` gives learner step `step` (0-based), for metrics."""
    # one compiled program per schedule, where calling the schedule eagerly compiles one per operation
    return float(_jitted_schedule(spec, num_train_steps)(step))


def build_optimizer(
    spec: OptimizerSpec, num_train_steps: int, updates_per_slot: int = 1
) -> optax.GradientTransformation:
    """Global-norm clipping (if `max_grad_norm`) then AdamW on every parameter, the rate per slot (see
    `learning_rate_schedule`); Adam's moment and bias-correction counts advance once per update."""
    parts = []
    if spec.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(spec.max_grad_norm))
    parts.append(
        optax.adamw(
            learning_rate_schedule(spec, num_train_steps, updates_per_slot),
            b1=spec.beta1,
            b2=spec.beta2,
            eps=spec.epsilon,
            weight_decay=spec.weight_decay,
        )
    )
    return optax.chain(*parts)


def make_logprob_fn(compute_dtype: str, block_size: int | None = None, attention: str = "default") -> Any:
    """(model, batch) -> (logprobs, entropy) [B, S] at the batch's per-token temperatures.

    With `block_size`, computed that many vocabulary entries at a time (`policy.model.blocked_logprobs_and_entropy`).
    `attention` "cudnn": levanter's attention computed by JAX's fused attention (`policy.attention`).
    A `policy.value_head.PolicyWithValue` is scored by its policy; the function's `values_fn` attribute is the
    one-pass (logprobs, entropy, values) of such a model (`policy.value_head.logprobs_entropy_and_values`), which
    critic PPO uses."""

    def logprob_fn(model: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        with fused_attention(attention):
            return _logprobs(VH.policy_of(model), batch)

    def _logprobs(model: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        if block_size is not None:
            return M.blocked_logprobs_and_entropy(
                M.cast_for_compute(model, compute_dtype),
                batch.tokens,
                batch.segment_ids,
                batch.position_ids,
                batch.temperature,
                block_size,
            )
        logits = M.forward_logits(
            M.cast_for_compute(model, compute_dtype), batch.tokens, batch.segment_ids, batch.position_ids
        )
        return M.shifted_logprobs_and_entropy(logits, batch.tokens, batch.segment_ids, batch.temperature)

    logprob_fn.values_fn = functools.partial(  # type: ignore[attr-defined]
        VH.logprobs_entropy_and_values, compute_dtype=compute_dtype, block_size=block_size, attention=attention
    )
    return logprob_fn


def mesh_train_step(config: LearnerStepConfig, lm: mesh_lib.LearnerMesh) -> Any:
    """The train step of one batch slot on mesh `lm`: `train.ppo_epochs` × `train.minibatches_per_slot` optimizer
    updates, each accumulated over `train.microbatch_size` microbatches (`policy.sharding`)."""
    from policy.sharding import make_mesh_train_step

    train = config.train
    rows = train.batch_size // train.minibatches_per_slot
    num_microbatches = rows // (train.microbatch_size or rows)
    if (rows // num_microbatches) % lm.data_ways:
        raise BatchMismatchError(
            f"train.microbatch_size={train.microbatch_size}: rows per pass must divide over {lm.data_ways} "
            "data-parallel devices"
        )
    return make_mesh_train_step(
        loss_module_from_config(config.loss),
        build_optimizer(config.optimizer, train.num_train_steps, updates_per_slot(train)),
        make_logprob_fn(config.model.compute_dtype, config.model.logprob_block_size, config.model.attention_backend),
        lm,
        num_microbatches,
        train.minibatches_per_slot,
        train.ppo_epochs,
    )


def updates_per_slot(train: TrainParams) -> int:
    """Optimizer updates per batch slot (learner step): ppo_epochs × minibatches_per_slot."""
    return train.ppo_epochs * train.minibatches_per_slot


def make_train_step(loss_module: RLLossModule, optimizer: optax.GradientTransformation, compute_dtype: str) -> Any:
    """A jitted `(model, opt_state, reference, batch) -> (model, opt_state, metrics)`, compiled once per shape.

    A step whose loss or gradient norm is not finite leaves model and optimizer state unchanged and reports
    `skipped_nonfinite: 1` (see `policy.update_guard.guarded_update`)."""
    loss_fn = lora.on_trainable(loss_module.create_loss_fn(None, make_logprob_fn(compute_dtype)))

    @eqx.filter_jit
    def train_step(model: Any, opt_state: Any, reference: Any, batch: Batch) -> tuple[Any, Any, dict[str, Any]]:
        trainable, frozen = lora.split_trainable(model)  # a loraized model: only its adapters are trained
        (loss, metrics), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(trainable, frozen, reference, batch)
        trainable, opt_state, guard_metrics = guarded_update(optimizer, trainable, opt_state, grads, loss)
        return lora.join_trainable(trainable, frozen), opt_state, {**metrics, **guard_metrics}

    return train_step


# ---------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------


def wait_for_batch(
    store: RunStore, slot: int, timeout_s: float, poll_s: float, on_wait: Callable[[], None] | None = None
) -> tuple[BatchLogEntry | None, float]:
    """The commit object of batch `slot` and the seconds waited; (None, waited) if control/STOP appeared.
    `on_wait` runs between checks and may raise to end the wait (a failed policy publish).

    Raises `pipeline.store.poll.WaitTimeout` naming the log entry and `cadence.batch_wait_timeout_s` when nothing
    appears within `timeout_s`, and `pipeline.store.committed.DamagedRecordError` (a DamagedInputError naming the
    file and field: exit code 7) when the entry is not a valid `BatchLogEntry`.
    """
    entry = layout.batch_log_entry(slot)

    def found() -> tuple[str, BatchLogEntry | None] | None:
        if store.exists(entry):
            return "batch", store.read_log_entry(slot)
        if store.exists(layout.STOP_FILE):
            return "stop", None
        return None

    (_, value), waited = poll_until(
        found,
        timeout_s=timeout_s,
        interval_s=poll_s,
        what=lambda: store.full_path(entry),
        setting="cadence.batch_wait_timeout_s",
        waker=waker_for(store),
        on_wait=on_wait,
    )
    return value, waited


def batch_arrays(rows: list[schemas.BatchRow], train: TrainParams, vocab_size: int, path: str) -> Batch:
    """Fixed-shape [batch_size, seq_len] learner arrays from batch rows; BatchMismatchError on any misfit."""
    return Batch(**jax.device_put(host_batch_arrays(rows, train, vocab_size, path), may_alias=False))


def host_batch_arrays(
    rows: list[schemas.BatchRow],
    train: TrainParams,
    vocab_size: int,
    path: str,
    start: int = 0,
    stop: int | None = None,
) -> dict[str, np.ndarray]:
    """Rows [start, stop) of the slot's [batch_size, seq_len] learner arrays on the host: numpy arrays named by the
    fields of `Batch` (`seq_index` numbered over the whole slot); BatchMismatchError on any misfit."""
    if len(rows) != train.batch_size:
        raise BatchMismatchError(f"{path}: {len(rows)} rows, run expects train.batch_size={train.batch_size}")
    B, S = train.batch_size, train.seq_len
    stop = B if stop is None else stop
    n = stop - start
    out = {
        "tokens": np.zeros((n, S), np.int32),
        "segment_ids": np.full((n, S), -1, np.int32),
        "position_ids": np.zeros((n, S), np.int32),
        "loss_mask": np.zeros((n, S), np.float32),
        "advantages": np.zeros((n, S), np.float32),
        "generator_logprobs": np.zeros((n, S), np.float32),
        "temperature": np.ones((n, S), np.float32),
        "truncated": np.zeros((n, S), bool),
        "seq_index": np.full((n, S), B * S, np.int32),
        "token_rewards": np.zeros((n, S), np.float32),
    }
    for b in range(start, stop):
        row, r = rows[b], b - start
        if len(row.tokens) != S:
            raise BatchMismatchError(f"{path}: row {b} has {len(row.tokens)} tokens, run expects train.seq_len={S}")
        tok = np.asarray(row.tokens, np.int64)
        if tok.size and (tok.min() < 0 or tok.max() >= vocab_size):
            raise BatchMismatchError(
                f"{path}: row {b} has token id {int(tok.max())} outside the vocabulary [0, {vocab_size}) "
                "(tokenizer mismatch?)"
            )
        seg = np.asarray(row.segment_ids, np.int32)
        out["tokens"][r] = tok
        out["segment_ids"][r] = seg
        out["position_ids"][r] = row.position_ids
        out["loss_mask"][r] = row.loss_mask
        out["advantages"][r] = row.advantages
        out["generator_logprobs"][r] = row.generator_logprobs
        if row.token_rewards is not None:  # None in batch files of version 1
            out["token_rewards"][r] = row.token_rewards
        valid = seg >= 0
        temps = np.asarray(row.temperatures, np.float32)
        trunc = np.asarray(row.truncated, bool)
        out["temperature"][r, valid] = temps[seg[valid]]
        out["truncated"][r, valid] = trunc[seg[valid]]
        out["seq_index"][r, valid] = b * S + seg[valid]
    return out


def read_batch(
    store: RunStore,
    slot: int,
    entry: BatchLogEntry,
    train: TrainParams,
    vocab_size: int,
    lm: mesh_lib.LearnerMesh | None = None,
) -> tuple[Batch, str]:
    """Load and check batch `slot` named by its commit object; returns (arrays, data file).

    The data file is verified against the entry (size, sha256, rows) before anything trains on it; one that does
    not match is set aside and the batch rebuilt from its recorded inputs, or the read ends in DamagedInputError
    naming the file and what differs (`pipeline.batch_maker.rebuild.verified_batch`).
    With a mesh, this process converts only its own rows (`policy.mesh.process_rows`) and the arrays returned
    are global arrays on the mesh, rows split over its data-parallel axes."""
    if entry.seq_len != train.seq_len:
        raise BatchMismatchError(
            f"{layout.batch_log_entry(slot)}: seq_len={entry.seq_len!r}, this run has seq_len={train.seq_len!r}"
        )
    data_file = entry.data_file
    # verified against the entry's size and sha256; a damaged file is quarantined and the slot rebuilt from its
    # recorded inputs, or DamagedInputError (pipeline.batch_maker.rebuild)
    table = verified_batch(store, entry, train)
    rows = schemas.BATCH.from_table(table)
    if lm is None:
        return batch_arrays(rows, train, vocab_size, data_file), data_file
    start, stop = mesh_lib.process_rows(train.batch_size)
    local = host_batch_arrays(rows, train, vocab_size, data_file, start, stop)
    return Batch(**mesh_lib.global_batch(local, lm, train.batch_size)), data_file


# ---------------------------------------------------------------------------------------------
# checkpoints, policies, the reference model
# ---------------------------------------------------------------------------------------------


def resume_or_init(
    store: RunStore, config: LearnerStepConfig, vocab_size: int, optimizer: Any, lm: mesh_lib.LearnerMesh | None = None
) -> LearnerState:
    """The newest committed checkpoint (onto mesh `lm` if given), or a fresh model (seeded, or an HF folder).

    A committed checkpoint that fails verification on any process is skipped (by all, in process 0's order) with
    one error line, and a damaged one (`DamagedCommitError`) is quarantined with its reason (the documented recovery:
    fall back to an older intact checkpoint); if checkpoints exist but none loads, this raises (DamagedCommitError,
    exit code 7) rather than silently restarting from scratch.
    """
    errors = []
    newest: int | None = None
    for s in reversed(mesh_lib.writer_ints(pf.committed_checkpoints(store))):
        newest = s if newest is None else newest
        try:
            state: LearnerState | None = pf.read_checkpoint(
                store, s, config.model, vocab_size, optimizer, lm, value_head=VH.needs_value_head(config.loss)
            )
        except pf.CheckpointError as e:
            logger.error("checkpoint %d unusable, trying an older one: %s", s, e)
            if isinstance(e, pf.DamagedCommitError) and mesh_lib.is_writer():
                store.quarantine(layout.checkpoint_dir(s), str(e))
            errors.append(str(e))
            state = None
        if not mesh_lib.all_processes(state is not None):  # every process skips it together
            errors.append(f"checkpoint {s} unusable on some learner process")
            continue
        assert state is not None
        logger.info("resuming from checkpoint %d (next batch slot %d)", s, s + 1)
        return state
    if errors:
        assert newest is not None
        why = "no committed checkpoint loads: " + "; ".join(errors)
        raise pf.DamagedCommitError(layout.checkpoint_marker(newest), why)
    if config.model.init_policy:  # another run's committed policy (an SFT warm start: `steps.sft`)
        from pipeline.store.init_policy import resolve_init_policy

        source, step = resolve_init_policy(config.model.init_policy, config.store.storage_options)
        logger.info("no checkpoint: initialising from %s", source.full_path(layout.policy_dir(step)))
        model = M.cast_params(pf.read_policy(source, step, config.model, vocab_size), config.model.param_dtype)
    else:
        logger.info("no checkpoint: initialising %s model (seed %d)", config.model.family, config.model.seed)
        model = M.build_model(config.model, vocab_size, jax.random.PRNGKey(config.model.seed), mesh=lm)
        if config.model.param_dtype not in ("float32", "fp32"):
            model = M.cast_for_compute(model, config.model.param_dtype)
    if config.model.lora is not None:  # adapters with B = 0: the model still computes the base's outputs
        model = lora.loraize(model, config.model.lora, config.model.seed)
    if VH.needs_value_head(config.loss):  # critic PPO: a deterministic fresh value head beside the policy
        model = VH.attach(model)
    # jitted: one compiled program instead of one per distinct moment shape (the same zeros)
    opt_state = eqx.filter_jit(optimizer.init)(lora.trainable_params(model))
    return LearnerState(step=0, model=model, opt_state=opt_state, parent=None)


def shard_state(state: LearnerState, lm: mesh_lib.LearnerMesh) -> LearnerState:
    """`state` with model and optimizer state placed on mesh `lm` (any mesh: checkpoints are mesh-independent)."""
    model = mesh_lib.shard_params(state.model, lm)
    opt_state = mesh_lib.shard_params(state.opt_state, lm)
    return LearnerState(step=state.step, model=model, opt_state=opt_state, parent=state.parent)


def load_reference(store: RunStore, config: LearnerStepConfig, vocab_size: int, module: RLLossModule) -> Any:
    """The frozen models the loss reads: the reference model (policy 0, the initial weights) if the loss needs
    one, else None (never built); with `loss.distill`, `FrozenModels(reference, teacher)` holding the
    distillation teacher too (`policy.teacher`), so the train step and replay receive both the same way."""
    teacher = load_teacher(config, vocab_size) if getattr(module, "needs_teacher", False) else None
    if not module.needs_reference:
        return frozen_models(None, teacher)
    # policy 0 may be published in a lower dtype (model.publish_dtype): the reference computes in param_dtype
    policy0 = pf.read_policy(store, 0, config.model, vocab_size)
    return frozen_models(module.build(M.cast_params(policy0, config.model.param_dtype)), teacher)


def replay_slots(store: RunStore, config: LearnerStepConfig, from_step: int, to_step: int) -> LearnerState:
    """The learner state after training slots from_step+1..to_step from checkpoint `from_step` (read-only): what
    `steps.replay` compares with the run's committed policy `to_step`."""
    from pipeline.environments.tokenizer import load_tokenizer

    vocab = M.model_vocab_size(load_tokenizer(config.model.tokenizer))
    optimizer = build_optimizer(config.optimizer, config.train.num_train_steps)
    lm = mesh_lib.build_mesh(config.mesh)
    # the learner's own slot step (epochs, minibatches, microbatches) on the same mesh: bitwise the same updates
    # restored onto the mesh as the learner resumes (each process reads what its devices hold)
    # with critic PPO the checkpoint's value head too (it shapes the policy's updates through the shared trunk)
    with_head = VH.needs_value_head(config.loss)
    state = shard_state(
        pf.read_checkpoint(store, from_step, config.model, vocab, optimizer, lm, value_head=with_head), lm
    )
    reference = load_reference(store, config, vocab, loss_module_from_config(config.loss))
    if reference is not None:
        reference = mesh_lib.shard_params(reference, lm)
    train_step = mesh_train_step(config, lm)
    for slot in range(from_step + 1, to_step + 1):
        batch, data_file = read_batch(store, slot, store.read_log_entry(slot), config.train, vocab, lm)
        model, opt_state, _ = train_step(state.model, state.opt_state, reference, batch)
        state = LearnerState(slot, model, opt_state, state.parent)
        logger.info("replayed batch slot %d (%s)", slot, data_file)
    return state


def publish_policy(store: RunStore, state: LearnerState, config: LearnerStepConfig) -> None:
    """Commit policy `state.step` unless it already is (markers record the batch slot, tokenizer, seq_len).
    Every learner process must call it (`prepare_publish`, then `pf.commit_policy` on this thread)."""
    pub = prepare_publish(state, config)
    if pub is not None:
        pf.commit_policy(store, pub)


def prepare_publish(state: LearnerState, config: LearnerStepConfig) -> pf.PolicyPublish | None:
    """Policy `state.step` ready for `pf.commit_policy`; every learner process calls it in step order (collectives).

    Full weights: no gather; each process later writes the blocks it holds, on parallel threads, and process 0
    commits once every process's are durable (`policy.policy_format.sharded`). LoRA policies (the adapters, or the
    merged model and its adapters): gathered into host memory (an all-gather) and written by process 0 alone (None
    on the others)."""
    extra = {"batch_slot": state.step, "tokenizer": config.model.tokenizer, "seq_len": config.train.seq_len}
    dtype = M.publish_dtype(config.model.publish_dtype)
    if config.model.lora is None:  # the policy only: a critic's value head is never published
        return pf.prepare_policy(state.step, VH.policy_of(state.model), extra, dtype)
    model = mesh_lib.to_host(VH.policy_of(state.model))
    if not mesh_lib.is_writer():
        return None
    return pf.single_writer_policy(state.step, model, extra, dtype, config.model)
