"""Continuous batching moves no KV cache between host and device (policy/inference/continuous.py).

The KV caches of a continuous-batching call are made on the device: before 2026-11-28 they were zeroed on the host
and copied to the device on every call, which was half of a call's wall time at the 1B shape on an H200 (805 MB per
call). This counts every byte a call hands to `jax.device_put` and asserts it is far below the caches' size."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from pipeline.config import ModelSpec
from policy.inference.continuous import ContinuousSampler, SeqRequest
from policy.inference.dense_sampler import DenseSampler
from policy.model import build_model

SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64)
"""The shapes of tests/test_continuous_batching.py (its compiled programs are shared through the cache)."""


def test_a_call_copies_no_kv_cache_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = DenseSampler(build_model(SPEC, 512, key=jax.random.PRNGKey(0)), "float32")
    cont = ContinuousSampler(sampler)
    requests = [SeqRequest([1, 2, 3, 4, 5], 40, i, 7) for i in range(4)]
    put_bytes = [0]
    real_put = jax.device_put

    def counting_put(x: Any, *args: Any, **kwargs: Any) -> Any:
        put_bytes[0] += sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(x))
        return real_put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counting_put)
    out = cont.run(requests, slots=4, stop_tokens=[], temperature=1.0)
    assert [len(o.tokens) for o in out] == [40] * 4
    a = sampler.arch
    # slots x kv heads x cache length (bucket(prompt) + bucket(budget) = 8 + 64) x head dim, K and V, every layer
    kv_bytes = 2 * a.num_layers * 4 * a.num_kv_heads * (8 + 64) * a.head_dim * np.dtype(a.compute_dtype).itemsize
    assert put_bytes[0] < kv_bytes / 2, (put_bytes[0], kv_bytes)
