"""Continuous batching with shared group prefixes for the dense sampler (`inference.continuous_batching: true`).

What it reads: the compiled math and the weights of a `policy.inference.dense_sampler.DenseSampler` (so
`update_params` there applies here too, without a recompile). What it writes: nothing; `ContinuousSampler.run`
returns each sequence's tokens and logprobs as numpy arrays.

Algorithm (a host scheduler over three compiled programs of fixed shapes):

- State on the device: `slots` sequences, each with its own KV cache rows `[L, kv_heads, head_dim]` per layer
  (left-aligned: cache index = rotary position), its next position, tokens generated, token budget, stop tokens,
  temperature and PRNG stream, plus the logits it samples its next token from.
- `prefill` (one program per prompt-length bucket Pb): the prompt right-aligned in `[1, Pb]` exactly as the static
  sampler lays it out, giving its KV (rolled so that cache index = position) and the logits of its last token.
- `insert` (one program per Pb): copies one prefilled prompt's KV and logits into any subset of the free slots
  (a scatter whose unused indices are dropped). The n samples of a prompt share one prefill: the prompt's KV is
  prefilled once and copied into each sample's slot (`prefill_tokens` counts the prompt tokens prefilled).
- `decode` (one program): a `while_loop` of decode steps over all slots (token t of a sequence is sampled from
  its carried logits with key `fold_in(fold_in(PRNGKey(seed), sample_id), t)`, the static sampler's stream, then
  fed at its own position) that returns to the host as soon as a sequence finishes while others wait in the queue
  (else when all are done). The host then reads the finished sequences and refills their slots from the queue.

So a finished sequence's slot is refilled at the next decode step instead of idling until the longest sequence of
its batch ends. Samples are those of the static sampler: the same per-sequence PRNG streams and the same math
(greedy tokens identical; logprobs equal within float rounding, since only the cache layout differs).

Shapes compiled: prefill per Pb; insert per (Pb, slots, L, K); decode per (slots, L, T, K); L = bucket(longest prompt) +
T, T = bucket(largest budget) >= 16 and K = bucket(stop tokens) >= 4, as the static path buckets them. Refilling
slots never compiles; `trace_count` counts traces.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from policy.inference.base import NO_CONTROLS, SamplingControls
from policy.inference.dense_sampler import DenseSampler, bucket, rms_norm, truncate_logits

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SeqRequest:
    """One sequence to sample: its prompt, token budget (>= 1), PRNG id, and seed."""

    prompt: Sequence[int]
    max_tokens: int
    sample_id: int
    seed: int


@dataclasses.dataclass(frozen=True)
class SeqResult:
    """Tokens and their logprobs (float32) of one sequence, and whether it ended on a stop token."""

    tokens: np.ndarray
    logprobs: np.ndarray
    stopped: bool


def _sample(
    logits: jax.Array,
    temperature: jax.Array,
    seq_keys: jax.Array,
    t: jax.Array,
    controls: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """`dense_sampler.sample_tokens` with a per-sequence temperature [S] and token index t [S] (so each slot
    follows its own sequence's PRNG stream): the same keys, truncation and logprob convention."""
    safe_t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)[:, None]
    z = logits / safe_t
    step_keys = jax.vmap(jax.random.fold_in)(seq_keys, t)
    top_p, top_k, min_p = controls
    active = (top_p < 1.0) | (top_k > 0) | (min_p > 0.0)
    zs = jax.lax.cond(active, lambda: truncate_logits(z, top_p, top_k, min_p), lambda: z)
    sampled = jax.vmap(jax.random.categorical)(step_keys, zs)
    tok = jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    chosen = jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0]
    return tok, chosen - jax.nn.logsumexp(z, axis=-1)


class ContinuousSampler:
    """Continuous batching over a `DenseSampler`'s model and weights (see the module docstring).

    Promises: `run` returns one `SeqResult` per request, in order, sampled as the static `DenseSampler.generate`
    samples it (same PRNG stream per sample id and seed); the three programs compile once per shape bucket and
    never again as slots refill or weights change; a prompt shared by several requests of one `run` is prefilled
    once (`prefill_tokens` counts padded prompt tokens through prefill, `decode_steps` counts decode steps).
    """

    def __init__(self, dense: DenseSampler):
        self.dense = dense
        self._m = dense._m
        self.trace_count = 0
        self.prefill_tokens = 0
        self.decode_steps = 0
        options = {"xla_backend_optimization_level": 0} if dense.fast_compile else None
        self._prefill = jax.jit(self._prefill_impl, compiler_options=options)
        self._insert = jax.jit(self._insert_impl, donate_argnums=(0,), compiler_options=options)
        self._decode = jax.jit(self._decode_impl, donate_argnums=(1,), compiler_options=options)

    # -- the compiled programs ---------------------------------------------------------------

    def _prefill_impl(
        self, params: dict[str, Any], tokens: jax.Array, plen: jax.Array
    ) -> tuple[list[jax.Array], list[jax.Array], jax.Array]:
        """KV [Pb, K, h] per layer with cache index = position (junk past plen) and the last token's logits [V]."""
        self.trace_count += 1
        P = tokens.shape[1]
        logger.info("continuous sampler: tracing prefill prompt=%d", P)
        pad = P - plen
        slots = jnp.arange(P, dtype=jnp.int32)
        pos = jnp.maximum(slots - pad, 0)[None, :]
        key_valid = (slots >= pad)[None, :]
        causal = slots[:, None] >= slots[None, :]
        mask = (causal[None] & key_valid[:, None, :]) | jnp.eye(P, dtype=bool)[None]
        h, ks, vs = self._m.prefill(params, tokens, pos, mask, P)
        ks = [jnp.roll(k[0], -pad, axis=0) for k in ks]
        vs = [jnp.roll(v[0], -pad, axis=0) for v in vs]
        return ks, vs, self._m.logits(params, h)[0]

    def _insert_impl(
        self,
        state: dict[str, Any],
        ks: list[jax.Array],
        vs: list[jax.Array],
        logits: jax.Array,
        plen: jax.Array,
        slot_idx: jax.Array,
        limits: jax.Array,
        seeds: jax.Array,
        sample_ids: jax.Array,
        temperature: jax.Array,
        stops: jax.Array,
    ) -> dict[str, Any]:
        """Start one sequence of this prompt in each slot named by `slot_idx` [S] (index S: unused, dropped);
        `limits`, `seeds`, `sample_ids` are [S] aligned with `slot_idx`, `temperature` and `stops` [K] shared."""
        self.trace_count += 1
        S = state["pos"].shape[0]
        P = ks[0].shape[0]
        logger.info("continuous sampler: tracing insert slots=%d prompt=%d", S, P)

        def put(a: jax.Array, v: jax.Array) -> jax.Array:
            return a.at[slot_idx].set(v, mode="drop")

        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, sample_ids)
        n = slot_idx.shape[0]
        return {
            "k": [
                kc.at[slot_idx, :P].set(jnp.broadcast_to(k, (n, *k.shape)), mode="drop")
                for kc, k in zip(state["k"], ks, strict=True)
            ],
            "v": [
                vc.at[slot_idx, :P].set(jnp.broadcast_to(v, (n, *v.shape)), mode="drop")
                for vc, v in zip(state["v"], vs, strict=True)
            ],
            "logits": put(state["logits"], jnp.broadcast_to(logits, (n, logits.shape[0]))),
            "pos": put(state["pos"], jnp.broadcast_to(plen, (n,))),
            "n_gen": put(state["n_gen"], jnp.zeros((n,), jnp.int32)),
            "limits": put(state["limits"], limits),
            "done": put(state["done"], jnp.zeros((n,), bool)),
            "stopped": put(state["stopped"], jnp.zeros((n,), bool)),
            "keys": put(state["keys"], keys),
            "temp": put(state["temp"], jnp.broadcast_to(temperature, (n,))),
            "stops": put(state["stops"], jnp.broadcast_to(stops, (n, stops.shape[0]))),
            "out_tok": state["out_tok"],
            "out_lp": state["out_lp"],
        }

    def _decode_impl(
        self,
        params: dict[str, Any],
        state: dict[str, Any],
        stop_on_finish: jax.Array,
        controls: tuple[jax.Array, jax.Array, jax.Array],
    ) -> tuple[dict[str, Any], jax.Array]:
        """Decode steps over all slots until a sequence finishes (when `stop_on_finish`) or all are done."""
        self.trace_count += 1
        S, T = state["out_tok"].shape
        L = state["k"][0].shape[1]
        logger.info("continuous sampler: tracing decode slots=%d cache=%d new=%d", S, L, T)
        m = self._m
        rows = jnp.arange(S, dtype=jnp.int32)
        cache_idx = jnp.arange(L, dtype=jnp.int32)

        def cond(carry: tuple[dict[str, Any], jax.Array, jax.Array]) -> jax.Array:
            st, finished, _ = carry
            return jnp.any(~st["done"]) & ~(stop_on_finish & finished)

        def body(carry: tuple[dict[str, Any], jax.Array, jax.Array]) -> tuple[dict[str, Any], jax.Array, jax.Array]:
            st, finished, steps = carry
            live = ~st["done"]
            tok, lp = _sample(st["logits"], st["temp"], st["keys"], st["n_gen"], controls)
            at = jnp.where(live, st["n_gen"], T)  # index T: out of bounds, dropped
            out_tok = st["out_tok"].at[rows, at].set(tok, mode="drop")
            out_lp = st["out_lp"].at[rows, at].set(lp, mode="drop")
            n_gen = st["n_gen"] + live.astype(jnp.int32)
            stopped = st["stopped"] | (live & jnp.any(tok[:, None] == st["stops"], axis=-1))
            newly = live & (stopped | (n_gen >= st["limits"]))
            # feed the token at each sequence's own position (a finished slot writes harmlessly: a new sequence
            # overwrites or masks every cache entry before it reads it)
            pos = jnp.minimum(st["pos"], L - 1)
            x = m.embed(params, tok[:, None])
            key_mask = (cache_idx[None, :] <= pos[:, None])[:, None, :]
            eps = m.arch.norm_eps
            new_k, new_v = [], []
            for lp_, kc, vc in zip(params["layers"], st["k"], st["v"], strict=True):
                h = rms_norm(x, lp_["ln1"], eps)
                q, k, v = m.qkv(lp_, h, pos[:, None])
                kc = kc.at[rows, pos].set(k[:, 0].astype(kc.dtype))
                vc = vc.at[rows, pos].set(v[:, 0].astype(vc.dtype))
                o = m.attn_out(lp_, m.attend(q, kc, vc, key_mask))
                x = x + rms_norm(o, lp_["post_attn_ln"], eps)
                x = m.mlp_block(lp_, x)
                new_k.append(kc)
                new_v.append(vc)
            new = {
                **st,
                "k": new_k,
                "v": new_v,
                "logits": m.logits(params, x[:, 0]),
                "pos": st["pos"] + live.astype(jnp.int32),
                "n_gen": n_gen,
                "done": st["done"] | newly,
                "stopped": stopped,
                "out_tok": out_tok,
                "out_lp": out_lp,
            }
            return new, finished | jnp.any(newly), steps + 1

        state, _, steps = jax.lax.while_loop(cond, body, (state, jnp.bool_(False), jnp.int32(0)))
        return state, steps

    # -- the host scheduler ------------------------------------------------------------------

    def _empty_state(self, S: int, L: int, T: int, K: int) -> dict[str, Any]:
        a = self.dense.arch
        dtype = jnp.dtype(a.compute_dtype)
        shape = (S, L, a.num_kv_heads, a.head_dim)
        host = {
            "k": [np.zeros(shape, dtype) for _ in range(a.num_layers)],
            "v": [np.zeros(shape, dtype) for _ in range(a.num_layers)],
            "logits": np.zeros((S, a.vocab_size), np.float32),
            "pos": np.zeros((S,), np.int32),
            "n_gen": np.zeros((S,), np.int32),
            "limits": np.ones((S,), np.int32),
            "done": np.ones((S,), bool),
            "stopped": np.zeros((S,), bool),
            "keys": np.zeros((S, 2), np.uint32),
            "temp": np.zeros((S,), np.float32),
            "stops": np.full((S, K), -1, np.int32),
            "out_tok": np.full((S, T), -1, np.int32),
            "out_lp": np.zeros((S, T), np.float32),
        }
        # device_put, not jnp: no small per-shape programs to compile (see DenseSampler.generate)
        return jax.device_put(host)  # type: ignore[no-any-return]

    def run(
        self,
        requests: Sequence[SeqRequest],
        *,
        slots: int,
        stop_tokens: Sequence[int],
        temperature: float,
        controls: SamplingControls = NO_CONTROLS,
        share_prefixes: bool = True,
    ) -> list[SeqResult]:
        """Sample every request with at most `slots` sequences in flight; one `SeqResult` per request, in order.

        Requests with the same prompt (the n samples of a group) share one prefill (`share_prefixes=False`: each
        request is prefilled on its own, for comparison). Raises ValueError for an empty request list, an empty
        prompt or a budget < 1.
        """
        if not requests:
            raise ValueError("no requests")
        if any(len(r.prompt) == 0 or r.max_tokens < 1 for r in requests):
            raise ValueError("every request needs a non-empty prompt and max_tokens >= 1")
        S = bucket(min(slots, len(requests)))
        T = bucket(max(r.max_tokens for r in requests), minimum=16)
        L = bucket(max(len(r.prompt) for r in requests), minimum=8) + T
        K = bucket(len(stop_tokens), minimum=4)
        stops = np.full((K,), -1, np.int32)
        stops[: len(stop_tokens)] = list(stop_tokens)
        params = self.dense.params
        ctrl = jax.device_put((np.float32(controls.top_p), np.int32(controls.top_k), np.float32(controls.min_p)))
        shared = jax.device_put((np.float32(temperature), stops))

        groups: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(tuple(int(t) for t in r.prompt), []).append(i)
        queue: deque[tuple[tuple[int, ...], list[int]]] = (
            deque(groups.items())
            if share_prefixes
            else deque((tuple(int(t) for t in r.prompt), [i]) for i, r in enumerate(requests))
        )
        prefilled: tuple[Any, Any, Any, Any] | None = None  # (ks, vs, logits, plen) of queue[0]

        state = self._empty_state(S, L, T, K)
        free = list(range(S))
        owner: dict[int, int] = {}  # slot -> request index
        results: list[SeqResult | None] = [None] * len(requests)
        while queue or owner:
            while free and queue:
                prompt, members = queue[0]
                if prefilled is None:
                    Pb = bucket(len(prompt), minimum=8)
                    toks = np.zeros((1, Pb), np.int32)
                    toks[0, Pb - len(prompt) :] = prompt
                    plen = np.int32(len(prompt))
                    ks, vs, logits = self._prefill(params, *jax.device_put((toks, plen)))
                    self.prefill_tokens += Pb
                    prefilled = (ks, vs, logits, plen)
                take, rest = members[: len(free)], members[len(free) :]
                idx = np.full((S,), S, np.int32)
                lim = np.ones((S,), np.int32)
                seeds = np.zeros((S,), np.uint32)
                ids = np.zeros((S,), np.uint32)
                for j, req_i in enumerate(take):
                    slot = free.pop()
                    owner[slot] = req_i
                    r = requests[req_i]
                    idx[j], lim[j], seeds[j], ids[j] = slot, r.max_tokens, r.seed, r.sample_id
                ks, vs, logits, plen = prefilled
                host = jax.device_put((plen, idx, lim, seeds, ids))
                state = self._insert(state, ks, vs, logits, *host, *shared)
                if rest:
                    queue[0] = (prompt, rest)
                else:
                    queue.popleft()
                    prefilled = None
            state, steps = self._decode(params, state, np.bool_(bool(queue)), ctrl)
            done, n_gen, stopped, out_tok, out_lp, steps = jax.device_get(
                (state["done"], state["n_gen"], state["stopped"], state["out_tok"], state["out_lp"], steps)
            )
            self.decode_steps += int(steps)
            for slot in [s for s in owner if done[s]]:
                k = int(n_gen[slot])
                results[owner.pop(slot)] = SeqResult(
                    np.array(out_tok[slot, :k]), np.array(out_lp[slot, :k]), bool(stopped[slot])
                )
                free.append(slot)
        return [r for r in results if r is not None]
