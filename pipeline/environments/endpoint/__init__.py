"""The generate endpoint: an HTTP server that serves a policy to programs that speak vLLM or OpenAI, batches their
requests into the sampler, and captures every call of an episode exactly. Environments that run such programs
(`agent.py`, `verifiers_env.py`) start one per `Environment.sample` call over the rollout worker's sampler;
`steps/serve.py` serves a committed policy with one, standalone.

`GenerateEndpoint(context, max_seq_len=...)` serves an `InferenceContext` (`ctx.tokenizer`, `ctx.generate`) on
`host:port` (loopback and a free port by default). Its parts, one module each:

- `routes.py`: the routes (vLLM's `POST /inference/v1/generate`, OpenAI's `POST /v1/completions` and
  `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`), at the root and under an episode prefix
  `/episodes/<episode_id>`, and the bearer token; `parsing.py`: every request field checked, a wrong one a 400
  naming it; `errors.py`: `EndpointError` and the error body.
- `server.py`: the bounded HTTP server: at most `max_connections` connections at once (default
  `max_pending + 64`), a connection beyond that answered 503 and closed, a connection silent for `read_timeout_s`
  closed (an idle keep-alive connection too), so connections that never send a request cannot hold its threads.
- `batcher.py`: the sampler thread: requests queue their prompts; it takes what is queued (waiting
  `batch_window_s` for more, or, after `expect_callers(n)`, for a request from each of the `n` callers still
  running, at most `batch_wait_max_s`), groups the requests that share sampling settings, and calls
  `context.generate` once per group. At most `max_pending` requests wait for it at once; one more is answered 503.
- `capture.py`: `open_episode(episode_id)` returns an `EpisodeCapture` whose `base_url` is the episode's prefix;
  every call answered under it is recorded as `CapturedCall`s (the exact prompt ids, the sampled ids, the
  sampler's logprobs, finish reason, policy step; one per choice) in arrival order, until `close_episode`.
- `endpoint.py`: `GenerateEndpoint`, joining them: start, close, `sample`, the policy step of a call.

Every response carries `policy_step`: the policy that sampled it (`policy_step()` after the call, or the step a
server backend reported for that call). The policy changes only between requests: the rollout worker holds its
model lock for a whole `Environment.sample` call, inside which an environment runs its endpoint. The caller of
`Environment.sample` needs no pumping helper: it just waits for its episodes (`serve_until` is there for a caller
that wants to wait on a future while the endpoint's health is checked). With a `token` (required on a
non-loopback host: ValueError at construction) every request, on every route, must carry
`Authorization: Bearer <token>`. Nothing a request does stops the server or the sampler. Nothing here imports JAX.
"""

from pipeline.environments.endpoint.capture import UNKNOWN_POLICY_STEP, CapturedCall, EpisodeCapture
from pipeline.environments.endpoint.endpoint import (
    DEFAULT_MODEL_NAME,
    EXTRA_CONNECTIONS,
    READ_TIMEOUT_S,
    GenerateEndpoint,
)
from pipeline.environments.endpoint.errors import EndpointError
from pipeline.environments.endpoint.server import MAX_BODY_BYTES

__all__ = [
    "DEFAULT_MODEL_NAME",
    "EXTRA_CONNECTIONS",
    "MAX_BODY_BYTES",
    "READ_TIMEOUT_S",
    "UNKNOWN_POLICY_STEP",
    "CapturedCall",
    "EndpointError",
    "EpisodeCapture",
    "GenerateEndpoint",
]
