"""The model side shared by the learner, rollout and evaluation steps (levanter Llama, Qwen2/2.5, Qwen3,
Mistral, Gemma: `policy.families.FAMILIES`).

Reads: an optional Hugging Face checkpoint folder (local or any fsspec URL such as gs://) named by
`ModelSpec.hf_checkpoint` (a remote one streamed: `policy.hf_checkpoint`); committed policies
`policies/step-S/` of a run root.
Writes: policies `policies/step-S/weights-<attempt>.safetensors` + `policies/step-S/COMMITTED` (written
last, create-if-absent) + the `policies/LATEST` hint; HF exports (`export_hf`).

API (stable; other steps call these):

    build_model(spec, vocab_size, key=None, mesh=None) -> LmHeadModel  # from scratch (seeded) or from HF
    save_policy(store, step, model, extra=None) -> bool            # commit policies/step-S
    load_policy(store, step, spec, vocab_size) -> LmHeadModel      # verified against the marker, in its stored dtype
    latest_policy_step(store) -> int | None                        # listing is the truth
    teacher_forced_logprobs(model, tokens, *, segment_ids, position_ids, temperature) -> [B, S] float32
    export_hf(model, out_dir, tokenizer)                           # transformers-loadable folder

Logprob alignment (the same everywhere in rlpipe): `logprobs[b, t] = log softmax(logits[b, t-1] / T)[tokens[b, t]]`,
i.e. the logprob of token t given the tokens before it in its segment; 0 at t = 0 and at the first
token of each segment (those are prompt tokens and never carry loss). T is the sampling temperature of
token t's segment; T <= 0 (greedy) is treated as 1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import equinox as eqx
import fsspec
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.layers.attention import AttentionBackend, AttentionMask
from levanter.models.lm_model import LmHeadModel

from pipeline.config import ConfigError, ModelSpec
from pipeline.store import layout, run_state
from policy import checkpoints as ckpt
from policy.families import FAMILIES, hf_metadata_folder
from policy.hf_checkpoint import hf_converter as _hf_converter
from policy.hf_checkpoint import host_mesh as _host_mesh
from policy.hf_checkpoint import load_hf_model
from schemas.records import CommitMarker, LatestPointer, RecordError

if TYPE_CHECKING:
    from policy.mesh import LearnerMesh

logger = logging.getLogger(__name__)

BATCH_AXIS = "batch"
POS_AXIS = "position"
POLICY_WEIGHTS = "weights"


class PolicyNotFoundError(FileNotFoundError):
    """The requested policy step has no commit marker."""


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


def model_template(spec: ModelSpec, vocab_size: int) -> LmHeadModel:
    """The model's structure with ShapeDtypeStruct leaves (no weights computed or loaded)."""
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
# policies on the run root
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


def save_policy(
    store: Any,
    step: int,
    model: LmHeadModel,
    extra: dict[str, Any] | None = None,
    dtype: str | None = None,
    spec: ModelSpec | None = None,
) -> bool:
    """Commit `model` as policy `step`: weights file, then COMMITTED (last), then the LATEST hint.

    `extra` goes into the marker (the learner records `batch_slot`, `tokenizer`, `seq_len`). With `dtype`,
    floating weights are written in that dtype (the marker records it as `dtype`; `load_policy` reads it).
    With `spec.lora`, `model` is the loraized model and the policy holds what `spec.lora.publish` says
    (`policy.lora.policy_blobs`), always in float32: `dtype` does not apply to LoRA policies.
    Returns False (and writes nothing new) if policy `step` was already committed: a committed policy
    is never replaced. LATEST only moves forward.
    """
    folder = layout.policy_dir(step)
    if store.exists(layout.policy_marker(step)):
        logger.info("policy %d already committed", step)
        return False
    lora_spec = spec.lora if spec is not None else None
    if dtype is not None and dtype not in ("float32", "fp32") and lora_spec is None:
        model = cast_params(model, dtype)
        extra = {**(extra or {}), "dtype": str(jnp.dtype(dtype))}
    meta = {"step": step, "vocab_size": int(model.Vocab.size), "kind": "policy", **(extra or {})}
    if spec is not None and lora_spec is not None:
        from policy import lora

        blobs, lora_meta = lora.policy_blobs(model, spec, step)
        meta.update(lora_meta)
    else:
        blobs = {POLICY_WEIGHTS: ckpt.tree_to_safetensors(model)}
    created = ckpt.write_committed(store, folder, blobs, meta)
    _advance_latest(store, step)
    return created


def _advance_latest(store: Any, step: int) -> None:
    try:
        current = LatestPointer.from_json(store.get(layout.POLICY_LATEST), path=layout.POLICY_LATEST).step
    except (FileNotFoundError, RecordError):
        current = -1
    if step > current:
        store.put_unique(layout.POLICY_LATEST, LatestPointer(step=step).to_json())


def load_policy(store: Any, step: int, spec: ModelSpec, vocab_size: int) -> LmHeadModel:
    """Load committed policy `step`, verifying size and sha256 against its marker.

    A policy published as LoRA adapters comes back merged into its base policy's weights (`policy.lora`), so the
    result is always a plain model of `spec`'s shape. Raises PolicyNotFoundError when the marker is missing,
    CheckpointError when the files do not match it or the weights do not fit `spec`/`vocab_size` (the message
    names the file and tensor).
    """
    folder = layout.policy_dir(step)
    if not store.exists(layout.policy_marker(step)):
        raise PolicyNotFoundError(f"{layout.policy_marker(step)}: policy {step} is not committed")
    record = ckpt.read_marker(store, folder)
    if record.vocab_size != vocab_size:
        raise ckpt.CheckpointError(f"{folder}: committed with vocab_size={record.vocab_size}, expected {vocab_size}")
    if POLICY_WEIGHTS not in record.files:
        from policy import lora

        return lora.load_adapter_policy(store, step, record, spec, vocab_size)
    data = ckpt.read_blob(store, folder, record, POLICY_WEIGHTS)
    template = model_template(spec, vocab_size)
    stored = record.extra.get("dtype")
    if isinstance(stored, str):  # published in the sampler's dtype (e.g. bfloat16): loaded as stored
        dt = jnp.dtype(stored)
        template = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, template
        )
    return ckpt.tree_from_safetensors(template, data, source=folder)


def policy_metadata(store: Any, step: int) -> CommitMarker:
    """The COMMITTED marker of policy `step` (batch slot, tokenizer, seq_len, files)."""
    return ckpt.read_marker(store, layout.policy_dir(step))


def latest_policy_step(store: Any) -> int | None:
    """Newest policy step with a commit marker, by listing (LATEST is only a hint); None if none."""
    return run_state.latest_policy_step(store)


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


# ---------------------------------------------------------------------------------------------
# Hugging Face export
# ---------------------------------------------------------------------------------------------


def export_hf(model: LmHeadModel, out_dir: str, tokenizer: Any, family: str = "llama") -> None:
    """Write a Hugging Face folder for `model` that transformers, vLLM and SGLang load as is.

    The folder: `config.json` (with `architectures` and `torch_dtype`), `generation_config.json` (BOS, EOS and
    pad ids), `model.safetensors`, and the tokenizer as `pipeline.environments.tokenizer.save_for_export` writes it (it
    encodes a prompt to the ids the rollout workers use, BOS included, and returns no `token_type_ids`).
    Nothing is fetched from a hub. `out_dir` may be local or an fsspec URL.
    """
    remote = "://" in out_dir and not out_dir.startswith("file://")
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "out") if remote else out_dir.removeprefix("file://")
        os.makedirs(local, exist_ok=True)
        _write_hf_folder(model, local, tokenizer, family, ref_dir=os.path.join(tmp, "ref"))
        if remote:
            fs, base = fsspec.core.url_to_fs(out_dir)
            for name in sorted(os.listdir(local)):
                fs.put_file(os.path.join(local, name), f"{base.rstrip('/')}/{name}")
    logger.info("exported HF checkpoint to %s", out_dir)


def _write_hf_folder(model: LmHeadModel, out: str, tokenizer: Any, family: str, ref_dir: str) -> None:
    import transformers

    from pipeline.environments.tokenizer import save_for_export

    hf_config = model.config.to_hf_config(model.Vocab.size)
    hf_config.architectures = [FAMILIES[family].architecture]
    hf_config.save_pretrained(ref_dir)
    converter = _hf_converter(ModelSpec(family=family), ref_dir, tokenizer=tokenizer)
    with _host_mesh():
        converter.save_pretrained(model, out, save_reference_code=False, save_tokenizer=False)
    save_for_export(tokenizer, out)
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config_file = os.path.join(out, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    # The generation defaults the converter copies into config.json (e.g. suppressing BOS/EOS/pad as the first
    # token) are not how the policy samples: generation_config.json below holds the ones that apply.
    for key in ("begin_suppress_tokens", "suppress_tokens", "decoder_start_token_id", "max_length"):
        config.pop(key, None)
    dtype = str(jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))[0].dtype)
    config.update(ids, torch_dtype=dtype, dtype=dtype)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    transformers.GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(out)


def numpy_params(model: Any) -> list[np.ndarray]:
    """All array leaves of `model` as numpy arrays, in tree order (for bitwise comparisons)."""
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]
