"""The configuration tree of rlpipe: frozen draccus dataclasses, validated when built.

Every error names the offending field (dotted path) and its value. Configs are composed,
not subclassed; a choice between real variants (loss modules) is a registered subclass.
Importable without JAX: the JAX side (`policy/`) turns these into levanter objects. One module per
area; every name is re-exported here, so `from pipeline.config import X` is the way to import.
"""

from pipeline.config.base import ConfigError, require
from pipeline.config.curriculum import (
    CurriculumConfig,
    EnvConfig,
    LessonConfig,
    LessonDependency,
    SamplingParams,
    find_cycle,
)
from pipeline.config.model import (
    INFERENCE_BACKENDS,
    MODEL_FAMILIES,
    InferenceConfig,
    ModelSpec,
)
from pipeline.config.steps import (
    WANDB_MODES,
    BatchMakerStepConfig,
    EvaluateStepConfig,
    JsonTrackerConfig,
    LearnerStepConfig,
    NoTrackerConfig,
    RolloutStepConfig,
    StoreConfig,
    TensorboardTrackerConfig,
    TrackerConfig,
    WandbTrackerConfig,
)
from pipeline.config.train import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    OVERLONG_RULES,
    LossConfig,
    OptimizerSpec,
    PPOClipLossConfig,
    RLOOLossConfig,
    TrainParams,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "INFERENCE_BACKENDS",
    "KL_ESTIMATORS",
    "MODEL_FAMILIES",
    "OVERLONG_RULES",
    "WANDB_MODES",
    "BatchMakerStepConfig",
    "ConfigError",
    "CurriculumConfig",
    "EnvConfig",
    "EvaluateStepConfig",
    "InferenceConfig",
    "JsonTrackerConfig",
    "LearnerStepConfig",
    "LessonConfig",
    "LessonDependency",
    "LossConfig",
    "ModelSpec",
    "NoTrackerConfig",
    "OptimizerSpec",
    "PPOClipLossConfig",
    "RLOOLossConfig",
    "RolloutStepConfig",
    "SamplingParams",
    "StoreConfig",
    "TensorboardTrackerConfig",
    "TrackerConfig",
    "TrainParams",
    "WandbTrackerConfig",
    "find_cycle",
    "require",
]
