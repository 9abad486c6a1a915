"""`python -m steps.rescore` as a real process on a real run root: committed rollout files (one with
`response_text`, one without, as rows written before schema version 3 are read) re-scored into
`rescored/<name>/step-P/`, with lineage to the source files, the source files byte-identical, exactly once.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import draccus
import pytest
from jobs import ROOT, TEST_CONFIG
from test_scoring import JudgeServer, completion

from pipeline.config import RLJobConfig
from pipeline.environments.exact_answer import normalized_match
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.run_contract import check_run_config
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import ROLLOUT, RolloutRow

TEXTS = [("cats", "cats"), ("a cat", "cat"), ("2", "3"), ("meow meow", "meow")]


def _rows(tok: Any, step: int, with_text: bool) -> list[RolloutRow]:
    out = []
    for i, (resp, truth) in enumerate(TEXTS):
        ids = [*tok.encode(resp), tok.eos_token_id]
        out.append(
            RolloutRow(
                rollout_id=f"w0-{step}-{i}", env_name="exact_answer", example_id=f"q{i}", lesson_id="qa",
                group_key=f"qa/q{i}/k", prompt_tokens=[tok.bos_token_id, *tok.encode(f"say {truth}")],
                response_tokens=ids, response_logprobs=[-0.5] * len(ids), token_rewards=[0.0] * (len(ids) - 1) + [0.25],
                response_loss_mask=[1] * len(ids), episode_reward=0.25, truncated=False, finish_reason="stop",
                temperature=1.0, policy_step=step, worker_id="w0", timestamp=1.0,
                response_text=resp if with_text else "", ground_truth=truth,
            )
        )  # fmt: skip
    return out


def _hashes(root: Path, folder: str) -> dict[str, str]:
    files = [p for p in (root / folder).rglob("*") if p.is_file()]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _rescore(run_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "steps.rescore", "--store.run_root", str(run_root), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, RunStore, list[str]]:
    root = tmp_path / "run"
    store = RunStore(str(root))
    check_run_config(store, draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=[]))
    tok = load_tokenizer("builtin:tiny")
    sources = []
    for step, with_text in ((0, True), (1, False)):
        rel = layout.rollout_file(step, "w0", 0)
        assert store.commit_data(
            rel, ROLLOUT.to_table(_rows(tok, step, with_text)), ROLLOUT, extra={"policy_step": step}
        )
        sources.append(rel)
    return root, store, sources


def test_rescore_writes_new_scores_with_lineage_and_never_touches_the_sources(run: Any) -> None:
    root, store, sources = run
    before = _hashes(root, "rollouts")
    scorer = ["--scorer", "{type: function, name: exact, weight: 2.0, "
              "function: pipeline.environments.exact_answer.normalized_match}"]  # fmt: skip
    first = _rescore(root, "--name", "exact1", "--max_files", "1", *scorer)  # stops after one file, like a kill
    assert first.returncode == 0, first.stderr[-2000:]
    (done,) = [f for f in sources if store.exists(layout.ready_marker(layout.rescored_file("exact1", f)))]
    first_attempt = store.read_marker(layout.rescored_file("exact1", done)).attempt_id
    # a run killed after writing the other data file but before its marker leaves this behind
    (left,) = [f for f in sources if f != done]
    store.put_unique(layout.rescored_file("exact1", left), b"half a file")
    second = _rescore(root, "--name", "exact1", "--base_weight", "1.0", *scorer)
    assert second.returncode == 0, second.stderr[-2000:]
    third = _rescore(root, "--name", "exact1", *scorer)  # nothing left: no file rewritten
    assert third.returncode == 0 and "nothing to do" in third.stderr, third.stderr[-2000:]

    assert _hashes(root, "rollouts") == before  # the sources: same files, same bytes
    assert sorted(store.list_committed(f"rescored/exact1/{layout.step_name(0)}")) + sorted(
        store.list_committed(f"rescored/exact1/{layout.step_name(1)}")
    ) == [layout.rescored_file("exact1", s) for s in sources]
    assert store.read_marker(layout.rescored_file("exact1", done)).attempt_id == first_attempt
    for src in sources:
        rel = layout.rescored_file("exact1", src)
        marker = store.read_marker(rel)
        assert marker.extra["source_file"] == src
        assert marker.extra["source_sha256"] == store.read_marker(src).sha256
        assert marker.extra["scorer"]["name"] == "exact" and marker.extra["n_failures"] == 0
        base_weight = 0.0 if src == done else 1.0
        old = {r["rollout_id"]: r for r in store.read_committed(src, ROLLOUT).to_pylist()}
        new = store.read_committed(rel, ROLLOUT).to_pylist()
        assert [r["rollout_id"] for r in new] == list(old)
        for r, (resp, truth) in zip(new, TEXTS, strict=True):
            o = old[r["rollout_id"]]
            assert r["response_text"] == resp  # decoded from the tokens for the file that had no text
            score = normalized_match(resp, truth)
            assert dict(r["reward_components"]) == {"original": 0.25, "exact": score}
            assert r["episode_reward"] == pytest.approx(base_weight * 0.25 + 2.0 * score)
            assert r["token_rewards"][-1] == pytest.approx(r["episode_reward"]) and sum(r["token_rewards"]) == (
                pytest.approx(r["episode_reward"])
            )
            for k in ("prompt_tokens", "response_tokens", "response_logprobs", "response_loss_mask", "policy_step"):
                assert r[k] == o[k]


def test_rescore_with_a_judge_lists_the_rows_it_could_not_score(run: Any) -> None:
    root, store, sources = run
    srv = JudgeServer(lambda body: (200, completion("<score>8</score>" if "cat" in body["prompt"] else "hmm"), 0.0))
    try:
        spec = {"type": "judge", "base_url": srv.base_url, "chat": False, "prompt": "{response}", "api_key": "sekrit"}
        out = _rescore(root, "--name", "judge1", "--scorer", json.dumps(spec))
    finally:
        srv.stop()
    assert out.returncode == 0, out.stderr[-2000:]
    for src in sources:
        marker = store.read_marker(layout.rescored_file("judge1", src))
        assert "api_key" not in marker.extra["scorer"]
        failed = {f["rollout_id"]: f["reason"] for f in marker.extra["failures"]}
        rows = store.read_committed(layout.rescored_file("judge1", src), ROLLOUT).to_pylist()
        assert [r["response_text"] for r in rows] == ["cats", "a cat"]
        assert all(dict(r["reward_components"])["judge"] == pytest.approx(0.8) for r in rows)
        assert sorted(failed) == sorted(r["rollout_id"] for r in store.read_committed(src, ROLLOUT).to_pylist()[2:])
        assert all("no match of score_pattern" in why for why in failed.values())


def test_rescore_refuses_a_bad_scorer_in_one_line(run: Any) -> None:
    root, _, _ = run
    out = _rescore(root, "--name", "x", "--scorer", '{"type": "judge", "base_url": "localhost:8000"}')
    assert out.returncode == 2
    assert "scorer.base_url='localhost:8000'" in out.stderr.splitlines()[-1] and not (root / "rescored").exists()


KILLS = 4


def _markers(root: Path, name: str) -> list[Path]:
    return sorted((root / "rescored" / name).rglob(f"*{layout.READY_SUFFIX}"))


@pytest.mark.slow
def test_rescore_sigkilled_at_random_points_rescores_every_file_exactly_once(tmp_path: Path) -> None:
    """The real `python -m steps.rescore` process SIGKILLed at random points (while starting, between files, while
    its judge answers, between a data file and its marker), rerun each time, then run to the end: every source file
    is re-scored exactly once (one committed file each, the first commit never rewritten), lineage from each new
    file to its source, the sources byte-identical, and after every kill each committed file reads back verified (a
    file cut by the kill is never visible as committed)."""
    root = tmp_path / "run"
    store = RunStore(str(root))
    check_run_config(store, draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=[]))
    tok = load_tokenizer("builtin:tiny")
    sources = []
    for step in range(8):
        for worker in ("w0", "w1"):
            rel = layout.rollout_file(step, worker, 0)
            assert store.commit_data(
                rel, ROLLOUT.to_table(_rows(tok, step, step % 2 == 0)), ROLLOUT, extra={"policy_step": step}
            )
            sources.append(rel)
    before = _hashes(root, "rollouts")
    rng = random.Random(0)
    delays = random.Random(1)  # the judge's answer times: each file takes a while, so kills land mid-file too
    srv = JudgeServer(
        lambda body: (
            200,
            completion(f"<score>{8 if 'cat' in body['prompt'] else 2}</score>"),
            delays.uniform(0.05, 0.2),
        )
    )
    spec = json.dumps(
        {"type": "judge", "name": "judge", "base_url": srv.base_url, "chat": False, "prompt": "{response}"}
    )
    cmd = [sys.executable, "-m", "steps.rescore", "--store.run_root", str(root), "--name", "j", "--scorer", spec]
    first_commit: dict[str, str] = {}
    partial = 0
    try:
        for _ in range(KILLS):
            n0 = len(_markers(root, "j"))
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if rng.random() < 0.25:  # anywhere in its start-up
                time.sleep(rng.uniform(0.0, 3.0))
            else:  # once it has committed a file: between files, mid-batch, between a data file and its marker
                deadline = time.monotonic() + 120
                while len(_markers(root, "j")) == n0 and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(rng.uniform(0.0, 0.4))
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            committed = [f for s in sources if store.exists(layout.ready_marker(f := layout.rescored_file("j", s)))]
            partial += 0 < len(committed) < len(sources)
            for rel in committed:  # committed = complete: the data file matches its marker (read_committed verifies)
                assert store.read_committed(rel, ROLLOUT) is not None, rel
                attempt = store.read_marker(rel).attempt_id
                assert first_commit.setdefault(rel, attempt) == attempt  # never rewritten by a later run
        final = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert final.returncode == 0, final.stderr[-2000:]
    finally:
        srv.stop()
    assert partial >= 2, "the kills never left a run half done"
    assert _hashes(root, "rollouts") == before
    rescored = [f for d in store.list("rescored/j") for f in store.list_committed(d)]
    assert sorted(rescored) == sorted(layout.rescored_file("j", s) for s in sources)  # exactly one each
    data = sorted(p for p in (root / "rescored/j").rglob("*.parquet"))
    assert [str(p.relative_to(root)) for p in data] == sorted(rescored)  # no half file left behind
    for src in sources:
        rel = layout.rescored_file("j", src)
        marker = store.read_marker(rel)
        assert first_commit.get(rel, marker.attempt_id) == marker.attempt_id
        assert marker.extra["source_file"] == src and marker.extra["source_sha256"] == store.read_marker(src).sha256
        new, old = (store.read_parquet(f, ROLLOUT).to_pylist() for f in (rel, src))
        assert [r["rollout_id"] for r in new] == [r["rollout_id"] for r in old]
        for r, (resp, _) in zip(new, TEXTS, strict=True):
            assert dict(r["reward_components"]) == {"original": 0.25, "judge": 0.8 if "cat" in resp else 0.2}
