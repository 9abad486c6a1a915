"""An inference backend that talks to an OpenAI-compatible `/v1/completions` server (vLLM, SGLang, levanter).

Reads: nothing from the run root. Talks HTTP to `InferenceConfig.openai_base_url` (e.g. `http://host:8000/v1`).
Writes: nothing. Built by `policy.inference.make_backend` for an `OpenAIInferenceConfig` (`inference: {type:
openai, ...}`) as `OpenAIBackend(config, tokenizer, max_seq_len=...)`; it is an `InferenceBackend` like the
in-process backends and returns `pipeline.environments.Completion`s (token ids + per-token logprobs).

Promises
- Token ids are never recovered by re-tokenising generated text. In order of preference the ids come from
  (1) the choice's `token_ids` field (vLLM `return_token_ids`), (2) `logprobs.tokens` entries of the form
  `token_id:123` (vLLM `return_tokens_as_token_ids`), (3) `logprobs.tokens` vocabulary strings as levanter's
  `InferenceServer` returns them (`convert_ids_to_tokens`), mapped back by exact vocabulary lookup; a string
  that is not a vocabulary entry raises `OpenAIResponseError`. Logprobs are `logprobs.token_logprobs`; a
  missing or short list raises.
- Prompts are sent as token ids (vLLM accepts `prompt: list[list[int]]`). A server that only takes text
  (levanter's `InferenceServer`, detected by its `/health` answer or by a 422 on an id prompt) gets the
  decoded prompt, but only after checking `encode(decode(ids)) == ids`; otherwise `PromptRoundTripError`.
- Stop tokens: sent as `stop_token_ids` (vLLM) and, for a single stop token, as its string (levanter);
  the output is also cut client-side after the first stop token, which is kept. `finish_reason` is "stop"
  when the last token is a stop token, else "length" when `max_tokens` tokens came back, else the server's.
- Lengths as in `policy.inference.base`: a prompt of `>= max_seq_len` tokens raises `PromptTooLongError` before
  any request (levanter's server would silently keep only the prompt's tail); otherwise a prompt's budget
  is `min(max_tokens, max_seq_len - len(prompt))`.
- Policy step: a server says which policy it serves by the response header `X-Policy-Step: <int>` or by
  a model name ending in `step-<int>` / `@<int>` (e.g. `--served-model-name policy@step-00000120`).
  `last_served_steps` holds the steps reported during the last `generate` call and `served_step` the most
  recent one (None when the server never says); `served_policy_step()` asks the server (`GET /v1/models`).
  The rollout manager tags rows with it and re-rolls a call during which the server switched policies.
- The server owns the weights: `update_model` is a no-op (`external_weights = True`).
- With levanter's server, `n > 1` leaks KV pages (levanter 1.2.dev1644), so each sample is its own prompt
  entry with `n = 1`; other servers get `n` per prompt.

Chat: `chat(ChatRequest)` asks `/v1/chat/completions` for the next assistant turn of each conversation, with tool
calls, exact prompt and completion ids and logprobs (`policy.inference.openai_chat` documents the payloads); with a
local chat template, `max_tokens` is cut so that the rendered prompt plus the turn fits in `max_seq_len`.

Retries: connection errors, timeouts and 5xx answers are retried `max_retries` times with backoff; 4xx
answers raise `OpenAIBackendError` naming the URL, status and body.

Key: with `api_key_env`, every request carries `Authorization: Bearer <the variable's value>` (`set_api_key`
changes it: the `server` backend sends each start's own secret).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from pipeline.config import ConfigError, OpenAIInferenceConfig
from pipeline.environments import Completion
from pipeline.environments.chat import ChatRequest, ChatTurn
from policy.inference.base import (
    NO_CONTROLS,
    BackendBuild,
    GenerationRequest,
    InferenceBackend,
    PromptTooLongError,
    SamplingControls,
    truncate_at_stop,
)
from policy.inference.registry import register_backend

logger = logging.getLogger(__name__)

POLICY_STEP_HEADER = "x-policy-step"
_STEP_IN_NAME = re.compile(r"(?:step-?|@)(\d+)$")
_TOKEN_ID_STR = re.compile(r"^token_id:(-?\d+)$")
PROMPT_FORMATS = ("auto", "ids", "text")


class OpenAIBackendError(RuntimeError):
    """The server refused a request or answered something unusable; the message names URL and status."""


class OpenAIResponseError(OpenAIBackendError):
    """A response lacks what we need (token ids, logprobs) or holds an unknown token string."""


class PromptRoundTripError(ValueError):
    """A text-only server was asked for a prompt whose decoded text does not encode back to the same ids."""


def policy_step_from_model_name(name: str | None) -> int | None:
    """The policy step a served model name advertises (`...step-120`, `...step120`, `...@120`), or None."""
    if not name:
        return None
    m = _STEP_IN_NAME.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class _Chunk:
    """One `/v1/completions` request: `n` samples of each entry, one token budget for all."""

    entries: list[list[int]]
    n: int
    temperature: float
    max_tokens: int
    stops: list[int]
    seed: int
    controls: SamplingControls = NO_CONTROLS


@register_backend(OpenAIInferenceConfig)
class OpenAIBackend(InferenceBackend):
    """Generation through an OpenAI-compatible completions server, returning token ids and logprobs.

    Thread-safe for concurrent `generate` calls only in the sense that each call is independent;
    `last_served_steps` describes the most recent call.
    """

    external_weights = True
    """The server owns the weights: the rollout worker tags rows with the step the server reports."""

    def __init__(
        self,
        config: OpenAIInferenceConfig,
        tokenizer: Any,
        *,
        max_seq_len: int | None = None,
        prompt_format: str = "auto",
        max_retries: int = 3,
        max_concurrent_requests: int = 4,
    ) -> None:
        if not config.openai_base_url:
            raise OpenAIBackendError("inference.openai_base_url is required for the openai backend")
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format={prompt_format!r}: must be one of {PROMPT_FORMATS}")
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.set_base_url(config.openai_base_url)
        self._prompt_format = prompt_format
        self._server_kind: str | None = None
        self._max_retries = max_retries
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, max_concurrent_requests))
        self._client = httpx.Client(timeout=httpx.Timeout(config.request_timeout_s, connect=30.0))
        self._lock = threading.Lock()
        self.served_step: int | None = None
        key_env = getattr(config, "api_key_env", None)
        if key_env:
            key = os.environ.get(key_env)
            if not key:
                raise ConfigError("inference.api_key_env", key_env, "names an environment variable that is not set")
            self.set_api_key(key)

    def set_base_url(self, url: str) -> None:
        """Talk to the server at `url` (`http://host:port/v1`) from now on."""
        self.base_url = url.rstrip("/")
        self._completions_url = f"{self.base_url}/completions"
        self._chat_url = f"{self.base_url}/chat/completions"

    def set_api_key(self, key: str | None) -> None:
        """Send `Authorization: Bearer <key>` with every request from now on (None: no such header)."""
        if key is None:
            self._client.headers.pop("Authorization", None)
        else:
            self._client.headers["Authorization"] = f"Bearer {key}"

    @classmethod
    def from_config(cls, config: Any, build: BackendBuild) -> OpenAIBackend:
        """A client of `config.openai_base_url` (the server owns model and dtype: `model`, `compute_dtype` unused)."""
        return cls(config, build.tokenizer, max_seq_len=build.max_seq_len)

    # ------------------------------------------------------------------------------------------
    # lifecycle
    # ------------------------------------------------------------------------------------------

    def update_model(self, model: Any) -> None:
        """No-op: the server owns its weights (load new weights into the server itself)."""
        logger.debug("openai backend: update_model ignored; the server at %s owns the weights", self.base_url)

    def shutdown(self) -> None:
        """Close the HTTP client and the request pool."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    @property
    def server_kind(self) -> str:
        """'levanter' when the server's /health names levanter's inference service, else 'openai'."""
        if self._server_kind is None:
            kind = "openai"
            root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
            try:
                r = self._client.get(f"{root}/health", timeout=10.0)
                if r.status_code == 200 and "levanter" in str(r.json().get("service", "")):
                    kind = "levanter"
            except (httpx.HTTPError, ValueError, AttributeError):
                pass  # no (JSON) health endpoint: a generic OpenAI-compatible server
            self._server_kind = kind
            if self._prompt_format == "auto" and kind == "levanter":
                self._prompt_format = "text"
            logger.info(
                "openai backend: server %s is %s; prompts sent as %s",
                self.base_url,
                kind,
                "text" if self._prompt_format == "text" else "token ids",
            )
        return self._server_kind

    def served_policy_step(self) -> int | None:
        """Ask `GET /v1/models` which policy step the server serves (from the model names); None if unsaid.

        When several served models advertise steps, the one named `config.openai_model` wins, else the
        newest step.
        """
        try:
            r = self._client.get(f"{self.base_url}/models", timeout=30.0)
        except httpx.HTTPError as e:
            raise OpenAIBackendError(f"GET {self.base_url}/models failed: {e}") from e
        header = r.headers.get(POLICY_STEP_HEADER)
        if header is not None:
            return int(header)
        if r.status_code != 200:
            return None
        steps: dict[str, int] = {}
        for m in r.json().get("data", []):
            s = policy_step_from_model_name(str(m.get("id", "")))
            if s is not None:
                steps[str(m.get("id"))] = s
        if not steps:
            return None
        if self.config.openai_model in steps:
            return steps[self.config.openai_model]
        return max(steps.values())

    # ------------------------------------------------------------------------------------------
    # generation
    # ------------------------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> list[list[Completion]]:
        """`n` completions per prompt, as token ids and per-token logprobs, in prompt order.

        Raises PromptTooLongError / PromptRoundTripError before sending anything, OpenAIBackendError on
        a refused request and OpenAIResponseError on an unusable answer.
        """
        n, temperature, max_tokens, seed = request.n, request.temperature, request.max_tokens, request.seed
        stop_tokens = request.stop_tokens
        ids_list: list[list[int]] = [[int(t) for t in p] for p in request.prompts]
        for i, p in enumerate(ids_list):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if self.max_seq_len is not None and len(p) >= self.max_seq_len:
                raise PromptTooLongError(i, len(p), self.max_seq_len)
        if not ids_list:
            return []
        self.server_kind  # noqa: B018 - resolves the prompt format once
        stops = list(stop_tokens) if stop_tokens is not None else [int(self.tokenizer.eos_token_id)]
        # One entry per (prompt, sample) with n=1 on levanter (its n>1 leaks KV pages); else n per prompt.
        per_entry_n = 1 if self._server_kind == "levanter" else n
        entries = [(i, p) for i, p in enumerate(ids_list) for _ in range(n // per_entry_n)]

        def budget(p: list[int]) -> int:
            return max_tokens if self.max_seq_len is None else min(max_tokens, self.max_seq_len - len(p))

        # Requests take one max_tokens each: chunk entries of equal budget, at most max_seqs sequences each.
        by_budget: dict[int, list[tuple[int, list[int]]]] = {}
        for e in entries:
            by_budget.setdefault(budget(e[1]), []).append(e)
        max_entries = max(1, self.config.max_seqs // per_entry_n)
        chunks = [
            (b, group[k : k + max_entries]) for b, group in by_budget.items() for k in range(0, len(group), max_entries)
        ]
        jobs = [
            self._pool.submit(
                self._complete_chunk,
                _Chunk([p for _, p in chunk], per_entry_n, temperature, b, stops, seed + 7919 * ci, request.controls),
            )
            for ci, (b, chunk) in enumerate(chunks)
        ]
        out: list[list[Completion]] = [[] for _ in ids_list]
        steps: set[int] = set()
        for job, (_, chunk) in zip(jobs, chunks, strict=True):
            completions, step = job.result()
            for k, (i, _) in enumerate(chunk):
                out[i].extend(completions[k * per_entry_n : (k + 1) * per_entry_n])
            if step is not None:
                steps.add(step)
        self._record_served(steps)
        for i, comps in enumerate(out):
            if len(comps) != n:
                raise OpenAIResponseError(f"{self._completions_url}: prompt {i} got {len(comps)} of {n} completions")
        return out

    def _record_served(self, steps: set[int]) -> None:
        """Remember the policy steps the server reported for the last call (the newest is `served_step`)."""
        with self._lock:
            self.last_served_steps = steps
            if steps:
                self.served_step = max(steps)

    def chat(self, request: ChatRequest) -> list[ChatTurn]:
        """The next assistant turn of each conversation through `/v1/chat/completions`, in order, with the exact
        prompt ids, sampled ids and logprobs (`policy.inference.openai_chat`). Raises OpenAIBackendError on a
        refused request and OpenAIResponseError on an answer without exact ids or logprobs."""
        from policy.inference.openai_chat import chat_body, chat_budget

        stops = list(request.stop_tokens) if request.stop_tokens is not None else [int(self.tokenizer.eos_token_id)]
        requests = [
            chat_budget(self.tokenizer, self.max_seq_len, k, conv, request)
            for k, conv in enumerate(request.conversations)
        ]
        jobs = [
            self._pool.submit(
                self._chat_one,
                chat_body(self.config.openai_model, conv, req, stops, request.seed + 7919 * k, request.controls),
                conv,
                req,
                stops,
            )
            for k, (conv, req) in enumerate(zip(request.conversations, requests, strict=True))
        ]
        turns: list[ChatTurn] = []
        steps: set[int] = set()
        for job in jobs:
            turn, step = job.result()
            turns.append(turn)
            if step is not None:
                steps.add(step)
        self._record_served(steps)
        return turns

    def _chat_one(
        self, body: dict[str, Any], conv: Any, request: ChatRequest, stops: list[int]
    ) -> tuple[ChatTurn, int | None]:
        from policy.inference.openai_chat import chat_completion, chat_prompt_ids, chat_turn

        r = self._post(body, self._chat_url)
        if r.status_code != 200:
            raise OpenAIBackendError(f"POST {self._chat_url} -> {r.status_code}: {r.text[:500]}")
        payload = r.json()
        choices = payload.get("choices") or []
        if len(choices) != 1:
            raise OpenAIResponseError(f"{self._chat_url}: asked for 1 choice, got {len(choices)}")
        choice = choices[0]
        content = (choice.get("logprobs") or {}).get("content")
        ids = self._token_ids(choice, None if content is None else [c.get("token") for c in content])
        completion = chat_completion(choice, ids, request.max_tokens, stops)
        prompt = chat_prompt_ids(payload, choice, conv, request, self.tokenizer)
        for what, got in (("completion", completion), ("prompt", prompt)):
            if isinstance(got, str):
                raise OpenAIResponseError(f"{self._chat_url}: {what}: {got}")
        header = r.headers.get(POLICY_STEP_HEADER)
        step = int(header) if header is not None else policy_step_from_model_name(payload.get("model"))
        return chat_turn(prompt, completion, choice), step  # type: ignore[arg-type]

    def _prompt_payload(self, entries: list[list[int]]) -> list[Any]:
        if self._prompt_format != "text":
            return entries
        texts = []
        for ids in entries:
            text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            back = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if list(back) != ids:
                raise PromptRoundTripError(
                    f"server {self.base_url} takes text prompts only, and prompt ids {ids[:16]}... do not survive "
                    f"decode/encode (got {list(back)[:16]}...); use a server that accepts token-id prompts"
                )
            texts.append(text)
        return texts

    def _body(self, chunk: _Chunk) -> dict[str, Any]:
        entries, stops, controls = chunk.entries, chunk.stops, chunk.controls
        body: dict[str, Any] = {
            "model": self.config.openai_model,
            "prompt": self._prompt_payload(entries),
            "n": chunk.n,
            "temperature": chunk.temperature,
            "max_tokens": chunk.max_tokens,
            "seed": chunk.seed,
            "logprobs": 1,
            "echo": False,
            # vLLM extensions (ignored by servers that do not know them):
            "stop_token_ids": stops,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if not controls.is_default:
            if self._server_kind == "levanter":
                raise ValueError(f"{self.base_url}: levanter's server has no top-p/top-k/min-p ({controls})")
            # OpenAI's top_p; vLLM and SGLang extensions top_k (-1: off) and min_p
            body.update(top_p=controls.top_p, top_k=controls.top_k or -1, min_p=controls.min_p)
        if len(stops) == 1:
            # Text servers (levanter) tokenise `stop` strings and treat their ids as one sequence: only a
            # single stop token can be expressed that way; the client-side cut handles the rest.
            body["stop"] = [self.tokenizer.convert_ids_to_tokens(stops[0])]
        return body

    def _post(self, body: dict[str, Any], url: str | None = None) -> httpx.Response:
        url = url or self._completions_url
        delay = 0.5
        for attempt in range(self._max_retries + 1):
            try:
                r = self._client.post(url, json=body)
            except (httpx.TransportError, httpx.TimeoutException) as e:
                if attempt == self._max_retries:
                    raise OpenAIBackendError(f"POST {url} failed: {type(e).__name__}: {e}") from e
                logger.warning("POST %s failed (%s); retry %d in %.1fs", url, e, attempt + 1, delay)
            else:
                if r.status_code < 500 or attempt == self._max_retries:
                    return r
                logger.warning("POST %s answered %d; retry %d in %.1fs", url, r.status_code, attempt + 1, delay)
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def _complete_chunk(self, chunk: _Chunk) -> tuple[list[Completion], int | None]:
        entries, n = chunk.entries, chunk.n
        r = self._post(self._body(chunk))
        if r.status_code == 422 and self._prompt_format == "auto" and "prompt" in r.text:
            logger.warning(
                "server %s refused token-id prompts (422); sending verified text prompts from now on", self.base_url
            )
            self._prompt_format = "text"
            r = self._post(self._body(chunk))
        if r.status_code != 200:
            raise OpenAIBackendError(f"POST {self._completions_url} -> {r.status_code}: {r.text[:500]}")
        payload = r.json()
        self._check_prompts(payload, entries)
        header = r.headers.get(POLICY_STEP_HEADER)
        step = int(header) if header is not None else policy_step_from_model_name(payload.get("model"))
        choices = sorted(payload.get("choices") or [], key=lambda c: int(c.get("index", 0)))
        if len(choices) != len(entries) * n:
            raise OpenAIResponseError(
                f"{self._completions_url}: asked for {len(entries) * n} choices, got {len(choices)}"
            )
        return [self._parse_choice(c, chunk.max_tokens, chunk.stops) for c in choices], step

    def _check_prompts(self, payload: dict[str, Any], entries: list[list[int]]) -> None:
        """The server saw exactly the prompt ids sent: `prompt_token_ids` per choice (vLLM) or the prompt token
        count in `usage` (servers that tokenise text prompts); OpenAIResponseError otherwise."""
        for c in payload.get("choices") or []:
            got = c.get("prompt_token_ids")
            if got is not None and [int(t) for t in got] not in entries:
                raise OpenAIResponseError(f"{self._completions_url}: server prompt ids {got[:16]} were not sent")
        usage = payload.get("usage") or {}
        if self._prompt_format == "text" and usage.get("prompt_tokens") is not None:
            sent = sum(len(e) for e in entries)
            if int(usage["prompt_tokens"]) != sent:
                raise OpenAIResponseError(
                    f"{self._completions_url}: server counted {usage['prompt_tokens']} prompt tokens, sent {sent}"
                )

    def _token_ids(self, choice: dict[str, Any], tokens: list[Any] | None) -> list[int]:
        if choice.get("token_ids") is not None:
            return [int(t) for t in choice["token_ids"]]
        if tokens is None:
            raise OpenAIResponseError(f"{self._completions_url}: choice without token_ids or logprobs.tokens")
        ids: list[int] = []
        for tok in tokens:
            m = _TOKEN_ID_STR.match(str(tok))
            if m:
                ids.append(int(m.group(1)))
                continue
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if tid is None or self.tokenizer.convert_ids_to_tokens(tid) != tok:
                raise OpenAIResponseError(
                    f"{self._completions_url}: token string {tok!r} is not a vocabulary entry of the tokenizer"
                )
            ids.append(int(tid))
        if any(t < 0 for t in ids):
            raise OpenAIResponseError(f"{self._completions_url}: negative token id in {ids[:16]}")
        return ids

    def _parse_choice(self, choice: dict[str, Any], max_tokens: int, stops: list[int]) -> Completion:
        lp = choice.get("logprobs") or {}
        token_logprobs = lp.get("token_logprobs")
        ids = self._token_ids(choice, lp.get("tokens"))
        if (
            token_logprobs is None
            or len(token_logprobs) < len(ids)
            or any(x is None for x in token_logprobs[: len(ids)])
        ):
            raise OpenAIResponseError(
                f"{self._completions_url}: choice {choice.get('index')} has {len(ids)} tokens but logprobs "
                f"{None if token_logprobs is None else len(token_logprobs)}"
            )
        logprobs = [float(x) for x in token_logprobs[: len(ids)]]
        ids, logprobs, stopped = truncate_at_stop(ids, logprobs, stops)
        server_reason = str(choice.get("finish_reason") or "")
        if stopped:
            reason = "stop"
        elif len(ids) >= max_tokens or server_reason == "length":
            reason = "length"
        elif server_reason == "stop":
            reason = "stop"  # a stop string the server matched that is not one of our stop ids
        else:
            raise OpenAIResponseError(f"{self._completions_url}: unexpected finish_reason {server_reason!r}")
        return Completion(tokens=ids, logprobs=logprobs, finish_reason=reason)
