"""The model side shared by the learner, rollout and evaluation steps (levanter Llama, Qwen2/2.5, Qwen3,
Mistral, Gemma: `policy.families.FAMILIES`).

Reads: an optional Hugging Face checkpoint folder (local or any fsspec URL such as gs://) named by
`ModelSpec.hf_checkpoint` (a remote one streamed: `policy.hf_checkpoint`). Policies, checkpoints and exports on
disk are `policy.policy_format`'s.

API (stable; other steps call these):

    build_model(spec, vocab_size, key=None, mesh=None) -> LmHeadModel  # from scratch (seeded) or from HF
    model_template(spec, vocab_size) -> LmHeadModel                # the structure, ShapeDtypeStruct leaves
    teacher_forced_logprobs(model, tokens, *, segment_ids, position_ids, temperature) -> [B, S] float32

Logprob alignment (the same everywhere in rlpipe): `logprobs[b, t] = log softmax(logits[b, t-1] / T)[tokens[b, t]]`,
i.e. the logprob of token t given the tokens before it in its segment; 0 at t = 0 and at the first
token of each segment (those are prompt tokens and never carry loss). T is the sampling temperature of
token t's segment; T <= 0 (greedy) is treated as 1.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.layers.attention import AttentionBackend, AttentionMask
from levanter.models.lm_model import LmHeadModel

from pipeline.config import ConfigError, ModelSpec
from policy.families import FAMILIES, hf_metadata_folder
from policy.hf_checkpoint import load_hf_model

if TYPE_CHECKING:
    from policy.mesh import LearnerMesh

logger = logging.getLogger(__name__)

BATCH_AXIS = "batch"
POS_AXIS = "position"


# ---------------------------------------------------------------------------------------------
# configs and construction
# ---------------------------------------------------------------------------------------------


def _attn_backend(spec: ModelSpec) -> AttentionBackend | None:
    if spec.attention_backend in ("default", "cudnn"):  # cudnn: the learner routes it (`policy.attention`)
        return None
    return AttentionBackend(spec.attention_backend)


def levanter_config(spec: ModelSpec) -> Any:
    """The levanter config for `spec`.

    From scratch: the spec's sizes. From an HF folder: the folder's config.json (the spec's
    size fields are then ignored), with `seq_len = spec.max_seq_len`. Gradient checkpointing
    (remat of each transformer block) per `spec.gradient_checkpointing`; layers are scanned.
    """
    common = dict(
        seq_len=spec.max_seq_len,
        attn_backend=_attn_backend(spec),
        gradient_checkpointing=spec.gradient_checkpointing,
        scan_layers=True,
    )
    cls = FAMILIES[spec.family].config_class
    if spec.hf_checkpoint:
        from transformers import AutoConfig

        hf_cfg = AutoConfig.from_pretrained(hf_metadata_folder(spec.hf_checkpoint))
        if getattr(hf_cfg, "model_type", spec.family) != spec.family:
            raise ConfigError(
                "model.family",
                spec.family,
                f"model.hf_checkpoint={spec.hf_checkpoint} is a {hf_cfg.model_type!r} checkpoint",
            )
        if spec.family == "qwen2" and not hasattr(hf_cfg, "no_bias"):
            hf_cfg.no_bias = True  # levanter reads it for the MLP (none in Qwen2; q/k/v biases are always on)
        base = cls.from_hf_config(hf_cfg)
        return dataclasses.replace(base, **common)
    sizes: dict[str, Any] = dict(
        hidden_dim=spec.hidden_dim,
        intermediate_dim=spec.intermediate_dim,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
    )
    field_names = {f.name for f in dataclasses.fields(cls)}
    if "tokenizer" in field_names:
        sizes["tokenizer"] = None
    if "head_dim" in field_names:  # Gemma's default head size is 256, not hidden / heads
        sizes["head_dim"] = spec.hidden_dim // spec.num_heads
    return cls(**sizes, **common)


def build_model(
    spec: ModelSpec, vocab_size: int, key: jax.Array | None = None, mesh: LearnerMesh | None = None
) -> LmHeadModel:
    """A levanter LM with `vocab_size` output classes, float32 parameters.

    From scratch the weights depend only on `key` (default `PRNGKey(spec.seed)`), so two calls give
    bitwise-identical models (`mesh` is not used). From an HF checkpoint the weights are loaded (the same values
    whatever the mesh) and the vocabulary resized to `vocab_size` if it differs (new rows deterministic per
    mesh): onto `mesh` with its parameter mapping (FSDP over "embed", tensor parallel over heads and mlp) when
    given, else onto a one-axis mesh over this process's devices.

    A remote checkpoint (gs:// or any fsspec URL) is never copied whole to local disk: its weights are streamed
    onto the devices, and one host holds at most one checkpoint file's bytes at a time
    (`policy.hf_checkpoint.load_hf_model` states the contract).
    """
    config = levanter_config(spec)
    if spec.hf_checkpoint:
        return load_hf_model(spec, config, vocab_size, mesh)
    if key is None:
        key = jax.random.PRNGKey(spec.seed)
    return _init_program(config, vocab_size)(key)


@functools.lru_cache(maxsize=16)
def _init_program(config: Any, vocab_size: int) -> Callable[[jax.Array], LmHeadModel]:
    """The jitted random initialisation of a model of `config`: the same bits as eager (threefry is exact) but one
    compiled program instead of many dispatches; kept per config, so a process that builds the same model again
    (a test session, a bench) traces and compiles it once."""
    vocab = hax.Axis("vocab", vocab_size)
    return eqx.filter_jit(lambda k: config.build(vocab, key=k))


@functools.lru_cache(maxsize=16)
def model_template(spec: ModelSpec, vocab_size: int) -> LmHeadModel:
    """The model's structure with ShapeDtypeStruct leaves (no weights computed or loaded). Kept per (spec, vocab):
    it is immutable, and a rollout worker or evaluator reads every policy into it (one trace of the model's
    initialisation per process, not one per policy loaded)."""
    config = levanter_config(spec)
    vocab = hax.Axis("vocab", vocab_size)
    return eqx.filter_eval_shape(lambda: config.build(vocab, key=jax.random.PRNGKey(0)))  # nothing computed


def model_vocab_size(tokenizer: Any, multiple: int = 1) -> int:
    """Model vocabulary size for a tokenizer: `len(tokenizer)` rounded up to a multiple of `multiple`."""
    n = len(tokenizer)
    return -(-n // multiple) * multiple


def count_params(model: Any) -> int:
    """Number of scalar parameters in the array leaves of `model`."""
    return int(sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))))


# ---------------------------------------------------------------------------------------------
# parameter dtypes
# ---------------------------------------------------------------------------------------------


def publish_dtype(name: str) -> str:
    """The dtype policies are published in for `model.publish_dtype` = `name`: `auto` is bfloat16 when JAX runs
    on an accelerator (GPU, TPU) and float32 on CPU; any other value is itself (`fp32` read as float32)."""
    if name == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return "float32" if name == "fp32" else name


def cast_params(model: Any, dtype: str) -> Any:
    """`model` with every floating array leaf cast to `dtype` (other leaves unchanged)."""
    dt = jnp.dtype("float32" if dtype == "fp32" else dtype)
    return jax.tree_util.tree_map(lambda x: x.astype(dt) if eqx.is_inexact_array(x) else x, model)


# ---------------------------------------------------------------------------------------------
# forward passes
# ---------------------------------------------------------------------------------------------


def cast_for_compute(model: LmHeadModel, compute_dtype: str) -> LmHeadModel:
    """`model` with floating parameters cast to `compute_dtype` (identity for float32)."""
    if compute_dtype in ("float32", "fp32"):
        return model
    dt = jnp.dtype(compute_dtype)

    def _cast(x: Any) -> Any:
        return x.astype(dt) if eqx.is_inexact_array(x) else x

    return jax.tree_util.tree_map(_cast, model)


def attention_mask(segment_ids: jax.Array | None) -> AttentionMask:
    """Causal mask that never crosses segments (`segment_ids` [B, S]; padding -1 attends only to padding)."""
    mask = AttentionMask.causal()
    if segment_ids is not None:
        mask = mask.with_segment_ids(hax.named(segment_ids, (BATCH_AXIS, POS_AXIS)))
    return mask


def forward_logits(
    model: LmHeadModel,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    position_ids: jax.Array | None = None,
) -> jax.Array:
    """Logits [B, S, V] (float32) of a packed batch; attention respects segments, rotary uses position_ids."""
    B, S = tokens.shape
    ids = hax.named(tokens.astype(jnp.int32), (BATCH_AXIS, POS_AXIS))
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    pos = hax.named(position_ids.astype(jnp.int32), (BATCH_AXIS, POS_AXIS))
    logits = model(ids, attention_mask(segment_ids), pos_ids=pos)
    return logits.rearrange((BATCH_AXIS, POS_AXIS, "vocab")).array.astype(jnp.float32)


def _per_token_temperature(temperature: jax.Array | float, shape: tuple[int, int]) -> jax.Array:
    t = jnp.broadcast_to(jnp.asarray(temperature, dtype=jnp.float32), shape)
    return jnp.where(t > 0, t, 1.0)


def shifted_logprobs_and_entropy(
    logits: jax.Array,
    tokens: jax.Array,
    segment_ids: jax.Array | None,
    temperature: jax.Array | float,
) -> tuple[jax.Array, jax.Array]:
    """Per-token logprobs and entropies of `softmax(logits / T)`, aligned to tokens (see module docstring).

    logprob[b, t] = log softmax(logits[b, t-1] / T[b, t])[tokens[b, t]];
    entropy[b, t] = -Σ_v p_v log p_v of that same distribution. Both are 0 at t = 0 and segment starts.
    """
    B, S = tokens.shape
    temp = _per_token_temperature(temperature, (B, S))
    prev = logits[:, :-1, :] / temp[:, 1:, None]
    logp_all = jax.nn.log_softmax(prev, axis=-1)
    lp = jnp.take_along_axis(logp_all, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    valid = jnp.ones((B, S - 1), dtype=bool)
    if segment_ids is not None:
        valid = segment_ids[:, 1:] == segment_ids[:, :-1]
    zeros = jnp.zeros((B, 1), jnp.float32)
    lp = jnp.concatenate([zeros, jnp.where(valid, lp, 0.0)], axis=1)
    ent = jnp.concatenate([zeros, jnp.where(valid, ent, 0.0)], axis=1)
    return lp, ent


def blocked_logprobs_and_entropy(
    model: LmHeadModel,
    tokens: jax.Array,
    segment_ids: jax.Array | None,
    position_ids: jax.Array | None,
    temperature: jax.Array | float,
    block_size: int,
) -> tuple[jax.Array, jax.Array]:
    """The same (logprobs, entropy) [B, S] as `shifted_logprobs_and_entropy(forward_logits(...))`, computed
    `block_size` vocabulary entries at a time: [B, S, V] logits are never held at once (peak [B, S, block]).

    An online log-sum-exp over the blocks gives log Z, the target's logit and Σ_v p_v z_v (so entropy =
    log Z − Σ p z); each block is recomputed in the backward pass (jax.checkpoint) rather than stored."""
    B, S = tokens.shape
    ids = hax.named(tokens.astype(jnp.int32), (BATCH_AXIS, POS_AXIS))
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    pos = hax.named(position_ids.astype(jnp.int32), (BATCH_AXIS, POS_AXIS))
    hidden = model.activations(ids, attention_mask(segment_ids), pos_ids=pos)
    h = hidden.rearrange((BATCH_AXIS, POS_AXIS, "embed")).array[:, :-1]
    w = model.get_lm_head().rearrange(("embed", "vocab")).array
    V = w.shape[1]
    nb = -(-V // block_size)
    w = jnp.pad(w, ((0, 0), (0, nb * block_size - V))).reshape(w.shape[0], nb, block_size).transpose(1, 0, 2)
    starts = jnp.arange(nb, dtype=jnp.int32) * block_size
    temp = _per_token_temperature(temperature, (B, S))[:, 1:, None]
    target = tokens[:, 1:].astype(jnp.int32)

    @jax.checkpoint
    def block(carry: tuple[jax.Array, ...], xs: tuple[jax.Array, jax.Array]) -> tuple[tuple[jax.Array, ...], None]:
        m, total, pz, tgt = carry
        wb, start = xs
        in_vocab = (start + jnp.arange(block_size)) < V
        z = jnp.einsum("bse,ev->bsv", h, wb).astype(jnp.float32) / temp
        z = jnp.where(in_vocab, z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new[..., None])
        total = total * scale + jnp.sum(e, axis=-1)
        pz = pz * scale + jnp.sum(e * jnp.where(in_vocab, z, 0.0), axis=-1)
        local = jnp.clip(target - start, 0, block_size - 1)
        hit = (target >= start) & (target < start + block_size)
        tgt = tgt + jnp.where(hit, jnp.take_along_axis(z, local[..., None], axis=-1)[..., 0], 0.0)
        return (m_new, total, pz, tgt), None

    zeros = jnp.zeros((B, S - 1), jnp.float32)
    init = (jnp.full((B, S - 1), -1e30, jnp.float32), zeros, zeros, zeros)
    (m, total, pz, tgt), _ = jax.lax.scan(block, init, (w, starts))
    log_z = m + jnp.log(total)
    lp, ent = tgt - log_z, log_z - pz / total
    valid = jnp.ones((B, S - 1), dtype=bool) if segment_ids is None else segment_ids[:, 1:] == segment_ids[:, :-1]
    pad = jnp.zeros((B, 1), jnp.float32)
    return (
        jnp.concatenate([pad, jnp.where(valid, lp, 0.0)], axis=1),
        jnp.concatenate([pad, jnp.where(valid, ent, 0.0)], axis=1),
    )


@eqx.filter_jit
def _tf_logprobs(model: Any, tokens: Any, segment_ids: Any, position_ids: Any, temperature: Any) -> jax.Array:
    logits = forward_logits(model, tokens, segment_ids, position_ids)
    lp, _ = shifted_logprobs_and_entropy(logits, tokens, segment_ids, temperature)
    return lp


def teacher_forced_logprobs(
    model: LmHeadModel,
    tokens: Any,
    *,
    segment_ids: Any = None,
    position_ids: Any = None,
    temperature: Any = 1.0,
    compute_dtype: str = "float32",
) -> jax.Array:
    """Logprobs [B, S] (float32) of `tokens` [B, S] under `model` at `temperature` (scalar or [B, S]).

    Same alignment and temperature convention as the sampler (module docstring). Jitted per shape.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        return teacher_forced_logprobs(
            model,
            tokens[None],
            segment_ids=None if segment_ids is None else jnp.asarray(segment_ids)[None],
            position_ids=None if position_ids is None else jnp.asarray(position_ids)[None],
            temperature=temperature,
            compute_dtype=compute_dtype,
        )[0]
    seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    pos = None if position_ids is None else jnp.asarray(position_ids, jnp.int32)
    temp = jnp.asarray(temperature, jnp.float32)
    return _tf_logprobs(cast_for_compute(model, compute_dtype), tokens, seg, pos, temp)


def numpy_params(model: Any) -> list[np.ndarray]:
    """All array leaves of `model` as numpy arrays, in tree order (for bitwise comparisons)."""
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]
