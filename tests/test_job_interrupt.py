"""Ctrl-C of `make run`, then `make run` again, as a user does it: the rerun resumes with nothing lost, and the
interrupted BatchMaker's lease does not stall the new one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from jobs import check_finished_run, job_config
from makefile import REPO, make_env, recipe_command

from pipeline.process.exits import Exit
from pipeline.store import layout
from pipeline.store.storage import RunStore

STEPS = 6


def _make_run(config: Path, run_root: Path, log: Path) -> subprocess.Popen[bytes]:
    """`make run CONFIG=… RUN=…` (its recipe, in the Makefile's environment) in a process group of its own, as a
    shell runs a foreground job: Ctrl-C reaches every process of that group."""
    with log.open("ab") as out:
        return subprocess.Popen(
            recipe_command("run", CONFIG=str(config), RUN=str(run_root)),
            cwd=REPO,
            env=make_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _committed_slots(store: RunStore) -> dict[int, str]:
    """Every committed batch slot and the data file its log entry names."""
    slots = [layout.parse_step(p) for p in store.list(layout.BATCH_LOG) if p.endswith(".json")]
    return {s: store.read_log_entry(s).data_file for s in slots}


def _lease_epochs(store: RunStore, name: str) -> list[dict]:
    """Every epoch of lease `name`, oldest first: its claim record and its last activity (claim or renewal)."""
    folder = f"{layout.LEASES}/{name}"
    records = {Path(rel).name: json.loads(store.get(rel)) for rel in store.list(folder)}
    epochs = []
    for file, claim in sorted(records.items()):
        if re.fullmatch(r"epoch-\d{8}\.json", file):
            prefix = file.removesuffix(".json") + ".renew-"
            times = [claim["time"]] + [r["time"] for f, r in records.items() if f.startswith(prefix)]
            epochs.append({"claim": claim, "last_activity": max(times)})
    return epochs


@pytest.mark.slow
def test_ctrl_c_then_make_run_again_resumes_without_a_stall(tmp_path: Path) -> None:
    """SIGINT to `make run`'s process group once policy 1 is committed: it exits 130 without finishing. The same
    command again finishes the run: slots contiguous, every rollout used at most once and accounted for, the
    slots and policies committed before the interrupt kept as they were, and its BatchMaker takes the released
    lease at once (no wait for it to lapse, no restart)."""
    run_root = tmp_path / "run"
    config = job_config(tmp_path, str(run_root))
    store = RunStore(str(run_root))
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"

    first = _make_run(config, run_root, first_log)
    try:
        deadline = time.monotonic() + 180
        while not store.exists(layout.policy_marker(1)) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.poll() is None, first_log.read_text()[-3000:]
        assert store.exists(layout.policy_marker(1)), first_log.read_text()[-3000:]
        os.killpg(first.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        first.wait(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    output = first_log.read_text()
    assert first.returncode == Exit.INTERRUPTED, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert not store.exists(layout.LEARNER_DONE), "the interrupt came too late: the run had already finished"
    before = _committed_slots(store)
    policies_before = [s for s in range(STEPS + 1) if store.exists(layout.policy_marker(s))]
    assert 1 in policies_before
    makers_before = set(store.list(f"{layout.LOGS}/batches"))

    started = time.monotonic()
    second = _make_run(config, run_root, second_log)
    try:
        second.wait(timeout=300)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait()
    wall = time.monotonic() - started
    output = second_log.read_text()
    assert second.returncode == 0, output[-3000:]

    check_finished_run(store, num_steps=STEPS, max_lag=1)
    after = _committed_slots(store)
    assert {s: after[s] for s in before} == before, "a slot committed before the interrupt changed"
    assert all(store.exists(layout.policy_marker(s)) for s in policies_before)

    # the rerun's BatchMaker started once, and claimed the lease before the interrupted one's epoch would have
    # lapsed (a stall waits out the old epoch's ttl_s, ~17 s after its last renewal)
    makers = sorted(set(store.list(f"{layout.LOGS}/batches")) - makers_before)
    assert len(makers) == 1, (makers, output[-3000:])
    assert "LeaseHeldError" not in store.get(makers[0]).decode()
    assert "batches exited with" not in output, output[-3000:]
    epochs = _lease_epochs(store, "batchmaker")
    old, new = epochs[-2], epochs[-1]
    assert new["claim"]["holder"] != old["claim"]["holder"], epochs  # the rerun's maker holds the newest epoch
    assert new["claim"]["time"] < old["last_activity"] + old["claim"]["ttl_s"], (
        f"the rerun's BatchMaker claimed the lease {new['claim']['time'] - old['last_activity']:.1f} s after the "
        f"interrupted one's last renewal: it waited for the old epoch to lapse"
    )
    # the whole rerun (fork server, compile, the remaining steps) well inside the 30 s lease TTL plus its own run
    assert wall < 90, f"the rerun took {wall:.0f} s"
