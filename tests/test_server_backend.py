"""The `server` backend against a REAL levanter `InferenceServer` that the backend starts as a child process on
loopback (`python -m policy.inference.adapters.levanter_server`): policies published to a run root are loaded on
request, the server's logprobs match the learner's teacher-forced logprobs of each policy, and a SIGKILLed server
is restarted and told to load the policy again.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest

from pipeline.config import ModelSpec, ServerInferenceConfig
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.store.storage import RunStore
from policy.inference import GenerationRequest, make_backend
from policy.inference.server import ServerBackend
from policy.model import build_model, model_vocab_size, teacher_forced_logprobs
from policy.policy_format import read_policy, write_policy

pytestmark = pytest.mark.slow

SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=2, num_kv_heads=2, max_seq_len=48)
COMMAND = (
    f"{sys.executable} -m policy.inference.adapters.levanter_server --run_root {{run_root}} --host {{host}} "
    "--port {port} --model_json {model_json} --step {step} --max_seqs 8 --page_size 8"
)


def _scaled(model: Any, factor: float) -> Any:
    return jax.tree_util.tree_map(lambda x: x * factor if eqx.is_inexact_array(x) else x, model)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerBackend, RunStore, Any]]:
    import dataclasses
    import json

    root = tmp_path_factory.mktemp("server_run")
    store = RunStore(str(root))
    tokenizer = load_tokenizer("builtin:tiny")
    model = build_model(SPEC, model_vocab_size(tokenizer))
    write_policy(store, 0, model)
    config = ServerInferenceConfig(command=COMMAND, port=0, max_seqs=8, startup_timeout_s=240, load_timeout_s=120)
    backend = make_backend(config, None, tokenizer, SPEC.max_seq_len)
    assert isinstance(backend, ServerBackend)
    backend.attach(str(root), json.dumps(dataclasses.asdict(SPEC)), str(Path(root) / "server.log"))
    yield backend, store, tokenizer
    backend.shutdown()


def _prompt(tokenizer: Any) -> list[int]:
    return [tokenizer.bos_token_id, *tokenizer.encode("give me moar cats")]


def _check_against_teacher_forcing(backend: ServerBackend, store: RunStore, tokenizer: Any, step: int) -> np.ndarray:
    prompt = _prompt(tokenizer)
    out = backend.generate(GenerationRequest([prompt], n=2, temperature=1.0, max_tokens=6, stop_tokens=[], seed=3))
    assert backend.last_served_steps == {step}
    policy = read_policy(store, step, SPEC, model_vocab_size(tokenizer))
    for c in out[0]:
        assert len(c.tokens) == 6 and len(c.logprobs) == 6
        seq = prompt + c.tokens
        tf = np.asarray(teacher_forced_logprobs(policy, np.asarray(seq)))[len(prompt) :]
        np.testing.assert_allclose(np.asarray(c.logprobs), tf, atol=1e-4)
    # the same fixed continuation scored under this policy: changes with the weights
    return np.asarray(teacher_forced_logprobs(policy, np.asarray([*prompt, 5, 6, 7])))


def test_server_loads_each_published_policy_and_matches_teacher_forcing(setup: Any) -> None:
    backend, store, tokenizer = setup
    assert backend.load_policy(0) >= 0 and backend.served_policy_step() == 0
    fixed0 = _check_against_teacher_forcing(backend, store, tokenizer, 0)
    model = read_policy(store, 0, SPEC, model_vocab_size(tokenizer))
    for step, factor in ((1, 1.5), (2, 0.7)):
        write_policy(store, step, _scaled(model, factor))
        backend.load_policy(step)
        assert backend.served_policy_step() == step and backend.loaded_step == step
        fixed = _check_against_teacher_forcing(backend, store, tokenizer, step)
        assert np.abs(fixed - fixed0).max() > 1e-3  # new weights give other logprobs


def test_sigkilled_server_is_restarted_with_the_same_policy(setup: Any) -> None:
    backend, store, tokenizer = setup
    if backend.loaded_step is None:
        backend.load_policy(0)
    step = backend.loaded_step
    assert backend.process is not None and backend.process.alive()
    old_pid, starts = backend.process.pid, backend.process.starts
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    backend.process.proc.wait(30)  # type: ignore[union-attr]
    _check_against_teacher_forcing(backend, store, tokenizer, step)  # restarted inside generate
    assert backend.process.starts == starts + 1 and backend.process.pid != old_pid
    assert backend.served_policy_step() == step
