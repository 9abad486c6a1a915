"""Continuous vs static batching in the dense sampler on a long-tailed completion-length distribution (CPU).

Workload: `--prompts` prompts of `--prompt-len` random tokens, `--n` samples each, temperature 1, on the tiny Llama
(`ModelSpec()` defaults, random weights, 512-token vocabulary, 1024 positions). Completion lengths are geometric
with mean `--mean` (p = 1/mean), capped at `--max-len`, one per sample, drawn with a fixed seed. The lengths are
forced: each sample's token budget (`max_tokens`) is its drawn length and there is no stop token (EOS suppressed:
`stop_tokens=[]`), so every sample generates exactly its drawn length on both paths. Both paths get the same rows
(prompt, budget, PRNG id), seed and `max_seqs` (`--slots`): static batching (`DenseSampler`: batches of `max_seqs`
rows, each decoded until its longest row ends) and continuous batching (`policy.inference.continuous`: `max_seqs`
slots refilled as sequences finish, the n samples of a prompt prefilled once).

Reported: generated tokens/s of each (after one warm-up call on the same shapes, so compilation is not timed;
median of `--repeats`), decode steps, prefill work (prompt tokens through prefill, padding included) and the
agreement of the two paths' samples (same tokens, max |logprob difference|). Goals: tokens/s ratio >= 2, prefill
ratio <= 1/4 at n = 8.

    JAX_PLATFORMS=cpu python -m bench.bench_continuous [--prompts 32 --n 8 --slots 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np

from bench.common import machine_name
from pipeline.config import DenseInferenceConfig, ModelSpec
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import make_backend
from policy.inference.dense import DenseBackend
from policy.inference.local import SampleRow
from policy.model import build_model, count_params

VOCAB = 512  # builtin:tiny


def workload(prompts: int, n: int, prompt_len: int, mean: int, max_len: int, seed: int = 0) -> list[SampleRow]:
    """`prompts` × `n` rows: random prompts (BOS + ids), budgets geometric(1/mean) capped at `max_len`."""
    rng = np.random.default_rng(seed)
    rows: list[SampleRow] = []
    for i in range(prompts):
        prompt = [1, *rng.integers(3, VOCAB, size=prompt_len - 1).tolist()]
        lengths = np.minimum(rng.geometric(1.0 / mean, size=n), max_len)
        rows.extend(SampleRow(i, j, prompt, int(lengths[j]), i * n + j) for j in range(n))
    return rows


def _timed(be: DenseBackend, rows: list[SampleRow], *, continuous: bool, seed: int) -> tuple[float, list[Any]]:
    t0 = time.perf_counter()
    out = be.generate_rows(rows, temperature=1.0, seed=seed, stops=[], continuous=continuous)
    return time.perf_counter() - t0, out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both paths on the same rows; the figures as a dict."""
    spec = ModelSpec(max_seq_len=1024)
    model = build_model(spec, VOCAB, key=jax.random.PRNGKey(0))
    tok = load_tokenizer(spec.tokenizer)
    be = make_backend(DenseInferenceConfig(max_seqs=args.slots), model, tok, spec.max_seq_len)
    assert isinstance(be, DenseBackend) and be.sampler is not None
    rows = workload(args.prompts, args.n, args.prompt_len, args.mean, args.max_len)
    # warm-up on the same shape buckets (a batch of `slots` rows with the longest budget), compiles both paths
    warm = [*rows[: args.slots - 1], max(rows, key=lambda r: r.max_tokens)]
    warm = [SampleRow(r.prompt_index, r.sample_index, r.prompt, min(r.max_tokens, 4), r.sample_id) for r in warm]
    warm[-1] = SampleRow(0, 0, rows[0].prompt, max(r.max_tokens for r in rows), 0)
    for continuous in (False, True):
        be.generate_rows(warm, temperature=1.0, seed=99, stops=[], continuous=continuous)
    res: dict[str, Any] = {"machine": machine_name(), "params": count_params(model), "sequences": len(rows)}
    res["workload"] = {k: getattr(args, k) for k in ("prompts", "n", "prompt_len", "mean", "max_len", "slots")}
    res["tokens"] = sum(r.max_tokens for r in rows)
    outs: dict[str, list[Any]] = {}
    for name, continuous in (("static", False), ("continuous", True)):
        sampler = be.continuous_sampler() if continuous else be.sampler
        times = []
        for _ in range(args.repeats):
            p0 = sampler.prefill_tokens
            d0 = be.continuous_sampler().decode_steps
            s, out = _timed(be, rows, continuous=continuous, seed=0)
            times.append(s)
            prefill = sampler.prefill_tokens - p0
            # static: each batch of `slots` rows (all prompts share one length bucket, so rows are chunked in order)
            # decodes until its longest budget, there being no stop token
            static_steps = sum(
                max(r.max_tokens for r in rows[k : k + args.slots]) for k in range(0, len(rows), args.slots)
            )
            steps = be.continuous_sampler().decode_steps - d0 if continuous else static_steps
            outs[name] = out
        generated = sum(len(c.tokens) for c in outs[name] if c is not None)
        med = statistics.median(times)
        res[name] = {
            "seconds": med,
            "tokens_per_s": generated / med,
            "generated": generated,
            "prefill_tokens": prefill,
            "decode_steps": steps,
        }
    same = sum(a.tokens == b.tokens for a, b in zip(outs["static"], outs["continuous"], strict=True))
    max_diff = max(
        float(np.max(np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs))))
        for a, b in zip(outs["static"], outs["continuous"], strict=True)
        if a.tokens == b.tokens
    )
    res["same_tokens"] = same
    res["max_logprob_diff"] = max_diff
    res["speedup"] = res["continuous"]["tokens_per_s"] / res["static"]["tokens_per_s"]
    res["prefill_ratio"] = res["continuous"]["prefill_tokens"] / res["static"]["prefill_tokens"]
    be.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", dest="prompt_len", type=int, default=16)
    ap.add_argument("--mean", type=int, default=64)
    ap.add_argument("--max-len", dest="max_len", type=int, default=512)
    ap.add_argument("--slots", type=int, default=64, help="max_seqs of both paths")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    r = run(args)
    w = r["workload"]
    print(
        f"\ncontinuous vs static batching, dense sampler, {r['machine']}, "
        f"jax {jax.__version__} ({jax.default_backend()})"
    )
    print(
        f"tiny Llama ({r['params']:,} params), {w['prompts']} prompts x n={w['n']}, prompt {w['prompt_len']} tokens, "
        f"lengths geometric mean {w['mean']} cap {w['max_len']} ({r['tokens']:,} tokens), {w['slots']} slots, T=1"
    )
    print(f"{'path':<11} {'seconds':>8} {'tokens/s':>9} {'prefill tokens':>15} {'decode steps':>13}")
    for name in ("static", "continuous"):
        f = r[name]
        steps = f"{f['decode_steps']:,}"
        print(f"{name:<11} {f['seconds']:>8.2f} {f['tokens_per_s']:>9,.0f} {f['prefill_tokens']:>15,} {steps:>13}")
    print(
        f"continuous / static tokens/s: {r['speedup']:.2f} (goal >= 2); prefill work: {r['prefill_ratio']:.3f} "
        f"(goal <= 0.25); same tokens {r['same_tokens']}/{r['sequences']}, max |logprob diff| "
        f"{r['max_logprob_diff']:.2e}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
