"""Continuous batching with shared group prefixes for the dense sampler (`inference.continuous_batching: true`).

What it reads: the compiled math and the weights of a `policy.inference.dense_sampler.DenseSampler` (so
`update_params` there applies here too, without a recompile). What it writes: nothing; `ContinuousSampler.run`
returns each sequence's tokens and logprobs as numpy arrays.

Algorithm (a host scheduler over three compiled programs of fixed shapes):

- State on the device: `slots` sequences, each with its own KV cache rows per layer (left-aligned: cache index =
  rotary position), its next position, tokens generated, token budget, stop tokens, temperature and PRNG stream,
  plus the logits it samples its next token from. The caches follow the dense sampler's `DecodeOptions`: head-major
  `[slots, kv_heads, L, head_dim]` by default (what the grouped-query products read without a transposed copy),
  `[slots, L, kv_heads, head_dim]` with `head_major_cache=False` (the legacy layout, for benchmarks).
- `prefill` (one program per (Bp, Pb), Bp = bucket(prompts), Pb = bucket(longest prompt)): the distinct prompts
  that start together, right-aligned in `[Bp, Pb]` exactly as the static sampler lays them out, giving their KV
  (rolled per row so that cache index = position) and the logits of their last tokens.
- `insert` (one program per (Bp, Pb)): copies the prefilled prompts' KV and logits into any subset of the free
  slots, each slot naming its prompt's row (a scatter whose unused indices are dropped). The n samples of a prompt
  share one prefill: the prompt's KV is prefilled once and copied into each sample's slot (`prefill_tokens` counts
  the prompt tokens prefilled, padding included).
- `decode` (one program per attention length): a `while_loop` of decode steps over all slots (token t of a
  sequence is sampled from its carried logits with key `fold_in(fold_in(PRNGKey(seed), sample_id), t)`, the static
  sampler's stream, by the static sampler's own function: `sample_tokens_fast` when no top-p/top-k/min-p is set, a
  static flag, else `sample_tokens`; then fed at its own position through the static sampler's decode step
  (`_Model.decode_step` with `head_major`, the fast decode loop's, with one cache slot per row: one in-place
  scatter per layer and cache) that runs up to `check_steps` steps on the device. It returns to the host (a host
  check, the one device-to-host transfer of a program: `host_syncs`) after those steps, once `refill_slots`
  sequences finished while others wait in the queue (so finished slots are refilled in batches, not one round trip
  per finish), when a live sequence reaches the end of its attention length, or when all are done. The host then
  reads the finished sequences and refills their slots from the queue.
- Length buckets: a decode program attends over the first `length` cache slots only, `length` the smallest of the
  static sampler's phase lengths (`phase_lengths`: 128·2^k above the prompt bucket, then L) that holds every live
  sequence's next `check_steps` positions; those slots are copied out of the cache once per program and back in
  place after it (a slice inside the loop would be copied every step), so only lengths up to L / 2 are used, above
  that the program reads the whole cache.

Why a step used to cost ~5x a static one on the long-tailed CPU bench: the decode program returned to the host at
every finish (about 300 programs, each followed by a prefill and an insert, for 776 steps) and attended over the
whole cache. The steps themselves are now the static loop's (the same decode step, sampling and cache layout); what
remains above a static step is the attention length: a static batch starts at its shortest phase while here one long
sequence in flight keeps every slot's attention at that sequence's bucket (docs/benchmarks.md).

So a finished sequence's slot is refilled at the next host check instead of idling until the longest sequence of
its batch ends. Samples are those of the static sampler: the same per-sequence PRNG streams and the same math
(greedy tokens identical; logprobs equal within float rounding, since only the cache layout differs).

Partial rollouts (`inference.partial_rollouts: true`, `partial=True` here): `stage(params, step)` (any thread)
hands in the weights of a newer policy; the host swaps them in at the next decode-program boundary (the decode
program then returns to the host at least every `swap_check_steps` steps, so a staged policy waits at most that
many steps; the weights are an argument of the compiled programs, so nothing recompiles). Sequences in flight
continue on the new weights; their KV cache stays as computed under the older policy (not recomputed, as in AReaL
and slime). Token t of a sequence is sampled from logits computed when token t-1 was fed (or at prefill for t = 0),
so its policy step is the step of the weights that computed those logits: after a swap at a boundary, the next
token still belongs to the old policy and the ones after it to the new one. `SeqResult.policy_steps` records that
step per token, and its logprob is that policy's.

Shapes compiled: prefill per (Bp, Pb); insert per (Bp, Pb, slots, L, K); decode per (slots, L, T, K), attention
length (at most log2(L / 128) + 1 of them) and whether controls are set; L = max(bucket(longest prompt), the
caller's `prompt_bucket`) + T, T = bucket(largest budget) >= 16 and K = bucket(stop tokens) >= 4, as the static path
buckets them (Bp takes at most log2(slots) + 1 values per Pb). Refilling slots compiles nothing beyond those
buckets; `trace_count` counts traces. A caller that passes one `prompt_bucket` for all its calls (the dense backend:
the largest prompt bucket it expects) keeps L, and so every decode program, across prompt buckets: a new bucket
needs only its prefill and insert, which `warm_up` compiles in idle time.

Size: `ContinuousSampler` is over 400 lines as one unit: the host scheduler (`run`) and the three compiled programs it
drives (prefill, insert, decode) share one device-state layout (`_empty_state`), one set of shape buckets and the
staged-weights swap; split apart, each half would restate the other's layout. What it shares with the static path
(the decode step, sampling, cache writes) already lives in `policy.inference.dense_sampler`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from policy.inference.base import NO_CONTROLS, SamplingControls
from policy.inference.dense_sampler import DenseSampler, bucket, phase_lengths, sample_tokens, sample_tokens_fast

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
    """Tokens and their logprobs (float32) of one sequence, whether it ended on a stop token, and the policy step
    that sampled each token (int64 per token; None when the sampler's policy step is unknown)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    stopped: bool
    policy_steps: np.ndarray | None = None


SWAP_CHECK_STEPS = 8
"""With partial rollouts, the most decode steps the decode program runs before it returns to the host, which then
swaps in a staged policy (a host round trip per this many steps, small against 8 decode steps of a real model)."""

CHECK_STEPS = 32
"""The most decode steps a decode program runs between host checks (where finished slots are refilled and the
attention length bucket is chosen again): one device-to-host transfer per this many steps at most, none per token."""


class ContinuousSampler:
    """Continuous batching over a `DenseSampler`'s model and weights (see the module docstring).

    Promises: `run` returns one `SeqResult` per request, in order, sampled as the static `DenseSampler.generate`
    samples it (same PRNG stream per sample id and seed); the three programs compile once per shape bucket and
    never again as slots refill or weights change; a prompt shared by several requests of one `run` is prefilled
    once (`prefill_tokens` counts padded prompt tokens through prefill, `decode_steps` counts decode steps).
    """

    def __init__(
        self,
        dense: DenseSampler,
        *,
        partial: bool = False,
        swap_check_steps: int = SWAP_CHECK_STEPS,
        policy_step: int | None = None,
        check_steps: int = CHECK_STEPS,
        refill_slots: int = 0,
        min_drain_slots: int = 8,
    ):
        """Over `dense`'s model and weights; `partial`: partial rollouts (see the module docstring), the weights
        of `dense` being those of `policy_step` (None: unknown until a policy is staged). `check_steps`,
        `refill_slots`: when a decode program returns to the host (the attributes of the same names)."""
        if swap_check_steps < 1 or check_steps < 1 or refill_slots < 0:
            raise ValueError(
                f"swap_check_steps={swap_check_steps}, check_steps={check_steps}: must be >= 1; "
                f"refill_slots={refill_slots}: must be >= 0"
            )
        self.dense = dense
        self._m = dense._m
        self.trace_count = 0
        self.prefill_tokens = 0
        self.decode_steps = 0
        self.partial = partial
        self.swap_check_steps = swap_check_steps
        self.check_steps = check_steps
        """The most decode steps a decode program runs before it returns to the host (which refills finished slots
        and picks the attention length bucket)."""
        self.refill_slots = refill_slots
        """Finished sequences that make a decode program return to refill their slots while requests wait (0: an
        eighth of the slots, at least one)."""
        self.min_drain_slots = max(1, min_drain_slots)
        """Once the queue is empty, the live sequences move into a state of bucket(live) slots when that halves the
        slots or more, down to this many."""
        self.host_syncs = 0
        """Device-to-host transfers so far: one per decode program (its results), none per token."""
        self._inserted: dict[tuple[int, int, int, int, int], None] = {}
        """(Bp, S, L, T, K) of every insert a call ran, in order of first use: what `warm_up` replays."""
        self._compiled: set[tuple[int, int, int, int, int, int]] = set()
        """(Bp, Pb, S, L, T, K) of every prefill + insert pair run or warmed."""
        self.policy_step = policy_step
        """The policy step of the weights in use (None: unknown)."""
        self.swaps = 0
        """Staged policies swapped in so far (at a call's start or between its decode steps)."""
        self._pending: tuple[dict[str, Any], int] | None = None
        self._pending_lock = threading.Lock()
        options = {"xla_backend_optimization_level": 0} if dense.fast_compile else None
        self._prefill = jax.jit(self._prefill_impl, compiler_options=options)
        self._insert = jax.jit(self._insert_impl, donate_argnums=(0,), compiler_options=options)
        self._compact = jax.jit(self._compact_impl, compiler_options=options)
        self._decode = jax.jit(
            self._decode_impl,
            donate_argnums=(1,),
            static_argnames=("length", "truncate"),
            compiler_options=options,
        )
        self.head_major = dense.decode.head_major_cache
        """KV cache layout [S, kv_heads, L, head_dim] (else [S, L, kv_heads, head_dim]), from `dense.decode`."""

    # -- policy swaps (partial rollouts) ----------------------------------------------------------

    def stage(self, params: dict[str, Any], step: int) -> None:
        """Use `params` (the weights of policy `step`, structured as `dense.params`) from the next decode-program
        boundary on, or from the next call's start when none runs. Thread-safe, never blocks on a running call;
        a newer staged policy replaces an older one not yet swapped in; an older one than in use is ignored."""
        with self._pending_lock:
            current = self._pending[1] if self._pending is not None else self.policy_step
            if current is not None and step < current:
                logger.warning("continuous sampler: policy %d staged after %d; ignored", step, current)
                return
            self._pending = (params, int(step))

    def stage_model(self, model: Any, step: int) -> None:
        """`stage` the weights of `model` (policy `step`), converted on the calling thread (a worker's prefetch
        thread, so the sampling thread only swaps a reference). Raises ValueError for a model of another structure
        (its weights cannot go into the compiled programs)."""
        if not self.dense.compatible(model):
            raise ValueError(f"policy {step} has another model structure than the sampler's: cannot swap it in")
        self.stage(self.dense.extract(model), step)

    def _swap_in_staged(self) -> bool:
        """Swap in the staged policy, if any (on the sampling thread, between decode programs). True if swapped."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        params, step = pending
        self.dense.params = params
        old, self.policy_step = self.policy_step, step
        self.swaps += 1
        logger.info("continuous sampler: policy %s -> %d between decode steps", old, step)
        return True

    def warm_up(self, prompt_buckets: Sequence[int]) -> bool:
        """Compile, before a call needs them, the prefill and insert programs of one prompt bucket of
        `prompt_buckets` not yet run, for a (prompts, slots, cache length, token and stop buckets) shape an earlier
        call's insert used; True if it compiled one such pair (seconds of work), False when none is left (cheap).
        Only buckets that fit the cache's prompt part (`run`'s `prompt_bucket`) are warmed: a call whose prompts
        fit it runs the decode programs an earlier call compiled (one per attention length those calls reached),
        so after the warm-up its new bucket compiles nothing. Runs
        one prefill of padding prompts and an insert that starts no sequence in a scratch state: nothing a caller
        sees changes but `trace_count`."""
        for Bp, S, L, T, K in self._inserted:
            for Pb in sorted(set(prompt_buckets)):
                if Pb > L - T or (Bp, Pb, S, L, T, K) in self._compiled:
                    continue
                self._compiled.add((Bp, Pb, S, L, T, K))
                toks, plens = np.zeros((Bp, Pb), np.int32), np.ones((Bp,), np.int32)
                ks, vs, logits = self._prefill(self.dense.params, *jax.device_put((toks, plens)))
                unused = np.full((S,), S, np.int32)  # every slot index out of range: nothing is started
                zeros, ids = np.zeros((S,), np.int32), np.zeros((S,), np.uint32)
                host = jax.device_put((plens, zeros, unused, zeros + 1, ids, ids))
                shared = jax.device_put((np.float32(1.0), np.full((K,), -1, np.int32)))
                jax.block_until_ready(self._insert(self._empty_state(S, L, T, K), ks, vs, logits, *host, *shared))
                logger.info("continuous sampler: warmed prefill + insert prompts=%d prompt=%d slots=%d", Bp, Pb, S)
                return True
        return False

    # -- the compiled programs ---------------------------------------------------------------

    def _prefill_impl(
        self, params: dict[str, Any], tokens: jax.Array, plen: jax.Array
    ) -> tuple[list[jax.Array], list[jax.Array], jax.Array]:
        """Prompts `tokens` [Bp, Pb] right-aligned (row b's length plen[b]) -> KV per layer with cache index =
        position (junk past plen), [Bp, K, Pb, h] head-major (else [Bp, Pb, K, h]), and last-token logits [Bp, V]."""
        self.trace_count += 1
        B, P = tokens.shape
        logger.info("continuous sampler: tracing prefill prompts=%d prompt=%d", B, P)
        pad = P - plen  # [Bp]
        slots = jnp.arange(P, dtype=jnp.int32)
        pos = jnp.maximum(slots[None, :] - pad[:, None], 0)
        key_valid = slots[None, :] >= pad[:, None]
        causal = slots[:, None] >= slots[None, :]
        mask = (causal[None] & key_valid[:, None, :]) | jnp.eye(P, dtype=bool)[None]
        h, ks, vs = self._m.prefill(params, tokens, pos, mask, P)
        # left-align: cache index i of row b holds slot (i + pad_b) mod P (a per-row roll by -pad_b)
        src = ((slots[None, :] + pad[:, None]) % P)[:, :, None, None]
        ks = [jnp.take_along_axis(k, src, axis=1) for k in ks]
        vs = [jnp.take_along_axis(v, src, axis=1) for v in vs]
        if self.head_major:
            ks = [k.transpose(0, 2, 1, 3) for k in ks]
            vs = [v.transpose(0, 2, 1, 3) for v in vs]
        return ks, vs, self._m.logits(params, h)

    def _insert_impl(
        self,
        state: dict[str, Any],
        ks: list[jax.Array],
        vs: list[jax.Array],
        logits: jax.Array,
        plen: jax.Array,
        src: jax.Array,
        slot_idx: jax.Array,
        limits: jax.Array,
        seeds: jax.Array,
        sample_ids: jax.Array,
        temperature: jax.Array,
        stops: jax.Array,
    ) -> dict[str, Any]:
        """Start a sequence of prefilled prompt `src[j]` (a row of `ks`, `vs`, `logits`, `plen`) in slot
        `slot_idx[j]` (index S: unused, dropped); `src`, `limits`, `seeds`, `sample_ids` are [S] aligned with
        `slot_idx`, `temperature` and `stops` [K] shared."""
        self.trace_count += 1
        S = state["pos"].shape[0]
        B, P = ks[0].shape[0], ks[0].shape[2 if self.head_major else 1]
        logger.info("continuous sampler: tracing insert slots=%d prompts=%d prompt=%d", S, B, P)

        def put(a: jax.Array, v: jax.Array) -> jax.Array:
            return a.at[slot_idx].set(v, mode="drop")

        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, sample_ids)
        n = slot_idx.shape[0]

        def put_kv(cache: jax.Array, kv: jax.Array) -> jax.Array:
            new = jnp.take(kv, src, axis=0)
            if self.head_major:
                return cache.at[slot_idx, :, :P].set(new, mode="drop")
            return cache.at[slot_idx, :P].set(new, mode="drop")

        return {
            "k": [put_kv(kc, k) for kc, k in zip(state["k"], ks, strict=True)],
            "v": [put_kv(vc, v) for vc, v in zip(state["v"], vs, strict=True)],
            "logits": put(state["logits"], jnp.take(logits, src, axis=0)),
            "pos": put(state["pos"], jnp.take(plen, src)),
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

    def _compact_impl(self, state: dict[str, Any], keep: jax.Array) -> dict[str, Any]:
        """The state of the slots `keep` [S'] (slot j of the result is slot keep[j])."""
        self.trace_count += 1
        logger.info("continuous sampler: tracing compaction slots=%d -> %d", state["pos"].shape[0], keep.shape[0])
        return jax.tree.map(lambda a: jnp.take(a, keep, axis=0), state)  # type: ignore[no-any-return]

    def _decode_impl(
        self,
        params: dict[str, Any],
        state: dict[str, Any],
        refill_at: jax.Array,
        controls: tuple[jax.Array, jax.Array, jax.Array],
        max_steps: jax.Array,
        *,
        length: int,
        truncate: bool = True,
    ) -> tuple[dict[str, Any], jax.Array]:
        """Decode steps over all slots until `refill_at` sequences finished, all are done, `max_steps` steps ran,
        or a live sequence's next position reaches `length` (all traced scalars but `length`). Attention reads the
        first `length` cache slots only (static: one program per length bucket). `truncate` (static): sample through
        the top-p/top-k/min-p machinery (`sample_tokens`), else with `sample_tokens_fast` (the controls are then
        off; the same tokens and logprobs within float rounding)."""
        self.trace_count += 1
        S, T = state["out_tok"].shape
        logger.info("continuous sampler: tracing decode slots=%d attention=%d new=%d", S, length, T)
        m = self._m
        rows = jnp.arange(S, dtype=jnp.int32)
        cache_idx = jnp.arange(length, dtype=jnp.int32)
        opts = self.dense.decode

        def cond(carry: tuple[dict[str, Any], jax.Array, jax.Array]) -> jax.Array:
            st, finished, steps = carry
            live = ~st["done"]
            fits = jnp.all(~live | (st["pos"] < length))
            return jnp.any(live) & (finished < refill_at) & (steps < max_steps) & fits

        def body(carry: tuple[dict[str, Any], jax.Array, jax.Array]) -> tuple[dict[str, Any], jax.Array, jax.Array]:
            st, finished, steps = carry
            live = ~st["done"]
            if truncate:
                tok, lp = sample_tokens(st["logits"], st["temp"], st["keys"], st["n_gen"], controls)
            else:
                tok, lp = sample_tokens_fast(st["logits"], st["temp"], st["keys"], st["n_gen"])
            at = jnp.where(live, st["n_gen"], T)  # index T: out of bounds, dropped
            out_tok = st["out_tok"].at[rows, at].set(tok, mode="drop")
            out_lp = st["out_lp"].at[rows, at].set(lp, mode="drop")
            n_gen = st["n_gen"] + live.astype(jnp.int32)
            stopped = st["stopped"] | (live & jnp.any(tok[:, None] == st["stops"], axis=-1))
            newly = live & (stopped | (n_gen >= st["limits"]))
            # feed the token at each sequence's own position, through the static sampler's decode step with one
            # slot per row (a finished slot writes harmlessly: a new sequence overwrites or masks every cache entry
            # before it reads it)
            pos = jnp.minimum(st["pos"], length - 1)
            key_mask = cache_idx[None, :] <= pos[:, None]  # [S, length]
            x, new_k, new_v = m.decode_step(
                params,
                tok,
                pos,
                pos,
                key_mask,
                st["k"],
                st["v"],
                head_major=self.head_major,
                reduce=opts.reduce_attention,
            )
            new = {
                **st,
                "k": new_k,
                "v": new_v,
                "logits": m.logits(params, x),
                "pos": st["pos"] + live.astype(jnp.int32),
                "n_gen": n_gen,
                "done": st["done"] | newly,
                "stopped": stopped,
                "out_tok": out_tok,
                "out_lp": out_lp,
            }
            return new, finished + jnp.sum(newly, dtype=jnp.int32), steps + 1

        # the loop runs over the first `length` cache slots, copied out once per call and written back in place
        # after it (a slice inside the loop would be copied every step: XLA's CPU dot reads no strided view)
        axis = 2 if self.head_major else 1
        full = state["k"], state["v"]
        if length < full[0][0].shape[axis]:
            cut = jax.lax.slice_in_dim
            state = {**state, "k": [cut(c, 0, length, axis=axis) for c in full[0]]}
            state["v"] = [cut(c, 0, length, axis=axis) for c in full[1]]
        state, _, steps = jax.lax.while_loop(cond, body, (state, jnp.int32(0), jnp.int32(0)))
        if length < full[0][0].shape[axis]:
            put = jax.lax.dynamic_update_slice_in_dim
            state["k"] = [put(c, part, 0, axis=axis) for c, part in zip(full[0], state["k"], strict=True)]
            state["v"] = [put(c, part, 0, axis=axis) for c, part in zip(full[1], state["v"], strict=True)]
        return state, steps

    # -- the host scheduler ------------------------------------------------------------------

    def _empty_state(self, S: int, L: int, T: int, K: int) -> dict[str, Any]:
        a = self.dense.arch
        dtype = jnp.dtype(a.compute_dtype)
        shape = (S, a.num_kv_heads, L, a.head_dim) if self.head_major else (S, L, a.num_kv_heads, a.head_dim)
        host = {
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
        # the small fields: device_put, not jnp (no small per-shape programs to compile, see DenseSampler.generate);
        # the KV caches: made on the device by one program per shape, since zeros built on the host are a host
        # memset and a host-to-device copy of every cache byte (805 MB per call at the 1B shape with 128 slots:
        # about half of a continuous call's wall time on an H200 before 2026-11-28)
        state: dict[str, Any] = jax.device_put(host)
        state["k"], state["v"] = self._zero_caches(shape, dtype.name, a.num_layers)
        return state

    @staticmethod
    @functools.partial(jax.jit, static_argnums=(0, 1, 2))
    def _zero_caches(shape: tuple[int, ...], dtype: str, layers: int) -> tuple[list[jax.Array], list[jax.Array]]:
        """Zeroed K and V caches of `layers` layers, made on the device."""
        return [jnp.zeros(shape, dtype) for _ in range(layers)], [jnp.zeros(shape, dtype) for _ in range(layers)]

    def run(
        self,
        requests: Sequence[SeqRequest],
        *,
        slots: int,
        stop_tokens: Sequence[int],
        temperature: float,
        controls: SamplingControls = NO_CONTROLS,
        share_prefixes: bool = True,
        before_decode: Callable[[int], None] | None = None,
        prompt_bucket: int = 0,
    ) -> list[SeqResult]:
        """Sample every request with at most `slots` sequences in flight; one `SeqResult` per request, in order.

        Requests with the same prompt (the n samples of a group) share one prefill (`share_prefixes=False`: each
        request is prefilled on its own, for comparison). With partial rollouts a staged policy is swapped in at
        the call's start and between decode programs; each result's `policy_steps` says which policy sampled each
        token (None while the sampler's policy step is unknown). `before_decode(decode_steps)`, if given, is called
        on this thread before each decode program (tests stage a policy at a chosen step with it).
        `prompt_bucket`: the prompt part of the KV cache, at least the longest prompt's bucket (0: that bucket);
        calls whose prompts fit the same `prompt_bucket` share every decode program (the caches have one length
        L), so a new prompt bucket then needs only a prefill and an insert, which `warm_up` compiles beforehand.
        Raises ValueError for an empty request list, an empty prompt or a budget < 1.
        """
        if not requests:
            raise ValueError("no requests")
        if any(len(r.prompt) == 0 or r.max_tokens < 1 for r in requests):
            raise ValueError("every request needs a non-empty prompt and max_tokens >= 1")
        S = bucket(min(slots, len(requests)))
        T = bucket(max(r.max_tokens for r in requests), minimum=16)
        L = max(bucket(max(len(r.prompt) for r in requests), minimum=8), prompt_bucket) + T
        K = bucket(len(stop_tokens), minimum=4)
        stops = np.full((K,), -1, np.int32)
        stops[: len(stop_tokens)] = list(stop_tokens)
        if self.partial:
            self._swap_in_staged()
        params = self.dense.params
        check = min(self.check_steps, self.swap_check_steps) if self.partial else self.check_steps
        # attention lengths: the static sampler's length phases over this call's cache (one program each)
        # (the lengths above L / 2 are not worth their copy: such a program reads the whole cache)
        lengths = [n for n in phase_lengths(L - T, L, self.dense.decode.length_bucket) if 2 * n <= L] + [L]
        refill_batch = self.refill_slots or max(1, S // 8)
        ctrl = jax.device_put((np.float32(controls.top_p), np.int32(controls.top_k), np.float32(controls.min_p)))
        truncate = not controls.is_default or not self.dense.decode.fast_sampling
        shared = jax.device_put((np.float32(temperature), stops))

        groups: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(tuple(int(t) for t in r.prompt), []).append(i)
        queue: deque[tuple[tuple[int, ...], list[int]]] = (
            deque(groups.items())
            if share_prefixes
            else deque((tuple(int(t) for t in r.prompt), [i]) for i, r in enumerate(requests))
        )
        # (ks, vs, logits, plen, row) of queue[0] when its prompt was prefilled but not all its members started
        prefilled: tuple[Any, Any, Any, Any, int] | None = None

        state = self._empty_state(S, L, T, K)
        free = list(range(S))
        owner: dict[int, int] = {}  # slot -> request index
        results: list[SeqResult | None] = [None] * len(requests)
        # per-token policy steps, kept on the host: a slot's generated-token count before the next decode program,
        # the step of the weights that computed its carried logits (its next token's policy), its tokens' steps
        host_ngen: dict[int, int] = {}
        logit_step: dict[int, int] = {}
        token_steps: dict[int, list[int]] = {}
        step_now = -1 if self.policy_step is None else self.policy_step
        while queue or owner:
            if before_decode is not None:
                before_decode(self.decode_steps)
            if self.partial and self._swap_in_staged():
                params = self.dense.params
                step_now = -1 if self.policy_step is None else self.policy_step
                prefilled = None  # a prompt prefilled under the old weights is prefilled again under the new
            while free and queue:
                # the queue's front groups that get a slot now: their prompts prefill as one batch (unless the
                # first was prefilled already), each group's members start from its row
                if prefilled is not None:
                    *out, row = prefilled
                    starts: list[tuple[int, list[int]]] = [(row, queue[0][1][: len(free)])]
                else:
                    batch: list[tuple[int, ...]] = []
                    starts, n_free = [], len(free)
                    for prompt, members in queue:
                        if n_free == 0:
                            break
                        starts.append((len(batch), members[:n_free]))
                        batch.append(prompt)
                        n_free -= len(starts[-1][1])
                    Bp, Pb = bucket(len(batch)), bucket(max(len(p) for p in batch), minimum=8)
                    toks = np.zeros((Bp, Pb), np.int32)
                    plens = np.ones((Bp,), np.int32)  # padding rows: one (masked-out) token
                    for b, prompt in enumerate(batch):
                        toks[b, Pb - len(prompt) :] = prompt
                        plens[b] = len(prompt)
                    ks, vs, logits = self._prefill(params, *jax.device_put((toks, plens)))
                    self.prefill_tokens += Bp * Pb
                    out = [ks, vs, logits, plens]
                idx = np.full((S,), S, np.int32)
                src = np.zeros((S,), np.int32)
                lim = np.ones((S,), np.int32)
                seeds = np.zeros((S,), np.uint32)
                ids = np.zeros((S,), np.uint32)
                j = 0
                for row, take in starts:
                    for req_i in take:
                        slot = free.pop()
                        owner[slot] = req_i
                        host_ngen[slot], logit_step[slot], token_steps[slot] = 0, step_now, []
                        r = requests[req_i]
                        idx[j], src[j], lim[j], seeds[j], ids[j] = slot, row, r.max_tokens, r.seed, r.sample_id
                        j += 1
                    prompt, members = queue[0]
                    if len(take) < len(members):  # out of slots: the rest start later from this prefill
                        queue[0] = (prompt, members[len(take) :])
                        prefilled = (*out, row)
                    else:
                        queue.popleft()
                        prefilled = None
                ks, vs, logits, plens = out
                host = jax.device_put((plens, src, idx, lim, seeds, ids))
                state = self._insert(state, ks, vs, logits, *host, *shared)
                Bp, Pb = int(plens.shape[0]), int(ks[0].shape[2 if self.head_major else 1])
                self._inserted.setdefault((Bp, S, L, T, K))
                self._compiled.add((Bp, Pb, S, L, T, K))
            # return for a refill once `refill_at` sequences finished (a batch of slots, or all the queue fills),
            # never while the queue is empty; the attention length covers every live sequence's next `check` steps
            # (the program returns early if one would pass it)
            queued = sum(len(members) for _, members in queue)
            refill_at = min(refill_batch, queued) if queued else S + 1
            reach = max(len(requests[i].prompt) + host_ngen[s] for s, i in owner.items()) + check
            length = next((n for n in lengths if n >= reach), L)
            state, steps = self._decode(
                params, state, np.int32(refill_at), ctrl, np.int32(check), length=length, truncate=truncate
            )
            # the one device-to-host transfer of a decode program (tests/test_continuous_batching.py counts them)
            done, n_gen, stopped, out_tok, out_lp, steps = jax.device_get(
                (state["done"], state["n_gen"], state["stopped"], state["out_tok"], state["out_lp"], steps)
            )
            self.host_syncs += 1
            self.decode_steps += int(steps)
            for slot in owner:
                new = int(n_gen[slot]) - host_ngen[slot]
                if new > 0:  # the first new token came from the carried logits, the rest from this program's
                    token_steps[slot] += [logit_step[slot]] + [step_now] * (new - 1)
                    logit_step[slot], host_ngen[slot] = step_now, int(n_gen[slot])
            for slot in [s for s in owner if done[s]]:
                k = int(n_gen[slot])
                steps_k: np.ndarray | None = np.asarray(token_steps.pop(slot), np.int64)
                if steps_k is not None and (steps_k < 0).any():
                    steps_k = None  # the weights' policy step was not known
                results[owner.pop(slot)] = SeqResult(
                    np.array(out_tok[slot, :k]), np.array(out_lp[slot, :k]), bool(stopped[slot]), steps_k
                )
                free.append(slot)
            if not queue and owner and bucket(len(owner)) <= S // 2 and self.min_drain_slots <= S // 2:
                # draining: the live sequences move into a state of fewer slots, so that each step of the long
                # sequences left computes (and reads the caches of) fewer finished slots
                S = max(bucket(len(owner)), self.min_drain_slots)
                keep = sorted(owner) + [f for f in free if f not in owner][: S - len(owner)]
                state = self._compact(state, jax.device_put(np.asarray(keep, np.int32)))
                moved = {old: j for j, old in enumerate(keep)}
                owner = {moved[o]: r for o, r in owner.items()}
                host_ngen = {moved[o]: n for o, n in host_ngen.items() if o in moved}
                logit_step = {moved[o]: n for o, n in logit_step.items() if o in moved}
                token_steps = {moved[o]: n for o, n in token_steps.items() if o in moved}
                free = [j for j in range(S) if j not in owner]
        return [r for r in results if r is not None]
