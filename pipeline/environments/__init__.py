"""Environments: the protocol (`base`), loading from config (`loading`), a scripted context for tests
(`scripted`) and the built-in environments.

Built in (import by dotted path in `EnvConfig.env_class`):
`pipeline.environments.cats.CatsEnv`, `pipeline.environments.arithmetic.ArithmeticEnv`,
`pipeline.environments.exact_answer.ExactAnswerEnv`, `pipeline.environments.calculator.CalculatorEnv`.
"""

from pipeline.environments.base import (
    Completion,
    EnvGroup,
    Environment,
    EnvironmentLoadError,
    EnvRollout,
    Example,
    ExampleFailure,
    InferenceContext,
    SampleResult,
    Score,
    SingleTurnEnvironment,
    Tokenizer,
    rollout_from_completion,
    token_rewards_for,
)
from pipeline.environments.loading import load_environment
from pipeline.environments.scripted import ScriptedContext

__all__ = [
    "Completion",
    "EnvGroup",
    "EnvRollout",
    "Environment",
    "EnvironmentLoadError",
    "Example",
    "ExampleFailure",
    "InferenceContext",
    "SampleResult",
    "Score",
    "ScriptedContext",
    "SingleTurnEnvironment",
    "Tokenizer",
    "load_environment",
    "rollout_from_completion",
    "token_rewards_for",
]
