"""RolloutManager on its own (standalone, as offline evaluation uses it): a tiny real model, no storage, no weight sync.

Also: bad input (unknown environment class, missing data file, prompts longer than max_seq_len, a calculator
tool call with malformed arguments), retries of failing examples, and the re-roll of a call during which an
external server switched policies.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest

from pipeline.config import CurriculumConfig, DenseInferenceConfig, EnvConfig, LessonConfig, ModelSpec, SamplingParams
from pipeline.environments import Completion, EnvironmentLoadError, ScriptedContext
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import GenerationRequest, InferenceBackend
from policy.model import build_model, model_vocab_size
from policy.rollout_manager import RolloutManager, batch_stats
from schemas import EVAL_ROW, ROLLOUT, EvalRow, EvalSummaryRow
from schemas.evaluation import validate_eval_summary

SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=2, num_kv_heads=2, max_seq_len=48)
SAMPLING = SamplingParams(temperature=1.0, n_prompts=2, n_generations_per_prompt=2, max_tokens=8)
EVAL_SAMPLING = SamplingParams(temperature=0.0, n_prompts=2, n_generations_per_prompt=1, max_tokens=8)


def _curriculum(**lessons: EnvConfig) -> CurriculumConfig:
    lessons = lessons or {"cats": EnvConfig()}
    return CurriculumConfig(
        lessons={k: LessonConfig(lesson_id=k, env=v) for k, v in lessons.items()},
        default_sampling=SAMPLING,
        eval_sampling=EVAL_SAMPLING,
    )


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("builtin:tiny")


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> Any:
    return build_model(SPEC, model_vocab_size(tokenizer))


@pytest.fixture(scope="module")
def manager(tokenizer: Any, model: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    data = tmp_path_factory.mktemp("data") / "problems.jsonl"
    rows = [{"id": "long", "prompt": "cats " * 60, "answer": "x"}] + [
        {"id": f"short{i}", "prompt": f"say {i}", "answer": str(i)} for i in range(3)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    only_long = tmp_path_factory.mktemp("data") / "long.jsonl"
    only_long.write_text(json.dumps({"id": "long", "prompt": "cats " * 60, "answer": "x"}) + "\n")
    cur = _curriculum(
        cats=EnvConfig(),
        mixed=EnvConfig("pipeline.environments.exact_answer.ExactAnswerEnv", {"path": str(data)}),
        too_long=EnvConfig("pipeline.environments.exact_answer.ExactAnswerEnv", {"path": str(only_long)}),
        unknown=EnvConfig("pipeline.environments.nope.NoSuchEnv"),
        missing_file=EnvConfig(
            "pipeline.environments.exact_answer.ExactAnswerEnv",
            {"path": str(tmp_path_factory.mktemp("x") / "no.jsonl")},
        ),
    )
    m = RolloutManager(DenseInferenceConfig(max_seqs=8), SPEC, cur, tokenizer, model)
    yield m
    m.shutdown()


def test_standalone_manager_batch_carries_given_weight_step_and_worker(manager: RolloutManager) -> None:
    """Standalone: no storage, no weight sync; metadata carries weight_step=100 and the worker id."""
    batch, metrics = manager.sample_batch("cats", 2, 2, "train", np.random.default_rng(0), 100, "test-worker")
    assert batch is not None
    assert batch.metadata.weight_step == 100
    assert batch.metadata.worker_id == "test-worker"
    assert len(batch.rows) == 4 and len(batch.groups) == 2
    assert all(r.policy_step == 100 and r.worker_id == "test-worker" for r in batch.rows)
    assert all(r.temperature == SAMPLING.temperature and r.lesson_id == "cats" for r in batch.rows)
    assert len({r.rollout_id for r in batch.rows}) == 4
    for rows in batch.groups.values():
        assert len(rows) == 2 and len({tuple(r.prompt_tokens) for r in rows}) == 1
    for r in batch.rows:
        assert len(r.response_tokens) == len(r.response_logprobs) == len(r.token_rewards) == len(r.response_loss_mask)
        assert r.response_tokens and all(lp <= 0 for lp in r.response_logprobs)
    # the rows are valid schema rows and survive the Arrow round trip
    assert ROLLOUT.from_table(ROLLOUT.to_table(batch.rows)) == batch.rows
    assert metrics["rows"] == 4 and metrics["failures"] == 0 and metrics["tokens"] > 0


def test_ids_unique_across_calls(manager: RolloutManager) -> None:
    rng = np.random.default_rng(1)
    a, _ = manager.sample_batch("cats", 2, 2, "train", rng, 3, "w")
    b, _ = manager.sample_batch("cats", 2, 2, "train", rng, 3, "w")
    assert a is not None and b is not None
    assert not {r.rollout_id for r in a.rows} & {r.rollout_id for r in b.rows}
    assert not set(a.groups) & set(b.groups)
    c, _ = manager.sample_batch("cats", 2, 2, "train", rng, 3, "w", batch_id="w.x-00000007")
    assert c is not None and [r.rollout_id for r in c.rows] == [f"w.x-00000007-{i}" for i in range(4)]


def test_update_model_changes_sampling_and_is_tagged_by_caller(manager: RolloutManager, model: Any) -> None:
    before, _ = manager.sample_batch("cats", 2, 2, "train", 5, 7, "w")
    other = jax.tree_util.tree_map(lambda x: x * 1.5 if eqx.is_inexact_array(x) else x, model)
    manager.update_model(other)
    try:
        after, _ = manager.sample_batch("cats", 2, 2, "train", 5, 8, "w")
    finally:
        manager.update_model(model)
    assert before is not None and after is not None
    assert after.metadata.weight_step == 8 and after.rows[0].policy_step == 8
    assert before.rows[0].response_logprobs != after.rows[0].response_logprobs


def test_update_training_stats_is_a_pure_summary(manager: RolloutManager) -> None:
    batch, _ = manager.sample_batch("cats", 2, 2, "train", 3, 1, "w")
    assert batch is not None
    stats = manager.update_training_stats("cats", batch, step=1)
    assert stats == batch_stats(batch) == manager.update_training_stats("cats", batch, step=1)
    assert stats.n_rows == 4 and 0.0 <= stats.mean_reward <= 1.0


def test_unknown_environment_class_is_a_clear_error(manager: RolloutManager) -> None:
    with pytest.raises(EnvironmentLoadError, match=r"pipeline\.environments\.nope\.NoSuchEnv"):
        manager.sample_batch("unknown", 1, 1, "train", 0, 0, "w")
    with pytest.raises(KeyError, match="no_such_lesson"):
        manager.sample_batch("no_such_lesson", 1, 1, "train", 0, 0, "w")


def test_missing_data_file_is_a_clear_error(manager: RolloutManager) -> None:
    with pytest.raises(EnvironmentLoadError, match=r"no\.jsonl"):
        manager.sample_batch("missing_file", 1, 1, "train", 0, 0, "w")


def test_prompt_longer_than_max_seq_len_is_a_recorded_failure(manager: RolloutManager) -> None:
    batch, metrics = manager.sample_batch("too_long", 2, 2, "train", 0, 0, "w")
    assert batch is None
    assert metrics["failures"] == 2 * (manager.max_example_retries + 1)
    # the manager goes on: the next call of another lesson works
    ok, _ = manager.sample_batch("cats", 2, 2, "train", 0, 0, "w")
    assert ok is not None


def test_mixed_lengths_fail_per_example_and_are_retried(manager: RolloutManager) -> None:
    batch, metrics = manager.sample_batch("mixed", 2, 2, "train", np.random.default_rng(3), 0, "w")
    produced = 0 if batch is None else len(batch.groups)
    failures = [] if batch is None else batch.failures
    assert all("max_seq_len" in f.reason for f in failures)
    assert metrics["failed_examples"] == 2 - produced
    if batch is not None:
        assert all(r.example_id != "long" for r in batch.rows)


# ---------------------------------------------------------------------------------------------
# fakes of the backend (scripted texts), for tool calls, retries and server policy switches
# ---------------------------------------------------------------------------------------------


class ScriptedBackend(InferenceBackend):
    """A backend answering from scripted texts (pipeline.environments.ScriptedContext), with failures and
    reported policy steps on demand."""

    def __init__(self, tokenizer: Any, script: Any, *, fail_calls: Sequence[int] = (), steps: Sequence[Any] = ()):
        super().__init__()
        self._ctx = ScriptedContext(tokenizer, script)
        self.tokenizer = tokenizer
        self.fail_calls = set(fail_calls)
        self.steps = list(steps)
        self.calls = 0
        self.external_weights = bool(steps)

    def generate(self, request: GenerationRequest) -> list[list[Completion]]:
        call = self.calls
        self.calls += 1
        if self.steps:
            s = self.steps[min(call, len(self.steps) - 1)]
            self.last_served_steps = set(s) if isinstance(s, set) else {s}
        if call in self.fail_calls:
            raise RuntimeError(f"injected failure of call {call}")
        return self._ctx.generate(request)

    def update_model(self, model: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_calculator_malformed_tool_args_are_recorded_and_sampling_goes_on(tokenizer: Any) -> None:
    cur = _curriculum(calc=EnvConfig("pipeline.environments.calculator.CalculatorEnv", {"max_turns": 2}))
    backend = ScriptedBackend(tokenizer, lambda text: "Answer: 5" if "<result>" in text else "<calc>2+*3)</calc>")
    m = RolloutManager(DenseInferenceConfig(), SPEC, cur, tokenizer, None, backend=backend)
    batch, metrics = m.sample_batch("calc", 2, 2, "train", 0, 4, "w")
    assert batch is not None and len(batch.rows) == 4
    assert metrics["env/tool_errors_total"] >= 1
    for r in batch.rows:
        assert 0 in r.response_loss_mask and 1 in r.response_loss_mask  # tool output is not policy text
        assert all(lp == 0.0 for lp, m_ in zip(r.response_logprobs, r.response_loss_mask, strict=True) if m_ == 0)
        assert "error" in tokenizer.decode(r.response_tokens)
    assert ROLLOUT.from_table(ROLLOUT.to_table(batch.rows)) == batch.rows


def test_failing_examples_are_retried_then_recorded(tokenizer: Any) -> None:
    backend = ScriptedBackend(tokenizer, ["cats"], fail_calls=[0])
    m = RolloutManager(DenseInferenceConfig(), SPEC, _curriculum(), tokenizer, None, backend=backend)
    batch, metrics = m.sample_batch("cats", 2, 2, "train", 0, 1, "w")
    assert batch is not None and len(batch.groups) == 2  # the retry filled the batch
    assert [f.attempt for f in batch.failures] == [0, 0]
    assert all("injected failure" in f.reason for f in batch.failures)
    assert metrics["failures"] == 2 and metrics["failed_examples"] == 0

    always = ScriptedBackend(tokenizer, ["cats"], fail_calls=range(100))
    m2 = RolloutManager(
        DenseInferenceConfig(), SPEC, _curriculum(), tokenizer, None, backend=always, max_example_retries=1
    )
    batch2, metrics2 = m2.sample_batch("cats", 2, 2, "train", 0, 1, "w")
    assert batch2 is None and metrics2["failures"] == 4 and metrics2["failed_examples"] == 2


def test_policy_switch_during_a_call_is_rerolled_and_rows_carry_the_served_step(tokenizer: Any) -> None:
    backend = ScriptedBackend(tokenizer, ["cats"], steps=[{5, 6}, 6])
    m = RolloutManager(DenseInferenceConfig(), SPEC, _curriculum(), tokenizer, None, backend=backend)
    batch, metrics = m.sample_batch("cats", 2, 2, "train", 0, 5, "w")
    assert backend.calls == 2
    assert batch is not None and batch.metadata.weight_step == 6
    assert {r.policy_step for r in batch.rows} == {6}
    assert metrics["failures"] == 2 and all("policy changed" in f.reason for f in batch.failures)


def test_rows_tagged_with_served_step_not_callers(tokenizer: Any, tmp_path: Path) -> None:
    backend = ScriptedBackend(tokenizer, ["cats"], steps=[11])
    m = RolloutManager(DenseInferenceConfig(), SPEC, _curriculum(), tokenizer, None, backend=backend)
    batch, _ = m.sample_batch("cats", 1, 2, "train", 0, 3, "w")
    assert batch is not None and {r.policy_step for r in batch.rows} == {11}


def test_evaluate_curriculum_covers_every_lesson(tokenizer: Any) -> None:
    cur = _curriculum(cats=EnvConfig(), add=EnvConfig("pipeline.environments.arithmetic.ArithmeticEnv"))
    m = RolloutManager(DenseInferenceConfig(), SPEC, cur, tokenizer, None, backend=ScriptedBackend(tokenizer, ["cats"]))
    results = m.evaluate_curriculum(3, 0, step=2, weight_step=2, worker_id="ev")
    assert sorted(results) == ["add", "cats"]
    cats_stats, cats_batch = results["cats"]
    assert cats_batch is not None and cats_stats.success_rate == 1.0
    assert all(isinstance(r, EvalRow) and r.eval_type == "eval" for r in cats_batch.rows)
    assert results["add"][0].success_rate == 0.0


def test_evaluate_lesson_uses_eval_sampling_and_eval_rows(tokenizer: Any) -> None:
    m = RolloutManager(
        DenseInferenceConfig(), SPEC, _curriculum(), tokenizer, None, backend=ScriptedBackend(tokenizer, ["cats"])
    )
    stats, batch = m.evaluate_lesson("cats", 4, "micro_eval", 0, step=4, weight_step=9, worker_id="ev")
    assert batch is not None and all(isinstance(r, EvalRow) and r.eval_type == "micro_eval" for r in batch.rows)
    assert all(r.temperature == EVAL_SAMPLING.temperature and r.policy_step == 9 for r in batch.rows)
    assert len(batch.groups) == 4 and all(
        len(g) == EVAL_SAMPLING.n_generations_per_prompt for g in batch.groups.values()
    )
    assert EVAL_ROW.from_table(EVAL_ROW.to_table(batch.rows)) == batch.rows
    assert stats.n_rows == 4 and stats.policy_step == 9 and stats.success_rate == 1.0
    summary = stats.to_summary_row("micro_eval", source="policy")
    assert isinstance(summary, EvalSummaryRow)
    validate_eval_summary(summary)
    with pytest.raises(ValueError, match="eval_type"):
        m.evaluate_lesson("cats", 1, "bogus", 0, 0, 0, "ev")
