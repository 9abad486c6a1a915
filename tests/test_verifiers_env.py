"""verifiers environments as rlpipe lessons (`pipeline.environments.verifiers_env`): verifiers' own rollout loop (an
`Agent` running the `null` harness's chat program, its `TrainClient`, its tool servers, its scoring) against the
real generate endpoint. The tool episode and its masks on a scripted sampler, and a whole CPU job with the shipped
single-turn (configs/envs/verifiers_cats.py) and multi-turn Python-tool (configs/envs/verifiers_sum.py) examples."""

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

CATS = "configs/envs/verifiers_cats.py:load_environment"
SUM = "configs/envs/verifiers_sum.py:load_environment"
CALL = '<tool_call>{"name": "adder_add", "arguments": {"a": 2, "b": 1}}</tool_call>'


def _script(prompt: str) -> str:
    """Call the tool first; answer once a tool result is in the prompt."""
    return "Answer: 3" if "<bos>tool\n" in prompt else CALL


def test_tool_episode_masks_tool_tokens_and_records_each_reward(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer()
    log = tmp_path / "capture.jsonl"
    env = VerifiersEnv(env=SUM, max_turns=3, max_seq_len=256, capture_log=str(log))
    spec = SampleSpec(n_examples=1, n_generations=2, temperature=1.0, max_tokens=64, stop_tokens=None, mode="eval")
    ctx = ScriptedContext(tok, _script, logprob=-0.5)
    ctx.policy_step = 7  # type: ignore[attr-defined]  # the worker's step, which the endpoint reports per call
    res = env.sample(ctx, spec, np.random.default_rng(0))
    assert not res.failures, res.failures  # includes: verifiers' recorded tokens agree with the endpoint's capture
    assert res.metrics["reward/correct"] == 1.0 and res.metrics["reward/used_tool"] == 1.0
    (group,) = res.groups
    assert len({r.episode_id for r in group.rollouts}) == 2
    sampled = [json.loads(line) for line in log.read_text().splitlines()]
    for row in group.rollouts:
        assert row.example_id == "sum-0" and row.segment_index == 0 and row.policy_step == 7
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
        VerifiersEnv.check_args({"env": "configs/envs/verifiers_cats.py:no_such_function"})
    with pytest.raises(ConfigError, match="env="):
        VerifiersEnv.check_args({"env": "no_such_taskset_id"})
    with pytest.raises(ConfigError, match="harness="):
        VerifiersEnv.check_args({"env": CATS, "harness": "no_such_harness"})
    VerifiersEnv.check_args({"env": CATS})


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
    for lid, ref, turns in (("cats", CATS, 1), ("sum", SUM, 2)):
        if lid != lesson:
            continue
        args = {"env": ref, "max_turns": turns, "max_seq_len": 64, "capture_log": str(logs[lid])}
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
                rows.extend((step, r) for r in store.read_parquet(name, ROLLOUT).to_pylist())
    assert rows
    seen = set()
    for step, row in rows:
        assert row["policy_step"] == step  # the step the endpoint sampled with, reported per call
        lid = lesson
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
