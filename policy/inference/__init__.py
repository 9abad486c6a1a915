"""Inference: token ids + per-token logprobs from the policy, behind one backend protocol.

    backend = make_backend(DenseInferenceConfig(max_seqs=8), model, tokenizer, max_seq_len=256)
    out = backend.generate(GenerationRequest([[1, 5, 7]], n=4, temperature=1.0, max_tokens=32, stop_tokens=None,
                                             seed=0))
    backend.update_model(new_model)   # new weights, same structure: no recompilation
    backend.shutdown()

Modules: `base` (the protocol, `GenerationRequest`, the errors), `registry` (config class -> backend class, the
factory), `context` (the environments' `InferenceContext` over a backend), one module per backend: `dense`
(default, `dense_sampler` + `dense_params`), `levanter_engine` (levanter's `InferenceEngine`), `openai` (an
OpenAI-compatible server). A new backend is one module here, registered with `@register_backend(ConfigClass)` and
imported below, plus one registered `pipeline.config.InferenceConfig` subclass.
"""

from policy.inference import dense, levanter_engine, openai, server  # noqa: F401  (each registers its backend)
from policy.inference.base import (
    GenerationError,
    GenerationRequest,
    GenerationStats,
    InferenceBackend,
    PromptTooLongError,
)
from policy.inference.context import BackendContext
from policy.inference.registry import backend_class, make_backend, register_backend

__all__ = [
    "BackendContext",
    "GenerationError",
    "GenerationRequest",
    "GenerationStats",
    "InferenceBackend",
    "PromptTooLongError",
    "backend_class",
    "make_backend",
    "register_backend",
]
