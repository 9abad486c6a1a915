"""The JAX side of supervised fine-tuning (`steps.sft`): the loss module, the learner view of an SFT config, and
the run's phases (`open_run`: data, run root, optimizer, mesh; `train`: the step loop) that `steps.sft.main` calls.

The loss is the mean negative log-likelihood of the response tokens (token-level: Σ −log π(y_t)·m_t / Σ m_t over
the batch, m the loss mask that is 0 on prompt tokens), the maximum-likelihood objective of supervised fine-tuning
(Ouyang et al. 2022, "Training language models to follow instructions with human feedback", §3.5 SFT). It plugs
into the learner's own train step (`policy.sharding.make_mesh_train_step`: mesh, microbatches, the non-finite
guard) as a loss module, so SFT trains the same model code with the same optimizer as RL, and its checkpoints and
policies are the learner's (`policy.policy_format`), through a `LearnerStepConfig` view of the SFT config.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import policy.losses.terms as T
from pipeline.config import LearnerCadence, LearnerStepConfig, LossConfig, RLOOLossConfig, TrainParams
from pipeline.config.sft import SFTStepConfig
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
from policy.losses.batch import Batch
from policy.losses.modules import LogprobFn, LossFn
from policy.sharding import make_mesh_train_step

logger = logging.getLogger("steps.sft")
"""The program's logger (its lines read `steps.sft` wherever the code that logs them lives)."""

Array = jax.Array


@dataclasses.dataclass
class SFTLoss:
    """Token-level negative log-likelihood of the loss-masked (response) tokens; no reference model.

    `config` is a token-aggregation loss config: the learner's microbatch accumulation weighs pieces by their
    loss tokens (`policy.sharding.aggregation_weight`), which makes the accumulated loss the slot's mean."""

    config: LossConfig = dataclasses.field(default_factory=RLOOLossConfig)

    @property
    def needs_reference(self) -> bool:
        return False

    def build(self, reference_model: Any | None) -> Any | None:
        return None

    def objective(
        self,
        logp: Array,
        batch: Batch,
        logp_ref: Array | None,
        entropy: Array | None = None,
        logp_teacher: Array | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """(mean NLL over loss tokens, metrics: loss, nll, loss_tokens and entropy); SFT has no reference or
        teacher term, so `logp_ref` and `logp_teacher` are ignored."""
        mask = batch.loss_mask.astype(jnp.float32)
        nll = T.token_mean(-logp, mask)
        metrics = {"loss": nll, "nll": nll, "loss_tokens": jnp.sum(mask)}
        if entropy is not None:
            metrics["entropy"] = T.token_mean(entropy, mask)
        return nll, metrics

    def create_loss_fn(self, reference_model: Any | None, logprob_fn: LogprobFn) -> LossFn:
        def loss_fn(model: Any, reference: Any, batch: Batch) -> tuple[Array, dict[str, Array]]:
            logp, entropy = logprob_fn(model, batch)
            return self.objective(logp, batch, None, jax.lax.stop_gradient(entropy))

        return loss_fn


def learner_view(config: SFTStepConfig) -> LearnerStepConfig:
    """The `LearnerStepConfig` whose model, optimizer, batch shape, mesh and cadence are the SFT config's: what the
    learner's init, checkpoint and policy functions read (`policy.learner`, `policy.policy_format`)."""
    return LearnerStepConfig(
        store=config.store,
        model=config.model,
        train=TrainParams(
            num_train_steps=config.num_train_steps,
            batch_size=config.batch_size,
            seq_len=config.seq_len,
            replay_buffer_capacity=max(config.batch_size, 1),
            seed=config.seed,
        ),
        optimizer=config.optimizer,
        cadence=LearnerCadence(
            policy_interval=config.policy_interval or config.num_train_steps,
            checkpoint_interval=config.checkpoint_interval,
        ),
        keep_checkpoints=config.keep_checkpoints,
        max_steps=config.max_steps,
        mesh=config.mesh,
    )


def device_batch(rows: dict[str, np.ndarray], lm: mesh_lib.LearnerMesh) -> Batch:
    """A learner `Batch` on mesh `lm` from packed SFT rows (tokens, segment_ids, position_ids, loss_mask): no
    advantages or sampler logprobs (zeros), temperature 1, `seq_index` numbered per (row, segment)."""
    B, S = rows["tokens"].shape
    seg = rows["segment_ids"]
    r = np.arange(B, dtype=np.int32)[:, None]
    host = {
        "tokens": rows["tokens"].astype(np.int32),
        "segment_ids": seg.astype(np.int32),
        "position_ids": rows["position_ids"].astype(np.int32),
        "loss_mask": rows["loss_mask"].astype(np.float32),
        "advantages": np.zeros((B, S), np.float32),
        "generator_logprobs": np.zeros((B, S), np.float32),
        "temperature": np.ones((B, S), np.float32),
        "truncated": np.zeros((B, S), bool),
        "seq_index": np.where(seg >= 0, r * S + seg, B * S).astype(np.int32),
    }
    start, stop = mesh_lib.process_rows(B)
    local = {k: v[start:stop] for k, v in host.items()}
    return Batch(**mesh_lib.global_batch(local, lm, B))


# ---------------------------------------------------------------------------------------------
# the SFT run: its phases, called by `steps.sft.main`
# ---------------------------------------------------------------------------------------------

METRICS_WORKER = "sft"
"""Its metrics records: `metrics/learner/sft-<seq>.jsonl` (the learner's kind, so reports read them alike)."""


@dataclasses.dataclass
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
