"""Policies published by two learner processes (real `jax.distributed` on loopback, gloo, 2 simulated CPU devices
each; parameters FSDP-sharded over the 4 devices), through the learner's own `PolicyPublisher`:

- each process writes only the blocks it holds: its manifest names it as the writer (process index and OS pid) and
  lists exactly the (tensor, box) of its addressable shards with `replica_id == 0`, as the child process reports
  them from the arrays' sharding; the files it lists lie on disk with the sizes it states; the COMMITTED marker
  names the files of both processes and nothing else;
- the worker-side load (`policy_format.read_policy`, what rollout workers call) gives tensors bitwise equal to the
  parameters the learner gathers (`mesh.to_host`), in float32 and in bfloat16 (`model.publish_dtype`);
- a SIGKILL of process 1 after its shard files are durable and before its manifest (the `RLPIPE_PUBLISH_PAUSE` hook)
  leaves no visible policy (no COMMITTED, `read_policy` refuses, LATEST does not move) and process 0 gives up with a
  one-line reason naming the missing manifest; restarting both processes then commits the policy.

As a program (the child the test starts): `python tests/test_parallel_publish.py ROOT OUT COORDINATOR PROCESS_ID
WAIT_S STEP[:DTYPE] ...`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.process.ports import ReservedPort, reserve_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VOCAB = 64
STEP = 5


def _spec() -> Any:
    from pipeline.config import ModelSpec

    return ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32)


# ------------------------------------------------------------------------------------------------------------------
# the child: one learner process
# ------------------------------------------------------------------------------------------------------------------


def child(root: str, out: str, coordinator: str, pid: int, wait_s: float, steps: list[str]) -> int:
    import dataclasses

    import haliax as hax
    import jax

    from pipeline.config import DistributedConfig, LearnerStepConfig, MeshConfig, StoreConfig
    from pipeline.store.storage import RunStore
    from policy import mesh as mesh_lib
    from policy import model as M
    from policy.learner import LearnerState
    from policy.policy_format import sharded
    from policy.publisher import PolicyPublisher

    mesh_lib.initialize_distributed(DistributedConfig(coordinator_address=coordinator, num_processes=2, process_id=pid))
    sharded.MANIFEST_WAIT_S = wait_s
    lm = mesh_lib.build_mesh(MeshConfig())
    model = M.build_model(_spec(), VOCAB, jax.random.PRNGKey(3))
    model = mesh_lib.shard_params(model, lm)
    # what this process holds, from the arrays' sharding (replica 0 of each block): the blocks it must write
    held = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(model, is_leaf=hax.is_named_array)[0]:
        arr = leaf.array if hax.is_named_array(leaf) else leaf
        if isinstance(arr, jax.Array):
            for s in arr.addressable_shards:
                if s.replica_id == 0:
                    held.append(
                        [
                            jax.tree_util.keystr(path),
                            [sl.indices(n)[0] for sl, n in zip(s.index, arr.shape, strict=True)],
                        ]
                    )
    Path(out, f"held-p{pid}.json").write_text(json.dumps({"pid": os.getpid(), "held": held}))
    params = M.numpy_params(mesh_lib.to_host(model))  # the learner's gathered parameters (an all-gather)
    if pid == 0:
        np.savez(Path(out, "gathered.npz"), *params)
    store = RunStore(root)
    rc = 0
    for item in steps:
        step, _, dtype = item.partition(":")
        spec = dataclasses.replace(_spec(), publish_dtype=dtype or "float32")
        publisher = PolicyPublisher(store, LearnerStepConfig(store=StoreConfig(run_root=root), model=spec))
        publisher.submit(LearnerState(int(step), model, None, None))
        try:
            publisher.drain()
        except sharded.PublishTimeoutError as e:
            print(f"PUBLISH FAILED: {e}", flush=True)
            rc = 3
        finally:
            publisher.close()
    print(f"process {pid} done", flush=True)
    sys.stdout.flush()
    os._exit(rc)  # not jax.distributed's shutdown barrier: the other process may be gone (the kill case)


# ------------------------------------------------------------------------------------------------------------------
# the test
# ------------------------------------------------------------------------------------------------------------------


def _start(root: Path, out: Path, port: int, pid: int, steps: list[str], wait_s: float, **env: str) -> Any:
    from jobs import simulated_devices

    e = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{ROOT}:{HERE}", "USE_TORCH": "0", **env}
    e["XLA_FLAGS"] = simulated_devices(2)
    cmd = [sys.executable, __file__, str(root), str(out), f"127.0.0.1:{port}", str(pid), str(wait_s), *steps]
    return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _port(held: list[ReservedPort]) -> int:
    """A coordinator port reserved (held in `held`, released with it) for the processes this test starts."""
    held.append(reserve_port())
    return held[-1].port


def _wait_line(proc: Any, needle: str, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} never printed:\n{''.join(lines)[-4000:]}")


def _finish(proc: Any, timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


@pytest.mark.slow
def test_two_processes_publish_their_own_shards_and_a_kill_never_exposes_a_half_policy(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    import ml_dtypes

    from pipeline.store import layout
    from pipeline.store.storage import RunStore
    from policy import model as M
    from policy import policy_format as pf
    from policy.policy_format import sharded
    from schemas.records import SHARDED_CHECKPOINT_FORMAT, CommitMarker

    root, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    store = RunStore(str(root))
    folder = layout.policy_dir(STEP)

    # 1. process 1 pauses with its shard files durable and no manifest; SIGKILL it there
    t0 = time.monotonic()
    held: list[ReservedPort] = []
    port = _port(held)
    p0 = _start(root, out, port, 0, [str(STEP)], 8.0)
    p1 = _start(root, out, port, 1, [str(STEP)], 8.0, **{sharded.PUBLISH_PAUSE_ENV: "1:300"})
    try:
        _wait_line(p1, "pausing", 120)
        print(f"process 1 paused mid-publish after {time.monotonic() - t0:.1f} s")
        deadline = time.monotonic() + 60
        while not any(n.startswith("manifest-") for n in os.listdir(root / folder)):  # process 0's, shortly
            assert time.monotonic() < deadline, os.listdir(root / folder)
            time.sleep(0.1)
        os.kill(p1.pid, signal.SIGKILL)
        rc1, _ = _finish(p1)
        rc0, text0 = _finish(p0)
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()
    print(f"phase 1 (kill mid-publish): {time.monotonic() - t0:.1f} s")
    assert rc1 == -signal.SIGKILL
    names = os.listdir(root / folder)
    assert any(n.endswith("-p00001-000.safetensors") for n in names), names  # process 1 had written its shards
    assert layout.COMMIT_MARKER not in names and not store.exists(layout.policy_marker(STEP))
    with pytest.raises(pf.PolicyNotFoundError):
        pf.read_policy(store, STEP, _spec(), VOCAB)
    assert not store.exists(layout.POLICY_LATEST)
    assert rc0 == 3, text0[-3000:]
    failed = [ln for ln in text0.splitlines() if ln.startswith("PUBLISH FAILED")]
    assert failed and "[1] did not commit their shards" in failed[0] and "-p00001.json" in failed[0], text0[-3000:]
    before = set(names)

    # 2. restart both: policy STEP (float32) and STEP + 1 (bfloat16) committed, each process writing its own blocks
    port = _port(held)
    procs = [_start(root, out, port, i, [str(STEP), f"{STEP + 1}:bfloat16"], 120.0) for i in range(2)]
    results = [_finish(p, 240) for p in procs]
    for rc, text in results:
        assert rc == 0, text[-3000:]
    print(f"phases 1+2: {time.monotonic() - t0:.1f} s")
    held = {i: json.loads((out / f"held-p{i}.json").read_text()) for i in range(2)}
    with np.load(out / "gathered.npz") as f:
        gathered = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]

    for step, dtype in ((STEP, np.float32), (STEP + 1, ml_dtypes.bfloat16)):
        folder = layout.policy_dir(step)
        marker = CommitMarker.from_json(store.get(layout.policy_marker(step)), path="m")
        assert marker.format == SHARDED_CHECKPOINT_FORMAT and marker.kind == "policy" and marker.tensors
        manifests = {}
        for i in range(2):
            m = json.loads(store.get(layout.join(folder, sharded.manifest_name(marker.attempt_id, i))))
            assert m["writer"]["process"] == i and m["writer"]["pid"] == held[i]["pid"]
            mine = sorted([name, blk["start"]] for name, t in m["tensors"].items() for blk in t["blocks"])
            assert mine == sorted([f"weights/{n}", s] for n, s in held[i]["held"]), f"process {i} wrote other blocks"
            for key, f in m["files"].items():
                assert key.startswith(f"p{i}.") and f"-p{i:05d}-" in f["path"]
                assert (root / folder / f["path"]).stat().st_size == f["size"]
            manifests[i] = m
        assert held[1]["held"] and held[0]["held"]  # both processes hold (and wrote) part of the model
        assert set(marker.files) == set(manifests[0]["files"]) | set(manifests[1]["files"])
        files_on_disk = {n for n in os.listdir(root / folder) if n.endswith(".safetensors")}
        named = {f.path for f in marker.files.values()}
        assert named <= files_on_disk and not (named & before)  # the killed attempt's files are never named

        loaded = M.numpy_params(pf.read_policy(store, step, _spec(), VOCAB))  # the worker-side load
        want = [g.astype(dtype) if np.issubdtype(g.dtype, np.floating) else g for g in gathered]
        assert len(loaded) == len(want)
        for a, b in zip(loaded, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert json.loads(store.get(layout.POLICY_LATEST))["step"] == STEP + 1


def test_one_process_writes_parallel_files_and_a_damaged_or_unmarked_one_is_never_read(tmp_path: Path) -> None:
    """One learner process, its blocks split over 4 files written on 4 threads (16 KiB parts): the worker-side
    load is bitwise the model; a folder whose manifest is there but whose COMMITTED is not is not a policy; a cut
    shard file is refused naming it."""
    pytest.importorskip("jax")
    import jax

    from pipeline.store import layout
    from pipeline.store.storage import RunStore
    from policy import model as M
    from policy import policy_format as pf
    from policy.policy_format import sharded

    store = RunStore(str(tmp_path / "run"))
    model = M.build_model(_spec(), VOCAB, jax.random.PRNGKey(1))
    meta = {"step": 2, "vocab_size": VOCAB, "kind": "policy"}
    job = sharded.prepare_publish(layout.policy_dir(2), {pf.POLICY_WEIGHTS: model}, meta, pf.POLICY_WEIGHTS)
    manifest = sharded.write_own_shards(store, job, threads=4, part_bytes=16 << 10)  # process 0's part, no marker
    assert len(manifest["files"]) == 4
    with pytest.raises(pf.PolicyNotFoundError):
        pf.read_policy(store, 2, _spec(), VOCAB)
    assert pf.commit_policy(store, pf.PolicyPublish(2, sharded=job))  # a fresh write of the same attempt commits
    assert not pf.commit_policy(store, pf.PolicyPublish(2, sharded=job))  # committed: never rewritten
    want = M.numpy_params(model)
    got = M.numpy_params(pf.read_policy(store, 2, _spec(), VOCAB))
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    marker = pf.policy_metadata(store, 2)
    victim = sorted(f.path for f in marker.files.values())[-1]
    path = tmp_path / "run" / layout.policy_dir(2) / victim
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(pf.DamagedCommitError, match=r"size/crc32c differ") as e:
        pf.read_policy(store, 2, _spec(), VOCAB)
    assert victim in str(e.value)


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(child(a[0], a[1], a[2], int(a[3]), float(a[4]), a[5:]))
