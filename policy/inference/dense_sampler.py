"""A fixed-shape, jit-compiled-once sampler with a dense KV cache for levanter Llama / Qwen3 models.

What it reads: a levanter `LlamaLMHeadModel` (or `Qwen3LMHeadModel`, which adds q/k RMSNorm); its
haliax weights are turned once into plain arrays (`policy.inference.dense_params.extract_params`) and
passed to the compiled function as arguments, so new weights (`DenseSampler.update_params`) never recompile anything.
What it writes: nothing; `DenseSampler.generate` returns token ids and logprobs as numpy arrays.

Algorithm (one jitted call per batch, no per-token host round trip):

1. Prompts are right-aligned (left-padded) in a `[B, P]` block. Sequence b has `pad_b = P - len_b`
   padding slots; the token in slot j has rotary position `j - pad_b`, so every sequence sees the
   positions 0, 1, ... exactly as the learner's teacher-forced forward does. Padding keys are masked.
2. Prefill: one forward over `[B, P]` (causal + padding mask) fills a dense KV cache of shape
   `[B, P + T, kv_heads, head_dim]` per layer (layers unrolled, one buffer each, updated in place)
   and gives the logits of the last prompt slot.
3. Decode: a `jax.lax.while_loop` feeds the last token of every sequence at slot `P + t` (position
   `len_b + t`), attends over the cache with a key mask, samples the next token, and stops
   when every sequence hit a stop token or its token budget. `DecodeOptions` (defaults): the cache is laid out
   `[B, kv_heads, slots, head_dim]` (read by the grouped-query products without a per-step transposed copy) and
   updated in place; the loop runs in length phases (cache lengths 128·2^k above P, then P + T), the cache grown
   once per phase, so a step reads only its phase's slots; with no top-p/top-k/min-p the sampling is one argmax
   and one log-sum-exp. `LEGACY_DECODE`: the earlier loop (whole cache every step), for benchmarks.
4. Sampling: `z = logits / T`; token ~ categorical(z) (Gumbel-max with a per-sequence key
   `fold_in(fold_in(PRNGKey(seed), sample_id), t)`, so a sample does not depend on how the batch was
   chunked); logprob = `z[token] - logsumexp(z)`. `T = 0` is greedy (argmax) and then the logprob
   reported is that of the untempered distribution (`T` treated as 1), the same convention as
   levanter's `Sampler` and `policy.model.teacher_forced_logprobs`.

Math is that of levanter's Llama: RMSNorm (in float32, then cast back, then times the weight), GQA
attention with scale `1/sqrt(head_dim)`, RoPE by calling the model's own levanter rotary module (so
every rope variant levanter supports is reproduced exactly), SwiGLU MLP with the model's activation,
optional q/k norm (Qwen3), biases, tied embeddings, hybrid norms and an input-embedding norm.

Compute dtype: weights and activations in `compute_dtype` (float32 on CPU; bfloat16 on GPU halves
the bytes per decode step); norms, attention softmax and logits are computed in float32.

Shapes compiled: one executable per (batch bucket B, prompt bucket P, token bucket T, stop bucket K);
`max_tokens`, temperature, seeds and weights are runtime arguments. `DenseSampler.trace_count`
counts traces (a trace precedes every compile), for tests and logs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from policy.inference.base import NO_CONTROLS, SamplingControls
from policy.inference.dense_params import (
    DenseArch,
    UnsupportedModelError,
    activation,
    dense_arch,
    extract_params,
    fuse_projections,
    rotary_module,
)

logger = logging.getLogger(__name__)

_NEG_INF = -1e30


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """The smallest power of two >= max(n, minimum), capped at `maximum` (when given)."""
    b = _next_pow2(max(n, minimum))
    return min(b, maximum) if maximum is not None else b


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How the static sampler's decode loop computes (static: part of the compile key). Every choice samples the
    same tokens from the same PRNG streams; logprobs agree within float rounding.

    The defaults are the fast path; `LEGACY_DECODE` reproduces the decode loop as it was before (for benchmarks).
    """

    fast_sampling: bool = True
    """Sampling with no work for what is off: no top-p/top-k/min-p branch when the call's controls are off, the
    Gumbel noise only when the temperature is > 0 (else one argmax), one log-sum-exp for the chosen token's logprob."""
    head_major_cache: bool = True
    """KV cache laid out [batch, kv_heads, slots, head_dim], the layout the grouped-query attention products
    read without a transpose (False: [batch, slots, kv_heads, head_dim], the legacy layout)."""
    reduce_attention: bool = False
    """Head-major decode attention as fused multiply-and-sum reductions in float32 instead of two batched matrix
    products (an ablation: which one streams the cache faster depends on the backend)."""
    fused_projections: bool = True
    """Each layer's query/key/value projections read as one weight and its gate/up projections as one
    (`policy.inference.dense_params.fuse_projections`): two matrix products per layer fewer, each over a wider
    output, for the same values (a decode step 7–8% faster on an H200 at the 1B shape, 6% less CPU per call on CPU)."""
    length_bucket: int = 128
    """Attend over the filled part of the cache only: the decode loop runs in phases whose attention reads the
    first L slots, L = the powers of two times this value that exceed the prompt bucket, capped at the cache
    length (one loop per phase in the same program). 0: every step reads the whole cache."""


LEGACY_DECODE = DecodeOptions(fast_sampling=False, head_major_cache=False, length_bucket=0, fused_projections=False)
"""The decode loop before the decode-efficiency work (several float32 passes in sampling, whole-cache attention)."""


def phase_lengths(prompt_bucket: int, total: int, length_bucket: int) -> list[int]:
    """Cache lengths of the decode phases (ascending, the last = `total`): phase i runs the steps whose slot is
    below its length. `length_bucket` 0: one phase over the whole cache."""
    if length_bucket <= 0:
        return [total]
    out, n = [], length_bucket
    while n < total:
        if n > prompt_bucket:
            out.append(n)
        n *= 2
    return [*out, total]


# ---------------------------------------------------------------------------------------------
# the math (plain jnp)
# ---------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, p: dict[str, Any] | None, eps: float) -> jax.Array:
    """y = (x / sqrt(mean(x², -1) + eps)) computed in float32, cast back to x.dtype, then · w + b."""
    if p is None:
        return x
    xf = x.astype(jnp.float32)
    out = (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)).astype(x.dtype)
    if p["w"] is not None:
        out = p["w"] * out
    if p["b"] is not None:
        out = out + p["b"]
    return out


def _add(x: jax.Array, b: jax.Array | None) -> jax.Array:
    return x if b is None else x + b


class _Model:
    """The forward pieces, closed over the static arch, rotary module and activation."""

    def __init__(self, arch: DenseArch, rot: Any, act: Callable[[Any], Any]):
        self.arch = arch
        self.rot = rot
        self.act = act
        self.dtype = jnp.dtype(arch.compute_dtype)

    def rope(self, x: jax.Array, pos: jax.Array) -> jax.Array:
        """Levanter's rotary embedding of x [B, Q, kv_head, (group,) head] at positions pos [B, Q]."""
        head = self.rot.HeadDim.name
        names = ("b", "q", "kvh", "g", head) if x.ndim == 5 else ("b", "q", "kvh", head)
        out = self.rot(hax.named(x, names), hax.named(pos, ("b", "q")))
        return out.rearrange(names).array.astype(x.dtype)

    def qkv(self, lp: dict[str, Any], h: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        a = self.arch
        B, Q = h.shape[:2]
        K, G, hd = a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim
        if "w_qkv" in lp:
            y = _add(jnp.einsum("bqd,nd->bqn", h, lp["w_qkv"]), lp["b_qkv"])
            q, k, v = y[..., : K * G * hd], y[..., K * G * hd : (K * G + K) * hd], y[..., (K * G + K) * hd :]
        else:
            q = _add(jnp.einsum("bqd,nd->bqn", h, lp["wq"]), lp["bq"])
            k = _add(jnp.einsum("bqd,nd->bqn", h, lp["wk"]), lp["bk"])
            v = _add(jnp.einsum("bqd,nd->bqn", h, lp["wv"]), lp["bv"])
        q, k, v = q.reshape(B, Q, K, G, hd), k.reshape(B, Q, K, hd), v.reshape(B, Q, K, hd)
        if a.qk_norm:
            q = rms_norm(q, lp["q_norm"], a.norm_eps)
            k = rms_norm(k, lp["k_norm"], a.norm_eps)
        return self.rope(q, pos), self.rope(k, pos), v

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        """softmax(q·kᵀ·scale masked) · v, in float32; q [B,Q,K,G,h], k/v [B,S,K,h], mask [B,Q,S]."""
        s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) * self.arch.attn_scale
        s = jnp.where(mask[:, None, None, :, :], s, _NEG_INF)
        w = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bkgqs,bskh->bqkgh", w.astype(v.dtype), v)

    def attn_out(self, lp: dict[str, Any], o: jax.Array) -> jax.Array:
        a = self.arch
        B, Q = o.shape[:2]
        o = o.reshape(B, Q, a.num_heads * a.head_dim)
        return _add(jnp.einsum("bqm,dm->bqd", o, lp["wo"]), lp["bo"])

    def mlp_block(self, lp: dict[str, Any], x: jax.Array) -> jax.Array:
        eps = self.arch.norm_eps
        h = rms_norm(x, lp["ln2"], eps)
        if "w_gate_up" in lp:
            gu = _add(jnp.einsum("bqd,md->bqm", h, lp["w_gate_up"]), lp["b_gate_up"])
            g, u = jnp.split(gu, 2, axis=-1)
        else:
            g = _add(jnp.einsum("bqd,md->bqm", h, lp["w_gate"]), lp["b_gate"])
            u = _add(jnp.einsum("bqd,md->bqm", h, lp["w_up"]), lp["b_up"])
        m = _add(jnp.einsum("bqm,dm->bqd", self.act(g) * u, lp["w_down"]), lp["b_down"])
        m = rms_norm(m, lp["post_mlp_ln"], eps)
        return x + m

    def embed(self, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        x = jnp.take(params["embed"], tokens, axis=0)
        return rms_norm(x, params["embed_norm"], self.arch.norm_eps)

    def logits(self, params: dict[str, Any], x: jax.Array) -> jax.Array:
        """float32 logits [B, V] of final hidden states x [B, D]."""
        h = rms_norm(x, params["final_norm"], self.arch.norm_eps)
        w = params["embed"] if params["lm_head"] is None else params["lm_head"]
        return jnp.einsum("bd,vd->bv", h, w, preferred_element_type=jnp.float32)

    def prefill(
        self, params: dict[str, Any], tokens: jax.Array, pos: jax.Array, mask: jax.Array, total: int
    ) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
        """Hidden state of the last slot [B, D] and per-layer caches [B, total, K, h] holding slots 0..P-1."""
        eps = self.arch.norm_eps
        x = self.embed(params, tokens)
        P = tokens.shape[1]
        pad = ((0, 0), (0, total - P), (0, 0), (0, 0))
        k_caches, v_caches = [], []
        for lp in params["layers"]:
            h = rms_norm(x, lp["ln1"], eps)
            q, k, v = self.qkv(lp, h, pos)
            o = self.attn_out(lp, self.attend(q, k, v, mask))
            x = x + rms_norm(o, lp["post_attn_ln"], eps)
            x = self.mlp_block(lp, x)
            k_caches.append(jnp.pad(k, pad))
            v_caches.append(jnp.pad(v, pad))
        return x[:, -1], k_caches, v_caches

    def decode_step(
        self,
        params: dict[str, Any],
        token: jax.Array,
        pos: jax.Array,
        slot: jax.Array,
        key_mask: jax.Array,
        k_caches: list[jax.Array],
        v_caches: list[jax.Array],
        *,
        head_major: bool = False,
        reduce: bool = False,
    ) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
        """One token per sequence (token [B], pos [B]) written at cache `slot` (one slot for all rows, or each
        row's own [B]); returns hidden [B, D]. Caches are [B, L, K, h] (key_mask [B, L]), or with `head_major`
        [B, K, L, h]: the new keys/values are then written in place and attention reads the L slots of the cache as
        it is (no transposed copy; `reduce`: see `DecodeOptions.reduce_attention`)."""
        eps = self.arch.norm_eps
        x = self.embed(params, token[:, None])
        pos2 = pos[:, None]
        mask = key_mask if head_major else key_mask[:, None, :]
        new_k, new_v = [], []
        for lp, kc, vc in zip(params["layers"], k_caches, v_caches, strict=True):
            h = rms_norm(x, lp["ln1"], eps)
            q, k, v = self.qkv(lp, h, pos2)
            if head_major:
                kc = write_slot(kc, k.transpose(0, 2, 1, 3), slot, 2)
                vc = write_slot(vc, v.transpose(0, 2, 1, 3), slot, 2)
                a = self.attend_cache(q, kc, vc, mask, reduce)
            else:
                kc, vc = write_slot(kc, k, slot, 1), write_slot(vc, v, slot, 1)
                a = self.attend(q, kc, vc, mask)
            x = x + rms_norm(self.attn_out(lp, a), lp["post_attn_ln"], eps)
            x = self.mlp_block(lp, x)
            new_k.append(kc)
            new_v.append(vc)
        return x[:, 0], new_k, new_v

    def attend_cache(
        self, q: jax.Array, kc: jax.Array, vc: jax.Array, mask: jax.Array, reduce: bool = False
    ) -> jax.Array:
        """`attend` for one query per sequence over a head-major cache: q [B,1,K,G,h], kc/vc [B,K,L,h], mask
        [B,L] -> [B,1,K,G,h]. Grouped-query: the G query heads of a kv head read its keys once (no repeat).
        `reduce`: the products as float32 multiply-and-sum reductions (see `DecodeOptions.reduce_attention`)."""
        if reduce:
            qf = q[:, 0].astype(jnp.float32)[:, :, :, None, :]  # [B,K,G,1,h]
            s = jnp.sum(qf * kc.astype(jnp.float32)[:, :, None], axis=-1) * self.arch.attn_scale
        else:
            s = jnp.einsum("bkgh,bklh->bkgl", q[:, 0], kc, preferred_element_type=jnp.float32) * self.arch.attn_scale
        s = jnp.where(mask[:, None, None, :], s, _NEG_INF)
        w = jax.nn.softmax(s, axis=-1)
        if reduce:
            return jnp.sum(w[..., None] * vc.astype(jnp.float32)[:, :, None], axis=3).astype(vc.dtype)[:, None]
        return jnp.einsum("bkgl,bklh->bkgh", w.astype(vc.dtype), vc)[:, None]


def write_slot(cache: jax.Array, new: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    """`cache` with `new` (one slot per row: size 1 on `axis`) written at slot `slot` on `axis` (1 or 2): the same
    slot for every row (a scalar: a dynamic-update-slice) or each row's own (`slot` [B]: a scatter with unique
    indices, continuous batching). XLA runs both in place on a loop-carried cache (tests/test_decode_efficiency.py)."""
    new = new.astype(cache.dtype)
    if jnp.ndim(slot) == 0:
        return jax.lax.dynamic_update_slice_in_dim(cache, new, slot, axis=axis)
    rows = jnp.arange(cache.shape[0], dtype=jnp.int32)
    one = jnp.squeeze(new, axis)
    if axis == 1:
        return cache.at[rows, slot].set(one, unique_indices=True)
    return cache.at[rows, :, slot].set(one, unique_indices=True)


def truncate_logits(z: jax.Array, top_p: jax.Array, top_k: jax.Array, min_p: jax.Array) -> jax.Array:
    """`z` [B, V] with the tokens that top-k / top-p / min-p exclude set to -inf (the rules of
    `policy.inference.base.SamplingControls`; `top_k = 0`, `top_p = 1`, `min_p = 0` switch a rule off)."""
    V = z.shape[-1]
    probs = jax.nn.softmax(z.astype(jnp.float32), axis=-1)
    desc = -jnp.sort(-probs, axis=-1)  # [B, V], most probable first
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V).astype(jnp.int32)
    kth = jax.lax.dynamic_index_in_dim(desc, k - 1, axis=-1, keepdims=True)  # [B, 1]
    # top-p: sorted token i is kept while the mass before it is < top_p (so at least one token)
    before = jnp.cumsum(desc, axis=-1) - desc
    n_p = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)
    pth = jnp.take_along_axis(desc, n_p - 1, axis=-1)
    threshold = jnp.maximum(jnp.maximum(kth, pth), min_p * desc[:, :1])
    keep = (probs >= threshold) | (probs >= desc[:, :1])
    return jnp.where(keep, z, -jnp.inf)


def _per_row(x: jax.Array) -> jax.Array:
    """A per-row [B] value as a column [B, 1] (broadcasts against [B, V]); a scalar as it is."""
    return x[:, None] if jnp.ndim(x) == 1 else x


def _step_keys(seq_keys: jax.Array, t: jax.Array) -> jax.Array:
    """Each row's key for token t: fold_in(seq_key, t), with t one index for all rows (scalar) or per row [B]."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None if jnp.ndim(t) == 0 else 0))(seq_keys, t)


def sample_tokens_fast(
    logits: jax.Array, temperature: jax.Array, seq_keys: jax.Array, t: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`sample_tokens` without controls, in fewer passes over the vocabulary: the same tokens (argmax of z plus the
    Gumbel noise `jax.random.categorical` draws with the same keys; of z alone when T = 0, where z = logits) from
    one argmax, no branch, and the same logprob z[token] - logsumexp(z) from one max and one sum of exponentials.
    `temperature` and `t` are scalars or per row [B] (continuous batching: each slot its own sequence's)."""
    temperature = _per_row(temperature)
    safe_t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    z = logits / safe_t
    step_keys = _step_keys(seq_keys, t)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, z.shape[-1:], z.dtype))(step_keys)
    tok = jnp.argmax(jnp.where(temperature > 0, z + noise, z), axis=-1).astype(jnp.int32)
    top = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(z - top), axis=-1)) + top[:, 0]
    chosen = jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0]
    return tok, chosen - lse


def sample_tokens(
    logits: jax.Array,
    temperature: jax.Array,
    seq_keys: jax.Array,
    t: jax.Array,
    controls: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(tokens [B], logprobs [B]): z = logits / T; token ~ categorical(z truncated by `controls` = (top_p,
    top_k, min_p), see `truncate_logits`) (argmax when T = 0); logprob = z[token] - logsumexp(z) of the
    untruncated z, with T treated as 1 when T = 0. `temperature` and `t` are scalars or per row [B]."""
    safe_t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    z = logits / _per_row(safe_t)
    step_keys = _step_keys(seq_keys, t)
    if controls is None:
        zs = z
    else:
        top_p, top_k, min_p = controls
        active = (top_p < 1.0) | (top_k > 0) | (min_p > 0.0)
        zs = jax.lax.cond(active, lambda: truncate_logits(z, top_p, top_k, min_p), lambda: z)
    sampled = jax.vmap(jax.random.categorical)(step_keys, zs)
    tok = jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    chosen = jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0]
    return tok, chosen - jax.nn.logsumexp(z, axis=-1)


# ---------------------------------------------------------------------------------------------
# the sampler
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DenseOutput:
    """Host arrays for one padded batch: tokens/logprobs [B, T] (valid up to lengths[b]), stopped [B]."""

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray


class DenseSampler:
    """Compiled prefill + decode for one model structure; weights are runtime arguments.

    Promises: `generate` runs one device call per batch (no per-token host round trips); the same
    (B, P, T, K) shapes never trace twice; `update_params` with a model of the same structure never
    retraces; tokens are sampled and scored exactly as in the module docstring.
    """

    def __init__(
        self,
        model: Any,
        compute_dtype: str = "float32",
        *,
        fast_compile: bool = False,
        decode: DecodeOptions | None = None,
    ):
        """`fast_compile`: ask XLA for its lowest backend optimisation level (about half the CPU compile
        time, slower execution; meant for tests). `decode`: how the decode loop computes (None: the defaults
        of `DecodeOptions`, the fast path)."""
        self.decode = decode or DecodeOptions()
        self.arch = dense_arch(model, compute_dtype)
        self._m = _Model(self.arch, rotary_module(model), activation(model))
        self.params = self.extract(model)
        self.trace_count = 0
        self.prefill_tokens = 0
        """Prompt-slot tokens run through prefill so far, padding included (batch bucket × prompt bucket per call)."""
        self.fast_compile = fast_compile
        options = {"xla_backend_optimization_level": 0} if fast_compile else None
        self._jitted = jax.jit(self._generate_impl, static_argnames=("max_new", "truncate"), compiler_options=options)

    def compatible(self, model: Any) -> bool:
        """True if `model` has this sampler's structure (its weights can be swapped in without a recompile)."""
        try:
            return dense_arch(model, self.arch.compute_dtype) == self.arch and rotary_module(model) == self._m.rot
        except UnsupportedModelError:
            return False

    def extract(self, model: Any) -> dict[str, Any]:
        """`model`'s weights as this sampler's calls take them (`extract_params`, fused per `decode`)."""
        params = extract_params(model, self.arch.compute_dtype)
        return fuse_projections(params) if self.decode.fused_projections else params

    def update_params(self, model: Any) -> None:
        """Use `model`'s weights from the next call on (the caller checked `compatible`)."""
        self.params = self.extract(model)

    def _generate_impl(
        self,
        params: dict[str, Any],
        tokens: jax.Array,
        lens: jax.Array,
        limits: jax.Array,
        active: jax.Array,
        base_key: jax.Array,
        sample_ids: jax.Array,
        stop_ids: jax.Array,
        temperature: jax.Array,
        controls: tuple[jax.Array, jax.Array, jax.Array],
        *,
        max_new: int,
        truncate: bool = True,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The prefill and decode loop of `self.decode` (one compiled program per shape).

        Length phases: the caches are allocated at the first phase length and grown (one copy per phase, not per
        step) when the next slot would not fit, so a step reads only the slots of the current phase.
        `LEGACY_DECODE` (slot-major cache, one phase over the whole cache, the full sampling path) is the earlier
        loop step for step: same operations, so the same tokens bit for bit."""
        self.trace_count += 1
        T = max_new
        logger.info("dense sampler: tracing batch=%d prompt=%d new=%d stops=%d", *tokens.shape, T, stop_ids.shape[0])
        opts = self.decode
        m = self._m
        B, P = tokens.shape
        S = P + T
        lengths = phase_lengths(P, S, opts.length_bucket)
        seq_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base_key, sample_ids)
        pad = P - lens
        slots = jnp.arange(P, dtype=jnp.int32)
        pos = jnp.maximum(slots[None, :] - pad[:, None], 0)
        key_valid_p = slots[None, :] >= pad[:, None]  # [B, P]
        causal = slots[:, None] >= slots[None, :]
        mask = (causal[None] & key_valid_p[:, None, :]) | jnp.eye(P, dtype=bool)[None]
        h, k_caches, v_caches = m.prefill(params, tokens, pos, mask, lengths[0])
        slot_axis = 2 if opts.head_major_cache else 1
        if opts.head_major_cache:
            k_caches = [k.transpose(0, 2, 1, 3) for k in k_caches]
            v_caches = [v.transpose(0, 2, 1, 3) for v in v_caches]
        key_valid = jnp.concatenate([key_valid_p, jnp.zeros((B, T), bool)], axis=1)
        all_slots = jnp.arange(S, dtype=jnp.int32)

        def sample(logits: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
            if truncate or not opts.fast_sampling:
                return sample_tokens(logits, temperature, seq_keys, t, controls)
            return sample_tokens_fast(logits, temperature, seq_keys, t)

        def phase(length: int, state: tuple) -> tuple:
            # the steps whose slot P + t is below `length`, over caches of `length` slots
            def cond(state: tuple) -> jax.Array:
                t, _, done, *_ = state
                return (t < length - P) & jnp.any(~done)

            def body(state: tuple) -> tuple:
                # sample token t from the carried logits, record it, then feed it (one sampling site keeps
                # the compiled program small; the feed after the last token is one wasted step per call)
                t, logits, done, stopped, n_gen, out_tok, out_lp, kcs, vcs = state
                tok, lp = sample(logits, t)
                live = ~done
                out_tok = jax.lax.dynamic_update_slice_in_dim(out_tok, jnp.where(live, tok, -1)[:, None], t, 1)
                out_lp = jax.lax.dynamic_update_slice_in_dim(out_lp, jnp.where(live, lp, 0.0)[:, None], t, 1)
                n_gen = n_gen + live.astype(jnp.int32)
                stopped = stopped | (live & jnp.any(tok[:, None] == stop_ids[None, :], axis=-1))
                done = done | stopped | (n_gen >= limits)
                slot = P + t
                cols = all_slots[None, :length]
                key_mask = key_valid[:, :length] | ((cols >= P) & (cols <= slot))
                h, kcs, vcs = m.decode_step(
                    params,
                    tok,
                    lens + t,
                    slot,
                    key_mask,
                    kcs,
                    vcs,
                    head_major=opts.head_major_cache,
                    reduce=opts.reduce_attention,
                )
                return t + 1, m.logits(params, h), done, stopped, n_gen, out_tok, out_lp, kcs, vcs

            return jax.lax.while_loop(cond, body, state)  # type: ignore[no-any-return]

        def grow(caches: list[jax.Array], length: int) -> list[jax.Array]:
            widths = [(0, 0)] * 4
            widths[slot_axis] = (0, length - caches[0].shape[slot_axis])
            return [jnp.pad(c, widths) for c in caches]

        out_tok = jnp.full((B, T), -1, jnp.int32)
        out_lp = jnp.zeros((B, T), jnp.float32)
        n_gen = jnp.zeros((B,), jnp.int32)
        done = ~active | (limits <= 0)
        stopped = jnp.zeros((B,), bool)
        state: tuple = (jnp.int32(0), m.logits(params, h), done, stopped, n_gen, out_tok, out_lp, k_caches, v_caches)
        for i, length in enumerate(lengths):
            if i > 0:
                state = (*state[:7], grow(state[7], length), grow(state[8], length))
            state = phase(length, state)
        _, _, _, stopped, n_gen, out_tok, out_lp, _, _ = state
        return out_tok, out_lp, n_gen, stopped

    def generate(
        self,
        prompts: list[list[int]],
        sample_ids: list[int],
        *,
        batch_size: int,
        max_tokens: list[int],
        max_new_bucket: int,
        stop_tokens: list[int],
        temperature: float,
        seed: int,
        controls: SamplingControls = NO_CONTROLS,
    ) -> DenseOutput:
        """Sample one continuation per prompt (len(prompts) <= batch_size) in one device call.

        `sample_ids[i]` names the PRNG stream of row i; `max_tokens[i]` (<= max_new_bucket) is its budget.
        The batch is padded to `batch_size` rows and prompts to a power-of-two length bucket.
        """
        n = len(prompts)
        if n == 0 or n > batch_size:
            raise ValueError(f"batch of {n} prompts for a batch bucket of {batch_size}")
        P = bucket(max(len(p) for p in prompts), minimum=8)
        tokens = np.zeros((batch_size, P), np.int32)
        lens = np.ones((batch_size,), np.int32)
        limits = np.ones((batch_size,), np.int32)
        active = np.zeros((batch_size,), bool)
        ids = np.zeros((batch_size,), np.uint32)
        for i, p in enumerate(prompts):
            tokens[i, P - len(p) :] = p
            lens[i] = len(p)
            limits[i] = max_tokens[i]
            active[i] = True
            ids[i] = sample_ids[i]
        K = bucket(len(stop_tokens), minimum=4)
        stops = np.full((K,), -1, np.int32)
        stops[: len(stop_tokens)] = stop_tokens
        # host inputs go in by device_put, not jnp.asarray / jnp.float32: those compile a small program per shape
        # at each process start; the per-row keys are folded inside the compiled program for the same reason
        host = (tokens, lens, limits, active, jax.random.PRNGKey(seed), ids, stops, np.float32(temperature))
        controls_host = (np.float32(controls.top_p), np.int32(controls.top_k), np.float32(controls.min_p))
        out = self._jitted(
            self.params,
            *jax.device_put(host),
            jax.device_put(controls_host),
            max_new=max_new_bucket,
            truncate=not controls.is_default or not self.decode.fast_sampling,
        )
        self.prefill_tokens += batch_size * P
        out_tok, out_lp, n_gen, stopped = jax.device_get(out)
        return DenseOutput(np.asarray(out_tok), np.asarray(out_lp), np.asarray(n_gen), np.asarray(stopped))
