"""verifiers environments as rlpipe lessons: `VerifiersEnv` runs a verifiers (0.4.0, `verifiers.v1`) taskset's
tasks through verifiers' own rollout loop, its model calls served by the generate endpoint over the worker's sampler.

Config (`EnvConfig`): `env_class: pipeline.environments.verifiers_env.VerifiersEnv` and `env_args`:
- `env`: what to load, one of `package.module:function` or `path/to/file.py:function` (a function returning a
  `vf.Env` -- its taskset is used -- or a `vf.Taskset`; called with `env_kwargs`), or an installed taskset id
  (`vf.load_taskset`, e.g. `textarena`); `env_kwargs`: its keyword arguments (for an id: the taskset config's fields).
- `eval_env` / `eval_env_kwargs`: the same for the eval split (default: the train taskset, minus `eval_holdout`).
- `eval_holdout`: the last N tasks of the train taskset are the eval split and never drawn in train mode.
- `max_tasks`: how many tasks to read from an infinite taskset (bounded ones are read whole).
- `harness` / `harness_config`: the verifiers harness that plays each task (default `null`: verifiers' chat program,
  tool calls through the task's MCP tool servers; `bash` adds a shell on this machine) and its config fields.
- `max_turns`: model calls per episode (verifiers' `AgentConfig.max_turns`); `episode_timeout_s`: its rollout
  timeout; `tool_parser`: the `renderers` tool parser verifiers' client reads tool calls with (default `rlpipe-text`:
  `<tool_call>{json}</tool_call>` blocks in the decoded text, the built-in tiny tokenizer's chat-template format;
  `qwen3` where `<tool_call>` is one token); `max_seq_len`: the endpoint's bound on prompt + completion tokens;
  `capture_log`: a local file the endpoint appends each sampled choice to (a debug record; tests compare rows with it).
- `harness_in_process` (default true): verifiers' chat program runs in this process's event loop, no process of its
  own, for every episode whose program has no local tools (`--bash`, `--edit`, `--search`) and no harness
  environment variables (`pipeline.environments.harness_pool.InProcessChatProgram`); the others use the pool.
- `harness_pool_size` (default 16): how many warm harness processes run verifiers' chat program (the `null`/`bash`
  harnesses' program) when it cannot run in process, one episode at a time each, reused across episodes
  (`pipeline.environments.harness_pool`): at most this many episodes run their program at once, the others wait for
  a free process; 0 (with `harness_in_process: false`): a new process per episode, verifiers' own subprocess
  runtime unchanged. `harness_pool_max_episodes` (default 1000): a pool process is replaced after this many
  episodes (0: never).

Examples are tasks: an example id is the task's durable `data.id` when it has one, else `key:` plus the task's
content key (stable across processes and runs). Each example runs `n_generations` episodes (an RLOO group).

An episode is `vf.Agent(config).run(task)`, exactly as verifiers runs a single-agent rollout: it runs the harness
program (a subprocess runtime on this machine; by default a `PooledRuntime` the episode owns and places the run in,
whose chat program runs in this process or in a warm pool process instead of a new one), verifiers' interception
server between the program and the model, and the task's tool servers (the taskset's shared ones start once per
environment, and again when one stops answering, checked at the start of each `sample`; a task's own start per
episode, as in verifiers); `close()` ends the pool's processes and the shared tool servers. The endpoint batches
the episodes' calls by caller (`GenerateEndpoint.expect_callers`): a sampler call waits for a call from every
episode still running, not a timer window. The interception answers each model call through verifiers' training
client (`TrainClient`, `TrainClientConfig` pointed at the episode's capture URL of a
`pipeline.environments.endpoint.GenerateEndpoint`), which renders the prompt to token ids with the policy
tokenizer's chat template and calls `/inference/v1/generate`; the finished trace is scored by the task
(`@vf.reward` functions, judges) and the harness (`@vf.metric`). The episode reward is `Trace.reward` (the weighted
sum) and each reward function's weighted value is its own entry of `reward_components` (and, averaged per episode, the
rollout metric `env/reward/<name>` in the metrics file, the trackers and the report). Each `@vf.metric` value (a
finite number; task or harness) is averaged the same way, 0 for an episode without it, as `env/<name>_mean`: a task's
`turns`, `tool_calls`, `tool_errors`, `ended_at_turn<k>` metrics fill the report's Tool use section.

Offline: verifiers prepares its chat program with `uv sync --script` (installing uv from the network when missing);
`prepare_local_chat_program` instead records this interpreter, whose environment holds every package the script
declares, as the script's prepared interpreter, so the program runs unchanged without uv or a network. Tool servers
start as `python -m <toolset module>`: the environment's folder goes on `PYTHONPATH` (`expose_env_module`), and a
module defining a `Toolset` must run it as `__main__` (see configs/envs/verifiers_sum.py).

Rows come from the endpoint's capture of the episode's calls (`rollouts_from_calls`), never from re-tokenised
text: sampled tokens mask 1 with the sampler's logprobs, tool/template tokens between calls mask 0; a call whose
prompt does not extend the transcript starts a new segment of the same episode; a row's `policy_step` is the step
the endpoint sampled with (the worker's `ctx.policy_step`). verifiers' own record of the sampled tokens (its
`TurnTokens`, committed to the trace's message graph) must equal the capture, or the example fails. A trace that is
not `ok` (the harness, a tool server, the client, or scoring failed: verifiers records each on the trace), an
episode the endpoint captured nothing of, or a reward function without a score or with one that is not a finite
number (NaN, infinity) fails the whole example with the reason (`ExampleFailure`).

Not run: multi-agent `Env.run` (a `vf.Env` contributes its taskset; its agents are not played), container and
sandbox runtimes. verifiers' `PolicySpan` is not filled: verifiers 0.4.0's client ignores the endpoint's
`policy_step` and the span is stamped by the trainer on an `Episode`; rlpipe's rows carry the step instead.

Size: over 600 lines as the one adapter to one external library: loading verifiers' tasksets, wiring its client to
the endpoint, running an episode and checking its trace against the capture all speak verifiers 0.4.0's API, so a
verifiers upgrade is made here; the part that does not (the warm harness processes) is already
`pipeline.environments.harness_pool`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.config.base import ConfigError
from pipeline.environments.base import (
    EnvGroup,
    Environment,
    EnvRollout,
    ExampleFailure,
    InferenceContext,
    SampleResult,
    SampleSpec,
    check_mode,
    checked_reward,
    group_key,
)

if TYPE_CHECKING:
    from pipeline.environments.harness_pool import HarnessPool, InProcessChatProgram

logger = logging.getLogger(__name__)

MODEL_NAME = "policy"
"""The model name the client sends; the endpoint serves one policy whatever the name."""


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------


def _load_target(ref: str) -> Callable[..., Any]:
    """The function `ref` names (`package.module:function` or `path/to/file.py:function`)."""
    module_ref, _, attr = ref.rpartition(":")
    if module_ref.endswith(".py"):
        from verifiers.v1.utils.loaders import file_module

        if not Path(module_ref).is_file():
            raise ImportError(f"no file {module_ref!r}")
        module = file_module(module_ref)
    else:
        module = importlib.import_module(module_ref)
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"{module_ref!r} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def load_taskset(ref: str, kwargs: Mapping[str, Any]) -> Any:
    """The verifiers `Taskset` `ref` names (see the module docstring); raises ImportError/AttributeError/TypeError
    naming the cause."""
    import verifiers.v1 as vf

    if ":" in ref:
        made = _load_target(ref)(**dict(kwargs))
        if isinstance(made, vf.Env):
            return made.taskset
        if isinstance(made, vf.Taskset):
            return made
        raise TypeError(f"{ref!r} returned a {type(made).__name__}, not a verifiers Env or Taskset")
    from verifiers.v1.utils.loaders import taskset_config_type

    config = taskset_config_type(ref).model_validate({"id": ref, **dict(kwargs)})
    return vf.load_taskset(config)


def _tasks_of(taskset: Any, max_tasks: int) -> list[Any]:
    """The taskset's tasks in `load()` order: all of a bounded one, the first `max_tasks` of an infinite one."""
    view = taskset if taskset.bounded else taskset.take(max_tasks)
    return list(view)


def env_name(ref: str) -> str:
    """The default lesson name of an environment reference: its module's last name (`configs/envs/x.py:f` -> `x`,
    `pkg.mod:f` -> `mod`), or the taskset id."""
    module_ref = ref.rpartition(":")[0]
    if not module_ref:
        return ref
    return Path(module_ref).stem if module_ref.endswith(".py") else module_ref.rpartition(".")[2]


def example_id_of(task: Any) -> str:
    """A task's stable example id: its durable `data.id`, else `key:` + its content key (first 16 hex digits)."""
    if task.data.id:
        return str(task.data.id)
    return f"key:{str(task.key)[:16]}"


# ---------------------------------------------------------------------------------------
# the client's tool parser
# ---------------------------------------------------------------------------------------


TEXT_TOOL_PARSER = "rlpipe-text"
"""The tool parser `VerifiersEnv` registers with `renderers`: `<tool_call>{json}</tool_call>` blocks found in the
decoded text (qwen3's parser needs `<tool_call>` to be one token id, which it is not in the built-in tiny
tokenizer)."""


class TextToolParser:
    """`renderers` tool parser over decoded text: each `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
    block (by `pipeline.environments.chat.parse_tool_calls`) is a call; the content ids are those before the token
    where the first block starts."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def extract(self, ids: list[int]) -> tuple[list[int], list[Any]]:
        """(content ids, parsed calls) of a completion's ids (stop tokens already stripped)."""
        from renderers.base import ParsedToolCall

        from pipeline.environments.chat import parse_tool_calls

        text = self._tokenizer.decode(ids)
        _, calls = parse_tool_calls(text)
        if not calls:
            return ids, []
        offset = text.find("<tool_call>")
        start = 0
        while start < len(ids) and len(self._tokenizer.decode(ids[: start + 1])) <= offset:
            start += 1  # the content is the longest token prefix that ends at or before the opening tag
        parsed = [
            ParsedToolCall(
                raw=json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}),
                name=c["function"]["name"],
                arguments=c["function"]["arguments"],
            )
            for c in calls
        ]
        return ids[:start], parsed


def register_tool_parser() -> None:
    """Make `TEXT_TOOL_PARSER` a tool parser name `renderers.DefaultRendererConfig(tool_parser=...)` accepts."""
    from renderers.parsers import TOOL_PARSERS

    TOOL_PARSERS.setdefault(TEXT_TOOL_PARSER, TextToolParser)


# ---------------------------------------------------------------------------------------
# verifiers' own rollout loop, offline
# ---------------------------------------------------------------------------------------

CHAT_PROGRAM_DEPENDENCIES = ("openai", "mcp", "httpx", "httpx2", "tenacity", "certifi")
"""What verifiers' bundled chat program (the `null`/`bash` harnesses' PEP 723 script) imports; verifiers 0.4.0 pins
`mcp==2.0.0` in the script, and rlpipe's lock installs the same."""

_prepared = threading.Lock()


def prepare_local_chat_program() -> str:
    """Make verifiers' subprocess runtime run its chat program with this interpreter, offline; returns the script's
    path.

    verifiers' `null`/`bash` harnesses run a PEP 723 script (`CHAT_PROGRAM_SOURCE`) that `Runtime.prepare_uv_script`
    prepares with `uv sync --script` (installing uv with pip or curl first when it is missing): network, every time
    a fresh machine runs it. The subprocess runtime remembers each prepared script's interpreter in a class-level
    cache keyed by the script's path; this writes the script where that runtime looks for it and records this
    interpreter (whose environment has every dependency the script declares, checked here) as its prepared one, so
    the harness runs verifiers' own program, unchanged, without uv. Raises RuntimeError naming a missing
    dependency."""
    import hashlib
    import importlib.metadata
    import sys

    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    for dep in CHAT_PROGRAM_DEPENDENCIES:
        if importlib.util.find_spec(dep) is None:
            raise RuntimeError(f"verifiers' chat program needs {dep!r}, which this environment lacks (run make setup)")
    if f'"mcp=={importlib.metadata.version("mcp")}"' not in CHAT_PROGRAM_SOURCE:
        logger.warning(
            "verifiers' chat program pins another mcp than the installed %s", importlib.metadata.version("mcp")
        )
    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    with _prepared:
        if str(path) not in SubprocessRuntime._interpreters:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_file() or path.read_bytes() != data:
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(data)
                tmp.replace(path)
            SubprocessRuntime._interpreters[str(path)] = sys.executable
    return str(path)


def expose_env_module(ref: str) -> None:
    """Let verifiers' tool servers import the environment's module: it starts each `Toolset` as
    `python -m <the toolset's module>` in a subprocess, so the folder of a `path/to/file.py:function` environment
    (and the working directory, for a `package.module:function` one) goes on this process's `PYTHONPATH`."""
    module_ref = ref.rpartition(":")[0]
    folders = [str(Path(module_ref).resolve().parent)] if module_ref.endswith(".py") else []
    folders.append(os.getcwd())
    with _prepared:
        current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        missing = [f for f in folders if f not in current]
        if missing:
            os.environ["PYTHONPATH"] = os.pathsep.join([*current, *missing])


def share_client_ssl_context() -> None:
    """Make the httpx clients verifiers builds for its model clients share one SSL context.

    verifiers builds a new `TrainClient` (with a new `httpx.AsyncClient`) for every rollout whose endpoint URL is
    new, and every episode has its own capture URL; each new httpx client builds a new SSL context, parsing the CA
    bundle again (about 0.08 CPU s, most of an episode's cost in this process once the harness pool is warm).
    This replaces `verifiers.v1.clients.base.build_async_httpx` (what `build_async_openai` calls) with the same
    client built on one context made once by httpx's own defaults (`httpx.create_ssl_context()`): the same
    verification, built once. Idempotent."""
    import httpx
    from verifiers.v1.clients import base

    with _prepared:
        if getattr(base.build_async_httpx, "rlpipe_shared_ssl", False):
            return
        context = httpx.create_ssl_context()

        def build_async_httpx(config: Any) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                timeout=httpx.Timeout(**config.timeout.model_dump()), limits=base.DEFAULT_LIMITS, verify=context
            )

        build_async_httpx.rlpipe_shared_ssl = True  # type: ignore[attr-defined]
        base.build_async_httpx = build_async_httpx


def client_base_url(base_url: str) -> str:
    """The `base_url` an OpenAI client built on `base_url` reports (what renderers keys its caches by)."""
    return base_url.rstrip("/") + "/"


@contextlib.contextmanager
def known_prompt_limits(base_urls: list[str], model_cards: Mapping[str, Any]) -> Any:
    """Give renderers' client the engine's prompt-length cap of each episode's URL up front, and forget them after.

    renderers' `generate` looks the cap up once per client base URL (`GET /models`, then a cache keyed by the URL)
    under one module-level `asyncio.Lock`: every episode has its own capture URL, so each episode's first call
    waited for that lock and made one more round trip, in series across the episodes (their first calls reached the
    sampler one by one, not as a batch), the cache grew by one entry per episode for the life of the process, and
    the lock, bound to the first event loop that used it, failed every lookup from a second environment's loop.
    This stores, for each URL, exactly the value that lookup computes from the endpoint's `/v1/models` body
    (`model_cards`: its `max_model_len` when a card's id is the client's model name, else None), so the lookup is a
    cache hit, and removes the entries when the block ends."""
    from renderers import client as renderers_client

    value: int | None = None
    for card in model_cards.get("data") or []:
        if card.get("id") == MODEL_NAME:
            raw = card.get("max_model_len")
            value = raw if isinstance(raw, int) and raw > 0 else None
            break
    # a private cache of the pinned renderers: without it (another version) the lookups run as renderers makes them
    cache = getattr(renderers_client, "_max_prompt_len_cache", None)
    if not isinstance(cache, dict):
        yield
        return
    keys = [(client_base_url(url), MODEL_NAME) for url in base_urls]
    for key in keys:
        cache[key] = value
    try:
        yield
    finally:
        for key in keys:
            cache.pop(key, None)


@dataclass
class EpisodeResult:
    """One episode as verifiers' rollout loop left it: its scored trace, or why there is none."""

    trace: Any = None
    error: str | None = None


def trace_error(trace: Any) -> str | None:
    """Why a finished trace is not a usable result (`trace.ok` false: its last error), else None."""
    if trace.ok:
        return None
    last = trace.errors[-1] if trace.errors else None
    if last is None:
        return f"the rollout did not complete (stop: {trace.stop_condition})"
    return f"{last.type}: {last.message.strip()[-1000:]}"


def reward_components(trace: Any) -> dict[str, float]:
    """Each reward function's weighted value (`Reward.value`); one that did not score, or scored NaN, infinity or
    something not a number, is an error naming the function (`pipeline.environments.base.reward_problem`), not a 0."""
    out = {}
    for name, reward in trace.rewards.items():
        if reward is None:
            raise ValueError(f"reward function {name!r} produced no score")
        out[name] = checked_reward(reward.value, f"the score of reward function {name!r}")
    return out


def trace_metrics(trace: Any) -> dict[str, float]:
    """The trace's `@vf.metric` values (task and harness) that are finite numbers; one without a value is left out."""
    out = {}
    for name, value in trace.metrics.items():
        if isinstance(value, int | float) and math.isfinite(value):
            out[name] = float(value)
    return out


def sampled_tokens(trace: Any) -> tuple[list[int], list[float]]:
    """The sampled token ids and their logprobs verifiers recorded (its `TurnTokens`, committed to the trace's
    message graph), in sampling order: each sampled node's ids where its mask is set."""
    ids: list[int] = []
    logprobs: list[float] = []
    for node in trace.nodes:
        if not node.sampled:
            continue
        ids.extend(t for t, m in zip(node.token_ids, node.mask, strict=True) if m)
        logprobs.extend(float(x) for x in node.logprobs)
    return ids, logprobs


def tokens_disagree(trace: Any, calls: list[Any]) -> str | None:
    """Where verifiers' record of the sampled tokens (ids and logprobs, from its client's `TurnTokens`) differs from
    the endpoint's capture of the episode's calls (what the sampler produced), or None when they agree."""
    ids, logprobs = sampled_tokens(trace)
    captured_ids = [t for c in calls for t in c.completion_ids]
    captured_lps = [float(x) for c in calls for x in c.logprobs]
    if ids != captured_ids:
        return f"sampled ids ({len(ids)} recorded by verifiers, {len(captured_ids)} captured)"
    if logprobs != captured_lps:
        return "logprobs"
    return None


async def _answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether a server accepts a TCP connection at `url`'s host and port (a liveness probe of a tool server)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port or 80), timeout_s)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


# ---------------------------------------------------------------------------------------
# the environment
# ---------------------------------------------------------------------------------------


class VerifiersEnv(Environment):
    """A verifiers taskset as an rlpipe lesson (see the module docstring)."""

    name = "verifiers"

    def __init__(
        self,
        env: str,
        env_kwargs: dict[str, Any] | None = None,
        eval_env: str | None = None,
        eval_env_kwargs: dict[str, Any] | None = None,
        eval_holdout: int = 0,
        max_tasks: int = 10_000,
        max_turns: int = 1,
        harness: str = "null",
        harness_config: dict[str, Any] | None = None,
        episode_timeout_s: float = 600.0,
        tool_parser: str | None = TEXT_TOOL_PARSER,
        max_seq_len: int = 4096,
        name: str | None = None,
        capture_log: str | None = None,
        harness_pool_size: int = 16,
        harness_pool_max_episodes: int = 1000,
        harness_in_process: bool = True,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}: must be >= 1")
        if eval_holdout < 0:
            raise ValueError(f"eval_holdout={eval_holdout}: must be >= 0")
        if episode_timeout_s <= 0:
            raise ValueError(f"episode_timeout_s={episode_timeout_s}: must be > 0")
        if harness_pool_size < 0 or harness_pool_max_episodes < 0:
            raise ValueError(
                f"harness_pool_size={harness_pool_size}, harness_pool_max_episodes={harness_pool_max_episodes}: "
                "must be >= 0"
            )
        from verifiers.v1.utils.loaders import harness_config_type

        self.name = name or env_name(env)
        self.max_turns = max_turns
        self.harness = harness_config_type(harness).model_validate({**(harness_config or {}), "id": harness})
        self.episode_timeout_s = float(episode_timeout_s)
        self.tool_parser = tool_parser
        self.max_seq_len = max_seq_len
        self.capture_log = capture_log
        for ref in (env, eval_env):
            if ref is not None and ":" in ref:
                expose_env_module(ref)
        self._chat_program = prepare_local_chat_program()
        share_client_ssl_context()
        taskset = load_taskset(env, env_kwargs or {})
        tasks = _tasks_of(taskset, max_tasks)
        if eval_env is not None:
            eval_taskset = load_taskset(eval_env, eval_env_kwargs or {})
            self.tasks = {"train": tasks, "eval": _tasks_of(eval_taskset, max_tasks)}
            self._tasksets = {"train": taskset, "eval": eval_taskset}
        else:
            if eval_holdout >= len(tasks) and eval_holdout:
                raise ValueError(f"eval_holdout={eval_holdout} leaves no train task of {len(tasks)}")
            split = len(tasks) - eval_holdout
            self.tasks = {"train": tasks[:split], "eval": tasks[split:] if eval_holdout else tasks}
            self._tasksets = {"train": taskset, "eval": taskset}
        for mode, ts in self.tasks.items():
            if not ts:
                raise ValueError(f"the {mode} taskset of {env!r} has no task")
        self._tokenizer_dir: str | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shared: dict[str, tuple[Any, contextlib.AsyncExitStack]] = {}
        self._pool: HarnessPool | None = None
        if harness_pool_size:
            from pipeline.environments.harness_pool import HarnessPool

            self._pool = HarnessPool(harness_pool_size, harness_pool_max_episodes)
        self._in_process: InProcessChatProgram | None = None
        if harness_in_process:
            from pipeline.environments.harness_pool import InProcessChatProgram

            self._in_process = InProcessChatProgram(self._chat_program)
        self._closed = False

    @classmethod
    def check_args(cls, env_args: Mapping[str, Any]) -> None:
        """The named environment must be loadable (module/file and function, or an installed taskset id), and the
        harness an installed verifiers harness."""
        for key in ("env", "eval_env"):
            ref = env_args.get(key)
            if ref is None:
                if key == "env":
                    raise ConfigError(key, ref, "must name a verifiers environment ('module:function' or an id)")
                continue
            if not isinstance(ref, str) or not ref:
                raise ConfigError(key, ref, "must be a non-empty string")
            try:
                if ":" in ref:
                    _load_target(ref)
                else:
                    from verifiers.v1.utils.loaders import taskset_class

                    taskset_class(ref)
            except Exception as e:
                raise ConfigError(key, ref, f"cannot load it: {type(e).__name__}: {e}") from None
        harness = env_args.get("harness", "null")
        try:
            from verifiers.v1.utils.loaders import harness_config_type

            harness_config_type(harness).model_validate({**(env_args.get("harness_config") or {}), "id": harness})
        except Exception as e:
            raise ConfigError("harness", harness, f"not a usable verifiers harness: {type(e).__name__}: {e}") from None

    def _tokenizer_path(self, tokenizer: Any) -> str:
        """A folder holding the policy tokenizer, for the client's renderer (built once per environment)."""
        with self._lock:
            if self._tokenizer_dir is None:
                path = tempfile.mkdtemp(prefix="rlpipe-vf-tokenizer-")
                tokenizer.save_pretrained(path)
                self._tokenizer_dir = path
            return self._tokenizer_dir

    @property
    def harness_pool(self) -> HarnessPool | None:
        """The environment's pool of harness processes (None when `harness_pool_size` is 0)."""
        return self._pool

    @property
    def in_process_program(self) -> InProcessChatProgram | None:
        """The chat program run in this process (None when `harness_in_process` is false)."""
        return self._in_process

    def close(self) -> None:
        """End the harness pool's processes, stop the shared tool servers and the event loop, and remove the
        tokenizer folder; waits for all of it. Idempotent; `sample` after `close` raises RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop = self._loop
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
        if self._tokenizer_dir:
            shutil.rmtree(self._tokenizer_dir, ignore_errors=True)
            self._tokenizer_dir = None

    async def _shutdown(self) -> None:
        if self._pool is not None:
            await self._pool.close()
        for _, stack in self._shared.values():
            with contextlib.suppress(Exception):
                await stack.aclose()
        self._shared.clear()

    def __del__(self) -> None:
        if getattr(self, "_tokenizer_dir", None):
            shutil.rmtree(self._tokenizer_dir, ignore_errors=True)  # type: ignore[arg-type]

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The environment's event loop (started on first use in a daemon thread)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"environment {self.name!r} is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name=f"verifiers-{self.name}", daemon=True).start()
                self._loop = loop
            return self._loop

    async def _shared_tools(self, mode: str) -> Any:
        """The taskset's shared (taskset-scoped) tool servers, started once for the environment's life (verifiers'
        `serve_shared`, as its `Env.serving` does for an eval) and started again when one stops answering (checked
        once per `sample`, before its episodes start); task-scoped ones start per rollout."""
        from verifiers.v1.mcp.launch import serve_shared

        taskset = self._tasksets[mode]
        key = str(id(taskset))
        if key in self._shared:
            servers, stack = self._shared[key]
            dead = [name for name, s in servers.items() if not s.external and not await _answers(s.url)]
            if not dead:
                return servers
            logger.warning("shared tool server(s) %s stopped answering: starting them again", dead)
            del self._shared[key]
            with contextlib.suppress(Exception):
                await stack.aclose()
        stack = contextlib.AsyncExitStack()
        servers = await stack.enter_async_context(serve_shared(taskset.toolsets(taskset.config)))
        self._shared[key] = (servers, stack)
        return servers

    async def _run_episode(
        self, task: Any, base_url: str, tokenizer_dir: str, spec: SampleSpec, tools: Mapping[str, Any]
    ) -> Any:
        """One episode of `task`: a verifiers `Agent` (the configured harness in a subprocess runtime, its client
        verifiers' `TrainClient` on the episode's capture URL) runs it and returns its scored trace. With a pool,
        the runtime is a `PooledRuntime` the episode owns (started and stopped here, placed with verifiers'
        `run(runtime=...)`), whose chat program runs in a warm pool process."""
        import verifiers.v1 as vf
        from renderers import DefaultRendererConfig
        from verifiers.v1.configs.agent import TimeoutConfig

        config = vf.AgentConfig(
            model=MODEL_NAME,
            harness=self.harness,
            runtime=vf.SubprocessConfig(),
            client=vf.TrainClientConfig(
                base_url=f"{base_url}/v1",
                api_key_var="RLPIPE_ENDPOINT_TOKEN",
                renderer=DefaultRendererConfig(tool_parser=self.tool_parser)
                if self.tool_parser
                else DefaultRendererConfig(),
                renderer_model_name=tokenizer_dir,
            ),
            sampling=vf.SamplingConfig(temperature=spec.temperature, max_tokens=spec.max_tokens),
            max_turns=self.max_turns,
            timeout=TimeoutConfig(rollout=self.episode_timeout_s),
        )
        if self._pool is None and self._in_process is None:
            return await vf.Agent(config).run(task, tools=tools)
        from pipeline.environments.harness_pool import PooledRuntime

        runtime = PooledRuntime(self._pool, self._chat_program, in_process=self._in_process)
        try:
            await runtime.start()
            return await vf.Agent(config).run(task, runtime=runtime, tools=tools)
        finally:
            await runtime.stop()

    async def _run_all(
        self,
        jobs: list[tuple[Any, str]],
        mode: str,
        tokenizer_dir: str,
        spec: SampleSpec,
        finished: Callable[[], None] = lambda: None,
    ) -> list[Any]:
        """Every episode of `jobs` ((task, capture URL) pairs) at once; `finished()` as each one ends."""
        try:
            tools = await self._shared_tools(mode)
        except Exception as e:  # the shared tool servers do not start: every episode fails with the reason
            return [EpisodeResult(error=f"starting the shared tool servers: {type(e).__name__}: {e}")] * len(jobs)

        async def one(task: Any, url: str) -> EpisodeResult:
            try:
                return EpisodeResult(trace=await self._run_episode(task, url, tokenizer_dir, spec, tools))
            except Exception as e:  # verifiers raising outside its own error capture: this episode fails
                return EpisodeResult(error=f"{type(e).__name__}: {e}")
            finally:
                finished()

        return await asyncio.gather(*(one(t, u) for t, u in jobs))

    def sample(self, ctx: InferenceContext, spec: SampleSpec, rng: np.random.Generator) -> SampleResult:
        """Run `n_generations` episodes of each of `n_examples` tasks (drawn with rng in train mode; the eval
        split's tasks in order in eval mode) concurrently through verifiers' rollout loop against the endpoint;
        one group or failure per task."""
        from pipeline.environments.endpoint import GenerateEndpoint
        from pipeline.environments.episodes import rollouts_from_calls
        from pipeline.environments.generation import SamplingControls

        check_mode(spec.mode)
        register_tool_parser()
        pool = self.tasks[spec.mode]
        if spec.mode == "train":
            picks = [pool[int(i)] for i in rng.integers(0, len(pool), size=spec.n_examples)]
        else:
            picks = [pool[i % len(pool)] for i in range(spec.n_examples)]
        tokenizer_dir = self._tokenizer_path(ctx.tokenizer)
        run_id = f"{int(rng.integers(0, 2**63 - 1)):016x}"
        step = getattr(ctx, "policy_step", None)
        controls = getattr(ctx, "controls", None)
        endpoint = GenerateEndpoint(
            ctx,
            max_seq_len=min(self.max_seq_len, getattr(ctx, "max_seq_len", None) or self.max_seq_len),
            policy_step=(lambda: int(step)) if step is not None else None,
            temperature=spec.temperature,
            controls=controls if isinstance(controls, SamplingControls) else None,
            max_tokens=spec.max_tokens,
            seed=int(rng.integers(0, 2**31 - 1)),
            capture_log=self.capture_log,
        )
        with endpoint:
            episodes = []
            for i in range(len(picks)):
                for g in range(spec.n_generations):
                    episode_id = f"{self.name}-{run_id}-{i}-{g}"
                    episodes.append((i, episode_id, endpoint.open_episode(episode_id)))
            jobs = [(picks[i], capture.base_url) for i, _, capture in episodes]
            limits = known_prompt_limits([f"{url}/v1" for _, url in jobs], endpoint.model_cards())
            # One event loop for the environment's life, in its own thread: verifiers/renderers keep asyncio locks
            # and the shared tool servers bound to it.
            # verifiers' single-agent episode waits on at most one model call at a time: the sampler batches the
            # calls of every episode still running rather than what a timer window happens to catch.
            endpoint.expect_callers(len(jobs))
            with limits:
                done: Future[list[EpisodeResult]] = asyncio.run_coroutine_threadsafe(
                    self._run_all(jobs, spec.mode, tokenizer_dir, spec, endpoint.caller_finished), self._event_loop()
                )
                endpoint.serve_until(done)
                results = done.result()
            captured = {episode_id: endpoint.close_episode(episode_id) for _, episode_id, _ in episodes}

        groups: list[EnvGroup] = []
        failures: list[ExampleFailure] = []
        sums: dict[str, float] = {}
        by_example: dict[int, list[tuple[str, EpisodeResult]]] = {}
        for (i, episode_id, _), res in zip(episodes, results, strict=True):
            by_example.setdefault(i, []).append((episode_id, res))
        for i, task in enumerate(picks):
            example_id = example_id_of(task)
            rollouts: list[EnvRollout] = []
            reason = None
            example_sums: dict[str, float] = {}
            for episode_id, res in by_example.get(i, []):
                reason = res.error if res.error is not None else trace_error(res.trace)
                calls = captured[episode_id]
                if reason is None and not calls:
                    reason = "the endpoint captured no model call"
                if reason is None:
                    disagree = tokens_disagree(res.trace, calls)
                    if disagree:
                        reason = f"verifiers' recorded tokens and the endpoint's capture disagree: {disagree}"
                if reason is None:
                    try:
                        components = reward_components(res.trace)
                        rows = rollouts_from_calls(
                            calls,
                            env_name=self.name,
                            example_id=example_id,
                            episode_reward=checked_reward(res.trace.reward, "the trace's reward"),
                            reward_components=components,
                            episode_id=episode_id,
                        )
                    except ValueError as e:  # a reward missing or not finite: this example fails, with the reason
                        reason = str(e)
                if reason is not None:
                    reason = f"episode {episode_id}: {reason}"
                    break
                for row in rows:
                    row.response_text = ctx.tokenizer.decode(row.response_tokens)
                    row.extracted_answer = res.trace.last_reply or None
                for name, value in components.items():
                    example_sums[f"reward/{name}"] = example_sums.get(f"reward/{name}", 0.0) + value
                for name, value in trace_metrics(res.trace).items():
                    example_sums[f"{name}_mean"] = example_sums.get(f"{name}_mean", 0.0) + value
                rollouts.extend(rows)
            if reason is not None:
                failures.append(ExampleFailure(example_id, reason))
                continue
            for k, v in example_sums.items():
                sums[k] = sums.get(k, 0.0) + v
            groups.append(EnvGroup(group_key(self.name, example_id, rng), rollouts))
        n_episodes = sum(len({r.episode_id for r in g.rollouts}) for g in groups)
        metrics = {k: v / n_episodes for k, v in sums.items()} if n_episodes else {}
        metrics["episodes"] = float(n_episodes)
        metrics["failures"] = float(len(failures))
        return SampleResult(groups, failures, metrics)
