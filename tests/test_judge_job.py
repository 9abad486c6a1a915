"""A whole job on CPU whose lesson is judged by an LLM: the cats lesson wrapped in `JudgedEnv`, its judge a policy
of this very run (policy 0) served by rlpipe's own generate endpoint (`python -m steps.serve`, the dense sampler) in
its own process on loopback, asked over `/v1/completions` by the judge's real httpx client.

The judge is SIGKILLed once judged rows are committed: the examples it cannot score fail with the judge's reason
(logged by the worker, counted in its metrics), the job goes on, and once the judge is back (same port, same policy)
the job completes. Every committed row carries both reward functions in `reward_components`, the cats rule's value
equals the rule recomputed on the row's text, the judge's value equals what the judge answers now for the same
text (greedy), and the episode reward is their sum.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from jobs import ROOT, TEST_CONFIG, check_finished_run

from pipeline.environments.cats import CatsEnv
from pipeline.process.ports import reserve_port
from pipeline.store import layout
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import read_metrics
from schemas import ROLLOUT

PATTERN = "(?i)cat"
STEPS = 3


def _start_judge(run_root: str, port: int, log: Path, step: int | None) -> subprocess.Popen:
    # the port is reserved by this test (reserve_port) for the judge's whole life, restarts included: the judge
    # binds it with SO_REUSEPORT, nobody else can take it (the job's config names it before the judge can start)
    cmd = [sys.executable, "-m", "steps.serve", "--run_root", run_root, "--port", str(port), "--reuse_port", "true",
           "--max_seqs", "16", *(["--policy_step", str(step)] if step is not None else [])]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def _wait(what: str, cond: Any, timeout: float, job: subprocess.Popen | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cond()
        if out:
            return out
        assert job is None or job.poll() is None, f"the job ended while waiting for {what}"
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _rollout_files(store: RunStore) -> list[str]:
    return [f for d in store.list(layout.ROLLOUTS) for f in store.list_committed(d)]


def _judge_failures_logged(run_root: str) -> bool:
    for log in Path(run_root, "logs").glob("rollout-*/*.log"):
        text = log.read_text(errors="replace")
        if re.search(
            r"scorer 'judge': judge http://127\.0\.0\.1:\d+/v1 failed after \d attempt\(s\): ConnectError", text
        ):
            return True
    return False


@pytest.mark.slow
def test_judged_lesson_with_a_served_policy_as_judge_survives_the_judge_dying(tmp_path: Path) -> None:
    run_root = str(tmp_path / "run")
    reserved = reserve_port()
    port = reserved.port
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["store"]["run_root"] = run_root
    cfg["train"]["num_train_steps"] = STEPS
    cfg["evaluator"] = False
    cfg["num_rollout_workers"] = 1
    judge = {"type": "judge", "name": "judge", "base_url": f"http://127.0.0.1:{port}/v1", "model": "policy",
             "chat": False, "prompt": "{response}", "rule": "match", "score_pattern": PATTERN, "max_tokens": 8,
             "timeout_s": 60, "max_retries": 2, "retry_backoff_s": 0.3}  # fmt: skip
    cfg["curriculum"]["lessons"]["cats"]["env"] = {
        "env_class": "pipeline.environments.judged.JudgedEnv",
        "env_args": {"base": {"env_class": "pipeline.environments.cats.CatsEnv"}, "scorers": [judge]},
    }
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    job = subprocess.Popen([sys.executable, "-m", "steps.run", "--config_path", str(config_path)], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    log = tmp_path / "judge.log"
    judge_proc = _start_judge(run_root, port, log, step=None)  # serves policy 0, once the learner wrote it
    store = RunStore(run_root)
    try:
        _wait("a committed judged rollout file", lambda: _rollout_files(store), 240, job)
        judge_proc.send_signal(signal.SIGKILL)
        judge_proc.wait(10)
        _wait("a judge failure recorded by the worker", lambda: _judge_failures_logged(run_root), 120, job)
        judge_proc = _start_judge(run_root, port, log, step=0)
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 0, out[-3000:]
        check_finished_run(store, STEPS, cfg["train"]["max_lag"], evaluated=False)

        # every row: both reward functions, the rule recomputed, reward = their sum
        tables = [store.read_committed(f, ROLLOUT) for f in _rollout_files(store)]
        rows = [r for t in tables if t is not None for r in t.to_pylist()]
        assert rows
        cats = CatsEnv()
        for r in rows:
            comps = dict(r["reward_components"])
            assert set(comps) == {"cats", "judge"}, comps
            assert comps["cats"] == cats.score(None, r["response_text"]).reward  # type: ignore[arg-type]
            assert comps["judge"] in (0.0, 1.0)
            assert r["episode_reward"] == pytest.approx(comps["cats"] + comps["judge"])
            assert r["policy_step"] <= STEPS
        # the judge's scores are what the judge (greedy, policy 0) says about the same texts
        with httpx.Client(timeout=120) as client:
            _wait("the judge back up", lambda: _healthy(client, port), 120)
            for r in rows[:6]:
                answer = client.post(f"http://127.0.0.1:{port}/v1/completions",
                                     json={"model": "policy", "prompt": r["response_text"], "max_tokens": 8,
                                           "temperature": 0.0}).json()  # fmt: skip
                assert answer["policy_step"] == 0  # the endpoint names the policy that answered: policy 0 of this run
                reply = answer["choices"][0]["text"]
                assert dict(r["reward_components"])["judge"] == (1.0 if re.search(PATTERN, reply) else 0.0), reply
        # the failures were counted in the worker's metrics
        records = read_metrics(store, "rollout")
        failed = sum(float(rec.get("env/n_scorer_failures/judge", 0.0)) for rec in records)
        scored = sum(float(rec.get("env/n_scored/judge", 0.0)) for rec in records)
        assert failed >= 1 and scored >= len(rows)
        assert any("env/scorer_latency_s/judge" in rec for rec in records)
    finally:
        if job.poll() is None:
            job.kill()
        if judge_proc.poll() is None:
            judge_proc.send_signal(signal.SIGTERM)
            try:
                judge_proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(judge_proc.pid, signal.SIGKILL)
        reserved.close()


def _healthy(client: httpx.Client, port: int) -> bool:
    try:
        return client.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--host", "0.0.0.0"], "host='0.0.0.0': is not loopback: give --token or set RLPIPE_ENDPOINT_TOKEN"),
        (["--wait_s", "0.3"], "no run.json after 0.3 s"),
    ],
)
def test_serve_refuses_bad_arguments_and_a_missing_run_in_one_line(tmp_path: Path, args: list[str], line: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RLPIPE_ENDPOINT_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "steps.serve", "--run_root", str(tmp_path / "none"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert line in proc.stderr.strip().splitlines()[-1]


def test_serve_waits_for_its_run_without_loading_jax(tmp_path: Path) -> None:
    """Started before its run root has a run.json (beside a job about to start), serve waits light: no jaxlib
    library is mapped into it while it waits (JAX and the model load once the policy is there); SIGTERM ends the
    wait with the documented code."""
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "steps.serve", "--run_root", str(tmp_path / "none"), "--port", "0", "--wait_s", "300"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait("serve's waiting line", lambda: "waiting up to 300 s" in log.read_text(), 120)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert proc.poll() is None, log.read_text()[-2000:]
        assert "jaxlib" not in maps, [ln for ln in maps.splitlines() if "jaxlib" in ln][:3]
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 143, (rc, log.read_text()[-2000:])
    assert "Traceback" not in log.read_text()
