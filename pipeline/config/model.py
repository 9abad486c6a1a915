"""The model and inference configs shared by the learner, rollout and evaluation steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import draccus

from pipeline.config.base import at_least, default_choice, one_of, positive, require

# ---------------------------------------------------------------------------------------
# model, tokenizer, inference
# ---------------------------------------------------------------------------------------

MODEL_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma")
"""levanter decoder families (`model.family`); `qwen2` also covers Qwen2.5 checkpoints."""
SHAPE_FIELDS = ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads")
"""The fields a `model.hf_checkpoint`'s own config.json decides (given with one, they would be ignored)."""
DTYPES = ("float32", "fp32", "bfloat16", "float16")
LORA_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of each Llama / Qwen3 decoder block (the names HF and PEFT use): the default LoRA targets."""
LORA_TARGETS = (*LORA_LAYERS, "lm_head")
"""Every linear layer LoRA adapters can wrap (`lm_head`: the output projection, unless tied to the embeddings)."""
LORA_PUBLISH = ("merged", "adapters")


@dataclass(frozen=True)
class LoraSpec:
    """`model.lora`: train low-rank adapters on the chosen linear layers; the base weights stay frozen.

    Each wrapped layer computes `W x + (alpha / r) · B A x`, with A [r, in] and B [out, r]; B starts at zero, so
    the model at step 0 (policy 0, and the reference model of the KL term) is exactly the base model."""

    SECTION: ClassVar[str] = "model.lora"

    r: int = 8
    """Rank of each adapter."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / r."""
    target_modules: tuple[str, ...] = LORA_LAYERS
    """Which linear layers get adapters: any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
    (default: all of these) and lm_head."""
    publish: str = "merged"
    """What a published policy holds: `merged` (base + adapters folded into full weights, the normal policy
    format) or `adapters` (only the adapter tensors; readers add them to the base weights of policy 0)."""

    def __post_init__(self) -> None:
        at_least(self, 1, "r")
        positive(self, "alpha")
        targets = tuple(self.target_modules)
        require(len(targets) > 0, "model.lora.target_modules", list(targets), "must name at least one layer")
        for name in targets:
            require(
                name in LORA_TARGETS,
                "model.lora.target_modules",
                list(targets),
                f"{name!r} is not one of {LORA_TARGETS}",
            )
        require(len(set(targets)) == len(targets), "model.lora.target_modules", list(targets), "has a duplicate")
        one_of(self, "publish", LORA_PUBLISH)


ATTENTION_BACKENDS = ("default", "vanilla", "jax_flash", "splash", "nvte", "cudnn")
"""`model.attention_backend` values: levanter's `AttentionBackend` names, and `cudnn` (`policy.attention`)."""


@dataclass(frozen=True)
class ModelSpec:
    """A levanter decoder, built from scratch (tiny configs) or loaded from an HF folder."""

    SECTION: ClassVar[str] = "model"

    family: str = "llama"
    """The decoder architecture: llama, qwen2 (Qwen2 and Qwen2.5), qwen3, mistral or gemma; with
    `hf_checkpoint` it must match the checkpoint's config.json."""
    hidden_dim: int = 64
    """Width of the residual stream (from scratch only: an `hf_checkpoint` sets the shape)."""
    intermediate_dim: int = 128
    """Width of each MLP's hidden layer (from scratch only)."""
    num_layers: int = 2
    """Decoder blocks (from scratch only)."""
    num_heads: int = 4
    """Attention (query) heads; must divide hidden_dim (from scratch only)."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide num_heads (from scratch only)."""
    max_seq_len: int = 256
    """Positions the model has: the longest sequence the learner and the samplers handle (train.seq_len and
    inference.max_seq_len must fit in it)."""
    hf_checkpoint: str | None = None
    """Local path or gs:// (any fsspec URL) folder of a Hugging Face checkpoint, streamed onto the learner's mesh
    (only its config and tokenizer files are copied to local disk); None: initialise from `seed`."""
    init_policy: str | None = None
    """Start the learner (at step 0) from a committed policy of another run instead of `seed`: a run root (local
    or gs://; its newest committed policy) or one of its `policies/step-S` folders, e.g. an SFT run's
    (`steps.sft`). Its shape and tokenizer must be this spec's; a resumed run reads its own checkpoints instead."""
    tokenizer: str = "builtin:tiny"
    """A local tokenizer folder, `builtin:tiny` (built deterministically in code) or `builtin:bpe` (a byte-level BPE
    for real text, shipped with rlpipe)."""
    seed: int = 0
    """Seeds the from-scratch initial weights (and LoRA's A matrices)."""
    compute_dtype: str = "float32"
    """Activation dtype: float32 on CPU, bfloat16 on GPU and TPU (parameters are cast for the forward pass)."""
    param_dtype: str = "float32"
    """Master-weight and optimizer-state dtype (float32 keeps mixed-precision training exact enough to learn)."""
    publish_dtype: str = "auto"
    """Dtype of the weights of published policies (what samplers load): `auto` is bfloat16 when the learner runs
    on an accelerator and float32 on CPU; or float32, bfloat16, float16. Checkpoints keep param_dtype; a KL
    reference model read from policy 0 is cast back to param_dtype (from bfloat16 weights when published so)."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass (levanter's remat) to save memory."""
    logprob_block_size: int | None = None
    """Vocabulary entries per block when the learner computes logprobs and entropies: the [batch, seq, vocab]
    logits are then never materialised at once. None: the whole vocabulary in one block."""
    attention_backend: str = "default"
    """Attention of the learner's forward passes: a levanter backend (default, vanilla, jax_flash, splash, nvte),
    or cudnn: JAX's fused attention (cuDNN's flash-attention kernel on NVIDIA GPUs, XLA's implementation of the
    same function elsewhere), segments of packed rows kept by an additive mask."""
    lora: LoraSpec | None = None
    """Train LoRA adapters instead of every weight (see `LoraSpec`); None: full fine-tuning."""

    def __post_init__(self) -> None:
        for name in ("compute_dtype", "param_dtype"):
            value = getattr(self, name)
            require(value in DTYPES, f"model.{name}", value, f"one of {DTYPES}")
        require(
            self.publish_dtype in ("auto", *DTYPES),
            "model.publish_dtype",
            self.publish_dtype,
            f"one of {('auto', *DTYPES)}",
        )
        at_least(self, 1, "logprob_block_size", or_null=True)
        one_of(self, "family", MODEL_FAMILIES)
        one_of(self, "attention_backend", ATTENTION_BACKENDS)
        require(
            not (self.init_policy and self.hf_checkpoint),
            "model.init_policy",
            self.init_policy,
            "give either model.init_policy or model.hf_checkpoint, not both",
        )
        if self.hf_checkpoint:
            for name in SHAPE_FIELDS:
                value = getattr(self, name)
                require(
                    value == getattr(ModelSpec, name),
                    f"model.{name}",
                    value,
                    "not allowed with model.hf_checkpoint (its config.json sets the shape)",
                )
        require(self.hidden_dim % self.num_heads == 0, "model.hidden_dim", self.hidden_dim, "must divide by num_heads")
        require(
            self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads, "must divide num_heads"
        )


@dataclass(frozen=True)
class InferenceConfig(draccus.ChoiceRegistry):
    """Which inference backend produces completions (`type: dense`, `levanter` or `openai`), and its sizing.

    Each backend is a registered subclass; the JAX side maps the subclass to its backend class
    (`policy.inference.make_backend`), so a new backend is one module there plus one subclass here.
    """

    SECTION: ClassVar[str] = "inference"

    max_seqs: int = 64
    """Most sequences decoded at once."""
    partial_rollouts: bool = False
    """Partial rollouts: the rollout worker loads each new committed policy in a background thread and the sampler
    switches to it between decode steps, sequences in flight continuing on the new weights (their KV cache as
    computed); rollout rows record the policy step of every token (`token_policy_steps`) and the lag rule applies
    to the oldest (docs/guides/partial-rollouts.md). Only `type: dense` with continuous batching
    (`continuous_batching` true or unset); refused for any other backend."""
    partial_rollouts_swap_steps: int = 8
    """With partial rollouts: the most decode steps between two checks for a staged newer policy (the decode
    program returns to the host that often; 1 swaps at the next step, at the cost of a host round trip per step)."""

    def __post_init__(self) -> None:
        at_least(self, 1, "max_seqs", "partial_rollouts_swap_steps")
        require(
            not self.partial_rollouts or self.backend == "dense",
            "inference.partial_rollouts",
            self.partial_rollouts,
            f"not supported by inference type {self.backend!r}: only type dense (with continuous_batching: true) can "
            "switch policies between decode steps and report each token's policy step (a server's completions "
            "report one policy step per response, and it loads a new policy only between requests)",
        )

    default_choice_name = default_choice("dense")

    @property
    def backend(self) -> str:
        """The registered name of this backend (`dense`, `levanter`, `openai`)."""
        return str(self.get_choice_name(type(self)))


DENSE_DTYPES = ("auto", *DTYPES)


@InferenceConfig.register_subclass("dense")
@dataclass(frozen=True)
class DenseInferenceConfig(InferenceConfig):
    """The in-process fixed-shape jitted sampler with a dense KV cache (the default)."""

    max_seq_len: int | None = None
    """Longest sequence (prompt + completion) the sampler serves: prompt budgets are cut to it and each row's KV
    cache holds at most its prompt bucket plus `bucket(max_seq_len)` slots. None: `model.max_seq_len`; larger than
    `model.max_seq_len` is refused."""
    compute_dtype: str | None = None
    """Sampler weights, activations and KV cache dtype: float32, bfloat16, float16, or auto (float32 on CPU,
    bfloat16 on an accelerator). None: `model.compute_dtype` (float32 unless set)."""
    continuous_batching: bool | None = None
    """Continuous batching: `max_seqs` decode slots, a finished sequence's slot refilled from the call's queue
    every few decode steps, and the n samples of a prompt sharing one prefill (its KV copied into their slots). The
    same samples as static batches (which run each batch until its longest sequence ends). null: on where it
    measured no slower than static batches on equal lengths, on CPU (0.99x; 2.65x on long-tailed lengths), and
    with partial rollouts; off on an accelerator (an H200: 0.92x on equal lengths, 1.47x on long-tailed ones;
    docs/benchmarks.md, "Continuous batching")."""

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self, 2, "max_seq_len", or_null=True)
        require(
            self.compute_dtype is None or self.compute_dtype in DENSE_DTYPES,
            "inference.compute_dtype",
            self.compute_dtype,
            f"one of {DENSE_DTYPES} or null",
        )
        require(
            not self.partial_rollouts or self.continuous_batching is not False,
            "inference.partial_rollouts",
            self.partial_rollouts,
            "needs continuous batching (inference.continuous_batching: true or null): a static batch decodes to "
            "its end on one policy",
        )


@InferenceConfig.register_subclass("levanter")
@dataclass(frozen=True)
class LevanterInferenceConfig(InferenceConfig):
    """levanter's in-process `InferenceEngine` (paged KV cache)."""

    page_size: int = 16
    """KV page size."""

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self, 1, "page_size")


@InferenceConfig.register_subclass("openai")
@dataclass(frozen=True)
class OpenAIInferenceConfig(InferenceConfig):
    """An external OpenAI-compatible `/v1/completions` server (vLLM, SGLang, levanter's InferenceServer)."""

    openai_base_url: str | None = None
    """The server's base URL (e.g. http://localhost:8000/v1); required."""
    openai_model: str = "policy"
    """The model name sent with each request (a name ending in `step-<N>` also tells the policy step)."""
    request_timeout_s: float = 600.0
    """Seconds before one HTTP request times out."""
    api_key_env: str | None = None
    """Environment variable holding the key the server requires: sent as `Authorization: Bearer <key>` on every
    request (None: no key). With type `server`, a server the worker starts gets a fresh secret instead."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            bool(self.openai_base_url),
            "inference.openai_base_url",
            self.openai_base_url,
            "is required with inference type 'openai'",
        )
        positive(self, "request_timeout_s")


SERVER_ADAPTERS = ("levanter", "sglang", "vllm")


@InferenceConfig.register_subclass("server")
@dataclass(frozen=True)
class ServerInferenceConfig(OpenAIInferenceConfig):
    """An OpenAI-compatible server the rollout worker owns or is pointed at, told to load each committed policy.

    `command` given: the worker starts it as a child process (placeholders `{port}`, `{host}`, `{api_key}`,
    `{run_root}`, `{step}`, `{policy_dir}`, ...) and restarts it if it dies. Every start gets a fresh secret that
    every request carries (`Authorization: Bearer <secret>`), and the worker checks that the server on the address
    is the one it started before its first request: a foreign server there is refused in one line. Without
    `command`, `openai_base_url` names a running server (its key, if it needs one, in `api_key_env`).
    """

    adapter: str = "levanter"
    """How the server is told to load policy S: levanter (rlpipe's levanter server), sglang, vllm."""
    command: str | None = None
    """Shell-split command line that starts the server; None: the server at `openai_base_url` is already up.
    `{python}` is this environment's own Python, whose bin folder is also first on the server's PATH. `{api_key}`
    is the start's secret (SGLang: `--api-key {api_key}`); rlpipe's levanter server reads it from
    `RLPIPE_SERVER_TOKEN` and vLLM from `VLLM_API_KEY`, so their commands need not show it."""
    host: str = "127.0.0.1"
    """Host the started server binds to (and the worker connects to)."""
    port: int = 8000
    """Port of the started server. 0: the worker's own: rlpipe's levanter server (`adapter: levanter`) binds a
    port itself and announces it to the worker (`{port}` is 0); vLLM and SGLang get a port the worker picks, and
    a start that finds it taken is retried on another. A fixed port taken by another program fails the start."""
    startup_timeout_s: float = 300.0
    """Seconds a started server has to announce its address and answer its health check."""
    load_timeout_s: float = 600.0
    """Seconds a server has to load a policy and report its step."""
    max_restarts: int = 5
    """Restarts of a dead child server before the worker gives up."""
    export_hf: bool = False
    """Publish `policies/step-S/hf/` (a Hugging Face folder) before asking the server to load step S."""

    def __post_init__(self) -> None:
        InferenceConfig.__post_init__(self)
        one_of(self, "adapter", SERVER_ADAPTERS)
        require(
            bool(self.openai_base_url or self.command),
            "inference.openai_base_url",
            self.openai_base_url,
            "is required with inference type 'server' unless inference.command starts the server",
        )
        require(0 <= self.port < 65536, "inference.port", self.port, "must be in [0, 65536)")
        positive(self, "request_timeout_s", "startup_timeout_s", "load_timeout_s")
        at_least(self, 0, "max_restarts")


INFERENCE_BACKENDS = ("dense", "levanter", "openai", "server")
"""The registered inference config types (`inference: {type: ...}`)."""
