"""The generate endpoint's routes: one HTTP request in, (status, JSON body) out, at the root and under an episode's
prefix `/episodes/<episode_id>` (whose calls are captured, `capture.Episodes`):

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
  checks prompt lengths against it); `GET /health`.

Every response carries `policy_step`: the policy that sampled it. Errors: a malformed request gets 400 naming the
field (`parsing`); an unknown route 404, an unknown or closed episode 404, a method other than GET or POST 405.
With a `token` every request, on every route, must carry `Authorization: Bearer <token>` (401 otherwise; compared
in constant time). `Routes.handle` never raises: a bug answering one request is a 500 for that request alone.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.environments.base import Completion
from pipeline.environments.chat import assistant_message, parse_tool_calls
from pipeline.environments.endpoint.capture import CapturedCall, EpisodeCapture, Episodes, captured_calls
from pipeline.environments.endpoint.errors import EndpointError, bad, error_body
from pipeline.environments.endpoint.parsing import (
    SamplingSettings,
    chat_prompt,
    completion_prompt,
    flag,
    json_object,
    max_new_tokens,
    sampling_settings,
    stop_tokens,
    token_ids,
)
from pipeline.process.ports import bearer_ok

logger = logging.getLogger(__name__)

Answer = tuple[dict[str, Any], list[CapturedCall]]
"""A route's answer: the response body and the calls it made (captured when it was under an episode's prefix)."""


SampleFn = Callable[..., tuple[list[Completion], int]]
"""`GenerateEndpoint.sample`: n completions of one prompt (keyword settings) and the policy step that sampled them."""


class Routes:
    """The routes of one endpoint (see the module docstring): sampling through `sample`, with the tokenizer of
    `context` (an `InferenceContext`) to encode, render and decode; `model_name` and `max_seq_len` as `/v1/models`
    reports them."""

    def __init__(
        self,
        sample: SampleFn,
        context: Any,
        episodes: Episodes,
        *,
        model_name: str,
        max_seq_len: int,
        token: str | None = None,
    ) -> None:
        self.sample = sample
        self.context = context
        self.episodes = episodes
        self.model_name = model_name
        self.max_seq_len = max_seq_len
        self.token = token
        self.requests_served = 0
        """Sampling requests answered (200)."""
        self._seq = itertools.count()

    @property
    def tokenizer(self) -> Any:
        """The served tokenizer (read from the context at each request, as the sampler reads it)."""
        return self.context.tokenizer

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        """Answer one HTTP request (`headers` with lower-case names): (status, JSON body). Never raises."""
        try:
            return 200, self._route(method, path, headers, body)
        except EndpointError as e:
            return e.status, error_body(e)
        except Exception as e:  # a bug answering one request must not take the server down
            logger.exception("generate endpoint: error answering %s %s", method, path)
            return 500, error_body(EndpointError(500, f"internal error: {type(e).__name__}: {e}"))

    def _route(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
        if self.token is not None and not bearer_ok(headers.get("authorization"), self.token):
            raise EndpointError(401, "a valid 'Authorization: Bearer <token>' header is required", "authorization")
        capture: EpisodeCapture | None
        capture, path = self.episodes.resolve(path.split("?", 1)[0].rstrip("/"))
        if method == "GET":
            if path in ("/v1/models", "/models"):
                return self.models()
            if path in ("/health", "/v1/health"):
                return {"status": "ok"}
            raise EndpointError(404, f"no route GET {path}")
        if method != "POST":
            raise EndpointError(405, f"method {method} is not allowed")
        routes: dict[str, Callable[[dict[str, Any]], Answer]] = {
            "/inference/v1/generate": self.generate,
            "/v1/completions": self.completions,
            "/v1/chat/completions": self.chat,
        }
        if path not in routes:
            raise EndpointError(404, f"no route POST {path}")
        request = json_object(body)
        seq = next(self._seq)
        answer, calls = routes[path](request)
        if capture is not None:
            capture.add(seq, calls)
        self.requests_served += 1
        return answer

    def models(self) -> dict[str, Any]:
        """`GET /v1/models`."""
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlpipe"}
        return {"object": "list", "data": [{**model, "max_model_len": self.max_seq_len}]}

    def _sample(
        self,
        prompt: list[int],
        settings: SamplingSettings,
        max_tokens: int | None,
        stops: list[int],
        param: str = "prompt",
    ) -> tuple[list[Completion], int]:
        return self.sample(
            prompt,
            n=settings.n,
            temperature=settings.temperature,
            max_tokens=max_tokens,
            stop_tokens=stops,
            controls=settings.controls,
            seed=settings.seed,
            param=param,
        )

    def generate(self, req: dict[str, Any]) -> Answer:
        """vLLM's `/inference/v1/generate` (token ids in and out)."""
        for unsupported in ("features", "content_parts"):
            if req.get(unsupported):
                raise bad(unsupported, "multimodal input is not supported")
        prompt = token_ids(req.get("token_ids"), "token_ids")
        sp = req.get("sampling_params", {})
        if sp is None:
            sp = {}
        if not isinstance(sp, dict):
            raise bad("sampling_params", "must be an object")
        settings = sampling_settings(sp, "sampling_params.")
        max_tokens = max_new_tokens(sp, "sampling_params.")
        stops = stop_tokens(sp, self.tokenizer)
        comps, step = self._sample(prompt, settings, max_tokens, stops, "token_ids")
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
            "usage": usage(prompt, comps),
        }
        return answer, captured_calls(prompt, comps, step, "generate", rid)

    def completions(self, req: dict[str, Any]) -> Answer:
        """OpenAI's `/v1/completions` with vLLM's `return_token_ids` and legacy `logprobs`."""
        if req.get("stream"):
            raise bad("stream", "streaming is not supported")
        if req.get("echo"):
            raise bad("echo", "echo is not supported")
        add_special = req.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise bad("add_special_tokens", "must be a boolean")
        tok = self.tokenizer
        prompt = completion_prompt(tok, req.get("prompt"), add_special)
        settings = sampling_settings(req)
        n_logprobs = req.get("logprobs")
        if n_logprobs is not None and (isinstance(n_logprobs, bool) or not isinstance(n_logprobs, int)):
            raise bad("logprobs", "must be an integer or null")
        want_ids = flag(req, "return_token_ids")
        stops = stop_tokens(req, tok)
        comps, step = self._sample(prompt, settings, max_new_tokens(req), stops)
        rid = f"cmpl-{uuid.uuid4().hex}"
        choices = []
        for i, c in enumerate(comps):
            choice: dict[str, Any] = {
                "index": i,
                "text": text(tok, c, set(stops)),
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
        answer = self._response(req, rid, "text_completion", choices, prompt, comps, step)
        return answer, captured_calls(prompt, comps, step, "completions", rid)

    def chat(self, req: dict[str, Any]) -> Answer:
        """OpenAI's `/v1/chat/completions`, rendered by the tokenizer's chat template."""
        if req.get("stream"):
            raise bad("stream", "streaming is not supported")
        tok = self.tokenizer
        prompt = chat_prompt(tok, req)
        settings = sampling_settings(req)
        want_logprobs = flag(req, "logprobs")
        want_ids = flag(req, "return_token_ids")
        stops = stop_tokens(req, tok)
        max_tokens = max_new_tokens(req, "", "max_completion_tokens", "max_tokens")
        comps, step = self._sample(prompt, settings, max_tokens, stops, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        choices = []
        for i, c in enumerate(comps):
            content, calls = parse_tool_calls(text(tok, c, set(stops)), id_prefix=f"call_{i}")
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
        answer = self._response(req, rid, "chat.completion", choices, prompt, comps, step)
        if want_ids:
            answer["prompt_token_ids"] = prompt
        return answer, captured_calls(prompt, comps, step, "chat", rid)

    def _response(
        self,
        req: dict[str, Any],
        rid: str,
        kind: str,
        choices: list[dict[str, Any]],
        prompt: list[int],
        comps: list[Completion],
        step: int,
    ) -> dict[str, Any]:
        """OpenAI's response object (`object`: `kind`) around `choices`: the model name asked for (else the one
        served), `usage`, and `policy_step`, the policy that sampled every choice."""
        return {
            "id": rid,
            "object": kind,
            "created": int(time.time()),
            "model": str(req.get("model") or self.model_name),
            "choices": choices,
            "usage": usage(prompt, comps),
            "policy_step": step,
        }


def text(tokenizer: Any, completion: Completion, stop: set[int]) -> str:
    """The completion's text: its ids decoded, without a final stop token (as vLLM reports it)."""
    ids = [int(t) for t in completion.tokens]
    if ids and completion.finish_reason == "stop" and ids[-1] in stop:
        ids = ids[:-1]
    return str(tokenizer.decode(ids))


def usage(prompt: list[int], comps: list[Completion]) -> dict[str, int]:
    """OpenAI's `usage`: prompt tokens once, completion tokens of every choice."""
    completion = sum(len(c.tokens) for c in comps)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}
