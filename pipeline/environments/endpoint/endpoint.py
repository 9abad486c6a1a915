"""`GenerateEndpoint`: the generate endpoint's lifecycle, joining its parts: the HTTP server (`server`), the routes
and their request parsing (`routes`, `parsing`), the batcher that feeds the sampler (`batcher`) and the episodes
whose calls it captures (`capture`). The package docstring says what it serves; each part's module says how.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from pipeline.environments.base import Completion
from pipeline.environments.endpoint.batcher import Batcher, Job
from pipeline.environments.endpoint.capture import UNKNOWN_POLICY_STEP, CapturedCall, EpisodeCapture, Episodes
from pipeline.environments.endpoint.parsing import check_prompt
from pipeline.environments.endpoint.routes import Routes
from pipeline.environments.endpoint.server import EndpointServer, endpoint_server
from pipeline.environments.generation import NO_CONTROLS, SamplingControls
from pipeline.process.ports import Announcement, announce, is_loopback

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "rlpipe-policy"
READ_TIMEOUT_S = 60.0
"""Default `read_timeout_s`: a connection silent this long is closed."""
EXTRA_CONNECTIONS = 64
"""Default `max_connections` is `max_pending` plus this many (connections with no request waiting: idle
keep-alive connections, requests being read or answered)."""


class GenerateEndpoint:
    """The generate endpoint over `context` (see the package docstring); a context manager (`start` / `close`).

    `max_seq_len`: the sampler's sequence limit (prompts of that many tokens or more are refused with 400).
    `policy_step()`: the policy step of a call (read after it; None: the context's `policy_step` attribute, else
    `UNKNOWN_POLICY_STEP`). `temperature` / `controls` set: every request samples with them (a request's own are
    ignored), so captured logprobs are those of the lesson's distribution. `max_tokens`: the default and the cap of a
    request's new tokens (None: default `max_seq_len - len(prompt)`, no cap). `seed`: seeds the draws of requests
    that give none. `batch_window_s`: how long a batch waits for more requests; `batch_wait_max_s`: how long it
    waits for the expected callers (`expect_callers`, see `batcher`). `max_pending`, `max_connections` (None:
    `max_pending + EXTRA_CONNECTIONS`) and `read_timeout_s` bound the load a client can put on it (see the package
    docstring). `reuse_port`: bind with SO_REUSEPORT, to serve on a port that the program which started this one
    reserved (`pipeline.process.ports.reserve_port`).
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
        batch_wait_max_s: float = 0.25,
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
        self.max_pending = max_pending
        self.max_connections = max_pending + EXTRA_CONNECTIONS if max_connections is None else int(max_connections)
        self.read_timeout_s = float(read_timeout_s)
        self.reuse_port = reuse_port
        self._batcher = Batcher(
            context,
            policy_step=self.current_policy_step,
            batch_window_s=batch_window_s,
            batch_wait_max_s=batch_wait_max_s,
            max_pending=max_pending,
            seed=seed,
            capture_log=capture_log,
        )
        self._episodes = Episodes()
        self._routes = Routes(
            self.sample, context, self._episodes, model_name=model_name, max_seq_len=self.max_seq_len, token=token
        )
        self._server: EndpointServer | None = None
        self._serve_thread: threading.Thread | None = None
        self._closed = threading.Event()

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> GenerateEndpoint:
        """Bind and start serving (idempotent); returns self."""
        if self._server is not None:
            return self
        server = endpoint_server(
            (self.host, self.port),
            self.handle,
            max_connections=self.max_connections,
            read_timeout_s=self.read_timeout_s,
            reuse_port=self.reuse_port,
        )
        self._server = server
        self.port = int(server.server_address[1])
        self._serve_thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name="endpoint-http", daemon=True
        )
        self._serve_thread.start()
        self._batcher.start()
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
        self._batcher.close()
        if self._serve_thread is not None:
            self._serve_thread.join(timeout=30)

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
            if self._batcher.died():
                raise RuntimeError("the endpoint's sampler thread died")
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    # -- episodes -------------------------------------------------------------------------------------

    def open_episode(self, episode_id: str) -> EpisodeCapture:
        """Start capturing the calls made under `/episodes/<episode_id>` (ValueError for a bad or open id)."""
        return self._episodes.open(episode_id, self.base_url)

    def close_episode(self, episode_id: str) -> list[CapturedCall]:
        """Stop capturing `episode_id` and return its calls in arrival order (KeyError if it is not open)."""
        return self._episodes.close(episode_id)

    def expect_callers(self, n: int | None) -> None:
        """Batch by callers, not a timer: each sampler call waits (at most `batch_wait_max_s`) for a request from
        every one of `n` callers still running (None: back to the `batch_window_s` timer); `caller_finished` as each
        ends. For a caller that runs `n` episodes, each waiting on at most one request at a time."""
        self._batcher.expect_callers(n)

    def caller_finished(self) -> None:
        """One of the expected callers will make no more requests (thread-safe)."""
        self._batcher.caller_finished()

    def model_cards(self) -> dict[str, Any]:
        """The body `GET /v1/models` answers: the one served model with its `max_model_len`."""
        return self._routes.models()

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
        ids = check_prompt(prompt, max_seq_len=self.max_seq_len, tokenizer=self.context.tokenizer, param=param)
        if self.max_tokens is not None:
            max_tokens = self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)
        if max_tokens is None:
            max_tokens = self.max_seq_len - len(ids)
        job = Job(
            ids,
            n,
            float(self.temperature if self.temperature is not None else temperature),
            int(max_tokens),
            None if stop_tokens is None else tuple(sorted({int(t) for t in stop_tokens})),
            self.controls if self.controls is not None else controls,
            seed,
        )
        return self._batcher.submit(job, timeout=timeout)

    @property
    def pending(self) -> int:
        """Requests waiting for the sampler now (queued or being sampled)."""
        return self._batcher.pending

    @property
    def generate_calls(self) -> int:
        """`context.generate` calls made (one per batch of requests sharing sampling settings)."""
        return self._batcher.generate_calls

    @property
    def requests_served(self) -> int:
        """Sampling requests answered (200)."""
        return self._routes.requests_served

    # -- HTTP -----------------------------------------------------------------------------------------

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        """Answer one HTTP request (`headers` with lower-case names): (status, JSON body). Never raises."""
        return self._routes.handle(method, path, headers, body)
