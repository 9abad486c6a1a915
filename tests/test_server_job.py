"""A whole job on CPU with `inference: {type: server}`: each rollout worker starts levanter's `InferenceServer`
(`policy.inference.adapters.levanter_server`) as a child process on loopback, tells it to load every committed
policy, and tags its rollouts with the step the server confirmed; a server SIGKILLed mid-run is restarted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from jobs import ROOT, job_config

from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import ROLLOUT

pytestmark = pytest.mark.slow

COMMAND = (
    f"{sys.executable} -m policy.inference.adapters.levanter_server --run_root {{run_root}} --host {{host}} "
    "--port {port} --model_json {model_json} --step {step} --max_seqs 16 --page_size 8"
)


def _server_pids(run_root: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "levanter_server" in cmd and run_root in cmd:
                pids.append(int(d))
    return pids


def test_job_with_a_levanter_server_in_the_loop(tmp_path: Path) -> None:
    run_root = str(tmp_path / "run")
    # no evaluator: it scores with its own dense sampler (never the rollout server), and nothing here reads it
    cfg = job_config(tmp_path, run_root, None, **{"inference.type": "server", "inference.command": COMMAND,
                     "inference.port": "0", "num_rollout_workers": "1", "train.num_train_steps": "4",
                     "evaluator": "false"})  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "steps.run", "--config_path", str(cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    store = RunStore(run_root)
    killed: list[int] = []

    def kill_once() -> None:  # SIGKILL the server once policy 1 is out
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline and not killed:
            if store.exists(layout.policy_marker(1)):
                pids = _server_pids(run_root)
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
            time.sleep(0.5)

    t = threading.Thread(target=kill_once, daemon=True)
    t.start()
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    assert killed, "the server was never seen"
    assert store.exists(layout.LEARNER_DONE)
    confirmed = set()
    for step in range(0, 5):
        for name in store.list(layout.rollout_step_dir(step)):
            if name.endswith(".parquet"):
                rows = store.read_parquet(name, ROLLOUT).column("policy_step").to_pylist()
                assert set(rows) == {step}, (name, set(rows))
                marker = store.read_marker(name)
                assert marker.extra["sampling"]["top_p"] == 1.0 and marker.extra["policy_step"] == step
                confirmed.add(step)
    assert len(confirmed) >= 2  # rollouts from more than one policy the server confirmed
    # the worker itself restarted its server: one worker incarnation (one server log, beside the worker's own
    # log of the same attempt), two server starts
    folder = Path(run_root, "logs", "rollout-worker0")
    (worker_log,) = [p for p in folder.glob("*.log") if not p.name.endswith(".server.log")]
    logs = list(folder.glob("*.server.log"))
    assert [p.name for p in logs] == [worker_log.name.removesuffix(".log") + ".server.log"], logs
    assert logs[0].read_text().count("levanter server: policy") == 2
    assert not Path(run_root, "logs", "server").exists()
