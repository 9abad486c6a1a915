"""The dense sampler's decode GEMMs alone, one kernel choice at a time, on a GPU machine:

    python3 -m bench.gpu_gemm [--rows 128] [--out DIR]       (JAX_PLATFORMS=cpu ... --tiny: a CPU smoke test)

At batch 128 on the Llama-3.2-1B shape, every decode step multiplies 128 rows by each layer's weight matrices
(fused query/key/value, output, fused gate/up, down) and by the tied embedding (the logits). This times each of
those products over `--layers` distinct weight matrices and inputs (so the weights come from HBM, not the L2 cache,
as in a decode step, and XLA cannot merge the products into one) and reports per product its time (CUPTI kernel
time on a GPU, wall time elsewhere) and its share of the weight bandwidth `--bandwidth` (weight bytes / time).
Variants:

- `xla-in-out`: `x @ w` with `w` `[in, out]`, XLA's own GEMM choice (autotuned);
- `xla-out-in`: `x @ w.T` with `w` stored `[out, in]`, the dense sampler's layout;
- `xla-splitk-S`: the contraction split in S parts as a batched product (`[S, rows, in/S] x [S, in/S, out]`),
  summed in float32: S times the thread blocks for the narrow products;
- `pallas-hopper-…`: JAX's Pallas Mosaic-GPU Hopper matmul (`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`)
  under a few tilings (Hopper GPUs only).

Writes `gemm.jsonl` (one line per product and variant) to `--out` (default `$OUT`, else /tmp/gpu_gemm) and prints a
table with the best variant per product.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

SHAPES_1B: dict[str, tuple[int, int, int]] = {
    # name: (in, out, how many per decode step)
    "qkv": (2048, 2048 + 2 * 512, 16),
    "o": (2048, 2048, 16),
    "gate_up": (2048, 2 * 8192, 16),
    "down": (8192, 2048, 16),
    "logits": (2048, 128256, 1),
}
SHAPES_TINY: dict[str, tuple[int, int, int]] = {"qkv": (64, 128, 2), "down": (256, 64, 2)}


def time_fn(fn: Callable[..., Any], args: tuple[Any, ...], reps: int) -> float:
    """Median wall seconds of one call of `fn(*args)`, compiled and warmed first."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_time(fn: Callable[..., Any], args: tuple[Any, ...], reps: int) -> float | None:
    """Median seconds of the kernels of one call of `fn(*args)`, measured by CUPTI (None where it is unavailable)."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, ms = profiler.measure(fn, iterations=reps)(*args)
    except Exception as e:  # fall back to wall time
        print(f"CUPTI timing unavailable: {type(e).__name__}: {e}", flush=True)
        return None
    if not ms:
        return None
    return statistics.median(ms) / 1e3


def xla_in_out(x: jax.Array, ws: jax.Array) -> list[jax.Array]:
    return [x[i] @ ws[i] for i in range(ws.shape[0])]


def xla_out_in(x: jax.Array, ws: jax.Array) -> list[jax.Array]:
    return [x[i] @ ws[i].T for i in range(ws.shape[0])]


def xla_split_k(parts: int) -> Callable[[jax.Array, jax.Array], list[jax.Array]]:
    def run(x: jax.Array, ws: jax.Array) -> list[jax.Array]:
        _, rows, k = x.shape
        outs = []
        for i in range(ws.shape[0]):
            xs = x[i].reshape(rows, parts, k // parts)
            w = ws[i].reshape(parts, k // parts, ws.shape[-1])
            y = jnp.einsum("msk,skn->smn", xs, w, preferred_element_type=jnp.float32)
            outs.append(y.sum(0).astype(x.dtype))
        return outs

    return run


def hopper_variants(rows: int, k: int, n: int) -> list[tuple[str, Callable[[jax.Array, jax.Array], list[jax.Array]]]]:
    """Pallas Hopper matmul tilings that divide this product ([] where the kernel is unavailable)."""
    try:
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    except Exception as e:  # report and go on without the kernel
        print(f"pallas hopper matmul unavailable: {type(e).__name__}: {e}", flush=True)
        return []
    fields = {f.name for f in dataclasses.fields(hm.TuningConfig)}
    takes_c = "c" in inspect.signature(hm.matmul).parameters
    out = []
    for tile_m, tile_n, wg, steps, tile_k in itertools.product((64, 128), (64, 128), ("M", "N"), (4,), (64, 128)):
        cta_m = tile_m * (2 if wg == "M" else 1)
        cta_n = tile_n * (2 if wg == "N" else 1)
        if rows % cta_m or n % cta_n or k % tile_k or cta_m > rows:
            continue
        kw: dict[str, Any] = dict(
            tile_m=tile_m,
            tile_n=tile_n,
            tile_k=tile_k,
            max_concurrent_steps=steps,
            epi_tile_n=64,
            epi_tile_m=64,
            wg_dimension=getattr(hm.MatmulDimension, wg),
        )
        if "grid_tile_width" in fields:
            kw["grid_tile_width"] = 1
        config = hm.TuningConfig(**{a: b for a, b in kw.items() if a in fields})

        def run(x: jax.Array, ws: jax.Array, config: Any = config) -> list[jax.Array]:
            if takes_c:
                return [hm.matmul(x[i], ws[i], None, config) for i in range(ws.shape[0])]
            return [hm.matmul(x[i], ws[i], config) for i in range(ws.shape[0])]

        out.append((f"pallas-hopper-m{tile_m}-n{tile_n}-k{tile_k}-wg{wg}-s{steps}", run))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--layers", type=int, default=0, help="weight matrices per product (0: 64; 4 for logits)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=3.73e12, help="bytes/s the shares are counted against")
    ap.add_argument("--products", default="", help="comma-separated subset of qkv,o,gate_up,down,logits")
    ap.add_argument("--no-pallas", action="store_true")
    ap.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    ap.add_argument("--budget", type=float, default=420.0, help="stop starting variants after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="small shapes, a CPU smoke test")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_gemm")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    shapes = SHAPES_TINY if args.tiny else SHAPES_1B
    if args.products:
        shapes = {k: v for k, v in shapes.items() if k in args.products.split(",")}
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    rows_out = []
    path = os.path.join(args.out, "gemm.jsonl")
    key = jax.random.PRNGKey(0)
    for name, (k, n, per_step) in shapes.items():
        layers = args.layers or (64 if per_step > 1 else 4)
        kx, kw = jax.random.split(jax.random.fold_in(key, len(rows_out)))
        x = jax.random.normal(kx, (layers, args.rows, k), jnp.bfloat16)
        w_in_out = (jax.random.normal(kw, (layers, k, n), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
        w_out_in = jnp.swapaxes(w_in_out, 1, 2).copy()
        ref = jnp.dot(x[0].astype(jnp.float32), w_in_out[0].astype(jnp.float32))
        variants: list[tuple[str, Callable[..., Any], jax.Array]] = [
            ("xla-in-out", xla_in_out, w_in_out),
            ("xla-out-in", xla_out_in, w_out_in),
        ]
        for parts in (2, 4, 8):
            if k % parts == 0:
                variants.append((f"xla-splitk-{parts}", xla_split_k(parts), w_in_out))
        if not args.no_pallas and dev.platform == "gpu":
            variants += [(v, f, w_in_out) for v, f in hopper_variants(args.rows, k, n)]
        weight_bytes = k * n * 2
        if args.variants:
            variants = [v for v in variants if v[0] in args.variants.split(",")]
        for variant, fn, ws in variants:
            if time.monotonic() - start > args.budget:
                print(f"budget spent: {name} {variant} skipped", flush=True)
                continue
            row: dict[str, Any] = {
                "product": name,
                "variant": variant,
                "rows": args.rows,
                "in": k,
                "out": n,
                "layers": layers,
                "device": dev.device_kind,
            }
            try:
                jf = jax.jit(fn)
                t0 = time.monotonic()
                got = jf(x, ws)
                row["compile_s"] = round(time.monotonic() - t0, 2)
                err = float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - ref)))
                row["max_abs_err"] = err
                dev_sec = device_time(jf, (x, ws), args.reps) if dev.platform == "gpu" else None
                row["timing"] = "cupti kernel time" if dev_sec is not None else "wall"
                sec = (dev_sec if dev_sec is not None else time_fn(jf, (x, ws), args.reps)) / layers
                row["us"] = round(sec * 1e6, 2)
                row["weight_gbps"] = round(weight_bytes / sec / 1e9, 1)
                row["share"] = round(weight_bytes / sec / args.bandwidth, 3)
                row["step_us"] = round(sec * per_step * 1e6, 1)
            except Exception as e:  # one variant failing must not end the sweep
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            rows_out.append(row)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print("\nbest per product (us per product, share of the bandwidth):")
    total_best = total_out_in = 0.0
    for name in shapes:
        ok = [r for r in rows_out if r["product"] == name and "us" in r and r["max_abs_err"] < 1.0]
        if not ok:
            continue
        best = min(ok, key=lambda r: r["us"])
        base = next((r for r in ok if r["variant"] == "xla-out-in"), best)
        total_best += best["step_us"]
        total_out_in += base["step_us"]
        print(
            f"  {name:8s} xla-out-in {base['us']:8.2f} us ({base['share']:.0%})   best {best['variant']}"
            f" {best['us']:8.2f} us ({best['share']:.0%})"
        )
    print(f"per decode step: xla-out-in {total_out_in:.0f} us, best of each {total_best:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
