"""Every cross-field config check, in one place: one `validate_<step>` per step config, and `validate_job`.

Single-field checks stay in each dataclass's `__post_init__` (a value out of range is refused as the config is
built). What needs two fields or two sections (the sequence length against the model, the batch against the
sampling plan, an environment class that must import, an environment's data file that must exist) is checked here,
before any work starts; every refusal is a `ConfigError` naming the field (dotted path) and the value.

Environments: every lesson's environment class may define the classmethod `check_args(env_args)`
(`pipeline.environments.Environment.check_args`); its `ConfigError(<arg>, value, why)` is reported as
`curriculum.lessons.<id>.env.env_args.<arg>=<value>: <why>` by `validate_job`, `validate_rollout` and
`validate_evaluate`, so an error the environment would hit at start-up is found before anything starts and is never
restarted. The rollout and evaluate programs also build each lesson's environment at their start
(`pipeline.environments.start_checks.check_rollout_step` / `check_evaluate_step`, which call the validators here
first): one whose constructor raises is refused naming `curriculum.lessons.<id>.env` and the cause.

Who calls what, and nothing else does: `validate_job` when a job is built (`pipeline.jobs.job.RLJob`), and each
step program at its start (its `main`): `validate_learner` (`steps.learn`), `validate_batch_maker`
(`steps.make_batches`), `validate_rollout` (`steps.rollout`), `validate_evaluate` (`steps.evaluate`),
`validate_serve` (`steps.serve`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeline.config.base import ConfigError, at_least, in_range
from pipeline.config.mesh import MeshConfig
from pipeline.config.model import ModelSpec
from pipeline.config.train import CriticPPOLossConfig, TrainParams

if TYPE_CHECKING:
    from pipeline.config.curriculum import CurriculumConfig
    from pipeline.config.job import RLJobConfig
    from pipeline.config.programs import ServeConfig
    from pipeline.config.steps import BatchMakerStepConfig, EvaluateStepConfig, LearnerStepConfig, RolloutStepConfig

NEEDS_GROUPS = ("rloo", "grpo", "dr_grpo")
"""Advantage estimators whose groups of one have zero advantage."""


def check_seq_len_fits_model(train: TrainParams, model: ModelSpec) -> None:
    """Refuse `train.seq_len` longer than the model's context (`model.max_seq_len`)."""
    if train.seq_len > model.max_seq_len:
        raise ConfigError("train.seq_len", train.seq_len, f"must be <= model.max_seq_len ({model.max_seq_len})")


def validate_train(train: TrainParams) -> None:
    """Refuse training parameters whose fields do not fit together: batch rows of a fixed shape (`pad_multiple`
    divides `seq_len`), minibatches that split the batch, a replay buffer that holds a batch."""
    if train.batch_size % train.minibatches_per_slot:
        raise ConfigError(
            "train.minibatches_per_slot",
            train.minibatches_per_slot,
            f"must be >= 1 and divide train.batch_size={train.batch_size}",
        )
    if train.replay_buffer_capacity < train.batch_size:
        raise ConfigError(
            "train.replay_buffer_capacity",
            train.replay_buffer_capacity,
            f"must be >= train.batch_size={train.batch_size}",
        )
    if train.pad_multiple > train.seq_len:
        raise ConfigError("train.pad_multiple", train.pad_multiple, f"must be in [1, train.seq_len={train.seq_len}]")
    if train.seq_len % train.pad_multiple:
        raise ConfigError(
            "train.pad_multiple",
            train.pad_multiple,
            f"must divide train.seq_len={train.seq_len} (rows are seq_len long)",
        )


def check_critic(loss: Any, train: TrainParams, model: ModelSpec) -> None:
    """Critic PPO (`loss.type: ppo_critic`) trains a value head beside the full policy (any number of updates per
    slot: its GAE targets and value clip are to the critic before the slot's first update): refuse LoRA."""
    if not isinstance(loss, CriticPPOLossConfig):
        return
    if model.lora is not None:
        raise ConfigError("model.lora", model.lora, "is not supported with loss.type ppo_critic (the value head)")


def validate_learner(c: LearnerStepConfig) -> None:
    """Cross-field checks of the learner step's config (`steps.learn` at its start)."""
    validate_train(c.train)
    check_critic(c.loss, c.train, c.model)
    check_seq_len_fits_model(c.train, c.model)
    check_learner_layout(c.train, c.model, c.mesh, "mesh")
    check_init_policy(c.model, c.store.storage_options)
    check_teacher(c.loss, c.model, c.store.storage_options)


def check_learner_layout(train: TrainParams, model: ModelSpec, mesh: MeshConfig, mesh_field: str) -> None:
    """Refuse a batch, microbatch or model shape the learner's mesh cannot split evenly.

    Checked where the sizes are known from the config alone (an axis of -1 is checked once devices are known)."""
    mb = train.microbatch_size
    minibatch = train.batch_size // train.minibatches_per_slot
    if mb is not None and minibatch % mb:
        where = (
            f"train.batch_size={train.batch_size}"
            if train.minibatches_per_slot == 1
            else f"the minibatch of {minibatch} rows (train.batch_size / train.minibatches_per_slot)"
        )
        raise ConfigError("train.microbatch_size", mb, f"must divide {where}")
    rows_per_pass = mb if mb is not None else minibatch
    data_ways = mesh.data * mesh.fsdp if mesh.data > 0 and mesh.fsdp > 0 else max(mesh.data, 1)
    if rows_per_pass % data_ways:
        divisible = (
            f"be divisible by the learner's data-parallel ways ({mesh_field}.data × {mesh_field}.fsdp = {data_ways})"
        )
        if mb is not None:
            raise ConfigError("train.microbatch_size", mb, f"must {divisible}")
        if train.minibatches_per_slot > 1:
            raise ConfigError(
                "train.minibatches_per_slot",
                train.minibatches_per_slot,
                f"leaves minibatches of {minibatch} rows; they must {divisible}",
            )
        raise ConfigError("train.batch_size", train.batch_size, f"must {divisible}")
    if mesh.model > 1 and model.lora is not None:
        raise ConfigError(
            "model.lora", model.lora, f"is not supported with tensor parallelism ({mesh_field}.model={mesh.model})"
        )
    if mesh.model > 1:
        for name in ("num_heads", "num_kv_heads", "intermediate_dim"):
            value = getattr(model, name)
            if value % mesh.model:
                raise ConfigError(
                    f"model.{name}", value, f"must be divisible by {mesh_field}.model={mesh.model} (tensor parallel)"
                )


def validate_batch_maker(c: BatchMakerStepConfig) -> None:
    """Checks of the BatchMaker step's config (`steps.make_batches` at its start): bounded mode, row shape."""
    if c.max_batches is not None and c.max_batches < 1:
        raise ConfigError("max_batches", c.max_batches, "must be >= 1 or null")
    validate_train(c.train)


def validate_rollout(c: RolloutStepConfig) -> None:
    """Cross-field checks of a rollout worker's config (`steps.rollout` at its start): the sampler's sequences
    fit the model, and every lesson's completions leave room for a prompt in a batch row."""
    check_inference_fits_model(c.inference, c.model)
    validate_train(c.train)
    _check_lessons_fit_rows(c.curriculum, c.train)
    check_environment_classes(c.curriculum)
    check_environment_args(c.curriculum)


def validate_evaluate(c: EvaluateStepConfig) -> None:
    """Cross-field checks of the evaluator's config (`steps.evaluate` at its start): the sampler's sequences fit
    the model, and every lesson's environment class imports and accepts its `env_args` (`check_environment_args`)."""
    check_inference_fits_model(c.inference, c.model)
    check_environment_classes(c.curriculum)
    check_environment_args(c.curriculum)


def validate_serve(c: ServeConfig) -> None:
    """Checks of `steps.serve`'s config at its start: a run root, a policy step and port in range, at least one
    sequence, and a bearer token (`token`, or the variable `token_env` names) for a host that is not loopback."""
    from pipeline.process.ports import is_loopback

    if not c.run_root:
        raise ConfigError("run_root", c.run_root, "is required: the run root whose committed policy is served")
    at_least(c, 0, "policy_step", or_null=True)
    in_range(c, 0, 65535, "port")
    at_least(c, 1, "max_seqs")
    if not is_loopback(c.host) and not c.bearer_token():
        raise ConfigError("host", c.host, f"is not loopback: give --token or set {c.token_env}")


def check_init_policy(model: ModelSpec, storage_options: dict[str, Any]) -> None:
    """Refuse a `model.init_policy` that names no committed policy (or one of another tokenizer)."""
    if model.init_policy:
        from pipeline.store.init_policy import check_init_policy as check

        check(model, storage_options)


def check_teacher(loss: Any, model: ModelSpec, storage_options: dict[str, Any]) -> None:
    """Refuse a `loss.distill.teacher` that names no HF folder or committed policy (or one of another tokenizer)."""
    if getattr(loss, "distill", None) is not None:
        from pipeline.store.teacher import check_teacher as check

        check(loss, model.tokenizer, storage_options)


def check_inference_fits_model(inference: Any, model: ModelSpec) -> None:
    """The dense sampler's `inference.max_seq_len` must not exceed `model.max_seq_len` (positions the model has)."""
    limit = getattr(inference, "max_seq_len", None)
    if limit is not None and limit > model.max_seq_len:
        raise ConfigError(
            "inference.max_seq_len", limit, f"exceeds model.max_seq_len={model.max_seq_len} (the model's positions)"
        )


def validate_job(c: RLJobConfig, *, check_environments: bool = True) -> None:
    """Cross-field checks of a whole job, before any process starts; raises ConfigError naming the field.

    With `check_environments`, every lesson's environment class must import and accept its `env_args`
    (`check_environment_args`).
    """
    if c.restart_backoff_s > c.restart_backoff_max_s:
        raise ConfigError(
            "restart_backoff_s",
            c.restart_backoff_s,
            f"must be in [0, restart_backoff_max_s={c.restart_backoff_max_s}]",
        )
    validate_train(c.train)
    check_critic(c.loss, c.train, c.model)
    check_seq_len_fits_model(c.train, c.model)
    check_inference_fits_model(c.inference, c.model)
    check_learner_layout(c.train, c.model, c.learner.mesh, "learner.mesh")
    _check_lessons_fit_rows(c.curriculum, c.train)
    for lesson_id in c.curriculum.lessons:
        _check_lesson_fits(c, lesson_id)
    check_init_policy(c.model, c.store.storage_options)
    check_teacher(c.loss, c.model, c.store.storage_options)
    if check_environments:
        check_environment_classes(c.curriculum)
        check_environment_args(c.curriculum)


def check_environment_classes(curriculum: CurriculumConfig) -> None:
    """Refuse (ConfigError naming `curriculum.lessons.<id>.env.env_class`) a lesson whose environment class does
    not import: the same one line, exit 2, through the job and through each step program."""
    for lesson_id, lesson in curriculum.lessons.items():
        check_importable(f"curriculum.lessons.{lesson_id}.env.env_class", lesson.env.env_class)


def _check_lesson_fits(c: RLJobConfig, lesson_id: str) -> None:
    """A lesson's sampling plan must be able to fill batches of `train.batch_size` rows of `train.seq_len`."""
    t = c.train
    sp = c.curriculum.sampling_for(lesson_id)
    if t.advantage_estimator in NEEDS_GROUPS and t.filter_zero_variance and sp.n_generations_per_prompt < 2:
        raise ConfigError(
            f"curriculum.lessons.{lesson_id}.sampling_params.n_generations_per_prompt",
            sp.n_generations_per_prompt,
            "groups of one have zero advantage and are all filtered: batches could never fill "
            f"(train.batch_size={t.batch_size}); use >= 2",
        )
    produced = sp.n_prompts * sp.n_generations_per_prompt * t.max_samples_per_rollout
    window = (t.max_lag + 1) * c.num_rollout_workers * max(1, c.pacing.max_steps_ahead)
    if not t.pack and produced * window < t.batch_size:
        raise ConfigError(
            "train.batch_size",
            t.batch_size,
            f"lesson {lesson_id!r}: n_prompts×n_generations×max_samples_per_rollout = {produced} rows per write, "
            f"and the staleness window (max_lag+1={t.max_lag + 1}) × workers × steps ahead allows {window} writes "
            "per batch: the batch cannot be filled",
        )


def _check_lessons_fit_rows(curriculum: CurriculumConfig, train: TrainParams) -> None:
    """Every lesson's completions (`max_tokens`) must leave room for a prompt in a batch row of `train.seq_len`."""
    for lesson_id in curriculum.lessons:
        sp = curriculum.sampling_for(lesson_id)
        if sp.max_tokens >= train.seq_len:
            raise ConfigError(
                f"curriculum.lessons.{lesson_id}.sampling_params.max_tokens",
                sp.max_tokens,
                f"leaves no room for a prompt in train.seq_len={train.seq_len}",
            )


def check_importable(field_name: str, dotted: str) -> None:
    """Refuse a dotted class path (`field_name`) whose module does not import or has no such class."""
    module_name, _, cls_name = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(field_name, dotted, f"module cannot be imported ({e})") from None
    if not hasattr(module, cls_name):
        raise ConfigError(field_name, dotted, f"module {module_name!r} has no class {cls_name!r}")


def check_environment_args(curriculum: CurriculumConfig) -> None:
    """Run each lesson's environment `check_args(env_args)` hook (see the module docstring); a refusal becomes a
    ConfigError naming `curriculum.lessons.<id>.env.env_args.<arg>`. A class that does not import is skipped here
    (`check_environment_classes` refuses it)."""
    for lesson_id, lesson in curriculum.lessons.items():
        module_name, _, cls_name = lesson.env.env_class.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name, None)
        except ImportError:
            continue
        check = getattr(cls, "check_args", None)
        if not callable(check):
            continue
        try:
            check(dict(lesson.env.env_args))
        except ConfigError as e:
            where = f"curriculum.lessons.{lesson_id}.env.env_args.{e.field}"
            why = str(e).removeprefix(f"{e.field}={e.value!r}: ")
            raise ConfigError(where, e.value, why) from None
