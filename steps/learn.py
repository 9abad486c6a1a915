"""The learner step: turns policy S into S+1 with batch slot S+1, publishes policies and checkpoints.

Reads:  `batches/log/step-T.json` (commit object; `data_file` names the batch parquet, read through
        `schemas.BATCH`), the newest committed `checkpoints/step-S/` on restart, `policies/step-0` (the
        frozen reference model when `loss.kl_coef > 0`), `control/STOP`.
Writes: `policies/step-S/` (+ COMMITTED, then the LATEST hint) every `policy_interval` steps, at step 0 and
        at the end; `checkpoints/step-S/` (model + optimizer state as safetensors, COMMITTED last, recording
        the batch slot consumed and its lineage) every `checkpoint_interval` steps and at exit;
        `metrics/learner/…`; `control/LEARNER_DONE` once `train.num_train_steps` are trained.

Algorithm (phases of `main`):
  1. resume from the newest committed checkpoint S (weights, optimizer state, step), else initialise from
     the ModelSpec (seeded, or an HF folder) and publish policy 0;
  2. loop T = S+1, S+2, …: wait for batch slot T (fail loudly naming the file after
     `batch_wait_timeout_s`), refuse a batch whose schema version, row count, seq_len or tokenizer do not
     match, run one jitted optimizer step of the configured loss module (losses.py), log metrics, publish
     policy T / checkpoint T on their intervals;
  3. stop at `train.num_train_steps` (checkpoint, policy, LEARNER_DONE), after `max_steps` in this process
     (bounded mode; checkpoint), or when control/STOP appears (checkpoint).
The step is a pure function of (checkpoint, batches): no wall clock or host RNG reaches the math, so
replaying batches S+1..S+k from checkpoint S gives bitwise-identical parameters on CPU.

Run:
  python -m steps.learn --config_path learner.yaml          # or flags: --store.run_root runs/demo ...
  python -m steps.learn export --store.run_root runs/demo --step 12 --out /tmp/hf   # HF folder of policy 12
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import schemas
from pipeline import layout
from pipeline.config import (
    ConfigError,
    LearnerStepConfig,
    LossConfig,
    ModelSpec,
    OptimizerSpec,
    StoreConfig,
    TrackerConfig,
    TrainParams,
)
from pipeline.metrics import MetricsWriter
from pipeline.storage import RunStore
from pipeline.tokenizer import load_tokenizer
from policy import checkpoints as ckpt
from policy import model as M
from policy.losses import Batch, RLLossModule, loss_module_from_config
from policy.update_guard import guarded_update
from schemas.records import BatchLogEntry, RecordError

logger = logging.getLogger("steps.learn")

LEARNER_DONE = getattr(layout, "LEARNER_DONE", "control/LEARNER_DONE")
"""Written (create-if-absent) when the learner has trained train.num_train_steps steps."""
MODEL_BLOB = "model"
OPT_BLOB = "opt_state"


class BatchWaitTimeout(TimeoutError):
    """The next batch's commit object did not appear in time; the message names it."""


class BatchMismatchError(ValueError):
    """A committed batch does not fit this run (schema, shape, tokenizer); the message names file and field."""


# ---------------------------------------------------------------------------------------------
# optimizer and the train step
# ---------------------------------------------------------------------------------------------


def learning_rate_schedule(spec: OptimizerSpec, num_train_steps: int) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then cosine decay to `min_lr_ratio · lr` at num_train_steps."""
    decay_steps = max(num_train_steps - spec.warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if spec.warmup_steps else spec.learning_rate,
        peak_value=spec.learning_rate,
        warmup_steps=spec.warmup_steps,
        decay_steps=decay_steps + spec.warmup_steps,
        end_value=spec.learning_rate * spec.min_lr_ratio,
    )


def build_optimizer(spec: OptimizerSpec, num_train_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping (if `max_grad_norm`) then AdamW on every parameter."""
    parts = []
    if spec.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(spec.max_grad_norm))
    parts.append(
        optax.adamw(
            learning_rate_schedule(spec, num_train_steps),
            b1=spec.beta1,
            b2=spec.beta2,
            eps=spec.epsilon,
            weight_decay=spec.weight_decay,
        )
    )
    return optax.chain(*parts)


def make_logprob_fn(compute_dtype: str) -> Any:
    """(model, batch) -> (logprobs, entropy) [B, S] at the batch's per-token temperatures."""

    def logprob_fn(model: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        logits = M.forward_logits(
            M.cast_for_compute(model, compute_dtype), batch["tokens"], batch["segment_ids"], batch["position_ids"]
        )
        return M.shifted_logprobs_and_entropy(logits, batch["tokens"], batch["segment_ids"], batch["temperature"])

    return logprob_fn


@functools.lru_cache(maxsize=8)
def train_step_for(loss: LossConfig, optimizer: OptimizerSpec, num_train_steps: int, compute_dtype: str) -> Any:
    """The jitted train step for these (hashable, frozen) configs; cached so one process compiles it once."""
    return make_train_step(loss_module_from_config(loss), build_optimizer(optimizer, num_train_steps), compute_dtype)


def make_train_step(loss_module: RLLossModule, optimizer: optax.GradientTransformation, compute_dtype: str) -> Any:
    """A jitted `(model, opt_state, reference, batch) -> (model, opt_state, metrics)`, compiled once per shape.

    A step whose loss or gradient norm is not finite leaves model and optimizer state unchanged and reports
    `skipped_nonfinite: 1` (see `policy.update_guard.guarded_update`)."""
    loss_fn = loss_module.create_loss_fn(None, make_logprob_fn(compute_dtype))

    @eqx.filter_jit
    def train_step(model: Any, opt_state: Any, reference: Any, batch: Batch) -> tuple[Any, Any, dict[str, Any]]:
        (loss, metrics), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, reference, batch)
        model, opt_state, guard_metrics = guarded_update(optimizer, model, opt_state, grads, loss)
        return model, opt_state, {**metrics, **guard_metrics}

    return train_step


# ---------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------


def wait_for_batch(store: RunStore, slot: int, timeout_s: float, poll_s: float) -> tuple[BatchLogEntry | None, float]:
    """The commit object of batch `slot` and the seconds waited; (None, waited) if control/STOP appeared.

    Raises BatchWaitTimeout naming the log entry when nothing appears within `timeout_s`, and
    BatchMismatchError naming the file and field when the entry is not a valid `BatchLogEntry`.
    """
    entry = layout.batch_log_entry(slot)
    start = time.monotonic()
    while True:
        if store.exists(entry):
            try:
                return store.read_log_entry(slot), time.monotonic() - start
            except RecordError as e:
                raise BatchMismatchError(str(e)) from None
        if store.exists(layout.STOP_FILE):
            return None, time.monotonic() - start
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise BatchWaitTimeout(
                f"waited {waited:.0f}s (> batch_wait_timeout_s={timeout_s}) for {store.full_path(entry)}"
            )
        time.sleep(poll_s)


def batch_arrays(rows: list[schemas.BatchRow], train: TrainParams, vocab_size: int, path: str) -> Batch:
    """Fixed-shape [batch_size, seq_len] learner arrays from batch rows; BatchMismatchError on any misfit."""
    if len(rows) != train.batch_size:
        raise BatchMismatchError(f"{path}: {len(rows)} rows, run expects train.batch_size={train.batch_size}")
    B, S = train.batch_size, train.seq_len
    out = {
        "tokens": np.zeros((B, S), np.int32),
        "segment_ids": np.full((B, S), -1, np.int32),
        "position_ids": np.zeros((B, S), np.int32),
        "loss_mask": np.zeros((B, S), np.float32),
        "advantages": np.zeros((B, S), np.float32),
        "generator_logprobs": np.zeros((B, S), np.float32),
        "temperature": np.ones((B, S), np.float32),
        "truncated": np.zeros((B, S), bool),
        "seq_index": np.full((B, S), B * S, np.int32),
    }
    for b, row in enumerate(rows):
        if len(row.tokens) != S:
            raise BatchMismatchError(f"{path}: row {b} has {len(row.tokens)} tokens, run expects train.seq_len={S}")
        tok = np.asarray(row.tokens, np.int64)
        if tok.size and (tok.min() < 0 or tok.max() >= vocab_size):
            raise BatchMismatchError(
                f"{path}: row {b} has token id {int(tok.max())} outside the vocabulary [0, {vocab_size}) "
                "(tokenizer mismatch?)"
            )
        seg = np.asarray(row.segment_ids, np.int32)
        out["tokens"][b] = tok
        out["segment_ids"][b] = seg
        out["position_ids"][b] = row.position_ids
        out["loss_mask"][b] = row.loss_mask
        out["advantages"][b] = row.advantages
        out["generator_logprobs"][b] = row.generator_logprobs
        valid = seg >= 0
        temps = np.asarray(row.temperatures, np.float32)
        trunc = np.asarray(row.truncated, bool)
        out["temperature"][b, valid] = temps[seg[valid]]
        out["truncated"][b, valid] = trunc[seg[valid]]
        out["seq_index"][b, valid] = b * S + seg[valid]
    return {k: jnp.asarray(v) for k, v in out.items()}


def read_batch(
    store: RunStore, slot: int, entry: BatchLogEntry, train: TrainParams, vocab_size: int
) -> tuple[Batch, str]:
    """Load and check batch `slot` named by its commit object; returns (arrays, data file)."""
    if entry.seq_len != train.seq_len:
        raise BatchMismatchError(
            f"{layout.batch_log_entry(slot)}: seq_len={entry.seq_len!r}, this run has seq_len={train.seq_len!r}"
        )
    data_file = entry.data_file
    table = store.read_parquet(data_file, schemas.BATCH)
    rows = schemas.BATCH.from_table(table)
    return batch_arrays(rows, train, vocab_size, data_file), data_file


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------


@dataclass
class LearnerState:
    """What a full checkpoint holds: `step` batches consumed (slots 1..step), model, optimizer state."""

    step: int
    model: Any
    opt_state: Any
    parent: int | None
    """The checkpoint this process resumed from (None: initialised)."""


def committed_checkpoints(store: RunStore) -> list[int]:
    """Committed, not garbage-collected checkpoint steps, ascending."""
    return [
        s
        for s in ckpt.committed_steps(store, layout.CHECKPOINTS)
        if not store.exists(layout.join(layout.checkpoint_dir(s), "COLLECTED"))
    ]


def save_checkpoint(store: RunStore, state: LearnerState, config: LearnerStepConfig, lineage_start: int) -> bool:
    """Commit `checkpoints/step-S`: model + optimizer state, then COMMITTED recording slots consumed."""
    meta = {
        "kind": "checkpoint",
        "step": state.step,
        "batch_slot": state.step,
        "parent": state.parent,
        "slots": [lineage_start, state.step],
        "tokenizer": config.model.tokenizer,
        "seq_len": config.train.seq_len,
        "vocab_size": int(state.model.Vocab.size),
        "loss": type(config.loss).__name__,
    }
    blobs = {
        MODEL_BLOB: ckpt.tree_to_safetensors(state.model),
        OPT_BLOB: ckpt.tree_to_safetensors(state.opt_state),
    }
    return ckpt.write_committed(store, layout.checkpoint_dir(state.step), blobs, meta)


def collect_old_checkpoints(store: RunStore, keep: int) -> None:
    """Garbage-collect all but the newest `keep` checkpoints: tombstone first, then delete their data files.

    The COMMITTED markers stay (commit objects are never deleted), so the lineage remains auditable.
    """
    steps = committed_checkpoints(store)
    for s in steps[: max(len(steps) - keep, 0)]:
        folder = layout.checkpoint_dir(s)
        store.put_json_if_absent(layout.join(folder, "COLLECTED"), {"step": s})
        for rel in store.list(folder):
            if rel.endswith(".safetensors"):
                store.delete(rel)
        logger.info("garbage-collected checkpoint %d", s)


def load_checkpoint(
    store: RunStore, step: int, spec: ModelSpec, vocab_size: int, optimizer: optax.GradientTransformation
) -> LearnerState:
    """Restore checkpoint `step` (verified against its marker) into templates built from the config."""
    folder = layout.checkpoint_dir(step)
    record = ckpt.read_marker(store, folder)
    template = M.model_template(spec, vocab_size)
    model = ckpt.tree_from_safetensors(template, ckpt.read_blob(store, folder, record, MODEL_BLOB), source=folder)
    abstract_params = eqx.filter(template, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_template = eqx.filter_eval_shape(optimizer.init, abstract_params)
    opt_state = ckpt.tree_from_safetensors(opt_template, ckpt.read_blob(store, folder, record, OPT_BLOB), source=folder)
    return LearnerState(step=step, model=model, opt_state=opt_state, parent=step)


def resume_or_init(
    store: RunStore, config: LearnerStepConfig, vocab_size: int, optimizer: optax.GradientTransformation
) -> LearnerState:
    """Phase 1: the newest committed checkpoint, or a fresh model (policy 0 published) if there is none.

    A committed checkpoint that fails verification is skipped with an error log; if checkpoints exist
    but none loads, this raises rather than silently restarting from scratch.
    """
    steps = committed_checkpoints(store)
    errors = []
    for s in reversed(steps):
        try:
            state = load_checkpoint(store, s, config.model, vocab_size, optimizer)
        except ckpt.CheckpointError as e:
            logger.error("checkpoint %d unusable, trying an older one: %s", s, e)
            errors.append(str(e))
            continue
        logger.info("resuming from checkpoint %d (next batch slot %d)", s, s + 1)
        return state
    if errors:
        raise ckpt.CheckpointError("no committed checkpoint loads: " + "; ".join(errors))
    logger.info("no checkpoint: initialising %s model (seed %d)", config.model.family, config.model.seed)
    model = M.build_model(config.model, vocab_size, jax.random.PRNGKey(config.model.seed))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    return LearnerState(step=0, model=model, opt_state=opt_state, parent=None)


def load_reference(store: RunStore, config: LearnerStepConfig, vocab_size: int, module: RLLossModule) -> Any:
    """The frozen reference model (policy 0, the initial weights) if the loss needs one; else None (never built)."""
    if not module.needs_reference:
        return None
    return module.build(M.load_policy(store, 0, config.model, vocab_size))


def publish_policy(store: RunStore, state: LearnerState, config: LearnerStepConfig) -> None:
    """Commit policy `state.step` unless it already is (markers record the batch slot, tokenizer, seq_len)."""
    M.save_policy(
        store,
        state.step,
        state.model,
        {"batch_slot": state.step, "tokenizer": config.model.tokenizer, "seq_len": config.train.seq_len},
    )


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def make_tracker(config: TrackerConfig, run_root: str) -> Any:
    """The levanter tracker `config` asks for (None for type 'none'), initialised with the run's name.

    Raises ConfigError naming `tracker.type` when the tracker's package is not installed.
    """
    if config.type == "none":
        return None
    local = run_root.removeprefix("file://") if "://" not in run_root or run_root.startswith("file://") else None
    logdir = config.logdir or (os.path.join(local, "trackers") if local else os.path.abspath("trackers"))
    name = config.name or run_root.rstrip("/").rsplit("/", 1)[-1] or "rlpipe"
    if config.type == "json":
        from levanter.tracker.json_logger import JsonLoggerConfig

        return JsonLoggerConfig().init(name)
    os.makedirs(logdir, exist_ok=True)
    try:
        if config.type == "tensorboard":
            import tensorboardX  # noqa: F401  (levanter imports it only inside init)
            from levanter.tracker.tensorboard import TensorboardConfig

            return TensorboardConfig(logdir=logdir).init(name)
        import wandb  # noqa: F401
        from levanter.tracker.wandb import WandbConfig

        if config.logdir or "WANDB_DIR" not in os.environ:  # an explicit logdir wins over the environment
            os.environ["WANDB_DIR"] = logdir
        os.environ.setdefault("WANDB_SILENT", "true")
        cfg = WandbConfig(project=config.project, name=name, mode=config.mode, save_code=False)
        return cfg.init(name)
    except ImportError as e:
        raise ConfigError("tracker.type", config.type, f"needs a package that is not installed ({e})") from e


def main(config: LearnerStepConfig) -> None:
    """Run the learner (see the module docstring): resume or init, then train batch slots in order."""
    store = RunStore(config.store.run_root, config.store.storage_options or None)
    tokenizer = load_tokenizer(config.model.tokenizer)
    vocab_size = M.model_vocab_size(tokenizer)
    loss_module = loss_module_from_config(config.loss)
    optimizer = build_optimizer(config.optimizer, config.train.num_train_steps)
    total = config.train.num_train_steps

    # phase 1: resume or initialise
    state = resume_or_init(store, config, vocab_size, optimizer)
    lineage_start = state.step + 1
    if state.step == 0 and not store.exists(layout.policy_marker(0)):
        publish_policy(store, state, config)
    if not store.exists(layout.policy_marker(state.step)):
        publish_policy(store, state, config)  # the crash fell between checkpoint S and policy S
    reference = load_reference(store, config, vocab_size, loss_module)
    logger.info(
        "learner at step %d of %d; %d parameters; loss %s; reference model %s",
        state.step,
        total,
        M.count_params(state.model),
        type(loss_module).__name__,
        "built" if reference is not None else "not built (kl_coef=0)",
    )
    if state.step >= total:
        store.put_json_if_absent(LEARNER_DONE, {"step": state.step})
        logger.info("already trained %d steps; nothing to do", state.step)
        return

    # phase 2: train
    train_step = train_step_for(config.loss, config.optimizer, total, config.model.compute_dtype)
    metrics = MetricsWriter(store, "learner", "learner")
    tracker = make_tracker(config.tracker, config.store.run_root)
    tokens_per_batch = config.train.batch_size * config.train.seq_len
    trained_here = 0
    last_checkpoint = state.step
    stop_reason = "num_train_steps"
    progress = _progress(total, state.step)
    try:
        while state.step < total:
            if config.max_steps is not None and trained_here >= config.max_steps:
                stop_reason = "max_steps"
                break
            slot = state.step + 1
            entry, waited = wait_for_batch(store, slot, config.batch_wait_timeout_s, config.poll_interval_s)
            if entry is None:
                stop_reason = "control/STOP"
                break
            batch, data_file = read_batch(store, slot, entry, config.train, vocab_size)
            t0 = time.monotonic()
            model, opt_state, step_metrics = train_step(state.model, state.opt_state, reference, batch)
            step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
            train_s = time.monotonic() - t0
            state = LearnerState(slot, model, opt_state, state.parent)
            trained_here += 1
            if step_metrics["skipped_nonfinite"]:  # parameters and optimizer state were left unchanged
                logger.warning(
                    "skipped the update of batch slot %d (%s): non-finite loss %s or grad norm %s",
                    slot,
                    data_file,
                    step_metrics["loss"],
                    step_metrics["grad_norm"],
                )
            record = {
                "step": slot,
                "batch_file": data_file,
                "wait_s": waited,
                "train_s": train_s,
                "tokens_per_s": tokens_per_batch / max(train_s, 1e-9),
                "learning_rate": float(learning_rate_schedule(config.optimizer, total)(slot - 1)),
                **step_metrics,
            }
            metrics.log(record)
            if tracker is not None:
                tracker.log({f"learner/{k}": v for k, v in record.items() if k != "batch_file"}, step=slot)
            logger.info(
                "trained slot %d (%s) loss=%.4f kl=%s grad_norm=%.3f wait=%.2fs train=%.2fs",
                slot,
                data_file,
                step_metrics["loss"],
                step_metrics.get("kl", "-"),
                step_metrics["grad_norm"],
                waited,
                train_s,
            )
            progress.update(1)
            if slot % config.policy_interval == 0 or slot == total:
                publish_policy(store, state, config)
            if slot % config.checkpoint_interval == 0 or slot == total:
                save_checkpoint(store, state, config, lineage_start)
                last_checkpoint = slot
                collect_old_checkpoints(store, config.keep_checkpoints)
                metrics.flush()
    finally:
        progress.close()
        metrics.flush()
        if tracker is not None:
            tracker.finish()

    # phase 3: finish
    if state.step > last_checkpoint:
        save_checkpoint(store, state, config, lineage_start)
        collect_old_checkpoints(store, config.keep_checkpoints)
    if state.step >= total:
        publish_policy(store, state, config)
        store.put_json_if_absent(LEARNER_DONE, {"step": state.step})
        stop_reason = "num_train_steps"
    logger.info("learner stopped at step %d (%s)", state.step, stop_reason)


def _progress(total: int, initial: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="learner", unit="step", disable=not sys.stderr.isatty())


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportConfig:
    """`python -m steps.learn export`: write a committed policy as a transformers-loadable folder."""

    store: StoreConfig = field(default_factory=StoreConfig)
    model: ModelSpec = field(default_factory=ModelSpec)
    step: int | None = None
    """Policy step to export; None: the newest committed policy."""
    out: str = "hf_export"
    """Output folder (local or fsspec URL)."""


def export(config: ExportConfig) -> str:
    """Export policy `config.step` to `config.out`; returns the folder written."""
    store = RunStore(config.store.run_root, config.store.storage_options or None)
    step = config.step if config.step is not None else M.latest_policy_step(store)
    if step is None:
        raise M.PolicyNotFoundError(f"{store.full_path(layout.POLICIES)}: no committed policy to export")
    tokenizer = load_tokenizer(config.model.tokenizer)
    model = M.load_policy(store, step, config.model, M.model_vocab_size(tokenizer))
    M.export_hf(model, config.out, tokenizer, family=config.model.family)
    logger.info("exported policy %d to %s", step, config.out)
    return config.out


def cli(argv: list[str] | None = None) -> None:
    """Entry point: `python -m steps.learn [flags]` or `python -m steps.learn export [flags]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "export":
        export(draccus.parse(ExportConfig, args=argv[1:]))
        return
    config = draccus.parse(LearnerStepConfig, args=argv)
    logger.info("config: %s", json.dumps(dataclasses.asdict(config), default=str, sort_keys=True))
    main(config)


if __name__ == "__main__":
    cli()
