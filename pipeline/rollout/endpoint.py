"""The generate endpoint: an HTTP server on a rollout worker that serves the policy to programs that speak vLLM or
OpenAI, batches their requests into the worker's sampler, and captures every call of an episode exactly.

`GenerateEndpoint(context, max_seq_len=...)` serves an `InferenceContext` (`ctx.tokenizer`, `ctx.generate`) on
`host:port` (loopback and a free port by default) with these routes, at the root and under an episode prefix
`/episodes/<episode_id>`:

- `POST /inference/v1/generate`: vLLM's token-in, token-out route, exactly as verifiers 0.4.0's training client
  (`TrainClientConfig` -> `renderers.client.generate`) calls it: `{"model", "token_ids": [...], "sampling_params":
  {"max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop_token_ids", "logprobs", ...}}` in;
  `{"request_id", "prompt_token_ids", "choices": [{"index", "token_ids", "logprobs": {"content": [{"token":
  "token_id:<id>", "logprob"}]}, "finish_reason"}], "policy_step"}` out.
- `POST /v1/completions` and `POST /v1/chat/completions`: OpenAI's routes with vLLM's extras: `return_token_ids`
  (each choice gets `token_ids`; completions choices and the chat response get `prompt_token_ids`), `logprobs`
  (completions: an int, the legacy `{"tokens", "token_logprobs", ...}` object; chat: a bool, `{"content": [...]}`).
  A string prompt is encoded once (`encode_prompt`, BOS as in training; `add_special_tokens: false` skips it); a
  chat request is rendered by the tokenizer's chat template (`render_chat`, tools included) and the assistant
  message (content, `tool_calls`) is parsed from the sampled text (`parse_tool_calls`). Sampled text is only ever
  decoded, never encoded again.
- `GET /v1/models`: the one served model, with vLLM's `max_model_len` (= `max_seq_len`; the verifiers client
  checks prompt lengths against it).

Every response carries `policy_step`: the policy that sampled it (`policy_step()` after the call, or the step a
server backend reported for that call). The policy changes only between requests: the rollout worker holds its
model lock for a whole `Environment.sample` call, inside which an environment runs its endpoint.

Sampling is driven by the endpoint's own sampler thread: request threads queue their prompts; the sampler takes
what is queued (waiting `batch_window_s` for more), groups the requests that share sampling settings, and calls
`context.generate` once per group; requests that arrive while a call runs go into the next one. The caller of
`Environment.sample` needs no pumping helper: it just waits for its episodes (`serve_until` is there for a caller
that wants to wait on a future while the endpoint's health is checked).

Errors: a malformed request gets 400 naming the field (`{"error": {"message", "type", "param", "code"}}`); a
prompt of `max_seq_len` tokens or more gets 400; an unknown route 404, an unknown or closed episode 404. With a
`token` (required on a non-loopback host: ValueError at construction) every request, on every route, must carry
`Authorization: Bearer <token>` (401 otherwise; compared in constant time). Nothing a request does stops the
server or the sampler.

Load: at most `max_pending` requests wait for the sampler at once (queued or being sampled); one more is answered
503 at once. The server (`pipeline.process.listener.BoundedHTTPServer`) serves at most `max_connections`
connections at once (default `max_pending + 64`), each in its own thread; a connection beyond that is answered 503
and closed. A connection that sends nothing, or stops sending, for `read_timeout_s` is closed (an idle keep-alive
connection too), so connections that never send a request cannot hold the server's threads.

Capture: `open_episode(episode_id)` returns an `EpisodeCapture` whose `base_url` is the episode's prefix; every call
answered under it is recorded as `CapturedCall`s (the exact prompt ids, the sampled ids, the sampler's logprobs,
finish reason, policy step; one per choice) in arrival order, until `close_episode`. `capture_log` (a local file
path) appends one JSON line per sampled choice as `context.generate` returned it (a debug record, used by tests).
Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from pipeline.environments.base import Completion, check_completions, effective_stop_tokens, encode_prompt
from pipeline.environments.chat import assistant_message, parse_tool_calls
from pipeline.environments.generation import NO_CONTROLS, GenerationRequest, SamplingControls
from pipeline.process.listener import BoundedHandler, BoundedHTTPServer
from pipeline.process.ports import Announcement, announce, bearer_ok, is_loopback

logger = logging.getLogger(__name__)

UNKNOWN_POLICY_STEP = -1
"""`CapturedCall.policy_step` when neither the endpoint nor the context knows the policy step."""
MAX_BODY_BYTES = 32 << 20
"""Largest request body accepted (413 above)."""
DEFAULT_MODEL_NAME = "rlpipe-policy"
READ_TIMEOUT_S = 60.0
"""Default `read_timeout_s`: a connection silent this long is closed."""
EXTRA_CONNECTIONS = 64
"""Default `max_connections` is `max_pending` plus this many (connections with no request waiting: idle
keep-alive connections, requests being read or answered)."""


@dataclasses.dataclass
class CapturedCall:
    """One sampled choice of one request: the exact prompt ids, the sampled ids (a stop token kept), the sampler's
    logprobs of them, why sampling ended ("stop" | "length") and the policy step that sampled them."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_step: int
    route: str = ""
    """The route that served it ("generate", "completions", "chat")."""
    request_id: str = ""


class EndpointError(Exception):
    """A request the endpoint refuses: HTTP `status`, the request field at fault (`param`) and a message."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.message = message


def _bad(param: str, why: str) -> EndpointError:
    return EndpointError(400, f"{param}: {why}", param)


class EpisodeCapture:
    """The calls of one episode (see the module docstring). `base_url` is the episode's root URL; an OpenAI client
    uses `openai_base_url` (`base_url + "/v1"`)."""

    def __init__(self, endpoint: GenerateEndpoint, episode_id: str) -> None:
        self.episode_id = episode_id
        self.base_url = f"{endpoint.base_url}/episodes/{episode_id}"
        self.openai_base_url = f"{self.base_url}/v1"
        self._endpoint = endpoint
        self._calls: list[tuple[int, int, CapturedCall]] = []
        self._lock = threading.Lock()
        self.closed = False

    def _add(self, seq: int, calls: Sequence[CapturedCall]) -> None:
        with self._lock:
            self._calls += [(seq, i, c) for i, c in enumerate(calls)]

    @property
    def calls(self) -> list[CapturedCall]:
        """The captured calls so far, in the order their requests arrived (choices of one request in order)."""
        with self._lock:
            return [c for _, _, c in sorted(self._calls, key=lambda t: (t[0], t[1]))]

    def close(self) -> list[CapturedCall]:
        """Stop capturing (later requests under this prefix get 404) and return the calls."""
        return self._endpoint.close_episode(self.episode_id)


@dataclasses.dataclass
class _Job:
    """One request waiting for the sampler."""

    prompt: list[int]
    n: int
    temperature: float
    max_tokens: int
    stop_tokens: tuple[int, ...] | None
    controls: SamplingControls
    seed: int | None
    seq: int
    future: Future[tuple[list[Completion], int]] = dataclasses.field(default_factory=Future)

    def key(self) -> tuple[Any, ...]:
        return (self.n, self.temperature, self.max_tokens, self.stop_tokens, self.controls, self.seed)


class GenerateEndpoint:
    """The generate endpoint over `context` (see the module docstring); a context manager (`start` / `close`).

    `max_seq_len`: the sampler's sequence limit (prompts of that many tokens or more are refused with 400).
    `policy_step()`: the policy step of a call (read after it; None: the context's `policy_step` attribute, else
    `UNKNOWN_POLICY_STEP`). `temperature` / `controls` set: every request samples with them (a request's own are
    ignored), so captured logprobs are those of the lesson's distribution. `max_tokens`: the default and the cap of a
    request's new tokens (None: default `max_seq_len - len(prompt)`, no cap). `seed`: seeds the draws of requests
    that give none. `max_pending`, `max_connections` (None: `max_pending + EXTRA_CONNECTIONS`) and `read_timeout_s`
    bound the load a client can put on it (see the module docstring). `reuse_port`: bind with SO_REUSEPORT, to
    serve on a port that the program which started this one reserved (`pipeline.process.ports.reserve_port`).
    Raises ValueError for a non-loopback `host` without a `token`.
    """

    def __init__(
        self,
        context: Any,
        *,
        max_seq_len: int,
        policy_step: Callable[[], int] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
        temperature: float | None = None,
        controls: SamplingControls | None = None,
        max_tokens: int | None = None,
        seed: int = 0,
        batch_window_s: float = 0.005,
        max_pending: int = 1024,
        max_connections: int | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        reuse_port: bool = False,
        capture_log: str | None = None,
    ) -> None:
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len={max_seq_len}: must be >= 2")
        if not is_loopback(host) and not token:
            raise ValueError(f"host={host!r} is not loopback: a token is required (every request must carry it)")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: must be >= 1 or None")
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending}: must be >= 1")
        self.context = context
        self.max_seq_len = int(max_seq_len)
        self._policy_step = policy_step
        self.host = host
        self.port = int(port)
        self.token = token
        self.model_name = model_name
        self.temperature = temperature
        self.controls = controls
        self.max_tokens = max_tokens
        self.batch_window_s = batch_window_s
        self.max_pending = max_pending
        self.max_connections = max_pending + EXTRA_CONNECTIONS if max_connections is None else int(max_connections)
        self.read_timeout_s = float(read_timeout_s)
        self.reuse_port = reuse_port
        self.capture_log = capture_log
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._rng = np.random.default_rng(seed)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._episodes: dict[str, EpisodeCapture] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._log_lock = threading.Lock()
        self.generate_calls = 0
        """`context.generate` calls made (one per batch of requests sharing sampling settings)."""
        self.requests_served = 0

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> GenerateEndpoint:
        """Bind and start serving (idempotent); returns self."""
        if self._server is not None:
            return self
        server = _Server(
            (self.host, self.port),
            _Handler,
            max_connections=self.max_connections,
            read_timeout_s=self.read_timeout_s,
            reuse_port=self.reuse_port,
        )
        server.endpoint = self
        self._server = server
        self.port = int(server.server_address[1])
        serve = threading.Thread(target=server.serve_forever, args=(0.05,), name="endpoint-http", daemon=True)
        sampler = threading.Thread(target=self._sampler_loop, name="endpoint-sampler", daemon=True)
        self._threads = [serve, sampler]
        for t in self._threads:
            t.start()
        logger.info("generate endpoint serving on %s", self.base_url)
        return self

    def announce(self, path: str) -> Announcement:
        """Write the bound `host:port` to `path` atomically (`pipeline.process.ports.announce`); after `start`."""
        if self._server is None:
            raise RuntimeError("the endpoint is not started")
        return announce(path, self._server.socket)

    def close(self) -> None:
        """Stop serving: the server shuts down, queued requests get 503, the sampler thread ends."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self._queue.put(None)
        for t in self._threads:
            t.join(timeout=30)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and not job.future.done():
                job.future.set_exception(EndpointError(503, "the endpoint closed"))

    def __enter__(self) -> GenerateEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def base_url(self) -> str:
        """`http://HOST:PORT` (loopback when bound to all interfaces, as a local client reaches it)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def serve_until(self, done: Future[Any] | Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until `done` (a future, or a predicate polled) is done or `timeout` seconds passed; returns whether
        it is done. Raises RuntimeError if the sampler thread died (then no request can be answered)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ok = done.done() if isinstance(done, Future) else bool(done())
            if ok:
                return True
            if self._threads and not self._threads[1].is_alive() and not self._closed.is_set():
                raise RuntimeError("the endpoint's sampler thread died")
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    # -- episodes -------------------------------------------------------------------------------------

    def open_episode(self, episode_id: str) -> EpisodeCapture:
        """Start capturing the calls made under `/episodes/<episode_id>` (ValueError for a bad or open id)."""
        if not episode_id or "/" in episode_id or "?" in episode_id or "#" in episode_id or " " in episode_id:
            raise ValueError(f"episode_id={episode_id!r}: must be non-empty without '/', '?', '#' or spaces")
        with self._lock:
            if episode_id in self._episodes:
                raise ValueError(f"episode {episode_id!r} is already open")
            cap = EpisodeCapture(self, episode_id)
            self._episodes[episode_id] = cap
        return cap

    def close_episode(self, episode_id: str) -> list[CapturedCall]:
        """Stop capturing `episode_id` and return its calls in arrival order (KeyError if it is not open)."""
        with self._lock:
            cap = self._episodes.pop(episode_id)
        cap.closed = True
        return cap.calls

    def _episode(self, episode_id: str) -> EpisodeCapture:
        with self._lock:
            cap = self._episodes.get(episode_id)
        if cap is None:
            raise EndpointError(404, f"episode {episode_id!r} is not open on this endpoint", "episode_id")
        return cap

    # -- sampling -------------------------------------------------------------------------------------

    def current_policy_step(self) -> int:
        """The step a call sampled with: the one step a server backend reported for it, else `policy_step()`, else
        the context's `policy_step` attribute, else `UNKNOWN_POLICY_STEP`."""
        served = getattr(getattr(self.context, "backend", None), "last_served_steps", None)
        if served and len(set(served)) == 1:
            return int(next(iter(served)))
        if self._policy_step is not None:
            return int(self._policy_step())
        step = getattr(self.context, "policy_step", None)
        return int(step) if step is not None else UNKNOWN_POLICY_STEP

    def sample(
        self,
        prompt: Sequence[int],
        *,
        n: int = 1,
        temperature: float = 1.0,
        max_tokens: int | None = None,
        stop_tokens: Sequence[int] | None = None,
        controls: SamplingControls = NO_CONTROLS,
        seed: int | None = None,
        timeout: float | None = None,
        param: str = "prompt",
    ) -> tuple[list[Completion], int]:
        """Queue one prompt for the sampler and wait: (n completions, policy step). Applies the endpoint's forced
        temperature/controls and its max_tokens default and cap. Raises EndpointError (400: too long, empty or
        out-of-vocabulary prompt, bad settings; 503: queue full or endpoint closed; 500: the sampler failed)."""
        ids = [int(t) for t in prompt]
        if not ids:
            raise _bad(param, "is empty")
        if len(ids) >= self.max_seq_len:
            raise EndpointError(
                400,
                f"{param}: the prompt has {len(ids)} tokens, but max_seq_len={self.max_seq_len} leaves no room to "
                f"generate (at most {self.max_seq_len - 1} prompt tokens)",
                param,
            )
        vocab = _vocab_size(self.context.tokenizer)
        if vocab is not None and (bad := [t for t in ids if not 0 <= t < vocab]):
            raise _bad(param, f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if self.max_tokens is not None:
            max_tokens = self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)
        if max_tokens is None:
            max_tokens = self.max_seq_len - len(ids)
        if self.temperature is not None:
            temperature = self.temperature
        if self.controls is not None:
            controls = self.controls
        if self._closed.is_set():
            raise EndpointError(503, "the endpoint is closed")
        job = _Job(
            ids,
            n,
            float(temperature),
            int(max_tokens),
            None if stop_tokens is None else tuple(sorted({int(t) for t in stop_tokens})),
            controls,
            seed,
            next(self._seq),
        )
        with self._pending_lock:
            if self._pending >= self.max_pending:
                raise EndpointError(503, f"{self.max_pending} requests already wait for the sampler; retry later")
            self._pending += 1
        try:
            self._queue.put(job)
            return job.future.result(timeout=timeout)
        finally:
            with self._pending_lock:
                self._pending -= 1

    @property
    def pending(self) -> int:
        """Requests waiting for the sampler now (queued or being sampled)."""
        with self._pending_lock:
            return self._pending

    def _sampler_loop(self) -> None:
        while not self._closed.is_set():
            job = self._queue.get()
            if job is None:
                break
            jobs = [job]
            deadline = time.monotonic() + self.batch_window_s
            while True:  # take whatever else is queued, waiting a moment for concurrent requests
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                jobs.append(nxt)
            groups: dict[tuple[Any, ...], list[_Job]] = {}
            for j in jobs:
                groups.setdefault(j.key(), []).append(j)
            for group in groups.values():
                self._run_group(group)

    def _run_group(self, group: list[_Job]) -> None:
        first = group[0]
        seed = first.seed if first.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        try:
            request = GenerationRequest(
                [j.prompt for j in group],
                n=first.n,
                temperature=first.temperature,
                max_tokens=first.max_tokens,
                stop_tokens=first.stop_tokens,
                seed=seed,
                controls=first.controls,
            )
            outs = check_completions(self.context.generate(request), len(group), first.n)
            step = self.current_policy_step()
            self.generate_calls += 1
        except Exception as e:
            if len(group) > 1:  # one bad request must not fail the others: answer each alone
                logger.warning("generate endpoint: a batch of %d failed (%r); retrying one by one", len(group), e)
                for j in group:
                    self._run_group([j])
                return
            status = 400 if isinstance(e, ValueError) else 500
            logger.warning("generate endpoint: request failed: %r", e)
            first.future.set_exception(EndpointError(status, f"generation failed: {type(e).__name__}: {e}"))
            return
        self._log(group, outs, step)
        for j, comps in zip(group, outs, strict=True):
            if not j.future.done():
                j.future.set_result((comps, step))

    def _log(self, group: list[_Job], outs: list[list[Completion]], step: int) -> None:
        if not self.capture_log:
            return
        lines = [
            json.dumps(
                {
                    "prompt_ids": j.prompt,
                    "completion_ids": [int(t) for t in c.tokens],
                    "logprobs": [float(x) for x in c.logprobs],
                    "finish_reason": c.finish_reason,
                    "policy_step": step,
                }
            )
            for j, comps in zip(group, outs, strict=True)
            for c in comps
        ]
        with self._log_lock, open(self.capture_log, "a") as f:
            f.write("".join(line + "\n" for line in lines))

    # -- routes ---------------------------------------------------------------------------------------

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        """Answer one HTTP request: (status, JSON body). Never raises."""
        try:
            return 200, self._route(method, path, headers, body)
        except EndpointError as e:
            return e.status, _error_body(e)
        except Exception as e:  # a bug answering one request must not take the server down
            logger.exception("generate endpoint: error answering %s %s", method, path)
            return 500, _error_body(EndpointError(500, f"internal error: {type(e).__name__}: {e}"))

    def _route(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
        if self.token is not None and not bearer_ok(headers.get("authorization"), self.token):
            raise EndpointError(401, "a valid 'Authorization: Bearer <token>' header is required", "authorization")
        path = path.split("?", 1)[0].rstrip("/")
        capture: EpisodeCapture | None = None
        if path.startswith("/episodes/"):
            episode_id, _, rest = path[len("/episodes/") :].partition("/")
            capture = self._episode(episode_id)
            path = "/" + rest
        if method == "GET":
            if path in ("/v1/models", "/models"):
                return self._models()
            if path in ("/health", "/v1/health"):
                return {"status": "ok"}
            raise EndpointError(404, f"no route GET {path}")
        if method != "POST":
            raise EndpointError(405, f"method {method} is not allowed")
        routes: dict[str, Callable[[dict[str, Any]], tuple[dict[str, Any], list[CapturedCall]]]] = {
            "/inference/v1/generate": self._generate,
            "/v1/completions": self._completions,
            "/v1/chat/completions": self._chat,
        }
        if path not in routes:
            raise EndpointError(404, f"no route POST {path}")
        try:
            request = json.loads(body or b"null")
        except ValueError as e:
            raise _bad("body", f"is not JSON ({e})") from None
        if not isinstance(request, dict):
            raise _bad("body", "must be a JSON object")
        seq = next(self._seq)
        answer, calls = routes[path](request)
        if capture is not None:
            capture._add(seq, calls)
        self.requests_served += 1
        return answer

    def _models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "rlpipe",
                    "max_model_len": self.max_seq_len,
                }
            ],
        }

    def _settings(self, req: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        """Sampling settings common to every route (`prefix` names where they sit, for error messages)."""
        n = _int(req, "n", prefix, 1, low=1)
        temperature = _num(req, "temperature", prefix, 1.0, low=0.0)
        top_p = _num(req, "top_p", prefix, 1.0, low=0.0)
        top_k = _int(req, "top_k", prefix, 0, low=-1)
        min_p = _num(req, "min_p", prefix, 0.0, low=0.0)
        try:
            controls = SamplingControls(top_p=top_p, top_k=max(top_k, 0), min_p=min_p)
        except ValueError as e:
            raise _bad(f"{prefix}top_p/top_k/min_p", str(e)) from None
        seed = req.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _bad(f"{prefix}seed", "must be an integer")
        return {"n": n, "temperature": temperature, "controls": controls, "seed": seed}

    def _stops(self, req: Mapping[str, Any], prefix: str = "") -> list[int] | None:
        """vLLM's rule: generation stops at EOS (unless `ignore_eos`) and at every `stop_token_ids` id. Stop strings
        are refused: honouring them would mean cutting sampled tokens by their text."""
        stop = req.get("stop")
        if stop not in (None, [], ""):
            raise _bad(f"{prefix}stop", "stop strings are not supported; use stop_token_ids")
        ids = req.get("stop_token_ids")
        if ids is None:
            ids = []
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise _bad(f"{prefix}stop_token_ids", "must be a list of integers")
        ignore_eos = req.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise _bad(f"{prefix}ignore_eos", "must be a boolean")
        base = set() if ignore_eos else effective_stop_tokens(self.context.tokenizer, None)
        return sorted(base | {int(t) for t in ids})

    def _max_tokens(self, req: Mapping[str, Any], prefix: str = "", *names: str) -> int | None:
        for name in names or ("max_tokens",):
            if req.get(name) is not None:
                return _int(req, name, prefix, 1, low=1)
        return None

    def _sample(
        self,
        prompt: list[int],
        settings: dict[str, Any],
        max_tokens: int | None,
        stops: list[int] | None,
        param: str = "prompt",
    ) -> tuple[list[Completion], int]:
        return self.sample(
            prompt,
            n=settings["n"],
            temperature=settings["temperature"],
            max_tokens=max_tokens,
            stop_tokens=stops,
            controls=settings["controls"],
            seed=settings["seed"],
            param=param,
        )

    def _calls(self, prompt: list[int], comps: list[Completion], step: int, route: str, rid: str) -> list[CapturedCall]:
        return [
            CapturedCall(
                [int(t) for t in prompt],
                [int(t) for t in c.tokens],
                [float(x) for x in c.logprobs],
                c.finish_reason,
                step,
                route,
                rid,
            )
            for c in comps
        ]

    def _generate(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[CapturedCall]]:
        """vLLM's `/inference/v1/generate` (token ids in and out)."""
        for unsupported in ("features", "content_parts"):
            if req.get(unsupported):
                raise _bad(unsupported, "multimodal input is not supported")
        prompt = _token_ids(req.get("token_ids"), "token_ids")
        sp = req.get("sampling_params", {})
        if sp is None:
            sp = {}
        if not isinstance(sp, dict):
            raise _bad("sampling_params", "must be an object")
        settings = self._settings(sp, "sampling_params.")
        max_tokens = self._max_tokens(sp, "sampling_params.")
        comps, step = self._sample(prompt, settings, max_tokens, self._stops(sp), "token_ids")
        rid = f"gen-{uuid.uuid4().hex}"
        choices = [
            {
                "index": i,
                "token_ids": [int(t) for t in c.tokens],
                "logprobs": {
                    "content": [
                        {"token": f"token_id:{int(t)}", "logprob": float(lp)}
                        for t, lp in zip(c.tokens, c.logprobs, strict=True)
                    ]
                },
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(comps)
        ]
        answer = {
            "request_id": rid,
            "prompt_token_ids": prompt,
            "choices": choices,
            "policy_step": step,
            "usage": _usage(prompt, comps),
        }
        return answer, self._calls(prompt, comps, step, "generate", rid)

    def _completions(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[CapturedCall]]:
        """OpenAI's `/v1/completions` with vLLM's `return_token_ids` and legacy `logprobs`."""
        if req.get("stream"):
            raise _bad("stream", "streaming is not supported")
        if req.get("echo"):
            raise _bad("echo", "echo is not supported")
        add_special = req.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise _bad("add_special_tokens", "must be a boolean")
        prompt = self._completion_prompt(req.get("prompt"), add_special)
        settings = self._settings(req)
        n_logprobs = req.get("logprobs")
        if n_logprobs is not None and (isinstance(n_logprobs, bool) or not isinstance(n_logprobs, int)):
            raise _bad("logprobs", "must be an integer or null")
        want_ids = _flag(req, "return_token_ids")
        stops = self._stops(req)
        comps, step = self._sample(prompt, settings, self._max_tokens(req), stops)
        rid = f"cmpl-{uuid.uuid4().hex}"
        tok = self.context.tokenizer
        stop = set(stops or [])
        choices = []
        for i, c in enumerate(comps):
            choice: dict[str, Any] = {
                "index": i,
                "text": _text(tok, c, stop),
                "finish_reason": c.finish_reason,
                "logprobs": None,
            }
            if n_logprobs is not None:
                tokens = [str(tok.decode([int(t)])) for t in c.tokens]
                offsets = list(itertools.accumulate([0, *(len(s) for s in tokens[:-1])])) if tokens else []
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": [float(x) for x in c.logprobs],
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
            if want_ids:
                choice["token_ids"] = [int(t) for t in c.tokens]
                choice["prompt_token_ids"] = prompt
            choices.append(choice)
        answer = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": str(req.get("model") or self.model_name),
            "choices": choices,
            "usage": _usage(prompt, comps),
            "policy_step": step,
        }
        return answer, self._calls(prompt, comps, step, "completions", rid)

    def _completion_prompt(self, prompt: Any, add_special: bool) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt(self.context.tokenizer, prompt, add_bos=add_special)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return self._completion_prompt(prompt[0], add_special)  # a batch of one
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return _token_ids(prompt, "prompt")
        raise _bad("prompt", "must be a string or a list of token ids (one prompt per request)")

    def _chat(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[CapturedCall]]:
        """OpenAI's `/v1/chat/completions`, rendered by the tokenizer's chat template."""
        from pipeline.environments.tokenizer import has_chat_template, render_chat

        if req.get("stream"):
            raise _bad("stream", "streaming is not supported")
        messages = _messages(req.get("messages"))
        tools = req.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise _bad("tools", "must be a list of objects")
        tok = self.context.tokenizer
        if not has_chat_template(tok):
            raise _bad("messages", "the served tokenizer has no chat template; use /v1/completions")
        try:
            prompt = render_chat(tok, messages, tools or None)
        except Exception as e:
            raise _bad("messages", f"the chat template cannot render them: {type(e).__name__}: {e}") from None
        settings = self._settings(req)
        want_logprobs = _flag(req, "logprobs")
        want_ids = _flag(req, "return_token_ids")
        stops = self._stops(req)
        max_tokens = self._max_tokens(req, "", "max_completion_tokens", "max_tokens")
        comps, step = self._sample(prompt, settings, max_tokens, stops, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stop = set(stops or [])
        choices = []
        for i, c in enumerate(comps):
            content, calls = parse_tool_calls(_text(tok, c, stop), id_prefix=f"call_{i}")
            message = assistant_message(content, calls)
            finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
            if want_logprobs:
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": str(tok.decode([int(t)])),
                            "logprob": float(lp),
                            "bytes": list(str(tok.decode([int(t)])).encode()),
                            "top_logprobs": [],
                        }
                        for t, lp in zip(c.tokens, c.logprobs, strict=True)
                    ]
                }
            if want_ids:
                choice["token_ids"] = [int(t) for t in c.tokens]
            choices.append(choice)
        answer: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(req.get("model") or self.model_name),
            "choices": choices,
            "usage": _usage(prompt, comps),
            "policy_step": step,
        }
        if want_ids:
            answer["prompt_token_ids"] = prompt
        return answer, self._calls(prompt, comps, step, "chat", rid)


# ---------------------------------------------------------------------------------------
# request parsing helpers
# ---------------------------------------------------------------------------------------


def _vocab_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except TypeError:
        return None


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise _bad(name, "must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise _bad(name, "must be a list of integers")
    return [int(t) for t in value]


def _num(req: Mapping[str, Any], name: str, prefix: str, default: float, *, low: float) -> float:
    v = req.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low:
        raise _bad(f"{prefix}{name}", f"must be a number >= {low}, got {v!r}")
    return float(v)


def _int(req: Mapping[str, Any], name: str, prefix: str, default: int, *, low: int) -> int:
    v = req.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise _bad(f"{prefix}{name}", f"must be an integer >= {low}, got {v!r}")
    return int(v)


def _flag(req: Mapping[str, Any], name: str) -> bool:
    v = req.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"must be a boolean, got {v!r}")
    return v


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "must be an object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"messages[{i}].role", f"must be system, user, assistant or tool, got {role!r}")
        msg = dict(m)
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for k, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content[{k}]", "only text parts are supported")
                texts.append(part["text"])
            msg["content"] = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "must be a string, a list of text parts or null")
        out.append(msg)
    return out


def _text(tokenizer: Any, completion: Completion, stop: set[int]) -> str:
    """The completion's text: its ids decoded, without a final stop token (as vLLM reports it)."""
    ids = [int(t) for t in completion.tokens]
    if ids and completion.finish_reason == "stop" and ids[-1] in stop:
        ids = ids[:-1]
    return str(tokenizer.decode(ids))


def _usage(prompt: list[int], comps: list[Completion]) -> dict[str, int]:
    completion = sum(len(c.tokens) for c in comps)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


def _error_body(e: EndpointError) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(e.status, "error")
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.status}}


# ---------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------


class _Server(BoundedHTTPServer):
    endpoint: GenerateEndpoint


class _Handler(BoundedHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("endpoint %s - %s", self.address_string(), format % args)

    def _answer(self, method: str) -> None:
        length = self.headers.get("Content-Length")
        body = b""
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                size = -1
            if size < 0 or size > MAX_BODY_BYTES:
                self._send(413 if size > 0 else 400, _error_body(EndpointError(413, "bad or too large body")))
                return
            body = self.rfile.read(size)
        headers = {k.lower(): v for k, v in self.headers.items()}
        status, answer = self.server.endpoint.handle(method, self.path, headers, body)
        self._send(status, answer)

    def _send(self, status: int, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")
