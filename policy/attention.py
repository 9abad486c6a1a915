"""Fused attention for the learner: levanter's causal attention computed by `jax.nn.dot_product_attention`.

`model.attention_backend: cudnn` routes the learner's forward passes (train step, pre-update and reference
logprobs) through JAX's fused attention: cuDNN's flash-attention kernel on NVIDIA GPUs, XLA's implementation of
the same function elsewhere (so the path is exercised on CPU too). Packed rows keep their segments: the
segment mask is passed as an additive bias ([batch, 1, q, k], 0 or a large negative number) next to the causal
flag, so a token never attends across sequences. On cuDNN, float32 queries/keys/values are computed in bfloat16
(the kernel takes 16-bit inputs only); the output is cast back.

Only what the fused function computes is routed: causal masks with optional segments, no explicit mask, no
sliding window, no causal offset, no attention bias, sink, soft cap or dropout. Anything else (another model
family's attention variant) runs levanter's own backend unchanged, logged once.

The routing is scoped: `fused_attention(kind)` is a context manager active while a function is traced, and
levanter's attention is wrapped once per process (idempotent) to consult it; outside the context every model
computes exactly as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

FUSED_BACKENDS = ("cudnn",)
"""`model.attention_backend` values served by this module (not levanter's `AttentionBackend`)."""

_ACTIVE: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlpipe_fused_attention", default=None)
_WARNED: set[str] = set()
_AXES = {"kv_head", "q_heads_per_group", "position", "head_size"}


def implementation_for(kind: str) -> str:
    """The `jax.nn.dot_product_attention` implementation of backend `kind` on this process's devices."""
    if kind == "cudnn" and jax.devices()[0].platform == "gpu":
        return "cudnn"
    return "xla"


@contextlib.contextmanager
def fused_attention(kind: str | None) -> Iterator[None]:
    """While active (during tracing), levanter attention calls that the fused function can compute use it.

    `kind` None or a levanter backend name: no effect."""
    if kind not in FUSED_BACKENDS:
        yield
        return
    install()
    token = _ACTIVE.set(implementation_for(kind))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def install() -> None:
    """Wrap `levanter.layers.attention.dot_product_attention` so that it consults `fused_attention` (once)."""
    import levanter.layers.attention as A

    if getattr(A.dot_product_attention, "_rlpipe_fused", False):
        return
    original = A.dot_product_attention

    def dot_product_attention(
        QPos: Any, KPos: Any, Key: Any, query: Any, key: Any, value: Any, *a: Any, **kw: Any
    ) -> Any:
        implementation = _ACTIVE.get()
        if implementation is None:
            return original(QPos, KPos, Key, query, key, value, *a, **kw)
        why = _unsupported(QPos, KPos, Key, query, a, kw)
        if why:
            if why not in _WARNED:
                _WARNED.add(why)
                logger.warning("fused attention not used for this call (%s): levanter's backend computes it", why)
            return original(QPos, KPos, Key, query, key, value, *a, **kw)
        mask = a[0] if a else kw.get("mask")
        return _fused(query, key, value, mask, kw.get("scaling_factor"), implementation)

    dot_product_attention._rlpipe_fused = True  # type: ignore[attr-defined]
    A.dot_product_attention = dot_product_attention


def _unsupported(QPos: Any, KPos: Any, Key: Any, query: Any, args: tuple, kw: dict[str, Any]) -> str | None:
    """Why the fused function cannot compute this call (None: it can)."""
    import levanter.layers.attention as A

    mask = args[0] if args else kw.get("mask")
    bias = args[1] if len(args) > 1 else kw.get("bias")
    if (QPos, KPos, Key) != ("position", "key_position", "head_size"):
        return f"axes {QPos}/{KPos}/{Key}"
    names = {ax.name for ax in query.axes}
    if not names >= _AXES or len(names - _AXES) != 1:
        return f"query axes {sorted(names)}"
    if not isinstance(mask, A.AttentionMask) or not mask.is_causal:
        return "not a causal AttentionMask"
    if mask.causal_offset is not None or mask.explicit_mask is not None or mask.sliding_window is not None:
        return "causal offset, explicit mask or sliding window"
    if bias is not None or kw.get("logits_soft_cap") is not None or kw.get("attn_sink") is not None:
        return "attention bias, soft cap or sink"
    if kw.get("dropout", 0.0):
        return "dropout"
    return None


def _fused(query: Any, key: Any, value: Any, mask: Any, scale: float | None, implementation: Any) -> Any:
    """levanter's attention output (query's axes) from `jax.nn.dot_product_attention`."""
    (batch,) = [ax.name for ax in query.axes if ax.name not in _AXES]
    q = query.rearrange((batch, "position", "kv_head", "q_heads_per_group", "head_size"))
    k = key.rearrange((batch, "key_position", "kv_head", "head_size")).array
    v = value.rearrange((batch, "key_position", "kv_head", "head_size")).array
    B, T, K, G, H = q.array.shape
    dtype = q.dtype
    if implementation == "cudnn" and dtype not in (jnp.bfloat16, jnp.float16):
        dtype = jnp.bfloat16  # the cuDNN kernel takes 16-bit inputs only
    bias = None
    if mask.segment_ids is not None:
        q_seg, k_seg = mask.segment_ids
        qs, ks = (seg.array if seg.axes[0].name == batch else seg.array.T for seg in (q_seg, k_seg))  # [B, pos]
        same = qs[:, None, :, None] == ks[:, None, None, :]
        bias = jnp.where(same, 0.0, jnp.finfo(dtype).min / 2).astype(dtype)
    out = jax.nn.dot_product_attention(
        q.array.reshape(B, T, K * G, H).astype(dtype),  # query head k·G + g uses kv head k (GQA)
        k.astype(dtype),
        v.astype(dtype),
        bias=bias,
        is_causal=True,
        scale=scale,
        implementation=implementation,
    )
    return hax.named(out.reshape(B, T, K, G, H).astype(q.dtype), q.axes)
