"""RolloutManager on its own (standalone, as offline evaluation uses it): a tiny real model, no storage, no weight sync.

Also: bad input (unknown environment class, missing data file, prompts longer than max_seq_len, a calculator
tool call with malformed arguments), retries of failing examples, and the re-roll of a call during which an
external server switched policies.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest

from pipeline.config import (
    ConfigError,
    CurriculumConfig,
    DenseInferenceConfig,
    EnvConfig,
    LessonConfig,
    ModelSpec,
    PollingConfig,
    RolloutStepConfig,
    SamplingParams,
    StoreConfig,
    TrainParams,
)
from pipeline.environments import Completion, EnvironmentLoadError, ScriptedContext
from pipeline.environments.base import Example
from pipeline.environments.cats import CatsEnv
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.rollout.worker import RolloutWorker
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import read_metrics
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


# ---------------------------------------------------------------------------------------------
# micro-evaluation in a rollout worker (curriculum.micro_eval_frequency)
# ---------------------------------------------------------------------------------------------


class _EvalSaysCats(ScriptedBackend):
    """A served policy (external weights, step 0) that says "cat cat" when sampled with the eval params and
    "no" with the training params, so an evaluation is told apart from a training sample by its reward."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, ["no"], steps=[0])

    def generate(self, request: GenerationRequest) -> list[list[Completion]]:
        text = "cat cat" if request.temperature == EVAL_SAMPLING.temperature else "no"
        self._ctx.script = [text]
        return super().generate(request)

    def served_policy_step(self) -> int | None:
        return 0


def test_rollout_worker_micro_evaluates_the_sampled_lesson_every_n_writes(tokenizer: Any, tmp_path: Path) -> None:
    """`curriculum.micro_eval_frequency: 2`: a bounded worker of 5 writes micro-evaluates the lesson it sampled
    after its 2nd and 4th writes, each `micro_eval_n_examples` examples with the lesson's eval sampling params,
    and records the result as a `micro_eval` record in `metrics/rollout` (reward and success of the eval answers,
    not of the training ones); nothing else: no evaluation files, no curriculum state."""
    root = tmp_path / "run"
    cur = dataclasses.replace(_curriculum(), micro_eval_frequency=2, micro_eval_n_examples=3)
    cfg = RolloutStepConfig(
        store=StoreConfig(run_root=str(root)),
        model=SPEC,
        inference=DenseInferenceConfig(),
        curriculum=cur,
        train=TrainParams(batch_size=10_000, replay_buffer_capacity=10_000),
        worker_id="w0",
        follow=False,
        max_rollouts=5 * SAMPLING.n_prompts * SAMPLING.n_generations_per_prompt,
        polling=PollingConfig(interval_s=0.05),
    )
    backend = _EvalSaysCats(tokenizer)
    manager = RolloutManager(DenseInferenceConfig(), SPEC, cur, tokenizer, None, backend=backend)
    store = RunStore(str(root))
    summary = RolloutWorker(cfg, store=store, tokenizer=tokenizer, manager=manager).run()
    assert len(summary.files) == 5, summary

    records = read_metrics(store, "rollout")
    events = [r.get("event", "write") for r in records]
    assert events.count("write") == 5
    # after the 2nd and the 4th write (writes are counted before each new one), never after the last
    writes_before = [events[:i].count("write") for i, e in enumerate(events) if e == "micro_eval"]
    assert writes_before == [2, 4], events
    cats = CatsEnv().score(Example("probe-0", "x"), "cat cat")
    for rec in (r for r in records if r.get("event") == "micro_eval"):
        assert rec["lesson_id"] == "cats" and rec["policy_step"] == 0
        assert rec["n_examples"] == rec["n_groups"] == 3
        assert rec["n_rows"] == 3 * EVAL_SAMPLING.n_generations_per_prompt and rec["n_failures"] == 0
        assert rec["temperature"] == EVAL_SAMPLING.temperature
        assert rec["mean_reward"] == cats.reward == 0.5 and rec["success_rate"] == 1.0
    assert all(r["mean_reward"] == 0.0 for r in records if r.get("event", "write") == "write")
    # the eval requests the backend saw: 3 probe prompts each, at the eval temperature
    evals = [kw for prompts, kw in backend._ctx.calls if kw["temperature"] == EVAL_SAMPLING.temperature]
    assert len(evals) == 2 and all(kw["n"] == EVAL_SAMPLING.n_generations_per_prompt for kw in evals)
    # logged only: no evaluation files, no curriculum state (the evaluate step and the BatchMaker write those)
    assert not store.list("evals") and not store.list("curriculum")


def test_micro_eval_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"curriculum\.micro_eval_frequency"):
        dataclasses.replace(_curriculum(), micro_eval_frequency=-1)
    with pytest.raises(ConfigError, match=r"curriculum\.micro_eval_n_examples"):
        dataclasses.replace(_curriculum(), micro_eval_n_examples=0)


# ---------------------------------------------------------------------------------------------
# a user's environment whose rewards are broken (NaN, missing): contained, one failure per example
# ---------------------------------------------------------------------------------------------

BROKEN_ENV = '''
import numpy as np
from pipeline.environments.base import EnvGroup, Environment, EnvRollout, SampleResult, group_key
from pipeline.environments.generation import GenerationRequest


def reward_of(example_id, position, broken_train):
    """NaN for e1 and for the second train example of a call (every one with `broken_train="all"`), missing (None)
    for e2, else 1.0: a user's reward function gone wrong."""
    if example_id == "e1" or (example_id.startswith("t") and (position == 1 or broken_train == "all")):
        return float("nan")
    return None if example_id == "e2" else 1.0


class BrokenRewardEnv(Environment):
    """Its own `sample` (as verifiers and agent environments have): eval examples e0, e1, ...; train ones t<k>."""

    name = "broken"

    def __init__(self, broken_train="second"):
        self.broken_train = broken_train

    def sample(self, ctx, spec, rng):
        if spec.mode == "eval":
            ids = [f"e{i}" for i in range(spec.n_examples)]
        else:
            ids = [f"t{int(rng.integers(0, 10))}" for _ in range(spec.n_examples)]
        prompts = [[1, *ctx.tokenizer.encode(f"say {i}")] for i in ids]
        request = GenerationRequest(prompts, n=spec.n_generations, temperature=spec.temperature,
                                    max_tokens=spec.max_tokens, stop_tokens=spec.stop_tokens, seed=0)
        groups = []
        for position, (example_id, prompt, comps) in enumerate(zip(ids, prompts, ctx.generate(request))):
            reward = reward_of(example_id, position, self.broken_train)
            rollouts = [
                EnvRollout(self.name, example_id, prompt, c.tokens, c.logprobs,
                           [0.0] * (len(c.tokens) - 1) + [reward], [1] * len(c.tokens), reward, False, c.finish_reason)
                for c in comps
            ]
            groups.append(EnvGroup(group_key(self.name, example_id, rng), rollouts))
        return SampleResult(groups, [], {"failures": 0.0, "episodes": float(len(ids))})
'''


class _ServesStep0(ScriptedBackend):
    """A served policy (external weights) at step 0."""

    def served_policy_step(self) -> int | None:
        return 0


@pytest.fixture
def broken_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The curriculum of one lesson `broken` (`BrokenRewardEnv`, written as a user's module) and a manager on it."""
    import sys

    (tmp_path / "user_broken_env.py").write_text(BROKEN_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    cur = _curriculum(broken=EnvConfig("user_broken_env.BrokenRewardEnv"))
    tok = load_tokenizer("builtin:tiny")
    m = RolloutManager(DenseInferenceConfig(), SPEC, cur, tok, None, backend=_ServesStep0(tok, ["cat"], steps=[0]))
    yield cur, m
    sys.modules.pop("user_broken_env", None)


def test_a_nan_or_missing_reward_fails_its_example_and_every_retry_counts(broken_env: Any) -> None:
    """Every train example broken: each attempt's examples fail with the reason (none crashes the call), and
    `env/failures` counts the failures of every attempt, not the last one's."""
    _, m = broken_env
    m._environments.clear()
    m.curriculum_config = _curriculum(broken=EnvConfig("user_broken_env.BrokenRewardEnv", {"broken_train": "all"}))
    batch, metrics = m.sample_batch("broken", 2, 2, "train", 0, 0, "w")
    assert batch is None
    attempts = m.max_example_retries + 1
    assert metrics["failures"] == metrics["env/failures"] == 2 * attempts
    assert metrics["env/episodes"] == 2 * attempts  # a count the environment reports is summed too
    assert [f.attempt for f in m.last_failures] == [a for a in range(attempts) for _ in range(2)]
    assert all(f.reason == "reward error: episode reward is nan, not a finite number" for f in m.last_failures)


def test_a_failed_eval_example_is_recorded_and_counted_never_replaced(broken_env: Any, tmp_path: Path) -> None:
    """Eval examples e0..e3, e1 NaN and e2 missing: the evaluator writes e0 and e3 once each, its summary counts
    the 2 failures (`n_failures`), and the reasons are the batch's failures; the next lesson call still works."""
    from pipeline.config import EvaluateStepConfig
    from pipeline.store import layout
    from policy.evaluation import Evaluator
    from schemas import EVAL_SUMMARY

    cur, m = broken_env
    evaluator = Evaluator(EvaluateStepConfig(store=StoreConfig(run_root=str(tmp_path / "run")), model=SPEC,
                                             curriculum=cur, n_examples=4))  # fmt: skip
    evaluator.evaluate_lesson(m, 0, "broken", None)
    evaluator.close()
    store = evaluator.store
    rows = EVAL_ROW.from_table(store.read_parquet(layout.eval_rollouts_file(0, "broken"), EVAL_ROW))
    assert sorted(r.example_id for r in rows) == ["e0", "e3"]  # one generation each: no duplicate stands in
    (summary,) = EVAL_SUMMARY.from_table(store.read_parquet(layout.eval_summary_file(0, "broken"), EVAL_SUMMARY))
    assert summary.n_examples == 2 and summary.n_failures == 2 and summary.mean_reward == 1.0
    stats, batch = m.evaluate_lesson("broken", 4, "eval", 0, 0, 0, "ev")
    assert batch is not None and stats.n_failures == 2
    assert {f.example_id: f.reason for f in batch.failures} == {
        "e1": "reward error: episode reward is nan, not a finite number",
        "e2": "reward error: episode reward is missing (None)",
    }


def test_a_rollout_worker_goes_on_past_broken_rewards_and_records_them(broken_env: Any, tmp_path: Path) -> None:
    """The second train example of every sampling call has a NaN reward: a bounded worker writes its files anyway
    (its retry, a call of one example, fills the write), each ready marker lists the failed example with the reason,
    and every committed row has a finite reward."""
    cur, m = broken_env
    root = tmp_path / "run"
    cfg = RolloutStepConfig(store=StoreConfig(run_root=str(root)), model=SPEC, inference=DenseInferenceConfig(),
                            curriculum=cur, train=TrainParams(batch_size=10_000, replay_buffer_capacity=10_000),
                            worker_id="w0", follow=False, max_rollouts=3 * SAMPLING.n_prompts * 2,
                            polling=PollingConfig(interval_s=0.05))  # fmt: skip
    store = RunStore(str(root))
    summary = RolloutWorker(cfg, store=store, tokenizer=m.tokenizer, manager=m).run()
    assert len(summary.files) == 3 and summary.failures == 3 and summary.rows == 12, summary
    from pipeline.store import layout

    reasons = [f["reason"] for rel in summary.files for f in store.get_json(layout.ready_marker(rel))["failures"]]
    assert reasons == ["reward error: episode reward is nan, not a finite number"] * summary.failures
    rows = [r for rel in summary.files for r in ROLLOUT.from_table(store.read_parquet(rel, ROLLOUT))]
    assert rows and all(r.episode_reward == 1.0 for r in rows)


def test_shutdown_closes_every_environment_once_even_when_one_fails(tokenizer: Any) -> None:
    """The environments a manager built hold processes and connections (a verifiers harness pool, a judge's
    client): `shutdown` closes each once, and one whose close raises does not keep the others open."""
    cur = _curriculum(cats=EnvConfig(), calc=EnvConfig("pipeline.environments.calculator.CalculatorEnv", {}))
    m = RolloutManager(DenseInferenceConfig(), SPEC, cur, tokenizer, None, backend=ScriptedBackend(tokenizer, ["x"]))
    m.sample_batch("cats", 2, 2, "train", 0, 1, "w")
    m.sample_batch("calc", 2, 2, "train", 0, 1, "w")
    closed: list[str] = []

    def failing() -> None:
        closed.append("cats")
        raise RuntimeError("boom")

    envs = {type(e).__name__: e for e in m._environments.values()}
    assert sorted(envs) == ["CalculatorEnv", "CatsEnv"]
    envs["CatsEnv"].close = failing  # type: ignore[method-assign]
    envs["CalculatorEnv"].close = lambda: closed.append("calc")  # type: ignore[method-assign]
    m.shutdown()
    m.shutdown()
    assert sorted(closed) == ["calc", "cats"]
