"""The OpenAI-compatible backend against a REAL server on loopback: levanter's `InferenceServer` (FastAPI +
uvicorn) serving a tiny levanter model, started in a thread of the test process. The server is wrapped with
a middleware that advertises the policy step it serves (`X-Policy-Step`), as a user's server would.

Plus response parsing of vLLM's formats (`token_ids`, `token_id:N` strings), which needs no server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.config import CurriculumConfig, LessonConfig, ModelSpec, OpenAIInferenceConfig, SamplingParams
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import GenerationRequest, PromptTooLongError
from policy.inference.base import truncate_at_stop
from policy.inference.openai import OpenAIBackend, OpenAIResponseError, policy_step_from_model_name
from policy.model import build_model, model_vocab_size
from policy.rollout_manager import RolloutManager

SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=2, num_kv_heads=2, max_seq_len=48)
MAX_SEQS = 8


class Server:
    """levanter's InferenceServer on 127.0.0.1:<free port>, advertising `step` in X-Policy-Step."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        from levanter.inference.engine import InferenceEngineConfig
        from levanter.inference.openai import InferenceServer, InferenceServerConfig

        service = InferenceEngineConfig(
            max_seq_len=SPEC.max_seq_len,
            page_size=8,
            max_pages=MAX_SEQS * SPEC.max_seq_len // 8 + 8,
            max_seqs=MAX_SEQS,
            compute_dtype=jnp.float32,
            enable_logprobs=True,
            max_prefill_size=MAX_SEQS * SPEC.max_seq_len,
            max_seqs_in_prefill=MAX_SEQS,
        )
        self.step: int | None = 3
        self.srv = InferenceServer.create(
            InferenceServerConfig(service=service, host="127.0.0.1", port=0, batch_timeout=0.05), model, tokenizer
        )

        @self.srv.app.middleware("http")
        async def policy_step_header(request: Any, call_next: Any) -> Any:
            response = await call_next(request)
            if self.step is not None:
                response.headers["X-Policy-Step"] = str(self.step)
            return response

        self.thread = threading.Thread(target=self.srv.serve, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while self.srv._server is None or not self.srv._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("levanter server did not start")
            time.sleep(0.05)
        self.base_url = f"http://{self.srv.address()}/v1"

    def stop(self) -> None:
        if self.srv._server is not None:
            self.srv._server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("builtin:tiny")


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> Any:
    return build_model(SPEC, model_vocab_size(tokenizer))


@pytest.fixture(scope="module")
def server(model: Any, tokenizer: Any) -> Iterator[Server]:
    s = Server(model, tokenizer)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def backend(server: Server, tokenizer: Any) -> Iterator[OpenAIBackend]:
    cfg = OpenAIInferenceConfig(openai_base_url=server.base_url, max_seqs=MAX_SEQS, request_timeout_s=300)
    b = OpenAIBackend(cfg, tokenizer, max_seq_len=SPEC.max_seq_len)
    yield b
    b.shutdown()


def _prompts(tokenizer: Any) -> list[list[int]]:
    return [[tokenizer.bos_token_id, *tokenizer.encode(t)] for t in ("give me moar cats", "hello")]


def test_generate_returns_ids_and_logprobs_from_a_real_server(backend: OpenAIBackend, tokenizer: Any) -> None:
    out = backend.generate(
        GenerationRequest(_prompts(tokenizer), n=2, temperature=1.0, max_tokens=6, stop_tokens=None, seed=1)
    )
    assert backend.server_kind == "levanter"
    assert [len(c) for c in out] == [2, 2]
    for comps in out:
        for c in comps:
            assert 1 <= len(c.tokens) <= 6 and len(c.logprobs) == len(c.tokens)
            assert all(isinstance(t, int) and 0 <= t < len(tokenizer) for t in c.tokens)
            assert all(lp <= 1e-5 and np.isfinite(lp) for lp in c.logprobs)
            if c.finish_reason == "stop":
                assert c.tokens[-1] == tokenizer.eos_token_id
            else:
                assert c.finish_reason == "length" and len(c.tokens) == 6
    assert backend.last_served_steps == {3} and backend.served_step == 3


def test_served_step_follows_the_server_and_model_names(
    backend: OpenAIBackend, server: Server, model: Any, tokenizer: Any
) -> None:
    server.srv.reload(lambda m: jax.tree_util.tree_map(lambda x: x * 1.5 if eqx.is_inexact_array(x) else x, m))
    server.step = 5
    try:
        backend.generate(
            GenerationRequest(_prompts(tokenizer)[:1], n=1, temperature=1.0, max_tokens=4, stop_tokens=None, seed=2)
        )
        assert backend.last_served_steps == {5}
        # without the header: the served model name carries the step (levanter echoes the requested name)
        server.step = None
        cfg = OpenAIInferenceConfig(openai_base_url=server.base_url, openai_model="policy@step-00000007")
        named = OpenAIBackend(cfg, tokenizer, max_seq_len=SPEC.max_seq_len)
        named.generate(
            GenerationRequest(_prompts(tokenizer)[:1], n=1, temperature=1.0, max_tokens=4, stop_tokens=None, seed=2)
        )
        assert named.last_served_steps == {7}
        named.shutdown()
    finally:
        server.srv.reload(lambda m: model)
        server.step = 3


def test_prompt_too_long_is_refused_before_any_request(backend: OpenAIBackend) -> None:
    with pytest.raises(PromptTooLongError, match="max_seq_len=48"):
        backend.generate(
            GenerationRequest([[5] * SPEC.max_seq_len], n=1, temperature=1.0, max_tokens=4, stop_tokens=None, seed=0)
        )


def test_rollout_manager_over_the_openai_backend(server: Server, tokenizer: Any) -> None:
    sampling = SamplingParams(temperature=1.0, n_prompts=2, n_generations_per_prompt=2, max_tokens=6)
    cur = CurriculumConfig(lessons={"cats": LessonConfig(lesson_id="cats")}, default_sampling=sampling)
    inference = OpenAIInferenceConfig(openai_base_url=server.base_url, max_seqs=MAX_SEQS)
    manager = RolloutManager(inference, SPEC, cur, tokenizer, None)  # builds the OpenAIBackend itself
    try:
        assert manager.external_weights
        batch, metrics = manager.sample_batch("cats", 2, 2, "train", 0, weight_step=0, worker_id="w")
    finally:
        manager.shutdown()
    assert batch is not None and len(batch.rows) == 4 and metrics["failures"] == 0
    # rows carry the step the server says it serves, not the caller's guess
    assert batch.metadata.weight_step == 3 and {r.policy_step for r in batch.rows} == {3}


# ---------------------------------------------------------------------------------------------
# response formats of other servers (no network)
# ---------------------------------------------------------------------------------------------


def _offline_backend(tokenizer: Any) -> OpenAIBackend:
    return OpenAIBackend(OpenAIInferenceConfig(openai_base_url="http://127.0.0.1:9/v1"), tokenizer)


def test_parse_vllm_token_ids_and_token_id_strings(tokenizer: Any) -> None:
    b = _offline_backend(tokenizer)
    eos = tokenizer.eos_token_id
    c = b._parse_choice({"index": 0, "token_ids": [10, 11, eos, 12], "finish_reason": "stop",
                         "logprobs": {"tokens": ["x"] * 4, "token_logprobs": [-1.0, -2.0, -0.5, -3.0]}},
                        max_tokens=8, stops=[eos])  # fmt: skip
    assert c.tokens == [10, 11, eos] and c.logprobs == [-1.0, -2.0, -0.5] and c.finish_reason == "stop"
    c = b._parse_choice({"index": 0, "finish_reason": "length",
                         "logprobs": {"tokens": ["token_id:10", "token_id:11"], "token_logprobs": [-1.0, -2.0]}},
                        max_tokens=2, stops=[eos])  # fmt: skip
    assert c.tokens == [10, 11] and c.finish_reason == "length"
    with pytest.raises(OpenAIResponseError, match="not a vocabulary entry"):
        b._parse_choice({"index": 0, "logprobs": {"tokens": ["no-such-piece"], "token_logprobs": [-1.0]}}, 4, [eos])
    with pytest.raises(OpenAIResponseError, match="logprobs"):
        b._parse_choice({"index": 0, "token_ids": [10, 11], "logprobs": {"token_logprobs": [-1.0]}}, 4, [eos])
    b.shutdown()


def test_step_from_model_name_and_stop_truncation() -> None:
    assert policy_step_from_model_name("policy@step-00000120") == 120
    assert policy_step_from_model_name("policy@42") == 42
    assert policy_step_from_model_name("policy-step7") == 7
    assert policy_step_from_model_name("policy") is None and policy_step_from_model_name(None) is None
    assert truncate_at_stop([1, 2, 3], [-1.0, -2.0, -3.0], [2]) == ([1, 2], [-1.0, -2.0], True)
    assert truncate_at_stop([1, 2, 3], [-1.0, -2.0, -3.0], []) == ([1, 2, 3], [-1.0, -2.0, -3.0], False)
