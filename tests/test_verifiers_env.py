"""verifiers environments as rlpipe lessons (`pipeline.environments.verifiers_env`), through the real generate
endpoint and verifiers' own training client: the tool loop and its masks on a scripted sampler, and a whole CPU job
with a single-turn and a multi-turn (Python tool) verifiers environment defined in tests/verifiers_envs.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from jobs import ROOT

from pipeline.config import ConfigError
from pipeline.environments.base import SampleSpec
from pipeline.environments.scripted import ScriptedContext
from pipeline.environments.tokenizer import build_tiny_tokenizer
from pipeline.environments.verifiers_env import VerifiersEnv

ENVS = "tests/verifiers_envs.py"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 1}}</tool_call>'


def _script(prompt: str) -> str:
    """Call the tool first; answer once a tool result is in the prompt."""
    return "Answer: 3" if "<bos>tool\n" in prompt else CALL


def test_tool_episode_masks_tool_tokens_and_records_each_reward(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer()
    log = tmp_path / "capture.jsonl"
    env = VerifiersEnv(env=f"{ENVS}:tool_use", max_turns=3, max_seq_len=256, capture_log=str(log))
    spec = SampleSpec(n_examples=1, n_generations=2, temperature=1.0, max_tokens=64, stop_tokens=None, mode="eval")
    res = env.sample(ScriptedContext(tok, _script, logprob=-0.5), spec, np.random.default_rng(0))
    assert not res.failures, res.failures  # includes: verifiers' TurnTokens agree with the endpoint's capture
    (group,) = res.groups
    assert len({r.episode_id for r in group.rollouts}) == 2
    sampled = [json.loads(line) for line in log.read_text().splitlines()]
    for row in group.rollouts:
        assert row.example_id == "sum-0" and row.segment_index == 0
        assert row.reward_components == {"correct": 1.0, "used_tool": 1.0} and row.episode_reward == 2.0
        # two sampled turns (mask 1, the sampler's ids and logprobs) around the tool message (mask 0, logprob 0.0)
        first = next(s for s in sampled if s["prompt_ids"] == row.prompt_tokens)
        assert first["completion_ids"] == row.response_tokens[: len(first["completion_ids"])]
        n1 = len(first["completion_ids"])
        second = next(s for s in sampled if s["prompt_ids"] == row.prompt_tokens + row.response_tokens[:-3])
        n2 = len(second["completion_ids"])
        assert row.response_tokens[-n2:] == second["completion_ids"]
        assert row.response_loss_mask == [1] * n1 + [0] * (len(row.response_tokens) - n1 - n2) + [1] * n2
        assert row.response_logprobs[:n1] == first["logprobs"] and row.response_logprobs[-n2:] == second["logprobs"]
        assert set(row.response_logprobs[n1:-n2]) == {0.0}
        assert "<bos>tool\n3<eos>" in tok.decode(row.response_tokens[n1:-n2])


def test_a_missing_environment_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="env="):
        VerifiersEnv.check_args({"env": f"{ENVS}:no_such_function"})
    with pytest.raises(ConfigError, match="env="):
        VerifiersEnv.check_args({"env": "no_such_taskset_id"})
    VerifiersEnv.check_args({"env": f"{ENVS}:single_turn"})


@pytest.mark.slow
@pytest.mark.parametrize("lesson", ["cats", "sum"])
def test_whole_job_trains_on_verifiers_envs(tmp_path: Path, lesson: str) -> None:
    """A one-step CPU job on one lesson: the single-turn env (two reward functions) or the tool env (max_turns 2).
    Every committed row's sampled tokens and logprobs are those of a call in the endpoint's capture record, and its
    reward components are the environment's reward functions."""
    import subprocess
    import sys

    from pipeline.store import layout
    from pipeline.store.storage import RunStore
    from schemas import ROLLOUT

    cfg = yaml.safe_load((ROOT / "configs/verifiers_example.yaml").read_text())
    cfg["store"]["run_root"] = str(tmp_path / "run")
    logs = {"cats": tmp_path / "cats.jsonl", "sum": tmp_path / "sum.jsonl"}
    lessons = cfg["curriculum"]["lessons"]
    lessons.clear()
    for lid, fn, turns in (("cats", "single_turn", 1), ("sum", "tool_use", 2)):
        if lid != lesson:
            continue
        args = {"env": f"{ENVS}:{fn}", "max_turns": turns, "max_seq_len": 64, "capture_log": str(logs[lid])}
        env = {"env_class": "pipeline.environments.verifiers_env.VerifiersEnv", "env_args": args}
        lessons[lid] = {"lesson_id": lid, "chat": True, "env": env}
    cfg["train"]["num_train_steps"] = 1
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "steps.run", "--config_path", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = RunStore(str(tmp_path / "run"))
    rows = []
    for step in range(0, 2):
        for name in store.list(layout.rollout_step_dir(step)):
            if name.endswith(".parquet"):
                rows.extend(store.read_parquet(name, ROLLOUT).to_pylist())
    assert rows
    seen = set()
    for row in rows:
        lid = "cats" if row["env_name"] == "single_turn" else "sum"
        seen.add(lid)
        sampled = [json.loads(line) for line in logs[lid].read_text().splitlines()]
        mask = row["response_loss_mask"]
        # the row's first sampled run is exactly one call the sampler made on this prompt (ids and logprobs)
        tokens, logprobs = row["response_tokens"], row["response_logprobs"]
        matches = [
            s
            for s in sampled
            if s["prompt_ids"] == row["prompt_tokens"]
            and s["completion_ids"] == tokens[: len(s["completion_ids"])]
            and s["logprobs"] == logprobs[: len(s["logprobs"])]
        ]
        assert matches, row["episode_id"]
        n = len(matches[0]["completion_ids"])
        assert mask[:n] == [1] * n
        if lid == "cats":  # one call per episode: the whole response is that call
            assert len(tokens) == n
        names = {"cats": {"says_cats", "brevity"}, "sum": {"correct", "used_tool"}}[lid]
        components = dict(row["reward_components"])
        assert set(components) == names
        weights = {"brevity": 0.5}  # Reward.value is score * weight: the components already carry the weights
        assert row["episode_reward"] == pytest.approx(sum(components.values()))
        assert all(0.0 <= v <= weights.get(k, 1.0) for k, v in components.items())
    assert seen == {lesson}
