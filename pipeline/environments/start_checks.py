"""What is checked of every lesson's environment before anything starts, and the one line a refusal is.

Each check raises `pipeline.config.ConfigError` naming the lesson, the field and the numbers (exit 2, never
restarted by the job runner):

- **the environment loads** (`lesson_environment`, `check_environments_load`): `load_environment(lesson.env)` is
  run; a constructor that raises (a verifiers `load_environment` that raises, env_args the class does not take, a
  data file it cannot read) is refused naming `curriculum.lessons.<id>.env` and the cause. Run by `check_rollout_step`
  and `check_evaluate_step` (so `python -m steps.rollout` / `steps.evaluate` refuse it before JAX is imported), and by
  `check_lessons` at job start and rollout worker start.
- **on `PROMPT_PROBE` examples drawn from each single-turn lesson** (`check_lessons`, at job start and rollout
  worker start; a judged lesson is drawn through its base environment):
  - some prompt leaves room to generate (< the sampler's `max_seq_len`);
  - some reference answer can be produced (`SingleTurnEnvironment.reference_response`: the answer rendered in
    the lesson's required format; an environment that cannot render one, and a judged lesson, is skipped): it
    round-trips through the tokenizer (`decode(encode(answer)) == answer`: no character outside the vocabulary),
    has at most the lesson's `max_tokens` tokens, and the environment's own `score` calls it a success;
  - some row fits `train.seq_len`: a prompt shorter than `seq_len` (`train.overlong: truncate`), or prompt plus
    reference answer (one token when the environment renders none) at most `seq_len` (`drop`); otherwise the
    BatchMaker would drop every row as `too_long` and never commit a batch.
  One drawn example that passes is enough (a mix of lengths trains on what fits); when only some pass, one warning
  line names how many did not and why.

Nothing here imports JAX.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.config.base import ConfigError
from pipeline.environments.base import Environment, Example, SingleTurnEnvironment, encode_prompt
from pipeline.environments.loading import load_environment

if TYPE_CHECKING:
    from pipeline.config import CurriculumConfig, EvaluateStepConfig, LessonConfig, RolloutStepConfig

logger = logging.getLogger(__name__)

PROMPT_PROBE = 16
"""Examples drawn per lesson at start (`check_lessons`)."""

_built: dict[str, Environment] = {}
"""Environments this process built for its start checks, by config (validation runs more than once per process)."""


def _key(lesson: LessonConfig) -> str:
    return f"{lesson.env.env_class}:{json.dumps(lesson.env.env_args, sort_keys=True, default=repr)}"


def lesson_environment(lesson_id: str, lesson: LessonConfig) -> Environment:
    """The lesson's environment, built once per process; ConfigError naming `curriculum.lessons.<id>.env`, the
    lesson and the cause when it cannot be built."""
    from pipeline.environments.base import EnvironmentLoadError

    key = _key(lesson)
    if key not in _built:
        try:
            _built[key] = load_environment(lesson.env)
        except EnvironmentLoadError as e:
            raise ConfigError(
                f"curriculum.lessons.{lesson_id}.env",
                lesson.env.env_class,
                f"lesson {lesson_id!r}: the environment cannot be loaded: {' '.join(e.why.split())}",
            ) from None
    return _built[key]


def check_environments_load(curriculum: CurriculumConfig) -> None:
    """Build every lesson's environment (`lesson_environment`): one that cannot load is a ConfigError at start."""
    for lesson_id, lesson in curriculum.lessons.items():
        lesson_environment(lesson_id, lesson)


def response_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids of `text` as a response (no special tokens added)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a tokenizer whose encode takes only the text
        ids = tokenizer.encode(text)
    return [int(t) for t in ids]


def reference_problem(
    env: SingleTurnEnvironment, example: Example, tokenizer: Any, max_tokens: int
) -> tuple[str, str, int] | None:
    """Why the environment's reference response of `example` cannot be produced, as (kind, reason, its token count):
    kind `vocabulary` (it does not round-trip through the tokenizer), `length` (more than `max_tokens` tokens) or
    `score` (the environment's own scorer does not call it a success); None when it can. ValueError when the
    environment renders none (`reference_response` is None)."""
    text = env.reference_response(example)
    if text is None:
        raise ValueError("no reference response")
    ids = response_ids(tokenizer, text)
    back = str(tokenizer.decode(ids))
    if back != text:
        lost = sorted({c for c in text if c not in back})
        what = f"characters {''.join(lost)!r} are not in the vocabulary" if lost else f"it decodes as {back!r}"
        return "vocabulary", f"the reference answer {text!r} does not survive the tokenizer: {what}", len(ids)
    if len(ids) > max_tokens:
        return "length", f"the reference answer {text!r} has {len(ids)} tokens > max_tokens={max_tokens}", len(ids)
    score = env.score(example, back)
    if not score.success:
        got = "extracts no answer" if score.extracted_answer is None else f"extracts {score.extracted_answer!r}"
        why = f"the reference answer {text!r} {got} and scores {score.reward:g} under the lesson's own scorer"
        return "score", why, len(ids)
    return None


def _single_turn(env: Environment) -> tuple[SingleTurnEnvironment | None, bool]:
    """(the single-turn environment whose examples the checks draw, whether its own scorer gives the reward): the
    environment itself, a judged lesson's base environment (its reward is the judges'), else None."""
    if isinstance(env, SingleTurnEnvironment):
        return env, True
    base = getattr(env, "base", None)
    if isinstance(base, SingleTurnEnvironment):
        return base, False
    return None, False


def check_lessons(config: RolloutStepConfig, tokenizer: Any) -> list[int]:
    """Every start check of the module docstring for each lesson of a rollout worker's config; ConfigError naming
    the lesson, the field and the lengths when one fails. Returns the token counts of the prompts drawn (the
    sampler's likely prompt lengths)."""
    drawn_lengths: list[int] = []
    limit = getattr(config.inference, "max_seq_len", None)
    field = "inference.max_seq_len" if limit is not None else "model.max_seq_len"
    limit = limit if limit is not None else config.model.max_seq_len
    for lesson_id, lesson in config.curriculum.lessons.items():
        env, scored = _single_turn(lesson_environment(lesson_id, lesson))
        if env is None:
            continue
        try:
            drawn = env.examples(PROMPT_PROBE, np.random.default_rng(config.seed), "train")
            examples = [
                (ex, len(encode_prompt(tokenizer, ex.prompt, add_bos=env.add_bos, chat=lesson.chat)))
                for ex in drawn
                if ex.prompt is not None and ex.error is None
            ]
        except Exception as e:  # the worker reports it per example when it samples the lesson
            logger.debug("start checks of lesson %s skipped: cannot draw examples: %s", lesson_id, e)
            continue
        if not examples:
            continue
        lengths = [n for _, n in examples]
        drawn_lengths.extend(lengths)
        if min(lengths) >= limit:
            raise ConfigError(
                field,
                limit,
                f"no prompt of lesson {lesson_id!r} fits: {len(lengths)} drawn have {min(lengths)}..{max(lengths)} "
                "tokens, and a prompt of >= max_seq_len tokens leaves no room to generate",
            )
        answers = _check_reference_answers(config, lesson_id, env, examples, tokenizer) if scored else None
        _check_rows_fit(config, lesson_id, lengths, answers)
    return drawn_lengths


def _sampling_field(config: RolloutStepConfig, lesson_id: str) -> str:
    if config.curriculum.lessons[lesson_id].sampling_params is not None:
        return f"curriculum.lessons.{lesson_id}.sampling_params.max_tokens"
    return "curriculum.default_sampling.max_tokens"


def _check_reference_answers(
    config: RolloutStepConfig,
    lesson_id: str,
    env: SingleTurnEnvironment,
    examples: Sequence[tuple[Example, int]],
    tokenizer: Any,
) -> list[int | None]:
    """The token count of each drawn example's reference answer (None: the environment renders none); ConfigError
    when none of them can be produced (`reference_problem`), a warning when only some cannot."""
    max_tokens = config.curriculum.sampling_for(lesson_id).max_tokens
    counts: list[int | None] = []
    problems: list[tuple[str, str, str]] = []
    for ex, _ in examples:
        try:
            found = reference_problem(env, ex, tokenizer, max_tokens)
        except ValueError:  # this environment renders no reference answer: nothing to check
            counts.append(None)
            continue
        except Exception as e:  # a scorer that raises on its own reference answer
            found = ("score", f"scoring the reference answer raised {type(e).__name__}: {e}", 0)
        if found is None:
            counts.append(len(response_ids(tokenizer, env.reference_response(ex) or "")))
        else:
            counts.append(found[2])
            problems.append((ex.example_id, found[0], found[1]))
    checked = sum(c is not None for c in counts)
    if not problems:
        return counts
    example_id, kind, why = problems[0]
    if len(problems) < checked:
        logger.warning(
            "lesson %s: %d of %d reference answers drawn cannot be produced, e.g. example %s: %s",
            lesson_id,
            len(problems),
            checked,
            example_id,
            why,
        )
        return counts
    where, value = {
        "vocabulary": ("model.tokenizer", config.model.tokenizer),
        "length": (_sampling_field(config, lesson_id), max_tokens),
    }.get(
        kind, (f"curriculum.lessons.{lesson_id}.env.env_args", dict(config.curriculum.lessons[lesson_id].env.env_args))
    )
    raise ConfigError(
        where,
        value,
        f"lesson {lesson_id!r}: none of the {checked} reference answers drawn can be produced, so every sample would "
        f"score 0: e.g. example {example_id}: {why}",
    )


def _check_rows_fit(
    config: RolloutStepConfig, lesson_id: str, prompt_lengths: Sequence[int], answers: Sequence[int | None] | None
) -> None:
    """ConfigError naming `train.seq_len` when no drawn example makes a row the BatchMaker keeps (module docstring)."""
    seq_len, rule = config.train.seq_len, config.train.overlong
    answer = [1 if answers is None or a is None else max(1, a) for a in (answers or [None] * len(prompt_lengths))]
    if rule == "drop":
        fits = any(p + a <= seq_len for p, a in zip(prompt_lengths, answer, strict=True))
    else:
        fits = any(p < seq_len for p in prompt_lengths)
    if fits:
        return
    need = [p + a for p, a in zip(prompt_lengths, answer, strict=True)]
    rendered = answers is not None and any(a is not None for a in answers)
    what = "prompt + reference answer" if rendered else "prompt + one response token"
    raise ConfigError(
        "train.seq_len",
        seq_len,
        f"lesson {lesson_id!r}: no row fits: the {len(prompt_lengths)} prompts drawn have "
        f"{min(prompt_lengths)}..{max(prompt_lengths)} tokens ({what}: {min(need)}..{max(need)}; "
        f"train.overlong={rule}), so the BatchMaker would drop every row as too_long and never commit a batch",
    )


def check_rollout_step(c: RolloutStepConfig) -> None:
    """A rollout worker's start checks: `validate_rollout`, then every lesson's environment loads
    (`check_environments_load`). One ConfigError (exit 2) for the first failure."""
    from pipeline.config import validate_rollout

    validate_rollout(c)
    check_environments_load(c.curriculum)


def check_evaluate_step(c: EvaluateStepConfig) -> None:
    """The evaluator's start checks: `validate_evaluate`, then every lesson's environment loads."""
    from pipeline.config import validate_evaluate

    validate_evaluate(c)
    check_environments_load(c.curriculum)
