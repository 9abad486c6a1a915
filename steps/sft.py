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

# `python -m steps.sft`: the config is parsed and checked (steps.cli.deferred_main) before the imports below
# load JAX, so a bad config is one line, exit 2, found before anything starts.
if __name__ == "__main__":
    import sys

    from pipeline.config.sft import SFTStepConfig, validate_sft
    from steps.cli import deferred_main, run_program

    sys.exit(run_program(SFTStepConfig, deferred_main("steps.sft"), validate=validate_sft))

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import jax

from pipeline.config.sft import SFTStepConfig, validate_sft
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.process.step_kind import StepKind
from pipeline.run_contract import encode_config
from pipeline.sft_data import RowStream, load_examples, too_long
from pipeline.store import layout
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter
from policy import learner as L
from policy import mesh as mesh_lib
from policy import model as M
from policy import policy_format as pf
from policy.sft import SFTLoss, device_batch, learner_view
from policy.sharding import make_mesh_train_step

logger = logging.getLogger("steps.sft")

METRICS_WORKER = "sft"
"""Its metrics records: `metrics/learner/sft-<seq>.jsonl` (the learner's kind, so reports read them alike)."""


@dataclass
class SFTRun:
    """What the SFT process holds fixed: the run, its data rows, the compiled step."""

    config: SFTStepConfig
    store: RunStore
    rows: RowStream
    vocab_size: int
    optimizer: Any
    mesh: Any
    train_step: Any = None
    last_checkpoint: int = 0


def main(config: SFTStepConfig) -> int:
    """Run SFT (module docstring); returns 0."""
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


def open_run(config: SFTStepConfig) -> SFTRun:
    """Phase 1: the tokenizer, the packed data, the run root (run.json written once), optimizer and mesh."""
    tokenizer = load_tokenizer(config.model.tokenizer)
    examples = load_examples(config, tokenizer)
    skipped = too_long(examples, config.seq_len)
    rows = RowStream(examples, config.seq_len, config.batch_size, config.seed, config.pack)
    n_tokens = sum(len(e.tokens) for e in rows.examples)
    n_loss = sum(sum(e.loss_mask) for e in rows.examples)
    logger.info("%d examples (%d longer than seq_len=%d skipped), %d tokens, %d of them response tokens; "
                "%d rows per pass (pack=%s)", len(rows.examples), skipped, config.seq_len, n_tokens, n_loss,
                len(rows.rows_of_pass(0)["tokens"]), config.pack)  # fmt: skip
    store = RunStore(config.store.run_root, config.store.storage_options or None)
    if mesh_lib.is_writer():
        store.put_json_if_absent(layout.RUN_CONFIG, {"kind": "sft", "config": encode_config(config)})
    return SFTRun(
        config=config,
        store=store,
        rows=rows,
        vocab_size=M.model_vocab_size(tokenizer),
        optimizer=L.build_optimizer(config.optimizer, config.num_train_steps),
        mesh=mesh_lib.build_mesh(config.mesh),
    )


def train(run: SFTRun, state: pf.LearnerState) -> tuple[pf.LearnerState, str]:
    """Phase 3: one optimizer update per step until num_train_steps or max_steps; returns (state, why)."""
    config, view = run.config, learner_view(run.config)
    run.train_step = make_mesh_train_step(
        SFTLoss(),
        run.optimizer,
        L.make_logprob_fn(config.model.compute_dtype, config.model.logprob_block_size, config.model.attention_backend),
        run.mesh,
        1,
    )
    metrics = MetricsWriter(run.store, StepKind.LEARNER, METRICS_WORKER)
    trained_here = 0
    try:
        while state.step < config.num_train_steps:
            if config.max_steps is not None and trained_here >= config.max_steps:
                return state, "max_steps"
            step = state.step + 1
            rows = run.rows.batch(step)
            t0 = time.monotonic()
            model, opt_state, m = run.train_step(state.model, state.opt_state, None, device_batch(rows, run.mesh))
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            train_s = time.monotonic() - t0
            state = pf.LearnerState(step, model, opt_state, state.parent)
            trained_here += 1
            record = {
                "step": step,
                "kind_of_step": "sft",
                "train_s": train_s,
                "tokens_per_s": float(rows["tokens"].size) / max(train_s, 1e-9),
                "response_tokens": float(rows["loss_mask"].sum()),
                "learning_rate": L.learning_rate_at(config.optimizer, config.num_train_steps, step - 1),
                **m,
            }
            metrics.log(record)
            logger.info("sft step %d/%d loss=%.4f grad_norm=%.3f tokens/s=%.0f", step, config.num_train_steps,
                        m["loss"], m["grad_norm"], record["tokens_per_s"])  # fmt: skip
            if config.policy_interval and step % config.policy_interval == 0:
                L.publish_policy(run.store, state, view)
            if step % config.checkpoint_interval == 0:
                pf.write_checkpoint(run.store, state, view, run.last_checkpoint + 1)
                run.last_checkpoint = step
                pf.collect_old_checkpoints(run.store, config.keep_checkpoints)
                metrics.flush()
    finally:
        metrics.flush()
    return state, "num_train_steps"


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.sft [--config_path F] [--field value …]`; returns the exit code."""
    from steps.cli import run_program

    return run_program(SFTStepConfig, main, argv, validate=validate_sft)
