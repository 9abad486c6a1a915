"""Where a dense-sampler decode step's device time goes: one traced call, kernel time grouped by name.

Run on the GPU machine after `bench/gpu_decode.sh` set up the path:
    python3 -m bench.gpu_profile_decode [--tiny] [--batch 128] [--continuous] [--separate] [--out DIR]
Prints the top kernels by total device time per decode step, the device-busy share of the call's wall time and
time by category (matmul, attention/fusion, reduce, copy/other)."""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--device-compat", action="store_true")
    ap.add_argument("--continuous", action="store_true", help="profile continuous batching (B slots, B requests)")
    ap.add_argument("--separate", action="store_true", help="separate projections (not fused, as before)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/prof"))
    args = ap.parse_args()
    if args.device_compat:
        import device_compat

        device_compat.install()
    import jax
    import numpy as np

    from bench.bench_gpu import model_config
    from policy.inference.dense_sampler import DecodeOptions, DenseSampler

    shape = "tiny" if args.tiny else "1b"
    B, P, T = args.batch, args.prompt_len, args.new_tokens
    import haliax as hax

    cfg, vocab = model_config(shape, max(P + T, 256))
    model = cfg.build(hax.Axis("vocab", vocab), key=jax.random.PRNGKey(0))
    sampler = DenseSampler(model, "bfloat16", decode=DecodeOptions(fused_projections=not args.separate))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, P).tolist() for _ in range(B)]

    def call(seed: int) -> None:
        out = sampler.generate(prompts, list(range(B)), batch_size=B, max_tokens=[T] * B, max_new_bucket=T,
                               stop_tokens=[], temperature=1.0, seed=seed)  # fmt: skip
        int(out.lengths.sum())

    if args.continuous:
        from policy.inference.continuous import ContinuousSampler, SeqRequest

        cont = ContinuousSampler(sampler)

        def call(seed: int) -> None:  # the variant under --continuous
            cont.run([SeqRequest(p, T, i, seed) for i, p in enumerate(prompts)], slots=B, stop_tokens=[],
                     temperature=1.0)  # fmt: skip

    call(0)
    call(1)
    t0 = time.perf_counter()
    call(2)
    wall = time.perf_counter() - t0
    import tempfile

    d = tempfile.mkdtemp(prefix="rlpipe-decode-trace-")  # a fresh folder: an earlier run's trace is not read
    with jax.profiler.trace(d, create_perfetto_trace=True):
        call(3)
    files = glob.glob(os.path.join(d, "**", "*perfetto*.json.gz"), recursive=True)
    print(f"untraced call {wall * 1e3:.1f} ms for {T} tokens x {B}; trace files: {files}")
    if args.continuous:
        print(f"continuous: {cont.decode_steps} decode steps, {cont.host_syncs} host syncs, {cont.trace_count} traces")
    if not files:
        return
    with gzip.open(files[0], "rt") as f:
        tr = json.load(f)
    events = tr["traceEvents"] if isinstance(tr, dict) else tr
    pids = {
        e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    dev = {p for p, n in pids.items() if "/device:gpu" in n.lower()}
    if not dev:  # CPU: use every non-host-python thread
        dev = set(pids)
    by_name: dict[str, float] = collections.defaultdict(float)
    lo, hi, busy = float("inf"), 0.0, 0.0
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in dev:
            continue
        dur = float(e.get("dur", 0.0))
        by_name[e.get("name", "?")] += dur
        busy += dur
        lo, hi = min(lo, float(e["ts"])), max(hi, float(e["ts"]) + dur)
    print(f"device processes: {[pids[p] for p in dev]}")
    print(f"device busy {busy / 1e3:.1f} ms over a span of {(hi - lo) / 1e3:.1f} ms; per decode step "
          f"{busy / 1e3 / T:.3f} ms busy")  # fmt: skip
    cats: dict[str, float] = collections.defaultdict(float)
    for n, v in by_name.items():
        low = n.lower()
        k = ("gemm/matmul" if any(s in low for s in ("gemm", "cublas", "matmul", "dot", "cutlass", "sm90", "xmma"))
             else "copy/memcpy" if any(s in low for s in ("copy", "memcpy", "memset", "transpose"))
             else "reduce" if "reduce" in low else "fusion/other")  # fmt: skip
        cats[k] += v
    for k, v in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<14} {v / 1e3 / T:8.3f} ms/step  {v / busy:6.1%}")
    for n, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:30]:
        print(f"  {v / 1e3 / T:8.4f} ms/step {v / busy:6.1%}  {n[:110]}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump({"wall_ms": wall * 1e3, "busy_ms": busy / 1e3, "span_ms": (hi - lo) / 1e3, "by_name": by_name}, f)


if __name__ == "__main__":
    main()
