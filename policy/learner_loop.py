"""The learner's loop (`steps.learn`): what one learner process holds (`Learner`) and the phases its `main` calls.

`open_learner` (the run root, the vocabulary, the loss module, the optimizer, the device mesh; `jax.distributed`
started first), `resume` (phase 1: the newest committed checkpoint or a fresh model, policy 0 or the resumed policy
committed), `train` (phase 2: batch slot after slot, `train_one` each, policies and checkpoints on their
intervals), `finish` (phase 3: the last checkpoint, the final policy, LEARNER_DONE) and `await_final_evaluation`
(phase 4: the final policy's evaluations forwarded to the tracker). The library they string together (optimizer,
train step, batch reading, checkpoints) is `policy.learner`; what the program reads and writes is in
`steps.learn`'s docstring.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import jax

from pipeline.config import LearnerStepConfig
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.process.step_kind import StepKind
from pipeline.store import layout
from pipeline.store.poll import WaitTimeout
from pipeline.store.storage import RunStore
from pipeline.telemetry.hops import step_hops
from pipeline.telemetry.metrics import MetricsWriter
from policy import learner as L
from policy import mesh as mesh_lib
from policy import model as M
from policy import policy_format as pf
from policy import publisher as P
from policy.losses import Batch, RLLossModule, loss_module_from_config
from policy.losses.modules import split_frozen
from policy.trackers import make_run_tracker

logger = logging.getLogger("steps.learn")
"""The program's logger (its lines read `steps.learn` wherever the code that logs them lives)."""


@dataclass
class Learner:
    """What one learner process holds fixed while it trains: the run, the model's shape, the compiled step."""

    config: LearnerStepConfig
    store: RunStore
    vocab_size: int
    loss_module: RLLossModule
    optimizer: Any
    lineage_start: int = 0
    """The first batch slot this process trains (recorded in its checkpoints)."""
    last_checkpoint: int = 0
    trained_here: int = 0
    reference: Any = None
    train_step: Any = None
    metrics: Any = None
    tracker: Any = None
    publisher: Any = None
    """`policy.publisher.PolicyPublisher`: policies are committed behind the next step's compute, in order."""
    mesh: Any = None
    """The device mesh (`policy.mesh.LearnerMesh`) parameters, optimizer state and batches live on."""

    @property
    def total(self) -> int:
        return self.config.train.num_train_steps


def open_learner(config: LearnerStepConfig) -> Learner:
    """The run root, the tokenizer's vocabulary size, the loss module, the optimizer and the device mesh.

    With several learner processes, `jax.distributed` is started here, before any device is touched."""
    mesh_lib.initialize_distributed(config.distributed)
    tokenizer = load_tokenizer(config.model.tokenizer)
    return Learner(
        config=config,
        store=RunStore(config.store.run_root, config.store.storage_options or None),
        vocab_size=M.model_vocab_size(tokenizer),
        loss_module=loss_module_from_config(config.loss),
        optimizer=L.build_optimizer(config.optimizer, config.train.num_train_steps),
        mesh=mesh_lib.build_mesh(config.mesh),
    )


def resume(learner: Learner) -> pf.LearnerState:
    """Phase 1: the newest checkpoint or a fresh model; policy 0 (or the resumed policy) committed."""
    store, config = learner.store, learner.config
    state = L.resume_or_init(store, config, learner.vocab_size, learner.optimizer, learner.mesh)
    state = L.shard_state(state, learner.mesh)  # a fresh model or an older whole-pytree checkpoint onto the mesh
    learner.lineage_start = state.step + 1
    learner.last_checkpoint = state.step
    verify_policy_marker(store, state.step)
    if not mesh_lib.agree_with_writer(store.exists(layout.policy_marker(state.step))):
        L.publish_policy(store, state, config)  # policy 0, or a crash fell between checkpoint S and policy S
    learner.reference = L.load_reference(store, config, learner.vocab_size, learner.loss_module)
    if learner.reference is not None:
        learner.reference = mesh_lib.shard_params(learner.reference, learner.mesh)
    reference, teacher = split_frozen(learner.reference)  # a distillation teacher travels with the reference
    logger.info(
        "learner at step %d of %d; %d parameters; loss %s; reference model %s%s",
        state.step,
        learner.total,
        M.count_params(state.model),
        type(learner.loss_module).__name__,
        "built" if reference is not None else "not built (kl_coef=0)",
        "; distillation teacher loaded" if teacher is not None else "",
    )
    return state


def verify_policy_marker(store: RunStore, step: int) -> None:
    """Refuse to carry on past a damaged `policies/step-S/COMMITTED` of the step resumed from: samplers cannot load
    that policy, and a committed marker is never replaced. DamagedCommitError (exit code 7) names the file, the field
    and the repair: deleting the folder lets the learner publish the policy again from the state it resumes from."""
    if not store.exists(layout.policy_marker(step)):
        return
    try:
        pf.policy_metadata(store, step)
    except pf.DamagedCommitError as e:
        raise pf.DamagedCommitError(
            e.path, f"{e.reason} (delete {layout.policy_dir(step)}/ and rerun: the learner publishes policy {step} "
            "again from the state it resumes from)"
        ) from None  # fmt: skip


def train(learner: Learner, state: pf.LearnerState) -> tuple[pf.LearnerState, str]:
    """Phase 2: train slot after slot until num_train_steps, max_steps or control/STOP; returns (state, why)."""
    config = learner.config
    learner.train_step = L.mesh_train_step(config, learner.mesh)
    writer = mesh_lib.is_writer()  # one process writes metrics and tracker records
    # one file per step (as the BatchMaker's per slot): each step's record reaches the tracker forwarding and the
    # job's progress line (pipeline.jobs.progress) as the step is committed, not up to FLUSH_INTERVAL_S later
    learner.metrics = (
        MetricsWriter(learner.store, StepKind.LEARNER, StepKind.LEARNER.job_name, flush_every=1)
        if writer
        else _NoMetrics()
    )
    # a fresh run's tracker forwards the records committed before it opened too; a restarted one from now on
    fresh = state.step == 0
    learner.tracker = (
        make_run_tracker(config.tracker, config.store.run_root, learner.store, fresh=fresh) if writer else None
    )
    learner.publisher = P.PolicyPublisher(learner.store, config)
    progress = _progress(learner.total, state.step)
    started_at = time.time()
    try:
        while state.step < learner.total:
            learner.publisher.check()  # a failed publish stops the learner (the BatchMaker waits for that policy)
            if config.max_steps is not None and learner.trained_here >= config.max_steps:
                return state, "max_steps"
            slot = state.step + 1
            bounded = config.max_steps is not None  # a scheduled job: a short wait, then exit 0 saying why
            try:
                entry, waited = L.wait_for_batch(
                    learner.store,
                    slot,
                    config.polling.bounded_wait_s if bounded else config.cadence.batch_wait_timeout_s,
                    config.polling.interval_s,
                    on_wait=learner.publisher.check,
                )
            except WaitTimeout:
                if not bounded:
                    raise
                return state, (
                    f"bounded mode: nothing more to do, batch slot {slot} is not committed "
                    f"({layout.batch_log_entry(slot)} did not appear within "
                    f"polling.bounded_wait_s={config.polling.bounded_wait_s:g})"
                )
            # several processes: all follow process 0's decision (a committed batch never disappears, so a
            # process that saw control/STOP first can still read the batch process 0 found)
            if mesh_lib.agree_with_writer(entry is None):
                return state, "control/STOP"
            if entry is None:
                entry = learner.store.read_log_entry(slot)
            events = {"learner_noticed_at": time.time(), **P.batch_events(learner.store, entry, learner.publisher)}
            batch, data_file = L.read_batch(learner.store, slot, entry, config.train, learner.vocab_size, learner.mesh)
            events["train_started_at"] = time.time()
            state, record = train_one(learner, state, batch, data_file, waited)
            events["trained_at"] = time.time()
            publish_on_interval(learner, state)
            ended_at = time.time()
            record.update(step_timing(started_at, ended_at, events))
            started_at = ended_at
            log_step(learner, record)
            progress.update(1)
    finally:
        learner.publisher.close()
        progress.close()
        learner.metrics.flush()
    return state, "num_train_steps"


def train_one(
    learner: Learner, state: pf.LearnerState, batch: Batch, data_file: str, waited: float
) -> tuple[pf.LearnerState, dict[str, Any]]:
    """The optimizer updates of slot `state.step + 1` on its batch; returns the new state and its metrics record."""
    slot = state.step + 1
    t0 = time.monotonic()
    model, opt_state, step_metrics = learner.train_step(state.model, state.opt_state, learner.reference, batch)
    step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    train_s = time.monotonic() - t0
    learner.trained_here += 1
    if step_metrics["skipped_nonfinite"]:  # parameters and optimizer state were left unchanged
        logger.warning(
            "skipped the update of batch slot %d (%s): non-finite loss %s or grad norm %s",
            slot,
            data_file,
            step_metrics["loss"],
            step_metrics["grad_norm"],
        )
    tokens_per_batch = learner.config.train.batch_size * learner.config.train.seq_len
    record = {
        "step": slot,
        "batch_file": data_file,
        "wait_s": waited,
        "train_s": train_s,
        "tokens_per_s": tokens_per_batch / max(train_s, 1e-9),
        "learning_rate": L.learning_rate_at(learner.config.optimizer, learner.total, slot - 1),
        **step_metrics,
    }
    return pf.LearnerState(slot, model, opt_state, state.parent), record


def step_timing(started_at: float, ended_at: float, events: dict[str, float | None]) -> dict[str, Any]:
    """The record's latency fields: the chain's unix times, `step_s` and its per-hop breakdown `hops`
    (`pipeline.telemetry.hops`: the hops add up to `step_s`)."""
    return {
        **{k: v for k, v in events.items() if v is not None},
        "step_started_at": started_at,
        "step_ended_at": ended_at,
        "step_s": ended_at - started_at,
        "hops": step_hops(started_at, ended_at, events),
    }


def log_step(learner: Learner, record: dict[str, Any]) -> None:
    """The step's record to the run root's metrics, the tracker and the log."""
    learner.metrics.log(record)
    if learner.tracker is not None:
        scalars = {k: v for k, v in record.items() if k not in ("batch_file", "hops") and not k.endswith("_at")}
        scalars.update({f"hops/{k}": v for k, v in record.get("hops", {}).items()})
        learner.tracker.log({f"learner/{k}": v for k, v in scalars.items()}, step=record["step"])
    logger.info(
        "trained slot %d (%s) loss=%.4f kl=%s grad_norm=%.3f wait=%.2fs train=%.2fs",
        record["step"],
        record["batch_file"],
        record["loss"],
        record.get("kl", "-"),
        record["grad_norm"],
        record["wait_s"],
        record["train_s"],
    )


def publish_on_interval(learner: Learner, state: pf.LearnerState) -> None:
    """A policy every `cadence.policy_interval` steps and at the end, a checkpoint every `cadence.checkpoint_interval`
    steps except the last: the final checkpoint is `finish`'s, after the last step's metrics record is logged (its
    `step_s` and time then measure the step, not the one-off multi-second write of weights and optimizer state)."""
    config, slot = learner.config, state.step
    if slot % config.cadence.policy_interval == 0 or slot == learner.total:
        learner.publisher.submit(state)  # committed in order on the publisher's thread
    if slot % config.cadence.checkpoint_interval == 0 and slot < learner.total:
        checkpoint(learner, state)
        learner.metrics.flush()


def checkpoint(learner: Learner, state: pf.LearnerState) -> None:
    """Commit checkpoint `state.step` and garbage-collect the old ones."""
    pf.write_checkpoint(learner.store, state, learner.config, learner.lineage_start)
    learner.last_checkpoint = state.step
    pf.collect_old_checkpoints(learner.store, learner.config.keep_checkpoints)


def finish(learner: Learner, state: pf.LearnerState, stop_reason: str) -> None:
    """Phase 3: checkpoint what is not yet; at num_train_steps, the final policy and LEARNER_DONE."""
    if state.step > learner.last_checkpoint:
        checkpoint(learner, state)
    if learner.publisher is not None:
        learner.publisher.drain()  # every policy handed off is committed before LEARNER_DONE
    if state.step >= learner.total:
        if not mesh_lib.agree_with_writer(learner.store.exists(layout.policy_marker(state.step))):
            L.publish_policy(learner.store, state, learner.config)  # not gathered again when already published
        if mesh_lib.is_writer():
            learner.store.put_json_if_absent(layout.LEARNER_DONE, {"step": state.step})
        stop_reason = "num_train_steps"
    logger.info("learner stopped at step %d (%s)", state.step, stop_reason)


def await_final_evaluation(learner: Learner, state: pf.LearnerState) -> None:
    """Phase 4: with a tracker and `final_eval_wait_s` > 0, after the final step, forward the final policy's
    evaluations (every lesson of run.json's curriculum) to the tracker before it closes, waiting at most that
    long for them."""
    wait_s = learner.config.final_eval_wait_s
    if learner.tracker is None or wait_s <= 0 or state.step < learner.total:
        return
    try:
        lessons = sorted(learner.store.get_json(layout.RUN_CONFIG)["config"]["curriculum"]["lessons"])
    except (FileNotFoundError, KeyError, TypeError, ValueError) as e:  # no job's run.json: nothing to wait for
        logger.warning("no curriculum in %s (%s); not waiting for the final evaluation", layout.RUN_CONFIG, e)
        return
    logger.info("waiting up to %.0f s for the evaluation of policy %d (%s) for the tracker", wait_s, state.step,
                ", ".join(lessons))  # fmt: skip
    if not learner.tracker.await_evaluations(state.step, lessons, wait_s):
        logger.warning("the evaluation of policy %d did not arrive within final_eval_wait_s=%.0f; the tracker "
                       "closes without it (it is in the run root and the report)", state.step, wait_s)  # fmt: skip


class _NoMetrics:
    """The metrics sink of a learner process other than process 0 (which alone writes metrics)."""

    def log(self, record: dict[str, Any]) -> None:
        del record

    def flush(self) -> None:
        pass


def _progress(total: int, initial: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="learner", unit="step", disable=not sys.stderr.isatty())
