"""BatchMaker throughput and memory on synthetic rollouts, against raw pyarrow I/O of the same bytes.

What it measures (one process, same files, same machine, same run; every parquet read verifies page
checksums and every write is zstd + page checksums, exactly as pipeline/store/storage.py does):
- pipeline: per rollout file: read + parse (read ahead by 2 files in threads, as the step does),
            `BatchMaker.add_rollouts`; whenever the batch is full
            (`not wants_more`, as the step decides) `make_batch`, serialize the batch and write it (on one
            writer thread while the next files are ingested, at most one batch in flight, as the step does
            with `write_behind`);
- raw (same bytes): read + parse the same rollout files and serialize + write the same number of batch
            tables of the same shape (one representative batch, re-serialized each time): the pyarrow I/O of
            exactly the bytes the pipeline reads and writes, with no BatchMaker work;
- raw (rollouts): read + parse each rollout file and write that table back (the batch files are larger than
            the rollout files: padding and six per-token columns; reported for context);
- batchmaker-only: the BatchMaker calls alone (ingest + build), summed inside the pipeline pass.
throughput = rollouts / s; headline ratio = pipeline rollouts/s ÷ raw (same bytes) rollouts/s (goal >= 0.7).
Memory: the BatchMaker's own array bytes and the Arrow pool, as their peak so far at 1/4 of the files and
at the end, plus the process peak RSS: bounded by the window (the reservoir), not by files consumed.
All rollouts are from policy 0 with an unbounded lag window (staleness is not what is measured here).

Run:
  python -m bench.bench_batch_maker                      # 204,800 rollouts, ~256 response tokens each
  python -m bench.bench_batch_maker --rollouts 51200 --pack
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench.common import cpu_model
from pipeline.batch_maker import BatchMaker
from pipeline.config import BatchMakerStepConfig, TrainParams
from pipeline.store.prefetch import read_ahead
from pipeline.store.storage import RunStore
from schemas import BATCH, ROLLOUT
from schemas.rollout import add_text_columns

logger = logging.getLogger("bench.batch_maker")

ROWS_PER_FILE = 256
GROUP = 4


def synthetic_rollouts(
    file_index: int, n: int, rng: np.random.Generator, resp_mean: int = 256, policy: int = 0
) -> pa.Table:
    """`n` rollout rows of one file (groups of GROUP, continuous rewards), built column-wise (no per-token Python)."""
    n_groups = n // GROUP
    p_len_g = rng.integers(32, 97, n_groups)
    p_len = np.repeat(p_len_g, GROUP)
    r_len = rng.integers(resp_mean - 64, resp_mean + 65, n)

    def lists(lengths: np.ndarray, values: pa.Array) -> pa.Array:
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), values)

    prompt_vals = rng.integers(0, 32000, int(p_len.sum()), dtype=np.int32)
    n_tok = int(r_len.sum())
    ids = [f"f{file_index}-r{i}" for i in range(n)]
    gkeys = [f"f{file_index}-g{i // GROUP}" for i in range(n)]
    cols = {
        "rollout_id": pa.array(ids),
        "env_name": pa.array(["math"] * n),
        "example_id": pa.array([f"ex{file_index}-{i // GROUP}" for i in range(n)]),
        "lesson_id": pa.array(["lesson"] * n),
        "group_key": pa.array(gkeys),
        "prompt_tokens": lists(p_len, pa.array(prompt_vals)),
        "response_tokens": lists(r_len, pa.array(rng.integers(0, 32000, n_tok, dtype=np.int32))),
        "response_logprobs": lists(r_len, pa.array(-rng.random(n_tok, dtype=np.float32))),
        "token_rewards": lists(r_len, pa.array(np.zeros(n_tok, dtype=np.float32))),
        "response_loss_mask": lists(r_len, pa.array(np.ones(n_tok, dtype=np.int8))),
        "episode_reward": pa.array(rng.random(n)),
        "truncated": pa.array(np.zeros(n, dtype=bool)),
        "finish_reason": pa.array(["stop"] * n),
        "temperature": pa.array(np.ones(n, dtype=np.float32)),
        "policy_step": pa.array(np.full(n, policy, dtype=np.int64)),
        "worker_id": pa.array(["w0"] * n),
        "timestamp": pa.array(np.full(n, 0.0)),
        "top_p": pa.array(np.ones(n, np.float32)),
        "top_k": pa.array(np.zeros(n, np.int32)),
        "min_p": pa.array(np.zeros(n, np.float32)),
    }
    # the text, answer and reward-component columns at their "not recorded" values
    return ROLLOUT.conform(add_text_columns(pa.table(cols)), "<synthetic>")


READ_AHEAD = BatchMakerStepConfig().read_ahead
WRITE_BEHIND = BatchMakerStepConfig().write_behind


def machine() -> str:
    """A one-line description of this machine."""
    return f"{platform.node()}: {cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}"


def files_in(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.parquet"))


def raw_pass(folder: Path, out: Path, template: pa.Table | None, n_batches: int) -> tuple[float, int]:
    """Read+parse every file; write `n_batches` copies of `template` (spread over the files), or, without a
    template, each rollout table back. Returns (seconds, bytes written)."""
    files = files_in(folder)
    t0 = time.perf_counter()
    written = 0
    done = 0
    for i, p in enumerate(files):
        table = RunStore.parse_parquet(p.read_bytes(), ROLLOUT, str(p))
        if template is None:
            data = RunStore.parquet_bytes(table, ROLLOUT)
            out.write_bytes(data)
            written += len(data)
            continue
        due = (i + 1) * n_batches // len(files)
        while done < due:
            data = RunStore.parquet_bytes(template, BATCH)
            out.write_bytes(data)
            written += len(data)
            done += 1
    return time.perf_counter() - t0, written


def pipeline_pass(folder: Path, out: Path, params: TrainParams) -> dict[str, Any]:
    """Read+parse, BatchMaker, write batches; memory peaks sampled at 1/4 and at the end."""
    files = files_in(folder)
    bm = BatchMaker(params)
    t0 = time.perf_counter()
    written = 0
    batches = 0
    rollouts_in_batches = 0
    bm_s = 0.0
    mem: dict[str, dict[str, float]] = {}
    peak_bm = peak_pool = 0
    template: pa.Table | None = None
    slot = 1
    # the same read-ahead as steps/make_batches.py: file i+1 is read and parsed while file i is ingested
    reads = read_ahead(lambda p: RunStore.parse_parquet(p.read_bytes(), ROLLOUT, str(p)), files, READ_AHEAD)
    # and the same write-behind: one writer thread, at most one batch in flight (settled before the next write)
    writer = ThreadPoolExecutor(1) if WRITE_BEHIND else None
    in_flight: Future[int] | None = None

    def write(table: pa.Table) -> int:
        data = RunStore.parquet_bytes(table, BATCH)
        out.write_bytes(data)
        return len(data)

    for i, (p, fut) in enumerate(reads):
        table = fut.result()
        t1 = time.perf_counter()
        bm.add_rollouts(table, p.name, slot=slot, latest_policy=0, dir_policy_step=0)
        del table
        peak_bm = max(peak_bm, bm.nbytes())
        built = []
        while not bm.wants_more(slot) and (b := bm.make_batch(slot)) is not None:
            built.append(b)
            slot += 1
        bm.take_dropped(slot)
        bm_s += time.perf_counter() - t1
        peak_bm = max(peak_bm, bm.nbytes())
        peak_pool = max(peak_pool, pa.total_allocated_bytes())
        for b in built:
            if in_flight is not None:
                written += in_flight.result()
                in_flight = None
            if writer is None:
                written += write(b.table)
            else:
                in_flight = writer.submit(write, b.table)
            batches += 1
            rollouts_in_batches += b.stats["n_rollouts"]
            if template is None:
                template = b.table
        if i + 1 in (len(files) // 4, len(files)):
            mem["quarter" if i + 1 == len(files) // 4 else "end"] = {
                "files_consumed": i + 1,
                "batchmaker_arrays_peak_mib": peak_bm / 2**20,
                "arrow_pool_peak_mib": peak_pool / 2**20,
                "live_rollouts_now": bm.n_live,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
    if in_flight is not None:
        written += in_flight.result()
    if writer is not None:
        writer.shutdown()
    return {
        "seconds": time.perf_counter() - t0,
        "batchmaker_seconds": bm_s,
        "bytes_written": written,
        "batches": batches,
        "rollouts_in_batches": rollouts_in_batches,
        "memory": mem,
        "template": template,
    }


def run(n_rollouts: int, pack: bool, repeats: int, keep: Path | None) -> dict[str, Any]:
    """Generate the files, then time the passes `repeats` times each, interleaved (best of each counts)."""
    n_files = max(4, n_rollouts // ROWS_PER_FILE)
    tmp = Path(tempfile.mkdtemp(prefix="bench-bm-", dir=keep))
    try:
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        in_bytes = 0
        for f in range(n_files):
            data = RunStore.parquet_bytes(synthetic_rollouts(f, ROWS_PER_FILE, rng), ROLLOUT)
            (tmp / f"rollouts-{f:08d}.parquet").write_bytes(data)
            in_bytes += len(data)
        gen_s = time.perf_counter() - t0
        lag = 10**9  # everything is policy 0: the lag window never bites here
        if pack:
            params = TrainParams(batch_size=64, seq_len=2048, pack=True, max_lag=lag, replay_buffer_capacity=4096)
        else:
            params = TrainParams(batch_size=ROWS_PER_FILE, seq_len=512, max_lag=lag, replay_buffer_capacity=4096)
        (tmp / "out").mkdir()
        out = tmp / "out" / "written.parquet"
        same, rolls, pipes = [], [], []
        for _ in range(repeats):
            pipes.append(pipeline_pass(tmp, out, params))
            same.append(raw_pass(tmp, out, pipes[-1]["template"], pipes[-1]["batches"]))
            rolls.append(raw_pass(tmp, out, None, 0))
        raw_s = min(r[0] for r in same)
        roll_s = min(r[0] for r in rolls)
        pipe = min(pipes, key=lambda p: p["seconds"])
        n = n_files * ROWS_PER_FILE
        return {
            "machine": machine(),
            "mode": "packed" if pack else "unpacked",
            "train": {"batch_size": params.batch_size, "seq_len": params.seq_len, "pack": params.pack},
            "rollouts": n,
            "files": n_files,
            "rollout_bytes_read": in_bytes,
            "batch_bytes_written": pipe["bytes_written"],
            "generate_s": round(gen_s, 2),
            "pipeline_s": round(pipe["seconds"], 3),
            "pipeline_rollouts_per_s": round(n / pipe["seconds"]),
            "raw_same_bytes_s": round(raw_s, 3),
            "raw_same_bytes_rollouts_per_s": round(n / raw_s),
            "ratio_pipeline_to_raw_same_bytes": round(raw_s / pipe["seconds"], 3),
            "raw_rollouts_read_write_s": round(roll_s, 3),
            "ratio_pipeline_to_raw_rollouts_read_write": round(roll_s / pipe["seconds"], 3),
            "batchmaker_only_s": round(pipe["batchmaker_seconds"], 3),
            "batchmaker_only_rollouts_per_s": round(n / pipe["batchmaker_seconds"]),
            "batches": pipe["batches"],
            "rollouts_in_batches": pipe["rollouts_in_batches"],
            "memory": {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in pipe["memory"].items()},
            "all_runs_s": {
                "pipeline": [round(p["seconds"], 3) for p in pipes],
                "raw_same_bytes": [round(r[0], 3) for r in same],
                "raw_rollouts": [round(r[0], 3) for r in rolls],
            },
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=204_800, help="synthetic rollouts (>= 200k for the goal)")
    ap.add_argument("--pack", action="store_true", help="packed batches (seq_len 2048) instead of one per row")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes of each kind; the best counts")
    ap.add_argument("--both", action="store_true", help="run unpacked and packed, one JSON object each")
    ap.add_argument("--tmp", type=Path, default=None, help="folder for the synthetic files (default: system tmp)")
    ap.add_argument("--json", default=None, help="also write the list of results to this file")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = []
    for pack in [False, True] if args.both else [args.pack]:
        results.append(run(args.rollouts, pack, args.repeats, args.tmp))
        print(json.dumps(results[-1], indent=2), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
