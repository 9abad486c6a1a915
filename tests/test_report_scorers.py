"""The report's Scorers section on a run root with scorer metrics records: per scorer values, latency and failures
aggregated by hand-checked weights, and the failures of sampling calls that committed nothing (every example of a
judged sample failed) shown with their reasons."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline import report
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter


def judge(n: float, failures: float, latency: float, top: float, value: float | None) -> dict[str, float]:
    rec = {"env/n_scored/judge": n, "env/n_scorer_failures/judge": failures, "env/scorer_latency_s/judge": latency,
           "env/scorer_latency_max_s/judge": top}  # fmt: skip
    if value is not None:
        rec["env/reward_component/judge"] = value
    return rec


def test_scorers_section_shows_values_latency_and_failures(tmp_path: Path) -> None:
    root = tmp_path / "run"
    w = MetricsWriter(RunStore(str(root)), "rollout", "w0")
    w.log(
        {
            "event": "write",
            "lesson_id": "qa",
            "policy_step": 0,
            "mean_reward": 0.5,
            "failures": 1.0,
            "env/n_scored/exact": 8.0,
            "env/reward_component/exact": 0.25,
            **judge(6, 2, 0.5, 0.9, 0.5),
        }
    )
    w.log(
        {
            "event": "write",
            "lesson_id": "qa",
            "policy_step": 1,
            "mean_reward": 1.0,
            "failures": 0.0,
            "env/n_scored/exact": 8.0,
            "env/reward_component/exact": 0.75,
            **judge(4, 0, 1.0, 1.2, 1.0),
        }
    )
    # the judge died: every example of the call failed, nothing was committed; only the `empty` record tells
    w.log({"event": "empty", "lesson_id": "qa", "policy_step": 1, "failures": 4.0, **judge(0, 8, 2.0, 3.0, None),
           "failure_reasons": ["scorer 'judge': connection refused (http://127.0.0.1:9/v1)"]})  # fmt: skip
    w.flush()

    page = Path(report.build_report(str(root), str(tmp_path / "out"))).read_text()
    m = re.search(r"<h2>Scorers</h2>(.*?)</section>", page, re.S)
    assert m, "no Scorers section"
    sec = m.group(1)
    cells = dict(
        (row[0], row[1:])
        for row in (re.findall(r"<td>(.*?)</td>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", sec))
        if row
    )
    # judge: scored 6+4+0 = 10, failed 2+0+8 = 10, rate 0.5; latency weighted by requests (8, 4, 8):
    # (8*0.5 + 4*1.0 + 8*2.0) / 20 = 1.2; max 3.0; value weighted by responses scored (6, 4): (3 + 4) / 10 = 0.7
    assert cells["judge"] == ["10", "10", "0.5", "1.2", "3", "0.7"], cells
    # a rule reward function: no failures or latency recorded, value (8*0.25 + 8*0.75) / 16 = 0.5
    assert cells["exact"] == ["16", "0", "0", "-", "-", "0.5"], cells
    assert "1 sampling call(s) committed nothing: every example failed (4 failures)" in sec
    assert "connection refused (http://127.0.0.1:9/v1)" in sec
    assert '<img alt="scorers"' in sec
    assert page.index("<h2>Reward per lesson</h2>") < page.index("<h2>Scorers</h2>") < page.index("<h2>Summary</h2>")


def test_a_run_without_scorers_says_so(tmp_path: Path) -> None:
    root = tmp_path / "run"
    w = MetricsWriter(RunStore(str(root)), "rollout", "w0")
    w.log({"event": "write", "lesson_id": "cats", "policy_step": 0, "mean_reward": 0.5})
    w.flush()
    page = Path(report.build_report(str(root), str(tmp_path / "out"))).read_text()
    assert "No scorer in this run" in page
