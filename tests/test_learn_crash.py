"""Crash test: SIGKILL the real `python -m steps.learn` at random points (>= 10 times), restart each time
(started as the local job backend starts it: forked by its fork server).

Checks: every restart resumes from the newest committed checkpoint at the time of the kill; the lineage of
checkpoint markers (parent + slots consumed) covers batch slots 1..N exactly once; the final parameters
equal, bitwise, those of an uninterrupted in-process run on the same batches (CPU, fixed seed).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import draccus
import numpy as np
import pytest

from pipeline.jobs.launchers.forkserver import ForkedProcess, ForkServer
from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore
from schemas.records import CommitMarker

pytest.importorskip("jax")

from invariants import check_checkpoint_lineage
from test_learner import VOCAB, tiny_config, write_batches

from policy import model as M
from policy import policy_format as pf
from steps import learn

REPO = Path(__file__).resolve().parents[1]
N_STEPS = 60
MIN_KILLS = 10


def _env(cache_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def _start(server: ForkServer, config_path: Path, log_path: Path, cache_dir: Path) -> ForkedProcess:
    """`python -m steps.learn` as the local job backend starts it: forked by a fork server (a real process of
    its own, the starting process's child); a fresh interpreter if the server cannot."""
    argv = ["--config_path", str(config_path)]
    with open(log_path, "wb") as out:
        forked = server.spawn("steps.learn", argv, _env(cache_dir), out.fileno())
        if forked is not None:
            return forked
        popen = subprocess.Popen([sys.executable, "-m", "steps.learn", *argv], cwd=REPO, env=_env(cache_dir),
                                 stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    return popen  # type: ignore[return-value]  # the same poll / wait / send_signal


def _wait_for(proc: ForkedProcess, log_path: Path, needle: bytes, count: int = 1, timeout: float = 300.0) -> None:
    """Until `needle` occurs `count` times in the child's log (or it exits, or `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if log_path.read_bytes().count(needle) >= count:
            return
        time.sleep(0.01)


@pytest.mark.slow
def test_sigkill_resume_replays_exactly(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    rng = random.Random(1234)
    root = tmp_path / "run"
    store = RunStore(str(root))
    write_batches(store, range(1, N_STEPS + 1))
    cfg = tiny_config(str(root), steps=N_STEPS, keep_checkpoints=1000, batch_wait_timeout_s=60.0)
    config_path = tmp_path / "learner.yaml"
    with open(config_path, "w") as f:
        draccus.dump(cfg, f)
    cache = tmp_path / "jax-cache"
    server = ForkServer(["steps.learn"], _env(cache))
    server.start()
    request.addfinalizer(server.close)

    kills = 0
    runs = 0
    while not store.exists(layout.LEARNER_DONE):
        assert runs < 40, "learner never finished"
        log_path = tmp_path / f"learn-{runs}.log"
        newest_before = (pf.committed_checkpoints(store) or [None])[-1]
        proc = _start(server, config_path, log_path, cache)
        runs += 1
        if kills < MIN_KILLS:
            # kill at a random point: sometimes during start-up / init / resume, mostly while training,
            # publishing and checkpointing (after this run's k-th trained step, k in 1..3, so that progress per
            # run is bounded whatever the machine's speed and >= MIN_KILLS kills happen before the end)
            if rng.random() < 0.25:
                _wait_for(proc, log_path, b"learner at step")
                time.sleep(rng.uniform(0.0, 0.5))
            else:
                _wait_for(proc, log_path, b"trained slot", count=rng.randint(1, 3))
                time.sleep(rng.uniform(0.0, 0.15))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        rc = proc.wait(timeout=300)
        text = log_path.read_text(errors="replace")
        assert rc in (0, -signal.SIGKILL), f"learner failed (rc={rc}):\n{text[-3000:]}"
        m = re.search(r"resuming from checkpoint (\d+)", text)
        if m:
            assert int(m.group(1)) == newest_before, f"resumed from {m.group(1)}, newest was {newest_before}"
        elif "no checkpoint: initialising" in text:
            assert newest_before is None, f"re-initialised although checkpoint {newest_before} was committed"
    assert kills >= MIN_KILLS

    check_checkpoint_lineage(store, N_STEPS)  # the slot ranges of the lineage tile 1..N exactly once
    # every committed checkpoint marker, in any lineage, is consistent (no slot trained twice into one chain)
    for s in ckpt_steps(store):
        rec = CommitMarker.from_json(store.get(layout.checkpoint_marker(s)), path=layout.checkpoint_marker(s))
        assert rec.slots is not None and rec.slots[1] == s and rec.batch_slot == s

    # uninterrupted in-process run on the same batches gives the same bits
    ref_root = tmp_path / "ref"
    ref_store = RunStore(str(ref_root))
    write_batches(ref_store, range(1, N_STEPS + 1))
    learn.main(tiny_config(str(ref_root), steps=N_STEPS, keep_checkpoints=1000))
    a = M.numpy_params(pf.read_policy(store, N_STEPS, cfg.model, VOCAB))
    b = M.numpy_params(pf.read_policy(ref_store, N_STEPS, cfg.model, VOCAB))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    print(f"crash test: {runs} runs, {kills} kills")


def ckpt_steps(store: RunStore) -> list[int]:
    return run_state.committed_steps(store, layout.CHECKPOINTS)
