"""verifiers environments as rlpipe lessons (`pipeline.environments.verifiers_env`): verifiers' own rollout loop (an
`Agent` running the `null` harness's chat program, its `TrainClient`, its tool servers, its scoring) against the
real generate endpoint. The tool episode and its masks on a scripted sampler, and one whole CPU job with both shipped
examples as lessons, the single-turn one (configs/envs/verifiers_cats.py) and the multi-turn Python-tool one
(configs/envs/verifiers_sum.py), whose policy 0 is a tiny SFT run on transcripts that call the tool, so that the
job's own sampled episodes call it."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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
N_SUM = 4
"""Tasks of the tool lesson in the whole job (each has an SFT transcript)."""
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


def _tool_transcripts(n: int) -> list[dict[str, Any]]:
    """SFT records (chats) for the `n` tasks of verifiers_sum: call `adder_add` on the task's numbers, then answer
    with the tool's result. The system message is the text the tiny tokenizer's chat template renders for a tool
    list (`<bos>system\nTools: adder_add<eos>`), so the SFT prompts are token for token the job's prompts."""
    sys.path.insert(0, str(ROOT / "configs/envs"))
    try:
        from verifiers_sum import load_environment
    finally:
        sys.path.remove(str(ROOT / "configs/envs"))
    out = []
    for task in load_environment(n=n).load():
        a, b = (int(x) for x in re.findall(r"\d+", task.data.prompt)[:2])
        call = json.dumps({"name": "adder_add", "arguments": {"a": a, "b": b}})
        chat = [{"role": "system", "content": "Tools: adder_add"}, {"role": "user", "content": task.data.prompt},
                {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                {"role": "tool", "content": str(a + b)},
                {"role": "assistant", "content": f"Answer: {a + b}"}]  # fmt: skip
        out.append({"messages": chat})
    return out


def _run(module: str, config: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--config_path", str(config)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_whole_job_trains_on_a_single_turn_and_a_tool_using_verifiers_env(tmp_path: Path) -> None:
    """One CPU job, two verifiers lessons: `cats` (one call, two reward functions) and `sum` (a Python tool, up to two
    calls). Policy 0 is a 150-step SFT run on tool-calling transcripts of the four `sum` tasks, so sampled `sum`
    episodes call the tool. Every committed row's sampled tokens and logprobs are those of calls in the endpoint's
    capture record (verifiers' own `TurnTokens` are checked against the same capture by the environment: a
    disagreement would fail the example), the tool result between two calls is in the row with mask 0 and logprob 0,
    and the reward components are the environment's reward functions."""
    from pipeline.store import layout
    from pipeline.store.storage import RunStore
    from schemas import ROLLOUT

    base = yaml.safe_load((ROOT / "configs/verifiers_example.yaml").read_text())
    model = {**base["model"], "max_seq_len": 128}
    data = tmp_path / "tool_chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _tool_transcripts(N_SUM)))
    sft = {"store": {"run_root": str(tmp_path / "sft")}, "model": model,
           "source": {"type": "files", "paths": [str(data)]},
           "optimizer": {"learning_rate": 0.01, "warmup_steps": 0}, "num_train_steps": 150, "batch_size": 4,
           "seq_len": 128, "pack": False, "checkpoint_interval": 1000}  # fmt: skip
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(sft))
    _run("steps.sft", tmp_path / "sft.yaml")

    # The rollout worker draws each sampling call's lesson at random (its generator is seeded with the time), so a
    # job of four or more calls leaves a lesson out now and then (at most 1 in 8): then the job runs again from the
    # same SFT policy in a fresh run root, at most three times in all (the assertions below hold for the last).
    for attempt in range(3):
        run_root, logs = tmp_path / f"run{attempt}", {k: tmp_path / f"{k}{attempt}.jsonl" for k in ("cats", "sum")}
        cfg = dict(base, evaluator=False, model={**model, "init_policy": str(tmp_path / "sft")})
        cfg["store"] = {"run_root": str(run_root)}
        # four 2-row sampling calls per batch of 8: a staleness window and a lead that let four writes into one batch
        cfg["train"] = {**base["train"], "num_train_steps": 1, "seq_len": 128, "max_lag": 3}
        cfg["pacing"] = {**base["pacing"], "max_steps_ahead": 2}
        lessons = cfg["curriculum"]["lessons"] = {}
        # the tool lesson samples at temperature 0.5: the tiny SFT policy writes a well-formed call (51 tokens) most
        # of the time there, and at 1.0 only about one episode in four
        for lid, ref, turns, max_tokens, temp, kwargs in (
            ("cats", CATS, 1, 8, 1.0, {}),
            ("sum", SUM, 2, 64, 0.5, {"n": N_SUM}),
        ):
            args = {"env": ref, "env_kwargs": kwargs, "max_turns": turns, "max_seq_len": 128,
                    "capture_log": str(logs[lid])}  # fmt: skip
            sampling = {"temperature": temp, "n_prompts": 1, "n_generations_per_prompt": 2, "max_tokens": max_tokens}
            lessons[lid] = {"lesson_id": lid, "chat": True, "env": {"env_class": "verifiers", "env_args": args},
                            "sampling_params": sampling}  # fmt: skip
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
        _run("steps.run", tmp_path / "job.yaml")
        store = RunStore(str(run_root))
        tables = [
            store.read_committed(f, ROLLOUT) for d in store.list(layout.ROLLOUTS) for f in store.list_committed(d)
        ]
        rows = [r for t in tables if t is not None for r in t.to_pylist()]
        if {r["lesson_id"] for r in rows} == {"cats", "sum"}:
            break
    # verifiers' own record of every sampled turn (its TurnTokens) agreed with the endpoint's capture: a
    # disagreement fails the example, and the worker lists each failure with its reason in the file's ready marker
    failures = [f for d in store.list(layout.ROLLOUTS) for p in store.list_committed(d)
                for f in store.read_marker(p).extra.get("failures", [])]  # fmt: skip
    assert not [f for f in failures if "disagree" in json.dumps(f)], failures
    assert {r["lesson_id"] for r in rows} == {"cats", "sum"}
    tok = build_tiny_tokenizer()
    sampled = {lid: [json.loads(line) for line in log.read_text().splitlines()] for lid, log in logs.items()}
    names = {"cats": {"says_cats", "brevity"}, "sum": {"correct", "used_tool"}}
    n_tool_rows = 0
    for row in rows:
        lid, tokens, logprobs, mask = (
            row["lesson_id"],
            row["response_tokens"],
            row["response_logprobs"],
            row["response_loss_mask"],
        )
        assert row["policy_step"] in (0, 1)  # the step the endpoint sampled with, reported per call
        components = dict(row["reward_components"])
        assert set(components) == names[lid]  # every reward function, each its own component
        assert row["episode_reward"] == pytest.approx(sum(components.values()))
        # the row = runs of sampled tokens (mask 1), each exactly one call's ids and logprobs, on exactly the prompt
        # the sampler saw (the prompt plus everything before the run); in between, mask 0 and logprob 0.0
        runs = [(m.start(), m.end()) for m in re.finditer("1+", "".join(map(str, mask)))]
        assert runs and runs[0][0] == 0
        for start, end in runs:
            call = [s for s in sampled[lid] if s["prompt_ids"] == row["prompt_tokens"] + tokens[:start]
                    and s["completion_ids"] == tokens[start:end] and s["logprobs"] == logprobs[start:end]]  # fmt: skip
            assert call, (row["episode_id"], start)
        for (_, end), (start, _) in itertools.pairwise(runs):
            assert set(logprobs[end:start]) == {0.0}
            assert "<bos>tool\n" in tok.decode(tokens[end:start])  # the tool's result, as the chat template put it
        if lid == "cats":
            assert len(runs) == 1 and len(tokens) == runs[0][1]
        elif len(runs) > 1:
            n_tool_rows += 1
            assert components["used_tool"] == 1.0
    assert n_tool_rows >= 1, "no sampled episode called the tool"
