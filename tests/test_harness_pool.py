"""The warm harness pool of verifiers lessons (`pipeline.environments.harness_pool`, used by `VerifiersEnv`): real
verifiers episodes (the `null` harness's chat program in pool processes, the generate endpoint, a scripted sampler)
reuse a bounded set of processes, give the rows a process per episode gives (and so does the chat program run in
this process, the default), fail only the episode whose process is killed (and replace it), restart a shared tool
server that died, and leave no process behind after `close()`."""

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


def test_the_pool_and_the_in_process_program_give_the_rows_of_a_process_per_episode() -> None:
    tok = build_tiny_tokenizer()
    spec = SampleSpec(n_examples=2, n_generations=2, temperature=1.0, max_tokens=16, stop_tokens=None, mode="train")
    pooled = VerifiersEnv(env=CATS, max_seq_len=256, harness_pool_size=2, harness_in_process=False)
    fresh = VerifiersEnv(env=CATS, max_seq_len=256, harness_pool_size=0, harness_in_process=False)
    local = VerifiersEnv(env=CATS, max_seq_len=256)  # the default: the chat program in this process
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
        in_process = local.sample(ScriptedContext(tok, _say, logprob=-0.25), spec, np.random.default_rng(5))
        assert local.in_process_program is not None and local.in_process_program.runs == 4
        assert local.harness_pool is not None and local.harness_pool.stats.starts == 0
        assert _rows(in_process) == _rows(baseline) and in_process.metrics == baseline.metrics
    finally:
        pooled.close()
        fresh.close()
        local.close()
    assert not set(pool.stats.pids) & set(_descendants())


def test_a_killed_harness_process_fails_its_episode_with_the_reason_and_is_replaced() -> None:
    tok = build_tiny_tokenizer()
    spec = SampleSpec(n_examples=1, n_generations=1, temperature=1.0, max_tokens=16, stop_tokens=None, mode="eval")
    env = VerifiersEnv(env=CATS, max_seq_len=256, harness_pool_size=1, harness_in_process=False)
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
    env = VerifiersEnv(env=SUM, max_turns=3, max_seq_len=256, harness_pool_size=2, harness_in_process=False)
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


PROGRAM = """
import argparse
import sys

import certifi
from openai import AsyncOpenAI, DefaultAsyncHttpxClient


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--how")
    return parser.parse_args()


async def main():
    how = parse_args().how
    if how == "raise":
        raise ValueError("the program's own bug")
    if how == "exit":
        sys.exit(3)
    if how == "message":
        sys.exit("a message, not a code")


if __name__ == "__main__":
    raise RuntimeError("the in-process program must not run the script's entry point")
"""


def test_an_in_process_program_that_fails_gives_its_code_and_reason_and_the_next_run_goes_on(tmp_path: Path) -> None:
    """A chat program run in this process reports as a process would: a raised exception is exit 1 with its
    traceback, `sys.exit(n)` is n, `sys.exit("text")` is 1 with the text; the next run is unaffected."""
    import asyncio

    from pipeline.environments.harness_pool import InProcessChatProgram

    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    program = InProcessChatProgram(str(script))

    def run(how: str):  # type: ignore[no-untyped-def]
        return asyncio.run(program.run([f"--how={how}"], str(tmp_path)))

    failed = run("raise")
    assert failed.exit_code == 1 and "ValueError: the program's own bug" in failed.stderr, failed
    assert run("exit").exit_code == 3
    message = run("message")
    assert message.exit_code == 1 and "a message, not a code" in message.stderr, message
    assert run("ok").exit_code == 0 and program.runs == 4
