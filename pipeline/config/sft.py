"""`SFTStepConfig`: the supervised warm start (`python -m steps.sft`, `make sft`).

Supervised fine-tuning writes its policies into a run root of its own (`policies/step-S/`, the same policy format
as the RL learner's), so an RL job starts from it with `model.init_policy: <that run root>`. The data come from
`source`, a registered choice: `files` (jsonl or parquet files of prompt/response pairs or chat messages, local or
any fsspec URL) or `reasoning_gym` (a reasoning-gym generator's questions with its reference answers rendered in
the answer format the RL lesson scores).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import draccus

from pipeline.config.base import ConfigError, at_least, default_choice, require
from pipeline.config.mesh import MeshConfig
from pipeline.config.model import ModelSpec
from pipeline.config.steps import StoreConfig
from pipeline.config.train import OptimizerSpec

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
"""File kinds `source: {type: files}` reads: JSON lines (`.jsonl`, `.json`) or parquet."""


@dataclass(frozen=True)
class SFTSourceConfig(draccus.ChoiceRegistry):
    """Where the SFT examples come from (a registered choice: `source: {type: files}` or `{type: reasoning_gym}`)."""

    default_choice_name = default_choice("files")


@SFTSourceConfig.register_subclass("files")
@dataclass(frozen=True)
class FilesSourceConfig(SFTSourceConfig):
    """Examples from jsonl or parquet files: one record per example, either `prompt` + `response` strings (loss
    on the response) or `messages`, a chat (a list of `{role, content}`; loss on every assistant turn, rendered
    with the tokenizer's chat template)."""

    paths: list[str] = field(default_factory=list)
    """The data files (local paths or fsspec URLs such as gs://bucket/sft.jsonl), read in this order."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for remote paths (e.g. gcsfs `endpoint_url`, `token`)."""
    prompt_field: str = "prompt"
    """Column (key) of the prompt text."""
    response_field: str = "response"
    """Column (key) of the response text."""
    messages_field: str = "messages"
    """Column (key) of a chat's messages; used when a record has it and no prompt."""

    def __post_init__(self) -> None:
        require(len(self.paths) > 0, "source.paths", list(self.paths), "must name at least one data file")
        for p in self.paths:
            require(
                str(p).endswith(DATA_SUFFIXES), "source.paths", p, f"a data file must end in one of {DATA_SUFFIXES}"
            )


@SFTSourceConfig.register_subclass("reasoning_gym")
@dataclass(frozen=True)
class ReasoningGymSourceConfig(SFTSourceConfig):
    """`n` training examples of a reasoning-gym lesson, drawn exactly as the RL lesson draws its train examples
    (`pipeline.environments.reasoning_gym_env.ReasoningGymEnv`: the same prompts, item seeds disjoint from its eval
    seeds, questions equal to an eval question redrawn), with the generator's reference answer rendered in the
    lesson's answer format as the response."""

    SECTION: ClassVar[str] = "source"

    task: str = ""
    """The reasoning-gym dataset name (e.g. chain_sum, basic_arithmetic, leg_counting)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The task's dataset config (difficulty settings such as min_terms, max_digits), as in the lesson."""
    n: int = 1000
    """Examples drawn."""
    env_args: dict[str, Any] = field(default_factory=dict)
    """The lesson's other `env_args` (seed, n_eval, level, prompt_template, answer_format, answer_tag): give the
    RL lesson's values, so prompts match and the lesson's eval problems stay held out."""
    draw_seed: int = 0
    """Seeds the draws of the `n` training item seeds."""
    answer_template: str | None = None
    """How the reference answer becomes the response (`{answer}` is replaced); None: from the lesson's
    `answer_format` (`tag`: `<answer_tag>{answer}</answer_tag>`, `boxed`: `\\boxed{{answer}}`, else `{answer}`)."""

    def __post_init__(self) -> None:
        require(bool(self.task), "source.task", self.task, "must name a reasoning-gym task")
        at_least(self, 1, "n")
        for key in ("task", "config", "tasks"):
            require(
                key not in self.env_args,
                f"source.env_args.{key}",
                self.env_args.get(key),
                "give it as source.task / source.config",
            )
        require(
            self.answer_template is None or "{answer}" in self.answer_template,
            "source.answer_template",
            self.answer_template,
            "needs {answer}",
        )

    def lesson_env_args(self) -> dict[str, Any]:
        """The `env_args` of the matching RL lesson (task, config and the rest)."""
        return {"task": self.task, "config": dict(self.config), **self.env_args}


@dataclass(frozen=True)
class SFTStepConfig:
    """`python -m steps.sft`: supervised fine-tuning on prompt/response examples, loss on response tokens only."""

    store: StoreConfig = field(default_factory=lambda: StoreConfig(run_root="runs/sft"))
    """The SFT run root: its `policies/` are what an RL job's `model.init_policy` names."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The model trained (from scratch, `model.hf_checkpoint` or `model.init_policy`) and the tokenizer; the RL
    job that starts from this run must use the same shape and tokenizer."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """AdamW and its learning-rate schedule (over `num_train_steps`)."""
    source: SFTSourceConfig = field(default_factory=SFTSourceConfig)
    """Where the examples come from (`files` or `reasoning_gym`)."""
    num_train_steps: int = 100
    """Optimizer steps; each takes `batch_size` packed rows (the data are repeated in new orders as needed)."""
    batch_size: int = 16
    """Rows per optimizer step."""
    seq_len: int = 128
    """Tokens per row; an example longer than this is skipped (counted in the log)."""
    pack: bool = True
    """Pack several examples per row (each its own attention segment with positions from 0); False: one per row."""
    chat: bool = False
    """Render prompt/response examples with the tokenizer's chat template (as a lesson with `chat: true` prompts);
    False: the prompt is the lesson's plain encoding (BOS + text) and the response ends with EOS."""
    seed: int = 0
    """Seeds the order of the examples (one shuffle per pass over the data)."""
    checkpoint_interval: int = 50
    """A full checkpoint (weights + optimizer state) every this many steps and at the end."""
    policy_interval: int = 0
    """A policy every this many steps (0: only the final one, and policy 0)."""
    keep_checkpoints: int = 2
    """Full checkpoints kept; older ones are garbage collected."""
    max_steps: int | None = None
    """Bounded mode: train at most this many steps in this process (checkpoint), then exit; a rerun continues."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh (data × fsdp × model), as the learner's."""

    def __post_init__(self) -> None:
        at_least(self, 1, "num_train_steps", "batch_size")
        at_least(self, 2, "seq_len")
        at_least(self, 1, "checkpoint_interval")
        at_least(self, 0, "policy_interval")
        at_least(self, 1, "keep_checkpoints")
        at_least(self, 1, "max_steps", or_null=True)


def validate_sft(c: SFTStepConfig) -> None:
    """Cross-field checks of the SFT step (before anything starts): rows fit the model, the data files exist, the
    reasoning-gym task is known. Every refusal is a ConfigError naming the field."""
    if c.seq_len > c.model.max_seq_len:
        raise ConfigError("seq_len", c.seq_len, f"must be <= model.max_seq_len ({c.model.max_seq_len})")
    source = c.source
    if isinstance(source, FilesSourceConfig):
        import fsspec

        for p in source.paths:
            fs, path = fsspec.core.url_to_fs(p, **source.storage_options)
            if not fs.exists(path):
                raise ConfigError("source.paths", p, "no such data file")
    elif isinstance(source, ReasoningGymSourceConfig):
        import importlib

        from pipeline.config.curriculum import ENV_TYPES

        # the class by its registered path, as every lesson's env_class is resolved: the config layer names the
        # environments and never imports them statically (pipeline.environments imports pipeline.config)
        module_name, _, class_name = ENV_TYPES["reasoning_gym"].rpartition(".")
        env_class = getattr(importlib.import_module(module_name), class_name)
        try:
            env_class.check_args(source.lesson_env_args())
        except ConfigError as e:
            raise ConfigError(f"source.{e.field}", e.value, str(e).split(": ", 1)[-1]) from None
