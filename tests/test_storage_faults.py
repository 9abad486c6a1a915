"""Storage faults a restart cannot fix (no space, a read-only run root) are named in one line by the step that hit
them (exit 8, `Exit.STORAGE_FAULT`) and by the job, which stops instead of restarting; after the space is back the
same command completes the run with every invariant intact; a dead step's lease never blocks the rerun; a worker
whose every generation fails the same way stops with one line (exit 9).

A full disk is simulated through the real write path of the real programs by the documented fault-injection hook
(`RLPIPE_INJECT_STORAGE_FAULT`, `pipeline.store.faults`): a small file system cannot be mounted here, and the tests
run as root (so `chmod a-w` would not make a run root read-only either).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
from pathlib import Path

import draccus
import pytest
from jobs import check_finished_run, job_config

from pipeline.config import RLJobConfig
from pipeline.jobs.job import RLJob
from pipeline.process.exits import Exit, StorageFaultError
from pipeline.process.step_kind import StepKind
from pipeline.store import layout
from pipeline.store.faults import FAULT_INJECTION_ENV, injected_faults
from pipeline.store.lease import Lease
from pipeline.store.storage import RunStore
from schemas import ROLLOUT

ROOT = Path(__file__).resolve().parents[1]
TEST_CONFIG = ROOT / "configs/test_cats.yaml"


# ---------------------------------------------------------------------------------------------- the store
def test_an_injected_full_disk_is_a_storage_fault_naming_path_and_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RunStore(str(tmp_path / "run"))
    monkeypatch.setenv(FAULT_INJECTION_ENV, "ENOSPC:policies/@10")
    with pytest.raises(StorageFaultError) as caught:
        store.put_unique("policies/step-00000001/weights.safetensors", b"x" * 1000)
    message = str(caught.value)
    assert message.startswith(str(tmp_path / "run" / "policies/step-00000001/weights.safetensors") + ": ")
    assert "No space left on device" in message and "(ENOSPC)" in message and "free of" in message
    # the half-written temp file is gone and, whatever happens, never listed
    folder = tmp_path / "run" / "policies/step-00000001"
    assert list(folder.iterdir()) == [] and store.list("policies/step-00000001") == []
    with pytest.raises(StorageFaultError):  # create-if-absent commits go through the same path
        store.put_json_if_absent(layout.policy_marker(1), {"step": 1})
    assert not store.exists(layout.policy_marker(1))
    store.put_unique("batches/other.json", b"{}")  # other prefixes are not full
    assert store.get("batches/other.json") == b"{}"
    monkeypatch.delenv(FAULT_INJECTION_ENV)  # "the space is back"
    store.put_unique("policies/step-00000001/weights.safetensors", b"x" * 1000)
    assert store.get("policies/step-00000001/weights.safetensors") == b"x" * 1000


def test_a_commit_that_hits_a_read_only_disk_leaves_nothing_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa

    store = RunStore(str(tmp_path / "run"))
    table = pa.table({n: pa.array([], type=ROLLOUT.schema.field(n).type) for n in ROLLOUT.schema.names})
    monkeypatch.setenv(FAULT_INJECTION_ENV, "EROFS:rollouts/")
    with pytest.raises(StorageFaultError, match=r"Read-only file system .*\(EROFS\)"):
        store.commit_data("rollouts/step-00000000/w0.x-0.parquet", table, ROLLOUT)
    assert store.list_committed("rollouts/step-00000000") == []


def test_an_object_store_that_refuses_a_write_is_a_storage_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on a non-local run root (`memory://`, as `gs://` goes): the fault names the object's URL."""
    store = RunStore("memory://faults-test/run")
    monkeypatch.setenv(FAULT_INJECTION_ENV, "ENOSPC:policies/")
    with pytest.raises(StorageFaultError, match=r"^memory://.*policies/step-00000001/COMMITTED: No space left"):
        store.put_json_if_absent(layout.policy_marker(1), {"step": 1})
    assert not store.exists(layout.policy_marker(1))


def test_a_bad_injection_rule_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_INJECTION_ENV, "ENOSUCH:policies/")
    with pytest.raises(ValueError, match=FAULT_INJECTION_ENV):
        injected_faults()
    monkeypatch.setenv(FAULT_INJECTION_ENV, "enospc:policies/@5, EROFS:")
    assert [(r.code, r.prefix, r.after_bytes) for r in injected_faults()] == [
        (errno.ENOSPC, "policies/", 5),
        (errno.EROFS, "", 0),
    ]


def test_the_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    """A step that died without releasing its lease (killed, or on a full disk) does not block the rerun."""
    root = tmp_path / "run"
    code = (
        "import os; from pipeline.store.lease import Lease; from pipeline.store.storage import RunStore; "
        f"Lease(RunStore({str(root)!r}), 'batchmaker', 'maker-dead', 600.0).acquire(); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    lease = Lease(RunStore(str(root)), "batchmaker", "maker-new", 600.0)
    assert lease.acquire() == 2  # no LeaseHeldError although epoch 1 has 600 s to go
    live = Lease(RunStore(str(root)), "batchmaker", "maker-third", 600.0)
    with pytest.raises(Exception, match="held by 'maker-new'"):  # this process lives: refused as before
        live.acquire()


# ---------------------------------------------------------------------------------------------- real programs
def _job(config: Path, fault: str | None, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != FAULT_INJECTION_ENV}
    if fault is not None:
        env[FAULT_INJECTION_ENV] = fault
    return subprocess.run(
        [sys.executable, "-m", "steps.run", "--config_path", str(config)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _stop_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if "(exit 8, not restarted)" in ln]


@pytest.mark.slow
def test_a_full_disk_stops_the_job_in_one_line_and_the_same_command_completes_the_run(tmp_path: Path) -> None:
    """(a) only `policies/` full from policy 2 on: the learner's queued publish fails, the learner stops (it does
    not train on while the BatchMaker waits for that policy), the job stops with the cause; (b) the whole run root
    full: every step log is unwritable, the job still names the cause; then, space back, the same command
    completes the run: exactly-once, contiguous slots and policies, lineage (tests/invariants.py). One rollout
    worker and no evaluator: three job starts, and neither changes what a full disk does to the learner, the step
    logs or the runner."""
    root = tmp_path / "run"
    config = job_config(
        tmp_path, str(root), None, **{"train.num_train_steps": "4", "num_rollout_workers": "1", "evaluator": "false"}
    )

    first = _job(config, f"ENOSPC:{layout.POLICIES}/step-00000002@100")
    assert first.returncode == Exit.STORAGE_FAULT, first.stderr[-4000:]
    (line,) = _stop_lines(first)
    assert "learner stopped (storage fault)" in line and "No space left on device" in line and "(ENOSPC)" in line
    assert f"{root}/policies/step-00000002/" in line and "free of" in line
    assert "Traceback" not in line and "restart" not in first.stderr.split(line)[0].split("job started")[-1]
    store = RunStore(str(root))
    assert not store.exists(layout.policy_marker(2)) and store.exists(layout.policy_marker(1))

    second = _job(config, "ENOSPC:")  # the whole run root full (run.json exists: the runner only reads it)
    assert second.returncode == Exit.STORAGE_FAULT, second.stderr[-4000:]
    (line,) = _stop_lines(second)
    assert "No space left on device" in line and f"{root}/" in line
    failed_log = line.rsplit("see ", 1)[1]
    assert not Path(failed_log).exists() or Path(failed_log).stat().st_size == 0  # the reason came off the run root

    third = _job(config, None)
    assert third.returncode == Exit.OK, third.stderr[-4000:]
    assert "waiting up to that long for it to lapse" not in third.stderr  # no dead lease blocked the rerun
    check_finished_run(store, 4, max_lag=1, evaluated=False)


def _policy_0_root(tmp_path: Path) -> Path:
    from pipeline.environments.tokenizer import load_tokenizer
    from policy.model import build_model, model_vocab_size
    from policy.policy_format import write_policy

    root = tmp_path / "run"
    cfg = draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=[])
    write_policy(RunStore(str(root)), 0, build_model(cfg.model, model_vocab_size(load_tokenizer(cfg.model.tokenizer))))
    return root


def _rollout(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_lesson_none_of_whose_prompts_fits_is_a_config_error_at_start(tmp_path: Path) -> None:
    root = _policy_0_root(tmp_path)
    job = ["steps.run", "step", "rollout", "--config_path", str(TEST_CONFIG), "--run_root", str(root)]
    proc = _rollout([*job, "--inference.max_seq_len", "2"])
    assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert line.startswith("error: invalid config: inference.max_seq_len=2: no prompt of lesson 'cats' fits: ")
    assert RunStore(str(root)).list(layout.ROLLOUTS) == []  # refused before anything started


def test_a_worker_whose_every_generation_fails_stops_in_one_line(tmp_path: Path) -> None:
    """Every example fails the same way in a way the start-up check cannot see (here the environment's own
    `max_prompt_tokens`): the worker (follow mode) stops with exit 9 naming the cause instead of failing forever."""
    root = _policy_0_root(tmp_path)
    cfg = draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=[])
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, run_root=str(root)))
    step = tmp_path / "rollout.yaml"
    step.write_text(str(draccus.dump(RLJob(cfg).to_worker_configs()[StepKind.ROLLOUT.job_name][0])))
    proc = _rollout(
        ["steps.rollout", "--config_path", str(step), "--curriculum.lessons.cats.env.env_args.max_prompt_tokens", "1"]
    )
    assert proc.returncode == Exit.NO_PROGRESS, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert line.startswith("error: no progress: lesson 'cats': 20 sampling calls in a row generated nothing")
    assert "max_prompt_tokens=1" in line and "Traceback" not in proc.stderr
    assert RunStore(str(root)).list_committed(layout.rollout_step_dir(0)) == []
