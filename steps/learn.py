"""The learner step: turns policy S into S+1 with batch slot S+1, publishes policies and checkpoints.

Reads:  `batches/log/step-T.json` (commit object; `data_file` names the batch parquet, read through
        `schemas.BATCH`), the newest committed `checkpoints/step-S/` on restart, `policies/step-0` (the
        frozen reference model when `loss.kl_coef > 0`), `control/STOP`.
Writes: `policies/step-S/` (+ COMMITTED, then the LATEST hint) every `cadence.policy_interval` steps, at step 0 and
        at the end; `checkpoints/step-S/` (model + optimizer state as sharded safetensors, one file per learner
        process, COMMITTED last, recording
        the batch slot consumed and its lineage) every `cadence.checkpoint_interval` steps and at exit;
        `metrics/learner/…`; `control/LEARNER_DONE` once `train.num_train_steps` are trained.

Phases of `main` (`policy.learner_loop` holds the loop: `resume`, `train`, `finish`, `await_final_evaluation`):
  1. resume from the newest committed checkpoint S (weights, optimizer state, step; a damaged one is quarantined
     and an older intact one used), else initialise from the ModelSpec (seeded, or an HF folder); publish policy 0
     (or policy S, if a crash fell between checkpoint S and policy S; a damaged policies/step-S/COMMITTED stops
     the step, exit code 7, naming the file and the field);
  2. loop T = S+1, S+2, …: wait for batch slot T (fail loudly naming the file after `cadence.batch_wait_timeout_s`),
     read it, verified against its log entry (size, sha256, rows: a file that differs is quarantined and the slot
     rebuilt from its recorded inputs, `pipeline.batch_maker.rebuild`, or the step stops with exit code 7 naming
     the file; refusing a batch whose schema version, row count, seq_len or tokenizer do not match), run the
     slot's optimizer updates of the configured loss module (one; or train.ppo_epochs ×
     train.minibatches_per_slot), log metrics, publish policy T / checkpoint T on
     their intervals;
  3. stop at `train.num_train_steps` (checkpoint, policy, LEARNER_DONE), after `max_steps` in this process
     (bounded mode; checkpoint), when bounded and the next batch slot is not committed within `polling.bounded_wait_s`
     (exit 0 naming the slot; checkpoint of what was trained), or when control/STOP appears (checkpoint);
  4. with a tracker and `final_eval_wait_s` > 0 (a job with an evaluator), forward the final policy's
     evaluations to it as they commit, then close the tracker run.
The step is a pure function of (checkpoint, batches) (see `policy.learner`): replaying batches S+1..S+k from
checkpoint S gives bitwise-identical parameters on CPU.

Run:
  python -m steps.learn --config_path learner.yaml          # or flags: --store.run_root runs/demo ...
  python -m steps.export --store.run_root runs/demo --step 12 --out /tmp/hf   # HF folder of policy 12
"""

from __future__ import annotations

import logging
import os
import sys

from pipeline.config import LearnerStepConfig, validate_learner
from pipeline.store import layout
from steps.cli import run_program, step_main
from steps.early import learner_already_done

logger = logging.getLogger("steps.learn")

HEAVY_MODULES = ("policy.learner_loop",)
"""What `main` imports (JAX, levanter, the model): loaded once the config is checked and the run is not finished
(`steps.cli.step_main`), or by the job's fork server before it forks the step."""
EARLY_EXIT = learner_already_done
"""A learner started on a run it already finished (a scheduled job firing again) ends here, before JAX."""


PROFILE_ENV = "RLPIPE_PROFILE"
"""Set to a folder, the learner runs under cProfile and writes `learner-<pid>.prof` there when `main` returns or
raises (`python -m pstats F` reads it; see docs/reference/steps.md). Only the main thread is profiled."""


def main(config: LearnerStepConfig) -> int:
    """Run the learner (see the module docstring): resume or init, then train batch slots in order; returns 0.
    With `RLPIPE_PROFILE=<folder>` in the environment, the same under cProfile (`PROFILE_ENV`)."""
    profile_dir = os.environ.get(PROFILE_ENV)
    if not profile_dir:
        return _main(config)
    import cProfile

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(_main, config)
    finally:
        os.makedirs(profile_dir, exist_ok=True)
        path = os.path.join(profile_dir, f"learner-{os.getpid()}.prof")
        profiler.dump_stats(path)
        logger.info("cProfile of the learner written to %s", path)


def _main(config: LearnerStepConfig) -> int:
    from policy import mesh as mesh_lib
    from policy.learner_loop import await_final_evaluation, finish, open_learner, resume, train

    validate_learner(config)
    learner = open_learner(config)
    state = resume(learner)
    if state.step >= learner.total:
        if mesh_lib.is_writer():
            learner.store.put_json_if_absent(layout.LEARNER_DONE, {"step": state.step})
        logger.info("already trained %d steps; nothing to do", state.step)
        return 0
    try:
        state, stop_reason = train(learner, state)
        finish(learner, state, stop_reason)
        await_final_evaluation(learner, state)
    finally:
        if learner.tracker is not None:
            learner.tracker.finish()
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.learn [--config_path F] [--field value …]`; returns the exit code. A learner started on a run
    it already finished (a scheduled job firing again) ends before importing JAX (`steps.early`)."""
    program = step_main(main, HEAVY_MODULES, EARLY_EXIT)
    return run_program(LearnerStepConfig, program, argv, validate=validate_learner)


if __name__ == "__main__":
    sys.exit(cli())
