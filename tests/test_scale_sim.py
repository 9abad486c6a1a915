"""The scale simulation (`bench.bench_scale`) and the waste metric.

- the request counting of `CountingStore` matches what the real storage code does for a commit, a listing and a
  verified read;
- the BatchMaker's requests per batch slot do not grow with the number of rollout workers (10 vs 200 simulated
  workers on local disk, same aggregate supply): a slot costs O(new files), not O(workers) or O(all files);
- waste (rows dropped stale / zero-variance / superseded / zero-advantage per row trained) is in the BatchMaker's
  metrics and in the report of a real short job, equal to what the run root's batch and dropped files say.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
from jobs import FinishedJob

from bench.bench_scale import CountingStore, SimConfig, rollout_table, run_once
from pipeline import report
from pipeline.batch_maker.slot_metrics import WASTE_REASONS
from pipeline.report.sections import WASTE_LABEL
from pipeline.store import layout
from schemas import ROLLOUT


def test_counting_store_counts_each_request(tmp_path: Path) -> None:
    import numpy as np

    store = CountingStore(str(tmp_path / "run"))
    rel = layout.rollout_file(3, "w0", 0)
    assert store.commit_data(rel, rollout_table(8, np.random.default_rng(0), 16), ROLLOUT)
    # commit: is it committed already (head of the marker), the data (put), the marker (create-if-absent put)
    assert store.snapshot() == {"list": 0, "get": 0, "put": 2, "head": 1, "delete": 0, "listed": 0}
    assert store.list_committed(layout.rollout_step_dir(3)) == [rel]
    after_list = store.snapshot()
    assert after_list["list"] == 2 and after_list["listed"] == 2  # the folder (data + marker) and quarantine/
    table = store.read_committed(rel, ROLLOUT)
    assert table is not None and table.num_rows == 8
    read = {k: v - after_list[k] for k, v in store.snapshot().items()}
    assert read == {"list": 0, "get": 2, "put": 0, "head": 1, "delete": 0, "listed": 0}  # quarantine?, marker, data


def _sim(tmp_path: Path, workers: int) -> dict:
    cfg = SimConfig(
        workers=workers, files_per_s=16.0, rows_per_file=8, resp_tokens=32, batch_size=32, step_s=0.2,
        policy_bytes=64 * 1024, slots=8, warmup=2, threads=8,
    )  # fmt: skip
    return run_once(str(tmp_path / f"run-{workers}"), None, cfg, 0.0)


def test_requests_per_slot_do_not_grow_with_workers(tmp_path: Path) -> None:
    small, large = _sim(tmp_path, 10), _sim(tmp_path, 200)
    assert small["slots"] == large["slots"] == 6
    # every slot was fed by files of several workers, and the supply kept up
    assert small["files_per_slot"] >= 4 and large["files_per_slot"] >= 4
    # (on local disk every file event wakes the pacing check, so the counts move with the machine's load: the
    # bound is the 2x, not equality)
    assert large["bm_ops_total_per_slot"] <= 2.0 * small["bm_ops_total_per_slot"], (small, large)
    # each rollout file costs its writer a bounded number of requests, whatever N
    for r in (small, large):
        assert sum(r["worker_ops_per_file"].values()) <= 6.0


def test_waste_in_metrics_and_report_of_a_real_job(default_job: FinishedJob, tmp_path: Path) -> None:
    root = default_job.root
    trained: set[str] = set()
    wasted_rows = 0
    wasted_distinct: dict[str, set[str]] = {r: set() for r in WASTE_REASONS}
    for entry_path in sorted((root / layout.BATCH_LOG).glob("*.json")):
        import json

        entry = json.loads(entry_path.read_text())
        ids = pq.read_table(root / entry["data_file"], columns=["rollout_ids"]).column("rollout_ids")
        trained.update(pc.list_flatten(ids).to_pylist())
        if entry.get("dropped_file"):
            dropped = pq.read_table(root / entry["dropped_file"]).to_pylist()
            for row in dropped:
                if row["reason"] in WASTE_REASONS:
                    wasted_rows += 1
                    wasted_distinct[row["reason"]].add(row["rollout_id"])
    assert trained, "the job trained nothing"
    # the metric: each slot's record says how many rows it wasted and per trained row
    records = report.load_run(str(root)).metrics["batchmaker"]
    per_slot = {int(r["slot"]): r for r in records}
    assert sum(int(r["rows_wasted"]) for r in per_slot.values()) == wasted_rows
    for r in per_slot.values():
        assert r["waste_per_trained_row"] == r["rows_wasted"] / r["n_rollouts"]
    # the report's summary: distinct wasted rows per distinct trained row
    expected = sum(len(v) for v in wasted_distinct.values()) / len(trained)
    page = Path(report.build_report(str(root), str(tmp_path / "report"))).read_text()
    summary = re.search(r"<h2>Summary</h2>(.*?)</section>", page, re.S)
    assert summary is not None
    assert f"<td>{html.escape(WASTE_LABEL)}</td><td>{report.fmt(expected)}</td>" in summary.group(1)
