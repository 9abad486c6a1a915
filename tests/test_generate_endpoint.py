"""The generate endpoint (pipeline/environments/endpoint/) end to end, over the real in-process sampler (dense
backend, tiny Llama, CPU), answering real clients: the `openai` SDK (completions and chat) and verifiers 0.4.0's own
training client (`TrainClient`, which calls `/inference/v1/generate`).

Checked: the ids and logprobs a client gets, and those the endpoint captures for an episode, are exactly what the
sampler returned for that call (`Recorder` keeps the backend's own output); a chat prompt is the tokenizer's chat
template rendering; every response carries the policy step; a prompt longer than max_seq_len gets a 400 and the
endpoint keeps serving; a non-loopback bind refuses requests without its token (401); a flood of 32 concurrent
requests is answered in full, batched into fewer sampler calls. Each part alone, without a model:
test_endpoint_routes.py (routes, request parsing: malformed requests get 400 naming the field),
test_endpoint_batcher.py, test_endpoint_capture.py; the server's load bounds: test_ports.py.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jax
import openai
import pytest

from pipeline.config import DenseInferenceConfig, ModelSpec
from pipeline.environments.base import Completion, encode_prompt
from pipeline.environments.endpoint import GenerateEndpoint
from pipeline.environments.generation import GenerationRequest
from pipeline.environments.tokenizer import load_tokenizer, render_chat, save_tiny_tokenizer
from policy.inference import BackendContext, make_backend
from policy.model import build_model

VOCAB = 512
MAX_SEQ_LEN = 64
SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=MAX_SEQ_LEN)
STEP = 3


class Recorder:
    """The real sampler's context, keeping each call's prompts and exactly what the backend returned."""

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.tokenizer = ctx.tokenizer
        self.policy_step = STEP
        self.log: list[tuple[list[int], Completion]] = []
        self.calls = 0
        self._lock = threading.Lock()

    def generate(self, request: GenerationRequest) -> list[list[Completion]]:
        out = self.ctx.generate(request)
        with self._lock:
            self.calls += 1
            self.log += [(list(p), c) for p, comps in zip(request.prompts, out, strict=True) for c in comps]
        return out

    def find(self, prompt: list[int], ids: list[int]) -> Completion:
        """The sampler's own record of the completion `ids` of `prompt` (fails the test when there is none)."""
        hits = [c for p, c in self.log if p == prompt and c.tokens == ids]
        assert hits, f"the sampler never produced {ids} for prompt {prompt}"
        return hits[0]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("builtin:tiny")


@pytest.fixture(scope="module")
def backend(tok: Any) -> Iterator[Any]:
    model = build_model(SPEC, VOCAB, key=jax.random.PRNGKey(0))
    b = make_backend(DenseInferenceConfig(max_seqs=32), model, tok, MAX_SEQ_LEN, fast_compile=True)
    yield b
    b.shutdown()


@pytest.fixture
def rec(backend: Any, tok: Any) -> Recorder:
    return Recorder(BackendContext(tok, backend))


@pytest.fixture
def endpoint(rec: Recorder) -> Iterator[GenerateEndpoint]:
    with GenerateEndpoint(rec, max_seq_len=MAX_SEQ_LEN, max_tokens=12) as ep:
        yield ep


def test_openai_sdk_gets_the_samplers_exact_ids_and_logprobs(endpoint: GenerateEndpoint, rec: Recorder, tok) -> None:
    cap = endpoint.open_episode("ep-1")
    client = openai.OpenAI(base_url=cap.openai_base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Tell me about cats."}]
    chat = client.chat.completions.create(
        model="policy", messages=messages, logprobs=True, temperature=1.0, extra_body={"return_token_ids": True}
    )
    raw = chat.model_dump()
    prompt = render_chat(tok, messages)
    assert raw["prompt_token_ids"] == prompt
    ids = raw["choices"][0]["token_ids"]
    sampled = rec.find(prompt, ids)
    assert [e["logprob"] for e in raw["choices"][0]["logprobs"]["content"]] == sampled.logprobs
    assert raw["policy_step"] == STEP and 1 <= len(ids) <= 12

    done = client.completions.create(
        model="policy", prompt="The cat", max_tokens=5, logprobs=1, extra_body={"return_token_ids": True}
    )
    choice = done.model_dump()["choices"][0]
    prompt2 = encode_prompt(tok, "The cat")
    assert choice["prompt_token_ids"] == prompt2
    sampled2 = rec.find(prompt2, choice["token_ids"])
    assert choice["logprobs"]["token_logprobs"] == sampled2.logprobs and len(sampled2.tokens) <= 5

    calls = cap.close()
    assert [(c.prompt_ids, c.completion_ids, c.logprobs) for c in calls] == [
        (prompt, sampled.tokens, sampled.logprobs),
        (prompt2, sampled2.tokens, sampled2.logprobs),
    ]
    assert {c.policy_step for c in calls} == {STEP}
    # a closed episode captures nothing more: its prefix is gone
    with pytest.raises(openai.NotFoundError, match="not open"):
        client.completions.create(model="policy", prompt="x")


def test_verifiers_training_client_through_inference_generate(
    endpoint: GenerateEndpoint, rec: Recorder, tok, tmp_path
) -> None:
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import SamplingConfig

    tokenizer_dir = save_tiny_tokenizer(tmp_path / "tok")
    cap = endpoint.open_episode("vf")
    os.environ["RLPIPE_TEST_KEY"] = "unused"
    client = TrainClient(
        TrainClientConfig(
            base_url=cap.openai_base_url, api_key_var="RLPIPE_TEST_KEY", renderer_model_name=tokenizer_dir
        )
    )
    messages = [{"role": "user", "content": "Say cat."}]

    async def ask() -> Any:
        try:
            body = {"model": "rlpipe-policy", "messages": messages}
            return await client.get_response(ChatDialect(), body, SamplingConfig(temperature=1.0, max_tokens=8))
        finally:
            await client.close()

    response = asyncio.run(ask())
    tokens = response.tokens
    sampled = rec.find(tokens.prompt_ids, tokens.completion_ids)
    assert tokens.completion_logprobs == sampled.logprobs
    assert tokens.prompt_ids == render_chat(tok, messages)  # verifiers' renderer, our template: the same ids
    [call] = cap.close()
    assert (call.prompt_ids, call.completion_ids, call.logprobs) == (
        tokens.prompt_ids,
        sampled.tokens,
        sampled.logprobs,
    )
    assert call.route == "generate" and call.policy_step == STEP


def test_too_long_prompt_is_a_clear_400_and_the_endpoint_keeps_serving(endpoint: GenerateEndpoint) -> None:
    client = openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_seq_len=64"):
        client.completions.create(model="policy", prompt=[1] + [40] * MAX_SEQ_LEN)
    r = httpx.post(endpoint.base_url + "/inference/v1/generate", json={"token_ids": [1] * MAX_SEQ_LEN})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids"
    ok = client.completions.create(model="policy", prompt="cat", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(endpoint.base_url + "/v1/models").json()["data"][0]["max_model_len"] == MAX_SEQ_LEN


def test_non_loopback_bind_needs_its_token(rec: Recorder) -> None:
    with pytest.raises(ValueError, match="token"):
        GenerateEndpoint(rec, max_seq_len=MAX_SEQ_LEN, host="0.0.0.0")
    with GenerateEndpoint(rec, max_seq_len=MAX_SEQ_LEN, host="0.0.0.0", token="s3cret", max_tokens=4) as ep:
        url = f"http://127.0.0.1:{ep.port}/v1"
        for key in ("wrong", ""):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url, api_key=key or "x", max_retries=0).completions.create(model="p", prompt="a")
        assert httpx.post(url + "/completions", json={"prompt": "a"}).status_code == 401
        assert httpx.get(url + "/models").status_code == 401
        good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0).completions.create(model="p", prompt="a")
        assert good.choices[0].text is not None and rec.calls == 1


def test_a_flood_of_concurrent_requests_is_batched_and_answered(endpoint: GenerateEndpoint, rec: Recorder, tok) -> None:
    n = 32
    caps = [endpoint.open_episode(f"flood-{i}") for i in range(n)]

    def ask(i: int) -> tuple[int, dict[str, Any]]:
        r = httpx.post(
            caps[i].base_url + "/inference/v1/generate",
            json={
                "token_ids": encode_prompt(tok, f"cat {i}"),
                "sampling_params": {"max_tokens": 6, "temperature": 1.0},
            },
            timeout=120,
        )
        return r.status_code, r.json()

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(ask, range(n)))
    assert [s for s, _ in answers] == [200] * n
    for i, (_, body) in enumerate(answers):
        [call] = caps[i].close()
        choice = body["choices"][0]
        sampled = rec.find(encode_prompt(tok, f"cat {i}"), choice["token_ids"])
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == sampled.logprobs == call.logprobs
    assert rec.calls < n  # concurrent requests shared sampler calls
    assert endpoint.requests_served == n


def test_capture_log_is_the_samplers_output(rec: Recorder, tmp_path: Path, tok) -> None:
    log = tmp_path / "capture.jsonl"
    with GenerateEndpoint(rec, max_seq_len=MAX_SEQ_LEN, max_tokens=4, capture_log=str(log)) as ep:
        httpx.post(ep.base_url + "/inference/v1/generate", json={"token_ids": [1, 40, 41]}, timeout=60)
    import json

    [line] = [json.loads(x) for x in log.read_text().splitlines()]
    sampled = rec.find([1, 40, 41], line["completion_ids"])
    assert line["logprobs"] == sampled.logprobs and line["policy_step"] == STEP
