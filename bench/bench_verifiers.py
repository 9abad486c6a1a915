"""A verifiers lesson against an rlpipe environment class doing the same single-turn task on the same sampler: rows/s
and the per-episode overhead in CPU seconds.

The task is configs/envs/verifiers_cats.py ("Say cats <i>." over 8 tasks; reward `says_cats` + 0.5 `brevity`),
once as a verifiers lesson (`VerifiersEnv`, verifiers' own rollout loop: its chat program, interception server and
training client, model calls through the generate endpoint) and once as `SayCatsEnv` below (a
`SingleTurnEnvironment`: one `generate` call, the same prompts through the same chat template, the same reward).
Both sample from the same dense sampler (random weights; `--size tiny`, the default, or `50m`, bench_rollout's
~50M shape) through one `BackendContext`: each step is `--examples` x `--generations` episodes of at most
`--max_tokens` tokens. At the tiny size the sampler takes well under a millisecond per episode, so the ratio is
the environments' own cost per episode (the upper bound of the overhead); at ~50M the sampler does a step's work
of a small real model, and the ratio is what a lesson costs beside it. The verifiers lesson runs as
configured by default (`verifiers`: the chat program in this process, `harness_in_process`), with its warm harness
pool instead (`verifiers_pool`: `harness_in_process: false`, after one warm-up step that starts the pool) and, for
`--per_episode_steps` steps, with a new harness process per episode (`verifiers_per_episode`: neither, verifiers'
own runtime).

Figures per variant: median wall seconds per step over `--steps` steps, rows/s, and CPU seconds of the whole
process tree per step (this process, its reaped children, and the live pool processes read from /proc). The
per-episode overhead is (verifiers CPU per step - rlpipe CPU per step) / episodes per step; the ratio is rlpipe
rows/s over verifiers rows/s (goal <= 2).

    python -m bench.bench_verifiers [--size tiny|50m] [--steps 3] [--pool_steps 3] [--per_episode_steps 1]
                                    [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from bench.common import machine_name
from pipeline.environments.base import Example, SampleSpec, Score, SingleTurnEnvironment

CATS = "configs/envs/verifiers_cats.py:load_environment"
N_TASKS = 8
"""Tasks of the verifiers taskset (its default `n`); `SayCatsEnv` has the same prompts."""


class SayCatsEnv(SingleTurnEnvironment):
    """configs/envs/verifiers_cats.py's task as an rlpipe environment class: prompts "Say cats <i>." (drawn with rng),
    reward 1.0 iff the reply mentions cats, plus 0.5 x (1 - len(reply)/16, at least 0)."""

    name = "say_cats"

    def examples(self, n: int, rng: np.random.Generator, mode: str) -> list[Example]:
        return [Example(f"cats-{int(i)}", f"Say cats {int(i)}.") for i in rng.integers(0, N_TASKS, size=n)]

    def score(self, example: Example, text: str) -> Score:
        says = 1.0 if "cat" in text.lower() else 0.0
        return Score(reward=says + 0.5 * max(0.0, 1.0 - len(text) / 16), success=says > 0)


class FixedBatchContext:
    """`inner` (an `InferenceContext`) with every `generate` call padded to `sequences` sequences (the first prompt
    repeated; the extra completions dropped): the generate endpoint batches whatever episodes' calls are pending, and
    a JIT-compiled sampler compiles once per new batch shape, which would time the compiler, not the environments.
    Both variants sample `sequences` sequences per call this way."""

    def __init__(self, inner: Any, sequences: int) -> None:
        self.inner = inner
        self.sequences = sequences
        self.tokenizer = inner.tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def generate(self, request: Any) -> Any:
        want = max(1, self.sequences // request.n)
        if len(request.prompts) >= want:
            return self.inner.generate(request)
        pad = [request.prompts[0]] * (want - len(request.prompts))
        out = self.inner.generate(dataclasses.replace(request, prompts=[*request.prompts, *pad]))
        return out[: len(request.prompts)]


def _tree_cpu(pids: list[int]) -> float:
    """CPU seconds of this process, its reaped children and the live processes `pids` (from /proc)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            pass  # ended meanwhile: reaped, so counted in RUSAGE_CHILDREN
    return total


def measure(env: Any, ctx: Any, spec: SampleSpec, steps: int, seed: int) -> dict[str, Any]:
    """Median wall s, rows/s and CPU s per step of `steps` sampling calls of `env`."""
    walls, cpus, rows, failures = [], [], 0, 0
    pool = getattr(env, "harness_pool", None)
    for s in range(steps):
        pids = pool.live_pids() if pool is not None else []
        c0, t0 = _tree_cpu(pids), time.perf_counter()
        res = env.sample(ctx, spec, np.random.default_rng(seed + s))
        wall = time.perf_counter() - t0
        pids = sorted(set(pids) | set(pool.live_pids() if pool is not None else []))
        cpus.append(_tree_cpu(pids) - c0)
        walls.append(wall)
        rows += sum(len(g.rollouts) for g in res.groups)
        failures += len(res.failures)
    wall = statistics.median(walls)
    per_step = rows / steps
    return {
        "steps": steps,
        "rows_per_step": per_step,
        "failures": failures,
        "s_per_step": wall,
        "rows_per_s": per_step / wall if wall > 0 else None,
        "cpu_s_per_step": statistics.median(cpus),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max_tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--size", choices=("tiny", "50m"), default="tiny", help="the sampler's model shape")
    ap.add_argument("--pool_steps", type=int, default=None, help="steps of the harness-pool variant (default --steps)")
    ap.add_argument("--per_episode_steps", type=int, default=1, help="steps without the pool (0: skip)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from bench.bench_rollout import SIZES
    from pipeline.config import DenseInferenceConfig
    from pipeline.environments.tokenizer import load_tokenizer
    from pipeline.environments.verifiers_env import VerifiersEnv
    from policy.inference import BackendContext, make_backend
    from policy.model import build_model, model_vocab_size

    model_spec = SIZES[args.size]
    tok = load_tokenizer(model_spec.tokenizer)
    episodes = args.examples * args.generations
    backend = make_backend(
        DenseInferenceConfig(max_seqs=episodes), build_model(model_spec, model_vocab_size(tok)), tok, 256
    )
    inner = BackendContext(tok, backend)
    inner.max_seq_len = 256
    ctx = FixedBatchContext(inner, episodes)
    spec = SampleSpec(n_examples=args.examples, n_generations=args.generations, temperature=1.0,
                      max_tokens=args.max_tokens, stop_tokens=None, mode="train", chat=True)  # fmt: skip
    rlpipe = SayCatsEnv()
    rlpipe.sample(ctx, spec, np.random.default_rng(99))  # compiles the sampler's shapes
    out: dict[str, Any] = {"machine": machine_name(), "size": args.size, "episodes_per_step": episodes,
                           "max_tokens": args.max_tokens}  # fmt: skip
    out["rlpipe"] = measure(rlpipe, ctx, spec, args.steps, seed=0)
    lesson = VerifiersEnv(env=CATS, max_turns=1, max_seq_len=256)
    try:
        lesson.sample(ctx, spec, np.random.default_rng(98))  # warm-up: loads the chat program
        out["verifiers"] = measure(lesson, ctx, spec, args.steps, seed=0)
    finally:
        lesson.close()
    pool_steps = args.steps if args.pool_steps is None else args.pool_steps
    if pool_steps:
        pooled = VerifiersEnv(env=CATS, max_turns=1, max_seq_len=256, harness_in_process=False)
        try:
            t0 = time.perf_counter()
            pooled.sample(ctx, spec, np.random.default_rng(98))  # warm-up: starts the pool's processes
            out["pool_warmup_s"] = time.perf_counter() - t0
            out["verifiers_pool"] = measure(pooled, ctx, spec, pool_steps, seed=0)
            pool = pooled.harness_pool
            assert pool is not None
            out["pool_starts"], out["pool_episodes"] = pool.stats.starts, pool.stats.episodes
        finally:
            pooled.close()
    if args.per_episode_steps:
        fresh = VerifiersEnv(env=CATS, max_turns=1, max_seq_len=256, harness_pool_size=0, harness_in_process=False)
        try:
            out["verifiers_per_episode"] = measure(fresh, ctx, spec, args.per_episode_steps, seed=0)
        finally:
            fresh.close()
    backend.shutdown()
    base = out["rlpipe"]
    for key in ("verifiers", "verifiers_pool", "verifiers_per_episode"):
        v = out.get(key)
        if v:
            v["ratio"] = base["rows_per_s"] / v["rows_per_s"] if v["rows_per_s"] else None
            v["overhead_cpu_s_per_episode"] = (v["cpu_s_per_step"] - base["cpu_s_per_step"]) / episodes
    print(f"\nverifiers lesson vs rlpipe environment class, same task and sampler ({args.size}); {out['machine']}")
    print(f"{episodes} episodes per step, max_tokens {args.max_tokens}; median of steps")
    print(f"{'variant':24} {'s/step':>8} {'rows/s':>8} {'CPU s/step':>11} {'ratio':>6} {'overhead CPU s/episode':>23}")
    for key in ("rlpipe", "verifiers", "verifiers_pool", "verifiers_per_episode"):
        v = out.get(key)
        if v:
            ratio = f"{v['ratio']:.2f}" if v.get("ratio") else "-"
            over = f"{v['overhead_cpu_s_per_episode']:.3f}" if "overhead_cpu_s_per_episode" in v else "-"
            figs = f"{v['s_per_step']:8.2f} {v['rows_per_s']:8.1f} {v['cpu_s_per_step']:11.2f}"
            print(f"{key:24} {figs} {ratio:>6} {over:>23}")
    print("ratio: rlpipe rows/s / the variant's rows/s (goal <= 2 for verifiers, the lesson as configured by default)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
