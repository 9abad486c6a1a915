"""The on-policy distillation teacher (`loss.distill.teacher`): a frozen model the learner scores every sampled
token with, as it does with the KL reference (`policy.learner.load_reference` holds both in
`policy.losses.modules.FrozenModels`).

Computed on the learner rather than by the rollout workers into a rollout column: no extra bytes in rollout and
batch files, any sampler (dense, levanter, an OpenAI-compatible server) works unchanged, and `make replay`
reproduces the teacher's logprobs from the same weights (the train step stays a pure function of its inputs)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pipeline.config import LearnerStepConfig, ModelSpec
from pipeline.config.model import SHAPE_FIELDS
from pipeline.store.layout import policy_dir
from pipeline.store.teacher import resolve_teacher
from policy import model as M
from policy import policy_format as pf

logger = logging.getLogger("policy.teacher")


def teacher_spec(student: ModelSpec, hf_folder: str | None) -> ModelSpec:
    """The teacher's model spec: the student's for a policy of a run; for a Hugging Face folder, the student's
    family, tokenizer and dtypes with the folder's own shape (from its config.json)."""
    if hf_folder is None:
        return dataclasses.replace(student, lora=None, init_policy=None)
    shape_defaults = {name: getattr(ModelSpec, name) for name in SHAPE_FIELDS}
    return dataclasses.replace(student, **shape_defaults, hf_checkpoint=hf_folder, init_policy=None, lora=None)


def load_teacher(config: LearnerStepConfig, vocab_size: int) -> Any:
    """The frozen teacher model of `config.loss.distill` in `model.param_dtype`, or None when distillation is off.

    Raises ConfigError naming `loss.distill.teacher` when it names no teacher (`pipeline.store.teacher`), and the
    policy reader's errors (CheckpointError naming file and tensor) when its weights do not fit the student's
    shape or vocabulary."""
    distill = config.loss.distill
    if distill is None:
        return None
    source = resolve_teacher(distill.teacher, config.store.storage_options)
    spec = teacher_spec(config.model, source.hf_folder)
    if source.hf_folder is not None:
        logger.info("distillation teacher: Hugging Face folder %s", source.hf_folder)
        return M.build_model(spec, vocab_size)
    assert source.store is not None and source.step is not None
    logger.info("distillation teacher: %s", source.store.full_path(policy_dir(source.step)))
    return M.cast_params(pf.read_policy(source.store, source.step, spec, vocab_size), config.model.param_dtype)
