"""Episodes captured from the generate endpoint as rollout rows (pipeline/environments/episodes.py) and the `agent`
environment (pipeline/environments/agent.py): any OpenAI-speaking program as an episode runner.

Unit tests answer from `ScriptedContext` (the endpoint and the agent program are real; the sampler is scripted).
The whole-job test runs configs/agent_example.yaml on CPU: a rollout worker's endpoint over the real sampler, the
agent script (configs/agents/cat_agent.py, the real `openai` SDK) run per episode as a subprocess; every rollout row
carries exactly the ids and logprobs the sampler produced (the endpoint's capture log, written where the sampler
returned them) and the reward the agent printed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import draccus
import numpy as np
import pytest
from jobs import ROOT, run_job

from pipeline.config import ConfigError, CurriculumConfig, EnvConfig, LessonConfig, RLJobConfig, SamplingParams
from pipeline.config.validate import check_environment_args
from pipeline.environments.agent import AgentEnv
from pipeline.environments.base import EnvGroup, SampleSpec, summarize
from pipeline.environments.endpoint import CapturedCall
from pipeline.environments.episodes import rollouts_from_calls
from pipeline.environments.scripted import ScriptedContext
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.rollout.rollout_batch import RolloutBatch, RolloutMetadata, batch_stats, schema_rows
from pipeline.store import layout
from pipeline.store.storage import RunStore
from policy.evaluation import with_pass_at_k
from schemas import ROLLOUT

sys.path.insert(0, str(ROOT / "configs" / "agents"))
import cat_agent  # the example agent script, importable from its folder

TASKS = [{"id": "t1", "prompt": "Tell me about cats.", "turns": 2}, {"id": "t2", "prompt": "Say hi.", "turns": 2}]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("builtin:tiny")


def spec(n: int = 2, g: int = 3, mode: str = "train") -> SampleSpec:
    return SampleSpec(n, g, temperature=1.0, max_tokens=8, stop_tokens=None, mode=mode)


class Ctx(ScriptedContext):
    max_seq_len = 128
    policy_step = 5


def agent(task: dict[str, Any], *, base_url: str, api_key: str) -> Any:
    """An entry point for the tests: the example agent's episode, in a thread."""
    return cat_agent.run(task, base_url=base_url, api_key=api_key)


def failing_agent(task: dict[str, Any], *, base_url: str, api_key: str) -> Any:
    if task["id"] == "t2":
        raise RuntimeError("the agent gave up")
    return cat_agent.run(task, base_url=base_url, api_key=api_key)


def test_calls_become_segments_with_masks_rewards_and_oldest_step() -> None:
    p = [1, 10, 11]
    calls = [
        CapturedCall(p, [20, 21], [-0.1, -0.2], "stop", 4),
        CapturedCall([*p, 20, 21, 30, 31], [22], [-0.3], "stop", 3),  # extends: 30, 31 are inserted
        CapturedCall([1, 10, 99], [23, 2], [-0.4, -0.5], "length", 6),  # rewrote its history: a new segment
    ]
    rows = rollouts_from_calls(calls, env_name="e", example_id="x", episode_reward=0.75, episode_id="ep")
    assert [(r.episode_id, r.segment_index) for r in rows] == [("ep", 0), ("ep", 1)]
    first, second = rows
    assert first.prompt_tokens == p and first.response_tokens == [20, 21, 30, 31, 22]
    assert first.response_loss_mask == [1, 1, 0, 0, 1]
    assert first.response_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert first.token_rewards == [0.0] * 5 and first.policy_step == 3
    assert second.prompt_tokens == [1, 10, 99] and second.response_tokens == [23, 2]
    assert second.token_rewards == [0.0, 0.75] and second.truncated and second.policy_step == 6
    assert {r.episode_reward for r in rows} == {0.75}
    with pytest.raises(ValueError, match="no calls"):
        rollouts_from_calls([], env_name="e", example_id="x", episode_reward=1.0, episode_id="ep")
    bad = [CapturedCall(p, [20], [], "stop", 1)]
    with pytest.raises(ValueError, match="logprobs"):
        rollouts_from_calls(bad, env_name="e", example_id="x", episode_reward=1.0, episode_id="ep")


def test_an_episode_of_several_segments_counts_once_in_rates_and_pass_at_k() -> None:
    p = [1, 10, 11]
    split = [CapturedCall(p, [20], [-0.1], "stop", 0), CapturedCall([1, 99], [21, 2], [-0.2, -0.3], "stop", 0)]
    whole = [CapturedCall(p, [22, 2], [-0.4, -0.5], "stop", 0)]
    won = rollouts_from_calls(split, env_name="e", example_id="x", episode_reward=1.0, episode_id="won")
    lost = rollouts_from_calls(whole, env_name="e", example_id="x", episode_reward=0.0, episode_id="lost")
    assert len(won) == 2 and len(lost) == 1
    metrics = summarize([EnvGroup("g", [*won, *lost])], [], n_examples=1, success=lambda r: r.episode_reward > 0)
    assert metrics["success_rate"] == 0.5 and metrics["mean_reward"] == 0.5 and metrics["n_rollouts"] == 3
    pairs = [("g", r) for r in [*won, *lost]]
    rows = schema_rows(pairs, "l", "b", SamplingParams(temperature=1.0), 0, "w", 0.0, None)
    batch = RolloutBatch("b", "l", "eval", 1.0, RolloutMetadata("w", 0.0, 0), rows, successes=[True, True, False])
    stats = batch_stats(batch)
    assert (stats.success_rate, stats.mean_reward, stats.n_rows) == (0.5, 0.5, 3)
    summary = with_pass_at_k(stats.to_summary_row("eval", "test"), batch, 0)
    assert (summary.samples_per_problem, summary.pass_at_k) == (2, 1.0)


def test_entry_point_agent_multi_turn_rows(tok: Any) -> None:
    ctx = Ctx(tok, ["the cat", "cat cat meow"], logprob=-0.5)
    env = AgentEnv(tasks=TASKS, entry_point="test_agent_env:agent", concurrency=4)
    result = env.sample(ctx, spec(2, 3), np.random.default_rng(0))
    assert not result.failures and len(result.groups) == 2
    for group in result.groups:
        assert len(group.rollouts) == 3  # n_generations episodes, one segment each
        for r in group.rollouts:
            mask = r.response_loss_mask
            assert 0 in mask and mask[0] == 1 and mask[-1] == 1  # two turns, the "More." turn inserted in between
            assert [lp for lp, m in zip(r.response_logprobs, mask, strict=True) if m] == [-0.5] * sum(mask)
            assert {lp for lp, m in zip(r.response_logprobs, mask, strict=True) if not m} == {0.0}
            said = r.extracted_answer or ""
            cats, brief = min(said.lower().count("cat"), 4) / 4, max(0.0, 1 - len(said) / 64)
            assert r.reward_components == {"cats": cats, "brief": brief}
            assert r.episode_reward == pytest.approx(cats + 0.1 * brief) and r.policy_step == 5
    # the sampled ids are the scripted sampler's: each turn's prompt is exactly what it was given
    sampled = [p for prompts, _ in ctx.calls for p in prompts]
    assert all(r.prompt_tokens in sampled for g in result.groups for r in g.rollouts)
    assert result.metrics["endpoint_generate_calls"] < result.metrics["endpoint_requests"]  # batched


def test_agent_failures_are_example_failures_with_reasons(tok: Any) -> None:
    ctx = Ctx(tok, ["cat"])
    env = AgentEnv(tasks=TASKS, entry_point="test_agent_env:failing_agent")
    result = env.sample(ctx, spec(2, 2, "eval"), np.random.default_rng(0))
    assert [g.rollouts[0].example_id for g in result.groups] == ["t1"]
    assert [(f.example_id, f.reason) for f in result.failures] == [
        ("t2", "the entry point raised RuntimeError: the agent gave up")
    ]
    py = "{python} -c"
    cases = {
        f"{py} 'import sys; sys.exit(3)'": "exited with status 3",
        f"{py} 'print(1)'": "made no call to the endpoint",
        f"{py} 'print(\"no json here\")'": "printed no JSON result line",
        f"{py} 'import time; time.sleep(30)'": "timed out after 1 s",
        f"{py} 'print(\"{{}}\")'": "no numeric 'reward'",
    }
    for command, why in cases.items():
        env = AgentEnv(tasks=TASKS[:1], command=command, timeout_s=1)
        result = env.sample(ctx, spec(1, 1, "eval"), np.random.default_rng(0))
        assert not result.groups and why in result.failures[0].reason, (command, result.failures)


def test_command_agent_gets_task_and_url(tok: Any, tmp_path: Path) -> None:
    ctx = Ctx(tok, ["a cat"])
    env = AgentEnv(
        tasks=[{"id": "only", "prompt": "Say cat."}], command="{python} configs/agents/cat_agent.py", cwd=str(ROOT)
    )
    result = env.sample(ctx, spec(1, 2), np.random.default_rng(1))
    assert not result.failures, result.failures
    [group] = result.groups
    assert [r.extracted_answer for r in group.rollouts] == ["a cat", "a cat"]
    assert [r.episode_reward for r in group.rollouts] == [pytest.approx(0.25 + 0.1 * (1 - 5 / 64))] * 2


def test_config_checks(tmp_path: Path) -> None:
    base = {"tasks": TASKS, "entry_point": "test_agent_env:agent"}
    AgentEnv.check_args(base)
    bad = {
        "host": {**base, "host": "0.0.0.0", "token_env": "RLPIPE_TEST_UNSET_TOKEN"},
        "entry_point": {**base, "command": "echo"},
        "tasks": {**base, "tasks": str(tmp_path / "missing.jsonl")},
        "scorer": {**base, "scorer": "no_such_module:f"},
    }
    for field, args in bad.items():
        with pytest.raises(ConfigError) as e:
            AgentEnv.check_args(args)
        assert e.value.field == field
    AgentEnv.check_args({**base, "host": "0.0.0.0", "token": "t"})
    lessons = {"a": LessonConfig("a", env=EnvConfig("agent", bad["host"]))}
    with pytest.raises(ConfigError, match=r"curriculum\.lessons\.a\.env\.env_args\.host.*token"):
        check_environment_args(CurriculumConfig(lessons=lessons))


@pytest.mark.slow
def test_agent_job_rows_carry_the_samplers_ids_and_the_agents_rewards(tmp_path: Path, tok: Any) -> None:
    cfg = draccus.parse(RLJobConfig, config_path=str(ROOT / "configs/agent_example.yaml"), args=[])
    log = tmp_path / "capture.jsonl"
    lesson = cfg.curriculum.lessons["cat_agent"]
    env = dataclasses.replace(lesson.env, env_args={**lesson.env.env_args, "capture_log": str(log)})
    cfg = dataclasses.replace(
        cfg,
        store=dataclasses.replace(cfg.store, run_root=str(tmp_path / "run")),
        train=dataclasses.replace(cfg.train, num_train_steps=2),
        curriculum=dataclasses.replace(cfg.curriculum, lessons={"cat_agent": dataclasses.replace(lesson, env=env)}),
    )
    path = tmp_path / "job.yaml"
    path.write_text(draccus.dump(cfg))
    proc = run_job(path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sampled = [json.loads(line) for line in log.read_text().splitlines()]
    by_ids = {(tuple(s["prompt_ids"]), tuple(s["completion_ids"])): s for s in sampled}
    store = RunStore(str(tmp_path / "run"))
    rows = 0
    for step_dir in store.list(layout.ROLLOUTS):
        for file in store.list_committed(step_dir):
            table = store.read_committed(file, ROLLOUT)
            for row in table.to_pylist() if table is not None else []:
                rows += 1
                assert row["response_loss_mask"] == [1] * len(row["response_tokens"])  # one call per episode
                s = by_ids[(tuple(row["prompt_tokens"]), tuple(row["response_tokens"]))]
                assert row["response_logprobs"] == pytest.approx(s["logprobs"], abs=0)
                assert row["policy_step"] == s["policy_step"] and row["episode_id"]
                # the agent saw exactly these tokens, and its reward is on the row
                text = tok.decode([t for t in row["response_tokens"] if t != tok.eos_token_id])
                assert row["extracted_answer"] == text.strip()  # chat content is the stripped text
                comps = dict(row["reward_components"])  # a parquet map column reads as (key, value) pairs
                assert comps["cats"] == min(text.lower().count("cat"), 4) / 4
                assert row["episode_reward"] == pytest.approx(comps["cats"] + 0.1 * comps["brief"])
    assert rows >= 2 * 16  # at least one file per batch slot of 16 rows
