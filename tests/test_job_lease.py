"""One job per run root: a whole job (`rlpipe run`) holds the run root's job lease (`pipeline.jobs.job_lease.job_lease`,
the lease machinery of `pipeline.store.lease`) from before its first step starts.

The first job here is a live process that holds that very lease, taken with the runner's own `job_lease` (what a
job runner holds from its start to its end; a real first job would spend ~20 s of CPU to show the same claim):

- a second `rlpipe run` on that run root is refused at once in one line naming the holder's host, pid and start
  time, exit 6, before anything is written (no run.json, no step log);
- once the first job's process is killed with SIGKILL (it never releases the lease), the same command takes the
  lease over at once, with no wait for its ttl: here it then stops at the next check of the job, a contract field
  that differs from run.json (exit 2), which only a job holding the lease reaches.

A job and scheduled training steps never run side by side: `rlpipe batches` and `rlpipe run step batches` beside
that live job are refused in one line naming it (exit 6), and run once it is dead; a job beside a live BatchMaker
started on its own is refused naming it, while a job's own BatchMaker outliving its killed runner blocks nothing.

Ctrl-C of a real job, then the same command resuming at once: tests/test_job_interrupt.py.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.jobs.job_lease import JOB_LEASE, JOB_LEASE_TTL_S
from pipeline.process.exits import Exit
from pipeline.store import layout

ROOT = Path(__file__).resolve().parents[1]
TEST_CONFIG = ROOT / "configs/test_cats.yaml"
RLPIPE = Path(sys.executable).parent / "rlpipe"

HOLD = """
import sys
from pipeline.jobs.job_lease import job_lease
from pipeline.store.storage import RunStore

lease = job_lease(RunStore(sys.argv[1]))
print(lease.acquire(), flush=True)
sys.stdin.read()  # held until stdin closes or the process is killed
"""


HOLD_MAKER = """
import os, socket, sys
from pipeline.store.lease import Lease
from pipeline.store.storage import RunStore

lease = Lease(RunStore(sys.argv[1]), "batchmaker", sys.argv[2].format(host=socket.gethostname(), pid=os.getpid()), 60)
print(lease.acquire(), flush=True)
sys.stdin.read()
"""


def rlpipe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RLPIPE), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def hold_job_lease(root: Path) -> subprocess.Popen[str]:
    """A live process holding `root`'s job lease as a job runner holds it (returns once it is claimed)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "1", "the holder claimed epoch 1"
    return proc


def claims(root: Path) -> dict[str, dict]:
    folder = root / layout.LEASES / JOB_LEASE
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.iterdir())}


def test_a_second_job_on_a_live_run_root_is_refused_then_a_killed_jobs_lease_is_taken_over_at_once(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    made = rlpipe("batches", "--config_path", str(TEST_CONFIG), "--run_root", str(root), "--max_batches", "1",
                  "--polling.bounded_wait_s", "0.2")  # fmt: skip  # run.json (train.max_lag 1); no job lease
    assert made.returncode == 0, made.stderr[-3000:]
    holder = hold_job_lease(root)
    try:
        second = rlpipe("run", "--config_path", str(TEST_CONFIG), "--run_root", str(root))
        assert second.returncode == Exit.LEASE_HELD, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        (line,) = [ln for ln in second.stderr.splitlines() if ln.startswith("error: ")]
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(claims(root)["epoch-00000001.json"]["time"]))
        assert line.startswith(
            f"error: lease held: another job is running on {root}: host {socket.gethostname()}, pid {holder.pid}, "
            f"started {started} (lease 'job' epoch 1)"
        ), line
        assert not (root / layout.LOGS).exists(), "no step started"
        assert " started " not in second.stderr.replace(line, "")
    finally:
        holder.kill()  # SIGKILL: the lease is never released
        holder.wait()
    assert set(claims(root)) == {"epoch-00000001.json"}

    third = rlpipe("run", "--config_path", str(TEST_CONFIG), "--run_root", str(root), "--train.max_lag", "3")
    assert third.returncode == Exit.CONFIG, third.stderr[-3000:]
    assert "error: lease held" not in third.stderr
    assert re.search(rf"epoch 1's holder 'job@\S+' \(pid {holder.pid} on this host\) is dead; taking over at once",
                     third.stderr), third.stderr[-3000:]  # fmt: skip
    assert "error: invalid config: train.max_lag=3: differs from run.json" in third.stderr  # reached with the lease
    records = claims(root)
    assert set(records) == {"epoch-00000001.json", "epoch-00000002.json", "epoch-00000002.released.json"}
    assert records["epoch-00000002.json"]["pid"] not in (0, holder.pid)
    # claimed while the dead job's epoch was still live (it lapses JOB_LEASE_TTL_S after its claim): no wait for it
    assert records["epoch-00000002.json"]["time"] < records["epoch-00000001.json"]["time"] + JOB_LEASE_TTL_S


def test_only_a_storage_fault_lets_a_job_start_without_its_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The job lease is advisory: a run root whose storage refuses the claim for good (here `leases/` full, through
    the real write path and the fault-injection hook) lets the job start without it, logged; a bug in the claim
    (any other exception) is not swallowed."""
    import dataclasses

    import draccus

    from pipeline.config import RLJobConfig
    from pipeline.jobs import job_lease as job_lease_module
    from pipeline.jobs import runner as runner_module
    from pipeline.jobs.job import RLJob
    from pipeline.store.faults import FAULT_INJECTION_ENV

    cfg = draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=[])
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, run_root=str(tmp_path / "run")))
    keeper = runner_module.JobRunner(RLJob(cfg)).job_lease

    monkeypatch.setenv(FAULT_INJECTION_ENV, f"ENOSPC:{layout.LEASES}/")
    with caplog.at_level("WARNING", logger=runner_module.__name__):
        keeper.take()
    assert keeper.lease is None
    assert "job lease not taken" in caplog.text and "No space left on device" in caplog.text
    monkeypatch.delenv(FAULT_INJECTION_ENV)

    class Broken:
        def acquire(self, **_: object) -> int:
            raise KeyError("a bug in the claim")

    monkeypatch.setattr(job_lease_module, "job_lease", lambda store: Broken())
    with pytest.raises(KeyError, match="a bug in the claim"):
        keeper.take()


def hold_maker_lease(root: Path, holder: str) -> subprocess.Popen[str]:
    """A live process holding `root`'s BatchMaker lease under `holder` (`{host}`, `{pid}` filled in)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_MAKER, str(root), holder], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip().isdigit(), "the holder claimed an epoch"
    return proc


def test_scheduled_training_steps_and_a_job_never_run_side_by_side(tmp_path: Path) -> None:
    """A training step started on its own beside a live job, and a job beside a scheduled BatchMaker, are each
    refused in one line (exit 6) naming the other's host and pid; a job's own BatchMaker (left by a killed job)
    does not block the next job."""
    root = tmp_path / "run"
    bounded = ("--config_path", str(TEST_CONFIG), "--run_root", str(root), "--max_batches", "1",
               "--polling.bounded_wait_s", "0.2")  # fmt: skip
    assert rlpipe("batches", *bounded).returncode == 0  # run.json; no lease left behind
    job = hold_job_lease(root)
    try:
        for argv in (("batches", *bounded), ("run", "step", "batches", "--config_path", str(TEST_CONFIG),
                                              "--run_root", str(root), "--max_batches", "1")):  # fmt: skip
            beside = rlpipe(*argv)
            assert beside.returncode == Exit.LEASE_HELD, beside.stderr[-3000:]
            assert "Traceback" not in beside.stderr
            (line,) = [ln for ln in beside.stderr.splitlines() if ln.startswith("error: ")]
            assert line.startswith(
                f"error: lease held: a job is running on {root}: host {socket.gethostname()}, pid {job.pid}, started "
            ), line
            assert "steps.make_batches started on its own would compete with the job's own" in line, line
    finally:
        job.kill()
        job.wait()
    assert rlpipe("batches", *bounded).returncode == 0, "the dead job's lease blocks no scheduled step"

    scheduled = hold_maker_lease(root, "{host}-{pid}")  # how a BatchMaker started on its own names itself
    try:
        refused = rlpipe("run", "--config_path", str(TEST_CONFIG), "--run_root", str(root))
        assert refused.returncode == Exit.LEASE_HELD, refused.stderr[-3000:]
        (line,) = [ln for ln in refused.stderr.splitlines() if ln.startswith("error: ")]
        assert line.startswith(
            f"error: lease held: scheduled steps are running on {root}: a BatchMaker started on its own holds the "
            f"BatchMaker lease (host {socket.gethostname()}, pid {scheduled.pid}, since "
        ), line
        assert set(claims(root)) == {"epoch-00000001.json"}, "refused before claiming the job lease"
    finally:
        scheduled.kill()
        scheduled.wait()

    own = hold_maker_lease(root, "batches@{host}-1")  # a job's own BatchMaker, outliving its killed runner
    try:
        # not refused as scheduled steps: the job claims its lease and stops at the next check (run.json), exit 2
        rerun = rlpipe("run", "--config_path", str(TEST_CONFIG), "--run_root", str(root), "--train.max_lag", "3")
        assert rerun.returncode == Exit.CONFIG, rerun.stderr[-3000:]
        assert "error: invalid config: train.max_lag=3: differs from run.json" in rerun.stderr
    finally:
        own.kill()
        own.wait()


def test_a_renewal_survives_a_storage_fault_but_not_a_bug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Renewing the job lease (`JobLeaseKeeper.renew`, as `JobRunner` holds it) on a run root whose `leases/` is full
    logs the fault and goes on (the next renewal retries); an error that is not the storage's (a bug) is not
    swallowed."""
    import dataclasses

    import draccus

    from pipeline.config import RLJobConfig
    from pipeline.jobs import runner as runner_module
    from pipeline.jobs.job import RLJob
    from pipeline.store.faults import FAULT_INJECTION_ENV

    cfg = draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=[])
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, run_root=str(tmp_path / "run")))
    keeper = runner_module.JobRunner(RLJob(cfg)).job_lease
    keeper.take()
    assert keeper.lease is not None
    due = time.monotonic() + JOB_LEASE_TTL_S  # past every renewal's due time

    monkeypatch.setenv(FAULT_INJECTION_ENV, f"ENOSPC:{layout.LEASES}/")
    with caplog.at_level("WARNING", logger=runner_module.__name__):
        assert keeper.renew(due) is True
    assert "job lease not renewed" in caplog.text and "No space left on device" in caplog.text
    monkeypatch.delenv(FAULT_INJECTION_ENV)

    def broken() -> None:
        raise KeyError("a bug in the renewal")

    monkeypatch.setattr(keeper.lease, "renew", broken)
    with pytest.raises(KeyError, match="a bug in the renewal"):
        keeper.renew(due + JOB_LEASE_TTL_S)
