"""GPU benchmark: rollout tokens/s vs the decode roofline, learner tokens/s and MFU.

What it measures, per model shape (random weights):

- HBM bandwidth: a jitted `x * a + b` over a large float32 buffer (read + write) -> bytes/s.
- Matmul peak: a bf16 [N, N] @ [N, N] matmul -> FLOP/s (for context; MFU is against 989 TFLOP/s).
- Rollout: the dense backend (policy.inference.dense / policy.inference.dense_sampler), bf16 weights and KV cache,
  `--batch` sequences x `--new-tokens` new tokens after `--prompt-len`-token prompts, temperature 1,
  no stop token. The first call (compile) is reported apart; the figure is the median of `--repeats` calls.
  Decode roofline: per step the weights (embedding gather excluded unless tied) plus the KV cache of the
  valid context (average over the steps) must be read once:
  `roofline tok/s = batch / ((weight bytes + mean KV bytes) / measured bandwidth)`; ratio = measured / roofline.
  `--engine` also times levanter's InferenceEngine (slow: ~70 s per call for the 1B shape on an H100).
- Learner: one AdamW step (optax) of a levanter Llama on `--learner-batch` x `--seq-len` tokens, float32
  params, bf16 compute (params cast inside the loss), levanter's (blockwise when `--ce-block`) next-token
  loss; attention backend `--attn` (`cudnn` routes causal attention through
  `jax.nn.dot_product_attention(implementation="cudnn")`), remat `--remat`. MFU = 3 x levanter's
  forward FLOPs/token x tokens/s / 989e12.

Shapes: `1b` = Llama-3.2-1B (hidden 2048, 16 layers, 32/8 heads, vocab 128256, tied); `8b-l4` = Llama-3-8B
layer shape with 4 layers (per-layer efficiency of the 8B shape within one GPU's memory); `--tiny` runs a
small shape on CPU as a smoke test.

Run on the GPU machine (JAX with CUDA), from the project root, with the project's dependencies installed
there (`pip install` of the project, or of its locked wheels, into that machine's python3):

    JAX_PLATFORMS= python3 -m bench.bench_gpu --shapes 1b,8b-l4 --json docs/bench_gpu.json
    # or: make bench-gpu ARGS="--shapes 1b,8b-l4 --json docs/bench_gpu.json"

Wheels installed elsewhere (`pip install --target DIR`): `make bench-gpu BENCH_PYTHONPATH=DIR`. A machine whose
JAX needs a driver shim can provide a `device_compat` module with an `install()` function on that path and pass
`--device-compat` (`make bench-gpu DEVICE_COMPAT=1`).

CPU smoke test: `JAX_PLATFORMS=cpu python -m bench.bench_gpu --tiny`.

Decode efficiency (`--decode-only` runs just the bandwidth measures and this part; `bench/gpu_decode.sh`
is the one command for the GPU machine): for each batch of `--decode-batches` the static sampler with the legacy
decode loop (`dense_sampler.LEGACY_DECODE`), with the fast one (`DecodeOptions()`, the default) and continuous
batching (`policy.inference.continuous`), then one-change ablations at `--ablation-batch` and the max |logprob
difference| of bf16 and f32 samples against float32 teacher-forced logprobs. Per case: whole-call tokens/s
(prefill included) and its share of the roofline (as above, with the larger of the read + write and read-only
bandwidth measures), and for static variants the decode step alone: (call - 1-token call of the same program) /
(new tokens - 1). `--decode-impl legacy|fast` picks the loop of the rollout row above. Cases left when
`--time-budget` seconds have passed are listed as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PEAK_BF16_FLOPS = 989e12  # H100 SXM dense bf16


def _timeit(fn: Any, repeats: int) -> float:
    """Median seconds of `fn()` (which must block until its result is ready)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """Device memory bandwidth in bytes/s: a jitted elementwise pass over `nbytes` of float32 (read + write)."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001 + 1.0)
    f(x).block_until_ready()
    t = _timeit(lambda: f(x).block_until_ready(), repeats)
    return 2 * nbytes / t


def measure_read_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """Device memory read bandwidth in bytes/s: a jitted sum over `nbytes` of bfloat16 (read only, as the weights
    and KV cache are in a decode step)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    f(x).block_until_ready()
    return nbytes / _timeit(lambda: f(x).block_until_ready(), repeats)


def measure_matmul(n: int, repeats: int = 10) -> float:
    """bf16 matmul FLOP/s of an [n, n] @ [n, n] product."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    return 2 * n**3 / _timeit(lambda: f(a).block_until_ready(), repeats)


DIMS = ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads")
"""The model dimensions a shape names (same names in levanter's LlamaConfig and rlpipe's ModelSpec)."""


def model_config(shape: str, seq_len: int) -> tuple[Any, int]:
    """(levanter LlamaConfig, vocab size) of a named shape."""
    from levanter.layers.rotary import Llama3RotaryEmbeddingsConfig
    from levanter.models.llama import LlamaConfig

    rope = Llama3RotaryEmbeddingsConfig(theta=500000.0, factor=32.0, original_max_position_embeddings=8192)
    # DIMS; rope factor, tied embeddings, vocab
    if shape == "tiny":
        dims, factor, tied, vocab = (64, 128, 2, 4, 2), 32.0, True, 512
    elif shape == "1b":
        dims, factor, tied, vocab = (2048, 8192, 16, 32, 8), 32.0, True, 128256
    elif shape.startswith("8b-l"):  # Llama-3-8B cut to N layers
        dims, factor, tied, vocab = (4096, 14336, int(shape[4:]), 32, 8), 8.0, False, 128256
    else:
        raise ValueError(f"unknown shape {shape!r}")
    rope = dataclasses.replace(rope, factor=factor)
    config = LlamaConfig(seq_len=seq_len, rope=rope, tie_word_embeddings=tied, **dict(zip(DIMS, dims, strict=True)))
    return config, vocab


# ---------------------------------------------------------------------------------------------
# rollout
# ---------------------------------------------------------------------------------------------


def bench_rollout(shape: str, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    import haliax as hax
    import jax
    import numpy as np

    from pipeline.config import InferenceConfig
    from policy.inference import GenerationRequest, make_backend

    P, T, B = args.prompt_len, args.new_tokens, args.batch
    config, vocab = model_config(shape, seq_len=max(P + T, 256))
    model = config.build(hax.Axis("vocab", vocab), key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, P).tolist() for _ in range(B)]
    row: dict[str, Any] = {"shape": shape, "batch": B, "prompt_len": P, "new_tokens": T}
    backends = ["dense"] + (["levanter"] if args.engine else [])
    for name in backends:
        be = make_backend(
            InferenceConfig.get_choice_class(name)(max_seqs=B), model, None, P + T, compute_dtype=args.dtype
        )
        if name == "dense":  # --decode-impl: the decode loop of the static sampler
            from policy.inference.dense_sampler import DenseSampler

            be.sampler = DenseSampler(model, args.dtype, decode=decode_options(args.decode_impl))  # type: ignore[attr-defined]
        kwargs: dict[str, Any] = dict(n=1, temperature=1.0, max_tokens=T, stop_tokens=[])
        t0 = time.perf_counter()
        be.generate(GenerationRequest(prompts, seed=0, **kwargs))
        first = time.perf_counter() - t0
        times, toks = [], 0
        for r in range(args.repeats):
            t0 = time.perf_counter()
            out = be.generate(GenerationRequest(prompts, seed=r + 1, **kwargs))
            times.append(time.perf_counter() - t0)
            toks = sum(len(c.tokens) for g in out for c in g)
        med = statistics.median(times)
        row[f"{name}_first_call_s"] = first
        row[f"{name}_call_s"] = med
        row[f"{name}_tokens_per_s"] = toks / med
        if name == "dense":
            params = be.sampler.params  # type: ignore[attr-defined]
            leaves = jax.tree_util.tree_leaves(params)
            weight_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
            if params["lm_head"] is not None:  # an untied embedding is only gathered (B rows per step)
                weight_bytes -= params["embed"].size * params["embed"].dtype.itemsize
            a = be.sampler.arch  # type: ignore[attr-defined]
            itemsize = np.dtype(a.compute_dtype).itemsize
            kv_per_token = a.num_layers * 2 * a.num_kv_heads * a.head_dim * itemsize
            kv_mean = B * kv_per_token * (P + (T + 1) / 2)
            step_floor = (weight_bytes + kv_mean) / bandwidth
            roofline = B / step_floor
            row.update(
                weight_gb=weight_bytes / 1e9,
                kv_mean_gb=kv_mean / 1e9,
                roofline_tokens_per_s=roofline,
                roofline_ratio=row["dense_tokens_per_s"] / roofline,
            )
        be.shutdown()
    del model
    return row


# ---------------------------------------------------------------------------------------------
# decode efficiency: legacy vs fast decode loop vs continuous batching, per batch size
# ---------------------------------------------------------------------------------------------

DECODE_VARIANTS = ("legacy", "fast", "continuous")
"""The decode bench's main variants, run at every `--decode-batches` size. `fast-tail` and `continuous-tail` (not
in the default list) are the static and continuous paths on long-tailed lengths (`tail_budgets`)."""
DECODE_ABLATIONS = ("sampling-only", "layout-only", "fast-no-phases", "fast-reduce-attn", "fast-unfused")
"""One change at a time (at `--ablation-batch` only): the fast sampling alone, the head-major cache alone, the
fast path without length phases, the fast path with multiply-and-sum attention, and with separate projections."""


def decode_options(variant: str) -> Any:
    """The `DecodeOptions` of a static decode variant (`continuous` runs on the default fast sampler)."""
    from policy.inference.dense_sampler import LEGACY_DECODE, DecodeOptions

    return {
        "legacy": LEGACY_DECODE,
        "fast": DecodeOptions(),
        "continuous": DecodeOptions(),
        "sampling-only": DecodeOptions(head_major_cache=False, length_bucket=0),
        "layout-only": DecodeOptions(fast_sampling=False, length_bucket=0),
        "fast-no-phases": DecodeOptions(length_bucket=0),
        "fast-reduce-attn": DecodeOptions(reduce_attention=True),
        "fast-fused": DecodeOptions(fused_projections=True),
        "fast-unfused": DecodeOptions(fused_projections=False),
    }[variant]


def decode_roofline(sampler: Any, B: int, P: int, T: int, bandwidth: float) -> tuple[float, float, float]:
    """(roofline tokens/s, weight bytes, mean KV bytes) of decoding B sequences from P to P + T tokens: each step
    reads the weights once (an untied input embedding is only gathered) and the valid KV cache (mean over steps)."""
    import jax
    import numpy as np

    params = sampler.params
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    if params["lm_head"] is not None:
        weight_bytes -= params["embed"].size * params["embed"].dtype.itemsize
    a = sampler.arch
    kv_per_token = a.num_layers * 2 * a.num_kv_heads * a.head_dim * np.dtype(a.compute_dtype).itemsize
    kv_mean = B * kv_per_token * (P + (T + 1) / 2)
    return B / ((weight_bytes + kv_mean) / bandwidth), weight_bytes, kv_mean


def _decode_case(model: Any, variant: str, B: int, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    """One (variant, batch) measurement: B random prompts of `--prompt-len` tokens, `--new-tokens` each,
    temperature 1, no stop token. Static variants also time a 1-token call of the same program (prefill + one
    step), so decode step = (full call - 1-token call) / (new tokens - 1)."""
    import numpy as np

    from policy.inference.continuous import ContinuousSampler, SeqRequest
    from policy.inference.dense_sampler import DenseSampler

    P, T = args.prompt_len, args.new_tokens
    vocab = model.Vocab.size
    rng = np.random.default_rng(B)
    tail = variant.endswith("-tail")
    prompts = [rng.integers(0, vocab, P).tolist() for _ in range(TAIL_REQUESTS_PER_SLOT * B if tail else B)]
    sampler = DenseSampler(model, args.dtype, decode=decode_options(variant.removesuffix("-tail")))
    row: dict[str, Any] = {"variant": variant, "batch": B, "prompt_len": P, "new_tokens": T}
    if tail:
        budgets = tail_budgets(len(prompts), T, seed=B)
        row.update(requests=len(prompts), mean_new_tokens=float(np.mean(budgets)))
        return _tail_case(sampler, prompts, budgets, B, row, args, bandwidth)
    if variant == "continuous":
        cont = ContinuousSampler(sampler)

        def call(seed: int, budget: int) -> int:
            reqs = [SeqRequest(p, budget, i, seed) for i, p in enumerate(prompts)]
            out = cont.run(reqs, slots=B, stop_tokens=[], temperature=1.0)
            return sum(len(o.tokens) for o in out)
    else:

        def call(seed: int, budget: int) -> int:
            return int(_sample_all(sampler, prompts, budget, T, seed).lengths.sum())

    t0 = time.perf_counter()
    call(0, T)
    row["first_call_s"] = time.perf_counter() - t0
    times, toks = [], 0
    for r in range(args.repeats):
        t0 = time.perf_counter()
        toks = call(r + 1, T)
        times.append(time.perf_counter() - t0)
    full = statistics.median(times)
    _record_call(row, sampler, full, toks, (B, P, T), bandwidth)
    if variant != "continuous" and T > 1:
        one = _timeit(lambda: call(args.repeats + 1, 1), max(1, args.repeats))
        step = max(full - one, 1e-9) / (T - 1)
        row.update(
            prefill_call_s=one,
            decode_step_ms=step * 1e3,
            decode_tokens_per_s=B / step,
            decode_roofline_ratio=B / step / row["roofline_tokens_per_s"],
        )
    return row


TAIL_REQUESTS_PER_SLOT = 4
"""Long-tailed decode cases: requests per slot (batch), so that continuous batching has sequences to refill with."""


def tail_budgets(n: int, max_new: int, seed: int) -> list[int]:
    """`n` long-tailed completion lengths: geometric with mean `max_new` / 4, capped at `max_new` (the shape of
    `bench.bench_continuous`'s workload: most completions short, a few at the cap)."""
    import numpy as np

    mean = max(1, max_new // 4)
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.minimum(rng.geometric(1.0 / mean, n), max_new)]


def _tail_case(
    sampler: Any,
    prompts: list[list[int]],
    budgets: list[int],
    B: int,
    row: dict[str, Any],
    args: argparse.Namespace,
    bandwidth: float,
) -> dict[str, Any]:
    """Long-tailed lengths: `fast-tail` decodes the requests in static batches of `B` rows (each batch until its
    longest row ends), `continuous-tail` keeps `B` slots busy, refilling finished ones; both generate exactly
    `budgets` tokens (no stop token). The roofline is that of `B` busy slots at the mean length."""
    import numpy as np

    from policy.inference.continuous import ContinuousSampler, SeqRequest

    P, T = args.prompt_len, args.new_tokens
    if row["variant"].startswith("continuous"):
        cont = ContinuousSampler(sampler)

        def call(seed: int) -> int:
            reqs = [SeqRequest(p, b, i, seed) for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))]
            out = cont.run(reqs, slots=B, stop_tokens=[], temperature=1.0)
            return sum(len(o.tokens) for o in out)
    else:

        def call(seed: int) -> int:
            total = 0
            for i in range(0, len(prompts), B):
                got = sampler.generate(
                    prompts[i : i + B],
                    list(range(i, i + len(prompts[i : i + B]))),
                    batch_size=B,
                    max_tokens=budgets[i : i + B],
                    max_new_bucket=T,
                    stop_tokens=[],
                    temperature=1.0,
                    seed=seed,
                )
                total += int(np.asarray(got.lengths).sum())
            return total

    t0 = time.perf_counter()
    call(0)
    row["first_call_s"] = time.perf_counter() - t0
    times, toks = [], 0
    for r in range(args.repeats):
        t0 = time.perf_counter()
        toks = call(r + 1)
        times.append(time.perf_counter() - t0)
    full = statistics.median(times)
    _record_call(row, sampler, full, toks, (B, P, max(1, round(row["mean_new_tokens"]))), bandwidth)
    return row


def _record_call(
    row: dict[str, Any], sampler: Any, call_s: float, tokens: int, shape: tuple[int, int, int], bandwidth: float
) -> None:
    """Add a timed call's tokens/s and its share of the decode roofline of `shape` (batch, prompt, new tokens)."""
    roof, weight_bytes, kv_mean = decode_roofline(sampler, *shape, bandwidth)
    row.update(
        call_s=call_s,
        tokens=tokens,
        tokens_per_s=tokens / call_s,
        roofline_tokens_per_s=roof,
        roofline_ratio=tokens / call_s / roof,
        weight_gb=weight_bytes / 1e9,
        kv_mean_gb=kv_mean / 1e9,
    )


def _sample_all(sampler: Any, prompts: list[list[int]], budget: int, bucket: int, seed: int) -> Any:
    """One `DenseSampler.generate` call: every prompt once in one batch, `budget` new tokens each (decode bucket
    `bucket`), temperature 1, no stop tokens."""
    n = len(prompts)
    return sampler.generate(
        prompts,
        list(range(n)),
        batch_size=n,
        max_tokens=[budget] * n,
        max_new_bucket=bucket,
        stop_tokens=[],
        temperature=1.0,
        seed=seed,
    )


def logprob_mismatch(model: Any, args: argparse.Namespace) -> dict[str, float]:
    """max |sampled logprob - float32 teacher-forced logprob| over 4 sequences (`--prompt-len` prompts, 32 new
    tokens, T = 1) for the fast sampler in bfloat16 and float32 and the legacy one in bfloat16."""
    import jax.numpy as jnp
    import numpy as np

    from policy.inference.dense_sampler import DenseSampler
    from policy.model import teacher_forced_logprobs

    P, T, B = args.prompt_len, 32, 4
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, model.Vocab.size, P).tolist() for _ in range(B)]
    out: dict[str, float] = {}
    for name, variant, dtype in (
        ("fast_bf16", "fast", "bfloat16"),
        ("fast_f32", "fast", "float32"),
        ("legacy_bf16", "legacy", "bfloat16"),
    ):
        sampler = DenseSampler(model, dtype, decode=decode_options(variant))
        got = _sample_all(sampler, prompts, T, T, seed=11)
        rows = np.array([p + got.tokens[i].tolist() for i, p in enumerate(prompts)], np.int32)
        tf = np.asarray(teacher_forced_logprobs(model, jnp.asarray(rows), temperature=1.0))[:, P:]
        out[f"max_abs_dlogprob_{name}"] = float(np.abs(got.logprobs - tf).max())
        del sampler
    return out


def bench_decode(shape: str, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    """Decode tokens/s and share of the roofline for every variant x batch (the main variants at
    `--ablation-batch`, the logprob mismatch, the main variants at the other batches, the ablations), stopping
    once `--time-budget` seconds have passed since the benchmark started (what was not run is listed under
    `skipped`)."""
    import haliax as hax
    import jax

    P, T = args.prompt_len, args.new_tokens
    config, vocab = model_config(shape, seq_len=max(P + T, 256))
    model = config.build(hax.Axis("vocab", vocab), key=jax.random.PRNGKey(0))
    batches = [int(b) for b in str(args.decode_batches).split(",") if b]
    variants = [v for v in str(args.decode_variants).split(",") if v]
    ablations = [v for v in str(args.ablations).split(",") if v]
    # the headline batch first, then the logprob check, the other batches and the one-change ablations: a time
    # budget that cuts the tail keeps what matters most
    head = args.ablation_batch if args.ablation_batch in batches else batches[0]
    cases: list[tuple[str, int]] = [(v, head) for v in variants] + [("mismatch", 0)] * bool(args.mismatch)
    cases += [(v, b) for b in sorted(batches, reverse=True) if b != head for v in variants]
    cases += [(v, args.ablation_batch) for v in ablations]
    result: dict[str, Any] = {"shape": shape, "runs": [], "skipped": []}
    for variant, B in cases:
        if time.perf_counter() - args.started > args.time_budget:
            result["skipped"].append(variant if variant == "mismatch" else f"{variant}@{B}")
            continue
        if variant == "mismatch":
            result.update(logprob_mismatch(model, args))
            print({k: v for k, v in result.items() if k.startswith("max_abs")}, flush=True)
            continue
        try:
            result["runs"].append(_decode_case(model, variant, B, args, bandwidth))
        except Exception as e:  # one case out of memory must not lose the others
            result["runs"].append({"variant": variant, "batch": B, "error": repr(e)[:300]})
        print(_decode_line(result["runs"][-1]), flush=True)
    del model
    return result


def _decode_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['variant']:<16} {r['batch']:>5}  error: {r['error']}"
    dec = (
        f"{r['decode_step_ms']:>8.3f} {r['decode_tokens_per_s']:>10.0f} {r['decode_roofline_ratio']:>6.1%}"
        if "decode_step_ms" in r
        else f"{'-':>8} {'-':>10} {'-':>6}"
    )
    return (
        f"{r['variant']:<16} {r['batch']:>5} {r['tokens_per_s']:>10.0f} {r['roofline_tokens_per_s']:>10.0f} "
        f"{r['roofline_ratio']:>6.1%} {dec} {r['first_call_s']:>6.1f}"
    )


def print_decode_table(result: dict[str, Any]) -> None:
    """The decode bench as a table: whole-call tokens/s (prefill included) and its share of the roofline, the
    decode step alone (static variants) and its share, and the first call (compile)."""
    print(f"\ndecode efficiency, shape {result['shape']} (call = prefill + decode; step = decode only)")
    hdr = (
        f"{'variant':<16} {'batch':>5} {'call tok/s':>10} {'roofline':>10} {'share':>6} "
        f"{'step ms':>8} {'step tok/s':>10} {'share':>6} {'1st s':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in sorted(result["runs"], key=lambda r: (r["batch"], r["variant"])):
        print(_decode_line(r))
    for k, v in result.items():
        if k.startswith("max_abs_dlogprob"):
            print(f"{k}: {v:.2e} (vs float32 teacher-forced)")
    if result["skipped"]:
        print(f"skipped (time budget): {', '.join(result['skipped'])}")


# ---------------------------------------------------------------------------------------------
# learner
# ---------------------------------------------------------------------------------------------


def install_cudnn_attention(implementation: str = "cudnn") -> None:
    """Route levanter's causal attention (no segments, no bias) through `jax.nn.dot_product_attention`."""
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import levanter.layers.attention as A

    original = A.dot_product_attention

    impl: Any = implementation  # "cudnn" | "xla" (jax's overloads want a Literal)

    def patched(
        QPos: Any,
        KPos: Any,
        Key: Any,
        query: Any,
        key: Any,
        value: Any,
        mask: Any = None,
        bias: Any = None,
        *a: Any,
        **kw: Any,
    ) -> Any:
        simple = (
            isinstance(mask, A.AttentionMask)
            and mask.is_causal
            and mask.causal_offset is None
            and mask.explicit_mask is None
            and mask.segment_ids is None
            and mask.sliding_window is None
            and bias is None
            and kw.get("logits_soft_cap") is None
            and QPos == "position"
            and KPos == "key_position"
            and Key == "head_size"
            and {a.name for a in query.axes} == {"batch", "kv_head", "q_heads_per_group", "position", "head_size"}
        )
        if not simple:
            return original(QPos, KPos, Key, query, key, value, mask, bias, *a, **kw)
        q = query.rearrange(("batch", "position", "kv_head", "q_heads_per_group", "head_size"))
        k = key.rearrange(("batch", "key_position", "kv_head", "head_size")).array
        v = value.rearrange(("batch", "key_position", "kv_head", "head_size")).array
        Bs, S, K, G, H = q.array.shape
        dtype = jnp.bfloat16 if q.dtype == jnp.float32 and implementation == "cudnn" else q.dtype
        out = jax.nn.dot_product_attention(
            q.array.reshape(Bs, S, K * G, H).astype(dtype),
            k.astype(dtype),
            v.astype(dtype),
            is_causal=True,
            scale=kw.get("scaling_factor"),
            implementation=impl,
        )
        return hax.named(out.reshape(Bs, S, K, G, H).astype(q.dtype), q.axes)

    A.dot_product_attention = patched


def bench_learner(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import optax
    from levanter.layers.attention import AttentionBackend, AttentionMask
    from levanter.models.loss import maybe_fused_next_token_loss

    B, S = args.learner_batch, args.seq_len
    config, vocab = model_config(shape, seq_len=S)
    remat: Any = {"none": False, "full": True}.get(args.remat, args.remat)
    attn = None if args.attn in ("default", "cudnn", "xla") else AttentionBackend(args.attn)
    config = dataclasses.replace(
        config, gradient_checkpointing=remat, attn_backend=attn, cross_entropy_block_size=args.ce_block
    )
    if args.attn in ("cudnn", "xla"):
        install_cudnn_attention(args.attn)
    Vocab = hax.Axis("vocab", vocab)
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    opt = optax.adamw(1e-4, weight_decay=0.0)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    cdt = jnp.dtype(args.dtype)

    def loss_fn(m: Any, tokens: Any) -> Any:
        m = jax.tree_util.tree_map(lambda x: x.astype(cdt) if eqx.is_inexact_array(x) else x, m)
        ids = hax.named(tokens, ("batch", "position"))
        act = m.activations(ids, AttentionMask.causal())
        Pos = m.Pos.resize(S)
        per_token = maybe_fused_next_token_loss(
            Pos,
            m.Embed,
            m.Vocab,
            act,
            m.get_lm_head(),
            ids,
            reduction=None,
            block_size=config.cross_entropy_block_size,
            dtype=jnp.float32,
        )
        keep = (jnp.arange(S) < S - 1).astype(jnp.float32)  # no target after the last token
        per_token = per_token.rearrange(("batch", "position")).array
        return jnp.sum(per_token * keep) / (per_token.shape[0] * (S - 1))

    @eqx.filter_jit(donate="all-except-first")
    def step(tokens: Any, m: Any, st: Any) -> Any:
        loss, grads = eqx.filter_value_and_grad(loss_fn)(m, tokens)
        updates, st = opt.update(grads, st, eqx.filter(m, eqx.is_array))
        return loss, eqx.apply_updates(m, updates), st

    tokens = jax.random.randint(jax.random.PRNGKey(1), (B, S), 0, vocab, dtype=jnp.int32)
    t0 = time.perf_counter()
    loss, model, opt_state = step(tokens, model, opt_state)
    loss.block_until_ready()
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.learner_steps):
        t0 = time.perf_counter()
        loss, model, opt_state = step(tokens, model, opt_state)
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tps = B * S / med
    flops_per_token = 3 * config.flops_per_token(vocab)
    return {
        "shape": shape,
        "learner_batch": B,
        "seq_len": S,
        "attn": args.attn,
        "remat": args.remat,
        "ce_block": args.ce_block,
        "first_step_s": first,
        "step_s": med,
        "learner_tokens_per_s": tps,
        "mfu": flops_per_token * tps / PEAK_BF16_FLOPS,
        "loss": float(loss),
        "params": int(sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))),
    }


def bench_rlpipe_learner(shape: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """rlpipe's own learner step (`policy.learner.mesh_train_step`: the RL loss module, blockwise logprobs,
    f32 master weights cast to the compute dtype, the non-finite update guard) on the mesh of every device,
    for every combination of `--rl-batch`, `--logprob-block` and `--rl-attn` (comma lists of
    `model.attention_backend` values: `cudnn` is rlpipe's fused-attention route)."""
    out = []
    blocks = [None if b in ("none", "") else int(b) for b in str(args.logprob_block).split(",")]
    attns = args.rl_attn.split(",")
    for attn in attns:
        for batch in [int(b) for b in str(args.rl_batch).split(",")]:
            for block in blocks:
                try:
                    out.append(_rlpipe_learner_run(shape, args, batch, block, attn))
                except Exception as e:  # one configuration out of memory must not lose the others
                    out.append({"rl_batch": batch, "rl_logprob_block": block, "rl_attn": attn, "error": repr(e)[:300]})
                print(out[-1], flush=True)
    return out


def _rlpipe_learner_run(shape: str, args: argparse.Namespace, B: int, block: int | None, attn: str) -> dict[str, Any]:
    import equinox as eqx
    import jax

    from bench.common import synthetic_learner_batch
    from pipeline.config import LearnerStepConfig, MeshConfig, ModelSpec, TrainParams
    from policy import learner as L
    from policy import mesh as mesh_lib
    from policy import model as M
    from policy.losses import Batch

    S = args.seq_len
    lev, vocab = model_config(shape, seq_len=S)
    spec = ModelSpec(
        **{name: getattr(lev, name) for name in DIMS},
        max_seq_len=S,
        compute_dtype=args.dtype,
        gradient_checkpointing=args.remat != "none",
        logprob_block_size=block,
        attention_backend=attn,
    )
    config = LearnerStepConfig(
        model=spec, train=TrainParams(batch_size=B, seq_len=S, num_train_steps=1000), mesh=MeshConfig(fsdp=-1)
    )
    lm = mesh_lib.build_mesh(config.mesh)
    model = M.build_model(config.model, vocab)
    flops_per_token = 3 * M.levanter_config(spec).flops_per_token(vocab)
    optimizer = L.build_optimizer(config.optimizer, 1000)
    state = L.shard_state(L.LearnerState(0, model, optimizer.init(eqx.filter(model, eqx.is_array)), None), lm)
    del model
    batch = Batch(**mesh_lib.global_batch(synthetic_learner_batch(B, S, vocab, -11.0), lm, B))
    step = L.mesh_train_step(config, lm)
    t0 = time.perf_counter()
    m, o, metrics = step(state.model, state.opt_state, None, batch)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.learner_steps):
        t0 = time.perf_counter()
        m, o, metrics = step(m, o, None, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tps = B * S / med
    return {
        "rl_batch": B,
        "rl_first_step_s": first,
        "rl_step_s": med,
        "rl_tokens_per_s": tps,
        "rl_mfu": flops_per_token * tps / PEAK_BF16_FLOPS,
        "rl_loss": float(metrics["loss"]),
        "rl_logprob_block": block,
        "rl_attn": attn,
        "rl_params": int(sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(m, eqx.is_array)))),
    }


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's flags (`--tiny` shrinks every size for a CPU smoke run)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shape, small sizes")
    ap.add_argument("--device-compat", action="store_true", help="call device_compat.install() (on PYTHONPATH) first")
    ap.add_argument("--shapes", default="1b")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", action="store_true", help="also time levanter's InferenceEngine (slow)")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype (rollout weights/KV, learner activations)")
    ap.add_argument("--learner-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--learner-steps", type=int, default=5)
    ap.add_argument("--attn", default="cudnn", help="default | vanilla | jax_flash | nvte | cudnn | xla")
    ap.add_argument("--remat", default="none", help="none | full | a haliax ScanCheckpointPolicy string")
    ap.add_argument("--ce-block", type=int, default=None, help="blockwise cross-entropy vocab block (None: fused)")
    ap.add_argument("--logprob-block", default="none", help="rlpipe learner: logprob vocabulary blocks (list)")
    ap.add_argument("--rl-attn", default="default,cudnn", help="rlpipe learner: model.attention_backend values")
    ap.add_argument("--rl-batch", default="8", help="rlpipe learner: batch sizes in sequences (list)")
    ap.add_argument("--skip-rl", action="store_true", help="skip rlpipe's own learner step")
    ap.add_argument("--skip-rollout", action="store_true")
    ap.add_argument("--skip-learner", action="store_true")
    ap.add_argument("--bandwidth-mb", type=int, default=2048)
    ap.add_argument("--json", default=None)
    ap.add_argument("--decode-impl", default="fast", choices=("fast", "legacy"), help="rollout row: decode loop")
    ap.add_argument("--skip-decode", action="store_true", help="skip the decode-efficiency variants")
    ap.add_argument("--decode-only", action="store_true", help="only the bandwidth and the decode variants")
    ap.add_argument("--decode-batches", default="1,64,128,256", help="decode bench batch sizes (list)")
    ap.add_argument("--decode-variants", default=",".join(DECODE_VARIANTS), help="legacy, fast, continuous (list)")
    ap.add_argument("--ablations", default=",".join(DECODE_ABLATIONS), help="one-change variants (list; '' none)")
    ap.add_argument("--ablation-batch", type=int, default=128)
    ap.add_argument("--no-mismatch", dest="mismatch", action="store_false", help="skip the bf16 logprob check")
    ap.add_argument("--time-budget", type=float, default=1e9, help="decode bench: skip cases after this many s")
    args = ap.parse_args(argv)
    args.started = time.perf_counter()
    if args.decode_only:
        args.skip_rollout = args.skip_learner = args.skip_rl = True
    if args.tiny:
        args.shapes, args.batch, args.prompt_len, args.new_tokens = "tiny", 8, 16, 16
        args.learner_batch, args.seq_len, args.learner_steps, args.repeats = 2, 128, 2, 2
        args.bandwidth_mb = min(args.bandwidth_mb, 64)
        args.decode_batches, args.ablation_batch = "1,8", 8
        if args.attn == "cudnn":
            args.attn = "xla"  # the same code path with XLA's implementation (no cuDNN on CPU)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device_compat:
        import device_compat

        device_compat.install()
    import jax

    dev = jax.devices()[0]
    device = f"{dev.device_kind} ({dev.platform}) x{jax.device_count()}"
    bandwidth = measure_bandwidth(args.bandwidth_mb << 20)
    read_bandwidth = 0.0 if args.skip_decode else measure_read_bandwidth(args.bandwidth_mb << 20)
    matmul = 0.0 if args.decode_only else measure_matmul(512 if args.tiny else 8192)
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        row: dict[str, Any] = {"shape": shape}
        if not args.skip_rollout:
            row.update(bench_rollout(shape, args, bandwidth))
        if not args.skip_learner:
            row.update(bench_learner(shape, args))
        if not args.skip_rl:
            row["rl_runs"] = bench_rlpipe_learner(shape, args)
        if not args.skip_decode:
            # the decode roofline takes the faster of the two measures (a higher floor: the honest share)
            row["decode"] = bench_decode(shape, args, max(bandwidth, read_bandwidth))
        rows.append(row)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\nbench_gpu  {when}  device: {device}  jax {jax.__version__}")
    print(
        f"measured bandwidth {bandwidth / 1e9:.0f} GB/s (read + write), {read_bandwidth / 1e9:.0f} GB/s (read; the "
        f"decode table's roofline uses the larger), bf16 matmul {matmul / 1e12:.0f} TFLOP/s; "
        f"MFU against {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s"
    )
    if not args.decode_only:
        print_table(rows)
    for row in rows:
        if "decode" in row:
            print_decode_table(row["decode"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": when,
                    "device": device,
                    "bandwidth_Bps": bandwidth,
                    "read_bandwidth_Bps": read_bandwidth,
                    "matmul_flops": matmul,
                    "args": {k: v for k, v in vars(args).items() if k != "started"},
                    "rows": rows,
                },
                f,
                indent=2,
            )
    sys.stdout.flush()


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per shape: rollout tokens/s against the roofline, learner tokens/s and MFU."""
    hdr = (
        f"{'shape':<7} {'rollout B x new':>15} {'tok/s':>9} {'roofline':>9} {'ratio':>6} {'1st s':>6} "
        f"{'learner BxS':>11} {'tok/s':>8} {'MFU':>6} {'attn':>8} {'remat':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ro = (
            f"{r['batch']:>9} x {r['new_tokens']:<3} {r['dense_tokens_per_s']:>9.0f} "
            f"{r['roofline_tokens_per_s']:>9.0f} {r['roofline_ratio']:>6.1%} {r['dense_first_call_s']:>6.1f}"
            if "dense_tokens_per_s" in r
            else f"{'-':>15} {'':>9} {'':>9} {'':>6} {'':>6}"
        )
        le = (
            f"{r['learner_batch']:>6}x{r['seq_len']:<4} {r['learner_tokens_per_s']:>8.0f} {r['mfu']:>6.1%} "
            f"{r['attn']:>8} {r['remat']:>6}"
            if "mfu" in r
            else "-"
        )
        print(f"{r['shape']:<7} {ro} {le}")
        for q in r.get("rl_runs", []):
            what = f"rlpipe learner B={q['rl_batch']} logprob block {q['rl_logprob_block']}, attn {q['rl_attn']}"
            if "error" in q:
                print(f"        {what}: {q['error']}")
                continue
            print(
                f"        {what}: {q['rl_step_s']:.3f} s, {q['rl_tokens_per_s']:.0f} tok/s, MFU {q['rl_mfu']:.1%} "
                f"(first step {q['rl_first_step_s']:.0f} s, {q['rl_params'] / 1e9:.2f}B params)"
            )
        if "levanter_tokens_per_s" in r:
            print(
                f"        levanter InferenceEngine: {r['levanter_tokens_per_s']:.0f} tok/s "
                f"(first call {r['levanter_first_call_s']:.0f} s)"
            )


if __name__ == "__main__":
    main()
