"""Continuous vs static batching in the dense sampler on a long-tailed completion-length distribution (CPU).

Workload: `--prompts` prompts of `--prompt-len` random tokens, `--n` samples each, temperature 1, on the tiny Llama
(`ModelSpec()` defaults, random weights, 512-token vocabulary, 1024 positions). Completion lengths are geometric
with mean `--mean` (p = 1/mean), capped at `--max-len`, one per sample, drawn with a fixed seed. The lengths are
forced: each sample's token budget (`max_tokens`) is its drawn length and there is no stop token (EOS suppressed:
`stop_tokens=[]`), so every sample generates exactly its drawn length on both paths. Both paths get the same rows
(prompt, budget, PRNG id), seed and `max_seqs` (`--slots`): static batching (`DenseSampler`: batches of `max_seqs`
rows, each decoded until its longest row ends) and continuous batching (`policy.inference.continuous`: `max_seqs`
slots refilled as sequences finish, the n samples of a prompt prefilled once).

Reported: generated tokens/s of each (after one warm-up call of each path on the same rows with another seed, so
compilation is not timed; median of `--repeats`), process CPU seconds (steadier than wall time on a shared machine),
decode steps, device-to-host syncs (continuous: one per decode program; static: one per batch), prefill work (prompt
tokens through prefill, padding included) and the agreement of the two paths' samples (same tokens, max |logprob
difference|); then the same on equal lengths (every sample's budget `--mean`). Goals: tokens/s ratio >= 2 on the
long-tailed lengths and >= 0.95 on equal lengths, prefill ratio <= 1/4 at n = 8.

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


def _timed(be: DenseBackend, rows: list[SampleRow], *, continuous: bool, seed: int) -> tuple[float, float, list[Any]]:
    """Wall and process CPU seconds of one call (CPU time is the steadier figure on a shared machine)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = be.generate_rows(rows, temperature=1.0, seed=seed, stops=[], continuous=continuous)
    return time.perf_counter() - t0, time.process_time() - c0, out


def measure(be: DenseBackend, rows: list[SampleRow], slots: int, repeats: int) -> dict[str, Any]:
    """Both paths on `rows` (after one warm-up call of each on the same rows with another seed, so that every
    shape bucket either path meets is compiled); the figures as a dict."""
    for continuous in (False, True):
        be.generate_rows(rows, temperature=1.0, seed=99, stops=[], continuous=continuous)
    res: dict[str, Any] = {"tokens": sum(r.max_tokens for r in rows)}
    outs: dict[str, list[Any]] = {}
    cont = be.continuous_sampler()
    for name, continuous in (("static", False), ("continuous", True)):
        sampler = cont if continuous else be.sampler
        assert sampler is not None
        times, cpu = [], []
        for _ in range(repeats):
            p0, d0, h0 = sampler.prefill_tokens, cont.decode_steps, cont.host_syncs
            s, c, out = _timed(be, rows, continuous=continuous, seed=0)
            times.append(s)
            cpu.append(c)
            prefill = sampler.prefill_tokens - p0
            # static: rows are chunked in order into batches of `slots` (all prompts share one length bucket), each
            # decoding until its longest budget, there being no stop token
            static_steps = sum(max(r.max_tokens for r in rows[k : k + slots]) for k in range(0, len(rows), slots))
            steps = cont.decode_steps - d0 if continuous else static_steps
            syncs = cont.host_syncs - h0 if continuous else -(-len(rows) // slots)
            outs[name] = out
        generated = sum(len(c.tokens) for c in outs[name] if c is not None)
        med, med_cpu = statistics.median(times), statistics.median(cpu)
        res[name] = {
            "seconds": med,
            "cpu_seconds": med_cpu,
            "tokens_per_s": generated / med,
            "tokens_per_cpu_s": generated / med_cpu,
            "generated": generated,
            "prefill_tokens": prefill,
            "decode_steps": steps,
            "host_syncs": syncs,
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
    res["cpu_speedup"] = res["continuous"]["tokens_per_cpu_s"] / res["static"]["tokens_per_cpu_s"]
    res["prefill_ratio"] = res["continuous"]["prefill_tokens"] / res["static"]["prefill_tokens"]
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both paths on the long-tailed rows (the top-level figures) and on the same rows with every budget `--mean`
    (`equal`); the figures as a dict."""
    spec = ModelSpec(max_seq_len=1024)
    model = build_model(spec, VOCAB, key=jax.random.PRNGKey(0))
    tok = load_tokenizer(spec.tokenizer)
    be = make_backend(DenseInferenceConfig(max_seqs=args.slots), model, tok, spec.max_seq_len)
    assert isinstance(be, DenseBackend) and be.sampler is not None
    rows = workload(args.prompts, args.n, args.prompt_len, args.mean, args.max_len)
    res: dict[str, Any] = {"machine": machine_name(), "params": count_params(model), "sequences": len(rows)}
    res["workload"] = {k: getattr(args, k) for k in ("prompts", "n", "prompt_len", "mean", "max_len", "slots")}
    res.update(measure(be, rows, args.slots, args.repeats))
    equal = [SampleRow(r.prompt_index, r.sample_index, r.prompt, args.mean, r.sample_id) for r in rows]
    res["equal"] = measure(be, equal, args.slots, args.repeats)
    res["machine_after"] = machine_name()
    be.shutdown()
    return res


def _table(r: dict[str, Any]) -> None:
    print(
        f"{'path':<11} {'seconds':>8} {'cpu s':>7} {'tokens/s':>9} {'prefill tokens':>15} "
        f"{'decode steps':>13} {'syncs':>6}"
    )
    for name in ("static", "continuous"):
        f = r[name]
        print(
            f"{name:<11} {f['seconds']:>8.2f} {f['cpu_seconds']:>7.2f} {f['tokens_per_s']:>9,.0f} "
            f"{f['prefill_tokens']:>15,} {f['decode_steps']:>13,} {f['host_syncs']:>6,}"
        )


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
        f"\ncontinuous vs static batching, dense sampler, {r['machine']} (after: {r['machine_after']}), "
        f"jax {jax.__version__} ({jax.default_backend()})"
    )
    print(
        f"tiny Llama ({r['params']:,} params), {w['prompts']} prompts x n={w['n']}, prompt {w['prompt_len']} tokens, "
        f"{w['slots']} slots, T=1; long-tailed: lengths geometric mean {w['mean']} cap {w['max_len']} "
        f"({r['tokens']:,} tokens)"
    )
    _table(r)
    e = r["equal"]
    print(f"equal lengths: every sample {w['mean']} tokens ({e['tokens']:,} tokens)")
    _table(e)
    for name, x, goal in (("long-tailed", r, 2.0), ("equal lengths", e, 0.95)):
        print(
            f"continuous / static tokens/s, {name}: {x['speedup']:.2f} (goal >= {goal}; per CPU second "
            f"{x['cpu_speedup']:.2f}); same tokens {x['same_tokens']}/{r['sequences']}, max |logprob diff| "
            f"{x['max_logprob_diff']:.2e}"
        )
    print(f"prefill work, long-tailed: {r['prefill_ratio']:.3f} (goal <= 0.25)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
