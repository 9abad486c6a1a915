"""Publish-to-readable latency of a policy against its size: 1 and 2 learner processes writing their own shards in
parallel (`policy.policy_format.sharded`, the code the learner publishes with), and a worker reading it back.

For each backend (local disk, the GCS emulator), size and writer count: W processes (real `jax.distributed` on
loopback when W = 2, one CPU device each) hold a synthetic float32 policy of the given size, split into 16 tensors
sharded over the W devices by rows; after a barrier every process runs `prepare_publish` + `commit_publish` (its
blocks as files on parallel threads, its manifest; process 0 waits for every manifest and writes COMMITTED). Then
a worker (this process) reads it as a rollout worker does: every file in parallel, each verified against the
marker's size and crc32c, every tensor assembled whole in host memory (the `device_put` a worker then does is left
out). Also, with one process, the older single-writer format (one safetensors file, one stream) for reference.

    publish_s   first writer's start -> COMMITTED written (process 0)
    read_s      the worker's read of the committed policy (parallel files, verified, assembled)
    total_s     publish_s + read_s: publish-to-readable on a worker that notices the marker at once

    python -m bench.bench_publish                                  # 50, 200, 800 MB; 1, 2 writers; local, gcs
    python -m bench.bench_publish --sizes_mb 50 --backends local   # one case
Results table: docs/scale.md ("Policies at real sizes"), with the extrapolation to 8B and 70B on GCS.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import gcs_emulator_class, machine_name
from pipeline.process.ports import ReservedPort, reserve_port

logger = logging.getLogger("rlpipe.bench.publish")

TENSORS = 16
COLS = 4096


def _child(args: argparse.Namespace) -> int:
    """One learner process: for each size in turn, build this process's rows of a synthetic policy, publish it as
    policy <n> (all processes start together after a barrier), report the timings (process 0)."""
    import gc

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pipeline.config import DistributedConfig
    from pipeline.store import layout
    from pipeline.store.storage import RunStore
    from policy import mesh as mesh_lib
    from policy.policy_format import committed, sharded

    if args.writers > 1:
        mesh_lib.initialize_distributed(
            DistributedConfig(coordinator_address=args.coordinator, num_processes=args.writers, process_id=args.pid)
        )
    store = RunStore(args.root, json.loads(args.storage_options) if args.storage_options else None)
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec("x", None))
    results = []
    for n, size_mb in enumerate(float(x) for x in args.sizes_mb.split(",")):
        rows = max(args.writers, int(size_mb * 1e6 / 4 / COLS / TENSORS) // args.writers * args.writers)

        def block(i: int, rows: int = rows) -> Any:
            def cb(index: tuple[slice, ...]) -> np.ndarray:
                lo, hi, _ = index[0].indices(rows)
                return np.random.default_rng([i, lo]).random((hi - lo, COLS), dtype=np.float32)

            return cb

        tree = {f"t{i:02d}": jax.make_array_from_callback((rows, COLS), sharding, block(i)) for i in range(TENSORS)}
        jax.block_until_ready(tree)
        meta = {"step": n + 1, "vocab_size": 1, "kind": "policy"}
        folder = layout.policy_dir(n + 1)
        mesh_lib.barrier(f"bench-publish-{n}")
        t0 = time.time()
        if args.mode == "single":  # the older format: one file of the whole tree, one writer, one stream
            host = mesh_lib.to_host(tree)
            if mesh_lib.is_writer():
                committed.write_committed(store, folder, {"weights": committed.tree_to_safetensors(host)}, meta)
            del host
        else:
            sharded.commit_publish(store, sharded.prepare_publish(folder, {"weights": tree}, meta, "weights"))
        t1 = time.time()
        results.append({"step": n + 1, "t0": t0, "t1": t1, "bytes": rows * COLS * 4 * TENSORS})
        del tree
        gc.collect()
        mesh_lib.barrier(f"bench-publish-{n}-done")
    if mesh_lib.is_writer():
        Path(args.result).write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # no jax.distributed shutdown barrier to wait through


def _read(root: str, storage_options: dict[str, Any] | None, step: int) -> tuple[float, int]:
    """(seconds, files) of a worker's read of policy `step`: files fetched in parallel, verified, assembled."""
    from pipeline.store import layout
    from pipeline.store.storage import RunStore
    from policy.policy_format import committed, sharded

    store = RunStore(root, storage_options)
    folder = layout.policy_dir(step)
    t0 = time.perf_counter()
    record = committed.read_marker(store, folder)
    if record.format == sharded.FORMAT:
        sharded.load_host(store, folder, record)
    else:
        committed.st_load(committed.read_blob(store, folder, record, "weights"))
    return time.perf_counter() - t0, len(record.files)


def _port() -> ReservedPort:
    """A coordinator port reserved for the processes of one case (released when the returned object is)."""
    return reserve_port()


def run_case(
    root: str, opts: dict[str, Any] | None, sizes: list[float], writers: int, mode: str, tmp: Path
) -> list[dict[str, Any]]:
    """Publishes of each size in `sizes` by `writers` processes under `root` (one process start for all), then one
    worker read of each."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    result = tmp / f"result-{writers}-{mode}.json"
    reserved = _port()  # held until this function returns
    port = reserved.port
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.bench_publish",
                "--child",
                "--root",
                root,
                "--sizes_mb",
                ",".join(map(str, sizes)),
                "--writers",
                str(writers),
                "--pid",
                str(i),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--mode",
                mode,
                "--result",
                str(result),
                "--storage_options",
                json.dumps(opts) if opts else "",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(writers)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=3000)
        if p.returncode != 0:
            raise RuntimeError(f"publish child failed ({p.returncode}): {out[-3000:]}")
    rows = []
    for r in json.loads(result.read_text()):
        read_s, files = _read(root, opts, r["step"])
        publish_s = r["t1"] - r["t0"]
        mb = r["bytes"] / 1e6
        rows.append(
            {
                "size_mb": round(mb, 1),
                "writers": writers,
                "mode": mode,
                "files": files,
                "publish_s": publish_s,
                "read_s": read_s,
                "total_s": publish_s + read_s,
                "publish_mb_s": mb / publish_s,
                "read_mb_s": mb / read_s,
            }
        )
    return rows


def run_all(sizes: list[float], writer_counts: list[int], backends: list[str], single: bool) -> list[dict[str, Any]]:
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="rlpipe-bench-publish-"))
    try:
        for backend in backends:
            emu = gcs_emulator_class()().start() if backend == "gcs" else None
            try:
                cases = [(w, "parallel") for w in writer_counts] + ([(1, "single")] if single else [])
                for n, (writers, mode) in enumerate(cases):
                    if emu is None:
                        root, opts = str(tmp / f"run{n}"), None
                    else:
                        root, opts = f"gs://{emu.bucket}/run{n}", emu.storage_options
                    for row in run_case(root, opts, sizes, writers, mode, tmp):
                        logger.info("%s", row)
                        rows.append({"backend": backend, **row})
                    _clear(root, opts)
            finally:
                if emu is not None:
                    emu.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _clear(root: str, opts: dict[str, Any] | None) -> None:
    """Delete a case's run root (the emulator keeps objects in memory)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(root, **(opts or {}))
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def print_table(rows: list[dict[str, Any]]) -> None:
    """The measured table (what docs/scale.md holds)."""
    head = (
        "backend",
        "MB",
        "writers",
        "format",
        "files",
        "publish s",
        "read s",
        "total s",
        "publish MB/s",
        "read MB/s",
    )
    out = [head]
    for r in rows:
        out.append(
            (
                r["backend"], f"{r['size_mb']:.0f}", str(r["writers"]),
                "sharded" if r["mode"] == "parallel" else "single file", str(r["files"]),
                f"{r['publish_s']:.2f}", f"{r['read_s']:.2f}", f"{r['total_s']:.2f}",
                f"{r['publish_mb_s']:.0f}", f"{r['read_mb_s']:.0f}",
            )
        )  # fmt: skip
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    for row in out:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes_mb", default="50,200,800", help="comma-separated policy sizes in MB")
    ap.add_argument("--writers", default="1,2", help="comma-separated learner process counts")
    ap.add_argument("--backends", default="local,gcs", help="local and/or gcs (the GCS emulator)")
    ap.add_argument("--no_single", action="store_true", help="leave out the older single-writer format")
    ap.add_argument("--json", default=None, help="write the rows here")
    # the child (one learner process)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="parallel", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--storage_options", default="", help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args(argv)
    if args.child:
        args.writers = int(args.writers)
        return _child(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sizes = [float(s) for s in args.sizes_mb.split(",") if s]
    writers = [int(w) for w in args.writers.split(",") if w]
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in ("local", "gcs")]
    if bad:
        ap.error(f"--backends: unknown {bad}; choose from local, gcs")
    rows = run_all(sizes, writers, backends, single=not args.no_single)
    print(f"\npolicy publish-to-readable  machine: {machine_name()}")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "machine": machine_name()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
