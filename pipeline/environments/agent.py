"""Any OpenAI-speaking program as an episode runner: `AgentEnv` (`env_class: pipeline.environments.agent.AgentEnv`).

Each `sample` call starts a generate endpoint (`pipeline.environments.endpoint.GenerateEndpoint`) over the worker's
sampler, and for each drawn task runs the configured program `n_generations` times (an RLOO group), each run an
episode with its own URL prefix, so its calls are captured and become rollout rows
(`pipeline.environments.episodes.rollouts_from_calls`: exact sampled ids and logprobs, mask 0 on what the program
inserted, a new segment where a prompt does not extend the transcript). Episodes run concurrently (`concurrency`
threads, each running episodes one after another); their requests are batched into the sampler by caller (a sampler
call waits for a request from every running thread, `GenerateEndpoint.expect_callers`, at most the endpoint's
`batch_wait_max_s`).

The program is one of:

- `entry_point: "package.module:function"` (or `"path/to/script.py:function"`): called in a thread as
  `function(task, base_url=..., api_key=...)`, where `base_url` is an OpenAI base URL (ending in `/v1`); it returns
  the result;
- `command: "{python} path/to/agent.py --flag"` (shell-split; `{python}` is this environment's Python): run as a
  subprocess per episode, with the task as JSON on stdin and in `RLPIPE_TASK`, `OPENAI_BASE_URL` (ending in `/v1`),
  `OPENAI_API_KEY`, and `RLPIPE_ENDPOINT_URL` (the episode's root, for `/inference/v1/generate` clients) in its
  environment; its result is the last line of its stdout that is a JSON value.

The result gives the reward: a number, or an object with `reward` (a number), optional `reward_components` (name ->
number, each recorded as its own column), `answer` (the extracted answer) and `info` (name -> number). With
`scorer: "package.module:function"`, `function(task, result)` gives it instead (a number or such an object). A task's
`answer` field is the ground truth recorded on its rows.

A run that fails — non-zero exit, timeout (`timeout_s`), an exception, no result, a reward that is not a finite
number, or no call to the endpoint — fails its example (`ExampleFailure` with the reason); so does a prompt that
does not fit `inference.max_seq_len` (the program sees a 400).

Tasks: `tasks` is a path to a JSON-lines file (one object per line), an inline list of objects, or a generator
`"package.module:function"` / `"path/to/file.py:function"` (a string that is not a file), called once with no
arguments and returning the list of objects (tasks made in code, e.g. a fixed held-out problem set); a task's `id`
field is its stable example id (else `task-<line index>`). `eval_tasks` (same forms) is the eval split (default: the
train tasks); train mode draws tasks with the rng, eval mode takes them in order.

Sampling: the lesson's temperature and top-p / top-k / min-p apply to every request (a program's own are ignored),
and `max_tokens` caps each request's new tokens (its default), so rows' logprobs are those of the lesson's
distribution. The endpoint binds `host:port` (loopback, a free port, by default); for programs on other machines
set `host` (e.g. `0.0.0.0`) and a `token` (or `token_env`, the name of an environment variable holding it): a
non-loopback host without one is a config error at start. `capture_log`: a local file where the endpoint appends
every sampled choice as the sampler returned it (a debug record).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import os
import re
import shlex
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.environments.base import (
    EnvGroup,
    Environment,
    EnvRollout,
    ExampleFailure,
    InferenceContext,
    SampleResult,
    SampleSpec,
    check_mode,
    draw_seed,
    group_key,
    summarize,
)
from pipeline.environments.episodes import rollouts_from_calls
from pipeline.environments.generation import SamplingControls

logger = logging.getLogger(__name__)

DEFAULT_TOKEN_ENV = "RLPIPE_ENDPOINT_TOKEN"


class AgentFailure(Exception):
    """A run of the agent program that produced no usable result; the message is the example's failure reason."""


@dataclass
class Task:
    """One task: its stable id and the JSON object handed to the program."""

    task_id: str
    data: dict[str, Any]


@dataclass
class AgentResult:
    """What one run gave: the reward, each reward function's value, the extracted answer, numeric info."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    answer: str | None = None
    info: dict[str, float] = field(default_factory=dict)


_GENERATOR = re.compile(r"[^:\s]+:[A-Za-z_]\w*")
"""A `tasks` string naming a generator function (`module:function`, `file.py:function`) rather than a file."""


def load_tasks(source: str | Sequence[Mapping[str, Any]], arg: str = "tasks") -> list[Task]:
    """Tasks from a JSON-lines file path, an inline list of objects or a generator's list (see the module
    docstring). Raises ValueError naming `arg` (and the line) for a missing file, a generator that cannot be imported
    or fails, a row that is not a JSON object, duplicate ids or no tasks."""
    rows: list[Any]
    if isinstance(source, str) and not Path(source).is_file() and _GENERATOR.fullmatch(source):
        generator = import_callable(source, arg)
        try:
            made = generator()
        except Exception as e:
            raise ValueError(f"{arg}={source!r}: the generator raised {type(e).__name__}: {e}") from None
        if isinstance(made, (str, bytes)) or not isinstance(made, Sequence):
            raise ValueError(f"{arg}={source!r}: the generator must return a list of objects")
        return load_tasks(list(made), arg)
    if isinstance(source, str):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{arg}: file {source!r} does not exist")
        rows = []
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{arg}: {source}:{i + 1} is not JSON ({e})") from None
    elif isinstance(source, Sequence):
        rows = list(source)
    else:
        raise ValueError(
            f"{arg}: must be a path to a JSON-lines file or a list of objects, got {type(source).__name__}"
        )
    tasks = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"{arg}: task {i} is not a JSON object")
        task_id = str(row.get("id", f"task-{i}"))
        tasks.append(Task(task_id, dict(row)))
    if not tasks:
        raise ValueError(f"{arg}: no tasks")
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{arg}: task id {dup!r} appears more than once")
    return tasks


def import_callable(spec: str, arg: str) -> Callable[..., Any]:
    """`package.module:function` imported, or `path/to/file.py:function` loaded from the file (relative to the working
    directory); ValueError naming `arg` when it cannot be."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{arg}={spec!r}: must be 'package.module:function' or 'path/to/file.py:function'")
    try:
        if module_name.endswith(".py"):  # a script file: loaded under its own name, once
            path = Path(module_name).resolve()
            name = f"_rlpipe_agent_{path.stem}_{abs(hash(str(path))):x}"
            module = sys.modules.get(name)  # type: ignore[assignment]
            if module is None:
                file_spec = importlib.util.spec_from_file_location(name, path)
                if file_spec is None or file_spec.loader is None or not path.is_file():
                    raise FileNotFoundError(f"no such file {module_name!r}")
                module = importlib.util.module_from_spec(file_spec)
                file_spec.loader.exec_module(module)
                sys.modules[name] = module
        else:
            module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"{arg}={spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{arg}={spec!r}: module {module_name!r} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def result_of(value: Any) -> AgentResult:
    """An `AgentResult` from a program's (or scorer's) result (see the module docstring); AgentFailure otherwise."""
    if isinstance(value, bool) or value is None:
        raise AgentFailure(f"result {value!r} gives no reward")
    if isinstance(value, (int, float)):
        reward, obj = float(value), {}
    elif isinstance(value, Mapping):
        obj = dict(value)
        raw = obj.get("reward")
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise AgentFailure(f"result has no numeric 'reward': {json.dumps(obj, default=str)[:200]}")
        reward = float(raw)
    else:
        raise AgentFailure(f"result {value!r} is neither a number nor an object with 'reward'")
    if not math.isfinite(reward):
        raise AgentFailure(f"reward {reward!r} is not finite")

    def numbers(key: str) -> dict[str, float]:
        got = obj.get(key) or {}
        if not isinstance(got, Mapping) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in got.values()
        ):
            raise AgentFailure(f"result's {key!r} must map names to finite numbers")
        return {str(k): float(v) for k, v in got.items()}

    answer = obj.get("answer")
    return AgentResult(reward, numbers("reward_components"), None if answer is None else str(answer), numbers("info"))


def last_json_line(stdout: str) -> Any:
    """The last line of `stdout` that parses as JSON; AgentFailure when there is none."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            return json.loads(line)
        except ValueError:
            continue
    raise AgentFailure("the program printed no JSON result line")


class AgentEnv(Environment):
    """Runs an OpenAI-speaking program per task and trains on its captured calls (see the module docstring)."""

    name = "agent"

    def __init__(
        self,
        *,
        tasks: str | list[dict[str, Any]],
        entry_point: str | None = None,
        command: str | list[str] | None = None,
        eval_tasks: str | list[dict[str, Any]] | None = None,
        scorer: str | None = None,
        timeout_s: float = 120.0,
        concurrency: int = 16,
        max_seq_len: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        token_env: str = DEFAULT_TOKEN_ENV,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        capture_log: str | None = None,
        name: str = "agent",
    ) -> None:
        self.check_args(
            {
                "tasks": tasks,
                "entry_point": entry_point,
                "command": command,
                "eval_tasks": eval_tasks,
                "scorer": scorer,
                "timeout_s": timeout_s,
                "concurrency": concurrency,
                "host": host,
                "token": token,
                "token_env": token_env,
            },
            as_config=False,
        )
        self.name = name
        self.tasks = load_tasks(tasks, "tasks")
        self.eval_tasks = load_tasks(eval_tasks, "eval_tasks") if eval_tasks is not None else self.tasks
        self.entry_point = import_callable(entry_point, "entry_point") if entry_point else None
        self.command = _command_argv(command) if command is not None else None
        self.scorer = import_callable(scorer, "scorer") if scorer else None
        self.timeout_s = float(timeout_s)
        self.concurrency = int(concurrency)
        self.max_seq_len = max_seq_len
        self.host, self.port = host, int(port)
        self.token = token or os.environ.get(token_env) or None
        self.extra_env = {str(k): str(v) for k, v in (env or {}).items()}
        self.cwd = cwd
        self.capture_log = capture_log

    @classmethod
    def check_args(cls, env_args: Mapping[str, Any], *, as_config: bool = True) -> None:
        """Exactly one of `entry_point` / `command`; `tasks` (and `eval_tasks`) loadable; a non-loopback `host` needs
        a `token` or a set `token_env` variable; positive `timeout_s` and `concurrency`. As a config check, raises
        `ConfigError(<arg>, value, why)`; else ValueError."""
        from pipeline.process.ports import is_loopback

        def fail(arg: str, value: Any, why: str) -> None:
            if as_config:
                from pipeline.config import ConfigError

                raise ConfigError(arg, value, why)
            raise ValueError(f"{arg}={value!r}: {why}")

        entry, command = env_args.get("entry_point"), env_args.get("command")
        if (entry is None) == (command is None):
            fail("entry_point", entry, "give exactly one of entry_point ('module:function') and command")
        if "tasks" not in env_args:
            fail("tasks", None, "required: a JSON-lines file or a list of task objects")
        for arg in ("tasks", "eval_tasks"):
            if env_args.get(arg) is not None:
                try:
                    load_tasks(env_args[arg], arg)
                except ValueError as e:
                    fail(arg, env_args[arg] if isinstance(env_args[arg], str) else "[...]", str(e))
        for arg in ("entry_point", "scorer"):
            if env_args.get(arg) is not None:
                try:
                    import_callable(str(env_args[arg]), arg)
                except ValueError as e:
                    fail(arg, env_args[arg], str(e))
        if command is not None:
            try:
                _command_argv(command)
            except ValueError as e:
                fail("command", command, str(e))
        for arg in ("timeout_s", "concurrency"):
            v = env_args.get(arg)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                fail(arg, v, "must be a positive number")
        host = str(env_args.get("host", "127.0.0.1"))
        token_env = str(env_args.get("token_env") or DEFAULT_TOKEN_ENV)
        if not is_loopback(host) and not (env_args.get("token") or os.environ.get(token_env)):
            fail(
                "host",
                host,
                f"a non-loopback endpoint needs a bearer token: set token, or the environment variable {token_env}",
            )

    # -- examples -----------------------------------------------------------------------------------

    def _draw(self, n: int, rng: np.random.Generator, mode: str) -> list[Task]:
        if mode == "eval":
            return [self.eval_tasks[i % len(self.eval_tasks)] for i in range(n)]
        return [self.tasks[int(i)] for i in rng.integers(0, len(self.tasks), size=n)]

    # -- sampling -----------------------------------------------------------------------------------

    def sample(self, ctx: InferenceContext, spec: SampleSpec, rng: np.random.Generator) -> SampleResult:
        from pipeline.environments.endpoint import GenerateEndpoint

        check_mode(spec.mode)
        tasks = self._draw(spec.n_examples, rng, spec.mode)
        max_seq_len = self.max_seq_len or getattr(ctx, "max_seq_len", None)
        if not max_seq_len:
            raise ValueError("AgentEnv needs max_seq_len (env_args.max_seq_len or the context's)")
        controls = getattr(ctx, "controls", None)
        endpoint = GenerateEndpoint(
            ctx,
            max_seq_len=int(max_seq_len),
            host=self.host,
            port=self.port,
            token=self.token,
            temperature=spec.temperature,
            controls=controls if isinstance(controls, SamplingControls) else None,
            max_tokens=spec.max_tokens,
            seed=draw_seed(rng),
            capture_log=self.capture_log,
        )
        keys = [group_key(self.name, t.task_id, rng) for t in tasks]
        runs = [(i, k) for i in range(len(tasks)) for k in range(spec.n_generations)]
        outcomes: dict[tuple[int, int], list[EnvRollout] | str] = {}
        todo = iter(runs)
        todo_lock = threading.Lock()

        def caller() -> None:
            """One of `n_callers` threads, each running episodes one after another until none is left."""
            try:
                while True:
                    with todo_lock:
                        run = next(todo, None)
                    if run is None:
                        return
                    suffix = f"{keys[run[0]].rsplit('/', 1)[-1]}-{run[1]}"
                    outcomes[run] = self._episode(endpoint, tasks[run[0]], suffix)
            finally:
                endpoint.caller_finished()

        n_callers = min(self.concurrency, max(1, len(runs)))
        with endpoint, ThreadPoolExecutor(max_workers=n_callers) as pool:
            # Batch by callers: a sampler call waits for a request from every running episode (bounded by the
            # endpoint's batch_wait_max_s). A millisecond timer cut the calculator agent's 256 episodes of a step
            # into about 20 sampler calls instead of 12, each costing about as much as one holding them all.
            endpoint.expect_callers(n_callers)
            for fut in [pool.submit(caller) for _ in range(n_callers)]:
                fut.result()
        groups, failures = [], []
        for i, task in enumerate(tasks):
            got = [outcomes[(i, k)] for k in range(spec.n_generations)]
            errors = [g for g in got if isinstance(g, str)]
            if errors:
                failures.append(ExampleFailure(task.task_id, errors[0]))
                continue
            groups.append(EnvGroup(keys[i], [r for g in got if not isinstance(g, str) for r in g]))
        metrics = summarize(groups, failures, n_examples=spec.n_examples, success=lambda r: r.episode_reward > 0)
        metrics["endpoint_generate_calls"] = float(endpoint.generate_calls)
        metrics["endpoint_requests"] = float(endpoint.requests_served)
        return SampleResult(groups, failures, metrics)

    def _episode(self, endpoint: Any, task: Task, suffix: str) -> list[EnvRollout] | str:
        """One run of the program on `task`: its rows, or the failure reason."""
        episode_id = f"{_safe(task.task_id)}.{suffix}"
        capture = endpoint.open_episode(episode_id)
        api_key = self.token or "rlpipe"
        try:
            try:
                raw = self._run(task, capture.openai_base_url, capture.base_url, api_key)
                result = result_of(self.scorer(task.data, raw) if self.scorer else raw)
            finally:
                calls = capture.close()
            if not calls:
                raise AgentFailure("the program made no call to the endpoint")
            return rollouts_from_calls(
                calls,
                env_name=self.name,
                example_id=task.task_id,
                episode_reward=result.reward,
                reward_components=result.components,
                episode_id=episode_id,
                extracted_answer=result.answer,
                ground_truth=str(task.data.get("answer", "")),
                info=result.info,
                tokenizer=endpoint.context.tokenizer,
            )
        except AgentFailure as e:
            return str(e)
        except Exception as e:  # the program's (or scorer's) error fails this example only
            return f"agent error: {type(e).__name__}: {e}"

    def _run(self, task: Task, openai_url: str, root_url: str, api_key: str) -> Any:
        if self.entry_point is not None:
            return self._call(task, openai_url, api_key)
        assert self.command is not None
        env = {
            **os.environ,
            **self.extra_env,
            "OPENAI_BASE_URL": openai_url,
            "OPENAI_API_KEY": api_key,
            "RLPIPE_ENDPOINT_URL": root_url,
            "RLPIPE_TASK": json.dumps(task.data),
        }
        try:
            proc = subprocess.run(
                self.command,
                input=json.dumps(task.data),
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                env=env,
                cwd=self.cwd,
            )
        except subprocess.TimeoutExpired:
            raise AgentFailure(f"the program timed out after {self.timeout_s:g} s") from None
        if proc.returncode != 0:
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            raise AgentFailure(f"the program exited with status {proc.returncode}: {tail[-400:]}")
        return last_json_line(proc.stdout)

    def _call(self, task: Task, openai_url: str, api_key: str) -> Any:
        fn = self.entry_point
        assert fn is not None
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn(dict(task.data), base_url=openai_url, api_key=api_key)
            except BaseException as e:
                box["error"] = e

        thread = threading.Thread(target=target, name=f"agent-{task.task_id}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():  # its episode is closed: its later calls get 404 and nothing more is captured
            raise AgentFailure(f"the entry point timed out after {self.timeout_s:g} s")
        if "error" in box:
            e = box["error"]
            raise AgentFailure(f"the entry point raised {type(e).__name__}: {e}")
        return box.get("value")


def _command_argv(command: str | list[str]) -> list[str]:
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise ValueError("command is empty")
    return [a.replace("{python}", sys.executable) for a in argv]


def _safe(task_id: str) -> str:
    """The task id as a URL path component (episode ids name a URL prefix)."""
    out = "".join(c if c.isalnum() or c in "-_." else "_" for c in task_id)
    return out or uuid.uuid4().hex[:8]
