"""Policies published in the sampler's dtype (`model.publish_dtype`): a bfloat16 policy is written in bfloat16
(half the bytes of float32), loads in its stored dtype, samples in the dense sampler with logprobs that match
the bfloat16 weights teacher-forced (within 5e-2, the bf16 compute tolerance of tests/test_inference.py), and
as a KL reference is cast back to the learner's float32. `auto` is float32 on CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import (
    ConfigError,
    DenseInferenceConfig,
    LearnerStepConfig,
    ModelSpec,
    RLOOLossConfig,
    StoreConfig,
)
from pipeline.environments.generation import GenerationRequest
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.store import layout
from pipeline.store.storage import RunStore

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from policy import learner as L  # noqa: E402
from policy import model as M  # noqa: E402
from policy import policy_format as pf  # noqa: E402
from policy.inference import make_backend  # noqa: E402
from policy.losses import loss_module_from_config  # noqa: E402

VOCAB, MAX_SEQ_LEN = 512, 128
SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=MAX_SEQ_LEN)
PROMPTS = [[1, 40, 41, 42, 43], [1, 7]]


def _weights_size(store: RunStore, step: int) -> int:
    return sum(f.size for f in pf.policy_metadata(store, step).files.values())


def test_bf16_policy_is_published_loaded_and_sampled(tmp_path: Path) -> None:
    model = M.build_model(SPEC, VOCAB)
    stores = {}
    for dtype in ("float32", "bfloat16"):
        root = str(tmp_path / dtype)
        cfg = LearnerStepConfig(store=StoreConfig(run_root=root), model=dataclasses.replace(SPEC, publish_dtype=dtype))
        stores[dtype] = RunStore(root)
        L.publish_policy(stores[dtype], L.LearnerState(0, model, None, None), cfg)
    assert pf.policy_metadata(stores["bfloat16"], 0).extra["dtype"] == "bfloat16"
    assert "dtype" not in pf.policy_metadata(stores["float32"], 0).extra
    assert _weights_size(stores["bfloat16"], 0) < 0.55 * _weights_size(stores["float32"], 0)

    loaded = pf.read_policy(stores["bfloat16"], 0, SPEC, VOCAB)
    floats = [
        x
        for x in jax.tree_util.tree_leaves(loaded)
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert floats and all(x.dtype == jnp.bfloat16 for x in floats)

    tokenizer = load_tokenizer("builtin:tiny")
    backend = make_backend(
        DenseInferenceConfig(max_seqs=4), loaded, tokenizer, MAX_SEQ_LEN, compute_dtype="bfloat16", fast_compile=True
    )
    out = backend.generate(GenerationRequest(PROMPTS, n=2, temperature=1.0, max_tokens=8, stop_tokens=[], seed=3))
    as_f32 = M.cast_params(loaded, "float32")
    for prompt, group in zip(PROMPTS, out, strict=True):
        assert len(group) == 2
        for c in group:
            assert len(c.tokens) == 8 and all(0 <= t < VOCAB for t in c.tokens)
            tf = np.asarray(M.teacher_forced_logprobs(as_f32, prompt + c.tokens))[len(prompt) :]
            np.testing.assert_allclose(np.asarray(c.logprobs), tf, atol=5e-2)

    # a KL reference read from the bf16 policy 0 computes in the learner's float32
    cfg = LearnerStepConfig(
        store=StoreConfig(run_root=str(tmp_path / "bfloat16")), model=SPEC, loss=RLOOLossConfig(kl_coef=0.1)
    )
    ref = L.load_reference(stores["bfloat16"], cfg, VOCAB, loss_module_from_config(cfg.loss))
    assert all(
        x.dtype == jnp.float32
        for x in jax.tree_util.tree_leaves(ref)
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
    )
    assert stores["bfloat16"].exists(layout.policy_marker(0))


def test_publish_dtype_choice() -> None:
    assert M.publish_dtype("auto") == ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    assert M.publish_dtype("bfloat16") == "bfloat16" and M.publish_dtype("fp32") == "float32"
    with pytest.raises(ConfigError, match=r"model\.publish_dtype"):
        ModelSpec(publish_dtype="int8")


def test_safetensors_reader_reads_every_dtype_without_copying_and_refuses_malformed_files() -> None:
    """`st_load` (what policies and checkpoints are read with) returns the tensors safetensors wrote, bf16 and
    scalars included, as views of the bytes; a truncated header or tensor extent is a CheckpointError."""
    import ml_dtypes
    from safetensors.numpy import save

    from policy.policy_format import CheckpointError, st_load

    tensors = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "s": np.array(3.5, np.float64),
        "i": np.arange(5, dtype=np.int32),
        "mask": np.array([True, False]),
        "h": np.full((2, 2), 1.5, ml_dtypes.bfloat16),
    }
    data = save(tensors, metadata={"format": "test"})
    got = st_load(data)
    assert sorted(got) == sorted(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert np.array_equal(got[name], want), name
    assert not got["w"].flags.owndata  # a view of `data`
    for bad in (b"", b"\x05", data[:20], data[:-1]):
        with pytest.raises(CheckpointError):
            st_load(bad)
