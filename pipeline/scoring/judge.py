"""An LLM judge over any OpenAI-compatible endpoint (vLLM, SGLang, levanter's InferenceServer, a hosted API, a
policy of this run served by a rollout worker's endpoint).

For each request the judge renders `prompt` (a template over `{prompt}`, `{response}` and `{answer}`, the reference
answer), sends it to `<base_url>/chat/completions` (`chat: true`, with `system_prompt` when set) or
`<base_url>/completions`, and turns the reply into a score by `rule`:

- `number` (default): the first match of `score_pattern` (its first group, else the whole match) read as a number,
  which must lie in `score_range` [lo, hi] and is mapped to [0, 1] (`normalize`, default true).
- `label`: the match, lower-cased and stripped, looked up in `labels` (label -> value), e.g. `{yes: 1, no: 0}`.
- `match`: 1.0 when `score_pattern` occurs in the reply, else 0.0 (verifiers' JudgeRubric style: "the judge
  said yes"). Never unparsable.

Requests run concurrently, at most `max_concurrency` at a time; each has `timeout_s` and is retried
`max_retries` times after a transport failure (connection refused or reset, timeout, HTTP 429 or 5xx), waiting
`retry_backoff_s` doubled each time. A request that still fails, an HTTP 4xx, a reply that is not an OpenAI
completion, or a reply the rule cannot parse is a failure with its reason (never a silent 0). The bearer token
is `api_key`, or the environment variable named by `api_key_env`.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from pipeline.scoring.base import (
    ScoreOutcome,
    Scorer,
    ScorerConfigError,
    ScoreRequest,
    failed,
    require_keys,
)

logger = logging.getLogger(__name__)

RULES = ("number", "label", "match")
DEFAULT_PROMPT = (
    "Rate the response to the task from 0 to 10.\nTask: {prompt}\nReference answer: {answer}\n"
    "Response: {response}\nReply with the rating as <score>N</score>."
)
DEFAULT_PATTERN = r"<score>\s*([-+]?\d+(?:\.\d+)?)\s*</score>"
_FIELDS = (
    "type",
    "name",
    "weight",
    "base_url",
    "model",
    "prompt",
    "system_prompt",
    "chat",
    "rule",
    "score_pattern",
    "labels",
    "score_range",
    "normalize",
    "max_tokens",
    "temperature",
    "timeout_s",
    "max_retries",
    "retry_backoff_s",
    "max_concurrency",
    "api_key",
    "api_key_env",
    "extra_body",
)


@dataclass(frozen=True)
class JudgeSpec:
    """A judge's settings (the module docstring says what each does)."""

    base_url: str
    model: str = "judge"
    prompt: str = DEFAULT_PROMPT
    system_prompt: str | None = None
    chat: bool = True
    rule: str = "number"
    score_pattern: str = DEFAULT_PATTERN
    labels: Mapping[str, float] | None = None
    score_range: tuple[float, float] = (0.0, 10.0)
    normalize: bool = True
    max_tokens: int = 64
    temperature: float = 0.0
    timeout_s: float = 30.0
    max_retries: int = 2
    retry_backoff_s: float = 0.5
    max_concurrency: int = 8
    api_key: str | None = None
    api_key_env: str | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)


def _number(spec: Mapping[str, Any], key: str, default: float, *, low: float, integer: bool = False) -> Any:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise ScorerConfigError(key, value, f"must be a {'whole ' if integer else ''}number >= {low:g}")
    if integer and int(value) != value:
        raise ScorerConfigError(key, value, "must be a whole number")
    return int(value) if integer else float(value)


def judge_spec(spec: Mapping[str, Any]) -> JudgeSpec:
    """The `JudgeSpec` of a scorer mapping; raises ScorerConfigError naming the field and the cause."""
    require_keys(spec, _FIELDS, "judge")
    base_url = spec.get("base_url")
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ScorerConfigError("base_url", base_url, "must be the http(s) URL of an OpenAI-compatible API (…/v1)")
    rule = spec.get("rule", "number")
    if rule not in RULES:
        raise ScorerConfigError("rule", rule, f"must be one of {RULES}")
    pattern = spec.get("score_pattern", DEFAULT_PATTERN)
    try:
        re.compile(str(pattern))
    except re.error as e:
        raise ScorerConfigError("score_pattern", pattern, f"is not a regular expression: {e}") from None
    labels = spec.get("labels")
    if rule == "label":
        if not isinstance(labels, Mapping) or not labels:
            raise ScorerConfigError("labels", labels, "rule 'label' needs a non-empty mapping label -> value")
        for k, v in labels.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ScorerConfigError(f"labels.{k}", v, "must be a finite number")
        labels = {str(k).strip().lower(): float(v) for k, v in labels.items()}
    score_range = spec.get("score_range", (0.0, 10.0))
    if (
        not isinstance(score_range, (list, tuple))
        or len(score_range) != 2
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in score_range)
        or not score_range[0] < score_range[1]
    ):
        raise ScorerConfigError("score_range", score_range, "must be [low, high] with low < high")
    prompt = spec.get("prompt", DEFAULT_PROMPT)
    if not isinstance(prompt, str) or not prompt:
        raise ScorerConfigError("prompt", prompt, "must be a non-empty template string")
    try:
        prompt.format_map({"prompt": "", "response": "", "answer": ""})
    except (KeyError, IndexError, ValueError) as e:
        raise ScorerConfigError(
            "prompt",
            prompt,
            f"template error ({type(e).__name__}: {e}); use {{prompt}}, {{response}}, {{answer}}"
            " and double other braces",
        ) from None
    api_key_env = spec.get("api_key_env")
    if api_key_env is not None and not isinstance(api_key_env, str):
        raise ScorerConfigError("api_key_env", api_key_env, "must name an environment variable")
    extra = spec.get("extra_body", {})
    if not isinstance(extra, Mapping):
        raise ScorerConfigError("extra_body", extra, "must be a mapping of extra request fields")
    return JudgeSpec(
        base_url=base_url.rstrip("/"),
        model=str(spec.get("model", "judge")),
        prompt=prompt,
        system_prompt=spec.get("system_prompt"),
        chat=bool(spec.get("chat", True)),
        rule=str(rule),
        score_pattern=str(pattern),
        labels=labels if rule == "label" else None,
        score_range=(float(score_range[0]), float(score_range[1])),
        normalize=bool(spec.get("normalize", True)),
        max_tokens=_number(spec, "max_tokens", 64, low=1, integer=True),
        temperature=_number(spec, "temperature", 0.0, low=0.0),
        timeout_s=_number(spec, "timeout_s", 30.0, low=0.001),
        max_retries=_number(spec, "max_retries", 2, low=0, integer=True),
        retry_backoff_s=_number(spec, "retry_backoff_s", 0.5, low=0.0),
        max_concurrency=_number(spec, "max_concurrency", 8, low=1, integer=True),
        api_key=spec.get("api_key"),
        api_key_env=api_key_env,
        extra_body=dict(extra),
    )


class _Retryable(Exception):
    """A transport failure worth another attempt."""


def parse_score(spec: JudgeSpec, reply: str) -> tuple[float | None, str | None, str | None]:
    """(value, extracted text, failure reason) of a judge reply under `spec.rule` (see the module docstring)."""
    m = re.search(spec.score_pattern, reply)
    if spec.rule == "match":
        return (1.0 if m else 0.0), (m.group(0) if m else None), None
    if m is None:
        return None, None, f"judge reply has no match of score_pattern {spec.score_pattern!r}: {reply[:120]!r}"
    text = m.group(1) if m.re.groups else m.group(0)
    if spec.rule == "label":
        assert spec.labels is not None
        key = text.strip().lower()
        if key not in spec.labels:
            return None, text, f"judge label {key!r} is not one of {sorted(spec.labels)}"
        return spec.labels[key], text, None
    try:
        x = float(text)
    except ValueError:
        return None, text, f"judge score {text!r} is not a number"
    lo, hi = spec.score_range
    if not (math.isfinite(x) and lo <= x <= hi):
        return None, text, f"judge score {x:g} is outside score_range [{lo:g}, {hi:g}]"
    return ((x - lo) / (hi - lo) if spec.normalize else x), text, None


class JudgeScorer(Scorer):
    """An LLM judge (see the module docstring). Thread-safe; `close` releases its connections."""

    kind = "judge"

    def __init__(self, spec: JudgeSpec, name: str = "judge") -> None:
        self.spec = spec
        self.name = name
        key = spec.api_key or (os.environ.get(spec.api_key_env) if spec.api_key_env else None)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=spec.max_concurrency, max_keepalive_connections=spec.max_concurrency)
        self._client = httpx.Client(timeout=spec.timeout_s, headers=headers, limits=limits)
        self._pool = ThreadPoolExecutor(max_workers=spec.max_concurrency, thread_name_prefix=f"judge-{name}")

    def render(self, req: ScoreRequest) -> str:
        """The judge prompt of one request."""
        return self.spec.prompt.format_map({"prompt": req.prompt, "response": req.response, "answer": req.ground_truth})

    def _body(self, text: str) -> tuple[str, dict[str, Any]]:
        s = self.spec
        body: dict[str, Any] = {"model": s.model, "max_tokens": s.max_tokens, "temperature": s.temperature}
        if s.chat:
            messages = [{"role": "system", "content": s.system_prompt}] if s.system_prompt else []
            messages.append({"role": "user", "content": text})
            body["messages"] = messages
            route = "/chat/completions"
        else:
            body["prompt"] = text
            route = "/completions"
        body.update(s.extra_body)
        return f"{s.base_url}{route}", body

    def _ask(self, url: str, body: dict[str, Any]) -> str:
        """The reply text of one attempt. Raises _Retryable (transport) or ValueError (a final answer)."""
        try:
            r = self._client.post(url, json=body)
        except httpx.TimeoutException as e:
            raise _Retryable(f"timed out after {self.spec.timeout_s:g}s ({type(e).__name__})") from e
        except httpx.TransportError as e:
            raise _Retryable(f"{type(e).__name__}: {' '.join(str(e).split()) or 'connection failed'}") from e
        if r.status_code == 429 or r.status_code >= 500:
            raise _Retryable(f"HTTP {r.status_code}: {' '.join(r.text.split())[:200]}")
        if r.status_code >= 400:
            raise ValueError(f"judge answered HTTP {r.status_code}: {' '.join(r.text.split())[:200]}")
        try:
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if self.spec.chat else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"judge reply is not an OpenAI completion ({type(e).__name__}: {e})") from None
        if not isinstance(text, str):
            raise ValueError(f"judge reply content is {type(text).__name__}, not text")
        return text

    def _one(self, req: ScoreRequest) -> ScoreOutcome:
        t0 = time.monotonic()
        try:
            url, body = self._body(self.render(req))
        except Exception as e:  # a template that cannot take this example's text
            return failed(f"judge prompt cannot be rendered: {type(e).__name__}: {e}")
        delay = self.spec.retry_backoff_s
        last = ""
        for attempt in range(self.spec.max_retries + 1):
            try:
                reply = self._ask(url, body)
            except _Retryable as e:
                last = str(e)
                if attempt < self.spec.max_retries:
                    time.sleep(delay)
                    delay *= 2
                continue
            except ValueError as e:
                return failed(str(e), time.monotonic() - t0)
            value, extracted, reason = parse_score(self.spec, reply)
            latency = time.monotonic() - t0
            if reason is not None:
                return failed(reason, latency, raw=reply)
            return ScoreOutcome(value, latency_s=latency, extracted=extracted, raw=reply)
        attempts = self.spec.max_retries + 1
        return failed(f"judge {self.spec.base_url} failed after {attempts} attempt(s): {last}", time.monotonic() - t0)

    def score_batch(self, requests: Sequence[ScoreRequest]) -> list[ScoreOutcome]:
        """Score every request, at most `max_concurrency` in flight; one outcome per request, in order."""
        if not requests:
            return []
        return list(self._pool.map(self._one, requests))

    def close(self) -> None:
        """Stop the request threads and close the connections."""
        self._pool.shutdown(wait=True)
        self._client.close()
