"""A rollout worker on a gs:// run root whose server cannot start: the one-line error names the server log where
the user can read it, its gs:// URL under `logs/` (the worker writes it to a temporary local file, uploaded there
and removed when the worker ends), with the log's last error line."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from jobs import ROOT, job_config

from pipeline.jobs.step_logs import location
from pipeline.process.exits import Exit
from pipeline.store import layout
from pipeline.store.storage import RunStore

PROBE = "import sys; print('starting'); print('ModuleNotFoundError: No module named levanter_probe'); sys.exit(3)"


@pytest.mark.slow
def test_server_start_error_on_a_gs_run_root_names_the_logs_url(tmp_path: Path, gcs_endpoint) -> None:
    run_root = f"gs://{gcs_endpoint.bucket}/server-log-{uuid.uuid4().hex[:8]}"
    probe = tmp_path / "server.py"  # a server command that cannot start (as a missing module would)
    probe.write_text(PROBE)
    cfg = job_config(
        tmp_path,
        run_root,
        gcs_endpoint.storage_options,
        **{"inference.type": "server", "inference.command": f"{sys.executable} {probe}", "inference.port": "0"},
    )
    store = RunStore(run_root, gcs_endpoint.storage_options)
    # policy 0's commit marker, as the learner would leave it: a server backend loads no weights in the worker, so
    # the worker goes straight to starting its server
    store.put_if_absent(layout.policy_marker(0), b"{}")
    proc = subprocess.run(
        [
            sys.executable, "-m", "steps.run", "step", "rollout", "--config_path", str(cfg), "--worker_id", "w1",
            "--follow", "false", "--max_rollouts", "4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if "inference.command" in ln and "error" in ln]
    logs = store.list(f"{layout.LOGS}/rollout-w1")
    server_logs = [p for p in logs if p.endswith(".server.log")]
    assert len(server_logs) == 1, (logs, line)
    url = location(store, server_logs[0])
    assert url.startswith("gs://") and f"see {url}: " in line, (url, line)
    assert line.endswith("ModuleNotFoundError: No module named levanter_probe"), line
    assert "rlpipe-log-" not in line  # not the temporary local copy
    assert b"No module named levanter_probe" in store.get(server_logs[0])  # the log it names holds that line
