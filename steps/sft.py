"""The SFT step: supervised fine-tuning of the learner's model on prompt/response examples (a warm start for RL).

Reads:  the data (`source`: jsonl/parquet files, local or any fsspec URL, or a reasoning-gym lesson's training
        draws with their reference answers), the newest committed `checkpoints/step-S/` of its run root on restart,
        `model.init_policy` / `model.hf_checkpoint` when the model does not start from its seed.
Writes: `policies/step-S/` (the learner's policy format; COMMITTED last, then LATEST) at step 0, every
        `policy_interval` steps and at the end; `checkpoints/step-S/` (model + optimizer state) every
        `checkpoint_interval` steps and at exit; `metrics/learner/sft-…jsonl` (loss, tokens/s per step); run.json
        (`kind: sft`, the config) once.

Phases of `main`:
  1. check the config (data files exist, the reasoning-gym lesson is valid: one line, exit 2), tokenize the
     examples and pack them into rows (`pipeline.sft_data`: each example its own attention segment, loss on
     response tokens only);
  2. resume from the newest committed checkpoint S, else initialise the model as the RL learner does
     (`policy.learner.resume_or_init`: seed, HF folder or another run's policy); publish policy 0;
  3. steps S+1 … num_train_steps: the rows of step t (a function of data, seed and t alone, so a resumed run
     trains exactly what an uninterrupted one would), one optimizer update through the learner's own train step
     (`policy.sharding.make_mesh_train_step` with `policy.sft.SFTLoss`), metrics, policies and checkpoints on
     their intervals;
  4. at the end (or `max_steps`): checkpoint, final policy. An RL job starts from it with
     `model.init_policy: <this run root>`.
On CPU a run killed at any point and rerun ends with parameters bitwise equal to an uninterrupted run's.

Run:
  python -m steps.sft --config_path configs/chain_sum_sft.yaml
"""

from __future__ import annotations

import logging
import sys

from pipeline.config.sft import SFTStepConfig, validate_sft
from pipeline.store import layout
from steps.cli import run_program, step_main

logger = logging.getLogger("steps.sft")

HEAVY_MODULES = ("policy.learner", "policy.policy_format", "policy.sft")
"""What `main` imports (JAX, levanter, the model): loaded once the config is checked (`steps.cli.step_main`), or by
the job's fork server before it forks the step."""


def main(config: SFTStepConfig) -> int:
    """Run SFT (module docstring); returns 0."""
    from policy import learner as L
    from policy import policy_format as pf
    from policy.sft import learner_view, open_run, train

    validate_sft(config)
    run = open_run(config)
    view = learner_view(config)
    state = L.resume_or_init(run.store, view, run.vocab_size, run.optimizer, run.mesh)
    state = L.shard_state(state, run.mesh)
    run.last_checkpoint = state.step
    if not run.store.exists(layout.policy_marker(state.step)):
        L.publish_policy(run.store, state, view)
    if state.step >= config.num_train_steps:
        logger.info("already trained %d steps; nothing to do", state.step)
        return 0
    state, why = train(run, state)
    if state.step > run.last_checkpoint:
        pf.write_checkpoint(run.store, state, view, run.last_checkpoint + 1)
    if state.step >= config.num_train_steps and not run.store.exists(layout.policy_marker(state.step)):
        L.publish_policy(run.store, state, view)
    logger.info("sft stopped at step %d of %d (%s); policies under %s", state.step, config.num_train_steps, why,
                run.store.full_path(layout.POLICIES))  # fmt: skip
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.sft [--config_path F] [--field value …]`; returns the exit code."""
    return run_program(SFTStepConfig, step_main(main, HEAVY_MODULES), argv, validate=validate_sft)


if __name__ == "__main__":
    sys.exit(cli())
