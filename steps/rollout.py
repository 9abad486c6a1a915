"""The rollout step: a RolloutWorker (`pipeline.rollout.worker`: coordination, storage, weight sync) around a
RolloutManager (`policy.rollout_manager`: inference, environments, rollout generation, evaluation).

Reads
    policies/step-S/COMMITTED (+ weights)    the newest committed policy (listing is the truth; never backwards)
    batches/log/step-T.json                  how far the BatchMaker is (pacing)
    rollouts/step-P/*.ready.json             row counts of committed rollouts (pacing)
    curriculum/state-T.json                  lesson sampling weights (written by the BatchMaker, the one writer)
    control/STOP                             stop file
Writes
    rollouts/step-P/<worker>.<nonce>-<seq>.parquet (+ .ready.json)   one file per write, P = policy that sampled it
    metrics/rollout/<worker>.<nonce>-<seq>.jsonl                     metrics records (`pipeline.rollout.worker.METRICS`)

Run
    python -m steps.rollout --store.run_root runs/demo --worker_id worker0 [--max_rollouts 64] [--max_seconds 60]
    python -m steps.rollout --config_path rollout.yaml        (a RolloutStepConfig as YAML)

Algorithm (RolloutWorker.run, named phases):
    1. wait_for_policy   poll `policies/` until a committed policy exists (`pipeline.store.poll.WaitTimeout` after
                         `wait_for_policy_timeout_s`, naming `policies/step-00000000/COMMITTED`), load it.
    2. loop until stopped (SIGTERM/SIGINT, control/STOP, bounds, or -- in follow mode -- the learner published
       policy `train.num_train_steps`):
       a. sync_weights   newest committed policy P' > P? load it and `manager.update_model` (an older step
                         published later is ignored: P only grows). With `inference: {type: server}` the
                         worker instead tells its server to load `policies/step-P'` (after the running
                         sampling call finished; HF folder `policies/step-P'/hf/` first when
                         `inference.export_hf`) and samples only once the server reports P' (a dead child
                         server is restarted and told again; `policy.inference.server`).
       b. pace           next batch slot T = B + 1 (B = newest committed batch slot). A rollout from policy P
                         is usable in slot T iff 0 <= (T-1) - P <= max_lag. Pause while (T-1) - P > max_lag
                         (it would arrive stale; wait for a newer policy), and while the unconsumed rows
                         usable by slot T or later are >= pacing.max_steps_ahead × train.batch_size (counted exactly
                         from the BatchMaker's cursor in log entry B; see `pipeline.rollout.pacing`; with
                         zero-variance filtering a file counts the rows of its groups with signal, recorded as
                         `signal_rows` in its ready marker, see `usable_rows`). A pause
                         "ahead" that sees no batch/policy progress for `stall_grace_s` lets one write
                         through (a safety net should the BatchMaker need more rows than counted), so
                         pacing can never deadlock the run; not while the BatchMaker waits for the learner
                         (slot T > newest policy + train.max_batches_ahead): such rows would go stale.
       c. sample_lesson  from the newest curriculum state (`pipeline.curriculum`).
       d. generate       `manager.sample_batch(...)` under the generation watchdog.
       e. write          `store.commit_data(rollouts/step-P/<worker>.<nonce>-<seq>.parquet)` under the
                         write watchdog; the ready marker also records the lesson, policy step and failures.
       f. metrics        one record per write (MetricsWriter, kind "rollout").

File names: every process incarnation draws a nonce (`<unix ms hex><4 random hex>`), and its files are
`<worker_id>.<nonce>-<seq>` with seq counting from 0. A restarted worker therefore never reuses a name of
its previous incarnation, whatever that one left behind (an uncommitted data file without a marker is
invisible to readers and simply stays unreferenced). `rollout_id` = `<file stem>-<row index>`: stable and
unique; `group_key` = `<lesson>/<env group key>/<file stem>`: unique per (lesson, example, sampling call).

Watchdogs: weight load, generation and write each run under a `pipeline.process.watchdog.watchdog` thread timer
(`weight_load_timeout_s`, `generation_timeout_s`, `write_timeout_s`). A phase that overruns logs a CRITICAL
line naming the phase and limit and ends the process with `os._exit(Exit.WATCHDOG)` (3): a hung JAX or
network call cannot be interrupted from Python, and the job runner restarts the step.

Task semantics: generation is atomic per `sample_batch` call: `update_model` waits for a running
call to finish, so no rollout mixes weights; every row carries the step the call started with. With an
external server (`openai` backend) that reports a different policy step during one call, the whole call is
re-rolled. An example that fails is retried (a fresh example of the same lesson is drawn, since environments
choose examples by rng) up to `max_example_retries` more times; every failure is kept with its reason in the
batch, the ready marker (`failures`) and the metrics (`failures`). Nothing is dropped silently. A worker whose
sampling calls generate nothing `NO_PROGRESS_AFTER` (20) times in a row, every example failing with the same error
type (a lesson none of whose prompts fits `max_seq_len`), stops with one line and exit code 9 (`NoProgressError`;
never restarted: docs/reference/exit-codes.md).
"""

from __future__ import annotations

import sys

from pipeline.config import RolloutStepConfig
from pipeline.environments.start_checks import check_lessons, check_rollout_step
from pipeline.environments.tokenizer import load_tokenizer
from steps.cli import run_program, step_main
from steps.early import rollout_nothing_to_do

HEAVY_MODULES = ("pipeline.rollout.worker", "policy.rollout_manager")
"""What `main` imports (JAX, levanter, the sampler): loaded once the config is checked and the run is not finished
(`steps.cli.step_main`), or by the job's fork server before it forks the step."""
EARLY_EXIT = rollout_nothing_to_do
"""A worker started on a finished run (or one with control/STOP) ends here, before JAX."""


def main(config: RolloutStepConfig) -> int:
    """Run one rollout worker until stopped; returns the exit status (0: clean stop)."""
    from pipeline.rollout.worker import RolloutWorker
    from policy.rollout_manager import policy_runtime

    check_rollout_step(config)
    tokenizer = load_tokenizer(config.model.tokenizer)
    # a lesson none of whose examples can be sampled or trained: exit 2 now; the prompts drawn tell the sampler
    # which prompt-length buckets to compile while paused (`DenseBackend.warm_up`)
    prompt_lengths = check_lessons(config, tokenizer)
    worker = RolloutWorker(config, runtime=policy_runtime(config, tokenizer, prompt_lengths), tokenizer=tokenizer)
    worker.install_signal_handlers()
    try:
        worker.run()  # phase 1 (wait for a policy, load it), then phase 2 (the loop) until stopped
    finally:
        worker.shutdown()
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.rollout [--config_path F] [--field value …]`; returns the exit code. A worker started on a
    finished run (or one with control/STOP) ends before importing JAX (`steps.early`)."""
    program = step_main(main, HEAVY_MODULES, EARLY_EXIT)
    return run_program(RolloutStepConfig, program, argv, validate=check_rollout_step)


if __name__ == "__main__":
    sys.exit(cli())
