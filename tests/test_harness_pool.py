"""The warm harness pool of verifiers lessons (`pipeline.environments.harness_pool`, used by `VerifiersEnv`): real
verifiers episodes (the `null` harness's chat program in pool processes, the generate endpoint, a scripted sampler)
reuse a bounded set of processes, give the rows a process per episode gives, fail only the episode whose process
is killed (and replace it), restart a shared tool server that died, and leave no process behind after `close()`."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pipeline.environments.base import SampleResult, SampleSpec
from pipeline.environments.scripted import ScriptedContext
from pipeline.environments.tokenizer import build_tiny_tokenizer
from pipeline.environments.verifiers_env import VerifiersEnv

CATS = "configs/envs/verifiers_cats.py:load_environment"
SUM = "configs/envs/verifiers_sum.py:load_environment"
CALL = '<tool_call>{"name": "adder_add", "arguments": {"a": 2, "b": 1}}</tool_call>'


def _say(prompt: str) -> str:
    """A reply that depends on the prompt (so rows differ between tasks)."""
    return f"cats {prompt[-12:-6]}"


def _rows(res: SampleResult) -> list[tuple[object, ...]]:
    """Every row's ids, tokens, logprobs, mask and rewards."""
    return [
        (r.example_id, r.episode_id, r.prompt_tokens, r.response_tokens, r.response_logprobs, r.response_loss_mask,
         r.token_rewards, r.episode_reward, r.reward_components)
        for g in res.groups for r in g.rollouts
    ]  # fmt: skip


def _descendants() -> dict[int, str]:
    """pid -> command line of every live (not zombie) descendant of this process."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent[int(entry)] = int(fields[1])
    mine, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - mine
        mine |= frontier
    out = {}
    for pid in mine:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return out


def _wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_pool_reuses_its_processes_and_gives_the_rows_of_a_process_per_episode() -> None:
    tok = build_tiny_tokenizer()
    spec = SampleSpec(n_examples=2, n_generations=2, temperature=1.0, max_tokens=16, stop_tokens=None, mode="train")
    pooled = VerifiersEnv(env=CATS, max_seq_len=256, harness_pool_size=2)
    fresh = VerifiersEnv(env=CATS, max_seq_len=256, harness_pool_size=0)
    try:
        first = pooled.sample(ScriptedContext(tok, _say, logprob=-0.25), spec, np.random.default_rng(5))
        pooled.sample(ScriptedContext(tok, _say, logprob=-0.25), spec, np.random.default_rng(6))
        pool = pooled.harness_pool
        assert pool is not None
        # 8 episodes, at most 2 at once: 2 processes started, each reused
        assert (pool.stats.starts, pool.stats.episodes, pool.stats.deaths) == (2, 8, 0)
        baseline = fresh.sample(ScriptedContext(tok, _say, logprob=-0.25), spec, np.random.default_rng(5))
        assert fresh.harness_pool is None
        assert not first.failures and not baseline.failures
        assert len(_rows(first)) == 4 and _rows(first) == _rows(baseline)  # token ids, logprobs, masks, rewards
        assert first.metrics == baseline.metrics
    finally:
        pooled.close()
        fresh.close()
    assert not set(pool.stats.pids) & set(_descendants())


def test_a_killed_harness_process_fails_its_episode_with_the_reason_and_is_replaced() -> None:
    tok = build_tiny_tokenizer()
    spec = SampleSpec(n_examples=1, n_generations=1, temperature=1.0, max_tokens=16, stop_tokens=None, mode="eval")
    env = VerifiersEnv(env=CATS, max_seq_len=256, harness_pool_size=1)
    try:
        assert not env.sample(ScriptedContext(tok, _say), spec, np.random.default_rng(0)).failures
        pool = env.harness_pool
        assert pool is not None and pool.stats.starts == 1
        victim = pool.stats.pids[0]

        def kill_then_answer(prompt: str) -> str:  # the program is waiting for this reply when its process dies
            os.kill(victim, signal.SIGKILL)
            return _say(prompt)

        res = env.sample(ScriptedContext(tok, kill_then_answer), spec, np.random.default_rng(1))
        (failure,) = res.failures
        assert f"harness pool process (pid {victim}) died mid-episode: killed by signal SIGKILL" in failure.reason
        assert res.metrics["failures"] == 1.0 and not res.groups
        again = env.sample(ScriptedContext(tok, _say), spec, np.random.default_rng(2))
        assert not again.failures and len(again.groups) == 1
        assert (pool.stats.starts, pool.stats.deaths) == (2, 1) and pool.live_pids() == [pool.stats.pids[1]]
    finally:
        env.close()


def test_a_dead_tool_server_is_restarted_and_close_leaves_no_process() -> None:
    before = set(_descendants())
    tok = build_tiny_tokenizer()
    spec = SampleSpec(n_examples=1, n_generations=2, temperature=1.0, max_tokens=64, stop_tokens=None, mode="eval")
    ctx = ScriptedContext(tok, lambda p: "Answer: 3" if "<bos>tool\n" in p else CALL)
    env = VerifiersEnv(env=SUM, max_turns=3, max_seq_len=256, harness_pool_size=2)
    try:
        res = env.sample(ctx, spec, np.random.default_rng(0))
        assert not res.failures and res.metrics["reward/used_tool"] == 1.0

        def servers() -> list[int]:
            return [p for p, cmd in _descendants().items() if "-m verifiers_sum" in cmd]

        (server,) = servers()  # one shared tool server for the environment (two episodes ran at once)
        os.kill(server, signal.SIGKILL)
        # reaped (its last thread gone, so its socket closed), not merely a zombie leader
        _wait_for(lambda: not Path(f"/proc/{server}").exists(), "the tool server to die")
        res = env.sample(ctx, spec, np.random.default_rng(1))
        assert not res.failures, [f.reason[:3000] for f in res.failures]
        assert res.metrics["reward/used_tool"] == 1.0
        (restarted,) = servers()
        assert restarted != server
        pool = env.harness_pool
        assert pool is not None and pool.stats.starts == 2 and len(pool.live_pids()) == 2
        assert set(pool.live_pids()) <= set(_descendants())
    finally:
        env.close()
    assert set(_descendants()) - before == set()  # no pool process, tool server or child of theirs remains
