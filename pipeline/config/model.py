"""The model and inference configs shared by the learner, rollout and evaluation steps."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.base import require

# ---------------------------------------------------------------------------------------
# model, tokenizer, inference
# ---------------------------------------------------------------------------------------

MODEL_FAMILIES = ("llama", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    """A levanter decoder, built from scratch (tiny configs) or loaded from an HF folder."""

    family: str = "llama"
    hidden_dim: int = 64
    intermediate_dim: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    max_seq_len: int = 256
    hf_checkpoint: str | None = None
    """Local path or gs:// folder of a Hugging Face checkpoint; None: initialise from `seed`."""
    tokenizer: str = "builtin:tiny"
    """A local tokenizer folder, or `builtin:tiny` (built deterministically in code)."""
    seed: int = 0
    compute_dtype: str = "float32"
    """Activation dtype: float32 on CPU, bfloat16 on GPU."""
    attention_backend: str = "default"
    """levanter attention backend: default, vanilla, jax_flash, splash."""

    def __post_init__(self) -> None:
        require(self.family in MODEL_FAMILIES, "model.family", self.family, f"one of {MODEL_FAMILIES}")
        require(self.hidden_dim % self.num_heads == 0, "model.hidden_dim", self.hidden_dim, "must divide by num_heads")
        require(
            self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads, "must divide num_heads"
        )


INFERENCE_BACKENDS = ("levanter", "dense", "openai")


@dataclass(frozen=True)
class InferenceConfig:
    """Which inference backend produces completions, and its sizing."""

    backend: str = "dense"
    """'dense': fixed-shape jitted sampler with a dense KV cache (default);
    'levanter': levanter's InferenceEngine; 'openai': an OpenAI-compatible server."""
    max_seqs: int = 64
    """Most sequences decoded at once."""
    page_size: int = 16
    """levanter engine only: KV page size."""
    openai_base_url: str | None = None
    """openai backend: the server's base URL (e.g. http://localhost:8000/v1)."""
    openai_model: str = "policy"
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        require(self.backend in INFERENCE_BACKENDS, "inference.backend", self.backend, f"one of {INFERENCE_BACKENDS}")
        require(
            self.backend != "openai" or bool(self.openai_base_url),
            "inference.openai_base_url",
            self.openai_base_url,
            "is required with backend 'openai'",
        )
