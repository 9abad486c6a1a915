"""XLA GEMM settings and projection layouts for the dense sampler's decode step (and the learner step), one process
per setting, on a GPU machine:

    python3 -m bench.gpu_sweep [--budget 450] [--out DIR]      (JAX_PLATFORMS=cpu ... --tiny: a CPU smoke test)

XLA flags are read once per process, so each setting runs `bench.bench_gpu` in a process of its own (the
Llama-3.2-1B shape, batch 128, 64-token prompts, 128 new tokens; the fast decode loop with separate and with fused
projections), then the learner step (`--learner-batches`, default 64) under the default and the best decode
setting (`--decode-cases`, `--decode-variants`, `--learner-cases` choose).
Cases still pending after `--budget` seconds are listed as skipped. Prints one table and writes `sweep.jsonl` (one
line per case) and `log.txt` (each process's output tail) to `--out` (default `$OUT`, else /tmp/gpu_sweep). The
machine's python needs levanter and haliax importable, as for `bench/gpu_decode.sh` (wheels installed with
`--target /tmp/site`, `PYTHONPATH=/tmp/site:.device` and `--device-compat` where JAX needs the shim).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

DECODE_SETTINGS: list[tuple[str, str]] = [
    ("xla-default", ""),
    ("cublas-only", "--xla_gpu_enable_triton_gemm=false"),
    ("cublaslt", "--xla_gpu_enable_cublaslt=true"),
    ("no-command-buffer", "--xla_gpu_enable_command_buffer="),
    ("exhaustive-tiling", "--xla_gpu_exhaustive_tiling_search=true"),
]
"""(name, XLA_FLAGS) of the settings, in the order they run. `exhaustive-tiling` is not among the defaults: its
autotuning did not finish within a case's 170 s on an H200 (2026-11-29)."""
DEFAULT_DECODE_CASES = ["xla-default", "cublas-only", "cublaslt", "no-command-buffer"]

DECODE_ARGS = [
    "--decode-only",
    "--shapes",
    "1b",
    "--prompt-len",
    "64",
    "--new-tokens",
    "128",
    "--repeats",
    "3",
    "--bandwidth-mb",
    "2048",
    "--decode-batches",
    "128",
    "--ablations=",
    "--no-mismatch",
]
LEARNER_ARGS = [
    "--shapes",
    "1b",
    "--skip-rollout",
    "--skip-learner",
    "--skip-decode",
    "--rl-attn",
    "cudnn",
    "--remat",
    "full",
    "--logprob-block",
    "16384",
    "--learner-steps",
    "3",
]


def _run(name: str, flags: str, args: list[str], timeout: float, out: str) -> list[dict[str, Any]]:
    """One `bench.bench_gpu` process under `XLA_FLAGS=flags`; its decode and learner rows, tagged with the case."""
    path = os.path.join("/tmp", f"gpu_sweep_{name}.json")
    if os.path.exists(path):
        os.remove(path)
    env = {**os.environ, "XLA_FLAGS": flags}
    cmd = [sys.executable, "-m", "bench.bench_gpu", *args, "--json", path]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = 124, f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "log.txt"), "a") as f:
        f.write(f"=== {name} XLA_FLAGS={flags!r} rc={rc} wall={wall:.0f}s\n{tail}\n")
    if rc != 0 or not os.path.exists(path):
        return [{"case": name, "flags": flags, "error": f"rc={rc}: {tail.strip().splitlines()[-1:]}", "wall_s": wall}]
    with open(path) as f:
        data = json.load(f)
    rows: list[dict[str, Any]] = []
    for shape_row in data.get("rows", []):
        for r in (shape_row.get("decode") or {}).get("runs", []):
            rows.append({"case": name, "flags": flags, "kind": "decode", **r})
        for r in shape_row.get("rl_runs", []):
            rows.append({"case": name, "flags": flags, "kind": "learner", **r})
    for r in rows:
        r.update(device=data.get("device"), date=data.get("date"), bandwidth_Bps=data.get("bandwidth_Bps"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=450.0, help="skip cases after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_sweep")
    ap.add_argument("--case-timeout", type=float, default=170.0)
    ap.add_argument("--skip-learner", action="store_true")
    ap.add_argument("--decode-cases", default="", help="comma list of DECODE_SETTINGS names (default: the four)")
    ap.add_argument("--decode-variants", default="fast-unfused,fast-fused", help="bench_gpu --decode-variants")
    ap.add_argument(
        "--learner-cases", default="", help="comma list of settings for the learner (default: default and best)"
    )
    ap.add_argument("--learner-batches", default="64", help="bench_gpu --rl-batch for the learner cases")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: the tiny shape, decode settings only")
    ap.add_argument("--device-compat", action="store_true", help="bench.bench_gpu --device-compat (the shim)")
    args = ap.parse_args()
    shape = ["--tiny"] if args.tiny else []
    shape += ["--device-compat"] if args.device_compat else []
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []

    def case(name: str, flags: str, case_args: list[str]) -> None:
        left = args.budget - (time.perf_counter() - start)
        if left < 30:
            skipped.append(name)
            return
        new = _run(name, flags, case_args, min(args.case_timeout, left), args.out)
        rows.extend(new)
        with open(os.path.join(args.out, "sweep.jsonl"), "a") as f:
            for r in new:
                f.write(json.dumps(r) + "\n")
        for r in new:
            if "error" in r:
                print(f"{name:<18} error {r['error']}", flush=True)
            elif r["kind"] == "decode":
                step, share = r.get("decode_step_ms", 0), r.get("decode_roofline_ratio", 0)
                print(f"{name:<18} {r['variant']:<12} step {step:7.3f} ms  roofline {share:6.1%}  "
                      f"call {r['call_s'] * 1e3:7.1f} ms", flush=True)  # fmt: skip
            else:
                print(f"{name:<18} learner b{r['rl_batch']} MFU {r.get('rl_mfu', 0):6.1%} step "
                      f"{r.get('rl_step_s', 0):.3f} s {r.get('error', '')}", flush=True)  # fmt: skip

    settings = dict(DECODE_SETTINGS)
    for name in args.decode_cases.split(",") if args.decode_cases else DEFAULT_DECODE_CASES:
        case(name, settings[name], [*DECODE_ARGS, "--decode-variants", args.decode_variants, *shape])
    if not (args.skip_learner or args.tiny):
        decode = [r for r in rows if r.get("kind") == "decode" and "decode_step_ms" in r]
        best = min(decode, key=lambda r: r["decode_step_ms"])["case"] if decode else "xla-default"
        learner = args.learner_cases.split(",") if args.learner_cases else ["xla-default", best]
        for name in dict.fromkeys(learner):
            case(f"learner-{name}", settings[name], [*LEARNER_ARGS, "--rl-batch", args.learner_batches, *shape])
    if skipped:
        print(f"skipped (budget {args.budget:.0f} s): {', '.join(skipped)}")
    print(f"sweep: {len(rows)} rows in {time.perf_counter() - start:.0f} s -> {args.out}/sweep.jsonl")


if __name__ == "__main__":
    main()
