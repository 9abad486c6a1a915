"""The configuration tree of rlpipe: frozen draccus dataclasses, validated when built.

Every error names the offending field (dotted path) and its value. Configs are composed,
not subclassed; a choice between real variants (loss modules, job backends) is a registered subclass.
Cross-field checks live in `pipeline.config.validate` (one `validate_<step>` per step config, `validate_job`).
The job config is `pipeline.config.job.RLJobConfig`; the parameter objects it shares with the step configs are in
`pipeline.config.pacing`; the run.json contract is `pipeline.run_contract`, outside this package (it reads and
writes the run root); `python -m pipeline.config.reference` writes docs/reference/configuration.md from these
dataclasses.
Importable without JAX: the JAX side (`policy/`) turns these into levanter objects. One module per
area; every name is re-exported here, so `from pipeline.config import X` is the way to import from outside the
package (its own modules import their siblings directly, never this package).
"""

from pipeline.config.backend import JobBackendConfig, LocalBackendConfig, RayBackendConfig, StepResources
from pipeline.config.base import ConfigError, require
from pipeline.config.curriculum import (
    CurriculumConfig,
    EnvConfig,
    LessonConfig,
    LessonDependency,
    SamplingParams,
    find_cycle,
)
from pipeline.config.job import RLJobConfig
from pipeline.config.mesh import DistributedConfig, LearnerPlacement, MeshConfig
from pipeline.config.model import (
    INFERENCE_BACKENDS,
    MODEL_FAMILIES,
    DenseInferenceConfig,
    InferenceConfig,
    LevanterInferenceConfig,
    LoraSpec,
    ModelSpec,
    OpenAIInferenceConfig,
    ServerInferenceConfig,
)
from pipeline.config.overrides import dump_yaml, resolve_overrides
from pipeline.config.pacing import LearnerCadence, PollingConfig, RolloutPacing
from pipeline.config.programs import ExportConfig, ReplayConfig, ServeConfig
from pipeline.config.rescore import RescoreStepConfig
from pipeline.config.retention import GcStepConfig, RetentionConfig
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
    CISPOLossConfig,
    CriticPPOLossConfig,
    DistillConfig,
    GSPOLossConfig,
    LossConfig,
    OptimizerSpec,
    PPOClipLossConfig,
    RLOOLossConfig,
    TrainParams,
)
from pipeline.config.validate import (
    check_importable,
    check_learner_layout,
    validate_batch_maker,
    validate_evaluate,
    validate_job,
    validate_learner,
    validate_rollout,
    validate_serve,
    validate_train,
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
    "CISPOLossConfig",
    "ConfigError",
    "CriticPPOLossConfig",
    "CurriculumConfig",
    "DenseInferenceConfig",
    "DistillConfig",
    "DistributedConfig",
    "EnvConfig",
    "EvaluateStepConfig",
    "ExportConfig",
    "GSPOLossConfig",
    "GcStepConfig",
    "InferenceConfig",
    "JobBackendConfig",
    "JsonTrackerConfig",
    "LearnerCadence",
    "LearnerPlacement",
    "LearnerStepConfig",
    "LessonConfig",
    "LessonDependency",
    "LevanterInferenceConfig",
    "LocalBackendConfig",
    "LoraSpec",
    "LossConfig",
    "MeshConfig",
    "ModelSpec",
    "NoTrackerConfig",
    "OpenAIInferenceConfig",
    "OptimizerSpec",
    "PPOClipLossConfig",
    "PollingConfig",
    "RLJobConfig",
    "RLOOLossConfig",
    "RayBackendConfig",
    "ReplayConfig",
    "RescoreStepConfig",
    "RetentionConfig",
    "RolloutPacing",
    "RolloutStepConfig",
    "SamplingParams",
    "ServeConfig",
    "ServerInferenceConfig",
    "StepResources",
    "StoreConfig",
    "TensorboardTrackerConfig",
    "TrackerConfig",
    "TrainParams",
    "WandbTrackerConfig",
    "check_importable",
    "check_learner_layout",
    "dump_yaml",
    "find_cycle",
    "require",
    "resolve_overrides",
    "validate_batch_maker",
    "validate_evaluate",
    "validate_job",
    "validate_learner",
    "validate_rollout",
    "validate_serve",
    "validate_train",
]
