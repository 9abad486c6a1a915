"""The SGLang and vLLM adapters of the `server` backend against loopback servers implementing exactly the
endpoints and payloads of the pinned versions (`tests/fake_servers.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_servers import FakeServer

from pipeline.config import ServerInferenceConfig
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import GenerationRequest, make_backend
from policy.inference.adapters.base import step_from_path
from policy.inference.base import SamplingControls
from policy.inference.openai import OpenAIResponseError
from policy.inference.server import ServerBackend


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("builtin:tiny")


@pytest.fixture(params=["sglang", "vllm"])
def served(request: pytest.FixtureRequest, tokenizer: Any) -> Iterator[tuple[FakeServer, ServerBackend]]:
    server = FakeServer(request.param, "/runs/x/policies/step-00000000/hf")
    config = ServerInferenceConfig(adapter=request.param, openai_base_url=f"{server.url}/v1", load_timeout_s=5)
    backend = make_backend(config, None, tokenizer, 64)
    assert isinstance(backend, ServerBackend)
    backend.attach("/runs/x")
    yield server, backend
    backend.shutdown()
    server.stop()


def test_load_policy_sends_the_hf_folder_and_confirms_the_step(served: tuple[FakeServer, ServerBackend]) -> None:
    server, backend = served
    assert backend.needs_hf
    backend.load_policy(3)
    assert server.model_path == "/runs/x/policies/step-00000003/hf"
    assert backend.served_policy_step() == 3 and backend.loaded_step == 3
    posts = [(p, b) for m, p, b in server.requests if m == "POST"]
    if server.kind == "sglang":
        assert posts == [("/update_weights_from_disk", {"model_path": "/runs/x/policies/step-00000003/hf"})]
    else:
        assert [p for p, _ in posts] == ["/collective_rpc", "/collective_rpc", "/reset_prefix_cache"]
        assert posts[0][1]["method"] == "update_config" and posts[1][1]["method"] == "reload_weights"


def test_generate_returns_token_ids_and_checks_the_prompt(served: tuple[FakeServer, ServerBackend]) -> None:
    server, backend = served
    backend.load_policy(1)
    out = backend.generate(GenerationRequest([[1, 5, 6]], n=2, temperature=1.0, max_tokens=4, stop_tokens=[], seed=0))
    assert [len(c.tokens) for c in out[0]] == [4, 4] and out[0][0].logprobs == [-1.0] * 4
    body = next(b for m, p, b in server.requests if p == "/v1/completions")
    assert body["prompt"] == [[1, 5, 6]] and body["logprobs"] == 1 and body["return_token_ids"] is True


def test_a_prompt_the_server_did_not_receive_is_refused(served: tuple[FakeServer, ServerBackend]) -> None:
    server, backend = served
    backend.load_policy(1)
    server.echo_prompt_shift = 1
    with pytest.raises(OpenAIResponseError, match="were not sent"):
        backend.generate(GenerationRequest([[1, 5, 6]], n=1, temperature=1.0, max_tokens=2, stop_tokens=[], seed=0))


def test_sampling_controls_are_sent(served: tuple[FakeServer, ServerBackend]) -> None:
    server, backend = served
    backend.load_policy(1)
    controls = SamplingControls(top_p=0.9, top_k=20, min_p=0.05)
    backend.generate(GenerationRequest([[1, 5]], n=1, temperature=1.0, max_tokens=2, stop_tokens=[], seed=0,
                                       controls=controls))  # fmt: skip
    body = [b for m, p, b in server.requests if p == "/v1/completions"][-1]
    assert (body["top_p"], body["top_k"], body["min_p"]) == (0.9, 20, 0.05)


def test_step_from_path() -> None:
    assert step_from_path("gs://b/run/policies/step-00000012/hf") == 12
    assert step_from_path("/r/policies/step-00000004") == 4
    assert step_from_path("Qwen/Qwen3-0.6B") is None
