"""Checks a step program makes before it imports JAX: whether it has anything to do at all.

A scheduled job (cron, a cloud scheduler) keeps starting the steps of a run after the run finished, and a job's
evaluator is restarted with its job; each such start would otherwise import JAX and levanter, build a model and
restore a checkpoint (several CPU seconds) only to find nothing to do. These checks read a few small objects of the
run root (the evaluator's: the policy listing and one summary per policy and lesson) and end the program the way its
full path would: the same log line, exit 0.
"""

from __future__ import annotations

import logging

from pipeline.config import EvaluateStepConfig, LearnerStepConfig, RolloutStepConfig
from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore
from schemas.records import CommitMarker, RecordError


def learner_already_done(config: LearnerStepConfig) -> int | None:
    """0 when `control/LEARNER_DONE` records at least `train.num_train_steps` (the learner's "already trained"
    path, logged as it logs it); None otherwise (a raised `num_train_steps` trains on)."""
    store = RunStore(config.store.run_root, config.store.storage_options)
    done = run_state.learner_done_step(store)
    if done is None or done < config.train.num_train_steps:
        return None
    logging.getLogger("steps.learn").info("already trained %d steps; nothing to do", done)
    return 0


def _finished_policy(store: RunStore, num_train_steps: int) -> bool:
    """True when the newest policy is at least `num_train_steps` and its COMMITTED marker is a valid record: a
    damaged one is left to the worker's full path, which sets the policy aside with its reason (quarantine)."""
    step = run_state.latest_policy_step(store)
    if step is None or step < num_train_steps:
        return False
    marker = layout.policy_marker(step)
    try:
        CommitMarker.from_json(store.get(marker), path=marker)
    except (OSError, RecordError):
        return False
    return True


def rollout_nothing_to_do(config: RolloutStepConfig) -> int | None:
    """0 when a rollout worker would stop before its first sample: `control/STOP` exists, or the learner
    published policy `train.num_train_steps` (logged as the worker's own stop line); None otherwise."""
    store = RunStore(config.store.run_root, config.store.storage_options)
    if store.exists(layout.STOP_FILE):
        reason = f"{layout.STOP_FILE} exists"
    elif _finished_policy(store, config.train.num_train_steps):
        reason = f"learner finished (policy {config.train.num_train_steps} published)"
    else:
        return None
    logging.getLogger("pipeline.rollout.worker").info(
        "rollout worker %s stopped (%s) before starting: 0 files, 0 rows, 0 failures", config.worker_id, reason
    )
    return 0


def _policy_set_aside(store: RunStore) -> bool:
    """Whether a file of some policy is quarantined: left to the evaluator's full path, which reports it."""
    return any(path.startswith(f"{layout.POLICIES}/") for path in store.quarantined())


def evaluate_nothing_to_do(config: EvaluateStepConfig) -> int | None:
    """0 when the evaluator would evaluate nothing: following, the final policy (`stop_after_step`) is committed
    and every policy it follows (multiples of `curriculum.eval_frequency`, and the final one) has a committed
    summary for every lesson (logged as its own closing line); with `--all` / `--steps`, every policy named is
    committed and has them. None otherwise (something to evaluate, `--force`, `--hf_checkpoint`, an uncommitted
    `--steps` policy or a policy set aside as damaged: the full path evaluates or reports it)."""
    if config.force or config.hf_checkpoint:
        return None
    store = RunStore(config.store.run_root, config.store.storage_options)
    committed = run_state.committed_steps(store, layout.POLICIES)
    final = config.stop_after_step
    if config.follow and not (config.all or config.steps):
        if final is None or final not in committed:
            return None  # the learner has not published its final policy: the evaluator waits for it
        freq = max(1, config.curriculum.eval_frequency)
        targets = [s for s in committed if s % freq == 0 or s == final]
        lines = [f"final policy {final} evaluated; done"]
    else:
        targets = committed if config.all else sorted(set(config.steps))
        if not set(targets) <= set(committed):
            return None
        lines = [f"policy {s}: every lesson already evaluated" for s in targets]
    lessons = sorted(config.curriculum.lessons)
    if any(not store.exists(layout.eval_summary_file(s, lesson)) for s in targets for lesson in lessons):
        return None
    if _policy_set_aside(store):
        return None
    for line in lines:  # the full path's own lines
        logging.getLogger("rlpipe.evaluate").info("%s", line)
    return 0
