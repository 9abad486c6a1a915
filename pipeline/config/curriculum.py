"""Sampling parameters, environments, lessons and the curriculum DAG."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.config.base import ConfigError, require

# ---------------------------------------------------------------------------------------
# sampling and curriculum
# ---------------------------------------------------------------------------------------


def sampling_controls_problem(top_p: float, top_k: int, min_p: float) -> tuple[str, float, str] | None:
    """(field, value, why) of the first of top-p / top-k / min-p outside its range (`top_p` in (0, 1], `top_k >= 0`,
    `min_p` in [0, 1]), or None when all three are valid: the one rule for a lesson's sampling config and for every
    sampling request (`pipeline.environments.generation.SamplingControls`)."""
    if not 0.0 < top_p <= 1.0:
        return "top_p", top_p, "must be in (0, 1]"
    if top_k < 0:
        return "top_k", top_k, "must be >= 0 (0: off)"
    if not 0.0 <= min_p <= 1.0:
        return "min_p", min_p, "must be in [0, 1]"
    return None


@dataclass(frozen=True)
class SamplingParams:
    """How rollouts are sampled from an environment."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    n_prompts: int = 8
    """Prompts (examples) per rollout write."""
    n_generations_per_prompt: int = 4
    """Completions per prompt: the RLOO/GRPO group size."""
    max_tokens: int = 32
    """Maximum new tokens per completion (per turn in multi-turn environments)."""
    stop_tokens: tuple[int, ...] | None = None
    """Token ids that end a completion (the stop token is kept in the output); None: the tokenizer's EOS."""
    top_p: float = 1.0
    """Nucleus sampling: only the most probable tokens whose mass reaches top_p (1: off)."""
    top_k: int = 0
    """Only the top_k most probable tokens (0: off)."""
    min_p: float = 0.0
    """Only tokens with probability >= min_p times the most probable one's (0: off)."""

    def __post_init__(self) -> None:
        require(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        require(self.n_prompts >= 1, "n_prompts", self.n_prompts, "must be >= 1")
        require(
            self.n_generations_per_prompt >= 1,
            "n_generations_per_prompt",
            self.n_generations_per_prompt,
            "must be >= 1",
        )
        require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        if problem := sampling_controls_problem(self.top_p, self.top_k, self.min_p):
            raise ConfigError(*problem)


ENV_TYPES: dict[str, str] = {
    "reasoning_gym": "pipeline.environments.reasoning_gym_env.ReasoningGymEnv",
    "exact_answer": "pipeline.environments.exact_answer.ExactAnswerEnv",
    "arithmetic": "pipeline.environments.arithmetic.ArithmeticEnv",
    "cats": "pipeline.environments.cats.CatsEnv",
    "agent": "pipeline.environments.agent.AgentEnv",
    "judged": "pipeline.environments.judged.JudgedEnv",
    "verifiers": "pipeline.environments.verifiers_env.VerifiersEnv",
}
"""Short names accepted in `env_class` for the built-in environments (the value is the class path)."""


@dataclass(frozen=True)
class EnvConfig:
    """An environment named by dotted class path plus keyword arguments."""

    env_class: str = "pipeline.environments.cats.CatsEnv"
    """Dotted path `package.module.Class` of an `Environment` subclass, or a short name of `ENV_TYPES`
    (`reasoning_gym`, `exact_answer`, `arithmetic`, `cats`, `agent`, `judged`, `verifiers`), replaced by its class
    path."""
    env_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the class."""

    def __post_init__(self) -> None:
        if self.env_class in ENV_TYPES:
            object.__setattr__(self, "env_class", ENV_TYPES[self.env_class])
        require(
            "." in self.env_class and not self.env_class.startswith("."),
            "env_class",
            self.env_class,
            f"must be a dotted path like 'package.module.ClassName' or one of {sorted(ENV_TYPES)}",
        )


@dataclass(frozen=True)
class LessonDependency:
    """A lesson unlocks only when `dependency_id` reached `reward_threshold` and plateaued."""

    dependency_id: str
    """The lesson this one waits for (a key of `curriculum.lessons`)."""
    reward_threshold: float = 0.8
    """Eval success the dependency must reach (and plateau at) before this lesson unlocks."""

    def __post_init__(self) -> None:
        require(bool(self.dependency_id), "dependencies.dependency_id", self.dependency_id, "must be non-empty")
        require(
            0.0 <= self.reward_threshold <= 1.0,
            f"dependencies.{self.dependency_id}.reward_threshold",
            self.reward_threshold,
            "must be in [0, 1]",
        )


@dataclass(frozen=True)
class LessonConfig:
    """One lesson of the curriculum."""

    lesson_id: str
    """The lesson's name; equals its key in `curriculum.lessons` and names its eval files (one path component)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment that gives this lesson's prompts and rewards."""
    dependencies: list[LessonDependency] = field(default_factory=list)
    """Lessons that must reach their reward threshold first (none: unlocked from the start)."""
    start_threshold: float = 0.0
    """Eval success needed before an unlocked lesson becomes active (is sampled for training)."""
    stop_threshold: float = 1.0
    """Eval success at which a plateaued lesson graduates (stops being sampled, except the floor)."""
    plateau_window: int = 50
    """Number of most recent rewards the plateau regression looks at."""
    plateau_threshold: float = 0.01
    """|slope| × window below which the lesson counts as plateaued."""
    sampling_params: SamplingParams | None = None
    """Per-lesson training sampling; None: the curriculum's default."""
    eval_sampling_params: SamplingParams | None = None
    """Per-lesson evaluation sampling; None: the curriculum's eval default."""
    chat: bool = False
    """Chat-formatted lesson (instruct models): prompts are rendered with the tokenizer's chat template (a user
    message, then the generation prompt) in rollouts and evaluations; the tokenizer must have a chat template."""

    def __post_init__(self) -> None:
        require(bool(self.lesson_id), "lesson_id", self.lesson_id, "must be non-empty")
        from pipeline.store.layout import check_component

        try:
            check_component(self.lesson_id, "lesson_id")  # it names eval files
        except ValueError as e:
            raise ConfigError(f"lessons.{self.lesson_id}.lesson_id", self.lesson_id, str(e)) from None
        for name in ("start_threshold", "stop_threshold"):
            v = getattr(self, name)
            require(0.0 <= v <= 1.0, f"lessons.{self.lesson_id}.{name}", v, "must be in [0, 1]")
        require(
            self.plateau_window >= 2,
            f"lessons.{self.lesson_id}.plateau_window",
            self.plateau_window,
            "must be >= 2",
        )
        require(
            self.plateau_threshold >= 0.0,
            f"lessons.{self.lesson_id}.plateau_threshold",
            self.plateau_threshold,
            "must be >= 0",
        )


@dataclass(frozen=True)
class CurriculumConfig:
    """Lessons, their dependency DAG, and how often they are evaluated."""

    lessons: dict[str, LessonConfig] = field(default_factory=dict)
    """The lessons by id (at least one; some lesson without dependencies must have start_threshold 0)."""
    eval_frequency: int = 10
    """Full evaluation of every lesson every this many policy steps (0: never)."""
    eval_n_examples: int = 16
    """Examples per lesson in a full evaluation."""
    eval_pass_k: int = 0
    """The k of pass@k in evaluation summaries (Chen et al. 2021's unbiased estimator from the n samples of each
    problem, n = the lesson's eval `n_generations_per_prompt`); 0: k = n. At most every lesson's n."""
    micro_eval_frequency: int = 0
    """Micro-evaluation (0: never): every this many of its rollout writes, a rollout worker evaluates the lesson it
    just sampled with the lesson's eval sampling params. Logged only: a `micro_eval` record in `metrics/rollout`
    (and a line in the worker's log); no evaluation file, and the curriculum, the report and the trackers do not
    read it (full evaluations, `eval_frequency`, steer the curriculum)."""
    micro_eval_n_examples: int = 4
    """Examples in one micro-evaluation (>= 1)."""
    minimum_sample_probability: float = 0.02
    """Floor of every active or graduated lesson's sampling probability (graduated lessons get exactly this)."""
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    """Training sampling of every lesson without its own `sampling_params`."""
    eval_sampling: SamplingParams = field(
        default_factory=lambda: SamplingParams(temperature=0.0, n_prompts=16, n_generations_per_prompt=1)
    )
    """Evaluation sampling of every lesson without its own `eval_sampling_params` (greedy by default)."""
    seed: int = 0
    """Recorded with the run's curriculum (part of its contract); no step draws from it today (lesson draws use each
    rollout worker's `seed`)."""
    skip_after: int = 0
    """Difficulty-aware prompt sampling (0: off). The curriculum records, per lesson and prompt (example id), how
    many of the prompt's newest training draws in a row had no reward spread with the same reward each time (solved
    by every sample, or by none); once that streak reaches `skip_after`, rollout workers stop drawing the prompt
    (except for re-tests, `retest_rate`): its groups would be dropped `zero_variance` anyway. A draw with spread
    clears the prompt's record, so a re-tested prompt that is learnable again comes back. Folded from committed
    files like every curriculum statistic, so changing it on an existing run needs its `curriculum/` rebuilt. Only
    helps where prompts recur (a fixed prompt list or dataset); generated tasks with a fresh id per draw (e.g.
    reasoning-gym's item seeds) rarely see a prompt twice unless drawn from a finite pool (a reasoning-gym lesson's
    `env_args.n_train_items`). A pool much smaller than the run's draws is mostly skipped after a while, and then
    the re-tests (`retest_rate` of every draw that hits a skipped prompt) make up much of what is drawn."""
    retest_rate: float = 0.1
    """With `skip_after` > 0: the probability that a training draw keeps a skipped prompt anyway (a re-test), so a
    prompt the policy has come to fail, or has stopped failing, is seen again. In [0, 1]."""
    max_tracked_prompts: int = 1024
    """With `skip_after` > 0: at most this many prompt records per lesson in the curriculum state (only prompts
    whose newest draws had no reward spread are recorded); beyond it the least recently drawn records are dropped
    (their prompts are drawn again). Bounds the state files' size."""

    def __post_init__(self) -> None:
        require(len(self.lessons) > 0, "curriculum.lessons", self.lessons, "must hold at least one lesson")
        for key, lesson in self.lessons.items():
            require(
                key == lesson.lesson_id,
                f"curriculum.lessons.{key}.lesson_id",
                lesson.lesson_id,
                f"must equal its key {key!r}",
            )
            for dep in lesson.dependencies:
                require(
                    dep.dependency_id in self.lessons,
                    f"curriculum.lessons.{key}.dependencies",
                    dep.dependency_id,
                    "names an unknown lesson",
                )
        cycle = find_cycle({k: [d.dependency_id for d in v.dependencies] for k, v in self.lessons.items()})
        if cycle:
            raise ConfigError(
                f"curriculum.lessons.{cycle[0]}.dependencies",
                cycle[0],
                "dependency cycle: " + " -> ".join(cycle),
            )
        require(
            0.0 <= self.minimum_sample_probability * len(self.lessons) <= 1.0,
            "curriculum.minimum_sample_probability",
            self.minimum_sample_probability,
            "times the number of lessons must be in [0, 1]",
        )
        require(self.eval_pass_k >= 0, "curriculum.eval_pass_k", self.eval_pass_k, "must be >= 0 (0: k = n)")
        require(
            self.micro_eval_frequency >= 0,
            "curriculum.micro_eval_frequency",
            self.micro_eval_frequency,
            "must be >= 0 (0: never)",
        )
        require(
            self.micro_eval_n_examples >= 1,
            "curriculum.micro_eval_n_examples",
            self.micro_eval_n_examples,
            "must be >= 1",
        )
        require(self.skip_after >= 0, "curriculum.skip_after", self.skip_after, "must be >= 0 (0: off)")
        require(0.0 <= self.retest_rate <= 1.0, "curriculum.retest_rate", self.retest_rate, "must be in [0, 1]")
        require(
            self.max_tracked_prompts >= 1,
            "curriculum.max_tracked_prompts",
            self.max_tracked_prompts,
            "must be >= 1",
        )
        for key in self.lessons:
            n = self.eval_sampling_for(key).n_generations_per_prompt
            require(
                self.eval_pass_k <= n,
                "curriculum.eval_pass_k",
                self.eval_pass_k,
                f"exceeds lesson {key!r}'s eval n_generations_per_prompt={n} (pass@k needs k <= samples per problem)",
            )
        roots = sorted(k for k, v in self.lessons.items() if not v.dependencies)
        require(
            any(self.lessons[k].start_threshold == 0.0 for k in roots),
            "curriculum.lessons",
            {k: self.lessons[k].start_threshold for k in roots},
            "some lesson without dependencies must have start_threshold 0, or nothing can be sampled before the "
            "first evaluation",
        )

    def sampling_for(self, lesson_id: str) -> SamplingParams:
        """Training sampling params of a lesson (its override or the default)."""
        return self.lessons[lesson_id].sampling_params or self.default_sampling

    def eval_sampling_for(self, lesson_id: str) -> SamplingParams:
        """Evaluation sampling params of a lesson (its override or the eval default)."""
        return self.lessons[lesson_id].eval_sampling_params or self.eval_sampling


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A dependency cycle as a node list that starts and ends at the same node, or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if color.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if color.get(nxt, 0) == 0:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = 2
        return None

    for n in sorted(graph):
        if color.get(n, 0) == 0:
            found = visit(n)
            if found:
                return found
    return None
