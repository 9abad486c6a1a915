"""The generate endpoint's routes and request parsing (pipeline/environments/endpoint/routes.py, parsing.py,
errors.py), over a scripted sampler: no JAX, no model.

Checked: every request field is validated by the parser with a 400 naming the field, over real HTTP as a client
sees it; the parser's rules one by one (stop tokens as vLLM sets them, prompts encoded once with or without BOS,
text content parts, the prompt limit); routing: the root and an episode's prefix, 404 for an unknown route or
episode, 405 for another method, the bearer token checked before anything else; answers carry what the sampler
returned and the policy step.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pipeline.environments.endpoint import EndpointError, GenerateEndpoint
from pipeline.environments.endpoint.errors import error_body
from pipeline.environments.endpoint.parsing import (
    check_prompt,
    completion_prompt,
    json_object,
    max_new_tokens,
    messages,
    sampling_settings,
    stop_tokens,
)
from pipeline.environments.generation import SamplingControls
from pipeline.environments.scripted import ScriptedContext
from pipeline.environments.tokenizer import load_tokenizer

MAX_SEQ_LEN = 32
STEP = 4


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("builtin:tiny")


class Ctx(ScriptedContext):
    policy_step = STEP


@pytest.fixture
def ctx(tok: Any) -> Ctx:
    return Ctx(tok, ["the cat"], logprob=-0.25)


@pytest.fixture
def endpoint(ctx: Ctx) -> Iterator[GenerateEndpoint]:
    with GenerateEndpoint(ctx, max_seq_len=MAX_SEQ_LEN, max_tokens=8) as ep:
        yield ep


def _post(ep: GenerateEndpoint, path: str, body: Any, **headers: str) -> tuple[int, dict[str, Any]]:
    """Through `handle`, the function the HTTP handler calls (no socket)."""
    return ep.handle("POST", path, {k.lower(): v for k, v in headers.items()}, json.dumps(body).encode())


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"model": "m"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
            "temperature",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": "x"}, "tools"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}, "stream"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": ["\n"]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "return_token_ids": "yes"}, "return_token_ids"),
        ("/inference/v1/generate", {"token_ids": []}, "token_ids"),
        ("/inference/v1/generate", {"token_ids": [1, 99999]}, "token_ids"),
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2], "sampling_params": {"top_p": 2.0}},
            "sampling_params.top_p/top_k/min_p",
        ),
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": []}, "sampling_params"),
        ("/inference/v1/generate", "not json", "body"),
        ("/inference/v1/generate", [1, 2], "body"),
    ],
)
def test_malformed_requests_get_400_naming_the_field(
    endpoint: GenerateEndpoint, ctx: Ctx, path: str, body: Any, field: str
) -> None:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(endpoint.base_url + path, timeout=30, **kwargs)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field) and err["type"] == "invalid_request_error"
    assert ctx.calls == []  # refused before the sampler
    assert httpx.post(endpoint.base_url + "/v1/nope", json={}, timeout=30).status_code == 404


def test_routes_answer_with_the_samplers_output_and_capture_under_an_episode(
    endpoint: GenerateEndpoint, ctx: Ctx, tok: Any
) -> None:
    cap = endpoint.open_episode("e1")
    status, gen = _post(endpoint, "/episodes/e1/inference/v1/generate", {"token_ids": [1, 40, 41]})
    assert status == 200 and gen["policy_step"] == STEP and gen["prompt_token_ids"] == [1, 40, 41]
    sampled = [*tok.encode("the cat"), tok.eos_token_id]
    [choice] = gen["choices"]
    assert choice["token_ids"] == sampled and choice["finish_reason"] == "stop"
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-0.25] * len(sampled)
    status, done = _post(endpoint, "/v1/completions", {"prompt": "a cat", "n": 2, "return_token_ids": True})
    assert status == 200 and [c["text"] for c in done["choices"]] == ["the cat"] * 2  # the stop token not in text
    assert done["choices"][0]["prompt_token_ids"] == [1, *tok.encode("a cat")]
    assert done["usage"] == {"prompt_tokens": 3, "completion_tokens": 2 * len(sampled), "total_tokens": 3 + 6}
    status, chat = _post(
        endpoint, "/episodes/e1/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 200 and chat["choices"][0]["message"]["content"] == "the cat"
    calls = cap.close()
    assert [c.route for c in calls] == ["generate", "chat"]  # the root call is not this episode's
    assert calls[0].prompt_ids == [1, 40, 41] and calls[0].completion_ids == sampled
    assert {c.policy_step for c in calls} == {STEP}
    assert endpoint.requests_served == 3
    status, body = _post(endpoint, "/episodes/e1/v1/completions", {"prompt": "x"})
    assert status == 404 and body["error"]["param"] == "episode_id"


def test_routing_refusals(endpoint: GenerateEndpoint, ctx: Ctx) -> None:
    assert endpoint.handle("GET", "/v1/models", {}, b"")[1]["data"][0]["max_model_len"] == MAX_SEQ_LEN
    assert endpoint.handle("GET", "/health?x=1", {}, b"") == (200, {"status": "ok"})
    assert endpoint.handle("GET", "/nope", {}, b"")[0] == 404
    assert _post(endpoint, "/v1/nope", {})[0] == 404
    assert endpoint.handle("PUT", "/v1/completions", {}, b"{}")[0] == 405
    assert _post(endpoint, "/episodes/nobody/v1/completions", {"prompt": "x"})[0] == 404
    assert ctx.calls == [] and endpoint.requests_served == 0


def test_the_token_is_checked_before_the_route(ctx: Ctx) -> None:
    ep = GenerateEndpoint(ctx, max_seq_len=MAX_SEQ_LEN, token="s3cret")  # not started: nothing is sampled here
    for path in ("/nope", "/episodes/nobody/v1/models", "/v1/models"):
        status, body = ep.handle("GET", path, {"authorization": "Bearer wrong"}, b"")
        assert status == 401 and body["error"]["type"] == "authentication_error"
    assert ep.handle("GET", "/v1/models", {"authorization": "Bearer s3cret"}, b"")[0] == 200


def test_parser_rules(tok: Any) -> None:
    assert sampling_settings({}).n == 1 and sampling_settings({}).controls == SamplingControls()
    got = sampling_settings({"n": 3, "temperature": 0, "top_k": -1, "top_p": 0.5, "seed": 9})
    assert (got.n, got.temperature, got.controls, got.seed) == (3, 0.0, SamplingControls(top_p=0.5), 9)
    for bad in ({"seed": True}, {"n": 1.5}, {"temperature": float("nan")}, {"min_p": -1}):
        with pytest.raises(EndpointError) as e:
            sampling_settings(bad, "sp.")
        assert e.value.status == 400 and e.value.param is not None and e.value.param.startswith("sp.")
    eos = tok.eos_token_id
    assert stop_tokens({}, tok) == [eos]
    assert stop_tokens({"stop_token_ids": [7, 5], "stop": []}, tok) == sorted({eos, 5, 7})
    assert stop_tokens({"stop_token_ids": [7], "ignore_eos": True}, tok) == [7]
    assert completion_prompt(tok, "a cat", True) == [1, *tok.encode("a cat")]
    assert completion_prompt(tok, ["a cat"], False) == tok.encode("a cat")  # a batch of one, no BOS
    assert completion_prompt(tok, [5, 6], True) == [5, 6]
    assert max_new_tokens({"max_completion_tokens": 3, "max_tokens": 9}, "", "max_completion_tokens", "max_tokens") == 3
    assert max_new_tokens({}) is None
    parts = [{"type": "text", "text": "a "}, {"type": "text", "text": "cat"}]
    assert messages([{"role": "user", "content": parts}]) == [{"role": "user", "content": "a cat"}]
    with pytest.raises(EndpointError, match=r"messages\[0\]\.content\[1\]"):
        messages([{"role": "user", "content": [parts[0], {"type": "image_url", "image_url": "x"}]}])
    assert json_object(b'{"a": 1}') == {"a": 1}
    assert check_prompt([1, 2], max_seq_len=3, tokenizer=tok) == [1, 2]
    with pytest.raises(EndpointError, match="max_seq_len=3 leaves no room"):
        check_prompt([1, 2, 3], max_seq_len=3, tokenizer=tok, param="token_ids")
    with pytest.raises(EndpointError, match=r"outside the vocabulary \[0, 512\)"):
        check_prompt([1, 512], max_seq_len=8, tokenizer=tok)
    assert error_body(EndpointError(404, "gone", "episode_id")) == {
        "error": {"message": "gone", "type": "not_found_error", "param": "episode_id", "code": 404}
    }
