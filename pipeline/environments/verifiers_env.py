"""verifiers environments as rlpipe lessons: `VerifiersEnv` runs a verifiers (0.4.0, `verifiers.v1`) taskset's
tasks against the policy through the generate endpoint, and scores them with the tasks' own rubric.

Config (`EnvConfig`): `env_class: pipeline.environments.verifiers_env.VerifiersEnv` and `env_args`:
- `env`: what to load, one of `package.module:function` or `path/to/file.py:function` (a function returning a
  `vf.Env` or a `vf.Taskset`; called with `env_kwargs`), or an installed taskset id (`vf.load_taskset`, e.g.
  `textarena`); `env_kwargs`: its keyword arguments (for an id: the taskset config's fields).
- `eval_env` / `eval_env_kwargs`: the same for the eval split (default: the train taskset, minus `eval_holdout`).
- `eval_holdout`: the last N tasks of the train taskset are the eval split and never drawn in train mode.
- `max_tasks`: how many tasks to read from an infinite taskset (bounded ones are read whole).
- `max_turns`: model calls per episode; `tool_parser`: the `renderers` tool parser that reads tool calls out of
  sampled text (default `rlpipe-text`: `<tool_call>{json}</tool_call>` blocks in the decoded text, the built-in
  tiny tokenizer's chat-template format; `qwen3` where `<tool_call>` is one token);
  `max_seq_len`: the endpoint's bound on prompt + completion tokens; `capture_log`: a local file the endpoint
  appends each sampled choice to (a debug record; tests compare rows with it).

Examples are tasks: an example id is the task's durable `data.id` when it has one, else `key:` plus the task's
content key (stable across processes and runs). Each example runs `n_generations` episodes (an RLOO group).

An episode (at most `max_turns` model calls): the task's messages (system prompt, prompt) go, through verifiers'
own training client (`TrainClient`, `TrainClientConfig` pointed at the episode's capture URL of a
`pipeline.rollout.endpoint.GenerateEndpoint` over the worker's sampler), to `/inference/v1/generate`; the client
renders them with the policy tokenizer's chat template and parses tool calls. Tool calls run the tasks' Python
tools (the `@vf.tool` methods of the task's and the taskset's `Toolset`s, called in this process), each result
goes back as a `tool` message, and the loop goes on; a reply without tool calls ends the episode. The finished
conversation becomes a verifiers `Trace` that the task scores (`Task.score`: its `@vf.reward` functions and
judges); the episode reward is the trace's weighted sum (`Trace.reward`) and each reward function's weighted value
is its own entry of `reward_components`.

Rows come from the endpoint's capture of the episode's calls (`rollouts_from_calls`), never from re-tokenised
text: sampled tokens mask 1 with the sampler's logprobs, tool/template tokens between calls mask 0; a call whose
prompt does not extend the transcript starts a new segment of the same episode. Any error of an episode (the
client, a tool raising is not one: the model sees `error: ...`; scoring raising; an episode the endpoint captured
nothing of) fails the whole example with the reason (`ExampleFailure`).

Not run: verifiers' harness programs (the `bash`/`null` chat programs launched through `uv` in a runtime,
sandboxes, MCP servers, multi-agent `Env.run`). This module plays the single-agent chat loop itself, in-process.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import shutil
import tempfile
import threading
import typing
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    group_key,
)

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


def example_id_of(task: Any) -> str:
    """A task's stable example id: its durable `data.id`, else `key:` + its content key (first 16 hex digits)."""
    if task.data.id:
        return str(task.data.id)
    return f"key:{str(task.key)[:16]}"


# ---------------------------------------------------------------------------------------
# tools
# ---------------------------------------------------------------------------------------


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclass
class PythonTool:
    """One `@vf.tool` method offered to the model: its OpenAI function spec and the bound method to call."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]

    def wire(self) -> dict[str, Any]:
        """The OpenAI `tools` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def call(self, arguments: str) -> str:
        """Run the tool on JSON `arguments`; its result as text, or `error: WHY` (bad JSON, a raise)."""
        try:
            args = json.loads(arguments or "{}")
            if not isinstance(args, dict):
                return "error: arguments must be a JSON object"
            result = self.fn(**args)
            if inspect.isawaitable(result):
                result = await result
        except Exception as e:  # the model sees its tool's failure, as verifiers' chat programs do
            return f"error: {type(e).__name__}: {e}"
        return result if isinstance(result, str) else json.dumps(result)


def python_tools(toolsets: list[Any]) -> list[PythonTool]:
    """The `@vf.tool` methods of `toolsets`, named as the tool (or the method) is named, parameters from the
    method's signature (annotated int/float/str/bool/list/dict; others untyped)."""
    from verifiers.v1.utils.decorators import discover_decorated

    tools = []
    for toolset in toolsets:
        for fn in discover_decorated(toolset, "tool"):
            props: dict[str, Any] = {}
            required = []
            try:
                hints = typing.get_type_hints(fn)
            except Exception:  # unresolvable annotations: the parameters go untyped
                hints = {}
            for pname, param in inspect.signature(fn).parameters.items():
                hint = hints.get(pname)
                kind = _JSON_TYPES.get(hint) if isinstance(hint, type) else None
                props[pname] = {"type": kind} if kind else {}
                if param.default is inspect.Parameter.empty:
                    required.append(pname)
            tools.append(
                PythonTool(
                    name=getattr(fn, "tool_name", None) or fn.__name__,
                    description=(fn.__doc__ or "").strip(),
                    parameters={"type": "object", "properties": props, "required": required},
                    fn=fn,
                )
            )
    return tools


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
# one episode
# ---------------------------------------------------------------------------------------


@dataclass
class EpisodeResult:
    """What one episode left: the verifiers trace (scored), the client's per-turn tokens, or the error."""

    trace: Any = None
    turn_tokens: list[Any] = field(default_factory=list)
    error: str | None = None


def initial_messages(data: Any) -> list[Any]:
    """A task's opening messages: its system prompt, then its prompt (text as one user message, or messages)."""
    import verifiers.v1 as vf

    messages: list[Any] = []
    if data.system_prompt:
        messages.append(vf.SystemMessage(content=data.system_prompt))
    if isinstance(data.prompt, str):
        messages.append(vf.UserMessage(content=data.prompt))
    elif data.prompt:
        messages.extend(data.prompt)
    return messages


def build_trace(task: Any, messages: list[Any], sampled: list[bool], tools: list[PythonTool]) -> Any:
    """A verifiers `Trace` of one linear conversation (`sampled[i]`: message i came from the model)."""
    import verifiers.v1 as vf
    from verifiers.v1.trace import AgentInfo

    nodes = [
        vf.MessageNode(parent=i - 1 if i else None, message=m, sampled=s)
        for i, (m, s) in enumerate(zip(messages, sampled, strict=True))
    ]
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=vf.AgentConfig()),
        tools=[vf.Tool(name=t.name, description=t.description, parameters=t.parameters) for t in tools],
        nodes=nodes,
    )
    return trace


async def run_episode(
    task: Any,
    base_url: str,
    *,
    tokenizer_dir: str,
    tool_parser: str | None,
    tools: list[PythonTool],
    max_turns: int,
    temperature: float,
    max_tokens: int,
) -> EpisodeResult:
    """One episode of `task` through verifiers' `TrainClient` at `base_url` (the episode's capture URL), scored by
    the task. Never raises: an error is the result's `error`."""
    import verifiers.v1 as vf
    from renderers import DefaultRendererConfig
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.dialects.chat import ChatDialect, message_to_wire

    register_tool_parser()
    result = EpisodeResult()
    client = TrainClient(
        vf.TrainClientConfig(
            base_url=f"{base_url}/v1",
            api_key_var="RLPIPE_ENDPOINT_TOKEN",
            renderer=DefaultRendererConfig(tool_parser=tool_parser) if tool_parser else DefaultRendererConfig(),
            renderer_model_name=tokenizer_dir,
        )
    )
    by_name = {t.name: t for t in tools}
    messages = initial_messages(task.data)
    sampled = [False] * len(messages)
    sampling = vf.SamplingConfig(temperature=temperature, max_tokens=max_tokens)
    try:
        for _ in range(max_turns):
            body: dict[str, Any] = {"model": MODEL_NAME, "messages": [message_to_wire(m) for m in messages]}
            if tools:
                body["tools"] = [t.wire() for t in tools]
            response = await client.get_response(ChatDialect(), body, sampling)
            result.turn_tokens.append(response.tokens)
            messages.append(response.message)
            sampled.append(True)
            calls = response.message.tool_calls or []
            if not calls:
                break
            for call in calls:
                tool = by_name.get(call.name)
                text = await tool.call(call.arguments) if tool else f"error: unknown tool {call.name!r}"
                messages.append(vf.ToolMessage(tool_call_id=call.id, content=text, name=call.name))
                sampled.append(False)
        trace = build_trace(task, messages, sampled, tools)
        await task.score(trace)
        trace.is_completed = True
        trace.ok = True
        result.trace = trace
    except Exception as e:  # per-episode failure: recorded with its reason, the example fails
        result.error = f"{type(e).__name__}: {e}"
    finally:
        await client.close()
    return result


def reward_components(trace: Any) -> dict[str, float]:
    """Each reward function's weighted value (`Reward.value`); one that did not score is an error, not a 0."""
    out = {}
    for name, reward in trace.rewards.items():
        if reward is None:
            raise ValueError(f"reward function {name!r} produced no score")
        out[name] = float(reward.value)
    return out


def tokens_disagree(turn_tokens: list[Any], calls: list[Any]) -> str | None:
    """Where verifiers' per-turn `TurnTokens` (what its client received) differ from the endpoint's captured calls
    (what the sampler produced), or None when every turn has the same prompt ids, sampled ids and logprobs."""
    if len(turn_tokens) != len(calls):
        return f"{len(turn_tokens)} turns but {len(calls)} captured calls"
    for k, (tt, call) in enumerate(zip(turn_tokens, calls, strict=True)):
        if list(tt.prompt_ids) != list(call.prompt_ids):
            return f"turn {k}: prompt ids"
        if list(tt.completion_ids) != list(call.completion_ids):
            return f"turn {k}: sampled ids"
        if [float(x) for x in tt.completion_logprobs] != [float(x) for x in call.logprobs]:
            return f"turn {k}: logprobs"
    return None


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
        tool_parser: str | None = TEXT_TOOL_PARSER,
        max_seq_len: int = 4096,
        name: str | None = None,
        capture_log: str | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}: must be >= 1")
        if eval_holdout < 0:
            raise ValueError(f"eval_holdout={eval_holdout}: must be >= 0")
        self.name = name or env.rpartition(":")[2] or env
        self.max_turns = max_turns
        self.tool_parser = tool_parser
        self.max_seq_len = max_seq_len
        self.capture_log = capture_log
        taskset = load_taskset(env, env_kwargs or {})
        tasks = _tasks_of(taskset, max_tasks)
        if eval_env is not None:
            eval_taskset = load_taskset(eval_env, eval_env_kwargs or {})
            self.tasks = {"train": tasks, "eval": _tasks_of(eval_taskset, max_tasks)}
            self._toolset_sources = {"train": taskset, "eval": eval_taskset}
        else:
            if eval_holdout >= len(tasks) and eval_holdout:
                raise ValueError(f"eval_holdout={eval_holdout} leaves no train task of {len(tasks)}")
            split = len(tasks) - eval_holdout
            self.tasks = {"train": tasks[:split], "eval": tasks[split:] if eval_holdout else tasks}
            self._toolset_sources = {"train": taskset, "eval": taskset}
        for mode, ts in self.tasks.items():
            if not ts:
                raise ValueError(f"the {mode} taskset of {env!r} has no task")
        self._tokenizer_dir: str | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def check_args(cls, env_args: Mapping[str, Any]) -> None:
        """The named environment must be loadable (module/file and function, or an installed taskset id)."""
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

    def _tokenizer_path(self, tokenizer: Any) -> str:
        """A folder holding the policy tokenizer, for the client's renderer (built once per environment)."""
        with self._lock:
            if self._tokenizer_dir is None:
                path = tempfile.mkdtemp(prefix="rlpipe-vf-tokenizer-")
                tokenizer.save_pretrained(path)
                self._tokenizer_dir = path
            return self._tokenizer_dir

    def __del__(self) -> None:
        if getattr(self, "_tokenizer_dir", None):
            shutil.rmtree(self._tokenizer_dir, ignore_errors=True)  # type: ignore[arg-type]

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The environment's event loop (started on first use in a daemon thread)."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name=f"verifiers-{self.name}", daemon=True).start()
                self._loop = loop
            return self._loop

    def _tools_for(self, mode: str, task: Any) -> list[PythonTool]:
        taskset = self._toolset_sources[mode]
        toolsets = [*type(task).toolsets(task.config), *type(taskset).toolsets(taskset.config)]
        return python_tools(toolsets)

    def sample(self, ctx: InferenceContext, spec: SampleSpec, rng: np.random.Generator) -> SampleResult:
        """Run `n_generations` episodes of each of `n_examples` tasks (drawn with rng in train mode; the eval
        split's tasks in order in eval mode) concurrently against the endpoint; one group or failure per task."""
        from pipeline.environments.episodes import rollouts_from_calls
        from pipeline.rollout.endpoint import GenerateEndpoint

        check_mode(spec.mode)
        pool = self.tasks[spec.mode]
        if spec.mode == "train":
            picks = [pool[int(i)] for i in rng.integers(0, len(pool), size=spec.n_examples)]
        else:
            picks = [pool[i % len(pool)] for i in range(spec.n_examples)]
        tokenizer_dir = self._tokenizer_path(ctx.tokenizer)
        run_id = f"{int(rng.integers(0, 2**63 - 1)):016x}"

        with GenerateEndpoint(ctx, max_seq_len=self.max_seq_len, capture_log=self.capture_log) as endpoint:
            jobs = []
            for i, task in enumerate(picks):
                tools = self._tools_for(spec.mode, task)
                for g in range(spec.n_generations):
                    episode_id = f"{self.name}-{run_id}-{i}-{g}"
                    jobs.append((i, episode_id, endpoint.open_episode(episode_id), task, tools))

            async def run_all() -> list[EpisodeResult]:
                return await asyncio.gather(
                    *(
                        run_episode(
                            task,
                            capture.base_url,
                            tokenizer_dir=tokenizer_dir,
                            tool_parser=self.tool_parser,
                            tools=tools,
                            max_turns=self.max_turns,
                            temperature=spec.temperature,
                            max_tokens=spec.max_tokens,
                        )
                        for (_, _, capture, task, tools) in jobs
                    )
                )

            # One event loop for the environment's life, in its own thread: verifiers/renderers keep asyncio locks
            # at module level, which bind to the first loop that waits on them.
            done: Future[list[EpisodeResult]] = asyncio.run_coroutine_threadsafe(run_all(), self._event_loop())
            endpoint.serve_until(done)
            results = done.result()
            captured = {episode_id: endpoint.close_episode(episode_id) for (_, episode_id, _, _, _) in jobs}

        groups: list[EnvGroup] = []
        failures: list[ExampleFailure] = []
        metrics: dict[str, float] = {}
        by_example: dict[int, list[tuple[str, EpisodeResult]]] = {}
        for (i, episode_id, _, _, _), res in zip(jobs, results, strict=True):
            by_example.setdefault(i, []).append((episode_id, res))
        for i, task in enumerate(picks):
            example_id = example_id_of(task)
            rollouts: list[EnvRollout] = []
            reason = None
            for episode_id, res in by_example.get(i, []):
                if res.error is not None:
                    reason = f"episode {episode_id}: {res.error}"
                    break
                calls = captured[episode_id]
                if not calls:
                    reason = f"episode {episode_id}: the endpoint captured no model call"
                    break
                disagree = tokens_disagree(res.turn_tokens, calls)
                if disagree:
                    reason = f"episode {episode_id}: verifiers' client and the endpoint's capture disagree: {disagree}"
                    break
                try:
                    components = reward_components(res.trace)
                except ValueError as e:
                    reason = f"episode {episode_id}: {e}"
                    break
                rows = rollouts_from_calls(
                    calls,
                    env_name=self.name,
                    example_id=example_id,
                    episode_reward=float(res.trace.reward),
                    reward_components=components,
                    episode_id=episode_id,
                )
                for row in rows:
                    row.response_text = ctx.tokenizer.decode(row.response_tokens)
                    row.extracted_answer = res.trace.last_reply or None
                for name, value in components.items():
                    metrics[f"reward/{name}"] = metrics.get(f"reward/{name}", 0.0) + value
                rollouts.extend(rows)
            if reason is not None:
                failures.append(ExampleFailure(example_id, reason))
                continue
            groups.append(EnvGroup(group_key(self.name, example_id, rng), rollouts))
        n_episodes = sum(len({r.episode_id for r in g.rollouts}) for g in groups)
        if n_episodes:
            metrics = {k: v / n_episodes for k, v in metrics.items()}
        metrics["episodes"] = float(n_episodes)
        metrics["failures"] = float(len(failures))
        return SampleResult(groups, failures, metrics)
