"""Storage throughput: RunStore.commit_data / read_committed vs raw pyarrow, on local disk.

Writes and reads synthetic rollout files (rows shaped like real rollouts: ~64 prompt and 256 response
tokens) through the committed-file protocol (parquet with page checksums + ready marker, fsync, verified
reads) and through plain `pq.write_table` / `pq.read_table` of the same tables into the same folder, in the
same run, and prints MB/s (in-memory Arrow bytes per second), rows/s and the ratio. Goal: ratio >= 0.9.

    python -m bench.bench_storage [--rows 20000] [--rows-per-file 1000] [--repeats 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store import layout
from pipeline.store.storage import RunStore, parquet_write_options
from schemas import ROLLOUT


def _lists(rng: np.random.Generator, n: int, mean_len: int, make: Callable[[int], np.ndarray]) -> pa.ListArray:
    lengths = rng.integers(mean_len // 2, mean_len * 3 // 2 + 1, size=n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(make(int(offsets[-1]))))


def synthetic_rollouts(n: int, seed: int, worker: str = "w0", resp_len: int = 256, prompt_len: int = 64) -> pa.Table:
    """`n` rollout-shaped rows conforming to ROLLOUT (token ids ~ Zipf-ish over a 32k vocab)."""
    rng = np.random.default_rng(seed)
    vocab = 32_000
    schema = ROLLOUT.arrow_schema()
    resp_lengths = rng.integers(resp_len // 2, resp_len * 3 // 2 + 1, size=n)
    offsets = pa.array(np.concatenate([[0], np.cumsum(resp_lengths)]).astype(np.int32))
    total = int(resp_lengths.sum())

    def per_token(values: np.ndarray, typ: pa.DataType) -> pa.ListArray:
        return pa.ListArray.from_arrays(offsets, pa.array(values, typ))

    tokens = np.minimum(rng.zipf(1.2, size=total), vocab - 1).astype(np.int32)
    rewards = np.zeros(total, np.float32)
    rewards[np.cumsum(resp_lengths) - 1] = rng.random(n).astype(np.float32)
    group = np.arange(n) // 8
    prompts = _lists(rng, n, prompt_len, lambda k: rng.integers(0, vocab, size=k).astype(np.int32))
    cols = {
        "rollout_id": pa.array([f"{worker}-{seed}-{i}" for i in range(n)]),
        "env_name": pa.array(["arith"] * n),
        "example_id": pa.array([f"ex{g}" for g in group]),
        "lesson_id": pa.array(["lesson-1"] * n),
        "group_key": pa.array([f"g{seed}-{g}" for g in group]),
        "prompt_tokens": prompts,
        "response_tokens": per_token(tokens, pa.int32()),
        "response_logprobs": per_token(-rng.exponential(1.0, size=total).astype(np.float32), pa.float32()),
        "token_rewards": per_token(rewards, pa.float32()),
        "response_loss_mask": per_token(np.ones(total, np.int8), pa.int8()),
        "episode_reward": pa.array(rng.random(n)),
        "truncated": pa.array(rng.random(n) < 0.1),
        "finish_reason": pa.array(["stop"] * n),
        "temperature": pa.array(np.ones(n, np.float32)),
        "policy_step": pa.array(np.full(n, 7, np.int64)),
        "worker_id": pa.array([worker] * n),
        "timestamp": pa.array(1.7e9 + np.arange(n, dtype=np.float64)),
        "top_p": pa.array(np.ones(n, np.float32)),
        "top_k": pa.array(np.zeros(n, np.int32)),
        "min_p": pa.array(np.zeros(n, np.float32)),
    }
    return pa.Table.from_pydict(cols, schema=schema)


@dataclass
class Result:
    name: str
    seconds: float
    nbytes: int
    rows: int
    disk_bytes: int

    @property
    def mb_s(self) -> float:
        return self.nbytes / self.seconds / 1e6

    @property
    def rows_s(self) -> float:
        return self.rows / self.seconds


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run(rows: int, rows_per_file: int, repeats: int, base: str) -> list[Result]:
    """Measure every variant; one Result per (operation, method), best time over `repeats`.

    Variants are interleaved within each repeat (write, then read back what was just written, so the page
    cache is equally warm for all), which keeps a noisy shared machine from favouring one of them.
    """
    tables = [synthetic_rollouts(rows_per_file, seed=i) for i in range(rows // rows_per_file)]
    nbytes, nrows = sum(t.nbytes for t in tables), sum(t.num_rows for t in tables)
    names = [layout.rollout_file(7, "w0", i) for i in range(len(tables))]
    step_dir = layout.rollout_step_dir(7)

    def raw_write(d: str, **kw: Any) -> None:
        os.makedirs(os.path.join(d, step_dir), exist_ok=True)
        for name, t in zip(names, tables, strict=True):
            pq.write_table(t, os.path.join(d, name), **kw)

    def raw_read(d: str) -> None:
        for name in names:
            pq.read_table(os.path.join(d, name))

    def store_write(d: str) -> None:
        store = RunStore(d)
        for name, t in zip(names, tables, strict=True):
            store.commit_data(name, t, ROLLOUT, {"policy_step": 7})

    def store_read(d: str) -> None:
        store = RunStore(d)
        for name in store.list_committed(step_dir):
            if store.read_committed(name, ROLLOUT) is None:
                raise RuntimeError(f"{name} failed verification")

    same = parquet_write_options(tables[0].schema)  # RunStore's settings, without its commit protocol
    variants: list[tuple[str, Callable[[str], None], Callable[[str], None]]] = [
        ("raw pyarrow (default snappy)", raw_write, raw_read),
        ("raw pyarrow (RunStore settings)", lambda d: raw_write(d, **same), raw_read),
        ("RunStore commit_data/read_committed", store_write, store_read),
    ]
    best: dict[tuple[str, str], float] = {}
    disk: dict[str, int] = {}
    for _ in range(repeats):
        for label, write, read in variants:
            d = tempfile.mkdtemp(dir=base, prefix="bench-")
            try:
                t0 = time.perf_counter()
                write(d)
                t1 = time.perf_counter()
                read(d)
                t2 = time.perf_counter()
                disk[label] = _dir_bytes(d)
            finally:
                shutil.rmtree(d)
            for op, secs in (("write", t1 - t0), ("read", t2 - t1)):
                best[op, label] = min(best.get((op, label), float("inf")), secs)
    return [
        Result(f"{op} {label}", best[op, label], nbytes, nrows, disk[label])
        for op in ("write", "read")
        for label, _, _ in variants
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--rows-per-file", type=int, default=1_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="folder on the disk to measure")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    results = run(args.rows, args.rows_per_file, args.repeats, args.dir)
    if args.json:
        rows = [
            {"name": r.name, "seconds": r.seconds, "mb_s": r.mb_s, "rows_s": r.rows_s, "disk_bytes": r.disk_bytes}
            for r in results
        ]
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "results": rows}, f, indent=2)
    print(f"machine: {platform.platform()} | {platform.processor() or platform.machine()} | {os.cpu_count()} CPUs")
    print(f"python {platform.python_version()} | pyarrow {pa.__version__} | disk folder {args.dir}")
    print(f"{args.rows} rows in files of {args.rows_per_file}; best of {args.repeats}; MB = in-memory Arrow bytes")
    print(f"{'operation':42s} {'s':>7s} {'MB/s':>8s} {'rows/s':>10s} {'on disk MB':>10s} {'ratio':>6s}")
    for group in (results[:3], results[3:]):
        ref = group[0]
        for r in group:
            ratio = ref.seconds / r.seconds
            print(
                f"{r.name:42s} {r.seconds:7.3f} {r.mb_s:8.1f} {r.rows_s:10.0f} {r.disk_bytes / 1e6:10.1f} {ratio:6.2f}"
            )
    print("ratio = raw pyarrow (default settings) time / this time; goal for RunStore >= 0.9.")
    print("'RunStore settings' rows isolate the commit protocol's cost (fsyncs, sha256, marker, verification).")


if __name__ == "__main__":
    main()
