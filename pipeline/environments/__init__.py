"""Environments: the protocol (`base`), the sampling request they send (`generation`), loading from config
(`loading`), a scripted context for tests (`scripted`) and the built-in environments.

Built in (import by dotted path in `EnvConfig.env_class`):
`pipeline.environments.cats.CatsEnv`, `pipeline.environments.arithmetic.ArithmeticEnv`,
`pipeline.environments.exact_answer.ExactAnswerEnv`, `pipeline.environments.calculator.CalculatorEnv`,
`pipeline.environments.chat_calculator.ChatCalculatorEnv` (chat turns with a calculator function tool; `chat`).
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
    SampleSpec,
    Score,
    SingleTurnEnvironment,
    Tokenizer,
    rollout_from_completion,
    token_rewards_for,
)
from pipeline.environments.generation import NO_CONTROLS, GenerationRequest, SamplingControls
from pipeline.environments.loading import load_environment
from pipeline.environments.scripted import ScriptedContext

__all__ = [
    "NO_CONTROLS",
    "Completion",
    "EnvGroup",
    "EnvRollout",
    "Environment",
    "EnvironmentLoadError",
    "Example",
    "ExampleFailure",
    "GenerationRequest",
    "InferenceContext",
    "SampleResult",
    "SampleSpec",
    "SamplingControls",
    "Score",
    "ScriptedContext",
    "SingleTurnEnvironment",
    "Tokenizer",
    "load_environment",
    "rollout_from_completion",
    "token_rewards_for",
]
