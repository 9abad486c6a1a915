"""The JAX side of supervised fine-tuning (`steps.sft`): the loss module and the learner view of an SFT config.

The loss is the mean negative log-likelihood of the response tokens (token-level: Σ −log π(y_t)·m_t / Σ m_t over
the batch, m the loss mask that is 0 on prompt tokens), the maximum-likelihood objective of supervised fine-tuning
(Ouyang et al. 2022, "Training language models to follow instructions with human feedback", §3.5 SFT). It plugs
into the learner's own train step (`policy.sharding.make_mesh_train_step`: mesh, microbatches, the non-finite
guard) as a loss module, so SFT trains the same model code with the same optimizer as RL, and its checkpoints and
policies are the learner's (`policy.policy_format`), through a `LearnerStepConfig` view of the SFT config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import policy.losses.terms as T
from pipeline.config import LearnerCadence, LearnerStepConfig, LossConfig, RLOOLossConfig, TrainParams
from pipeline.config.sft import SFTStepConfig
from policy import mesh as mesh_lib
from policy.losses.batch import Batch
from policy.losses.modules import LogprobFn, LossFn

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
