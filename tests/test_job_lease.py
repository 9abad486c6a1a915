"""One job per run root: a whole job (`rlpipe run`) holds the run root's job lease (`pipeline.jobs.runner.job_lease`,
the lease machinery of `pipeline.store.lease`) from before its first step starts.

The first job here is a live process that holds that very lease, taken with the runner's own `job_lease` (what a
job runner holds from its start to its end; a real first job would spend ~20 s of CPU to show the same claim):

- a second `rlpipe run` on that run root is refused at once in one line naming the holder's host, pid and start
  time, exit 6, before anything is written (no run.json, no step log);
- once the first job's process is killed with SIGKILL (it never releases the lease), the same command takes the
  lease over at once, with no wait for its ttl: here it then stops at the next check of the job, a contract field
  that differs from run.json (exit 2), which only a job holding the lease reaches.

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

from pipeline.jobs.runner import JOB_LEASE, JOB_LEASE_TTL_S
from pipeline.process.exits import Exit
from pipeline.store import layout

ROOT = Path(__file__).resolve().parents[1]
TEST_CONFIG = ROOT / "configs/test_cats.yaml"
RLPIPE = Path(sys.executable).parent / "rlpipe"

HOLD = """
import sys
from pipeline.jobs.runner import job_lease
from pipeline.store.storage import RunStore

lease = job_lease(RunStore(sys.argv[1]))
print(lease.acquire(), flush=True)
sys.stdin.read()  # held until stdin closes or the process is killed
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
